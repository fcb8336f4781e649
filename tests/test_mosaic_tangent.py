"""The Mosaic GPU (Hopper) tangent kernel: (d out, d lse) in the Mosaic GPU CPU interpreter against `jax.jvp` of
the float32 plain-jnp reference, for tangents of any of q, k, v; through `flash_attention` / `flex_attention`
on backend "mosaic_interpret" with the features it takes (segment ids, masks, dropout, hooks, BlockMasks); and
the tangents of a score_mod's arrays read one element at a time; the calls it leaves to Triton's tangent (arrays
read as vectors, a score_mod at head dim 256; the kernel at head dim 256: test_mosaic_wide_tangent.py; a bias's
tangent: test_mosaic_bias_tangent.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

from probjax_kernels import (
    FlashConfig,
    create_block_mask,
    flash_attention,
    flash_attention_reference,
    flex_attention,
    flex_attention_reference,
)
from probjax_kernels._scores import base2_lse
from probjax_kernels._tiles import refined_tables
from probjax_kernels.flex.mods import alibi, alibi_slopes, document_mask, softcap
from probjax_kernels.mosaic.tangent import mosaic_tangent, tangent_smem_bytes

MOSAIC = FlashConfig(backend="mosaic_interpret")


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    reset_gpu_interpret_mode_state()


def _float32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def reference_jvp(reference, primals, tangents):
    """(out, lse) of `reference` and their tangents, under one jit."""
    return jax.jit(lambda p, t: jax.jvp(reference, p, t))(tuple(primals), tuple(tangents))


def assert_lse_tangent_close(got, want, lse):
    """d lse where a row has a key (lse finite), 0 elsewhere, within float32 sums of bfloat16 products."""
    finite = np.isfinite(np.asarray(lse))
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(np.where(finite, got, 0.0), np.where(finite, want, 0.0), rtol=2e-2, atol=2e-2)
    assert (got[~finite] == 0).all()


@pytest.mark.parametrize(
    "causal, q_lengths, kv_lengths, num_kv_heads, window, moving, head_dims",
    [
        (True, [200, 256], [77, 256], 1, (None, None), "qkv", (64, 64)),
        (False, [256], [256], 2, (70, 30), "q", (64, 64)),  # two-sided window: tiles skipped on both edges
        (True, [256, 130], [256, 0], 2, (100, None), "k", (64, 64)),  # a sequence without keys: d lse = 0
        (False, [256], [256], 1, (None, None), "v", (64, 64)),
        (True, [256], [180], 1, (None, None), "kv", (128, 64)),  # v's head dim its own: out takes a tile of it
    ],
)
def test_tangent_matches_the_reference_in_interpreter(causal, q_lengths, kv_lengths, num_kv_heads, window,
                                                      moving, head_dims):
    assert_kernel_matches_reference(head_dims, moving, num_kv_heads, q_lengths, kv_lengths, causal=causal,
                                    window=window)


def assert_kernel_matches_reference(head_dims, moving: str, num_kv_heads: int, q_lengths, kv_lengths, *, causal,
                                    window, **options):
    """`mosaic_tangent` (with `options`) in the interpreter against the reference's jvp: 2 heads, 256 rows and
    keys, bfloat16, the tangents of the inputs named in `moving` ("q", "k", "v")."""
    batch, seq, num_heads, dtype = len(q_lengths), 256, 2, jnp.bfloat16
    head_dim, value_dim = head_dims
    q, k, _ = random_qkv(0, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    v = random_qkv(1, batch, seq, seq, num_heads, num_kv_heads, value_dim, dtype)[2]
    dq, dk, _ = random_qkv(2, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    dv = random_qkv(3, batch, seq, seq, num_heads, num_kv_heads, value_dim, dtype)[2]
    q_lengths, kv_lengths = jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)
    scale = head_dim**-0.5
    tangents = {name: t for name, t in (("dq", dq), ("dk", dk), ("dv", dv)) if name[1] in moving}

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, causal=causal, window=window, scale=scale, q_lengths=q_lengths,
                                         kv_lengths=kv_lengths, return_lse=True)

    zero_or = [tangents.get(name, jnp.zeros_like(x)) for name, x in (("dq", q), ("dk", k), ("dv", v))]
    (out, lse), (d_out, d_lse) = reference_jvp(reference, _float32(q, k, v), _float32(*zero_or))
    got_out, got_lse = jax.jit(functools.partial(mosaic_tangent, scale=scale, causal=causal, window=window,
                                                 interpret=True, **options))(
        q, k, v, out.astype(dtype), base2_lse(lse), q_lengths, kv_lengths, **tangents)
    assert got_out.shape == out.shape and got_out.dtype == dtype and got_lse.shape == lse.shape
    assert_close(got_out, d_out, dtype, "d out")
    assert_lse_tangent_close(got_lse, d_lse, lse)


def _capped(score, b, h, q_idx, kv_idx):
    # a soft cap and a per-head distance penalty: nonlinear in the score, and it reads h
    return 2.0 * jnp.tanh(score / 2.0) - 0.01 * jnp.abs(q_idx - kv_idx).astype(jnp.float32) * (h + 1).astype(
        jnp.float32)


def _capped_jvp(score, b, h, q_idx, kv_idx):
    return jax.jvp(lambda s: _capped(s, b, h, q_idx, kv_idx), (score,), (jnp.ones_like(score),))


def _head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 156 + 100 * h)


def test_block_tables_and_hooks_match_the_reference_in_interpreter():
    """Over a BlockMask's kv_tables refined to the kernel's 128 x 64 tiles, with a score_fn (its derivative
    scales the score tangent) and a per-head mask_fn, GQA 2:1, against jax.jvp of flex_attention_reference."""
    batch, seq, num_heads, num_kv_heads, head_dim, dtype = 1, 256, 2, 1, 64, jnp.bfloat16
    q, k, v = random_qkv(4, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    tangents = random_qkv(5, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    block_mask = create_block_mask(_head_window, None, num_heads, seq, seq, block_size=(128, 128))
    lengths = jnp.full((batch,), seq, jnp.int32)

    def reference(q, k, v):
        return flex_attention_reference(q, k, v, _capped, block_mask, scale=0.125, enable_gqa=True,
                                         return_lse=True)

    (out, lse), (d_out, d_lse) = reference_jvp(reference, _float32(q, k, v), _float32(*tangents))
    tables = refined_tables(block_mask.kv_tables, (128, 128), (128, 64))
    got_out, got_lse = jax.jit(lambda *args: mosaic_tangent(
        *args, dq=tangents[0], dk=tangents[1], dv=tangents[2], scale=0.125, causal=False, interpret=True,
        kv_tables=tables, mask_fn=_head_window, score_fn=_capped, score_jvp=_capped_jvp))(
        q, k, v, out.astype(dtype), base2_lse(lse), lengths, lengths)
    assert_close(got_out, d_out, dtype, "d out")
    assert_lse_tangent_close(got_lse, d_lse, lse)


def _jvp_through(fn, reference, args, tangents):
    """The jvp of `fn` (backend "mosaic_interpret") and of `reference` (float32) at bfloat16 `args`."""
    got = jax.jit(lambda p, t: jax.jvp(fn, p, t))(tuple(args), tuple(tangents))
    want = reference_jvp(reference, _float32(*args), _float32(*tangents))
    return got, want


def assert_the_mosaic_tangent_matches(fn, reference, args, tangents, tangent_calls: list):
    """`_jvp_through` `fn` and `reference`: the Mosaic tangent kernel ran (`tangent_calls`), and out and d out
    match the reference's."""
    (out, d_out), (want_out, want_d_out) = _jvp_through(fn, reference, args, tangents)
    assert tangent_calls
    assert_close(out, want_out, jnp.bfloat16, "out")
    assert_close(d_out, want_d_out, jnp.bfloat16, "d out")


@pytest.mark.parametrize("feature", ["segments_and_padding", "dense_mask", "head_key_mask", "dropout"])
def test_flash_attention_features_run_the_mosaic_tangent(feature, tangent_calls):
    """jax.jvp of flash_attention on backend "mosaic_interpret" runs the Mosaic tangent kernel, and matches the
    reference's: segment ids with a key padding mask (both as segment ids), a dense mask per head (int8 tiles),
    a per-head key mask (a 0 / -inf bias, which holds still), dropout (every backend's keep mask); GQA 2:1."""
    batch, seq, num_heads, num_kv_heads, head_dim = 2, 192, 4, 2, 64
    q, k, v = random_qkv(6, batch, seq, seq, num_heads, num_kv_heads, head_dim, jnp.bfloat16)
    tangents = random_qkv(7, batch, seq, seq, num_heads, num_kv_heads, head_dim, jnp.bfloat16)
    rng = np.random.default_rng(8)
    options = dict(causal=True)
    if feature == "segments_and_padding":
        segment_ids = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seq)), axis=1), jnp.int32)
        options.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                       mask=jnp.asarray(rng.random((batch, 1, 1, seq)) < 0.8))
    elif feature == "dense_mask":
        mask = rng.random((batch, num_heads, seq, seq)) < 0.6
        mask[0, 1, 5] = False  # a row that keeps no key: zero tangents
        options.update(mask=jnp.asarray(mask))
    elif feature == "head_key_mask":
        options.update(mask=jnp.asarray(rng.random((batch, num_heads, 1, seq)) < 0.7))
    else:
        options.update(dropout_rate=0.25, dropout_seed=5, kv_lengths=jnp.array([150, 192]))
    assert_the_mosaic_tangent_matches(
        lambda q, k, v: flash_attention(q, k, v, config=MOSAIC, **options),
        lambda q, k, v: flash_attention_reference(q, k, v, **options), (q, k, v), tangents, tangent_calls)


def test_flex_hooks_run_the_mosaic_tangent(tangent_calls):
    """A soft cap (its derivative) under a causal document mask (ids read as vectors along q_idx / kv_idx), and
    a BlockMask: jax.jvp of flex_attention on backend "mosaic_interpret" against the reference's."""
    batch, seq, num_heads, head_dim = 1, 256, 2, 64
    q, k, v = random_qkv(9, batch, seq, seq, num_heads, num_heads, head_dim, jnp.bfloat16)
    tangents = random_qkv(10, batch, seq, seq, num_heads, num_heads, head_dim, jnp.bfloat16)
    documents = jnp.asarray(np.repeat([0, 1, 2], [90, 100, 66])[None], jnp.int32)
    mask_mod = document_mask(documents)
    block_mask = create_block_mask(mask_mod, batch, None, seq, seq, block_size=(128, 128))
    score_mod = softcap(3.0)
    assert_the_mosaic_tangent_matches(
        lambda q, k, v: flex_attention(q, k, v, score_mod, block_mask, config=MOSAIC),
        lambda q, k, v: flex_attention_reference(q, k, v, score_mod, block_mask), (q, k, v), tangents,
        tangent_calls)


def _learnable_cap(cap):
    """A soft cap whose cap is an array (a parameter; the kernels read it as a scalar): its jvp in the cap adds
    two tangents (`add_any`, which Mosaic GPU has no lowering rule for: the kernels bind it as an add)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)
    return score_mod


def _token_bias(bias):
    """A per-token bias `bias[b, kv_idx]`: the kernels read it as vectors along kv_idx."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, kv_idx]
    return score_mod


@pytest.mark.parametrize("case", ["alibi", "learnable_cap"])
def test_score_mod_arrays_move_in_the_mosaic_tangent(case, tangent_calls):
    """jax.jvp of flex_attention in q, k, v and a score_mod's captured array read one element at a time (ALiBi's
    slopes[h]; a soft cap's 0-d cap, whose jvp adds its two paths' tangents with `add_any` and holds cap ** -2)
    runs the Mosaic tangent kernel, which reads the array's tangent the same way, and matches the reference's; the
    same with the array held still, and with the array moving alone. GQA 2:1, 192 rows and keys (a partial
    tile)."""
    batch, seq, num_heads, head_dim = 1, 192, 4, 64
    q, k, v = random_qkv(14, batch, seq, seq, num_heads, 2, head_dim, jnp.bfloat16)
    tangents = random_qkv(15, batch, seq, seq, num_heads, 2, head_dim, jnp.bfloat16)
    if case == "alibi":
        mod, array, d_array = alibi, alibi_slopes(num_heads), jnp.linspace(-1.0, 1.0, num_heads)
    else:
        mod, array, d_array = _learnable_cap, jnp.asarray(3.0), jnp.asarray(-2.0)

    def attend(attention, **config):
        return lambda q, k, v, array: attention(q, k, v, mod(array), enable_gqa=True, **config)

    assert_the_mosaic_tangent_matches(attend(flex_attention, config=MOSAIC), attend(flex_attention_reference),
                                      (q, k, v, array), (*tangents, d_array), tangent_calls)
    tangent_calls.clear()
    assert_the_mosaic_tangent_matches(
        lambda q, k, v: attend(flex_attention, config=MOSAIC)(q, k, v, array),
        lambda q, k, v: attend(flex_attention_reference)(q, k, v, array), (q, k, v), tangents, tangent_calls)
    tangent_calls.clear()
    assert_the_mosaic_tangent_matches(
        lambda array: attend(flex_attention, config=MOSAIC)(q, k, v, array),
        lambda array: attend(flex_attention_reference)(*_float32(q, k, v), array), (array,), (d_array,),
        tangent_calls)


def test_what_the_mosaic_tangent_leaves_to_triton(tangent_calls):
    """A score_mod's array read as vectors along kv_idx (a per-token bias: its tangent would need vectors of its
    own) takes Triton's tangent kernel beside the Mosaic forward; the jvp (in the array too) still matches the
    reference's."""
    batch, seq, num_heads, head_dim = 1, 128, 2, 64
    q, k, v = random_qkv(11, batch, seq, seq, num_heads, num_heads, head_dim, jnp.bfloat16)
    tangents = random_qkv(12, batch, seq, seq, num_heads, num_heads, head_dim, jnp.bfloat16)
    mod, array, d_array = _token_bias, jnp.linspace(-2.0, 2.0, seq)[None], jnp.ones((1, seq))

    def attend(attention, **config):
        return lambda q, k, v, array: attention(q, k, v, mod(array), **config)

    got, want = _jvp_through(attend(flex_attention, config=MOSAIC), attend(flex_attention_reference),
                             (q, k, v, array), (*tangents, d_array))
    assert not tangent_calls
    assert_close(got[1], want[1], jnp.bfloat16, "d out")


def test_shared_memory_and_argument_checks():
    """Shared memory for the tiles, with and without each tangent's ring, and the checks of the arguments."""
    # Q, dQ; the K, V, dK, dV rings of 2 x 64 keys at head dim 128 (32 KiB each); lse2's rows (1 KiB aligned);
    # Mosaic GPU's 2 KiB reduction scratch where the tangent of q or k moves (c's row sums; the compile record has
    # 199,680 B for the first); 8-byte barriers: 4 per consumer (Q, dQ, lse2, out) and 4 per ring slot
    assert tangent_smem_bytes(128, 128, 64, 2) == 6 * 32768 + 1024 + 2048 + 8 * (2 * 4 + 8)
    assert tangent_smem_bytes(128, 128, 64, 2, moving=(False, False, True)) == 4 * 32768 + 1024 + 8 * (2 * 3 + 8)
    # Head dim 256, k's program: Q (64 KiB), K and dK (one 32 KiB slot each), V's 128 columns, out's (a tile of its
    # own: 32 KiB), the index vectors (1 KiB each); the compile record has 185,344 B
    assert tangent_smem_bytes(256, 128, 64, 1, value_dim=128, moving=(False, True, False), indices=True) == (
        65536 + 1024 + 2 * 32768 + 16384 + 32768 + 2 * 1024 + 2048 + 8 * (2 * 3 + 4))
    q, k, v = random_qkv(0, 1, 128, 128, 2, 2, 64, jnp.bfloat16)
    lengths = jnp.full((1,), 128, jnp.int32)
    out, lse2 = jnp.zeros_like(q), jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="needs a tangent of q, k, v, the bias or the score_fn's arrays"):
        mosaic_tangent(q, k, v, out, lse2, lengths, lengths, scale=0.125, causal=True, interpret=True)
    with pytest.raises(ValueError, match="dk must have the shape and dtype"):
        mosaic_tangent(q, k, v, out, lse2, lengths, lengths, dk=k.astype(jnp.float16), scale=0.125, causal=True,
                       interpret=True)
