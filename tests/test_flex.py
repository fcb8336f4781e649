"""flex_attention (hooks inside the kernels, block-sparse tiles, dropout) against the dense reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, numpy_allowed, numpy_attention, output_and_grads, random_qkv

from probjax_kernels import (
    BlockMask, FlashConfig, alibi, alibi_slopes, and_masks, causal_mask, create_block_mask, create_mask, document_mask,
    dropout_keep_mask,
    flash_attention, flex_attention, flex_attention_reference, or_masks, padding_mask, prefix_lm,
    relative_bias, sliding_window, softcap,
)

T = 100
DOCS = jnp.array([[0] * 40 + [1] * 60, [0] * 10 + [1] * 85 + [2] * 5], jnp.int32)


def flex_gradients(fn, q, k, v, score_mod, block_mask, **kwargs):
    cotangent = normal(77, q.shape, jnp.float32)
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, score_mod, block_mask, **kwargs).astype(jnp.float32) * cotangent)  # noqa: E731
    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)


def check_flex(q, k, v, score_mod=None, block_mask=None, grads=True, **kwargs):
    """out and lse, and with `grads` the gradients of sum(out * cotangent) in q, k, v (lse undifferentiated),
    kernel against reference; out, lse and the gradients come from one forward pass."""
    kwargs = dict(kwargs, enable_gqa=True)
    cotangent = normal(77, q.shape, jnp.float32)

    def run(attention):
        fn = lambda q, k, v: attention(q, k, v, score_mod, block_mask, return_lse=True, **kwargs)  # noqa: E731
        if grads:
            return output_and_grads(fn, (q, k, v), cotangent, has_aux=True)
        return jax.jit(fn)(q, k, v), ()

    (out, lse), actual = run(flex_attention)
    (expected, expected_lse), reference = run(flex_attention_reference)
    assert_close(out, expected, q.dtype, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(np.asarray(expected_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(expected_lse)[finite], atol=1e-4)
    for name, a, e in zip(("dq", "dk", "dv"), actual, reference):
        assert_close(a, e, q.dtype, name)
    return out


MASKS = {
    "causal": lambda: create_block_mask(causal_mask, None, None, T, T, block_size=32),
    "causal_window": lambda: create_block_mask(and_masks(causal_mask, sliding_window(20)), None, None, T, T,
                                               block_size=32),
    "prefix_lm_per_batch": lambda: create_block_mask(prefix_lm(jnp.array([30, 5])), 2, None, T, T, block_size=32),
    "documents_causal": lambda: create_block_mask(and_masks(causal_mask, document_mask(DOCS)), 2, None, T, T,
                                                  block_size=(32, 16)),
    "padding_or_diagonal": lambda: create_block_mask(
        or_masks(padding_mask(jnp.array([70, 0])), lambda b, h, q, k: q == k), 2, 4, T, T, block_size=16),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_mask_mods_against_reference(name):
    q, k, v = random_qkv(40, 2, T, T, 4, 2, 32)
    check_flex(q, k, v, block_mask=MASKS[name]())


def test_block_mask_matches_numpy_mask():
    """The reference's reading of the mods, checked against NumPy masks built independently."""
    q, k, v = random_qkv(41, 2, T, T, 4, 2, 32)
    block_mask = MASKS["documents_causal"]()
    allowed = numpy_allowed(2, T, T, causal=True, q_segment_ids=DOCS, kv_segment_ids=DOCS)
    expected, _ = numpy_attention(q, k, v, allowed=allowed)
    actual = jax.jit(lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True))(q, k, v)
    assert_close(actual, expected, jnp.float32)


def test_sliding_window_keeps_distances_up_to_and_including_w():
    """sliding_window(w) keeps |q_idx - kv_idx| <= w, w >= 0, as flash_attention(window=w) does (it kept
    < w); with causal_mask, the current key and the w before it."""
    rows, cols = np.arange(12)[:, None], np.arange(12)[None, :]
    for w in (0, 3):
        np.testing.assert_array_equal(sliding_window(w)(0, 0, jnp.asarray(rows), jnp.asarray(cols)),
                                      np.abs(rows - cols) <= w)
    q, k, v = random_qkv(43, 1, 12, 12, 2, 2, 16)
    block_mask = create_block_mask(and_masks(causal_mask, sliding_window(3)), None, None, 12, 12)
    expected, _ = numpy_attention(q, k, v, allowed=numpy_allowed(1, 12, 12, causal=True, window=(3, 3)))
    actual = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, None, block_mask))(q, k, v)
    assert_close(actual, expected, jnp.float32)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=r"window must be an int >= 0"):
            sliding_window(bad)


@pytest.mark.parametrize(
    "score_mod",
    [alibi(alibi_slopes(4)), softcap(1.5), relative_bias(0.3 * normal(3, (4, 2 * T - 1)))],
    ids=["alibi", "softcap", "relative_bias"],
)
def test_score_mods_with_causal_block_mask(score_mod):
    q, k, v = random_qkv(42, 2, T, T, 4, 2, 32)
    q = 3.0 * q  # large scores, so softcap changes them
    check_flex(q, k, v, score_mod, MASKS["causal"]())


def test_score_mod_without_block_mask_gqa_and_ragged():
    q, k, v = random_qkv(43, 1, 77, 150, 8, 2, 48)
    check_flex(q, k, v, lambda s, b, h, q_idx, kv_idx: s + 0.01 * ((q_idx - kv_idx) * h).astype(s.dtype))


def test_ragged_lengths_with_block_mask_and_dtypes():
    for dtype in (jnp.bfloat16, jnp.float16):
        q, k, v = random_qkv(44, 1, 77, 130, 2, 1, 64, dtype)
        block_mask = create_block_mask(lambda b, h, q, k: k <= q + 40, None, None, 77, 130, block_size=32)
        check_flex(q, k, v, softcap(5.0), block_mask, grads=dtype == jnp.bfloat16)


def test_decoding_one_query_against_a_cache():
    """T = 1: the new token at position `offset[b]` sees the cache up to itself (a captured [B] array)."""
    q, k, v = random_qkv(45, 2, 1, 300, 4, 1, 32)
    offset = jnp.array([299, 57], jnp.int32)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= offset[b] + q_idx, 2, None, 1, 300,
                                   block_size=(16, 64))
    out = check_flex(q, k, v, alibi(alibi_slopes(4)), block_mask, grads=False)
    expected = jax.jit(lambda q, k, v: flash_attention(q, k, v, kv_lengths=offset + 1, bias=None))(q, k, v)
    actual = jax.jit(lambda q, k, v: flex_attention(q, k, v, None, block_mask, enable_gqa=True))(q, k, v)
    assert_close(actual, expected, jnp.float32)
    assert out.shape == q.shape


def test_captured_array_gradients_are_exact_and_deterministic():
    q, k, v = random_qkv(46, 2, T, T, 4, 2, 32)
    slopes = alibi_slopes(4)
    table = 0.1 * normal(47, (4, 2 * T - 1))
    cotangent = normal(48, q.shape)
    block_mask = MASKS["causal_window"]()

    def loss(fn, slopes, table):
        def score_mod(s, b, h, q_idx, kv_idx):
            return relative_bias(table)(alibi(slopes)(s, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

        return jnp.sum(fn(q, k, v, score_mod, block_mask, enable_gqa=True) * cotangent)

    grad = jax.jit(jax.grad(lambda s, t: loss(flex_attention, s, t), (0, 1)))
    actual = grad(slopes, table)
    expected = jax.jit(jax.grad(lambda s, t: loss(flex_attention_reference, s, t), (0, 1)))(slopes, table)
    for a, e in zip(actual, expected):
        assert_close(a, e, jnp.float32)
    again = grad(slopes, table)
    for a, b in zip(actual, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LearnedAlibi:
    """A module-like hook (a pytree with parameters and __call__, as an Equinox module is)."""

    slopes: jax.Array

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score - jax.nn.softplus(self.slopes[h]) * jnp.abs(q_idx - kv_idx).astype(score.dtype)


def test_module_hook_trains_through_the_kernel():
    q, k, v = random_qkv(49, 1, 64, 64, 2, 2, 32)
    block_mask = create_block_mask(causal_mask, None, None, 64, 64, block_size=32)
    causal_target = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, alibi(jnp.array([0.5, 0.05])),
                                                                     block_mask))(q, k, v)

    def loss(module):
        return jnp.mean((flex_attention(q, k, v, module, block_mask) - causal_target) ** 2)

    module = LearnedAlibi(jnp.zeros(2))
    grad = jax.jit(jax.grad(loss))
    expected = jax.jit(jax.grad(
        lambda m: jnp.mean((flex_attention_reference(q, k, v, m, block_mask) - causal_target) ** 2)))
    assert_close(grad(module).slopes, expected(module).slopes, jnp.float32)
    losses, jitted_loss = [], jax.jit(loss)
    for _ in range(20):
        losses.append(float(jitted_loss(module)))
        module = jax.tree.map(lambda p, g: p - 20.0 * g, module, grad(module))
    assert losses[-1] < 0.5 * losses[0], losses


def test_block_mask_classification_and_sparsity():
    block_mask = create_block_mask(causal_mask, None, None, 512, 512, block_size=128)
    dense = np.asarray(block_mask.to_dense()[0, 0])
    np.testing.assert_array_equal(dense, np.tril(np.full((4, 4), 2), -1) + np.eye(4, dtype=int))
    assert float(block_mask.tile_sparsity()[0, 0]) == pytest.approx(6 / 16)
    window = create_block_mask(and_masks(causal_mask, sliding_window(128)), None, None, 2048, 2048, block_size=128)
    computed = 1.0 - float(window.tile_sparsity()[0, 0])
    assert computed == pytest.approx((16 + 15) / 256)  # the diagonal and the one block before it


def test_empty_tiles_are_really_skipped():
    """NaN keys/values in tiles the mask never reaches would poison every row that visited them."""
    q, k, v = random_qkv(50, 1, 128, 128, 2, 2, 32)
    poison = jnp.zeros((1, 128, 2, 32)).at[:, 96:].set(jnp.nan)
    block_mask = create_block_mask(causal_mask, None, None, 128, 128, block_size=32)
    out = jax.jit(lambda q, k, v: flex_attention(q, k + poison, v + poison, None, block_mask))(q, k, v)
    expected = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, None, block_mask))(q, k, v)
    assert_close(out[:, :96], expected[:, :96], jnp.float32)
    tiles = FlashConfig(block_q=32, block_k=32, block_q_dq=32, block_k_dq=32, block_q_dkv=32, block_k_dkv=32)
    out = jax.jit(lambda q, k, v: flash_attention(q, k + poison, v + poison, causal=True, config=tiles))(q, k, v)
    assert_close(out[:, :96], expected[:, :96], jnp.float32)


def test_per_batch_documents_under_jit_do_not_retrace():
    q, k, v = random_qkv(51, 2, 64, 64, 2, 2, 32)
    traces = []

    @jax.jit
    def run(q, k, v, ids):
        traces.append(None)
        block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 2, None, 64, 64, block_size=32)
        return flex_attention(q, k, v, None, block_mask)

    @jax.jit
    def run_with_mask(q, k, v, block_mask: BlockMask):
        traces.append(None)
        return flex_attention(q, k, v, None, block_mask)

    for split in (10, 50):
        ids = jnp.concatenate([jnp.zeros((2, split), jnp.int32), jnp.ones((2, 64 - split), jnp.int32)], axis=1)
        expected = jax.jit(lambda q, k, v, ids: flex_attention_reference(
            q, k, v, None, create_block_mask(and_masks(causal_mask, document_mask(ids)), 2, None, 64, 64)))(
            q, k, v, ids)
        assert_close(run(q, k, v, ids), expected, jnp.float32)
        block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 2, None, 64, 64, block_size=32)
        assert_close(run_with_mask(q, k, v, block_mask), expected, jnp.float32)
    assert len(traces) == 2  # one trace per jitted function


def test_dropout_matches_reference_and_is_reproducible():
    q, k, v = random_qkv(52, 2, 64, 64, 2, 1, 32)
    block_mask = create_block_mask(causal_mask, None, None, 64, 64, block_size=32)
    kwargs = dict(dropout_rate=0.3, dropout_seed=jnp.uint32(11), enable_gqa=True)
    out = check_flex(q, k, v, softcap(4.0), block_mask, **kwargs)
    again = jax.jit(lambda q, k, v: flex_attention(q, k, v, softcap(4.0), block_mask, **kwargs))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
    other = jax.jit(lambda q, k, v: flex_attention(q, k, v, softcap(4.0), block_mask, dropout_rate=0.3,
                                                   dropout_seed=12, enable_gqa=True))(q, k, v)
    assert float(np.abs(np.asarray(other) - np.asarray(out)).max()) > 1e-2
    flash = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, dropout_rate=0.3, dropout_seed=11))(q, k, v)
    expected = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, None, block_mask, **kwargs))(q, k, v)
    assert_close(flash, expected, jnp.float32)


def test_dropout_keep_mask_statistics():
    grids = (jnp.arange(2).reshape(2, 1, 1, 1), jnp.arange(4).reshape(1, 4, 1, 1),
             jnp.arange(512).reshape(1, 1, 512, 1), jnp.arange(512).reshape(1, 1, 1, 512))
    keep = np.asarray(dropout_keep_mask(3, *grids, 0.2, 4))
    assert abs(keep.mean() - 0.8) < 0.002  # 2M draws: the standard error is 3e-4
    row_rates = keep.mean(axis=-1)
    assert abs(row_rates.std() - np.sqrt(0.8 * 0.2 / 512)) < 0.003  # rows independent, binomial spread
    assert np.abs(np.corrcoef(keep[0, 0, :, :-1].ravel(), keep[0, 0, :, 1:].ravel())[0, 1]) < 0.01
    assert (keep[0, 0] != keep[0, 1]).mean() > 0.3 and (keep[0, 0] != keep[1, 0]).mean() > 0.3


def test_fully_masked_rows_zero_output_and_gradients():
    q, k, v = random_qkv(53, 1, 64, 64, 2, 2, 32)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= 16) & (kv_idx <= q_idx), None, None, 64, 64,
                                   block_size=16)
    out = check_flex(q, k, v, alibi(alibi_slopes(2)), block_mask)
    assert np.all(np.asarray(out[:, :16]) == 0)
    dq, _, _ = flex_gradients(flex_attention, q, k, v, None, block_mask)
    assert np.all(np.asarray(dq[:, :16]) == 0)


def test_errors():
    q, k, v = random_qkv(54, 2, 32, 32, 2, 2, 16)
    with pytest.raises(TypeError, match="mask_mod must return bool"):
        create_block_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx, None, None, 32, 32)
    with pytest.raises(TypeError, match="score_mod must return a score of the input's shape and dtype"):
        flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: s.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="score_mod must return"):
        flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: jnp.sum(s))
    with pytest.raises(ValueError, match="block_mask was built for q_len=64, kv_len=64, but q and k have T=32"):
        flex_attention(q, k, v, None, create_block_mask(causal_mask, None, None, 64, 64))
    with pytest.raises(ValueError, match="block_mask was built for B=3"):
        flex_attention(q, k, v, None, create_block_mask(causal_mask, 3, None, 32, 32))
    names = {"a": 1.0}
    with pytest.raises(TypeError, match="score_mod could not be traced"):
        flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: s + names[h])
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        flex_attention(q, k, v, None, causal_mask)
    with pytest.raises(ValueError, match="block_size"):
        create_block_mask(causal_mask, None, None, 32, 32, block_size=0)
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        flex_attention(q, k, v, dropout_rate=0.1)


def test_block_mask_at_32k_costs_about_window_over_seq():
    """Built under jit at seq 32768 (one slab of query blocks at a time); a causal 1024-window visits about
    window / seq of the tiles: per row of 128-blocks the diagonal, 7 full blocks and one partial far end.
    Compiled with the CPU backend's optimizations, which conftest.py turns off for the suite: the mask_mod runs
    on 32768 x 32768 elements, about 20 s of CPU without them and 2 s with them."""
    seq, window = 32768, 1024
    build = jax.jit(lambda ids: create_block_mask(
        and_masks(causal_mask, sliding_window(window), document_mask(ids)), 1, None, seq, seq),
        compiler_options={"xla_backend_optimization_level": 2})
    block_mask = build(jnp.zeros((1, seq), jnp.int32))
    dense = np.asarray(block_mask.to_dense()[0, 0])
    rows = dense.shape[0]
    visited = (dense > 0).sum()
    assert visited == sum(min(i, 8) + 1 for i in range(rows))
    assert (dense == 2).sum() == sum(min(i, 7) for i in range(rows))  # all between the two partial ends
    assert abs(visited / dense.size - window / seq) < 0.01


def test_vmap_over_inputs_and_captured_arrays():
    """Equinox-style per-example vmap: the kernels' batching rules also batch the arrays a hook captures."""
    q = normal(55, (3, 1, 40, 2, 16))
    slopes = jnp.array([[0.3, 0.1], [0.6, 0.2], [0.9, 0.3]])
    block_mask = create_block_mask(causal_mask, None, None, 40, 40, block_size=16)

    def loss(fn, slopes, q):
        return jnp.sum(fn(q, q, q, alibi(slopes), block_mask) ** 2)

    grads = jax.jit(jax.vmap(jax.grad(lambda s, q: loss(flex_attention, s, q), (0, 1))))(slopes, q)
    expected = jax.jit(jax.vmap(jax.grad(lambda s, q: loss(flex_attention_reference, s, q), (0, 1))))(slopes, q)
    for a, e in zip(grads, expected):
        assert_close(a, e, jnp.float32)


def test_hooks_with_jax_enable_x64():
    """Under jax_enable_x64 the kernels' index tiles stay int32, the dtype the hooks were traced with."""
    q, k, v = random_qkv(40, 1, 40, 40, 2, 2, 16, jnp.float32)
    with jax.enable_x64(True):
        block_mask = create_block_mask(causal_mask, None, None, 40, 40)
        score_mod = softcap(2.0)
        out = jax.jit(lambda q, k, v: flex_attention(q, k, v, score_mod, block_mask))(q, k, v)
        expected = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, score_mod, block_mask))(q, k, v)
        assert_close(out, expected, jnp.float32)
        grads = [jax.jit(jax.grad(lambda q, f=f: jnp.sum(f(q, k, v, score_mod, block_mask))))(q)
                 for f in (flex_attention, flex_attention_reference)]
        assert_close(grads[0], grads[1], jnp.float32, "dq")


def test_kernels_retiled_per_call_stay_exact(monkeypatch):
    """The dispatch may run the forward, dQ and dK/dV kernels of one call on different tiles
    (`triton.plan.forward_config`, `backward_configs`: narrower tiles or other warps where a feature
    spills): each kernel then traces the hooks at its own tile and reads the block tables at it."""
    from probjax_kernels.triton import plan as triton_plan

    def halved(config, *fields):
        return dataclasses.replace(config, **{name: getattr(config, name) // 2 for name in fields})

    monkeypatch.setattr(triton_plan, "forward_config", lambda problem, config, *_: halved(config, "block_k"))
    monkeypatch.setattr(triton_plan, "backward_configs", lambda problem, *_: (
        halved(problem.config, "block_q_dq"), halved(problem.config, "block_k_dkv")))
    # the tangent's query tile below the forward's, with block tables (float32 on a GPU)
    monkeypatch.setattr(triton_plan, "tangent_config", lambda config, *_, **__: halved(config, "block_q"))
    q, k, v = random_qkv(49, 1, 64, 64, 2, 1, 16)
    table = 0.3 * normal(50, (2, 127))
    block_mask = create_block_mask(causal_mask, None, None, 64, 64, block_size=32)
    config = FlashConfig(block_q=32, block_k=32, block_q_dq=32, block_k_dq=32, block_q_dkv=32, block_k_dkv=32)
    check_flex(q, k, v, relative_bias(table), block_mask, config=config)
    d_q = normal(51, q.shape)
    calls = ((flex_attention, dict(config=config)), (flex_attention_reference, {}))
    tangents = [jax.jit(lambda q, d_q, fn=fn, extra=extra: jax.jvp(
        lambda q: fn(q, k, v, relative_bias(table), block_mask, enable_gqa=True, **extra), (q,), (d_q,))[1])(q, d_q)
                for fn, extra in calls]
    assert_close(tangents[0], tangents[1], q.dtype, "d out")


def _branchy_mask(b, h, q_idx, kv_idx):
    return True if q_idx >= kv_idx else False  # noqa: SIM210 (Python control flow on purpose)


def _branchy_score(score, b, h, q_idx, kv_idx):
    return score if q_idx >= kv_idx else -score


def _branchy_and_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) and (kv_idx >= 0)


@pytest.mark.parametrize("path", [
    "create_block_mask", "create_block_mask and", "create_mask", "flex score_mod", "flex score_mod jit",
    "flex traced scale", "flex reference", "attention flex score_mod", "attention flex mask_mod",
    "attention xla score_mod", "attention xla mask_mod", "attention xla mask_mod jit",
])
def test_python_control_flow_in_a_hook_names_it(path):
    """Issue 6b: Python control flow on a hook's arrays gave NumPy's 'truth value ... is ambiguous'; every
    path now gives the message of docs/flex_attention.md, naming the hook."""
    import probjax_nn

    q, k, v = random_qkv(55, 1, 32, 32, 2, 2, 16)
    calls = {
        "create_block_mask": lambda: create_block_mask(_branchy_mask, None, None, 32, 32),
        "create_block_mask and": lambda: create_block_mask(_branchy_and_mask, 1, 2, 32, 32),
        "create_mask": lambda: create_mask(_branchy_score, 1, 2, 32, 32),
        "flex score_mod": lambda: flex_attention(q, k, v, _branchy_score),
        "flex score_mod jit": lambda: jax.jit(lambda q: flex_attention(q, k, v, _branchy_score))(q),
        "flex traced scale": lambda: jax.jit(lambda s: flex_attention(q, k, v, _branchy_score, scale=s))(0.5),
        "flex reference": lambda: flex_attention_reference(q, k, v, _branchy_score),
        "attention flex score_mod": lambda: probjax_nn.attention(q, k, v, score_mod=_branchy_score, impl="flex"),
        "attention flex mask_mod": lambda: probjax_nn.attention(q, k, v, mask_mod=_branchy_mask, impl="flex"),
        "attention xla score_mod": lambda: probjax_nn.attention(q, k, v, score_mod=_branchy_score, impl="xla"),
        "attention xla mask_mod": lambda: probjax_nn.attention(q, k, v, mask_mod=_branchy_mask, impl="xla"),
        "attention xla mask_mod jit": lambda: jax.jit(
            lambda q: probjax_nn.attention(q, k, v, mask_mod=_branchy_mask, impl="xla"))(q),
    }
    hook = "mask_mod" if "mask_mod" in path or path.startswith("create_block_mask") else "score_mod"
    with pytest.raises(TypeError, match=f"^{hook} could not be traced with array arguments: it uses Python control "
                                        "flow .* write it with jnp.where"):
        calls[path]()
