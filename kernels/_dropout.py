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


Positions = tuple[tuple[int, jax.Array, jax.Array], tuple[int, jax.Array, jax.Array]]
SEED_PARTS = 7  # the length of `positional_seed`'s vector


def positional_seed(seed, positions: Positions, offsets=(0, 0)) -> jax.Array:
    """The kernels' dropout input when indices are not positions (a shard of a longer sequence, or of the
    batch / heads): uint32 `[7]` = (seed, q first, q second, kv first, kv second, batch offset, head offset).
    `positions` is ((q_split, q_first, q_second), (kv_split, kv_first, kv_second)): local index x sits at
    position x + first below split, else x - split + second (two chunks: the zigzag layout of
    `ring_attention`); `offsets` = (b0, h0): local batch b and head h are b + b0 and h + h0 of the whole."""
    (_, q_first, q_second), (_, kv_first, kv_second) = positions
    parts = (seed, q_first, q_second, kv_first, kv_second, *offsets)
    return jnp.stack([jnp.asarray(x).astype(jnp.uint32).reshape(()) for x in parts])


def positions_of(seed_parts, splits: tuple[int, int], b, h, q_idx, kv_idx):
    """(seed, b, h, q positions, kv positions) of the whole attention from `positional_seed`'s parts (an
    array or a tuple of scalars), the static (q_split, kv_split) and local indices."""
    def place(x, split, first, second):
        first, second = first.astype(jnp.int32), second.astype(jnp.int32)
        return jnp.where(x < split, x + first, x - split + second)

    return (seed_parts[0], b + seed_parts[5].astype(jnp.int32), h + seed_parts[6].astype(jnp.int32),
            place(q_idx, splits[0], seed_parts[1], seed_parts[2]), place(kv_idx, splits[1], seed_parts[3],
                                                                          seed_parts[4]))
