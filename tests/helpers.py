"""Test helpers: random inputs, a float64 NumPy attention (independent of the jnp reference), tolerances, a
stand-in for a GPU device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Normalised max error allowed per dtype: max |actual - expected| / max(max |expected|, 1), i.e. relative to
# the largest expected value, and absolute where every expected value is below 1 (a gradient that is exactly
# zero in exact arithmetic, such as dq for a single key, is rounding noise on both sides).
TOLERANCE = {jnp.float32: 2e-5, jnp.float16: 4e-3, jnp.bfloat16: 3e-2}


# Test inputs come from NumPy's generator on the host: a jax.random draw compiles an XLA program per shape (tens
# of milliseconds each, a sizable share of a small-shape test). Each helper draws from a stream of its own
# (the second word of the seed), so that equal seeds in one test do not give equal arrays.
_NORMAL, _BERNOULLI, _QKV = 1, 2, 3


def _standard_normal(rng: np.random.Generator, shape, dtype) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(jnp.dtype(dtype)))


def normal(seed: int | tuple[int, ...], shape, dtype=jnp.float32) -> jax.Array:
    """Standard normal samples of `shape`, drawn in float32 and rounded to `dtype`."""
    return _standard_normal(np.random.default_rng((*np.atleast_1d(seed), _NORMAL)), shape, dtype)


def bernoulli(seed: int, p: float, shape=()) -> jax.Array:
    """A bool array of `shape`, True with probability `p`."""
    return jnp.asarray(np.random.default_rng((seed, _BERNOULLI)).random(shape) < p)


def random_qkv(seed: int, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype=jnp.float32):
    """q [batch, q_len, num_heads, head_dim] and k, v [batch, kv_len, num_kv_heads, head_dim], standard
    normal, drawn in float32 and rounded to `dtype`."""
    rng = np.random.default_rng((seed, _QKV))
    q_shape, kv_shape = (batch, q_len, num_heads, head_dim), (batch, kv_len, num_kv_heads, head_dim)
    return tuple(_standard_normal(rng, shape, dtype) for shape in (q_shape, kv_shape, kv_shape))


def output_and_grads(f, args, cotangent, *, has_aux=False):
    """`f(*args)` and the gradients of `sum(f(*args) * cotangent)` for every arg, from one forward pass
    (jax.vjp): an interpret-mode forward costs as much as the backward, so tests check both from one run.
    With `has_aux`, f returns (out, aux) (such as lse), aux is not differentiated, and the first result is
    (out, aux). Runs under one jax.jit: eagerly, every op of the forward and of the backward is an XLA
    compile of its own, which costs far more than running the tests' tiny shapes."""

    @jax.jit
    def run(args, cotangent):
        if not has_aux:
            out, vjp = jax.vjp(f, *args)
            return out, vjp(jnp.asarray(cotangent, out.dtype))
        out, vjp, aux = jax.vjp(f, *args, has_aux=True)
        return (out, aux), vjp(jnp.asarray(cotangent, out.dtype))

    return run(tuple(args), cotangent)


def to_float32(x) -> np.ndarray:
    """`x` (a jax or NumPy array of any float dtype, bfloat16 included) as a float32 NumPy array: the values of
    `jnp.asarray(x, jnp.float32)`, converted on the host instead of by an eager XLA compile per shape."""
    return np.asarray(x).astype(np.float32)


def assert_close(actual, expected, dtype, name: str = "", factor: float = 1.0):
    actual = to_float32(actual).astype(np.float64)
    expected = to_float32(expected).astype(np.float64)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert np.isfinite(actual).all(), f"{name}: non-finite values"
    denominator = max(np.abs(expected).max(), 1.0)
    error = np.abs(actual - expected).max() / denominator
    assert error <= TOLERANCE[jnp.dtype(dtype).type] * factor, f"{name}: normalised error {error:.3g}"


def assert_lse_close(lse, expected_lse):
    """A kernel's lse `[B, N, T]` against the float64 one: -inf on exactly the same rows (no key attended, or
    past the query lengths), within 1e-5 elsewhere."""
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse[finite], expected_lse[finite], rtol=1e-5, atol=1e-5)


def numpy_attention(q, k, v, *, allowed=None, bias=None, scale=None):
    """Float64 softmax attention from first principles; `allowed` is a bool array broadcastable to
    [B, N, T, S]. Returns (out [B, T, N, D], lse [B, N, T]); rows with no allowed key give 0 and -inf."""
    q, k, v = (to_float32(x).astype(np.float64) for x in (q, k, v))
    batch, q_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    scale = head_dim**-0.5 if scale is None else scale
    scores = np.einsum("btnd,bsnd->bnts", q, k) * scale
    if bias is not None:
        scores = scores + to_float32(bias).astype(np.float64)
    allowed = np.ones(scores.shape, bool) if allowed is None else np.broadcast_to(allowed, scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.where(allowed, np.exp(scores - row_max), 0.0)
    row_sum = weights.sum(axis=-1, keepdims=True)
    probs = weights / np.where(row_sum > 0, row_sum, 1.0)
    out = np.einsum("bnts,bsnd->btnd", probs, v)
    lse = np.where(row_sum > 0, np.log(np.where(row_sum > 0, row_sum, 1.0)) + row_max, -np.inf)[..., 0]
    return out, lse


def numpy_attention_vjp(q, k, v, d_out, *, allowed=None, scale=None):
    """Float64 gradients `(dq, dk, dv)` of `numpy_attention`'s out at the cotangent d_out `[B, T, N, Dv]`, from
    first principles: dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q,
    summed over each KV head's query heads (and over the batch where k / v have batch 1)."""
    q, k, v, d_out = (to_float32(x).astype(np.float64) for x in (q, k, v, d_out))
    batch, _, num_heads, head_dim = q.shape
    kv_batch, group = k.shape[0], num_heads // k.shape[2]
    k, v = (np.repeat(np.broadcast_to(x, (batch, *x.shape[1:])), group, axis=2) for x in (k, v))
    out, _ = numpy_attention(q, k, v, allowed=allowed, scale=scale)
    scale = head_dim**-0.5 if scale is None else scale
    scores = np.einsum("btnd,bsnd->bnts", q, k) * scale
    allowed = np.ones(scores.shape, bool) if allowed is None else np.broadcast_to(allowed, scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    weights = np.where(allowed, np.exp(scores - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    row_sum = weights.sum(axis=-1, keepdims=True)
    probs = weights / np.where(row_sum > 0, row_sum, 1.0)
    dv = np.einsum("bnts,btnd->bsnd", probs, d_out)
    d_probs = np.einsum("btnd,bsnd->bnts", d_out, v)
    ds = probs * (d_probs - np.einsum("btnd,btnd->bnt", d_out, out)[..., None])
    dq = scale * np.einsum("bnts,bsnd->btnd", ds, k)
    dk = scale * np.einsum("bnts,btnd->bsnd", ds, q)

    def per_kv_head(x):
        x = x.reshape(*x.shape[:2], -1, group, x.shape[-1]).sum(axis=3)
        return x.sum(axis=0, keepdims=True) if kv_batch == 1 < batch else x

    return dq, per_kv_head(dk), per_kv_head(dv)


def numpy_allowed(batch, q_len, kv_len, *, causal=False, window=(None, None), q_lengths=None,
                  kv_lengths=None, q_segment_ids=None, kv_segment_ids=None, mask=None):
    """The [B, 1|N, T, S] bool mask of attended pairs, built independently of the library."""
    rows = np.arange(q_len)[:, None]
    cols = np.arange(kv_len)[None, :]
    allowed = np.ones((batch, 1, q_len, kv_len), bool)
    left, right = window
    if causal:
        allowed &= cols <= rows
    if right is not None:
        allowed &= cols <= rows + right
    if left is not None:
        allowed &= cols >= rows - left
    for b in range(batch):
        if q_lengths is not None:
            allowed[b, :, int(q_lengths[b]):, :] = False
        if kv_lengths is not None:
            allowed[b, :, :, int(kv_lengths[b]):] = False
        if q_segment_ids is not None:
            qs, ks = np.asarray(q_segment_ids[b]), np.asarray(kv_segment_ids[b])
            allowed[b] &= qs[:, None] == ks[None, :]
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    return allowed


@dataclasses.dataclass(frozen=True)
class FakeGPU:
    """What the dispatch reads of a device: its platform, compute capability and kind."""

    compute_capability: str
    device_kind: str = "a fake GPU"
    platform: str = "gpu"
