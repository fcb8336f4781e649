"""Dropout at head dim 256 on backend "mosaic_interpret" (the Mosaic GPU CPU interpreter): the Mosaic forward
(hashing the keep mask by halves of its tile beside v's 256 columns: `forward.dropped_by_halves`) and the head dim
256 dQ / dK / dV programs drop exactly the weights of the plain-jnp reference (every backend's
`_dropout.keep_mask`), and so do the jvp's tangent programs, with d out in 64-column pieces (beside 128-column ones
the hash spilled the tangent's dK pieces)."""

import jax.numpy as jnp
import pytest
from helpers import assert_close, random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
from test_mosaic_dispatch import MOSAIC, assert_mosaic_matches_reference, runs_triton_forward
from test_mosaic_tangent import _jvp_through

from probjax_kernels import flash_attention, flash_attention_reference


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize(
    "head_dims, causal, num_kv_heads, positional",
    [
        ((256, 256), True, 1, False),  # halves; dQ and dK in pieces, dV its own program; GQA 2:1
        ((64, 256), False, 2, True),  # halves on v's 256 columns alone; the seed as positional_seed's [7]
        ((256, 128), True, 2, False),  # the whole tile's hash beside 128 columns, on 64-key steps
    ],
)
def test_dropout_at_head_dim_256_runs_the_mosaic_forward_and_backward(head_dims, causal, num_kv_heads, positional):
    """out and the gradients of q, k and v against the reference's with the same keep mask, on ragged lengths
    (a sequence whose last keys are padding)."""
    (head_dim, value_dim), batch, seq, num_heads = head_dims, 2, 256, 2
    q, k, _ = random_qkv(31, batch, seq, seq, num_heads, num_kv_heads, head_dim, jnp.bfloat16)
    v = random_qkv(32, batch, seq, seq, num_heads, num_kv_heads, value_dim, jnp.bfloat16)[2]
    private = {"_dropout_shard": (0, 0, num_heads)} if positional else {}
    assert_mosaic_matches_reference(q, k, v, 33, causal=causal, kv_lengths=jnp.array([256, 150]), dropout_rate=0.3,
                                    dropout_seed=91, **private)


def test_the_jvp_of_dropout_at_head_dim_256_runs_the_mosaic_tangent(tangent_calls):
    """The Mosaic forward and the Mosaic tangent's split programs with d out in four 64-column pieces, on ragged
    keys: out and d out of the reference with the same keep mask."""
    q, k, v = random_qkv(34, 1, 192, 192, 2, 2, 256, jnp.bfloat16)
    tangents = random_qkv(35, 1, 192, 192, 2, 2, 256, jnp.bfloat16)
    options = dict(causal=True, dropout_rate=0.2, dropout_seed=5, kv_lengths=jnp.array([150]))
    fn = lambda q, k, v: flash_attention(q, k, v, config=MOSAIC, **options)  # noqa: E731
    assert not runs_triton_forward(fn, q, k, v)
    (out, d_out), (want_out, want_d_out) = _jvp_through(
        fn, lambda q, k, v: flash_attention_reference(q, k, v, **options), (q, k, v), tangents)
    assert {(call.get("pieces"), call.get("split")) for call in tangent_calls} == {(4, True)}
    assert_close(out, want_out, jnp.bfloat16, "out")
    assert_close(d_out, want_d_out, jnp.bfloat16, "d out")
