"""`BlockMask` and `create_block_mask`: which tiles of the score matrix flex attention visits.

A tile of (block_q x block_kv) (query, key) pairs is *empty* when mask_mod is False on all of it (skipped
in forward and backward), *full* when it is True on all of it (computed without evaluating mask_mod), and
*partial* otherwise. The tables follow PyTorch's layout: per query block, the count and the ordered indices
of its partial and of its full key blocks; and the transpose, per key block, for the dK/dV kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from probjax_kernels._mods import MaskMod

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
        num_kv_blocks = self.kv_indices.shape[-1]

        def mark(num, indices, value):
            used = jnp.arange(num_kv_blocks).reshape((1,) * num.ndim + (-1,)) < num[..., None]
            hits = jax.nn.one_hot(jnp.where(used, indices, num_kv_blocks), num_kv_blocks, dtype=jnp.int8)
            return hits.sum(axis=-2) * value

        return (mark(self.kv_num_blocks, self.kv_indices, 1)
                + mark(self.full_kv_num_blocks, self.full_kv_indices, 2)).astype(jnp.int8)

    def sparsity(self) -> jax.Array:
        """The fraction of tiles skipped (empty), per (batch, head) of the tables, as a float32 array."""
        dense = self.to_dense()
        return jnp.mean((dense == 0).astype(jnp.float32), axis=(-2, -1))


def _check_block_size(block_size) -> tuple[int, int]:
    pair = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(pair) != 2 or any(not isinstance(b, int) or b < 16 or b & (b - 1) for b in pair):
        raise ValueError(f"block_size must be a power of two >= 16 or a pair of them, got {block_size!r}.")
    return pair


def _ordered_indices(selected: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(count, indices) of the True entries along the last axis, those first and ascending."""
    count = jnp.sum(selected, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(~selected, axis=-1, stable=True).astype(jnp.int32)
    return count, order


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    q_len: int,
    kv_len: int,
    *,
    block_size: int | tuple[int, int] | None = None,
) -> BlockMask:
    """Evaluates `mask_mod` tile by tile and classifies every tile as empty, partial or full.

    **Arguments:**

    - `mask_mod`: `mask_mod(b, h, q_idx, kv_idx) -> bool`, True = attend; called with int32 arrays that
      broadcast (`[B|1, 1, 1, 1]`, `[1, H|1, 1, 1]`, `[1, 1, block_q, 1]`, `[1, 1, 1, S]`).
    - `B`, `H`: batch size and number of query heads, or None when the mask is the same for all of them.
    - `q_len`, `kv_len`: sequence lengths of the queries and keys it will be used with.
    - `block_size`: the tile, an int or (block_q, block_kv), powers of two >= 16; default 128.

    Jit-able; the working set is one row of query blocks at a time (`block_q x kv_len` per batch and head),
    so long sequences are cheap. Positions past q_len / kv_len count as masked.
    """
    block_q, block_kv = _check_block_size(DEFAULT_BLOCK_SIZE if block_size is None else block_size)
    for name, value in (("B", B), ("H", H)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}.")
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    batch, heads = B or 1, H or 1
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
    b = jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1)
    h = jnp.arange(heads, dtype=jnp.int32).reshape(1, heads, 1, 1)
    kv_idx = jnp.arange(num_kv_blocks * block_kv, dtype=jnp.int32).reshape(1, 1, 1, -1)
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
    kv_num, kv_indices = _ordered_indices(partial)
    full_kv_num, full_kv_indices = _ordered_indices(full)
    q_num, q_indices = _ordered_indices(jnp.swapaxes(partial, -1, -2))
    full_q_num, full_q_indices = _ordered_indices(jnp.swapaxes(full, -1, -2))
    return BlockMask(
        kv_num, kv_indices, full_kv_num, full_kv_indices, q_num, q_indices, full_q_num, full_q_indices,
        (block_q, block_kv), (q_len, kv_len), mask_mod,
    )
