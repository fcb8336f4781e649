"""FlashConfig(backend="tpu_interpret"): the Mosaic TPU kernels (forward, dQ, dK/dV, tangent) run in Pallas'
TPU interpret mode on the CPU, through `flash_attention` / `flex_attention`, against the plain-jnp and the
float64 NumPy references; and the XLA path, with a warning naming the op, for a hook Mosaic TPU cannot lower.
Shapes are tiny and configs few: each one costs an interpret-mode compile."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, bernoulli, normal, numpy_allowed, numpy_attention, random_qkv

from probjax_kernels import (
    AuxRequest, FlashConfig, alibi, create_block_mask, flash_attention, flash_attention_reference,
    flex_attention, flex_attention_reference, relative_bias, sliding_window, softcap,
)
from probjax_kernels import _dispatch
from probjax_kernels.tpu import plan as tpu_plan

TPU = FlashConfig(backend="tpu_interpret")


def finite(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


def check_gradients(kernel, reference, args, dtype, factor=1.0):
    """Gradients in every argument of sum(out * cotangent) + sum(lse) (the finite entries), kernel against
    reference, from one pass of the kernels (`jax.vjp`, whose primal outputs (out, lse, ...) it returns with the
    reference's, for the caller to check too: each interpret-mode kernel call costs a compile). Under one jit:
    eagerly, every op around the kernels is an XLA compile of its own."""

    @jax.jit
    def run(args):
        outputs, kernel_vjp = jax.vjp(kernel, *args)
        expected_outputs, reference_vjp = jax.vjp(reference, *args)
        cotangent = normal(7, outputs[0].shape, jnp.float32).astype(outputs[0].dtype)
        lse_cotangent = jnp.isfinite(expected_outputs[1]).astype(jnp.float32)
        rest = [jnp.zeros_like(x) for x in outputs[2:]]
        grads = kernel_vjp((cotangent, lse_cotangent, *rest))
        expected = reference_vjp((cotangent.astype(expected_outputs[0].dtype), lse_cotangent, *rest))
        return outputs, expected_outputs, grads, expected

    outputs, expected_outputs, grads, expected = run(tuple(args))
    for i, (got, want) in enumerate(zip(grads, expected)):
        assert_close(got, want, dtype, f"grad {i}", factor)
    return outputs, expected_outputs


def test_causal_gqa_lengths_bias_mask_against_float64_and_gradients():
    """Ragged T / S (77 / 200: one padded 128-row tile, two key tiles), GQA 2:1, causal, per-batch lengths,
    a broadcast [1, N, T, S] bias (differentiable) and a dense [B, 1, T, S] mask, in float32."""
    q, k, v = random_qkv(0, 2, 77, 200, 2, 1, 64)
    q_lengths, kv_lengths = jnp.array([77, 50]), jnp.array([200, 120])
    bias = normal(4, (1, 2, 77, 200))
    mask = bernoulli(5, 0.8, (2, 1, 77, 200))
    kwargs = dict(causal=True, q_lengths=q_lengths, kv_lengths=kv_lengths, mask=mask)
    (out, lse), _ = check_gradients(
        lambda q, k, v, b: flash_attention(q, k, v, bias=b, return_lse=True, config=TPU, **kwargs),
        lambda q, k, v, b: flash_attention_reference(q, k, v, bias=b, return_lse=True, **kwargs),
        (q, k, v, bias), jnp.float32)
    allowed = numpy_allowed(2, 77, 200, causal=True, q_lengths=np.asarray(q_lengths),
                            kv_lengths=np.asarray(kv_lengths), mask=np.asarray(mask))
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed, bias=bias)
    assert_close(out, expected, jnp.float32, "out")
    assert np.array_equal(np.isfinite(lse), np.isfinite(expected_lse))
    assert_close(finite(lse), finite(jnp.asarray(expected_lse, jnp.float32)), jnp.float32, "lse")


def test_bf16_window_segments_value_dim_shared_kv_and_dropout():
    """A two-sided window, segment ids, Dv != D, k / v of batch 1 shared by the batch and dropout with the
    keep mask every backend uses (`dropout_keep_mask`, the reference's), in bfloat16: gradients."""
    q, k, _ = random_qkv(1, 2, 130, 130, 2, 2, 64, jnp.bfloat16)
    k = k[:1]
    v = normal(2, (1, 130, 2, 32), jnp.float32).astype(jnp.bfloat16)
    segments = jnp.stack([jnp.repeat(jnp.arange(2), 65), jnp.repeat(jnp.arange(3), 44)[:130]])
    kwargs = dict(window=(40, 10), q_segment_ids=segments, kv_segment_ids=segments, dropout_rate=0.3,
                  dropout_seed=11)
    check_gradients(lambda q, k, v: flash_attention(q, k, v, return_lse=True, config=TPU, **kwargs),
                    lambda q, k, v: flash_attention_reference(q, k, v, return_lse=True, **kwargs), (q, k, v),
                    jnp.bfloat16)


def test_flex_hooks_block_mask_and_captured_array_gradient():
    """ALiBi (slopes read per head from SMEM) under a soft cap with a sliding-window BlockMask, GQA, and the
    slopes' gradient (the XLA pass over query chunks); the row max of AuxRequest."""
    q, k, v = random_qkv(8, 1, 200, 260, 2, 1, 64)
    block_mask = create_block_mask(sliding_window(70), None, None, 200, 260)

    def attend(attention):
        def call(q, k, v, slopes):
            def score_mod(score, b, h, q_idx, kv_idx):
                return softcap(20.0)(alibi(slopes)(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

            out, aux = attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                 return_aux=AuxRequest(lse=True, max_scores=True),
                                 **({"config": TPU} if attention is flex_attention else {}))
            return out, aux.lse, aux.max_scores

        return call

    slopes = jnp.array([0.5, 0.25])
    got, want = check_gradients(attend(flex_attention), attend(flex_attention_reference), (q, k, v, slopes),
                                jnp.float32)
    for name, x, y in zip(("out", "lse", "max_scores"), got, want):
        assert_close(finite(x), finite(y), jnp.float32, name)


def test_block_mask_coarser_than_the_tiles_runs_in_the_kernels():
    """A BlockMask of 512 x 512 blocks against interpret mode's (v5e's) tiles: forward and tangent 256 x 512,
    dQ and dK/dV 256 x 256, each walking the tables refined to its tile (two or four tiles per block), with no
    XLA fallback. A per-head window (the tables differ per query head, GQA 2:1) over ragged tiles (T = 520,
    S = 700): out, lse, the gradients of q, k, v and the jvp against the plain-jnp reference, float32."""
    q, k, v = random_qkv(21, 1, 520, 700, 2, 1, 32)

    def per_head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 400 * h) & (kv_idx >= q_idx - 100)

    block_mask = create_block_mask(per_head_window, None, 2, 520, 700, BLOCK_SIZE=512)
    skipped = np.asarray(block_mask.tile_sparsity())[0]
    assert skipped[0] > 0 and skipped[1] == 0  # head 0 skips a block, head 1 visits every one

    def attend(attention, **extra):
        return lambda q, k, v: attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True,
                                         **extra)

    tangents = tuple(normal(40 + i, x.shape) for i, x in enumerate((q, k, v)))
    jvp = jax.jit(lambda f, p, t: jax.jvp(f, p, t), static_argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the XLA fallback warns
        (out, lse), (expected, expected_lse) = check_gradients(
            attend(flex_attention, config=TPU), attend(flex_attention_reference), (q, k, v), jnp.float32)
        _, (d_out, _) = jvp(attend(flex_attention, config=TPU), (q, k, v), tangents)
    _, (want_out, _) = jvp(attend(flex_attention_reference), (q, k, v), tangents)
    assert_close(out, expected, jnp.float32, "out")
    assert_close(finite(lse), finite(expected_lse), jnp.float32, "lse")
    assert_close(d_out, want_out, jnp.float32, "d out")


def test_jvp_against_reference():
    """Forward mode through the TPU tangent kernel: tangents of q, k, v and the bias."""
    q, k, v = random_qkv(9, 1, 140, 140, 2, 1, 64)
    bias = normal(10, (1, 1, 140, 140))
    tangents = tuple(normal(20 + i, x.shape) for i, x in enumerate((q, k, v, bias)))

    def of(attention, **extra):
        return lambda q, k, v, b: attention(q, k, v, bias=b, causal=True, return_lse=True, **extra)

    # Under jit: the interpreter's ordered callbacks must thread through custom_linear's lowering.
    jvp = jax.jit(lambda p, t: jax.jvp(of(flash_attention, config=TPU), p, t))
    (out, lse), (d_out, d_lse) = jvp((q, k, v, bias), tangents)
    (_, _), (want_out, want_lse) = jax.jit(lambda p, t: jax.jvp(of(flash_attention_reference), p, t))(
        (q, k, v, bias), tangents)
    assert_close(d_out, want_out, jnp.float32, "d out")
    assert_close(d_lse, want_lse, jnp.float32, "d lse")


def test_gradient_under_jit():
    """`jit(grad)`: the backward kernels in the interpreter, reached through custom_linear's transpose."""
    q, k, v = random_qkv(15, 1, 70, 70, 2, 1, 32)
    cotangent = normal(16, q.shape)

    def loss(attention, **extra):
        return lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, **extra) * cotangent)

    grads = jax.jit(jax.grad(loss(flash_attention, config=TPU), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.jit(jax.grad(loss(flash_attention_reference), argnums=(0, 1, 2)))(q, k, v)
    for name, got, want in zip("qkv", grads, expected):
        assert_close(got, want, jnp.float32, f"d{name}")


def test_long_ragged_float16_forward():
    """T = S = 600 (five 128-row tiles and three 256-key tiles after padding), causal, float16 (computed in
    float32 inside the kernels)."""
    q, k, v = random_qkv(12, 1, 600, 600, 1, 1, 32, jnp.float16)
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, config=TPU))(q, k, v)
    expected, _ = numpy_attention(q, k, v, allowed=numpy_allowed(1, 600, 600, causal=True))
    assert out.dtype == jnp.float16
    assert_close(out, expected, jnp.float16, "out")


def test_a_hook_with_a_gather_falls_back_to_xla_with_a_warning():
    """relative_bias reads its table at kv_idx - q_idx: a vector gather, which Mosaic TPU cannot lower (a read
    at exactly q_idx / kv_idx is a tile: tests/test_tpu_tile_reads.py). The call warns, naming the op, and computes on XLA: forward,
    gradients (the table's too) and jvp."""
    q, k, v = random_qkv(13, 1, 24, 24, 2, 2, 32)
    table = normal(14, (2, 47))

    def of(attention, **extra):
        return lambda q, k, v, table: attention(q, k, v, score_mod=relative_bias(table), return_lse=True, **extra)

    tangents = tuple(normal(30 + i, x.shape) for i, x in enumerate((q, k, v, table)))
    jvp = jax.jit(lambda f, p, t: jax.jvp(f, p, t), static_argnums=0)
    with pytest.warns(UserWarning, match="score_mod .op `gather`"):
        (out, lse), (expected, expected_lse) = check_gradients(
            of(flex_attention, config=TPU), of(flex_attention_reference), (q, k, v, table), jnp.float32)
        _, (d_out, d_lse) = jvp(of(flex_attention, config=TPU), (q, k, v, table), tangents)
    _, (want_out, want_lse) = jvp(of(flex_attention_reference), (q, k, v, table), tangents)
    for name, got, want in (("out", out, expected), ("lse", lse, expected_lse), ("d out", d_out, want_out),
                            ("d lse", d_lse, want_lse)):
        assert_close(got, want, jnp.float32, name)


@pytest.mark.parametrize("kind, generation", [
    ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5", "v5p"), ("TPU v5p", "v5p"),
    ("TPU v6 lite", "v6e"), ("TPU7x", "tpu7x"), ("cpu", "v5e"),
])
def test_tpu_generation_and_tiles(kind, generation):
    device = type("Device", (), {"device_kind": kind})()
    assert tpu_plan.tpu_generation(device) == generation
    config = _dispatch.default_config(TPU, q_len=77, kv_len=5000, head_dim=64)
    assert (config.block_q, config.block_k, config.backend) == (128, 512, "tpu_interpret")


def test_a_tpu_device_picks_the_tpu_kernels(monkeypatch):
    """On a TPU, `FlashConfig()` means backend "tpu", and probjax_nn's impl="auto" picks the Pallas kernels."""
    from probjax_nn import _attention

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert _dispatch.default_backend() == "tpu"
    request = _attention._Request("bfloat16", 128, value_dim=False, kv_broadcast=False, score_mod=False,
                                  mask_mod=False, dropout=False, right_window=False, gpu=False)
    assert _attention._choose("auto", request) == "pallas"
    assert _attention._choose("auto", dataclasses.replace(request, score_mod=True)) == "flex"
