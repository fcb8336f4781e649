"""The Mosaic GPU forward for Blackwell (sm_100a, tcgen05 MMAs into tensor memory): numerics in the Mosaic GPU
CPU interpreter against a float64 NumPy reference, its argument checks, and its CUDA lowering on the CPU.

The interpreter runs the kernel as it is compiled: both warpgroups, TMA, the tensor-core barriers, tcgen05 MMAs
from shared memory into tensor memory, and O's rescaling through tensor-memory loads and stores.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import (
    FakeGPU,
    assert_close,
    assert_lse_close,
    normal,
    numpy_allowed,
    numpy_attention,
    random_qkv,
)
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

from probjax_kernels import FlashConfig, _backend, flash_attention, flash_attention_reference
from probjax_kernels.mosaic.forward_tcgen05 import tcgen05_forward


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # After an error inside the interpreter its global state must be reset before the next kernel runs.
    yield
    reset_gpu_interpret_mode_state()


CASES = {
    # name: (B, T, S, N, K, D, Dv, dtype, causal, window, q_lengths, kv_lengths, tiles)
    "dense_mqa_ragged_keys": (1, 256, 384, 2, 1, 64, 64, jnp.bfloat16, False, (None, None), [256], [226], {}),
    "causal_ring_wraps": (1, 256, 384, 2, 2, 64, 64, jnp.bfloat16, True, (None, None), [256], [384],
                          {"block_kv": 64}),
    "causal_ragged_empty_rows": (2, 256, 256, 4, 2, 64, 64, jnp.float16, True, (None, None), [200, 256], [0, 77],
                                 {"block_kv": 64, "num_stages": 3}),
    "head_dim_128_sliding": (1, 256, 256, 2, 1, 128, 128, jnp.bfloat16, True, (100, None), [256], [256], {}),
    "two_sided_window_value_dim": (1, 128, 256, 2, 1, 128, 64, jnp.bfloat16, False, (70, 30), [128], [256],
                                   {"block_kv": 64}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_matches_float64_in_the_interpreter(case):
    batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, value_dim, dtype, causal, window, q_lengths, \
        kv_lengths, tiles = case
    q, k, v = random_qkv(0, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype)
    v = random_qkv(1, batch, q_len, kv_len, num_heads, num_kv_heads, value_dim, dtype)[2]
    scale = head_dim**-0.5
    # NaN keys from the first tile past every length on: those tiles must never be loaded.
    block_kv = tiles.get("block_kv", 128)
    poison_from = -(-max(kv_lengths) // block_kv) * block_kv
    k_in, v_in = (x.at[:, poison_from:].set(jnp.nan) for x in (k, v))
    forward = functools.partial(tcgen05_forward, scale=scale, causal=causal, window=window, interpret=True, **tiles)
    out, lse = jax.jit(forward)(q, k_in, v_in, jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32))
    allowed = numpy_allowed(batch, q_len, kv_len, causal=causal, window=window, q_lengths=q_lengths,
                            kv_lengths=kv_lengths)
    expected_out, expected_lse = numpy_attention(q, k, v, allowed=allowed, scale=scale)
    assert out.shape == (batch, q_len, num_heads, value_dim) and out.dtype == q.dtype
    assert lse.shape == (batch, num_heads, q_len) and lse.dtype == jnp.float32
    assert_close(out, expected_out, dtype, "out")
    assert_lse_close(lse, expected_lse)


def test_bad_arguments_name_what_they_need():
    q, k, v = random_qkv(0, 1, 128, 128, 2, 1, 64, jnp.bfloat16)
    lengths = jnp.array([128], jnp.int32)
    call = functools.partial(tcgen05_forward, scale=0.125, causal=False)
    with pytest.raises(ValueError, match="block_kv must be 64 or 128"):
        call(q, k, v, lengths, lengths, block_kv=256)
    with pytest.raises(NotImplementedError, match="head_dim"):
        call(*random_qkv(0, 1, 128, 128, 2, 1, 256, jnp.bfloat16), lengths, lengths)
    with pytest.raises(NotImplementedError, match="float32"):
        call(*(x.astype(jnp.float32) for x in (q, k, v)), lengths, lengths)
    with pytest.raises(ValueError, match="pad T=100"):
        call(q[:, :100], k, v, lengths, lengths)
    with pytest.raises(ValueError, match="scale"):
        tcgen05_forward(q, k, v, lengths, lengths, scale=-1.0, causal=False)


# ------------------------------------------------------------------------------------------------ the dispatch

B200 = FakeGPU("10.0", "NVIDIA B200")
INTERPRET = FlashConfig(backend="mosaic_interpret")


def _kernels(fn, *args) -> set[str]:
    """The names of the Pallas kernels in the forward's jaxpr."""
    return set(re.findall(r"probjax_[a-z0-9_]+", str(jax.make_jaxpr(fn)(*args))))


def test_backend_mosaic_on_blackwell_runs_the_tcgen05_forward(monkeypatch):
    """On a compute capability 10.x device, backend "mosaic" runs the tcgen05 forward for a plain causal call
    with GQA and a length that is no multiple of the tiles; the output matches the reference. (Its gradients
    through the tcgen05 backward: tests/test_mosaic_tcgen05_backward.py.)"""
    monkeypatch.setattr(_backend, "target_device", lambda: B200)
    q, k, v = random_qkv(3, 2, 200, 200, 4, 2, 64, jnp.bfloat16)
    fn = functools.partial(flash_attention, causal=True, config=INTERPRET)
    assert "probjax_mosaic_forward_tcgen05" in _kernels(fn, q, k, v)
    assert "probjax_mosaic_forward" not in _kernels(fn, q, k, v)
    assert_close(jax.jit(fn)(q, k, v), flash_attention_reference(q, k, v, causal=True), jnp.bfloat16, "out")


@pytest.mark.parametrize("kwargs", [dict(window=(100, 20)), dict()], ids=["window", "full"])
def test_windows_and_full_attention_run_the_tcgen05_forward_on_blackwell(kwargs, monkeypatch):
    monkeypatch.setattr(_backend, "target_device", lambda: B200)
    q, k, v = random_qkv(8, 1, 256, 320, 2, 1, 128, jnp.bfloat16)
    fn = functools.partial(flash_attention, config=INTERPRET, **kwargs)
    assert "probjax_mosaic_forward_tcgen05" in _kernels(fn, q, k, v)
    assert_close(jax.jit(fn)(q, k, v), flash_attention_reference(q, k, v, **kwargs), jnp.bfloat16, "out")


def test_features_the_tcgen05_forward_lacks_run_the_triton_kernels_on_blackwell(monkeypatch):
    """float32 inputs or head dim 256 on Blackwell: backend "mosaic" leaves the call to the Triton kernels (as
    on Hopper for what its Mosaic kernels lack), and the answer is the reference's."""
    monkeypatch.setattr(_backend, "target_device", lambda: B200)
    q, k, v = random_qkv(5, 1, 128, 128, 2, 1, 64, jnp.float32)
    bias = normal(6, (1, 2, 128, 128))
    fn = functools.partial(flash_attention, config=INTERPRET, bias=bias)
    found = _kernels(fn, q, k, v)
    assert "probjax_flash_forward" in found and not any(name.startswith("probjax_mosaic") for name in found)
    assert_close(fn(q, k, v), flash_attention_reference(q, k, v, bias=bias), jnp.float32, "out")
    wide = random_qkv(7, 1, 128, 128, 2, 1, 256, jnp.bfloat16)
    assert "probjax_mosaic_forward_tcgen05" not in _kernels(functools.partial(flash_attention, config=INTERPRET),
                                                          *wide)
