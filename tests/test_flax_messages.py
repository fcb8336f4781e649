"""Issue 22 items 17-18: the drop-in attention functions raise flax's own exceptions and messages for invalid
shapes (code written against flax matches on them), and the modules' docs say where float64 runs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import probjax_nn.equinox
import probjax_nn.linen
import probjax_nn.nnx

BAD_SHAPES = {
    "rank": ((2, 4, 2, 8), (4, 2, 8), (4, 2, 8)),
    "batch": ((2, 4, 2, 8), (3, 4, 2, 8), (3, 4, 2, 8)),
    "lengths": ((2, 4, 2, 8), (2, 5, 2, 8), (2, 6, 2, 8)),
    "depths": ((2, 4, 2, 8), (2, 5, 2, 4), (2, 5, 2, 4)),
    "kv_heads": ((2, 4, 2, 8), (2, 5, 2, 8), (2, 5, 1, 8)),
    "heads": ((2, 4, 3, 8), (2, 5, 2, 8), (2, 5, 2, 8)),
}


def _error(fn, shapes, **kwargs):
    arrays = [jnp.ones(shape, jnp.float32) for shape in shapes]
    with pytest.raises(Exception) as info:
        fn(*arrays, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize(("case", "dropout"), [(case, 0.0) for case in sorted(BAD_SHAPES)] + [
    (case, 0.5) for case in sorted(BAD_SHAPES) if case != "kv_heads"])  # with dropout flax takes fewer v heads
def test_nnx_attention_fn_raises_flax_messages(case, dropout):
    ours = probjax_nn.nnx.attention_fn("xla")
    options = dict(dropout_rate=dropout, dropout_rng=jax.random.key(0))
    assert _error(ours, BAD_SHAPES[case], **options) == _error(nnx.dot_product_attention, BAD_SHAPES[case], **options)


@pytest.mark.parametrize("case", ["rank", "batch", "lengths", "depths"])
def test_linen_attention_fn_raises_flax_messages(case):
    ours = probjax_nn.linen.attention_fn("xla")
    assert _error(ours, BAD_SHAPES[case]) == _error(nn.dot_product_attention, BAD_SHAPES[case])


def test_docs_say_where_float64_runs():
    for documented in (probjax_nn.nnx.attention_fn, probjax_nn.linen.attention_fn,
                       probjax_nn.equinox.MultiheadAttention):
        assert 'float64 runs only under impl "xla" and "auto"' in " ".join(documented.__doc__.split())
    with jax.enable_x64(True):
        q = jnp.ones((1, 4, 1, 8), jnp.float64)
        assert probjax_nn.attention(q, q, q, impl="auto").dtype == jnp.float64
        with pytest.raises(NotImplementedError, match="impl='pallas' does not support dtype float64"):
            probjax_nn.attention(q, q, q, impl="pallas")


@pytest.mark.parametrize("impl", ["pallas", "flex"])
def test_float64_one_token_steps_raise_the_impls_not_implemented(impl):
    """A float64 decode step (NNX decode=True after init_cache; a one-token Linen apply) under a kernel impl
    raises the NotImplementedError naming the impl, as the full-length call does (the decode kernel's dtype
    TypeError before)."""
    message = f"impl='{impl}' does not support dtype float64"
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (2, 4, 16), jnp.float64)
        module = probjax_nn.nnx.MultiHeadAttention(2, 16, decode=True, dtype=jnp.float64, param_dtype=jnp.float64,
                                                   attention_impl=impl, rngs=nnx.Rngs(0))
        with pytest.raises(NotImplementedError, match=message):
            module(x, decode=False)
        module.init_cache(x.shape, jnp.float64)
        # flax's decode step compares its int32 cache index with an int64 under x64: standard promotion.
        with jax.numpy_dtype_promotion("standard"), pytest.raises(NotImplementedError, match=message):
            module(x[:, :1])
        linen = probjax_nn.linen.MultiHeadDotProductAttention(2, dtype=jnp.float64, param_dtype=jnp.float64,
                                                              attention_impl=impl)
        variables = nn.MultiHeadDotProductAttention(2, dtype=jnp.float64, param_dtype=jnp.float64).init(
            jax.random.key(0), x)
        for inputs in (x, x[:, :1]):
            with pytest.raises(NotImplementedError, match=message):
                linen.apply(variables, inputs)


def test_dropout_rate_out_of_range_raises_flax_message():
    ours = probjax_nn.nnx.attention_fn("xla")
    q = jnp.ones((2, 4, 2, 8), jnp.float32)
    options = dict(dropout_rate=1.5, dropout_rng=jax.random.key(0))
    assert _error(ours, (q.shape,) * 3, **options) == _error(nnx.dot_product_attention, (q.shape,) * 3, **options)
    assert "dropout_rate must be in the range [0, 1), got 1.5." in _error(ours, (q.shape,) * 3, **options)[1]


@pytest.mark.parametrize("einsums", [
    dict(qk_attn_weights_einsum=jnp.einsum),
    dict(precision=jax.lax.Precision.HIGHEST, qk_attn_weights_einsum=jnp.einsum,
         attn_weights_value_einsum=jnp.einsum),
    dict(einsum_dot_general=jax.lax.dot_general, qk_attn_weights_einsum=jnp.einsum,
         attn_weights_value_einsum=jnp.einsum),
])
@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_linen_bad_einsum_combinations_raise_flax_value_error(einsums, impl):
    """Flax's ValueError for a bad combination of custom einsums / precision comes first, under every impl
    (a kernel impl raised NotImplementedError for custom einsums before)."""
    ours = probjax_nn.linen.attention_fn(impl)
    shapes = ((2, 4, 2, 8),) * 3
    assert _error(ours, shapes, **einsums) == _error(nn.dot_product_attention, shapes, **einsums)
