"""The forward-mode tangent kernel in Pallas Mosaic TPU (docs/forward_mode.md): (d out, d lse) of one query
tile for tangents of q, k, v, the bias and score_mod arrays, in one walk over the key tiles (the forward's
grid and walk), with the two sums in VMEM scratch.

With p = softmax(s) known from lse, d p_j = p_j (d s_j - c) where c = sum_j p_j d s_j, so
d out = sum_j p_j z_j (d s_j v_j + d v_j) - c out and d lse = c (z: the dropout factor; out is already
dropped)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._scores import _dropout_scale, _score_tangents
from probjax_kernels.tpu import common
from probjax_kernels.tpu.common import dot


def _tangent_kernel(*refs, problem: _Problem, layout: common.SeqLayout, grid: common.StepGrid, tangents: _Tangents,
                    num_kv_tiles: int, to_refs, stages: tuple[int, ...]):
    (b, block, i, step, last), refs = grid.ids(refs)
    n_scalar = common.num_scalars(problem)
    scalars = common.scalars_of(problem, refs[:n_scalar], "q")
    q_ref, k_ref, v_ref, out_ref, lse2_ref, *rest = refs[n_scalar:]
    rest, (q_stage, out_stage, dq_stage, k_stage, v_stage, dk_stage, dv_stage) = common.split_stages(rest, stages)
    dq_ref = rest.pop(0) if tangents.q else None
    dk_ref = rest.pop(0) if tangents.k else None
    dv_ref = rest.pop(0) if tangents.v else None
    *input_refs, d_out_ref, d_lse_ref, acc_ref, c_ref = rest
    opt = to_refs(input_refs)
    bq, bk = problem.config.block_q, problem.config.block_k
    walk = common.q_walk(problem, scalars, b, layout.head(block, 0), i, num_kv_tiles)
    dropout = problem.features.dropout_rate > 0

    @pl.when(step == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        c_ref[...] = jnp.zeros(c_ref.shape, jnp.float32)
        for ref, stage in ((q_ref, q_stage), (out_ref, out_stage), (dq_ref, dq_stage)):
            if ref is not None:
                layout.stage(ref, stage)

    @pl.when(walk.visited(step))
    def _():
        for ref, stage in ((k_ref, k_stage), (v_ref, v_stage), (dk_ref, dk_stage), (dv_ref, dv_stage)):
            if ref is not None:
                layout.stage(ref, stage, kv=True)

    def body(masked: bool):
        def head(slot):
            kv_slot = layout.kv_slot(slot)
            ctx = common.tile_context(opt, problem, b, layout.head(block, slot), i * bq, walk.tile(step) * bk,
                                      scalars.kv_len[b], False, tangents, slot=slot)
            q = layout.read(q_ref, q_stage, slot)
            k, v = layout.read(k_ref, k_stage, kv_slot, kv=True), layout.read(v_ref, v_stage, kv_slot, kv=True)
            d_dot = None if dq_ref is None else dot(layout.read(dq_ref, dq_stage, slot), k, (1, 1))
            if dk_ref is not None:
                q_dk = dot(q, layout.read(dk_ref, dk_stage, kv_slot, kv=True), (1, 1))
                d_dot = q_dk if d_dot is None else d_dot + q_dk
            s2, ds = _score_tangents(dot(q, k, (1, 1)), d_dot, ctx, problem, masked)
            p = jnp.exp2(s2 - layout.row(lse2_ref, slot).T)
            scale = _dropout_scale(ctx, problem) if dropout else None
            if ds is not None:
                p_ds = jnp.where(p > 0, p * ds, 0.0)  # a non-finite tangent where p = 0 must not leak
                c_ref[slot] += jnp.sum(p_ds, axis=1, keepdims=True)
                if dropout:
                    p_ds = p_ds * scale
                acc_ref[slot] += dot(p_ds.astype(v.dtype), v, (1, 0))
            if dv_ref is not None:
                p_kept = p * scale if dropout else p
                dv = layout.read(dv_ref, dv_stage, kv_slot, kv=True)
                acc_ref[slot] += dot(p_kept.astype(dv.dtype), dv, (1, 0))

        layout.for_heads(head)

    common.run_step(walk, step, body)

    @pl.when(last)
    def _():
        def head(slot):
            c = c_ref[slot]
            acc_ref[slot] = acc_ref[slot] - c * layout.read(out_ref, out_stage, slot).astype(jnp.float32)
            layout.store_row(d_lse_ref, slot, c.T)

        layout.for_heads(head)
        layout.unstage(acc_ref, d_out_ref)


def tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, out, lse2, linear: dict,
            optional: dict):
    """(d out `[B, T, N, Dv]`, d lse `[B, N, T]`) for the tangents in `linear` (dq, dk, dv; d_bias and
    d_score_consts in `optional`), of padded inputs in the core's layout; lse2 is `base2_lse`'s."""
    batch, t_pad, num_heads, d_pad = q.shape
    s_pad, dv_pad = k.shape[1], v.shape[3]
    bq, bk = problem.config.block_q, problem.config.block_k
    num_kv_tiles, group = s_pad // bk, problem.group
    dtype = common.compute_dtype(q.dtype)
    layout = common.kernel_layout(problem, q, v, k.shape[2], "tangent", (bq, bk))
    heads = lambda x, kv=False: layout.view(x.astype(dtype), kv)  # noqa: E731

    def kv_tile(b, block, i, s, *scalar_refs):
        scalars = common.scalars_of(problem, scalar_refs, "q")
        return common.q_walk(problem, scalars, b, layout.head(block, 0), i, num_kv_tiles).tile(s)

    maps = dict(b=lambda b, h, i, s, *r: b, h=lambda b, h, i, s, *r: h, q=lambda b, h, i, s, *r: i, kv=kv_tile)
    extra, extra_specs, to_refs = common.optional_inputs(problem, optional, "q", maps, (t_pad, s_pad), tangents,
                                                         heads=layout.heads)
    kv_b = (lambda b: 0) if problem.kv_broadcast else (lambda b: b)

    q_tile = lambda b, h, i, s, *r: (b, h, i)  # noqa: E731

    def q_side(dim):
        return layout.spec(bq, dim, q_tile)

    def kv_side(dim):
        return layout.spec(bk, dim, lambda b, block, i, s, *r: (kv_b(b), layout.kv_block(block),
                                                               kv_tile(b, block, i, s, *r)), kv=True)

    row = layout.row_spec(bq, q_tile)
    lin, lin_specs = [], []
    for name, spec in (("q", q_side(d_pad)), ("k", kv_side(d_pad)), ("v", kv_side(dv_pad))):
        if getattr(tangents, name):
            lin.append(heads(linear[name], name != "q"))
            lin_specs.append(spec)
    scalar_inputs = common.scalar_inputs(problem, q_len, kv_len, optional, "q")
    steps = num_kv_tiles if problem.table_shape is None else (
        optional["kv_tables"][1].shape[-1] + optional["kv_tables"][3].shape[-1])
    stages = [layout.stage_shape(bq, d_pad, dtype), layout.stage_shape(bq, dv_pad, dtype),
              layout.stage_shape(bq, d_pad, dtype) if tangents.q else [],
              layout.stage_shape(bk, d_pad, dtype, kv=True), layout.stage_shape(bk, dv_pad, dtype, kv=True),
              layout.stage_shape(bk, d_pad, dtype, kv=True) if tangents.k else [],
              layout.stage_shape(bk, dv_pad, dtype, kv=True) if tangents.v else []]
    heads_per_block = layout.q_heads
    grid = common.step_grid(problem, "q", (t_pad, s_pad), steps,
                            batch * (num_heads // heads_per_block))
    kernel = functools.partial(_tangent_kernel, problem=problem, layout=layout, grid=grid, tangents=tangents,
                               num_kv_tiles=num_kv_tiles, to_refs=to_refs, stages=tuple(map(len, stages)))
    scalar_inputs = [*grid.scalar_inputs(), *scalar_inputs]
    varying = (q, k, v, *(linear[name] for name in "qkv" if name in linear))
    d_out, d_lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_inputs),
            grid=grid.shape(batch, num_heads // heads_per_block),
            in_specs=grid.specs([q_side(d_pad), kv_side(d_pad), kv_side(dv_pad), q_side(dv_pad), row, *lin_specs,
                                 *extra_specs]),
            out_specs=grid.specs([q_side(dv_pad), row]),
            scratch_shapes=[pltpu.VMEM((heads_per_block, bq, dv_pad), jnp.float32),
                            pltpu.VMEM((heads_per_block, bq, 1), jnp.float32), *(x for stage in stages for x in stage)],
        ),
        out_shape=[common.output(layout.shape(batch, t_pad, num_heads, dv_pad), dtype, *varying),  # float16: cast
                   common.output((batch, num_heads, 1, t_pad), jnp.float32, *varying)],
        name="probjax_tpu_tangent",
        **common.compiler_params(problem, grid.semantics(), layout),
    )(*scalar_inputs, heads(q), heads(k, True), heads(v, True), heads(out), common.as_rows(lse2), *lin, *extra)
    return layout.unview(d_out).astype(out.dtype), d_lse[:, :, 0]
