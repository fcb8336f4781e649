"""Gradients of the Pallas kernel (dQ and dK/dV kernels) against autodiff of the plain-jnp reference."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, bernoulli, normal, random_qkv

from probjax_kernels import _backend, FlashConfig, _dispatch, default_config, flash_attention, flash_attention_reference
from probjax_kernels.triton import plan as triton_plan

SMALL_TILES = FlashConfig(block_q=16, block_k=32, block_q_dq=32, block_k_dq=16, block_q_dkv=16, block_k_dkv=32)


def gradients(attention_fn, q, k, v, *, bias=None, with_lse=False, **kwargs):
    """Gradients of <out, c> (+ <lse, c'> with `with_lse`) in q, k, v (and bias), for fixed random c."""
    out_shape = q.shape
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    out_cotangent = normal(99, out_shape)
    lse_cotangent = normal(98, lse_shape)

    def loss(q, k, v, bias):
        out, lse = attention_fn(q, k, v, bias=bias, return_lse=True, **kwargs)
        total = jnp.sum(out.astype(jnp.float32) * out_cotangent)
        if with_lse:
            total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * lse_cotangent)
        return total

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    return jax.jit(jax.grad(loss, argnums))(q, k, v, bias)


def check_gradients(q, k, v, factor=1.0, **kwargs):
    actual = gradients(flash_attention, q, k, v, **kwargs)
    expected = gradients(flash_attention_reference, q, k, v, **kwargs)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), actual, expected):
        assert a.dtype == e.dtype
        assert_close(a, e, q.dtype, name, factor)
    return actual


@pytest.mark.parametrize(
    "batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, causal",
    [
        (2, 128, 128, 2, 2, 64, False),
        (2, 128, 128, 2, 2, 64, True),
        (1, 1, 1, 1, 1, 32, False),
        (2, 77, 77, 4, 1, 64, True),  # MQA 4:1
        (1, 600, 600, 8, 1, 32, True),  # GQA 8:1
        (1, 77, 300, 2, 2, 80, False),
        (1, 300, 77, 2, 2, 96, True),
        (1, 40, 40, 2, 2, 128, False),
        (1, 40, 56, 1, 1, 256, True),
        (1, 1500, 1500, 2, 1, 64, True),
    ],
)
def test_gradients_float32(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, causal):
    q, k, v = random_qkv(20, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim)
    check_gradients(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gradients_half_precision(dtype):
    q, k, v = random_qkv(21, 2, 100, 150, 4, 2, 64, dtype)
    check_gradients(q, k, v, causal=True, config=SMALL_TILES, factor=1.5)


def test_gradients_small_tiles_all_masks():
    """Lengths, segments, window and a dense mask at once, with tiles small enough to exercise every range."""
    q, k, v = random_qkv(22, 2, 90, 110, 4, 2, 32)
    segments_q = jnp.array([[0] * 40 + [1] * 50, [3] * 90], jnp.int32)
    segments_kv = jnp.array([[0] * 50 + [1] * 60, [3] * 110], jnp.int32)
    mask = bernoulli(23, 0.8, (2, 1, 1, 110))
    check_gradients(
        q, k, v, causal=True, window=(30, None), mask=mask, q_lengths=jnp.array([90, 61], jnp.int32),
        kv_lengths=jnp.array([100, 7], jnp.int32), q_segment_ids=segments_q, kv_segment_ids=segments_kv,
        config=SMALL_TILES,
    )


@pytest.mark.parametrize("head_dim, q_len, kv_len, num_kv_heads", [(128, 100, 150, 2), (256, 77, 90, 1)])
def test_gradients_at_the_hopper_default_tiles(head_dim, q_len, kv_len, num_kv_heads, monkeypatch):
    """The 16-bit backward tiles default_config picks for an sm_90a GPU (64 x 64 dK/dV at head dim 128, 16 x 64
    dK/dV and 64 x 32 dQ at 256, the dK/dV kernel on transposed scores), run in interpret mode on lengths that
    end inside a tile, with GQA 4:2 and causal masking."""
    sm90 = types.SimpleNamespace(compute_capability="9.0")
    monkeypatch.setattr(_backend, "target_device", lambda: sm90)
    hopper = default_config(FlashConfig(backend="triton"), q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                            dtype=jnp.bfloat16)
    transposed = triton_plan.dkv_transposed(hopper, jnp.bfloat16, head_dim, device=sm90)
    monkeypatch.undo()
    assert transposed
    monkeypatch.setattr(triton_plan, "dkv_transposed", lambda *args, **kwargs: transposed)
    assert (hopper.block_q_dkv, hopper.block_k_dkv, hopper.block_q_dq) == (
        (64, 64, 64) if head_dim == 128 else (16, 64, 64))
    q, k, v = random_qkv(30, 1, q_len, kv_len, 4, num_kv_heads, head_dim, jnp.bfloat16)
    check_gradients(q, k, v, causal=True, config=dataclasses.replace(hopper, backend="interpret"), factor=1.5)


@pytest.mark.parametrize("window", [(8, 4), (None, 3)])
def test_gradients_local_window(window):
    q, k, v = random_qkv(24, 1, 90, 100, 2, 1, 32)
    check_gradients(q, k, v, window=window, config=SMALL_TILES)


@pytest.mark.parametrize("bias_shape", [(2, 4, 60, 90), (1, 4, 60, 90), (60, 90), (2, 1, 1, 90)])
def test_bias_gradient(bias_shape):
    q, k, v = random_qkv(25, 2, 60, 90, 4, 2, 32)
    bias = normal(26, bias_shape, jnp.float32)
    dq, dk, dv, dbias = check_gradients(q, k, v, bias=bias, causal=True, config=SMALL_TILES)
    assert dbias.shape == bias.shape


@pytest.mark.parametrize("per_query_head", [True, False])
def test_gqa_dkv_per_query_head_and_over_the_group(per_query_head, monkeypatch):
    """With GQA the dK/dV kernel runs one program per query head and dK / dV are summed over the group
    (`triton_plan.retile.dkv_per_query_head`: the default on a GPU, forced here), or loops over the group's query
    heads in one program (interpret mode's default). Both exact against the reference with k / v of batch 1
    shared by the query batch, a bias and a mask tile, causal masking and lengths inside a tile."""
    chosen = []
    choose = triton_plan.retile.dkv_per_query_head
    monkeypatch.setattr(triton_plan.retile, "dkv_per_query_head",
                        lambda problem: chosen.append(choose(problem)) or per_query_head)
    q, k, v = random_qkv(29, 2, 50, 70, 4, 2, 32)
    k, v = k[:1], v[:1]
    bias = normal(30, (1, 4, 50, 70), jnp.float32)
    mask = bernoulli(31, 0.8, (2, 1, 50, 70))
    check_gradients(q, k, v, bias=bias, mask=mask, causal=True, kv_lengths=jnp.array([70, 45], jnp.int32),
                    config=SMALL_TILES)
    assert chosen == [False]  # interpret mode


def test_lse_cotangent():
    q, k, v = random_qkv(27, 2, 50, 70, 2, 1, 32)
    check_gradients(q, k, v, causal=True, with_lse=True, kv_lengths=jnp.array([70, 0], jnp.int32),
                    config=SMALL_TILES)


def test_fully_masked_rows_have_zero_finite_gradients():
    q, k, v = random_qkv(28, 2, 40, 40, 2, 2, 32)
    mask = np.ones((2, 2, 40, 40), bool)
    mask[0, :, :10, :] = False  # first 10 query rows of batch 0 see nothing
    mask[1, 1] = False  # head 1 of batch 1 sees nothing
    dq, dk, dv = check_gradients(q, k, v, mask=jnp.asarray(mask), with_lse=True)
    assert np.all(np.asarray(dq[0, :10]) == 0) and np.all(np.asarray(dq[1, :, 1]) == 0)
    assert np.all(np.asarray(dk[1, :, 1]) == 0) and np.all(np.asarray(dv[1, :, 1]) == 0)


def test_zero_length_batch_gradients():
    q, k, v = random_qkv(29, 2, 33, 33, 2, 2, 32)
    lengths = jnp.array([0, 33], jnp.int32)
    dq, dk, dv = check_gradients(q, k, v, q_lengths=lengths, kv_lengths=lengths, causal=True)
    assert np.all(np.asarray(dq[0]) == 0) and np.all(np.asarray(dk[0]) == 0) and np.all(np.asarray(dv[0]) == 0)
