"""Plain-jnp attention with the flash kernel's signature and semantics: the tests' reference and the XLA path.

It materialises the `[B, N, T, S]` scores, so it is quadratic in memory; the Pallas kernel is not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from probjax_kernels._dropout import keep_mask, positional_seed, positions_of
from probjax_kernels._hooks import hook_hint
from probjax_kernels._inputs import AttentionInputs, check_dropout, check_flag, check_inputs, check_sinks
from probjax_kernels._sinks import attach_sinks

REFERENCE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def allowed_positions(inputs: AttentionInputs, causal: bool) -> jax.Array:
    """The bool `[B|1, N|1, T, S]` mask of (query, key) pairs that attend: every masking argument combined."""
    _, q_len, kv_len, *_ = inputs.shape
    q_idx = jnp.arange(q_len).reshape(1, 1, q_len, 1)
    kv_idx = jnp.arange(kv_len).reshape(1, 1, 1, kv_len)
    allowed = jnp.ones((1, 1, q_len, kv_len), jnp.bool_)
    left, right = inputs.window
    if causal:
        right = 0 if right is None else min(right, 0)
    if right is not None:
        allowed &= kv_idx <= q_idx + right
    if left is not None:
        allowed &= kv_idx >= q_idx - left
    if inputs.q_lengths is not None:
        allowed &= q_idx < inputs.q_lengths[:, None, None, None]
    if inputs.kv_lengths is not None:
        allowed &= kv_idx < inputs.kv_lengths[:, None, None, None]
    if inputs.q_segment_ids is not None:
        allowed &= inputs.q_segment_ids[:, None, :, None] == inputs.kv_segment_ids[:, None, None, :]
    if inputs.mask is not None:
        allowed &= inputs.mask
    return allowed


def _index_grids(batch: int, num_heads: int, q_len: int, kv_len: int):
    """(b, h, q_idx, kv_idx) as broadcasting int32 grids of the [B, N, T, S] score array."""
    return (
        jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1),
        jnp.arange(num_heads, dtype=jnp.int32).reshape(1, num_heads, 1, 1),
        jnp.arange(q_len, dtype=jnp.int32).reshape(1, 1, q_len, 1),
        jnp.arange(kv_len, dtype=jnp.int32).reshape(1, 1, 1, kv_len),
    )


def attention_from_inputs(
    inputs: AttentionInputs,
    causal: bool,
    compute_dtype=jnp.float32,
    *,
    score_mod=None,
    mask_mod=None,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    dropout_positions=None,
    dropout_shard=None,
    return_max: bool = False,
) -> tuple[jax.Array, ...]:
    """Dense softmax attention in `compute_dtype`; returns (out `[B, T, N, Dv]` in q's dtype, lse `[B, N, T]`),
    and with `return_max` the row max of the masked scores `[B, N, T]` float32 (-inf where fully masked, no
    gradient).

    `score_mod` rewrites the scaled (and biased) scores, `mask_mod` masks further (True = attend); both are
    called with broadcasting index grids. Dropout uses the kernels' keep mask, so it matches them exactly;
    `dropout_positions` (see `_dropout.positional_seed`) makes it hash global positions instead of indices,
    `dropout_shard` = (batch offset, head offset, whole head count) global batch and head indices.
    """
    batch, q_len, kv_len, num_heads, num_kv_heads, head_dim = inputs.shape
    group = num_heads // num_kv_heads
    q = inputs.q.astype(compute_dtype).reshape(batch, q_len, num_kv_heads, group, head_dim)
    k = inputs.k.astype(compute_dtype)
    v = inputs.v.astype(compute_dtype)
    # k / v of batch 1 are shared by every example: contract against them without repeating them.
    kv = "skd" if inputs.kv_broadcast else "bskd"
    k, v = (k[0], v[0]) if inputs.kv_broadcast else (k, v)
    scores = jnp.einsum(f"btkgd,{kv}->bkgts", q, k, precision=lax.Precision.HIGHEST)
    scores = scores.reshape(batch, num_heads, q_len, kv_len) * inputs.scale
    if inputs.bias is not None:
        scores = scores + inputs.bias.astype(compute_dtype)
    grids = _index_grids(batch, num_heads, q_len, kv_len)
    if score_mod is not None:
        with hook_hint("score_mod"):
            scores = score_mod(scores, *grids)
    allowed = allowed_positions(inputs, causal)
    if mask_mod is not None:
        with hook_hint("mask_mod"):
            allowed = allowed & mask_mod(*grids)
    scores = jnp.where(allowed, scores, -jnp.inf)
    # The row max only stabilises exp; softmax does not depend on it, so it carries no gradient. A fully
    # masked row has max -inf: use 0 there so that exp gives exact zeros instead of NaN.
    max_scores = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(max_scores), max_scores, 0.0)
    weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)
    probs = weights / safe_sum
    if dropout_rate:
        b, h, q_idx, kv_idx = grids
        hash_heads = num_heads
        if dropout_positions is not None or dropout_shard is not None:  # a shard (`_dropout.positional_seed`)
            positions = dropout_positions or ((q_len, 0, 0), (kv_len, 0, 0))
            offsets = (0, 0) if dropout_shard is None else dropout_shard[:2]
            hash_heads = num_heads if dropout_shard is None else dropout_shard[2]
            dropout_seed, b, h, q_idx, kv_idx = positions_of(
                positional_seed(dropout_seed, positions, offsets), (positions[0][0], positions[1][0]), b, h,
                q_idx, kv_idx)
        keep = keep_mask(dropout_seed, b, h, q_idx, kv_idx, dropout_rate, hash_heads)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    probs = probs.reshape(batch, num_kv_heads, group, q_len, kv_len)
    out = jnp.einsum(f"bkgts,{kv}->btkgd", probs, v, precision=lax.Precision.HIGHEST)
    out = out.reshape(batch, q_len, num_heads, inputs.value_dim).astype(inputs.q.dtype)
    lse = jnp.where(row_sum > 0, jnp.log(safe_sum) + row_max, -jnp.inf)[..., 0]
    lse = jnp.broadcast_to(lse, (batch, num_heads, q_len)).astype(jnp.float32)
    if return_max:
        return out, lse, jnp.broadcast_to(max_scores[..., 0], (batch, num_heads, q_len)).astype(jnp.float32)
    return out, lse


def flash_attention_reference(
    q,
    k,
    v,
    *,
    bias=None,
    mask=None,
    causal: bool = False,
    scale: float | None = None,
    q_lengths=None,
    kv_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    return_lse: bool = False,
    config=None,
    window=None,
    sinks=None,
):
    """Plain-jnp attention with exactly the semantics of `probjax_kernels.flash_attention`.

    Computes in float32 (float64 when given float64 inputs and x64 is enabled) with `Precision.HIGHEST`.
    `config` is accepted for signature compatibility and ignored. See `flash_attention` for the arguments.
    """
    del config
    inputs = check_inputs(
        q, k, v, bias=bias, mask=mask, scale=scale, q_lengths=q_lengths, kv_lengths=kv_lengths,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, window=window, dropout_rate=dropout_rate,
        allowed_dtypes=REFERENCE_DTYPES, max_head_dim=None,
    )
    dropout_seed, sinks = check_dropout(dropout_rate, dropout_seed), check_sinks(sinks, inputs.q.shape[2])
    out, lse = attention_from_inputs(
        inputs, check_flag("causal", causal), compute_dtype(inputs), dropout_rate=dropout_rate,
        dropout_seed=dropout_seed,
    )
    out, lse = attach_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def compute_dtype(inputs: AttentionInputs):
    return jnp.float64 if inputs.q.dtype == jnp.float64 else jnp.float32
