"""The Mosaic GPU kernels for Blackwell (tcgen05 into tensor memory) compiled on a compute capability 10.x GPU
(B200 / GB200 / B300) against the plain-jnp reference: the forward, the dQ and dK/dV kernels, and
flash_attention with FlashConfig(backend="mosaic") with its gradients (dropout too), flex_attention's score_mods
(soft cap, ALiBi) and BlockMasks with theirs.

Skipped off the GPU and on other GPUs; tests/gpu/run_gpu_checks.sh runs it. The CPU suite runs the same kernels
in the Mosaic GPU interpreter (tests/test_mosaic_tcgen05.py, tests/test_mosaic_tcgen05_backward.py,
tests/test_mosaic_tcgen05_features.py).
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import random_qkv
from test_gpu_flash import TOLERANCE, _assert_close, _normal

from probjax_kernels import (
    FlashConfig,
    alibi,
    alibi_slopes,
    and_masks,
    causal_mask,
    create_block_mask,
    document_mask,
    flash_attention,
    flash_attention_reference,
    flex_attention,
    flex_attention_reference,
    sliding_window,
    softcap,
)
from probjax_kernels.mosaic import glue as mosaic_glue
from probjax_kernels.mosaic.backward_tcgen05 import tcgen05_backward_dkv, tcgen05_backward_dq
from probjax_kernels.mosaic.forward_tcgen05 import tcgen05_forward


def _is_blackwell() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("10.")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_blackwell(), reason="needs a Blackwell (sm_100) GPU")]
TOL = TOLERANCE["bfloat16"]


@pytest.mark.parametrize("block_kv", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward(causal, head_dim, block_kv):
    q, k, v = random_qkv(0, 2, 1024, 1024, 8, 2, head_dim, jnp.bfloat16)
    q_lengths, kv_lengths = jnp.array([1024, 700]), jnp.array([1024, 333])
    out, lse = jax.jit(lambda q, k, v: tcgen05_forward(
        q, k, v, q_lengths, kv_lengths, scale=head_dim**-0.5, causal=causal, block_kv=block_kv))(q, k, v)
    expected, expected_lse = flash_attention_reference(q, k, v, causal=causal, q_lengths=q_lengths,
                                                       kv_lengths=kv_lengths, return_lse=True)
    _assert_close("out", out, expected, TOL)
    _assert_close("lse", lse, expected_lse, TOL)


def counting_tcgen05_backward(monkeypatch) -> list:
    """A list that gets an entry each time the tcgen05 backward is built (when jax.grad's tangent map is lowered:
    a jaxpr does not show the backward's kernels)."""
    calls, backward = [], mosaic_glue.backward_tcgen05
    monkeypatch.setattr(mosaic_glue, "backward_tcgen05", lambda *a, **k: calls.append(1) or backward(*a, **k))
    return calls


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(256, 0)), dict()], ids=["causal", "window", "full"])
def test_flash_attention_with_the_mosaic_backend(kwargs, monkeypatch):
    q, k, v = random_qkv(1, 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    cotangent = _normal(2, q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

    mosaic = lambda q, k, v: flash_attention(q, k, v, config=FlashConfig(backend="mosaic"), **kwargs)  # noqa: E731
    reference = lambda q, k, v: flash_attention_reference(q, k, v, **kwargs)  # noqa: E731
    _assert_tcgen05_matches_reference(mosaic, reference, (q, k, v), loss, monkeypatch)


def _assert_tcgen05_matches_reference(mosaic, reference, args, loss, monkeypatch):
    """`mosaic` runs the tcgen05 forward and backward, and its output and gradients (of `loss(fn)`) match
    `reference`'s."""
    assert "probjax_mosaic_forward_tcgen05" in str(jax.make_jaxpr(mosaic)(*args))
    _assert_close("out", jax.jit(mosaic)(*args), reference(*args), TOL)
    calls = counting_tcgen05_backward(monkeypatch)
    grads = jax.jit(jax.grad(loss(mosaic), (0, 1, 2)))(*args)
    assert calls, "the tcgen05 backward did not run"
    expected = jax.grad(loss(reference), (0, 1, 2))(*args)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        _assert_close(name, got, want, TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_kernels(causal, head_dim):
    """dQ and dK/dV of ragged GQA against the reference's vjp (the forward's out and lse from the reference)."""
    q, k, v = random_qkv(3, 2, 1024, 1024, 8, 2, head_dim, jnp.bfloat16)
    d_out = _normal(4, q.shape).astype(jnp.bfloat16)
    q_lengths, kv_lengths = jnp.array([1024, 700]), jnp.array([1024, 333])

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                         return_lse=True)

    (out, lse), vjp = jax.vjp(reference, q, k, v)
    expected = vjp((d_out, jnp.zeros_like(lse)))
    args = (q, k, v, out, lse, d_out, q_lengths, kv_lengths)
    options = dict(scale=head_dim**-0.5, causal=causal)
    dq = jax.jit(lambda *a: tcgen05_backward_dq(*a, **options))(*args)
    dk, dv = jax.jit(lambda *a: tcgen05_backward_dkv(*a, **options))(*args)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected, strict=True):
        _assert_close(name, got, want, TOL)


@pytest.mark.parametrize("case", ["softcap_alibi", "sliding_window_block_mask", "document_mask_token_bias"])
def test_flex_attention_with_the_mosaic_backend(case, monkeypatch):
    """A soft cap then ALiBi from a slope table, a causal sliding-window BlockMask with a soft cap, and a causal
    document mask with a per-key bias (vectors along q_idx / kv_idx): the tcgen05 forward and backward run them
    (hooks, their vectors and tables in the kernels); out and gradients against the reference."""
    q, k, v = random_qkv(5, 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    cotangent = _normal(6, q.shape)
    cap, bias = softcap(30.0), alibi(alibi_slopes(8))
    if case == "softcap_alibi":
        score_mod, block_mask = (lambda s, b, h, q_idx, kv_idx: bias(cap(s, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx),
                                 None)
    elif case == "document_mask_token_bias":
        ids = jnp.repeat(jnp.array([[0, 1, 2, 3], [0, 0, 1, 1]]), 256, axis=1)
        token_bias = jnp.linspace(-1.0, 1.0, 2 * 1024).reshape(2, 1024)
        score_mod = lambda s, b, h, q_idx, kv_idx: s + token_bias[b, kv_idx]  # noqa: E731
        block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 2, None, 1024, 1024)
    else:
        score_mod = cap
        block_mask = create_block_mask(and_masks(causal_mask, sliding_window(300)), None, None, 1024, 1024)

    def run(attention, **options):
        return lambda q, k, v: attention(q, k, v, score_mod, block_mask, enable_gqa=True, **options)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

    mosaic, reference = run(flex_attention, config=FlashConfig(backend="mosaic")), run(flex_attention_reference)
    _assert_tcgen05_matches_reference(mosaic, reference, (q, k, v), loss, monkeypatch)


def test_dropout(monkeypatch):
    """Dropout (every backend's keep mask) in the tcgen05 forward, dQ and dK/dV, causal GQA: out and gradients
    against the reference, which drops the same weights."""
    q, k, v = random_qkv(7, 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    cotangent = _normal(8, q.shape)
    options = dict(causal=True, dropout_rate=0.1, dropout_seed=3)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

    mosaic = lambda q, k, v: flash_attention(q, k, v, config=FlashConfig(backend="mosaic"), **options)  # noqa: E731
    reference = lambda q, k, v: flash_attention_reference(q, k, v, **options)  # noqa: E731
    _assert_tcgen05_matches_reference(mosaic, reference, (q, k, v), loss, monkeypatch)


@pytest.mark.parametrize("masking", ["segments", "key_padding_mask", "dense_mask"])
def test_segment_ids_and_key_padding_masks(masking, monkeypatch):
    """Segment ids (three packed documents a row, causal, GQA 8:2, ragged lengths), a `[B, 1, 1, S]` key
    padding mask (which reaches the kernels as segment ids) and a random `[B, N, T, S]` mask (int8 tiles) in the
    tcgen05 forward, dQ and dK/dV: out and gradients against the reference."""
    q, k, v = random_qkv(9, 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    cotangent = _normal(10, q.shape)
    if masking == "segments":
        ids = jnp.concatenate([jnp.zeros((2, 300), jnp.int32), jnp.ones((2, 500), jnp.int32),
                               jnp.full((2, 224), 2, jnp.int32)], axis=1)
        options = dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids, q_lengths=jnp.array([1024, 900]),
                       kv_lengths=jnp.array([1024, 700]))
    elif masking == "key_padding_mask":
        options = dict(mask=(jnp.arange(1024)[None, :] < jnp.array([[1000], [333]]))[:, None, None, :])
    else:
        options = dict(mask=jax.random.bernoulli(jax.random.key(3), 0.7, (2, 8, 1024, 1024)))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

    mosaic = lambda q, k, v: flash_attention(q, k, v, config=FlashConfig(backend="mosaic"), **options)  # noqa: E731
    reference = lambda q, k, v: flash_attention_reference(q, k, v, **options)  # noqa: E731
    _assert_tcgen05_matches_reference(mosaic, reference, (q, k, v), loss, monkeypatch)
