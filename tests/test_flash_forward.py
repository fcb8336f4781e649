"""Forward pass of the Pallas kernel (interpret mode on CPU) against a float64 NumPy attention."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, bernoulli, normal, numpy_allowed, numpy_attention, random_qkv

from probjax_kernels import FlashConfig, flash_attention, flash_attention_reference

SMALL_TILES = FlashConfig(block_q=16, block_k=32, block_q_dq=32, block_k_dq=16, block_q_dkv=16, block_k_dkv=16)


def check_forward(q, k, v, *, allowed=None, bias=None, scale=None, factor=1.0, **kwargs):
    out, lse = flash_attention(q, k, v, bias=bias, scale=scale, return_lse=True, **kwargs)
    expected_out, expected_lse = numpy_attention(q, k, v, allowed=allowed, bias=bias, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close(out, expected_out, q.dtype, "out", factor)
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse[finite], expected_lse[finite], atol=1e-4 if q.dtype == jnp.float32 else 5e-2)
    return out, lse


@pytest.mark.parametrize(
    "batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, causal",
    [
        (2, 128, 128, 2, 2, 64, False),
        (2, 128, 128, 2, 2, 64, True),
        (1, 1, 1, 1, 1, 32, False),
        (2, 77, 77, 4, 1, 64, True),  # MQA 4:1, ragged
        (1, 600, 600, 8, 1, 32, True),  # 8:1
        (1, 77, 300, 2, 2, 80, False),  # T != S, D padded to 128
        (1, 300, 77, 2, 2, 96, True),  # causal with T > S: the last rows see every key
        (1, 40, 40, 2, 2, 128, True),
        (1, 40, 56, 1, 1, 256, False),
        (1, 1, 1500, 2, 1, 64, True),  # decode-like T=1 with causal: only key 0 is visible
    ],
)
def test_shapes_float32(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, causal):
    q, k, v = random_qkv(0, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim)
    allowed = numpy_allowed(batch, q_len, kv_len, causal=causal)
    check_forward(q, k, v, allowed=allowed, causal=causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes_small_tiles(dtype, causal):
    """Several tiles in every direction, with partial tiles at both sequence ends."""
    q, k, v = random_qkv(1, 2, 100, 150, 4, 2, 64, dtype)
    allowed = numpy_allowed(2, 100, 150, causal=causal)
    check_forward(q, k, v, allowed=allowed, causal=causal, config=SMALL_TILES)


def test_reference_matches_numpy():
    q, k, v = random_qkv(2, 2, 50, 70, 4, 2, 32)
    lengths = jnp.array([50, 20], jnp.int32)
    out, lse = flash_attention_reference(q, k, v, causal=True, kv_lengths=lengths, return_lse=True)
    expected_out, expected_lse = numpy_attention(q, k, v, allowed=numpy_allowed(2, 50, 70, causal=True,
                                                                                 kv_lengths=lengths))
    assert_close(out, expected_out, jnp.float32)
    np.testing.assert_allclose(np.asarray(lse), expected_lse, atol=1e-5)


@pytest.mark.parametrize(
    "bias_shape", [(2, 4, 60, 90), (1, 4, 60, 90), (60, 90), (2, 1, 1, 90), (4, 60, 1)]
)
def test_bias_broadcasts(bias_shape):
    q, k, v = random_qkv(3, 2, 60, 90, 4, 2, 32)
    bias = 2.0 * normal(4, bias_shape, jnp.float32)
    check_forward(q, k, v, bias=bias, config=SMALL_TILES)


@pytest.mark.parametrize("mask_shape", [(2, 4, 60, 90), (2, 1, 60, 90), (2, 1, 1, 90), (60, 90)])
def test_dense_mask(mask_shape):
    q, k, v = random_qkv(5, 2, 60, 90, 4, 2, 32)
    mask = bernoulli(6, 0.7, mask_shape)
    allowed = numpy_allowed(2, 60, 90, causal=True, mask=np.asarray(mask))
    check_forward(q, k, v, allowed=allowed, mask=mask, causal=True, config=SMALL_TILES)


def test_lengths_including_empty():
    q, k, v = random_qkv(7, 3, 70, 90, 2, 1, 64)
    q_lengths = jnp.array([70, 33, 0], jnp.int32)
    kv_lengths = jnp.array([1, 90, 45], jnp.int32)
    allowed = numpy_allowed(3, 70, 90, q_lengths=q_lengths, kv_lengths=kv_lengths)
    out, lse = check_forward(q, k, v, allowed=allowed, q_lengths=q_lengths, kv_lengths=kv_lengths,
                             config=SMALL_TILES)
    assert np.all(np.asarray(out[1, 33:]) == 0) and np.all(np.asarray(out[2]) == 0)
    assert np.all(np.isneginf(lse[1, :, 33:])) and np.all(np.isneginf(lse[2]))


def test_segment_ids_packed_documents():
    q, k, v = random_qkv(8, 2, 96, 96, 2, 2, 32)
    segments = jnp.array([[0] * 30 + [1] * 50 + [2] * 16, [5] * 7 + [6] * 89], jnp.int32)
    allowed = numpy_allowed(2, 96, 96, causal=True, q_segment_ids=segments, kv_segment_ids=segments)
    check_forward(q, k, v, allowed=allowed, causal=True, q_segment_ids=segments, kv_segment_ids=segments,
                  config=SMALL_TILES)


@pytest.mark.parametrize("window, causal", [((8, 4), False), ((20, None), True), ((None, 3), False), (5, False)])
def test_local_window(window, causal):
    q, k, v = random_qkv(9, 1, 90, 100, 2, 1, 32)
    pair = (window, window) if isinstance(window, int) else window
    allowed = numpy_allowed(1, 90, 100, causal=causal, window=pair)
    check_forward(q, k, v, allowed=allowed, causal=causal, window=window, config=SMALL_TILES)


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = random_qkv(10, 1, 40, 40, 2, 2, 32)
    mask = np.ones((1, 2, 40, 40), bool)
    mask[0, 0, 3] = False  # one row of head 0
    mask[0, 1, :, :] = False  # all of head 1
    out, lse = check_forward(q, k, v, allowed=mask, mask=jnp.asarray(mask))
    assert np.all(np.asarray(out[0, 3, 0]) == 0) and np.all(np.asarray(out[0, :, 1]) == 0)
    assert np.isneginf(lse[0, 0, 3]) and np.all(np.isneginf(lse[0, 1]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_large_logits_do_not_overflow(dtype):
    q, k, v = random_qkv(11, 1, 64, 64, 2, 2, 64, dtype)
    q = (q.astype(jnp.float32) * 30.0).astype(dtype)  # scores around 1e3: exp would overflow naively
    check_forward(q, k, v, causal=True, allowed=numpy_allowed(1, 64, 64, causal=True), factor=2.0)


def test_custom_scale_and_float16_bias():
    q, k, v = random_qkv(12, 1, 48, 48, 2, 2, 64, jnp.float16)
    bias = normal(13, (1, 2, 48, 48), jnp.float16)
    check_forward(q, k, v, bias=bias, scale=0.3)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_and_inf_inputs_propagate_as_in_numpy(causal):
    """A NaN key or an infinite query entry makes NaN exactly the output rows that see it (not zeros, which
    would hide a diverging run); float64 NumPy says which."""
    q, k, v = random_qkv(30, 1, 40, 40, 2, 2, 16, jnp.float32)
    k = k.at[0, 2, 0, 3].set(jnp.nan)
    q = q.at[0, 30, 1, 0].set(jnp.inf)
    out = np.asarray(flash_attention(q, k, v, causal=causal))
    allowed = numpy_allowed(1, 40, 40, causal=causal)
    with np.errstate(invalid="ignore"):
        expected, _ = numpy_attention(q, k, v, allowed=allowed)
    assert np.isnan(out).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
