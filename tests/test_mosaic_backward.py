"""The Mosaic GPU (Hopper) dQ and dK / dV kernels: numerics in the Mosaic GPU CPU interpreter against `jax.vjp` of the
float32 plain-jnp reference, and CUDA lowering on CPU. As for the forward, the interpreter stages dS (dQ) and P^T / dS^T (dK / dV)
through shared memory and accumulates out of place; the compiled register-fed, in-place dS K matmul is only lowered.
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
from probjax_kernels._mosaic_backward import (
    dkv_smem_bytes,
    mosaic_backward_dkv,
    mosaic_backward_dq,
)


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


@pytest.mark.parametrize(
    "causal, q_seq, kv_seq, q_lengths, kv_lengths, num_kv_heads, block_q",
    [
        (False, 256, 256, [256, 256], [256, 256], 1, 64),  # MQA, group of 4 summed in the kernel
        (True, 256, 256, [200, 256], [77, 256], 2, 64),  # ragged, GQA
        (False, 256, 256, [256, 100], [0, 130], 2, 64),  # batch 0 fully masked: zero grads
        (True, 128, 384, [128, 90], [384, 300], 1, 128),  # T < S: the last KV tile sees no query row
    ],
)
def test_dkv_matches_reference_in_interpreter(causal, q_seq, kv_seq, q_lengths, kv_lengths, num_kv_heads, block_q):
    batch, num_heads, head_dim, dtype = 2, 4, 64, jnp.bfloat16
    q, k, v = random_qkv(2, batch, q_seq, kv_seq, num_heads, num_kv_heads, head_dim, dtype)
    d_out = random_qkv(3, batch, q_seq, q_seq, num_heads, num_heads, head_dim, dtype)[0]
    q_lengths, kv_lengths = jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)
    scale = head_dim**-0.5

    def reference(k, v):
        return flash_attention_reference(
            q.astype(jnp.float32), k, v, causal=causal, scale=scale, q_lengths=q_lengths, kv_lengths=kv_lengths,
            return_lse=True,
        )

    (out, lse), vjp = jax.vjp(reference, k.astype(jnp.float32), v.astype(jnp.float32))
    expected_dk, expected_dv = vjp((d_out.astype(jnp.float32), jnp.zeros_like(lse)))
    dk, dv = mosaic_backward_dkv(
        q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths, scale=scale, causal=causal,
        block_q=block_q, interpret=True,
    )
    assert dk.shape == k.shape and dk.dtype == k.dtype and dv.shape == v.shape and dv.dtype == v.dtype
    # Observed errors sit at the bf16 rounding of the result (about 3e-3); a quarter of the bf16 tolerance.
    assert_close(dk, expected_dk, dtype, "dk", factor=0.25)
    assert_close(dv, expected_dv, dtype, "dv", factor=0.25)
    for b in range(batch):  # keys past kv_lengths (all of them where kv_lengths is 0) get exactly zero
        assert not jnp.any(dk[b, int(kv_lengths[b]):]) and not jnp.any(dv[b, int(kv_lengths[b]):])


@pytest.mark.parametrize(
    "head_dim, causal, block_q, p_in_smem",
    [(64, True, 64, False), (128, False, 64, False), (128, True, 64, False), (128, True, 128, False),
     (128, False, 64, True)],
)
def test_dkv_lowers_for_cuda(head_dim, causal, block_q, p_in_smem):
    batch, seq, num_heads, num_kv_heads = 2, 1024, 8, 2
    q = jax.ShapeDtypeStruct((batch, seq, num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, num_heads, seq), jnp.float32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = functools.partial(
        mosaic_backward_dkv, scale=head_dim**-0.5, causal=causal, block_q=block_q, block_kv=128, p_in_smem=p_in_smem
    )
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(q, kv, kv, q, lse, q, lengths, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_dkv_rejects_what_it_cannot_run():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    lengths = jnp.full((1,), 128, jnp.int32)
    args = (q, kv, kv, q, lse, q, lengths, lengths)
    with pytest.raises(ValueError, match="multiple of 128"):
        mosaic_backward_dkv(*args, scale=0.125, causal=False, block_kv=64)
    with pytest.raises(NotImplementedError, match="float32"):
        mosaic_backward_dkv(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args), scale=0.125,
                            causal=False)
    big = jnp.zeros((1, 128, 1, 256), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="head_dim"):
        mosaic_backward_dkv(big, big, big, big, jnp.zeros((1, 1, 128)), big, lengths, lengths, scale=0.1,
                            causal=False)
    assert dkv_smem_bytes(128, 64, 128, 2) <= 227 * 1024 < dkv_smem_bytes(128, 64, 128, 6)
