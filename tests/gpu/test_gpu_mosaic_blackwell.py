"""The Mosaic GPU kernels for Blackwell (tcgen05 into tensor memory) compiled on a compute capability 10.x GPU
(B200 / GB200 / B300) against the plain-jnp reference: the forward, the dQ and dK/dV kernels, and
flash_attention with FlashConfig(backend="mosaic") with its gradients.

Skipped off the GPU and on other GPUs; tests/gpu/run_gpu_checks.sh runs it. The CPU suite runs the same kernels
in the Mosaic GPU interpreter (tests/test_mosaic_tcgen05.py, tests/test_mosaic_tcgen05_backward.py).
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import random_qkv
from test_gpu_flash import TOLERANCE, _assert_close, _normal

from probjax_kernels import FlashConfig, flash_attention, flash_attention_reference
from probjax_kernels.mosaic.backward_tcgen05 import tcgen05_backward_dkv, tcgen05_backward_dq
from probjax_kernels.mosaic.forward_tcgen05 import tcgen05_forward


def _is_blackwell() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("10.")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_blackwell(), reason="needs a Blackwell (sm_100) GPU")]
TOL = TOLERANCE["bfloat16"]


@pytest.mark.parametrize("block_kv", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward(causal, head_dim, block_kv):
    q, k, v = random_qkv(0, 2, 1024, 1024, 8, 2, head_dim, jnp.bfloat16)
    q_lengths, kv_lengths = jnp.array([1024, 700]), jnp.array([1024, 333])
    out, lse = jax.jit(lambda q, k, v: tcgen05_forward(
        q, k, v, q_lengths, kv_lengths, scale=head_dim**-0.5, causal=causal, block_kv=block_kv))(q, k, v)
    expected, expected_lse = flash_attention_reference(q, k, v, causal=causal, q_lengths=q_lengths,
                                                       kv_lengths=kv_lengths, return_lse=True)
    _assert_close("out", out, expected, TOL)
    _assert_close("lse", lse, expected_lse, TOL)


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(256, 0)), dict()], ids=["causal", "window", "full"])
def test_flash_attention_with_the_mosaic_backend(kwargs):
    q, k, v = random_qkv(1, 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    cotangent = _normal(2, q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

    mosaic = lambda q, k, v: flash_attention(q, k, v, config=FlashConfig(backend="mosaic"), **kwargs)  # noqa: E731
    assert "probjax_mosaic_forward_tcgen05" in str(jax.make_jaxpr(mosaic)(q, k, v))
    assert "probjax_mosaic_backward_dkv_tcgen05" in str(jax.make_jaxpr(jax.grad(loss(mosaic), (0, 1, 2)))(q, k, v))
    reference = lambda q, k, v: flash_attention_reference(q, k, v, **kwargs)  # noqa: E731
    _assert_close("out", jax.jit(mosaic)(q, k, v), reference(q, k, v), TOL)
    grads = jax.jit(jax.grad(loss(mosaic), (0, 1, 2)))(q, k, v)
    expected = jax.grad(loss(reference), (0, 1, 2))(q, k, v)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        _assert_close(name, got, want, TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_kernels(causal, head_dim):
    """dQ and dK/dV of ragged GQA against the reference's vjp (the forward's out and lse from the reference)."""
    q, k, v = random_qkv(3, 2, 1024, 1024, 8, 2, head_dim, jnp.bfloat16)
    d_out = _normal(4, q.shape).astype(jnp.bfloat16)
    q_lengths, kv_lengths = jnp.array([1024, 700]), jnp.array([1024, 333])

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                         return_lse=True)

    (out, lse), vjp = jax.vjp(reference, q, k, v)
    expected = vjp((d_out, jnp.zeros_like(lse)))
    args = (q, k, v, out, lse, d_out, q_lengths, kv_lengths)
    options = dict(scale=head_dim**-0.5, causal=causal)
    dq = jax.jit(lambda *a: tcgen05_backward_dq(*a, **options))(*args)
    dk, dv = jax.jit(lambda *a: tcgen05_backward_dkv(*a, **options))(*args)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected, strict=True):
        _assert_close(name, got, want, TOL)
