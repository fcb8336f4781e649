"""Reverse over reverse through the kernels: grad of grad, jacrev of grad and the gradient of a gradient penalty
(loss + ||d loss / d q||^2), against the same derivatives of the plain-jnp references in float64.

The inner gradient runs the backward kernels; the outer one differentiates them through `custom_linear`: in
the cotangents by the kernels themselves, in q, k, v and the hooks' arrays by the chunked XLA attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal, random_qkv, to_float32, TOLERANCE

from probjax_kernels import (
    FlashConfig, causal_mask, create_block_mask, flash_attention, flash_attention_reference, flex_attention,
    flex_attention_reference, relative_bias,
)
from probjax_nn import attention

TILES = FlashConfig(block_q=16, block_k=16, block_q_dq=16, block_k_dq=16, block_q_dkv=16, block_k_dkv=16)


def assert_close64(actual, expected, name: str):
    """Leaf by leaf, float32 results against float64 ones, normalised as in helpers.assert_close."""
    for index, (a, e) in enumerate(zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)):
        a, e = to_float32(a).astype(np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (name, index, a.shape, e.shape)
        assert np.isfinite(a).all(), f"{name}[{index}]: non-finite values"
        error = np.abs(a - e).max() / max(np.abs(e).max(), 1.0)
        assert error <= TOLERANCE[jnp.float32], f"{name}[{index}]: normalised error {error:.3g}"


def in_float64(fn, *args):
    """`jax.jit(fn)(*args)` with x64 on and the float arguments in float64: the reference's derivatives. The
    integer arrays `fn` closes over become int64 there, as x64's own index grids are (strict promotion)."""
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        args64 = [x.astype(jnp.float64) for x in args]
        return jax.tree.map(np.asarray, jax.jit(fn)(*args64))


def loss_of(attention_fn):
    """A scalar loss of the attention output, nonlinear in it (so its second derivative has every term)."""

    def loss(*args):
        out = attention_fn(*args)
        return jnp.sum(jnp.sin(out)) + 0.5 * jnp.sum(out * out)

    return loss


def penalty_of(loss):
    """loss + ||d loss / d (first argument)||^2: a gradient penalty (WGAN-GP, R1) on the queries."""

    def penalty(*args):
        grad_q = jax.grad(loss)(*args)
        return loss(*args) + jnp.sum(grad_q * grad_q)

    return penalty


B, T, S, N, K, D = 2, 24, 40, 4, 2, 16
LENGTHS = {"q_lengths": jnp.array([24, 13]), "kv_lengths": jnp.array([5, 40])}
FLASH_CASES = {
    "causal_lengths_gqa": dict(causal=True, **LENGTHS),
    "mask_segments": dict(
        mask=jnp.arange(S)[None, None, None, :] % 5 != 1,
        q_segment_ids=jnp.array([[0] * 12 + [1] * 12, [0] * 24]),
        kv_segment_ids=jnp.array([[0] * 20 + [1] * 20, [0] * 7 + [1] * 33]),
    ),
    "dropout": {"dropout_rate": 0.25, "dropout_seed": 5, "window": (9, 2)},
}


@pytest.mark.parametrize("case", FLASH_CASES)
def test_gradient_penalty_gradient(case):
    """The gradient in q, k, v and a bias of loss + ||d loss / d q||^2, GQA (4 query heads on 2 KV heads)."""
    kwargs = FLASH_CASES[case]
    q, k, v = random_qkv(1, B, T, S, N, K, D)
    bias = 0.5 * normal(2, (B, 1, T, S))

    def penalty(reference, **extra):
        call = lambda q, k, v, bias: reference(q, k, v, bias=bias, **kwargs, **extra)  # noqa: E731
        return jax.grad(penalty_of(loss_of(call)), (0, 1, 2, 3))

    actual = jax.jit(penalty(flash_attention, config=TILES))(q, k, v, bias)
    expected = in_float64(penalty(flash_attention_reference), q, k, v, bias)
    assert_close64(actual, expected, case)


def test_grad_of_grad_with_lse_and_jacrev_of_grad():
    """grad of a weighted inner gradient in k, with a loss on the lse too (both cotangents of the backward
    kernels move); and jacrev of grad, the full Jacobian of d loss / d v in (q, v), on small shapes."""
    q, k, v = random_qkv(3, 1, 20, 28, 2, 1, 8)
    weights = normal(4, k.shape)
    kv_lengths = jnp.array([25])

    def grad_of_grad(attention_fn, **extra):
        def loss(q, k, v):
            out, lse = attention_fn(q, k, v, causal=True, kv_lengths=kv_lengths, return_lse=True, **extra)
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse))

        def inner(q, k, v):
            return jnp.sum(jax.grad(loss, 1)(q, k, v) * weights.astype(q.dtype))

        return jax.grad(inner, (0, 1, 2))

    actual = jax.jit(grad_of_grad(flash_attention, config=TILES))(q, k, v)
    expected = in_float64(grad_of_grad(flash_attention_reference), q, k, v)
    assert_close64(actual, expected, "grad of grad")

    small_q, small_k, small_v = random_qkv(5, 1, 6, 7, 1, 1, 4)

    def jacrev_of_grad(attention_fn, **extra):
        loss = loss_of(lambda q, k, v: attention_fn(q, k, v, causal=True, **extra))
        return jax.jacrev(jax.grad(loss, 2), (0, 2))

    actual = jax.jit(jacrev_of_grad(flash_attention, config=TILES))(small_q, small_k, small_v)
    expected = in_float64(jacrev_of_grad(flash_attention_reference), small_q, small_k, small_v)
    assert_close64(actual, expected, "jacrev of grad")


FLEX_T = 32


def test_flex_gradient_penalty_in_a_captured_table():
    """A score_mod that closes over a relative-bias table, under a causal BlockMask with GQA: the gradient in
    q, k, v and the table of a penalty on d loss / d q, and jacrev of d loss / d table in the table."""
    q, k, v = random_qkv(6, 1, FLEX_T, FLEX_T, 4, 2, 16)
    table = 0.3 * normal(7, (4, 2 * FLEX_T - 1))
    block_mask = create_block_mask(causal_mask, None, None, FLEX_T, FLEX_T, block_size=16)

    def call(attention_fn):
        return lambda q, k, v, table: attention_fn(q, k, v, relative_bias(table), block_mask, enable_gqa=True)

    def derivatives(attention_fn):
        loss = loss_of(call(attention_fn))
        penalty = jax.grad(penalty_of(loss), (0, 1, 2, 3))
        table_hessian = jax.jacrev(jax.grad(loss, 3), 3)
        return lambda *args: (penalty(*args), table_hessian(*args)[:2, :8, :2, :8])

    actual = jax.jit(derivatives(flex_attention))(q, k, v, table)
    expected = in_float64(derivatives(flex_attention_reference), q, k, v, table)
    assert_close64(actual, expected, "flex")


def test_attention_impl_pallas_gradient_penalty():
    """`probjax_nn.attention(impl="pallas")` under a gradient penalty, against impl "xla" in float64."""
    q, k, v = random_qkv(8, 2, 16, 24, 2, 2, 8)
    bias = 0.5 * normal(9, (2, 2, 16, 24))

    def derivative(impl):
        call = functools.partial(attention, is_causal=True, key_value_seq_lengths=jnp.array([24, 11]), impl=impl)
        return jax.grad(penalty_of(loss_of(lambda q, k, v, bias: call(q, k, v, bias))), (0, 1, 2, 3))

    actual = jax.jit(derivative("pallas"))(q, k, v, bias)
    expected = in_float64(derivative("xla"), q, k, v, bias)
    assert_close64(actual, expected, "attention")


def test_gradient_penalty_memory_is_linear_in_sequence_length():
    """XLA's temp memory for the compiled gradient of a gradient penalty: the kernels store nothing of size
    T x S, and the XLA pass over query chunks holds one [B, N, chunk, S] block, so once the chunk is below T
    (B N T S above 16 M scores) it grows linearly, where dense attention's quadruples with T."""

    def temp_mb(attention_fn, seq_len):
        spec = jax.ShapeDtypeStruct((1, seq_len, 2, 64), jnp.float32)
        loss = loss_of(lambda q, k, v: attention_fn(q, k, v, causal=True))
        compiled = jax.jit(jax.grad(penalty_of(loss), (0, 1, 2))).lower(spec, spec, spec).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    flash = [temp_mb(flash_attention, seq_len) for seq_len in (4096, 8192)]
    dense = [temp_mb(flash_attention_reference, seq_len) for seq_len in (4096, 8192)]
    assert flash[1] / flash[0] < 2.2, flash
    assert dense[1] / dense[0] > 3.5, dense
    assert flash[1] < dense[1] / 4, (flash, dense)
