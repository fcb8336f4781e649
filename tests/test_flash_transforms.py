"""jit / vmap / grad / remat compose with the kernel's custom_jvp (forward mode: test_forward_ad.py)."""

import jax
import jax.numpy as jnp
from helpers import assert_close, random_qkv

from probjax_kernels import FlashConfig, flash_attention, flash_attention_reference

TILES = FlashConfig(block_q=16, block_k=16, block_q_dq=16, block_k_dq=16, block_q_dkv=16, block_k_dkv=16)


def test_vmap_over_an_extra_axis_forward_and_grad():
    q, k, v = random_qkv(30, 2, 40, 40, 2, 1, 32)
    stack = lambda x: jnp.stack([x, 0.5 * x])  # noqa: E731  (a leading axis that vmap maps over)
    qs, ks, vs = stack(q), stack(k), stack(v)

    def loss(attention_fn, q, k, v):
        return jnp.sum(jnp.sin(attention_fn(q, k, v, causal=True, config=TILES)))

    # Each under jit: eagerly, every op is an XLA compile of its own.
    out = jax.jit(jax.vmap(lambda q, k, v: flash_attention(q, k, v, causal=True, config=TILES)))(qs, ks, vs)
    expected = jax.jit(jax.vmap(lambda q, k, v: flash_attention_reference(q, k, v, causal=True)))(qs, ks, vs)
    assert_close(out, expected, jnp.float32)
    grads = jax.jit(jax.vmap(jax.grad(lambda *a: loss(flash_attention, *a), (0, 1, 2))))(qs, ks, vs)
    expected = jax.jit(jax.vmap(jax.grad(lambda *a: loss(flash_attention_reference, *a), (0, 1, 2))))(qs, ks, vs)
    for a, e in zip(grads, expected):
        assert_close(a, e, jnp.float32)


def test_remat_and_jit_of_grad_match_plain_grad():
    q, k, v = random_qkv(31, 1, 48, 48, 2, 2, 32)

    def layer(q, k, v):
        return flash_attention(jnp.tanh(q), k, v, causal=True, config=TILES)

    def loss(layer_fn, q, k, v):
        return jnp.sum(layer_fn(layer_fn(q, k, v), k, v) ** 2)

    plain = jax.grad(lambda *a: loss(layer, *a), (0, 1, 2))(q, k, v)
    remat = jax.jit(jax.grad(lambda *a: loss(jax.checkpoint(layer), *a), (0, 1, 2)))(q, k, v)
    for a, e in zip(remat, plain):
        assert_close(a, e, jnp.float32)


def test_second_use_under_jit_with_traced_lengths():
    """Lengths are data: one compiled function serves every value (no retrace per length)."""
    q, k, v = random_qkv(32, 2, 40, 40, 2, 2, 32)
    traces = []

    @jax.jit
    def run(q, k, v, lengths):
        traces.append(None)
        return flash_attention(q, k, v, kv_lengths=lengths, config=TILES)

    for lengths in ([40, 3], [17, 40]):
        lengths = jnp.array(lengths, jnp.int32)
        expected = flash_attention_reference(q, k, v, kv_lengths=lengths)
        assert_close(run(q, k, v, lengths), expected, jnp.float32)
    assert len(traces) == 1


def test_gradient_memory_is_linear_in_sequence_length():
    """XLA's temp memory for a compiled grad doubles with T (flash), where dense attention quadruples."""

    def temp_mb(attention_fn, seq_len):
        spec = jax.ShapeDtypeStruct((1, seq_len, 2, 64), jnp.float32)
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention_fn(q, k, v, causal=True)), (0, 1, 2)))
        return grad.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes / 2**20

    flash = [temp_mb(flash_attention, seq_len) for seq_len in (1024, 2048)]
    dense = [temp_mb(flash_attention_reference, seq_len) for seq_len in (1024, 2048)]
    assert flash[1] / flash[0] < 2.2, flash
    assert dense[1] / dense[0] > 3.5, dense  # the check can tell quadratic from linear


def test_forward_inside_shard_map_with_default_checks():
    """Under shard_map's check_vma=True the call is accepted (on the CPU through the plain-jnp path, see
    tests/test_vma_fallback.py; on a GPU the kernel's outputs carry their inputs' varying mesh axes)."""
    mesh = jax.make_mesh((1,), ("data",))
    q, k, v = (jax.device_put(x, jax.NamedSharding(mesh, jax.P("data"))) for x in random_qkv(33, 2, 40, 40, 2, 1, 32))
    sharded = jax.shard_map(
        lambda q, k, v: flash_attention(q, k, v, causal=True, config=TILES), mesh=mesh,
        in_specs=jax.P("data"), out_specs=jax.P("data"),
    )
    assert_close(jax.jit(sharded)(q, k, v), flash_attention_reference(q, k, v, causal=True), jnp.float32)
