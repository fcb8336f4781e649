"""Plain-jnp ragged paged attention with exactly `ragged_paged_attention`'s semantics: the tests' reference
and the XLA path (`RaggedConfig(backend="xla")`, the default off the accelerators).

It gathers each sequence's pages into a dense `[S, capacity, K, D]` cache (dequantized), gives each packed
token its sequence's keys and materialises the `[num_tokens, N, capacity]` scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from probjax_kernels._hooks import Hook
from probjax_kernels._ragged_inputs import (
    RaggedInputs, TokenLayout, check_ragged_config, check_ragged_inputs, poison_bad_rows, token_layout,
)
from probjax_kernels._reference import REFERENCE_DTYPES
from probjax_kernels.flex.mods import mask_lookback
from probjax_kernels.ragged.append import append_new_kv


def dense_pages(inputs: RaggedInputs, compute) -> tuple[jax.Array, jax.Array]:
    """(k `[S, capacity, K, D]`, v `[S, capacity, K, Dv]`) in `compute`: each sequence's pages gathered
    through `page_indices` (clamped into range) and multiplied by the scales of a quantized cache."""
    seqs, pages_per_seq = inputs.page_indices.shape

    def gather(cache, scale):
        dense = cache[inputs.page_indices].reshape(seqs, pages_per_seq * cache.shape[1], *cache.shape[2:])
        dense = dense.astype(compute)
        return dense if scale is None else dense * scale.astype(compute)[None, None, :, None]

    return gather(inputs.k_pages, inputs.k_scale), gather(inputs.v_pages, inputs.v_scale)


def ragged_index_grids(inputs: RaggedInputs, layout: TokenLayout) -> tuple[jax.Array, ...]:
    """(b, h, q_idx, kv_idx) as broadcasting int32 grids of the `[num_tokens, N, capacity]` scores: b the
    sequence of each packed token `[T, 1, 1]`, h `[1, N, 1]`, q_idx its position `[T, 1, 1]`, kv_idx
    `[1, 1, capacity]`."""
    num_tokens, num_heads = inputs.q.shape[:2]
    return (
        layout.seq.reshape(num_tokens, 1, 1),
        jnp.arange(num_heads, dtype=jnp.int32).reshape(1, num_heads, 1),
        layout.position.reshape(num_tokens, 1, 1),
        jnp.arange(inputs.capacity, dtype=jnp.int32).reshape(1, 1, inputs.capacity),
    )


def ragged_from_inputs(inputs: RaggedInputs, score_mod=None, mask_mod=None) -> jax.Array:
    """out `[num_tokens, N, Dv]` in q's dtype of checked inputs (new keys already appended), accumulated in
    float32 (float64 for float64 inputs); padding rows are 0 (NaN rows of `bad_rows` come after, from
    `poison_bad_rows`)."""
    num_tokens, num_heads, num_kv_heads, head_dim, value_dim = inputs.shape
    group, capacity = num_heads // num_kv_heads, inputs.capacity
    if num_tokens == 0:
        return jnp.zeros((0, num_heads, value_dim), inputs.q.dtype)
    compute = jnp.float64 if inputs.q.dtype == jnp.float64 else jnp.float32
    layout = token_layout(inputs.cu_q_lens, inputs.num_seqs, inputs.kv_lens, num_tokens)
    grids = ragged_index_grids(inputs, layout)
    _, _, q_idx, kv_idx = grids
    length = inputs.kv_lens[layout.seq].reshape(num_tokens, 1, 1)
    allowed = layout.live.reshape(num_tokens, 1, 1) & (kv_idx <= q_idx) & (kv_idx < length)
    if inputs.sliding_window is not None:
        allowed = allowed & (q_idx - kv_idx < inputs.sliding_window)
    if mask_mod is not None:
        allowed = allowed & mask_mod(*grids)
    allowed = jnp.broadcast_to(allowed, (num_tokens, num_heads, capacity))
    # Slots no head of a group attends may hold anything (NaN in a recycled page or past a length): zeroed,
    # as 0 * NaN would poison the sums, forward and backward.
    seen = jnp.any(allowed.reshape(num_tokens, num_kv_heads, group, capacity), axis=2)
    seen = jnp.transpose(seen, (0, 2, 1))[..., None]  # [T, capacity, K, 1]
    k, v = (jnp.where(seen, x[layout.seq], 0.0) for x in dense_pages(inputs, compute))  # its sequence's
    q = inputs.q.astype(compute).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,tckd->tkgc", q, k, precision=lax.Precision.HIGHEST)
    scores = scores.reshape(num_tokens, num_heads, capacity) * inputs.scale
    if score_mod is not None:
        scores = score_mod(scores, *grids).astype(compute)
    if inputs.soft_cap is not None:
        scores = inputs.soft_cap * jnp.tanh(scores / inputs.soft_cap)
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    if inputs.sinks is not None:
        sinks = inputs.sinks.astype(compute).reshape(1, num_heads, 1)
        row_max = jnp.maximum(row_max, sinks)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    if inputs.sinks is not None:  # a virtual key of value zero: in the denominator only
        row_sum = row_sum + jnp.where(layout.live.reshape(num_tokens, 1, 1), jnp.exp(sinks - row_max), 0.0)
    probs = (weights / jnp.where(row_sum > 0, row_sum, 1.0)).reshape(num_tokens, num_kv_heads, group, capacity)
    out = jnp.einsum("tkgc,tckd->tkgd", probs, v, precision=lax.Precision.HIGHEST)
    return out.reshape(num_tokens, num_heads, value_dim).astype(inputs.q.dtype)


def prepare_reference_hooks(inputs: RaggedInputs, score_hook: Hook | None, mask_hook: Hook | None) -> None:
    """Traces the hooks at the index grids `ragged_reference_kernel` calls them on (float32 scores: the
    public op takes the kernel dtypes); in the caller's context, as `Hook.prepare` needs."""
    num_tokens, num_heads = inputs.q.shape[:2]
    i32 = jnp.int32
    grids = (jax.ShapeDtypeStruct((num_tokens, 1, 1), i32), jax.ShapeDtypeStruct((1, num_heads, 1), i32),
             jax.ShapeDtypeStruct((num_tokens, 1, 1), i32), jax.ShapeDtypeStruct((1, 1, inputs.capacity), i32))
    if score_hook is not None:
        score_hook.prepare(jax.ShapeDtypeStruct((num_tokens, num_heads, inputs.capacity), jnp.float32), *grids)
    if mask_hook is not None:
        mask_hook.prepare(*grids)


def ragged_reference_kernel(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks, k_scale, v_scale, hook_consts, *,
    scale: float, sliding_window: int | None, soft_cap: float | None, score_hook: Hook | None,
    mask_hook: Hook | None, num_score_consts: int, block_q: int, interpret: bool = False,
) -> jax.Array:
    """The kernel contract (the `ragged_paged_attention_kernel` of each backend) computed by the reference:
    the XLA path. Hooks run on their captured arrays `hook_consts` (prepared by `prepare_reference_hooks`);
    `block_q` and `interpret` mean nothing here."""
    del block_q, interpret
    inputs = RaggedInputs(
        q=q, k_pages=k_pages, v_pages=v_pages, kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
        num_seqs=num_seqs, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale, new_k=None, new_v=None,
    )
    score_mod, mask_mod = (
        None if hook is None else functools.partial(hook.on_values, consts)
        for hook, consts in ((score_hook, hook_consts[:num_score_consts]),
                             (mask_hook, hook_consts[num_score_consts:]))
    )
    return ragged_from_inputs(inputs, score_mod, mask_mod)


def ragged_paged_attention_reference(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs=None, *, scale=None, sliding_window=None,
    soft_cap=None, sinks=None, k_scale=None, v_scale=None, score_mod=None, mask_mod=None, new_k=None, new_v=None,
    config=None,
):
    """Plain-jnp `ragged_paged_attention` with the same arguments and semantics (see there): the new keys
    appended by an XLA scatter, the pages gathered into a dense cache per sequence, the `[num_tokens, N,
    capacity]` scores materialised, float32 accumulation (float64 for float64 inputs, which it takes, with
    any head dim). `config` is checked and otherwise ignored; hooks are called on `[num_tokens, N, capacity]`
    index grids (`ragged_index_grids`)."""
    check_ragged_config(config)
    inputs = check_ragged_inputs(
        q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, scale=scale, sliding_window=sliding_window,
        soft_cap=soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale, score_mod=score_mod, mask_mod=mask_mod,
        new_k=new_k, new_v=new_v, lookback=mask_lookback(mask_mod), allowed_dtypes=REFERENCE_DTYPES,
        max_head_dim=None,
    )
    if inputs.new_k is not None:
        inputs = append_new_kv(inputs)
    out = poison_bad_rows(ragged_from_inputs(inputs, score_mod, mask_mod), inputs)
    return (out, inputs.k_pages, inputs.v_pages) if inputs.new_k is not None else out
