"""The fused Mosaic TPU backward (`probjax_kernels.tpu.fused_backward`, `FlashConfig(fused_backward=True)`):
one kernel computing dQ, dK and dV, in TPU interpret mode against the float64 NumPy reference and the
plain-jnp one; the calls it leaves to the two kernels; and the tile model's choice of the default."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, numpy_allowed, numpy_attention, random_qkv
from test_tpu_kernels import check_gradients, finite

from probjax_kernels import (
    FlashConfig, alibi, create_block_mask, flash_attention, flash_attention_reference, flex_attention,
    flex_attention_reference, sliding_window,
)
from probjax_kernels.tpu import backward, chips, fused_backward, plan, tile_model

FUSED = FlashConfig(backend="tpu_interpret", fused_backward=True, block_q_dkv=128, block_k_dkv=128)


@pytest.fixture
def backwards(monkeypatch):
    """Which backward ran: "fused" or "two" (the dQ and dK/dV kernels)."""
    ran = []
    for name, module in (("fused", fused_backward), ("two", backward)):
        original = module.backward

        def recording(*args, _original=original, _name=name, **kwargs):
            ran.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "backward", recording)
    return ran


def test_causal_gqa_lengths_float32(backwards):
    """GQA 2:1 in float32 (the transposed layout: the kernel walks a group's two heads per key tile, each
    adding to its own dQ rows), ragged T / S and per-batch lengths, causal; out and lse against float64."""
    q, k, v = random_qkv(60, 2, 300, 420, 2, 1, 64)
    lengths = dict(q_lengths=jnp.array([300, 170]), kv_lengths=jnp.array([420, 250]))
    (out, lse), _ = check_gradients(
        lambda q, k, v: flash_attention(q, k, v, causal=True, return_lse=True, config=FUSED, **lengths),
        lambda q, k, v: flash_attention_reference(q, k, v, causal=True, return_lse=True, **lengths), (q, k, v),
        jnp.float32)
    assert set(backwards) == {"fused"}
    allowed = numpy_allowed(2, 300, 420, causal=True, q_lengths=np.array([300, 170]),
                            kv_lengths=np.array([420, 250]))
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed)
    assert_close(out, expected, jnp.float32, "out")
    assert_close(finite(lse), finite(jnp.asarray(expected_lse, jnp.float32)), jnp.float32, "lse")


def test_in_place_bf16_window_segments_dropout_shared_kv(backwards):
    """8 bfloat16 heads of dim 128 in place (one program adds the dQ rows of all 8), a two-sided window,
    segment ids, dropout (the keep mask every backend uses) and k / v of batch 1 shared by the batch."""
    q, k, v = random_qkv(61, 2, 260, 260, 8, 8, 128, jnp.bfloat16)
    k, v = k[:1], v[:1]
    segments = jnp.stack([jnp.repeat(jnp.arange(2), 130), jnp.repeat(jnp.arange(4), 65)])
    kwargs = dict(window=(90, 40), q_segment_ids=segments, kv_segment_ids=segments, dropout_rate=0.2,
                  dropout_seed=5)
    check_gradients(lambda q, k, v: flash_attention(q, k, v, return_lse=True, config=FUSED, **kwargs),
                    lambda q, k, v: flash_attention_reference(q, k, v, return_lse=True, **kwargs), (q, k, v),
                    jnp.bfloat16)
    assert set(backwards) == {"fused"}


def test_flex_hook_with_a_block_mask_and_the_slopes_gradient(backwards):
    """ALiBi's slopes (SMEM scalars; their gradient comes from the XLA pass, as on every backend) with a
    sliding-window BlockMask, GQA 8:4, bfloat16."""
    q, k, v = random_qkv(62, 1, 200, 260, 8, 4, 128, jnp.bfloat16)
    block_mask = create_block_mask(sliding_window(90), None, None, 200, 260)
    slopes = 2.0 ** -jnp.arange(1.0, 9.0)

    def attend(attention, **extra):
        def call(q, k, v, slopes):
            return attention(q, k, v, score_mod=alibi(slopes), block_mask=block_mask, enable_gqa=True,
                             return_lse=True, **extra)
        return call

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the XLA fallback warns
        check_gradients(attend(flex_attention, config=FUSED), attend(flex_attention_reference),
                        (q, k, v, slopes), jnp.bfloat16)
    assert set(backwards) == {"fused"}


def test_a_bias_gradient_takes_the_two_kernels(backwards):
    """The bias gradient is dS summed by the dQ (or dK/dV) kernel, so such calls run the two kernels, right."""
    q, k, v = random_qkv(63, 1, 150, 150, 2, 2, 64)
    bias = normal(64, (1, 2, 150, 150))
    check_gradients(lambda q, k, v, b: flash_attention(q, k, v, bias=b, return_lse=True, config=FUSED),
                    lambda q, k, v, b: flash_attention_reference(q, k, v, bias=b, return_lse=True),
                    (q, k, v, bias), jnp.float32)
    assert set(backwards) == {"two"}


def test_fused_and_two_kernels_agree():
    q, k, v = random_qkv(65, 1, 384, 384, 2, 2, 64)

    def grads(fused):
        config = FlashConfig(backend="tpu_interpret", fused_backward=fused)
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, config=config) ** 2),
                                argnums=(0, 1, 2)))(q, k, v)

    for fused, two in zip(grads(True), grads(False)):
        np.testing.assert_allclose(np.asarray(fused), np.asarray(two), rtol=1e-5, atol=1e-5)


def test_the_config_names_a_bad_value():
    with pytest.raises(TypeError, match="fused_backward"):
        FlashConfig(fused_backward="yes")


@pytest.mark.parametrize("name", sorted(chips.CHIPS))
def test_the_default_is_the_models(name):
    """Fused where the model says it beats the two kernels by more than its tolerance, its extra traffic
    outside the kernel counted; the default config carries the choice."""
    chip, tiles = chips.CHIPS[name], plan.TILES[name]
    fused, two = tile_model.backward_times(chip, tiles)
    assert tile_model.fused_backward_pays(chip, tiles) == (fused < two * (1 - tile_model.TOLERANCE))
    assert fused > 0 and two > 0
    if name == "v5e":  # interpret mode's
        from probjax_kernels import default_config

        config = default_config(FlashConfig(backend="tpu_interpret"), q_len=1024, kv_len=1024, head_dim=128)
        assert config.fused_backward == tile_model.fused_backward_pays(chip, tiles)
