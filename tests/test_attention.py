"""`probjax_nn.attention` against `jax.nn.dot_product_attention` and against the kernel's plain-jnp reference."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bernoulli, normal, numpy_attention, random_qkv

from probjax_kernels import FlashConfig, flash_attention_reference
from probjax_nn import AttentionConfig, _attention, attention

BATCH, Q_LEN, KV_LEN, HEADS, KV_HEADS, HEAD_DIM = 2, 24, 40, 4, 2, 16
TOL = 1e-5  # float32
IMPLS_HERE = ("xla", "pallas", "flex", "auto")  # the impls that run on the CPU


def _normal(seed: int, shape, dtype=jnp.float32) -> jax.Array:
    return normal(seed, shape, dtype)


def _qkv(kv_heads: int = KV_HEADS, dtype=jnp.float32):
    return random_qkv(0, BATCH, Q_LEN, KV_LEN, HEADS, kv_heads, HEAD_DIM, dtype)


def _mask(shape) -> jax.Array:
    """Random bool mask that keeps the diagonal, so that causal / windowed rows never lose every key."""
    diagonal = jnp.eye(shape[-2], shape[-1], dtype=jnp.bool_)
    return bernoulli(3, 0.6, shape) | jnp.broadcast_to(diagonal, shape)


# Requests on which jax.nn.dot_product_attention and attention agree: no query row loses every key (rows past
# query_seq_lengths are 0 in both). `kv_heads` is popped before the call.
AGREEING_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "mha": {"kv_heads": HEADS, "is_causal": True},
    "mqa": {"kv_heads": 1},
    "bias": {"bias": _normal(4, (BATCH, HEADS, Q_LEN, KV_LEN))},
    "bias_broadcast": {"bias": _normal(4, (1, HEADS, 1, KV_LEN)), "is_causal": True},
    "mask": {"mask": _mask((BATCH, 1, Q_LEN, KV_LEN))},
    "lengths": {
        "query_seq_lengths": jnp.array([17, Q_LEN], jnp.int32),
        "key_value_seq_lengths": jnp.array([33, 5], jnp.int32),
    },
    "window": {"local_window_size": (3, 2)},
    "window_int": {"local_window_size": 4},
    "window_causal": {"local_window_size": (5, 3), "is_causal": True},
    "everything": {
        "bias": _normal(5, (BATCH, 1, Q_LEN, KV_LEN)),
        "mask": _mask((1, HEADS, Q_LEN, KV_LEN)),
        "scale": 0.3,
        "is_causal": True,
        "query_seq_lengths": jnp.array([Q_LEN, 11], jnp.int32),
        "key_value_seq_lengths": jnp.array([Q_LEN, 30], jnp.int32),
        "local_window_size": (6, 0),
    },
}


def _split_case(name: str):
    kwargs = dict(AGREEING_CASES[name])
    return _qkv(kwargs.pop("kv_heads", KV_HEADS)), kwargs


def _assert_close(actual, expected, tol=TOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=tol, rtol=tol)


# "auto" is left out: on the CPU it runs the "xla" path (test_rank3_matches_jax and the dispatch tests run it).
@pytest.mark.parametrize("impl", [impl for impl in IMPLS_HERE if impl != "auto"])
@pytest.mark.parametrize("case", AGREEING_CASES)
def test_matches_jax(case, impl):
    (q, k, v), kwargs = _split_case(case)
    # Under jit: eagerly, every op of either is an XLA compile of its own.
    expected = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs))(q, k, v)
    out = jax.jit(lambda q, k, v: attention(q, k, v, impl=impl, **kwargs))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, expected)


@pytest.mark.parametrize("impl", IMPLS_HERE)
def test_rank3_matches_jax(impl):
    q, k, v = (x[0] for x in _qkv())
    kwargs = {
        "bias": _normal(4, (HEADS, Q_LEN, KV_LEN)),
        "mask": _mask((Q_LEN, KV_LEN)),
        "key_value_seq_lengths": jnp.array([31], jnp.int32),
        "local_window_size": (7, 2),
    }
    expected = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs))(q, k, v)
    out = jax.jit(lambda q, k, v: attention(q, k, v, impl=impl, **kwargs))(q, k, v)
    assert out.shape == (Q_LEN, HEADS, HEAD_DIM)
    _assert_close(out, expected)


@pytest.mark.parametrize("impl", IMPLS_HERE)
@pytest.mark.parametrize("rank", [3, 4])
def test_return_residual_matches_jax(rank, impl):
    q, k, v = _qkv()
    kwargs = {"bias": _normal(4, (1, HEADS, Q_LEN, KV_LEN)), "is_causal": True}
    if rank == 3:
        q, k, v = q[0], k[0], v[0]
    expected_out, expected_lse = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **kwargs
    ))(q, k, v)
    out, lse = jax.jit(lambda q, k, v: attention(q, k, v, impl=impl, return_residual=True, **kwargs))(q, k, v)
    assert lse.shape == expected_lse.shape == q.shape[:-1]  # [B, T, N] or [T, N]
    assert lse.dtype == jnp.float32
    _assert_close(out, expected_out)
    _assert_close(lse, expected_lse)


def _mask_with_empty_rows() -> jax.Array:
    """Batch 0, all heads: query rows 3 and 10 attend nothing."""
    mask = _mask((BATCH, 1, Q_LEN, KV_LEN))
    return mask.at[0, :, jnp.array([3, 10]), :].set(False)


@pytest.mark.parametrize("impl", IMPLS_HERE)
def test_fully_masked_rows_match_reference(impl):
    q, k, v = _qkv()
    mask = _mask_with_empty_rows()
    kv_lengths = jnp.array([KV_LEN, 0], jnp.int32)  # batch 1: every row is empty
    out, lse = jax.jit(lambda q, k, v: attention(q, k, v, mask=mask, key_value_seq_lengths=kv_lengths, impl=impl,
                                                 return_residual=True))(q, k, v)
    expected_out, expected_lse = jax.jit(lambda q, k, v: flash_attention_reference(
        q, k, v, mask=mask, kv_lengths=kv_lengths, return_lse=True
    ))(q, k, v)
    _assert_close(out, expected_out)
    _assert_close(lse, np.swapaxes(np.asarray(expected_lse), 1, 2))
    out = np.asarray(out)
    empty = (out[0, np.array([3, 10])], out[1])
    assert all(float(np.abs(rows).max()) == 0.0 for rows in empty)
    assert np.all(np.asarray(lse)[0, np.array([3, 10])] == -np.inf)
    assert np.all(np.asarray(lse[1]) == -np.inf)
    assert np.isfinite(np.asarray(lse[0, :3])).all()


def _loss_and_grads(impl: str, q, k, v, bias, **kwargs):
    """Gradients of sum(out * c) + sum(lse * c') (finite lse only) w.r.t. q, k, v and bias."""

    def loss(q, k, v, bias):
        out, lse = attention(q, k, v, bias, impl=impl, return_residual=True, **kwargs)
        out_cotangent = _normal(6, out.shape)
        lse_cotangent = _normal(7, lse.shape)
        return jnp.sum(out * out_cotangent) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * lse_cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)  # one compile, not one per eager op


@pytest.mark.parametrize(
    "rank, kwargs",
    [
        (4, {"mask": _mask_with_empty_rows(), "is_causal": True}),
        (3, {"key_value_seq_lengths": jnp.array([29], jnp.int32), "local_window_size": (4, 3)}),
    ],
    ids=["causal_mask_empty_rows", "rank3_lengths_window"],
)
@pytest.mark.parametrize("impl", ["pallas", "flex"])
def test_kernel_gradients_match_xla(rank, kwargs, impl):
    q, k, v = _qkv()
    bias = _normal(4, (1, HEADS, Q_LEN, KV_LEN))
    if rank == 3:
        q, k, v, bias = q[0], k[0], v[0], bias[0]
    expected = _loss_and_grads("xla", q, k, v, bias, **kwargs)
    grads = _loss_and_grads(impl, q, k, v, bias, **kwargs)
    for name, grad, reference in zip(("dq", "dk", "dv", "dbias"), grads, expected):
        assert grad.shape == reference.shape, name
        assert np.isfinite(np.asarray(grad)).all(), name
        _assert_close(grad, reference)
    assert float(jnp.abs(expected[0]).max()) > 0.1  # the comparison is not between zeros


def _recording(monkeypatch, name: str) -> list:
    """Replaces the kernel `name` inside probjax_nn._attention with a wrapper that records its config."""
    calls = []
    kernel = getattr(_attention, name)

    def record(*args, **kwargs):
        calls.append(kwargs.get("config"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(_attention, name, record)
    return calls


def test_auto_on_cpu_runs_xla_over_query_bands(monkeypatch):
    flash_calls = _recording(monkeypatch, "flash_attention")
    reference_calls = _recording(monkeypatch, "attention_from_inputs")
    chunked_calls = _recording(monkeypatch, "chunked_attention")
    q, k, v = _qkv()
    _assert_close(attention(q, k, v, is_causal=True), jax.nn.dot_product_attention(q, k, v, is_causal=True))
    assert (len(flash_calls), len(reference_calls), len(chunked_calls)) == (0, 0, 1)
    attention(q, k, v, is_causal=True, impl="xla")  # asked for by name, "xla" stays the dense reference
    assert (len(flash_calls), len(reference_calls), len(chunked_calls)) == (0, 1, 1)


def test_auto_on_gpu_runs_pallas_and_falls_back_to_xla(monkeypatch):
    monkeypatch.setattr(_attention, "_on_gpu", lambda: True)
    flash_calls = _recording(monkeypatch, "flash_attention")
    reference_calls = _recording(monkeypatch, "attention_from_inputs")
    q, k, v = _qkv()
    attention(q, k, v)
    assert (len(flash_calls), len(reference_calls)) == (1, 0)
    with jax.enable_x64(True):
        q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
        out = attention(q64, k64, v64)  # the kernel has no float64: auto falls through to xla
        with pytest.raises(NotImplementedError, match="impl='pallas' does not support dtype float64"):
            attention(q64, k64, v64, impl="pallas")
    assert out.dtype == jnp.float64
    assert (len(flash_calls), len(reference_calls)) == (1, 1)


def test_xla_computes_float64_in_float64():
    """jax.nn.dot_product_attention keeps float64 inputs in float64; so must impl "xla" (it computed in float32)."""
    q, k, v = (np.asarray(x, np.float64) for x in _qkv())
    bias = np.asarray(_normal(4, (1, HEADS, Q_LEN, KV_LEN)), np.float64)
    group = HEADS // KV_HEADS
    scores = np.einsum("btnd,bsnd->bnts", q, np.repeat(k, group, axis=2)) * HEAD_DIM**-0.5 + bias
    scores = np.where(np.tril(np.ones((Q_LEN, KV_LEN), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = np.einsum("bnts,bsnd->btnd", probs / probs.sum(axis=-1, keepdims=True), np.repeat(v, group, axis=2))
    with jax.enable_x64(True):
        out = attention(*(jnp.asarray(x) for x in (q, k, v, bias)), is_causal=True, impl="xla")
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=1e-12)


def test_config_flash_reaches_the_kernel_under_jit(monkeypatch):
    flash_calls = _recording(monkeypatch, "flash_attention")
    flash = FlashConfig(block_q=16, block_k=16)
    config = AttentionConfig(impl="pallas", flash=flash)
    assert hash(config) == hash(AttentionConfig("pallas", FlashConfig(block_q=16, block_k=16)))
    q, k, v = _qkv()
    run = jax.jit(functools.partial(attention, is_causal=True, impl=config))
    _assert_close(run(q, k, v), jax.nn.dot_product_attention(q, k, v, is_causal=True))
    assert flash_calls == [flash]


def test_implementation_is_an_alias_for_impl(monkeypatch):
    flash_calls = _recording(monkeypatch, "flash_attention")
    q, k, v = _qkv()
    expected = jax.nn.dot_product_attention(q, k, v)
    _assert_close(attention(q, k, v, implementation="xla"), expected)
    _assert_close(attention(q, k, v, implementation="xla", impl="xla"), expected)
    assert flash_calls == []
    with pytest.raises(ValueError, match="implementation='xla' and impl='pallas' disagree"):
        attention(q, k, v, implementation="xla", impl="pallas")
    with pytest.raises(ValueError, match="implementation='cudnn' and impl='xla' disagree"):
        attention(q, k, v, implementation="cudnn", impl=AttentionConfig(impl="xla"))


def test_bad_impl_lists_the_valid_ones():
    q, k, v = _qkv()
    valid = "'auto', 'pallas', 'flex', 'xla', 'cudnn'"
    with pytest.raises(ValueError, match=f"impl='triton' is not one of {valid}"):
        attention(q, k, v, impl="triton")
    with pytest.raises(ValueError, match=f"impl='XLA' is not one of {valid}"):
        AttentionConfig(impl="XLA")
    with pytest.raises(ValueError, match=f"^implementation='mosaic' is not one of {valid} or None"):
        attention(q, k, v, implementation="mosaic")
    with pytest.raises(TypeError, match="flash must be a probjax_kernels.FlashConfig"):
        AttentionConfig(flash={"block_q": 16})


def test_cudnn_needs_a_gpu():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="impl='cudnn' needs an NVIDIA GPU"):
        attention(q, k, v, impl="cudnn")
    with pytest.raises(NotImplementedError, match="impl='cudnn' needs an NVIDIA GPU"):
        attention(q, k, v, implementation="cudnn")


def test_cudnn_refuses_what_it_cannot_do(monkeypatch):
    monkeypatch.setattr(_attention, "_on_gpu", lambda: True)
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="impl='cudnn' does not support dtype float32"):
        attention(q, k, v, impl="cudnn")
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="impl='cudnn' does not support a local window that reaches"):
        attention(q, k, v, local_window_size=(3, 2), impl="cudnn")


def test_cudnn_call_through_jax(monkeypatch):
    """The cudnn glue on the CPU: jax's cuDNN entry point is replaced by its XLA path, and the call recorded."""
    monkeypatch.setattr(_attention, "_on_gpu", lambda: True)
    calls = []
    dot_product_attention = jax.nn.dot_product_attention

    def as_xla(*args, implementation, **kwargs):
        calls.append((implementation, kwargs["local_window_size"]))
        return dot_product_attention(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
    q, k, v = (x[0] for x in _qkv(dtype=jnp.bfloat16))  # rank 3
    kwargs = {"is_causal": True, "key_value_seq_lengths": jnp.array([33], jnp.int32), "local_window_size": 4}
    with jax.numpy_dtype_promotion("standard"):  # jax's XLA path mixes bfloat16 and float32 implicitly
        out, lse = attention(q, k, v, impl="cudnn", return_residual=True, **kwargs)
        expected_out, expected_lse = dot_product_attention(q, k, v, return_residual=True, **kwargs)
    assert calls == [("cudnn", (4, 0))]  # causal: the right side of the window is dropped
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    assert lse.shape == q.shape[:-1] and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(expected_lse, np.float32))


def _alibi_hook(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (h + 1).astype(score.dtype) * jnp.abs(q_idx - kv_idx).astype(score.dtype)


def _even_keys_hook(b, h, q_idx, kv_idx):
    return (kv_idx % 2 == 0) | (kv_idx == q_idx)


@pytest.mark.parametrize("impl", ["flex", "xla", "auto"])
def test_hooks_with_every_jax_argument(impl):
    (q, k, v), kwargs = _split_case("everything")
    # Both under jit: eagerly, every op is an XLA compile of its own.
    out, lse = jax.jit(lambda q, k, v: attention(q, k, v, impl=impl, score_mod=_alibi_hook, mask_mod=_even_keys_hook,
                                                 return_residual=True, **kwargs))(q, k, v)

    @jax.jit
    def expectation(q, k, v):
        # Independent expectation: the hooks as an additive bias and a bool mask through jax.nn.
        b, h, q_idx, kv_idx = (jnp.arange(n).reshape(shape) for n, shape in (
            (BATCH, (BATCH, 1, 1, 1)), (HEADS, (1, HEADS, 1, 1)), (Q_LEN, (1, 1, Q_LEN, 1)),
            (KV_LEN, (1, 1, 1, KV_LEN))))
        extra_bias = _alibi_hook(jnp.zeros((BATCH, HEADS, Q_LEN, KV_LEN)), b, h, q_idx, kv_idx)
        return jax.nn.dot_product_attention(
            q, k, v, implementation="xla", return_residual=True,
            **dict(kwargs, bias=kwargs["bias"] + extra_bias,
                   mask=kwargs["mask"] & _even_keys_hook(b, h, q_idx, kv_idx)),
        )

    expected, expected_lse = expectation(q, k, v)
    _assert_close(out, expected)
    defined = np.arange(Q_LEN)[None, :] < np.asarray(kwargs["query_seq_lengths"])[:, None]  # jax: -2e38 past it
    _assert_close(np.asarray(lse)[defined], np.asarray(expected_lse)[defined])


def test_auto_routes_hooks_to_flex_on_gpu_and_xla_elsewhere(monkeypatch):
    q, k, v = _qkv()
    flex_calls = _recording(monkeypatch, "flex_attention")
    xla_calls = _recording(monkeypatch, "chunked_attention")
    attention(q, k, v, score_mod=_alibi_hook)
    assert (len(flex_calls), len(xla_calls)) == (0, 1)
    monkeypatch.setattr(_attention, "_on_gpu", lambda: True)
    attention(q, k, v, mask_mod=_even_keys_hook)
    assert (len(flex_calls), len(xla_calls)) == (1, 1)


@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
@pytest.mark.parametrize("feature", ["score_mod", "mask_mod"])
def test_hooks_need_flex_or_xla(monkeypatch, impl, feature):
    monkeypatch.setattr(_attention, "_on_gpu", lambda: True)  # so that cudnn gets as far as the hook check
    q, k, v = _qkv(dtype=jnp.bfloat16)
    hook = {"score_mod": _alibi_hook, "mask_mod": _even_keys_hook}
    with pytest.raises(NotImplementedError, match=f"impl='{impl}' does not support {feature}"):
        attention(q, k, v, impl=impl, **{feature: hook[feature]})


def test_head_dims_beyond_the_kernel_fall_back_to_xla(monkeypatch):
    monkeypatch.setattr(_attention, "_on_gpu", lambda: True)
    q, k, v = random_qkv(1, 1, 8, 8, 2, 2, 320)
    _assert_close(attention(q, k, v), jax.nn.dot_product_attention(q, k, v))
    with pytest.raises(NotImplementedError, match="impl='pallas' does not support head dim 320"):
        attention(q, k, v, impl="pallas")


def test_bad_inputs_name_the_argument():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="mask must be a bool array"):
        attention(q, k, v, mask=jnp.ones((Q_LEN, KV_LEN), jnp.int32))
    with pytest.raises(ValueError, match="query must have rank 3"):
        attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match="bias must be broadcastable"):
        attention(q, k, v, bias=jnp.ones((HEADS + 1, Q_LEN, KV_LEN)))
    # Errors name attention's (jax's) arguments, not the kernel's q_lengths / kv_lengths / window / q, k, v.
    with pytest.raises(ValueError, match=r"^key_value_seq_lengths must lie in"):
        attention(q, k, v, key_value_seq_lengths=jnp.array([KV_LEN + 1, 1], jnp.int32))
    with pytest.raises(ValueError, match=r"^key_value_seq_lengths must have shape \[2\], got \(\)"):
        attention(q, k, v, key_value_seq_lengths=jnp.array(5, jnp.int32))
    with pytest.raises(TypeError, match=r"^query_seq_lengths must be an integer array"):
        attention(q, k, v, query_seq_lengths=jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"^local_window_size must be None, an int >= 0.*got -1"):
        attention(q, k, v, local_window_size=-1)
    with pytest.raises(TypeError, match=r"^query, key and value must share one dtype"):
        attention(q, k.astype(jnp.bfloat16), v)
    # A truthy non-bool was taken as True; a traced rate failed with a TracerBoolConversionError.
    with pytest.raises(TypeError, match=r"^is_causal must be a bool \(True or False\), got 'yes'"):
        attention(q, k, v, is_causal="yes")
    with pytest.raises(TypeError, match=r"^dropout_rate must be a Python float, got a traced value"):
        jax.jit(lambda rate: attention(q, k, v, dropout_rate=rate, dropout_seed=1))(0.1)


def test_complex_inputs_run_jax_nn_under_auto_and_raise_otherwise():
    """No implementation here computes in complex numbers: "auto" runs jax.nn.dot_product_attention (it was a
    TypeError), an explicit impl raises NotImplementedError naming the dtype, and so do hooks / dropout."""
    q, k, v = (jax.lax.complex(*random_qkv(seed, 1, 6, 6, 2, 2, 8)[:2]) for seed in (60, 61, 62))
    mask = jnp.tril(jnp.ones((6, 6), bool))
    # jax.nn casts the complex scores to float32 (deprecated, warning) and mixes dtypes: as it does, so do we.
    with jax.numpy_dtype_promotion("standard"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Casting from complex", DeprecationWarning)
        np.testing.assert_array_equal(attention(q, k, v, mask=mask), jax.nn.dot_product_attention(q, k, v, mask=mask))
    for impl in ("pallas", "xla"):
        with pytest.raises(NotImplementedError, match=f"impl='{impl}' does not support dtype complex64"):
            attention(q, k, v, impl=impl)
    with pytest.raises(NotImplementedError, match="score_mod with dtype complex64"):
        attention(q, k, v, score_mod=lambda s, b, h, i, j: s)


def test_dropout_drops_the_same_weights_on_every_impl(monkeypatch):
    (q, k, v), kwargs = _split_case("everything")
    dropout = {"dropout_rate": 0.25, "dropout_seed": 17}
    outs = {impl: attention(q, k, v, impl=impl, **kwargs, **dropout) for impl in ("xla", "pallas", "flex")}
    _assert_close(outs["pallas"], outs["xla"])
    _assert_close(outs["flex"], outs["xla"])
    undropped = attention(q, k, v, impl="xla", **kwargs)
    assert float(jnp.abs(outs["xla"] - undropped).max()) > 0.1
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        attention(q, k, v, dropout_rate=0.1)
    monkeypatch.setattr(_attention, "_on_gpu", lambda: True)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="impl='cudnn' does not support dropout"):
        attention(q16, k16, v16, impl="cudnn", **dropout)


@pytest.mark.parametrize("dtype, q_factor, k_factor, scale", [("bfloat16", 3, 1, 0.7), ("float16", 100, 0.01, 1000.0)])
def test_traced_scale_is_as_accurate_as_a_static_one(dtype, q_factor, k_factor, scale):
    """A traced scale multiplies the float32 scores, as a static one does. It was folded into the query and
    rounded to its dtype: in bfloat16 over twice the static error, in float16 (q ~ 100, scale 1000) every
    output NaN where the static scale gives none."""
    q, k, v = random_qkv(51, 1, 16, 16, 2, 2, 16)
    q, k, v = (x.astype(dtype) for x in (q_factor * q, k_factor * k, v))
    expected, _ = numpy_attention(q, k, v, scale=scale)
    static = attention(q, k, v, scale=scale, impl="pallas")
    traced = jax.jit(lambda s: attention(q, k, v, scale=s, impl="pallas"))(scale)
    assert np.isfinite(np.asarray(traced, np.float32)).all()
    static_error = np.abs(np.asarray(static, np.float64) - expected).max()
    traced_error = np.abs(np.asarray(traced, np.float64) - expected).max()
    assert traced_error <= 1.25 * static_error + 1e-6, (traced_error, static_error)


@pytest.mark.parametrize("impl", ["pallas", "flex"])
def test_traced_negative_scale_with_a_bias_and_their_gradients(impl):
    """With a traced scale the kernels take the bias inside the scale's score_mod (their own bias would be
    scaled too): values and the gradients in the scale and the bias match jax.nn.dot_product_attention."""
    q, k, v = random_qkv(52, 1, 8, 12, 2, 1, 16)
    bias = _normal(53, (1, 2, 8, 12))

    def loss(attention, scale, bias):
        return jnp.sum(jnp.sin(attention(q, k, v, bias, scale=scale, is_causal=True)))

    ours = jax.jit(jax.value_and_grad(lambda s, b: loss(functools.partial(attention, impl=impl), s, b), (0, 1)))
    expected = jax.jit(jax.value_and_grad(lambda s, b: loss(jax.nn.dot_product_attention, s, b), (0, 1)))
    (value, grads), (expected_value, expected_grads) = ours(-0.4, bias), expected(-0.4, bias)
    np.testing.assert_allclose(value, expected_value, rtol=1e-4)
    np.testing.assert_allclose(grads[0], expected_grads[0], rtol=1e-3)
    np.testing.assert_allclose(grads[1], expected_grads[1], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("impl", ["pallas", "flex", "xla"])
def test_traced_scale_matches_jax_nn_with_its_gradient(impl):
    """A traced scale (a jit argument, a learnable temperature): values and the gradient in the scale match
    jax.nn.dot_product_attention, which takes a traced scale too."""
    q, k, v = random_qkv(50, 2, 40, 40, 4, 2, 16)

    def loss(attention, scale):
        return jnp.sum(jnp.sin(attention(q, k, v, scale=scale, is_causal=True)))

    ours = jax.jit(jax.value_and_grad(lambda s: loss(functools.partial(attention, impl=impl), s)))
    expected = jax.jit(jax.value_and_grad(lambda s: loss(jax.nn.dot_product_attention, s)))
    (value, grad), (expected_value, expected_grad) = ours(0.3), expected(0.3)
    np.testing.assert_allclose(value, expected_value, rtol=1e-4)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-3)
