"""FlashConfig(backend="mosaic"): the Mosaic GPU kernels (forward, dQ, dK/dV) where a call fits them, the
Triton kernels elsewhere; run here in both interpreters ("mosaic_interpret"), and lowered for CUDA on the
CPU."""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, bernoulli, normal, output_and_grads, random_qkv, to_float32
from test_flash_lowering import lower_for_cuda, spec

from probjax_kernels import (
    AuxRequest, FlashConfig, alibi, alibi_slopes, and_masks, causal_mask, create_block_mask, document_mask,
    flash_attention, flash_attention_reference, flex_attention, flex_attention_reference, relative_bias,
    sliding_window, softcap,
)
from probjax_kernels._dispatch import MOSAIC_ENV, default_backend
from probjax_kernels.mosaic import plan as mosaic_plan

MOSAIC = FlashConfig(backend="mosaic_interpret")


def backward_kernels(loss_of_config, *args) -> str:
    """"triton" or "mosaic": the backward kernels that jax.grad (in every argument) of `loss_of_config(config)`
    runs with FlashConfig(backend="mosaic"), read from its CUDA lowering. They are picked when the tangent map
    (custom_linear) is lowered, so the jaxpr does not show them; the interpreters cannot be lowered, and the
    compiled backend makes the same choices as "mosaic_interpret" except for float32 bias tiles (the
    interpreters' staging needs more shared memory there)."""
    text = lower_for_cuda(jax.grad(loss_of_config(FlashConfig(backend="mosaic")), tuple(range(len(args)))),
                          *(spec(x.shape, x.dtype) for x in args))
    triton = "probjax_flash_backward" in text
    assert triton or "mosaic_gpu" in text
    return "triton" if triton else "mosaic"


@contextlib.contextmanager
def counting_mosaic_backward():
    """Counts the calls of the Mosaic dQ / dK/dV kernels (the interpreters' choice is the compiled backend's but
    for float32 bias tiles: `backward_kernels`)."""
    calls = []
    original = mosaic_plan.glue.backward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mosaic_plan.glue, "backward", lambda *a, **k: calls.append(1) or original(*a, **k))
        yield calls


def interpreted_beside_reference(fn, reference, args, cotangent):
    """`output_and_grads` of `fn` (interpreted) and of `reference` at `args` and `cotangent`, and whether the
    interpreted backward ran the Mosaic dQ / dK/dV kernels: ((out, grads), mosaic_backward, (out, grads))."""
    with counting_mosaic_backward() as backward_calls:
        interpreted = output_and_grads(fn, args, cotangent)
    return interpreted, bool(backward_calls), output_and_grads(reference, args, cotangent)


def runs_triton_forward(fn, *args) -> bool:
    return "probjax_flash_forward" in str(jax.make_jaxpr(fn)(*args))


def assert_output_and_grads_close(result, expected, names=("dq", "dk", "dv"), checks=None):
    """`result` = (out, grads) of the Mosaic backend against `expected`, the reference's, within bfloat16's
    tolerance: out, then each gradient `names` names (same shape and dtype as the reference's), through
    `checks[name](got, expected)` instead where it is given."""
    (out, grads), (expected_out, expected_grads) = result, expected
    assert_close(out, expected_out, jnp.bfloat16, "out")
    for name, got, want in zip(names, grads, expected_grads, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, got.dtype, want.shape)
        if checks and name in checks:
            checks[name](got, want)
        else:
            assert_close(got, want, jnp.bfloat16, name)


def assert_mosaic_matches_reference(q, k, v, seed: int, backward: str = "mosaic", **kwargs):
    """`flash_attention(q, k, v, **kwargs)` on backend "mosaic_interpret": the Mosaic forward runs, the backward
    runs `backward`'s kernels, and the output and the gradients of every input match the plain-jnp reference's
    (a random cotangent from `seed`). The interpreters choose the backward kernels as the compiled backend
    does, except where their staging needs more shared memory (a float32 bias: the dense-bias test below reads
    that choice from the CUDA lowering); the compile report compiles each feature's choice for sm_90a."""
    fn = lambda q, k, v: flash_attention(q, k, v, config=MOSAIC, **kwargs)  # noqa: E731
    assert not runs_triton_forward(fn, q, k, v)
    cotangent = normal(seed, (*q.shape[:3], v.shape[3]))
    reference = {key: value for key, value in kwargs.items() if not key.startswith("_")}
    result, mosaic_backward, expected = interpreted_beside_reference(
        fn, lambda *a: flash_attention_reference(*a, **reference), (q, k, v), cotangent)
    assert mosaic_backward == (backward == "mosaic")
    assert_output_and_grads_close(result, expected)
    return result


def test_forward_gradients_and_jvp_through_the_mosaic_kernels():
    """out and lse, the gradients of a loss of both (lse's cotangent reaches dQ and dK/dV) and the jvp. One
    sequence: per-sequence lengths are the tests' below."""
    q, k, v = random_qkv(0, 1, 256, 256, 2, 1, 64, jnp.bfloat16)
    kwargs = {"causal": True, "q_lengths": jnp.array([130]), "kv_lengths": jnp.array([200])}
    assert not runs_triton_forward(lambda q, k, v: flash_attention(q, k, v, config=MOSAIC, **kwargs), q, k, v)
    cotangent = normal(1, q.shape)
    tangents = (0.5 * q, 0.5 * k, -v)

    def loss(attention, **extra):
        def value(q, k, v):
            out, lse = attention(q, k, v, return_lse=True, **kwargs, **extra)
            return jnp.sum(out.astype(jnp.float32) * cotangent) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return value

    assert backward_kernels(lambda config: loss(flash_attention, config=config), q, k, v) == "mosaic"

    @functools.partial(jax.jit, static_argnums=0)
    def outputs_grads_and_jvp(attention, q, k, v):
        """(out, lse), the gradients of `loss` and the jvp of out at `tangents`, from one forward pass: jax.grad
        is jax.linearize then its transpose, so `linear` runs the tangent kernel and its transpose the dQ and
        dK/dV kernels. Under one jit: eagerly, every op is an XLA compile of its own."""
        (out, lse), linear = jax.linearize(lambda *a: attention(*a, return_lse=True, **kwargs), q, k, v)
        # loss's cotangents: d sum(out * cotangent) / d out and d sum(where(isfinite(lse), lse, 0)) / d lse
        cotangents = (cotangent.astype(out.dtype), jnp.isfinite(lse).astype(lse.dtype))
        return (out, lse), jax.linear_transpose(linear, q, k, v)(cotangents), linear(*tangents)[0]

    (out, lse), grads, d_out = outputs_grads_and_jvp(functools.partial(flash_attention, config=MOSAIC), q, k, v)
    (expected, expected_lse), expected_grads, expected_d_out = outputs_grads_and_jvp(
        flash_attention_reference, q, k, v)
    assert_close(out, expected, jnp.bfloat16, "out")
    finite = np.isfinite(to_float32(expected_lse))
    assert_close(np.where(finite, to_float32(lse), 0), np.where(finite, to_float32(expected_lse), 0), jnp.bfloat16,
                 "lse")
    for name, a, e in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_close(a, e, jnp.bfloat16, name)
    assert_close(d_out, expected_d_out, jnp.bfloat16, "d_out")


@pytest.mark.parametrize("case", ["float32", "float32_bias_at_256", "short", "negative_scale"])
def test_calls_that_do_not_fit_fall_back_to_triton(case):
    shape = {"short": (1, 40, 40, 2, 2, 64),
             "float32_bias_at_256": (1, 128, 128, 2, 2, 256)}.get(case, (1, 128, 128, 2, 2, 64))
    dtype = jnp.float32 if case == "float32" else jnp.bfloat16
    q, k, v = random_qkv(2, *shape, dtype)
    # float32 bias tiles beside a 256-column Q / K / V do not fit in shared memory, even on 64-key steps.
    kwargs = {"float32_bias_at_256": {"bias": jnp.ones((1, 1, shape[1], shape[2]))},
              "negative_scale": {"scale": -0.2}}.get(case, {})
    fn = lambda q, k, v: flash_attention(q, k, v, config=MOSAIC, **kwargs)  # noqa: E731
    expected = jax.jit(lambda q, k, v: flash_attention_reference(q, k, v, **kwargs))(q, k, v)
    assert_close(jax.jit(fn)(q, k, v), expected, dtype)
    assert runs_triton_forward(fn, q, k, v)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_mosaic_backend_lowers_for_cuda(head_dim):
    """Forward, dQ and dK/dV in Mosaic GPU; at head dim 256 dQ and dK in 128-column pieces, dV on its own."""

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, config=FlashConfig(backend="mosaic")).astype(jnp.float32))

    q, kv = spec((2, 1024, 8, head_dim), jnp.bfloat16), spec((2, 1024, 2, head_dim), jnp.bfloat16)
    text = lower_for_cuda(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    assert "mosaic_gpu" in text and "probjax_flash_" not in text and "probjax_mosaic_backward_dq" in text
    pieces = {f"probjax_mosaic_backward_{name}_piece{p}" for name in ("dq", "dkv_dk") for p in (0, 1)}
    assert all(name in text for name in pieces) == ("probjax_mosaic_backward_dkv_dv" in text) == (head_dim == 256)


def test_flex_block_mask_runs_the_mosaic_forward_when_its_mask_is_index_only():
    """A BlockMask of a pure index mask_mod (causal and a sliding window) at the kernel's 128 x 128 tiles runs
    the Mosaic kernels with the block tables; so does a document mask, whose ids the kernels read as vectors
    along q_idx and kv_idx (`hook_vectors`: the ids of the query rows beside Q, of the keys beside K)."""
    q, k, v = random_qkv(7, 1, 384, 384, 1, 1, 64, jnp.bfloat16)  # one sequence and head: the grid is 3 x 3 tiles
    window = create_block_mask(and_masks(causal_mask, sliding_window(150)), None, None, 384, 384)
    documents = create_block_mask(document_mask(jnp.array([[0] * 200 + [1] * 184])), 1, None, 384, 384)
    for block_mask in (window, documents):
        fn = lambda q, k, v, bm=block_mask: flex_attention(q, k, v, None, bm, config=MOSAIC)  # noqa: E731
        assert not runs_triton_forward(fn, q, k, v)
    expected = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, None, documents))(q, k, v)
    assert_close(jax.jit(lambda q, k, v: flex_attention(q, k, v, None, documents, config=MOSAIC))(q, k, v), expected,
                 jnp.bfloat16)
    # The window's output and dq from one Mosaic forward.
    cotangent = normal(8, q.shape)
    (out, (dq,)), (expected_out, (expected_dq,)) = (
        output_and_grads(lambda q, f=f: f(q, k, v, None, window), (q,), cotangent)
        for f in (lambda *a: flex_attention(*a, config=MOSAIC), flex_attention_reference))
    assert_close(out, expected_out, jnp.bfloat16, "out")
    assert_close(dq, expected_dq, jnp.bfloat16, "dq")


def test_refined_tables_list_each_block_as_its_kernel_tiles():
    """`_tiles.refined_tables`: tables of (128, 256) blocks as tables of 128 x 64 tiles (and the
    transposed q_tables of (256, 128) blocks as 64 x 128 ones) list exactly the tiles of the listed blocks, in
    the same class (partial / full)."""
    from probjax_kernels.flex.block_tables import tiles_of
    from probjax_kernels._tiles import refined_tables

    block_mask = create_block_mask(and_masks(causal_mask, sliding_window(300)), 2, 1, 512, 1024, block_size=(128, 256))
    for tables, block, tile, repeat in ((block_mask.kv_tables, (128, 256), (128, 64), (1, 4)),
                                        (block_mask.q_tables, (256, 128), (64, 128), (4, 1))):
        fine = refined_tables(tables, block, tile)
        for num, listed in ((0, 1), (2, 3)):  # partial, then full
            coarse = np.asarray(tiles_of(tables[num], tables[listed]))
            expected = np.repeat(np.repeat(coarse, repeat[0], axis=2), repeat[1], axis=3)
            np.testing.assert_array_equal(np.asarray(tiles_of(fine[num], fine[listed])), expected)
            assert (np.diff(np.where(np.arange(fine[listed].shape[-1]) < np.asarray(fine[num])[..., None],
                                     np.asarray(fine[listed]), 10**6), axis=-1) >= 0).all()  # ascending


def test_a_block_mask_coarser_than_the_tiles_runs_the_mosaic_kernels():
    """A BlockMask of 128 x 256 blocks (coarser than the Mosaic kernels' 128 x 128 tiles) runs the Mosaic
    forward and backward on its tables refined to the tiles, and matches the reference; it ran the Triton
    forward before (at head dim 256 the default 128 x 128 BlockMask is coarser than the forward's 64-key tile)."""
    q, k, v = random_qkv(9, 1, 512, 512, 1, 1, 64, jnp.bfloat16)
    block_mask = create_block_mask(and_masks(causal_mask, sliding_window(200)), None, None, 512, 512,
                                   block_size=(128, 256))
    fn = lambda q, k, v: flex_attention(q, k, v, None, block_mask, config=MOSAIC)  # noqa: E731
    assert not runs_triton_forward(fn, q, k, v)
    cotangent = normal(10, q.shape)
    (out, grads), mosaic_backward, (expected_out, expected_grads) = interpreted_beside_reference(
        fn, lambda q, k, v: flex_attention_reference(q, k, v, None, block_mask), (q, k, v), cotangent)
    assert mosaic_backward
    assert_close(out, expected_out, jnp.bfloat16, "out")
    for name, got, want in zip("qkv", grads, expected_grads):
        assert_close(got, want, jnp.bfloat16, f"d{name}")


def _head_window(b, h, q_idx, kv_idx):  # a per-head window: the Mosaic kernel's mask_fn reads h
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 100 + 100 * h)


def _head_alibi(score, b, h, q_idx, kv_idx):
    slope = jnp.exp2(-(h + 1).astype(jnp.float32))
    return score - slope * jnp.abs(q_idx - kv_idx).astype(jnp.float32)


_CAP = jnp.array(1.5)  # a 0-d array, as a learnable soft cap: a scalar load wherever the hook reads it
_ROW_SHIFT = jnp.cos(jnp.arange(2 * 256, dtype=jnp.float32)).reshape(2, 256)  # per head and query row


def _array_softcap(score, b, h, q_idx, kv_idx):
    return _CAP * jnp.tanh(score / _CAP)


def _fixed(score_mod):
    return lambda: score_mod


def _capped_alibi_from_h(score, b, h, q_idx, kv_idx):
    return _head_alibi(_array_softcap(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)


def _capped_alibi_from_h_and_token_vectors(token_bias):
    def score_mod(score, b, h, q_idx, kv_idx):
        shift = token_bias[b, kv_idx] - 0.5 * _ROW_SHIFT[h, q_idx]
        return _capped_alibi_from_h(score, b, h, q_idx, kv_idx) + shift

    return score_mod


def _capped_alibi(slopes):
    cap, bias = softcap(1.5), alibi(slopes)
    return lambda score, b, h, q_idx, kv_idx: bias(cap(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)


# name: (score_mod from its differentiable arrays, those arrays, whether it takes the BlockMask, whether the
# Mosaic kernels run it, whether to lower its gradient for CUDA). The Mosaic cases compose score_mods (ALiBi on
# the capped score, so the cap keeps the distance penalty): each part's reads, values and derivative are checked
# at the cost of one interpreted forward and backward.
_SCORE_MOD_CASES = {
    "float_softcap_then_alibi_slope_table_block_mask": (_capped_alibi, lambda: (alibi_slopes(2),), True, True, False),
    # a 0-d array cap, ALiBi from h, then arrays read along kv_idx and q_idx as vectors (one with a gradient)
    "0d_array_softcap_then_alibi_from_h_then_per_token_bias_vectors": (
        _capped_alibi_from_h_and_token_vectors, lambda: (jnp.linspace(-2.0, 2.0, 256).reshape(1, 256),), False,
        True, True),
    "relative_bias_gather": (_fixed(relative_bias(jnp.linspace(-1.0, 1.0, 2 * 511).reshape(2, 511))), lambda: (),
                             False, False, False),
    "relu_custom_jvp": (_fixed(lambda s, b, h, q_idx, kv_idx: jax.nn.relu(s)), lambda: (), False, False, False),
}


@pytest.mark.parametrize("case", sorted(_SCORE_MOD_CASES))
def test_flex_score_mod_runs_in_the_mosaic_kernels_when_it_can(case):
    """score_mods of elementwise ops and scalar reads of captured arrays (soft-capping with a float or a 0-d
    array cap, ALiBi with slopes from h or from a slope table) run inside the Mosaic forward and the Mosaic
    dQ / dK/dV kernels (with the score_mod's derivative), with or without a BlockMask (its mask_mod reading h;
    the backward walks kv_tables and q_tables); the slope gradient comes from XLA. score_mods that gather a
    captured array per element (a relative-position table) or use an op without a Mosaic GPU lowering (a
    custom_jvp such as relu) run the Triton kernels."""
    make_score_mod, make_params, with_mask, mosaic, lower = _SCORE_MOD_CASES[case]
    q, k, v = random_qkv(9, 1, 256, 256, 2, 1, 64, jnp.bfloat16)
    mask = create_block_mask(_head_window, None, 2, 256, 256) if with_mask else None
    params = make_params()

    def fn(q, k, v, *params):
        return flex_attention(q, k, v, make_score_mod(*params), mask, enable_gqa=True, config=MOSAIC)

    def reference(q, k, v, *params):
        return flex_attention_reference(q, k, v, make_score_mod(*params), mask, enable_gqa=True)

    args = (q, k, v, *params)
    assert runs_triton_forward(fn, *args) != mosaic
    if not mosaic:  # the Triton fallbacks' backward is tested in test_flex.py
        assert_close(jax.jit(fn)(*args), jax.jit(reference)(*args), jnp.bfloat16)
        return

    def loss_of_config(config, score_mod=make_score_mod(*params)):
        return lambda q, k, v: jnp.sum(
            flex_attention(q, k, v, score_mod, mask, enable_gqa=True, config=config).astype(jnp.float32))

    if lower:
        assert backward_kernels(loss_of_config, q, k, v) == "mosaic"
    # The slopes' gradient (ALiBi from a slope table) comes from XLA, beside the kernels' dq, dk, dv.
    cotangent = normal(10, q.shape)
    result, mosaic_backward, expected = interpreted_beside_reference(fn, reference, args, cotangent)
    assert mosaic_backward, "the Mosaic backward did not run"
    assert_output_and_grads_close(result, expected, ("dq", "dk", "dv", *(f"d_params[{n}]" for n in range(len(params)))))


def test_a_document_mask_runs_the_mosaic_forward_and_backward():
    """Packed documents as a flex BlockMask (causal within each document) on the Mosaic forward, dQ and dK/dV
    at head dim 128: the ids travel as vectors beside Q and K (dK/dV: beside each Q tile, per head), against
    the reference. (Head dim 64 reads them the same way: the tests above; 256 runs the Mosaic forward and
    Triton's backward, as every call there.)"""
    q, k, v = random_qkv(11, 2, 256, 256, 2, 1, 128, jnp.bfloat16)
    ids = jnp.stack([jnp.repeat(jnp.arange(4), 64), jnp.repeat(jnp.arange(2), 128)])
    block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 2, None, 256, 256)
    fn = lambda q, k, v: flex_attention(q, k, v, None, block_mask, enable_gqa=True, config=MOSAIC)  # noqa: E731
    assert not runs_triton_forward(fn, q, k, v)  # the compiled backward: the report's document_mask rows
    cotangent = normal(12, q.shape)
    result, mosaic_backward, expected = interpreted_beside_reference(
        fn, lambda q, k, v: flex_attention_reference(q, k, v, None, block_mask, enable_gqa=True), (q, k, v),
        cotangent)
    assert mosaic_backward, "the Mosaic backward did not run"
    assert_output_and_grads_close(result, expected)
    for head_dim in (64, 256):
        assert not runs_triton_forward(fn, *random_qkv(11, 2, 256, 256, 2, 1, head_dim, jnp.bfloat16))


@pytest.mark.parametrize("score_mod", [softcap(30.0), alibi(alibi_slopes(8))], ids=["softcap", "alibi"])
def test_flex_score_mod_through_the_mosaic_kernels_lowers_for_cuda(score_mod):
    def loss(q, k, v):
        out = flex_attention(q, k, v, score_mod, create_block_mask(_head_window, None, 8, 1024, 1024),
                             enable_gqa=True, config=FlashConfig(backend="mosaic"))
        return jnp.sum(out.astype(jnp.float32))

    q, kv = spec((2, 1024, 8, 128), jnp.bfloat16), spec((2, 1024, 2, 128), jnp.bfloat16)
    text = lower_for_cuda(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    assert "mosaic_gpu" in text and "probjax_flash_forward" not in text
    assert "probjax_flash_backward" not in text


def test_a_two_sided_window_runs_the_mosaic_forward_and_backward():
    """A (left, right) window reaches the Mosaic forward, dQ and dK/dV as both of its sides. One tile: windows
    that skip tiles (two-sided, causal sliding) are the kernels' tests' (test_mosaic_forward / _backward.py)."""
    q, k, v = random_qkv(11, 1, 128, 128, 1, 1, 64, jnp.bfloat16)
    assert_mosaic_matches_reference(q, k, v, 12, window=(40, 70), kv_lengths=jnp.array([100]))


def test_segment_ids_and_a_key_mask_beside_them_run_the_mosaic_forward_and_backward():
    """Packed documents: the Mosaic kernels read the segment ids as vectors beside their tiles (forward, dQ and
    dK/dV), with GQA, causality, per-sequence lengths, documents that end inside a tile and rows whose document
    has no key below kv_lengths (output 0, zero gradient); a key mask `[B, 1, 1, S]` beside them reaches the
    kernels as a 0 / -inf bias (`glue.mask_as_bias`). One tile: ids across tiles are the kernels' tests'."""
    q, k, v = random_qkv(13, 2, 128, 128, 2, 1, 64, jnp.bfloat16)
    segments = jnp.array([[0] * 35 + [1] * 70 + [2] * 23, [5] * 65 + [7] * 63])
    mask = bernoulli(25, 0.7, (2, 1, 1, 128)).at[1, :, :, :50].set(False)
    out, grads = assert_mosaic_matches_reference(q, k, v, 14, causal=True, kv_lengths=jnp.array([100, 128]),
                                                 q_segment_ids=segments, kv_segment_ids=segments, mask=mask)
    # Rows that see no key: sequence 0's document 2 (from 105, past kv_lengths 100), sequence 1's rows under 50.
    for batch, rows in ((0, slice(105, None)), (1, slice(None, 50))):
        assert not np.any(np.asarray(out)[batch, rows]) and not np.any(np.asarray(grads[0])[batch, rows])


@pytest.mark.parametrize("positional", [False, True])
def test_dropout_runs_the_mosaic_forward_and_backward(positional):
    """Dropout hashed in the Mosaic kernels (forward, dQ, dK/dV) drops exactly the reference's weights: the keep
    mask of `_dropout.keep_mask` on (seed, b, h, q, k), GQA, per-sequence lengths. `positional`: the seed as
    `positional_seed`'s [7] (a shard's call; here the whole sequence and heads, so the same weights)."""
    # The positional seed on one sequence: the batch index's part of the hash is checked by the other case.
    kv_lengths = jnp.array([170] if positional else [256, 170])
    q, k, v = random_qkv(19, len(kv_lengths), 256, 256, 2, 1, 64, jnp.bfloat16)
    private = {"_dropout_shard": (0, 0, 2)} if positional else {}
    assert_mosaic_matches_reference(q, k, v, 20, causal=True, kv_lengths=kv_lengths, dropout_rate=0.3,
                                    dropout_seed=77, **private)


@pytest.mark.parametrize("shape", [(2, 1, 1, 128), (2, 1, 128, 1), (2, 1, 1, 1)])
def test_a_key_padding_or_query_mask_runs_the_mosaic_forward_and_backward(shape):
    """A dense mask that is a row or a column vector (`[B, 1, 1, S]`, `[B, 1, T, 1]`, `[B, 1, 1, 1]`) runs in the
    Mosaic kernels as segment ids (`glue._segments`); rows that keep no key give 0. One tile."""
    q, k, v = random_qkv(21, 2, 128, 128, 2, 1, 64, jnp.bfloat16)
    mask = bernoulli(22, 0.7, shape)
    if shape[2] == 1 and shape[3] > 1:
        mask = mask.at[1, :, :, :100].set(False)  # sequence 1's rows under 100 see no key (causal)
    if shape == (2, 1, 1, 1):
        mask = jnp.array([True, False]).reshape(shape)
    assert_mosaic_matches_reference(q, k, v, 23, causal=True, mask=mask)


def test_a_mask_over_queries_and_keys_runs_the_mosaic_forward_and_backward():
    """A dense mask `[B, 1, T, S]` read as int8 tiles beside K (forward, dQ) and, transposed, beside Q (dK/dV),
    with causality, GQA and per-sequence lengths; one tile (other broadcasts, T < S: the kernels' tests)."""
    q, k, v = random_qkv(28, 2, 128, 128, 2, 1, 64, jnp.bfloat16)
    mask = bernoulli(29, 0.6, (2, 1, 128, 128))
    assert_mosaic_matches_reference(q, k, v, 30, causal=True, mask=mask, kv_lengths=jnp.array([128, 100]),
                                    q_lengths=jnp.array([128, 90]))


@pytest.mark.parametrize("shape, dtype, head_dim, backward", [
    # per head, the inputs' dtype: forward tiles on the config's 128-key steps, dS written by dQ
    ((2, 2, 128, 128), jnp.bfloat16, 128, "mosaic"),
    # float32 tiles: the forward on 64-key steps to fit in shared memory; the interpreters' staging leaves no
    # room for the Mosaic backward here, so they run Triton's, the compiled kernels Mosaic's (the lowering)
    ((1, 1, 128, 128), jnp.float32, 128, "mosaic"),
    ((1, 2, 128, 1), jnp.bfloat16, 64, "mosaic"),  # per query row: dQ sums dS
    ((1, 1, 1, 1), jnp.float32, 256, "mosaic"),  # one value, head dim 256, GQA: dQ / dK in pieces
])
def test_a_dense_bias_runs_the_mosaic_kernels(shape, dtype, head_dim, backward):
    """A dense bias of every broadcast shape: the Mosaic kernels read it as tiles of its dtype or float32
    vectors, and make its gradient (dS tiles, summed in XLA over the broadcast axes; row sums), against the
    reference with -inf entries (masked keys), causality and lengths. A key bias `[B, 1, 1, S]`: the soft-cap
    test below. One tile: bias tiles across tiles are the kernels' tests'."""
    q, k, v = random_qkv(31, 2, 128, 128, 2, 1, head_dim, jnp.bfloat16)
    bias = 2 * normal(32, shape, jnp.float32)
    bias = jnp.where(bernoulli(33, 0.1, shape), -jnp.inf, bias).astype(dtype)
    kwargs = dict(window=(None, 100), kv_lengths=jnp.array([128, 100]), q_lengths=jnp.array([128, 90]))
    fn = lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, config=MOSAIC, **kwargs)  # noqa: E731
    assert not runs_triton_forward(fn, q, k, v, bias)
    float32_tiles = dtype == jnp.float32 and shape[2] > 1 and shape[3] > 1
    if float32_tiles:  # the interpreters run Triton's backward here: the compiled choice from the CUDA lowering
        assert backward_kernels(lambda config: lambda *a: jnp.sum(flash_attention(
            *a[:3], bias=a[3], config=config, **kwargs).astype(jnp.float32)), q, k, v, bias) == backward
    cotangent = normal(34, q.shape)
    result, mosaic_backward, expected = interpreted_beside_reference(
        fn, lambda q, k, v, bias: flash_attention_reference(q, k, v, bias=bias, **kwargs), (q, k, v, bias), cotangent)
    assert mosaic_backward == (backward == "mosaic" and not float32_tiles)

    def row_bias_gradient(got, expected):
        # A bias constant along keys shifts whole rows of scores: its gradient is 0 up to rounding (a row's
        # rowsum(P dP) - delta, delta from the 16-bit O: terms ~8 here), summed over the rows it spans.
        rows_summed = q.shape[0] * q.shape[2] * q.shape[1] // np.prod(shape)
        assert np.abs(to_float32(got) - to_float32(expected)).max() <= 0.1 * np.sqrt(rows_summed)

    assert_output_and_grads_close(result, expected, ("dq", "dk", "dv", "dbias"),
                                  {"dbias": row_bias_gradient} if shape[3] == 1 else None)


def test_a_dense_bias_beside_a_soft_cap_runs_the_mosaic_kernels():
    """A bias under a score_mod (Gemma 2's soft cap after scale and bias): the backward on the forward's square
    tiles, dS through the cap's derivative, the bias gradient included; a key bias `[B, 1, 1, S]` (its gradient:
    dK/dV's key sums, summed over the heads), head dim 64, one tile."""
    q, k, v = random_qkv(37, 2, 128, 128, 2, 1, 64, jnp.bfloat16)
    bias = jnp.where(bernoulli(38, 0.2, (2, 1, 1, 128)), -jnp.inf, 0.5)
    kwargs = dict(causal=True, logits_soft_cap=5.0, kv_lengths=jnp.array([128, 100]))
    fn = lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, config=MOSAIC, **kwargs)  # noqa: E731
    assert not runs_triton_forward(fn, q, k, v, bias)
    assert backward_kernels(lambda config: lambda *a: jnp.sum(
        flash_attention(*a[:3], bias=a[3], config=config, **kwargs).astype(jnp.float32)), q, k, v, bias) == "mosaic"

    def reference(q, k, v, bias):  # plain jnp, float32: softmax(5 tanh((q k^T / 8 + bias) / 5)), masked
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        scores = jnp.einsum("btnd,bsnd->bnts", q, jnp.repeat(k, 2, axis=2)) / 8.0 + bias
        scores = 5.0 * jnp.tanh(scores / 5.0)
        rows, cols = jnp.arange(128).reshape(1, 1, -1, 1), jnp.arange(128).reshape(1, 1, 1, -1)
        scores = jnp.where((cols <= rows) & (cols < kwargs["kv_lengths"].reshape(-1, 1, 1, 1)), scores, -jnp.inf)
        return jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(scores, axis=-1), jnp.repeat(v, 2, axis=2))

    cotangent = normal(39, q.shape)
    assert_output_and_grads_close(*(output_and_grads(f, (q, k, v, bias), cotangent) for f in (fn, reference)),
                                  ("dq", "dk", "dv", "dbias"))


def test_a_backward_over_the_shared_memory_runs_the_triton_kernels():
    """A soft cap (a score_mod: the backward on the forward's square 128 x 128 tiles), a dense mask and segment
    ids at head dim 128: the Mosaic dQ kernel would take 233,616 B of shared memory as Mosaic GPU counts it
    (1 KiB-aligned buffers, barriers; 227 KiB is the limit), so the backward is Triton's, not a lowering error."""
    q, k, v = random_qkv(35, 1, 256, 256, 2, 2, 128, jnp.bfloat16)
    mask = bernoulli(36, 0.8, (1, 1, 256, 256))
    segments = jnp.zeros((1, 256), jnp.int32)
    kwargs = dict(mask=mask, q_segment_ids=segments, kv_segment_ids=segments, logits_soft_cap=30.0, causal=True)
    assert not runs_triton_forward(lambda q, k, v: flash_attention(q, k, v, config=MOSAIC, **kwargs), q, k, v)
    assert backward_kernels(lambda config: lambda *a: jnp.sum(
        flash_attention(*a, config=config, **kwargs).astype(jnp.float32)), q, k, v) == "triton"


@pytest.mark.parametrize("shape", [(2, 2, 1, 128), (2, 2, 128, 1)], ids=["per_head_keys", "per_head_rows"])
def test_masks_over_keys_or_queries_alone_run_the_mosaic_kernels_as_a_bias(shape):
    """A per-head key mask `[B, N, 1, S]` and a per-head query mask `[B, N, T, 1]` reach the Mosaic kernels as a
    float32 bias of 0 / -inf (key or row vectors); rows that keep no key give 0, as the reference's."""
    q, k, v = random_qkv(24, 2, 128, 128, 2, 1, 64, jnp.bfloat16)
    mask = bernoulli(25, 0.7, shape)
    kwargs = dict(causal=True, mask=mask.at[1, :, :, :50].set(False) if shape[3] > 1 else mask)
    assert_mosaic_matches_reference(q, k, v, 26, **kwargs)


def test_a_per_head_key_mask_under_a_score_mod_runs_the_triton_kernels():
    """A mask acts after the score_mod, a bias before it: a per-head key mask beside a soft cap stays on Triton."""
    q, k, v = random_qkv(24, 2, 256, 256, 2, 1, 64, jnp.bfloat16)
    mask = jnp.ones((2, 2, 1, 256), bool)
    assert runs_triton_forward(
        lambda q, k, v: flash_attention(q, k, v, mask=mask, logits_soft_cap=5.0, config=MOSAIC), q, k, v)


def test_hooks_on_non_square_tiles_run_the_triton_backward():
    """With block_k != block_q the Mosaic backward's tiles are not the shape the hooks were vetted at: the
    forward stays in Mosaic GPU, the backward runs on Triton, and both match the reference."""
    q, k, v = random_qkv(13, 1, 256, 256, 2, 1, 64, jnp.bfloat16)
    config = FlashConfig(backend="mosaic_interpret", block_k=64)
    score_mod = softcap(1.5)
    fn = lambda q: flex_attention(q, k, v, score_mod, enable_gqa=True, config=config)  # noqa: E731
    assert not runs_triton_forward(
        lambda q, k, v: flex_attention(q, k, v, score_mod, enable_gqa=True, config=config), q, k, v)
    assert backward_kernels(
        lambda config: lambda *a: jnp.sum(flex_attention(*a, score_mod, enable_gqa=True,
                                                         config=dataclasses.replace(config, block_k=64))
                                          .astype(jnp.float32)), q, k, v
    ) == "triton"
    cotangent = normal(14, q.shape)
    grads = [jax.jit(jax.grad(lambda q, f=f: jnp.sum(f(q).astype(jnp.float32) * cotangent)))(q)
             for f in (fn, lambda q: flex_attention_reference(q, k, v, score_mod, enable_gqa=True))]
    assert_close(grads[0], grads[1], jnp.bfloat16, "dq")


@pytest.mark.parametrize(
    "platform, capability, env, expected",
    [("gpu", "9.0", "1", "mosaic"), ("gpu", "9.0", None, "triton"), ("gpu", "8.6", "1", "triton"),
     ("cpu", None, "1", "interpret")],
)
def test_default_backend_picks_mosaic_on_hopper_only_when_asked(monkeypatch, platform, capability, env, expected):
    class Device:
        compute_capability = capability

    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(jax, "devices", lambda *_: [Device()])
    if env is None:
        monkeypatch.delenv(MOSAIC_ENV, raising=False)
    else:
        monkeypatch.setenv(MOSAIC_ENV, env)
    assert default_backend() == expected


def test_k_and_v_of_batch_1_run_the_mosaic_kernels():
    """k / v of batch 1 shared by every query batch (a shared prefix): the kernels read batch 0's tiles, and
    dK/dV sums each query batch's part. Per-sequence lengths; one head (the kernels pick the batch of K / V's
    tile apart from its head, and GQA is the tests' above)."""
    q, k, v = random_qkv(25, 2, 256, 256, 1, 1, 64, jnp.bfloat16)
    assert_mosaic_matches_reference(q, k[:1], v[:1], 26, causal=True, kv_lengths=jnp.array([256, 150]))


def test_max_scores_come_from_the_mosaic_forward():
    """AuxRequest(max_scores=True): the forward's row max of the scaled, modified, masked scores, against
    float64 NumPy; rows that attend no key give -inf."""
    q, k, v = random_qkv(27, 1, 256, 256, 2, 1, 64, jnp.bfloat16)
    aux = AuxRequest(lse=True, max_scores=True)
    mask = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx - 10) & (kv_idx < 200)  # noqa: E731
    block_mask = create_block_mask(mask, None, None, 256, 256, BLOCK_SIZE=128)
    fn = lambda q, k, v: flex_attention(q, k, v, softcap(4.0), block_mask, scale=0.2, enable_gqa=True,  # noqa: E731
                                        return_aux=aux, config=MOSAIC)
    assert not runs_triton_forward(lambda *a: fn(*a)[0], q, k, v)
    compiled = lambda q, k, v: flex_attention(q, k, v, softcap(4.0), block_mask, scale=0.2,  # noqa: E731
                                              enable_gqa=True, return_aux=aux, config=FlashConfig(backend="mosaic"))
    assert "mosaic_gpu" in lower_for_cuda(compiled, *(spec(x.shape, x.dtype) for x in (q, k, v)))
    out, got = jax.jit(fn)(q, k, v)
    qn, kn = (np.asarray(to_float32(x), np.float64) for x in (q, k))
    scores = 4.0 * np.tanh(np.einsum("btnd,bsnd->bnts", qn, np.repeat(kn, 2, axis=2)) * 0.2 / 4.0)
    rows, cols = np.arange(256)[:, None], np.arange(256)[None, :]
    expected = np.where((cols <= rows - 10) & (cols < 200), scores, -np.inf).max(-1)
    np.testing.assert_allclose(np.asarray(got.max_scores), expected, rtol=1e-5, atol=1e-5)  # rows < 10: -inf
    assert np.all(np.isneginf(np.asarray(got.max_scores)[:, :, :10]))


@pytest.mark.parametrize("head_dim, value_dim", [(64, 128), (128, 256)])
def test_a_value_head_dim_of_its_own_runs_the_mosaic_kernels(head_dim, value_dim):
    """v's head dim Dv != q / k's: the Mosaic forward (O in a tile of its own), and the Mosaic dQ and dK/dV
    kernels (at 256 one slot, dK and dV from programs of their own, dK per query head with GQA). One tile: both
    orders across tiles are the kernels' tests'."""
    q, k, _ = random_qkv(16, 1, 128, 128, 2, 1, head_dim, jnp.bfloat16)
    v = random_qkv(17, 1, 128, 128, 2, 1, value_dim, jnp.bfloat16)[2]
    out, _ = assert_mosaic_matches_reference(q, k, v, 18, causal=True, kv_lengths=jnp.array([100]))
    assert out.shape == (1, 128, 2, value_dim)


def test_the_triton_fallback_of_the_mosaic_backend_takes_the_triton_forward_tiles():
    """What backend "mosaic" runs on Triton gets at most the Triton forward's tiles, not the Mosaic forward's
    128 x 128 (229,376 B of shared memory at head dim 128, and a spill with a relative-bias table); the
    exactness of those calls is checked above (relative bias, float32, bias, segments, ...)."""
    from probjax_kernels.triton.plan import fallback_config as triton_fallback_config

    mosaic = FlashConfig(block_q=128, block_k=128, block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
                         num_warps=8, num_stages=2, backend="mosaic")
    assert dataclasses.astuple(triton_fallback_config(mosaic, 128))[:2] == (128, 64)
    assert dataclasses.astuple(triton_fallback_config(mosaic, 256))[:2] == (64, 32)
    assert triton_fallback_config(mosaic, 128).block_q_dkv == 32  # the backward's tiles are kept
    triton = dataclasses.replace(mosaic, backend="triton")
    assert triton_fallback_config(triton, 128) == triton
