"""The Pallas kernels (impl "pallas" / "flex") on inputs sharded over a mesh, Explicit and Auto axes: they run
per shard of the batch and heads (a shard_map in the program), hooks and dropout see the whole attention's
b and h, and the results equal the unsharded call's. conftest.py gives the CPU 8 host devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close, normal, random_qkv
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import probjax_nn
from probjax_kernels import alibi

SLOPES = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)


def _mesh(axis_type):
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def _lengths_mask(lengths):
    """A mask_mod that reads b: example b attends to its first lengths[b] keys."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]
    return mask_mod


def test_flex_hooks_and_dropout_per_shard():
    """Batch and heads split over a 2 x 2 mesh of Auto axes (the layout the layer asks for: XLA's own is not
    visible when it traces; Explicit axes run the same shard_map, see the tests below): ALiBi reads h, the
    mask_mod reads b, dropout hashes both; the outputs are the unsharded ones (impl "xla", the same seed),
    and the kernel ran inside a shard_map."""
    q, k, v = random_qkv(0, 4, 32, 32, 4, 2, 16)
    lengths = jnp.asarray([32, 9, 20, 1], jnp.int32)
    kwargs = dict(is_causal=True, score_mod=alibi(SLOPES), mask_mod=_lengths_mask(lengths), dropout_rate=0.25,
                  dropout_seed=7)
    expected = jax.jit(functools.partial(probjax_nn.attention, impl="xla", **kwargs))(q, k, v)
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, jax.NamedSharding(mesh, P("data", None, "model"))) for x in (q, k, v)]
        attend = jax.jit(functools.partial(probjax_nn.attention, impl="flex", **kwargs))
        assert "shard_map" in str(jax.make_jaxpr(attend)(*placed))
        out = attend(*placed)
    assert_close(out, expected, jnp.float32)


def test_pallas_gradients_sequence_sharded():
    """impl "pallas" on Explicit axes, the batch on "data" and the sequence on "model" (not a context-parallel
    call: the sequence is gathered), GQA: outputs and gradients equal the unsharded call's."""
    q, k, v = random_qkv(1, 2, 32, 32, 4, 2, 16)
    weights = normal(2, (2, 32, 4, 16), jnp.float32)

    def loss(impl, q, k, v):
        return jnp.sum(probjax_nn.attention(q, k, v, is_causal=True, impl=impl) * weights)

    expected = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), (0, 1, 2)))(q, k, v)
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, jax.NamedSharding(mesh, P("data", "model"))) for x in (q, k, v)]
        value, grads = jax.jit(jax.value_and_grad(functools.partial(loss, "pallas"), (0, 1, 2)))(*placed)
    np.testing.assert_allclose(value, expected[0], rtol=1e-5)
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads, expected[1]):
        assert_close(actual, wanted, jnp.float32, name)


def test_modules_with_pallas_on_an_explicit_mesh():
    """The NNX and Equinox drop-ins with attention_impl="pallas" on a batch sharded over an Explicit mesh (the
    Flax NNX minigpt tutorial's setting; Equinox under jax.vmap) give the stock modules' outputs. Linen's
    module reaches `attention` through the same `AttentionFunction` as NNX's."""
    import equinox as eqx
    from flax import nnx

    from probjax_nn import equinox as peqx
    from probjax_nn import nnx as pnnx

    x = normal(3, (4, 16, 32), jnp.float32)
    nnx_ours = pnnx.MultiHeadAttention(4, 32, attention_impl="pallas", decode=False, rngs=nnx.Rngs(0))
    nnx_stock = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
    eqx_ours = peqx.MultiheadAttention(4, 32, attention_impl="pallas", key=jax.random.key(0))
    eqx_stock = eqx.nn.MultiheadAttention(4, 32, key=jax.random.key(0))
    expected = {
        "nnx": nnx_stock(x),
        "equinox": jax.vmap(eqx_stock)(x, x, x),
    }
    calls = {
        "nnx": (nnx.jit(lambda module, x: module(x)), nnx_ours),
        "equinox": (eqx.filter_jit(lambda module, x: jax.vmap(module)(x, x, x)), eqx_ours),
    }
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        placed = jax.device_put(x, P("data"))
        for name, (call, state) in calls.items():
            assert_close(call(state, placed), expected[name], jnp.float32, name)


def test_kernels_inside_a_partly_manual_shard_map():
    """impl "pallas" and "flex" inside the caller's shard_map that makes only "data" manual, on an Explicit
    ("data", "model") mesh, the inputs replicated over "model": the kernel runs with the free axis turned Auto
    (turning the manual "data" Auto too raised NotImplementedError), with the unsharded outputs."""
    q, k, v = random_qkv(4, 4, 16, 16, 4, 2, 16)
    expected = probjax_nn.attention(q, k, v, is_causal=True, impl="xla")
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, P("data")) for x in (q, k, v)]
        for impl in ("pallas", "flex"):
            attend = functools.partial(probjax_nn.attention, is_causal=True, impl=impl)
            mapped = jax.shard_map(attend, in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
            assert_close(jax.jit(mapped)(*placed), expected, jnp.float32, impl)
