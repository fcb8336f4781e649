"""Head dims under 64 on the Mosaic GPU kernels (Hopper's, in the Mosaic GPU CPU interpreter): q, k, v (and out,
the cotangent, the tangents) widened to 64 with zero columns (`mosaic.glue.kernel_head_dims`), which change no
score, and the results cut back to the call's head dims; against the plain-jnp reference. Blackwell's are in
test_mosaic_tcgen05_features.py."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close, random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
from test_mosaic_dispatch import assert_mosaic_matches_reference

from probjax_kernels import FlashConfig, flash_attention, flash_attention_reference
from probjax_kernels.mosaic import glue as mosaic_glue


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize("head_dim, value_dim", [(16, 16), (32, 64)])
def test_forward_and_backward(head_dim, value_dim):
    """Head dims 16 and 32 (q / k's; v's 16 or 64): the Mosaic forward and backward run, and out and the
    gradients match the reference's at the call's own head dims."""
    q, k, _ = random_qkv(40, 1, 192, 192, 2, 1, head_dim, jnp.bfloat16)
    v = random_qkv(41, 1, 192, 192, 2, 1, value_dim, jnp.bfloat16)[2]
    assert_mosaic_matches_reference(q, k, v, 42, causal=True, kv_lengths=jnp.array([150]))


def test_the_tangent(monkeypatch):
    """Head dim 32: the Mosaic tangent kernel runs, and d out (cut back to 32) matches the reference's jvp."""
    calls, kernel = [], mosaic_glue.mosaic_tangent
    monkeypatch.setattr(mosaic_glue, "mosaic_tangent", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    q, k, v = random_qkv(14, 1, 192, 192, 2, 1, 32, jnp.bfloat16)
    tangents = random_qkv(15, 1, 192, 192, 2, 1, 32, jnp.bfloat16)
    options = dict(causal=True, kv_lengths=jnp.array([170]))

    def jvp(fn, primals, tangents):
        return jax.jit(lambda p, t: jax.jvp(fn, p, t))(tuple(primals), tuple(tangents))

    mosaic = FlashConfig(backend="mosaic_interpret")
    _, d_out = jvp(lambda q, k, v: flash_attention(q, k, v, config=mosaic, **options), (q, k, v), tangents)
    _, want = jvp(lambda q, k, v: flash_attention_reference(q, k, v, **options),
                  [x.astype(jnp.float32) for x in (q, k, v)], [t.astype(jnp.float32) for t in tangents])
    assert calls and d_out.shape == q.shape
    assert_close(d_out, want, jnp.bfloat16, "d out")
