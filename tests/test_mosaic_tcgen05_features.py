"""FlexAttention's hooks, BlockMasks, the row max, dropout and segment ids in the Mosaic GPU kernels for
Blackwell (sm_100a: tcgen05 MMAs into tensor memory): the forward, dQ and dK / dV kernels with a score_fn and a
mask_fn in the Mosaic GPU CPU interpreter against float64 NumPy, and the dispatch of flex_attention's score_mods
and BlockMasks and of flash_attention's dropout, segment ids and key padding masks on a Blackwell device against
the plain-jnp reference.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeGPU, assert_close, normal, output_and_grads, random_qkv, to_float32
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

from probjax_kernels import (
    AuxRequest,
    FlashConfig,
    _backend,
    create_block_mask,
    flash_attention,
    flash_attention_reference,
    flex_attention,
    flex_attention_reference,
)
from probjax_kernels.flex.mods import alibi, alibi_slopes, and_masks, causal_mask, document_mask, relative_bias, softcap
from probjax_kernels.mosaic import glue as mosaic_glue
from probjax_kernels.mosaic.backward_tcgen05 import tcgen05_backward_dkv, tcgen05_backward_dq
from probjax_kernels.mosaic.forward_tcgen05 import tcgen05_forward

B200 = FakeGPU("10.0", "NVIDIA B200")
INTERPRET = FlashConfig(backend="mosaic_interpret")
CAP = 2.0


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # After an error inside the interpreter its global state must be reset before the next kernel runs.
    yield
    reset_gpu_interpret_mode_state()


@pytest.fixture
def tcgen05_backward_calls(monkeypatch) -> list:
    """On a fake B200: a list that gets an entry each time the tcgen05 backward is built (when jax.grad's
    tangent map is lowered: a jaxpr does not show the backward's kernels)."""
    monkeypatch.setattr(_backend, "target_device", lambda: B200)
    calls, backward = [], mosaic_glue.backward_tcgen05
    monkeypatch.setattr(mosaic_glue, "backward_tcgen05", lambda *a, **k: calls.append(1) or backward(*a, **k))
    return calls


def _capped_distance(score, b, h, q_idx, kv_idx):
    # a soft cap, then a distance penalty per head: nonlinear in the score, and it reads h
    distance = jnp.abs(q_idx - kv_idx).astype(jnp.float32)
    return CAP * jnp.tanh(score / CAP) - 0.02 * (h + 1).astype(jnp.float32) * distance


def _capped_distance_jvp(score, b, h, q_idx, kv_idx):
    return jax.jvp(lambda s: _capped_distance(s, b, h, q_idx, kv_idx), (score,), (jnp.ones_like(score),))


def _prefix_per_head(b, h, q_idx, kv_idx):
    # causal, and a prefix every query sees whole: 40 keys for head 0, 100 for head 1
    return (kv_idx <= q_idx) | (kv_idx < 40 + 60 * h)


def _numpy_hooked(q, k, v, d_out, scale, q_length, kv_length):
    """Float64 (out, lse, row max, dq, dk, dv) of attention with `_capped_distance` and `_prefix_per_head`, one
    batch, rows >= q_length and keys >= kv_length masked; from first principles."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    group = num_heads // num_kv_heads
    q, k, v, d_out = (to_float32(x).astype(np.float64) for x in (q, np.repeat(k, group, 2), np.repeat(v, group, 2),
                                                                  d_out))
    z = np.einsum("btnd,bsnd->bnts", q, k) * scale
    rows, cols = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    heads = np.arange(num_heads)[None, :, None, None]
    scores = CAP * np.tanh(z / CAP) - 0.02 * (heads + 1) * np.abs(rows - cols)
    allowed = ((cols <= rows) | (cols < 40 + 60 * heads)) & (cols < kv_length) & (rows < q_length)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(-1)
    lse = row_max + np.log(np.exp(scores - row_max[..., None]).sum(-1))
    p = np.exp(scores - lse[..., None])
    out = np.einsum("bnts,bsnd->btnd", p, v)
    delta = np.einsum("btnd,btnd->bnt", d_out, out)[..., None]
    ds = p * (np.einsum("btnd,bsnd->bnts", d_out, v) - delta) * (1 - np.tanh(z / CAP) ** 2)

    def group_sum(x):
        return x.reshape(*x.shape[:2], num_kv_heads, group, x.shape[-1]).sum(3)

    dq = scale * np.einsum("bnts,bsnd->btnd", ds, k)
    dk = group_sum(scale * np.einsum("bnts,btnd->bsnd", ds, q))
    dv = group_sum(np.einsum("bnts,btnd->bsnd", p, d_out))
    return out, lse, row_max, dq, dk, dv


def test_hooks_and_the_row_max_match_float64_in_the_interpreter():
    """The forward (on 64-key steps, its row max too), dQ and dK / dV with a score_fn that reads h and a
    per-head mask_fn (every tile masked per element), GQA 2:1 (dK / dV calls the hooks with each query head of
    the group), keys past kv_lengths, against float64."""
    batch, seq, num_heads, num_kv_heads, head_dim, dtype = 1, 256, 2, 1, 64, jnp.bfloat16
    q, k, v = random_qkv(0, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    d_out = random_qkv(2, batch, seq, seq, num_heads, num_heads, head_dim, dtype)[0]
    scale, q_lengths, kv_lengths = head_dim**-0.5, jnp.array([256]), jnp.array([230])
    out, lse, row_max, *grads = _numpy_hooked(q, k, v, d_out, scale, 256, 230)
    hooks = dict(scale=scale, causal=False, interpret=True, score_fn=_capped_distance, mask_fn=_prefix_per_head)
    got_out, got_lse, got_max = tcgen05_forward(q, k, v, q_lengths, kv_lengths, block_kv=64, return_max=True,
                                                **hooks)
    assert_close(got_out, out, dtype, "out")
    np.testing.assert_allclose(np.asarray(got_lse), lse, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(got_max), row_max, rtol=1e-2, atol=1e-2)
    args = (q, k, v, got_out, got_lse, d_out, q_lengths, kv_lengths)
    dq = tcgen05_backward_dq(*args, score_jvp=_capped_distance_jvp, **hooks)
    dk, dv = tcgen05_backward_dkv(*args, score_jvp=_capped_distance_jvp, **hooks)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads, strict=True):
        assert_close(got, want, dtype, name)


def test_a_score_fn_without_its_derivative_is_refused():
    q, k, v = random_qkv(0, 1, 128, 128, 2, 1, 64, jnp.bfloat16)
    lse, lengths = jnp.zeros((1, 2, 128), jnp.float32), jnp.array([128], jnp.int32)
    with pytest.raises(ValueError, match="score_jvp"):
        tcgen05_backward_dq(q, k, v, q, lse, q, lengths, lengths, scale=0.125, causal=False,
                            score_fn=_capped_distance)


def _capped_alibi(slopes):
    cap, bias = softcap(1.5), alibi(slopes)
    return lambda score, b, h, q_idx, kv_idx: bias(cap(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)


def _kernels(fn, *args) -> set:
    return set(re.findall(r"probjax_[a-z0-9_]+", str(jax.make_jaxpr(fn)(*args))))


def test_flex_score_mods_with_scalar_reads_run_the_tcgen05_kernels_on_blackwell(tcgen05_backward_calls):
    """On a B200, flex_attention with a soft cap then ALiBi from a slope table (`slopes[h]`: one element at a
    time), GQA, T = S = 200 (padded to 256), lse and max_scores requested: the tcgen05 forward and backward run
    it; out, lse, max_scores and the gradients of q, k, v and the slopes (the slopes' from XLA) match the
    reference's."""
    q, k, v = random_qkv(9, 1, 200, 200, 2, 1, 64, jnp.bfloat16)
    request = AuxRequest(lse=True, max_scores=True)

    def run(attention, q, k, v, slopes, **config):
        out, aux = attention(q, k, v, _capped_alibi(slopes), None, enable_gqa=True, return_aux=request, **config)
        return out, (aux.lse, aux.max_scores)

    fn = functools.partial(run, flex_attention, config=INTERPRET)
    args = (q, k, v, alibi_slopes(2))
    assert _kernels(fn, *args) == {"probjax_mosaic_forward_tcgen05"}
    cotangent = normal(10, q.shape)
    (out, (lse, row_max)), grads = output_and_grads(fn, args, cotangent, has_aux=True)
    assert tcgen05_backward_calls, "the tcgen05 backward did not run"
    (want_out, (want_lse, want_max)), want_grads = output_and_grads(
        functools.partial(run, flex_attention_reference), args, cotangent, has_aux=True)
    assert_close(out, want_out, jnp.bfloat16, "out")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(row_max), np.asarray(want_max), rtol=1e-2, atol=1e-2)
    for name, got, want in zip(("dq", "dk", "dv", "dslopes"), grads, want_grads, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert_close(got, want, jnp.bfloat16, name)


def test_score_mods_that_gather_per_element_run_the_triton_kernels_on_blackwell(monkeypatch):
    """A relative-position table (a gather per element, at q_idx - kv_idx: not a vector along either) leaves the
    call to the Triton kernels on a B200."""
    monkeypatch.setattr(_backend, "target_device", lambda: B200)
    q, k, v = random_qkv(11, 1, 128, 128, 2, 2, 64, jnp.bfloat16)
    score_mod = relative_bias(jnp.linspace(-1.0, 1.0, 2 * 255).reshape(2, 255))
    found = _kernels(lambda q, k, v: flex_attention(q, k, v, score_mod, config=INTERPRET), q, k, v)
    assert "probjax_flash_forward" in found and "probjax_mosaic_forward_tcgen05" not in found


def test_document_masks_and_per_token_biases_run_the_tcgen05_kernels_on_blackwell(tcgen05_backward_calls):
    """On a B200, flex_attention with a causal document mask (`ids[b, q_idx] == ids[b, kv_idx]`: int32 vectors
    along queries and keys) and a score_mod adding per-key and per-query biases of each head (float32 vectors
    `[N, S]` / `[N, T]` read at h), GQA 2:1, T = S = 200 (256 keys, two of dK/dV's tiles): the vectors travel
    beside Q and each K tile in the forward and dQ, in the Q ring of dK/dV. Output and the gradients of q, k, v
    and the key bias (the bias's from XLA) match the reference's."""
    q, k, v = random_qkv(12, 2, 200, 200, 2, 1, 64, jnp.bfloat16)
    ids = jnp.array([[0] * 70 + [1] * 61 + [2] * 69, [0] * 10 + [1] * 150 + [2] * 40], jnp.int32)
    key_bias = jnp.linspace(-1.0, 1.0, 400).reshape(2, 200)
    row_bias = jnp.cos(jnp.arange(400.0)).reshape(2, 200)
    mask_mod = and_masks(causal_mask, document_mask(ids))

    def run(attention, q, k, v, key_bias, **config):
        def biased(score, b, h, q_idx, kv_idx):
            return score + key_bias[h, kv_idx] - 0.5 * row_bias[h, q_idx]

        block_mask = create_block_mask(mask_mod, 2, 2, 200, 200)
        return attention(q, k, v, biased, block_mask, enable_gqa=True, **config)

    fn = functools.partial(run, flex_attention, config=INTERPRET)
    args = (q, k, v, key_bias)
    assert _kernels(fn, *args) == {"probjax_mosaic_forward_tcgen05"}
    cotangent = normal(13, q.shape)
    out, grads = output_and_grads(fn, args, cotangent)
    assert tcgen05_backward_calls, "the tcgen05 backward did not run"
    want_out, want_grads = output_and_grads(functools.partial(run, flex_attention_reference), args, cotangent)
    assert_close(out, want_out, jnp.bfloat16, "out")
    for name, got, want in zip(("dq", "dk", "dv", "dkey_bias"), grads, want_grads, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert_close(got, want, jnp.bfloat16, name)


def _head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 156 + 100 * h)


def test_block_masks_run_the_tcgen05_kernels_on_blackwell(tcgen05_backward_calls):
    """On a B200, flex_attention with a soft cap and a BlockMask of 128 x 128 blocks whose mask_mod reads h (a
    causal window of 156 + 100 h keys), GQA 4:2: the forward walks the kv tables refined to its (128, 64)
    tiles, dQ to (128, 64), dK/dV the q tables per query head of its group; the blocks below the diagonal are
    partial for head 0 and full for the others. Output and gradients match the reference's."""
    q, k, v = random_qkv(4, 1, 256, 256, 4, 2, 64, jnp.bfloat16)
    block_mask = create_block_mask(_head_window, None, 4, 256, 256, block_size=(128, 128))
    kinds = np.asarray(block_mask.to_dense())  # 0: empty, 1: partial, 2: full
    assert (kinds[0, :, 0, 1] == 0).all() and kinds[0, 0, 1, 0] == 1 and (kinds[0, 1:, 1, 0] == 2).all()

    def fn(q, k, v):
        return flex_attention(q, k, v, softcap(2.0), block_mask, enable_gqa=True, config=INTERPRET)

    def reference(q, k, v):
        return flex_attention_reference(q, k, v, softcap(2.0), block_mask, enable_gqa=True)

    assert _kernels(fn, q, k, v) == {"probjax_mosaic_forward_tcgen05"}
    cotangent = normal(5, q.shape)
    out, grads = output_and_grads(fn, (q, k, v), cotangent)
    assert tcgen05_backward_calls, "the tcgen05 backward did not run"
    want_out, want_grads = output_and_grads(reference, (q, k, v), cotangent)
    assert_close(out, want_out, jnp.bfloat16, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert_close(got, want, jnp.bfloat16, name)


def test_dropout_runs_the_tcgen05_kernels_on_blackwell(tcgen05_backward_calls):
    """On a B200, flash_attention with dropout (every backend's keep mask), causal, GQA 4:2 and ragged lengths:
    the tcgen05 forward drops P after the softmax's normalisation, dQ and dK/dV hash the same mask for dP and
    for dV's P. Output and gradients match the reference's, which drops the same weights."""
    q, k, v = random_qkv(3, 2, 200, 200, 4, 2, 64, jnp.bfloat16)
    options = dict(causal=True, dropout_rate=0.25, dropout_seed=11, q_lengths=jnp.array([200, 150]),
                   kv_lengths=jnp.array([200, 120]))
    _assert_flash_runs_tcgen05_as_the_reference((q, k, v), options, tcgen05_backward_calls, seed=4)


def test_a_head_dim_under_64_runs_the_tcgen05_kernels_widened(tcgen05_backward_calls):
    """On a B200, head dim 32 (the LM example's tiny preset's): q, k and v widened to 64 with zero columns, the
    tcgen05 forward and backward run, and out and the gradients (cut back to 32) match the reference's."""
    q, k, v = random_qkv(5, 1, 192, 192, 2, 1, 32, jnp.bfloat16)
    _assert_flash_runs_tcgen05_as_the_reference((q, k, v), dict(causal=True, kv_lengths=jnp.array([150])),
                                                tcgen05_backward_calls, seed=6)


def _assert_flash_runs_tcgen05_as_the_reference(qkv: tuple, options: dict, backward_calls: list, seed: int):
    """flash_attention(**options) on the fake B200 runs the tcgen05 forward and backward (`backward_calls`:
    the `tcgen05_backward_calls` fixture's list), and its output and gradients (for a normal cotangent of
    `seed`) match the reference's."""
    def fn(q, k, v):
        return flash_attention(q, k, v, config=INTERPRET, **options)

    assert _kernels(fn, *qkv) == {"probjax_mosaic_forward_tcgen05"}
    cotangent = normal(seed, qkv[0].shape)
    out, grads = output_and_grads(fn, qkv, cotangent)
    assert backward_calls, "the tcgen05 backward did not run"
    want_out, want_grads = output_and_grads(lambda q, k, v: flash_attention_reference(q, k, v, **options), qkv,
                                            cotangent)
    assert_close(out, want_out, jnp.bfloat16, "out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert_close(got, want, jnp.bfloat16, name)


@pytest.mark.parametrize("masking", ["segments", "key_padding_mask", "dense_mask_per_head"])
def test_segments_and_masks_run_the_tcgen05_kernels_on_blackwell(tcgen05_backward_calls, masking):
    """On a B200, flash_attention with packed sequences (segment ids of three documents a batch row, the
    boundaries inside the kernels' tiles, causal, GQA 2:1, ragged lengths), with a key padding mask
    `[B, 1, 1, S]` (which reaches the kernels as segment ids) or with a random mask per batch row and head
    `[B, N, T, S]` (int8 tiles beside K; some rows keep no key): the tcgen05 forward, dQ and dK/dV apply them.
    T = S = 200 pad to 256 (two of dK/dV's 128-key tiles). Output and gradients match the reference's."""
    q, k, v = random_qkv(6, 2, 200, 200, 2, 1, 64, jnp.bfloat16)
    if masking == "segments":
        ids = jnp.array([[0] * 70 + [1] * 61 + [2] * 69, [0] * 10 + [1] * 150 + [2] * 40], jnp.int32)
        options = dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids, q_lengths=jnp.array([200, 170]),
                       kv_lengths=jnp.array([200, 150]))
    elif masking == "key_padding_mask":
        keep = jnp.arange(200)[None, :] < jnp.array([[190], [77]])
        options = dict(mask=keep[:, None, None, :])
    if masking == "dense_mask_per_head":
        keep = jax.random.bernoulli(jax.random.key(7), 0.6, (2, 2, 200, 200)).at[0, 1, 5:9].set(False)
        options = dict(mask=keep)
    _assert_flash_runs_tcgen05_as_the_reference((q, k, v), options, tcgen05_backward_calls, seed=8)


@pytest.mark.parametrize("case", ["tiles_bf16", "tiles_f32", "keys", "rows", "per_head_key_mask"])
def test_a_bias_runs_the_tcgen05_forward_and_the_triton_backward_on_blackwell(tcgen05_backward_calls, case):
    """On a B200, flash_attention with a dense bias of each way the kernels read one (`check_bias`): tiles of
    its dtype `[B, N, T, S]` (bfloat16, float32), float32 key vectors `[B, 1, 1, S]`, row vectors `[1, N, T, 1]`;
    and a per-head key mask `[B, N, 1, S]` (a 0 / -inf bias), causal, GQA 2:1, T = S = 200. The tcgen05
    forward adds it to the scaled scores; the backward (the bias's gradient included) is Triton's. Output and
    the gradients of q, k, v and the bias match the reference's."""
    q, k, v = random_qkv(14, 2, 200, 200, 2, 1, 64, jnp.bfloat16)
    shape = {"tiles_bf16": (2, 2, 200, 200), "tiles_f32": (2, 2, 200, 200), "keys": (2, 1, 1, 200),
             "rows": (1, 2, 200, 1), "per_head_key_mask": (2, 2, 1, 200)}[case]
    if case == "per_head_key_mask":
        extra = jax.random.bernoulli(jax.random.key(15), 0.7, shape)
        name = "mask"
    else:
        extra = normal(15, shape).astype(jnp.bfloat16 if case == "tiles_bf16" else jnp.float32)
        name = "bias"

    def run(attention, q, k, v, extra, **config):
        return attention(q, k, v, causal=True, **{name: extra}, **config)

    fn = functools.partial(run, flash_attention, config=INTERPRET)
    args = (q, k, v, extra)
    assert _kernels(fn, *args) == {"probjax_mosaic_forward_tcgen05"}
    cotangent = normal(16, q.shape)
    wrt = 4 if name == "bias" else 3
    out, grads = output_and_grads(lambda *a: fn(*a[:3], *a[3:] or (extra,)), args[:wrt], cotangent)
    assert not tcgen05_backward_calls, "a bias's backward runs on Triton"
    want_out, want_grads = output_and_grads(
        lambda *a: run(flash_attention_reference, *a[:3], *a[3:] or (extra,)), args[:wrt], cotangent)
    assert_close(out, want_out, jnp.bfloat16, "out")
    for label, got, want in zip(("dq", "dk", "dv", "dbias")[:wrt], grads, want_grads, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, label
        assert_close(got, want, jnp.bfloat16, label)
