"""decode_attention's Mosaic TPU kernel (kernels/tpu/decode.py) in TPU interpret mode (`DecodeConfig(backend=
"tpu_interpret")`: scalar prefetch, SMEM / VMEM refs and the BlockSpec pipeline with TPU semantics, on the CPU)
against the float64 NumPy reference of tests/test_decode.py.

Each case combines several features in one static config (compile time dominates): ragged lengths (0, T, a
page boundary +- 1, full), shuffled pages with spares, a page shared by two sequences, unused table entries
(-1) and NaN past a length, T in {1, 4, 16}, GQA 4:1 and 8:2 and none, a hook that reads a captured array at
h (run once per head of the group), hooks on h / q_idx / kv_idx columns, Dv != D, return_lse, several splits,
several pages per step, a dense cache whose length is no multiple of the block, and bfloat16 / float16 /
float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax_kernels import DecodeConfig, _dispatch, alibi, decode_attention, relative_bias, sliding_window, softcap
from probjax_kernels._decode_inputs import check_decode_inputs
from helpers import normal, numpy_attention
from test_decode import check, expected, make_cache, paginate, random_q

TPU = "tpu_interpret"


def test_paged_ragged_shuffled_shared_t4_gqa_alibi_window_value_dim():
    """f32, page 16, T=4, GQA 8:2, D=32 / Dv=16, 2 pages a step (block_k 32), 3 splits asked for (2 made);
    alibi reads slopes[h]: the kernel calls it once per query head."""
    dtype, page, new_tokens = jnp.float32, 16, 4
    lengths = np.array([31, 0, 4, 15, 17, 64])  # sequence 1 shares sequence 0's first page
    k, v = make_cache(0, len(lengths), 64, 2, 32, 16, dtype)
    k_pages, v_pages, tables, k, v = paginate(k, v, lengths, page, seed=1)
    q = random_q(2, len(lengths), new_tokens, 8, 32, dtype)
    slopes = jnp.linspace(0.05, 0.4, 8)

    @jax.jit
    def run(q, k_pages, v_pages, lengths, tables):
        return decode_attention(q, k_pages, v_pages, kv_lengths=lengths, block_tables=tables,
                                score_mod=alibi(slopes), mask_mod=sliding_window(20), num_splits=3,
                                return_lse=True, config=DecodeConfig(block_k=32, backend=TPU))

    out, lse = run(q, jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(lengths),
                   jnp.asarray(tables, jnp.int32))
    want_out, want_lse = expected(q, k, v, lengths, slopes=slopes, window=20)
    check("tpu paged", out, lse, want_out, want_lse, dtype)


def reference(q, k, v, lengths, *, bias=None, keep=None):
    """float64 decode attention with a `[B, N, T, S]` additive bias and keep mask (tests/helpers)."""
    batch, new_tokens = q.shape[:2]
    capacity = k.shape[1]
    q_pos = lengths[:, None, None, None] - new_tokens + np.arange(new_tokens)[None, None, :, None]
    kv_pos = np.arange(capacity)[None, None, None, :]
    allowed = (kv_pos <= q_pos) & (kv_pos < lengths[:, None, None, None])
    if keep is not None:
        allowed = allowed & keep
    v = np.where(np.arange(capacity)[None, :, None, None] < lengths[:, None, None, None], np.nan_to_num(v), 0)
    return numpy_attention(q, np.nan_to_num(k), v, allowed=allowed, bias=bias)


def test_dense_t1_gqa4_softcap_partial_block():
    """bfloat16 dense cache of 40 keys in 32-key blocks (the last block is partial), T=1, GQA 4:1 (K=1), a
    soft cap (no h: one call on the packed tile), default splits (2 interpreted)."""
    dtype, group = jnp.bfloat16, 4
    lengths = np.array([40, 0, 1, 33])
    k, v = make_cache(3, len(lengths), 40, 1, 64, 64, dtype)
    q = random_q(4, len(lengths), 1, group, 64, dtype)
    out, lse = jax.jit(lambda q, k, v, lengths: decode_attention(
        q, k, v, kv_lengths=lengths, score_mod=softcap(2.0), return_lse=True,
        config=DecodeConfig(backend=TPU)))(q, k, v, jnp.asarray(lengths))
    q64, k64 = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k))
    scores = np.einsum("btnd,bsnd->bnts", q64, np.repeat(k64, group, axis=2)) * 64**-0.5
    want_out, want_lse = reference(q, k, v, lengths, bias=2.0 * np.tanh(scores / 2.0) - scores)
    check("tpu dense softcap", out, lse, want_out, want_lse, dtype)


def test_paged_t16_float16_mha_head_column_mask():
    """float16 (the cache converted to float32 for the kernel), T=16, N=K=2, page 16 and block_k 16 (one page
    a step), one split: up to 3 steps accumulate in one program, and a 1-page sequence skips 2; a mask_mod on
    the h / q_idx / kv_idx columns."""
    dtype, page, new_tokens = jnp.float16, 16, 16
    lengths = np.array([16, 48, 33])
    k, v = make_cache(5, len(lengths), 48, 2, 16, 16, dtype)
    k_pages, v_pages, tables, k, v = paginate(k, v, lengths, page, seed=6)
    q = random_q(7, len(lengths), new_tokens, 2, 16, dtype)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx + h) % 3 != 1) | (kv_idx == q_idx)

    out, lse = jax.jit(lambda q, kp, vp: decode_attention(
        q, kp, vp, kv_lengths=jnp.asarray(lengths), block_tables=jnp.asarray(tables, jnp.int32),
        mask_mod=mask_mod, num_splits=1, return_lse=True, config=DecodeConfig(block_k=16, backend=TPU)))(
        q, jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype))
    kv_pos, heads = np.arange(48)[None, None, None, :], np.arange(2)[None, :, None, None]
    q_pos = lengths[:, None, None, None] - new_tokens + np.arange(new_tokens)[None, None, :, None]
    want_out, want_lse = reference(q, k, v, lengths, keep=((kv_pos + heads) % 3 != 1) | (kv_pos == q_pos))
    check("tpu paged f16 mask", out, lse, want_out, want_lse, dtype)


@pytest.mark.parametrize("which", ["relative_bias", "kv_bias"])
def test_a_hook_mosaic_tpu_cannot_lower_runs_the_xla_path_with_a_warning(which):
    """relative_bias reads table[h, q_idx - kv_idx]: a vector gather with or without a scalar h; so is
    bias[b, kv_idx] in the decode kernel (it holds hook arrays in SMEM only). The call warns, naming the
    hook, and computes on the XLA path: the float64 reference's numbers."""
    q = random_q(11, 2, 3, 4, 16, jnp.float32)
    k, v = make_cache(12, 2, 40, 2, 16, 16, jnp.float32)
    lengths = np.array([9, 40])
    if which == "relative_bias":
        table = normal(13, (4, 79))
        score_mod = relative_bias(table)
        q_pos = lengths[:, None, None, None] - 3 + np.arange(3)[None, None, :, None]
        bias = np.asarray(table)[np.arange(4)[None, :, None, None], np.arange(40)[None, None, None, :] - q_pos + 39]
    else:
        kv_bias = normal(13, (2, 40))
        score_mod = lambda s, b, h, q_idx, kv_idx: s + kv_bias[b, kv_idx]  # noqa: E731
        bias = np.asarray(kv_bias)[:, None, None, :]
    with pytest.warns(UserWarning, match="score_mod cannot run in the Mosaic TPU decode kernel.*XLA path"):
        out, lse = decode_attention(q, k, v, kv_lengths=jnp.asarray(lengths), score_mod=score_mod,
                                    return_lse=True, config=DecodeConfig(backend=TPU))
    want_out, want_lse = reference(q, k, v, lengths, bias=bias)
    check(f"xla path {which}", out, lse, want_out, want_lse, jnp.float32)


def test_the_default_on_a_tpu_is_the_tpu_kernel(monkeypatch):
    """`DecodeConfig()` plans the Mosaic TPU kernel where `default_backend()` says TPU (here faked: no TPU),
    with 128 keys (8 pages of 16) a step and one split; explicit backends are accepted."""
    monkeypatch.setattr(_dispatch, "default_backend", lambda: "tpu")
    inputs = check_decode_inputs(
        jnp.ones((2, 1, 8, 64)), jnp.ones((40, 16, 2, 64)), jnp.ones((40, 16, 2, 64)), kv_lengths=jnp.array([5, 300]),
        block_tables=jnp.zeros((2, 20), jnp.int32), score_mod=None, mask_mod=None, num_splits=None, scale=None,
        return_lse=False)
    plan = _dispatch.decode_plan(inputs, None, None, None, 0).plan
    assert (plan.backend, plan.tiles_per_step, plan.splits, plan.steps, plan.rows) == ("tpu", 8, 1, 3, 8)
    assert DecodeConfig(backend="tpu_interpret", block_k=64).backend == "tpu_interpret"
