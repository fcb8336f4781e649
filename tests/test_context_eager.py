"""Context parallelism (`AttentionConfig(context_axis=...)`) called eagerly, outside jit, on a 2-axis mesh
("data", "seq") of Auto or Explicit axes: the same outputs and gradients as under jit and as the unsharded
call. conftest.py gives the CPU 8 host devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, random_qkv
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import probjax_nn
from probjax_kernels import alibi
from probjax_nn import AttentionConfig

SLOPES = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)


def _loss(impl, hooks, weights, q, k, v):
    """A weighted sum of the outputs of a causal GQA call with dropout from a Python-int seed (made into an
    array under the mesh), the soft cap and, where the impl takes hooks, an ALiBi score_mod."""
    out = probjax_nn.attention(
        q, k, v, is_causal=True, dropout_rate=0.2, dropout_seed=11, logits_soft_cap=3.0, impl=impl,
        score_mod=alibi(SLOPES) if hooks else None,
    )
    return jnp.sum(out * weights)


# The interpreted kernels run eagerly op by op (22 s a case), so "pallas" takes one axis type; the mesh's axis
# types change the sharding around the kernels, which "xla" covers with both.
@pytest.mark.parametrize(("impl", "axis_type"), [("pallas", AxisType.Explicit), ("xla", AxisType.Auto),
                                                 ("xla", AxisType.Explicit)],
                         ids=["pallas-explicit", "xla-auto", "xla-explicit"])
def test_context_parallel_eager_equals_jit(impl, axis_type):
    q, k, v = random_qkv(21, 2, 32, 32, 4, 2, 16)
    weights = normal(22, q.shape, jnp.float32)
    hooks = impl != "pallas"  # "pallas" takes no score_mod
    plain = functools.partial(_loss, AttentionConfig(impl="xla"), hooks, weights)
    expected = jax.jit(jax.value_and_grad(plain, (0, 1, 2)))(q, k, v)
    parallel = functools.partial(_loss, AttentionConfig(impl=impl, context_axis="seq"), hooks, weights)
    mesh = jax.make_mesh((2, 2), ("data", "seq"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, jax.NamedSharding(mesh, P("data", "seq"))) for x in (q, k, v)]
        eager_out = probjax_nn.attention(*placed, is_causal=True, impl=AttentionConfig(impl=impl, context_axis="seq"))
        eager = jax.value_and_grad(parallel, (0, 1, 2))(*placed)
        jitted = jax.jit(jax.value_and_grad(parallel, (0, 1, 2)))(*placed)
    assert_close(eager_out, probjax_nn.attention(q, k, v, is_causal=True, impl="xla"), jnp.float32, "out")
    for result in (eager, jitted):
        np.testing.assert_allclose(result[0], expected[0], rtol=1e-5)
        for name, actual, wanted in zip(("dq", "dk", "dv"), result[1], expected[1]):
            assert_close(actual, wanted, jnp.float32, name)
