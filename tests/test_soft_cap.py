"""`logits_soft_cap` (Gemma 2's `cap * tanh(score / cap)`) on every path: `flash_attention`, every impl of
`probjax_nn.attention` and the drop-in modules, against a float64 NumPy attention with its own gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, numpy_allowed, output_and_grads, random_qkv, to_float32

import probjax_nn
from probjax_kernels import flash_attention, softcap

CAP = 4.0  # q scaled by 4 below: raw scores reach about 10, so the cap bends them


def _float64(x) -> np.ndarray:
    x = np.asarray(x)
    return x if x.dtype == np.float64 else to_float32(x).astype(np.float64)


def numpy_capped(q, k, v, cap, d_out, *, allowed=None, bias=None, scale=None, score_mod=None):
    """Float64 attention with the soft cap applied after bias and `score_mod` (a NumPy function of the
    [B, N, T, S] scores and index grids), and the gradients of sum(out * d_out) in q, k, v derived by hand.
    Returns (out, lse, dq, dk, dv)."""
    q, k, v, d_out = map(_float64, (q, k, v, d_out))
    batch, q_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = head_dim**-0.5 if scale is None else scale
    s = np.einsum("btnd,bsnd->bnts", q, kr) * scale
    if bias is not None:
        s = s + to_float32(bias).astype(np.float64)
    if score_mod is not None:
        s = score_mod(s, *np.ix_(range(batch), range(num_heads), range(q_len), range(k.shape[1])))
    capped = cap * np.tanh(s / cap)
    allowed = np.ones(s.shape, bool) if allowed is None else np.broadcast_to(allowed, s.shape)
    scores = np.where(allowed, capped, -np.inf)
    row_max = scores.max(-1, keepdims=True)
    weights = np.where(allowed, np.exp(scores - row_max), 0.0)
    row_sum = weights.sum(-1, keepdims=True)
    p = weights / row_sum
    out = np.einsum("bnts,bsnd->btnd", p, vr)
    lse = (np.log(row_sum) + row_max)[..., 0]
    dv = np.einsum("bnts,btnd->bsnd", p, d_out)
    dp = np.einsum("btnd,bsnd->bnts", d_out, vr)
    d_capped = p * (dp - (dp * p).sum(-1, keepdims=True))
    ds = d_capped * (1.0 - np.tanh(s / cap) ** 2)  # d cap tanh(s / cap) / ds; score_mod here is s + const
    dq = np.einsum("bnts,bsnd->btnd", ds, kr) * scale
    dk = np.einsum("bnts,btnd->bsnd", ds, q) * scale
    fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[-1]).sum(3)  # noqa: E731 (GQA)
    return out, lse, dq, fold(dk), fold(dv)


def inputs(key, batch=1, q_len=40, kv_len=40, num_heads=4, num_kv_heads=2, head_dim=16):
    q, k, v = random_qkv(key, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim)
    d_out = normal(key + 1000, q.shape, jnp.float32)
    return 4.0 * q, k, v, d_out


def check(actual, expected, factor=1.0):
    (out, lse), grads = actual
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected):
        assert_close(a, e, jnp.float32, name, factor)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_soft_cap_against_float64(causal):
    """Forward, lse and backward kernels with GQA 4:2, causal or with a padded key length and a bias."""
    q, k, v, d_out = inputs(1)
    kwargs = dict(causal=True) if causal else dict(
        kv_lengths=jnp.array([29], jnp.int32), bias=normal(5, (1, 4, 40, 40)))
    allowed = numpy_allowed(1, 40, 40, causal=causal, kv_lengths=None if causal else [29])
    result = output_and_grads(
        lambda q, k, v: flash_attention(q, k, v, logits_soft_cap=CAP, return_lse=True, **kwargs),
        (q, k, v), d_out, has_aux=True)
    check(result, numpy_capped(q, k, v, CAP, d_out, allowed=allowed, bias=kwargs.get("bias")))
    # The cap is the softcap score_mod: the same kernels, bit for bit.
    (out, _), _ = result
    flex = probjax_nn.attention(q, k, v, kwargs.get("bias"), is_causal=causal, impl="flex", score_mod=softcap(CAP),
                                key_value_seq_lengths=kwargs.get("kv_lengths"))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(flex))


def test_flash_attention_soft_cap_with_a_traced_scale_and_forward_mode():
    """A traced scale moves the cap into the affine score_mod; the tangent kernel against the float64 answer's
    directional derivative (central differences of the float64 NumPy attention)."""
    q, k, v, d_out = inputs(2)
    scale = 0.3
    result = output_and_grads(
        lambda q, k, v: jax.jit(lambda s: flash_attention(q, k, v, scale=s, causal=True, logits_soft_cap=CAP,
                                                           return_lse=True))(jnp.float32(scale)),
        (q, k, v), d_out, has_aux=True)
    allowed = numpy_allowed(1, 40, 40, causal=True)
    check(result, numpy_capped(q, k, v, CAP, d_out, allowed=allowed, scale=scale))
    tangents = tuple(normal(10 + i, x.shape, jnp.float32) for i, x in enumerate((q, k, v)))
    _, d_actual = jax.jit(lambda p, t: jax.jvp(lambda q, k, v: flash_attention(
        q, k, v, causal=True, logits_soft_cap=CAP), p, t))((q, k, v), tangents)
    eps = 1e-4
    plus, minus = ([_float64(x) + sign * eps * _float64(t)
                    for x, t in zip((q, k, v), tangents)] for sign in (1.0, -1.0))
    zeros = np.zeros(q.shape)
    d_expected = (numpy_capped(*plus, CAP, zeros, allowed=allowed)[0]
                  - numpy_capped(*minus, CAP, zeros, allowed=allowed)[0]) / (2 * eps)
    assert_close(d_actual, d_expected, jnp.float32, "tangent")


def _linear_score_mod(slope, score, b, h, q_idx, kv_idx):
    """A relative-position score_mod (ALiBi-like, ascending with h), in jnp or NumPy alike."""
    return score + slope * ((h + 1) * (kv_idx - q_idx)).astype(score.dtype)


@pytest.mark.parametrize("impl", ["pallas", "flex", "xla"])
def test_attention_soft_cap_every_impl(impl):
    """Causal GQA with a bias: output, lse and gradients; "flex" and "xla" with a user score_mod too, the
    cap applied after it."""
    q, k, v, d_out = inputs(3)
    bias = normal(6, (1, 4, 40, 40))
    hooks = impl != "pallas"
    score_mod = (lambda s, b, h, i, j: _linear_score_mod(0.05, s, b, h, i, j)) if hooks else None

    def run(q, k, v):
        out, lse = probjax_nn.attention(q, k, v, bias, is_causal=True, impl=impl, logits_soft_cap=CAP,
                                        score_mod=score_mod, return_residual=True)
        return out, jnp.swapaxes(lse, 1, 2)

    expected = numpy_capped(q, k, v, CAP, d_out, allowed=numpy_allowed(1, 40, 40, causal=True), bias=bias,
                            score_mod=(lambda s, b, h, i, j: _linear_score_mod(0.05, s, b, h, i, j)) if hooks else None)
    check(output_and_grads(run, (q, k, v), d_out, has_aux=True), expected)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan"), "4", True, [4.0]])
def test_bad_soft_cap_is_a_value_error_naming_it(cap):
    q, k, v, _ = inputs(4)
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive, finite float or None"):
        flash_attention(q, k, v, logits_soft_cap=cap)
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive, finite float or None"):
        probjax_nn.attention(q, k, v, logits_soft_cap=cap)
    with pytest.raises(TypeError, match="logits_soft_cap must be a Python float, got a traced value"):
        jax.jit(lambda c: probjax_nn.attention(q, k, v, logits_soft_cap=c))(4.0)


def test_cudnn_refuses_the_soft_cap_by_name():
    q, k, v, _ = inputs(4)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="impl='cudnn' does not support logits_soft_cap"):
        probjax_nn.attention(q, k, v, impl="cudnn", logits_soft_cap=CAP)
