"""Which tiles a block of query rows (or keys) visits under a local window and the sequence lengths, and a
BlockMask's tables on finer tiles (`refined_tables`); shared by the Triton, Mosaic GPU and Mosaic TPU kernels.
A query at row r sees the keys in [r - left, r + right] below kv_len (`window = (left, right)`, None =
unbounded; causal is right = 0). The ranges are traced int32 scalars (lo, full_lo, full_hi, hi): tiles
[lo, hi) are visited, of which [full_lo, full_hi) need no per-element mask and the others do; lo = hi when
nothing is visited.
"""

from __future__ import annotations

import jax.numpy as jnp

Window = tuple[int | None, int | None]


def _cdiv(a, b: int):
    return -(-a // b)


def _clamp(lo, full_lo, full_hi, hi, num_tiles: int | None, mask_everywhere: bool):
    if num_tiles is not None:  # lengths past the padded arrays (traced, so unchecked) must not index past them
        lo, hi = jnp.minimum(lo, num_tiles), jnp.minimum(hi, num_tiles)
    if mask_everywhere:
        return lo, hi, hi, hi
    full_lo = jnp.clip(full_lo, lo, hi)
    return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def kv_tile_range(row0, rows: int, q_len, kv_len, block_k: int, window: Window, num_tiles: int | None = None,
                  mask_everywhere: bool = False):
    """KV tiles of `block_k` keys that the query rows [row0, row0 + rows) visit: the tiles holding a key that
    a row < q_len sees, from the first to the last; the unmasked ones are those every row of the block (rows
    >= q_len included) sees whole. `mask_everywhere`: no tile skips the per-element mask (segments, dense
    masks)."""
    left, right = window
    row_end = jnp.minimum(row0 + rows, q_len)
    key_start = 0 if left is None else jnp.maximum(row0 - left, 0)
    key_end = kv_len if right is None else jnp.minimum(kv_len, row_end + right)
    hi = jnp.where((row_end > row0) & (key_end > key_start), _cdiv(key_end, block_k), 0)
    lo = jnp.minimum(key_start // block_k, hi)
    # tile j is inside every row's left edge iff j * block_k >= the last row - left, and inside the right edge
    # iff its last key (j + 1) * block_k - 1 <= row0 + right
    full_lo = lo if left is None else _cdiv(row0 + rows - 1 - left, block_k)
    full_hi = kv_len // block_k
    if right is not None:
        full_hi = jnp.minimum(full_hi, (row0 + right + 1) // block_k)
    return _clamp(lo, full_lo, full_hi, hi, num_tiles, mask_everywhere)


def q_tile_range(key0, keys: int, q_len, kv_len, block_q: int, window: Window, num_tiles: int | None = None,
                 mask_everywhere: bool = False):
    """Query tiles of `block_q` rows that see the keys [key0, key0 + keys) (those below kv_len): the tiles
    holding a row < q_len that sees one of them, from the first to the last; the unmasked ones see all of
    them from every row (rows >= q_len need no mask: the backward gives them p = 0). A key block straddling
    kv_len masks every tile."""
    left, right = window
    key_end = jnp.minimum(key0 + keys, kv_len)
    row_start = 0 if right is None else jnp.maximum(key0 - right, 0)
    row_end = q_len if left is None else jnp.minimum(q_len, key_end + left)
    hi = jnp.where((key_end > key0) & (row_end > row_start), _cdiv(row_end, block_q), 0)
    lo = jnp.minimum(row_start // block_q, hi)
    # tile t is right of every key's window edge iff t * block_q >= the last key - right, and its last row
    # (t + 1) * block_q - 1 <= the first key + left
    full_lo = lo if right is None else _cdiv(key0 + keys - 1 - right, block_q)
    full_hi = jnp.where(key0 + keys > kv_len, 0, hi)
    if left is not None:
        full_hi = jnp.minimum(full_hi, (key0 + left + 1) // block_q)
    return _clamp(lo, full_lo, full_hi, hi, num_tiles, mask_everywhere)


def refined_tables(tables: tuple, block_size: tuple[int, int], tile: tuple[int, int]) -> tuple:
    """Block tables `(num_partial, partial_indices, num_full, full_indices)` of `block_size` tiles (rows,
    columns: a BlockMask's (q, kv) for `kv_tables`, (kv, q) for `q_tables`) as tables of the kernel's `tile`,
    each side of which divides the block's: a row of blocks repeats for each row of tiles it covers, and a
    listed block becomes its tiles, in order (a partial block's tiles are partial: the kernel applies the
    mask_mod there; a full block's are full). Counts `[B|1, H|1, rows]`, indices `[B|1, H|1, rows, listed]`."""
    (rows, cols), (tile_rows, tile_cols) = block_size, tile
    row_split, col_split = rows // tile_rows, cols // tile_cols
    if (row_split, col_split) == (1, 1):
        return tuple(tables)
    num_partial, partial, num_full, full = tables

    def counts(num):
        return jnp.repeat(num * col_split, row_split, axis=2)

    def indices(listed):
        split = listed[..., None] * col_split + jnp.arange(col_split, dtype=listed.dtype).reshape(1, 1, 1, 1, -1)
        return jnp.repeat(split.reshape(*listed.shape[:-1], -1), row_split, axis=2)

    return counts(num_partial), indices(partial), counts(num_full), indices(full)
