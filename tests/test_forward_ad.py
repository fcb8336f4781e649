"""Forward-mode autodiff (jvp, linearize, jacfwd, grad of jvp, hessian) through the kernels, against the
plain-jnp references differentiated by JAX."""

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, random_qkv
from module_helpers import FEATURES, HEADS, SEQ, assert_trees_close, inputs, padding_mask

from probjax_kernels import _backend
from probjax_kernels import (
    FlashConfig, _dispatch, alibi, and_masks, causal_mask, create_block_mask, document_mask, flash_attention,
    flash_attention_reference, flex_attention, flex_attention_reference, relative_bias, sliding_window,
)
from probjax_kernels.triton import plan as triton_plan

TILES = FlashConfig(block_q=16, block_k=16, block_q_dq=16, block_k_dq=16, block_q_dkv=16, block_k_dkv=16)


def tangents_like(seed: int, *arrays):
    return tuple(normal((seed, i + 1), x.shape, x.dtype) for i, x in enumerate(arrays))


def check_jvp(fn, reference, primals, tangents, dtype, factor: float = 1.0):
    """jax.jvp of `fn` against jax.jvp of `reference`; both return (out, lse)."""
    (out, lse), (d_out, d_lse) = jax.jit(lambda p, t: jax.jvp(fn, p, t))(primals, tangents)
    (e_out, e_lse), (e_d_out, e_d_lse) = jax.jit(lambda p, t: jax.jvp(reference, p, t))(primals, tangents)
    assert_close(out, e_out, dtype, "out")
    assert_close(d_out, e_d_out, dtype, "d_out", factor)
    finite = np.isfinite(np.asarray(e_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert_close(np.where(finite, d_lse, 0.0), np.where(finite, e_d_lse, 0.0), dtype, "d_lse", factor)


B, T, S, N, K, D = 2, 40, 56, 4, 2, 32
LENGTHS = {"q_lengths": jnp.array([40, 13]), "kv_lengths": jnp.array([3, 50])}
SEGMENTS = {
    "q_segment_ids": jnp.array([[0] * 20 + [1] * 20, [0] * 40]),
    "kv_segment_ids": jnp.array([[0] * 30 + [1] * 26, [0] * 10 + [1] * 46]),
}
FLASH_CASES = {
    "plain_gqa": {},
    "causal_lengths": dict(causal=True, **LENGTHS),
    "window": {"window": (7, 3)},
    "segments_mask": dict(mask=jnp.arange(S)[None, None, None, :] % 5 != 1, **SEGMENTS),
    "dropout": {"dropout_rate": 0.3, "dropout_seed": 7, "causal": True},
}


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_jvp_in_q_k_v_and_bias(case):
    kwargs = FLASH_CASES[case]
    q, k, v = random_qkv(1, B, T, S, N, K, D)
    bias = 0.5 * normal(2, (B, 1, T, S))
    primals = (q, k, v, bias)

    def fn(attention, **extra):
        return lambda q, k, v, bias: attention(q, k, v, bias=bias, return_lse=True, **kwargs, **extra)

    check_jvp(fn(flash_attention, config=TILES), fn(flash_attention_reference), primals, tangents_like(3, *primals),
              jnp.float32)


@pytest.mark.parametrize("moving", ["v", "bias", "k"])
def test_flash_jvp_with_one_moving_input(moving):
    """Inputs without a tangent are symbolic zeros: the kernel skips their terms."""
    q, k, v = random_qkv(4, 1, 24, 24, 2, 2, 16)
    inputs_ = {"q": q, "k": k, "v": v, "bias": normal(5, (1, 2, 24, 24))}

    def fn(attention, **extra):
        def call(x):
            args = dict(inputs_, **{moving: x})
            return attention(args["q"], args["k"], args["v"], bias=args["bias"], causal=True, return_lse=True,
                             **extra)

        return call

    x = inputs_[moving]
    check_jvp(fn(flash_attention, config=TILES), fn(flash_attention_reference), (x,), tangents_like(6, x),
              jnp.float32)


def test_flash_jvp_float32_head_dim_256():
    """Above head dim 128 the float32 tangent kernel sums its score dots over 64-wide slices of the head dim."""
    q, k, v = random_qkv(9, 1, 24, 40, 2, 1, 256)
    fn = lambda attention, **extra: lambda q, k, v: attention(q, k, v, causal=True, return_lse=True, **extra)  # noqa: E731
    check_jvp(fn(flash_attention, config=TILES), fn(flash_attention_reference), (q, k, v),
              tangents_like(10, q, k, v), jnp.float32)


def test_flash_jvp_bfloat16():
    q, k, v = random_qkv(7, 1, 48, 48, 2, 1, 64, jnp.bfloat16)
    fn = lambda attention, **extra: lambda q, k, v: attention(q, k, v, causal=True, return_lse=True, **extra)  # noqa: E731
    check_jvp(fn(flash_attention, config=TILES), fn(flash_attention_reference), (q, k, v), tangents_like(8, q, k, v),
              jnp.bfloat16)


def test_flash_jvp_at_the_hopper_head_dim_256_tiles(monkeypatch):
    """On sm_90a at head dim 256 the 16-bit tangent kernel runs 64 x 16 on 4 warps with the value head dim split
    across two programs (`tangent_value_splits`), each recomputing the scores and writing the same d lse; run
    in interpret mode on lengths that end inside a tile, against a float32 reference's jvp."""
    hopper = types.SimpleNamespace(compute_capability="9.0")
    monkeypatch.setattr(_backend, "target_device", lambda: hopper)
    config = _dispatch.default_config(FlashConfig(backend="triton"), q_len=77, kv_len=90, head_dim=256,
                                      dtype=jnp.bfloat16)
    tiles = triton_plan.tangent_config(config, 256, dtype=jnp.bfloat16)
    splits = triton_plan.tangent_value_splits(config, 256, dtype=jnp.bfloat16)
    assert (tiles.block_q, tiles.block_k, tiles.num_warps, splits) == (64, 16, 4, 2)
    hopper.compute_capability = "8.0"  # sm_80 keeps one program per query tile
    assert triton_plan.tangent_value_splits(config, 256, dtype=jnp.bfloat16) == 1
    monkeypatch.setattr(triton_plan, "tangent_config", lambda *_, **__: dataclasses.replace(tiles, backend="interpret"))
    monkeypatch.setattr(triton_plan, "tangent_value_splits", lambda *_, **__: splits)
    seen, kernel = [], triton_plan.tangent.tangent
    monkeypatch.setattr(triton_plan.tangent, "tangent",
                        lambda *a, **kw: seen.append(kw["value_splits"]) or kernel(*a, **kw))
    q, k, v = random_qkv(11, 1, 77, 90, 2, 1, 256, jnp.bfloat16)
    run = dataclasses.replace(config, backend="interpret")
    mask = {"causal": True, "window": (20, None)}  # both in one call: each interpret-mode config is a compile

    def fn(q, k, v):
        return flash_attention(q, k, v, return_lse=True, config=run, **mask)

    def reference(q, k, v):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        return flash_attention_reference(q, k, v, return_lse=True, **mask)

    check_jvp(fn, reference, (q, k, v), tangents_like(12, q, k, v), jnp.bfloat16)
    assert seen == [2]


def test_split_tangent_with_block_tables_a_gathered_table_and_a_dense_bias(monkeypatch):
    """The tangent kernel with the value head dim split across two programs (as on sm_90a with a BlockMask, and
    on sm_86 with a bias or a relative-bias table at head dim 256, Version 7d): each program reads the block
    tables, gathers the table's scores and adds the bias tangent on its own. Interpret mode, against the
    references' jvp; tangents of q, k, v, the table and the bias."""
    seen, kernel = [], triton_plan.tangent.tangent
    monkeypatch.setattr(triton_plan, "tangent_value_splits", lambda *_, **__: 2)
    monkeypatch.setattr(triton_plan.tangent, "tangent",
                        lambda *a, **kw: seen.append(kw["value_splits"]) or kernel(*a, **kw))
    q, k, v = random_qkv(23, 1, FLEX_T, FLEX_T, 2, 2, 64)
    table = 0.3 * normal(24, (2, 2 * FLEX_T - 1))
    block_mask = create_block_mask(and_masks(causal_mask, sliding_window(20)), None, None, FLEX_T, FLEX_T,
                                   block_size=16)

    def flex(attention, **extra):
        return lambda q, k, v, table: attention(q, k, v, relative_bias(table), block_mask, return_lse=True, **extra)

    primals = (q, k, v, table)
    check_jvp(flex(flex_attention, config=TILES), flex(flex_attention_reference), primals,
              tangents_like(25, *primals), jnp.float32)
    bias = 0.5 * normal(26, (1, 2, FLEX_T, FLEX_T))

    def dense(attention, **extra):
        return lambda q, bias: attention(q, k, v, bias=bias, causal=True, return_lse=True, **extra)

    check_jvp(dense(flash_attention, config=TILES), dense(flash_attention_reference), (q, bias),
              tangents_like(27, q, bias), jnp.float32)
    assert seen == [2, 2]


def test_linearize_and_jacfwd():
    q, k, v = random_qkv(9, 1, 6, 5, 2, 1, 4)

    def fn(attention, **extra):
        return lambda q, k: attention(q, k, v, causal=True, **extra)

    ours, reference = fn(flash_attention, config=TILES), fn(flash_attention_reference)
    tangent_sets = [tangents_like(seed, q, k) for seed in (10, 11)]

    # Each linearization and its linear map applied to both tangent sets in one jit: eagerly, every op of
    # the primal and of the linear map is an XLA compile of its own.
    @functools.partial(jax.jit, static_argnums=0)
    def linearized(f, q, k, tangent_sets):
        out, linear = jax.linearize(f, q, k)
        return out, [linear(dq, dk) for dq, dk in tangent_sets]

    out, linear_outs = linearized(ours, q, k, tangent_sets)
    expected_out, expected_linear_outs = linearized(reference, q, k, tangent_sets)
    assert_close(out, expected_out, jnp.float32)
    for linear_out, expected_linear_out in zip(linear_outs, expected_linear_outs):
        assert_close(linear_out, expected_linear_out, jnp.float32)
    for argnum in (0, 1):
        assert_close(jax.jit(jax.jacfwd(ours, argnum))(q, k), jax.jit(jax.jacfwd(reference, argnum))(q, k),
                     jnp.float32)


def test_grad_of_jvp_and_hessian():
    """Second order: the tangent map's own derivative (its residuals q, k, v move)."""
    q, k, v = random_qkv(12, 1, 20, 20, 2, 1, 8)
    dq, dk, dv = tangents_like(13, q, k, v)
    weights = normal(14, q.shape)

    def fn(attention, **extra):
        return lambda q, k, v: attention(q, k, v, causal=True, kv_lengths=jnp.array([17]), **extra)

    ours, reference = fn(flash_attention, config=TILES), fn(flash_attention_reference)

    def jvp_loss(attention, q, k, v):
        _, tangent = jax.jvp(attention, (q, k, v), (dq, dk, dv))
        return jnp.sum(weights * tangent) + jnp.sum(attention(q, k, v) ** 2)

    actual = jax.jit(jax.grad(functools.partial(jvp_loss, ours), (0, 1, 2)))(q, k, v)
    expected = jax.jit(jax.grad(functools.partial(jvp_loss, reference), (0, 1, 2)))(q, k, v)
    for name, a, e in zip(("q", "k", "v"), actual, expected):
        assert_close(a, e, jnp.float32, name)

    small_q, small_k, small_v = random_qkv(15, 1, 4, 4, 1, 1, 4)
    scalar = lambda attention: lambda k: jnp.sum(jnp.sin(attention(small_q, k, small_v)))  # noqa: E731
    hessian = jax.jit(jax.hessian(scalar(functools.partial(flash_attention, causal=True, config=TILES))))(small_k)
    expected = jax.jit(jax.hessian(scalar(functools.partial(flash_attention_reference, causal=True))))(small_k)
    assert_close(hessian, expected, jnp.float32)


def test_grad_uses_the_backward_kernels_and_jvp_the_tangent_kernel():
    q, k, v = random_qkv(16, 1, 32, 32, 2, 2, 16)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, config=TILES)  # noqa: E731

    def kernels(f):
        program = jax.jit(f).lower(q, k, v).as_text(debug_info=True)
        return set(re.findall(r"probjax_flash_\w+", program))

    grad_kernels = kernels(jax.grad(lambda *a: jnp.sum(fn(*a)), (0, 1, 2)))
    assert grad_kernels == {"probjax_flash_forward", "probjax_flash_backward_dq", "probjax_flash_backward_dkv"}
    assert kernels(lambda *a: jax.jvp(fn, a, a)) == {"probjax_flash_forward", "probjax_flash_tangent"}


def test_jvp_memory_is_linear_in_sequence_length():
    """XLA's temp memory for a compiled jvp doubles with T (flash), where dense attention quadruples."""

    def temp_mb(attention_fn, seq_len):
        spec = jax.ShapeDtypeStruct((1, seq_len, 2, 64), jnp.float32)
        jvp = jax.jit(lambda q, k, v: jax.jvp(lambda q, k, v: attention_fn(q, k, v, causal=True), (q, k, v),
                                              (q, k, v)))
        return jvp.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes / 2**20

    flash = [temp_mb(flash_attention, seq_len) for seq_len in (1024, 2048)]
    dense = [temp_mb(flash_attention_reference, seq_len) for seq_len in (1024, 2048)]
    assert flash[1] / flash[0] < 2.2, flash
    assert dense[1] / dense[0] > 3.5, dense


# --------------------------------------------------------------------------------------------------------- flex

FLEX_T = 48
DOCS = jnp.array([[0] * 20 + [1] * 28, [0] * 5 + [1] * 43], jnp.int32)


def test_flex_jvp_in_captured_arrays_with_block_mask():
    """Tangents of q and of the arrays score_mod closes over (ALiBi slopes, a relative-bias table)."""
    q, k, v = random_qkv(17, 2, FLEX_T, FLEX_T, 4, 2, 16)
    slopes = jnp.array([0.5, 0.25, 0.1, 0.0])
    table = 0.1 * normal(18, (4, 2 * FLEX_T - 1))
    block_mask = create_block_mask(and_masks(causal_mask, document_mask(DOCS)), 2, None, FLEX_T, FLEX_T,
                                   block_size=16)

    def fn(attention):
        def call(q, slopes, table):
            def score_mod(s, b, h, q_idx, kv_idx):
                return relative_bias(table)(alibi(slopes)(s, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

            return attention(q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True)

        return call

    primals = (q, slopes, table)
    check_jvp(fn(flex_attention), fn(flex_attention_reference), primals, tangents_like(19, *primals), jnp.float32)


def test_flex_jvp_with_an_integer_capture_and_a_sliding_window():
    """A score_mod that indexes a float table by an int array it also closes over (token types)."""
    q, k, v = random_qkv(20, 1, FLEX_T, FLEX_T, 2, 2, 16)
    token_type = jnp.arange(FLEX_T, dtype=jnp.int32) % 3
    table = normal(21, (3, 3))
    block_mask = create_block_mask(sliding_window(10), None, None, FLEX_T, FLEX_T, block_size=16)

    def fn(attention):
        def call(k, table):
            def score_mod(s, b, h, q_idx, kv_idx):
                return s + table[token_type[q_idx], token_type[kv_idx]]

            return attention(q, k, v, score_mod, block_mask, return_lse=True)

        return call

    primals = (k, table)
    check_jvp(fn(flex_attention), fn(flex_attention_reference), primals, tangents_like(22, *primals), jnp.float32)
    # and the gradient of the table, which now holds an int neighbour
    loss = lambda attention: lambda k, table: jnp.sum(fn(attention)(k, table)[0] ** 2)  # noqa: E731
    for a, e in zip(jax.jit(jax.grad(loss(flex_attention), (0, 1)))(*primals),
                    jax.jit(jax.grad(loss(flex_attention_reference), (0, 1)))(*primals)):
        assert_close(a, e, jnp.float32)


# ------------------------------------------------------------------------------------------------------ modules


def test_nnx_module_jvp_in_inputs_and_parameters():
    nnx = pytest.importorskip("flax.nnx")
    import probjax_nn.nnx as pnnx

    def build(impl):
        return pnnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=2, attention_impl=impl, decode=False,
                                       rngs=nnx.Rngs(0))

    x, dx = inputs(1), inputs(2)

    def jvp(module):
        graphdef, params = nnx.split(module)

        def call(params, x):
            return nnx.merge(graphdef, params)(x, mask=padding_mask(), is_causal=True)

        @jax.jit  # one compile instead of one per eager op
        def run(params, x, dx):
            d_params = jax.tree.map(lambda p: 0.1 * jnp.cos(p), params)
            return jax.jvp(call, (params, x), (d_params, dx))

        return run(params, x, dx)

    (out, tangent), (expected_out, expected_tangent) = jvp(build("pallas")), jvp(build("xla"))
    assert_trees_close(out, expected_out, name="out")
    assert_trees_close(tangent, expected_tangent, name="tangent")


def test_linen_module_jvp_and_grad_of_jvp():
    nn = pytest.importorskip("flax.linen")
    import probjax_nn.linen as plinen

    x, dx = inputs(3), inputs(4)

    def module(impl):
        return plinen.MultiHeadDotProductAttention(num_heads=HEADS, attention_impl=impl)

    params = jax.jit(module("xla").init)(jax.random.key(0), x)
    del nn

    def jvp_loss(impl, params):
        _, tangent = jax.jvp(lambda x: module(impl).apply(params, x, mask=padding_mask()), (x,), (dx,))
        return jnp.sum(tangent**2)

    value_and_grad = {impl: jax.jit(jax.value_and_grad(functools.partial(jvp_loss, impl)))
                      for impl in ("pallas", "xla")}
    (value, grads), (expected_value, expected_grads) = value_and_grad["pallas"](params), value_and_grad["xla"](params)
    assert_trees_close(value, expected_value, name="value")
    assert_trees_close(grads, expected_grads, name="grads")


def test_equinox_flex_module_jvp():
    eqx = pytest.importorskip("equinox")
    import probjax_nn.equinox as peqx

    def build(impl):
        return peqx.FlexAttention(HEADS, FEATURES, score_mod=peqx.ALiBi(HEADS), mask_mod=causal_mask,
                                  attention_impl=impl, key=jax.random.key(0))

    x, dx = inputs(5)[0], inputs(6)[0]

    def jvp(module):
        d_module = jax.tree.map(lambda p: 0.1 * jnp.sin(p), eqx.filter(module, eqx.is_inexact_array))
        params, static = eqx.partition(module, eqx.is_inexact_array)
        call = lambda params, x: eqx.combine(params, static)(x, x, x)  # noqa: E731
        return jax.jvp(call, (params, x), (d_module, dx))

    jvp = eqx.filter_jit(jvp)  # one compile instead of one per eager op
    (out, tangent), (expected_out, expected_tangent) = jvp(build("flex")), jvp(build("xla"))
    assert out.shape == (SEQ, FEATURES)
    assert_trees_close(out, expected_out, name="out")
    assert_trees_close(tangent, expected_tangent, name="tangent")
