"""The tile walk of the Mosaic TPU kernels: which key tiles a query tile visits (or query tiles a key tile),
from scalar-prefetched lengths or a `BlockMask`'s tables, with index maps that clamp skipped steps onto the
last visited tile so they cost no DMA, and which steps run the per-element mask.

A grid's last axis counts steps, not tiles: step j visits tile lo + j of the tile range (`_tiles.py`), or
entry j of a `BlockMask` row (partial entries, then full ones); steps past the range repeat the last
visited tile in every index map (the pipeline skips a DMA whose block index did not change) and the kernel
skips their compute. Such a skipped step still costs the grid's fixed step overhead; where the static shapes
already rule steps out (causal, local windows), `step_grid` lists only the steps a program may visit, on one
flattened axis.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from probjax_kernels._problem import _Problem
from probjax_kernels._tiles import kv_tile_range, q_tile_range
from probjax_kernels.tpu.chips import Chip


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


# A flattened step is one int32 code: tile * 2**16 + step * 2 + last (tile and step under 2**15).
_TILE_SHIFT, _MAX_CODE_FIELD = 1 << 16, 1 << 15
# Most codes a flattened grid scalar-prefetches into SMEM (4 bytes each, 64 KiB; a larger grid keeps two axes).
MAX_FLAT_STEPS = 1 << 14


@dataclasses.dataclass(frozen=True)
class StepGrid:
    """The (tile, step) axes of a kernel's (B, head block, tile, step) grid: two axes of `num_tiles` x
    `num_steps`, or (`codes` set) one flattened "arbitrary" axis over the (tile, step) pairs a program may
    visit, in tile order, as scalar-prefetched int32 codes (tile * 2**16 + step * 2 + last). Kernels and index
    maps see (b, block, tile, step) either way; `last` marks a tile's last step, where its outputs are written.
    The flattened axis gives up the tile axis' "parallel" semantics (a megacore chip then splits only the batch
    and head-block axes)."""

    num_tiles: int
    num_steps: int
    codes: np.ndarray | None = None

    @property
    def flat(self) -> bool:
        return self.codes is not None

    @property
    def num_visits(self) -> int:
        """Grid steps a program runs on these axes."""
        return len(self.codes) if self.flat else self.num_tiles * self.num_steps

    def shape(self, *outer: int) -> tuple[int, ...]:
        return (*outer, len(self.codes)) if self.flat else (*outer, self.num_tiles, self.num_steps)

    def semantics(self, num_outer: int = 2) -> tuple[str, ...]:
        return ("parallel",) * num_outer + (("arbitrary",) if self.flat else ("parallel", "arbitrary"))

    def scalar_inputs(self) -> list:
        """The codes, first of the scalar-prefetched inputs (none on two axes)."""
        return [jnp.asarray(self.codes, jnp.int32)] if self.flat else []

    def ids(self, refs: tuple) -> tuple[tuple, tuple]:
        """((b, block, tile, step, last), the kernel's other refs) inside a kernel."""
        if not self.flat:
            b, block, tile, step = (pl.program_id(axis) for axis in range(4))
            return (b, block, tile, step, step == pl.num_programs(3) - 1), refs
        code = refs[0][pl.program_id(2)]
        tile, step, last = _decode(code)
        return (pl.program_id(0), pl.program_id(1), tile, step, last == 1), refs[1:]

    def spec(self, spec: pl.BlockSpec) -> pl.BlockSpec:
        """`spec` with its index map, written for (b, block, tile, step, *scalar refs), read off the codes."""
        if not self.flat or spec.index_map is None:
            return spec
        index_map = spec.index_map

        def flat_index_map(b, block, visit, codes_ref, *scalar_refs):
            tile, step, _ = _decode(codes_ref[visit])
            return index_map(b, block, tile, step, *scalar_refs)

        return dataclasses.replace(spec, index_map=flat_index_map)

    def specs(self, specs) -> list:
        return [self.spec(spec) for spec in specs]


def _decode(code):
    return code // _TILE_SHIFT, (code % _TILE_SHIFT) // 2, code % 2


def full_length_ranges(kind: str, tile: tuple[int, int], lengths: tuple[int, int], window, num_steps: int):
    """(lo, hi) per tile of `_tiles.kv_tile_range` (`kind` "q") or `q_tile_range` ("kv") at the full padded
    (T, S) `lengths`, in NumPy: static, with no device to evaluate jnp on (a deviceless compile has none)."""
    (bq, bk), (t_pad, s_pad), (left, right) = tile, lengths, window
    size, other, length = (bq, bk, t_pad) if kind == "q" else (bk, bq, s_pad)
    start = np.arange(length // size) * size
    end = np.minimum(start + size, length)
    if kind == "q":  # keys [start - left, end - 1 + right] of rows [start, end)
        first = np.zeros_like(start) if left is None else np.maximum(start - left, 0)
        stop = np.full_like(start, s_pad) if right is None else np.minimum(s_pad, end + right)
    else:  # rows [start - right, end - 1 + left] that see keys [start, end)
        first = np.zeros_like(start) if right is None else np.maximum(start - right, 0)
        stop = np.full_like(start, t_pad) if left is None else np.minimum(t_pad, end + left)
    hi = np.where((end > start) & (stop > first), -(-stop // other), 0)
    lo = np.minimum(first // other, hi)
    return np.minimum(lo, num_steps), np.minimum(hi, num_steps)


def step_grid(problem: _Problem, kind: str, chip: Chip, lengths: tuple[int, int], num_steps: int,
              parallel_programs: int, head_steps: int = 1, every_step: bool = False) -> StepGrid:
    """The step axes of a kernel walking key tiles per query tile (`kind` "q": forward, dQ, tangent) or query
    tiles per key tile ("kv": dK/dV) over the padded (T, S) `lengths`, `num_steps` steps a tile (times
    `head_steps`: the transposed dK/dV walks the query heads of a group in turn, `num_steps` apart).

    Flattened when the static shapes leave idle steps, which each cost a grid step's fixed overhead
    (docs/perf-notes.md, TPU tile model): a tile visits at most the tiles of its range at the full lengths
    (shorter runtime lengths only shrink a range, `_tiles`), so only those steps are listed. Kept on two axes
    when nothing is idle, for a `BlockMask` (its tables' rows set the steps) or `every_step` (dQ writing every
    dS block), when the codes would not fit (`MAX_FLAT_STEPS`), and on a megacore chip whose
    `parallel_programs` (batch x head blocks) are odd: its second core would idle for a whole program, where
    the tile axis splits evenly."""
    bq, bk = problem.config.block_q, problem.config.block_k
    t_pad, s_pad = lengths
    num_tiles = t_pad // bq if kind == "q" else s_pad // bk
    two_axes = StepGrid(num_tiles, head_steps * num_steps)
    if problem.table_shape is not None or every_step or (chip.megacore and parallel_programs % 2):
        return two_axes
    lo, hi = full_length_ranges(kind, (bq, bk), lengths, window(problem), num_steps)
    counts = np.maximum(hi - lo, 1)  # every tile's first step writes its outputs
    visits = int(counts.sum()) * head_steps
    if (visits >= num_tiles * num_steps * head_steps or visits > MAX_FLAT_STEPS
            or num_tiles > _MAX_CODE_FIELD or head_steps * num_steps > _MAX_CODE_FIELD):
        return two_axes
    codes = []
    for tile, count in enumerate(counts.tolist()):
        steps = [head * num_steps + step for head in range(head_steps) for step in range(count)]
        codes += [tile * _TILE_SHIFT + step * 2 + (n == len(steps) - 1) for n, step in enumerate(steps)]
    return StepGrid(num_tiles, head_steps * num_steps, np.asarray(codes, np.int32))
