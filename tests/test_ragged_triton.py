"""The Pallas Triton ragged paged attention kernel (kernels/triton/ragged.py) in interpret mode, through the
public front-end, against the float64 page-by-page reference of tests/test_ragged.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FakeGPU
from probjax_kernels import RaggedConfig, _backend, alibi, alibi_slopes, ragged_paged_attention
from test_ragged import FP8, assert_matches, expected, make_batch, quantize_np


def interpret(block_q: int) -> RaggedConfig:
    return RaggedConfig(backend="interpret", block_q=block_q)


@pytest.mark.parametrize("block_q", [1, 4])
def test_mixed_batch_with_padding_and_several_items_per_sequence(block_q):
    """Decode rows, a chunk over a cached prefix, a whole prompt, an empty sequence, padding sequences with
    garbage tables and padding rows (exactly 0); GQA 4:2, Dv 32 != D 16; NaN in every unused slot."""
    b = make_batch()
    out = ragged_paged_attention(*b.args(), config=interpret(block_q))
    assert_matches(out, expected(b))
    assert np.all(np.asarray(out)[int(b.cu_q_lens[b.num_seqs]):] == 0)


def test_window_soft_cap_sinks_alibi_and_mask_mod_mha_pages_of_32():
    """Every option at once, pages larger than a step's tile (two tiles a page), one item per chunk."""
    b = make_batch(1, new=(3, 1, 9), lens=(30, 48, 20), pad_seqs=1, pad_tokens=2, heads=(3, 3), dims=(32, 16),
                   page=32, pages_per_seq=2)
    num_heads = b.q.shape[1]
    slopes = np.asarray(alibi_slopes(num_heads), np.float32)
    sinks = np.linspace(-1.0, 2.0, num_heads).astype(np.float32)
    keep_table = np.random.default_rng(5).random((b.kv_lens.shape[0], 64)) < 0.7

    def keep_mod(seq, h, q_idx, kv_idx):
        return jnp.asarray(keep_table)[seq, kv_idx] | (h == 0)

    out = ragged_paged_attention(
        *b.args(), sliding_window=9, soft_cap=0.5, scale=1.5, sinks=jnp.asarray(sinks),
        score_mod=alibi(jnp.asarray(slopes)), mask_mod=keep_mod, config=interpret(4))
    want = expected(b, window=9, soft_cap=0.5, scale=1.5, sinks=sinks, slopes=slopes,
                    keep=lambda i, h, p, keys: keep_table[i, keys] | (h == 0))
    assert_matches(out, want)


def test_a_window_reads_no_page_before_it():
    """With a window, the pages before the first token's window are never read: they are freed (-1) and the
    slots of the one that holds the window's start are NaN before it; a long prompt chunk's unmasked middle
    steps (keys below every row and inside every window) agree with the masked edges."""
    b = make_batch(2, new=(2, 12), lens=(70, 60), pad_seqs=0, pad_tokens=0, pages_per_seq=5)
    b.page_indices[0, :3] = -1  # positions 0..47: before 70 - 2 - 10 + 1 = 59 - ... the window's start
    b.k_pages[b.page_indices[0, 3], :4] = np.nan  # positions 48..51, before the window of the first token
    b.v_pages[b.page_indices[0, 3], :4] = np.nan
    out = ragged_paged_attention(*b.args(), sliding_window=16, config=interpret(8))
    assert_matches(out, expected(b, window=16))


@pytest.mark.parametrize("cache_dtype", [jnp.int8, FP8])
def test_quantized_pages_with_per_head_scales(cache_dtype):
    b = make_batch(3)
    k_scale, v_scale = np.array([0.03, 0.05], np.float32), np.array([0.02, 0.06], np.float32)
    quantized = dataclasses.replace(b, k_pages=quantize_np(np.nan_to_num(b.k_pages), k_scale, cache_dtype),
                                    v_pages=quantize_np(np.nan_to_num(b.v_pages), v_scale, cache_dtype))
    out = ragged_paged_attention(*quantized.args(cache_dtype=cache_dtype), k_scale=k_scale, v_scale=v_scale,
                                 config=interpret(2))
    assert_matches(out, expected(quantized, k_scale=k_scale, v_scale=v_scale))


@pytest.mark.parametrize("dtype, tolerance", [(jnp.bfloat16, 3e-2), (jnp.float16, 4e-3)])
def test_half_precision(dtype, tolerance):
    b = make_batch(4, new=(1, 6), lens=(21, 6), pad_seqs=1, pad_tokens=1, heads=(8, 2), dims=(64, 64))
    rounded = dataclasses.replace(
        b, q=np.asarray(jnp.asarray(b.q, dtype)).astype(np.float64),
        k_pages=np.asarray(jnp.asarray(b.k_pages, dtype)).astype(np.float64),
        v_pages=np.asarray(jnp.asarray(b.v_pages, dtype)).astype(np.float64))
    out = ragged_paged_attention(*b.args(dtype), config=interpret(2))
    assert out.dtype == dtype
    assert_matches(out, expected(rounded), tolerance)


def test_under_jit_with_a_traced_num_seqs_and_the_append():
    """One compiled call for two live counts; new keys and values written before they are attended."""
    b = make_batch(6, new=(2, 3), lens=(9, 20), pad_seqs=1, pad_tokens=1)
    num_tokens, num_kv_heads = b.q.shape[0], b.k_pages.shape[2]
    rng = np.random.default_rng(0)
    new_k = rng.normal(size=(num_tokens, num_kv_heads, b.k_pages.shape[3]))
    new_v = rng.normal(size=(num_tokens, num_kv_heads, b.v_pages.shape[3]))

    @jax.jit
    def step(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, new_k, new_v):
        return ragged_paged_attention(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, new_k=new_k, new_v=new_v,
                                      config=interpret(2))

    q, k_pages, v_pages, kv_lens, tables, cu, _ = b.args()
    for live in (2, 1):
        out, k_after, v_after = step(q, k_pages, v_pages, kv_lens, tables, cu, jnp.int32(live),
                                     jnp.asarray(new_k, jnp.float32), jnp.asarray(new_v, jnp.float32))
        appended = dataclasses.replace(b, k_pages=np.asarray(k_after, np.float64),
                                       v_pages=np.asarray(v_after, np.float64))
        assert_matches(out, expected(appended, num_seqs=live))
        assert np.all(np.asarray(out)[int(b.cu_q_lens[live]):] == 0)


def test_float8_pages_before_sm89_run_the_xla_path_with_a_warning(monkeypatch):
    """Triton casts float8 only from compute capability 8.9 on: on an A100 (8.0) the dispatch warns and the
    call runs the XLA path, with the reference's rows."""
    monkeypatch.setattr(_backend, "target_device", lambda: FakeGPU("8.0", "NVIDIA A100"))
    b = make_batch(8)
    scale = np.array([0.03, 0.05], np.float32)
    quantized = dataclasses.replace(b, k_pages=quantize_np(np.nan_to_num(b.k_pages), scale, FP8),
                                    v_pages=quantize_np(np.nan_to_num(b.v_pages), scale, FP8))
    with pytest.warns(UserWarning, match=r"float8_e4m3fn pages on a GPU of compute capability 8\.0.*XLA path"):
        out = ragged_paged_attention(*quantized.args(cache_dtype=FP8), k_scale=scale, v_scale=scale,
                                     config=RaggedConfig(backend="triton"))
    assert_matches(out, expected(quantized, k_scale=scale, v_scale=scale))


def test_head_dims_that_are_not_powers_of_two():
    """D = 80, Dv = 48: the pages are read in place with the lanes past each head dim masked, GQA 6:2."""
    b = make_batch(9, new=(1, 4), lens=(33, 20), pad_seqs=0, pad_tokens=2, heads=(6, 2), dims=(80, 48))
    assert_matches(ragged_paged_attention(*b.args(), config=interpret(2)), expected(b))


def test_decode_only_one_token_items_gqa_6_2_float16_with_an_empty_sequence():
    b = make_batch(10, new=(1, 1, 0, 1), lens=(40, 3, 9, 17), pad_seqs=1, pad_tokens=1, heads=(6, 2), dims=(32, 32))
    rounded = dataclasses.replace(
        b, q=np.asarray(jnp.asarray(b.q, jnp.float16)).astype(np.float64),
        k_pages=np.asarray(jnp.asarray(b.k_pages, jnp.float16)).astype(np.float64),
        v_pages=np.asarray(jnp.asarray(b.v_pages, jnp.float16)).astype(np.float64))
    out = ragged_paged_attention(*b.args(jnp.float16), config=interpret(1))
    assert_matches(out, expected(rounded), 4e-3)


def test_whole_prompts_only_mqa_block_q_longer_than_the_prompts_and_a_window_mask_mod():
    """MQA (4 heads, 1 KV head), prompts of 3 and 7 tokens in one 16-token item each; the window comes from a
    recognised `sliding_window` mask_mod alone."""
    from probjax_kernels import sliding_window

    b = make_batch(11, new=(3, 7), lens=(3, 7), pad_seqs=0, pad_tokens=0, heads=(4, 1), dims=(16, 16))
    assert_matches(ragged_paged_attention(*b.args(), config=interpret(16)), expected(b))
    out = ragged_paged_attention(*b.args(), mask_mod=sliding_window(2), config=interpret(16))
    assert_matches(out, expected(b, window=3))


def test_an_item_whose_tokens_straddle_a_step_boundary():
    """Tokens at positions 28..39 in one item, steps of 32 keys (interpret mode): the step of keys 0..31 holds
    keys after the first tokens, so it must take the causal mask although it is below the last token."""
    b = make_batch(12, new=(12, 1), lens=(40, 45), pad_seqs=0, pad_tokens=0)
    assert_matches(ragged_paged_attention(*b.args(), config=interpret(16)), expected(b))
    assert_matches(ragged_paged_attention(*b.args(), sliding_window=20, config=interpret(16)),
                   expected(b, window=20))
