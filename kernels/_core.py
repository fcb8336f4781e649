"""The attention kernel core shared by `flash_attention` and `flex_attention`: Pallas forward, dQ and dK/dV
kernels (FlashAttention-2), a forward-mode tangent kernel, and the dispatch to the Mosaic GPU kernels.
`_autodiff.py` puts them under one `jax.custom_jvp` and holds the entry point `attention`;
`_chunked.py` holds the XLA passes over query chunks (see docs/forward_mode.md).

Notation (FlashAttention-2, Alg. 1 and 2): per query row, m_i is the running max of the scores and l_i the
running sum of exp(s - m_i); lse = m + log l. Scores are kept in the base-2 domain inside the kernels
(s2 = s * log2(e)) so that every exponential is an exp2; without hooks, log2(e) is folded into the scale.

`attention` pads T, S to a multiple of the tiles and D to a power of two (Triton needs power-of-two tiles)
and masks the padding through the key/query lengths, so callers never pad. Which (query, key) pairs attend
is decided per element by: key lengths, a causal / local window, segment ids, a dense bool mask, and a
user `mask_mod`. Which tiles are visited is decided either by index ranges (windows and lengths) or by the
block tables of a `BlockMask`; tiles that every pair reaches skip the per-element mask. Query rows past
`q_lengths` (and fully masked rows) give output 0 and lse -inf; the backward pass sees them as lse = +inf,
hence p = 0 and exactly zero gradients. A `score_mod` rewrites the scaled score per element before
masking; its derivative in the score comes from `jax.jvp` inside the backward kernels, and the gradients
of the arrays it closes over from an XLA pass over query chunks (deterministic, no atomics).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.pallas.mosaic_gpu import core as mosaic_gpu_core  # the Mosaic GPU lowering rules, to vet hooks
from jax._src.pallas.mosaic_gpu import lowering as mosaic_lowering
from jax.experimental import pallas as pl
# Pallas' interpret-mode lowering imports the fuser on first use, and the fuser registers a config value that
# is part of the tracing context: imported mid-way, it makes every `jit` that traced before it retrace once.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401
from jax.extend import core as jex_core

from probjax_kernels import _triton
from probjax_kernels._config import FlashConfig
from probjax_kernels._dropout import keep_mask
from probjax_kernels._hooks import Hook
from probjax_kernels._linear import widest_manual_axis_type
from probjax_kernels._mosaic_forward import SMEM_BYTES as MOSAIC_SMEM_BYTES
from probjax_kernels._mosaic_forward import mosaic_forward
from probjax_kernels._mosaic_forward import smem_bytes as mosaic_smem_bytes
from probjax_kernels._tiles import kv_tile_range, q_tile_range

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_M_INIT = float(jnp.finfo(jnp.float32).min)  # finite, so exp2(m_old - m_new) is never (-inf) - (-inf)


@dataclasses.dataclass(frozen=True)
class Features:
    """What one attention call computes, apart from the arrays (static and hashable).

    - `window_left`, `window_right`: a query at row r sees keys in [r - left, r + right]; None = unbounded
      (causal is `window_right=0`).
    - `score_mod`, `mask_mod`: traced user hooks (see `_hooks.Hook`).
    - `block_sizes`: the (q, kv) tile of the block tables, when tile visits come from a `BlockMask`.
    - `dropout_rate`: probability of dropping an attention weight (0 = off).
    """

    scale: float
    window_left: int | None = None
    window_right: int | None = None
    score_mod: Hook | None = None
    mask_mod: Hook | None = None
    block_sizes: tuple[int, int] | None = None
    dropout_rate: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Problem:
    """Features plus the static facts of the padded arrays; the nondiff argument of the custom_jvp."""

    features: Features
    group: int  # query heads per key/value head
    num_heads: int
    bias_shape: tuple[int, int, int, int] | None  # padded, with 1 on broadcast dims
    mask_shape: tuple[int, int, int, int] | None
    table_shape: tuple[int, int] | None  # (batch, heads) of the block tables: 1 = broadcast
    has_segments: bool
    num_score_consts: int
    num_mask_consts: int
    config: FlashConfig  # every field filled
    precision: lax.Precision

    @property
    def per_element_mask_everywhere(self) -> bool:
        """Segments and dense masks can cut any tile, so no tile may skip the per-element mask."""
        return self.has_segments or self.mask_shape is not None


@dataclasses.dataclass(frozen=True)
class _Refs:
    """Refs of one program's optional inputs (None / empty when absent)."""

    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    bias: Any = None
    mask: Any = None
    dropout_seed: Any = None
    score_consts: tuple = ()
    mask_consts: tuple = ()
    tables: tuple | None = None  # (num_partial, partial_indices, num_full, full_indices)
    d_bias: Any = None  # tangent kernel: the tangent of the bias
    d_score_consts: tuple = ()  # tangent kernel: tangents of the moving score_mod constants


@dataclasses.dataclass(frozen=True)
class _Tangents:
    """Which inputs have a (nonzero) tangent in a forward-mode pass; static, like `_Problem`."""

    q: bool
    k: bool
    v: bool
    bias: bool
    score_consts: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class _ScoreContext:
    """Everything the per-element score and mask need, shaped to broadcast against the score tile: (bq, bk)
    in a kernel, [B, N, C, S] on the XLA side. `score_mod` / `mask_mod` are bound to their constants."""

    b: Any
    h: Any
    q_idx: Any
    kv_idx: Any
    kv_len: Any
    bias: Any = None
    mask: Any = None
    q_seg: Any = None
    kv_seg: Any = None
    dropout_seed: Any = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    d_bias: Any = None
    score_mod_jvp: Callable | None = None  # (score, d_score) -> (score_mod(score), its tangent)


def _allowed(ctx: _ScoreContext, problem: _Problem):
    """Where (query, key) pairs attend: key length, window, segments, dense mask and mask_mod."""
    f = problem.features
    allowed = ctx.kv_idx < ctx.kv_len
    if f.window_right is not None:
        allowed &= ctx.kv_idx <= ctx.q_idx + f.window_right
    if f.window_left is not None:
        allowed &= ctx.kv_idx >= ctx.q_idx - f.window_left
    if ctx.q_seg is not None:
        allowed &= ctx.q_seg == ctx.kv_seg
    if ctx.mask is not None:
        allowed &= ctx.mask != 0
    if ctx.mask_mod is not None:
        allowed &= ctx.mask_mod(ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx)
    return allowed


def _scores(dot, ctx: _ScoreContext, problem: _Problem, masked: bool, with_derivative: bool = False):
    """Base-2 scores s2 = log2(e) * score_mod(scale * q k^T + bias), -inf where masked, from `dot` = q k^T.

    With `with_derivative`, also returns d score_mod / d score (None without a score_mod).
    """
    f = problem.features
    derivative = None
    if ctx.score_mod is None and ctx.bias is None:
        s2 = dot * (f.scale * LOG2E)
    else:
        s = dot * f.scale
        if ctx.bias is not None:
            s = s + ctx.bias.astype(jnp.float32)
        if ctx.score_mod is not None:
            modded = lambda x: ctx.score_mod(x, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx)  # noqa: E731
            if with_derivative:
                # The hook is elementwise in the score, so a tangent of ones gives its derivative.
                s, derivative = jax.jvp(modded, (s,), (jnp.ones_like(s),))
            else:
                s = modded(s)
        s2 = s * LOG2E
    if masked:
        s2 = jnp.where(_allowed(ctx, problem), s2, -jnp.inf)
    return s2, derivative


def _score_tangents(dot, d_dot, ctx: _ScoreContext, problem: _Problem, masked: bool):
    """Base-2 scores s2 as in `_scores`, and the tangent of the natural-log score (None when the scores do
    not move), from `dot` = q k^T and its tangent `d_dot` = dq k^T + q dk^T (None when q and k are fixed).
    Masked entries of the tangent are left as they are: callers multiply it by p, which is 0 there."""
    f = problem.features
    s = dot * f.scale
    ds = None if d_dot is None else d_dot * f.scale
    if ctx.bias is not None:
        s = s + ctx.bias.astype(jnp.float32)
    if ctx.d_bias is not None:
        d_bias = ctx.d_bias.astype(jnp.float32)
        ds = d_bias if ds is None else ds + d_bias
    if ctx.score_mod_jvp is not None:
        ds = jnp.zeros_like(s) if ds is None else jnp.broadcast_to(ds, s.shape)
        s, ds = ctx.score_mod_jvp(s, ds, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx)
    elif ctx.score_mod is not None:
        s = ctx.score_mod(s, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx)
    s2 = s * LOG2E
    if masked:
        s2 = jnp.where(_allowed(ctx, problem), s2, -jnp.inf)
    return s2, ds


def base2_lse(lse):
    """lse `[B, N, T]` as the backward and tangent kernels read it: in base 2, and +inf for rows without any
    attended key (lse -inf), so that p = exp2(s2 - lse2) is exactly 0 there."""
    return jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)


def backward_delta(out, lse, d_out, d_lse=None):
    """delta = rowsum(dO * O) `[B, N, T]` float32 (FlashAttention-2's preprocess), minus an lse cotangent if
    given: d lse / d s = p, so d_lse enters dS = p (dP - delta) as -d_lse."""
    delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    return delta if d_lse is None else delta - jnp.where(jnp.isfinite(lse), d_lse, 0.0)


def _dropout_scale(ctx: _ScoreContext, problem: _Problem):
    """keep / (1 - rate) for the tile: the factor on dropped-out probabilities."""
    rate = problem.features.dropout_rate
    keep = keep_mask(ctx.dropout_seed, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx, rate, problem.num_heads)
    return jnp.where(keep, 1.0 / (1.0 - rate), 0.0)


# ----------------------------------------------------------------------------------------------- tile ranges


def _window(problem: _Problem) -> tuple[int | None, int | None]:
    return problem.features.window_left, problem.features.window_right


def _kv_tile_range(q_tile, q_len, kv_len, block_q: int, block_k: int, problem: _Problem, num_tiles: int):
    """KV tiles that query tile `q_tile` needs (`_tiles.kv_tile_range`): masked [lo, full_lo), unmasked
    [full_lo, full_hi), masked [full_hi, hi), all within [0, num_tiles)."""
    return kv_tile_range(q_tile * block_q, block_q, q_len, kv_len, block_k, _window(problem), num_tiles,
                         problem.per_element_mask_everywhere)


def _q_tile_range(kv_tile, q_len, kv_len, block_q: int, block_k: int, problem: _Problem, num_tiles: int):
    """Query tiles that KV tile `kv_tile` is seen by (`_tiles.q_tile_range`), split like `_kv_tile_range`."""
    return q_tile_range(kv_tile * block_k, block_k, q_len, kv_len, block_q, _window(problem), num_tiles,
                        problem.per_element_mask_everywhere)


def _run_ranges(tile_range, body, carry):
    """Runs body(tile, carry, masked) over the three ranges of `_kv_tile_range` / `_q_tile_range`."""
    lo, full_lo, full_hi, hi = tile_range
    carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


def _run_table(tables, head, tiles_per_block: int, body, carry, problem: _Problem):
    """Runs body(tile, carry, masked) over the partial blocks, then the full blocks, of one row of a block
    table; a block of the table spans `tiles_per_block` kernel tiles. `head` picks the row of a table block
    that carries several query heads (dK/dV kernel)."""
    num_partial, partial, num_full, full = tables

    def read(ref, *index):
        return ref[(head, *index)] if head is not None else ref[index] if index else ref[...]

    def visit(indices, masked):
        def block_body(n, carry):
            block = read(indices, n)
            if tiles_per_block == 1:
                return body(block, carry, masked=masked)
            return lax.fori_loop(
                0, tiles_per_block, lambda t, c: body(block * tiles_per_block + t, c, masked=masked), carry
            )

        return block_body

    carry = lax.fori_loop(0, read(num_partial), visit(partial, True), carry)
    return lax.fori_loop(0, read(num_full), visit(full, problem.per_element_mask_everywhere), carry)


# ------------------------------------------------------------------------------------------- shared tile math


def _dot(a, b, contract: tuple[int, int], precision):
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32,
        precision=precision,
    )


def _load_2d(ref, row_start, rows, col_start, cols, head=None):
    """A (rows|1, cols|1) tile of a bias / mask block, honouring broadcast axes of size 1.

    A 3-D block carries the query heads of one KV head (dK/dV kernel); `head` picks one. The index is built
    as one tuple because the Triton lowering takes a single indexer per load.
    """
    head_index = (head,) if len(ref.shape) == 3 else ()
    row_axis, col_axis = ref.shape[-2], ref.shape[-1]
    row_slice = pl.ds(row_start, rows) if row_axis > 1 else slice(None)
    col_slice = pl.ds(col_start, cols) if col_axis > 1 else slice(None)
    return ref[(*head_index, row_slice, col_slice)]


def _tile_context(refs: _Refs, problem: _Problem, b, h, head_in_block, q_start, block_q, kv_start, block_k,
                  kv_len, q_is_tile: bool, tangents: _Tangents | None = None) -> _ScoreContext:
    """The score context of tile (q_start:+block_q, kv_start:+block_k) read from a kernel's refs.

    `q_is_tile`: the query axis of the bias / mask / segment refs is already the tile (forward, dQ) rather
    than the whole sequence (dK/dV, where the key axis is the tile instead).
    """
    q_off, kv_off = (0, kv_start) if q_is_tile else (q_start, 0)
    f = problem.features
    return _ScoreContext(
        b=b,
        h=h,
        q_idx=q_start + jnp.arange(block_q, dtype=jnp.int32)[:, None],  # int32 under jax_enable_x64 too: the
        kv_idx=kv_start + jnp.arange(block_k, dtype=jnp.int32)[None, :],  # hooks were traced with int32
        kv_len=kv_len,
        bias=None if refs.bias is None else _load_2d(refs.bias, q_off, block_q, kv_off, block_k, head_in_block),
        mask=None if refs.mask is None else _load_2d(refs.mask, q_off, block_q, kv_off, block_k, head_in_block),
        q_seg=None if refs.q_segment_ids is None else (
            refs.q_segment_ids[...] if q_is_tile else refs.q_segment_ids[pl.ds(q_start, block_q)])[:, None],
        kv_seg=None if refs.kv_segment_ids is None else (
            refs.kv_segment_ids[pl.ds(kv_start, block_k)] if q_is_tile else refs.kv_segment_ids[...])[None, :],
        dropout_seed=None if refs.dropout_seed is None else refs.dropout_seed[...],
        score_mod=None if f.score_mod is None else functools.partial(f.score_mod.in_kernel, refs.score_consts),
        mask_mod=None if f.mask_mod is None else functools.partial(f.mask_mod.in_kernel, refs.mask_consts),
        d_bias=None if refs.d_bias is None else _load_2d(refs.d_bias, q_off, block_q, kv_off, block_k,
                                                         head_in_block),
        score_mod_jvp=None if f.score_mod is None or tangents is None else functools.partial(
            f.score_mod.jvp_in_kernel, refs.score_consts, refs.d_score_consts, tangents.score_consts),
    )


# ---------------------------------------------------------------------------------------------- forward kernel


def _forward_kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, *refs, problem: _Problem, refs_fn):
    *input_refs, out_ref, lse_ref = refs
    opt: _Refs = refs_fn(input_refs)
    cfg = problem.config
    block_q, block_k = cfg.block_q, cfg.block_k
    q_tile, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_len, kv_len = q_len_ref[...], kv_len_ref[...]
    q = q_ref[...]
    dropout = problem.features.dropout_rate > 0

    def body(kv_tile, carry, masked: bool):
        acc, m, l = carry
        start = kv_tile * block_k
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        ctx = _tile_context(opt, problem, b, h, None, q_tile * block_q, block_q, start, block_k, kv_len, True)
        s, _ = _scores(_dot(q, k, (1, 1), problem.precision), ctx, problem, masked)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        if dropout:  # l sums the kept and the dropped weights alike: dropout acts after normalisation
            p = p * _dropout_scale(ctx, problem)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, (1, 0), problem.precision)
        return acc, m_new, l

    carry = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), _M_INIT, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    if opt.tables is not None:
        acc, m, l = _run_table(opt.tables, None, problem.features.block_sizes[1] // block_k, body, carry, problem)
    else:
        tile_range = _kv_tile_range(q_tile, q_len, kv_len, block_q, block_k, problem, k_ref.shape[0] // block_k)
        acc, m, l = _run_ranges(tile_range, body, carry)
    rows = q_tile * block_q + jnp.arange(block_q, dtype=jnp.int32)
    row_valid = (rows < q_len) & (l != 0)  # l = 0: no key attended; a NaN l (NaN / inf inputs) stays NaN
    safe_l = jnp.where(row_valid, l, 1.0)
    out_ref[...] = jnp.where(row_valid[:, None], acc / safe_l[:, None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(row_valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)


# --------------------------------------------------------------------------------------------- backward: dQ


def _tile_gradient(s, do, v, delta, lse2, derivative, ctx, problem: _Problem):
    """p and dS = d loss / d (scaled, biased score) of one tile, FlashAttention-2 with dropout and score_mod."""
    p = jnp.exp2(s - lse2[:, None])
    dp = _dot(do, v, (1, 1), problem.precision)
    p_dropped = p
    if problem.features.dropout_rate > 0:
        scale = _dropout_scale(ctx, problem)
        dp, p_dropped = dp * scale, p * scale
    ds = p * (dp - delta[:, None])
    if derivative is not None:
        ds = ds * derivative
    return p_dropped, ds


def _dq_kernel(
    q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, do_ref, lse2_ref, delta_ref, *refs, problem: _Problem,
    refs_fn, emit_ds: bool,
):
    if emit_ds:
        *input_refs, dq_ref, ds_ref = refs
    else:
        *input_refs, dq_ref = refs
    opt: _Refs = refs_fn(input_refs)
    cfg = problem.config
    block_q, block_k = cfg.block_q_dq, cfg.block_k_dq
    q_tile, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_len, kv_len = q_len_ref[...], kv_len_ref[...]
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse2_ref[...], delta_ref[...]
    with_derivative = problem.features.score_mod is not None

    def body(kv_tile, dq, masked: bool):
        start = kv_tile * block_k
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        ctx = _tile_context(opt, problem, b, h, None, q_tile * block_q, block_q, start, block_k, kv_len, True)
        s, derivative = _scores(_dot(q, k, (1, 1), problem.precision), ctx, problem, masked, with_derivative)
        _, ds = _tile_gradient(s, do, v, delta, lse2, derivative, ctx, problem)
        if emit_ds:
            ds_ref[:, pl.ds(start, block_k)] = ds
        return dq + _dot(ds.astype(k.dtype), k, (1, 0), problem.precision)

    zeros = jnp.zeros(q.shape, jnp.float32)
    if opt.tables is not None:
        dq = _run_table(opt.tables, None, problem.features.block_sizes[1] // block_k, body, zeros, problem)
    else:
        tile_range = _kv_tile_range(q_tile, q_len, kv_len, block_q, block_k, problem, k_ref.shape[0] // block_k)
        dq = _run_ranges(tile_range, body, zeros)
    dq_ref[...] = (dq * problem.features.scale).astype(dq_ref.dtype)
    if emit_ds:
        # Skipped tiles still need their zeros: Pallas outputs start uninitialised.
        def zero_tile(kv_tile, _):
            ds_ref[:, pl.ds(kv_tile * block_k, block_k)] = jnp.zeros((block_q, block_k), jnp.float32)

        lo, hi = tile_range[0], tile_range[3]
        lax.fori_loop(0, lo, zero_tile, None)
        lax.fori_loop(hi, k_ref.shape[0] // block_k, zero_tile, None)


# ------------------------------------------------------------------------------------------ backward: dK, dV


def _dkv_kernel(
    q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, do_ref, lse2_ref, delta_ref, *refs, problem: _Problem, refs_fn,
):
    *input_refs, dk_ref, dv_ref = refs
    opt: _Refs = refs_fn(input_refs)
    cfg = problem.config
    block_q, block_k = cfg.block_q_dkv, cfg.block_k_dkv
    kv_tile, b, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_len, kv_len = q_len_ref[...], kv_len_ref[...]
    k, v = k_ref[...], v_ref[...]
    with_derivative = problem.features.score_mod is not None
    kv_start = kv_tile * block_k

    def head_body(head, carry):
        # K/V stay resident while the loop walks the query tiles of every query head of this KV head (GQA).
        def body(q_tile, carry, masked: bool):
            dk, dv = carry
            start = q_tile * block_q
            q = q_ref[pl.ds(start, block_q), head, :]
            do = do_ref[pl.ds(start, block_q), head, :]
            lse2 = lse2_ref[head, pl.ds(start, block_q)]
            delta = delta_ref[head, pl.ds(start, block_q)]
            ctx = _tile_context(opt, problem, b, kv_head * problem.group + head, head, start, block_q, kv_start,
                                block_k, kv_len, False)
            s, derivative = _scores(_dot(q, k, (1, 1), problem.precision), ctx, problem, masked, with_derivative)
            p, ds = _tile_gradient(s, do, v, delta, lse2, derivative, ctx, problem)
            dv = dv + _dot(p.astype(do.dtype), do, (0, 0), problem.precision)
            dk = dk + _dot(ds.astype(q.dtype), q, (0, 0), problem.precision)
            return dk, dv

        if opt.tables is not None:
            table_head = head if problem.table_shape[1] > 1 else None
            return _run_table(opt.tables, table_head, problem.features.block_sizes[0] // block_q, body, carry,
                              problem)
        tile_range = _q_tile_range(kv_tile, q_len, kv_len, block_q, block_k, problem, q_ref.shape[0] // block_q)
        return _run_ranges(tile_range, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, problem.group, head_body, (zeros, zeros))
    dk_ref[...] = (dk * problem.features.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------- forward-mode tangent


def _tangent_kernel(
    q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, out_ref, lse2_ref, *refs, problem: _Problem, tangents: _Tangents,
    refs_fn,
):
    """d out and d lse of one query tile for tangents of q, k, v, bias and score_mod constants.

    With p = softmax(s) known from lse, d p_j = p_j (d s_j - c) where c = sum_j p_j d s_j, so
    d out = sum_j p_j z_j (d s_j v_j + d v_j) - c out and d lse = c (z: the dropout factor; out is already
    dropped). One pass over the KV tiles accumulates both sums; c is subtracted once at the end.
    """
    refs = list(refs)
    dq_ref = refs.pop(0) if tangents.q else None
    dk_ref = refs.pop(0) if tangents.k else None
    dv_ref = refs.pop(0) if tangents.v else None
    *input_refs, d_out_ref, d_lse_ref = refs
    opt: _Refs = refs_fn(input_refs)
    cfg = problem.config
    block_q, block_k = cfg.block_q, cfg.block_k
    q_tile, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_len, kv_len = q_len_ref[...], kv_len_ref[...]
    q, lse2 = q_ref[...], lse2_ref[...]
    dq = None if dq_ref is None else dq_ref[...]
    dropout = problem.features.dropout_rate > 0

    def body(kv_tile, carry, masked: bool):
        acc, c = carry
        kv = pl.ds(kv_tile * block_k, block_k)
        k, v = k_ref[kv, :], v_ref[kv, :]
        ctx = _tile_context(opt, problem, b, h, None, q_tile * block_q, block_q, kv_tile * block_k, block_k,
                            kv_len, True, tangents)
        d_dot = None if dq is None else _dot(dq, k, (1, 1), problem.precision)
        if dk_ref is not None:
            q_dk = _dot(q, dk_ref[kv, :], (1, 1), problem.precision)
            d_dot = q_dk if d_dot is None else d_dot + q_dk
        s2, ds = _score_tangents(_dot(q, k, (1, 1), problem.precision), d_dot, ctx, problem, masked)
        p = jnp.exp2(s2 - lse2[:, None])
        scale = _dropout_scale(ctx, problem) if dropout else None
        if ds is not None:
            p_ds = jnp.where(p > 0, p * ds, 0.0)  # a non-finite tangent where p = 0 must not leak
            c = c + jnp.sum(p_ds, axis=1)
            if dropout:
                p_ds = p_ds * scale
            acc = acc + _dot(p_ds.astype(v.dtype), v, (1, 0), problem.precision)
        if dv_ref is not None:
            p_kept = p * scale if dropout else p
            dv = dv_ref[kv, :]
            acc = acc + _dot(p_kept.astype(dv.dtype), dv, (1, 0), problem.precision)
        return acc, c

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    if opt.tables is not None:
        acc, c = _run_table(opt.tables, None, problem.features.block_sizes[1] // block_k, body, carry, problem)
    else:
        tile_range = _kv_tile_range(q_tile, q_len, kv_len, block_q, block_k, problem, k_ref.shape[0] // block_k)
        acc, c = _run_ranges(tile_range, body, carry)
    d_out_ref[...] = (acc - c[:, None] * out_ref[...].astype(jnp.float32)).astype(d_out_ref.dtype)
    d_lse_ref[...] = c


# ----------------------------------------------------------------------------------------------- block specs


def _refs_fn(problem: _Problem, tangents: _Tangents | None = None):
    """Maps the trailing optional input refs of a kernel to `_Refs`, in the order `_optional_inputs` uses."""

    def to_refs(refs):
        refs = list(refs)
        take = lambda n: tuple(refs.pop(0) for _ in range(n))  # noqa: E731
        fields = {}
        if problem.has_segments:
            fields["q_segment_ids"], fields["kv_segment_ids"] = take(2)
        if problem.bias_shape is not None:
            (fields["bias"],) = take(1)
        if problem.mask_shape is not None:
            (fields["mask"],) = take(1)
        if problem.features.dropout_rate > 0:
            (fields["dropout_seed"],) = take(1)
        fields["score_consts"] = take(problem.num_score_consts)
        fields["mask_consts"] = take(problem.num_mask_consts)
        if problem.table_shape is not None:
            fields["tables"] = take(4)
        if tangents is not None:
            if tangents.bias:
                (fields["d_bias"],) = take(1)
            fields["d_score_consts"] = take(sum(tangents.score_consts))
        assert not refs
        return _Refs(**fields)

    return to_refs


def _whole(x) -> pl.BlockSpec:
    return pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n)


def _optional_inputs(arrays: dict, problem: _Problem, kind: str, block_q: int, block_k: int):
    """Arrays and BlockSpecs of the optional inputs for a "q" or "kv" kernel grid.

    "q" grids are (q_tile, b, h) and see one query tile against the whole key axis; "kv" grids are
    (kv_tile, b, kv_head) and see one key tile against the whole query axis of the group's query heads.
    The tangent kernel's `d_bias` and `d_score_consts` come last, laid out like the bias and the constants.
    """
    group = problem.group
    inputs, specs = [], []
    if problem.has_segments:
        t_pad, s_pad = arrays["q_segment_ids"].shape[1], arrays["kv_segment_ids"].shape[1]
        inputs += [arrays["q_segment_ids"], arrays["kv_segment_ids"]]
        if kind == "q":
            specs += [
                pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
                pl.BlockSpec((None, s_pad), lambda i, b, h: (b, 0)),
            ]
        else:
            specs += [
                pl.BlockSpec((None, t_pad), lambda j, b, h: (b, 0)),
                pl.BlockSpec((None, block_k), lambda j, b, h: (b, j)),
            ]
    for name in ("bias", "mask"):
        if arrays.get(name) is not None:
            inputs.append(arrays[name])
            specs.append(_broadcast_spec(arrays[name].shape, kind, block_q, block_k, group))
    if problem.features.dropout_rate > 0:
        inputs.append(arrays["dropout_seed"])
        specs.append(pl.BlockSpec((), lambda *_: ()))
    for const in (*arrays["score_consts"], *arrays["mask_consts"]):
        inputs.append(const)
        specs.append(_whole(const))
    if problem.table_shape is not None:
        tb, th = problem.table_shape
        table_q, table_k = problem.features.block_sizes
        if kind == "q":
            tables = arrays["kv_tables"]
            row = lambda i: i * block_q // table_q  # noqa: E731
            num_spec = pl.BlockSpec((None, None, None), lambda i, b, h: (b if tb > 1 else 0, h if th > 1 else 0, row(i)))
            idx_spec = pl.BlockSpec(
                (None, None, None, tables[1].shape[-1]),
                lambda i, b, h: (b if tb > 1 else 0, h if th > 1 else 0, row(i), 0),
            )
        else:
            tables = arrays["q_tables"]
            col = lambda j: j * block_k // table_k  # noqa: E731
            heads = group if th > 1 else None
            num_spec = pl.BlockSpec((None, heads, None), lambda j, b, h: (b if tb > 1 else 0, h if th > 1 else 0, col(j)))
            idx_spec = pl.BlockSpec(
                (None, heads, None, tables[1].shape[-1]),
                lambda j, b, h: (b if tb > 1 else 0, h if th > 1 else 0, col(j), 0),
            )
        inputs += list(tables)
        specs += [num_spec, idx_spec, num_spec, idx_spec]
    if arrays.get("d_bias") is not None:
        inputs.append(arrays["d_bias"])
        specs.append(_broadcast_spec(arrays["d_bias"].shape, kind, block_q, block_k, group))
    for const in arrays.get("d_score_consts", ()):
        inputs.append(const)
        specs.append(_whole(const))
    return inputs, specs


def _broadcast_spec(shape, kind: str, block_q: int, block_k: int, group: int) -> pl.BlockSpec:
    """The BlockSpec of a [B|1, N|1, T|1, S|1] bias or mask on a "q" or "kv" grid (see `_optional_inputs`)."""
    nb, nh, nt, ns = shape
    if kind == "q":
        block = (None, None, block_q if nt > 1 else 1, ns)

        def index_map(i, b, h):
            return (b if nb > 1 else 0, h if nh > 1 else 0, i if nt > 1 else 0, 0)
    else:
        block = (None, group if nh > 1 else None, nt, block_k if ns > 1 else 1)

        def index_map(j, b, h):
            return (b if nb > 1 else 0, h if nh > 1 else 0, 0, j if ns > 1 else 0)

    return pl.BlockSpec(block, index_map)


def _interpreted(problem: _Problem) -> bool:
    return problem.config.backend in ("interpret", "mosaic_interpret")


def _compiler_params(problem: _Problem):
    cfg = problem.config
    if _interpreted(problem):
        return dict(interpret=True)
    return dict(compiler_params=_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def _length_spec():
    return pl.BlockSpec((None,), lambda i, b, h: (b,))


def _output(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A kernel output that varies over the mesh axes its inputs vary over, so that the kernels run inside
    `jax.shard_map` with its default `check_vma=True` (outside one, no axis varies)."""
    manual = widest_manual_axis_type([jax.typeof(x) for x in inputs])
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


# ------------------------------------------------------------------------------------------- pallas_call glue


def _q_grid(problem: _Problem, q, k, block_q: int, block_k: int, optional: dict):
    """The specs of a (q_tile, b, h) grid: a query tile, the whole K / V of the head's group, a row vector of
    the tile, and the optional inputs."""
    d_pad, s_pad, group = q.shape[3], k.shape[1], problem.group
    extra, extra_specs = _optional_inputs(optional, problem, "q", block_q, block_k)
    q_spec = pl.BlockSpec((None, block_q, None, d_pad), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda i, b, h: (b, 0, h // group, 0))
    row_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
    return q_spec, kv_spec, row_spec, extra, extra_specs


def _mosaic_takes(problem: _Problem, q) -> bool:
    """Whether backend "mosaic" is asked for and the Mosaic GPU forward takes this call's dtype, head dim,
    tiles and hooks, and none of what it lacks (dropout, bias, dense masks, segments, hooks that read
    captured arrays other than as scalars or use an op Mosaic GPU cannot lower)."""
    f, cfg = problem.features, problem.config
    return (
        cfg.backend in ("mosaic", "mosaic_interpret") and f.dropout_rate == 0 and problem.bias_shape is None
        and f.scale > 0  # the Mosaic kernels take the row max before scaling
        and problem.mask_shape is None and not problem.has_segments
        and (f.score_mod is None or _is_mosaic_hook(f.score_mod, cfg, with_score=True))
        and (f.mask_mod is None or _is_mosaic_hook(f.mask_mod, cfg, with_score=False))
        and (f.block_sizes is None or f.block_sizes == (cfg.block_q, cfg.block_k))
        and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[3] in (64, 128, 256)
        and cfg.block_q % 128 == 0 and cfg.block_k % 64 == 0 and cfg.num_stages >= 2
        and mosaic_smem_bytes(q.shape[3], cfg.block_q, cfg.block_k, cfg.num_stages) <= MOSAIC_SMEM_BYTES
    )


def _fits_mosaic(problem: _Problem, q) -> bool:
    """Whether the Mosaic GPU kernels run the backward of this call too (at head dim 64 / 128): when they run
    its forward and a score_mod's derivative also runs in Mosaic GPU."""
    f = problem.features
    return _mosaic_takes(problem, q) and (
        f.score_mod is None or _is_mosaic_score_derivative(f.score_mod, problem.config)
    )


def mosaic_hook_shapes(config: FlashConfig) -> tuple:
    """Shapes of (b, h, q_idx, kv_idx, score) where the Mosaic forward calls the hooks: scalar b and h, and
    [block_q // 2, block_k] tiles of a consumer warpgroup for the rest."""
    tile = (config.block_q // 2, config.block_k)
    return (), (), tile, tile, tile


def _hook_specs(config: FlashConfig, with_score: bool) -> list[jax.ShapeDtypeStruct]:
    b, h, q_idx, kv_idx, score = mosaic_hook_shapes(config)
    specs = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in (b, h, q_idx, kv_idx)]
    if with_score:
        specs.insert(0, jax.ShapeDtypeStruct(score, jnp.float32))
    return specs


def _is_mosaic_hook(hook: Hook, config: FlashConfig, with_score: bool) -> bool:
    """Whether a hook can run inside the Mosaic GPU kernels (see `_runs_in_mosaic`), at their tile shapes."""
    jaxpr = hook._jaxpr(_hook_specs(config, with_score))
    return _runs_in_mosaic(jaxpr, set(jaxpr.constvars))


def _is_mosaic_score_derivative(hook: Hook, config: FlashConfig) -> bool:
    """Whether a score_mod's value and derivative (its jvp, for the backward kernels) run in Mosaic GPU."""
    closed = hook.jvp_jaxpr((False,) * len(hook.const_avals), *_hook_specs(config, with_score=True))
    captured = closed.jaxpr.invars[: len(hook.const_avals)]  # the refs of the hook's arrays
    return not closed.consts and _runs_in_mosaic(closed.jaxpr, set(captured))


def _runs_in_mosaic(jaxpr, consts: set) -> bool:
    """Whether every primitive of `jaxpr` has a Mosaic GPU lowering rule, and it reads the arrays `consts`
    only one element at a time (`slopes[h]`: a `dynamic_slice` of size 1 then squeezed, a scalar load from
    global memory), never as arrays; 0-d arrays (a learnable soft cap) are scalar loads wherever used."""
    elements = set()  # the size-1 slices of constants, which may only be squeezed to scalars
    consts = {var for var in consts if var.aval.shape}
    for eqn in jaxpr.eqns:
        reads_element = (
            eqn.primitive.name == "dynamic_slice" and eqn.invars[0] in consts
            and all(size == 1 for size in eqn.params["slice_sizes"])
        )
        if reads_element:  # a scalar load in the kernel (`_hooks._Element`), not a lowered dynamic_slice
            elements.add(eqn.outvars[0])
        elif not _lowers_in_mosaic(eqn):
            return False
        for position, var in enumerate(eqn.invars):
            if isinstance(var, jex_core.Literal):
                continue
            if var in consts and not (reads_element and position == 0):
                return False
            if var in elements and not (eqn.primitive.name == "squeeze" and not eqn.outvars[0].aval.shape):
                return False
    outputs = {var for var in jaxpr.outvars if not isinstance(var, jex_core.Literal)}
    return not outputs & (consts | elements)


def _lowers_in_mosaic(eqn) -> bool:
    """Whether Mosaic GPU has a lowering rule for the equation's primitive and those of its sub-jaxprs."""
    rules = mosaic_lowering.mosaic_lowering_rules[mosaic_gpu_core.LANExWG_SEMANTICS]
    return eqn.primitive in rules and all(
        _lowers_in_mosaic(inner) for sub in jex_core.jaxprs_in_params(eqn.params) for inner in sub.eqns
    )


def _mosaic_score_jvp_fn(hook: Hook | None) -> Callable | None:
    """`(score, b, h, q_idx, kv_idx, *array_refs) -> (score_mod(score), d score_mod / d score)` for the
    Mosaic backward kernels, from the hook's jvp jaxpr."""
    return None if hook is None else functools.partial(_call_score_jvp_in_mosaic, hook)


def _call_score_jvp_in_mosaic(hook: Hook, score, *indices_and_refs):
    num_indices = len(indices_and_refs) - len(hook.const_avals)
    indices, refs = indices_and_refs[:num_indices], indices_and_refs[num_indices:]
    moved = (False,) * len(hook.const_avals)
    return hook.jvp_in_kernel(refs, (), moved, score, jnp.ones_like(score), *indices)


def _mosaic_hook_fn(hook: Hook | None) -> Callable | None:
    """A hook as the Mosaic forward calls it, `fn(*args, *array_refs)`, from its jaxpr prepared at the
    kernel's shapes (never the user's Python again); hashable (a static argument) by the hook's identity."""
    return None if hook is None else functools.partial(_call_hook_in_mosaic, hook)


def _call_hook_in_mosaic(hook: Hook, *args_and_refs):
    num_args = len(args_and_refs) - len(hook.const_avals)
    return hook.in_kernel(args_and_refs[num_args:], *args_and_refs[:num_args])


def _forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    f = problem.features
    if _mosaic_takes(problem, q):
        cfg = problem.config
        return mosaic_forward(
            q, k, v, q_len, kv_len, scale=f.scale, causal=False, window=(f.window_left, f.window_right),
            block_q=cfg.block_q, block_kv=cfg.block_k, num_stages=cfg.num_stages, interpret=_interpreted(problem),
            kv_tables=optional["kv_tables"] if f.block_sizes is not None else None,
            mask_fn=_mosaic_hook_fn(f.mask_mod), score_fn=_mosaic_hook_fn(f.score_mod),
            mask_arrays=optional["mask_consts"], score_arrays=optional["score_consts"],
        )
    batch, t_pad, num_heads, _ = q.shape
    block_q = problem.config.block_q
    q_spec, kv_spec, row_spec, extra, extra_specs = _q_grid(problem, q, k, block_q, problem.config.block_k, optional)
    kernel = functools.partial(_forward_kernel, problem=problem, refs_fn=_refs_fn(problem))
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, batch, num_heads),
        in_specs=[q_spec, kv_spec, kv_spec, _length_spec(), _length_spec(), *extra_specs],
        out_specs=[q_spec, row_spec],
        out_shape=[
            _output(q.shape, q.dtype, q, k, v),
            _output((batch, num_heads, t_pad), jnp.float32, q, k, v),
        ],
        name="probjax_flash_forward",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, *extra)


def _backward_dq(problem: _Problem, q, k, v, q_len, kv_len, do, lse2, delta, optional: dict, emit_ds: bool):
    batch, t_pad, num_heads, _ = q.shape
    s_pad = k.shape[1]
    block_q = problem.config.block_q_dq
    q_spec, kv_spec, row_spec, extra, extra_specs = _q_grid(
        problem, q, k, block_q, problem.config.block_k_dq, optional)
    out_specs = [q_spec]
    out_shape = [_output(q.shape, q.dtype, q, k, v, do)]
    if emit_ds:
        out_specs.append(pl.BlockSpec((None, None, block_q, s_pad), lambda i, b, h: (b, h, i, 0)))
        out_shape.append(_output((batch, num_heads, t_pad, s_pad), jnp.float32, q, k, v, do))
    kernel = functools.partial(_dq_kernel, problem=problem, refs_fn=_refs_fn(problem), emit_ds=emit_ds)
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, batch, num_heads),
        in_specs=[
            q_spec, kv_spec, kv_spec, _length_spec(), _length_spec(), q_spec, row_spec, row_spec, *extra_specs
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        name="probjax_flash_backward_dq",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, do, lse2, delta, *extra)


def _backward_dkv(problem: _Problem, q, k, v, q_len, kv_len, do, lse2, delta, optional: dict):
    batch, t_pad, num_heads, d_pad = q.shape
    s_pad, num_kv_heads = k.shape[1], k.shape[2]
    block_k = problem.config.block_k_dkv
    group = problem.group
    extra, extra_specs = _optional_inputs(optional, problem, "kv", problem.config.block_q_dkv, block_k)
    q_spec = pl.BlockSpec((None, t_pad, group, d_pad), lambda j, b, h: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, block_k, None, d_pad), lambda j, b, h: (b, j, h, 0))
    row_spec = pl.BlockSpec((None, group, t_pad), lambda j, b, h: (b, h, 0))
    kernel = functools.partial(_dkv_kernel, problem=problem, refs_fn=_refs_fn(problem))
    return pl.pallas_call(
        kernel,
        grid=(s_pad // block_k, batch, num_kv_heads),
        in_specs=[
            q_spec, kv_spec, kv_spec, _length_spec(), _length_spec(), q_spec, row_spec, row_spec, *extra_specs
        ],
        out_specs=[kv_spec, kv_spec],
        out_shape=[_output(k.shape, k.dtype, q, k, v, do), _output(v.shape, v.dtype, q, k, v, do)],
        name="probjax_flash_backward_dkv",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, do, lse2, delta, *extra)


def _tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, out, lse2, linear: dict,
             optional: dict):
    """(d out, d lse) for the tangents in `linear` (dq, dk, dv; d_bias and d_score_consts go in `optional`)."""
    batch, t_pad, num_heads, _ = q.shape
    block_q = problem.config.block_q
    q_spec, kv_spec, row_spec, extra, extra_specs = _q_grid(problem, q, k, block_q, problem.config.block_k, optional)
    lin, lin_specs = [], []
    for name, spec in (("q", q_spec), ("k", kv_spec), ("v", kv_spec)):
        if getattr(tangents, name):
            lin.append(linear[name])
            lin_specs.append(spec)
    kernel = functools.partial(_tangent_kernel, problem=problem, tangents=tangents,
                               refs_fn=_refs_fn(problem, tangents))
    varying = (q, k, v, *lin)
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, batch, num_heads),
        in_specs=[q_spec, kv_spec, kv_spec, _length_spec(), _length_spec(), q_spec, row_spec, *lin_specs,
                  *extra_specs],
        out_specs=[q_spec, row_spec],
        out_shape=[
            _output(q.shape, q.dtype, *varying),
            _output((batch, num_heads, t_pad), jnp.float32, *varying),
        ],
        name="probjax_flash_tangent",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, out, lse2, *lin, *extra)
