"""The schedule of `ring_attention` (see `parallel/ring.py`): where a device's rows sit in the whole sequence, which
(query block, key block) pairs a device visits, the kernel call of one pair, and the forward and backward
passes over all pairs (ring by `ppermute`, or all-gather), merged through their lse in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from probjax_kernels._config import FlashConfig
from probjax_kernels._flash_attention import flash_attention
from probjax_kernels._hooks import Hook
from probjax_kernels._inputs import check_inputs
from probjax_kernels._reference import attention_from_inputs
from probjax_kernels.flex.attention import flex_attention
from probjax_kernels.flex.block_mask import DEFAULT_BLOCK_SIZE, create_block_mask

# ------------------------------------------------------------------------------------------------ positions


@dataclasses.dataclass(frozen=True)
class _Slice:
    """Local rows [lo, hi) of a device's shard."""

    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class _Positions:
    """Global position of local index x (0 at the slice's start): x + first below `split`, x - split + second
    from there on. `first` and `second` are traced int32 scalars (they depend on the device index)."""

    split: int
    first: jax.Array
    second: jax.Array

    def __call__(self, x):
        return jnp.where(x < self.split, x + self.first, x - self.split + self.second)

    def bounds(self, length: int):
        """(min, max) global position of the slice's `length` rows."""
        ends = [self.first, self.first + min(self.split, length) - 1]
        if length > self.split:
            ends += [self.second, self.second + length - self.split - 1]
        return functools.reduce(jnp.minimum, ends), functools.reduce(jnp.maximum, ends)


def _positions(layout: str, device, shard: int, num_devices: int, part: _Slice) -> _Positions:
    """Where the rows `part` of `device`'s shard (of `shard` rows) sit in the whole sequence."""
    device = jnp.asarray(device, jnp.int32)
    if layout == "contiguous":
        start = device * shard + part.lo
        return _Positions(part.hi - part.lo, start, start + part.hi - part.lo)
    chunk = shard // 2
    chunk_starts = (device * chunk, (2 * num_devices - 1 - device) * chunk)
    if part.lo >= chunk:
        start = chunk_starts[1] + part.lo - chunk
        return _Positions(part.hi - part.lo, start, start + part.hi - part.lo)
    if part.hi <= chunk:
        start = chunk_starts[0] + part.lo
        return _Positions(part.hi - part.lo, start, start + part.hi - part.lo)
    return _Positions(chunk - part.lo, chunk_starts[0] + part.lo, chunk_starts[1])


# ----------------------------------------------------------------------------------------------- the problem


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static description of one ring_attention call (the nondiff argument of `parallel/ring.py`'s custom_jvp)."""

    axis_name: str
    layout: str
    strategy: str
    causal: bool
    scale: float
    window: tuple[int | None, int | None]
    has_segments: bool
    score_mod: Hook | None
    mask_mod: Hook | None
    config: FlashConfig | None
    backend: str  # "kernel": the flash / flex kernels; "reference": plain jnp (probjax_nn's impl="xla")
    dropout_rate: float = 0.0
    # The whole attention's head count when the caller shards the batch / heads too: the dropout input is
    # then (seed, batch offset, head offset) uint32 [3] (`ring_attention`'s `_dropout_shard`).
    dropout_heads: int | None = None

    @property
    def positional(self) -> bool:
        """Whether a block needs global positions beyond the causal diagonal (hooks or a window)."""
        return self.score_mod is not None or self.mask_mod is not None or self.window != (None, None)

    def blocks(self, shard_q: int, shard_kv: int) -> tuple[tuple[_Slice, _Slice, bool], ...]:
        """The kinds of (query rows, key rows, causal on local indices) pairs; index 0 of the schedule's
        `lax.switch` is the empty pair, kind k its branch k + 1 (see `kind`)."""
        whole_q, whole_kv = _Slice(0, shard_q), _Slice(0, shard_kv)
        if not self.causal:
            return ((whole_q, whole_kv, False),)
        if self.layout == "contiguous":
            return ((whole_q, whole_kv, True), (whole_q, whole_kv, False))
        half = shard_q // 2
        # Chunks of j < i: the first is before both of device i's chunks, the second after them; for
        # j > i only device i's second chunk sees device j's (both of them).
        return ((whole_q, whole_kv, True), (whole_q, _Slice(0, half), False),
                (_Slice(half, shard_q), whole_kv, False))

    def kind(self, i, j):
        """The branch of `lax.switch` for device i's queries against device j's keys (0: nothing visible)."""
        if not self.causal:
            return jnp.int32(1)
        if self.layout == "contiguous":
            return jnp.where(i == j, 1, jnp.where(j < i, 2, 0)).astype(jnp.int32)
        return jnp.where(i == j, 1, jnp.where(j < i, 2, 3)).astype(jnp.int32)


def _allowed(problem: _Ring, q_pos: _Positions, kv_pos: _Positions, segments, mask_consts):
    """The mask_mod of one block on local indices: causal, window and the user's mask_mod on global
    positions, segment ids on local ones."""
    left, right = problem.window
    if problem.causal:
        right = 0 if right is None else min(right, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        gq, gk = q_pos(q_idx), kv_pos(kv_idx)
        allowed = (gq >= 0) & (gk >= 0)
        if right is not None:
            allowed &= gk <= gq + right
        if left is not None:
            allowed &= gk >= gq - left
        if segments is not None:
            q_seg, kv_seg = segments
            allowed &= q_seg[b, q_idx] == kv_seg[b, kv_idx]
        if problem.mask_mod is not None:
            allowed &= _call_hook(problem.mask_mod, mask_consts, b, h, gq, gk)
        return allowed

    return mask_mod


def _call_hook(hook: Hook, consts, *args):
    """The user's hook at these argument shapes, its captured arrays replaced by `consts`."""
    varying = _vma_union(*args)
    if not varying:
        hook.prepare(*(jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args))
        return hook.on_values(consts, *args)
    # Global positions vary over the mesh axes (shard_map's varying-axes checks): the hook is traced at those
    # types, so that jnp's casts of its unvarying captured arrays are in the jaxpr it replays.
    key = ("varying", varying, tuple((jnp.shape(a), jnp.result_type(a)) for a in args))
    if key not in hook.jaxprs:
        closed = jax.make_jaxpr(hook.fn)(*args)  # at the arguments' types, varying axes included
        if tuple((tuple(jnp.shape(c)), jnp.result_type(c)) for c in closed.consts) != hook.const_avals:
            raise ValueError(f"{hook.name} closes over different arrays under shard_map; create its arrays "
                             "outside the function and close over them.")
        hook.jaxprs[key] = closed.jaxpr
    (result,) = _replay(hook.jaxprs[key], list(consts), list(args))
    return result


def _replay(jaxpr, consts: list, args: list) -> list:
    """Evaluates a hook's jaxpr; its casts (`pvary`) of captured arrays that already vary are skipped, and
    operands of one equation are cast to the axes any of them varies over. The
    backward pass hands the hook varying copies of its arrays (`_backward`), so that their gradients need no
    psum inside the schedule's device-dependent `lax.switch` (a collective there would deadlock)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "pvary" and all(set(eqn.params["axes"]) <= jax.typeof(x).manual_axis_type.varying for x in invals):
            outvals = invals
        elif name in ("pjit", "jit", "closed_call"):
            inner = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
            outvals = _replay(inner.jaxpr, list(inner.consts), invals)
        else:
            # An array that varies where the trace saw it unvarying: cast the others as jnp would have.
            axes = _vma_union(*invals)
            invals = [_pvary(x, axes) if isinstance(x, jax.Array) else x for x in invals]
            with eqn.ctx.manager:
                outvals = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outvals = outvals if eqn.primitive.multiple_results else [outvals]
        env.update(zip(eqn.outvars, outvals))
    return [read(v) for v in jaxpr.outvars]


def _block(problem: _Ring, q, k, v, segments, consts, q_pos, kv_pos, causal_local: bool):
    """(out in q's dtype, lse float32 `[B, N, Tq]`) of one (query block, key block) pair; `consts` are
    (score_mod's arrays, mask_mod's arrays, the dropout seed)."""
    score_consts, mask_consts, dropout_seed = consts
    dropout = _dropout_args(problem, dropout_seed, q_pos, kv_pos)
    mask_mod = _allowed(problem, q_pos, kv_pos, segments, mask_consts)
    score_mod = None
    if problem.score_mod is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return _call_hook(problem.score_mod, score_consts, score, b, h, q_pos(q_idx), kv_pos(kv_idx))

    if problem.backend == "reference":
        inputs = check_inputs(q, k, v, scale=problem.scale)
        return attention_from_inputs(inputs, False, jnp.float32, score_mod=score_mod, mask_mod=mask_mod, **dropout)
    if not problem.positional:
        seg = dict(q_segment_ids=segments[0], kv_segment_ids=segments[1]) if segments is not None else {}
        return flash_attention(q, k, v, causal=causal_local, scale=problem.scale, return_lse=True,
                               config=problem.config, **seg, **dropout)
    batch, q_len, num_heads, _ = q.shape
    kv_len = k.shape[1]
    per_batch = segments is not None or problem.mask_mod is not None
    block_mask = create_block_mask(
        mask_mod, batch if per_batch else None, num_heads if problem.mask_mod is not None else None,
        q_len, kv_len, block_size=_table_tile(problem.config, q_len, kv_len),
    )
    return flex_attention(q, k, v, score_mod, block_mask, scale=problem.scale, enable_gqa=True, return_lse=True,
                          config=problem.config, **dropout)


def _dropout_args(problem: _Ring, seed, q_pos: _Positions, kv_pos: _Positions) -> dict:
    """The dropout arguments of one block's call: the keep mask on global positions."""
    if not problem.dropout_rate:
        return {}
    positions = tuple((p.split, p.first, p.second) for p in (q_pos, kv_pos))
    prefix = "" if problem.backend == "reference" else "_"
    shard = None
    if problem.dropout_heads is not None:
        seed, shard = seed[0], (seed[1], seed[2], problem.dropout_heads)
    return {"dropout_rate": problem.dropout_rate, "dropout_seed": seed, f"{prefix}dropout_positions": positions,
            f"{prefix}dropout_shard": shard}


def _table_tile(config: FlashConfig | None, q_len: int, kv_len: int) -> tuple[int, int]:
    """The block mask's tile: the config's, else the default capped at the block (no padding beyond it)."""
    if config is not None and config.block_q is not None and config.block_k is not None:
        return config.block_q, config.block_k
    fit = lambda n: min(DEFAULT_BLOCK_SIZE, max(16, 1 << (n - 1).bit_length()))  # noqa: E731
    return fit(q_len), fit(kv_len)


def _visible(problem: _Ring, q_pos: _Positions, kv_pos: _Positions, q_len: int, kv_len: int, segments):
    """False when no pair of the block can attend (a window or disjoint segment-id ranges); a cheap test
    that may say True for an empty block, never False for a visible one."""
    visible = jnp.bool_(True)
    left, right = problem.window
    q_min, q_max = q_pos.bounds(q_len)
    kv_min, kv_max = kv_pos.bounds(kv_len)
    if left is not None:
        visible &= kv_max >= q_min - left
    if right is not None:
        visible &= kv_min <= q_max + right
    if segments is not None:
        q_seg, kv_seg = segments
        visible &= (jnp.min(q_seg) <= jnp.max(kv_seg)) & (jnp.min(kv_seg) <= jnp.max(q_seg))
    return visible


# ------------------------------------------------------------------------------------------- the schedule


def _merge(out, lse, out_b, lse_b):
    """Online merge of two partial results (out `[B, T, N, D]` float32, lse `[B, N, T]`); -inf rows stay.
    Written so that no derivative meets exp(-inf - -inf) (forward mode differentiates it)."""
    top = jnp.maximum(lse, lse_b)
    finite = jnp.isfinite(top)
    safe_top = jnp.where(finite, top, 0.0)

    def relative(x):  # exp(x - top), 0 where x = -inf
        seen = jnp.isfinite(x)
        return jnp.where(seen, jnp.exp(jnp.where(seen, x, safe_top) - safe_top), 0.0)

    w, w_b = relative(lse), relative(lse_b)
    total = jnp.where(finite, w + w_b, 1.0)
    weight = lambda w: jnp.swapaxes(w / total, 1, 2)[..., None]  # noqa: E731
    new = jnp.where(finite, safe_top + jnp.log(total), -jnp.inf)
    return out * weight(w) + out_b.astype(jnp.float32) * weight(w_b), new


def _vma_union(*xs):
    """The mesh axes any of xs varies over (inside shard_map with its varying-axes checks; else none)."""
    return tuple(sorted(set().union(*(jax.typeof(x).manual_axis_type.varying for x in xs))))


def _pvary(x, axes):
    """x marked as varying over `axes`: lax.switch / cond / fori_loop need one type in every branch."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _source(step, i, n):
    """The device whose keys device i holds at `step` (blocks move one device forward per step)."""
    return (i - step) % n


def _send(tree, axis_name: str, n: int):
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, [(d, (d + 1) % n) for d in range(n)]), tree)


def _gathered(problem: _Ring, kv: dict):
    """K/V (and kv segment ids) of every device, `[B, n * S, ...]`, gathered once."""
    return jax.tree.map(lambda x: lax.all_gather(x, problem.axis_name, axis=1, tiled=True), kv)


def _take(gathered: dict, j, shard_kv: int):
    return jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, j * shard_kv, shard_kv, axis=1), gathered)


def _schedule_pair(problem: _Ring, q, kv, q_seg, i, j, n, compute, empty):
    """`compute(q_part, kv_part, causal_local, q_pos, kv_pos, segments)` for the kind of pair that device
    i's queries make with device j's keys, or `empty()` where nothing is visible (no kernel runs)."""
    shard_q, shard_kv = q.shape[1], kv["k"].shape[1]

    def branch(q_part, kv_part, causal_local):
        def run():
            q_pos = _positions(problem.layout, i, shard_q, n, q_part)
            kv_pos = _positions(problem.layout, j, shard_kv, n, kv_part)
            segments = None
            if problem.has_segments:
                segments = (q_seg[:, q_part.lo:q_part.hi], kv["seg"][:, kv_part.lo:kv_part.hi])
            visible = _visible(problem, q_pos, kv_pos, q_part.hi - q_part.lo, kv_part.hi - kv_part.lo, segments)
            pair = functools.partial(compute, q_part, kv_part, causal_local, q_pos, kv_pos, segments)
            return lax.cond(visible, pair, empty)

        return run

    branches = [empty] + [branch(*kind) for kind in problem.blocks(shard_q, shard_kv)]
    return lax.switch(problem.kind(i, j), branches)


def _block_forward(problem: _Ring, q, kv, q_seg, consts, i, j, n):
    """(out float32 `[B, T, N, D]`, lse `[B, N, T]`) of device i's queries against device j's keys, padded
    to the whole shard; zeros and -inf where nothing is visible."""
    varying = _vma_union(q, kv["k"])
    batch, shard_q, num_heads, _ = q.shape
    value_dim = kv["v"].shape[3]

    def empty():
        return (_pvary(jnp.zeros((batch, shard_q, num_heads, value_dim), jnp.float32), varying),
                _pvary(jnp.full((batch, num_heads, shard_q), -jnp.inf, jnp.float32), varying))

    def compute(q_part, kv_part, causal_local, q_pos, kv_pos, segments):
        rows, keys = slice(q_part.lo, q_part.hi), slice(kv_part.lo, kv_part.hi)
        out, lse = _block(problem, q[:, rows], kv["k"][:, keys], kv["v"][:, keys], segments, consts, q_pos,
                          kv_pos, causal_local)
        padding = (q_part.lo, shard_q - q_part.hi)
        out = jnp.pad(out.astype(jnp.float32), ((0, 0), padding, (0, 0), (0, 0)))
        lse = jnp.pad(lse, ((0, 0), (0, 0), padding), constant_values=-jnp.inf)
        return _pvary(out, varying), _pvary(lse, varying)

    return _schedule_pair(problem, q, kv, q_seg, i, j, n, compute, empty)


def _forward(problem: _Ring, q, k, v, score_consts, q_seg, kv_seg, mask_consts, dropout_seed):
    """(out in q's dtype, lse float32 `[B, N, T]`) of the whole schedule, on one device's shard."""
    n, i = lax.axis_size(problem.axis_name), lax.axis_index(problem.axis_name)
    kv = {"k": k, "v": v, **({"seg": kv_seg} if problem.has_segments else {})}
    consts = (score_consts, mask_consts, dropout_seed)
    batch, shard_q, num_heads, _ = q.shape
    varying = _vma_union(q, k)
    out = _pvary(jnp.zeros((batch, shard_q, num_heads, v.shape[3]), jnp.float32), varying)
    lse = _pvary(jnp.full((batch, num_heads, shard_q), -jnp.inf, jnp.float32), varying)
    if problem.strategy == "ring":
        def step(s, carry):
            kv, out, lse = carry
            incoming = _send(kv, problem.axis_name, n)  # in flight while the kernel runs on `kv`
            out_b, lse_b = _block_forward(problem, q, kv, q_seg, consts, i, _source(s, i, n), n)
            return (incoming, *_merge(out, lse, out_b, lse_b))

        _, out, lse = lax.fori_loop(0, n, step, (kv, out, lse))
    else:
        gathered = _gathered(problem, kv)

        def step(j, carry):
            out_b, lse_b = _block_forward(problem, q, _take(gathered, j, k.shape[1]), q_seg, consts, i, j, n)
            return _merge(*carry, out_b, lse_b)

        out, lse = lax.fori_loop(0, n, step, (out, lse))
    return out.astype(q.dtype), lse


# ------------------------------------------------------------------------------------------------ backward


def _block_backward(problem: _Ring, q, kv, q_seg, consts, i, j, n, cot):
    """(dq float32 `[B, T, N, D]`, dk, dv float32 `[B, S, K, D]`, d score consts) of one pair, through
    the block's own vjp with the cotangents of the merge (module docstring); zeros where nothing is visible."""
    out, d_out, d_lse, lse, delta = cot
    shard_q, shard_kv = q.shape[1], kv["k"].shape[1]
    score_consts, mask_consts, dropout_seed = consts
    varying = _vma_union(q, kv["k"], d_out)

    def zeros():
        z = lambda x: _pvary(jnp.zeros(x.shape, jnp.float32), varying)  # noqa: E731
        return z(q), z(kv["k"]), z(kv["v"]), tuple(_pvary(jnp.zeros(c.shape, c.dtype), varying)
                                                    for c in score_consts if _differentiable(c))

    def compute(q_part, kv_part, causal_local, q_pos, kv_pos, segments):
        rows, keys = slice(q_part.lo, q_part.hi), slice(kv_part.lo, kv_part.hi)

        def block(q, k, v, moving):
            return _block(problem, q, k, v, segments, (_with_moving(score_consts, moving), mask_consts,
                                                        dropout_seed), q_pos, kv_pos, causal_local)

        moving = tuple(c for c in score_consts if _differentiable(c))
        if problem.backend == "kernel" and not problem.positional:
            # The backward kernels alone, on the whole sequence's out and lse: no block forward to recompute.
            grads = flash_attention(
                q[:, rows], kv["k"][:, keys], kv["v"][:, keys], causal=causal_local, scale=problem.scale,
                config=problem.config, **_dropout_args(problem, dropout_seed, q_pos, kv_pos),
                **({} if segments is None else dict(q_segment_ids=segments[0], kv_segment_ids=segments[1])),
                _cotangents=(out[:, rows], lse[:, :, rows], d_out[:, rows], d_lse[:, :, rows]),
            )
            return _padded_grads(grads, q_part, kv_part, shard_q, shard_kv, varying) + ((),)
        (out_b, lse_b), vjp = jax.vjp(block, q[:, rows], kv["k"][:, keys], kv["v"][:, keys], moving)
        row_lse = lse[:, :, rows]
        row_d_out = d_out[:, rows].astype(jnp.float32)
        finite = jnp.isfinite(lse_b) & jnp.isfinite(row_lse)
        weight = jnp.where(finite, jnp.exp(lse_b - jnp.where(finite, row_lse, 0.0)), 0.0)  # w_j `[B, N, Tq]`
        d_out_b = row_d_out * jnp.swapaxes(weight, 1, 2)[..., None]
        own = jnp.einsum("btnd,btnd->bnt", row_d_out, out_b.astype(jnp.float32))
        d_lse_b = weight * (own - delta[:, :, rows] + d_lse[:, :, rows])
        dq, dk, dv, d_consts = vjp((d_out_b.astype(out_b.dtype), d_lse_b))
        return _padded_grads((dq, dk, dv), q_part, kv_part, shard_q, shard_kv, varying) + (tuple(d_consts),)

    return _schedule_pair(problem, q, kv, q_seg, i, j, n, compute, zeros)


def _padded_grads(grads, q_part: _Slice, kv_part: _Slice, shard_q: int, shard_kv: int, varying) -> tuple:
    """A block's (dq, dk, dv) in float32, zero-padded from its rows to the whole shards."""
    dq, dk, dv = grads
    dq = jnp.pad(dq.astype(jnp.float32), ((0, 0), (q_part.lo, shard_q - q_part.hi), (0, 0), (0, 0)))
    pad_kv = ((0, 0), (kv_part.lo, shard_kv - kv_part.hi), (0, 0), (0, 0))
    dk, dv = (jnp.pad(x.astype(jnp.float32), pad_kv) for x in (dk, dv))
    return _pvary(dq, varying), _pvary(dk, varying), _pvary(dv, varying)


def _backward(problem: _Ring, res, cotangents):
    q, k, v, score_consts, q_seg, kv_seg, mask_consts, dropout_seed, out, lse = res
    d_out, d_lse = cotangents
    n, i = lax.axis_size(problem.axis_name), lax.axis_index(problem.axis_name)
    delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)
    cot = (out, d_out, d_lse, lse, delta)
    varying = _vma_union(q, k, d_out)
    # Varying copies of score_mod's arrays: their gradients then stay per device inside the schedule, and the
    # psum over the axis comes once, at the end.
    consts = (tuple(_pvary(c, varying) if _differentiable(c) else c for c in score_consts), mask_consts,
              dropout_seed)
    dq = _pvary(jnp.zeros(q.shape, jnp.float32), varying)
    d_consts = tuple(_pvary(jnp.zeros(c.shape, c.dtype), varying) for c in score_consts if _differentiable(c))
    kv = {"k": k, "v": v, **({"seg": kv_seg} if problem.has_segments else {})}
    add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
    if problem.strategy == "ring":
        def step(s, carry):
            kv, dkv, dq, d_consts = carry
            incoming = _send(kv, problem.axis_name, n)
            dq_b, dk_b, dv_b, dc_b = _block_backward(problem, q, kv, q_seg, consts, i, _source(s, i, n),
                                                     n, cot)
            dkv = _send(add(dkv, (dk_b, dv_b)), problem.axis_name, n)  # home after n sends
            return incoming, dkv, dq + dq_b, add(d_consts, dc_b)

        dkv = tuple(_pvary(jnp.zeros(x.shape, jnp.float32), varying) for x in (k, v))
        _, (dk, dv), dq, d_consts = lax.fori_loop(0, n, step, (kv, dkv, dq, d_consts))
    else:
        gathered = _gathered(problem, kv)
        shard_kv = k.shape[1]

        def step(j, carry):
            dkv, dq, d_consts = carry
            dq_b, dk_b, dv_b, dc_b = _block_backward(problem, q, _take(gathered, j, shard_kv), q_seg, consts,
                                                     i, j, n, cot)
            dkv = tuple(lax.dynamic_update_slice_in_dim(acc, lax.dynamic_slice_in_dim(acc, j * shard_kv, shard_kv, 1)
                                                        + d, j * shard_kv, axis=1)
                        for acc, d in zip(dkv, (dk_b, dv_b)))
            return dkv, dq + dq_b, add(d_consts, dc_b)

        dkv = tuple(jnp.zeros(x.shape, jnp.float32) for x in (gathered["k"], gathered["v"]))
        dkv = tuple(_pvary(x, varying) for x in dkv)
        dkv, dq, d_consts = lax.fori_loop(0, n, step, (dkv, dq, d_consts))
        dk, dv = (lax.psum_scatter(x, problem.axis_name, scatter_dimension=1, tiled=True) for x in dkv)
    # Every captured array's gradient stays this device's part: `custom_linear` cast the tangents of arrays
    # that do not vary over the axis to varying ones, and JAX transposes that cast into the psum (without
    # vma tracking, check_vma=False, shard_map sums the cotangents of its replicated inputs itself).
    d_moving = iter(d_consts)
    d_consts = tuple(next(d_moving) if _differentiable(c) else None for c in score_consts)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_consts, None, None, None, None)


def _differentiable(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _with_moving(consts, moving):
    """`consts` with its differentiable entries replaced, in order, by `moving`."""
    it = iter(moving)
    return tuple(next(it) if _differentiable(c) else c for c in consts)
