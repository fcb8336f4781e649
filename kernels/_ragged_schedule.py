"""The work items of a ragged paged attention call: which packed query rows each kernel program takes.

The new tokens of every sequence are packed in `q [num_tokens, N, D]`; sequence i owns rows
`cu_q_lens[i]:cu_q_lens[i + 1]`. A kernel program takes one *item*: up to `block_q` consecutive rows of one
sequence, so that every row of an item shares one page table and one causal frontier. Sequence i with
`n_i` rows gives `cdiv(n_i, block_q)` items; their count is at most `num_tokens // block_q + S`, the static
number of items every backend launches (the rest are idle: length 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from probjax_kernels._tiles import kv_tile_range


@dataclasses.dataclass(frozen=True)
class WorkItems:
    """`[W]` int32 arrays, W = `num_items(num_tokens, num_seqs_static, block_q)`; idle items have `length` 0
    (their `seq` is 0 and `start` is num_tokens, past every real row)."""

    seq: jax.Array  # the sequence of the item
    start: jax.Array  # its first packed query row
    length: jax.Array  # its rows, 0..block_q


def num_items(num_tokens: int, num_seqs_static: int, block_q: int) -> int:
    """Items a call with `num_tokens` packed rows over at most `num_seqs_static` sequences can need."""
    return num_tokens // block_q + num_seqs_static


def ragged_work_items(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, block_q: int) -> WorkItems:
    """The items of the sequences `0..num_seqs - 1`, in sequence order, then idle items.

    `cu_q_lens`: `[S + 1]` int32, non-decreasing, `cu_q_lens[num_seqs] <= num_tokens`; `num_seqs`: a traced
    int32 scalar <= S. Sequences from `num_seqs` on give no item."""
    seqs = cu_q_lens.shape[0] - 1
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    lens = jnp.where(jnp.arange(seqs) < num_seqs, lens, 0)
    per_seq = (lens + block_q - 1) // block_q
    first_item = jnp.cumsum(per_seq) - per_seq  # [S] index of each sequence's first item
    total = jnp.sum(per_seq)
    width = num_items(num_tokens, seqs, block_q)
    items = jnp.arange(width, dtype=jnp.int32)
    # The sequence of item w: the last sequence whose first item is <= w (empty sequences share a first
    # item with the next one and are skipped by side="right").
    seq = jnp.searchsorted(first_item, items, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, seqs - 1)
    offset = (items - first_item[seq]) * block_q
    live = items < total
    start = jnp.where(live, cu_q_lens[seq] + offset, num_tokens).astype(jnp.int32)
    length = jnp.where(live, jnp.minimum(block_q, lens[seq] - offset), 0).astype(jnp.int32)
    return WorkItems(seq=jnp.where(live, seq, 0), start=start, length=length)


def item_steps(first, length, keys_per_step: int, sliding_window: int | None, mask_everywhere: bool = False):
    """The steps of `keys_per_step` keys an item's page walk visits, as `_tiles.kv_tile_range` splits them
    (lo, full_lo, full_hi, hi): its tokens sit at positions [first, first + length) and see the keys up to
    their own (causal) within the window; [lo, hi) runs from the step of the first token's window start (0
    without a window) to the step of the last token's position, and [full_lo, full_hi) need no per-element
    mask (every key at or before the first token and inside the last token's window). Traced int32 scalars;
    lo = hi for an idle item (length 0)."""
    left = None if sliding_window is None else sliding_window - 1
    return kv_tile_range(first, length, first + length, first + length, keys_per_step, (left, 0),
                         mask_everywhere=mask_everywhere)


def keys_read(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, block_q: int,
              keys_per_step: int, sliding_window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(keys the kernels' page walk reads, live keys) of one call, per KV head, summed over its items: an item
    reads whole steps of `keys_per_step` keys (`item_steps`, the walk of `triton/ragged.py` and
    `tpu/ragged.py`); the live keys are the ones some new token of the sequence attends, each counted once.
    Their ratio is the cost of re-reading a sequence's prefix once per item (and of whole steps) against
    reading each live K/V byte once."""
    items = ragged_work_items(cu_q_lens, num_seqs, num_tokens, block_q)
    n = cu_q_lens[1:] - cu_q_lens[:-1]
    first = kv_lens[items.seq] - n[items.seq] + (items.start - cu_q_lens[items.seq])
    lo, _, _, hi = item_steps(first, items.length, keys_per_step, sliding_window)
    live_seq = (jnp.arange(n.shape[0]) < num_seqs) & (n > 0)
    seq_first = kv_lens - n  # the sequence's first new token's position
    seq_lo = 0 if sliding_window is None else jnp.maximum(seq_first - sliding_window + 1, 0)
    live = jnp.sum(jnp.where(live_seq, kv_lens - seq_lo, 0))
    return jnp.sum((hi - lo) * keys_per_step), live
