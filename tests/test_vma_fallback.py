"""The kernels inside a user's `jax.shard_map` with its default `check_vma=True` on the CPU: jax 0.11.2's
interpreters of the GPU kernels cannot run on varying types ("Scan carry input and output got mismatched
varying manual axes" in the backward, a while_loop carry TypeError in a partly-manual shard_map), so
`flash_attention`, `flex_attention` and `probjax_nn.attention` take their plain-jnp path there, as
`ring_attention` does: outputs and gradients equal the unsharded call's. conftest.py gives 8 host devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, random_qkv
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import probjax_nn
from probjax_kernels import causal_mask, create_block_mask, flash_attention, flex_attention, softcap

T = 32


def _flash(q, k, v):
    return flash_attention(q, k, v, causal=True, window=9, logits_soft_cap=2.5)


def _flex(q, k, v):
    mask = create_block_mask(causal_mask, None, None, T, T, BLOCK_SIZE=16)
    return flex_attention(q, k, v, softcap(3.0), mask, enable_gqa=True)


CALLS = {
    "flash": (_flash, functools.partial(probjax_nn.attention, is_causal=True, local_window_size=9,
                                        logits_soft_cap=2.5, impl="xla")),
    "flex": (_flex, functools.partial(probjax_nn.attention, is_causal=True, score_mod=softcap(3.0), impl="xla")),
    "attention pallas": (functools.partial(probjax_nn.attention, is_causal=True, impl="pallas", logits_soft_cap=2.0),
                         functools.partial(probjax_nn.attention, is_causal=True, impl="xla", logits_soft_cap=2.0)),
    "attention flex": (functools.partial(probjax_nn.attention, impl="flex", mask_mod=causal_mask),
                       functools.partial(probjax_nn.attention, impl="xla", mask_mod=causal_mask)),
}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("manual", ["data", "all"])
@pytest.mark.parametrize("call", list(CALLS))
def test_gradients_inside_a_checked_shard_map(call, manual, axis_type):
    """The batch split over "data" of a ("data", "model") mesh, "model" manual too or left free: the
    outputs and the gradients of a weighted sum equal the unsharded plain-jnp call's."""
    attend, plain = CALLS[call]
    q, k, v = random_qkv(31, 4, T, T, 4, 2, 16)
    weights = normal(32, q.shape, jnp.float32)

    def value_and_grads(fn, q, k, v, weights):
        def loss(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(out * weights), out
        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    expected = jax.jit(functools.partial(value_and_grads, plain))(q, k, v, weights)
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    batch = P("data")
    sharded = jax.shard_map(
        functools.partial(value_and_grads, attend), mesh=mesh, in_specs=(batch,) * 4, out_specs=(batch, (batch,) * 3),
        axis_names={"data", "model"} if manual == "all" else {"data"},
    )
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, jax.NamedSharding(mesh, batch)) for x in (q, k, v, weights)]
        out, grads = jax.jit(sharded)(*placed)
    assert_close(out, expected[0], jnp.float32, "out")
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads, expected[1]):
        assert_close(actual, wanted, jnp.float32, name)
    assert np.isfinite(np.asarray(grads[0])).all()
