"""The decode kernel (Pallas Triton) on an NVIDIA GPU against the plain-jnp reference. Skipped off the GPU;
tests/gpu/run_gpu_checks.sh runs this file. Default config (num_splits from the device), dense and paged
caches with shuffled pages, ragged lengths, GQA 8:1 and 32:8, hd 128, hooks with captured arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax_kernels import alibi, decode_attention, decode_attention_reference, sliding_window

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU"),
]

TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("heads, new_tokens", [((8, 1), 1), ((32, 8), 4)])
@pytest.mark.parametrize("page_size", [0, 16, 64])
@pytest.mark.parametrize("hooks", [False, True])
def test_decode_matches_reference(dtype, heads, new_tokens, page_size, hooks):
    (num_heads, num_kv_heads), batch, capacity, head_dim = heads, 5, 4096, 128
    keys = jax.random.split(jax.random.key(page_size + new_tokens), 4)
    q = jax.random.normal(keys[0], (batch, new_tokens, num_heads, head_dim), jnp.float32).astype(dtype)
    lengths = jnp.array([new_tokens, 1000, 1024, 1025, capacity], jnp.int32)
    tables = None
    if page_size:
        pages = capacity // page_size
        shape = (batch * pages, page_size, num_kv_heads, head_dim)
        tables = jax.random.permutation(keys[3], batch * pages).astype(jnp.int32).reshape(batch, pages)
    else:
        shape = (batch, capacity, num_kv_heads, head_dim)
    k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys[1:3])
    hook_args = dict(score_mod=alibi(jnp.linspace(0.01, 0.1, num_heads)), mask_mod=sliding_window(700)) if hooks else {}

    def run(fn):
        return jax.jit(lambda q, k, v, n, t: fn(q, k, v, kv_lengths=n, block_tables=t, return_lse=True, **hook_args))(
            q, k, v, lengths, tables)

    out, lse = run(decode_attention)
    want_out, want_lse = run(lambda q, k, v, **kw: decode_attention_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **kw))
    out, want_out = np.asarray(out, np.float32), np.asarray(want_out, np.float32)
    error = np.abs(out - want_out).max() / max(np.abs(want_out).max(), 1.0)
    assert error <= TOLERANCE[dtype], error
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=10 * TOLERANCE[dtype])
