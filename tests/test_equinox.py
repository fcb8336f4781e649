"""probjax_nn.equinox against equinox.nn.MultiheadAttention: leaves, outputs, gradients, vmap, dropout, hooks."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from module_helpers import FEATURES, HEADS, KV_LENGTHS, SEQ, alibi_bias, assert_trees_close, cotangent, inputs

from probjax_kernels import causal_mask

eqx = pytest.importorskip("equinox")
import probjax_nn.equinox as peqx  # noqa: E402

CAUSAL = jnp.tril(jnp.ones((SEQ, SEQ), jnp.bool_))
# Per-sequence masks for jax.vmap, built in NumPy; every query row keeps a key.
CAUSAL_PADDING = jnp.asarray(
    np.tril(np.ones((SEQ, SEQ), bool)) & (np.arange(SEQ) < np.array(KV_LENGTHS)[:, None, None])
)
PER_HEAD = jnp.asarray((np.random.default_rng(0).random((2, HEADS, SEQ, SEQ)) < 0.5) | np.eye(SEQ, dtype=bool))


def _batched_loss(module, x, masks=None, **call):
    """Self-attention of every sequence of `x` `[B, T, F]` under jax.vmap, weighted by a fixed cotangent."""
    if masks is None:
        out = jax.vmap(lambda x: module(x, x, x, **call))(x)
    else:
        out = jax.vmap(lambda x, mask: module(x, x, x, mask, **call))(x, masks)
    return jnp.sum(out.astype(jnp.float32) * cotangent(out.shape)), out


@pytest.mark.parametrize(
    "impl, masks",
    [("xla", CAUSAL_PADDING), ("xla", PER_HEAD), ("pallas", CAUSAL_PADDING)],
    ids=["xla-2d", "xla-per-head", "pallas-2d"],
)
def test_vmap_matches_stock_outputs_and_gradients(impl, masks):
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, use_query_bias=True, use_output_bias=True, key=jax.random.key(0))
    ours = peqx.MultiheadAttention(
        HEADS, FEATURES, use_query_bias=True, use_output_bias=True, attention_impl=impl, key=jax.random.key(0)
    )
    assert_trees_close(jax.tree.leaves(ours), jax.tree.leaves(stock), name="leaves")
    x = inputs(1)
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(_batched_loss, has_aux=True))
    (_, out), grads = value_and_grad(ours, x, masks)
    (_, expected_out), expected_grads = value_and_grad(stock, x, masks)
    assert_trees_close(out, expected_out, name="out")
    assert_trees_close(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), name="grads")


def test_loads_stock_leaves():
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, key=jax.random.key(1))
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, stock)
    buffer.seek(0)
    ours = eqx.tree_deserialise_leaves(buffer, peqx.MultiheadAttention(HEADS, FEATURES, key=jax.random.key(2)))
    x = inputs(2)[0]
    assert_trees_close(ours(x, x, x, CAUSAL), stock(x, x, x, CAUSAL), name="out")


def test_cross_attention_with_other_sizes_and_process_heads():
    sizes = dict(key_size=24, value_size=16, output_size=8, qk_size=4, vo_size=12, use_key_bias=True)
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, **sizes, key=jax.random.key(3))
    ours = peqx.MultiheadAttention(HEADS, FEATURES, **sizes, attention_impl="pallas", key=jax.random.key(3))
    query, key_, value = inputs(3, (7, FEATURES)), inputs(4, (SEQ, 24)), inputs(5, (SEQ, 16))

    def process_heads(q, k, v):
        return q * 2.0, k[::-1], v

    expected = stock(query, key_, value, process_heads=process_heads)
    assert_trees_close(ours(query, key_, value, process_heads=process_heads), expected, name="out")


def test_dropout_follows_the_stock_rules():
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, dropout_p=0.5, key=jax.random.key(0))
    xla = peqx.MultiheadAttention(HEADS, FEATURES, dropout_p=0.5, attention_impl="xla", key=jax.random.key(0))
    pallas = peqx.MultiheadAttention(HEADS, FEATURES, dropout_p=0.5, attention_impl="pallas", key=jax.random.key(0))
    x = inputs(6)[0]
    assert_trees_close(xla(x, x, x, inference=True), stock(x, x, x, inference=True), name="inference")
    with pytest.raises(RuntimeError, match="key"):
        xla(x, x, x)
    dropped = xla(x, x, x, key=jax.random.key(1))
    assert float(jnp.max(jnp.abs(dropped - stock(x, x, x, inference=True)))) > 1e-3
    assert_trees_close(pallas(x, x, x, key=jax.random.key(1)), dropped, name="pallas")
    inference = eqx.nn.inference_mode(xla)
    assert_trees_close(inference(x, x, x), stock(x, x, x, inference=True), name="inference_mode")
    # Under vmap with one key per sequence, the kernel runs batched with one seed per sequence.
    keys = jax.random.split(jax.random.key(2), 2)
    batch = inputs(7)
    out = jax.vmap(lambda x, key: pallas(x, x, x, key=key))(batch, keys)
    expected = jnp.stack([xla(batch[i], batch[i], batch[i], key=keys[i]) for i in range(2)])
    assert_trees_close(out, expected, name="vmap dropout")


def test_process_heads_of_mixed_dtypes_are_promoted():
    """Heads returned in different dtypes compute in their promoted dtype, as the stock module's einsums do
    (they raised "must share one dtype")."""
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, key=jax.random.key(4))
    ours = peqx.MultiheadAttention(HEADS, FEATURES, attention_impl="xla", key=jax.random.key(4))
    x = inputs(8)[0]

    def process_heads(q, k, v):
        return q.astype(jnp.bfloat16), k, v.astype(jnp.bfloat16)

    with jax.numpy_dtype_promotion("standard"):  # the stock module's einsums need it
        expected = stock(x, x, x, CAUSAL, process_heads=process_heads)
        out = ours(x, x, x, CAUSAL, process_heads=process_heads)
    assert out.dtype == expected.dtype == jnp.float32
    assert_trees_close(out, expected, jnp.bfloat16, name="out")  # Equinox scales the bfloat16 query in bfloat16


def test_dropout_p_one_drops_everything_as_stock():
    """dropout_p=1.0 drops every attention weight, as in Equinox (the kernels' rate check raised); in
    inference nothing is dropped."""
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, dropout_p=1.0, use_output_bias=True, key=jax.random.key(5))
    ours = peqx.MultiheadAttention(
        HEADS, FEATURES, dropout_p=1.0, use_output_bias=True, attention_impl="xla", key=jax.random.key(5)
    )
    x = inputs(9)[0]
    out = ours(x, x, x, key=jax.random.key(6))
    assert_trees_close(out, stock(x, x, x, key=jax.random.key(6)), name="dropped")
    np.testing.assert_allclose(out, jnp.broadcast_to(ours.output_proj.bias, out.shape))
    assert_trees_close(ours(x, x, x, inference=True), stock(x, x, x, inference=True), name="inference")


def test_complex_inputs_run_the_stock_module_under_auto_and_raise_otherwise():
    """Complex heads run equinox.nn.MultiheadAttention's own call under "auto" (a TypeError before); an
    explicit impl raises NotImplementedError naming the dtype."""
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, key=jax.random.key(7))
    x = jax.lax.complex(inputs(10)[0], inputs(11)[0])
    with jax.numpy_dtype_promotion("standard"):  # real weights times complex inputs
        out = peqx.MultiheadAttention(HEADS, FEATURES, key=jax.random.key(7))(x, x, x, CAUSAL)
        np.testing.assert_array_equal(out, stock(x, x, x, CAUSAL))
        with pytest.raises(NotImplementedError, match="impl='xla' does not support dtype complex64"):
            peqx.MultiheadAttention(HEADS, FEATURES, attention_impl="xla", key=jax.random.key(7))(x, x, x)


def test_scan_and_remat_over_layers():
    def run(cls, **kwargs):
        keys = jax.random.split(jax.random.key(0))
        layers = eqx.filter_vmap(lambda key: cls(HEADS, FEATURES, key=key, **kwargs))(keys)
        arrays, static = eqx.partition(layers, eqx.is_array)

        @jax.checkpoint
        def body(x, layer_arrays):
            layer = eqx.combine(layer_arrays, static)
            return x + layer(x, x, x, CAUSAL), None

        @eqx.filter_jit
        @eqx.filter_value_and_grad
        def loss(arrays, x):
            return jnp.sum(jax.lax.scan(body, x, arrays)[0] * cotangent(x.shape))

        return loss(arrays, inputs(8)[0])

    (value, grads), (expected_value, expected_grads) = (
        run(peqx.MultiheadAttention, attention_impl="pallas"), run(eqx.nn.MultiheadAttention)
    )
    assert_trees_close(value, expected_value, name="loss")
    assert_trees_close(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), name="grads")


def test_bfloat16_compute():
    stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, key=jax.random.key(0))
    ours = peqx.MultiheadAttention(HEADS, FEATURES, attention_impl="pallas", key=jax.random.key(0))
    ours = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16) if eqx.is_inexact_array(leaf) else leaf, ours)
    x = inputs(9)[0]
    half = x.astype(jnp.bfloat16)
    out = ours(half, half, half, CAUSAL)
    assert out.dtype == jnp.bfloat16
    assert_trees_close(out, stock(x, x, x, CAUSAL), jnp.bfloat16, name="out")


def test_bad_attention_impl_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'auto', 'pallas', 'flex', 'xla', 'cudnn'"):
        peqx.MultiheadAttention(HEADS, FEATURES, attention_impl="splash", key=jax.random.key(0))


# ----------------------------------------------------------------------------------------------- FlexAttention


def _biased_attention(module, x, bias):
    """The module's projections around jax.nn.dot_product_attention with a bias and a causal mask."""
    projections = (module.query_proj, module.key_proj, module.value_proj)
    heads = [jax.vmap(projection)(x).reshape(SEQ, HEADS, -1) for projection in projections]
    out = jax.nn.dot_product_attention(*heads, bias=bias, is_causal=True)
    return jax.vmap(module.output_proj)(out.reshape(SEQ, -1))


@pytest.mark.parametrize("impl", ["xla", "flex"])
def test_flex_alibi_matches_the_biased_projections(impl):
    ours = peqx.FlexAttention(
        HEADS, FEATURES, score_mod=peqx.ALiBi(HEADS), mask_mod=causal_mask, attention_impl=impl, key=jax.random.key(0)
    )
    x = inputs(10)[0]
    distance = jnp.abs(jnp.arange(SEQ)[:, None] - jnp.arange(SEQ)[None, :]).astype(jnp.float32)
    expected_out = _biased_attention(ours, x, alibi_bias(ours.score_mod.slopes, SEQ, SEQ))
    assert_trees_close(ours(x, x, x), expected_out, name="out")

    def loss(module, attend):
        out = attend(module)
        return jnp.sum(out * cotangent(out.shape))

    grads = eqx.filter_grad(loss)(ours, lambda m: m(x, x, x))
    # The independent path sees the slopes through its bias, so it differentiates them too.
    biased = lambda m: _biased_attention(m, x, -m.score_mod.slopes[:, None, None] * distance[None])  # noqa: E731
    expected = eqx.filter_grad(loss)(ours, biased)
    assert_trees_close(jax.tree.leaves(grads), jax.tree.leaves(expected), name="grads")


def test_flex_hook_parameters_train_through_the_kernel():
    x = inputs(11)
    teacher_slopes = jnp.array([1.0, 0.5, 0.25, 0.0])
    flex = lambda impl: peqx.FlexAttention(  # noqa: E731
        HEADS, FEATURES, score_mod=peqx.ALiBi(HEADS), attention_impl=impl, key=jax.random.key(0)
    )
    teacher = flex("xla")
    teacher = eqx.tree_at(lambda m: m.score_mod.slopes, teacher, teacher_slopes)
    target = jax.vmap(lambda x: teacher(x, x, x, CAUSAL))(x)
    student = flex("flex")

    @eqx.filter_jit
    def step(hook):
        def loss(hook):
            module = eqx.tree_at(lambda m: m.score_mod, student, hook)
            return jnp.mean((jax.vmap(lambda x: module(x, x, x, CAUSAL))(x) - target) ** 2)

        value, grad = eqx.filter_value_and_grad(loss)(hook)
        return value, jax.tree.map(lambda p, g: p - 20.0 * g, hook, grad)

    hook, losses = student.score_mod, []
    for _ in range(12):
        value, hook = step(hook)
        losses.append(float(value))
    assert losses[-1] < 0.1 * losses[0], losses
    assert_trees_close(hook.slopes, teacher_slopes, factor=5e3, name="slopes")  # within 0.1
