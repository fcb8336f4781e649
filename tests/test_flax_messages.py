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
