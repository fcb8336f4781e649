"""`logits_soft_cap` of the drop-in modules (NNX, Linen, Equinox): no new parameter (the stock module's state
loads unchanged), and outputs against a float64 NumPy computation from that state; an NNX decode loop with
the cap against the whole causal sequence."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from helpers import assert_close, to_float32
from module_helpers import BATCH, FEATURES, HEADS, SEQ, inputs
from test_soft_cap import numpy_capped

import probjax_nn.equinox
import probjax_nn.linen
import probjax_nn.nnx

CAP = 2.0
QKV = 64  # head dim 16
CAUSAL = np.tril(np.ones((SEQ, SEQ), bool))


def _float64(x):
    return to_float32(x).astype(np.float64)


def numpy_module(x, query, key, value, out, *, causal=False):
    """A multi-head attention layer in float64 NumPy from flax-style (kernel, bias) pairs: projections
    `[F, N, H]` / `[N]`-`[N, H]` biases, output `[N, H, F]`; attention soft-capped at CAP."""
    x = _float64(x)
    heads = [np.einsum("btf,fnh->btnh", x, _float64(w)) + _float64(b) for w, b in (query, key, value)]
    attended, *_ = numpy_capped(*heads, CAP, np.zeros(heads[0].shape), allowed=CAUSAL if causal else None)
    return np.einsum("btnh,nhf->btf", attended, _float64(out[0])) + _float64(out[1])


def test_nnx_soft_cap_keeps_the_stock_state():
    stock = nnx.MultiHeadAttention(HEADS, FEATURES, QKV, decode=False, rngs=nnx.Rngs(0))
    ours = probjax_nn.nnx.MultiHeadAttention(HEADS, FEATURES, QKV, decode=False, logits_soft_cap=CAP, rngs=nnx.Rngs(0))
    assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(stock))
    nnx.update(ours, nnx.state(stock))
    x = 4.0 * inputs(1)
    layers = [(getattr(stock, n).kernel[...], getattr(stock, n).bias[...]) for n in ("query", "key", "value", "out")]
    assert_close(ours(x), numpy_module(x, *layers), jnp.float32)
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive, finite float or None, got -1"):
        probjax_nn.nnx.MultiHeadAttention(HEADS, FEATURES, logits_soft_cap=-1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pass logits_soft_cap or attention_fn, not both"):
        probjax_nn.nnx.MultiHeadAttention(HEADS, FEATURES, logits_soft_cap=CAP,
                                          attention_fn=probjax_nn.nnx.attention_fn(), rngs=nnx.Rngs(0))


def test_nnx_soft_cap_decode_matches_the_causal_sequence():
    """One token per call through the decode kernel (impl "pallas": the cap as its score_mod) against the
    whole causal sequence in NumPy."""
    module = probjax_nn.nnx.MultiHeadAttention(HEADS, FEATURES, QKV, decode=True, attention_impl="pallas",
                                               logits_soft_cap=CAP, rngs=nnx.Rngs(1))
    x = 4.0 * inputs(2)
    module.init_cache(x.shape)
    step = nnx.jit(lambda module, token: module(token, decode=True))
    steps = jnp.concatenate([step(module, x[:, t:t + 1]) for t in range(SEQ)], axis=1)
    layers = [(getattr(module, n).kernel[...], getattr(module, n).bias[...]) for n in ("query", "key", "value", "out")]
    assert_close(steps, numpy_module(x, *layers, causal=True), jnp.float32)


def test_linen_soft_cap_keeps_the_stock_variables():
    x = 4.0 * inputs(3)
    stock = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=QKV)
    ours = probjax_nn.linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=QKV, logits_soft_cap=CAP,
                                                         attention_impl="flex")
    variables = stock.init(jax.random.key(0), x)
    assert jax.tree.structure(ours.init(jax.random.key(0), x)) == jax.tree.structure(variables)
    params = variables["params"]
    layers = [(params[n]["kernel"], params[n]["bias"]) for n in ("query", "key", "value", "out")]
    mask = nn.make_causal_mask(jnp.ones((BATCH, SEQ)))
    assert_close(ours.apply(variables, x, mask=mask), numpy_module(x, *layers, causal=True), jnp.float32)
    assert ours.clone(logits_soft_cap=None).apply(variables, x, mask=mask).shape == x.shape


def test_equinox_soft_cap_keeps_the_stock_leaves():
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, qk_size=QKV // HEADS, vo_size=QKV // HEADS,
                                      use_query_bias=True, use_key_bias=True, use_value_bias=True,
                                      use_output_bias=True, key=jax.random.key(0))
    ours = probjax_nn.equinox.MultiheadAttention(
        HEADS, FEATURES, qk_size=QKV // HEADS, vo_size=QKV // HEADS, use_query_bias=True, use_key_bias=True,
        use_value_bias=True, use_output_bias=True, logits_soft_cap=CAP, key=jax.random.key(0))
    assert [np.shape(x) for x in jax.tree.leaves(ours)] == [np.shape(x) for x in jax.tree.leaves(stock)]
    x = 4.0 * inputs(4)

    def layer(linear):  # eqx.nn.Linear's [N * H, F] weight as flax's [F, N, H] kernel
        return (linear.weight.T.reshape(FEATURES, HEADS, -1), linear.bias.reshape(HEADS, -1))

    out = (stock.output_proj.weight.T.reshape(HEADS, -1, FEATURES), stock.output_proj.bias)
    expected = numpy_module(x, layer(stock.query_proj), layer(stock.key_proj), layer(stock.value_proj), out)
    actual = jax.vmap(lambda x: ours(x, x, x))(x)
    assert_close(actual, expected, jnp.float32)
