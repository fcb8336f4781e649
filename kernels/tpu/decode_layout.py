"""How the Mosaic TPU decode kernel reads a KV cache: the view of its blocks in HBM and VMEM, and a head's keys.

XLA lays a cache `[.., S, K, D]` (pages `[P, page, K, D]`, dense `[B, S, K, D]`) out in HBM tiled on its last
two dims (K, D): tiles of (r, 128) with r = K for K in {1, 2, 4} (bfloat16 / int8 drop a K of 1 and tile
(S, D)), 8 otherwise, so each key's K x D values are one run of whole tiles. Two views of it:

- **rows** (`[.., S * K, D]`, row `key * K + g`): a reshape that is free (a bitcast: no copy) exactly when
  those tiles stack into (8, 128) tiles of the merged rows: K % 8 == 0 (any D), K in {1, 2, 4} with
  D <= 128, or K = 1 in a 16-bit dtype (any D) (checked in compiled HLO for v5e / v5p / v6e, bfloat16
  and float32, K in {1, 2, 3, 4, 8, 16}, D in {64, 128, 192, 256}: scripts/compile/tpu_decode_layout.py).
  A block of `tile` keys is then `[tile * K, W]`, dense on sublanes and lanes: no padding of K up to the
  sublane tile (8x for K = 2 in bfloat16 under the heads view), one contiguous DMA per page, and head g's
  keys are a sublane-strided load `block[g::K]` (tile, W), head dim on the lanes. Mosaic's strided load needs
  a block whose lane width is at most 128, so D > 128 is read in ceil(D / 128) lane blocks of 128 (one
  BlockSpec each; the last may run past D, its lanes past D are zeroed after the load, since a block past
  the array's end holds anything).
- **heads** (`[.., S, K, D]` as given): whole `[tile, K, D]` blocks and head g's keys `block[:, g, :]` (one
  sublane per key). Used only where the rows view would copy the cache and this one does not (D > 128 with
  K in {2, 4}, or K = 1 in float32), or where Mosaic cannot stride over the tile (K > 1 with an odd tile in
  a 16-bit dtype: a dense cache shorter than a block).

Where neither view is free (K = 3, 5, 6, 7, ...; a head dim under 128 that XLA lays out with another dim on
the lanes, as it does for D = 64 or 192 when the page count is a multiple of 128), XLA copies the cache
into the kernel's layout whatever the kernel does; the kernel then takes the dense rows view. A float16
cache is converted to float32 by XLA before the kernel (a copy anyway), so it takes the rows view too.
The lane view `[.., S, K * D]` is never free for K > 1: K sits on the tiles' sublanes, not their lanes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

LANES = 128


@dataclasses.dataclass(frozen=True)
class CacheView:
    """How one cache (keys or values) is read: its view, lane blocks and head dim (hashable: part of the plan)."""

    rows: bool  # True: `[.., S * K, D]` blocks, a head's keys strided rows; False: `[.., S, K, D]` blocks
    num_kv_heads: int  # K
    dim: int  # D (or Dv)
    width: int  # lanes of one block: D when D <= 128 or under the heads view, else 128
    chunks: int  # lane blocks per tile: ceil(D / width)

    @property
    def padded_dim(self) -> int:
        """Lanes of the blocks together: D rounded up to the block width."""
        return self.width * self.chunks


def rows_view_is_free(num_kv_heads: int, dim: int, dtype) -> bool:
    """Whether `[.., S, K, D] -> [.., S * K, D]` is a bitcast of XLA's default TPU layout (see the module
    docstring; a head dim XLA lays out with another dim on the lanes copies either way)."""
    if num_kv_heads % 8 == 0 or (num_kv_heads == 1 and jnp.dtype(dtype).itemsize < 4):
        return True
    return dim <= LANES and num_kv_heads in (1, 2, 4)


def cache_view(num_kv_heads: int, dim: int, dtype, tile: int, converted: bool = False) -> CacheView:
    """The view the kernel reads a cache of `dtype` (the kernel's: after any conversion) in, blocks of `tile`
    keys: rows, unless that view copies the cache and the heads view does not, or its strided load cannot
    take the tile (Mosaic strides over packed rows only for a whole number of 32-bit rows: an even tile in
    a 16-bit dtype, "Unsupported strided load for packed type"; a dense cache shorter than a block).
    `converted`: XLA converts the cache for the kernel (a new array, laid out as the kernel asks: the rows
    view is free)."""
    packing = max(1, 4 // jnp.dtype(dtype).itemsize)
    if num_kv_heads > 1 and tile % packing:
        return CacheView(rows=False, num_kv_heads=num_kv_heads, dim=dim, width=dim, chunks=1)
    heads_free = num_kv_heads in (2, 4) or (num_kv_heads == 1 and jnp.dtype(dtype).itemsize == 4)
    rows = converted or rows_view_is_free(num_kv_heads, dim, dtype) or not heads_free
    width = min(dim, LANES) if rows else dim
    return CacheView(rows=rows, num_kv_heads=num_kv_heads, dim=dim, width=width, chunks=-(-dim // width))


def as_view(cache, view: CacheView):
    """The cache array in `view`: `[.., S, K, D]` -> `[.., S * K, D]` for the rows view (a free reshape)."""
    if not view.rows:
        return cache
    *lead, keys, heads, dim = cache.shape
    return cache.reshape(*lead, keys * heads, dim)


def block_spec(view: CacheView, tile: int, chunk: int, index_map) -> pl.BlockSpec:
    """The BlockSpec of lane block `chunk` of one tile of `tile` keys; `index_map(*grid, *scalars)` gives
    (leading index, tile index) of the tile."""
    if view.rows:
        def rows_map(*args):
            lead, tile_index = index_map(*args)
            return lead, tile_index, chunk
        return pl.BlockSpec((None, tile * view.num_kv_heads, view.width), rows_map)

    def heads_map(*args):
        lead, tile_index = index_map(*args)
        return lead, tile_index, 0, 0
    return pl.BlockSpec((None, tile, view.num_kv_heads, view.dim), heads_map)


def head_keys(view: CacheView, ref, head: int, chunk: int):
    """Head `head`'s keys of one tile's block (lane block `chunk`): `(tile, width)`, lanes past D zero."""
    if not view.rows:
        return ref[:, head, :]
    heads = view.num_kv_heads
    tile = ref.shape[0] // heads
    x = ref[...] if heads == 1 else ref[pl.ds(head, tile, stride=heads), :]
    real = view.dim - chunk * view.width
    if real < view.width:  # the last lane block runs past D: those lanes hold anything (NaN * 0 is NaN)
        lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
        x = jnp.where(lane < real, x, jnp.zeros((), x.dtype))
    return x


def pad_lanes(x: jax.Array, view: CacheView) -> jax.Array:
    """`[..., D]` -> `[..., padded_dim]` with zero lanes (the queries, matched to the key blocks)."""
    extra = view.padded_dim - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])
