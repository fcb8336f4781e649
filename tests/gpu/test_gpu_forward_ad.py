"""Forward mode on an NVIDIA GPU: the tangent kernel (Triton) against jax.jvp of the plain-jnp reference.

Skipped off the GPU; tests/gpu/run_gpu_checks.sh runs it. Tolerances as in test_gpu_flash.py.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import random_qkv
from test_gpu_flash import TOLERANCE, _assert_close, _normal

from probjax_kernels import (
    alibi, causal_mask, create_block_mask, flash_attention, flash_attention_reference, flex_attention,
    flex_attention_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_jvp(dtype, causal):
    q, k, v = random_qkv(0, 2, 700, 900, 8, 2, 128, dtype)
    bias = _normal(1, (1, 8, 700, 900))
    tangents = tuple(_normal(seed, x.shape, x.dtype) for seed, x in zip((2, 3, 4, 5), (q, k, v, bias)))
    lengths = jnp.array([700, 333])

    def run(attention):
        fn = lambda q, k, v, bias: attention(q, k, v, bias=bias, causal=causal, kv_lengths=lengths,  # noqa: E731
                                             return_lse=True)
        return jax.jit(lambda p, t: jax.jvp(fn, p, t))((q, k, v, bias), tangents)

    (out, lse), (d_out, d_lse) = run(flash_attention)
    (e_out, e_lse), (e_d_out, e_d_lse) = run(flash_attention_reference)
    tolerance = TOLERANCE[jnp.dtype(dtype).name]
    _assert_close("out", out, e_out, tolerance)
    _assert_close("d_out", d_out, e_d_out, 2 * tolerance)
    _assert_close("d_lse", jnp.where(jnp.isfinite(e_lse), d_lse, 0), jnp.where(jnp.isfinite(e_lse), e_d_lse, 0),
                  2 * tolerance)


def test_flex_jvp_in_hook_parameters():
    q, k, v = random_qkv(6, 2, 1024, 1024, 8, 8, 64, jnp.bfloat16)
    slopes = jnp.linspace(1.0, 0.01, 8)
    block_mask = create_block_mask(causal_mask, None, None, 1024, 1024)

    def run(attention):
        fn = lambda q, slopes: attention(q, k, v, alibi(slopes), block_mask)  # noqa: E731
        return jax.jit(lambda p, t: jax.jvp(fn, p, t))((q, slopes), (_normal(7, q.shape, q.dtype), jnp.cos(slopes)))

    (out, d_out), (e_out, e_d_out) = run(flex_attention), run(flex_attention_reference)
    _assert_close("out", out, e_out, TOLERANCE["bfloat16"])
    _assert_close("d_out", d_out, e_d_out, 2 * TOLERANCE["bfloat16"])
