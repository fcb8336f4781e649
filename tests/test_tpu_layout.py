"""The Mosaic TPU kernels' in-place layout (`probjax_kernels.tpu.common.SeqLayout`): with head dims that are
multiples of 128 the forward, dQ, dK/dV and tangent kernels read q, k, v, dO and write out, dQ, dK, dV in the
core's `[B, T, N, D]` layout, a block of heads per program, with lse / delta as lane-dense rows. In TPU
interpret mode against the float64 NumPy reference and the plain-jnp one: MHA, GQA with head blocks smaller
than N, per-head bias with its gradient, masks, segments, dropout, Dv != D, shared K / V, hooks with a
BlockMask, the jvp; and which calls take the transposed layout instead."""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, bernoulli, normal, numpy_allowed, numpy_attention, random_qkv
from test_tpu_kernels import TPU, check_gradients, finite

from probjax_kernels import (
    FlashConfig, alibi, create_block_mask, flash_attention, flash_attention_reference, flex_attention,
    flex_attention_reference, sliding_window,
)
from probjax_kernels.tpu import common

_layouts = []


@pytest.fixture(autouse=True)
def record_layouts(monkeypatch):
    """Records the layout each kernel call picks (`common.kernel_layout`)."""
    original = common.kernel_layout

    def recording(problem, q, v, num_kv_heads, kernel, *args, **kwargs):
        layout = original(problem, q, v, num_kv_heads, kernel, *args, **kwargs)
        _layouts.append((kernel, layout))
        return layout

    _layouts.clear()
    monkeypatch.setattr(common, "kernel_layout", recording)
    yield


def in_place_heads(kernels=("forward", "dq", "dkv")) -> set[int]:
    """The head blocks the `kernels` took (0: transposed). A gradient traces the tangent kernel too (jax.grad
    linearizes through the jvp), which the backward kernels then replace."""
    found = {layout.heads for kernel, layout in _layouts if kernel in kernels}
    assert found, "no TPU kernel ran"
    return found


BF16 = jnp.bfloat16
BUDGET = 24 << 20  # 3/4 of the VMEM limit the in-place kernels ask of a v5e (chips.Chip.vmem_limit)


@pytest.mark.parametrize("num_heads, num_kv_heads, tile, heads", [
    (2, 2, (256, 512), 0), (4, 2, (256, 512), 0), (8, 8, (256, 512), 8), (16, 16, (256, 512), 8),
    (16, 2, (256, 512), 8), (32, 8, (256, 512), 8), (3, 3, (256, 512), 0), (24, 24, (512, 512), 8),
    (128, 2, (512, 512), 0)])
def test_head_blocks(num_heads, num_kv_heads, tile, heads):
    """The head block: the fewest query heads that fill whole sublane tiles (a multiple of 8) and hold whole
    GQA groups, with the forward's blocks, staging copies and scratch within the budget (GQA 64:1 needs 64
    heads a block, too large on 512 x 512 tiles: transposed, heads 0); kv heads in place only as a
    multiple of 8 too; fewer than 8 heads, a head dim of 64, a hook array tiled per head, a per-head
    BlockMask or float32 / float16 inputs take the transposed layout."""

    class Problem:  # what the layout reads of a call
        table_shape = None
        features = type("F", (), {"score_mod": None, "mask_mod": None})()
        config = None

    layout = common.seq_layout(Problem, num_heads, num_kv_heads, (128, 128), BF16, "forward", tile, False, BUDGET)
    assert (layout.heads, layout.group) == (heads, num_heads // num_kv_heads)
    assert layout.kv_in_place == (heads > 0 and (heads // layout.group) % 8 == 0)
    assert not common.seq_layout(Problem, num_heads, num_kv_heads, (64, 64), BF16, "forward", tile, False, BUDGET).in_place
    assert not common.seq_layout(Problem, num_heads, num_kv_heads, (256, 256), BF16, "forward", tile, False, BUDGET).in_place
    assert not common.seq_layout(Problem, num_heads, num_kv_heads, (128, 128), BF16, "forward", tile, True, BUDGET).in_place
    for other in (jnp.float32, jnp.float16):
        assert not common.seq_layout(Problem, num_heads, num_kv_heads, (128, 128), other, "forward", tile, False,
                                     BUDGET).in_place
    Problem.table_shape = (1, num_heads)
    assert not common.seq_layout(Problem, num_heads, num_kv_heads, (128, 128), BF16, "forward", tile, False, BUDGET).in_place


def test_mha_causal_lengths_bias_mask_gradients_in_place():
    """8 heads (one block, K / V in place too), ragged T / S 150 / 300, causal, lengths, a per-head bias
    [1, N, T, S] with its gradient (the dQ kernel writes dS per head of the block) and a dense mask, bfloat16,
    head dim 128. The dQ tile is 128 x 256: on v5e's 256 x 512 the per-head bias, dS and mask blocks of 8 heads
    pass the in-place budget (`kernel_vmem`'s tile arrays), and that kernel runs transposed."""
    q, k, v = random_qkv(30, 2, 150, 300, 8, 8, 128, jnp.bfloat16)
    q_lengths, kv_lengths = jnp.array([150, 90]), jnp.array([300, 200])
    bias = normal(31, (1, 8, 150, 300))
    mask = bernoulli(32, 0.85, (2, 1, 150, 300))
    kwargs = dict(causal=True, q_lengths=q_lengths, kv_lengths=kv_lengths, mask=mask)
    config = FlashConfig(backend="tpu_interpret", block_q_dq=128, block_k_dq=256)
    (out, lse), _ = check_gradients(
        lambda q, k, v, b: flash_attention(q, k, v, bias=b, return_lse=True, config=config, **kwargs),
        lambda q, k, v, b: flash_attention_reference(q, k, v, bias=b, return_lse=True, **kwargs),
        (q, k, v, bias), jnp.bfloat16)
    assert in_place_heads() == {8}
    allowed = numpy_allowed(2, 150, 300, causal=True, q_lengths=np.asarray(q_lengths),
                            kv_lengths=np.asarray(kv_lengths), mask=np.asarray(mask))
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed, bias=bias)
    assert_close(out, expected, jnp.bfloat16, "out")
    assert np.array_equal(np.isfinite(lse), np.isfinite(expected_lse))
    assert_close(finite(lse), finite(jnp.asarray(expected_lse, jnp.float32)), jnp.bfloat16, "lse")


def test_gqa_in_blocks_of_8_heads_bf16_window_segments_dropout():
    """16 query heads over 16 kv heads in two blocks of 8, then GQA 8:2 (one block of all heads), bfloat16,
    a two-sided window, segment ids and dropout (the keep mask of every backend): gradients."""
    segments = jnp.repeat(jnp.arange(3), 46)[None, :130]
    kwargs = dict(window=(60, 20), q_segment_ids=segments, kv_segment_ids=segments, dropout_rate=0.2,
                  dropout_seed=5)
    for num_heads, kv_heads, heads in ((16, 16, 8), (8, 2, 8)):
        _layouts.clear()
        q, k, v = random_qkv(33, 1, 130, 130, num_heads, kv_heads, 128, jnp.bfloat16)
        check_gradients(lambda q, k, v: flash_attention(q, k, v, return_lse=True, config=TPU, **kwargs),
                        lambda q, k, v: flash_attention_reference(q, k, v, return_lse=True, **kwargs), (q, k, v),
                        jnp.bfloat16)
        assert in_place_heads() == {heads}


def test_shared_kv_in_place_and_float16_transposed():
    """k / v of batch 1 shared by a batch of 2 (the dK/dV kernel's float32 per-batch blocks), GQA 8:2 (K / V
    transposed, a (2, rows, D) block): gradients in bfloat16 (in place) and float16 (float32 inside the
    kernels, the transposed layout). (Dv != D takes the transposed layout: tests/test_tpu_kernels.py.)"""
    for dtype, heads in ((jnp.bfloat16, 8), (jnp.float16, 0)):
        _layouts.clear()
        q, k, v = random_qkv(34, 2, 140, 140, 8, 2, 128, dtype)
        k, v = k[:1], v[:1]
        check_gradients(lambda q, k, v: flash_attention(q, k, v, causal=True, return_lse=True, config=TPU),
                        lambda q, k, v: flash_attention_reference(q, k, v, causal=True, return_lse=True),
                        (q, k, v), dtype)
        assert in_place_heads() == {heads}


def test_hooks_with_a_block_mask_and_jvp_in_place():
    """ALiBi's per-head slopes (SMEM) with a sliding-window BlockMask shared by the heads (one walk per head
    block), GQA 8:4: gradients including the slopes', and the tangent kernel's jvp, bfloat16."""
    q, k, v = random_qkv(36, 1, 200, 260, 8, 4, 128, jnp.bfloat16)
    block_mask = create_block_mask(sliding_window(90), None, None, 200, 260)
    slopes = 2.0 ** -jnp.arange(1.0, 9.0)

    def attend(attention, **extra):
        def call(q, k, v, slopes):
            return attention(q, k, v, score_mod=alibi(slopes), block_mask=block_mask, enable_gqa=True,
                             return_lse=True, **extra)
        return call

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the XLA fallback warns
        check_gradients(attend(flex_attention, config=TPU), attend(flex_attention_reference), (q, k, v, slopes),
                        jnp.bfloat16)
        tangents = tuple(normal(40 + i, x.shape, x.dtype)
                         for i, x in enumerate((q, k, v)))
        jvp = jax.jit(lambda f, p, t: jax.jvp(f, p, t), static_argnums=0)
        (_, (d_out, d_lse)) = jvp(lambda q, k, v: attend(flex_attention, config=TPU)(q, k, v, slopes), (q, k, v),
                                  tangents)
    assert in_place_heads(("forward", "dq", "dkv", "tangent")) == {8}
    (_, (want_out, want_lse)) = jvp(lambda q, k, v: attend(flex_attention_reference)(q, k, v, slopes), (q, k, v),
                                    tangents)
    assert_close(d_out, want_out, jnp.bfloat16, "d out")
    assert_close(finite(d_lse), finite(want_lse), jnp.bfloat16, "d lse")


def test_per_head_block_mask_takes_the_transposed_layout():
    """A BlockMask whose tables differ per head walks different key tiles per head: one head per program,
    transposed, exact all the same."""
    q, k, v = random_qkv(37, 1, 256, 256, 8, 8, 128)

    def per_head(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 128 * (h % 2)

    block_mask = create_block_mask(per_head, None, 8, 256, 256)
    out = jax.jit(lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, config=TPU))(q, k, v)
    assert in_place_heads() == {0}
    allowed = np.arange(256)[None, :] <= np.arange(256)[:, None] + 128 * (np.arange(8) % 2)[:, None, None]
    expected, _ = numpy_attention(q, k, v, allowed=allowed[None])
    assert_close(out, expected, jnp.float32, "out")


@pytest.mark.parametrize("fused_backward", [False, True])
def test_in_place_program_has_no_layout_copy(fused_backward):
    """The lowered fwd + bwd program holds no [B, T, N, D] <-> [B, N, T, D] transpose of q, k, v, dO or the
    results at head dim 128, bf16 (the transposed layout's head dim 64 holds them; the kernels' own (rows, 1)
    <-> (1, rows) transposes of row statistics are not counted), with the two backward kernels or the fused
    one (its float32 dQ accumulates in [B, T, N, D]). The program is lowered, not a jaxpr printed: the
    backward kernels are reached through custom_linear's transpose only as the program is lowered."""
    config = dataclasses.replace(TPU, fused_backward=fused_backward)

    def count_transposes(head_dim):
        q, k, v = random_qkv(38, 1, 256, 256, 8, 8, head_dim, jnp.bfloat16)
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, config=config).astype(jnp.float32))  # noqa: E731
        text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).as_text()
        return len(re.findall(r"stablehlo\.transpose .*dims = \[0, 2, 1, 3\]", text))

    assert count_transposes(128) == 0
    assert count_transposes(64) > 0
