"""What the Hopper kernels over query rows (the dQ kernel, `mosaic.backward`, and the tangent kernel,
`mosaic.tangent`) read beside Q and the K / V tiles, and how they walk their KV steps: the rows' segment ids,
row bias and hook vectors (with each consumer's rows), the keys' segment ids, the dense mask's and the bias's
tiles of each part, the keys' bias and hook vectors (with each K tile, on K's barrier)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_kernels.mosaic.common import _CONSUMERS, bias_scratch, mask_index, mask_tiles, own_ranges
from probjax_kernels.mosaic.hook_vectors import tile_of


def side_scratch(segments, mask, bias_kind: str | None, bias, num_stages: int, block_q: int, block_kv: int,
                 part: int, rows: int) -> tuple:
    """The shared memory of `SideInputs` but the hook vectors', in its order: the rows' segment ids (a buffer
    per consumer of `rows`), a ring of the keys', an int8 ring of (block_q, part) mask tiles per part of a step,
    and the bias's (`bias_scratch`); None for each the call lacks."""
    return (
        plgpu.SMEM((_CONSUMERS, rows), jnp.int32) if segments else None,
        plgpu.SMEM((num_stages, block_kv), jnp.int32) if segments else None,
        tuple(plgpu.SMEM((num_stages, block_q, part), jnp.int8, transforms=mask_tiles(part))
              for _ in range(block_kv // part)) if mask is not None else None,
        bias_scratch(bias_kind, bias, (num_stages, block_q, part), block_kv // part, keys=(num_stages, block_kv),
                     rows=(_CONSUMERS, rows)),
    )


def vector_scratch(vectors, num_stages: int, block_kv: int, rows: int) -> tuple:
    """The hook vectors' shared memory: a buffer per consumer of `rows` along queries, a ring along keys."""
    return tuple(plgpu.SMEM((_CONSUMERS, rows) if axis == "q" else (num_stages, block_kv), ref.dtype)
                 for axis, ref in vectors)


@dataclasses.dataclass(frozen=True)
class SideInputs:
    """The refs of what a kernel reads beside Q / K / V and their shared memory: `segments` (the rows' and the
    keys' id refs) into `q_segment_smem` / `kv_segment_smem`, the dense mask `mask_ref` into `mask_rings` (an
    int8 ring of (block_q, part) tiles per part), the bias `bias_ref` read as `bias` (`check_bias`'s kind) into
    `bias_smem`, and the hooks' `vectors` ((axis, ref) pairs) into `vector_smem`. Refs absent are None."""

    segments: Any
    q_segment_smem: Any
    kv_segment_smem: Any
    mask_ref: Any
    mask_rings: Any
    bias: str | None
    bias_ref: Any
    bias_smem: Any
    vectors: tuple
    vector_smem: Any

    def row_copies(self, batch, head, row0, rows: int, wg) -> tuple[list, list]:
        """(sources, destinations) of what arrives with a consumer's rows: their segment ids, row bias and hook
        vectors along queries."""
        sources, own = [], []
        if self.segments is not None:
            sources.append(self.segments[0].at[batch, pl.ds(row0, rows)])
            own.append(self.q_segment_smem.at[wg])
        if self.bias == "rows":
            sources.append(self.bias_ref.at[(*mask_index(self.bias_ref, batch, head), pl.ds(row0, rows))])
            own.append(self.bias_smem.at[wg])
        for (axis, ref), buffer in zip(self.vectors, self.vector_smem):
            if axis == "q":
                sources.append(ref.at[(*mask_index(ref, batch, head), pl.ds(row0, rows))])
                own.append(buffer.at[wg])
        return sources, own

    def row_values(self, wg) -> tuple:
        """(the rows' segment ids, the row bias) of a consumer, loaded once its row copies have arrived."""
        reduced = plgpu.Layout.WGMMA.reduce(1)
        q_segments = None if self.segments is None else plgpu.load(self.q_segment_smem.at[wg], layout=reduced)
        row_bias = plgpu.load(self.bias_smem.at[wg], layout=reduced) if self.bias == "rows" else None
        return q_segments, row_bias

    def key_copies(self, key0, tile_row0, block_q: int, block_kv: int, part: int, batch, head, ready) -> list:
        """The producer's copies of what arrives with the K tile at `key0`, on the `ready` barrier ring: the keys'
        segment ids, the CTA's rows of the dense mask and of the bias tile by part, the keys' bias and hook
        vectors along keys."""
        copies = []
        if self.segments is not None:
            copies.append((self.segments[1].at[batch, pl.ds(key0, block_kv)], self.kv_segment_smem, ready))
        bias_tiles = self.bias_ref if self.bias == "tiles" else None
        for ref, rings in ((self.mask_ref, self.mask_rings), (bias_tiles, self.bias_smem)):
            if ref is not None:
                index = (*mask_index(ref, batch, head), pl.ds(tile_row0, block_q))
                copies += [(ref.at[(*index, pl.ds(key0 + j * part, part))], ring, ready)
                           for j, ring in enumerate(rings)]
        if self.bias == "keys":
            copies.append((self.bias_ref.at[(*mask_index(self.bias_ref, batch, head), pl.ds(key0, block_kv))],
                           self.bias_smem, ready))
        copies += [(ref.at[(*mask_index(ref, batch, head), pl.ds(key0, block_kv))], buffer, ready)
                   for (axis, ref), buffer in zip(self.vectors, self.vector_smem) if axis == "kv"]
        return copies

    def part_tiles(self, slot, j: int, keys, wg, rows: int, shape: tuple, row_bias) -> tuple:
        """(the keys' segment ids, the mask tile, the float32 bias tile, the hook vectors' tiles) of part `j`
        (`keys` of the K slot `slot`) for a consumer's rows; absent ones None (the vectors' tiles load lazily)."""
        kv_segments = mask_tile = bias_tile = None
        if self.segments is not None:
            kv_segments = plgpu.load(self.kv_segment_smem.at[slot, keys], layout=plgpu.Layout.WGMMA.reduce(0))
        own_rows = pl.ds(wg * rows, rows)
        if self.mask_ref is not None:
            mask_tile = plgpu.load(self.mask_rings[j].at[slot, own_rows], layout=plgpu.Layout.WGMMA)
        if self.bias == "tiles":
            bias_tile = plgpu.load(self.bias_smem[j].at[slot, own_rows], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        elif self.bias == "keys":
            bias_tile = lax.broadcast_in_dim(
                plgpu.load(self.bias_smem.at[slot, keys], layout=plgpu.Layout.WGMMA.reduce(0)), shape, [1])
        elif self.bias == "rows":
            bias_tile = lax.broadcast_in_dim(row_bias, shape, [0])
        tiles = [tile_of(buffer.at[wg], plgpu.Layout.WGMMA.reduce(1), shape, 0) if axis == "q" else
                 tile_of(buffer.at[slot, keys], plgpu.Layout.WGMMA.reduce(0), shape, 1)
                 for (axis, _), buffer in zip(self.vectors, self.vector_smem)]
        return kv_segments, mask_tile, bias_tile, tiles


def run_steps(step, skip, carry, *, tables: tuple | None = None, own: tuple | None = None, cta_lo=None,
              cta_steps=None):
    """A consumer's loop over the CTA's KV steps: `step(n, carry, masked=, user_mask=)` on its own steps,
    `skip(n, None)` on those only the other consumer needs. With block tables (`tables` = (num_partial, steps))
    the partial blocks take every mask and the full ones the length mask; else the steps [0, `cta_steps`) hold
    the tiles from `cta_lo`, and the consumer's own are `own` (`kv_tile_range`'s), unmasked in their full
    middle."""
    if tables is not None:
        num_partial, steps = tables
        carry = lax.fori_loop(0, num_partial, functools.partial(step, masked=True, user_mask=True), carry)
        return lax.fori_loop(num_partial, steps, functools.partial(step, masked=True, user_mask=False), carry)
    lo, full_lo, full_hi, hi = own_ranges(own, cta_lo)
    lax.fori_loop(0, lo - cta_lo, skip, None)
    for start, end, masked in ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True)):
        carry = lax.fori_loop(start - cta_lo, end - cta_lo, functools.partial(step, masked=masked, user_mask=masked),
                              carry)
    lax.fori_loop(hi - cta_lo, cta_steps, skip, None)
    return carry


# The layouts of a consumer's row and key index vectors: those of a WGMMA tile's rows and columns.
ROW_AND_KEY_VECTORS = (plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0))


def index_scratch(rows: int, part: int) -> tuple:
    """The shared memory of each consumer's row and key index vectors (`store_indices`): int32 [2, rows], [2, part]."""
    return plgpu.SMEM((_CONSUMERS, rows), jnp.int32), plgpu.SMEM((_CONSUMERS, part), jnp.int32)


def store_indices(index_smem: tuple, wg) -> None:
    """Each thread of consumer `wg` stores the entries of the row and key iotas its layout holds, once. Read back per
    step (`stored_indices`), the iotas are not hoisted out of the step loops and held in registers by LLVM, which
    spilled the head dim 256 programs (dQ's and the tangent's pieces) on sm_90a."""
    for ref, layout in zip(index_smem, ROW_AND_KEY_VECTORS):
        ref.at[wg][...] = plgpu.broadcasted_iota(jnp.int32, ref.shape[1:], 0, layout=layout)


def stored_indices(index_smem: tuple, own, shape: tuple, row0, key0) -> tuple:
    """(query, key) index tiles of `shape` from rows `row0` and keys `key0` on, from `store_indices`' vectors."""
    rows_of, keys_of = (plgpu.load(ref.at[own], layout=layout) for ref, layout in zip(index_smem, ROW_AND_KEY_VECTORS))
    return row0 + lax.broadcast_in_dim(rows_of, shape, [0]), key0 + lax.broadcast_in_dim(keys_of, shape, [1])
