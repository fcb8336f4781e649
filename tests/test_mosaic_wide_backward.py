"""The Mosaic GPU (Hopper) backward at head dim 256: the dQ and dK / dV kernels on one K / V (Q / dO) slot, dK
and dV from two programs (`split`: one float32 accumulator each), dQ and dK from a program per 128 of their
columns where q / k's head dim is 256 (`pieces`), in the Mosaic GPU CPU interpreter against
`jax.vjp` of the float32 plain-jnp reference, and through `flash_attention` on backend "mosaic_interpret" (v's
head dim its own, GQA, lengths, masks, segment ids, a key bias with its gradient, BlockMasks with their
mask_mods, score_mods with dK in 64-column pieces); bias tiles and BlockMasks of 64-key blocks keep Triton's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
from test_mosaic_backward import reference_vjp
from test_mosaic_dispatch import (
    MOSAIC,
    assert_mosaic_matches_reference,
    backward_kernels,
    assert_output_and_grads_close,
    interpreted_beside_reference,
)

from probjax_kernels import (
    create_block_mask,
    flash_attention,
    flash_attention_reference,
    flex_attention,
    flex_attention_reference,
)
from probjax_kernels.flex.mods import alibi, alibi_slopes, document_mask, sliding_window, softcap
from probjax_kernels.mosaic.backward import mosaic_backward_dq
from probjax_kernels.mosaic.backward_dkv import mosaic_backward_dkv
from probjax_kernels.mosaic.plan import WIDE_STAGES


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize("head_dims, causal, num_kv_heads", [((256, 256), True, 1), ((128, 256), False, 2)])
def test_the_kernels_match_the_reference_in_interpreter(head_dims, causal, num_kv_heads):
    """dQ (in pieces at q / k's head dim 256), then the dV and dK programs, on `WIDE_STAGES` slots, ragged lengths
    (a sequence whose last rows and keys are padding)."""
    (head_dim, value_dim), batch, seq, num_heads, dtype = head_dims, 2, 256, 2, jnp.bfloat16
    q, k, _ = random_qkv(0, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    v = random_qkv(1, batch, seq, seq, num_heads, num_kv_heads, value_dim, dtype)[2]
    d_out = random_qkv(2, batch, seq, seq, num_heads, num_heads, value_dim, dtype)[2]
    q_lengths, kv_lengths = jnp.array([200, 256], jnp.int32), jnp.array([77, 256], jnp.int32)
    scale = head_dim**-0.5

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, causal=causal, scale=scale, q_lengths=q_lengths,
                                         kv_lengths=kv_lengths, return_lse=True)

    (out, lse), expected = reference_vjp(reference, tuple(x.astype(jnp.float32) for x in (q, k, v)),
                                         d_out.astype(jnp.float32))
    args = (q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths)
    options = dict(scale=scale, causal=causal, interpret=True, num_stages=WIDE_STAGES, pieces=head_dim // 128)
    dq = jax.jit(functools.partial(mosaic_backward_dq, **options))(*args)
    dk, dv = jax.jit(functools.partial(mosaic_backward_dkv, split=True, **options))(*args)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected, strict=True):
        assert got.shape == want.shape and got.dtype == dtype, name
        assert_close(got, want, dtype, name)


def test_the_split_and_the_pieces_are_required_above_128():
    """One program's dK + dV accumulators, or a 64 x 256 float32 dQ / dK accumulator, spill: at head dim 256 the
    kernels refuse to build them, and pieces that do not cover the head dim."""
    q, k, v = random_qkv(3, 1, 128, 128, 2, 2, 256, jnp.bfloat16)
    lse, lengths = jnp.zeros((1, 2, 128)), jnp.full((1,), 128, jnp.int32)
    args = (q, k, v, q, lse, q, lengths, lengths)
    with pytest.raises(ValueError, match="needs split=True"):
        mosaic_backward_dkv(*args, scale=0.1, causal=True, interpret=True, num_stages=1, pieces=2)
    with pytest.raises(ValueError, match="pieces=1 at head_dim=256"):
        mosaic_backward_dkv(*args, scale=0.1, causal=True, interpret=True, num_stages=1, split=True)
    with pytest.raises(ValueError, match="pieces=1 at head_dim=256"):
        mosaic_backward_dq(*args, scale=0.1, causal=True, interpret=True, num_stages=1)
    narrow = tuple(x[..., :128] for x in (q, k))
    with pytest.raises(ValueError, match="pieces=2 at head_dim=128"):
        mosaic_backward_dq(*narrow, v, q, lse, q, lengths, lengths, scale=0.1, causal=True, interpret=True,
                           num_stages=1, pieces=2)


@pytest.mark.parametrize("case", ["gqa_lengths", "value_dim_64", "segments_and_mask", "key_bias"])
def test_flash_attention_runs_the_mosaic_backward_at_head_dim_256(case):
    """flash_attention on backend "mosaic_interpret" at head dim 256: the Mosaic forward and backward, out and
    the gradients (a key bias's too) against the reference; GQA 2:1 (dK's programs per query head) but with the
    key bias."""
    q, k, v = random_qkv(4, 2, 192, 192, 4, 4 if case == "key_bias" else 2, 256, jnp.bfloat16)
    rng = np.random.default_rng(5)
    kwargs = dict(causal=True, kv_lengths=jnp.array([192, 130]))
    if case == "value_dim_64":
        v = v[..., :64]
    elif case == "segments_and_mask":
        segment_ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, 192)), axis=1), jnp.int32)
        kwargs.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                      mask=jnp.asarray(rng.random((2, 4, 192, 192)) < 0.8))
    if case == "key_bias":  # float32 key vectors; the gradient's key sums come from the dK program
        bias = jnp.asarray(rng.normal(size=(2, 4, 1, 192)), jnp.float32)
        result, mosaic_backward, expected = interpreted_beside_reference(
            lambda q, k, v, b: flash_attention(q, k, v, bias=b, config=MOSAIC, **kwargs),
            lambda q, k, v, b: flash_attention_reference(q, k, v, bias=b, **kwargs), (q, k, v, bias),
            normal(7, q.shape))
        assert mosaic_backward
        assert_output_and_grads_close(result, expected, ("dq", "dk", "dv", "dbias"))
        return
    assert_mosaic_matches_reference(q, k, v, 8, **kwargs)


@pytest.mark.parametrize("dtype, backward", [(jnp.bfloat16, "triton"), (jnp.float32, "triton")])
def test_bias_tiles_at_head_dim_256(dtype, backward):
    """Bias tiles at head dim 256 keep Triton's backward: beside Q, dO and one K / V slot, the dQ kernel's bias
    ring and float32 dS staging need 247,904 B of shared memory with 16-bit tiles (of 232,448); read from the
    CUDA lowering (the compiled choice)."""
    q, k, v = (jnp.zeros((2, 1024, 8, 256), jnp.bfloat16),) * 3
    bias = jnp.zeros((2, 8, 1024, 1024), dtype)
    assert backward_kernels(lambda config: lambda *a: jnp.sum(flash_attention(
        *a[:3], bias=a[3], causal=True, config=config).astype(jnp.float32)), q, k, v, bias) == backward


@pytest.mark.parametrize("head_dims, num_kv_heads", [((256, 256), 4), ((256, 256), 2), ((128, 256), 2)])
def test_sliding_windows_at_head_dim_256_run_the_mosaic_backward(head_dims, num_kv_heads):
    """A sliding window at head dim 256, with GQA or without (the dQ pieces read their index vectors from shared
    memory per step: held in registers they spilled on sm_90a): the Mosaic backward, against the reference."""
    head_dim, value_dim = head_dims
    q, k, _ = random_qkv(8, 1, 256, 256, 4, num_kv_heads, head_dim, jnp.bfloat16)
    v = random_qkv(9, 1, 256, 256, 4, num_kv_heads, value_dim, jnp.bfloat16)[2]
    assert_mosaic_matches_reference(q, k, v, 10, window=(100, 0), kv_lengths=jnp.array([230]))


def _flex_beside_reference(q, k, v, seed: int, **kwargs):
    """`interpreted_beside_reference` of flex_attention (GQA) on backend "mosaic_interpret" and of its reference."""
    return interpreted_beside_reference(
        lambda q, k, v: flex_attention(q, k, v, enable_gqa=True, config=MOSAIC, **kwargs),
        lambda q, k, v: flex_attention_reference(q, k, v, enable_gqa=True, **kwargs), (q, k, v),
        normal(seed, (*q.shape[:3], v.shape[3])))


@pytest.mark.parametrize("mod, head_dims", [("document", (256, 256)), ("sliding_window", (256, 128))])
def test_flex_block_masks_at_head_dim_256_run_the_mosaic_backward(mod, head_dims):
    """A BlockMask's mask_mod at head dim 256 (a document mask's ids read as vectors along q_idx / kv_idx; a
    sliding window), its tables refined to dQ's 128 x 64 and dK/dV's 128 x 128 tiles, on 320 queries and keys
    (padded to 384): flex_attention runs the Mosaic backward (dQ and dK in pieces where q / k's head dim is 256,
    dV alone) and matches the reference's output and gradients, GQA 2:1."""
    (head_dim, value_dim), batch, seq = head_dims, 1, 320
    q, k, _ = random_qkv(11, batch, seq, seq, 4, 2, head_dim, jnp.bfloat16)
    v = random_qkv(12, batch, seq, seq, 4, 2, value_dim, jnp.bfloat16)[2]
    if mod == "document":
        mask_mod = document_mask(jnp.asarray(np.repeat([0, 1, 2], [90, 150, 80])[None], jnp.int32))
    else:
        mask_mod = sliding_window(70)
    block_mask = create_block_mask(mask_mod, batch, None, seq, seq, block_size=(128, 128))
    result, mosaic_backward, expected = _flex_beside_reference(q, k, v, 13, block_mask=block_mask)
    assert mosaic_backward
    assert_output_and_grads_close(result, expected)


@pytest.mark.parametrize("mod, head_dims, seq", [
    ("softcap", (128, 256), 320), ("alibi", (256, 128), 256), ("softcap_window", (256, 256), 320)])
def test_score_mods_at_head_dim_256_run_the_mosaic_backward(mod, head_dims, seq, dkv_calls):
    """A score_mod at head dim 256 runs the Mosaic backward with dK in 64-column pieces (a soft cap's derivative
    beside S^T and dP^T spilled the 128-column pieces on sm_90a): a soft cap with no BlockMask at (128, 256) on
    320 keys (padded for dK/dV's 128-key CTAs by the glue), ALiBi's slopes (read one element at a time) at
    (256, 128), and a soft cap on a sliding-window BlockMask at (256, 256); GQA 2:1, out and gradients against the
    reference."""
    (head_dim, value_dim), batch = head_dims, 1
    q, k, _ = random_qkv(16, batch, seq, seq, 4, 2, head_dim, jnp.bfloat16)
    v = random_qkv(17, batch, seq, seq, 4, 2, value_dim, jnp.bfloat16)[2]
    if mod == "alibi":
        kwargs = dict(score_mod=alibi(alibi_slopes(4)))
    elif mod == "softcap":
        kwargs = dict(score_mod=softcap(20.0))
    else:
        kwargs = dict(score_mod=softcap(20.0), block_mask=create_block_mask(
            sliding_window(70), batch, None, seq, seq, block_size=(128, 128)))
    result, mosaic_backward, expected = _flex_beside_reference(q, k, v, 18, **kwargs)
    assert mosaic_backward and {call.get("pieces", 1) for call in dkv_calls} == {max(1, head_dim // 64)}
    assert_output_and_grads_close(result, expected)


def test_dk_pieces_of_64_columns_need_a_split():
    """dK's 64-column pieces: head_dim / 64 of them, and only in a split."""
    q = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
    lengths = jnp.array([128], jnp.int32)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    for pieces, split in ((3, True), (4, False), (8, True)):
        with pytest.raises(ValueError, match="pieces=|split=True"):
            mosaic_backward_dkv(q, q, q, q, lse, q, lengths, lengths, scale=0.1, causal=True, interpret=True,
                                num_stages=1, split=split, pieces=pieces)


@pytest.mark.parametrize("case", ["key_vector_score_mod", "blocks_of_64_keys"])
def test_what_keeps_triton_backward_at_head_dim_256(case):
    """At head dim 256 a score_mod that reads an array along kv_idx with no BlockMask (its vectors along keys
    would not span the 128-key CTAs the glue pads k and v to) and a BlockMask of 64-key blocks (finer than
    dK/dV's 128-key tiles; the forward's 64-key steps take it) run Triton's backward beside the Mosaic forward,
    and match the reference."""
    q, k, v = random_qkv(14, 1, 320, 320, 4, 2, 256, jnp.bfloat16)
    if case == "key_vector_score_mod":
        key_bias = jnp.asarray(np.random.default_rng(3).normal(size=(1, 320)), jnp.float32)
        kwargs = dict(score_mod=lambda score, b, h, q_idx, kv_idx: score + key_bias[b, kv_idx])
    else:
        kwargs = dict(block_mask=create_block_mask(sliding_window(70), 1, None, 320, 320, block_size=(128, 64)))
    result, mosaic_backward, expected = _flex_beside_reference(q, k, v, 15, **kwargs)
    assert not mosaic_backward
    assert_output_and_grads_close(result, expected)
