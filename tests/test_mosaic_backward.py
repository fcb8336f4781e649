"""The Mosaic GPU (Hopper) dQ kernel: numerics in the Mosaic GPU CPU interpreter against `jax.vjp` of the
float32 plain-jnp reference, and CUDA lowering on CPU. As for the forward, the interpreter stages dS through
shared memory and accumulates out of place; the compiled register-fed, in-place dS K matmul is only lowered.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close, random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    reset_gpu_interpret_mode_state,
)
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from probjax_kernels import flash_attention_reference
from probjax_kernels._mosaic_backward import mosaic_backward_dq


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize(
    "causal, q_lengths, kv_lengths, num_kv_heads",
    [(False, [256, 256], [256, 256], 1), (True, [200, 256], [77, 256], 2), (False, [256, 100], [0, 130], 2)],
)
def test_dq_matches_reference_in_interpreter(causal, q_lengths, kv_lengths, num_kv_heads):
    batch, seq, num_heads, head_dim, dtype = 2, 256, 2, 64, jnp.bfloat16
    q, k, v = random_qkv(0, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    d_out = random_qkv(1, batch, seq, seq, num_heads, num_heads, head_dim, dtype)[0]
    q_lengths, kv_lengths = jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)
    scale = head_dim**-0.5

    def reference(q):
        return flash_attention_reference(
            q, k.astype(jnp.float32), v.astype(jnp.float32), causal=causal, scale=scale, q_lengths=q_lengths,
            kv_lengths=kv_lengths, return_lse=True,
        )

    (out, lse), vjp = jax.vjp(reference, q.astype(jnp.float32))
    (expected,) = vjp((d_out.astype(jnp.float32), jnp.zeros_like(lse)))
    dq = mosaic_backward_dq(
        q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths, scale=scale, causal=causal, interpret=True,
    )
    assert dq.shape == q.shape and dq.dtype == q.dtype
    assert_close(dq, expected, dtype, "dq")


@pytest.mark.parametrize("head_dim, causal", [(64, True), (128, False), (128, True)])
def test_dq_lowers_for_cuda(head_dim, causal):
    batch, seq, num_heads, num_kv_heads = 2, 1024, 8, 2
    q = jax.ShapeDtypeStruct((batch, seq, num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, num_heads, seq), jnp.float32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = functools.partial(mosaic_backward_dq, scale=head_dim**-0.5, causal=causal, block_q=128, block_kv=64)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(q, kv, kv, q, lse, q, lengths, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
