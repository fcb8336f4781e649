"""`merge_splits`: the log-sum-exp merge of a split-KV decode kernel's per-split partials, in XLA. Every
decode kernel (triton/decode.py, tpu/decode.py) writes one (out, lse) per split; this combines them."""

from __future__ import annotations

import jax.numpy as jnp


def merge_splits(out, lse):
    """Combines per-split (out `[..., splits, rows, Dv]`, lse `[..., splits, rows]`) by their lse, in float32:
    out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s); rows no split attended give 0, -inf."""
    top = jnp.max(lse, axis=-2, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(lse - top)  # exactly 0 for an empty split
    total = jnp.sum(weights, axis=-2)
    safe = jnp.where(total > 0, total, 1.0)
    merged = jnp.sum(weights[..., None] * out, axis=-3) / safe[..., None]
    merged_lse = jnp.where(total > 0, jnp.log(safe) + top[..., 0, :], -jnp.inf)
    return jnp.where((total > 0)[..., None], merged, 0.0), merged_lse
