"""The Mosaic TPU decode kernel's cache views and its masked / unmasked steps (kernels/tpu/decode_layout.py,
kernels/tpu/decode.py), in TPU interpret mode against float64 NumPy attention.

The rows view reads a cache `[.., S, K, D]` as `[.., S * K, D]` (a head's keys strided rows, D > 128 in
lane blocks of 128 whose lanes past D are zeroed); the heads view reads `[.., S, K, D]` blocks. Only the
step(s) that can hold a key some row must not see run the causal / length mask and zero V past the length;
the others run unmasked. Each case puts lengths on both sides of that boundary (a step ending one key before
/ at / after the first new token's position, a length ending mid-page and exactly at a page end, empty
sequences) with NaN in cache slots past a length, so a step wrongly run unmasked fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax_kernels import DecodeConfig, alibi, decode_attention, softcap
from probjax_kernels.tpu.decode_layout import cache_view
from helpers import numpy_attention
from test_decode import check, make_cache, paginate, random_q

TPU = "tpu_interpret"


def reference(q, k, v, lengths, *, causal=True, bias=None, keep=None):
    """float64 decode attention of a dense `[B, S, K, D]` cache (NaN past a length is never read): token t of
    sequence b sits at lengths[b] - T + t; causal: it sees keys up to it, else every key below the length."""
    batch, new_tokens = q.shape[:2]
    capacity = k.shape[1]
    lengths = np.asarray(lengths)
    q_pos = lengths[:, None, None, None] - new_tokens + np.arange(new_tokens)[None, None, :, None]
    kv_pos = np.arange(capacity)[None, None, None, :]
    allowed = kv_pos < lengths[:, None, None, None]
    if causal:
        allowed = allowed & (kv_pos <= q_pos)
    if keep is not None:
        allowed = allowed & keep
    inside = np.arange(capacity)[None, :, None, None] < lengths[:, None, None, None]
    k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (k, v))
    return numpy_attention(q, np.where(inside, k, 0), np.where(inside, v, 0), allowed=allowed, bias=bias)


def poison_past_lengths(x, lengths):
    """The dense cache with NaN in every slot at or past its sequence's length."""
    x = np.array(jnp.asarray(x, jnp.float32))
    for b, length in enumerate(lengths):
        x[b, length:] = np.nan
    return x


@pytest.mark.parametrize(
    "num_kv_heads, head_dim, dtype, rows, width, chunks",
    [(8, 128, jnp.bfloat16, True, 128, 1), (2, 128, jnp.bfloat16, True, 128, 1), (4, 64, jnp.float32, True, 64, 1),
     (1, 256, jnp.bfloat16, True, 128, 2), (8, 192, jnp.float32, True, 128, 2), (3, 128, jnp.bfloat16, True, 128, 1),
     (2, 256, jnp.bfloat16, False, 256, 1), (4, 192, jnp.float32, False, 192, 1), (1, 256, jnp.float32, False, 256, 1)],
)
def test_the_view_is_the_rows_view_unless_only_the_heads_view_is_free(num_kv_heads, head_dim, dtype, rows, width,
                                                                        chunks):
    """The rows view wherever `[.., S * K, D]` is a bitcast of XLA's TPU layout or neither view is (K = 3); the
    heads view for D > 128 with K in {2, 4}, or K = 1 in float32; a float16 cache (converted) always rows
    (16-key tiles)."""
    view = cache_view(num_kv_heads, head_dim, dtype, 16)
    assert (view.rows, view.width, view.chunks, view.padded_dim) == (rows, width, chunks, width * chunks)
    assert cache_view(num_kv_heads, head_dim, jnp.float32, 16, converted=True).rows


def test_an_odd_tile_of_a_16_bit_cache_takes_the_heads_view():
    """Mosaic's strided load over packed bfloat16 rows needs an even tile (a dense cache of 37 keys is one
    block of 37): the heads view then, for K > 1; K = 1 and float32 load without packing."""
    assert not cache_view(2, 128, jnp.bfloat16, 37).rows
    assert cache_view(2, 128, jnp.float32, 37).rows and cache_view(1, 128, jnp.bfloat16, 37).rows


PAGED_CASES = {
    # K, page, block_k, dtype, D, Dv, T, group, lengths (capacity = the longest rounded up to pages)
    "mqa_k1_page64_bf16_t1": (1, 64, 64, jnp.bfloat16, 64, 64, 1, 4, [64, 0, 100, 128, 1]),
    "gqa_k2_page16_f32_t4_boundary": (2, 16, 32, jnp.float32, 32, 16, 4, 4, [35, 0, 34, 32, 36, 67, 4]),
    "gqa_k8_page16_bf16_t2_alibi": (8, 16, 32, jnp.bfloat16, 128, 128, 2, 2, [48, 0, 17, 33, 2]),
    "k8_d192_dv160_f32_lane_blocks": (8, 16, 16, jnp.float32, 192, 160, 1, 1, [31, 0, 16, 9]),
    "k2_d160_heads_view_dv32_rows_view_bf16": (2, 16, 32, jnp.bfloat16, 160, 32, 3, 2, [47, 0, 48, 3]),
}


@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_views_and_unmasked_steps(name):
    """Pages shuffled with spares, a page shared by two sequences, table entries -1 past a sequence's pages and
    NaN past a length in its last page; one split per sequence, so a program accumulates its unmasked steps
    and then the masked last one. The alibi case calls the hook once per query head (it reads slopes[h])."""
    num_kv_heads, page, block_k, dtype, head_dim, value_dim, new_tokens, group, lengths = PAGED_CASES[name]
    lengths = np.array(lengths)
    capacity = -(-lengths.max() // page) * page
    num_heads = num_kv_heads * group
    k, v = make_cache(21, len(lengths), capacity, num_kv_heads, head_dim, value_dim, dtype)
    k_pages, v_pages, tables, k, v = paginate(k, v, lengths, page, seed=22)
    q = random_q(23, len(lengths), new_tokens, num_heads, head_dim, dtype)
    slopes = jnp.linspace(0.1, 0.6, num_heads) if "alibi" in name else None

    @jax.jit
    def run(q, k_pages, v_pages, lengths, tables):
        return decode_attention(q, k_pages, v_pages, kv_lengths=lengths, block_tables=tables, num_splits=1,
                                score_mod=None if slopes is None else alibi(slopes), return_lse=True,
                                config=DecodeConfig(block_k=block_k, backend=TPU))

    out, lse = run(q, jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(lengths),
                   jnp.asarray(tables, jnp.int32))
    bias = None
    if slopes is not None:
        q_pos = lengths[:, None, None, None] - new_tokens + np.arange(new_tokens)[None, None, :, None]
        distance = np.abs(q_pos - np.arange(capacity)[None, None, None, :])
        bias = -np.asarray(slopes, np.float64)[None, :, None, None] * distance
    want_out, want_lse = reference(q, k, v, lengths, bias=bias)
    check(f"tpu views {name}", out, lse, want_out, want_lse, dtype)


def test_dense_not_causal_softcap_and_mask_mod_with_nan_past_lengths():
    """A dense bfloat16 cache of 70 keys, K = 2 (GQA 6:2), T = 3, causal=False (every new token sees all keys
    below the length: the last step is the only masked one), in 32-key blocks (the third block runs past the
    cache), NaN in every slot past a length; a soft cap and a mask_mod on the h / kv_idx columns (applied on
    unmasked steps too); two splits."""
    dtype, group, new_tokens = jnp.bfloat16, 3, 3
    lengths = np.array([70, 0, 64, 3, 33, 32])
    k, v = make_cache(31, len(lengths), 70, 2, 64, 64, dtype)
    k_bad, v_bad = (jnp.asarray(poison_past_lengths(x, lengths), dtype) for x in (k, v))
    q = random_q(32, len(lengths), new_tokens, 2 * group, 64, dtype)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx + h) % 5 != 0

    out, lse = jax.jit(lambda q, k, v, lengths: decode_attention(
        q, k, v, kv_lengths=lengths, causal=False, score_mod=softcap(3.0), mask_mod=mask_mod, num_splits=2,
        return_lse=True, config=DecodeConfig(block_k=32, backend=TPU)))(q, k_bad, v_bad, jnp.asarray(lengths))
    q64, k64 = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k))
    scores = np.einsum("btnd,bsnd->bnts", q64, np.repeat(k64, group, axis=2)) * 64**-0.5
    keep = (np.arange(70)[None, None, None, :] + np.arange(2 * group)[None, :, None, None]) % 5 != 0
    want_out, want_lse = reference(q, k, v, lengths, causal=False, bias=3.0 * np.tanh(scores / 3.0) - scores,
                                   keep=keep)
    check("tpu dense not causal", out, lse, want_out, want_lse, dtype)


def test_dense_bfloat16_cache_shorter_than_a_block_gqa_k2():
    """A dense bfloat16 cache of 37 keys read in blocks of up to 64 keys (one block of 37: the heads view),
    K = 2, T = 2, NaN past the lengths; one split."""
    dtype, lengths = jnp.bfloat16, np.array([37, 2, 0, 20])
    k, v = make_cache(41, len(lengths), 37, 2, 64, 32, dtype)
    k_bad, v_bad = (jnp.asarray(poison_past_lengths(x, lengths), dtype) for x in (k, v))
    q = random_q(42, len(lengths), 2, 4, 64, dtype)
    out, lse = jax.jit(lambda q, k, v, lengths: decode_attention(
        q, k, v, kv_lengths=lengths, return_lse=True, config=DecodeConfig(block_k=64, backend=TPU)))(
        q, k_bad, v_bad, jnp.asarray(lengths))
    want_out, want_lse = reference(q, k, v, lengths)
    check("tpu dense short block", out, lse, want_out, want_lse, dtype)
