"""`BlockMask` and `create_block_mask`: which tiles of the score matrix flex attention visits.

A tile of (block_q x block_kv) (query, key) pairs is *empty* when mask_mod is False on all of it (skipped
in forward and backward), *full* when it is True on all of it (computed without evaluating mask_mod), and
*partial* otherwise. The tables follow PyTorch's layout: per query block, the count and the ordered indices
of its partial and of its full key blocks; and the transpose, per key block, for the dK/dV kernel.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import Partial

from probjax_kernels._hooks import hook_hint
from probjax_kernels._table_tiles import tile_classes
from probjax_kernels.flex.block_tables import (
    check_block_size,
    ordered_indices,
    retile,
    tile_class_mask_mod,
    tiles_of,
)
from probjax_kernels.flex.mods import MaskMod, ScoreMod, noop_mask
from probjax_kernels.flex.shifted_queries import shifted_queries

DEFAULT_BLOCK_SIZE = 128


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "__array__")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(eq=False)
class BlockMask:
    """Tile tables of a mask_mod for sequences of (q_len, kv_len), broadcast over batch / heads of size 1.

    **Fields:**

    - `kv_num_blocks`, `full_kv_num_blocks`: `[B|1, H|1, ceil(q_len / block_q)]` int32, the number of
      partial / full key blocks of each query block.
    - `kv_indices`, `full_kv_indices`: `[B|1, H|1, num_q_blocks, num_kv_blocks]` int32, those key blocks
      first, in ascending order.
    - `q_num_blocks`, `q_indices`, `full_q_num_blocks`, `full_q_indices`: the same per key block (None after
      `from_kv_blocks(..., compute_q_blocks=False)`: then derived when a kernel needs them).
    - `block_size`: (block_q, block_kv); `seq_lengths`: (q_len, kv_len); `mask_mod`: the mask it encodes.
    - `leading_axes`: how many of (B, H) the tables were given with (2 unless `from_kv_blocks` got tables
      without them); `shape` reports those, as PyTorch's does.
    - `exact_mask_mod`: whether `mask_mod` alone gives the mask the tables describe (False on empty blocks,
      True on full ones): so for `create_block_mask` and what is sliced or cropped from it; not for
      `from_kv_blocks`, whose tables are taken as given. Kernels may then walk the tables on tiles coarser
      than the blocks (a tile that mixes classes is partial and evaluates mask_mod per element). An assigned
      `mask_mod` must keep that promise.

    As in PyTorch, `mask_mod` and `seq_lengths` may be assigned (the decoding pattern of
    `block_mask[:, :, i]` followed by new lengths). It is a pytree: arrays inside `mask_mod` (a
    `jax.tree_util.Partial` such as `document_mask(ids)`) are leaves, so it can be passed through `jit` and
    rebuilt from new data without a retrace.
    """

    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    full_kv_num_blocks: jax.Array
    full_kv_indices: jax.Array
    q_num_blocks: jax.Array | None
    q_indices: jax.Array | None
    full_q_num_blocks: jax.Array | None
    full_q_indices: jax.Array | None
    block_size: tuple[int, int]
    seq_lengths: tuple[int, int]
    mask_mod: Any
    leading_axes: int = 2
    exact_mask_mod: bool = True

    _TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
               "q_indices", "full_q_num_blocks", "full_q_indices")

    def tree_flatten(self):
        leaves, treedef = jax.tree.flatten(self.mask_mod)
        dynamic = [leaf for leaf in leaves if _is_array(leaf)]
        static = tuple(None if _is_array(leaf) else leaf for leaf in leaves)
        children = (*(getattr(self, name) for name in self._TABLES), *dynamic)
        return children, (self.block_size, self.seq_lengths, treedef, static, self.leading_axes,
                          self.exact_mask_mod)

    @classmethod
    def tree_unflatten(cls, aux, children):
        block_size, seq_lengths, treedef, static, leading_axes, exact = aux
        tables, dynamic = children[: len(cls._TABLES)], iter(children[len(cls._TABLES):])
        leaves = [next(dynamic) if leaf is None else leaf for leaf in static]
        return cls(*tables, block_size, seq_lengths, jax.tree.unflatten(treedef, leaves), leading_axes, exact)

    @property
    def shape(self) -> tuple[int, ...]:
        """(B|1, H|1, q_len, kv_len), without the batch / head axes the tables were not given with (PyTorch's
        `(*batch_dims, q_len, kv_len)`)."""
        return (*self.kv_num_blocks.shape[2 - self.leading_axes:2], *self.seq_lengths)

    @property
    def kv_tables(self) -> tuple[jax.Array, ...]:
        return self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices

    @property
    def q_tables(self) -> tuple[jax.Array, ...]:
        if self.q_indices is None:
            partial, full = (jnp.swapaxes(tiles_of(*pair), -1, -2) for pair in (self.kv_tables[:2], self.kv_tables[2:]))
            return (*ordered_indices(partial), *ordered_indices(full))
        return self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices

    def to_dense(self) -> jax.Array:
        """`[B|1, H|1, num_q_blocks, num_kv_blocks]` int8: 0 empty, 1 partial, 2 full."""
        return tile_classes(self.kv_tables)

    @property
    def BLOCK_SIZE(self) -> tuple[int, int]:  # noqa: N802 (PyTorch's name)
        """PyTorch's name for `block_size`."""
        return self.block_size

    def numel(self) -> int:
        """The number of (batch, head, query, key) entries the mask stands for, as PyTorch counts them."""
        return math.prod(self.shape)

    def tile_sparsity(self) -> jax.Array:
        """The fraction of tiles skipped (empty) per (batch, head) of the tables, `[B|1, H|1]` float32."""
        dense = self.to_dense()
        return jnp.mean((dense == 0).astype(jnp.float32), axis=(-2, -1))

    def sparsity(self) -> float:
        """PyTorch's `BlockMask.sparsity()`, the same number: `100 * (1 - visited blocks * block_q * block_kv
        / numel())`. It counts whole blocks, so with a ragged last block it is below the fraction of tiles
        skipped (and can be negative); `tile_sparsity()` gives that fraction per (batch, head). Needs
        concrete tables (not under `jit`)."""
        visited = jnp.sum(self.kv_num_blocks) + jnp.sum(self.full_kv_num_blocks)
        return 100.0 * (1.0 - int(visited) * math.prod(self.block_size) / self.numel())

    def as_tuple(self, flatten: bool = True) -> tuple:
        """PyTorch's `BlockMask.as_tuple` (torch 2.9 layout): `(q_len, kv_len, kv_num_blocks, kv_indices,
        full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
        block_q, block_kv, mask_mod)`; with `flatten=False` the lengths and the block size stay pairs."""
        lengths = self.seq_lengths if flatten else (self.seq_lengths,)
        block_size = self.block_size if flatten else (self.block_size,)
        return (*lengths, *(getattr(self, name) for name in self._TABLES), *block_size, self.mask_mod)

    def __getitem__(self, index) -> BlockMask:
        """The mask of some batches / heads / query blocks, as PyTorch's `block_mask[b]`, `block_mask[:, h]`,
        `block_mask[b, h]`, `block_mask[:, :, i]` (i a query block), with ints, slices or 1-D integer arrays.

        Integers keep their axis (size 1, as in PyTorch); the axes are those of `shape` (a mask from tables
        without batch / head axes is indexed by query block first). Unlike PyTorch, the result keeps a
        working `mask_mod`: it is called with the original batch, head and query indices, and selecting query
        blocks gives a mask for the selected queries only (`seq_lengths` (their count, kv_len)), so the sliced
        mask gives the same attention as those rows of the original. A ragged last query block may only be
        selected last.
        """
        index = index if isinstance(index, tuple) else (index,)
        visible = self.leading_axes + 1
        if len(index) > visible:
            raise IndexError(f"a BlockMask of shape {self.shape} takes at most {visible} indices (batch, head, query "
                             f"block), got {len(index)}: {index!r}.")
        index = (*(slice(None),) * (2 - self.leading_axes), *index, *(slice(None),) * (visible - len(index)))
        selections = [_selection(name, i, size) for name, i, size in
                      zip(("batch", "head", "query block"), index, self.kv_num_blocks.shape[:3])]
        # The per-query-block tables are indexed on all three axes; the per-key-block ones list query blocks in
        # their last axis, so they are rebuilt from the selected rows (PyTorch's __getitem__ does the same).
        tables = {name: _take(getattr(self, name), selections) for name in self._TABLES[:4]}
        if self.q_indices is not None:
            for (name_num, name_idx), (num, idx) in zip((self._TABLES[4:6], self._TABLES[6:8]),
                                                        ((tables["kv_num_blocks"], tables["kv_indices"]),
                                                         (tables["full_kv_num_blocks"], tables["full_kv_indices"]))):
                tables[name_num], tables[name_idx] = ordered_indices(jnp.swapaxes(tiles_of(num, idx), -1, -2))
        else:
            tables.update(dict.fromkeys(self._TABLES[4:]))
        block_q, q_len = self.block_size[0], self.seq_lengths[0]
        rows = selections[2]
        last_rows = q_len - (self.kv_num_blocks.shape[2] - 1) * block_q
        if last_rows < block_q and np.any(rows[:-1] == self.kv_num_blocks.shape[2] - 1):
            raise IndexError(f"the last query block is ragged ({last_rows} of {block_q} queries): select it last.")
        new_q_len = (len(rows) - 1) * block_q + (last_rows if rows[-1] == self.kv_num_blocks.shape[2] - 1 else block_q)
        maps = [_index_map(s) for s in selections]
        mask_mod = self.mask_mod
        if isinstance(maps[2], tuple) and maps[2][1] in (0, 1) and maps[2] != (0, 1):
            # Contiguous query blocks (one, or a run): their queries are the original ones shifted by the first
            # block's start, with arrays read at q_idx kept as reads at exactly q_idx (`shifted_queries`).
            mask_mod, maps[2] = shifted_queries(mask_mod, maps[2][0] * block_q), (0, 1)
        mask_mod = Partial(_reindexed, maps[0], maps[1], maps[2], block_q, mask_mod)
        return BlockMask(*(tables[name] for name in self._TABLES), self.block_size,
                         (new_q_len, self.seq_lengths[1]), mask_mod, self.leading_axes, self.exact_mask_mod)

    def adjust(self, q_len: int, kv_len: int) -> BlockMask:
        """The mask cropped to shorter sequences (its top-left corner), as PyTorch's `block_mask._adjust`:
        for a mask_mod that does not depend on the lengths (causal, windows, documents), the mask of the
        first q_len queries and kv_len keys, without evaluating mask_mod again. Full tiles that became ragged
        at a new length are marked partial, as `create_block_mask` classifies a ragged last block (and so the
        keys past kv_len stay masked). Growing is refused: build a new mask with `create_block_mask` then."""
        for name, value, old in (("q_len", q_len, self.seq_lengths[0]), ("kv_len", kv_len, self.seq_lengths[1])):
            if not _is_size(value) or value > old:
                raise ValueError(
                    f"adjust crops a mask to shorter sequences: {name} must be an int in [1, {old}], got {value!r}; "
                    "build a new mask with create_block_mask for longer ones."
                )
        block_q, block_kv = self.block_size
        rows, cols = -(-q_len // block_q), -(-kv_len // block_kv)
        dense = self.to_dense()[..., :rows, :cols]
        partial, full = dense == 1, dense == 2
        ragged = _ragged_tiles(rows, cols, self.block_size, (q_len, kv_len))
        partial, full = partial | (full & ragged), full & ~ragged
        return _from_tiles(partial, full, self.block_size, (q_len, kv_len), self.mask_mod, self.leading_axes,
                           self.exact_mask_mod)

    _adjust = adjust  # PyTorch's (private) name

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: jax.Array,
        kv_indices: jax.Array,
        full_kv_num_blocks: jax.Array | None = None,
        full_kv_indices: jax.Array | None = None,
        BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,  # noqa: N803 (PyTorch's name)
        mask_mod: MaskMod | None = None,
        seq_lengths: tuple[int, int] | None = None,
        compute_q_blocks: bool = True,
    ) -> BlockMask:
        """A BlockMask from its key-block tables, as PyTorch's `BlockMask.from_kv_blocks`; the tables per key
        block (for the dK/dV kernel) are derived from them.

        **Arguments:**

        - `kv_num_blocks`: `[..., num_q_blocks]` int, the number of partial key blocks of each query block;
          `kv_indices`: `[..., num_q_blocks, num_kv_blocks]` int, those blocks first. Leading axes are
          `[B, H]`, `[H]` or none (missing ones broadcast; `shape` leaves them out, as PyTorch's does).
        - `full_kv_num_blocks`, `full_kv_indices`: the same for the full blocks (attended everywhere, so
          mask_mod is not evaluated on them); None = no full blocks.
        - `BLOCK_SIZE`: the tile, an int or (block_q, block_kv), any size >= 1 (`flex_attention` maps tiles
          that are not powers of two >= 16 onto ones that are, exactly; docs/flex_attention.md).
        - `mask_mod`: evaluated on the partial blocks; None = `noop_mask` (they attend everywhere too).
        - `seq_lengths`: (q_len, kv_len); default the tables' extent, num_blocks * block.
        - `compute_q_blocks`: False leaves the per-key-block tables None, as in PyTorch; they are then derived
          when a kernel needs them.
        """
        block_q, block_kv = check_block_size(BLOCK_SIZE, "BLOCK_SIZE")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("full_kv_num_blocks and full_kv_indices must be given together (or neither).")
        kv_indices = jnp.asarray(kv_indices)
        if not 2 <= kv_indices.ndim <= 4:
            raise ValueError(f"kv_indices must be [B, H, num_q_blocks, num_kv_blocks] (or without B / H), got shape "
                             f"{kv_indices.shape}.")
        rows, cols = kv_indices.shape[-2:]
        if seq_lengths is None:
            seq_lengths = (rows * block_q, cols * block_kv)
        q_len, kv_len = seq_lengths
        if not (_is_size(q_len) and _is_size(kv_len)):
            raise ValueError(f"seq_lengths must be two ints >= 1, got {seq_lengths!r}.")
        if (rows, cols) != (-(-q_len // block_q), -(-kv_len // block_kv)):
            raise ValueError(
                f"kv_indices {kv_indices.shape} must have ceil(q_len / block_q) x ceil(kv_len / block_kv) = "
                f"{-(-q_len // block_q)} x {-(-kv_len // block_kv)} blocks for seq_lengths {tuple(seq_lengths)} and "
                f"BLOCK_SIZE {(block_q, block_kv)}."
            )
        partial = _ordered_to_tiles("kv", kv_num_blocks, kv_indices)
        full = jnp.zeros_like(partial) if full_kv_num_blocks is None else _ordered_to_tiles(
            "full_kv", full_kv_num_blocks, full_kv_indices, kv_indices.shape)
        mask = _from_tiles(partial, full & ~partial, (block_q, block_kv), (int(q_len), int(kv_len)),
                           noop_mask if mask_mod is None else mask_mod, kv_indices.ndim - 2, exact_mask_mod=False)
        if not compute_q_blocks:
            mask.q_num_blocks = mask.q_indices = mask.full_q_num_blocks = mask.full_q_indices = None
        return mask

    def for_kernel(self) -> BlockMask:
        """This mask with tables the kernels can run: tiles that are powers of two >= 16 (`flex.block_tables`;
        merged tiles keep an exact mask_mod (`exact_mask_mod`) and otherwise get one that follows these tables,
        which makes it exact), and no full tile past the key length (the kernels skip the mask, and so the
        length check, on full tiles). The same attention, exactly."""
        partial, full = (self.to_dense() == c for c in (1, 2))
        partial, full, block_size, merged = retile(partial, full, self.block_size, self.seq_lengths)
        mask_mod = self.mask_mod
        if merged and not self.exact_mask_mod:
            mask_mod = Partial(tile_class_mask_mod, self.to_dense(), self.block_size, self.mask_mod)
        elif not merged and block_size == self.block_size and self.seq_lengths[1] % block_size[1] == 0:
            return self if self.q_indices is not None else dataclasses.replace(
                self, **dict(zip(self._TABLES[4:], self.q_tables)))
        ragged = _ragged_tiles(*partial.shape[-2:], block_size, (math.inf, self.seq_lengths[1]))
        partial, full = partial | (full & ragged), full & ~ragged
        return _from_tiles(partial, full, block_size, self.seq_lengths, mask_mod,
                           exact_mask_mod=merged or self.exact_mask_mod)

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """A text picture of the visited tiles per (batch, head), as PyTorch draws it: two characters per
        cell, a cell summarising up to `grid_size` rows x columns of tiles: `██` all visited, `░░` some,
        blank none. At most `limit` (batch, head) pairs are drawn; `grid_size=-1` draws every tile."""
        visited = np.asarray(self.to_dense()) > 0
        batch, heads, rows, cols = visited.shape
        if grid_size == -1:
            grid_size = (rows, cols)
        max_rows, max_cols = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
        row_step, col_step = max(1, -(-rows // max_rows)), max(1, -(-cols // max_cols))
        pictures = []
        for number, (b, h) in enumerate(itertools.product(range(batch), range(heads))):
            if number == limit:
                pictures += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                             "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            lines = [f"{(b, h)}"]
            for r in range(0, rows, row_step):
                cells = [visited[b, h, r:r + row_step, c:c + col_step].mean() for c in range(0, cols, col_step)]
                lines.append("".join("██" if f == 1 else "  " if f == 0 else "░░" for f in cells))
            pictures.append("\n".join(lines) + "\n")
        return "\n".join(pictures)

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n{self.to_string().strip()}\n)"

    def __repr__(self) -> str:
        tables = ", ".join(f"{name}={getattr(self, name).shape}" for name in self._TABLES)
        return (f"BlockMask({tables}, block_size={self.block_size}, shape={self.shape}, "
                f"mask_mod={getattr(self.mask_mod, '__name__', self.mask_mod)})")


def _is_size(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1


def _selection(name: str, index, size: int) -> np.ndarray:
    """The positions `index` (int, slice or 1-D integer array) selects on an axis of `size`, checked."""
    if isinstance(index, jax.core.Tracer):
        raise TypeError(f"a BlockMask's {name} index must be concrete (not traced under jit), got {index!r}.")
    if isinstance(index, slice):
        selected = np.arange(size)[index]
    elif isinstance(index, bool) or index is None or index is Ellipsis:
        raise IndexError(f"a BlockMask is indexed by ints, slices or integer arrays, got {index!r} for the {name} axis.")
    else:
        selected = np.asarray(index)
        if not np.issubdtype(selected.dtype, np.integer) or selected.ndim > 1:
            raise IndexError(f"a BlockMask is indexed by ints, slices or 1-D integer arrays, got {index!r} for the "
                             f"{name} axis.")
        if selected.size and (selected.min() < -size or selected.max() >= size):
            raise IndexError(f"{name} index {index!r} is out of range for the mask's {name} axis of size {size}.")
        selected = selected.reshape(-1) % size
    if not selected.size:
        raise IndexError(f"{name} index {index!r} selects nothing from the mask's {name} axis of size {size}.")
    return selected


def _take(table, selections):
    """`table` (4-D or 3-D, or None) at the selected positions of its batch, head and query-block axes."""
    if table is None:
        return None
    for axis, selected in enumerate(selections):
        if not np.array_equal(selected, np.arange(table.shape[axis])):
            table = jnp.take(table, jnp.asarray(selected, jnp.int32), axis=axis)
    return table


def _index_map(selected: np.ndarray):
    """new position -> original one: (start, step) when it is affine (step 0: a single position, so the result
    does not read the index), else the int32 array of positions."""
    if len(selected) == 1:
        return int(selected[0]), 0
    steps = np.diff(selected)
    if np.all(steps == steps[0]):
        return int(selected[0]), int(steps[0])
    return jnp.asarray(selected, jnp.int32)


def _original(index, mapping):
    if isinstance(mapping, tuple):
        start, step = mapping
        if (start, step) == (0, 1):  # exactly the index, so that arrays read at b / h stay selected per b / h
            return index
        return jnp.full_like(index, start) if step == 0 else start + step * index
    return mapping[jnp.clip(index, 0, mapping.shape[0] - 1)]


def _reindexed(batch_map, head_map, block_map, block_q, mask_mod, b, h, q_idx, kv_idx):
    """mask_mod at the original batch, head and query of a sliced mask (see `BlockMask.__getitem__`)."""
    if not (isinstance(block_map, tuple) and block_map == (0, 1)):
        q_idx = _original(q_idx // block_q, block_map) * block_q + q_idx % block_q
    return mask_mod(_original(b, batch_map), _original(h, head_map), q_idx, kv_idx)


def _ordered_to_tiles(name: str, num_blocks, indices, shape=None) -> jax.Array:
    """`[B|1, H|1, rows, cols]` bool tiles listed by (num_blocks, indices) tables, checked."""
    num_blocks, indices = jnp.asarray(num_blocks), jnp.asarray(indices)
    if shape is not None and indices.shape != shape:
        raise ValueError(f"{name}_indices must have the shape of kv_indices {shape}, got {indices.shape}.")
    if num_blocks.shape != indices.shape[:-1]:
        raise ValueError(f"{name}_num_blocks must have shape {indices.shape[:-1]} (kv_indices' without its last "
                         f"axis), got {num_blocks.shape}.")
    for array, what in ((num_blocks, "num_blocks"), (indices, "indices")):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise TypeError(f"{name}_{what} must be an integer array, got dtype {array.dtype}.")
    cols = indices.shape[-1]
    if not isinstance(num_blocks, jax.core.Tracer) and not isinstance(indices, jax.core.Tracer):
        counts, values = np.asarray(num_blocks), np.asarray(indices)
        used = np.arange(cols) < counts[..., None]
        if counts.size and (counts.min() < 0 or counts.max() > cols):
            raise ValueError(
                f"{name}_num_blocks must lie in [0, {cols}], got values in [{counts.min()}, {counts.max()}].")
        if used.any() and (values[used].min() < 0 or values[used].max() >= cols):
            raise ValueError(f"{name}_indices must lie in [0, {cols}) where used, got values in "
                             f"[{values[used].min()}, {values[used].max()}].")
    lead = (1,) * (4 - indices.ndim)
    return tiles_of(num_blocks.reshape(lead + num_blocks.shape), indices.reshape(lead + indices.shape))


def _from_tiles(partial, full, block_size, seq_lengths, mask_mod, leading_axes: int = 2,
                exact_mask_mod: bool = True) -> BlockMask:
    """The BlockMask of `[B|1, H|1, rows, cols]` bool partial / full tiles: ordered tables both ways."""
    kv_num, kv_indices = ordered_indices(partial)
    full_kv_num, full_kv_indices = ordered_indices(full)
    q_num, q_indices = ordered_indices(jnp.swapaxes(partial, -1, -2))
    full_q_num, full_q_indices = ordered_indices(jnp.swapaxes(full, -1, -2))
    return BlockMask(
        kv_num, kv_indices, full_kv_num, full_kv_indices, q_num, q_indices, full_q_num, full_q_indices,
        tuple(block_size), tuple(seq_lengths), mask_mod, leading_axes, exact_mask_mod,
    )


def _ragged_tiles(rows: int, cols: int, block_size, seq_lengths) -> jax.Array:
    """`[1, 1, rows, cols]` bool: the tiles that reach past q_len or kv_len (never full, as in PyTorch)."""
    row = (np.arange(rows) + 1) * block_size[0] > seq_lengths[0]
    col = (np.arange(cols) + 1) * block_size[1] > seq_lengths[1]
    return jnp.asarray(row[:, None] | col[None, :]).reshape(1, 1, rows, cols)


def _one_of(torch_name: str, torch_value, name: str, value):
    """The value of an argument that has PyTorch's spelling and probjax's; giving both is an error."""
    if torch_value is not None and value is not None and torch_value != value:
        raise ValueError(f"{torch_name}={torch_value!r} and {name}={value!r} disagree; pass only one of them.")
    return value if torch_value is None else torch_value


def _check_sizes(B, H, q_len, kv_len) -> tuple[int, int]:
    for name, value in (("B", B), ("H", H)):
        if value is not None and not _is_size(value):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}.")
    for name, value in (("Q_LEN", q_len), ("KV_LEN", kv_len)):
        if not _is_size(value):
            raise ValueError(f"{name} (q_len / kv_len) must be an int >= 1, got {value!r}.")
    return B or 1, H or 1


def _index_grids(batch: int, heads: int, q_idx: jax.Array, kv_idx: jax.Array):
    return (jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1),
            jnp.arange(heads, dtype=jnp.int32).reshape(1, heads, 1, 1), q_idx, kv_idx)


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int | None = None,  # noqa: N803 (PyTorch's names)
    KV_LEN: int | None = None,  # noqa: N803
    device: Any = None,
    BLOCK_SIZE: int | tuple[int, int] | None = None,  # noqa: N803
    _compile: bool = False,
    separate_full_blocks: bool = True,
    *,
    q_len: int | None = None,
    kv_len: int | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> BlockMask:
    """Evaluates `mask_mod` tile by tile and classifies every tile as empty, partial or full.

    PyTorch's signature (`create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128,
    _compile=False, separate_full_blocks=True)`), positional or by keyword; probjax's own spellings `q_len`,
    `kv_len`, `block_size` work too. `device` and `_compile` are accepted and ignored (the tables live on
    JAX's default device; the function is jit-able as it is).

    **Arguments:**

    - `mask_mod`: `mask_mod(b, h, q_idx, kv_idx) -> bool`, True = attend; called with int32 arrays that
      broadcast (`[B|1, 1, 1, 1]`, `[1, H|1, 1, 1]`, `[1, 1, block_q, 1]`, `[1, 1, 1, S]`).
    - `B`, `H`: batch size and number of query heads, or None when the mask is the same for all of them
      (a mask_mod that reads b / h then needs B / H: `flex_attention` refuses the broadcast).
    - `Q_LEN` / `q_len`, `KV_LEN` / `kv_len`: sequence lengths of the queries and keys it will be used with.
    - `BLOCK_SIZE` / `block_size`: the tile, an int or (block_q, block_kv), any size >= 1 (PyTorch's 8, 48,
      96, (64, 48) included: `flex_attention` runs other tiles than powers of two >= 16 on ones that are,
      exactly; docs/flex_attention.md); default 128.
    - `separate_full_blocks`: False lists every visited tile as partial (mask_mod evaluated everywhere), as
      in PyTorch; the full tables are then empty.

    Jit-able; the working set is one row of query blocks at a time (`block_q x kv_len` per batch and head),
    so long sequences are cheap. Positions past q_len / kv_len count as masked, as in PyTorch: a ragged last
    block is never full (causal, 100 x 100, BLOCK_SIZE 32: `kv_num_blocks` [1, 1, 1, 4], `full_kv_num_blocks`
    [0, 1, 2, 0]).
    """
    del device, _compile
    if _num_required_arguments(mask_mod) == 5:
        raise TypeError(
            "create_block_mask needs a mask_mod(b, h, q_idx, kv_idx) -> bool, got a function of five arguments "
            "(a score_mod): pass it to flex_attention's score_mod, or write its mask as a mask_mod."
        )
    q_len = _one_of("Q_LEN", Q_LEN, "q_len", q_len)
    kv_len = _one_of("KV_LEN", KV_LEN, "kv_len", kv_len)
    size_name = "block_size" if BLOCK_SIZE is None else "BLOCK_SIZE"
    block_size = _one_of("BLOCK_SIZE", BLOCK_SIZE, "block_size", block_size)
    block_q, block_kv = check_block_size(DEFAULT_BLOCK_SIZE if block_size is None else block_size, size_name)
    batch, heads = _check_sizes(B, H, q_len, kv_len)
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
    kv_idx = jnp.arange(num_kv_blocks * block_kv, dtype=jnp.int32).reshape(1, 1, 1, -1)
    b, h, _, _ = _index_grids(batch, heads, kv_idx, kv_idx)
    with hook_hint("mask_mod"):
        example = mask_mod(b, h, jnp.zeros((1, 1, block_q, 1), jnp.int32), kv_idx)
    if jnp.result_type(example) != jnp.bool_:
        raise TypeError(f"mask_mod must return bool (True = attend), got {jnp.result_type(example)}.")

    def classify(q_block):
        q_idx = (q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)).reshape(1, 1, block_q, 1)
        shape = (batch, heads, block_q, num_kv_blocks * block_kv)
        allowed = jnp.broadcast_to(mask_mod(b, h, q_idx, kv_idx), shape) & (kv_idx < kv_len) & (q_idx < q_len)
        tiles = allowed.reshape(batch, heads, block_q, num_kv_blocks, block_kv)
        any_pair = jnp.any(tiles, axis=(2, 4))
        # As in PyTorch, positions past q_len / kv_len count as masked: a tile over them is not full.
        every_pair = jnp.all(tiles, axis=(2, 4))
        if not separate_full_blocks:
            return any_pair, jnp.zeros_like(any_pair)
        return any_pair & ~every_pair, every_pair

    partial, full = lax.map(classify, jnp.arange(num_q_blocks, dtype=jnp.int32))  # [num_q_blocks, B, H, num_kv_blocks]
    partial, full = jnp.moveaxis(partial, 0, 2), jnp.moveaxis(full, 0, 2)
    return _from_tiles(partial, full, (block_q, block_kv), (q_len, kv_len), mask_mod)


def create_mask(
    mod_fn: MaskMod | ScoreMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,  # noqa: N803 (PyTorch's names)
    KV_LEN: int,  # noqa: N803
    device: Any = None,
) -> jax.Array:
    """The dense bool mask `[B|1, H|1, Q_LEN, KV_LEN]` (True = attend) of a mask_mod, as PyTorch's
    `create_mask`; B / H None give an axis of 1 (evaluated at b = 0 / h = 0). A score_mod (five arguments)
    is evaluated on zero scores and attends where it does not give -inf. `device` is ignored."""
    del device
    batch, heads = _check_sizes(B, H, Q_LEN, KV_LEN)
    grids = _index_grids(batch, heads, jnp.arange(Q_LEN, dtype=jnp.int32).reshape(1, 1, Q_LEN, 1),
                         jnp.arange(KV_LEN, dtype=jnp.int32).reshape(1, 1, 1, KV_LEN))
    shape = (batch, heads, Q_LEN, KV_LEN)
    if _num_required_arguments(mod_fn) == 5:
        with hook_hint("score_mod"):
            score = mod_fn(jnp.zeros(shape, jnp.float32), *grids)
        return ~jnp.isneginf(jnp.broadcast_to(score, shape))
    with hook_hint("mask_mod"):
        mask = mod_fn(*grids)
    if jnp.result_type(mask) != jnp.bool_:
        raise TypeError(f"mask_mod must return bool (True = attend), got {jnp.result_type(mask)}.")
    return jnp.broadcast_to(mask, shape)


def _num_required_arguments(fn) -> int | None:
    """How many positional arguments without a default `fn` takes (PyTorch's way to tell a score_mod, 5,
    from a mask_mod, 4); None when Python cannot say."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds and p.default is inspect.Parameter.empty for p in parameters)
