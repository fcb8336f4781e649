"""Attention sinks (gpt-oss; the `sinks` of JAX's splash attention): a learned logit per head for a virtual key
whose value is zero. It joins every query row's softmax denominator and nothing else.

Every front-end applies it to a call's (out, lse) after the kernels, as one more partial of the log-sum-exp
merge that split-KV decoding and ring attention already do:

    lse' = logaddexp(lse, sink[h]),    out' = out * exp(lse - lse') = out * sigmoid(lse - sink[h]).

This is exact (the kernels' out and lse are the attention without the sink) and costs one elementwise pass
over out. Its derivatives run through the kernels: the backward kernels take lse's cotangent, the tangent
kernel gives lse's tangent, and the sinks' own gradient is the XLA of these two lines.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attach_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(out `[B, T, N, Dv]`, lse `[B, N, T]` float32) of attention without sinks -> the same with `sinks`
    `[N]` float32 in every row's denominator (None: unchanged). A row that attends nothing keeps out 0 and
    gets lse = sink."""
    if sinks is None:
        return out, lse
    sink = sinks.astype(lse.dtype).reshape(1, -1, 1)
    merged = jnp.logaddexp(lse, sink)
    weight = jnp.exp(lse - merged)  # in [0, 1); exactly 0 where lse is -inf
    dtype = jnp.float64 if out.dtype == jnp.float64 else jnp.float32  # float32 at least
    scaled = out.astype(dtype) * jnp.swapaxes(weight, 1, 2)[..., None].astype(dtype)
    return scaled.astype(out.dtype), merged

