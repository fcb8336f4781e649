"""A value head dim Dv other than D, and key / value of batch 1 shared by the query batch: the references and
attention(), against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, numpy_attention

import probjax_nn
from probjax_kernels import (
    causal_mask, create_block_mask, flash_attention, flash_attention_reference, flex_attention, flex_attention_reference,
)


def inputs(seed, batch, kv_batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, value_dim):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, q_len, num_heads, head_dim))
    k = jax.random.normal(kk, (kv_batch, kv_len, num_kv_heads, head_dim))
    v = jax.random.normal(kv, (kv_batch, kv_len, num_kv_heads, value_dim))
    return q, k, v


def expected(q, k, v, allowed=None):
    k, v = (jnp.broadcast_to(x, (q.shape[0], *x.shape[1:])) for x in (k, v))
    return numpy_attention(q, k, v, allowed=allowed)


@pytest.mark.parametrize("kv_batch", [2, 1])
def test_references_and_attention(kv_batch):
    q, k, v = inputs(0, 2, kv_batch, 40, 56, 4, 2, 24, 40)
    allowed = np.tril(np.ones((40, 56), bool))
    out, lse = expected(q, k, v, allowed)
    got, got_lse = flash_attention_reference(q, k, v, causal=True, return_lse=True)
    assert got.shape == (2, 40, 4, 40)
    assert_close(got, out, jnp.float32)
    np.testing.assert_allclose(np.asarray(got_lse), lse, rtol=1e-5)
    block_mask = create_block_mask(causal_mask, None, None, 40, 56, BLOCK_SIZE=16)
    assert_close(flex_attention_reference(q, k, v, None, block_mask, enable_gqa=True), out, jnp.float32)
    assert_close(probjax_nn.attention(q, k, v, is_causal=True, impl="xla"), out, jnp.float32)
    assert_close(probjax_nn.attention(q, k, v, is_causal=True), out, jnp.float32)  # auto: xla on the CPU
    grads = jax.grad(lambda q, k, v: jnp.sum(flash_attention_reference(q, k, v, causal=True) ** 2), (1, 2))(q, k, v)
    assert grads[0].shape == k.shape and grads[1].shape == v.shape


def test_the_kernels_refuse_what_they_cannot_do_yet():
    q, k, v = inputs(1, 2, 2, 16, 16, 2, 2, 16, 32)
    with pytest.raises(NotImplementedError, match="need v's head dim Dv=32 equal to q / k's D=16"):
        flash_attention(q, k, v)
    with pytest.raises(NotImplementedError, match="impl='pallas' does not support a value head dim"):
        probjax_nn.attention(q, k, v, impl="pallas")
    q, k, v = inputs(1, 2, 1, 16, 16, 2, 2, 16, 16)
    with pytest.raises(NotImplementedError, match="need k / v with q's batch B=2, not 1"):
        flex_attention(q, k, v)
    with pytest.raises(NotImplementedError, match="impl='flex' does not support key / value of batch 1"):
        probjax_nn.attention(q, k, v, impl="flex")
