"""The flash-attention forward in Pallas Mosaic TPU (FlashAttention-2, Alg. 1): a (B, N, query tile, step)
grid whose last axis walks the key tiles of the query tile (`common.q_walk`), with the running max m, sum l
and the float32 accumulator in VMEM scratch; the last step writes out, lse (and the row max)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._problem import _Problem
from probjax_kernels._scores import LN2, _dropout_scale, _scores
from probjax_kernels.tpu import common
from probjax_kernels.tpu.common import M_INIT, dot


def _forward_kernel(*refs, problem: _Problem, num_kv_tiles: int, to_refs, num_out: int):
    n_scalar = common.num_scalars(problem)
    scalars = common.scalars_of(problem, refs[:n_scalar], "q")
    q_ref, k_ref, v_ref, *rest = refs[n_scalar:]
    m_ref, l_ref, acc_ref = rest[-3:]
    out_refs = rest[-3 - num_out:-3]
    opt = to_refs(rest[:-3 - num_out])
    out_ref, lse_ref = out_refs[:2]
    b, h, i, step = (pl.program_id(axis) for axis in range(4))
    bq, bk = problem.config.block_q, problem.config.block_k
    walk = common.q_walk(problem, scalars, b, h, i, num_kv_tiles)
    kv_len = scalars.kv_len[b]

    @pl.when(step == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, M_INIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def body(masked: bool):
        ctx = common.tile_context(opt, problem, b, h, i * bq, walk.tile(step) * bk, kv_len, False)
        v = v_ref[...]
        s, _ = _scores(dot(q_ref[...], k_ref[...], (1, 1)), ctx, problem, masked)
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new)
        l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        if problem.features.dropout_rate > 0:  # l sums kept and dropped weights: dropout acts after softmax
            p = p * _dropout_scale(ctx, problem)
        acc_ref[...] = acc_ref[...] * alpha + dot(p.astype(v.dtype), v, (1, 0))
        m_ref[...] = m_new

    common.run_step(walk, step, body)

    @pl.when(step == pl.num_programs(3) - 1)
    def _():
        l, m = l_ref[...], m_ref[...]
        rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        row_valid = (rows < scalars.q_len[b]) & (l != 0)  # l = 0: no key attended
        safe_l = jnp.where(row_valid, l, 1.0)
        out_ref[...] = jnp.where(row_valid, acc_ref[...] / safe_l, 0.0).astype(out_ref.dtype)
        lse_ref[...] = jnp.where(row_valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)
        if num_out == 3:  # m is the row max of the base-2 scores
            out_refs[2][...] = jnp.where(row_valid, m * LN2, -jnp.inf)


def forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    """(out `[B, T, N, Dv]`, lse `[B, N, T]`[, row max]) of padded q `[B, T, N, D]`, k `[B|1, S, K, D]`,
    v `[B|1, S, K, Dv]` (the core's layout; the kernel runs on `[B, N, T, D]`)."""
    batch, t_pad, num_heads, _ = q.shape
    s_pad, dv_pad = k.shape[1], v.shape[3]
    cfg = problem.config
    bq, bk = cfg.block_q, cfg.block_k
    out_dtype = q.dtype
    dtype = common.compute_dtype(q.dtype)
    qh, kh, vh = (common.to_heads(x.astype(dtype)) for x in (q, k, v))
    num_q_tiles, num_kv_tiles = t_pad // bq, s_pad // bk
    group = problem.group

    def kv_tile(b, h, i, step, *scalar_refs):
        scalars = common.scalars_of(problem, scalar_refs, "q")
        return common.q_walk(problem, scalars, b, h, i, num_kv_tiles).tile(step)

    def kv_batch(b):
        return 0 if problem.kv_broadcast else b

    maps = dict(b=lambda b, h, i, s, *r: b, h=lambda b, h, i, s, *r: h, q=lambda b, h, i, s, *r: i, kv=kv_tile)
    extra, extra_specs, to_refs = common.optional_inputs(problem, optional, "q", maps, (t_pad, s_pad))
    q_spec = pl.BlockSpec((None, None, bq, qh.shape[3]), lambda b, h, i, s, *r: (b, h, i, 0))

    def kv_spec(dim):
        return pl.BlockSpec((None, None, bk, dim),
                            lambda b, h, i, s, *r: (kv_batch(b), h // group, kv_tile(b, h, i, s, *r), 0))

    out_spec = pl.BlockSpec((None, None, bq, dv_pad), lambda b, h, i, s, *r: (b, h, i, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, s, *r: (b, h, i, 0))
    num_out = 3 if problem.features.return_max else 2
    row_shape = common.output((batch, num_heads, t_pad, 1), jnp.float32, q, k, v)
    scalar_inputs = common.scalar_inputs(problem, q_len, kv_len, optional, "q")
    kernel = functools.partial(_forward_kernel, problem=problem, num_kv_tiles=num_kv_tiles, to_refs=to_refs,
                               num_out=num_out)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalar_inputs),
        grid=(batch, num_heads, num_q_tiles, num_kv_tiles if problem.table_shape is None else _table_steps(optional)),
        in_specs=[q_spec, kv_spec(qh.shape[3]), kv_spec(dv_pad), *extra_specs],
        out_specs=[out_spec, *(row_spec for _ in range(num_out - 1))],
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, dv_pad), jnp.float32)],
    )
    results = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        # float16 leaves the kernel in float32 (Mosaic TPU cannot pack float16), cast below
        out_shape=[common.output((batch, num_heads, t_pad, dv_pad), dtype, q, k, v),
                   *(row_shape for _ in range(num_out - 1))],
        name="probjax_tpu_forward",
        **common.compiler_params(problem, ("parallel", "parallel", "parallel", "arbitrary")),
    )(*scalar_inputs, qh, kh, vh, *extra)
    out, *rows = results
    return (jnp.swapaxes(out, 1, 2).astype(out_dtype), *(r[..., 0] for r in rows))


def _table_steps(optional: dict) -> int:
    """Steps of a `BlockMask` row: its partial entries then its full ones."""
    tables = optional["kv_tables"]
    return tables[1].shape[-1] + tables[3].shape[-1]
