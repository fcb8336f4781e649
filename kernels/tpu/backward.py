"""The flash-attention backward in Pallas Mosaic TPU (FlashAttention-2, Alg. 2), without atomics so the
gradients are deterministic: the dQ kernel (a (B, N, query tile, step) grid walking key tiles, which can also
write dS for the bias gradient) and the dK/dV kernel (a (B, K, key tile, step) grid whose steps walk the query
tiles of each query head of the GQA group in turn, so the group's sum happens in VMEM, with K / V never
repeated). The dK/dV kernel computes the transposed scores k q^T, so lse and delta enter it as rows."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._scores import _dropout_scale, _scores, backward_delta, base2_lse
from probjax_kernels.tpu import common
from probjax_kernels.tpu.common import dot


def with_tiles(problem: _Problem, block_q: int, block_k: int) -> _Problem:
    """The problem as a kernel on (block_q, block_k) tiles sees it (`common` reads config.block_q / block_k)."""
    config = dataclasses.replace(problem.config, block_q=block_q, block_k=block_k)
    return dataclasses.replace(problem, config=config)


def _tile_gradient(s, do, v, delta, lse2, derivative, ctx, problem: _Problem, transposed: bool):
    """(p with dropout, dS) of one tile; transposed tiles are (keys, queries) with lse / delta as rows."""
    p = jnp.exp2(s - lse2)
    dp = dot(v, do, (1, 1)) if transposed else dot(do, v, (1, 1))
    p_dropped = p
    if problem.features.dropout_rate > 0:
        scale = _dropout_scale(ctx, problem)
        dp, p_dropped = dp * scale, p * scale
    ds = p * (dp - delta)
    if derivative is not None:
        ds = ds * derivative
    return p_dropped, ds


# --------------------------------------------------------------------------------------------- dQ kernel


def _dq_kernel(*refs, problem: _Problem, num_kv_tiles: int, to_refs, emit_ds: bool):
    n_scalar = common.num_scalars(problem)
    scalars = common.scalars_of(problem, refs[:n_scalar], "q")
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *rest = refs[n_scalar:]
    acc_ref = rest[-1]
    num_out = 2 if emit_ds else 1
    dq_ref = rest[-1 - num_out]
    ds_ref = rest[-2] if emit_ds else None
    opt = to_refs(rest[:-1 - num_out])
    b, h, i, step = (pl.program_id(axis) for axis in range(4))
    bq, bk = problem.config.block_q, problem.config.block_k
    walk = _dq_walk(problem, scalars, b, h, i, num_kv_tiles, emit_ds)
    with_derivative = problem.features.score_mod is not None

    @pl.when(step == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    if emit_ds:  # every dS block is written: skipped tiles get zeros
        ds_ref[...] = jnp.zeros(ds_ref.shape, jnp.float32)

    def body(masked: bool):
        ctx = common.tile_context(opt, problem, b, h, i * bq, walk.tile(step) * bk, scalars.kv_len[b], False)
        k = k_ref[...]
        s, derivative = _scores(dot(q_ref[...], k, (1, 1)), ctx, problem, masked, with_derivative)
        _, ds = _tile_gradient(s, do_ref[...], v_ref[...], delta_ref[...], lse2_ref[...], derivative, ctx,
                               problem, False)
        if emit_ds:
            ds_ref[...] = ds
        acc_ref[...] += dot(ds.astype(k.dtype), k, (1, 0))

    common.run_step(walk, step, body)

    @pl.when(step == pl.num_programs(3) - 1)
    def _():
        dq_ref[...] = (acc_ref[...] * problem.features.scale).astype(dq_ref.dtype)


def _dq_walk(problem, scalars, b, h, i, num_kv_tiles: int, emit_ds: bool) -> common.Walk:
    """The dQ kernel's walk; with dS written, every key tile is a step (each dS block is written once)."""
    walk = common.q_walk(problem, scalars, b, h, i, num_kv_tiles)
    if not emit_ds:
        return walk
    lo = walk.tile(0)
    visits = lambda j: walk.visited(j - lo) & (j >= lo) & (walk.tile(j - lo) == j)  # noqa: E731
    return common.Walk(tile=lambda j: j, visited=visits, masked=lambda j: walk.masked(j - lo),
                       always_masked=walk.always_masked)


def _backward_dq(problem: _Problem, qh, kh, vh, doh, lse2, delta, scalar_inputs, optional: dict, emit_ds: bool,
                 varying):
    batch, num_heads, t_pad, d_pad = qh.shape
    s_pad, dv_pad = kh.shape[2], vh.shape[3]
    problem = with_tiles(problem, problem.config.block_q_dq, problem.config.block_k_dq)
    bq, bk = problem.config.block_q, problem.config.block_k
    num_kv_tiles, group = s_pad // bk, problem.group
    steps = num_kv_tiles if problem.table_shape is None or emit_ds else _table_steps(optional["kv_tables"])

    def kv_tile(b, h, i, s, *scalar_refs):
        scalars = common.scalars_of(problem, scalar_refs, "q")
        return _dq_walk(problem, scalars, b, h, i, num_kv_tiles, emit_ds).tile(s)

    maps = dict(b=lambda b, h, i, s, *r: b, h=lambda b, h, i, s, *r: h, q=lambda b, h, i, s, *r: i, kv=kv_tile)
    extra, extra_specs, to_refs = common.optional_inputs(problem, optional, "q", maps, (t_pad, s_pad))
    kv_b = (lambda b: 0) if problem.kv_broadcast else (lambda b: b)

    def q_side(dim):
        return pl.BlockSpec((None, None, bq, dim), lambda b, h, i, s, *r: (b, h, i, 0))

    def kv_side(dim):
        return pl.BlockSpec((None, None, bk, dim),
                            lambda b, h, i, s, *r: (kv_b(b), h // group, kv_tile(b, h, i, s, *r), 0))

    row = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, s, *r: (b, h, i, 0))
    out_specs, out_shape = [q_side(d_pad)], [common.output(qh.shape, qh.dtype, *varying)]
    if emit_ds:
        out_specs.append(pl.BlockSpec((None, None, bq, bk), lambda b, h, i, s, *r: (b, h, i, s)))
        out_shape.append(common.output((batch, num_heads, t_pad, s_pad), jnp.float32, *varying))
    kernel = functools.partial(_dq_kernel, problem=problem, num_kv_tiles=num_kv_tiles, to_refs=to_refs,
                               emit_ds=emit_ds)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_inputs),
            grid=(batch, num_heads, t_pad // bq, steps),
            in_specs=[q_side(d_pad), kv_side(d_pad), kv_side(dv_pad), q_side(dv_pad), row, row, *extra_specs],
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((bq, d_pad), jnp.float32)],
        ),
        out_shape=out_shape,
        name="probjax_tpu_backward_dq",
        **common.compiler_params(problem, ("parallel", "parallel", "parallel", "arbitrary")),
    )(*scalar_inputs, qh, kh, vh, doh, lse2[..., None], delta[..., None], *extra)


# ------------------------------------------------------------------------------------------ dK/dV kernel


def _dkv_kernel(*refs, problem: _Problem, num_q_tiles: int, steps: int, to_refs):
    n_scalar = common.num_scalars(problem)
    scalars = common.scalars_of(problem, refs[:n_scalar], "kv")
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *rest = refs[n_scalar:]
    dk_ref, dv_ref, dk_acc, dv_acc = rest[-4:]
    opt = to_refs(rest[:-4])
    b, kv_head, j, step = (pl.program_id(axis) for axis in range(4))
    bq, bk = problem.config.block_q, problem.config.block_k
    head, q_step = step // steps, step % steps
    walk = common.kv_walk(problem, scalars, b, kv_head, head, j, num_q_tiles)
    with_derivative = problem.features.score_mod is not None

    @pl.when(step == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def body(masked: bool):
        h = kv_head * problem.group + head
        ctx = common.tile_context(opt, problem, b, h, walk.tile(q_step) * bq, j * bk, scalars.kv_len[b], True)
        q, do = q_ref[...], do_ref[...]
        s, derivative = _scores(dot(k_ref[...], q, (1, 1)), ctx, problem, masked, with_derivative)
        p, ds = _tile_gradient(s, do, v_ref[...], delta_ref[...], lse2_ref[...], derivative, ctx, problem, True)
        dv_acc[...] += dot(p.astype(do.dtype), do, (1, 0))
        dk_acc[...] += dot(ds.astype(q.dtype), q, (1, 0))

    common.run_step(walk, q_step, body)

    @pl.when(step == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = (dk_acc[...] * problem.features.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _backward_dkv(problem: _Problem, qh, kh, vh, doh, lse2, delta, scalar_inputs, optional: dict, varying):
    batch, num_heads, t_pad, d_pad = qh.shape
    num_kv_heads, s_pad, dv_pad = kh.shape[1], kh.shape[2], vh.shape[3]
    problem = with_tiles(problem, problem.config.block_q_dkv, problem.config.block_k_dkv)
    bq, bk = problem.config.block_q, problem.config.block_k
    num_q_tiles, group = t_pad // bq, problem.group
    steps = num_q_tiles if problem.table_shape is None else _table_steps(optional["q_tables"])

    def q_tile(b, kv_head, j, s, *scalar_refs):
        scalars = common.scalars_of(problem, scalar_refs, "kv")
        return common.kv_walk(problem, scalars, b, kv_head, s // steps, j, num_q_tiles).tile(s % steps)

    def head_of(b, kv_head, j, s, *r):
        return kv_head * group + s // steps

    maps = dict(b=lambda b, kh, j, s, *r: b, h=head_of, q=q_tile, kv=lambda b, kh, j, s, *r: j)
    extra, extra_specs, to_refs = common.optional_inputs(problem, optional, "kv", maps, (t_pad, s_pad))
    kv_b = (lambda b: 0) if problem.kv_broadcast else (lambda b: b)

    def q_side(dim):
        return pl.BlockSpec((None, None, bq, dim),
                            lambda b, kh, j, s, *r: (b, head_of(b, kh, j, s), q_tile(b, kh, j, s, *r), 0))

    def kv_side(dim, shared: bool):
        return pl.BlockSpec((None, None, bk, dim), lambda b, kh, j, s, *r: (kv_b(b) if shared else b, kh, j, 0))

    row = pl.BlockSpec((None, None, 1, bq),
                       lambda b, kh, j, s, *r: (b, head_of(b, kh, j, s), 0, q_tile(b, kh, j, s, *r)))
    if problem.kv_broadcast:  # shared k / v: a float32 gradient per query batch, summed below
        out_shape = [common.output((batch, *x.shape[1:]), jnp.float32, *varying) for x in (kh, vh)]
    else:
        out_shape = [common.output(x.shape, x.dtype, *varying) for x in (kh, vh)]
    kernel = functools.partial(_dkv_kernel, problem=problem, num_q_tiles=num_q_tiles, steps=steps, to_refs=to_refs)
    dk, dv = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_inputs),
            grid=(batch, num_kv_heads, s_pad // bk, group * steps),
            in_specs=[q_side(d_pad), kv_side(d_pad, True), kv_side(dv_pad, True), q_side(dv_pad), row, row,
                      *extra_specs],
            out_specs=[kv_side(d_pad, False), kv_side(dv_pad, False)],
            scratch_shapes=[pltpu.VMEM((bk, d_pad), jnp.float32), pltpu.VMEM((bk, dv_pad), jnp.float32)],
        ),
        out_shape=out_shape,
        name="probjax_tpu_backward_dkv",
        **common.compiler_params(problem, ("parallel", "parallel", "parallel", "arbitrary")),
    )(*scalar_inputs, qh, kh, vh, doh, lse2[:, :, None, :], delta[:, :, None, :], *extra)
    if problem.kv_broadcast:
        dk, dv = (jnp.sum(g, axis=0, keepdims=True).astype(x.dtype) for g, x in ((dk, kh), (dv, vh)))
    return dk, dv


def _table_steps(tables) -> int:
    return tables[1].shape[-1] + tables[3].shape[-1]


def backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse) -> dict:
    """Gradients of q, k, v and the bias flagged in `tangents` from `_autodiff`'s residuals (padded, in the
    core's `[B, T, N, D]` layout); the score_mod arrays' come from `_chunked`, as on every backend."""
    q, k, v, out, lse = res["q"], res["k"], res["v"], res["out"], res["lse"]
    bias, q_len, kv_len = res["bias"], res["q_len"], res["kv_len"]
    delta, lse2 = backward_delta(out, lse, d_out, d_lse), base2_lse(lse)
    optional = dict(res["others"], bias=bias, score_consts=res["score_consts"])
    dtype = common.compute_dtype(q.dtype)
    qh, kh, vh, doh = (common.to_heads(x.astype(dtype)) for x in (q, k, v, d_out))
    varying = (q, k, v, d_out)
    grads = {}
    if tangents.q or tangents.bias:
        scalars = common.scalar_inputs(problem, q_len, kv_len, optional, "q")
        dq, *ds = _backward_dq(problem, qh, kh, vh, doh, lse2, delta, scalars, optional, tangents.bias, varying)
        if tangents.q:
            grads["q"] = jnp.swapaxes(dq, 1, 2).astype(q.dtype)
        if tangents.bias:
            broadcast_axes = tuple(axis for axis, size in enumerate(bias.shape) if size == 1)
            grads["bias"] = jnp.sum(ds[0], axis=broadcast_axes, keepdims=True).astype(bias.dtype)
    if tangents.k or tangents.v:
        scalars = common.scalar_inputs(problem, q_len, kv_len, optional, "kv")
        dk, dv = _backward_dkv(problem, qh, kh, vh, doh, lse2, delta, scalars, optional, varying)
        grads.update({name: jnp.swapaxes(g, 1, 2).astype(x.dtype)
                      for name, g, x in (("k", dk, k), ("v", dv, v)) if getattr(tangents, name)})
    return grads
