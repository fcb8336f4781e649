"""Every kernel variant lowers through Pallas' Triton backend for CUDA, checked on the CPU (no GPU needed).

Catches what interpret mode cannot: unsupported primitives, non-power-of-two in-kernel shapes, indexers.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from probjax_kernels import (
    AuxRequest, DecodeConfig, FlashConfig, alibi, and_masks, causal_mask, create_block_mask, decode_attention,
    document_mask, flash_attention, flex_attention, relative_bias, softcap,
)


def lower_for_cuda(fn, *specs):
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


B, T, S, N, K = 2, 600, 300, 6, 2


@pytest.mark.parametrize("head_dim", [32, 80, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_forward_and_backward_lower(head_dim, dtype):
    config = FlashConfig(backend="triton")

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, config=config).astype(jnp.float32))

    q, kv = spec((B, T, N, head_dim), dtype), spec((B, S, K, head_dim), dtype)
    text = lower_for_cuda(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    for name in ("probjax_flash_forward", "probjax_flash_backward_dq", "probjax_flash_backward_dkv"):
        assert name in text


@pytest.mark.parametrize(
    "bias_shape, mask_shape",
    [((1, N, T, S), (B, 1, 1, S)), ((B, N, T, S), (B, N, T, S)), ((T, S), None), (None, (T, S))],
)
def test_every_option_lowers(bias_shape, mask_shape):
    config = FlashConfig(backend="triton")

    def loss(q, k, v, bias, mask, q_segments, kv_segments, lengths):
        out, lse = flash_attention(
            q, k, v, bias=bias, mask=mask, q_segment_ids=q_segments, kv_segment_ids=kv_segments,
            q_lengths=lengths, kv_lengths=lengths // 2, window=(64, 8), causal=True, return_lse=True,
            config=config,
        )
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    argnums = (0, 1, 2, 3) if bias_shape is not None else (0, 1, 2)
    lower_for_cuda(
        jax.grad(loss, argnums),
        spec((B, T, N, 64), jnp.bfloat16), spec((B, S, K, 64), jnp.bfloat16), spec((B, S, K, 64), jnp.bfloat16),
        None if bias_shape is None else spec(bias_shape, jnp.float32),
        None if mask_shape is None else spec(mask_shape, jnp.bool_),
        spec((B, T), jnp.int32), spec((B, S), jnp.int32), spec((B,), jnp.int32),
    )


def _flex_loss(with_dropout: bool):
    def loss(q, k, v, slopes, table, ids):
        def score_mod(score, b, h, q_idx, kv_idx):
            score = relative_bias(table)(alibi(slopes)(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)
            return softcap(20.0)(score, b, h, q_idx, kv_idx)

        block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), B, N, T, T, block_size=(64, 128))
        dropout = dict(dropout_rate=0.1, dropout_seed=7) if with_dropout else {}
        out = flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True, config=FlashConfig(backend="triton"),
                             **dropout)
        return jnp.sum(out.astype(jnp.float32))

    return loss


@pytest.mark.parametrize("with_dropout", [False, True])
def test_flex_hooks_block_tables_and_dropout_lower(with_dropout):
    """Hooks reading captured arrays (as ref loads), per-batch / per-head block tables, jvp of the hook in
    the backward kernels, and the dropout hash, through the Triton lowering."""
    text = lower_for_cuda(
        jax.grad(_flex_loss(with_dropout), (0, 1, 2, 3, 4)),
        spec((B, T, N, 64), jnp.bfloat16), spec((B, T, K, 64), jnp.bfloat16), spec((B, T, K, 64), jnp.bfloat16),
        spec((N,), jnp.float32), spec((N, 2 * T - 1), jnp.float32), spec((B, T), jnp.int32),
    )
    for name in ("probjax_flash_forward", "probjax_flash_backward_dq", "probjax_flash_backward_dkv"):
        assert name in text


def test_flash_dropout_lowers():
    def loss(q, k, v):
        out = flash_attention(q, k, v, causal=True, dropout_rate=0.2, dropout_seed=jnp.uint32(5),
                              config=FlashConfig(backend="triton"))
        return jnp.sum(out.astype(jnp.float32))

    lower_for_cuda(jax.grad(loss, (0, 1, 2)), spec((B, T, N, 64), jnp.float16), spec((B, S, K, 64), jnp.float16),
                   spec((B, S, K, 64), jnp.float16))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_tangent_kernel_lowers(head_dim):
    """Forward mode: the tangent kernel with every flash option and tangents of q, k, v and the bias."""
    config = FlashConfig(backend="triton")

    def attention(q, k, v, bias, mask, segments, lengths):
        return flash_attention(
            q, k, v, bias=bias, mask=mask, q_segment_ids=segments, kv_segment_ids=segments, q_lengths=lengths,
            kv_lengths=lengths, window=(64, 8), causal=True, dropout_rate=0.1, dropout_seed=3, return_lse=True,
            config=config,
        )

    def jvp(q, k, v, bias, mask, segments, lengths):
        return jax.jvp(lambda q, k, v, bias: attention(q, k, v, bias, mask, segments, lengths), (q, k, v, bias),
                       (q, k, v, bias))

    x = spec((B, T, N, head_dim), jnp.bfloat16)
    kv = spec((B, T, K, head_dim), jnp.bfloat16)
    text = lower_for_cuda(jvp, x, kv, kv, spec((1, N, T, T), jnp.float32), spec((B, 1, 1, T), jnp.bool_),
                          spec((B, T), jnp.int32), spec((B,), jnp.int32))
    assert "probjax_flash_tangent" in text


def test_flex_tangent_kernel_lowers():
    """Forward mode through hooks: the jvp of score_mod in its captured arrays reads their tangents as refs."""

    def jvp(q, k, v, slopes, table, ids):
        fn = lambda q, k, v, slopes, table: _flex_loss(True)(q, k, v, slopes, table, ids)  # noqa: E731
        return jax.jvp(fn, (q, k, v, slopes, table), (q, k, v, slopes, table))

    text = lower_for_cuda(
        jvp, spec((B, T, N, 64), jnp.bfloat16), spec((B, T, K, 64), jnp.bfloat16), spec((B, T, K, 64), jnp.bfloat16),
        spec((N,), jnp.float32), spec((N, 2 * T - 1), jnp.float32), spec((B, T), jnp.int32),
    )
    assert "probjax_flash_tangent" in text


@pytest.mark.parametrize("head_dim, value_dim, kv_batch", [(192, 128, B), (64, 80, 1)])
def test_value_head_dim_shared_kv_and_max_scores_lower(head_dim, value_dim, kv_batch):
    """Dv != D (multi-head latent attention's 192 / 128; 80 pads to 128 inside the wrapper), k / v of batch 1
    shared by the batch, and the max_scores output: forward, dQ, dK/dV and the tangent kernel."""
    config = FlashConfig(backend="triton")
    aux = AuxRequest(lse=True, max_scores=True)

    def loss(q, k, v):
        out, stats = flex_attention(q, k, v, softcap(20.0), None, enable_gqa=True, config=config, return_aux=aux)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(stats.lse), stats.lse, 0.0))

    def jvp(q, k, v):
        return jax.jvp(lambda *a: flash_attention(*a, causal=True, config=config), (q, k, v), (q, k, v))

    specs = (spec((B, T, N, head_dim), jnp.bfloat16), spec((kv_batch, S, K, head_dim), jnp.bfloat16),
             spec((kv_batch, S, K, value_dim), jnp.bfloat16))
    text = lower_for_cuda(jax.grad(loss, (0, 1, 2)), *specs)
    for name in ("probjax_flash_forward", "probjax_flash_backward_dq", "probjax_flash_backward_dkv"):
        assert name in text
    assert "probjax_flash_tangent" in lower_for_cuda(jvp, *specs)


@pytest.mark.parametrize(
    "paged, hooks, dtype, head_dim, new_tokens, num_heads",
    [
        (False, False, jnp.bfloat16, 128, 1, 8),  # dense, GQA 8:1 at T=1, S = 1000 read in place (masked tail)
        (True, False, jnp.bfloat16, 128, 4, 32),  # paged, GQA 32:8
        (True, True, jnp.float16, 128, 16, 16),  # hooks with captured arrays; 256 rows: two row blocks
        (False, True, jnp.float32, 96, 2, 2),  # dense, hooks, float32, Dv != D, neither a power of two
        (True, False, jnp.float32, 256, 2, 8),  # hd 256: 16-key tiles, each page read as four slices
    ],
)
def test_decode_kernel_lowers(paged, hooks, dtype, head_dim, new_tokens, num_heads):
    num_kv_heads = 8 if num_heads == 32 else 1
    value_dim = head_dim // 2 if dtype == jnp.float32 else head_dim
    bias = jnp.zeros((4, 1000), jnp.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap(30.0)(score, b, h, q_idx, kv_idx) + bias[b, kv_idx]

    def keep(b, h, q_idx, kv_idx):
        return bias[b, kv_idx] > -1.0

    hook_args = dict(score_mod=score_mod, mask_mod=and_masks(causal_mask, keep)) if hooks else {}
    config = DecodeConfig(backend="triton")
    q = spec((4, new_tokens, num_heads, head_dim), dtype)
    if paged:
        k, v = spec((61, 64, num_kv_heads, head_dim), dtype), spec((61, 64, num_kv_heads, value_dim), dtype)
        tables = (spec((4, 16), jnp.int32),)
    else:
        k, v = spec((4, 1000, num_kv_heads, head_dim), dtype), spec((4, 1000, num_kv_heads, value_dim), dtype)
        tables = ()

    def run(q, k, v, lengths, *tables):
        return decode_attention(q, k, v, kv_lengths=lengths, block_tables=tables[0] if tables else None,
                                num_splits=8, config=config, **hook_args)

    text = lower_for_cuda(run, q, k, v, spec((4,), jnp.int32), *tables)
    assert "probjax_decode_attention" in text
