"""The Mosaic GPU backward for Blackwell (sm_100a: tcgen05 MMAs into tensor memory): the dQ and dK / dV kernels
in the Mosaic GPU CPU interpreter against float64 NumPy gradients, their argument checks, and the dispatch of
backend "mosaic" on a Blackwell device.

The interpreter runs the kernels as they are compiled: both warpgroups, TMA, the tensor-core barriers, tcgen05
MMAs from shared memory (dK/dV's with transposed left operands) into tensor memory and its chunked loads.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FakeGPU,
    assert_close,
    normal,
    numpy_allowed,
    numpy_attention,
    numpy_attention_vjp,
    random_qkv,
    to_float32,
)
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

from probjax_kernels import FlashConfig, _backend, flash_attention
from probjax_kernels.mosaic import glue as mosaic_glue
from probjax_kernels.mosaic.backward_tcgen05 import (
    dkv_smem_bytes,
    dkv_stages,
    tcgen05_backward_dkv,
    tcgen05_backward_dq,
)
from probjax_kernels.mosaic.common import SMEM_BYTES


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # After an error inside the interpreter its global state must be reset before the next kernel runs.
    yield
    reset_gpu_interpret_mode_state()


CASES = {
    # name: (B, T, S, N, K, D, Dv, dtype, causal, window, q_lengths, kv_lengths, dQ's block_kv)
    # MQA (both query heads summed into one dK / dV), ragged on both sides, a key tile past kv_lengths.
    "dense_mqa_ragged": (1, 256, 384, 2, 1, 64, 64, jnp.bfloat16, False, (None, None), [200], [226], 64),
    # GQA 2:1 per batch, batch 0 without keys (zero gradients), rows past q_lengths; the K / V ring wraps.
    "causal_gqa_ragged_empty": (2, 256, 256, 4, 2, 64, 64, jnp.float16, True, (None, None), [256, 190], [0, 77],
                                64),
    # Head dim 128 (one Q / dO slot in dK/dV), v's head dim 64, a causal sliding window, dQ on 128-key steps.
    "head_dim_128_sliding_value_dim": (1, 256, 256, 2, 1, 128, 64, jnp.bfloat16, True, (100, None), [256], [256],
                                       128),
    # T < S, a two-sided window: query tiles skipped on both edges of a key tile.
    "two_sided_window_t_below_s": (1, 128, 384, 2, 2, 64, 128, jnp.bfloat16, False, (70, 30), [128], [384], 64),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gradients_match_float64_in_the_interpreter(case):
    batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, value_dim, dtype, causal, window, q_lengths, \
        kv_lengths, dq_block_kv = case
    q, k, _ = random_qkv(0, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype)
    v = random_qkv(1, batch, q_len, kv_len, num_heads, num_kv_heads, value_dim, dtype)[2]
    d_out = random_qkv(2, batch, q_len, q_len, num_heads, num_heads, value_dim, dtype)[0]
    scale = head_dim**-0.5
    allowed = numpy_allowed(batch, q_len, kv_len, causal=causal, window=window, q_lengths=q_lengths,
                            kv_lengths=kv_lengths)
    out, lse = numpy_attention(q, k, v, allowed=allowed, scale=scale)
    expected = numpy_attention_vjp(q, k, v, d_out, allowed=allowed, scale=scale)
    # NaN keys from the first 128-key tile past every length on: no step may read them.
    poison_from = -(-max(kv_lengths) // 128) * 128
    k_in, v_in = (x.at[:, poison_from:].set(jnp.nan) for x in (k, v))
    args = (q, k_in, v_in, jnp.asarray(out, dtype), jnp.asarray(lse, jnp.float32), d_out,
            jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32))
    options = dict(scale=scale, causal=causal, window=window, interpret=True)
    dq = jax.jit(functools.partial(tcgen05_backward_dq, block_kv=dq_block_kv, **options))(*args)
    dk, dv = jax.jit(functools.partial(tcgen05_backward_dkv, **options))(*args)
    for name, got, want, like in zip(("dq", "dk", "dv"), (dq, dk, dv), expected, (q, k, v), strict=True):
        assert got.shape == like.shape and got.dtype == dtype, name
        assert_close(got, want, dtype, name)
    if not kv_lengths[0]:  # a sequence without keys: every gradient of it is exactly zero
        assert not np.any(np.asarray(dq[0])) and not np.any(np.asarray(dk[0])) and not np.any(np.asarray(dv[0]))


def test_an_lse_cotangent_enters_dq_and_dkv():
    """d_lse (a loss of the lse too): dS = P (dP - delta + d_lse), against float64."""
    batch, seq, num_heads, head_dim, dtype = 1, 128, 2, 64, jnp.bfloat16
    q, k, v = random_qkv(3, batch, seq, seq, num_heads, 1, head_dim, dtype)
    d_out = random_qkv(4, batch, seq, seq, num_heads, num_heads, head_dim, dtype)[0]
    d_lse = normal(5, (batch, num_heads, seq))
    allowed = numpy_allowed(batch, seq, seq, causal=True)
    out, lse = numpy_attention(q, k, v, allowed=allowed)
    # d lse / d s = p (s the scaled score): the lse cotangent adds P * d_lse to dS.
    q64, k64 = (to_float32(x).astype(np.float64) for x in (q, np.repeat(k, num_heads, axis=2)))
    scale = head_dim**-0.5
    probs = np.where(allowed, np.exp(np.einsum("btnd,bsnd->bnts", q64, k64) * scale - lse[..., None]), 0.0)
    ds = probs * to_float32(d_lse).astype(np.float64)[..., None]
    dq, dk, dv = numpy_attention_vjp(q, k, v, d_out, allowed=allowed)
    dq = dq + scale * np.einsum("bnts,bsnd->btnd", ds, k64)
    dk = dk + scale * np.einsum("bnts,btnd->bsnd", ds, q64).sum(axis=2, keepdims=True)
    args = (q, k, v, jnp.asarray(out, dtype), jnp.asarray(lse, jnp.float32), d_out, jnp.array([seq]), jnp.array([seq]))
    options = dict(scale=head_dim**-0.5, causal=True, interpret=True, d_lse=d_lse)
    got_dq = tcgen05_backward_dq(*args, **options)
    got_dk, got_dv = tcgen05_backward_dkv(*args, **options)
    for name, got, want in (("dq", got_dq, dq), ("dk", got_dk, dk), ("dv", got_dv, dv)):
        assert_close(got, want, dtype, name)


def test_bad_arguments_name_what_they_need():
    q, k, v = random_qkv(0, 1, 128, 128, 2, 1, 64, jnp.bfloat16)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    lengths = jnp.array([128], jnp.int32)
    args = (q, k, v, q, lse, q, lengths, lengths)
    with pytest.raises(ValueError, match="block_kv must be 128"):
        tcgen05_backward_dkv(*args, scale=0.125, causal=False, block_kv=64)
    with pytest.raises(ValueError, match="block_kv must be 64 or 128"):
        tcgen05_backward_dq(*args, scale=0.125, causal=False, block_kv=32)
    with pytest.raises(ValueError, match="d_out must have q's dtype"):
        tcgen05_backward_dq(q, k, v, q, lse, q.astype(jnp.float32), lengths, lengths, scale=0.125, causal=False)
    with pytest.raises(ValueError, match="lse"):
        tcgen05_backward_dkv(q, k, v, q, lse[:, :, :64], q, lengths, lengths, scale=0.125, causal=False)
    with pytest.raises(NotImplementedError, match="head_dim"):
        wide = random_qkv(0, 1, 128, 128, 2, 1, 256, jnp.bfloat16)
        tcgen05_backward_dq(*wide, wide[0], lse, wide[0], lengths, lengths, scale=0.125, causal=False)


def test_the_dkv_ring_has_two_slots_where_they_fit():
    """Two Q / dO slots at head dim 64, one at 128 (two are over the shared memory beside P and dS)."""
    assert dkv_stages(64, 64) == 2 and dkv_smem_bytes(64, 64, 2) <= SMEM_BYTES
    assert dkv_stages(128, 128) == 1 and dkv_smem_bytes(128, 128, 2) > SMEM_BYTES >= dkv_smem_bytes(128, 128, 1)


# ------------------------------------------------------------------------------------------------ the dispatch

B200 = FakeGPU("10.0", "NVIDIA B200")


def test_backend_mosaic_on_blackwell_runs_the_tcgen05_backward(monkeypatch):
    """On a compute capability 10.x device, jax.grad through backend "mosaic" runs the tcgen05 forward, dQ and
    dK/dV kernels (no Triton kernel), for k / v of batch 1 shared by two query batches, GQA and a length that
    leaves S = 200 padded to 256; the gradients match float64."""
    monkeypatch.setattr(_backend, "target_device", lambda: B200)
    calls = []
    for name in ("tcgen05_backward_dq", "tcgen05_backward_dkv"):  # the backward's kernels are picked at lowering
        kernel = getattr(mosaic_glue, name)
        monkeypatch.setattr(mosaic_glue, name, functools.partial(
            lambda kernel, name, *a, **k: calls.append(name) or kernel(*a, **k), kernel, name))
    q, k, v = random_qkv(6, 2, 200, 200, 4, 2, 64, jnp.bfloat16)
    k, v = k[:1], v[:1]
    d_out = normal(7, q.shape).astype(q.dtype)
    fn = functools.partial(flash_attention, causal=True, config=FlashConfig(backend="mosaic_interpret"))

    def grads(q, k, v):
        return jax.vjp(fn, q, k, v)[1](d_out)

    assert set(re.findall(r"probjax_[a-z0-9_]+", str(jax.make_jaxpr(fn)(q, k, v)))) == {
        "probjax_mosaic_forward_tcgen05"}
    got = jax.jit(grads)(q, k, v)
    assert set(calls) == {"tcgen05_backward_dq", "tcgen05_backward_dkv"}
    expected = numpy_attention_vjp(q, k, v, d_out, allowed=numpy_allowed(2, 200, 200, causal=True))
    for name, got_grad, want in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert got_grad.shape == want.shape, name
        assert_close(got_grad, want, jnp.bfloat16, name)
