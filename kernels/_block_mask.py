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

from probjax_kernels._mods import MaskMod, ScoreMod, noop_mask

DEFAULT_BLOCK_SIZE = 128


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "__array__")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Tile tables of a mask_mod for sequences of (q_len, kv_len), broadcast over batch / heads of size 1.

    **Fields:**

    - `kv_num_blocks`, `full_kv_num_blocks`: `[B|1, H|1, ceil(q_len / block_q)]` int32, the number of
      partial / full key blocks of each query block.
    - `kv_indices`, `full_kv_indices`: `[B|1, H|1, num_q_blocks, num_kv_blocks]` int32, those key blocks
      first, in ascending order.
    - `q_num_blocks`, `q_indices`, `full_q_num_blocks`, `full_q_indices`: the same per key block.
    - `block_size`: (block_q, block_kv); `seq_lengths`: (q_len, kv_len); `mask_mod`: the mask it encodes.

    It is a pytree: arrays inside `mask_mod` (a `jax.tree_util.Partial` such as `document_mask(ids)`) are
    leaves, so it can be passed through `jit` and rebuilt from new data without a retrace.
    """

    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    full_kv_num_blocks: jax.Array
    full_kv_indices: jax.Array
    q_num_blocks: jax.Array
    q_indices: jax.Array
    full_q_num_blocks: jax.Array
    full_q_indices: jax.Array
    block_size: tuple[int, int]
    seq_lengths: tuple[int, int]
    mask_mod: Any

    _TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
               "q_indices", "full_q_num_blocks", "full_q_indices")

    def tree_flatten(self):
        leaves, treedef = jax.tree.flatten(self.mask_mod)
        dynamic = [leaf for leaf in leaves if _is_array(leaf)]
        static = tuple(None if _is_array(leaf) else leaf for leaf in leaves)
        children = (*(getattr(self, name) for name in self._TABLES), *dynamic)
        return children, (self.block_size, self.seq_lengths, treedef, static)

    @classmethod
    def tree_unflatten(cls, aux, children):
        block_size, seq_lengths, treedef, static = aux
        tables, dynamic = children[: len(cls._TABLES)], iter(children[len(cls._TABLES):])
        leaves = [next(dynamic) if leaf is None else leaf for leaf in static]
        return cls(*tables, block_size, seq_lengths, jax.tree.unflatten(treedef, leaves))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B|1, H|1, q_len, kv_len)."""
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    @property
    def kv_tables(self) -> tuple[jax.Array, ...]:
        return self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices

    @property
    def q_tables(self) -> tuple[jax.Array, ...]:
        return self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices

    def to_dense(self) -> jax.Array:
        """`[B|1, H|1, num_q_blocks, num_kv_blocks]` int8: 0 empty, 1 partial, 2 full."""
        partial = _tiles(self.kv_num_blocks, self.kv_indices)
        full = _tiles(self.full_kv_num_blocks, self.full_kv_indices)
        return partial.astype(jnp.int8) + 2 * full.astype(jnp.int8)

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
        """The percentage of tiles skipped (empty), over every (batch, head) of the tables, as PyTorch's
        `BlockMask.sparsity()` (equal to it when the lengths are multiples of the block size; PyTorch counts
        elements, so a ragged last block makes its value differ). Needs concrete tables (not under `jit`);
        `tile_sparsity()` gives the per-(batch, head) fractions as an array."""
        visited = jnp.sum(self.kv_num_blocks) + jnp.sum(self.full_kv_num_blocks)
        return 100.0 * (1.0 - float(visited) / self.kv_indices.size)

    def as_tuple(self, flatten: bool = True) -> tuple:
        """PyTorch's `BlockMask.as_tuple` (torch 2.9 layout): `(q_len, kv_len, kv_num_blocks, kv_indices,
        full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
        block_q, block_kv, mask_mod)`; with `flatten=False` the lengths and the block size stay pairs."""
        lengths = self.seq_lengths if flatten else (self.seq_lengths,)
        block_size = self.block_size if flatten else (self.block_size,)
        return (*lengths, *(getattr(self, name) for name in self._TABLES), *block_size, self.mask_mod)

    def __getitem__(self, index) -> BlockMask:
        """The mask of some batches / heads, as PyTorch's `block_mask[b]`, `block_mask[:, h]`, `block_mask[0, 1]`.

        Integers keep their axis (size 1, as in PyTorch), slices select; only the batch and head axes are
        indexed. Unlike PyTorch, the result keeps a working `mask_mod`: it is called with the original batch
        and head indices, so the sliced mask gives the same attention as those rows of the original.
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 2 or any(not isinstance(i, (int, slice)) or isinstance(i, bool) for i in index):
            raise IndexError(f"a BlockMask is indexed by [batch] or [batch, head] with ints or slices, got {index!r}.")
        index = (*index, slice(None), slice(None))[:2]
        maps, selectors = [], []
        for axis, (i, size) in enumerate(zip(index, self.kv_num_blocks.shape[:2])):
            name = ("batch", "head")[axis]
            if isinstance(i, int):
                if not -size <= i < size:
                    raise IndexError(f"{name} index {i} is out of range for the mask's {name} axis of size {size}.")
                i %= size
                maps.append((i, 0))
                selectors.append(slice(i, i + 1))
            else:
                start, stop, step = i.indices(size)
                if not range(start, stop, step):
                    raise IndexError(f"{name} slice {i} selects nothing from the mask's {name} axis of size {size}.")
                maps.append((start, step))
                selectors.append(slice(start, stop, step))
        tables = [getattr(self, name)[tuple(selectors)] for name in self._TABLES]
        mask_mod = Partial(_reindexed, maps[0], maps[1], self.mask_mod)
        return BlockMask(*tables, self.block_size, self.seq_lengths, mask_mod)

    def adjust(self, q_len: int, kv_len: int) -> BlockMask:
        """The mask cropped to shorter sequences (its top-left corner), as PyTorch's `block_mask._adjust`:
        for a mask_mod that does not depend on the lengths (causal, windows, documents), the mask of the
        first q_len queries and kv_len keys, without evaluating mask_mod again. Tiles that became ragged at
        the new key length are marked partial, so the keys past kv_len stay masked. Growing is refused:
        build a new mask with `create_block_mask` then."""
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
        if kv_len % block_kv:
            ragged = (jnp.arange(cols) == cols - 1).reshape(1, 1, 1, cols)
            partial, full = partial | (full & ragged), full & ~ragged
        return _from_tiles(partial, full, self.block_size, (q_len, kv_len), self.mask_mod)

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
    ) -> BlockMask:
        """A BlockMask from its key-block tables, as PyTorch's `BlockMask.from_kv_blocks`; the tables per key
        block (for the dK/dV kernel) are derived from them.

        **Arguments:**

        - `kv_num_blocks`: `[..., num_q_blocks]` int, the number of partial key blocks of each query block;
          `kv_indices`: `[..., num_q_blocks, num_kv_blocks]` int, those blocks first. Leading axes are
          `[B, H]`, `[H]` or none (missing ones broadcast).
        - `full_kv_num_blocks`, `full_kv_indices`: the same for the full blocks (attended everywhere, so
          mask_mod is not evaluated on them); None = no full blocks.
        - `BLOCK_SIZE`: the tile, an int or (block_q, block_kv), powers of two >= 16.
        - `mask_mod`: evaluated on the partial blocks; None = `noop_mask` (they attend everywhere too).
        - `seq_lengths`: (q_len, kv_len); default the tables' extent, num_blocks * block.
        """
        block_q, block_kv = _check_block_size(BLOCK_SIZE, "BLOCK_SIZE")
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
        return _from_tiles(partial, full & ~partial, (block_q, block_kv), (q_len, kv_len),
                           noop_mask if mask_mod is None else mask_mod)

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


def _reindexed(batch_map, head_map, mask_mod, b, h, q_idx, kv_idx):
    """mask_mod at the original batch / head of a sliced mask: index start + step * i (start alone for an
    integer index, so that the result does not read b / h)."""
    def original(index, mapping):
        start, step = mapping
        return jnp.full_like(index, start) if step == 0 else start + step * index

    return mask_mod(original(b, batch_map), original(h, head_map), q_idx, kv_idx)


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
    return _tiles(num_blocks.reshape(lead + num_blocks.shape), indices.reshape(lead + indices.shape))


def _tiles(num_blocks: jax.Array, indices: jax.Array) -> jax.Array:
    """`[B, H, rows, cols]` bool: the tiles that 4-D (num_blocks, indices) tables list."""
    cols = indices.shape[-1]
    used = jnp.arange(cols).reshape(1, 1, 1, cols) < num_blocks[..., None]
    hits = jax.nn.one_hot(jnp.where(used, indices, cols), cols, dtype=jnp.int32)
    return jnp.sum(hits, axis=-2) > 0


def _from_tiles(partial, full, block_size, seq_lengths, mask_mod) -> BlockMask:
    """The BlockMask of `[B|1, H|1, rows, cols]` bool partial / full tiles: ordered tables both ways."""
    kv_num, kv_indices = _ordered_indices(partial)
    full_kv_num, full_kv_indices = _ordered_indices(full)
    q_num, q_indices = _ordered_indices(jnp.swapaxes(partial, -1, -2))
    full_q_num, full_q_indices = _ordered_indices(jnp.swapaxes(full, -1, -2))
    return BlockMask(
        kv_num, kv_indices, full_kv_num, full_kv_indices, q_num, q_indices, full_q_num, full_q_indices,
        tuple(block_size), tuple(seq_lengths), mask_mod,
    )


def _check_block_size(block_size, name: str = "block_size") -> tuple[int, int]:
    pair = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(pair) != 2 or any(not isinstance(b, int) or b < 16 or b & (b - 1) for b in pair):
        raise ValueError(f"{name} must be a power of two >= 16 or a pair of them, got {block_size!r}.")
    return pair


def _ordered_indices(selected: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(count, indices) of the True entries along the last axis, those first and ascending."""
    count = jnp.sum(selected, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(~selected, axis=-1, stable=True).astype(jnp.int32)
    return count, order


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
    *,
    q_len: int | None = None,
    kv_len: int | None = None,
    block_size: int | tuple[int, int] | None = None,
) -> BlockMask:
    """Evaluates `mask_mod` tile by tile and classifies every tile as empty, partial or full.

    PyTorch's signature (`create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128,
    _compile=False)`), positional or by keyword; probjax's own spellings `q_len`, `kv_len`, `block_size`
    work too. `device` and `_compile` are accepted and ignored (the tables live on JAX's default device;
    the function is jit-able as it is).

    **Arguments:**

    - `mask_mod`: `mask_mod(b, h, q_idx, kv_idx) -> bool`, True = attend; called with int32 arrays that
      broadcast (`[B|1, 1, 1, 1]`, `[1, H|1, 1, 1]`, `[1, 1, block_q, 1]`, `[1, 1, 1, S]`).
    - `B`, `H`: batch size and number of query heads, or None when the mask is the same for all of them
      (a mask_mod that reads b / h then needs B / H: `flex_attention` refuses the broadcast).
    - `Q_LEN` / `q_len`, `KV_LEN` / `kv_len`: sequence lengths of the queries and keys it will be used with.
    - `BLOCK_SIZE` / `block_size`: the tile, an int or (block_q, block_kv), powers of two >= 16; default 128.

    Jit-able; the working set is one row of query blocks at a time (`block_q x kv_len` per batch and head),
    so long sequences are cheap. Positions past q_len / kv_len count as masked.
    """
    del device, _compile
    q_len = _one_of("Q_LEN", Q_LEN, "q_len", q_len)
    kv_len = _one_of("KV_LEN", KV_LEN, "kv_len", kv_len)
    size_name = "block_size" if BLOCK_SIZE is None else "BLOCK_SIZE"
    block_size = _one_of("BLOCK_SIZE", BLOCK_SIZE, "block_size", block_size)
    block_q, block_kv = _check_block_size(DEFAULT_BLOCK_SIZE if block_size is None else block_size, size_name)
    batch, heads = _check_sizes(B, H, q_len, kv_len)
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
    kv_idx = jnp.arange(num_kv_blocks * block_kv, dtype=jnp.int32).reshape(1, 1, 1, -1)
    b, h, _, _ = _index_grids(batch, heads, kv_idx, kv_idx)
    example = mask_mod(b, h, jnp.zeros((1, 1, block_q, 1), jnp.int32), kv_idx)
    if jnp.result_type(example) != jnp.bool_:
        raise TypeError(f"mask_mod must return bool (True = attend), got {jnp.result_type(example)}.")

    def classify(q_block):
        q_idx = (q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)).reshape(1, 1, block_q, 1)
        shape = (batch, heads, block_q, num_kv_blocks * block_kv)
        allowed = jnp.broadcast_to(mask_mod(b, h, q_idx, kv_idx), shape) & (kv_idx < kv_len) & (q_idx < q_len)
        tiles = allowed.reshape(batch, heads, block_q, num_kv_blocks, block_kv)
        any_pair = jnp.any(tiles, axis=(2, 4))
        # Query rows past q_len do not matter; keys past kv_len are masked, so a tile over them is not full.
        row_free = (q_idx >= q_len).reshape(1, 1, block_q, 1, 1)
        every_pair = jnp.all(tiles | row_free, axis=(2, 4)) & any_pair
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
        return ~jnp.isneginf(jnp.broadcast_to(mod_fn(jnp.zeros(shape, jnp.float32), *grids), shape))
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
