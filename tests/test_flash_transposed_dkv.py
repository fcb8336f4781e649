"""The Triton dK/dV kernel on transposed score tiles (S^T = K Q^T, `triton_plan.dkv_transposed`: 16-bit at
head dim 128 / 256 on Hopper), run in interpret mode on small tiles against the reference's gradients: masks,
lengths that end inside a tile, GQA, a bias, segments, a score_mod reading a captured table, a BlockMask and
dropout; and where the dispatch picks it."""

import dataclasses
import types

import jax.numpy as jnp
import pytest
from helpers import assert_close, normal, output_and_grads, random_qkv

from probjax_kernels import _backend
from probjax_kernels import (
    FlashConfig, _dispatch, and_masks, causal_mask, create_block_mask, default_config, document_mask,
    flash_attention,
    flash_attention_reference, flex_attention, flex_attention_reference, relative_bias,
)
from probjax_kernels.triton import plan as triton_plan

# Key tiles twice the query step, as on Hopper (64 keys, 32 queries); a query step of 16 cuts the lengths.
TILES = FlashConfig(block_q=16, block_k=32, block_q_dq=16, block_k_dq=32, block_q_dkv=16, block_k_dkv=32,
                    backend="interpret")


@pytest.fixture(params=[False, True], ids=["one_program", "dv_and_dk_programs"])
def transposed(request, monkeypatch):
    """Every call takes the transposed dK/dV kernel, in one program per key tile or in two (dV's and dK's,
    `triton_plan.retile.dkv_split`); the calls are counted, so a test sees it was chosen."""
    calls = []

    def choose(config, dtype, head_dim, bias=False, device=None):
        calls.append(head_dim)
        return True

    monkeypatch.setattr(triton_plan, "dkv_transposed", choose)
    splits = []
    monkeypatch.setattr(triton_plan.retile, "dkv_split", lambda *_: splits.append(request.param) or request.param)
    yield calls
    assert splits and all(split == request.param for split in splits)


def _check(fn, reference, args, dtype, factor=1.0, value_dim=None):
    cotangent = normal(5, (*args[0].shape[:3], value_dim or args[0].shape[3]), jnp.float32)
    out, grads = output_and_grads(fn, args, cotangent)
    expected_out, expected = output_and_grads(reference, args, cotangent)
    assert_close(out, expected_out, dtype, "out")
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), grads, expected):
        assert_close(a, e, dtype, name, factor)


def test_flash_masks_lengths_bias_and_gqa(transposed):
    dtype = jnp.float32  # float32's tolerance catches a wrong mask row or contraction that bfloat16's hides
    q, k, v = random_qkv(60, 2, 45, 70, 4, 2, 32, dtype)
    bias = normal(61, (2, 1, 45, 70), jnp.float32)
    seg_q = jnp.array([[0] * 20 + [1] * 25, [2] * 45], jnp.int32)
    seg_kv = jnp.array([[0] * 30 + [1] * 40, [2] * 70], jnp.int32)
    kwargs = dict(causal=True, window=(20, None), q_lengths=jnp.array([45, 30], jnp.int32),
                  kv_lengths=jnp.array([70, 41], jnp.int32), q_segment_ids=seg_q, kv_segment_ids=seg_kv)

    def run(attention, **extra):
        return lambda q, k, v, bias: attention(q, k, v, bias=bias, **kwargs, **extra)

    _check(run(flash_attention, config=TILES), run(flash_attention_reference), (q, k, v, bias), dtype, 1.5)
    assert transposed


def test_flex_score_mod_block_mask_and_dropout(transposed):
    dtype = jnp.bfloat16  # the inputs the dispatch transposes for (P^T and dS^T cast to bfloat16 before dV, dK)
    t = 64
    q, k, v = random_qkv(62, 2, t, t, 4, 2, 32, dtype)
    docs = jnp.array([[0] * 24 + [1] * 40, [0] * 50 + [1] * 14], jnp.int32)
    score_mod = relative_bias(0.3 * normal(63, (4, 2 * t - 1)))
    block_mask = create_block_mask(and_masks(causal_mask, document_mask(docs)), 2, None, t, t, block_size=32)
    kwargs = dict(enable_gqa=True, dropout_rate=0.2, dropout_seed=jnp.uint32(7))

    def run(attention, **extra):
        return lambda q, k, v: attention(q, k, v, score_mod, block_mask, **kwargs, **extra)

    _check(run(flex_attention, config=TILES), run(flex_attention_reference), (q, k, v), dtype, 1.5)
    assert transposed


def test_split_grid_per_query_head_with_shared_kv_and_another_value_dim(transposed, monkeypatch):
    """The split grid's fourth axis beside the per-query-head grid (GQA on a GPU), k / v of batch 1 shared by
    the batch (their float32 gradients summed by XLA) and a value head dim other than q / k's."""
    monkeypatch.setattr(triton_plan.retile, "dkv_per_query_head", lambda problem: True)
    dtype = jnp.float32
    q = normal(64, (2, 40, 4, 32), dtype)
    k = normal(65, (1, 50, 2, 32), dtype)
    v = normal(66, (1, 50, 2, 16), dtype)
    bias = normal(67, (2, 4, 40, 50), jnp.float32)
    kwargs = dict(causal=True, kv_lengths=jnp.array([50, 33], jnp.int32))

    def run(attention, **extra):
        return lambda q, k, v, bias: attention(q, k, v, bias=bias, **kwargs, **extra)

    _check(run(flash_attention, config=TILES), run(flash_attention_reference), (q, k, v, bias), dtype, 1.5,
           value_dim=16)
    assert transposed


@pytest.mark.parametrize("capability, backend, dtype, head_dim, expected", [
    ("9.0", "triton", jnp.bfloat16, 256, True), ("9.0", "triton", jnp.float16, 128, True),
    ("9.0", "mosaic", jnp.bfloat16, 256, True), ("8.0", "mosaic_interpret", jnp.bfloat16, 256, True),
    ("9.0", "triton", jnp.bfloat16, 64, False),
    ("9.0", "triton", jnp.float32, 256, False), ("8.0", "triton", jnp.bfloat16, 256, False),
    ("9.0", "interpret", jnp.bfloat16, 256, False),
])
def test_the_dispatch_transposes_on_hopper_for_16_bit_inputs(capability, backend, dtype, head_dim, expected,
                                                             monkeypatch):
    """K Q^T on Hopper (a 9.x device, or the Mosaic backends) for 16-bit inputs at head dim 128 / 256 on the
    default tiles; with a dense bias at head dim 256 only, never where the key tile is smaller than the query
    tile."""
    monkeypatch.setattr(_backend, "target_device", lambda: types.SimpleNamespace(compute_capability=capability))
    config = default_config(FlashConfig(backend=backend), q_len=1024, kv_len=1024, head_dim=head_dim, dtype=dtype)
    assert triton_plan.dkv_transposed(config, dtype, head_dim) == expected
    assert triton_plan.dkv_transposed(config, dtype, head_dim, bias=True) == (expected and head_dim > 128)
    narrow = dataclasses.replace(config, block_q_dkv=64, block_k_dkv=32)
    assert not triton_plan.dkv_transposed(narrow, dtype, head_dim)
