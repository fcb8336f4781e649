"""The tile walk of the Mosaic TPU kernels: which key tiles a query tile visits (or query tiles a key tile),
from scalar-prefetched lengths or a `BlockMask`'s tables, with index maps that clamp skipped steps onto the
last visited tile so they cost no DMA, and which steps run the per-element mask.

A grid's last axis counts steps, not tiles: step j visits tile lo + j of the tile range (`_tiles.py`), or
entry j of a `BlockMask` row (partial entries, then full ones); steps past the range repeat the last
visited tile in every index map (the pipeline skips a DMA whose block index did not change) and the kernel
skips their compute. Such a skipped step still costs the grid's fixed step overhead; where the static shapes
already rule steps out (causal, local windows), `common.step_grid` lists only the steps a program may visit, on
one flattened axis.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax_kernels._problem import _Problem
from probjax_kernels._tiles import kv_tile_range, q_tile_range


@dataclasses.dataclass(frozen=True)
class Walk:
    """One program's visit of the step axis: `tile(step)` for the index maps and the kernel, `visited(step)`
    and `masked(step)` (whether the per-element mask runs) for the kernel. Scalars only."""

    tile: Callable
    visited: Callable
    masked: Callable
    always_masked: bool = False  # segments / dense masks: no unmasked variant is compiled


def window(problem: _Problem):
    return problem.features.window_left, problem.features.window_right


def range_walk(tile_range, num_tiles: int, always_masked: bool) -> Walk:
    """Steps over (lo, full_lo, full_hi, hi) of `_tiles`: step j visits tile lo + j while lo + j < hi."""
    lo, full_lo, full_hi, hi = tile_range
    last = jnp.clip(hi - 1, 0, num_tiles - 1)
    return Walk(
        tile=lambda j: jnp.minimum(lo + j, last),
        visited=lambda j: lo + j < hi,
        masked=lambda j: (lo + j < full_lo) | (lo + j >= full_hi),
        always_masked=always_masked,
    )


def table_walk(tables, row: tuple, mask_everywhere: bool) -> Walk:
    """Steps over one row of a `BlockMask`'s tables (scalar-prefetched refs, row = (b, h, tile)): the partial
    entries then the full ones; a step past both repeats the last visited tile."""
    num_partial, partial, num_full, full = tables
    n_p, n_f = num_partial[row], num_full[row]

    def entry(j):
        jp = jnp.clip(j, 0, jnp.maximum(n_p - 1, 0))
        jf = jnp.clip(j - n_p, 0, jnp.maximum(n_f - 1, 0))
        from_full = (j >= n_p) & (n_f > 0)
        # Past the end: the last full entry, or the last partial one when there is no full entry.
        return jnp.where(from_full | ((n_p == 0) & (n_f > 0)), full[(*row, jf)], partial[(*row, jp)])

    return Walk(
        tile=entry,
        visited=lambda j: j < n_p + n_f,
        masked=lambda j: (j < n_p) | mask_everywhere,
        always_masked=mask_everywhere,
    )


def q_walk(problem: _Problem, scalars, b, h, i, num_kv_tiles: int) -> Walk:
    """The walk over key tiles of query tile i (forward, dQ, tangent), for batch b and query head h."""
    cfg = problem.config
    bq, bk = cfg.block_q, cfg.block_k
    if problem.table_shape is not None:
        tb, th = problem.table_shape
        row = (b if tb > 1 else 0, h if th > 1 else 0, i)
        return table_walk(scalars.tables, row, problem.per_element_mask_everywhere)
    tile_range = kv_tile_range(i * bq, bq, scalars.q_len[b], scalars.kv_len[b], bk, window(problem), num_kv_tiles,
                               problem.per_element_mask_everywhere)
    return range_walk(tile_range, num_kv_tiles, problem.per_element_mask_everywhere)


def kv_walk(problem: _Problem, scalars, b, kv_head, head, j, num_q_tiles: int) -> Walk:
    """The walk over query tiles that see key tile j (dK/dV), for query head `head` of kv head `kv_head`."""
    bq, bk = problem.config.block_q, problem.config.block_k
    if problem.table_shape is not None:
        tb, th = problem.table_shape
        row = (b if tb > 1 else 0, kv_head * problem.group + head if th > 1 else 0, j)
        return table_walk(scalars.q_tables, row, problem.per_element_mask_everywhere)
    tile_range = q_tile_range(j * bk, bk, scalars.q_len[b], scalars.kv_len[b], bq, window(problem), num_q_tiles,
                              problem.per_element_mask_everywhere)
    return range_walk(tile_range, num_q_tiles, problem.per_element_mask_everywhere)


def run_step(walk: Walk, step, body: Callable) -> None:
    """Runs body(masked) for a visited step: the masked or the unmasked variant of the tile's math."""
    visited, masked = walk.visited(step), walk.masked(step)
    if walk.always_masked:
        pl.when(visited)(lambda: body(True))
        return

    @pl.when(visited & masked)
    def _():
        body(True)

    @pl.when(visited & jnp.logical_not(masked))
    def _():
        body(False)
