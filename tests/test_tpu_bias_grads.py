"""The gradient of a dense bias broadcast over the keys or the queries, reduced inside the Mosaic TPU backward
kernels (TPU interpret mode): a `[.., T|1, 1]` bias's by the dQ kernel (dS summed over each row), a
`[.., 1, S]` one's by the dK/dV kernel (dS summed over each column, per query head of the GQA walk or of the
in-place head block), so no `[B, N, T, S]` dS reaches XLA. Against the plain-jnp reference's gradients and
float64 outputs, in the transposed layout (head dim 64, GQA 4:2) and the in-place one (bfloat16, head dim
128, 8 heads)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, numpy_allowed, numpy_attention, random_qkv
from test_tpu_kernels import TPU, check_gradients

from probjax_kernels import flash_attention, flash_attention_reference

B, T, S = 2, 150, 300


def has_full_scores_array(fn, *args) -> bool:
    """Whether the lowered program of `fn` holds a float32 array of [B, N, >= T, >= S] (a dS for XLA to sum).
    Lowered, not a printed jaxpr: a gradient reaches the backward kernels through custom_linear's transpose
    only as the program is lowered. The batch must be B, so that a bias of batch 1 is not taken for dS."""
    text = jax.jit(fn).lower(*args).as_text()
    shapes = re.findall(r"tensor<(\d+)x(\d+)x(\d+)x(\d+)xf32>", text)
    return any(int(b) == B and int(t) >= T and int(s) >= S for b, _, t, s in shapes)


@pytest.mark.parametrize("bias_shape, heads, kv_heads, head_dim, dtype", [
    ((B, 1, 1, S), 4, 2, 64, jnp.float32),  # key padding, transposed, the dK/dV kernel's GQA walk
    ((1, 4, 1, S), 4, 2, 64, jnp.float32),  # per head and key: each query head of the walk its own row
    ((1, 4, T, 1), 4, 2, 64, jnp.float32),  # per head and query: the dQ kernel's row sums
    ((B, 1, 1, S), 8, 2, 128, jnp.bfloat16),  # in place: 8 query heads a program over 2 kv heads
    ((1, 1, 1, 1), 8, 8, 128, jnp.bfloat16),  # one scalar, in place: row sums, then XLA sums T
])
def test_broadcast_bias_gradient_in_the_kernels(bias_shape, heads, kv_heads, head_dim, dtype):
    q, k, v = random_qkv(60, B, T, S, heads, kv_heads, head_dim, dtype)
    bias = normal(61, bias_shape)
    q_lengths, kv_lengths = jnp.array([T, 101]), jnp.array([S, 230])
    kwargs = dict(causal=True, q_lengths=q_lengths, kv_lengths=kv_lengths)

    def kernel(q, k, v, b):
        return flash_attention(q, k, v, bias=b, return_lse=True, config=TPU, **kwargs)

    def reference(q, k, v, b):
        return flash_attention_reference(q, k, v, bias=b, return_lse=True, **kwargs)

    (out, _), _ = check_gradients(kernel, reference, (q, k, v, bias), dtype)
    allowed = numpy_allowed(B, T, S, causal=True, q_lengths=np.asarray(q_lengths),
                            kv_lengths=np.asarray(kv_lengths))
    expected, _ = numpy_attention(q, k, v, allowed=allowed, bias=bias)
    assert_close(out, expected, dtype, "out")
    bias_grad = jax.grad(lambda b: jnp.sum(kernel(q, k, v, b)[0].astype(jnp.float32)))
    assert not has_full_scores_array(bias_grad, bias)


def test_a_bias_with_both_axes_still_takes_ds():
    """A [1, N, T, S] bias's gradient is dS itself (summed over the batch): the dQ kernel writes it."""
    q, k, v = random_qkv(62, B, T, S, 4, 2, 64)
    bias = normal(63, (1, 4, T, S))
    grad = jax.grad(lambda b: jnp.sum(flash_attention(q, k, v, bias=b, causal=True, config=TPU)))
    assert has_full_scores_array(grad, bias)
