"""`attention(impl="auto")` off the GPU: `chunked_attention`, XLA attention over query bands and chunks, against
a float64 reference (outputs, lse and gradients), the dense "xla" impl (hooks, dropout, forward mode), and
jax.nn.dot_product_attention's memory (the chunked path must not hold the [T, S] scores)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bernoulli, normal, random_qkv

from probjax_kernels import _chunked
from probjax_kernels.layer_api import attention_from_inputs, check_inputs
from probjax_nn import attention

BATCH, Q_LEN, KV_LEN, HEADS, HEAD_DIM = 2, 150, 40, 4, 16
TOL = 2e-5  # float32 against float64, relative to the largest expected value
# Rows of one step when a step's scores may take this many bytes: 16 rows, so Q_LEN = 150 splits into 10
# chunks, 8 bands of 2 steps (lax.map and checkpoint), the last band partly padding.
SMALL_CHUNK_BYTES = 4 * BATCH * HEADS * KV_LEN * 16


def _mask_with_empty_rows() -> np.ndarray:
    """A random [B, 1, T, S] mask in which query rows 3 and 100 of batch 0 see no key."""
    mask = np.array(bernoulli(3, 0.7, (BATCH, 1, Q_LEN, KV_LEN)))
    mask[0, 0, [3, 100]] = False
    return mask


def _bias_with_a_minus_inf_row() -> np.ndarray:
    bias = np.array(normal(4, (1, HEADS, Q_LEN, KV_LEN)))
    bias[0, 1, 7] = -np.inf  # a bias that masks: row 7 of head 1 sees nothing
    return bias


# (kv heads, attention's keyword arguments). The cases from bias_minus_inf on have rows that see no key.
CASES = {
    "plain": (HEADS, {}),
    "causal_gqa": (2, {"is_causal": True}),
    "mqa_bias": (1, {"bias": normal(5, (BATCH, HEADS, Q_LEN, KV_LEN)), "scale": 0.3}),
    "bias_broadcast_causal": (2, {"bias": normal(6, (1, HEADS, 1, KV_LEN)),
                                  "is_causal": True}),
    "bias_minus_inf": (HEADS, {"bias": _bias_with_a_minus_inf_row()}),
    "mask_empty_rows": (2, {"mask": _mask_with_empty_rows(), "is_causal": True}),
    # a key mask broadcast over query rows (flax's padding masks), every key of batch 1 masked
    "key_mask": (2, {"mask": np.arange(KV_LEN)[None, None, None, :] < np.array([25, 0]).reshape(BATCH, 1, 1, 1)}),
    # a window without causal: rows past S - 1 + 6 see no key (whole bands skip their keys)
    "window": (2, {"local_window_size": (6, 3)}),
    "window_causal": (1, {"local_window_size": (9, 4), "is_causal": True}),
    "lengths": (2, {"query_seq_lengths": np.array([150, 61], np.int32),
                    "key_value_seq_lengths": np.array([0, 33], np.int32), "is_causal": True}),
}


def _reference_float64(q, k, v, bias, kwargs):
    """(out, lse [B, T, N]) of the dense reference in float64 on the same inputs; lengths become a mask (the
    reference's int64 positions under x64 do not compare with int32 lengths)."""
    mask = np.ones((BATCH, 1, Q_LEN, KV_LEN), bool) if kwargs.get("mask") is None else np.asarray(kwargs["mask"])
    for name, axis in (("query_seq_lengths", 2), ("key_value_seq_lengths", 3)):
        if kwargs.get(name) is not None:
            positions = np.arange(mask.shape[axis]).reshape([-1 if a == axis else 1 for a in range(4)])
            mask = mask & (positions < np.asarray(kwargs[name]).reshape(-1, 1, 1, 1))
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        bias = None if bias is None else jnp.asarray(bias, jnp.float64)

        def run(q, k, v, bias):
            inputs = check_inputs(
                q, k, v, bias=bias, mask=mask, scale=kwargs.get("scale"), window=kwargs.get("local_window_size"),
                allowed_dtypes=(jnp.float64,), max_head_dim=None,
            )
            out, lse = attention_from_inputs(inputs, kwargs.get("is_causal", False), jnp.float64)
            return out, jnp.swapaxes(lse, 1, 2)

        return _output_and_grads(run, q, k, v, bias)


def _output_and_grads(f, q, k, v, bias):
    """(out, lse, grads of sum(out * cotangent) in q, k, v and bias), under one jit."""
    @jax.jit
    def run(q, k, v, bias):
        (out, lse), vjp = jax.vjp(lambda *args: f(*args), q, k, v, bias)
        cotangent = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
        return out, lse, vjp((cotangent, jnp.zeros_like(lse)))

    out, lse, grads = run(q, k, v, bias)
    return np.asarray(out), np.asarray(lse), [None if g is None else np.asarray(g) for g in grads]


def _assert_close(actual, expected, name):
    assert actual.shape == expected.shape, name
    assert np.isfinite(actual).all(), name
    scale = max(float(np.max(np.abs(expected))), 1.0)
    assert float(np.max(np.abs(actual - expected))) <= TOL * scale, name


@pytest.mark.parametrize("small_chunks", [False, True], ids=["one_block", "bands_and_steps"])
@pytest.mark.parametrize("case", list(CASES))
def test_auto_matches_float64_reference(monkeypatch, case, small_chunks):
    if small_chunks:
        monkeypatch.setattr(_chunked, "CHUNK_BYTES", SMALL_CHUNK_BYTES)
        assert _chunked.chunk_plan(BATCH, HEADS, Q_LEN, KV_LEN) == (8, 2, 10)
    kv_heads, kwargs = CASES[case]
    q, k, v = random_qkv(0, BATCH, Q_LEN, KV_LEN, HEADS, kv_heads, HEAD_DIM)
    bias = kwargs.get("bias")
    rest = {name: value for name, value in kwargs.items() if name != "bias"}

    def auto(q, k, v, bias):
        return attention(q, k, v, bias, **rest, return_residual=True)

    out, lse, grads = _output_and_grads(auto, q, k, v, None if bias is None else jnp.asarray(bias))
    expected_out, expected_lse, expected_grads = _reference_float64(q, k, v, bias, kwargs)
    _assert_close(out, expected_out, "out")
    empty = np.isneginf(expected_lse)  # [B, T, N]: rows with nothing to attend
    assert (np.isneginf(lse) == empty).all()
    _assert_close(np.where(empty, 0, lse), np.where(empty, 0, expected_lse), "lse")
    assert (out[empty] == 0).all() and (grads[0][empty] == 0).all()  # output 0, zero gradients
    assert empty.any() == (list(CASES).index(case) >= list(CASES).index("bias_minus_inf"))
    for name, grad, expected in zip(("dq", "dk", "dv", "dbias"), grads, expected_grads):
        if expected is not None:
            _assert_close(grad, expected, name)
    assert float(np.max(np.abs(expected_grads[0]))) > 0.1  # not a comparison between zeros


def _alibi(slopes):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * jnp.abs(q_idx - kv_idx).astype(score.dtype)

    return score_mod


def _even_keys(b, h, q_idx, kv_idx):
    return (kv_idx % 2 == 0) | (q_idx % 5 == 0)


def test_auto_hooks_and_dropout_match_the_dense_xla_impl(monkeypatch):
    """Hooks see global positions and dropout hashes them, in every band and step: the same numbers as the
    dense impl "xla", gradients of the slopes a score_mod closes over included."""
    monkeypatch.setattr(_chunked, "CHUNK_BYTES", SMALL_CHUNK_BYTES)
    q, k, v = random_qkv(1, BATCH, Q_LEN, KV_LEN, HEADS, 2, HEAD_DIM)
    slopes = jnp.linspace(0.05, 0.4, HEADS)
    cotangent = jnp.sin(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    def terms(q, k, v, slopes, impl):
        out = attention(q, k, v, is_causal=True, local_window_size=(30, 0), score_mod=_alibi(slopes),
                        mask_mod=_even_keys, dropout_rate=0.25, dropout_seed=11, impl=impl)
        return out * cotangent

    def loss_and_grads(impl):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(terms(*a, impl)), argnums=(0, 1, 2, 3)))(q, k, v, slopes)

    (auto_loss, auto_grads), (xla_loss, xla_grads) = loss_and_grads("auto"), loss_and_grads("xla")
    # The loss sums terms of both signs (their magnitudes sum to ~60,000x the loss here): the two impls' float32
    # rounding differs by up to ~1e-7 of that sum, which a relative tolerance on the loss alone cannot absorb on
    # every CPU. The gradients below are checked element by element.
    magnitude = float(jnp.sum(jnp.abs(terms(q, k, v, slopes, "xla"))))
    np.testing.assert_allclose(auto_loss, xla_loss, rtol=0, atol=1e-7 * magnitude)
    for name, grad, expected in zip(("dq", "dk", "dv", "dslopes"), auto_grads, xla_grads):
        _assert_close(np.asarray(grad), np.asarray(expected), name)
    assert float(jnp.max(jnp.abs(xla_grads[3]))) > 0.1


def test_auto_forward_mode_matches_the_dense_xla_impl(monkeypatch):
    monkeypatch.setattr(_chunked, "CHUNK_BYTES", SMALL_CHUNK_BYTES)
    q, k, v = random_qkv(2, BATCH, Q_LEN, KV_LEN, HEADS, 2, HEAD_DIM)
    tangents = random_qkv(3, BATCH, Q_LEN, KV_LEN, HEADS, 2, HEAD_DIM)
    mask = _mask_with_empty_rows()

    def jvp(impl):
        return jax.jit(lambda primals, tangents: jax.jvp(
            lambda q, k, v: attention(q, k, v, mask=mask, is_causal=True, impl=impl), primals, tangents,
        ))((q, k, v), tangents)

    (out, d_out), (expected_out, expected_d_out) = jvp("auto"), jvp("xla")
    _assert_close(np.asarray(out), np.asarray(expected_out), "out")
    _assert_close(np.asarray(d_out), np.asarray(expected_d_out), "d_out")


def _temp_bytes(f, seq_len: int) -> int:
    """XLA's temporary memory for the gradient of sum(f(q, k, v)) in q, k and v, causal, [1, seq_len, 2, 16]."""
    q, k, v = random_qkv(0, 1, seq_len, seq_len, 2, 2, 16)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)))
    return step.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


def test_auto_holds_no_seq_by_seq_scores(monkeypatch):
    """jax.nn's "xla" path keeps the [B, N, T, S] probabilities for the backward pass: its memory grows 4x when
    T doubles. The chunked path keeps one step's scores: past a step's budget, its memory is linear in T."""
    monkeypatch.setattr(_chunked, "CHUNK_BYTES", 2**18)  # 256 KiB: 16 rows of [2, 2048] float32 scores

    def auto(q, k, v):
        return attention(q, k, v, is_causal=True)

    def stock(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    auto_temp = {seq: _temp_bytes(auto, seq) for seq in (1024, 2048)}
    stock_temp = {seq: _temp_bytes(stock, seq) for seq in (1024, 2048)}
    assert stock_temp[2048] > 2 * stock_temp[1024]  # superlinear: what the chunked path must not be
    assert auto_temp[2048] / auto_temp[1024] < 2.5
    assert auto_temp[2048] < 0.1 * stock_temp[2048]


def test_auto_shared_key_value_batch_and_value_head_dim(monkeypatch):
    """k / v of batch 1 shared by the query batch, and a value head dim other than D, in bands and steps."""
    monkeypatch.setattr(_chunked, "CHUNK_BYTES", SMALL_CHUNK_BYTES)
    q, k, _ = random_qkv(4, BATCH, Q_LEN, KV_LEN, HEADS, 2, HEAD_DIM)
    k = k[:1]
    v = normal(5, (1, KV_LEN, 2, 24))
    kwargs = {"is_causal": True, "local_window_size": (12, 0)}

    def auto(q, k, v, bias):
        return attention(q, k, v, **kwargs, return_residual=True)

    out, lse, grads = _output_and_grads(auto, q, k, v, None)
    with jax.enable_x64(True):
        def reference(q, k, v, bias):
            inputs = check_inputs(q, k, v, window=(12, 0), allowed_dtypes=(jnp.float64,), max_head_dim=None)
            out, lse = attention_from_inputs(inputs, True, jnp.float64)
            return out, jnp.swapaxes(lse, 1, 2)

        expected = _output_and_grads(reference, *(jnp.asarray(x, jnp.float64) for x in (q, k, v)), None)
    assert out.shape == (BATCH, Q_LEN, HEADS, 24)
    _assert_close(out, expected[0], "out")
    empty = np.isneginf(expected[1])  # rows past S - 1 + 12 see no key
    assert empty.any() and (np.isneginf(lse) == empty).all() and (out[empty] == 0).all()
    _assert_close(np.where(empty, 0, lse), np.where(empty, 0, expected[1]), "lse")
    for name, grad, reference_grad in zip(("dq", "dk", "dv"), grads, expected[2]):
        _assert_close(grad, reference_grad, name)
