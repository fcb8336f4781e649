"""The forward-mode tangent kernel in Pallas Triton (see docs/forward_mode.md): (d out, d lse) of one query
tile for tangents of q, k, v, the bias and score_mod constants, in one pass over the KV tiles. Backend
"triton" runs it, and backend "mosaic" where its own tangent kernel (`mosaic.tangent`, Hopper) does not: a bias,
a score_mod's captured arrays, head dim 256, float32, Blackwell."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from probjax_kernels._config import FlashConfig
from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._scores import _dropout_scale, _score_tangents
from probjax_kernels.triton.specs import _compiler_params, _length_spec, _output, _q_grid, _refs_fn
from probjax_kernels.triton.tiles import (
    _dot, _kv_tile_range, _Refs, _run_ranges, _run_table, _sliced_dot, _tile_context,
)


def tangent_tiles(config: FlashConfig, head_dim: int, tables: bool, dtype, *, hopper: bool,
                  large_smem: bool, score_tile: bool = False) -> tuple[FlashConfig, int]:
    """(tiles, value splits) of the tangent kernel on a GPU (`_dispatch.tangent_config` passes the target's
    `hopper` and `large_smem`: over 160 KB of shared memory per CTA): 8 warps, a key tile of at most 32 (16
    at head dim 256) and, at head dim 256 without block tables (which index the forward's query tile), a
    query tile of at most 32. It holds q, its tangent and a (block_q, Dv) float32 accumulator, so the forward's
    tiles spill at every head dim (255 registers; 1,080 B at head dim 256 on sm_90a) and need
    131,072 B of shared memory at head dim 128 (docs/perf-notes.md). Halving a tile keeps it a divisor of
    the padded length and of every block table's block. A float32 `dtype` (FMA dots; None: a 16-bit one, as
    in `default_config`) takes a query tile of at most 16, with block tables too (32 spilled 488 B at head dim
    128 on sm_86, and 208-228 B with a sliding-window BlockMask on sm_90a), and at least 2 stages. Where
    a CTA gets 99 KB of shared memory (sm_86 / sm_89) the query tile is at most 64 at head dim 128 without
    block tables: 128 x 32 needs 98,304 B there, and 114,688 B (over 101,376) with a score_mod that reads a
    captured table (a relative bias). On Hopper at head dim 256, 16-bit: 64 x 16 on 4 warps, 2 stages, the
    value head dim split across 2 programs (`tangent`'s `value_splits`): a 64-row tile (wgmma's M) with the
    whole 64 x 256 float32 accumulator spilled; split, it is wgmma throughout (198 registers, no spill) at 1.6x
    the matmul work (each split recomputes the scores; Version 7u); with block tables too (the forward's 64
    x 32 spilled 188 B with a sliding-window BlockMask, split 212 registers; Version 7d). On a 99 KB GPU at
    head dim 256, a `score_tile` (a bias tile, or a score_mod that gathers one from a captured table) splits
    the value head dim in two as well, on the tiles above: unsplit it spilled 4-36 B with 16-bit inputs and
    float32 needed 102,400 B of shared memory; split, 126-166 registers in 16-bit and float32 (Version 7d)."""
    float32 = dtype is not None and jnp.dtype(dtype) == jnp.float32
    if hopper and head_dim > 128 and not float32:
        return dataclasses.replace(config, block_q=min(config.block_q, 64), block_k=min(config.block_k, 16),
                                   num_warps=4, num_stages=2), 2
    splits = 2 if head_dim > 128 and score_tile and not large_smem and not hopper else 1
    cap = 32 if head_dim <= 128 else 16
    block_q = config.block_q
    if float32:
        block_q = min(block_q, 16)
    elif not tables and head_dim > 128:
        block_q = min(block_q, 32)
    elif not tables and head_dim > 64 and not large_smem:
        block_q = min(block_q, 64)
    # float32 takes at least 2 stages (the float32 tiles have 1 at head dim 256): with 1 the tangent spilled
    # 6-16 KB at head dim 256 on sm_86, 368 B at 128 on sm_90a (docs/perf-notes.md, Version 6). So does 16-bit
    # at head dim 256 on a 99 KB GPU without block tables: on 1 the 32 x 16 tile spilled 8-12 B with a window
    # or ALiBi on sm_86, on 2 every feature holds 95-128 registers (Version 7e; the 64 x 16 tile of block
    # tables would not fit twice).
    two_stages = float32 or (head_dim > 128 and not large_smem and not tables)
    stages = max(config.num_stages, 2) if two_stages else config.num_stages
    return dataclasses.replace(config, block_q=block_q, block_k=min(config.block_k, cap),
                               num_warps=max(config.num_warps, 8), num_stages=stages), splits


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
    dropout = problem.features.dropout_rate > 0
    # float32 (FMA dots at Precision.HIGHEST): q and its tangent are read again at every KV step, as K / V are
    # in the dK/dV kernel; held across the loop, their FMA operand layouts stay in registers and spill. Above
    # head dim 128 the score dots also run over 64-wide slices of the head dim, read from the refs.
    reload = problem.precision == lax.Precision.HIGHEST
    head_dim = q_ref.shape[-1]
    chunk = 64 if head_dim > 128 else head_dim
    q, lse2 = None if reload else q_ref[...], lse2_ref[...]
    dq = None if reload or dq_ref is None else dq_ref[...]

    def score_dot(a_ref, a, b_ref, b, kv):
        """a (block_q, D) . b (block_k, D)^T, b = b_ref[kv]; float32: read from the refs, in head-dim slices of
        `chunk` (a and b unused)."""
        if not reload:
            return _dot(a, b, (1, 1), problem.precision)
        return _sliced_dot(lambda cols: a_ref[:, cols], lambda cols: b_ref[kv, cols], head_dim, chunk,
                           problem.precision)

    def body(kv_tile, carry, masked: bool):
        acc, c = carry
        kv = pl.ds(kv_tile * block_k, block_k)
        k, v = k_ref[kv, :], v_ref[kv, :]
        ctx = _tile_context(opt, problem, b, h, None, q_tile * block_q, block_q, kv_tile * block_k, block_k,
                            kv_len, True, tangents)
        d_dot = None if dq_ref is None else score_dot(dq_ref, dq, k_ref, k, kv)
        if dk_ref is not None:
            q_dk = score_dot(q_ref, q, dk_ref, None if reload else dk_ref[kv, :], kv)
            d_dot = q_dk if d_dot is None else d_dot + q_dk
        s2, ds = _score_tangents(score_dot(q_ref, q, k_ref, k, kv), d_dot, ctx, problem, masked)
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

    carry = (jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32), jnp.zeros((block_q,), jnp.float32))
    if opt.tables is not None:
        acc, c = _run_table(opt.tables, None, problem.features.block_sizes[1] // block_k, body, carry, problem)
    else:
        tile_range = _kv_tile_range(q_tile, q_len, kv_len, block_q, block_k, problem, k_ref.shape[0] // block_k)
        acc, c = _run_ranges(tile_range, body, carry)
    d_out_ref[...] = (acc - c[:, None] * out_ref[...].astype(jnp.float32)).astype(d_out_ref.dtype)
    d_lse_ref[...] = c


# ------------------------------------------------------------------------------------------- pallas_call glue


def _split_spec(spec: pl.BlockSpec, value_splits: int, value_cols: bool) -> pl.BlockSpec:
    """`spec` on the grid (q tile, batch, head, value split): the same block, or with `value_cols` the split's
    columns of the value head dim (its last axis)."""
    index_map = spec.index_map
    if not value_cols:
        return dataclasses.replace(spec, index_map=lambda i, b, h, s: index_map(i, b, h))
    shape = (*spec.block_shape[:-1], spec.block_shape[-1] // value_splits)
    return dataclasses.replace(spec, block_shape=shape,
                               index_map=lambda i, b, h, s: (*index_map(i, b, h)[:-1], s))


def tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, out, lse2, linear: dict,
            optional: dict, value_splits: int = 1):
    """(d out, d lse) for the tangents in `linear` (dq, dk, dv; d_bias and d_score_consts go in `optional`).

    `value_splits` > 1 splits the value head dim across that many programs per query tile: each holds a
    (block_q, Dv / value_splits) accumulator (v, d v, out and d out in column blocks) and recomputes the scores
    and their tangent, so every split writes the same d lse (Hopper at head dim 256: `_dispatch`)."""
    batch, t_pad, num_heads, _ = q.shape
    block_q = problem.config.block_q
    grid = _q_grid(problem, q, k, v, block_q, problem.config.block_k, optional)
    lin, lin_specs = [], []
    for name, spec in (("q", grid.q), ("k", grid.k), ("v", grid.v)):
        if getattr(tangents, name):
            lin.append(linear[name])
            lin_specs.append(_split_spec(spec, value_splits, name == "v") if value_splits > 1 else spec)
    kernel = functools.partial(_tangent_kernel, problem=problem, tangents=tangents,
                               refs_fn=_refs_fn(problem, tangents))
    varying = (q, k, v, *lin)
    in_specs = [grid.q, grid.k, grid.v, _length_spec(), _length_spec(), grid.out, grid.row]
    out_specs = [grid.out, grid.row]
    grid_shape = (t_pad // block_q, batch, num_heads)
    if value_splits > 1:
        if v.shape[3] % (16 * value_splits):
            raise ValueError(f"value_splits={value_splits} needs a padded value head dim that splits into "
                             f"columns of a multiple of 16, got {v.shape[3]}")
        cols = (grid.v, grid.out)  # the value-dim blocks; q, k, lengths, rows and hook inputs stay whole
        in_specs = [_split_spec(spec, value_splits, any(spec is c for c in cols)) for spec in in_specs]
        out_specs = [_split_spec(spec, value_splits, spec is grid.out) for spec in out_specs]
        grid_shape = (*grid_shape, value_splits)
        extra_specs = [_split_spec(spec, value_splits, False) for spec in grid.extra_specs]
    else:
        extra_specs = list(grid.extra_specs)
    return pl.pallas_call(
        kernel,
        grid=grid_shape,
        in_specs=[*in_specs, *lin_specs, *extra_specs],
        out_specs=out_specs,
        out_shape=[
            _output(out.shape, out.dtype, *varying),
            _output((batch, num_heads, t_pad), jnp.float32, *varying),
        ],
        name="probjax_flash_tangent",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, out, lse2, *lin, *grid.extra)
