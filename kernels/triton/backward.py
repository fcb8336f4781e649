"""The flash-attention backward in Pallas Triton (FlashAttention-2, Alg. 2), split so that nothing needs
atomics: the dQ kernel (one program per query tile, which can also write dS for the bias gradient) and the
dK/dV kernel (one program per KV tile and KV head, summing its GQA group's query heads; per query head, summed
by XLA, where the dispatch asks: `_Problem.dkv_per_query_head`; two per KV tile, dV's and dK's, each recomputing
the scores, where it asks `_Problem.dkv_split`)."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._scores import _dropout_scale, _scores, backward_delta, base2_lse
from probjax_kernels.triton.specs import (
    _compiler_params,
    _kv_batch,
    _length_spec,
    _optional_inputs,
    _output,
    _q_grid,
    _refs_fn,
)
from probjax_kernels.triton.tiles import (
    _dot,
    _kv_tile_range,
    _q_tile_range,
    _Refs,
    _run_ranges,
    _run_table,
    _sliced_dot,
    _tile_context,
)

# --------------------------------------------------------------------------------------------- backward: dQ


def _tile_probabilities(s, lse2, ctx, problem: _Problem):
    """p of one tile from its scores, with dropout's keep mask and scale: what dV sums (`_tile_gradient`'s
    first output, without dP)."""
    p = jnp.exp2(s - lse2)
    if problem.features.dropout_rate > 0:
        p = p * _dropout_scale(ctx, problem)
    return p


def _tile_gradient(s, dp_fn, delta, lse2, derivative, ctx, problem: _Problem):
    """p and dS = d loss / d (scaled, biased score) of one tile from its scores s and dP = dO V^T (`dp_fn()`),
    FlashAttention-2 with dropout and score_mod. `delta` and `lse2` are shaped to broadcast along the tile's
    query axis: (bq, 1) columns, or (1, bq) rows for a transposed (keys, queries) tile."""
    p = jnp.exp2(s - lse2)
    dp = dp_fn()
    p_dropped = p
    if problem.features.dropout_rate > 0:
        scale = _dropout_scale(ctx, problem)
        dp, p_dropped = dp * scale, p * scale
    ds = p * (dp - delta)
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
        _, ds = _tile_gradient(s, lambda: _dot(do, v, (1, 1), problem.precision), delta[:, None], lse2[:, None],
                               derivative, ctx, problem)
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

_F32_SLICE = 64  # head-dim slice of the float32 dK/dV kernel's score dots (`_sliced_dot`)


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
    kv_start = kv_tile * block_k
    # float32 (FMA dots at Precision.HIGHEST): K and V are read again at every query step, and S = Q K^T and
    # dP = dO V^T summed over 64-wide slices of the head dim. Held across the loop, K and V stay in registers
    # in the FMA operand layout and spill (0.3 KB at head dim 128, 2-6 KB at 256; docs/perf-notes.md).
    reload = problem.precision == lax.Precision.HIGHEST
    # `problem.dkv_transposed` (Hopper, `_dispatch.triton_dkv_transposed`): the kernel computes S^T = K Q^T and
    # dP^T = V dO^T, (block_k, block_q) tiles, so that every dot's M (rows) is the key tile: dV += P^T dO and
    # dK += dS^T Q too. wgmma needs M >= 64 per warpgroup, and dK, dV (block_k x D float32) bound the key tile,
    # so this keeps all four dots on wgmma with small query steps. The score context, lse2 and delta follow.
    transposed = problem.dkv_transposed
    orient = (lambda a, b: (b, a)) if transposed else (lambda a, b: (a, b))  # noqa: E731
    row_of = (lambda x: x[None, :]) if transposed else (lambda x: x[:, None])  # noqa: E731  per-query values
    outer = (1, 0) if transposed else (0, 0)  # contracts the query axis of P / dS with dO / Q's rows

    def accumulate(want_dk: bool, want_dv: bool):
        """dK (unscaled) and dV of this key tile, each None where not wanted; the dV-only pass needs no dP."""
        with_derivative = problem.features.score_mod is not None and want_dk

        def head_body(head, carry):
            # K/V stay resident while the loop walks the query tiles of every query head of this KV head (GQA).
            def body(q_tile, carry, masked: bool):
                dk, dv = carry
                start = q_tile * block_q
                rows = pl.ds(start, block_q)
                q = q_ref[rows, head, :]
                do = do_ref[rows, head, :]
                lse2 = row_of(lse2_ref[head, rows])
                delta = row_of(delta_ref[head, rows]) if want_dk else None
                ctx = _tile_context(opt, problem, b, kv_head * problem.group + head, head, start, block_q,
                                    kv_start, block_k, kv_len, False, transposed=transposed)
                if reload:
                    qk = _sliced_dot(*orient(lambda c: q_ref[rows, head, c], lambda c: k_ref[:, c]), q.shape[-1],
                                     _F32_SLICE, problem.precision)
                    dp_fn = lambda: _sliced_dot(  # noqa: E731
                        *orient(lambda c: do_ref[rows, head, c], lambda c: v_ref[:, c]), do.shape[-1],
                        _F32_SLICE, problem.precision)
                else:
                    qk = _dot(*orient(q, k), (1, 1), problem.precision)
                    dp_fn = lambda: _dot(*orient(do, v), (1, 1), problem.precision)  # noqa: E731
                s, derivative = _scores(qk, ctx, problem, masked, with_derivative)
                if want_dk:
                    p, ds = _tile_gradient(s, dp_fn, delta, lse2, derivative, ctx, problem)
                else:
                    p, ds = _tile_probabilities(s, lse2, ctx, problem), None
                if want_dv:
                    dv = dv + _dot(p.astype(do.dtype), do, outer, problem.precision)
                if want_dk:
                    dk = dk + _dot(ds.astype(q.dtype), q, outer, problem.precision)
                return dk, dv

            if opt.tables is not None:
                table_head = head if problem.table_shape[1] > 1 else None
                return _run_table(opt.tables, table_head, problem.features.block_sizes[0] // block_q, body,
                                  carry, problem)
            tile_range = _q_tile_range(kv_tile, q_len, kv_len, block_q, block_k, problem,
                                       q_ref.shape[0] // block_q)
            return _run_ranges(tile_range, body, carry)

        zeros = (jnp.zeros(k.shape, jnp.float32) if want_dk else None,
                 jnp.zeros(v.shape, jnp.float32) if want_dv else None)
        return lax.fori_loop(0, problem.group, head_body, zeros)

    def store_dk(dk):
        dk_ref[...] = (dk * problem.features.scale).astype(dk_ref.dtype)

    def store_dv(dv):
        dv_ref[...] = dv.astype(dv_ref.dtype)

    if problem.dkv_split:
        # Two programs per key tile (`_dispatch.triton_dkv_split`): the last grid axis picks dV (0) or dK (1),
        # each holding one block_k x D float32 accumulator and recomputing the scores.
        @pl.when(pl.program_id(3) == 0)
        def _():
            store_dv(accumulate(want_dk=False, want_dv=True)[1])

        @pl.when(pl.program_id(3) == 1)
        def _():
            store_dk(accumulate(want_dk=True, want_dv=False)[0])
    else:
        dk, dv = accumulate(want_dk=True, want_dv=True)
        store_dk(dk)
        store_dv(dv)


# ------------------------------------------------------------------------------------------- pallas_call glue


def _backward_dq(problem: _Problem, q, k, v, q_len, kv_len, do, lse2, delta, optional: dict, emit_ds: bool):
    batch, t_pad, num_heads, _ = q.shape
    s_pad = k.shape[1]
    block_q = problem.config.block_q_dq
    grid = _q_grid(problem, q, k, v, block_q, problem.config.block_k_dq, optional)
    out_specs = [grid.q]
    out_shape = [_output(q.shape, q.dtype, q, k, v, do)]
    if emit_ds:
        out_specs.append(pl.BlockSpec((None, None, block_q, s_pad), lambda i, b, h: (b, h, i, 0)))
        out_shape.append(_output((batch, num_heads, t_pad, s_pad), jnp.float32, q, k, v, do))
    kernel = functools.partial(_dq_kernel, problem=problem, refs_fn=_refs_fn(problem), emit_ds=emit_ds)
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, batch, num_heads),
        in_specs=[
            grid.q, grid.k, grid.v, _length_spec(), _length_spec(), grid.out, grid.row, grid.row, *grid.extra_specs
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        name="probjax_flash_backward_dq",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, do, lse2, delta, *grid.extra)


def _backward_dkv(problem: _Problem, q, k, v, q_len, kv_len, do, lse2, delta, optional: dict):
    """dK, dV by the dK/dV kernel: one program per (key tile, batch, KV head) walking the query tiles of the
    group's query heads, or with `problem.dkv_per_query_head` one per query head (the kernel on a group of 1),
    its float32 dK / dV summed over the group here."""
    batch, t_pad, num_heads, d_pad = q.shape
    s_pad, num_kv_heads, dv_pad = k.shape[1], k.shape[2], v.shape[3]
    block_k = problem.config.block_k_dkv
    per_query_head = problem.dkv_per_query_head and problem.group > 1
    kernel_problem = dataclasses.replace(problem, group=1) if per_query_head else problem
    group, program_heads = kernel_problem.group, num_heads if per_query_head else num_kv_heads
    extra, extra_specs = _optional_inputs(optional, kernel_problem, "kv", problem.config.block_q_dkv, block_k)

    def q_side(dim):
        return pl.BlockSpec((None, t_pad, group, dim), lambda j, b, h: (b, 0, h, 0))

    def kv_input(dim):
        kv_head = (lambda h: h // problem.group) if per_query_head else (lambda h: h)  # noqa: E731
        return pl.BlockSpec((None, block_k, None, dim), lambda j, b, h: (_kv_batch(problem, b), j, kv_head(h), 0))

    def kv_output(dim):
        return pl.BlockSpec((None, block_k, None, dim), lambda j, b, h: (b, j, h, 0))

    row_spec = pl.BlockSpec((None, group, t_pad), lambda j, b, h: (b, h, 0))
    # Shared (batch-1) k / v, and per-query-head programs, get their gradient in float32, summed below.
    summed = problem.kv_broadcast or per_query_head
    out_shape = [_output((batch, s_pad, program_heads, x.shape[3]), jnp.float32 if summed else x.dtype, q, k, v, do)
                 for x in (k, v)]
    kernel = functools.partial(_dkv_kernel, problem=kernel_problem, refs_fn=_refs_fn(kernel_problem))
    in_specs = [q_side(d_pad), kv_input(d_pad), kv_input(dv_pad), _length_spec(), _length_spec(), q_side(dv_pad),
                row_spec, row_spec, *extra_specs]
    grid = (s_pad // block_k, batch, program_heads)
    if problem.dkv_split:  # a fourth grid axis of 2, dV's program and dK's, which the blocks do not depend on
        grid = (*grid, 2)

    def split(spec: pl.BlockSpec) -> pl.BlockSpec:
        if not problem.dkv_split:
            return spec
        index_map = spec.index_map
        return dataclasses.replace(spec, index_map=lambda j, b, h, _: index_map(j, b, h))

    dk, dv = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[split(spec) for spec in in_specs],
        out_specs=[split(kv_output(d_pad)), split(kv_output(dv_pad))],
        out_shape=out_shape,
        name="probjax_flash_backward_dkv",
        **_compiler_params(kernel_problem),
    )(q, k, v, q_len, kv_len, do, lse2, delta, *extra)
    if summed:
        def reduce(g, x):
            if per_query_head:
                g = jnp.sum(g.reshape(batch, s_pad, num_kv_heads, problem.group, g.shape[3]), axis=3)
            if problem.kv_broadcast:
                g = jnp.sum(g, axis=0, keepdims=True)
            return g.astype(x.dtype)
        dk, dv = reduce(dk, k), reduce(dv, v)
    return dk, dv


def backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse,
             dkv_problem: _Problem | None = None) -> dict:
    """Gradients of q, k, v and the bias (those flagged in `tangents`) from the residuals `res` of
    `_autodiff`, by the dQ and dK/dV kernels; the score_mod constants' come from `_chunked`."""
    q, k, v, out, lse = res["q"], res["k"], res["v"], res["out"], res["lse"]
    bias, q_len, kv_len = res["bias"], res["q_len"], res["kv_len"]
    delta, lse2 = backward_delta(out, lse, d_out, d_lse), base2_lse(lse)
    optional = dict(res["others"], bias=bias, score_consts=res["score_consts"])
    grads = {}
    if tangents.q or tangents.bias:
        dq, *ds = _backward_dq(problem, q, k, v, q_len, kv_len, d_out, lse2, delta, optional, tangents.bias)
        if tangents.q:
            grads["q"] = dq
        if tangents.bias:
            broadcast_axes = tuple(axis for axis, size in enumerate(bias.shape) if size == 1)
            grads["bias"] = jnp.sum(ds[0], axis=broadcast_axes, keepdims=True).astype(bias.dtype)
    if tangents.k or tangents.v:
        dk, dv = _backward_dkv(dkv_problem or problem, q, k, v, q_len, kv_len, d_out, lse2, delta, optional)
        grads.update({name: g for name, g in (("k", dk), ("v", dv)) if getattr(tangents, name)})
    return grads
