"""decode_attention (split-KV flash-decoding over dense and paged caches) against a float64 NumPy reference.

Compile time dominates interpret mode, so each case combines several features in one static config:
ragged lengths (0, T, a page boundary +- 1, full), shuffled pages, a page shared by two sequences, unused
table entries and NaN in unused slots, T from 1 to 16, GQA ratios 1, 2, 4, 5, 8 and 16, each hook family,
Dv != D, return_lse and every dtype.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TOLERANCE, assert_close, numpy_attention
from probjax_kernels import (
    DecodeConfig, alibi, and_masks, causal_mask, decode_attention, decode_attention_reference, prefix_lm,
    sliding_window,
)

# Errors of the kernel against float64 (normalised as in helpers.assert_close), kept for the report.
MEASURED: dict[str, float] = {}


def make_cache(seed, batch, capacity, num_kv_heads, head_dim, value_dim, dtype):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(batch, capacity, num_kv_heads, head_dim))
    v = rng.normal(size=(batch, capacity, num_kv_heads, value_dim))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def paginate(k, v, lengths, page, seed):
    """Pages `[P, page, K, D]` (shuffled, with spare pages) and tables of a dense cache. Sequence 1 shares its
    first page with sequence 0 (a common prefix: its dense keys are made equal), table entries past a
    sequence's pages are -1, and slots past a length in an unshared page hold NaN."""
    rng = np.random.default_rng(seed)
    k, v = np.array(k, np.float32), np.array(v, np.float32)
    batch, capacity = k.shape[:2]
    max_pages = capacity // page
    k[1, :page], v[1, :page] = k[0, :page], v[0, :page]
    num_pages = batch * max_pages + 3
    order = rng.permutation(num_pages)
    tables = order[: batch * max_pages].reshape(batch, max_pages)
    tables[1, 0] = tables[0, 0]
    k_pages = np.zeros((num_pages, page, *k.shape[2:]), np.float32)
    v_pages = np.zeros((num_pages, page, *v.shape[2:]), np.float32)
    for b in range(batch):
        for p in range(max_pages):
            k_pages[tables[b, p]] = k[b, p * page:(p + 1) * page]
            v_pages[tables[b, p]] = v[b, p * page:(p + 1) * page]
    for b in range(batch):
        used = -(-int(lengths[b]) // page)
        if b > 1 and 0 < lengths[b] % page:  # never the shared page
            k_pages[tables[b, used - 1], lengths[b] % page:] = np.nan
            v_pages[tables[b, used - 1], lengths[b] % page:] = np.nan
        tables[b, used:] = -1
    return k_pages, v_pages, tables, k, v


def expected(q, k, v, lengths, *, slopes=None, bias=None, window=None, keep=None, scale=None):
    """float64 decode attention: token t of sequence b sits at lengths[b] - T + t and sees keys up to it."""
    batch, new_tokens, num_heads, _ = q.shape
    capacity = k.shape[1]
    lengths = np.asarray(lengths)
    q_pos = lengths[:, None, None, None] - new_tokens + np.arange(new_tokens)[None, None, :, None]
    kv_pos = np.arange(capacity)[None, None, None, :]
    allowed = (kv_pos <= q_pos) & (kv_pos < lengths[:, None, None, None])
    if window is not None:
        allowed &= np.abs(q_pos - kv_pos) <= window
    if keep is not None:
        allowed &= np.asarray(keep)[:, None, None, :]
    total_bias = np.zeros((batch, num_heads, new_tokens, capacity))
    if slopes is not None:
        total_bias -= np.asarray(slopes, np.float64)[None, :, None, None] * np.abs(q_pos - kv_pos)
    if bias is not None:
        total_bias += np.asarray(bias, np.float64)[:, None, None, :]
    v = np.where(np.arange(capacity)[None, :, None, None] < lengths[:, None, None, None], np.nan_to_num(v), 0)
    return numpy_attention(q, np.nan_to_num(k), v, allowed=allowed, bias=total_bias, scale=scale)


def check(name, out, lse, want_out, want_lse, dtype):
    error = float(np.abs(np.asarray(out, np.float64) - want_out).max() / max(np.abs(want_out).max(), 1.0))
    MEASURED[f"{name} {jnp.dtype(dtype).name}"] = error
    assert_close(out, want_out, dtype, name)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse)), name
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=TOLERANCE[jnp.dtype(dtype).type] * 10)
    assert np.all(np.asarray(out)[np.isneginf(want_lse).transpose(0, 2, 1)] == 0), name


def random_q(seed, batch, new_tokens, num_heads, head_dim, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, new_tokens, num_heads, head_dim)), dtype)


def test_paged_ragged_shared_prefix_gqa4_value_dim_alibi_and_window():
    """f32, page 16, T=3, GQA 8:2, D=32 / Dv=16; lengths 0, T, a page boundary +- 1 and full; 2 pages per
    step, 3 splits asked for (2 made: 4 pages hold only 2 steps)."""
    dtype, page, new_tokens = jnp.float32, 16, 3
    lengths = np.array([31, 0, 3, 15, 16, 17, 64])  # sequence 1 shares sequence 0's first page
    k, v = make_cache(0, len(lengths), 64, 2, 32, 16, dtype)
    k_pages, v_pages, tables, k, v = paginate(k, v, lengths, page, seed=1)
    q = random_q(2, len(lengths), new_tokens, 8, 32, dtype)
    slopes = jnp.linspace(0.05, 0.4, 8)
    score_mod, mask_mod = alibi(slopes), sliding_window(20)

    @jax.jit
    def run(q, k_pages, v_pages, lengths, tables):
        return decode_attention(q, k_pages, v_pages, kv_lengths=lengths, block_tables=tables, score_mod=score_mod,
                                mask_mod=mask_mod, num_splits=3, return_lse=True, config=DecodeConfig(block_k=32))

    out, lse = run(q, jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(lengths),
                   jnp.asarray(tables, jnp.int32))
    want_out, want_lse = expected(q, k, v, lengths, slopes=slopes, window=20)
    check("paged", out, lse, want_out, want_lse, dtype)
    ref_out, ref_lse = jax.jit(lambda q, k_pages, v_pages: decode_attention_reference(
        q, k_pages, v_pages, kv_lengths=jnp.asarray(lengths), block_tables=jnp.asarray(tables, jnp.int32),
        score_mod=score_mod, mask_mod=mask_mod, return_lse=True))(q, jnp.asarray(k_pages), jnp.asarray(v_pages))
    check("reference", ref_out, ref_lse, want_out, want_lse, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_paged_half_precision_t16_mha_captured_bias_and_mask(dtype):
    """T=16, N=K=4 (GQA 1), page 32, a score_mod and a mask_mod that close over per-position arrays, default
    splits; float16 reads each page as two 16-key tiles."""
    page, new_tokens, capacity = 32, 16, 96
    lengths = np.array([16, 33, 96])
    k, v = make_cache(3, 3, capacity, 4, 64, 64, dtype)
    k_pages, v_pages, tables, k, v = paginate(k, v, lengths, page, seed=4)
    q = random_q(5, 3, new_tokens, 4, 64, dtype)
    rng = np.random.default_rng(6)
    bias = jnp.asarray(rng.normal(size=(3, capacity)), jnp.float32)
    keep = jnp.asarray(rng.random((3, capacity)) < 0.8) | (jnp.arange(capacity) == 0)[None, :]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[b, kv_idx]

    config = DecodeConfig(block_k=16) if dtype == jnp.float16 else None  # pages read as two tiles
    out, lse = jax.jit(lambda q, kp, vp: decode_attention(
        q, kp, vp, kv_lengths=jnp.asarray(lengths), block_tables=jnp.asarray(tables, jnp.int32),
        score_mod=score_mod, mask_mod=mask_mod, return_lse=True, config=config))(
        q, jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype))
    want_out, want_lse = expected(q, k, v, lengths, bias=bias, keep=np.asarray(keep))
    check("paged hooks", out, lse, want_out, want_lse, dtype)


@pytest.mark.parametrize(
    "dtype, new_tokens, num_heads, num_kv_heads, capacity, lengths, splits, hooks",
    [
        # GQA 8, T=1, a length that is no multiple of 16 (read in place: the last 32-key tile reaches past
        # S = 200, masked), default splits.
        (jnp.float32, 1, 8, 1, 200, [1, 200, 77], None, "mask"),
        # GQA 2, T=5, 4 splits over a 128-key cache in 16-key tiles, a score_mod only.
        (jnp.float16, 5, 6, 3, 128, [0, 5, 100, 128], 4, "score"),
        # GQA 5 (20 rows pad to 32) and GQA 16 x T 16 (256 rows: two row blocks of 128), both hooks.
        (jnp.float32, 4, 10, 2, 64, [4, 40], 2, "both"),
        (jnp.bfloat16, 16, 16, 1, 48, [16, 48], 2, "none"),
    ],
)
def test_dense_cache(dtype, new_tokens, num_heads, num_kv_heads, capacity, lengths, splits, hooks):
    lengths = np.array(lengths)
    k, v = make_cache(7, len(lengths), capacity, num_kv_heads, 16, 32, dtype)
    q = random_q(8, len(lengths), new_tokens, num_heads, 16, dtype)
    slopes = jnp.linspace(0.1, 1.0, num_heads)
    score_mod = alibi(slopes) if hooks in ("score", "both") else None
    mask_mod = and_masks(sliding_window(9)) if hooks in ("mask", "both") else None
    config = DecodeConfig(block_k=16) if splits == 4 else None
    out, lse = jax.jit(lambda q, k, v, lengths: decode_attention(
        q, k, v, kv_lengths=lengths, score_mod=score_mod, mask_mod=mask_mod, num_splits=splits, scale=0.3,
        return_lse=True, config=config))(q, k, v, jnp.asarray(lengths))
    want_out, want_lse = expected(q, k, v, lengths, slopes=slopes if score_mod else None,
                                  window=9 if mask_mod else None, scale=0.3)
    check("dense", out, lse, want_out, want_lse, dtype)


def test_forward_only():
    q, k = jnp.ones((1, 1, 2, 16)), jnp.ones((1, 32, 2, 16))

    def loss(q):
        return jnp.sum(decode_attention(q, k, k, kv_lengths=jnp.array([3])))

    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(loss)(q)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.jvp(loss, (q,), (q,))


def _call(**overrides):
    args = dict(q=jnp.ones((2, 2, 4, 16)), k=jnp.ones((5, 16, 2, 16)), v=jnp.ones((5, 16, 2, 16)),
                kv_lengths=jnp.array([2, 20]), block_tables=jnp.array([[0, 1], [2, 3]], jnp.int32))
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return decode_attention(q, k, v, **args)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(q=jnp.ones((2, 17, 4, 16))), ValueError, "T=17"),
        (dict(k=jnp.ones((5, 24, 2, 16)), v=jnp.ones((5, 24, 2, 16))), ValueError, "page_size"),
        (dict(block_tables=jnp.array([0, 1], jnp.int32)), ValueError, "block_tables"),
        (dict(block_tables=jnp.array([[0.0, 1.0], [2.0, 3.0]])), TypeError, "block_tables"),
        (dict(block_tables=jnp.array([[0, 1], [2, 7]], jnp.int32)), ValueError, r"block_tables\[1, 1\] = 7"),
        (dict(kv_lengths=jnp.array([1, 20])), ValueError, "kv_lengths"),
        (dict(kv_lengths=jnp.array([2, 33])), ValueError, "kv_lengths"),
        (dict(kv_lengths=jnp.array([2])), ValueError, "kv_lengths"),
        (dict(kv_lengths=None), ValueError, "kv_lengths"),
        (dict(q=jnp.ones((2, 2, 4, 16), jnp.bfloat16)), TypeError, "dtype"),
        (dict(q=jnp.ones((2, 2, 3, 16))), ValueError, "multiple"),
        (dict(k=jnp.ones((5, 16, 2, 8))), ValueError, "head dim"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(score_mod=3), TypeError, "score_mod"),
        (dict(mask_mod=lambda b, h, q, kv: q - kv), TypeError, "mask_mod"),
        (dict(config=DecodeConfig(backend="interpret").__dict__), TypeError, "config"),
        (dict(block_tables=None, k=jnp.ones((3, 16, 2, 16)), v=jnp.ones((3, 16, 2, 16))), ValueError, "dense"),
    ],
)
def test_bad_inputs(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


def test_config_checks():
    with pytest.raises(ValueError, match="block_k"):
        DecodeConfig(block_k=24)
    with pytest.raises(ValueError, match="backend"):
        DecodeConfig(backend="mosaic")


def test_out_of_contract_rows_are_nan_under_jit():
    """Issue 30 item 4: under jit a length past the cache re-read the last page, a table entry outside the
    pool was clamped, and under x64 an entry page + 2**32 wrapped to a valid page. Such a sequence's rows are
    NaN now, in the kernel and the reference alike; the other rows are right. Concrete values raise."""
    k, v = make_cache(11, 2, 32, 2, 16, 16, jnp.float32)
    q = random_q(12, 2, 2, 4, 16, jnp.float32)
    spare = jnp.zeros((1, 16, 2, 16))
    k_pages, v_pages = (jnp.concatenate([x.reshape(4, 16, 2, 16), spare]) for x in (k, v))  # P = 5
    tables = np.array([[0, 1], [2, 3]])

    def both(lengths, tables):
        args = dict(kv_lengths=lengths, block_tables=tables, return_lse=True)
        return (decode_attention(q, k_pages, v_pages, **args),
                decode_attention_reference(q, k_pages, v_pages, **args))

    want_out, want_lse = expected(q, k, v, np.array([20, 20]))
    run = jax.jit(both)
    for lengths, row_tables in (([20, 33], [2, 3]), ([20, 1], [2, 3]), ([20, 20], [2, 5]), ([20, 20], [-1, 3])):
        for out, lse in run(jnp.asarray(lengths, jnp.int32), jnp.asarray([tables[0], row_tables], jnp.int32)):
            assert np.isnan(np.asarray(out[1])).all() and np.isnan(np.asarray(lse[1])).all(), (lengths, row_tables)
            check("valid row", out[:1], lse[:1], want_out[:1], want_lse[:1], jnp.float32)
    with jax.enable_x64(True):
        wrapped = np.array([[0, 1], [2, 3 + 2**32]], np.int64)
        for out, lse in jax.jit(both)(jnp.asarray([20, 20], jnp.int64), jnp.asarray(wrapped)):
            assert np.isnan(np.asarray(out[1])).all() and np.isnan(np.asarray(lse[1])).all()
            check("valid row x64", out[:1], lse[:1], want_out[:1], want_lse[:1], jnp.float32)
        with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 4294967299"):
            decode_attention(q, k_pages, v_pages, kv_lengths=jnp.asarray([20, 20]), block_tables=jnp.asarray(wrapped))


def test_not_causal_among_new_tokens_follows_the_mask_mod():
    """Issue 30 item 22: decode was always causal among the new tokens, so `prefix_lm` with new tokens inside
    the prefix differed from flex_attention (1.34); `causal=False` leaves it to the mask_mod, kernel and
    reference alike. Tokens at 16..19 of 20 keys, prefix 18 (the first two see token 17 ahead of them)."""
    k, v = make_cache(13, 1, 32, 1, 16, 16, jnp.float32)
    q = random_q(14, 1, 4, 2, 16, jnp.float32)
    q_pos = np.arange(16, 20)[:, None]
    allowed = (np.arange(20)[None, :] < 18) | (np.arange(20)[None, :] <= q_pos)
    want_out, want_lse = numpy_attention(q, k[:, :20], v[:, :20], allowed=allowed)
    for fn in (decode_attention, decode_attention_reference):
        out, lse = fn(q, k, v, kv_lengths=jnp.array([20]), mask_mod=prefix_lm(18), causal=False, return_lse=True)
        check(f"not causal {fn.__name__}", out, lse, want_out, want_lse, jnp.float32)
    with pytest.raises(TypeError, match="causal"):
        decode_attention(q, k, v, kv_lengths=jnp.array([20]), causal=None)


def test_empty_batch_and_a_cache_shorter_than_the_new_tokens():
    """Issue 30 item 23: B = 0 gives empty outputs (as jax.nn.dot_product_attention) instead of an error, dense
    and paged, kernel and reference; T > capacity says so (it read "lie in [T, capacity] = [8, 4]")."""
    q = jnp.ones((0, 2, 4, 16))
    for fn in (decode_attention, decode_attention_reference):
        out, lse = fn(q, jnp.ones((0, 32, 2, 16)), jnp.ones((0, 32, 2, 8)), kv_lengths=jnp.zeros((0,), jnp.int32),
                      return_lse=True)
        assert out.shape == (0, 2, 4, 8) and out.dtype == jnp.float32 and lse.shape == (0, 4, 2)
        out = fn(q, jnp.ones((3, 16, 2, 16)), jnp.ones((3, 16, 2, 16)), kv_lengths=jnp.zeros((0,), jnp.int32),
                 block_tables=jnp.zeros((0, 2), jnp.int32))
        assert out.shape == (0, 2, 4, 16)
    with pytest.raises(ValueError, match=r"capacity=4 keys per sequence \(S\), fewer than the T=8 new tokens"):
        decode_attention(jnp.ones((1, 8, 2, 16)), jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 2, 16)),
                         kv_lengths=jnp.array([4]))


def _ops_on(jaxpr, shapes) -> list[str]:
    """The primitives (at any depth, through jit / custom_jvp) that take an array of one of `shapes`."""
    names = []
    for eqn in jaxpr.eqns:
        if any(getattr(x.aval, "shape", None) in shapes for x in eqn.invars):
            names.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += _ops_on(sub, shapes)
    return names


def test_caches_of_any_length_and_head_dim_are_read_in_place():
    """Issue 30 item 20: a dense cache whose length is no multiple of 16 or a head dim that is no power of two
    was padded (a copy of the whole cache) on every call. The kernel reads such caches in place now: only
    the kernel (and the custom_jvp around it) takes them, and the answers match float64. Dense S = 20 with
    D = 24 / Dv = 40; paged D = 24 / Dv = 40."""
    lengths = np.array([20, 7])
    k, v = make_cache(15, 2, 20, 1, 24, 40, jnp.float32)
    q = random_q(16, 2, 2, 2, 24, jnp.float32)
    want_out, want_lse = expected(q, k, v, lengths)
    k_pages, v_pages, tables, k32, v32 = paginate(jnp.pad(k, ((0, 0), (0, 12), (0, 0), (0, 0))),
                                                  jnp.pad(v, ((0, 0), (0, 12), (0, 0), (0, 0))), lengths, 16, seed=17)
    # paginate makes sequence 1's first page sequence 0's (a shared prefix): its answer follows those keys.
    want_paged = expected(q, k32, v32, lengths)
    for caches, tabled, want in (((k, v), None, (want_out, want_lse)),
                                 ((jnp.asarray(k_pages), jnp.asarray(v_pages)), jnp.asarray(tables, jnp.int32),
                                  want_paged)):
        def run(q, k, v):
            return decode_attention(q, k, v, kv_lengths=jnp.asarray(lengths), block_tables=tabled, return_lse=True)

        assert set(_ops_on(jax.make_jaxpr(run)(q, *caches).jaxpr, {c.shape for c in caches})) == {
            "custom_jvp_call", "pallas_call"}
        out, lse = jax.jit(run)(q, *caches)
        check("in place", out, lse, *want, jnp.float32)


def test_a_sliding_window_skips_the_keys_before_it():
    """Issue 30 item 21: a window read the whole cache. The splits now start at the step holding the earliest
    new token's first key: the keys before it are NaN here (read, they would poison the sums), and the
    answer equals float64 on the clean cache. T = 2, window 20, 16-key steps, lengths 128 and 50."""
    lengths = np.array([128, 50])
    k, v = make_cache(18, 2, 128, 1, 16, 16, jnp.float32)
    q = random_q(19, 2, 2, 2, 16, jnp.float32)
    want_out, want_lse = expected(q, k, v, lengths, window=20)
    first = (lengths - 2 - 20) // 16 * 16  # the first key of the step the window starts in: 96 and 16
    before = np.arange(128)[None, :, None, None] < first[:, None, None, None]
    poisoned = [jnp.where(before, jnp.nan, x) for x in (k, v)]
    out, lse = jax.jit(lambda q, k, v: decode_attention(
        q, k, v, kv_lengths=jnp.asarray(lengths), mask_mod=and_masks(causal_mask, sliding_window(20)), num_splits=2,
        return_lse=True, config=DecodeConfig(block_k=16)))(q, *poisoned)
    check("window", out, lse, want_out, want_lse, jnp.float32)


def test_mask_lookback_reads_windows_through_and_or():
    from probjax_kernels.flex.mods import mask_lookback, or_masks

    assert mask_lookback(sliding_window(7)) == 7
    assert mask_lookback(and_masks(causal_mask, sliding_window(9), sliding_window(4))) == 4
    assert mask_lookback(or_masks(sliding_window(3), sliding_window(5))) == 5
    assert mask_lookback(or_masks(sliding_window(3), causal_mask)) is None
    assert mask_lookback(causal_mask) is None and mask_lookback(prefix_lm(4)) is None


@pytest.mark.parametrize("kind", ["score_mod", "mask_mod"])
def test_python_control_flow_in_a_decode_hook_names_it(kind):
    """A hook with Python control flow raised NumPy's "truth value of an array is ambiguous" from the decode
    path; it names the hook and what to write instead, as flex_attention does (docs/flex_attention.md)."""
    q, k = jnp.ones((1, 1, 2, 16)), jnp.ones((1, 32, 2, 16))
    hooks = {"score_mod": lambda s, b, h, q_idx, kv_idx: s if q_idx >= kv_idx else 0.0 * s,
             "mask_mod": lambda b, h, q_idx, kv_idx: True if q_idx >= kv_idx else False}
    with pytest.raises(TypeError, match=f"{kind} could not be traced with array arguments.*jnp.where"):
        decode_attention(q, k, k, kv_lengths=jnp.array([5]), **{kind: hooks[kind]})
