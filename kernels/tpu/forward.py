"""The flash-attention forward in Pallas Mosaic TPU (FlashAttention-2, Alg. 1): a (B, head block, query tile,
step) grid whose last axis walks the key tiles of the query tile (`common.q_walk`), with the running max m,
sum l and the float32 accumulator of each head of the block in VMEM scratch; the last step writes out and, as
lane-dense rows, lse (and the row max). The heads of a block share the walk and each step's K / V blocks
(`common.SeqLayout`). Under a causal mask or a local window the (query tile, step) axes are one flattened axis
over the steps the static shapes allow (`common.step_grid`), so no grid step is idle at full lengths."""

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


def _forward_kernel(*refs, problem: _Problem, layout: common.SeqLayout, grid: common.StepGrid, num_kv_tiles: int,
                    to_refs, num_out: int, stages: tuple[int, ...]):
    (b, block, i, step, last), refs = grid.ids(refs)
    n_scalar = common.num_scalars(problem)
    scalars = common.scalars_of(problem, refs[:n_scalar], "q")
    q_ref, k_ref, v_ref, *rest = refs[n_scalar:]
    rest, (q_stage, k_stage, v_stage) = common.split_stages(rest, stages)
    m_ref, l_ref, acc_ref = rest[-3:]
    out_refs = rest[-3 - num_out:-3]
    opt = to_refs(rest[:-3 - num_out])
    out_ref, lse_ref = out_refs[:2]
    bq, bk = problem.config.block_q, problem.config.block_k
    walk = common.q_walk(problem, scalars, b, layout.head(block, 0), i, num_kv_tiles)
    kv_len = scalars.kv_len[b]

    @pl.when(step == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, M_INIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        layout.stage(q_ref, q_stage)

    @pl.when(walk.visited(step))
    def _():
        layout.stage(k_ref, k_stage, kv=True)
        layout.stage(v_ref, v_stage, kv=True)

    def body(masked: bool):
        def head(slot):
            ctx = common.tile_context(opt, problem, b, layout.head(block, slot), i * bq, walk.tile(step) * bk,
                                      kv_len, False, slot=slot)
            kv_slot = layout.kv_slot(slot)
            k, v = layout.read(k_ref, k_stage, kv_slot, kv=True), layout.read(v_ref, v_stage, kv_slot, kv=True)
            s, _ = _scores(dot(layout.read(q_ref, q_stage, slot), k, (1, 1)), ctx, problem, masked)
            m = m_ref[slot]
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new)
            l_ref[slot] = l_ref[slot] * alpha + jnp.sum(p, axis=1, keepdims=True)
            if problem.features.dropout_rate > 0:  # l sums kept and dropped weights: dropout acts after softmax
                p = p * _dropout_scale(ctx, problem)
            acc_ref[slot] = acc_ref[slot] * alpha + dot(p.astype(v.dtype), v, (1, 0))
            m_ref[slot] = m_new

        layout.for_heads(head)

    common.run_step(walk, step, body)

    @pl.when(last)
    def _():
        rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)

        def head(slot):  # out (normalised in the accumulator), lse and the row max of one head
            l, m = l_ref[slot], m_ref[slot]
            row_valid = (rows < scalars.q_len[b]) & (l != 0)  # l = 0: no key attended
            safe_l = jnp.where(row_valid, l, 1.0)
            acc_ref[slot] = jnp.where(row_valid, acc_ref[slot] / safe_l, 0.0)
            layout.store_row(lse_ref, slot, jnp.where(row_valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf).T)
            if num_out == 3:  # m is the row max of the base-2 scores
                layout.store_row(out_refs[2], slot, jnp.where(row_valid, m * LN2, -jnp.inf).T)

        layout.for_heads(head)
        layout.unstage(acc_ref, out_ref)


def forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    """(out `[B, T, N, Dv]`, lse `[B, N, T]`[, row max]) of padded q `[B, T, N, D]`, k `[B|1, S, K, D]`,
    v `[B|1, S, K, Dv]` (the core's layout, read in place or transposed: `common.SeqLayout`)."""
    batch, t_pad, num_heads, d_pad = q.shape
    s_pad, num_kv_heads, dv_pad = k.shape[1], k.shape[2], v.shape[3]
    cfg = problem.config
    bq, bk = cfg.block_q, cfg.block_k
    out_dtype = q.dtype
    dtype = common.compute_dtype(q.dtype)
    layout = common.kernel_layout(problem, q, v, num_kv_heads, "forward", (bq, bk))
    qh = layout.view(q.astype(dtype))
    kh, vh = (layout.view(x.astype(dtype), kv=True) for x in (k, v))
    num_kv_tiles = s_pad // bk

    def kv_tile(b, block, i, step, *scalar_refs):
        scalars = common.scalars_of(problem, scalar_refs, "q")
        return common.q_walk(problem, scalars, b, layout.head(block, 0), i, num_kv_tiles).tile(step)

    def kv_batch(b):
        return 0 if problem.kv_broadcast else b

    maps = dict(b=lambda b, h, i, s, *r: b, h=lambda b, h, i, s, *r: h, q=lambda b, h, i, s, *r: i, kv=kv_tile)
    extra, extra_specs, to_refs = common.optional_inputs(problem, optional, "q", maps, (t_pad, s_pad),
                                                         heads=layout.heads)
    q_tile = lambda b, block, i, s, *r: (b, block, i)  # noqa: E731

    def kv_spec(dim):
        return layout.spec(bk, dim, lambda b, block, i, s, *r: (kv_batch(b), layout.kv_block(block),
                                                               kv_tile(b, block, i, s, *r)), kv=True)

    num_out = 3 if problem.features.return_max else 2
    row_shape = common.output((batch, num_heads, 1, t_pad), jnp.float32, q, k, v)
    scalar_inputs = common.scalar_inputs(problem, q_len, kv_len, optional, "q")
    stages = [layout.stage_shape(bq, d_pad, qh.dtype), layout.stage_shape(bk, d_pad, kh.dtype, kv=True),
              layout.stage_shape(bk, dv_pad, vh.dtype, kv=True)]
    heads = layout.q_heads
    grid = common.step_grid(problem, "q", (t_pad, s_pad),
                            num_kv_tiles if problem.table_shape is None else _table_steps(optional),
                            batch * (num_heads // heads))
    kernel = functools.partial(_forward_kernel, problem=problem, layout=layout, grid=grid, num_kv_tiles=num_kv_tiles,
                               to_refs=to_refs, num_out=num_out, stages=tuple(map(len, stages)))
    scalar_inputs = [*grid.scalar_inputs(), *scalar_inputs]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalar_inputs),
        grid=grid.shape(batch, num_heads // heads),
        in_specs=grid.specs([layout.spec(bq, d_pad, q_tile), kv_spec(d_pad), kv_spec(dv_pad), *extra_specs]),
        out_specs=grid.specs([layout.spec(bq, dv_pad, q_tile),
                              *(layout.row_spec(bq, q_tile) for _ in range(num_out - 1))]),
        scratch_shapes=[pltpu.VMEM((heads, bq, 1), jnp.float32), pltpu.VMEM((heads, bq, 1), jnp.float32),
                        pltpu.VMEM((heads, bq, dv_pad), jnp.float32), *(x for stage in stages for x in stage)],
    )
    results = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        # float16 leaves the kernel in float32 (Mosaic TPU cannot pack float16), cast below
        out_shape=[common.output(layout.shape(batch, t_pad, num_heads, dv_pad), dtype, q, k, v),
                   *(row_shape for _ in range(num_out - 1))],
        name="probjax_tpu_forward",
        **common.compiler_params(problem, grid.semantics(), layout),
    )(*scalar_inputs, qh, kh, vh, *extra)
    out, *rows = results
    return (layout.unview(out).astype(out_dtype), *(r[:, :, 0] for r in rows))


def _table_steps(optional: dict) -> int:
    """Steps of a `BlockMask` row: its partial entries then its full ones."""
    tables = optional["kv_tables"]
    return tables[1].shape[-1] + tables[3].shape[-1]
