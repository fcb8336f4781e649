"""The re-tiling of a BlockMask's tiles onto tiles the kernels can run (the ordered (count, indices) tables <->
dense tile classes conversions are `_table_tiles`', re-exported here).

A `BlockMask` may use any tile PyTorch accepts (8, 48, 96, (64, 48), ...), while the kernels' tiles are
powers of two >= 16 that must divide the tables' tile. `retile` maps the tables onto such a tile at call time:

- a tile that is a multiple of 16 is split into its largest power-of-two divisor (48 -> 16, 96 -> 32): every
  kernel tile lies inside one mask tile and keeps its class, so nothing else changes;
- any other tile (8, 24, 100) is merged into power-of-two tiles (8 -> 16, 100 -> 64) that may cover several
  mask tiles: one is empty only if every mask tile it covers is empty, full only if every one is full, and
  partial otherwise, where `tile_class_mask_mod` evaluates the mask per element as the mask's tables say
  (full: attend, empty: masked, partial: its mask_mod).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from probjax_kernels._table_tiles import ordered_indices as ordered_indices
from probjax_kernels._table_tiles import tile_class_mask_mod as tile_class_mask_mod
from probjax_kernels._table_tiles import tiles_of as tiles_of

KERNEL_MIN_TILE = 16


def check_block_size(block_size, name: str = "block_size") -> tuple[int, int]:
    """(block_q, block_kv) from an int or a pair of ints >= 1, as PyTorch takes it."""
    pair = (block_size, block_size) if isinstance(block_size, (int, np.integer)) else tuple(block_size)
    if len(pair) != 2 or any(not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1 for b in pair):
        raise ValueError(f"{name} must be an int >= 1 or a pair of them (block_q, block_kv), got {block_size!r}.")
    return int(pair[0]), int(pair[1])


def kernel_tile(size: int) -> int:
    """The table tile the kernels run for a mask tile of `size` along one axis (see the module docstring)."""
    if size >= KERNEL_MIN_TILE and size & (size - 1) == 0:
        return size
    if size % KERNEL_MIN_TILE == 0:
        return size & -size  # the largest power of two dividing it
    return max(KERNEL_MIN_TILE, 1 << (size.bit_length() - 1))


def _cover(length: int, old: int, new: int) -> tuple[np.ndarray, np.ndarray]:
    """For one axis of `length` positions: which old tiles each new tile overlaps `[new_tiles, old_tiles]`, and
    whether a new tile reaches past the old tiles' extent (positions that no table describes)."""
    new_tiles, old_tiles = -(-length // new), -(-length // old)
    start = np.arange(new_tiles)[:, None] * new
    old_start = np.arange(old_tiles)[None, :] * old
    overlaps = (old_start < start + new) & (start < old_start + old)
    beyond = (np.arange(new_tiles) + 1) * new > old_tiles * old
    return overlaps, beyond


def retile(partial: jax.Array, full: jax.Array, block_size: tuple[int, int], seq_lengths: tuple[int, int]):
    """Partial / full `[B, H, rows, cols]` bool tiles of `block_size` mapped onto `kernel_tile`'s tiles.

    Returns (partial, full, new block size, merged): `merged` is True when a new tile can cover several mask
    tiles (its mask_mod must then follow the old tables, `tile_class_mask_mod`). A new tile reaching past the
    old tables' extent is never full.
    """
    new_size = tuple(kernel_tile(b) for b in block_size)
    if new_size == tuple(block_size):
        return partial, full, new_size, False
    (rows, row_beyond), (cols, col_beyond) = (_cover(n, b, t) for n, b, t in zip(seq_lengths, block_size, new_size))
    rows, cols = jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32)

    def count(tiles):  # how many of the old tiles under each new tile are set
        return jnp.einsum("ri,bhij,cj->bhrc", rows, tiles.astype(jnp.int32), cols)

    covered = (jnp.sum(rows, axis=1)[:, None] * jnp.sum(cols, axis=1)[None, :])[None, None]
    inside = jnp.asarray(~row_beyond[:, None] & ~col_beyond[None, :])[None, None]
    new_full = (count(full) == covered) & inside
    new_partial = (count(partial | full) > 0) & ~new_full
    merged = any(b % t for b, t in zip(block_size, new_size))
    return new_partial, new_full, new_size, merged
