"""The flash-attention backward as one Pallas Mosaic TPU kernel (`FlashConfig.fused_backward`): the dK/dV
kernel's (B, K, key tile, step) walk (`backward._dkv_kernel`), which also adds each step's dS^T K to the dQ
rows of its query tile, so QK^T and dO V^T are computed once per tile pair (5 tile matmuls against the two
kernels' 7).

dQ accumulates in a float32 array in HBM (`memory_space=ANY`) in the layout's own order (`[B, T, N, D]` in
place, so that no transpose of it runs in XLA; `[B, N, T, D]` transposed): a visited step reads its query
tile's rows of its heads, adds, and writes them back, with DMAs it waits on, so the sum over key tiles happens in one
program in a fixed order (deterministic, no atomics). That makes the key-tile axis sequential ("arbitrary"):
only the batch and head-block axes run in parallel. The program zeroes its heads' dQ rows at its first step.
delta = rowsum(dO * O) - d lse comes from XLA. Calls that need the dQ kernel's own
outputs (dS for a bias gradient, hook array gradients) take the two kernels (`fusable`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._scores import base2_lse
from probjax_kernels.tpu import backward as two_kernels
from probjax_kernels.tpu import common
from probjax_kernels.tpu.common import dot


def fusable(tangents: _Tangents, tile_grads: tuple) -> bool:
    """Whether a backward can run fused: q, k and v all get gradients, and neither a bias nor a hook array
    does (their sums come from the dQ kernel's dS)."""
    return bool(tangents.q and tangents.k and tangents.v and not tangents.bias and not tile_grads)


def _fused_kernel(*refs, problem: _Problem, layout: common.SeqLayout, grid: common.StepGrid, num_q_tiles: int,
                  steps: int, step_heads: int, program_heads: int, to_refs, stages: tuple[int, ...]):
    (b, block, j, step, last), refs = grid.ids(refs)
    n_scalar = common.num_scalars(problem)
    scalars = common.scalars_of(problem, refs[:n_scalar], "kv")
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *rest = refs[n_scalar:]
    rest, (q_stage, do_stage, k_stage, v_stage) = common.split_stages(rest, stages)
    *optional, dk_ref, dv_ref, dq_hbm, dk_acc, dv_acc, dq_rows, dq_part, sems = rest
    opt = to_refs(optional)
    bq = problem.config.block_q
    # in place: every query head of the block each step; transposed: the group's heads one after the other
    head, q_step = (0, step) if layout.in_place else (step // steps, step % steps)
    walk = common.kv_walk(problem, scalars, b, block, head, j, num_q_tiles)
    q_tile = walk.tile(q_step)
    first_head = block * program_heads + head  # of this step's `step_heads` query heads

    def rows_of(first, tile):  # the dQ rows of `step_heads` heads from `first` on query tile `tile`
        heads, rows = pl.ds(first, step_heads), pl.ds(tile * bq, bq)
        return dq_hbm.at[b, rows, heads, :] if layout.in_place else dq_hbm.at[b, heads, rows, :]

    @pl.when((j == 0) & (step == 0))
    def _():  # this program's dQ rows start at zero
        dq_rows[...] = jnp.zeros(dq_rows.shape, jnp.float32)

        def zero(n, carry):
            copy = pltpu.make_async_copy(dq_rows, rows_of(block * program_heads + n // num_q_tiles * step_heads,
                                                          n % num_q_tiles), sems.at[0])
            copy.start()
            copy.wait()
            return carry

        jax.lax.fori_loop(0, num_q_tiles * (program_heads // step_heads), zero, 0)

    @pl.when(step == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)
        layout.stage(k_ref, k_stage, kv=True)
        layout.stage(v_ref, v_stage, kv=True)

    read = pltpu.make_async_copy(rows_of(first_head, q_tile), dq_rows, sems.at[0])
    write = pltpu.make_async_copy(dq_rows, rows_of(first_head, q_tile), sems.at[1])
    visited = walk.visited(q_step)

    @pl.when(visited)
    def _():
        read.start()  # overlaps the step's matmuls
        layout.stage(q_ref, q_stage)
        layout.stage(do_ref, do_stage)

    step_of = two_kernels.KeyTileStep(
        problem, layout, opt, scalars.kv_len[b], (b, block, head, j, q_tile),
        (q_ref, q_stage, k_ref, k_stage, v_ref, v_stage, do_ref, do_stage, lse2_ref, delta_ref), (dk_acc, dv_acc))

    def body(masked: bool):
        def one(slot):
            _, k, _, ds, _ = step_of(slot, masked)
            dq_part[slot if layout.in_place else 0] = dot(ds.astype(k.dtype), k, (0, 0))

        layout.for_heads(one)

    common.run_step(walk, q_step, body)

    @pl.when(visited)
    def _():
        read.wait()
        if layout.in_place:  # (heads, rows, D) parts into the (rows, heads, D) rows, head by head
            for slot in range(step_heads):
                layout.store(dq_rows, slot, layout.load(dq_rows, slot) + dq_part[slot])
        else:
            dq_rows[...] += dq_part[...]
        write.start()
        write.wait()

    @pl.when(last)
    def _():
        dk_acc[...] = dk_acc[...] * problem.features.scale
        layout.unstage(dk_acc, dk_ref, kv=True)
        layout.unstage(dv_acc, dv_ref, kv=True)


def fused_backward(problem: _Problem, layout: common.SeqLayout, shapes, qh, kh, vh, doh, lse2, delta,
                   scalar_inputs, optional: dict, varying):
    """(dQ float32, scaled; dK, dV), each in `layout`'s arrays, of padded inputs in `layout`'s arrays, on the
    dK/dV kernel's tiles."""
    (batch, t_pad, num_heads, d_pad), (kv_batch, s_pad, num_kv_heads, dv_pad) = shapes
    walk = two_kernels.dkv_walk(problem, layout, (t_pad, s_pad), optional)
    problem, steps = walk.problem, walk.steps
    bq, bk = problem.config.block_q, problem.config.block_k
    num_q_tiles, group = t_pad // bq, problem.group
    step_heads = layout.q_heads if layout.in_place else 1
    program_heads = layout.q_heads if layout.in_place else group
    out_batch, out_dtype = (batch, jnp.float32) if problem.kv_broadcast else (kv_batch, kh.dtype)
    out_shape = [common.output(layout.shape(out_batch, s_pad, num_kv_heads, dim, kv=True), out_dtype, *varying)
                 for dim in (d_pad, dv_pad)]
    out_shape.append(common.output(layout.shape(batch, t_pad, num_heads, d_pad), jnp.float32, *varying))
    stages = [layout.stage_shape(bq, d_pad, qh.dtype), layout.stage_shape(bq, dv_pad, doh.dtype),
              layout.stage_shape(bk, d_pad, kh.dtype, kv=True), layout.stage_shape(bk, dv_pad, vh.dtype, kv=True)]
    kv_heads = layout.kv_heads
    grid = common.step_grid(problem, "kv", (t_pad, s_pad), steps, batch * (num_kv_heads // kv_heads),
                            head_steps=walk.head_steps)
    kernel = functools.partial(_fused_kernel, problem=problem, layout=layout, grid=grid, num_q_tiles=num_q_tiles,
                               steps=steps, step_heads=step_heads, program_heads=program_heads,
                               to_refs=walk.to_refs, stages=tuple(map(len, stages)))
    scalar_inputs = [*grid.scalar_inputs(), *scalar_inputs]
    # the key-tile axis is sequential: its steps add to the same dQ rows
    semantics = ("parallel", "parallel", "arbitrary") if grid.flat else ("parallel", "parallel", "arbitrary",
                                                                         "arbitrary")
    dk, dv, dq = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_inputs),
            grid=grid.shape(batch, num_kv_heads // kv_heads),
            in_specs=grid.specs([walk.q_side(d_pad), walk.kv_side(d_pad, True), walk.kv_side(dv_pad, True),
                                 walk.q_side(dv_pad), walk.row, walk.row, *walk.extra_specs]),
            out_specs=[*grid.specs([walk.kv_side(d_pad, False), walk.kv_side(dv_pad, False)]),
                       pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((kv_heads, bk, d_pad), jnp.float32),
                            pltpu.VMEM((kv_heads, bk, dv_pad), jnp.float32),
                            pltpu.VMEM(layout.shape(1, bq, step_heads, d_pad)[1:], jnp.float32),  # dQ rows
                            pltpu.VMEM((step_heads, bq, d_pad), jnp.float32), pltpu.SemaphoreType.DMA((2,)),
                            *(x for stage in stages for x in stage)],
        ),
        out_shape=out_shape,
        name="probjax_tpu_backward_fused",
        **common.compiler_params(problem, semantics, layout),
    )(*scalar_inputs, qh, kh, vh, doh, common.as_rows(lse2), common.as_rows(delta), *walk.extra)
    if problem.kv_broadcast:
        dk, dv = (jnp.sum(g, axis=0, keepdims=True).astype(x.dtype) for g, x in ((dk, kh), (dv, vh)))
    return dq * problem.features.scale, dk, dv


def backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse) -> dict:
    """The q, k, v gradients of `backward.backward` from the fused kernel (`fusable` calls)."""
    q, k, v, out, lse = res["q"], res["k"], res["v"], res["out"], res["lse"]
    # delta = rowsum(dO * O) - d lse: exact products accumulated in float32, with no float32 copy of O or dO
    delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(out.dtype), out, preferred_element_type=jnp.float32)
    if d_lse is not None:
        delta = delta - jnp.where(jnp.isfinite(lse), d_lse.astype(jnp.float32), 0.0)
    optional = dict(res["others"], bias=res["bias"], score_consts=res["score_consts"])
    scalars = common.scalar_inputs(problem, res["q_len"], res["kv_len"], optional, "kv")
    cfg = problem.config
    layout = common.kernel_layout(problem, q, v, k.shape[2], "dkv", (cfg.block_q_dkv, cfg.block_k_dkv))
    dtype = common.compute_dtype(q.dtype)
    qh, doh = (layout.view(x.astype(dtype)) for x in (q, d_out))
    kh, vh = (layout.view(x.astype(dtype), kv=True) for x in (k, v))
    dq, dk, dv = fused_backward(problem, layout, (q.shape, v.shape), qh, kh, vh, doh, base2_lse(lse), delta,
                                scalars, optional, (q, k, v, d_out))
    # scaled and cast in place (transposed: before the transpose to [B, T, N, D], no float32 copy of dQ there)
    return dict(q=layout.unview(dq.astype(q.dtype)), k=layout.unview(dk, kv=True).astype(k.dtype),
                v=layout.unview(dv, kv=True).astype(v.dtype))
