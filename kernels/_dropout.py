"""Attention dropout from a stateless hash of (seed, b, h, q_idx, kv_idx).

The keep mask is a pure function of integer coordinates, so the backward kernels recompute exactly the mask
the forward kernel used, and the plain-jnp reference reproduces it bit for bit (it calls this same
function). Arguments may be scalars or arrays that broadcast against each other (a kernel tile passes
(bq, 1) query and (1, bk) key indices; the reference passes 4-D index grids).
"""

import jax
import jax.numpy as jnp


def _mix(x: jax.Array) -> jax.Array:
    """The murmur3 32-bit finaliser: a bijection of uint32 with full avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def keep_mask(seed, batch_index, head_index, q_idx, kv_idx, rate: float, num_heads: int) -> jax.Array:
    """True where an attention probability survives dropout with the given `rate` (probability 1 - rate)."""
    u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)  # noqa: E731
    stream = _mix(u32(seed) ^ _mix(u32(batch_index) * jnp.uint32(num_heads) + u32(head_index) + jnp.uint32(1)))
    bits = _mix(stream ^ _mix(u32(q_idx) * jnp.uint32(0x9E3779B9) + u32(kv_idx)))
    threshold = jnp.uint32(min(int(rate * 2.0**32), 2**32 - 1))
    return bits >= threshold
