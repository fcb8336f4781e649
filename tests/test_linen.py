"""probjax_nn.linen against flax.linen.MultiHeadDotProductAttention: variables, outputs, gradients, decode,
dropout, hooks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from module_helpers import BATCH, HEADS, SEQ, alibi_bias, assert_trees_close, cotangent, inputs, padding_mask

from probjax_kernels import alibi_slopes, causal_mask

nn = pytest.importorskip("flax.linen")
import probjax_nn.linen as plinen  # noqa: E402
from probjax_nn import _attention  # noqa: E402

CAUSAL = nn.make_causal_mask(jnp.ones((1, SEQ)), dtype=jnp.bool_)  # [1, 1, T, T]
# Call arguments; no query row loses every key, where flax would average the values.
CASES = {
    "padding_mask": {"mask": padding_mask()},
    "causal_and_padding_masks": {"mask": CAUSAL & padding_mask()},
}


def _decode(module, params, x):
    """Feeds `x` `[B, T, F]` one token at a time through a fresh cache; returns (outputs, last cache)."""
    decoder = module.clone(decode=True)
    cache = decoder.init(jax.random.key(0), x)["cache"]
    step = jax.jit(lambda cache, token: decoder.apply({"params": params, "cache": cache}, token, mutable=["cache"]))
    outputs = []
    for t in range(x.shape[1]):
        out, variables = step(cache, x[:, t : t + 1])
        outputs.append(out)
        cache = variables["cache"]
    return jnp.concatenate(outputs, axis=1), cache


def _loss(module, variables, x, **call):
    return jnp.sum(module.apply(variables, x, **call).astype(jnp.float32) * cotangent(x.shape))


@pytest.mark.parametrize(
    "impl, case, normalize_qk", [("xla", "padding_mask", False), ("pallas", "causal_and_padding_masks", True)]
)
def test_matches_stock_outputs_and_gradients(impl, case, normalize_qk):
    stock = nn.MultiHeadDotProductAttention(HEADS, normalize_qk=normalize_qk)
    ours = plinen.MultiHeadDotProductAttention(HEADS, normalize_qk=normalize_qk, attention_impl=impl)
    x = inputs(1)
    variables = stock.init(jax.random.key(0), x)
    assert_trees_close(ours.init(jax.random.key(0), x), variables, name="init")
    call = CASES[case]
    assert_trees_close(ours.apply(variables, x, **call), stock.apply(variables, x, **call), name="out")
    grad = lambda module: jax.jit(jax.grad(functools.partial(_loss, module, **call)))(variables, x)  # noqa: E731
    assert_trees_close(grad(ours), grad(stock), name="grads")


def test_stock_module_takes_attention_fn():
    stock = nn.MultiHeadDotProductAttention(HEADS)
    swapped = nn.MultiHeadDotProductAttention(HEADS, attention_fn=plinen.attention_fn("pallas"))
    x = inputs(2)
    variables = stock.init(jax.random.key(0), x)
    assert_trees_close(swapped.apply(variables, x, mask=CAUSAL), stock.apply(variables, x, mask=CAUSAL), name="out")


def test_stock_aliases_match_flax():
    """flax.linen's MultiHeadAttention, SelfAttention and dot_product_attention exist here too, with the stock
    signatures, variable names and outputs (they were missing)."""
    import inspect

    def parameters(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert parameters(plinen.dot_product_attention) == parameters(nn.dot_product_attention)
    assert parameters(plinen.SelfAttention.__call__) == parameters(nn.SelfAttention.__call__)
    q, k, v = (inputs(seed, (BATCH, SEQ, HEADS, 8)) for seed in (11, 12, 13))
    mask = padding_mask()
    out = plinen.dot_product_attention(q, k, v, mask=mask)
    assert_trees_close(out, nn.dot_product_attention(q, k, v, mask=mask), name="dot_product_attention")

    class Parent(nn.Module):
        layer: type

        @nn.compact
        def __call__(self, x):
            options = {"attention_impl": "xla"} if self.layer is plinen.MultiHeadAttention else {}
            return self.layer(HEADS, **options)(x)

    x = inputs(14)
    variables = Parent(nn.MultiHeadAttention).init(jax.random.key(0), x)
    assert list(variables["params"]) == ["MultiHeadAttention_0"]
    out = Parent(plinen.MultiHeadAttention).apply(variables, x)
    assert_trees_close(out, Parent(nn.MultiHeadAttention).apply(variables, x), name="MultiHeadAttention")
    assert isinstance(plinen.MultiHeadAttention(HEADS), nn.MultiHeadAttention)
    with pytest.warns(DeprecationWarning, match="SelfAttention will be deprecated"):  # flax's own warning
        variables = nn.SelfAttention(HEADS).init(jax.random.key(1), x)
        out = plinen.SelfAttention(HEADS, attention_impl="xla").apply(variables, x, mask, True)
        expected = nn.SelfAttention(HEADS).apply(variables, x, mask, True)
    assert_trees_close(out, expected, name="SelfAttention")


def test_clone_switches_attention_impl(monkeypatch):
    """clone(attention_impl=...) rebuilds the attention function (it kept the old one, or raised "pass
    attention_impl or attention_fn, not both"); a user's attention_fn survives clones."""
    calls = []
    flash = _attention.flash_attention
    monkeypatch.setattr(_attention, "flash_attention", lambda *a, **k: calls.append(1) or flash(*a, **k))
    module = plinen.MultiHeadDotProductAttention(HEADS, attention_impl="xla")
    x = inputs(3)
    variables = module.init(jax.random.key(0), x)
    expected = module.apply(variables, x, mask=CAUSAL)
    clone = module.clone(attention_impl="pallas")
    assert_trees_close(clone.apply(variables, x, mask=CAUSAL), expected, name="out")
    assert calls == [1]
    clone.clone(attention_impl="xla").apply(variables, x, mask=CAUSAL)
    plinen.MultiHeadDotProductAttention(HEADS).clone(attention_impl="xla").apply(variables, x)
    assert calls == [1]
    custom = plinen.MultiHeadDotProductAttention(HEADS, attention_fn=plinen.attention_fn("xla"))
    assert custom.clone(dropout_rate=0.1).attention_fn == plinen.attention_fn("xla")
    with pytest.raises(ValueError, match="pass attention_impl or attention_fn, not both"):
        custom.clone(attention_impl="pallas")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_decode_step_by_step_matches_a_causal_forward(impl):
    ours = plinen.MultiHeadDotProductAttention(HEADS, attention_impl=impl)
    x = inputs(3)
    params = ours.init(jax.random.key(0), x)["params"]
    outputs, cache = _decode(ours, params, x)
    assert_trees_close(outputs, ours.apply({"params": params}, x, mask=CAUSAL), name="decode")
    assert int(cache["cache_index"]) == SEQ


def test_dropout_follows_the_stock_rules():
    x = inputs(4)
    stock = nn.MultiHeadDotProductAttention(HEADS, dropout_rate=0.5)
    xla = plinen.MultiHeadDotProductAttention(HEADS, dropout_rate=0.5, attention_impl="xla")
    pallas = plinen.MultiHeadDotProductAttention(HEADS, dropout_rate=0.5, attention_impl="pallas")
    variables = stock.init(jax.random.key(0), x, deterministic=True)
    deterministic = stock.apply(variables, x, deterministic=True)
    assert_trees_close(xla.apply(variables, x, deterministic=True), deterministic, name="deterministic")
    dropped = xla.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert float(jnp.max(jnp.abs(dropped - deterministic))) > 1e-3
    assert_trees_close(
        pallas.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)}), dropped, name="pallas"
    )
    # An explicit dropout_rng is used as it is (make_rng folds in the module path first).
    explicit = xla.apply(variables, x, deterministic=False, dropout_rng=jax.random.key(1))
    assert_trees_close(
        pallas.apply(variables, x, deterministic=False, dropout_rng=jax.random.key(1)), explicit, name="dropout_rng"
    )
    assert float(jnp.max(jnp.abs(explicit - dropped))) > 1e-3
    with pytest.raises(Exception, match="dropout"):  # flax: no "dropout" RNG stream given
        xla.apply(variables, x, deterministic=False)


def test_sow_weights_falls_back_on_auto_and_raises_otherwise():
    x = inputs(5)
    stock = nn.MultiHeadDotProductAttention(HEADS)
    variables = stock.init(jax.random.key(0), x)
    out, state = plinen.MultiHeadDotProductAttention(HEADS).apply(
        variables, x, sow_weights=True, mutable=["intermediates"]
    )
    assert_trees_close(out, stock.apply(variables, x), name="out")
    assert state["intermediates"]["attention_weights"][0].shape == (x.shape[0], HEADS, SEQ, SEQ)
    with pytest.raises(NotImplementedError, match="sow_weights"):
        plinen.MultiHeadDotProductAttention(HEADS, attention_impl="xla").apply(variables, x, sow_weights=True)


def test_sow_weights_does_not_change_a_fully_masked_row():
    """Under "auto", sow_weights sows flax's weights but the output stays ours: a query row with every key
    masked gives 0 with or without sowing (it gave flax's average of the values when sowing)."""
    x = inputs(6)
    mask = jnp.ones((x.shape[0], 1, SEQ, SEQ), bool).at[0, :, 3].set(False)
    module = plinen.MultiHeadDotProductAttention(HEADS)
    variables = module.init(jax.random.key(0), x)
    plain = module.apply(variables, x, mask=mask)
    sown, state = module.apply(variables, x, mask=mask, sow_weights=True, mutable=["intermediates"])
    assert_trees_close(sown, plain, name="out")
    assert float(jnp.abs(plain[0, 3]).max()) == 0.0  # zero heads through a zero-initialised output bias
    assert state["intermediates"]["attention_weights"][0].shape == (x.shape[0], HEADS, SEQ, SEQ)


def test_complex_inputs_run_flax_under_auto_and_raise_otherwise():
    """Complex inputs fall back to flax's dot_product_attention under "auto" (they were a TypeError); an
    explicit impl raises NotImplementedError naming the dtype."""
    q, k, v = (jax.lax.complex(inputs(seed, (1, 6, 2, 8)), inputs(seed + 1, (1, 6, 2, 8))) for seed in (20, 22, 24))
    mask = jnp.tril(jnp.ones((6, 6), bool))
    with jax.numpy_dtype_promotion("standard"):  # flax mixes complex and float32
        out = plinen.attention_fn()(q, k, v, mask=mask)
        np.testing.assert_array_equal(out, nn.dot_product_attention(q, k, v, mask=mask))
    with pytest.raises(NotImplementedError, match="impl='xla' does not support dtype complex64"):
        plinen.attention_fn("xla")(q, k, v)


def test_query_and_key_head_dims_must_match():
    """q.k needs one head dim: a key of another one raises, naming both (it was zero-padded); flax raises too.
    The value's head dim may differ."""
    q, k = jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 7))
    with pytest.raises(AssertionError, match="q, k depths must match"):
        plinen.attention_fn("xla")(q, k, k)  # flax's exception and message, issue 22 item 17
    assert plinen.attention_fn("xla")(q, q, k).shape == (1, 4, 2, 7)


class _Stack(nn.Module):
    """Two attention layers under nn.scan, each rematerialised."""

    layer: type

    @nn.compact
    def __call__(self, x):
        def body(layer, carry, _):
            return carry + layer(carry, mask=CAUSAL), None

        scan = nn.scan(
            nn.remat(body), variable_axes={"params": 0}, split_rngs={"params": True}, length=2
        )
        return scan(self.layer(HEADS), x, None)[0]


def test_scan_and_remat_over_layers():
    x = inputs(6)
    stock = _Stack(nn.MultiHeadDotProductAttention)
    ours = _Stack(functools.partial(plinen.MultiHeadDotProductAttention, attention_impl="pallas"))
    variables = stock.init(jax.random.key(0), x)
    loss = lambda module: jax.jit(jax.value_and_grad(functools.partial(_loss, module)))(variables, x)  # noqa: E731
    assert_trees_close(loss(ours), loss(stock), name="loss and grads")


def test_bfloat16_compute():
    x = inputs(7)
    ours = plinen.MultiHeadDotProductAttention(HEADS, dtype=jnp.bfloat16, attention_impl="pallas")
    variables = ours.init(jax.random.key(0), x)
    out = ours.apply(variables, x, mask=CAUSAL)
    assert out.dtype == jnp.bfloat16
    reference = plinen.MultiHeadDotProductAttention(HEADS, attention_impl="xla").apply(variables, x, mask=CAUSAL)
    assert_trees_close(out, reference, jnp.bfloat16, name="out")


def test_bad_attention_impl_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'auto', 'pallas', 'flex', 'xla', 'cudnn'"):
        plinen.MultiHeadDotProductAttention(HEADS, attention_impl="flash")
    with pytest.raises(ValueError, match="'auto', 'pallas', 'flex', 'xla', 'cudnn'"):
        plinen.attention_fn(3)


# ----------------------------------------------------------------------------------------------- FlexAttention


@pytest.mark.parametrize("impl", ["xla", "flex"])
def test_flex_alibi_matches_a_stock_module_with_the_bias(impl):
    x = inputs(8)
    ours = plinen.FlexAttention(HEADS, score_mod=plinen.ALiBi(HEADS), mask_mod=causal_mask, attention_impl=impl)
    variables = ours.init(jax.random.key(0), x)
    assert variables["params"]["score_mod"]["slopes"].shape == (HEADS,)
    stock_params = {name: p for name, p in variables["params"].items() if name != "score_mod"}
    bias = alibi_bias(alibi_slopes(HEADS), SEQ, SEQ)[None]
    stock = nn.MultiHeadDotProductAttention(HEADS, attention_fn=functools.partial(nn.dot_product_attention, bias=bias))
    assert_trees_close(ours.apply(variables, x), stock.apply({"params": stock_params}, x, mask=CAUSAL), name="out")
    grads = jax.jit(jax.grad(functools.partial(_loss, ours)))(variables, x)["params"]  # one compile, not one per op
    slopes = grads.pop("score_mod")["slopes"]
    expected = jax.jit(jax.grad(functools.partial(_loss, stock, mask=CAUSAL)))({"params": stock_params}, x)["params"]
    assert_trees_close(grads, expected, name="grads")
    assert float(jnp.abs(slopes).min()) > 0.0


def test_flex_hook_parameters_train_through_the_kernel():
    x = inputs(9)
    student = plinen.FlexAttention(
        HEADS, score_mod=plinen.RelativePositionBias(HEADS, max_len=SEQ), attention_impl="flex"
    )
    variables = student.init(jax.random.key(0), x)
    teacher = plinen.FlexAttention(HEADS, score_mod=plinen.ALiBi(HEADS), attention_impl="xla")
    teacher_params = {**variables["params"], "score_mod": {"slopes": jnp.array([1.0, 0.5, 0.25, 0.0])}}
    target = teacher.apply({"params": teacher_params}, x, is_causal=True)

    @jax.jit
    def step(variables):
        def loss(table):
            params = {**variables["params"], "score_mod": {"table": table}}
            return jnp.mean((student.apply({"params": params}, x, is_causal=True) - target) ** 2)

        value, grad = jax.value_and_grad(loss)(variables["params"]["score_mod"]["table"])
        table = variables["params"]["score_mod"]["table"] - 50.0 * grad
        return value, {"params": {**variables["params"], "score_mod": {"table": table}}}

    losses = []
    for _ in range(12):
        value, variables = step(variables)
        losses.append(float(value))
    assert losses[-1] < 0.1 * losses[0], losses


@pytest.mark.parametrize("impl", ["xla", "flex"])
def test_flex_decode_gives_hooks_the_token_position(impl):
    ours = plinen.FlexAttention(HEADS, score_mod=plinen.ALiBi(HEADS), attention_impl=impl)
    x = inputs(10)
    params = ours.init(jax.random.key(0), x)["params"]
    outputs, _ = _decode(ours, params, x)
    assert_trees_close(outputs, ours.apply({"params": params}, x, is_causal=True), name="decode")


def test_flex_decode_past_the_cache_names_the_cache():
    ours = plinen.FlexAttention(HEADS, attention_impl="xla", decode=True)
    x = inputs(11)[:, :2]
    variables = ours.init(jax.random.key(0), x)  # a cache of 2 tokens
    for t in range(2):
        _, mutated = ours.apply(variables, x[:, t : t + 1], mutable=["cache"])
        variables = {**variables, **mutated}
    # It said "key_value_seq_lengths must lie in [0, 2]", an argument the caller never passed.
    with pytest.raises(ValueError, match=r"decode cache is full: cache_index=2 and the cache holds 2 tokens"):
        ours.apply(variables, x[:, :1], mutable=["cache"])
