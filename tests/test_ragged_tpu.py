"""The Mosaic TPU ragged paged attention kernel (kernels/tpu/ragged.py) in TPU interpret mode (scalar
prefetch, SMEM / VMEM refs, manual DMAs and semaphores with TPU semantics, on the CPU), called through its
kernel contract, against a float64 NumPy reference written here: per sequence, its pages gathered densely,
softmax over the keys each new token may see.

Each case combines several features in one static configuration (compile time dominates): decode rows,
chunked prefill over a cached prefix, whole prompts and empty sequences in one call; several items per
sequence; num_seqs < S with padding tokens (exact zeros); shuffled pages with spares; GQA 8:2 and MHA;
Dv != D; float32 and bfloat16; a sliding window over pages filled with NaN outside it; soft cap; sinks;
int8 / float8_e4m3fn pages with per-head scales; alibi (a hook reading slopes[h]) and a mask_mod on the
h / q_idx / kv_idx columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax_kernels import alibi, relative_bias
from probjax_kernels.decode.attention import trace_decode_hook
from probjax_kernels.tpu.decode import HookNotInKernel
from probjax_kernels._ragged_schedule import ragged_work_items
from probjax_kernels.tpu.ragged import RaggedPlan, _item, _item_layout, ragged_paged_attention_kernel
from helpers import TOLERANCE

PAGE = 16


def make_batch(seed, new_tokens, kv_lens, num_heads, num_kv_heads, head_dim, value_dim, pad_tokens=0,
               spare_pages=3, nan_before=None):
    """Random q, shuffled pages (spares hold NaN), page_indices (-1 past a sequence's pages) and cu_q_lens
    for sequences with `new_tokens[i]` new tokens of `kv_lens[i]`; `pad_tokens` rows of q past the last
    sequence. `nan_before[i]`: sequence i's pages wholly before that position hold NaN."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max(-(-max(kv_lens) // PAGE), 1)
    used = [-(-n // PAGE) for n in kv_lens]
    num_pages = sum(used) + spare_pages
    order = rng.permutation(num_pages)
    k_pages = np.full((num_pages, PAGE, num_kv_heads, head_dim), np.nan)
    v_pages = np.full((num_pages, PAGE, num_kv_heads, value_dim), np.nan)
    tables = np.full((len(kv_lens), pages_per_seq), -1, np.int32)
    taken = 0
    for i, n in enumerate(used):
        for p in range(n):
            page = order[taken]
            taken += 1
            tables[i, p] = page
            if nan_before is None or (p + 1) * PAGE > nan_before[i]:
                k_pages[page] = rng.normal(size=k_pages.shape[1:])
                v_pages[page] = rng.normal(size=v_pages.shape[1:])
    cu = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.normal(size=(int(cu[-1]) + pad_tokens, num_heads, head_dim))
    return q, k_pages, v_pages, tables, cu


def reference(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, *, scale, window=None, soft_cap=None,
              sinks=None, k_scale=None, v_scale=None, bias=None, keep=None):
    """float64 out `[T, N, Dv]`: each sequence's K/V gathered densely from its pages (dequantized), softmax
    over the keys j <= p (p - j < window) that `keep(i, h, p, j)` allows, `bias(i, h, p, j)` added before
    the soft cap, a sink logit per head in the denominator; rows of no sequence are 0."""
    q = np.asarray(q, np.float64)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros((num_tokens, num_heads, v_pages.shape[3]))
    for i in range(num_seqs):
        n, kv_len = cu[i + 1] - cu[i], kv_lens[i]
        if n == 0:
            continue
        k = np.asarray(k_pages, np.float64)[tables[i]].reshape(-1, num_kv_heads, k_pages.shape[3])[:kv_len]
        v = np.asarray(v_pages, np.float64)[tables[i]].reshape(-1, num_kv_heads, v_pages.shape[3])[:kv_len]
        if k_scale is not None:
            k, v = k * k_scale[None, :, None], v * v_scale[None, :, None]
        for t in range(n):
            p = kv_len - n + t
            for h in range(num_heads):
                g = h // group
                j = np.arange(kv_len)
                allowed = j <= p
                if window is not None:
                    allowed &= p - j < window
                if keep is not None:
                    allowed &= np.array([keep(i, h, p, jj) for jj in j], bool)
                js = j[allowed]
                s = scale * k[js, g] @ q[cu[i] + t, h]
                if bias is not None:
                    s = s + np.array([bias(i, h, p, jj) for jj in js])
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                logits = np.concatenate([s, [] if sinks is None else [sinks[h]]])
                if js.size == 0 and sinks is None:
                    continue
                weights = np.exp(logits - logits.max())
                out[cu[i] + t, h] = weights[: js.size] @ v[js, g] / weights.sum()
    return out


def run(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, *, dtype, page_dtype=None, block_q=8, scale=None,
        window=None, soft_cap=None, sinks=None, k_scale=None, v_scale=None, score_mod=None, mask_mod=None,
        pages_per_step=2):
    """The kernel under jit in interpret mode on inputs cast to `dtype` (pages to `page_dtype`)."""
    head_dim = q.shape[2]
    score_hook, score_consts = trace_decode_hook("score_mod", score_mod)
    mask_hook, mask_consts = trace_decode_hook("mask_mod", mask_mod)
    options = dict(scale=scale or head_dim**-0.5, sliding_window=window, soft_cap=soft_cap, score_hook=score_hook,
                   mask_hook=mask_hook, num_score_consts=len(score_consts), block_q=block_q, interpret=True,
                   pages_per_step=pages_per_step)
    as_f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)  # noqa: E731
    fn = jax.jit(lambda *a: ragged_paged_attention_kernel(*a, **options))
    page_dtype = page_dtype or dtype
    arrays = (jnp.asarray(q, dtype), jnp.asarray(k_pages, page_dtype), jnp.asarray(v_pages, page_dtype),
              jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables, jnp.int32), jnp.asarray(cu, jnp.int32))
    others = (as_f32(sinks), as_f32(k_scale), as_f32(v_scale), [*score_consts, *mask_consts])
    if isinstance(num_seqs, int):
        return fn(*arrays, jnp.int32(num_seqs), *others)
    return [fn(*arrays, jnp.int32(n), *others) for n in num_seqs]  # one compile: num_seqs is traced


def as_given(x, dtype):
    """x as the kernel sees it after the cast to `dtype`, in float64 (NaN kept)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


def check(name, out, want, dtype, real_rows):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert out.shape == want.shape, (name, out.shape, want.shape)
    assert np.isfinite(out).all(), f"{name}: non-finite values"
    assert np.all(out[real_rows:] == 0), f"{name}: padding rows are not exactly zero"
    error = np.abs(out - want).max() / max(np.abs(want).max(), 1.0)
    assert error <= TOLERANCE[jnp.dtype(dtype).type], f"{name}: normalised error {error:.3g}"


def test_mixed_batch_gqa_value_dim_padding_f32():
    """float32, GQA 8:2, D=32 / Dv=16, block_q 8, 2 pages a step: a decode row at a page boundary + 1, a
    chunked prefill of 11 over a 25-token prefix (2 items), a whole prompt of 20 (3 items), an empty
    sequence (no new token), a decode row at 1 token, then 2 sequences past num_seqs = 5 and 5 padding rows;
    the same call with num_seqs 7 (every sequence) and 0 (all rows padding: zeros)."""
    new_tokens, kv_lens = [1, 11, 20, 0, 1, 3, 2], [17, 36, 20, 9, 1, 30, 4]
    q, k_pages, v_pages, tables, cu = make_batch(0, new_tokens, kv_lens, 8, 2, 32, 16, pad_tokens=5)
    outs = run(q, k_pages, v_pages, kv_lens, tables, cu, [5, 7, 0], dtype=jnp.float32)
    for out, num_seqs in zip(outs, [5, 7, 0]):
        want = reference(q, k_pages, v_pages, kv_lens, tables, cu, num_seqs, scale=32**-0.5)
        check(f"mixed f32 num_seqs={num_seqs}", out, want, jnp.float32, cu[num_seqs])


def test_mha_bf16_soft_cap_sinks_one_page_steps():
    """bfloat16, MHA 2:2, D=64, block_q 16, one page a step (up to 4 steps per item), soft cap 5 and sinks
    (one of them large, so a row's sink outweighs its keys); a 1-row decode, a 40-token prompt (3 items),
    a chunk of 7 over a 50-token prefix."""
    new_tokens, kv_lens = [1, 40, 7], [33, 40, 57]
    q, k_pages, v_pages, tables, cu = make_batch(1, new_tokens, kv_lens, 2, 2, 64, 64)
    q = q * 3  # scores large enough for the cap to matter
    sinks = np.array([0.5, 4.0])
    out = run(q, k_pages, v_pages, kv_lens, tables, cu, 3, dtype=jnp.bfloat16, block_q=16, soft_cap=5.0,
              sinks=sinks, pages_per_step=1)
    bf = lambda x: as_given(x, jnp.bfloat16)  # noqa: E731
    want = reference(bf(q), bf(k_pages), bf(v_pages), kv_lens, tables, cu, 3, scale=64**-0.5, soft_cap=5.0,
                     sinks=sinks)
    check("mha bf16 cap sinks", out, want, jnp.bfloat16, cu[-1])


def test_sliding_window_over_nan_pages_one_page_steps():
    """float32, GQA 8:2, a window of 40 in steps of one page (16 keys), so some steps lie wholly inside the
    first row's window and run unmasked while a later row's window edge needs the mask; long contexts whose
    pages wholly outside every new token's window hold NaN; decode rows and a chunk of 12 (2 items)."""
    new_tokens, kv_lens, window = [1, 12, 1], [100, 90, 41], 40
    first = [n - t for n, t in zip(kv_lens, new_tokens)]
    q, k_pages, v_pages, tables, cu = make_batch(2, new_tokens, kv_lens, 8, 2, 32, 32,
                                                 nan_before=[p - window + 1 for p in first])
    assert np.isnan(k_pages[tables[0, 2]]).all() and np.isnan(v_pages[tables[1, 1]]).all()
    out = run(q, k_pages, v_pages, kv_lens, tables, cu, 3, dtype=jnp.float32, window=window, pages_per_step=1)
    want = reference(q, k_pages, v_pages, kv_lens, tables, cu, 3, scale=32**-0.5, window=window)
    check("window", out, want, jnp.float32, cu[-1])


@pytest.mark.parametrize("window", [None, 5, 40])
def test_the_walk_fetches_exactly_the_pages_a_row_can_see(window):
    """The item walk (first page, last page, steps) of random schedules against brute force: the pages a
    step fetches (page <= the last one) are exactly those holding a key some row of the item may see."""
    rng = np.random.default_rng(7)
    block_q, pages_per_step = 8, 3
    for _ in range(20):
        new_tokens = rng.integers(0, 20, size=4)
        kv_lens = new_tokens + rng.integers(0, 60, size=4)
        cu = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
        plan = _plan_for_walk(block_q, pages_per_step, window)
        items = ragged_work_items(jnp.asarray(cu), jnp.int32(4), int(cu[-1]), block_q)
        first = _item_layout(items, jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32))
        for w in range(items.seq.shape[0]):
            item = _item(plan, w, items.seq, first, items.length)
            fetched = {int(item.lo_page) + s * pages_per_step + i for s in range(int(item.steps))
                       for i in range(pages_per_step)}
            fetched = {p for p in fetched if p <= int(item.hi_page)}
            start, length = int(items.start[w]), int(items.length[w])
            seen = set()
            for row in range(start, start + length):
                seq = int(np.searchsorted(cu, row, side="right")) - 1
                p = kv_lens[seq] - new_tokens[seq] + row - cu[seq]
                seen |= {j // PAGE for j in range(p + 1) if window is None or p - j < window}
            assert fetched == seen, (w, fetched, seen)


def _plan_for_walk(block_q, pages_per_step, window):
    return RaggedPlan(num_items=0, block_q=block_q, group=1, num_kv_heads=1, rows=8, page_size=PAGE,
                      pages_per_step=pages_per_step, pages_per_seq=8, num_pages=8, scale=1.0,
                      sliding_window=window, soft_cap=None, score_mod=None, mask_mod=None, score_per_head=False,
                      mask_per_head=False, num_score_consts=0, has_sinks=False, quantized=False)


@pytest.mark.parametrize("page_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_quantized_pages_with_per_head_scales(page_dtype):
    """bfloat16 queries, int8 / float8_e4m3fn pages with a scale per KV head (k_scale folded into the
    scores, v_scale into the output), GQA 4:2 (2 queries a KV head), a prompt and two decode rows."""
    new_tokens, kv_lens = [9, 1, 1], [9, 40, 16]
    q, k_pages, v_pages, tables, cu = make_batch(3, new_tokens, kv_lens, 4, 2, 32, 32)
    if page_dtype == jnp.int8:
        k_pages, v_pages = np.round(k_pages * 40), np.round(v_pages * 40)
    k_scale, v_scale = np.array([0.02, 0.03]), np.array([0.025, 0.015])
    if page_dtype != jnp.int8:
        k_scale, v_scale = k_scale * 40, v_scale * 40
    out = run(q, np.nan_to_num(k_pages), np.nan_to_num(v_pages), kv_lens, tables, cu, 3, dtype=jnp.bfloat16,
              page_dtype=page_dtype, k_scale=k_scale, v_scale=v_scale)
    pages = [as_given(np.nan_to_num(x), page_dtype) for x in (k_pages, v_pages)]
    want = reference(as_given(q, jnp.bfloat16), *pages, kv_lens, tables, cu, 3, scale=32**-0.5, k_scale=k_scale,
                     v_scale=v_scale)
    check(f"quantized {jnp.dtype(page_dtype).name}", out, want, jnp.bfloat16, cu[-1])


def test_alibi_and_a_column_mask_mod():
    """float16 (computed in float32: Mosaic TPU loads no float16 vectors), GQA 8:2: alibi (reads slopes[h],
    run once per query head of the group) and a mask_mod on the b / h / q_idx / kv_idx columns that masks
    every key of some rows (they give 0)."""
    new_tokens, kv_lens = [6, 1, 10], [20, 33, 10]
    q, k_pages, v_pages, tables, cu = make_batch(4, new_tokens, kv_lens, 8, 2, 32, 16)
    slopes = np.linspace(0.05, 0.4, 8)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx + h + b) % 3 != 1) & (q_idx % 5 != 2)

    out = run(q, k_pages, v_pages, kv_lens, tables, cu, 3, dtype=jnp.float16,
              score_mod=alibi(jnp.asarray(slopes, jnp.float32)), mask_mod=mask_mod)
    f16 = lambda x: as_given(x, jnp.float16)  # noqa: E731
    want = reference(f16(q), f16(k_pages), f16(v_pages), kv_lens, tables, cu, 3, scale=32**-0.5,
                     bias=lambda i, h, p, j: -slopes[h] * abs(p - j),
                     keep=lambda i, h, p, j: (j + h + i) % 3 != 1 and p % 5 != 2)
    check("alibi mask_mod", out, want, jnp.float16, cu[-1])


def test_a_hook_it_cannot_lower_raises_hook_not_in_kernel():
    """relative_bias reads table[h, q_idx - kv_idx], a vector gather: the kernel raises the decode kernel's
    HookNotInKernel (the dispatcher's signal for the XLA path), naming this kernel."""
    q, k_pages, v_pages, tables, cu = make_batch(5, [2], [5], 4, 2, 16, 16)
    table = jnp.zeros((4, 63), jnp.float32)
    with pytest.raises(HookNotInKernel, match="ragged paged attention kernel"):
        run(q, k_pages, v_pages, [5], tables, cu, 1, dtype=jnp.float32, score_mod=relative_bias(table))


def test_the_front_end_runs_the_xla_path_for_a_hook_it_cannot_lower():
    """Through `ragged_paged_attention` with backend "tpu_interpret": the dispatcher vets the hooks first,
    warns naming the op, and the call gives the reference's rows."""
    from probjax_kernels import RaggedConfig, ragged_paged_attention, ragged_paged_attention_reference

    q, k_pages, v_pages, tables, cu = make_batch(6, [2, 1], [5, 9], 4, 2, 16, 16)
    args = (q, k_pages, v_pages, jnp.array([5, 9], jnp.int32), jnp.maximum(tables, 0), cu)
    table = jnp.linspace(-1.0, 1.0, 4 * 63, dtype=jnp.float32).reshape(4, 63)
    with pytest.warns(UserWarning, match="ragged paged attention kernel.*runs the XLA path"):
        out = ragged_paged_attention(*args, score_mod=relative_bias(table),
                                     config=RaggedConfig(backend="tpu_interpret"))
    want = ragged_paged_attention_reference(*args, score_mod=relative_bias(table))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
