"""What the model files share for batched generation on a paged KV cache: RoPE at per-sequence positions,
writing a new token's key / value into its page, and the decode step's attention (`probjax_nn.decode_attention`).

The layout is `probjax_nn.pages_from_dense`'s: a layer's keys (and values) are pages `[P, page_size, K, D]`,
and position j of sequence b lives in page `block_tables[b, j // page_size]`, slot `j % page_size`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import probjax_nn
from lm.common import rope

KVPages = tuple[jax.Array, jax.Array]  # one layer's key and value pages, `[P, page_size, K, D]` each


def rope_rows(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """`rope` with positions per sequence: x `[B, T, heads, head_dim]`, positions `[B, T]` int."""
    return jax.vmap(lambda row, where: rope(row, where, theta))(x, positions)


def write_token(pages: jax.Array, block_tables: jax.Array, positions: jax.Array, new: jax.Array) -> jax.Array:
    """Stores `new` `[B, 1, K, D]` (one token per sequence) at `positions` `[B]` of each sequence's pages."""
    page_size = pages.shape[1]
    page = jnp.take_along_axis(block_tables, (positions // page_size)[:, None], axis=1)[:, 0]
    return pages.at[page, positions % page_size].set(new[:, 0].astype(pages.dtype))


def paged_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, pages: KVPages, block_tables: jax.Array,
    positions: jax.Array, impl: str,
) -> tuple[jax.Array, KVPages]:
    """One decode step of a layer: the new token's key and value (`[B, 1, K, D]`, rotated) go into the pages at
    `positions` `[B]`, then its query `[B, 1, N, D]` attends each sequence's first `positions + 1` keys.
    Returns the attention output `[B, 1, N, D]` and the updated pages."""
    key_pages, value_pages = (write_token(p, block_tables, positions, x) for p, x in zip(pages, (key, value)))
    out = probjax_nn.decode_attention(
        query, key_pages.astype(query.dtype), value_pages.astype(query.dtype), kv_lengths=positions + 1,
        block_tables=block_tables, impl=impl,
    )
    return out, (key_pages, value_pages)
