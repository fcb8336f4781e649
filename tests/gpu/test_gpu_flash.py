"""The Triton kernel on an NVIDIA GPU against the plain-jnp reference: forward, lse and gradients.

Skipped off the GPU. On the device machine, tests/gpu/run_gpu_checks.sh runs this file. Each case runs the
kernel with its default GPU config (`flash_attention(..., config=None)`) and the reference under `jit`, and
compares the output, lse and the gradients of sum(out * cotangent) w.r.t. q, k, v (and bias).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv

from probjax_kernels import flash_attention, flash_attention_reference
from probjax_kernels.triton import plan as triton_plan
from probjax_nn import attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU"),
]

# Normalised max error, max |actual - expected| / max |expected|, of the output and lse; gradients get
# twice as much (they sum one more sequence axis of rounded products). float32 runs with precision=HIGHEST.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _normal(seed: int, shape, dtype=F32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _assert_close(name: str, actual, expected, tolerance: float):
    actual = np.asarray(jnp.asarray(actual, F32))
    expected = np.asarray(jnp.asarray(expected, F32))
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(actual), finite, err_msg=f"{name}: non-finite pattern differs")
    if not finite.any():
        return
    error = np.abs(actual[finite] - expected[finite]).max() / max(np.abs(expected[finite]).max(), 1e-6)
    assert error <= tolerance, f"{name}: normalised error {error:.3g} > {tolerance:.3g}"


def _outputs_and_grads(kernel, q, k, v, bias, cotangent, **kwargs):
    """Jitted (out, lse, dq, dk, dv, dbias) of `kernel`; dbias is None without a bias."""

    def loss(q, k, v, bias):
        out, lse = kernel(q, k, v, bias=bias, return_lse=True, **kwargs)
        return jnp.sum(out.astype(F32) * cotangent), (out, lse)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (out, lse)), grads = step(q, k, v, bias)
    return (out, lse, *grads)


def check_against_reference(
    dtype, batch, q_len, kv_len, heads, kv_heads, head_dim, *, bias_shape=None, bias_dtype=None, **kwargs
) -> tuple[jax.Array, ...]:
    """Kernel vs reference on random inputs (a bias in `bias_dtype`, by default `dtype`); kwargs go to both.
    Returns the kernel's (out, lse, dq, ...)."""
    q, k, v = random_qkv(0, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    bias = None if bias_shape is None else _normal(3, bias_shape, bias_dtype or dtype)
    cotangent = _normal(4, q.shape)
    actual = _outputs_and_grads(flash_attention, q, k, v, bias, cotangent, **kwargs)
    expected = _outputs_and_grads(flash_attention_reference, q, k, v, bias, cotangent, **kwargs)
    tolerance = TOLERANCE[jnp.dtype(dtype).name]
    for name, got, want, factor in zip(
        ("out", "lse", "dq", "dk", "dv", "dbias"), actual, expected, (1, 1, 2, 2, 2, 2)
    ):
        if want is None:
            continue
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        _assert_close(name, got, want, tolerance * factor)
    return actual


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_dtypes_gqa(dtype, causal):
    check_against_reference(dtype, 2, 600, 600, 8, 2, 64, causal=causal)


@pytest.mark.parametrize(
    "q_len, kv_len, causal",
    [(77, 77, True), (77, 600, False), (600, 1500, False), (1500, 1500, True), (1500, 600, True)],
)
def test_ragged_lengths(q_len, kv_len, causal):
    check_against_reference(BF16, 2, q_len, kv_len, 4, 4, 64, causal=causal)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_head_dims(head_dim, dtype):
    check_against_reference(dtype, 2, 600, 600, 4, 2, head_dim, causal=True)


@pytest.mark.parametrize("head_dim, value_dim, kv_batch", [(192, 128, 2), (64, 32, 1), (128, 256, 1)])
def test_value_head_dims_and_shared_kv(head_dim, value_dim, kv_batch):
    """Dv != D (multi-head latent attention's 192 / 128) and k / v of batch 1 shared by the batch."""
    q = _normal(0, (2, 600, 8, head_dim), BF16)
    k = _normal(1, (kv_batch, 600, 2, head_dim), BF16)
    v = _normal(2, (kv_batch, 600, 2, value_dim), BF16)
    cotangent = _normal(4, (2, 600, 8, value_dim))
    actual = _outputs_and_grads(flash_attention, q, k, v, None, cotangent, causal=True)
    expected = _outputs_and_grads(flash_attention_reference, q, k, v, None, cotangent, causal=True)
    for name, got, want, factor in zip(("out", "lse", "dq", "dk", "dv"), actual, expected, (1, 1, 2, 2, 2)):
        _assert_close(name, got, want, TOLERANCE["bfloat16"] * factor)


@pytest.mark.parametrize(
    "dtype, bias_shape",
    [(BF16, (2, 4, 600, 600)), (BF16, (1, 4, 1, 600)), (BF16, (2, 1, 600, 600)), (F32, (2, 4, 600, 600))],
)
def test_bias_and_its_gradient(dtype, bias_shape):
    check_against_reference(dtype, 2, 600, 600, 4, 2, 64, bias_shape=bias_shape, causal=True)


@pytest.mark.parametrize("bias_dtype", [BF16, F32])
def test_head_dim_256_bias_on_the_split_dkv_grid(bias_dtype):
    """On Hopper, head dim 256 with a bias runs dV and dK in two programs per key tile
    (`triton_plan.retile.dkv_split`, docs/perf-notes.md Version 7f), a grid that never ran on a GPU before."""
    check_against_reference(BF16, 2, 600, 600, 4, 2, 256, bias_shape=(2, 4, 600, 600), bias_dtype=bias_dtype,
                            causal=True)


def _mask(seed: int, shape) -> jax.Array:
    return jax.random.bernoulli(jax.random.key(seed), 0.7, shape)


def _segment_ids(length: int, boundaries: tuple[int, ...]) -> jax.Array:
    """[2, length] ids of packed documents that start at `boundaries` (batch 1 is one document)."""
    ids = jnp.zeros((length,), jnp.int32)
    for start in boundaries:
        ids = ids + (jnp.arange(length) >= start).astype(jnp.int32)
    return jnp.stack([ids, jnp.zeros_like(ids)])


MASKING_CASES = {
    "mask": {"mask": _mask(5, (2, 1, 600, 1500))},
    "mask_per_head": {"mask": _mask(5, (1, 4, 600, 1500)), "causal": True},
    "lengths": {"q_lengths": jnp.array([600, 311], jnp.int32), "kv_lengths": jnp.array([977, 1500], jnp.int32)},
    "segment_ids": {
        "q_segment_ids": _segment_ids(600, (100, 350)),
        "kv_segment_ids": _segment_ids(1500, (90, 700)),
    },
    "window": {"window": (200, 64)},
    "window_causal": {"window": (300, 0), "causal": True},
}


@pytest.mark.parametrize("case", MASKING_CASES)
def test_masking(case):
    check_against_reference(BF16, 2, 600, 1500, 4, 2, 64, **MASKING_CASES[case])


def test_fully_masked_rows_give_zero_output_and_gradients():
    mask = _mask(6, (2, 1, 600, 600)).at[0, :, jnp.array([0, 5, 599]), :].set(False)
    kv_lengths = jnp.array([600, 0], jnp.int32)  # batch 1: every row is empty
    out, lse, dq, *_ = check_against_reference(
        BF16, 2, 600, 600, 4, 2, 64, bias_shape=(2, 4, 600, 600), mask=mask, kv_lengths=kv_lengths, causal=True
    )
    rows = jnp.array([0, 5, 599])
    for name, x in (("out", out), ("dq", dq)):
        assert float(jnp.abs(x[0, rows]).max()) == 0.0, name
        assert float(jnp.abs(x[1]).max()) == 0.0, name
    assert bool(jnp.all(lse[0, :, rows] == -jnp.inf)) and bool(jnp.all(lse[1] == -jnp.inf))


@pytest.mark.parametrize("window", [None, (128, 3)])
@pytest.mark.parametrize("impl", ["auto", "pallas", "xla", "cudnn"])
def test_attention_impls_on_gpu(impl, window):
    """probjax_nn.attention on the GPU: every impl, forward, lse and gradients, against the reference."""
    q, k, v = random_qkv(1, 2, 600, 600, 8, 2, 64, BF16)
    cotangent = _normal(4, q.shape)
    kv_lengths = jnp.array([600, 451], jnp.int32)  # with causal, no query row is empty

    def via_attention(q, k, v, bias, return_lse):
        del bias
        return attention(
            q, k, v, is_causal=True, key_value_seq_lengths=kv_lengths, local_window_size=window,
            return_residual=return_lse, impl=impl,
        )

    def via_reference(q, k, v, bias, return_lse):
        del bias
        out, lse = flash_attention_reference(
            q, k, v, causal=True, kv_lengths=kv_lengths, window=window, return_lse=return_lse
        )
        return out, jnp.swapaxes(lse, 1, 2)

    actual = _outputs_and_grads(via_attention, q, k, v, None, cotangent)
    expected = _outputs_and_grads(via_reference, q, k, v, None, cotangent)
    for name, got, want, factor in zip(("out", "lse", "dq", "dk", "dv"), actual, expected, (1, 1, 2, 2, 2)):
        _assert_close(f"{impl} {name}", got, want, TOLERANCE["bfloat16"] * factor)


def test_auto_runs_the_kernel_under_jit():
    q, k, v = random_qkv(2, 1, 256, 256, 2, 2, 64, BF16)
    text = jax.jit(functools.partial(attention, is_causal=True)).lower(q, k, v).as_text()
    assert "probjax_flash_forward" in text
