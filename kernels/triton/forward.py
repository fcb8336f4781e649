"""The flash-attention forward in Pallas Triton (FlashAttention-2, Alg. 1): one program per (query tile,
batch, query head) walks its KV tiles with a running max and sum, and writes out and lse."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax_kernels._problem import _Problem
from probjax_kernels._scores import LN2, _dropout_scale, _scores
from probjax_kernels.triton.specs import _compiler_params, _length_spec, _output, _q_grid, _refs_fn
from probjax_kernels.triton.tiles import _dot, _kv_tile_range, _Refs, _run_ranges, _run_table, _tile_context

_M_INIT = float(jnp.finfo(jnp.float32).min)  # finite, so exp2(m_old - m_new) is never (-inf) - (-inf)


def _forward_kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, *refs, problem: _Problem, refs_fn):
    if problem.features.return_max:
        *input_refs, out_ref, lse_ref, max_ref = refs
    else:
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
        jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32),
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
    if problem.features.return_max:  # m is the row max of the base-2 scores s2 = log2(e) * score
        max_ref[...] = jnp.where(row_valid, m * LN2, -jnp.inf)


# ------------------------------------------------------------------------------------------- pallas_call glue


def forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    """(out `[B, T, N, Dv]`, lse[, row max]) of padded q `[B, T, N, D]`, k `[B|1, S, K, D]`, v `[B|1, S, K, Dv]`;
    `optional` holds the optional inputs by name (see `_triton_specs._optional_inputs`)."""
    batch, t_pad, num_heads, _ = q.shape
    block_q = problem.config.block_q
    grid = _q_grid(problem, q, k, v, block_q, problem.config.block_k, optional)
    kernel = functools.partial(_forward_kernel, problem=problem, refs_fn=_refs_fn(problem))
    rows = (_output((batch, num_heads, t_pad), jnp.float32, q, k, v),) * (2 if problem.features.return_max else 1)
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, batch, num_heads),
        in_specs=[grid.q, grid.k, grid.v, _length_spec(), _length_spec(), *grid.extra_specs],
        out_specs=[grid.out, *(grid.row for _ in rows)],
        out_shape=[_output((batch, t_pad, num_heads, v.shape[3]), q.dtype, q, k, v), *rows],
        name="probjax_flash_forward",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, *grid.extra)
