"""Context parallelism: attention over a sequence sharded on a mesh axis, inside `jax.shard_map`.

Each device holds L/n queries and L/n keys. The schedule visits, on device i, the key/value block of every
device j once: with `strategy="ring"` the blocks travel around the ring by `ppermute` (the send of the next
block is issued before the kernel runs on the current one, so the two overlap); with `"allgather"` they are
gathered once. A (query block, key block) pair under causal masking is fully visible, diagonal or empty;
empty pairs skip the kernel (`lax.switch` on the traced device index). The partial results merge through
their lse in float32: O = sum_j exp(lse_j - lse) O_j, lse = logsumexp_j lse_j.

Autodiff: `_ring` is a `jax.custom_jvp` whose tangent is `custom_linear` (as the kernels' own, `_autodiff.py`):
applied (`jax.jvp`), it is the forward-mode derivative of the schedule, each block through the kernels'
tangent kernel and the merge in jnp; transposed (`jax.grad`), it is the backward schedule below.

Backward: the blocks travel the ring again, each with its float32 dK / dV accumulator, which arrives home after n
sends (no atomics, one order of sums: deterministic). The flash path runs the backward kernels alone on the whole
sequence's (O, lse, dO, d lse): probabilities exp(s - lse) and delta = rowsum(dO O) are then the global ones, as
FlashAttention-2's backward on the whole sequence. Blocks with hooks or windows (the flex path) take their own
(out_j, lse_j)'s vjp under the cotangents that the merge gives them, d out_j = w_j dO and d lse_j = w_j (rowsum(dO
out_j) - delta + d lse) with w_j = exp(lse_j - lse): the kernels then see delta_j = w_j (delta - d lse) and P_j w_j
= exp(s - lse), the same gradients, at the cost of the block's forward once more. Memory: O(L/n).

Layouts: `"contiguous"` gives device i positions [i C, (i+1) C); `"zigzag"` cuts the sequence into 2n chunks
of c and gives device i chunks i and 2n-1-i, which balances causal work. Hooks, windows and causal masks see
global positions: every block maps its local indices to global ones through 0-d int32 offsets that the
wrapped hooks capture (kernel inputs, as any captured array); dropout's keep mask gets the same offsets
beside its seed (`_dropout.positional_seed`), so the same weights drop as in the unsharded call. The
schedule itself lives in `parallel/schedule.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from probjax_kernels._config import CALLBACK_INTERPRETERS, FlashConfig
from probjax_kernels._backend import config_backend
from probjax_kernels._hooks import affine_score_mod, example_indices, hook_hint, trace_hook
from probjax_kernels._inputs import check_config, check_dropout, check_inputs, check_sinks
from probjax_kernels._linear import custom_linear
from probjax_kernels._sinks import attach_sinks
from probjax_kernels.parallel.schedule import _backward, _differentiable, _forward
from probjax_kernels.parallel.schedule import _Ring as _Ring  # scripts/context_parallel_cost.py reads its schedule

Layout = Literal["contiguous", "zigzag"]
Strategy = Literal["ring", "allgather"]
LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("ring", "allgather")


def zigzag_permutation(length: int, axis_size: int) -> np.ndarray:
    """The zigzag order of `length` positions over `axis_size` devices: `x[:, p]` lays a sequence out so that
    device i's contiguous shard holds chunks i and 2n-1-i of 2n equal chunks.

    **Returns:** `p`, int32 `[length]`; `p[t]` is the original position of the token at slot t. Its inverse
    (`np.argsort(p)`) restores the original order.
    """
    if not isinstance(axis_size, int) or axis_size < 1:
        raise ValueError(f"axis_size must be an int >= 1, got {axis_size!r}.")
    if not isinstance(length, int) or length < 1 or length % (2 * axis_size):
        raise ValueError(
            f"length={length!r} must be a positive multiple of 2 * axis_size = {2 * axis_size} for the zigzag "
            "layout (2 equal chunks per device)."
        )
    chunk = length // (2 * axis_size)
    order = [np.arange(c * chunk, (c + 1) * chunk) for i in range(axis_size) for c in (i, 2 * axis_size - 1 - i)]
    return np.concatenate(order).astype(np.int32)


# ------------------------------------------------------------------------------------------------- autodiff


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ring(problem: _Ring, q, k, v, score_consts, q_seg, kv_seg, mask_consts, dropout_seed):
    return _forward(problem, q, k, v, score_consts, q_seg, kv_seg, mask_consts, dropout_seed)


def _is_zero(t) -> bool:
    return t is None or isinstance(t, jax.custom_derivatives.SymbolicZero)


@functools.partial(_ring.defjvp, symbolic_zeros=True)
def _ring_jvp(problem: _Ring, primals, tangents):
    q, k, v, score_consts, q_seg, kv_seg, mask_consts, dropout_seed = primals
    dq, dk, dv, d_consts = tangents[:4]
    # The primal through `_ring` itself, so that an outer derivative of this rule finds it.
    out, lse = _ring(problem, *primals)
    # The inputs with a tangent: q, k, v, then the differentiable arrays score_mod captures (in order).
    inputs = (q, k, v, *score_consts)
    d_inputs = (dq, dk, dv, *d_consts)
    moving = tuple(i < 3 or _differentiable(c) for i, c in enumerate(inputs))
    moving = tuple(m and not _is_zero(t) for m, t in zip(moving, d_inputs))
    if not any(moving):
        return (out, lse), (jnp.zeros_like(out), jnp.zeros_like(lse))
    residuals = dict(q=q, k=k, v=v, score_consts=score_consts, q_seg=q_seg, kv_seg=kv_seg, mask_consts=mask_consts,
                     dropout_seed=dropout_seed, out=out, lse=lse)
    res_flat, res_tree = jax.tree.flatten(residuals)
    lin_flat = [t for t, m in zip(d_inputs, moving) if m]
    unflatten = functools.partial(jax.tree.unflatten, res_tree)

    def tangent_map(backend: str):
        """The tangent of (out, lse) by jax.jvp of the schedule; `backend` runs its blocks."""
        def apply(res_flat, lin_flat):
            res = unflatten(res_flat)
            blocks = problem if backend == problem.backend else _with_backend(problem, backend)
            primal = (res["q"], res["k"], res["v"], *res["score_consts"])
            lin = iter(lin_flat)
            tangent = [next(lin) if m else jnp.zeros_like(x) for x, m in zip(primal, moving)]
            position = [i for i, x in enumerate(primal) if i < 3 or _differentiable(x)]

            def schedule(*moved):
                full = list(primal)
                for i, x in zip(position, moved):
                    full[i] = x
                return _forward(blocks, *full[:3], tuple(full[3:]), res["q_seg"], res["kv_seg"],
                                res["mask_consts"], res["dropout_seed"])

            _, (d_out, d_lse) = jax.jvp(schedule, [primal[i] for i in position], [tangent[i] for i in position])
            return [d_out, d_lse]

        return apply

    def transpose(res_flat, cotangents):
        res = unflatten(res_flat)
        order = ("q", "k", "v", "score_consts", "q_seg", "kv_seg", "mask_consts", "dropout_seed", "out", "lse")
        dq, dk, dv, d_consts, *_ = _backward(problem, tuple(res[name] for name in order), tuple(cotangents))
        return [g for g, m in zip((dq, dk, dv, *d_consts), moving) if m]

    specs = [jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(lse.shape, lse.dtype)]
    # Derivatives in the residuals (second order) take the plain-jnp blocks, differentiable to any order.
    d_out, d_lse = custom_linear(tangent_map(problem.backend), transpose, tangent_map("reference"), res_flat,
                                 lin_flat, specs, interpreted=_kernel_backend(problem.config) in CALLBACK_INTERPRETERS)
    return (out, lse), (d_out, d_lse)


def _kernel_backend(config: FlashConfig | None) -> str:
    return config_backend(config)


def _interpreter_cannot_run(config: FlashConfig | None, varying: bool) -> bool:
    """Whether this call's kernels run in a CPU interpreter that cannot run as the ring's blocks, which then
    take the plain-jnp path (the same numbers). Pallas' TPU interpreter simulates one chip per process: its
    callbacks from several host devices beside the ring's collective-permutes deadlock. jax 0.11.2's GPU
    interpreters cannot run under shard_map's varying-axes checks (`varying`: they replay the kernel body on
    varying types, whose loops start from unvarying constants); check_vma=False runs them."""
    backend = _kernel_backend(config)
    return backend == "tpu_interpret" or (varying and backend in ("interpret", "mosaic_interpret"))


def _with_backend(problem: _Ring, backend: str) -> _Ring:
    return dataclasses.replace(problem, backend=backend)


# ---------------------------------------------------------------------------------------------- entry point


def _trace(name: str, fn: Callable | None, with_score: bool):
    """(Hook, the arrays it captures) of a user hook."""
    if fn is None:
        return None, ()
    indices = example_indices()
    args = (jnp.zeros((16, 16), jnp.float32), *indices) if with_score else indices
    with hook_hint(name):
        hook, consts, _ = trace_hook(name, fn, args)
    return hook, tuple(consts)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: str,
    layout: Layout = "contiguous",
    strategy: Strategy = "ring",
    causal: bool = False,
    scale: float | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | int | None = None,
    return_lse: bool = False,
    config: FlashConfig | None = None,
    sinks: jax.Array | None = None,
    _backend: str = "kernel", _dropout_shard: tuple | None = None,
):
    """Attention over a sequence sharded on mesh axis `axis_name`; call it inside `jax.shard_map`.

    The result is that of `flash_attention` (or `flex_attention` with the hooks) on the gathered arrays, in
    forward and in gradients of q, k, v and of the arrays score_mod captures.

    **Arguments:**

    - `q` `[B, T, N, D]`, `k` `[B, S, K, D]`, `v` `[B, S, K, Dv]`: this device's shard of the sequence axis
      (N a multiple of K; Dv may differ from D, as in `flash_attention`). With `causal`, T == S.
    - `axis_name`: the mesh axis the sequence is split over (n devices).
    - `layout`: `"contiguous"` (device i holds positions [i T, (i+1) T)) or `"zigzag"` (the sequence in 2n
      chunks, device i holding chunks i and 2n-1-i; lay tokens out with `zigzag_permutation`). T and S
      must be even for zigzag.
    - `strategy`: `"ring"` (K/V blocks travel by ppermute; O(L/n) memory) or `"allgather"` (K/V gathered
      once; their gradients reduce-scattered home).
    - `causal`, `scale` (a traced 0-d array multiplies the float32 scores), `window`, `q_segment_ids`
      `[B, T]`, `kv_segment_ids` `[B, S]` (this device's shards): as in `flash_attention`, on global
      positions.
    - `score_mod(score, b, h, q_idx, kv_idx)`, `mask_mod(b, h, q_idx, kv_idx)`: as in `flex_attention`,
      called with global positions (the original ones under zigzag) and the local batch index.
    - `dropout_rate`, `dropout_seed`: attention dropout with the keep mask of the unsharded call (the kernels
      hash global positions: the same weights drop as in `flash_attention` on the gathered arrays).
    - `return_lse`: also return lse `[B, N, T]` float32; `config`: the kernels' `FlashConfig`.
    - `sinks`: None or `[N]` float (this device's heads), attention-sink logits as in `flash_attention`.

    **Returns:** out `[B, T, N, Dv]` in q's dtype (this device's queries), or `(out, lse)`. Differentiable in
    reverse and forward mode (`jax.grad`, `jax.jvp`) in q, k, v, sinks, a traced scale and score_mod's arrays.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}.")
    check_config(config)
    inputs = check_inputs(q, k, v, scale=scale, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                          window=window, dropout_rate=dropout_rate)
    dropout_seed, sinks = check_dropout(dropout_rate, dropout_seed), check_sinks(sinks, inputs.q.shape[2])
    q, scale = inputs.q, inputs.scale
    if inputs.traced_scale:
        # The schedule's static description takes a float: a traced scale multiplies the float32 scores
        # through a score_mod, as in flash_attention (folded into q it would be rounded to q's dtype).
        score_mod, scale = affine_score_mod(scale, score_mod=score_mod), 1.0
    shard_q, shard_kv = q.shape[1], inputs.k.shape[1]
    if causal and shard_q != shard_kv:
        raise ValueError(f"causal ring_attention needs equal query and key shards, got T={shard_q}, S={shard_kv}.")
    if layout == "zigzag" and (shard_q % 2 or shard_kv % 2):
        raise ValueError(
            f"layout='zigzag' needs even shards (2 chunks per device), got T={shard_q}, S={shard_kv}: the "
            f"sequence length must be a multiple of 2 * the size of axis {axis_name!r}."
        )
    if _backend == "kernel" and _interpreter_cannot_run(config, axis_name in jax.typeof(q).manual_axis_type.varying):
        _backend = "reference"
    score_hook, score_consts = _trace("score_mod", score_mod, with_score=True)
    mask_hook, mask_consts = _trace("mask_mod", mask_mod, with_score=False)
    problem = _Ring(
        axis_name=axis_name, layout=layout, strategy=strategy, causal=bool(causal), scale=scale,
        window=inputs.window, has_segments=inputs.q_segment_ids is not None, score_mod=score_hook,
        mask_mod=mask_hook, config=config, backend=_backend, dropout_rate=float(dropout_rate),
        dropout_heads=None if _dropout_shard is None or not dropout_rate else _dropout_shard[2],
    )
    if problem.dropout_heads is not None:  # (seed, batch offset, head offset): see `_Ring.dropout_heads`
        parts = (dropout_seed, *_dropout_shard[:2])
        dropout_seed = jnp.stack([jnp.asarray(x).astype(jnp.uint32).reshape(()) for x in parts])
    out, lse = _ring(problem, q, inputs.k, inputs.v, score_consts, inputs.q_segment_ids,
                     inputs.kv_segment_ids, mask_consts, dropout_seed)
    out, lse = attach_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out
