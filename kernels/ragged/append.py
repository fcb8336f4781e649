"""Writing the new tokens' keys and values into the pages before attending (`new_k` / `new_v` of
`ragged_paged_attention`): one XLA scatter per cache, quantized with the cache's scales when it is int8 or
float8_e4m3fn.

New token j of sequence i (of n_i) goes to position `kv_lens[i] - n_i + j`: page
`page_indices[i, position // page_size]`, slot `position % page_size`. Padding rows (sequences from num_seqs
on, rows from cu_q_lens[num_seqs] on) and rows that break the contract under jit are never written: their
scatter index points past the pages and `mode="drop"` drops it, so no write ever leaves the arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from probjax_kernels._ragged_inputs import RaggedInputs, TokenLayout, token_layout


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`[num_tokens, K, D]` values as `dtype` pages hold them: `x / scale[kv_head]` (scale `[K]` float32),
    rounded and clipped to [-127, 127] for int8, clipped to the finite range for float8_e4m3fn (whose cast
    would turn an overflow into NaN)."""
    y = x.astype(jnp.float32) / scale[None, :, None]
    if jnp.dtype(dtype) == jnp.int8:
        return jnp.clip(jnp.round(y), -127, 127).astype(dtype)
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(y, -largest, largest).astype(dtype)


def write_slots(inputs: RaggedInputs, layout: TokenLayout) -> tuple[jax.Array, jax.Array]:
    """(page, slot) `[num_tokens]` int32 of each packed row's write; page = P (past the pages, dropped) for a
    row that is not written."""
    num_pages, page_size = inputs.k_pages.shape[:2]
    written = layout.live & (layout.position >= 0) & (layout.position < inputs.capacity)
    if inputs.bad_rows is not None:
        written = written & ~inputs.bad_rows
    position = jnp.clip(layout.position, 0, inputs.capacity - 1)
    page = inputs.page_indices[layout.seq, position // page_size]
    return jnp.where(written, page, num_pages), position % page_size


def _check_distinct(page: jax.Array, slot: jax.Array, layout: TokenLayout, num_pages: int, page_size: int) -> None:
    """Outside jit, two rows writing one slot (a page shared by two sequences, both appending) is a
    ValueError: the scatter would keep one of them at random."""
    if any(isinstance(x, jax.core.Tracer) for x in (page, slot)):
        return
    page, slot, seq = np.asarray(page), np.asarray(slot), np.asarray(layout.seq)
    rows = np.flatnonzero(page < num_pages)
    keys = page[rows].astype(np.int64) * page_size + slot[rows]
    _, first, counts = np.unique(keys, return_index=True, return_counts=True)
    if np.any(counts > 1):
        row = int(rows[first[np.argmax(counts > 1)]])
        clash = [int(r) for r in rows if page[r] == page[row] and slot[r] == slot[row]]
        raise ValueError(
            f"packed rows {clash} (sequences {[int(seq[r]) for r in clash]}) all write page {int(page[row])}, slot "
            f"{int(slot[row])} of the cache: each new token needs a slot of its own (a page shared by several "
            "sequences must not be appended to)."
        )


def append_new_kv(inputs: RaggedInputs) -> RaggedInputs:
    """`inputs` with `new_k` / `new_v` written into `k_pages` / `v_pages` (quantized with `k_scale` /
    `v_scale` for a quantized cache). Positions outside a sequence's pages are ValueErrors of the input
    checks when the values are concrete; under jit such rows are dropped."""
    layout = token_layout(inputs.cu_q_lens, inputs.num_seqs, inputs.kv_lens, inputs.q.shape[0])
    page, slot = write_slots(inputs, layout)
    _check_distinct(page, slot, layout, *inputs.k_pages.shape[:2])
    pages = []
    for cache, new, scale in ((inputs.k_pages, inputs.new_k, inputs.k_scale),
                              (inputs.v_pages, inputs.new_v, inputs.v_scale)):
        values = quantize(new, scale, cache.dtype) if inputs.quantized else new
        pages.append(cache.at[page, slot].set(values, mode="drop"))
    return dataclasses.replace(inputs, k_pages=pages[0], v_pages=pages[1])
