"""Bad input fails at the boundary with a ValueError / TypeError naming the argument and what it got."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, random_qkv

from probjax_kernels import FlashConfig, dropout_keep_mask, flash_attention, flash_attention_reference, flex_attention

q = jnp.zeros((2, 8, 4, 32), jnp.float32)
kv = jnp.zeros((2, 8, 2, 32), jnp.float32)


@pytest.mark.parametrize("attention_fn", [flash_attention, flash_attention_reference])
@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((q[0], kv, kv), {}, ValueError, r"q must have rank 4.*\(8, 4, 32\)"),
        ((q, kv[..., :16], kv[..., :16]), {}, ValueError, r"D=32"),
        ((q, kv, kv[:, :4]), {}, ValueError, r"k and v must have the same shape"),
        ((q, jnp.zeros((2, 8, 3, 32)), jnp.zeros((2, 8, 3, 32))), {}, ValueError, r"N=4.*K=3"),
        ((q, kv.astype(jnp.bfloat16), kv), {}, TypeError, r"one dtype.*bfloat16"),
        ((q.astype(jnp.int32), kv.astype(jnp.int32), kv.astype(jnp.int32)), {}, TypeError, r"int32"),
        ((q, kv, kv), {"q_lengths": jnp.array([8, 9])}, ValueError, r"q_lengths must lie in \[0, 8\]"),
        ((q, kv, kv), {"kv_lengths": jnp.array([-1, 2])}, ValueError, r"kv_lengths"),
        ((q, kv, kv), {"kv_lengths": jnp.array([1, 2, 3])}, ValueError, r"kv_lengths must have shape \[2\]"),
        ((q, kv, kv), {"kv_lengths": jnp.array([1.0, 2.0])}, TypeError, r"kv_lengths must be an integer"),
        ((q, kv, kv), {"mask": jnp.ones((2, 4, 8, 8), jnp.int32)}, TypeError, r"mask must be a bool"),
        ((q, kv, kv), {"mask": jnp.ones((3, 1, 8, 8), bool)}, ValueError, r"mask must be broadcastable"),
        ((q, kv, kv), {"bias": jnp.ones((2, 4, 8, 9))}, ValueError, r"bias must be broadcastable.*\(2, 4, 8, 9\)"),
        ((q, kv, kv), {"bias": jnp.ones((2, 4, 8, 8), jnp.int32)}, TypeError, r"bias must be a floating"),
        ((q, kv, kv), {"q_segment_ids": jnp.zeros((2, 8), jnp.int32)}, ValueError, r"kv_segment_ids"),
        ((q, kv, kv), {"window": (-1, 2)}, ValueError, r"window"),
        ((q, kv, kv), {"window": 2.0}, ValueError, r"window must be None, an int >= 0.*got 2.0"),
        ((q, kv, kv), {"window": True}, ValueError, r"window must be None, an int >= 0.*got True"),
        ((q, kv, kv), {"dropout_rate": 0.1, "dropout_seed": 1.5}, TypeError, r"dropout_seed.*got dtype float"),
        ((q, kv, kv), {"dropout_rate": 0.1, "dropout_seed": jax.random.key(0)}, TypeError, r"dropout_seed.*PRNG key"),
        ((q, kv, kv), {"dropout_rate": 0.1, "dropout_seed": 2**40}, ValueError, r"dropout_seed must lie in"),
        ((q, kv, kv), {"dropout_rate": 1.5}, ValueError, r"dropout_rate"),
        ((q, kv, kv), {"dropout_rate": "0.1", "dropout_seed": 1}, TypeError, r"dropout_rate must be a real.*'0.1'"),
        ((q, kv, kv), {"causal": "yes"}, TypeError, r"causal must be a bool \(True or False\), got 'yes'"),
        ((q, kv, kv), {"scale": float("nan")}, ValueError, r"scale must be finite, got nan"),
        ((q, kv, kv), {"scale": float("inf")}, ValueError, r"scale must be finite, got inf"),
        ((q, kv, kv), {"scale": "0.5"}, TypeError, r"scale must be a real scalar.*'0.5'"),
    ],
)
def test_bad_input(attention_fn, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        attention_fn(*args, **kwargs)


@pytest.mark.parametrize("attention_fn", [flash_attention, flex_attention])
def test_traced_dropout_rate_is_named(attention_fn):
    """The kernels compile the rate: a traced one is a TypeError naming dropout_rate (it was a
    TracerBoolConversionError that named nothing)."""
    with pytest.raises(TypeError, match=r"dropout_rate must be a Python float, got a traced value"):
        jax.jit(lambda rate: attention_fn(q, kv, kv, dropout_rate=rate, dropout_seed=1))(0.1)


def test_kernel_head_dim_limit():
    x = jnp.zeros((1, 8, 1, 300))
    with pytest.raises(ValueError, match=r"head dim D=300 is not supported: it must be <= 256"):
        flash_attention(x, x, x)
    assert flash_attention_reference(x, x, x).shape == x.shape  # the plain-jnp path takes any head dim


def test_empty_sequence():
    with pytest.raises(ValueError, match=r"every dimension must be >= 1"):
        flash_attention(jnp.zeros((1, 0, 1, 32)), jnp.zeros((1, 4, 1, 32)), jnp.zeros((1, 4, 1, 32)))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"block_q": 48}, "block_q=48"), ({"block_k": 8}, "block_k=8"), ({"num_warps": 0}, "num_warps"),
     ({"backend": "cuda"}, "backend")],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlashConfig(**kwargs)


def test_config_must_be_flash_config():
    with pytest.raises(TypeError, match="config must be a FlashConfig"):
        flash_attention(q, kv, kv, config={"block_q": 64})


def test_dropout_needs_a_scalar_seed():
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        flash_attention(q, kv, kv, dropout_rate=0.1)
    with pytest.raises(ValueError, match="dropout_seed must be a scalar"):
        flash_attention(q, kv, kv, dropout_rate=0.1, dropout_seed=np.zeros(2, np.uint32))


@pytest.mark.parametrize("attention_fn", [flash_attention, flash_attention_reference])
@pytest.mark.parametrize("seed", [3_000_000_000, 2**32 - 1, -1])
def test_any_32_bit_python_int_is_a_seed(attention_fn, seed):
    """Python ints past int32 (the upper half of the uint32 seeds) raised an OverflowError; -1 wraps like int32."""
    rate, (batch, q_len, kv_len, heads, kv_heads, head_dim) = 0.3, (2, 9, 13, 2, 1, 16)
    q, k, v = random_qkv(5, batch, q_len, kv_len, heads, kv_heads, head_dim)
    out = attention_fn(q, k, v, dropout_rate=rate, dropout_seed=seed)
    grids = np.ix_(np.arange(batch), np.arange(heads), np.arange(q_len), np.arange(kv_len))
    keep = np.asarray(dropout_keep_mask(jnp.uint32(seed % 2**32), *map(jnp.asarray, grids), rate, heads))
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("btnd,bsnd->bnts", q64, np.repeat(k64, heads // kv_heads, axis=2)) * head_dim**-0.5
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True) * keep / (1 - rate)
    expected = np.einsum("bnts,bsnd->btnd", probs, np.repeat(v64, heads // kv_heads, axis=2))
    assert_close(out, expected, jnp.float32, "out")
