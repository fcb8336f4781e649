"""What the tcgen05 kernels (`forward_tcgen05`, `backward_tcgen05`) read beside Q and K, and how: segment ids,
the hooks' vectors along q_idx / kv_idx (`hook_vectors`), a dense mask's int8 tiles and a bias's tiles or
vectors. Each arrives by TMA into shared memory (the rows' with Q, the keys' with each K tile) and is loaded in
the tensor-memory tile layout: a vector along rows is `Layout.TCGEN05.reduce(1)`, one along columns
`.reduce(0)` (a row's columns are spread over four threads: block_k / 4 registers a thread).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_kernels.mosaic.common import mask_index, mask_tiles
from probjax_kernels.mosaic.hook_vectors import vectors_in, views


def segment_smem_bytes(rows: int, keys: int, segments: bool) -> list[int]:
    """The shared-memory buffers of the int32 segment ids a tcgen05 kernel holds: `rows` queries' and `keys`
    keys' (none without `segments`)."""
    return [4 * rows, 4 * keys] if segments else []


def load_segments(ref, axis: int):
    """A 32-bit vector from shared memory (segment ids, a hook's vector) along a tensor-memory tile's rows
    (`axis` 0: one per query row) or columns (`axis` 1: one per key column)."""
    return plgpu.load(ref, layout=plgpu.Layout.TCGEN05.reduce(1 - axis))


def bias_tile(kind: str, buffer, slot, shape: tuple) -> jax.Array:
    """A bias's float32 tile of `shape` from shared memory, read as `check_bias`'s `kind`: a tile of the
    ring's `slot`, the slot's key vector along the rows, or the CTA's row vector along the columns."""
    if kind == "rows":
        return lax.broadcast_in_dim(load_segments(buffer, 0), shape, [0])
    view = buffer.at[slot]
    if kind == "keys":
        return lax.broadcast_in_dim(load_segments(view, 1), shape, [1])
    return plgpu.load(view, layout=plgpu.Layout.TCGEN05).astype(jnp.float32)


def load_mask(view) -> jax.Array:
    """A dense mask's int8 tile (or chunk) in shared memory as a boolean tensor-memory-layout tile."""
    return plgpu.load(view, layout=plgpu.Layout.TCGEN05) != 0


def vector_counts(score_vectors: tuple, mask_vectors: tuple) -> tuple[int, int]:
    """How many hook vectors a kernel holds along queries and along keys (`score_vectors` / `mask_vectors`: per
    hook array, the axes of its vectors)."""
    axes = [axis for array_axes in (*score_vectors, *mask_vectors) for axis in array_axes]
    return axes.count("q"), axes.count("kv")


def vector_scratch(vectors: list, resident: str, rows: int, keys: int, num_stages: int) -> tuple:
    """The shared-memory buffers of the hooks' vectors (`hook_vectors.vectors_in`'s (axis, array) pairs) in a
    tcgen05 kernel: a vector along the `resident` axis ("q", "kv", or None) holds the CTA's `rows` queries' or
    `keys` keys' values; the others a ring of `num_stages` slots, one per step."""
    def buffer(axis, array):
        length = rows if axis == "q" else keys
        return plgpu.SMEM((length,) if axis == resident else (num_stages, length), array.dtype)
    return tuple(buffer(axis, array) for axis, array in vectors)


def vector_source(ref, batch, head, start, length: int):
    """The global-memory part of a hook vector `[B|1, N|1, L]` that a CTA of (batch, head) reads from `start`."""
    return ref.at[(*mask_index(ref, batch, head), pl.ds(start, length))]


def vector_tiles(vectors: list, buffers, shape: tuple, slot=None, columns=None) -> list:
    """Per hook vector, a function giving its tile of `shape` (a tensor-memory-layout tile or chunk), loaded
    from shared memory when a hook reads it: a vector along queries broadcast along the columns, one along keys
    (restricted to `columns` of it) along the rows. A buffer with a ring (two axes) is read at `slot`."""
    def tile(axis, buffer):
        view = buffer.at[slot] if len(buffer.shape) == 2 else buffer
        if axis == "kv" and columns is not None:
            view = view.at[columns]
        return lambda: lax.broadcast_in_dim(load_segments(view, 0 if axis == "q" else 1), shape,
                                            [0 if axis == "q" else 1])
    return [tile(axis, buffer) for (axis, _), buffer in zip(vectors, buffers)]


def key_sources(batch, head, rows, segments: tuple, vectors: tuple, mask: tuple,
                bias: tuple = (None, None)) -> list:
    """(source, ring) of what arrives with each K tile of the forward and dQ kernels, for `fill_kv_ring`;
    `source(start, length)` is the global-memory part that a tile of `length` keys from `start` reads:
    - `segments`: (both segment ids' refs or None, the keys' ring);
    - `vectors`: the hooks' (axis, ref) vectors and their buffers: those along keys, (batch, head)'s;
    - `mask`: (the dense mask's ref or None, its rings): the query tile's `rows` (a `pl.ds`), the tile's keys
      split evenly over the rings (64-column parts where the kernel reads the mask in chunks);
    - `bias`: (a bias's ref read as tiles or key vectors, its ring; or None): the tile's part of it."""
    (segment_refs, segment_ring), (hook_vectors, buffers), (mask_ref, mask_rings) = segments, vectors, mask
    out = []
    if segment_refs is not None:
        out.append((lambda start, length: segment_refs[1].at[batch, pl.ds(start, length)], segment_ring))
    out += [(functools.partial(vector_source, ref, batch, head), buffer)
            for (axis, ref), buffer in zip(hook_vectors, buffers) if axis == "kv"]
    for part, ring in enumerate(mask_rings):
        def mask_part(start, length, part=part):
            width = length // len(mask_rings)
            return mask_ref.at[(*mask_index(mask_ref, batch, head), rows,
                                pl.ds(start + part * width, width))]
        out.append((mask_part, ring))
    bias_ref, bias_ring = bias
    if bias_ring is not None:
        def bias_part(start, length):
            keys = pl.ds(start, length)
            index = mask_index(bias_ref, batch, head)
            return bias_ref.at[(*index, rows, keys) if len(bias_ref.shape) == 4 else (*index, keys)]
        out.append((bias_part, bias_ring))
    return out


def hook_views(groups: tuple, tiles: list) -> tuple:
    """(score_arrays, mask_arrays) as the hooks get them in a step: refs as they are, vectors as `VectorTiles`
    whose tiles are `tiles` (`vector_tiles`, in `vectors_in` order: the score_fn's, then the mask_fn's)."""
    score_count = len(vectors_in(groups[0]))
    return views(groups[0], tiles[:score_count]), views(groups[1], tiles[score_count:])


def mask_rings(mask, num_stages: int, rows: int, keys: int, chunk: int) -> tuple:
    """The shared-memory rings of a dense mask's int8 (`rows`, `keys`) tiles in a backward kernel (none without
    a mask): `chunk`-column parts, a ring each, so that each chunk of S reads its part whole (a slice of a
    swizzled wider tile is not a tile)."""
    if mask is None:
        return ()
    return tuple(plgpu.SMEM((num_stages, rows, chunk), jnp.int8, transforms=mask_tiles(chunk))
                 for _ in range(keys // chunk))


def chunk_views(groups: tuple, vectors: list, buffers, shape: tuple, slot):
    """`columns -> (score_arrays, mask_arrays)`: the hooks' arrays for the chunk of `shape` at `columns` of a
    step's tile (`hook_views` of `vector_tiles` at the ring's `slot`)."""
    return lambda columns: hook_views(groups, vector_tiles(vectors, buffers, shape, slot, columns))
