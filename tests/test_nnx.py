"""probjax_nn.nnx against flax.nnx.MultiHeadAttention: parameters, outputs, gradients, decode, dropout, hooks."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from module_helpers import (
    BATCH, FEATURES, HEADS, SEQ, alibi_bias, assert_trees_close, cotangent, inputs, padding_mask,
)

from probjax_kernels import alibi_slopes, causal_mask, document_mask

nnx = pytest.importorskip("flax.nnx")
import probjax_nn.nnx as pnnx  # noqa: E402

# (constructor arguments, call arguments); no query row loses every key, where flax would average the values.
CASES = {
    "padding_mask": ({}, {"mask": padding_mask()}),
    "gqa_normalize_qk_mask_causal": (
        {"num_kv_heads": 2, "normalize_qk": True}, {"mask": padding_mask(), "is_causal": True}
    ),
}
PARITY = [("xla", case) for case in CASES] + [("pallas", "gqa_normalize_qk_mask_causal")]


def _pair(impl, seed: int = 0, **kwargs):
    """A stock module and ours, built from the same RNG seed."""
    kwargs = {"decode": False, **kwargs}
    stock = nnx.MultiHeadAttention(HEADS, FEATURES, rngs=nnx.Rngs(seed), **kwargs)
    ours = pnnx.MultiHeadAttention(HEADS, FEATURES, attention_impl=impl, rngs=nnx.Rngs(seed), **kwargs)
    return stock, ours


def _decode(module, x):
    """Feeds `x` `[B, T, F]` one token at a time through a fresh cache; returns the outputs, concatenated."""
    module.init_cache(x.shape)
    step = nnx.jit(lambda module, token: module(token, decode=True))
    return jnp.concatenate([step(module, x[:, t : t + 1]) for t in range(x.shape[1])], axis=1)


def _loss(module, x, **call):
    return jnp.sum(module(x, **call).astype(jnp.float32) * cotangent(x.shape))


@pytest.mark.parametrize("impl, case", PARITY)
def test_matches_stock_outputs_and_gradients(impl, case):
    build, call = CASES[case]
    stock, ours = _pair(impl, **build)
    assert_trees_close(nnx.state(ours, nnx.Param), nnx.state(stock, nnx.Param), name="params")
    x = inputs(1)
    assert_trees_close(ours(x, **call), stock(x, **call), name="out")
    grad = lambda m: nnx.jit(nnx.grad(functools.partial(_loss, **call)))(m, x)  # noqa: E731
    assert_trees_close(grad(ours), grad(stock), name="grads")


def test_loads_a_stock_state():
    stock = nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=2, decode=False, rngs=nnx.Rngs(1))
    ours = pnnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=2, decode=False, rngs=nnx.Rngs(2))
    graphdef, _ = nnx.split(ours)
    _, state = nnx.split(stock)
    loaded = nnx.merge(graphdef, state)
    assert isinstance(loaded, pnnx.MultiHeadAttention)
    x = inputs(3)
    assert_trees_close(loaded(x, is_causal=True), stock(x, is_causal=True), name="out")


def test_stock_module_takes_attention_fn():
    stock = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0))
    swapped = nnx.MultiHeadAttention(
        HEADS, FEATURES, decode=False, attention_fn=pnnx.attention_fn("pallas"), rngs=nnx.Rngs(0)
    )
    x = inputs(4)
    assert_trees_close(swapped(x, mask=padding_mask()), stock(x, mask=padding_mask()), name="out")


@pytest.mark.parametrize("impl, kv_heads", [("xla", HEADS), ("pallas", 2)])
def test_decode_step_by_step_matches_a_causal_forward(impl, kv_heads):
    _, ours = _pair(impl, num_kv_heads=kv_heads)
    x = inputs(5)
    expected = ours(x, is_causal=True)
    assert_trees_close(_decode(ours, x), expected, name="decode")
    assert int(ours.cache_index[...]) == SEQ


def test_dropout_follows_the_stock_rules():
    kwargs = {"decode": False, "dropout_rate": 0.5}
    stock = nnx.MultiHeadAttention(HEADS, FEATURES, rngs=nnx.Rngs(0, dropout=1), **kwargs)
    xla = pnnx.MultiHeadAttention(HEADS, FEATURES, attention_impl="xla", rngs=nnx.Rngs(0, dropout=1), **kwargs)
    pallas = pnnx.MultiHeadAttention(HEADS, FEATURES, attention_impl="pallas", rngs=nnx.Rngs(0, dropout=1), **kwargs)
    x = inputs(6)
    assert_trees_close(xla(x, deterministic=True), stock(x, deterministic=True), name="deterministic")
    dropped = xla(x, deterministic=False)
    assert float(jnp.max(jnp.abs(dropped - xla(x, deterministic=True)))) > 1e-3
    # Both impls draw the kernels' keep mask from the same stored dropout stream.
    assert_trees_close(pallas(x, deterministic=False), dropped, name="pallas dropout")
    assert float(jnp.max(jnp.abs(xla(x, deterministic=False) - dropped))) > 1e-3  # the stream moved on
    without_rngs = pnnx.MultiHeadAttention(HEADS, FEATURES, keep_rngs=False, rngs=nnx.Rngs(0), **kwargs)
    with pytest.raises(ValueError, match="rngs"):
        without_rngs(x, deterministic=False)
    assert without_rngs(x, deterministic=False, rngs=nnx.Rngs(dropout=3)).shape == x.shape


def test_sow_weights_falls_back_on_auto_and_raises_otherwise():
    stock, auto = _pair("auto")
    x = inputs(7)
    out, intermediates = nnx.capture(lambda module: module(x, sow_weights=True), nnx.Intermediate)(auto)
    assert_trees_close(out, stock(x), name="out")
    assert intermediates["attention_weights"][0].shape == (BATCH, HEADS, SEQ, SEQ)
    _, xla = _pair("xla")
    with pytest.raises(NotImplementedError, match="sow_weights"):
        xla(x, sow_weights=True)


def test_sow_weights_does_not_change_a_fully_masked_row():
    """Under "auto", sow_weights sows flax's weights but the output stays ours: a query row with every key
    masked gives 0 with or without sowing (it gave flax's average of the values when sowing)."""
    _, auto = _pair("auto")
    x = inputs(9)
    mask = jnp.ones((BATCH, 1, SEQ, SEQ), bool).at[0, :, 3].set(False)
    plain = auto(x, mask=mask)
    sown, intermediates = nnx.capture(lambda m: m(x, mask=mask, sow_weights=True), nnx.Intermediate)(auto)
    assert_trees_close(sown, plain, name="out")
    assert float(jnp.abs(plain[0, 3]).max()) == 0.0  # zero heads through a zero-initialised output bias
    assert intermediates["attention_weights"][0].shape == (BATCH, HEADS, SEQ, SEQ)


def test_complex_inputs_run_flax_under_auto_and_raise_otherwise():
    """Complex inputs fall back to flax's dot_product_attention under "auto" (they were a TypeError); an
    explicit impl raises NotImplementedError naming the dtype."""
    q, k, v = (jax.lax.complex(inputs(seed, (1, 6, 2, 8)), inputs(seed + 1, (1, 6, 2, 8))) for seed in (20, 22, 24))
    mask = jnp.tril(jnp.ones((6, 6), bool))
    # flax (through jax.nn) casts the complex scores to float32 (deprecated, warning): as it does, so do we.
    with jax.numpy_dtype_promotion("standard"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Casting from complex", DeprecationWarning)
        out = pnnx.attention_fn()(q, k, v, mask=mask)
        np.testing.assert_array_equal(out, nnx.dot_product_attention(q, k, v, mask=mask))
    with pytest.raises(NotImplementedError, match="impl='xla' does not support dtype complex64"):
        pnnx.attention_fn("xla")(q, k, v)


def test_query_and_key_head_dims_must_match():
    """q.k needs one head dim: a key of another one raises, naming both (it was zero-padded); flax raises too.
    The value's head dim may differ."""
    q, k = jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 7))
    with pytest.raises(ValueError, match=re.escape("query shape should be [1, -1, -1, 7]: but got (1, 4, 2, 8)")):
        pnnx.attention_fn("xla")(q, k, k)  # flax's message (its jax.nn path), issue 22 item 17
    assert pnnx.attention_fn("xla")(q, q, k).shape == (1, 4, 2, 7)


def test_several_batch_axes():
    stock, ours = _pair("xla")
    x = inputs(8, (2, 3, SEQ, FEATURES))
    mask = jnp.broadcast_to(padding_mask()[:, None], (2, 3, 1, 1, SEQ))  # flax flattens a broadcast batch axis wrongly
    assert_trees_close(ours(x, mask=mask), stock(x, mask=mask), name="out")


def test_scan_and_remat_over_layers():
    def run(cls, **kwargs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return cls(HEADS, FEATURES, decode=False, rngs=rngs, **kwargs)

        layers = create(nnx.Rngs(0))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, layer):
            return x + layer(x, is_causal=True)

        loss = nnx.jit(nnx.value_and_grad(lambda layers, x: jnp.sum(forward(x, layers) * cotangent(x.shape))))
        return loss(layers, inputs(9))

    (value, grads), (expected_value, expected_grads) = run(pnnx.MultiHeadAttention, attention_impl="pallas"), run(
        nnx.MultiHeadAttention
    )
    assert_trees_close(value, expected_value, name="loss")
    assert_trees_close(grads, expected_grads, name="grads")


def test_bfloat16_compute():
    stock, ours = _pair("pallas", dtype=jnp.bfloat16)
    x = inputs(10)
    out = ours(x, is_causal=True)
    assert out.dtype == jnp.bfloat16
    _, reference = _pair("xla")  # float32 compute, same parameters
    assert_trees_close(out, reference(x, is_causal=True), jnp.bfloat16, name="out")
    grads = nnx.jit(nnx.grad(functools.partial(_loss, is_causal=True)))(ours, x)  # one compile, not one per op
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_bad_attention_impl_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'auto', 'pallas', 'flex', 'xla', 'cudnn'"):
        pnnx.MultiHeadAttention(HEADS, FEATURES, attention_impl="flash", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'auto', 'pallas', 'flex', 'xla', 'cudnn'"):
        pnnx.attention_fn("triton")


# ----------------------------------------------------------------------------------------------- FlexAttention

TEACHER_SLOPES = jnp.array([1.0, 0.5, 0.25, 0.0])


def _flex(impl, seed: int = 0, **kwargs):
    return pnnx.FlexAttention(HEADS, FEATURES, decode=False, attention_impl=impl, rngs=nnx.Rngs(seed), **kwargs)


@pytest.mark.parametrize("impl", ["xla", "flex"])
def test_flex_alibi_matches_a_stock_module_with_the_bias(impl):
    ours = _flex(impl, score_mod=pnnx.ALiBi(HEADS))
    bias = alibi_bias(alibi_slopes(HEADS), SEQ, SEQ)
    stock = nnx.MultiHeadAttention(
        HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0),
        attention_fn=functools.partial(nnx.dot_product_attention, bias=bias),
    )
    x = inputs(11)
    assert_trees_close(ours(x, is_causal=True), stock(x, is_causal=True), name="out")
    grads = nnx.jit(nnx.grad(functools.partial(_loss, is_causal=True)))(ours, x)  # one compile, not one per op
    expected = nnx.jit(nnx.grad(functools.partial(_loss, is_causal=True)))(stock, x)
    slopes = grads.pop("score_mod")["slopes"][...]
    assert_trees_close(grads, expected, name="grads")
    assert float(jnp.abs(slopes).min()) > 0.0


@pytest.mark.parametrize(
    "hook, learning_rate", [(pnnx.ALiBi, 5.0), (functools.partial(pnnx.RelativePositionBias, max_len=SEQ), 20.0)]
)
def test_flex_hook_parameters_train_through_the_kernel(hook, learning_rate):
    """Fit the hook alone to a target that another hook produced; the projections stay fixed. (12 fixed-rate
    steps: on most inputs the loss falls 10^4 to 10^7 times and ALiBi finds the teacher's slopes; seed 12's
    draw is one where it falls 10 times only.)"""
    x = inputs(16)
    teacher = _flex("xla", score_mod=pnnx.ALiBi(HEADS))
    teacher.score_mod.slopes[...] = TEACHER_SLOPES
    target = teacher(x, is_causal=True)
    student = _flex("flex", score_mod=hook(HEADS))
    hook_params = nnx.DiffState(0, nnx.All(nnx.Param, nnx.PathContains("score_mod")))

    @nnx.jit
    def step(module):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x, is_causal=True) - target) ** 2), argnums=hook_params)(
            module
        )
        hook_state = nnx.state(module, hook_params.filter)
        nnx.update(module, jax.tree.map(lambda p, g: p - learning_rate * g, hook_state, grads))
        return loss

    losses = [float(step(student)) for _ in range(12)]
    assert losses[-1] < 0.1 * losses[0], losses
    if isinstance(student.score_mod, pnnx.ALiBi):
        assert_trees_close(student.score_mod.slopes[...], TEACHER_SLOPES, factor=1e3, name="slopes")


def test_flex_mask_mods_match_the_masks():
    ours = _flex("flex", mask_mod=causal_mask)
    _, reference = _pair("xla")
    x = inputs(13)
    assert_trees_close(ours(x), reference(x, is_causal=True), name="causal")
    documents = jnp.array([[0] * 5 + [1] * 7, [0] * 12], jnp.int32)
    same_document = documents[:, None, :, None] == documents[:, None, None, :]
    assert_trees_close(
        ours(x, mask_mod=document_mask(documents)), reference(x, is_causal=True, mask=same_document), name="documents"
    )


@pytest.mark.parametrize("impl", ["xla", "flex"])
def test_flex_decode_gives_hooks_the_token_position(impl):
    ours = _flex(impl, num_kv_heads=2, score_mod=pnnx.ALiBi(HEADS))
    x = inputs(14)
    expected = ours(x, is_causal=True)
    assert_trees_close(_decode(ours, x), expected, name="decode")


def test_flex_decode_past_the_cache_names_the_cache():
    ours = _flex("xla")
    x = inputs(15, (BATCH, 2, FEATURES))
    ours.init_cache(x.shape)
    ours(x[:, :1], decode=True)
    ours(x[:, 1:], decode=True)
    # It said "key_value_seq_lengths must lie in [0, 2]", an argument the caller never passed.
    with pytest.raises(ValueError, match=r"decode cache is full: cache_index=2 and the cache holds 2 tokens"):
        ours(x[:, :1], decode=True)
