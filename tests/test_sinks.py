"""Attention sinks (`sinks` [N]: a per-head logit of a virtual key with value 0) in every front-end and module,
against a float64 NumPy attention that appends that key as one more column of the scores."""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import probjax_kernels as pk
import probjax_nn
import probjax_nn.equinox as peqx
import probjax_nn.linen as plinen
import probjax_nn.nnx as pnnx
from helpers import assert_close, normal, numpy_allowed, numpy_attention, random_qkv

SINKS = np.array([0.7, -1.5, 2.0, 0.0], np.float32)


def numpy_with_sinks(q, k, v, sinks, allowed=None, scale=None):
    """(out, lse) of attention whose scores get one more column: a key of zeros (score 0) with a bias of
    sinks[h] and a value of zeros, attended by every row."""
    batch, q_len, num_heads, _ = q.shape
    kv_len = k.shape[1]
    zeros = lambda x: np.zeros((x.shape[0], 1, *x.shape[2:]), np.float32)  # noqa: E731
    k_ext = np.concatenate([np.asarray(k, np.float32), zeros(k)], axis=1)
    v_ext = np.concatenate([np.asarray(v, np.float32), zeros(v)], axis=1)
    bias = np.zeros((batch, num_heads, q_len, kv_len + 1))
    bias[..., kv_len] = np.asarray(sinks, np.float64)[None, :, None]
    if allowed is None:
        allowed = np.ones((batch, 1, q_len, kv_len), bool)
    allowed = np.broadcast_to(allowed, (batch, allowed.shape[1], q_len, kv_len))
    allowed = np.concatenate([allowed, np.ones((*allowed.shape[:3], 1), bool)], axis=-1)
    return numpy_attention(q, k_ext, v_ext, allowed=allowed, bias=bias, scale=scale)


def test_flash_forward_grad_and_tangent_gqa_causal_with_an_empty_row():
    q, k, v = random_qkv(0, 2, 20, 20, 4, 2, 16)
    kv_lengths = jnp.array([20, 0], jnp.int32)  # the second sequence attends nothing: only the sink
    sinks = jnp.asarray(SINKS)
    allowed = numpy_allowed(2, 20, 20, causal=True, kv_lengths=np.asarray(kv_lengths))

    def attend(q, k, v, sinks):
        return pk.flash_attention(q, k, v, causal=True, kv_lengths=kv_lengths, sinks=sinks, return_lse=True)

    (out, lse), vjp = jax.jit(lambda *a: jax.vjp(attend, *a))(q, k, v, sinks)
    expected_out, expected_lse = numpy_with_sinks(q, k, v, SINKS, allowed)
    assert_close(out, expected_out, jnp.float32, "out")
    assert_close(lse, expected_lse, jnp.float32, "lse")
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    np.testing.assert_allclose(np.asarray(lse[1]), np.broadcast_to(SINKS[:, None], (4, 20)), rtol=1e-6)
    d_out = normal(7, out.shape)
    grads = vjp((d_out, jnp.zeros_like(lse)))

    def loss(q, k, v, sinks):  # the same loss through the plain-jnp reference (Precision.HIGHEST), by jax.grad
        out = pk.flash_attention_reference(q, k, v, causal=True, kv_lengths=kv_lengths, sinks=sinks)
        return jnp.sum(out * d_out)

    expected = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected):
        assert_close(got, want, jnp.float32, name)
    tangent = jax.jvp(lambda s: attend(q, k, v, s)[0], (sinks,), (jnp.ones_like(sinks),))[1]
    want = jax.jvp(lambda s: pk.flash_attention_reference(q, k, v, causal=True, kv_lengths=kv_lengths, sinks=s),
                   (sinks,), (jnp.ones_like(sinks),))[1]
    assert_close(tangent, want, jnp.float32, "tangent")


def test_flash_bfloat16_and_value_dim():
    q, k, v = random_qkv(1, 1, 24, 24, 4, 4, 32, jnp.bfloat16)
    v = v[..., :16]
    out = pk.flash_attention(q, k, v, sinks=jnp.asarray(SINKS))
    assert out.dtype == jnp.bfloat16
    assert_close(out, numpy_with_sinks(q, k, v, SINKS)[0], jnp.bfloat16, "out")


def test_flex_with_score_mod_and_block_mask():
    q, k, v = random_qkv(2, 1, 32, 32, 4, 2, 16)
    slopes = pk.alibi_slopes(4)
    block_mask = pk.create_block_mask(pk.causal_mask, None, None, 32, 32)
    out, lse = pk.flex_attention(q, k, v, pk.alibi(slopes), block_mask, enable_gqa=True, return_lse=True,
                                 sinks=jnp.asarray(SINKS))
    rows, cols = np.arange(32)[:, None], np.arange(32)[None, :]
    bias = -np.asarray(slopes, np.float64)[:, None, None] * np.abs(rows - cols)
    bias = np.concatenate([bias[None], np.zeros((1, 4, 32, 1))], axis=-1)  # the sink column gets no ALiBi
    zeros = np.zeros((1, 1, 2, 16), np.float32)
    sink_bias = np.zeros((1, 4, 32, 33))
    sink_bias[..., 32] = SINKS[None, :, None]
    allowed = np.concatenate([np.tril(np.ones((32, 32), bool)), np.ones((32, 1), bool)], axis=-1)
    expected_out, expected_lse = numpy_attention(
        q, np.concatenate([np.asarray(k), zeros], 1), np.concatenate([np.asarray(v), zeros], 1),
        allowed=allowed, bias=bias + sink_bias)
    assert_close(out, expected_out, jnp.float32, "out")
    assert_close(lse, expected_lse, jnp.float32, "lse")
    reference = pk.flex_attention_reference(q, k, v, pk.alibi(slopes), block_mask, enable_gqa=True,
                                            sinks=jnp.asarray(SINKS))
    assert_close(reference, expected_out, jnp.float32, "reference")


@pytest.mark.parametrize("paged", [False, True])
def test_decode(paged):
    batch, new, heads, kv_heads, dim, page = 2, 2, 4, 2, 16, 16
    lengths = np.array([37, 5], np.int32)
    q = normal(3, (batch, new, heads, dim))
    keys = normal(4, (batch, 48, kv_heads, dim))
    values = normal(5, (batch, 48, kv_heads, dim))
    if paged:  # 3 pages per sequence, laid out in reverse order in the pool
        tables = jnp.array([[5, 4, 3], [2, 1, 0]], jnp.int32)
        pool = lambda x: jnp.flip(x.reshape(batch * 3, page, kv_heads, dim), 0)  # noqa: E731
        k, v, extra = pool(keys), pool(values), dict(block_tables=tables)
    else:
        k, v, extra = keys, values, {}
    out, lse = pk.decode_attention(q, k, v, kv_lengths=jnp.asarray(lengths), sinks=jnp.asarray(SINKS),
                                   return_lse=True, **extra)
    positions = lengths[:, None] - new + np.arange(new)[None, :]
    allowed = np.arange(48)[None, None, None, :] <= positions[:, None, :, None]
    expected_out, expected_lse = numpy_with_sinks(q, keys, values, SINKS, allowed)
    assert_close(out, expected_out, jnp.float32, "out")
    assert_close(lse, expected_lse, jnp.float32, "lse")
    reference = pk.decode_attention_reference(q, k, v, kv_lengths=jnp.asarray(lengths), sinks=jnp.asarray(SINKS),
                                              **extra)
    assert_close(reference, expected_out, jnp.float32, "reference")


def test_ring_attention_on_four_devices():
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = random_qkv(6, 1, 32, 32, 4, 2, 16)
    seq = P(None, "sp")

    def attend(q, k, v, sinks):
        return pk.ring_attention(q, k, v, axis_name="sp", causal=True, sinks=sinks)

    mapped = jax.shard_map(attend, mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=seq, check_vma=False)
    d_out = normal(8, (1, 32, 4, 16))
    out, vjp = jax.vjp(mapped, q, k, v, jnp.asarray(SINKS))
    allowed = numpy_allowed(1, 32, 32, causal=True)
    assert_close(out, numpy_with_sinks(q, k, v, SINKS, allowed)[0], jnp.float32, "out")
    grads = vjp(d_out)
    expected = jax.vjp(lambda *a: pk.flash_attention_reference(*a[:3], causal=True, sinks=a[3]),
                       q, k, v, jnp.asarray(SINKS))[1](d_out)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected):
        assert_close(got, want, jnp.float32, name, factor=4)


@pytest.mark.parametrize("impl", ["xla", "pallas", "flex", "auto"])
def test_probjax_nn_attention(impl):
    q, k, v = random_qkv(9, 2, 12, 12, 4, 2, 16)
    out, lse = probjax_nn.attention(q, k, v, is_causal=True, impl=impl, sinks=jnp.asarray(SINKS),
                                    return_residual=True)
    expected_out, expected_lse = numpy_with_sinks(q, k, v, SINKS, numpy_allowed(2, 12, 12, causal=True))
    assert_close(out, expected_out, jnp.float32, "out")
    assert_close(lse, np.swapaxes(expected_lse, 1, 2), jnp.float32, "lse")  # jax's residual layout [B, T, N]
    grad = jax.grad(lambda s: jnp.sum(probjax_nn.attention(q, k, v, is_causal=True, impl=impl, sinks=s) ** 2))(
        jnp.asarray(SINKS))
    want = jax.grad(lambda s: jnp.sum(pk.flash_attention_reference(q, k, v, causal=True, sinks=s) ** 2))(
        jnp.asarray(SINKS))
    assert_close(grad, want, jnp.float32, "dsinks")


def test_bad_sinks():
    q, k, v = random_qkv(10, 1, 8, 8, 4, 4, 16)
    with pytest.raises(ValueError, match=r"sinks must have shape \[N\] = \[4\].*got \[2\]"):
        pk.flash_attention(q, k, v, sinks=jnp.zeros(2))
    with pytest.raises(TypeError, match="sinks must be a float array.*int32"):
        pk.flex_attention(q, k, v, sinks=jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="sinks must be finite"):
        probjax_nn.attention(q, k, v, sinks=jnp.array([0.0, -jnp.inf, 0.0, 0.0]))
    with pytest.raises(NotImplementedError, match="impl='cudnn' does not support sinks"):
        probjax_nn.attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                             impl="cudnn", sinks=jnp.zeros(4))
    with pytest.raises(ValueError, match="pass attention_sinks or attention_fn, not both"):
        pnnx.MultiHeadAttention(4, 16, attention_sinks=True, attention_fn=nnx.dot_product_attention,
                                rngs=nnx.Rngs(0))


def _sink_attention_fn(sinks, query, key, value, mask=None, **kwargs):
    """flax's attention with the sink as an extra key: the stock modules' expected output."""
    del kwargs
    pad = lambda x: jnp.concatenate([x, jnp.zeros((*x.shape[:-3], 1, *x.shape[-2:]), x.dtype)], -3)  # noqa: E731
    *batch, q_len, heads, _ = query.shape
    kv_len = key.shape[-3]
    bias = jnp.zeros((*batch, heads, q_len, kv_len + 1)).at[..., kv_len].set(sinks[:, None])
    if mask is not None:
        mask = jnp.concatenate([jnp.broadcast_to(mask.astype(bool), (*batch, heads, q_len, kv_len)),
                                jnp.ones((*batch, heads, q_len, 1), bool)], -1)
    return jax.nn.dot_product_attention(query, pad(key), pad(value), bias, mask, implementation="xla")


def test_nnx_module_and_its_decode_steps():
    x = normal(11, (2, 6, 16))
    module = pnnx.MultiHeadAttention(4, 16, attention_sinks=True, decode=False, rngs=nnx.Rngs(0))
    module.sinks[...] = jnp.asarray(SINKS)
    stock = nnx.MultiHeadAttention(4, 16, decode=False, rngs=nnx.Rngs(0),
                                   attention_fn=functools.partial(_sink_attention_fn, jnp.asarray(SINKS)))
    causal = nnx.make_causal_mask(x[..., 0])
    assert_close(module(x, is_causal=True), stock(x, mask=causal), jnp.float32, "nnx")
    grads = nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2))(module)
    assert np.abs(np.asarray(grads.sinks[...])).min() > 0
    module.init_cache((2, 6, 16))
    steps = jnp.concatenate([module(x[:, t:t + 1], decode=True) for t in range(6)], axis=1)
    assert_close(steps, stock(x, mask=causal), jnp.float32, "decode steps")
    plain = pnnx.MultiHeadAttention(4, 16, decode=False, rngs=nnx.Rngs(0))
    assert plain.sinks is None and "sinks" not in nnx.state(plain, nnx.Param)


def test_linen_module():
    x = normal(12, (2, 6, 16))
    module = plinen.MultiHeadDotProductAttention(num_heads=4, attention_sinks=True)
    variables = module.init(jax.random.key(0), x)
    params = dict(variables["params"], sinks=jnp.asarray(SINKS))
    stock = nn.MultiHeadDotProductAttention(num_heads=4,
                                            attention_fn=functools.partial(_sink_attention_fn, jnp.asarray(SINKS)))
    stock_params = {name: value for name, value in params.items() if name != "sinks"}
    assert_close(module.apply({"params": params}, x), stock.apply({"params": stock_params}, x), jnp.float32,
                 "linen")
    grads = jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x) ** 2))(params)
    assert np.abs(np.asarray(grads["sinks"])).min() > 0
    assert "sinks" not in plinen.MultiHeadDotProductAttention(num_heads=4).init(jax.random.key(0), x)["params"]


def test_equinox_module():
    x = normal(13, (6, 16))
    module = peqx.MultiheadAttention(4, 16, attention_sinks=True, key=jax.random.key(0))
    module = eqx.tree_at(lambda m: m.sinks, module, jnp.asarray(SINKS))
    stock = eqx.nn.MultiheadAttention(4, 16, key=jax.random.key(0))
    heads = lambda proj, x: jax.vmap(proj)(x).reshape(6, 4, -1)  # noqa: E731
    q, k, v = (heads(p, x)[None] for p in (stock.query_proj, stock.key_proj, stock.value_proj))
    expected = numpy_with_sinks(q, k, v, SINKS)[0][0].reshape(6, -1)
    expected = jax.vmap(stock.output_proj)(jnp.asarray(expected, jnp.float32))
    assert_close(module(x, x, x), expected, jnp.float32, "equinox")
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x, x, x) ** 2))(module)
    assert np.abs(np.asarray(grads.sinks)).min() > 0
    plain = peqx.MultiheadAttention(4, 16, key=jax.random.key(0))
    assert len(jax.tree.leaves(plain)) == len(jax.tree.leaves(stock))
