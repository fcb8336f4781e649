"""ragged_paged_attention (packed new tokens of many sequences against paged K/V) against a float64 NumPy
reference written here, one sequence, one token and one head at a time from the pages.

The implementation under test is the XLA path (`RaggedConfig(backend="xla")`, the plain-jnp reference, the
default on the CPU); the kernels' own tests compare them with it. One call mixes a decode step, a prompt
chunk, a whole prompt, an empty sequence and padding (sequences from num_seqs on with garbage tables, rows
past cu_q_lens[num_seqs]); pages are shuffled, spare pages and slots past a length hold NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from probjax_kernels import (
    RaggedConfig, alibi, alibi_slopes, and_masks, causal_mask, ragged_paged_attention,
    ragged_paged_attention_reference, sliding_window,
)
from probjax_kernels._dispatch import ragged_plan
from probjax_kernels._ragged_inputs import default_block_q

XLA = RaggedConfig(backend="xla")
FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass
class Batch:
    """One call's arrays as NumPy (q and the pages float64 or quantized), and its sizes."""

    q: np.ndarray
    k_pages: np.ndarray
    v_pages: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: int

    def args(self, dtype=jnp.float32, cache_dtype=None):
        cache_dtype = cache_dtype or dtype
        return (jnp.asarray(self.q, dtype), jnp.asarray(self.k_pages, cache_dtype),
                jnp.asarray(self.v_pages, cache_dtype), jnp.asarray(self.kv_lens), jnp.asarray(self.page_indices),
                jnp.asarray(self.cu_q_lens), self.num_seqs)


def make_batch(seed=0, new=(1, 5, 7, 0), lens=(37, 40, 7, 20), pad_seqs=2, pad_tokens=3, heads=(4, 2),
               dims=(16, 32), page=16, pages_per_seq=3) -> Batch:
    """Live sequences with `new` new tokens and `lens` keys, then `pad_seqs` padding sequences (kv_lens 999,
    page index -7, cu_q_lens entries that go back down) and `pad_tokens` padding rows."""
    rng = np.random.default_rng(seed)
    (num_heads, num_kv_heads), (head_dim, value_dim) = heads, dims
    live, seqs = len(new), len(new) + pad_seqs
    num_tokens = sum(new) + pad_tokens
    num_pages = live * pages_per_seq + 3
    order = rng.permutation(num_pages)
    tables = np.full((seqs, pages_per_seq), -7, np.int32)
    tables[:live] = order[: live * pages_per_seq].reshape(live, pages_per_seq)
    k_pages = np.full((num_pages, page, num_kv_heads, head_dim), np.nan)
    v_pages = np.full((num_pages, page, num_kv_heads, value_dim), np.nan)
    for i, length in enumerate(lens):
        for p in range(-(-length // page)):
            filled = min(page, length - p * page)
            k_pages[tables[i, p], :filled] = rng.normal(size=(filled, num_kv_heads, head_dim))
            v_pages[tables[i, p], :filled] = rng.normal(size=(filled, num_kv_heads, value_dim))
        tables[i, -(-length // page):] = -1  # entries past a sequence's pages may hold anything
    cu = np.concatenate([[0], np.cumsum(new), np.full(pad_seqs, 2)]).astype(np.int32)
    kv_lens = np.concatenate([lens, np.full(pad_seqs, 999)]).astype(np.int32)
    q = rng.normal(size=(num_tokens, num_heads, head_dim))
    return Batch(q, k_pages, v_pages, kv_lens, tables, cu, live)


def expected(b: Batch, *, scale=None, window=None, soft_cap=None, sinks=None, k_scale=1.0, v_scale=1.0,
             slopes=None, keep=None, num_seqs=None) -> np.ndarray:
    """float64 ragged paged attention: token j of sequence i sits at kv_lens[i] - n_i + j and sees the keys
    up to it, read page by page; `keep(i, h, p, keys) -> bool [keys]` is a mask_mod, `slopes` ALiBi."""
    q = np.asarray(b.q, np.float64)
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads, value_dim = b.k_pages.shape[1], b.k_pages.shape[2], b.v_pages.shape[3]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    k_scale, v_scale = (np.broadcast_to(np.asarray(s, np.float64), (num_kv_heads,)) for s in (k_scale, v_scale))
    out = np.zeros((num_tokens, num_heads, value_dim))
    for i in range(b.num_seqs if num_seqs is None else num_seqs):
        start, n, length = int(b.cu_q_lens[i]), int(b.cu_q_lens[i + 1] - b.cu_q_lens[i]), int(b.kv_lens[i])
        if n == 0:
            continue
        pages = [b.page_indices[i, p] for p in range(-(-length // page))]
        k = np.concatenate([np.asarray(b.k_pages[p]).astype(np.float64) for p in pages])[:length] * k_scale[:, None]
        v = np.concatenate([np.asarray(b.v_pages[p]).astype(np.float64) for p in pages])[:length] * v_scale[:, None]
        for j in range(n):
            position = length - n + j
            keys = np.arange(position + 1)
            for h in range(num_heads):
                s = scale * k[: position + 1, h // group] @ q[start + j, h]
                if slopes is not None:
                    s = s - slopes[h] * (position - keys)
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                allow = np.ones(position + 1, bool)
                if window is not None:
                    allow &= position - keys < window
                if keep is not None:
                    allow &= keep(i, h, position, keys)
                logits, values = s[allow], v[: position + 1, h // group][allow]
                top = max(logits.max(initial=-np.inf), -np.inf if sinks is None else sinks[h])
                if not np.isfinite(top):
                    continue
                weights = np.exp(logits - top)
                denominator = weights.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
                out[start + j, h] = weights @ values / denominator
    return out


def assert_matches(actual, want, tolerance=2e-5):
    actual = np.asarray(actual).astype(np.float64)
    assert actual.shape == want.shape
    assert np.isfinite(actual).all()
    assert np.abs(actual - want).max() <= tolerance * max(np.abs(want).max(), 1.0), np.abs(actual - want).max()


def test_mixed_decode_chunk_prompt_empty_and_padding():
    """GQA 4/2, Dv = 32 != D = 16, in float32; padding rows exactly zero; `config=None` on the CPU is the XLA
    path, and the reference itself in float64 matches to rounding."""
    b = make_batch()
    out = ragged_paged_attention(*b.args(), config=XLA)
    want = expected(b)
    assert_matches(out, want)
    live_rows = int(b.cu_q_lens[b.num_seqs])
    assert np.all(np.asarray(out)[live_rows:] == 0)
    assert np.array_equal(np.asarray(ragged_paged_attention(*b.args())), np.asarray(out))
    with jax.enable_x64(True):
        exact = ragged_paged_attention_reference(*b.args(jnp.float64))
        assert exact.dtype == jnp.float64
        assert_matches(exact, want, 1e-12)


@pytest.mark.parametrize("case", ["window", "soft_cap", "sinks", "alibi", "mask_mod", "all"])
def test_features(case):
    b = make_batch(1, new=(3, 1, 9), lens=(30, 48, 20), pad_seqs=1, pad_tokens=2, heads=(6, 3), dims=(32, 16))
    num_heads = b.q.shape[1]
    slopes = np.asarray(alibi_slopes(num_heads), np.float64)
    sinks = np.linspace(-1.0, 2.0, num_heads)
    keep_table = np.random.default_rng(5).random((b.kv_lens.shape[0], 48)) < 0.7

    def keep_mod(seq, h, q_idx, kv_idx):
        return jnp.asarray(keep_table)[seq, kv_idx] | (h == 0)

    options = {
        "window": (dict(sliding_window=5), dict(window=5)),
        "soft_cap": (dict(soft_cap=0.5, scale=1.5), dict(soft_cap=0.5, scale=1.5)),
        "sinks": (dict(sinks=jnp.asarray(sinks, jnp.float32)), dict(sinks=sinks.astype(np.float32))),
        "alibi": (dict(score_mod=alibi(jnp.asarray(slopes, jnp.float32))),
                  dict(slopes=slopes.astype(np.float32))),
        "mask_mod": (dict(mask_mod=keep_mod), dict(keep=lambda i, h, p, keys: keep_table[i, keys] | (h == 0))),
    }
    if case == "all":
        given = {k: v for name in options for k, v in options[name][0].items()}
        want = {k: v for name in options for k, v in options[name][1].items()}
    else:
        given, want = options[case]
    assert_matches(ragged_paged_attention(*b.args(), **given, config=XLA), expected(b, **want))


def test_a_recognised_window_mask_reads_no_page_before_it():
    """`and_masks(causal_mask, sliding_window(w))` narrows the window with `sliding_window`: a sequence whose
    window starts past page 0 may have page 0 freed (-1); without the window that page is read, a
    ValueError."""
    b = make_batch(2, new=(2, 1), lens=(40, 35), pad_seqs=0, pad_tokens=0)
    b.page_indices[0, 0] = -1
    mask = and_masks(causal_mask, sliding_window(6))  # a token sees itself and the 6 before it
    out = ragged_paged_attention(*b.args(), mask_mod=mask, sliding_window=20, config=XLA)
    assert_matches(out, expected(b, window=7))
    with pytest.raises(ValueError, match=r"page_indices\[0, 0\] = -1 is not a page"):
        ragged_paged_attention(*b.args(), sliding_window=30, config=XLA)


def quantize_np(x, scale, dtype):
    y = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[:, None]
    if dtype == jnp.int8:
        return np.clip(np.round(y), -127, 127).astype(np.int8)
    return np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("cache_dtype, per_head", [(jnp.int8, False), (jnp.int8, True), (FP8, False), (FP8, True)])
def test_quantized_cache(cache_dtype, per_head):
    b = make_batch(3)
    num_kv_heads = b.k_pages.shape[2]
    k_scale = np.array([0.03, 0.05], np.float32) if per_head else np.float32(0.04)
    v_scale = np.array([0.02, 0.06], np.float32) if per_head else np.float32(0.03)
    spread = np.broadcast_to(k_scale, (num_kv_heads,)), np.broadcast_to(v_scale, (num_kv_heads,))
    quantized = dataclasses.replace(
        b, k_pages=quantize_np(np.nan_to_num(b.k_pages), spread[0], cache_dtype),
        v_pages=quantize_np(np.nan_to_num(b.v_pages), spread[1], cache_dtype))
    scales = (k_scale, v_scale) if per_head else (float(k_scale), float(v_scale))
    out = ragged_paged_attention(*quantized.args(cache_dtype=cache_dtype), k_scale=scales[0], v_scale=scales[1],
                                 config=XLA)
    assert_matches(out, expected(quantized, k_scale=k_scale, v_scale=v_scale))


def appended_np(b: Batch, new_k, new_v):
    """The pages after writing each live token's key / value at its position (NumPy scatter)."""
    k_pages, v_pages = b.k_pages.copy(), b.v_pages.copy()
    page = k_pages.shape[1]
    for i in range(b.num_seqs):
        start, end, length = int(b.cu_q_lens[i]), int(b.cu_q_lens[i + 1]), int(b.kv_lens[i])
        for j, t in enumerate(range(start, end)):
            position = length - (end - start) + j
            k_pages[b.page_indices[i, position // page], position % page] = new_k[t]
            v_pages[b.page_indices[i, position // page], position % page] = new_v[t]
    return k_pages, v_pages


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.int8, FP8])
def test_append_writes_the_new_tokens_then_attends_them(cache_dtype):
    """The pages after the call are the expected scatter (padding rows write nothing; quantized with the
    scales, the int8 overflow clipped), and the output is the attention over the appended cache."""
    b = make_batch(4)
    rng = np.random.default_rng(9)
    num_tokens, num_kv_heads = b.q.shape[0], b.k_pages.shape[2]
    new_k = rng.normal(size=(num_tokens, num_kv_heads, b.k_pages.shape[3])).astype(np.float32)
    new_v = rng.normal(size=(num_tokens, num_kv_heads, b.v_pages.shape[3])).astype(np.float32)
    new_k[0, 0, 0] = 50.0  # past int8's range at this scale: clipped to 127
    quantized = cache_dtype != jnp.float32
    k_scale, v_scale = np.array([0.03, 0.05], np.float32), np.float32(0.04)
    scales = dict(k_scale=k_scale, v_scale=float(v_scale)) if quantized else {}
    if quantized:
        b = dataclasses.replace(b, k_pages=quantize_np(np.nan_to_num(b.k_pages), k_scale, cache_dtype),
                                v_pages=quantize_np(np.nan_to_num(b.v_pages), np.full(2, v_scale), cache_dtype))
        want_k, want_v = appended_np(b, quantize_np(new_k, k_scale, cache_dtype),
                                     quantize_np(new_v, np.full(2, v_scale), cache_dtype))
    else:
        want_k, want_v = appended_np(b, new_k, new_v)
    out, k_pages, v_pages = ragged_paged_attention(
        *b.args(cache_dtype=cache_dtype), new_k=jnp.asarray(new_k), new_v=jnp.asarray(new_v), **scales, config=XLA)
    assert k_pages.dtype == cache_dtype and v_pages.dtype == cache_dtype
    np.testing.assert_array_equal(np.asarray(k_pages).astype(np.float32), want_k.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(v_pages).astype(np.float32), want_v.astype(np.float32))
    if cache_dtype == jnp.int8:
        assert np.asarray(k_pages)[b.page_indices[0, 36 // 16], 36 % 16, 0, 0] == 127
    appended = dataclasses.replace(b, k_pages=want_k, v_pages=want_v)
    scale_args = dict(k_scale=k_scale, v_scale=v_scale) if quantized else {}
    assert_matches(out, expected(appended, **scale_args))


def test_jit_with_traced_num_seqs_and_tables():
    """Every table traced: num_seqs 2 makes the later sequences padding (zero rows); an out-of-contract
    sequence (kv_lens below its new tokens, a page index past P) gets NaN rows and writes nothing, the
    others are exact."""
    b = make_batch(6)
    q, k_pages, v_pages, kv_lens, tables, cu, _ = b.args()
    new = jnp.ones((q.shape[0], 2, 16), jnp.float32), jnp.ones((q.shape[0], 2, 32), jnp.float32)

    @jax.jit
    def run(kv_lens, tables, cu, num_seqs):
        return ragged_paged_attention(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, new_k=new[0],
                                      new_v=new[1], config=XLA)

    want_pages = appended_np(b, np.ones((q.shape[0], 2, 16)), np.ones((q.shape[0], 2, 32)))
    out, k_after, _ = run(kv_lens, tables, cu, jnp.int32(4))
    assert_matches(out, expected(dataclasses.replace(b, k_pages=want_pages[0], v_pages=want_pages[1])))
    out, _, _ = run(kv_lens, tables, cu, jnp.int32(2))
    two = appended_np(dataclasses.replace(b, num_seqs=2), np.ones((q.shape[0], 2, 16)), np.ones((q.shape[0], 2, 32)))
    assert_matches(out, expected(dataclasses.replace(b, k_pages=two[0], v_pages=two[1]), num_seqs=2))
    assert np.all(np.asarray(out)[int(b.cu_q_lens[2]):] == 0)

    bad_tables = tables.at[1, 2].set(10_000)  # sequence 1 reads its third page
    out, k_after, _ = run(kv_lens.at[2].set(3), bad_tables, cu, jnp.int32(4))  # sequence 2: 7 new tokens > 3
    out = np.asarray(out)
    rows = [range(int(b.cu_q_lens[i]), int(b.cu_q_lens[i + 1])) for i in range(4)]
    assert np.isnan(out[list(rows[1]) + list(rows[2])]).all()
    assert np.isfinite(out[list(rows[0])]).all() and np.all(out[int(b.cu_q_lens[4]):] == 0)
    first = b.page_indices[2, 0]  # sequence 2's first page: nothing written
    np.testing.assert_array_equal(np.asarray(k_after)[first], b.k_pages[first].astype(np.float32))
    out, _, _ = run(kv_lens, tables, cu.at[2].set(0), jnp.int32(4))  # cu_q_lens goes down: every row NaN
    assert np.isnan(np.asarray(out)).all()


def test_hooks_closing_over_traced_arrays_and_low_precision():
    """ALiBi slopes that are a jit argument reach the hook on the XLA path; bfloat16 and float16 calls keep
    their dtype and float32 accumulation."""
    b = make_batch(13, new=(4, 1), lens=(20, 33), pad_seqs=1, pad_tokens=1)
    slopes = np.asarray(alibi_slopes(4))

    @jax.jit
    def run(q, slopes):
        return ragged_paged_attention(q, *b.args()[1:], score_mod=alibi(slopes), config=XLA)

    assert_matches(run(jnp.asarray(b.q, jnp.float32), slopes), expected(b, slopes=slopes))
    for dtype, tolerance in ((jnp.bfloat16, 3e-2), (jnp.float16, 4e-3)):
        rounded = dataclasses.replace(b, q=np.asarray(jnp.asarray(b.q, dtype)).astype(np.float64),
                                      k_pages=np.asarray(jnp.asarray(b.k_pages, dtype)).astype(np.float64),
                                      v_pages=np.asarray(jnp.asarray(b.v_pages, dtype)).astype(np.float64))
        out = ragged_paged_attention(*b.args(dtype), config=XLA)
        assert out.dtype == dtype
        assert_matches(out, expected(rounded), tolerance)


def test_public_face_and_dispatch():
    import probjax_nn

    assert probjax_nn.ragged_paged_attention is ragged_paged_attention
    plan = functools.partial(ragged_plan, inputs=None, score_mod=None, mask_mod=None, block_q=8)
    assert plan(RaggedConfig(backend="xla")) is None and plan(None) is None  # the CPU: XLA
    assert default_block_q(1000, 1) == 64 and default_block_q(1000, 8) == 8 and default_block_q(3, 1) == 4
    assert default_block_q(5, 128) == 1
    b = make_batch(7, new=(2,), lens=(5,), pad_seqs=0, pad_tokens=0)
    q, *rest = b.args()
    with pytest.raises(NotImplementedError, match="ragged_paged_attention is forward only"):
        jax.grad(lambda q: ragged_paged_attention(q, *rest).sum())(q)
    empty = ragged_paged_attention(q[:0], *rest[:4], jnp.zeros(2, jnp.int32), config=XLA)
    assert empty.shape == (0, 4, 32)


@pytest.mark.parametrize("field, value, match", [
    ("block_q", 3, "block_q=3 must be a power of two"), ("num_warps", 0, "num_warps=0 must be a positive int"),
    ("backend", "mosaic", "backend='mosaic' must be"),
])
def test_config_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        RaggedConfig(**{field: value})


def _bad(b: Batch, **changes):
    """The arguments of a small valid call (live sequences only) with `changes` applied."""
    q, k_pages, v_pages, kv_lens, tables, cu, num_seqs = b.args()
    args = dict(q=q, k_pages=k_pages, v_pages=v_pages, kv_lens=kv_lens, page_indices=tables, cu_q_lens=cu,
                num_seqs=num_seqs)
    return {**args, **changes}


ERRORS = [
    (lambda a: dict(q=a["q"][0]), ValueError, r"q must have rank 3 \(\[num_tokens, N, D\]"),
    (lambda a: dict(v_pages=a["v_pages"][:-1]), ValueError, "k_pages and v_pages must share P, page_size and K"),
    (lambda a: dict(k_pages=a["k_pages"][..., :8]), ValueError, "k_pages must have q's head dim D=16"),
    (lambda a: dict(k_pages=a["k_pages"][:, :8], v_pages=a["v_pages"][:, :8]), ValueError,
     "page_size .* must be a power of two >= 16, got 8"),
    (lambda a: dict(q=a["q"][:, :3]), ValueError, r"query heads N=3 \(q.shape\[1\]\) must be a multiple of the "
     r"key/value heads K=2"),
    (lambda a: dict(q=a["q"].astype(jnp.float16)), TypeError, "k_pages and v_pages must have q's dtype float16"),
    (lambda a: dict(q=a["q"].astype(jnp.int32)), TypeError, "q must have dtype bfloat16, float16, float32"),
    (lambda a: dict(v_pages=a["v_pages"].astype(jnp.int8)), TypeError, "must share one dtype, got float32 and int8"),
    (lambda a: dict(page_indices=a["page_indices"][0]), ValueError, r"page_indices must have shape "
     r"\[S, pages_per_seq\] = \[3, >= 1\]"),
    (lambda a: dict(page_indices=a["page_indices"].astype(jnp.float32)), TypeError,
     "page_indices must be an int array"),
    (lambda a: dict(cu_q_lens=a["cu_q_lens"][:-1]), ValueError, r"cu_q_lens must have shape \[S \+ 1\] = \[4\]"),
    (lambda a: dict(kv_lens=a["kv_lens"].astype(jnp.float32)), TypeError, "kv_lens must be an int array"),
    (lambda a: dict(cu_q_lens=a["cu_q_lens"].at[0].set(1)), ValueError, "cu_q_lens must start at 0"),
    (lambda a: dict(cu_q_lens=a["cu_q_lens"].at[2].set(0)), ValueError, "cu_q_lens must .* be non-decreasing"),
    (lambda a: dict(cu_q_lens=a["cu_q_lens"].at[3].set(99)), ValueError, "end them at most at num_tokens = 11"),
    (lambda a: dict(kv_lens=a["kv_lens"].at[1].set(3)), ValueError,
     r"kv_lens\[1\] = 3 must lie in \[n_1, pages_per_seq \* page_size\] = \[5, 48\]"),
    (lambda a: dict(kv_lens=a["kv_lens"].at[2].set(49)), ValueError, r"kv_lens\[2\] = 49 must lie in"),
    (lambda a: dict(page_indices=a["page_indices"].at[1, 1].set(99)), ValueError,
     r"page_indices\[1, 1\] = 99 is not a page \(k_pages has P=12 pages"),
    (lambda a: dict(num_seqs=4), ValueError, r"num_seqs must lie in \[0, S\] = \[0, 3\]"),
    (lambda a: dict(num_seqs=1.0), TypeError, "num_seqs must be None or an int"),
    (lambda a: dict(num_seqs=jnp.ones(1, jnp.int32)), ValueError, "num_seqs must be a scalar"),
    (lambda a: dict(k_scale=0.1, v_scale=0.1), ValueError, "k_scale is only for an int8 / float8_e4m3fn cache"),
    (lambda a: dict(k_pages=a["k_pages"].astype(jnp.int8), v_pages=a["v_pages"].astype(jnp.int8)), ValueError,
     r"k_scale is required for a quantized \(int8\) cache"),
    (lambda a: dict(k_pages=a["k_pages"].astype(FP8), v_pages=a["v_pages"].astype(FP8), k_scale=jnp.ones(3),
                    v_scale=1.0), ValueError,
     r"k_scale must be a scalar or have shape \[2\] \(one per KV head\), got shape \[3\]"),
    (lambda a: dict(k_pages=a["k_pages"].astype(FP8), v_pages=a["v_pages"].astype(FP8), k_scale=1.0,
                    v_scale=jnp.ones(2, jnp.int32)), TypeError, "v_scale must be a float array"),
    (lambda a: dict(k_pages=a["k_pages"].astype(FP8), v_pages=a["v_pages"].astype(FP8), k_scale=1.0,
                    v_scale=jnp.array([0.5, 0.0])), ValueError,
     r"v_scale must be positive and finite .* got \[0.5, 0.0\]"),
    (lambda a: dict(sinks=jnp.zeros(3)), ValueError, r"sinks must have shape \[4\]"),
    (lambda a: dict(sinks=jnp.zeros(4, jnp.int32)), TypeError, "sinks must be a float array"),
    (lambda a: dict(new_k=jnp.zeros((11, 2, 16))), ValueError, "new_k and new_v must be given together"),
    (lambda a: dict(new_k=jnp.zeros((11, 2, 16)), new_v=jnp.zeros((11, 2, 16))), ValueError,
     r"new_v must have shape \[num_tokens, K, Dv\] = \[11, 2, 32\]"),
    (lambda a: dict(new_k=jnp.zeros((11, 2, 16), jnp.float16), new_v=jnp.zeros((11, 2, 32))), TypeError,
     "new_k must have q's dtype float32"),
    (lambda a: dict(sliding_window=0), ValueError, "sliding_window must be None or a positive int"),
    (lambda a: dict(sliding_window=2.5), ValueError, "sliding_window must be None or a positive int"),
    (lambda a: dict(soft_cap=-1.0), ValueError, "soft_cap must be a positive, finite float"),
    (lambda a: dict(soft_cap="big"), TypeError, "soft_cap must be a Python float"),
    (lambda a: dict(scale=float("nan")), ValueError, "scale must be finite"),
    (lambda a: dict(score_mod=3), TypeError, "score_mod must be callable or None"),
    (lambda a: dict(config=XLA.backend), TypeError, "config must be a RaggedConfig or None, got str"),
    (lambda a: dict(score_mod=lambda s, b, h, q, kv: s.sum()), TypeError, "score_mod must return float32"),
]


@pytest.mark.parametrize("change, error, match", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors_name_the_argument(change, error, match):
    b = make_batch(8, new=(1, 5, 3), lens=(17, 40, 3), pad_seqs=0, pad_tokens=2)
    args = _bad(b)
    args = {**args, **change(args)}
    for fn in (ragged_paged_attention, ragged_paged_attention_reference):
        if fn is ragged_paged_attention_reference and "score_mod must return" in match:
            continue  # the reference calls hooks on grids as they are written, without tracing them first
        with pytest.raises(error, match=match):
            fn(**args)


def test_the_reference_is_differentiable():
    """The forward-only op's advice holds: the reference's gradient in q (float64) is a central difference's."""
    b = make_batch(11, new=(2, 3), lens=(20, 3), pad_seqs=1, pad_tokens=1)
    weights = np.random.default_rng(12).normal(size=(b.q.shape[0], 4, 32))
    with jax.enable_x64(True):
        q, *rest = b.args(jnp.float64)

        def loss(q):
            out = ragged_paged_attention_reference(q, *rest, sinks=jnp.ones(4, jnp.float32), sliding_window=4)
            return jnp.sum(out * weights)

        grad = np.asarray(jax.jit(jax.grad(loss))(q))
        assert np.isfinite(grad).all() and np.all(grad[-1] == 0)  # the padding row
        step = np.zeros(q.shape)
        for index in [(0, 1, 3), (3, 2, 0), (4, 0, 15)]:
            step[index] = 1e-6
            numeric = (loss(q + step) - loss(q - step)) / 2e-6
            step[index] = 0
            assert abs(numeric - grad[index]) <= 1e-6 * max(1.0, abs(numeric))


def test_append_refuses_two_writes_to_one_slot():
    """Two sequences sharing a page both append at the same position: a ValueError outside jit."""
    b = make_batch(10, new=(1, 1), lens=(5, 5), pad_seqs=0, pad_tokens=0)
    b.page_indices[1, 0] = b.page_indices[0, 0]
    args = _bad(b)
    new = jnp.zeros((2, 2, 16)), jnp.zeros((2, 2, 32))
    with pytest.raises(ValueError, match=r"packed rows \[0, 1\] \(sequences \[0, 1\]\) all write page"):
        ragged_paged_attention(**args, new_k=new[0], new_v=new[1])


@pytest.mark.parametrize("window", [None, 40])
def test_keys_read_by_the_page_walk_against_a_count_from_first_principles(window):
    """`_ragged_schedule.keys_read`: every item reads the whole steps that hold a key one of its rows attends
    (the union of [position - window + 1, position] over its rows), and the live keys are the union over a
    sequence's new tokens, counted here key by key."""
    from probjax_kernels._ragged_schedule import keys_read

    new = [1, 1, 37, 0, 12, 64, 1]
    lens = [300, 17, 100, 50, 12, 200, 64]
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    num_tokens, block_q, step = int(cu[-1]) + 5, 8, 32
    read, live = keys_read(jnp.asarray(cu), jnp.asarray(lens, jnp.int32), jnp.int32(len(new)), num_tokens, block_q,
                           step, window)
    want_read = want_live = 0
    for n, length in zip(new, lens):
        positions = [length - n + j for j in range(n)]
        attended = [set(range(0 if window is None else max(p - window + 1, 0), p + 1)) for p in positions]
        want_live += len(set().union(*attended))
        for i in range(0, n, block_q):  # the items of this sequence
            steps = {key // step for keys in attended[i:i + block_q] for key in keys}
            want_read += (max(steps) - min(steps) + 1) * step
    assert (int(read), int(live)) == (want_read, want_live)
