"""Plain-jnp decode attention with exactly `decode_attention`'s semantics: the tests' reference and a fallback.

It gathers each sequence's pages into a dense `[B, S, K, D]` cache and materialises the `[B, N, T, S]` scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from probjax_kernels._decode_inputs import DecodeInputs, check_decode_inputs, empty_outputs, poison_rows
from probjax_kernels._reference import REFERENCE_DTYPES
from probjax_kernels._sinks import attach_sinks


def dense_cache(inputs: DecodeInputs) -> tuple[jax.Array, jax.Array]:
    """(k, v) as dense `[B, S, K, D]` caches: a paged cache's pages gathered through `block_tables` (entries
    past a sequence's pages may hold anything: they read a clamped page, masked by the length)."""
    if not inputs.paged:
        return inputs.k, inputs.v
    tables = jnp.clip(inputs.block_tables, 0, inputs.k.shape[0] - 1)
    batch, max_pages = tables.shape

    def gather(cache):
        pages = cache[tables]  # [B, max_pages, page_size, K, D]
        return pages.reshape(batch, max_pages * cache.shape[1], *cache.shape[2:])

    return gather(inputs.k), gather(inputs.v)


def decode_index_grids(inputs: DecodeInputs) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(b, h, q_idx, kv_idx) as broadcasting int32 grids of the `[B, N, T, S]` scores; q_idx holds each new
    token's global position `kv_lengths[b] - T + t`."""
    batch, new_tokens, num_heads, *_ = inputs.shape
    capacity = inputs.capacity
    positions = inputs.kv_lengths[:, None] - new_tokens + jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
    return (
        jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1),
        jnp.arange(num_heads, dtype=jnp.int32).reshape(1, num_heads, 1, 1),
        positions.reshape(batch, 1, new_tokens, 1),
        jnp.arange(capacity, dtype=jnp.int32).reshape(1, 1, 1, capacity),
    )


def decode_from_inputs(inputs: DecodeInputs, score_mod=None, mask_mod=None) -> tuple[jax.Array, jax.Array]:
    """(out `[B, T, N, Dv]` in q's dtype, lse `[B, N, T]` float32) of checked inputs, accumulated in float32
    (float64 for float64 inputs)."""
    batch, new_tokens, num_heads, num_kv_heads, head_dim, value_dim = inputs.shape
    group = num_heads // num_kv_heads
    compute = jnp.float64 if inputs.q.dtype == jnp.float64 else jnp.float32
    k, v = (x.astype(compute) for x in dense_cache(inputs))
    q = inputs.q.astype(compute).reshape(batch, new_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=lax.Precision.HIGHEST)
    scores = scores.reshape(batch, num_heads, new_tokens, inputs.capacity) * inputs.scale
    grids = decode_index_grids(inputs)
    b, h, q_idx, kv_idx = grids
    if score_mod is not None:
        scores = score_mod(scores, *grids).astype(compute)
    allowed = kv_idx < inputs.kv_lengths.reshape(batch, 1, 1, 1)
    if inputs.causal:
        allowed = allowed & (kv_idx <= q_idx)
    if mask_mod is not None:
        allowed = allowed & mask_mod(*grids)
    scores = jnp.where(allowed, scores, -jnp.inf)
    # Slots past a length may hold anything (NaN in a recycled page); 0 * NaN would poison the sum.
    v = jnp.where(kv_idx.reshape(1, -1, 1, 1) < inputs.kv_lengths.reshape(batch, 1, 1, 1), v, 0)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)
    probs = (weights / safe_sum).reshape(batch, num_kv_heads, group, new_tokens, inputs.capacity)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=lax.Precision.HIGHEST)
    out = out.reshape(batch, new_tokens, num_heads, value_dim).astype(inputs.q.dtype)
    lse = jnp.where(row_sum > 0, jnp.log(safe_sum) + row_max, -jnp.inf)[..., 0]
    return out, jnp.broadcast_to(lse, (batch, num_heads, new_tokens)).astype(jnp.float32)


def decode_attention_reference(
    q, k, v, *, kv_lengths, block_tables=None, score_mod=None, mask_mod=None, num_splits=None, scale=None,
    return_lse: bool = False, config=None, causal: bool = True, sinks=None,
):
    """Plain-jnp `decode_attention` with the same arguments and semantics (see there): the pages gathered
    through `block_tables`, the `[B, N, T, S]` scores materialised, float32 accumulation (float64 for float64
    inputs). `num_splits` and `config` are checked for compatibility and otherwise ignored; hooks are called
    on `[B, N, T, S]` index grids."""
    del config
    inputs = check_decode_inputs(
        q, k, v, kv_lengths=kv_lengths, block_tables=block_tables, score_mod=score_mod, mask_mod=mask_mod,
        num_splits=num_splits, scale=scale, return_lse=return_lse, causal=causal, sinks=sinks,
        allowed_dtypes=REFERENCE_DTYPES, max_head_dim=None,
    )
    if inputs.q.shape[0] == 0:
        return empty_outputs(inputs)
    out, lse = poison_rows(*decode_from_inputs(inputs, score_mod, mask_mod), inputs.out_of_contract)
    out, lse = attach_sinks(out, lse, inputs.sinks)
    return (out, lse) if inputs.return_lse else out
