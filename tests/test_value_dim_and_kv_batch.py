"""A value head dim Dv other than D, and key / value of batch 1 shared by the query batch: the references and
attention(), against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, numpy_attention

import probjax_nn
from probjax_nn import _protocol
from probjax_kernels import (
    causal_mask, create_block_mask, flash_attention, flash_attention_reference, flex_attention, flex_attention_reference,
    softcap,
)


def inputs(seed, batch, kv_batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, value_dim):
    q = normal((seed, 1), (batch, q_len, num_heads, head_dim))
    k = normal((seed, 2), (kv_batch, kv_len, num_kv_heads, head_dim))
    v = normal((seed, 3), (kv_batch, kv_len, num_kv_heads, value_dim))
    return q, k, v


def expected(q, k, v, allowed=None):
    k, v = (jnp.broadcast_to(x, (q.shape[0], *x.shape[1:])) for x in (k, v))
    return numpy_attention(q, k, v, allowed=allowed)


def test_references_and_attention():
    q, k, v = inputs(0, 2, 1, 40, 56, 4, 2, 24, 40)
    allowed = np.tril(np.ones((40, 56), bool))
    out, lse = expected(q, k, v, allowed)
    got, got_lse = flash_attention_reference(q, k, v, causal=True, return_lse=True)
    assert got.shape == (2, 40, 4, 40)
    assert_close(got, out, jnp.float32)
    np.testing.assert_allclose(np.asarray(got_lse), lse, rtol=1e-5)
    block_mask = create_block_mask(causal_mask, None, None, 40, 56, BLOCK_SIZE=16)
    assert_close(flex_attention_reference(q, k, v, None, block_mask, enable_gqa=True), out, jnp.float32)
    assert_close(probjax_nn.attention(q, k, v, is_causal=True, impl="xla"), out, jnp.float32)
    grads = jax.grad(lambda q, k, v: jnp.sum(flash_attention_reference(q, k, v, causal=True) ** 2), (1, 2))(q, k, v)
    assert grads[0].shape == k.shape and grads[1].shape == v.shape



def kernel_and_reference_agree(kernel, reference, q, k, v, jvp=True):
    """Forward, gradients in q, k, v (k / v of batch 1 get the sum over the batch) and the jvp, against the
    plain-jnp reference."""
    # Each under jit: eagerly, every op is an XLA compile of its own.
    assert_close(jax.jit(kernel)(q, k, v), jax.jit(reference)(q, k, v), jnp.float32, "out")
    cotangent = normal(9, (*q.shape[:-1], v.shape[-1]))
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cotangent), (0, 1, 2)))(q, k, v)
             for f in (kernel, reference)]
    for name, got, want in zip(("dq", "dk", "dv"), *grads):
        assert got.shape == want.shape
        assert_close(got, want, jnp.float32, name)
    if not jvp:
        return
    tangents = tuple(normal(i, x.shape) for i, x in enumerate((q, k, v)))
    tangent_of = jax.jit(lambda f, primals, tangents: jax.jvp(f, primals, tangents)[1], static_argnums=0)
    assert_close(tangent_of(kernel, (q, k, v), tangents), tangent_of(reference, (q, k, v), tangents), jnp.float32,
                 "jvp")


def test_flash_kernel_with_shared_kv_and_value_dim():
    q, k, v = inputs(2, 2, 1, 40, 56, 4, 2, 32, 16)
    kwargs = dict(causal=True, kv_lengths=jnp.array([56, 30]))
    kernel_and_reference_agree(lambda *a: flash_attention(*a, **kwargs),
                               lambda *a: flash_attention_reference(*a, **kwargs), q, k, v)


def test_flex_kernel_with_hooks_gqa_and_value_dim():
    q, k, v = inputs(3, 2, 2, 32, 32, 2, 1, 16, 48)
    block_mask = create_block_mask(causal_mask, None, None, 32, 32, BLOCK_SIZE=16)
    kernel_and_reference_agree(lambda *a: flex_attention(*a, softcap(2.0), block_mask, enable_gqa=True),
                               lambda *a: flex_attention_reference(*a, softcap(2.0), block_mask, enable_gqa=True),
                               q, k, v, jvp=False)  # the tangent kernel with Dv: test_flash_kernel


def test_modules_no_longer_pad_the_smaller_head_dim(monkeypatch):
    """Equinox's qk_size != vo_size reaches the kernel as it is (was padded to the larger head dim)."""
    seen = []
    attention = _protocol.attention

    def spy(query, key, value, **kwargs):
        seen.append((query.shape[-1], key.shape[-1], value.shape[-1]))
        return attention(query, key, value, **kwargs)

    monkeypatch.setattr(_protocol, "attention", spy)
    q, k, v = inputs(4, 1, 1, 16, 16, 2, 2, 4, 12)
    out = _protocol.AttentionFunction(probjax_nn.AttentionConfig(impl="pallas"))(q[0], k[0], v[0])
    assert seen == [(4, 4, 12)]
    assert_close(out, expected(q, k, v)[0][0], jnp.float32)


def test_cudnn_refuses_what_it_lacks(monkeypatch):
    monkeypatch.setattr(probjax_nn._attention, "_on_gpu", lambda: True)
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs(5, 2, 2, 16, 16, 2, 2, 16, 32))
    with pytest.raises(NotImplementedError, match="impl='cudnn' does not support a value head dim"):
        probjax_nn.attention(q, k, v, impl="cudnn")
    with pytest.raises(NotImplementedError, match="impl='cudnn' does not support key / value of batch 1"):
        probjax_nn.attention(q, k[:1], v[:1, ..., :16], impl="cudnn")
