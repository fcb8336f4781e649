"""The Mosaic GPU (Hopper) tangent kernel at head dim 256, in the Mosaic GPU CPU interpreter against `jax.jvp` of
the float32 plain-jnp reference: d out in 128-column pieces where v's head dim is 256, the tangents of q, k and v
each from programs of their own (`split`, on one ring slot) where q / k's is; through `flash_attention` on
backend "mosaic_interpret" with the features the plan gives it there; and the refusals of the spilling or
overflowing forms.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
from test_mosaic_tangent import MOSAIC, assert_kernel_matches_reference, assert_the_mosaic_tangent_matches

from probjax_kernels import (
    create_block_mask,
    flash_attention,
    flash_attention_reference,
    flex_attention,
    flex_attention_reference,
)
from probjax_kernels.flex.mods import alibi, alibi_slopes, document_mask, sliding_window, softcap
from probjax_kernels.mosaic.plan import WIDE_STAGES
from probjax_kernels.mosaic.tangent import mosaic_tangent


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize(
    "head_dims, moving, causal, window, num_kv_heads",
    [
        ((256, 256), "qkv", True, (None, None), 1),  # pieces and split; GQA 2:1
        ((256, 64), "qv", False, (100, 20), 2),  # split, one piece: out its own tile
        ((128, 256), "k", True, (None, None), 2),  # pieces on two ring slots, no split
    ],
)
def test_the_kernel_at_head_dim_256_matches_the_reference(head_dims, moving, causal, window, num_kv_heads):
    """(d out, d lse) on ragged lengths (a sequence whose last rows and keys are padding; one whose keys all
    are, whose rows get zero tangents)."""
    head_dim, value_dim = head_dims
    split = head_dim > 128
    assert_kernel_matches_reference(head_dims, moving, num_kv_heads, [200, 256], [77, 0], causal=causal,
                                    window=window, pieces=max(1, value_dim // 128), split=split,
                                    num_stages=WIDE_STAGES if split else 2)


def test_the_pieces_and_the_split_are_required_at_256():
    """One program for v's 256 columns (its accumulator spills) and Q, dQ, K, dK, V, dV and out in one program's
    shared memory are refused, naming what to pass."""
    q, k, v = random_qkv(0, 1, 128, 128, 2, 2, 256, jnp.bfloat16)
    lengths = jnp.full((1,), 128, jnp.int32)
    lse2 = jnp.zeros((1, 2, 128), jnp.float32)
    tangents = dict(dq=q, dk=k, dv=v)
    with pytest.raises(ValueError, match="pieces=1 at head_dim=256"):
        mosaic_tangent(q, k, v, q, lse2, lengths, lengths, **tangents, scale=0.1, causal=True, interpret=True)
    with pytest.raises(ValueError, match="bytes of SMEM for the tangents of"):
        mosaic_tangent(q, k, v, q, lse2, lengths, lengths, **tangents, scale=0.1, causal=True, interpret=True,
                       pieces=2, num_stages=1)
    with pytest.raises(ValueError, match="pieces=4 at head_dim=128"):  # 32 columns: narrower than 64
        mosaic_tangent(q, k, v[..., :128], q[..., :128], lse2, lengths, lengths, dq=q, scale=0.1, causal=True,
                       interpret=True, pieces=4)


@pytest.mark.parametrize("case", ["gqa_lengths", "value_dim_64", "segments_and_mask"])
def test_flash_attention_jvp_at_head_dim_256_runs_the_mosaic_tangent(case, tangent_calls):
    """jax.jvp of flash_attention on backend "mosaic_interpret" at head dim 256 runs the Mosaic tangent kernel
    (split; in pieces where v's head dim is 256 too) and matches the reference's: GQA 2:1 on ragged keys, v's
    head dim 64, segment ids with a dense mask (their shared memory beside the one-slot rings)."""
    batch, seq, num_heads = 2, 192, 4
    q, k, v = random_qkv(4, batch, seq, seq, num_heads, 2, 256, jnp.bfloat16)
    tangents = list(random_qkv(5, batch, seq, seq, num_heads, 2, 256, jnp.bfloat16))
    rng = np.random.default_rng(6)
    options = dict(causal=True, kv_lengths=jnp.array([192, 130]))
    if case == "value_dim_64":
        v, tangents[2] = v[..., :64], tangents[2][..., :64]
    elif case == "segments_and_mask":
        segment_ids = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seq)), axis=1), jnp.int32)
        options.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                       mask=jnp.asarray(rng.random((batch, num_heads, seq, seq)) < 0.8))
    assert_the_mosaic_tangent_matches(
        lambda q, k, v: flash_attention(q, k, v, config=MOSAIC, **options),
        lambda q, k, v: flash_attention_reference(q, k, v, **options), (q, k, v), tangents, tangent_calls)


def test_flex_mask_mods_at_head_dim_256_run_the_mosaic_tangent(tangent_calls):
    """A document mask (ids read as vectors along q_idx / kv_idx) under its BlockMask (the tables refined to the
    tangent's tiles) at head dim 256: jax.jvp of flex_attention on backend "mosaic_interpret" against the
    reference's, GQA 2:1."""
    batch, seq, num_heads = 1, 256, 4
    q, k, v = random_qkv(9, batch, seq, seq, num_heads, 2, 256, jnp.bfloat16)
    tangents = random_qkv(10, batch, seq, seq, num_heads, 2, 256, jnp.bfloat16)
    mask_mod = document_mask(jnp.asarray(np.repeat([0, 1, 2], [90, 100, 66])[None], jnp.int32))
    block_mask = create_block_mask(mask_mod, batch, None, seq, seq, block_size=(128, 128))
    assert_the_mosaic_tangent_matches(
        lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, config=MOSAIC),
        lambda q, k, v: flex_attention_reference(q, k, v, block_mask=block_mask, enable_gqa=True), (q, k, v),
        tangents, tangent_calls)


@pytest.mark.parametrize("mod, head_dims", [("softcap", (128, 256)), ("softcap_window", (256, 256))])
def test_score_mods_at_head_dim_256_run_the_mosaic_tangent(mod, head_dims, tangent_calls):
    """A score_mod at head dim 256 runs the Mosaic tangent with d out in 64-column pieces (a soft cap's derivative
    beside S' spilled k's program with 128-column ones on sm_90a): a soft cap at (128, 256) on 320 queries and
    keys (four pieces), a soft cap on a sliding-window BlockMask at (256, 256) (split, four pieces each); GQA
    2:1, jax.jvp of flex_attention on backend "mosaic_interpret" against the reference's."""
    (head_dim, value_dim), batch, seq, num_heads = head_dims, 1, 320 if mod == "softcap" else 256, 4
    q, k, _ = random_qkv(11, batch, seq, seq, num_heads, 2, head_dim, jnp.bfloat16)
    v = random_qkv(12, batch, seq, seq, num_heads, 2, value_dim, jnp.bfloat16)[2]
    tangents = [*random_qkv(13, batch, seq, seq, num_heads, 2, head_dim, jnp.bfloat16)[:2],
                random_qkv(14, batch, seq, seq, num_heads, 2, value_dim, jnp.bfloat16)[2]]
    options = dict(score_mod=softcap(20.0), enable_gqa=True)
    if mod == "softcap_window":
        options["block_mask"] = create_block_mask(sliding_window(90), batch, None, seq, seq, block_size=(128, 128))
    assert_the_mosaic_tangent_matches(
        lambda q, k, v: flex_attention(q, k, v, config=MOSAIC, **options),
        lambda q, k, v: flex_attention_reference(q, k, v, **options), (q, k, v), tangents, tangent_calls)
    assert {call.get("pieces") for call in tangent_calls} == {4}
    assert {bool(call.get("split")) for call in tangent_calls} == {head_dim > 128}



def test_moving_alibi_slopes_at_head_dim_256_run_the_mosaic_tangent(tangent_calls):
    """ALiBi's slopes moving at head dim 256: their tangents ride in q's programs of the split (four 64-column
    pieces each), and in programs of their own when only the slopes move; jax.jvp of flex_attention in q, k, v and
    the slopes, and in the slopes alone, against the reference's, GQA 2:1, 192 queries and keys."""
    batch, seq, num_heads = 1, 192, 4
    q, k, v = random_qkv(17, batch, seq, seq, num_heads, 2, 256, jnp.bfloat16)
    tangents = random_qkv(18, batch, seq, seq, num_heads, 2, 256, jnp.bfloat16)
    slopes, d_slopes = alibi_slopes(num_heads), jnp.linspace(-1.0, 1.0, num_heads, dtype=jnp.float32)

    def attend(attention, **config):
        return lambda q, k, v, slopes: attention(q, k, v, alibi(slopes), enable_gqa=True, **config)

    assert_the_mosaic_tangent_matches(attend(flex_attention, config=MOSAIC), attend(flex_attention_reference),
                                      (q, k, v, slopes), (*tangents, d_slopes), tangent_calls)
    assert all(call.get("pieces") == 4 and call.get("split") and call.get("score_tangents") for call in tangent_calls)
    tangent_calls.clear()
    assert_the_mosaic_tangent_matches(
        lambda slopes: attend(flex_attention, config=MOSAIC)(q, k, v, slopes),
        lambda slopes: attend(flex_attention_reference)(*(x.astype(jnp.float32) for x in (q, k, v)), slopes),
        (slopes,), (d_slopes,), tangent_calls)
