"""The Mosaic GPU (Hopper) forward kernel: numerics in the Mosaic GPU CPU interpreter, and CUDA lowering on CPU.

The interpreter runs the warp-specialised pipeline (TMA, barriers, both consumer warpgroups, wgmma from SMEM)
but stages P through shared memory and accumulates P V out of place (see `mosaic.forward`); the register-fed,
in-place P V of the compiled kernel is only lowered here, not run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, bernoulli, normal, numpy_allowed, numpy_attention, random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    reset_gpu_interpret_mode_state,
)
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from probjax_kernels import dropout_keep_mask
from probjax_kernels.mosaic.forward import SMEM_BYTES, mosaic_forward, smem_bytes


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # After an error inside the interpreter its global state must be reset before the next kernel runs.
    yield
    reset_gpu_interpret_mode_state()


def _check_against_numpy(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype, causal, q_lengths,
                         kv_lengths, poison_from=None, window=(None, None), segments=None, value_dim=None, mask=None,
                         bias=None, **tiles):
    """`poison_from`: keys from there on are NaN in the kernel's K and V, to prove their tiles are never read.
    `segments`: (q_segment_ids, kv_segment_ids). `value_dim`: v's head dim, if not q's. `mask`: a dense mask.
    `bias`: a dense bias."""
    q, k, v = random_qkv(0, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype)
    if value_dim is not None:
        v = random_qkv(1, batch, q_len, kv_len, num_heads, num_kv_heads, value_dim, dtype)[2]
    scale = head_dim**-0.5
    k_in, v_in = k, v
    if poison_from is not None:
        k_in, v_in = (x.at[:, poison_from:].set(jnp.nan) for x in (k, v))
    # Under jit: eagerly, every op around the kernel is an XLA compile of its own.
    q_segment_ids, kv_segment_ids = segments or (None, None)
    out, lse = jax.jit(functools.partial(mosaic_forward, scale=scale, causal=causal, window=window, interpret=True,
                                         **tiles))(
        q, k_in, v_in, jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32),
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, mask=mask, bias=bias)
    allowed = numpy_allowed(batch, q_len, kv_len, causal=causal, window=window, q_lengths=q_lengths,
                            kv_lengths=kv_lengths, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                            mask=mask)
    expected_out, expected_lse = numpy_attention(q, k, v, allowed=allowed, scale=scale, bias=bias)
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == q.dtype
    assert lse.shape == (batch, num_heads, q_len) and lse.dtype == jnp.float32
    assert_close(out, expected_out, dtype, "out")
    assert_lse_close(lse, expected_lse)


CASES = {
    # name: (B, T, S, N, K, D, dtype, causal, q_lengths, kv_lengths, tiles)
    "dense_mqa": (1, 256, 256, 2, 1, 64, jnp.bfloat16, False, [256], [256], {}),
    "causal_ring_wraps": (1, 256, 256, 2, 2, 64, jnp.bfloat16, True, [256], [256], {"block_kv": 64}),
    "causal_three_stages": (1, 256, 256, 2, 1, 64, jnp.bfloat16, True, [256], [256],
                            {"block_kv": 64, "num_stages": 3}),
    "causal_ragged": (2, 256, 256, 2, 1, 64, jnp.bfloat16, True, [200, 256], [150, 77], {"block_kv": 64}),
    "ragged_empty_rows": (2, 128, 256, 4, 2, 64, jnp.float16, False, [100, 128], [0, 130], {"block_kv": 64}),
    "causal_short_queries": (1, 128, 256, 2, 1, 64, jnp.bfloat16, True, [60], [256], {}),
    "head_dim_128": (1, 128, 256, 2, 1, 128, jnp.float16, True, [128], [200], {"block_kv": 64}),
    "block_q_256": (1, 256, 128, 2, 1, 64, jnp.bfloat16, False, [256], [128], {"block_q": 256, "block_kv": 64}),
}


WINDOW_CASES = {
    # name: (B, T, S, N, K, D, dtype, causal, q_lengths, kv_lengths, window, tiles)
    "causal_sliding": (1, 512, 512, 2, 1, 64, jnp.bfloat16, True, [512], [512], (100, None), {"block_kv": 64}),
    "two_sided_ragged": (2, 256, 384, 2, 1, 64, jnp.bfloat16, False, [256, 200], [384, 100], (70, 30),
                         {"block_kv": 64}),
    "right_only_gqa": (1, 256, 512, 4, 2, 64, jnp.float16, False, [256], [500], (None, 40), {}),
    "diagonal_only": (1, 384, 384, 2, 1, 64, jnp.bfloat16, False, [384], [384], (0, 0), {"block_kv": 64}),
}


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_windows_match_numpy_in_interpreter(case):
    *shape, window, tiles = WINDOW_CASES[case]
    _check_against_numpy(*shape, window=window, **tiles)


@pytest.mark.parametrize("case", CASES)
def test_matches_numpy_in_interpreter(case):
    *shape, tiles = CASES[case]
    _check_against_numpy(*shape, **tiles)


@pytest.mark.parametrize(
    "causal, q_lengths, kv_lengths",
    [(True, [128], [512]), (False, [128], [100])],  # above the diagonal / past the last partial tile
)
def test_skipped_tiles_are_never_read(causal, q_lengths, kv_lengths):
    _check_against_numpy(1, 128, 512, 2, 1, 64, jnp.bfloat16, causal, q_lengths, kv_lengths, poison_from=128,
                         block_kv=64)


def _documents(lengths: list[list[int]]) -> jnp.ndarray:
    """int32 [B, sum(lengths[b])] segment ids: document d of sequence b has lengths[b][d] tokens (ids 3d + b)."""
    return jnp.asarray([np.repeat(3 * np.arange(len(row)) + b, row) for b, row in enumerate(lengths)], jnp.int32)


@pytest.mark.parametrize("causal, window, tiles", [
    (True, (None, None), {"block_kv": 64, "num_stages": 3}),  # documents ending inside tiles, the ring wraps
    (False, (60, 20), {}),  # a two-sided window on top of the documents
])
def test_segment_ids_match_numpy_in_interpreter(causal, window, tiles):
    # T < S (packed queries against a longer packed key sequence), GQA, ragged lengths; query rows whose
    # document has no key below kv_lengths give 0 and lse -inf.
    q_segments = _documents([[40, 60, 28], [128]])
    kv_segments = _documents([[100, 30, 126], [56, 200]])
    _check_against_numpy(2, 128, 256, 4, 2, 64, jnp.bfloat16, causal, [128, 100], [200, 256], window=window,
                         segments=(q_segments, kv_segments), **tiles)


@pytest.mark.parametrize("head_dim, value_dim, tiles", [
    (64, 128, {}), (128, 64, {"num_stages": 3}), (128, 256, {"block_kv": 64}), (256, 64, {"block_kv": 64}),
])
def test_a_value_head_dim_of_its_own_matches_numpy_in_interpreter(head_dim, value_dim, tiles):
    # v [B, S, K, Dv] with Dv != D: O gets a shared-memory tile of its own instead of Q's. One sequence (ragged):
    # the interpreter's time grows with the grid, and per-sequence lengths are the cases' above.
    _check_against_numpy(1, 256, 256, 2, 1, head_dim, jnp.bfloat16, True, [180], [200], value_dim=value_dim,
                         **tiles)


@pytest.mark.parametrize("mask_shape, tiles", [((2, 4, 128, 256), {}), ((1, 1, 128, 256), {"block_kv": 64})])
def test_a_dense_mask_matches_numpy_in_interpreter(mask_shape, tiles):
    # int8 tiles of the mask beside K (128 or 64 bytes a row), per head or broadcast, with causality and lengths.
    mask = np.asarray(bernoulli(4, 0.5, mask_shape))
    _check_against_numpy(2, 128, 256, 4, 2, 64, jnp.bfloat16, True, [128, 100], [256, 170], mask=mask, **tiles)


@pytest.mark.parametrize("bias_shape, dtype, tiles", [
    ((2, 4, 128, 256), jnp.bfloat16, {}),  # per head: 16-bit tiles beside K
    ((1, 1, 128, 256), jnp.float32, {"block_kv": 64}),  # broadcast float32 tiles
    ((2, 1, 1, 256), jnp.float32, {}),  # a key padding bias: float32 key vectors beside K
    ((1, 4, 128, 1), jnp.float16, {}),  # per row: float32 row vectors beside Q
    ((1, 1, 1, 1), jnp.bfloat16, {}),  # one value: a key vector of it
])
def test_a_dense_bias_matches_numpy_in_interpreter(bias_shape, dtype, tiles):
    # Added to the scaled scores before the masks; -inf entries mask like a mask's False.
    bias = 3 * normal(5, bias_shape, jnp.float32)
    bias = jnp.where(bernoulli(6, 0.1, bias_shape), -jnp.inf, bias).astype(dtype)
    _check_against_numpy(2, 128, 256, 4, 2, 64, jnp.bfloat16, True, [128, 100], [256, 170], bias=bias, **tiles)


def test_rejects_a_bias_of_the_wrong_shape_or_dtype():
    q, k, v = random_qkv(0, 1, 128, 128, 2, 2, 64, jnp.bfloat16)
    lengths = jnp.array([128], jnp.int32)
    for bias, error, match in [(jnp.zeros((1, 2, 64, 128)), ValueError, "bias must be"),
                               (jnp.zeros((1, 2, 128, 128), jnp.int32), TypeError, "bias must be bfloat16")]:
        with pytest.raises(error, match=match):
            mosaic_forward(q, k, v, lengths, lengths, scale=0.125, causal=False, interpret=True, bias=bias)


def test_rejects_a_dense_mask_of_the_wrong_shape():
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    lengths = jnp.array([256], jnp.int32)
    for mask, match in ((jnp.ones((1, 1, 1, 256), bool), r"mask must be \[B\|1, N\|1, T, S\]"),
                        (jnp.ones((1, 1, 256, 256), jnp.float32), "mask must be bool or integer")):
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(mosaic_forward, scale=1.0, causal=False, mask=mask), q, q, q, lengths,
                           lengths)


@pytest.mark.parametrize("segments, match", [
    ((jnp.zeros((1, 256), jnp.int32), None), "pass both q_segment_ids and kv_segment_ids"),
    ((jnp.zeros((1, 200), jnp.int32), jnp.zeros((1, 256), jnp.int32)), r"q_segment_ids must be integer \[B, T\]"),
    ((jnp.zeros((1, 256), jnp.int32), jnp.zeros((1, 256), jnp.float32)), "kv_segment_ids must be integer"),
])
def test_rejects_bad_segment_ids(segments, match):
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    lengths = jnp.array([256], jnp.int32)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(mosaic_forward, scale=1.0, causal=False, q_segment_ids=segments[0],
                                         kv_segment_ids=segments[1]), q, q, q, lengths, lengths)


@pytest.mark.parametrize("options, match", [
    ({"dropout_rate": 0.1}, "needs a dropout_seed"),
    ({"dropout_rate": 1.0, "dropout_seed": 3}, r"dropout_rate must be in \[0, 1\)"),
    ({"dropout_rate": 0.1, "dropout_seed": jnp.zeros(7, jnp.uint32)}, "dropout_seed must be a scalar"),
    ({"dropout_rate": 0.1, "dropout_seed": 3, "dropout_positions": (256, 256)}, "positional_seed's \\[7\\]"),
])
def test_rejects_bad_dropout_arguments(options, match):
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    lengths = jnp.array([256], jnp.int32)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(mosaic_forward, scale=1.0, causal=False, **options), q, q, q, lengths,
                       lengths)


def test_dropout_matches_numpy_in_interpreter():
    """Each weight dropped where every backend's keep mask (`dropout_keep_mask`, a hash of the seed and the
    (batch, query head, query, key) indices) drops it, the kept ones scaled by 1 / (1 - rate); lse is the
    undropped softmax's. A two-sided window and ragged lengths, GQA."""
    batch, seq, num_heads, num_kv_heads, head_dim, rate = 2, 256, 4, 2, 64, 0.25
    q, k, v = random_qkv(3, batch, seq, seq, num_heads, num_kv_heads, head_dim, jnp.bfloat16)
    q_lengths, kv_lengths, window = [256, 190], [220, 256], (80, 30)
    out, lse = jax.jit(functools.partial(mosaic_forward, scale=0.125, causal=False, window=window, interpret=True,
                                         dropout_rate=rate))(
        q, k, v, jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32), dropout_seed=jnp.uint32(9))
    allowed = numpy_allowed(batch, seq, seq, window=window, q_lengths=q_lengths, kv_lengths=kv_lengths)
    _, expected_lse = numpy_attention(q, k, v, allowed=allowed, scale=0.125)
    grid = np.meshgrid(np.arange(batch), np.arange(num_heads), np.arange(seq), np.arange(seq), indexing="ij")
    keep = np.asarray(dropout_keep_mask(9, *(jnp.asarray(g, jnp.int32) for g in grid), rate, num_heads))
    # softmax weights of the allowed keys, then dropped: out = (keep / (1 - rate) * P) V
    q64, k64, v64 = (np.repeat(np.asarray(x, np.float64), 1 if x is q else 2, axis=2) for x in (q, k, v))
    scores = np.where(np.broadcast_to(allowed, keep.shape), np.einsum("btnd,bsnd->bnts", q64, k64) * 0.125, -np.inf)
    weights = np.where(np.isfinite(expected_lse)[..., None], np.exp(scores - np.where(
        np.isfinite(expected_lse), expected_lse, 0)[..., None]), 0.0)
    expected_out = np.einsum("bnts,bsnd->btnd", weights * keep / (1 - rate), v64)
    assert 0.2 < 1 - keep.mean() < 0.3  # the mask drops about `rate` of the weights
    assert_close(out, expected_out, jnp.bfloat16, "out")
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], expected_lse[finite], rtol=1e-5, atol=1e-5)


def _specs(batch, seq, num_heads, num_kv_heads, head_dim) -> tuple:
    """q, k, v (bf16) and the two length vectors of a `mosaic_forward` call, as abstract shapes."""
    q = jax.ShapeDtypeStruct((batch, seq, num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return q, kv, kv, lengths, lengths


def _lower_for_cuda(fn, *specs) -> str:
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "head_dim, causal, tiles",
    [
        (64, False, {"block_q": 128, "block_kv": 128, "num_stages": 2}),
        (64, True, {"block_q": 256, "block_kv": 128, "num_stages": 3}),
        (128, False, {"block_q": 128, "block_kv": 128, "num_stages": 2}),
        (128, True, {"block_q": 128, "block_kv": 64, "num_stages": 4}),
        (128, True, {"block_q": 128, "block_kv": 128, "num_stages": 2, "p_in_smem": True}),
        (256, True, {"block_q": 128, "block_kv": 64, "num_stages": 2}),
        (128, False, {"block_q": 128, "block_kv": 128, "num_stages": 2, "window": (256, 64)}),
        (64, True, {"block_q": 128, "block_kv": 64, "num_stages": 3, "window": (1000, None)}),
    ],
)
def test_lowers_for_cuda(head_dim, causal, tiles):
    batch, seq, num_heads, num_kv_heads = 2, 1024, 8, 2
    fn = functools.partial(mosaic_forward, scale=head_dim**-0.5, causal=causal, **tiles)
    assert "mosaic_gpu" in _lower_for_cuda(fn, *_specs(batch, seq, num_heads, num_kv_heads, head_dim))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_segment_ids_lower_for_cuda(head_dim):
    segments = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
    fn = functools.partial(mosaic_forward, scale=head_dim**-0.5, causal=True, block_kv=128 if head_dim == 64 else 64)
    text = _lower_for_cuda(lambda *a: fn(*a[:5], q_segment_ids=a[5], kv_segment_ids=a[6]),
                           *_specs(2, 1024, 8, 2, head_dim), segments, segments)
    assert "mosaic_gpu" in text


def test_smem_estimate():
    # Mosaic GPU's own count: each buffer from a 1 KiB boundary, 8 B a barrier (2 + 4 * stages + 1), no
    # reduction scratch (with its default 2 KiB, its check refused 232,568 B for 3 stages at head dim 128).
    assert smem_bytes(128, 128, 128, 2) == 2 * 128 * (128 + 4 * 128) + 1024 + 8 * 11
    assert smem_bytes(128, 128, 128, 3) == 232_568 - 2048 <= SMEM_BYTES
    assert smem_bytes(256, 128, 128, 2) > SMEM_BYTES
    # Dv != D: V's ring in Dv columns, and an O tile of its own
    assert (smem_bytes(128, 128, 64, 2, value_dim=256)
            == 2 * (128 * (128 + 128) + 256 * (128 + 128)) + 1024 + 8 * 11)
    # segment ids: the query rows' and a ring slot of the keys' per stage, int32 (1 KiB each)
    assert smem_bytes(128, 128, 128, 2, segments=True) == smem_bytes(128, 128, 128, 2) + 2 * 1024
    # a bias: 16-bit tiles fill the rest at 128 x 128 (232,536 B as Mosaic GPU counted them with the scratch)
    assert smem_bytes(128, 128, 128, 2, bias="tiles", bias_itemsize=2) == 232_536 - 2048 <= SMEM_BYTES
    assert smem_bytes(128, 128, 128, 2, bias="tiles", bias_itemsize=4) > SMEM_BYTES


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"dtype": jnp.float32}, NotImplementedError, "bfloat16 / float16"),
        ({"head_dim": 96}, NotImplementedError, "head_dim"),
        ({"q_len": 200}, ValueError, "pad T=200"),
        ({"block_q": 64}, ValueError, "block_q=64"),
        ({"block_kv": 96}, ValueError, "block_kv=96"),
        ({"num_stages": 1}, ValueError, "num_stages=1"),
        ({"num_heads": 3}, ValueError, "num_heads=3"),
        ({"head_dim": 256, "block_kv": 128}, ValueError, "bytes of SMEM"),
    ],
)
def test_rejects(change, error, match):
    args = {"q_len": 256, "num_heads": 4, "head_dim": 64, "dtype": jnp.bfloat16, "block_q": 128, "block_kv": 128,
            "num_stages": 2} | change
    q = jax.ShapeDtypeStruct((1, args["q_len"], args["num_heads"], args["head_dim"]), args["dtype"])
    kv = jax.ShapeDtypeStruct((1, 256, 2, args["head_dim"]), args["dtype"])
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = functools.partial(mosaic_forward, scale=1.0, causal=False, block_q=args["block_q"],
                           block_kv=args["block_kv"], num_stages=args["num_stages"])
    with pytest.raises(error, match=match):
        jax.eval_shape(fn, q, kv, kv, lengths, lengths)


def _alibi_from_head(score, b, h, q_idx, kv_idx):
    # ALiBi with slopes computed from the head index (no captured array), plus a per-batch offset.
    slope = jnp.exp2(-(h + 1).astype(jnp.float32))
    return score + slope * (kv_idx - q_idx).astype(jnp.float32) + 0.5 * b.astype(jnp.float32)


def _softcap(score, b, h, q_idx, kv_idx):
    return 2.0 * jnp.tanh(score / 2.0)


SCORE_FNS = {
    # name: (kernel score_fn, its float64 numpy twin on [B, N, T, S] scores)
    "alibi_from_head": (_alibi_from_head, lambda s, b, h, rows, cols: s + 2.0 ** -(h + 1.0) * (cols - rows) + 0.5 * b),
    "softcap": (_softcap, lambda s, b, h, rows, cols: 2.0 * np.tanh(s / 2.0)),
}


@pytest.mark.parametrize("name", SCORE_FNS)
def test_score_fn_matches_numpy_in_interpreter(name):
    score_fn, numpy_fn = SCORE_FNS[name]
    # Two query heads on one KV head (the interpreter's time grows with the grid; GQA with several KV heads is
    # right_only_gqa's): score_fn gets the query head.
    batch, seq, num_heads, num_kv_heads, head_dim = 2, 256, 2, 1, 64
    q_lengths, kv_lengths = [256, 190], [256, 130]
    q, k, v = random_qkv(3, batch, seq, seq, num_heads, num_kv_heads, head_dim, jnp.bfloat16)
    scale = 0.5  # scores of a few units, so that the soft cap bends them
    out, lse = jax.jit(functools.partial(mosaic_forward, scale=scale, causal=True, block_kv=64, interpret=True,
                                         score_fn=score_fn))(
        q, k, v, jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32))

    q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    k64, v64 = (np.repeat(x, num_heads // num_kv_heads, axis=2) for x in (k64, v64))
    scores = np.einsum("btnd,bsnd->bnts", q64, k64) * scale
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(num_heads)[None, :, None, None]
    rows, cols = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = numpy_allowed(batch, seq, seq, causal=True, q_lengths=q_lengths, kv_lengths=kv_lengths)
    scores = np.where(allowed, numpy_fn(scores, b, h, rows, cols), -np.inf)
    row_max = np.where(allowed.any(-1), scores.max(-1), 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf on rows without any key
        expected_lse = np.log(np.exp(scores - row_max[..., None]).sum(-1)) + row_max
    weights = np.exp(scores - np.where(np.isfinite(expected_lse), expected_lse, 0.0)[..., None])
    expected_out = np.einsum("bnts,bsnd->btnd", weights, v64)
    assert_close(out, expected_out, jnp.bfloat16, "out")
    assert_lse_close(lse, expected_lse)


@pytest.mark.parametrize("name", SCORE_FNS)
def test_score_fn_lowers_for_cuda(name):
    batch, seq, num_heads, num_kv_heads, head_dim = 2, 1024, 8, 2, 128

    def mask_fn(b, h, q_idx, kv_idx):  # reads the batch and head indices too
        return (q_idx - kv_idx < 256 + 64 * h) | (b == 1)

    fn = functools.partial(mosaic_forward, scale=head_dim**-0.5, causal=True, score_fn=SCORE_FNS[name][0],
                           mask_fn=mask_fn)
    assert "mosaic_gpu" in _lower_for_cuda(fn, *_specs(batch, seq, num_heads, num_kv_heads, head_dim))


def test_nan_keys_give_nan_rows_as_in_numpy():
    q, k, v = random_qkv(5, 1, 128, 256, 2, 1, 64, jnp.bfloat16)
    k = k.at[0, 200, 0, 7].set(jnp.nan)  # seen by every row (non-causal), by none past kv_lengths=150 (below)
    run = jax.jit(functools.partial(mosaic_forward, scale=0.125, causal=False, interpret=True))  # one compile
    for kv_length, rows_nan in ((256, True), (150, False)):
        out, _ = run(q, k, v, jnp.array([128], jnp.int32), jnp.array([kv_length], jnp.int32))
        assert bool(jnp.isnan(out).all()) if rows_nan else not bool(jnp.isnan(out).any())
