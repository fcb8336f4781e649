"""Helpers for the NNX, Linen and Equinox module tests: masks and biases built in NumPy, tree comparisons."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import TOLERANCE, normal, to_float32

# Tiny shapes: Pallas runs in interpret mode on the CPU. Head dim = FEATURES / HEADS = 8.
BATCH, SEQ, FEATURES, HEADS = 2, 12, 32, 4
KV_LENGTHS = (SEQ, 7)  # keys past these are padding; every query keeps at least one key


def inputs(seed: int, shape=(BATCH, SEQ, FEATURES)) -> jax.Array:
    return normal(seed, shape)


def padding_mask() -> jax.Array:
    """`[B, 1, 1, S]` bool: batch b attends to its first KV_LENGTHS[b] keys."""
    return jnp.asarray(np.arange(SEQ)[None, None, None, :] < np.array(KV_LENGTHS)[:, None, None, None])


def alibi_bias(slopes, q_len: int, kv_len: int) -> jax.Array:
    """`[N, T, S]` float32: -slopes[h] * |i - j|, independently of probjax_kernels."""
    distance = np.abs(np.arange(q_len)[:, None] - np.arange(kv_len)[None, :])
    return jnp.asarray(-np.asarray(slopes, np.float64)[:, None, None] * distance, jnp.float32)


def assert_trees_close(actual, expected, dtype=jnp.float32, name: str = "", factor: float = 1.0):
    """Leaf by leaf, with errors normalised by the largest expected value of the whole tree: some gradients
    are zero in exact arithmetic (a key bias shifts a softmax row uniformly) and only rounding noise."""
    actual_leaves, actual_def = jax.tree.flatten(actual)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert actual_def == expected_def, (name, actual_def, expected_def)
    scale = max(float(np.max(np.abs(to_float32(e)))) for e in expected_leaves)
    for index, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        a, e = (to_float32(x).astype(np.float64) for x in (a, e))
        assert a.shape == e.shape, (f"{name}[{index}]", a.shape, e.shape)
        assert np.isfinite(a).all(), f"{name}[{index}]: non-finite values"
        error = np.abs(a - e).max() / max(scale, 1e-6)
        assert error <= TOLERANCE[jnp.dtype(dtype).type] * factor, f"{name}[{index}]: normalised error {error:.3g}"


def cotangent(shape, seed: int = 99) -> jax.Array:
    """A fixed random output weighting, so that a loss sees every output element differently."""
    return normal(seed, shape)
