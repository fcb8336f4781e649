"""A BlockMask's tables as arrays: ordered (count, indices) tables <-> dense tile classes, and the tables of
any block size on a kernel's tiles (`tables_on_tiles`), each side a multiple or a divisor of the block's.

A kernel tile finer than the blocks lies inside one block and keeps its class (`_tiles.refined_tables`, no
dense step). A kernel tile coarser than the blocks covers several of them (or parts of the last): it is
skipped when every block it covers is empty, full (no per-element mask) only when every one is full, and
partial otherwise, where the kernel evaluates mask_mod on each element. That is exact when mask_mod alone
gives the mask the tables describe (`BlockMask.exact_mask_mod`: every mask from `create_block_mask`, its
slices and crops), since mask_mod is then False on an empty block and True on a full one; positions past the
tables' extent count as empty, so a tile reaching past the key length is never full.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax_kernels._tiles import refined_tables


def tiles_of(num_blocks: jax.Array, indices: jax.Array) -> jax.Array:
    """`[B, H, rows, cols]` bool: the tiles that 4-D (num_blocks, indices) tables list (a scatter, linear in
    the size of the tables)."""
    cols = indices.shape[-1]
    used = jnp.arange(cols, dtype=num_blocks.dtype).reshape(1, 1, 1, cols) < num_blocks[..., None]
    target = jnp.where(used, indices, cols)  # unused entries land in a spare column, dropped below
    dense = jnp.zeros((*indices.shape[:-1], cols + 1), jnp.bool_)
    lead = jnp.indices(indices.shape, sparse=True)[:-1]
    return dense.at[(*lead, target)].set(True)[..., :cols]


def ordered_indices(selected: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(count, indices) of the True entries along the last axis, those first and ascending."""
    count = jnp.sum(selected, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(~selected, axis=-1, stable=True).astype(jnp.int32)
    return count, order


def tile_classes(tables: tuple) -> jax.Array:
    """`[B|1, H|1, rows, cols]` int8 tile classes of 4-D tables `(num_partial, partial, num_full, full)`: 0
    empty, 1 partial, 2 full."""
    num_partial, partial, num_full, full = tables
    return tiles_of(num_partial, partial).astype(jnp.int8) + 2 * tiles_of(num_full, full).astype(jnp.int8)


def tile_class_mask_mod(classes, block_size, mask_mod, b, h, q_idx, kv_idx):
    """The element-wise mask that tables of `classes` (`[B|1, H|1, rows, cols]` int8: 0 empty, 1 partial,
    2 full) and `mask_mod` stand for: True on full tiles, mask_mod on partial ones, False on empty ones.
    Broadcast table axes are read at 0, so the result reads b / h only where the tables have them."""
    batch, heads, rows, cols = classes.shape
    row = jnp.minimum(q_idx // block_size[0], rows - 1)
    col = jnp.minimum(kv_idx // block_size[1], cols - 1)
    tile = classes[b if batch > 1 else 0, h if heads > 1 else 0, row, col]
    return (tile == 2) | ((tile == 1) & mask_mod(b, h, q_idx, kv_idx))


def check_tiles(block_size: tuple[int, int], tile: tuple[int, int]) -> str | None:
    """Why tables of `block_size` blocks cannot be put on kernel tiles `tile` (None when they can): on each
    axis one must divide the other (always so for powers of two)."""
    for name, block, size in zip(("rows", "columns"), block_size, tile):
        if block % size and size % block:
            return f"kernel tiles {tuple(tile)} neither divide nor are multiples of the {name} of {tuple(block_size)}"
    return None


def _onto(tiles: jax.Array, axis: int, block: int, size: int, count: int, reduce) -> jax.Array:
    """Bool `tiles` of `block` along `axis` as `count` tiles of `size`: each block repeated for the tiles in it,
    or the blocks under each tile combined by `reduce` (jnp.any / jnp.all; positions past the blocks are
    False)."""
    if block % size == 0:
        tiles = jnp.repeat(tiles, block // size, axis=axis)
        factor = 1
    else:
        factor = size // block
    extra = count * factor - tiles.shape[axis]
    if extra < 0:
        raise ValueError(f"{count} tiles of {size} cannot hold {tiles.shape[axis]} blocks of {block}.")
    tiles = jnp.pad(tiles, [(0, extra if a == axis else 0) for a in range(tiles.ndim)])
    if factor == 1:
        return tiles
    shape = (*tiles.shape[:axis], count, factor, *tiles.shape[axis + 1:])
    return reduce(tiles.reshape(shape), axis=axis + 1)


def tables_on_tiles(tables: tuple, block_size: tuple[int, int], tile: tuple[int, int],
                    grid: tuple[int, int]) -> tuple:
    """Block tables `(num_partial, partial_indices, num_full, full_indices)` of `block_size` blocks (rows,
    columns: a BlockMask's (q, kv) for `kv_tables`, (kv, q) for `q_tables`) as tables of the kernel's `tile`
    over its `grid` of (rows, columns) tiles (the padded sequences over the tile); see the module docstring.
    Counts `[B|1, H|1, grid rows]` int32, indices `[B|1, H|1, grid rows, listed]` int32; traced tables work
    (no host sync)."""
    reason = check_tiles(block_size, tile)
    if reason is not None:
        raise ValueError(reason)
    num_partial, partial, num_full, full = tables
    fine = all(b % t == 0 for b, t in zip(block_size, tile))
    if fine and all(n * b == g * t for n, b, g, t in zip(partial.shape[-2:], block_size, grid, tile)):
        return refined_tables(tables, block_size, tile)
    full_tiles = tiles_of(num_full, full)
    visited = tiles_of(num_partial, partial) | full_tiles
    for axis, block, size, count in zip((2, 3), block_size, tile, grid):
        visited = _onto(visited, axis, block, size, count, jnp.any)
        full_tiles = _onto(full_tiles, axis, block, size, count, jnp.all)
    return (*ordered_indices(visited & ~full_tiles), *ordered_indices(full_tiles))
