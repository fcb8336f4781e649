"""Every kernel variant lowers through Pallas' Triton backend for CUDA, checked on the CPU (no GPU needed).

Catches what interpret mode cannot: unsupported primitives, non-power-of-two in-kernel shapes, indexers.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from probjax_kernels import FlashConfig, flash_attention


def lower_for_cuda(fn, *specs):
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


B, T, S, N, K = 2, 600, 300, 6, 2


@pytest.mark.parametrize("head_dim", [32, 80, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_forward_and_backward_lower(head_dim, dtype):
    config = FlashConfig(backend="triton")

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, config=config).astype(jnp.float32))

    q, kv = spec((B, T, N, head_dim), dtype), spec((B, S, K, head_dim), dtype)
    text = lower_for_cuda(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    for name in ("probjax_flash_forward", "probjax_flash_backward_dq", "probjax_flash_backward_dkv"):
        assert name in text


@pytest.mark.parametrize(
    "bias_shape, mask_shape",
    [((1, N, T, S), (B, 1, 1, S)), ((B, N, T, S), (B, N, T, S)), ((T, S), None), (None, (T, S))],
)
def test_every_option_lowers(bias_shape, mask_shape):
    config = FlashConfig(backend="triton")

    def loss(q, k, v, bias, mask, q_segments, kv_segments, lengths):
        out, lse = flash_attention(
            q, k, v, bias=bias, mask=mask, q_segment_ids=q_segments, kv_segment_ids=kv_segments,
            q_lengths=lengths, kv_lengths=lengths // 2, window=(64, 8), causal=True, return_lse=True,
            config=config,
        )
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    argnums = (0, 1, 2, 3) if bias_shape is not None else (0, 1, 2)
    lower_for_cuda(
        jax.grad(loss, argnums),
        spec((B, T, N, 64), jnp.bfloat16), spec((B, S, K, 64), jnp.bfloat16), spec((B, S, K, 64), jnp.bfloat16),
        None if bias_shape is None else spec(bias_shape, jnp.float32),
        None if mask_shape is None else spec(mask_shape, jnp.bool_),
        spec((B, T), jnp.int32), spec((B, S), jnp.int32), spec((B,), jnp.int32),
    )
