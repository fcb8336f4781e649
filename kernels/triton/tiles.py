"""How a Triton kernel walks and reads its tiles, shared by the forward, dQ, dK/dV and tangent kernels: the
refs of its optional inputs, the three tile ranges (`_tiles.py`) or the rows of a `BlockMask`'s tables, the
float32 tile matmul, and the score context of one tile read from the refs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._scores import _ScoreContext
from probjax_kernels._tiles import kv_tile_range, q_tile_range


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


def _sliced_dot(a, b, head_dim: int, chunk: int, precision):
    """a(cols) . b(cols)^T summed over the head dim in slices of `chunk` columns, where a / b read the
    (rows, len(cols)) slice of their operand from a ref: float32 FMA dots over the whole of a wide head dim
    hold too many operand values per thread."""
    out = None
    for start in range(0, head_dim, chunk):
        cols = pl.ds(start, min(chunk, head_dim - start))
        part = _dot(a(cols), b(cols), (1, 1), precision)
        out = part if out is None else out + part
    return out


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
                  kv_len, q_is_tile: bool, tangents: _Tangents | None = None,
                  transposed: bool = False) -> _ScoreContext:
    """The score context of tile (q_start:+block_q, kv_start:+block_k) read from a kernel's refs.

    `q_is_tile`: the query axis of the bias / mask / segment refs is already the tile (forward, dQ) rather
    than the whole sequence (dK/dV, where the key axis is the tile instead). `transposed`: the context of the
    transposed (block_k, block_q) score tile K Q^T (the dK/dV kernel's on Hopper): q_idx a (1, block_q) row,
    kv_idx a (block_k, 1) column, the bias / mask tiles transposed.
    """
    q_off, kv_off = (0, kv_start) if q_is_tile else (q_start, 0)
    f = problem.features
    # Query vectors run along the score tile's rows, key vectors along its columns (the other way transposed).
    along_q, along_kv = (lambda x: x[:, None]), (lambda x: x[None, :])
    if transposed:
        along_q, along_kv = along_kv, along_q

    def tile(ref):
        loaded = _load_2d(ref, q_off, block_q, kv_off, block_k, head_in_block)
        return loaded.T if transposed else loaded

    return _ScoreContext(
        b=b,
        h=h,
        q_idx=q_start + along_q(jnp.arange(block_q, dtype=jnp.int32)),  # int32 under jax_enable_x64 too: the
        kv_idx=kv_start + along_kv(jnp.arange(block_k, dtype=jnp.int32)),  # hooks were traced with int32
        kv_len=kv_len,
        bias=None if refs.bias is None else tile(refs.bias),
        mask=None if refs.mask is None else tile(refs.mask),
        q_seg=None if refs.q_segment_ids is None else along_q(
            refs.q_segment_ids[...] if q_is_tile else refs.q_segment_ids[pl.ds(q_start, block_q)]),
        kv_seg=None if refs.kv_segment_ids is None else along_kv(
            refs.kv_segment_ids[pl.ds(kv_start, block_k)] if q_is_tile else refs.kv_segment_ids[...]),
        dropout_seed=None if refs.dropout_seed is None else (
            refs.dropout_seed[...] if f.dropout_positions is None  # else scalars: no value indexing in Triton
            else tuple(refs.dropout_seed[i] for i in range(refs.dropout_seed.shape[0]))),
        score_mod=None if f.score_mod is None else functools.partial(f.score_mod.in_kernel, refs.score_consts),
        mask_mod=None if f.mask_mod is None else functools.partial(f.mask_mod.in_kernel, refs.mask_consts),
        d_bias=None if refs.d_bias is None else tile(refs.d_bias),
        score_mod_jvp=None if f.score_mod is None or tangents is None else functools.partial(
            f.score_mod.jvp_in_kernel, refs.score_consts, refs.d_score_consts, tangents.score_consts),
    )


def online_softmax_step(carry, scores2: list, values: list, precision):
    """FlashAttention-2's online softmax over one step of key tiles: (acc `[rows, Dv]`, m, l `[rows]`) float32,
    the running output, max and sum in base 2, updated by the step's base-2 score tiles `[rows, keys]` (-inf
    where masked) and their value tiles `[keys, Dv]`."""
    acc, m, l = carry
    m_new = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in scores2], m)
    alpha = jnp.exp2(m - m_new)
    acc, l = acc * alpha[:, None], l * alpha
    for s, v in zip(scores2, values):
        weights = jnp.exp2(s - m_new[:, None])
        l = l + jnp.sum(weights, axis=1)
        acc = acc + _dot(weights.astype(v.dtype), v, (1, 0), precision)
    return acc, m_new, l
