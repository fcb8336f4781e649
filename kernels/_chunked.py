"""XLA passes over query chunks, beside the kernels: the gradients of the arrays a score_mod closes over,
the dense attention that second-order derivatives differentiate (and that the TPU backend falls back to:
`dense_forward` / `dense_backward` / `dense_tangent`), and the tracing of hooks at every shape they will
see. Each step's working set is one [B, N, chunk, S] block."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from probjax_kernels._problem import Features, _Problem, _Tangents
from probjax_kernels._scores import LN2, LOG2E, _dropout_scale, _ScoreContext, _scores
from probjax_kernels._table_tiles import tile_class_mask_mod, tile_classes

_XLA_CHUNK_BYTES = 256 * 2**20  # working set of one query chunk


def _xla_chunk(batch: int, num_heads: int, t_pad: int, s_pad: int) -> int:
    """Query rows per step of the XLA gradient pass: a power-of-two divisor of t_pad within the budget."""
    chunk = t_pad
    while chunk > 16 and chunk % 2 == 0 and batch * num_heads * chunk * s_pad * 16 > _XLA_CHUNK_BYTES:
        chunk //= 2
    return chunk


def _prepare_hooks(features: Features, kernel_shapes: list[tuple], batch: int, num_heads: int, t_pad: int,
                   s_pad: int):
    """Traces the hooks for every shape they will see: the chosen backend's kernel tiles (`kernel_shapes`, as
    (b, h, q_idx, kv_idx, score) shapes: `_dispatch.hook_shapes`) and the XLA gradient pass."""
    spec = jax.ShapeDtypeStruct
    i32, f32 = jnp.int32, jnp.float32
    chunk = _xla_chunk(batch, num_heads, t_pad, s_pad)
    xla_shapes = ((batch, 1, 1, 1), (1, num_heads, 1, 1), (1, 1, chunk, 1), (1, 1, 1, s_pad),
                  (batch, num_heads, chunk, s_pad))
    for b, h, q_idx, kv_idx, score in [*kernel_shapes, xla_shapes]:
        indices = (spec(b, i32), spec(h, i32), spec(q_idx, i32), spec(kv_idx, i32))
        if features.score_mod is not None:
            features.score_mod.prepare(spec(score, f32), *indices)
        if features.mask_mod is not None:
            features.mask_mod.prepare(*indices)


def _chunk_context(problem: _Problem, shape: tuple[int, int, int, int], start, chunk: int, kv_len, optional: dict,
                   score_consts) -> _ScoreContext:
    """The score context of query rows [start, start + chunk) against all keys, as [B, N, chunk, S] grids.

    `shape` is (B, N, T, S) padded; bias / mask keep their broadcast axes of size 1."""
    batch, num_heads, _, s_pad = shape
    f = problem.features

    def rows(x):
        """The chunk's query rows of a [B|1, N|1, T|1, S|1] bias or mask (all of a broadcast axis)."""
        if x is None or x.shape[2] == 1:
            return x
        return lax.dynamic_slice_in_dim(x, start, chunk, axis=2)

    seg = optional.get("q_segment_ids")
    mask_consts = optional["mask_consts"]
    mask_mod = None if f.mask_mod is None else functools.partial(f.mask_mod.on_values, mask_consts)
    if mask_mod is not None and f.block_sizes is not None and not f.exact_mask_mod:
        # Tables given by hand (`from_kv_blocks`) decide the mask with mask_mod, as the kernels read them.
        mask_mod = functools.partial(tile_class_mask_mod, tile_classes(optional["kv_tables"]), f.block_sizes,
                                     mask_mod)
    return _ScoreContext(
        b=jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1),
        h=jnp.arange(num_heads, dtype=jnp.int32).reshape(1, num_heads, 1, 1),
        q_idx=(start + jnp.arange(chunk, dtype=jnp.int32)).reshape(1, 1, chunk, 1),
        kv_idx=jnp.arange(s_pad, dtype=jnp.int32).reshape(1, 1, 1, s_pad),
        kv_len=kv_len.reshape(batch, 1, 1, 1),
        bias=rows(optional.get("bias")),
        mask=rows(optional.get("mask")),
        q_seg=None if seg is None else lax.dynamic_slice_in_dim(seg, start, chunk, axis=1).reshape(
            batch, 1, chunk, 1),
        kv_seg=None if seg is None else optional["kv_segment_ids"].reshape(batch, 1, 1, s_pad),
        dropout_seed=optional.get("dropout_seed"),
        score_mod=None if f.score_mod is None else functools.partial(f.score_mod.on_values, score_consts),
        mask_mod=mask_mod,
    )


def _kv_operand(y, batch: int) -> tuple[str, jax.Array]:
    """The einsum spelling of k / v [B|1, S, K, D]: one of batch 1 is shared by the batch, not repeated."""
    return ("skd", y[0]) if y.shape[0] == 1 < batch else ("bskd", y)


def _chunk_dot(x, y, start, chunk: int, group: int, precision):
    """Rows [start, start + chunk) of x [B, T, N, D] against y [B|1, S, K, D], as [B, N, chunk, S] float32."""
    batch, _, num_heads, d_pad = x.shape
    x = lax.dynamic_slice_in_dim(x, start, chunk, axis=1).reshape(batch, chunk, num_heads // group, group, d_pad)
    spelling, y_operand = _kv_operand(y, batch)
    return jnp.einsum(f"bckgd,{spelling}->bkgcs", x, y_operand, preferred_element_type=jnp.float32,
                      precision=precision).reshape(batch, num_heads, chunk, y.shape[1])


def _with_moving(consts: tuple, moving: tuple[bool, ...], values) -> tuple:
    """`consts` with the entries flagged in `moving` replaced by `values`, in order."""
    values = iter(values)
    return tuple(next(values) if m else c for c, m in zip(consts, moving))


def _score_const_gradients(problem: _Problem, q, k, v, kv_len, do, lse2, delta, optional: dict, consts: tuple,
                           moving: tuple[bool, ...]) -> tuple:
    """d loss / d (the arrays score_mod closes over that are flagged in `moving`), by recomputing dS in XLA
    over query chunks.

    Deterministic (no atomics) and general in the hook; it costs about one more dense forward pass, with a
    working set of one query chunk: [B, N, chunk, S] floats.
    """
    batch, t_pad, num_heads, _ = q.shape
    shape = (batch, num_heads, t_pad, k.shape[1])
    chunk = _xla_chunk(*shape)

    def chunk_gradient(start):
        dot = _chunk_dot(q, k, start, chunk, problem.group, problem.precision)
        dp = _chunk_dot(do, v, start, chunk, problem.group, problem.precision)
        lse2_c = lax.dynamic_slice_in_dim(lse2, start, chunk, axis=2)[..., None]
        delta_c = lax.dynamic_slice_in_dim(delta, start, chunk, axis=2)[..., None]
        context = functools.partial(_chunk_context, problem, shape, start, chunk, kv_len, optional)
        scores = lambda m: _scores(dot, context(_with_moving(consts, moving, m)), problem, masked=True)[0]  # noqa: E731
        s2, vjp = jax.vjp(scores, moved)
        p = jnp.exp2(s2 - lse2_c)
        if problem.features.dropout_rate > 0:
            dp = dp * _dropout_scale(context(consts), problem)
        ds = p * (dp - delta_c)
        (grads,) = vjp(ds / LOG2E)  # s2 = log2(e) * score
        return grads

    def accumulate(i, total):
        return jax.tree.map(jnp.add, total, chunk_gradient(i * chunk))

    moved = tuple(c for c, m in zip(consts, moving) if m)
    zeros = tuple(jnp.zeros(c.shape, jnp.float32) for c in moved)
    total = lax.fori_loop(0, t_pad // chunk, accumulate, zeros)
    return tuple(g.astype(c.dtype) for g, c in zip(total, moved))


def _dense_attention(problem: _Problem, q, k, v, bias, score_consts, q_len, kv_len, others: dict):
    """(out, lse) like the kernels, as XLA ops over query chunks: differentiable to any order, with a working
    set of one [B, N, chunk, S] chunk (rematerialised under reverse mode). Only second-order derivatives
    (a derivative of the forward-mode tangent) run it."""
    batch, t_pad, num_heads, _ = q.shape
    dv_pad = v.shape[3]
    shape = (batch, num_heads, t_pad, k.shape[1])
    chunk = _xla_chunk(*shape)
    optional = dict(others, bias=bias)
    v_spelling, v32 = _kv_operand(v.astype(jnp.float32), batch)

    @jax.checkpoint
    def one_chunk(start):
        context = _chunk_context(problem, shape, start, chunk, kv_len, optional, score_consts)
        s2, _ = _scores(_chunk_dot(q, k, start, chunk, problem.group, problem.precision), context, problem, True)
        m = lax.stop_gradient(jnp.max(s2, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp2(s2 - m)
        l = jnp.sum(p, axis=-1, keepdims=True)
        valid = (context.q_idx < q_len.reshape(batch, 1, 1, 1)) & (l != 0)  # as in the forward kernel
        safe_l = jnp.where(valid, l, 1.0)
        weights = jnp.where(valid, p / safe_l, 0.0)
        if problem.features.dropout_rate > 0:
            weights = weights * _dropout_scale(context, problem)
        weights = weights.reshape(batch, num_heads // problem.group, problem.group, chunk, -1)
        out = jnp.einsum(f"bkgcs,{v_spelling}->bckgd", weights, v32, precision=lax.Precision.HIGHEST)
        lse = jnp.where(valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)[..., 0]
        return out.reshape(batch, chunk, num_heads, dv_pad), lse

    outs, lses = lax.map(one_chunk, jnp.arange(0, t_pad, chunk, dtype=jnp.int32))
    out = jnp.moveaxis(outs, 0, 1).reshape(batch, t_pad, num_heads, dv_pad).astype(q.dtype)
    lse = jnp.moveaxis(lses, 0, 2).reshape(batch, num_heads, t_pad)
    return out, lse


# ------------------------------------------------------------------- the XLA path of a backend's kernels


def _dense_others(optional: dict) -> dict:
    return {name: x for name, x in optional.items() if name not in ("bias", "score_consts", "d_bias",
                                                                   "d_score_consts", "q_tables")}


def dense_forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    """(out, lse) of the kernels' forward by `_dense_attention`, for calls the TPU kernels cannot take (the
    XLA path of `_dispatch`); a BlockMask's mask_mod is evaluated per element here, so its tables go unused
    (but for tables given by hand, which decide the mask with it: `_chunk_context`)."""
    if problem.features.return_max:
        raise NotImplementedError("the XLA path of the TPU backend has no max_scores output")
    return _dense_attention(problem, q, k, v, optional.get("bias"), optional["score_consts"], q_len, kv_len,
                            _dense_others(optional))


def dense_backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse) -> dict:
    """The gradients the backward kernels return (`_dispatch.backward`), by reverse mode through
    `_dense_attention`."""
    names = [name for name in ("q", "k", "v", "bias") if getattr(tangents, name)]
    others = _dense_others(res["others"])

    def dense(moving):
        args = dict(res, **moving)
        return _dense_attention(problem, args["q"], args["k"], args["v"], args["bias"], res["score_consts"],
                                res["q_len"], res["kv_len"], others)

    _, vjp = jax.vjp(dense, {name: res[name] for name in names})
    (grads,) = vjp((d_out.astype(res["out"].dtype), d_lse))
    return grads


def dense_tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, linear: dict, optional: dict):
    """(d out, d lse) of the tangent kernel (`_dispatch.tangent`), by forward mode through `_dense_attention`."""
    primals = dict(q=q, k=k, v=v, bias=optional.get("bias"), score_consts=tuple(optional["score_consts"]))
    moving = [name for name in ("q", "k", "v") if getattr(tangents, name)]
    if tangents.bias:
        moving.append("bias")
    tangent_of = dict(linear, bias=optional.get("d_bias"))
    consts_moving = tangents.score_consts

    def dense(moved, moved_consts):
        args = dict(primals, **moved)
        consts = _with_moving(primals["score_consts"], consts_moving, moved_consts)
        return _dense_attention(problem, args["q"], args["k"], args["v"], args["bias"], consts, q_len, kv_len,
                                _dense_others(optional))

    moved_consts = [c for c, m in zip(primals["score_consts"], consts_moving) if m]
    _, (d_out, d_lse) = jax.jvp(dense, ({name: primals[name] for name in moving}, moved_consts),
                                ({name: tangent_of[name] for name in moving}, list(optional["d_score_consts"])))
    return d_out, d_lse


# ------------------------------------------------- attention over query bands, for `probjax_nn.attention` off the GPU

# Imported here, not above: the lines above keep their numbers, which the compile report's fingerprints hold.
from probjax_kernels._dropout import keep_mask  # noqa: E402

# float32 scores of one step of `chunked_attention`, [B, N, chunk, S]: the threshold past which a call runs in
# checkpointed steps (below it, one block without recomputation). Measured on a 2-core CPU (B=1, N=8, D=64,
# T=512..4096, docs/benchmarks/cpu_attention.md): 4 and 16 MiB time alike (within the noise of a shared
# machine) and both beat 64 MiB, which leaves the CPU's caches; 4 MiB keeps the least memory.
CHUNK_BYTES = 4 * 2**20
MAX_BANDS = 8  # query bands of `chunked_attention`, each with its own key range (unrolled: compile time)


def chunk_plan(batch: int, num_heads: int, q_len: int, kv_len: int, chunk_bytes: int | None = None,
               skips: bool = True):
    """(bands, steps, chunk) of `chunked_attention`: `bands` x `steps` x `chunk` >= q_len query rows, in
    `bands` bands of `steps` steps of `chunk` rows; a step's scores [B, N, chunk, S] fit `chunk_bytes`
    (None: `CHUNK_BYTES`). Without `skips` (no causal or window: every row sees every key) one band: bands
    only pay where they skip keys, and one `lax.map` bounds memory where unrolled bands need not."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows = max(16, chunk_bytes // (4 * batch * num_heads * kv_len))
    chunks = -(-q_len // rows)
    bands = min(chunks, MAX_BANDS if skips else 1)
    steps = -(-chunks // bands)
    return bands, steps, -(-q_len // (bands * steps))


def _key_range(inputs, causal: bool, start: int, stop: int) -> tuple[int, int]:
    """The keys [lo, hi) that query rows [start, stop) may see through causal and the window."""
    kv_len = inputs.k.shape[1]
    left, right = inputs.window
    if causal:
        right = 0 if right is None else min(right, 0)
    hi = kv_len if right is None else max(0, min(kv_len, stop + right))
    lo = 0 if left is None else min(kv_len, max(0, start - left))
    return lo, hi


def _rows(x, axis: int, start: int, stop: int, fill):
    """Rows [start, stop) of `x` along `axis` (all of an axis of size 1), padded with `fill` past its end."""
    if x is None or x.shape[axis] == 1:
        return x
    part = lax.slice_in_dim(x, start, min(stop, x.shape[axis]), axis=axis)
    missing = stop - start - part.shape[axis]
    if missing:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, missing)
        part = jnp.pad(part, pad, constant_values=fill)
    return part


def _chunk_scores(inputs, causal: bool, compute_dtype, q, k, v, start, lo: int, hooks: dict, with_lse: bool):
    """(out [B, K, G, c, Dv], lse [B, N, c] or None) of query rows start + [0, c) against keys lo + [0, s).

    `q` [B, K, G, c, D] holds the c rows, `k` / `v` [B|1, K, s, D] the s keys (heads before positions: XLA's
    CPU dot is several times faster on this layout than on [B, T, N, D]), `hooks` the rows' slices of bias,
    mask and q segment ids (and the keys' of kv segment ids, bias, mask), score_mod, mask_mod and dropout.
    Masked scores become a large finite negative before `jax.nn.softmax` (whose derivative saves only the
    probabilities), and a row with nothing to attend gets output 0 (lse -inf) afterwards, so that its
    gradients are zero and finite."""
    batch, num_kv_heads, group, chunk, head_dim = q.shape
    num_heads, keys = num_kv_heads * group, k.shape[2]
    # k / v of batch 1 are shared by the batch, not repeated.
    spelling, k, v = ("ksd", k[0], v[0]) if k.shape[0] == 1 < batch else ("bksd", k, v)
    # The scale multiplies the c x D queries, not the c x s scores: one pass over the scores fewer.
    rows = q.reshape(batch, num_kv_heads, group * chunk, head_dim) * inputs.scale
    scores = jnp.einsum(f"bkmd,{spelling}->bkms", rows, k, preferred_element_type=compute_dtype,
                        precision=lax.Precision.HIGHEST)
    scores = scores.reshape(batch, num_heads, chunk, keys)
    if hooks["bias"] is not None:
        scores = scores + hooks["bias"].astype(compute_dtype)
    b = jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1)
    h = jnp.arange(num_heads, dtype=jnp.int32).reshape(1, num_heads, 1, 1)
    q_idx = (start + jnp.arange(chunk, dtype=jnp.int32)).reshape(1, 1, chunk, 1)
    kv_idx = (lo + jnp.arange(keys, dtype=jnp.int32)).reshape(1, 1, 1, keys)
    if hooks["score_mod"] is not None:
        scores = hooks["score_mod"](scores, b, h, q_idx, kv_idx)
    left, right = inputs.window
    if causal:
        right = 0 if right is None else min(right, 0)
    allowed = []  # rows past the end (padding of the last step) are cut off afterwards
    if right is not None:
        allowed.append(kv_idx <= q_idx + right)
    if left is not None:
        allowed.append(kv_idx >= q_idx - left)
    if inputs.q_lengths is not None:
        allowed.append(q_idx < inputs.q_lengths.reshape(batch, 1, 1, 1))
    if inputs.kv_lengths is not None:
        allowed.append(kv_idx < inputs.kv_lengths.reshape(batch, 1, 1, 1))
    if hooks["q_seg"] is not None:
        allowed.append(hooks["q_seg"][:, None, :, None] == hooks["kv_seg"][:, None, None, :])
    if hooks["mask"] is not None:
        allowed.append(hooks["mask"])
    if hooks["mask_mod"] is not None:
        allowed.append(hooks["mask_mod"](b, h, q_idx, kv_idx))
    # -0.7 of the largest float, as jax.nn.dot_product_attention: finite, and its exp underflows to 0. A score
    # of -inf (a bias or score_mod that masks) counts as masked.
    floor = -0.7 * float(jnp.finfo(compute_dtype).max)
    if hooks["bias"] is not None or hooks["score_mod"] is not None:
        allowed.append(scores > floor)
    # Causal and the window alone leave every row a key, unless the window's left edge passes the last key.
    may_empty = len(allowed) > (right is not None) + (left is not None) or (
        left is not None and inputs.q.shape[1] - 1 - left > inputs.k.shape[1] - 1)
    attends = None
    if allowed:
        allowed = functools.reduce(jnp.logical_and, allowed)
        scores = jnp.where(allowed, scores, floor)
        if may_empty:
            attends = jnp.any(allowed, axis=-1, keepdims=True)  # [B|1, N|1, c, 1]
    probs = jax.nn.softmax(scores, axis=-1)
    lse = None
    if with_lse:
        row_max = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
        lse = row_max + jnp.log(jnp.sum(jnp.exp(scores - row_max), axis=-1, keepdims=True))
        lse = lse if attends is None else jnp.where(attends, lse, -jnp.inf)
        lse = jnp.broadcast_to(lse[..., 0], (batch, num_heads, chunk))
    if hooks["dropout_rate"]:
        rate = hooks["dropout_rate"]
        keep = keep_mask(hooks["dropout_seed"], b, h, q_idx, kv_idx, rate, num_heads)
        probs = jnp.where(keep, probs / (1.0 - rate), 0.0)
    probs = probs.reshape(batch, num_kv_heads, group * chunk, keys)
    out = jnp.einsum(f"bkms,{spelling}->bkmd", probs, v, precision=lax.Precision.HIGHEST)
    out = out.reshape(batch, num_kv_heads, group, chunk, -1)
    if attends is not None:
        attends = jnp.broadcast_to(attends, (*attends.shape[:2], chunk, 1))  # a mask may broadcast over rows
        attends = attends.reshape(attends.shape[0], num_kv_heads if attends.shape[1] > 1 else 1, -1, chunk, 1)
        out = jnp.where(attends, out, 0.0)
    return out, lse


def chunked_attention(inputs, causal: bool, compute_dtype=jnp.float32, *, score_mod=None, mask_mod=None,
                      dropout_rate: float = 0.0, dropout_seed=None, return_lse: bool = False,
                      chunk_bytes: int | None = None):
    """`attention_from_inputs` (the same arguments and results: out `[B, T, N, Dv]` in q's dtype, lse
    `[B, N, T]` float32 or None without `return_lse`) as XLA ops over query bands and chunks.

    When causal or a window hides keys, the query rows split into at most `MAX_BANDS` bands, each reading only
    the keys its rows may see (a causal call computes a little over half of the scores). When the scores
    exceed `chunk_bytes` (None: `CHUNK_BYTES`), a band runs as steps of `chunk` rows under `lax.map`, each
    step under `jax.checkpoint`, so that memory stays linear in T; a call within it is one block. Plain jnp:
    every JAX transformation (grad, jvp, vmap, hessian) applies, and hooks receive gradients as in the dense
    reference."""
    batch, q_len, kv_len, num_heads, num_kv_heads, head_dim = inputs.shape
    group = num_heads // num_kv_heads
    skips = causal or inputs.window != (None, None)
    bands, steps, chunk = chunk_plan(batch, num_heads, q_len, kv_len, chunk_bytes, skips)
    # Heads before positions (see `_chunk_scores`): q [B, K, G, T, D], k and v [B|1, K, S, D].
    q = inputs.q.astype(compute_dtype).reshape(batch, q_len, num_kv_heads, group, head_dim)
    q = q.transpose(0, 2, 3, 1, 4)
    k, v = (jnp.swapaxes(x.astype(compute_dtype), 1, 2) for x in (inputs.k, inputs.v))
    seg = inputs.q_segment_ids
    outs, lses = [], []
    for band in range(bands):
        start = band * steps * chunk
        stop = min(start + steps * chunk, q_len)
        if start >= q_len:
            break
        lo, hi = _key_range(inputs, causal, start, stop)
        rows = stop - start
        if hi <= lo:  # no key in reach: output 0, lse -inf
            outs.append(jnp.zeros((batch, num_kv_heads, group, rows, inputs.value_dim), compute_dtype))
            lses.append(jnp.full((batch, num_heads, rows), -jnp.inf, jnp.float32))
            continue
        band_steps = -(-rows // chunk)
        end = start + band_steps * chunk
        keys = lambda x, axis: None if x is None else _rows(x, axis, lo, hi, 0)  # noqa: E731
        band_q = _rows(q, 3, start, end, 0)
        if outs:  # one band after another, so that XLA frees a band's scores before the next one's
            band_q = lax.optimization_barrier((band_q, outs[-1]))[0]
        band_k, band_v = keys(k, 2), keys(v, 2)
        band_bias = keys(_rows(inputs.bias, 2, start, end, 0), 3)
        band_mask = keys(_rows(inputs.mask, 2, start, end, False), 3)
        band_seg = None if seg is None else _rows(seg, 1, start, end, 0)
        kv_seg = keys(inputs.kv_segment_ids, 1)

        def step(offset, band_q=band_q, band_k=band_k, band_v=band_v, band_bias=band_bias, band_mask=band_mask,
                 band_seg=band_seg, kv_seg=kv_seg, start=start, lo=lo):
            """One chunk of `chunk` rows at `offset` in the band."""
            take = lambda x, axis: x if x is None or x.shape[axis] == 1 else lax.dynamic_slice_in_dim(  # noqa: E731
                x, offset, chunk, axis=axis)
            hooks = dict(bias=take(band_bias, 2), mask=take(band_mask, 2), q_seg=take(band_seg, 1), kv_seg=kv_seg,
                         score_mod=score_mod, mask_mod=mask_mod, dropout_rate=dropout_rate,
                         dropout_seed=dropout_seed)
            return _chunk_scores(inputs, causal, compute_dtype, take(band_q, 3), band_k, band_v, start + offset,
                                 lo, hooks, return_lse)

        if band_steps == 1:
            out, lse = (jax.checkpoint(step) if bands > 1 else step)(0)
        else:
            offsets = jnp.arange(0, band_steps * chunk, chunk, dtype=jnp.int32)
            out, lse = lax.map(jax.checkpoint(step), offsets)  # [steps, B, K, G, chunk, Dv], [steps, B, N, chunk]
            out = jnp.moveaxis(out, 0, 3).reshape(batch, num_kv_heads, group, band_steps * chunk, -1)
            lse = None if lse is None else jnp.moveaxis(lse, 0, 2).reshape(batch, num_heads, -1)
        outs.append(out[:, :, :, :rows])
        lses.append(None if lse is None else lse[:, :, :rows].astype(jnp.float32))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, -1).astype(inputs.q.dtype)
    if not return_lse:
        return out, None
    return out, lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=2)
