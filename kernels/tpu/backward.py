"""The flash-attention backward in Pallas Mosaic TPU (FlashAttention-2, Alg. 2), without atomics so the
gradients are deterministic: the dQ kernel (a (B, N, query tile, step) grid walking key tiles, which can also
write dS for the bias gradient) and the dK/dV kernel (a (B, K, key tile, step) grid whose steps walk the query
tiles of each query head of the GQA group in turn, so the group's sum happens in VMEM, with K / V never
repeated). lse and delta enter both as lane-dense rows: the dK/dV kernel computes the transposed scores k q^T
and uses them as they are, the dQ kernel transposes them to columns."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._scores import _dropout_scale, _scores, backward_delta, base2_lse
from probjax_kernels.tpu import common, hook_grads
from probjax_kernels.tpu.common import dot


def with_tiles(problem: _Problem, block_q: int, block_k: int) -> _Problem:
    """The problem as a kernel on (block_q, block_k) tiles sees it (`common` reads config.block_q / block_k)."""
    config = dataclasses.replace(problem.config, block_q=block_q, block_k=block_k)
    return dataclasses.replace(problem, config=config)


def _tile_gradient(s, do, v, delta, lse2, derivative, ctx, problem: _Problem, transposed: bool):
    """(p with dropout, dS, d loss / d score_mod(score)) of one tile; transposed tiles are (keys, queries)
    with lse / delta as rows."""
    p = jnp.exp2(s - lse2)
    dp = dot(v, do, (1, 1)) if transposed else dot(do, v, (1, 1))
    p_dropped = p
    if problem.features.dropout_rate > 0:
        scale = _dropout_scale(ctx, problem)
        dp, p_dropped = dp * scale, p * scale
    d_modded = p * (dp - delta)
    ds = d_modded if derivative is None else d_modded * derivative
    return p_dropped, ds, d_modded


def _score_before_hook(qk, ctx, problem: _Problem):
    """The score the score_mod sees (as in `_scores`): scale * q k^T + bias."""
    s = qk * problem.features.scale
    return s if ctx.bias is None else s + ctx.bias.astype(jnp.float32)


# --------------------------------------------------------------------------------------------- dQ kernel


def _dq_kernel(*refs, problem: _Problem, layout: common.SeqLayout, grid: common.StepGrid, num_kv_tiles: int,
               to_refs, emit_ds: bool, bias_sums: bool, grads: tuple, stages: tuple[int, ...]):
    (b, block, i, step, last), refs = grid.ids(refs)
    n_scalar = common.num_scalars(problem)
    scalars = common.scalars_of(problem, refs[:n_scalar], "q")
    q_ref, k_ref, v_ref, do_ref, out_ref, lse2_ref, d_lse_ref, *rest = refs[n_scalar:]
    rest, (q_stage, do_stage, k_stage, v_stage) = common.split_stages(rest, stages)
    n_grads = sum(g.axis == "q" for g in grads)
    grad_accs = rest[len(rest) - n_grads:]
    acc_ref, delta_ref, *bias_acc = rest[len(rest) - n_grads - 2 - bias_sums:len(rest) - n_grads]
    rest = rest[:len(rest) - n_grads - 2 - bias_sums]
    num_out = 2 + emit_ds + bias_sums + n_grads
    dq_ref, delta_out_ref, *outs = rest[len(rest) - num_out:]
    ds_ref = outs[0] if emit_ds else None
    bias_out = outs[emit_ds] if bias_sums else None
    grad_outs = outs[len(outs) - n_grads:]
    opt = to_refs(rest[:len(rest) - num_out])
    bq, bk = problem.config.block_q, problem.config.block_k
    walk = _dq_walk(problem, scalars, b, layout.head(block, 0), i, num_kv_tiles, emit_ds)
    with_derivative = problem.features.score_mod is not None

    @pl.when(step == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        hook_grads.zero([*bias_acc, *grad_accs])
        layout.stage(q_ref, q_stage)
        layout.stage(do_ref, do_stage)
        for slot in range(layout.q_heads):  # delta = rowsum(dO * O) - d lse, for this kernel and dK/dV's
            d_out, out = (layout.load(ref, slot).astype(jnp.float32) for ref in (do_ref, out_ref))
            d_lse = jnp.where(layout.row(lse2_ref, slot) < jnp.inf, layout.row(d_lse_ref, slot), 0.0)
            delta = jnp.sum(d_out * out, axis=1, keepdims=True) - d_lse.T
            delta_ref[slot] = delta
            layout.store_row(delta_out_ref, slot, delta.T)

    if emit_ds:  # every dS block is written: skipped tiles get zeros
        ds_ref[...] = jnp.zeros(ds_ref.shape, jnp.float32)

    @pl.when(walk.visited(step))
    def _():
        layout.stage(k_ref, k_stage, kv=True)
        layout.stage(v_ref, v_stage, kv=True)

    def body(masked: bool):
        def head(slot):
            ctx = common.tile_context(opt, problem, b, layout.head(block, slot), i * bq, walk.tile(step) * bk,
                                      scalars.kv_len[b], False, slot=slot)
            kv_slot = layout.kv_slot(slot)
            k, v = layout.read(k_ref, k_stage, kv_slot, kv=True), layout.read(v_ref, v_stage, kv_slot, kv=True)
            qk = dot(layout.read(q_ref, q_stage, slot), k, (1, 1))
            s, derivative = _scores(qk, ctx, problem, masked, with_derivative)
            _, ds, d_modded = _tile_gradient(s, layout.read(do_ref, do_stage, slot), v, delta_ref[slot],
                                             layout.row(lse2_ref, slot).T, derivative, ctx, problem, False)
            hook_grads.accumulate(grads, "q", problem, opt.score_consts, grad_accs, None,
                                  _score_before_hook(qk, ctx, problem), d_modded, ctx)
            if emit_ds:
                common.store_head_tile(ds_ref, slot, ds)
            if bias_sums:  # a bias broadcast over the keys: its gradient sums dS over them
                bias_acc[0][slot] += jnp.sum(ds, axis=1, keepdims=True)
            acc_ref[slot] += dot(ds.astype(k.dtype), k, (1, 0))

        layout.for_heads(head)

    common.run_step(walk, step, body)

    @pl.when(last)
    def _():
        acc_ref[...] = acc_ref[...] * problem.features.scale
        layout.unstage(acc_ref, dq_ref)
        hook_grads.store(grad_accs, grad_outs)
        for slot in range(layout.q_heads if bias_sums else 0):
            layout.store_row(bias_out, slot, bias_acc[0][slot].T)


def _dq_walk(problem, scalars, b, h, i, num_kv_tiles: int, emit_ds: bool) -> common.Walk:
    """The dQ kernel's walk; with dS written, every key tile is a step (each dS block is written once)."""
    walk = common.q_walk(problem, scalars, b, h, i, num_kv_tiles)
    if not emit_ds:
        return walk
    lo = walk.tile(0)
    visits = lambda j: walk.visited(j - lo) & (j >= lo) & (walk.tile(j - lo) == j)  # noqa: E731
    return common.Walk(tile=lambda j: j, visited=visits, masked=lambda j: walk.masked(j - lo),
                       always_masked=walk.always_masked)


def _backward_dq(problem: _Problem, layout: common.SeqLayout, shapes, qh, kh, vh, doh, outh, lse2, d_lse,
                 scalar_inputs, optional: dict, emit_ds: bool, bias_sums: bool, varying, grads: tuple = ()):
    """(dQ, delta rows `[B, N, 1, T]` for the dK/dV kernel[, dS `[B, N, T, S]`][, dS summed over the keys as
    rows `[B, N, 1, T]` (`bias_sums`)][, hook array gradient blocks]); the kernel computes delta =
    rowsum(dO * O) - d lse at each query tile's first step."""
    (batch, t_pad, num_heads, d_pad), (_, s_pad, _, dv_pad) = shapes
    problem = with_tiles(problem, problem.config.block_q_dq, problem.config.block_k_dq)
    bq, bk = problem.config.block_q, problem.config.block_k
    num_kv_tiles, heads = s_pad // bk, layout.q_heads
    steps = num_kv_tiles if problem.table_shape is None or emit_ds else _table_steps(optional["kv_tables"])

    def kv_tile(b, block, i, s, *scalar_refs):
        scalars = common.scalars_of(problem, scalar_refs, "q")
        return _dq_walk(problem, scalars, b, layout.head(block, 0), i, num_kv_tiles, emit_ds).tile(s)

    maps = dict(b=lambda b, h, i, s, *r: b, h=lambda b, h, i, s, *r: h, q=lambda b, h, i, s, *r: i, kv=kv_tile)
    extra, extra_specs, to_refs = common.optional_inputs(problem, optional, "q", maps, (t_pad, s_pad),
                                                         heads=layout.heads)
    kv_b = (lambda b: 0) if problem.kv_broadcast else (lambda b: b)
    q_tile = lambda b, block, i, s, *r: (b, block, i)  # noqa: E731

    def kv_side(dim):
        return layout.spec(bk, dim, lambda b, block, i, s, *r: (kv_b(b), layout.kv_block(block),
                                                               kv_tile(b, block, i, s, *r)), kv=True)

    row = layout.row_spec(bq, q_tile)
    out_specs = [layout.spec(bq, d_pad, q_tile), row]
    out_shape = [common.output(qh.shape, qh.dtype, *varying),
                 common.output((batch, num_heads, 1, t_pad), jnp.float32, *varying)]
    if emit_ds:
        out_specs.append(pl.BlockSpec((None, heads if layout.in_place else None, bq, bk),
                                      lambda b, block, i, s, *r: (b, block, i, s)))
        out_shape.append(common.output((batch, num_heads, t_pad, s_pad), jnp.float32, *varying))
    if bias_sums:
        out_specs.append(row)
        out_shape.append(common.output((batch, num_heads, 1, t_pad), jnp.float32, *varying))
    grad_shapes, grad_specs, grad_scratch = hook_grads.outputs(
        grads, "q", (batch, num_heads), (None, None), lambda b, h, i, s, *r: (b, h), t_pad, bq, varying)
    stages = [layout.stage_shape(bq, d_pad, qh.dtype), layout.stage_shape(bq, dv_pad, doh.dtype),
              layout.stage_shape(bk, d_pad, kh.dtype, kv=True), layout.stage_shape(bk, dv_pad, vh.dtype, kv=True)]
    grid = common.step_grid(problem, "q", (t_pad, s_pad), steps,
                            batch * (num_heads // heads), every_step=emit_ds)
    kernel = functools.partial(_dq_kernel, problem=problem, layout=layout, grid=grid, num_kv_tiles=num_kv_tiles,
                               to_refs=to_refs, emit_ds=emit_ds, bias_sums=bias_sums, grads=grads,
                               stages=tuple(map(len, stages)))
    scalar_inputs = [*grid.scalar_inputs(), *scalar_inputs]
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_inputs),
            grid=grid.shape(batch, num_heads // heads),
            in_specs=grid.specs([layout.spec(bq, d_pad, q_tile), kv_side(d_pad), kv_side(dv_pad),
                                 layout.spec(bq, dv_pad, q_tile), layout.spec(bq, dv_pad, q_tile), row, row,
                                 *extra_specs]),
            out_specs=grid.specs([*out_specs, *grad_specs]),
            scratch_shapes=[pltpu.VMEM((heads, bq, d_pad), jnp.float32), pltpu.VMEM((heads, bq, 1), jnp.float32),
                            *[pltpu.VMEM((heads, bq, 1), jnp.float32)] * bias_sums, *grad_scratch,
                            *(x for stage in stages for x in stage)],
        ),
        out_shape=[*out_shape, *grad_shapes],
        name="probjax_tpu_backward_dq",
        **common.compiler_params(problem, grid.semantics(), layout),
    )(*scalar_inputs, qh, kh, vh, doh, outh, common.as_rows(lse2), common.as_rows(d_lse), *extra)


# ------------------------------------------------------------------------------------------ dK/dV kernel


@dataclasses.dataclass(frozen=True)
class KeyTileStep:
    """One query head's step of the key-tile walk (the dK/dV and fused kernels): `step_of(slot, masked)`
    computes the transposed (keys, queries) scores and gradient tile of query head `slot` of the program against
    its key tile, adds dV += P^T dO and dK += dS^T Q (unscaled) to the float32 accumulators, and returns
    (ctx, k, kq, dS, d loss / d score_mod(score)) for what the kernel adds to it."""

    problem: _Problem  # on the kernel's tiles
    layout: common.SeqLayout
    opt: object  # the kernel's optional refs (`to_refs`)
    kv_len: jnp.ndarray
    # (batch, head block, head of the group (transposed), key tile, the step's query tile: `walk.tile(step)`, read
    # once for every head of the step)
    ids: tuple
    blocks: tuple  # (q, q stage, k, k stage, v, v stage, dO, dO stage, lse2 rows, delta rows)
    accs: tuple  # (dK, dV) float32 scratch

    def __call__(self, slot, masked: bool):
        problem, layout = self.problem, self.layout
        b, block, head, j, q_tile = self.ids
        q_ref, q_stage, k_ref, k_stage, v_ref, v_stage, do_ref, do_stage, lse2_ref, delta_ref = self.blocks
        dk_acc, dv_acc = self.accs
        kv_slot = layout.kv_slot(slot)
        h = layout.head(block, slot) if layout.in_place else block * problem.group + head
        ctx = common.tile_context(self.opt, problem, b, h, q_tile * problem.config.block_q,
                                  j * problem.config.block_k, self.kv_len, True, slot=slot)
        q, do = layout.read(q_ref, q_stage, slot), layout.read(do_ref, do_stage, slot)
        k = layout.read(k_ref, k_stage, kv_slot, kv=True)
        kq = dot(k, q, (1, 1))
        s, derivative = _scores(kq, ctx, problem, masked, problem.features.score_mod is not None)
        p, ds, d_modded = _tile_gradient(s, do, layout.read(v_ref, v_stage, kv_slot, kv=True),
                                         layout.row(delta_ref, slot), layout.row(lse2_ref, slot), derivative, ctx,
                                         problem, True)
        dv_acc[kv_slot] += dot(p.astype(do.dtype), do, (1, 0))
        dk_acc[kv_slot] += dot(ds.astype(q.dtype), q, (1, 0))
        return ctx, k, kq, ds, d_modded


def _dkv_kernel(*refs, problem: _Problem, layout: common.SeqLayout, grid: common.StepGrid, num_q_tiles: int,
                steps: int, to_refs, bias_sums: bool, grads: tuple, stages: tuple[int, ...]):
    (b, block, j, step, last), refs = grid.ids(refs)
    n_scalar = common.num_scalars(problem)
    scalars = common.scalars_of(problem, refs[:n_scalar], "kv")
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *rest = refs[n_scalar:]
    rest, (q_stage, do_stage, k_stage, v_stage) = common.split_stages(rest, stages)
    n_grads = sum(g.axis == "kv" for g in grads) + bias_sums  # the bias sums go first, as a hook gradient would
    grad_accs = rest[len(rest) - n_grads:]
    rest = rest[:len(rest) - n_grads]
    dk_acc, dv_acc = rest[-2:]
    grad_outs = rest[len(rest) - 2 - n_grads:-2]
    dk_ref, dv_ref = rest[-4 - n_grads:-2 - n_grads]
    opt = to_refs(rest[:-4 - n_grads])
    (bias_acc, *grad_accs), (bias_out, *grad_outs) = ([None, *x] if not bias_sums else x
                                                      for x in (grad_accs, grad_outs))
    # in place: every query head of the block each step; transposed: the group's heads one after the other
    head, q_step = (0, step) if layout.in_place else (step // steps, step % steps)
    walk = common.kv_walk(problem, scalars, b, block, head, j, num_q_tiles)

    @pl.when(step == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)
        hook_grads.zero([bias_acc, *grad_accs] if bias_sums else grad_accs)
        layout.stage(k_ref, k_stage, kv=True)
        layout.stage(v_ref, v_stage, kv=True)

    @pl.when(walk.visited(q_step))
    def _():
        layout.stage(q_ref, q_stage)
        layout.stage(do_ref, do_stage)

    step_of = KeyTileStep(problem, layout, opt, scalars.kv_len[b], (b, block, head, j, walk.tile(q_step)),
                          (q_ref, q_stage, k_ref, k_stage, v_ref, v_stage, do_ref, do_stage, lse2_ref, delta_ref),
                          (dk_acc, dv_acc))

    def body(masked: bool):
        def one(slot):
            ctx, _, kq, ds, d_modded = step_of(slot, masked)
            hook_grads.accumulate(grads, "kv", problem, opt.score_consts, grad_accs, head,
                                  _score_before_hook(kq, ctx, problem), d_modded, ctx)
            if bias_sums:  # a bias broadcast over the queries: its gradient sums dS over them
                bias_acc[slot if layout.in_place else head] += jnp.sum(ds, axis=1, keepdims=True)

        layout.for_heads(one)

    common.run_step(walk, q_step, body)

    @pl.when(last)
    def _():
        dk_acc[...] = dk_acc[...] * problem.features.scale
        layout.unstage(dk_acc, dk_ref, kv=True)
        layout.unstage(dv_acc, dv_ref, kv=True)
        hook_grads.store(grad_accs, grad_outs)
        for head in range(bias_acc.shape[0] if bias_sums else 0):
            bias_out[head] = bias_acc[head].T


@dataclasses.dataclass(frozen=True)
class DkvWalk:
    """The key-tile kernels' walk (dK/dV, fused backward): its tiles and steps, and the index maps of their
    blocks over a (B, kv head or head block, key tile, step) grid."""

    problem: _Problem  # on the dK/dV tiles
    steps: int  # per query head
    head_steps: int  # query heads walked in turn (transposed: the group; in place: 1)
    q_side: Callable  # dim -> the BlockSpec of a query-side block (q, dO)
    kv_side: Callable  # (dim, shared) -> the BlockSpec of a key-side block (k, v; dK, dV when not shared)
    row: pl.BlockSpec  # a query-side lane-dense row (lse, delta)
    extra: list  # the optional inputs, their specs and their refs' holder (`common.optional_inputs`)
    extra_specs: list
    to_refs: Callable


def dkv_walk(problem: _Problem, layout: common.SeqLayout, lengths: tuple[int, int], optional: dict) -> DkvWalk:
    """The walk of the key-tile kernels over padded (T, S) `lengths`."""
    t_pad, s_pad = lengths
    problem = with_tiles(problem, problem.config.block_q_dkv, problem.config.block_k_dkv)
    bq, bk = problem.config.block_q, problem.config.block_k
    num_q_tiles, group = t_pad // bq, problem.group
    steps = num_q_tiles if problem.table_shape is None else _table_steps(optional["q_tables"])

    def q_tile(b, block, j, s, *scalar_refs):
        scalars = common.scalars_of(problem, scalar_refs, "kv")
        head = 0 if layout.in_place else s // steps
        return common.kv_walk(problem, scalars, b, block, head, j, num_q_tiles).tile(s % steps)

    def head_of(b, block, j, s, *r):
        """The query head (transposed) or head block (in place) a step reads."""
        return block if layout.in_place else block * group + s // steps

    maps = dict(b=lambda b, kh, j, s, *r: b, h=head_of, q=q_tile, kv=lambda b, kh, j, s, *r: j)
    extra, extra_specs, to_refs = common.optional_inputs(problem, optional, "kv", maps, (t_pad, s_pad),
                                                         heads=layout.heads)
    kv_b = (lambda b: 0) if problem.kv_broadcast else (lambda b: b)

    def q_where(b, block, j, s, *r):
        return b, head_of(b, block, j, s), q_tile(b, block, j, s, *r)

    def q_side(dim):
        return layout.spec(bq, dim, q_where)

    def kv_side(dim, shared: bool):
        return layout.spec(bk, dim, lambda b, block, j, s, *r: (kv_b(b) if shared else b, block, j), kv=True)

    return DkvWalk(problem, steps, 1 if layout.in_place else group, q_side, kv_side, layout.row_spec(bq, q_where),
                   extra, extra_specs, to_refs)


def _backward_dkv(problem: _Problem, layout: common.SeqLayout, shapes, qh, kh, vh, doh, lse2, delta,
                  scalar_inputs, optional: dict, bias_sums: bool, varying, grads: tuple = ()):
    """(dK, dV, [dS summed over the queries as rows `[B, N, 1, S]` (`bias_sums`),] hook array gradient
    blocks `[B, N, ..]`)."""
    (batch, t_pad, num_heads, d_pad), (kv_batch, s_pad, num_kv_heads, dv_pad) = shapes
    walk = dkv_walk(problem, layout, (t_pad, s_pad), optional)
    problem, steps, head_steps = walk.problem, walk.steps, walk.head_steps
    bq, bk = problem.config.block_q, problem.config.block_k
    num_q_tiles, group = t_pad // bq, problem.group
    q_side, kv_side, row, extra, extra_specs, to_refs = (walk.q_side, walk.kv_side, walk.row, walk.extra,
                                                         walk.extra_specs, walk.to_refs)
    # shared k / v: a float32 gradient per query batch, summed below
    out_batch, out_dtype = (batch, jnp.float32) if problem.kv_broadcast else (kv_batch, kh.dtype)
    out_shape = [common.output(layout.shape(out_batch, s_pad, num_kv_heads, dim, kv=True), out_dtype, *varying)
                 for dim in (d_pad, dv_pad)]
    grad_shapes, grad_specs, grad_scratch = hook_grads.outputs(
        grads, "kv", (batch, num_kv_heads, group), (None, None, group), lambda b, kh, j, s, *r: (b, kh, 0), s_pad,
        bk, varying)
    if bias_sums:  # per query head of the program: the in-place block's heads, or the transposed walk's group
        heads = layout.q_heads if layout.in_place else group
        grad_shapes.insert(0, common.output((batch, num_heads, 1, s_pad), jnp.float32, *varying))
        grad_specs.insert(0, pl.BlockSpec((None, heads, 1, bk), lambda b, block, j, s, *r: (b, block, 0, j)))
        grad_scratch.insert(0, pltpu.VMEM((heads, bk, 1), jnp.float32))
    stages = [layout.stage_shape(bq, d_pad, qh.dtype), layout.stage_shape(bq, dv_pad, doh.dtype),
              layout.stage_shape(bk, d_pad, kh.dtype, kv=True), layout.stage_shape(bk, dv_pad, vh.dtype, kv=True)]
    kv_heads = layout.kv_heads
    grid = common.step_grid(problem, "kv", (t_pad, s_pad), steps,
                            batch * (num_kv_heads // kv_heads), head_steps=head_steps)
    kernel = functools.partial(_dkv_kernel, problem=problem, layout=layout, grid=grid, num_q_tiles=num_q_tiles,
                               steps=steps, to_refs=to_refs, bias_sums=bias_sums, grads=grads,
                               stages=tuple(map(len, stages)))
    scalar_inputs = [*grid.scalar_inputs(), *scalar_inputs]
    dk, dv, *grad_blocks = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_inputs),
            grid=grid.shape(batch, num_kv_heads // kv_heads),
            in_specs=grid.specs([q_side(d_pad), kv_side(d_pad, True), kv_side(dv_pad, True), q_side(dv_pad), row,
                                 row, *extra_specs]),
            out_specs=grid.specs([kv_side(d_pad, False), kv_side(dv_pad, False), *grad_specs]),
            scratch_shapes=[pltpu.VMEM((kv_heads, bk, d_pad), jnp.float32),
                            pltpu.VMEM((kv_heads, bk, dv_pad), jnp.float32), *grad_scratch,
                            *(x for stage in stages for x in stage)],
        ),
        out_shape=[*out_shape, *grad_shapes],
        name="probjax_tpu_backward_dkv",
        **common.compiler_params(problem, grid.semantics(), layout),
    )(*scalar_inputs, qh, kh, vh, doh, common.as_rows(lse2), common.as_rows(delta), *extra)
    if problem.kv_broadcast:
        dk, dv = (jnp.sum(g, axis=0, keepdims=True).astype(x.dtype) for g, x in ((dk, kh), (dv, vh)))
    bias_rows = grad_blocks.pop(0) if bias_sums else None
    # [B, K, group, ...] -> [B, N, ...]: query head kv_head * group + head
    grad_blocks = [x.reshape(batch, num_heads, *x.shape[3:]) for x in grad_blocks]
    return dk, dv, ([bias_rows] if bias_sums else []) + grad_blocks


def _table_steps(tables) -> int:
    return tables[1].shape[-1] + tables[3].shape[-1]


def backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse) -> dict:
    """Gradients of q, k, v and the bias flagged in `tangents` from `_autodiff`'s residuals (padded, in the
    core's `[B, T, N, D]` layout), and under "score_consts_by_index" those of the score_mod arrays read as
    tiles (`hook_grads`); the other score_mod arrays' come from `_chunked`, as on every backend."""
    q, k, v, out, lse = res["q"], res["k"], res["v"], res["out"], res["lse"]
    bias, q_len, kv_len = res["bias"], res["q_len"], res["kv_len"]
    lse2 = base2_lse(lse)
    d_lse = jnp.zeros(lse.shape, jnp.float32) if d_lse is None else d_lse.astype(jnp.float32)
    delta = None  # from the dQ kernel when it runs
    optional = dict(res["others"], bias=bias, score_consts=res["score_consts"])
    dtype = common.compute_dtype(q.dtype)
    shapes = (q.shape, v.shape)
    varying = (q, k, v, d_out)
    grads = {}
    tile_grads = hook_grads.tile_grads(problem, tangents)
    blocks = {}  # (array position, axis) -> accumulated blocks `[B, N, *whole, T|S, 1]`
    # The bias gradient: dS summed over the bias's broadcast axes. Over the keys (a [.., T|1, 1] bias) the dQ
    # kernel sums each row, over the queries (a [.., 1, S] one) the dK/dV kernel sums each column; only a
    # bias with both a query and a key axis takes the whole dS [B, N, T, S] (its own size up to B x N).
    bias_axes = () if not tangents.bias else tuple(axis for axis, size in enumerate(bias.shape) if size == 1)
    sum_keys, sum_queries = 3 in bias_axes, 2 in bias_axes and 3 not in bias_axes
    emit_ds = bool(tangents.bias) and not (sum_keys or sum_queries)
    if tangents.q or emit_ds or sum_keys or any(g.axis == "q" for g in tile_grads):
        scalars = common.scalar_inputs(problem, q_len, kv_len, optional, "q")
        cfg = problem.config
        layout = common.kernel_layout(problem, q, v, k.shape[2], "dq", (cfg.block_q_dq, cfg.block_k_dq),
                                      any(g.axis == "q" for g in tile_grads))
        qh, doh, outh = (layout.view(x.astype(dtype)) for x in (q, d_out, out))
        kh, vh = (layout.view(x.astype(dtype), kv=True) for x in (k, v))
        dq, delta_rows, *rest = _backward_dq(problem, layout, shapes, qh, kh, vh, doh, outh, lse2, d_lse, scalars,
                                             optional, emit_ds, sum_keys, varying, tile_grads)
        delta = delta_rows[:, :, 0]
        if tangents.q:
            grads["q"] = layout.unview(dq).astype(q.dtype)
        if emit_ds or sum_keys:  # dS, or its row sums [B, N, 1, T] -> [B, N, T, 1]
            summed = rest.pop(0) if emit_ds else jnp.swapaxes(rest.pop(0), 2, 3)
            grads["bias"] = jnp.sum(summed, axis=bias_axes, keepdims=True).astype(bias.dtype)
        blocks.update(zip([(g.index, "q") for g in tile_grads if g.axis == "q"], rest))
    if tangents.k or tangents.v or sum_queries or any(g.axis == "kv" for g in tile_grads):
        scalars = common.scalar_inputs(problem, q_len, kv_len, optional, "kv")
        cfg = problem.config
        layout = common.kernel_layout(problem, q, v, k.shape[2], "dkv", (cfg.block_q_dkv, cfg.block_k_dkv),
                                      any(g.axis == "kv" for g in tile_grads))
        qh, doh = (layout.view(x.astype(dtype)) for x in (q, d_out))
        kh, vh = (layout.view(x.astype(dtype), kv=True) for x in (k, v))
        if delta is None:
            delta = backward_delta(out, lse, d_out, d_lse)
        dk, dv, rest = _backward_dkv(problem, layout, shapes, qh, kh, vh, doh, lse2, delta, scalars, optional,
                                     sum_queries, varying, tile_grads)
        grads.update({name: layout.unview(g, kv=True).astype(x.dtype)
                      for name, g, x in (("k", dk, k), ("v", dv, v)) if getattr(tangents, name)})
        if sum_queries:  # dS's column sums [B, N, 1, S]
            grads["bias"] = jnp.sum(rest.pop(0), axis=bias_axes, keepdims=True).astype(bias.dtype)
        blocks.update(zip([(g.index, "kv") for g in tile_grads if g.axis == "kv"], rest))
    if tile_grads:
        consts = res["score_consts"]
        lengths = {"q": q.shape[1], "kv": k.shape[1]}
        by_index = {}
        for g in tile_grads:
            part = hook_grads.finish(g, blocks[(g.index, g.axis)], consts[g.index], lengths[g.axis])
            by_index[g.index] = part if g.index not in by_index else by_index[g.index] + part
        grads["score_consts_by_index"] = by_index
    return grads
