"""ring_attention (context parallelism over host devices) against unsharded attention on the gathered arrays.

conftest.py gives the CPU 8 host devices. The kernels run in Pallas interpret mode, whose lowering does not
carry shard_map's varying-axes types through control flow, so the kernel tests use `check_vma=False` (under
the default checks ring_attention runs its blocks in plain jnp on the CPU); the plain-jnp block path runs
with the default checks. The unsharded references run under jax.jit: eagerly, every op of them and of their
gradients was an XLA compile of its own.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, numpy_allowed, numpy_attention, random_qkv
from jax.sharding import PartitionSpec as P

from probjax_kernels import FlashConfig, create_block_mask, flex_attention_reference, ring_attention, zigzag_permutation

SEQ = P(None, "sp")


def _sharded(n, fn, *, check_vma):
    """fn(q, k, v, ...) -> (out, lse) under shard_map, the sequence axis split over n devices ("sp")."""
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=SEQ, out_specs=(SEQ, P(None, None, "sp")), check_vma=check_vma)
    return mesh, mapped


def _order(length, n, layout):
    return zigzag_permutation(length, n) if layout == "zigzag" else np.arange(length)


def run_ring(n, q, k, v, *, layout, check_vma=False, extras=(), grad_of=None, **kwargs):
    """(out, lse, grads) of ring_attention on n devices, in the original token order. `extras` are `[B, L]`
    arrays sharded like the sequence (segment ids), passed to ring_attention by name; `grad_of` is a
    pair (d_out, d_lse) of loss weights for the gradients."""
    order = _order(q.shape[1], n, layout)
    inverse = np.argsort(order)
    names = [name for name, _ in extras]

    def fn(q, k, v, *arrays):
        return ring_attention(q, k, v, axis_name="sp", layout=layout, return_lse=True,
                              **dict(zip(names, arrays)), **kwargs)

    mesh, ring = _sharded(n, fn, check_vma=check_vma)
    place = lambda x: jax.device_put(jnp.asarray(x)[:, order], jax.NamedSharding(mesh, SEQ))  # noqa: E731
    arrays = [place(x) for _, x in extras]
    d_out, d_lse = grad_of
    weights = place(d_out), jnp.asarray(d_lse)[:, :, order]

    def loss(q, k, v):  # forward and gradients from one compiled program
        out, lse = ring(q, k, v, *arrays)
        return jnp.sum(out * weights[0]) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights[1]), (out, lse)

    step = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))
    grads, (out, lse) = step(place(q), place(k), place(v))
    for again, first in zip(step(place(q), place(k), place(v))[0], grads):  # no atomics: the same bits
        np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
    return np.asarray(out)[:, inverse], np.asarray(lse)[:, :, inverse], [np.asarray(g)[:, inverse] for g in grads]


def _cotangents(q):
    batch, length, heads, _ = q.shape
    d_out = normal(5, q.shape, jnp.float32).astype(q.dtype)
    d_lse = normal(6, (batch, heads, length), jnp.float32)
    return d_out, d_lse


def _reference_grads(q, k, v, allowed, d_out, d_lse):
    """Gradients of sum(out * d_out) + sum(lse * d_lse) of unsharded plain-jnp attention on the same mask."""
    def loss(q, k, v):
        scores_mask = jnp.asarray(allowed)

        def mask_mod(b, h, q_idx, kv_idx):
            return scores_mask[b % scores_mask.shape[0], 0, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[1], k.shape[1], block_size=16)
        out, lse = flex_attention_reference(q, k, v, None, block_mask, enable_gqa=True, return_lse=True)
        return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)

    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)


def _check(out, lse, expected, expected_lse, dtype=jnp.float32):
    assert_close(out, expected, dtype, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse[finite], expected_lse[finite], atol=1e-4)


def test_zigzag_permutation():
    order = zigzag_permutation(16, 2)
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    assert sorted(order) == list(range(16))


def test_zigzag_permutation_needs_a_multiple():
    with pytest.raises(ValueError, match="multiple of 2 \\* axis_size = 8"):
        zigzag_permutation(20, 4)


def test_kernels_zigzag_ring_causal_gqa_documents():
    """Flash kernel per block: causal zigzag ring on 2 devices (4 chunks), GQA, packed documents across
    chunk and device borders."""
    n, length = 2, 64
    q, k, v = random_qkv(0, 1, length, length, 2, 1, 16)
    ids = np.repeat([0, 1, 2], [11, 30, 23])[None]  # document 1, [11, 41), spans both devices
    d_out, d_lse = _cotangents(q)
    out, lse, grads = run_ring(n, q, k, v, layout="zigzag", causal=True, strategy="ring",
                               extras=(("q_segment_ids", ids), ("kv_segment_ids", ids)), grad_of=(d_out, d_lse))
    allowed = numpy_allowed(1, length, length, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed)
    _check(out, lse, expected, expected_lse)
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads, _reference_grads(q, k, v, allowed, d_out, d_lse)):
        assert_close(actual, wanted, jnp.float32, name)


def test_tpu_interpreter_config_runs_the_blocks_in_plain_jnp():
    """`FlashConfig(backend="tpu_interpret")` in a ring on 2 host devices: the TPU interpreter's callbacks
    beside the collective-permutes deadlocked (forward) or aborted (jit of the gradient); the blocks now take
    the plain-jnp path. Forward and gradients against float64, under the default varying-axes checks too."""
    n, length = 2, 64
    q, k, v = random_qkv(3, 1, length, length, 2, 1, 32)
    d_out, d_lse = _cotangents(q)
    allowed = numpy_allowed(1, length, length, causal=True)
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed)
    expected_grads = _reference_grads(q, k, v, allowed, d_out, d_lse)
    for check_vma in (False, True):
        out, lse, grads = run_ring(n, q, k, v, layout="contiguous", causal=True, check_vma=check_vma,
                                   grad_of=(d_out, d_lse), config=FlashConfig(backend="tpu_interpret"))
        _check(out, lse, expected, expected_lse)
        for name, actual, wanted in zip(("dq", "dk", "dv"), grads, expected_grads):
            assert_close(actual, wanted, jnp.float32, name)


def test_kernels_allgather_hooks_see_global_positions():
    """Flex kernel per block: a relative-position table (captured, with its gradient), a mask_mod, a window
    and dropout (the unsharded call's keep mask), all on global positions, with the all-gather schedule on 4
    devices, contiguous, not causal."""
    n, length, heads = 4, 64, 2
    q, k, v = random_qkv(1, 1, length, length, heads, 2, 16)
    table = normal(3, (heads, 2 * length - 1), jnp.float32)

    def score_mod(table, score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx - q_idx + length - 1]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 5 != 0

    d_out, d_lse = _cotangents(q)

    def ring_loss(table, q, k, v):
        def fn(q, k, v):
            return ring_attention(q, k, v, axis_name="sp", strategy="allgather", window=(9, 20),
                                  score_mod=functools.partial(score_mod, table), mask_mod=mask_mod,
                                  dropout_rate=0.25, dropout_seed=11, return_lse=True)
        _, ring = _sharded(n, fn, check_vma=False)
        out, lse = ring(q, k, v)
        return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse), (out, lse)

    def reference_loss(table, q, k, v):
        def both(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx, kv_idx) & (kv_idx >= q_idx - 9) & (kv_idx <= q_idx + 20)

        block_mask = create_block_mask(both, None, None, length, length, block_size=16)
        out, lse = flex_attention_reference(q, k, v, functools.partial(score_mod, table), block_mask,
                                            enable_gqa=True, dropout_rate=0.25, dropout_seed=11, return_lse=True)
        return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(ring_loss, (0, 1, 2, 3), has_aux=True))(table, q, k, v)
    expected_grads, (expected, expected_lse) = jax.jit(jax.grad(reference_loss, (0, 1, 2, 3), has_aux=True))(
        table, q, k, v)
    _check(np.asarray(out), np.asarray(lse), np.asarray(expected), np.asarray(expected_lse))
    for name, actual, wanted in zip(("dtable", "dq", "dk", "dv"), grads, expected_grads):
        assert_close(actual, wanted, jnp.float32, name)


@pytest.mark.parametrize("n,layout,strategy,causal", [(4, "contiguous", "ring", True), (8, "zigzag", "allgather", False)])
def test_window_on_four_and_eight_devices(n, layout, strategy, causal):
    """The plain-jnp block path with shard_map's default checks, and a window that empties some steps
    entirely; gradients are the same bits run to run."""
    length = 128
    q, k, v = random_qkv(2, 2, length, length, 4, 2, 16)
    d_out, d_lse = _cotangents(q)
    window = (20, 3)
    out, lse, grads = run_ring(n, q, k, v, layout=layout, strategy=strategy, causal=causal, window=window,
                               check_vma=True, grad_of=(d_out, d_lse), _backend="reference")
    allowed = numpy_allowed(2, length, length, causal=causal, window=window)
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed)
    _check(out, lse, expected, expected_lse)
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads, _reference_grads(q, k, v, allowed, d_out, d_lse)):
        assert_close(actual, wanted, jnp.float32, name)


def test_bad_arguments():
    q, k, v = random_qkv(0, 1, 6, 6, 2, 1, 16)
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))

    def call(**kwargs):
        fn = functools.partial(ring_attention, axis_name="sp", **kwargs)
        return jax.shard_map(fn, mesh=mesh, in_specs=SEQ, out_specs=SEQ, check_vma=False)(q, k, v)

    with pytest.raises(ValueError, match="layout='zigzag' needs even shards"):
        call(layout="zigzag")
    with pytest.raises(ValueError, match="strategy='tree'"):
        call(strategy="tree")


def _modules(config):
    """(params, apply(params, inputs)) of NNX's FlexAttention with learnable ALiBi (slopes' gradients too);
    the same weights for any config. Every module reaches `attention` through the same AttentionFunction;
    tests/test_examples_models.py trains NNX, Linen and Equinox models context parallel."""
    from flax import nnx

    from probjax_nn import nnx as pn

    flex = pn.FlexAttention(4, 32, score_mod=pn.ALiBi(4), attention_impl=config, rngs=nnx.Rngs(2), decode=False)
    graph, state = nnx.split(flex)
    return {"nnx_flex": (state, lambda state, x: nnx.merge(graph, state)(x, is_causal=True))}


def test_modules_context_parallel():
    """A module under `jax.set_mesh` with `AttentionConfig(context_axis=...)` gives the unsharded outputs and
    parameter gradients (a learnable hook's too), with the batch on a second, Explicit mesh axis."""
    import equinox as eqx

    from probjax_nn import AttentionConfig

    plain = _modules(AttentionConfig(impl="xla"))
    sharded = _modules(AttentionConfig(impl="xla", context_axis="sp"))
    mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = normal(7, (2, 32, 32), jnp.float32)

    def loss(apply, params, x):
        return jnp.sum(jnp.sin(apply(params, x)))

    for name in plain:
        value_and_grad = lambda entry: eqx.filter_value_and_grad(functools.partial(loss, entry[1]))  # noqa: E731
        expected, expected_grads = eqx.filter_jit(value_and_grad(plain[name]))(plain[name][0], x)
        with jax.set_mesh(mesh):
            step = eqx.filter_jit(value_and_grad(sharded[name]))
            placed = jax.device_put(x, P("data"))
            assert "ppermute" in str(eqx.filter_make_jaxpr(step)(sharded[name][0], placed)[0]), name
            value, grads = step(sharded[name][0], placed)
        np.testing.assert_allclose(value, expected, rtol=1e-5, err_msg=name)
        leaves = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))  # noqa: E731
        for actual, wanted in zip(leaves(grads), leaves(expected_grads), strict=True):
            assert_close(actual, wanted, jnp.float32, name)


@pytest.mark.parametrize("hooks", [False, True])
def test_ring_lowers_for_cuda(hooks):
    """The schedule around the Triton kernels lowers for CUDA on 4 abstract H100s: the flash path (zigzag,
    causal, dropout on global positions) with shard_map's default varying-axes checks, the flex path (a captured table, a window) without
    them (hooks traced at unvarying indices then meet the varying global positions)."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    from probjax_kernels import FlashConfig

    mesh = AbstractMesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                        abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    config = FlashConfig(backend="triton")
    table = jax.ShapeDtypeStruct((4, 1023), jnp.float32)

    def loss(q, k, v, table):
        def attend(q, k, v, table):
            if not hooks:
                return ring_attention(q, k, v, axis_name="sp", layout="zigzag", causal=True, config=config,
                                      dropout_rate=0.1, dropout_seed=3)
            return ring_attention(q, k, v, axis_name="sp", window=100, config=config,
                                  score_mod=lambda s, b, h, i, j: s + table[h, j - i + 511])

        out = jax.shard_map(attend, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, P()), out_specs=SEQ,
                            check_vma=not hooks)(q, k, v, table)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    with use_abstract_mesh(mesh):
        text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(q, kv, kv, table).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("probjax_flash_forward", "probjax_flash_backward_dq", "probjax_flash_backward_dkv",
                 "collective_permute"):
        assert name in text, name


def test_attention_context_parallel_dropout_zigzag():
    """`probjax_nn.attention` with a zigzag context axis and dropout drops the unsharded call's weights (the
    tokens laid out by `zigzag_permutation`, the result compared in that order)."""
    import probjax_nn

    q, k, v = random_qkv(8, 2, 64, 64, 4, 2, 16)
    order = zigzag_permutation(64, 4)
    kwargs = dict(is_causal=True, dropout_rate=0.2, dropout_seed=5)
    expected = jax.jit(functools.partial(probjax_nn.attention, impl="xla", **kwargs))(q, k, v)
    config = probjax_nn.AttentionConfig(impl="xla", context_axis="sp", context_layout="zigzag")
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        out = jax.jit(functools.partial(probjax_nn.attention, impl=config, **kwargs))(
            q[:, order], k[:, order], v[:, order])
    assert_close(out, np.asarray(expected)[:, order], jnp.float32)


def test_ring_never_holds_the_whole_key_value():
    """Per-device memory O(L/n): the compiled forward and backward of the ring has no array of the whole
    sequence's K/V (`[1, 64, 2, 8]` on 4 devices of 16), where the all-gather schedule has them."""
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q = jax.ShapeDtypeStruct((1, 64, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.float32)

    def compiled(strategy):
        def loss(q, k, v):
            attend = functools.partial(ring_attention, axis_name="sp", strategy=strategy, causal=True,
                                       _backend="reference")
            return jnp.sum(jax.shard_map(attend, mesh=mesh, in_specs=SEQ, out_specs=SEQ, check_vma=False)(q, k, v))

        return jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile().as_text()

    whole = "[1,64,2,8]"
    assert whole not in compiled("ring")
    assert any(whole in line and "all-gather" in line for line in compiled("allgather").splitlines())


def test_context_parallel_global_batch_and_head_indices():
    """The context-parallel layer with the batch and the heads on other (Explicit) mesh axes: ALiBi reads h,
    a mask_mod reads b and dropout hashes both, as in the unsharded call (each shard saw its local b and h
    before); through jax.jvp (a custom_vjp before), with a value head dim Dv != D (refused before)."""
    import probjax_nn
    from probjax_kernels import alibi

    q, k, _ = random_qkv(9, 2, 32, 32, 4, 2, 16)
    v = normal(15, (2, 32, 2, 24), jnp.float32)
    lengths = jnp.asarray([32, 11], jnp.int32)
    kwargs = dict(is_causal=True, score_mod=alibi(jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)),
                  mask_mod=lambda b, h, q_idx, kv_idx: kv_idx < lengths[b], dropout_rate=0.25, dropout_seed=4)
    tangents = tuple(normal(16 + i, x.shape, jnp.float32) for i, x in enumerate((q, k, v)))
    reference = functools.partial(probjax_nn.attention, impl="xla", **kwargs)
    expected = jax.jit(lambda p, t: jax.jvp(reference, p, t))((q, k, v), tangents)
    config = probjax_nn.AttentionConfig(impl="xla", context_axis="sp")
    mesh = jax.make_mesh((2, 2, 2), ("data", "sp", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    with jax.set_mesh(mesh):
        placed = tuple(jax.device_put(x, P("data", None, "model")) for x in (q, k, v))
        attend = functools.partial(probjax_nn.attention, impl=config, **kwargs)
        out, d_out = jax.jit(lambda p, t: jax.jvp(attend, p, t))(placed, tangents)
    assert_close(out, expected[0], jnp.float32, "out")
    assert_close(d_out, expected[1], jnp.float32, "d_out")


def test_default_checks_traced_scale_value_dim():
    """ring_attention as the docs call it, in a shard_map with its default varying-axes checks (a crash in
    the Pallas interpreter before; on the CPU the blocks now take the plain-jnp path there), 2 devices: a
    traced scale multiplies the float32 scores (bf16 lse against float64; folding it into q cost 3e-3), and
    with a value head dim Dv != D (a cond type error before) and ALiBi's captured slopes (whose gradients
    once met a psum inside the schedule's device-dependent switch), outputs and gradients equal the unsharded
    reference's."""
    from probjax_kernels import alibi, causal_mask

    mesh = jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = random_qkv(10, 2, 32, 32, 4, 2, 16, jnp.bfloat16)

    def ring_lse(scale, q, k, v):
        fn = lambda q, k, v: ring_attention(q, k, v, axis_name="sp", scale=scale, return_lse=True)  # noqa: E731
        return jax.shard_map(fn, mesh=mesh, in_specs=SEQ, out_specs=(SEQ, P(None, None, "sp")))(q, k, v)[1]

    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    scores = np.einsum("btnd,bsnd->bnts", q64, np.repeat(k64, 2, axis=2)) * 0.3
    top = scores.max(-1)
    expected_lse = np.log(np.exp(scores - top[..., None]).sum(-1)) + top
    lse = jax.jit(ring_lse)(jnp.float32(0.3), q, k, v)
    assert np.abs(np.asarray(lse, np.float64) - expected_lse).max() < 1e-4

    q, k, _ = random_qkv(11, 1, 32, 32, 4, 2, 16)
    v = normal(12, (1, 32, 2, 8), jnp.float32)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    block_mask = create_block_mask(causal_mask, None, None, 32, 32, block_size=16)

    def ring(q, k, v, slopes):
        return jax.shard_map(functools.partial(ring_attention, axis_name="sp", causal=True, score_mod=alibi(slopes)),
                             mesh=mesh, in_specs=SEQ, out_specs=SEQ)(q, k, v)

    def reference(q, k, v, slopes):
        return flex_attention_reference(q, k, v, score_mod=alibi(slopes), block_mask=block_mask, enable_gqa=True)

    weights = normal(13, (1, 32, 4, 8), jnp.float32)
    loss = lambda attend: lambda *args: jnp.sum(attend(*args) * weights)  # noqa: E731
    # The gradient of the captured slopes too (issue 30 item 5: "Expected cotangent type float32[4] but got
    # float32[4]{V:sp}" under the default checks before).
    (value, grads), (expected, expected_grads) = (
        jax.jit(jax.value_and_grad(loss(ring), (0, 1, 2, 3)))(q, k, v, slopes),
        jax.jit(jax.value_and_grad(loss(reference), (0, 1, 2, 3)))(q, k, v, slopes))
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for name, actual, wanted in zip(("dq", "dk", "dv", "d slopes"), grads, expected_grads):
        assert_close(actual, wanted, jnp.float32, name)


@pytest.mark.parametrize("impl, mesh_axes, q_spec, kv_spec", [
    # Heads of the query split, GQA key / value replicated (each shard paired its query heads with the
    # first key heads: off by 2.1).
    ("pallas", (("sp", 1), ("model", 4)), P(None, None, "model"), P()),
    # Query replicated, key / value batch-split (each device took its local key batch as the whole batch's).
    ("xla", (("data", 2), ("sp", 4)), P(), P("data")),
])
def test_context_parallel_query_and_key_sharded_differently(impl, mesh_axes, q_spec, kv_spec):
    """The context-parallel layer puts query, key and value on one batch / head layout whatever their own
    shardings: the outputs equal the unsharded call's."""
    import probjax_nn

    q, k, v = random_qkv(17, 2, 16, 16, 8, 2, 16)
    expected = jax.jit(functools.partial(probjax_nn.attention, is_causal=True, impl="xla"))(q, k, v)
    names, sizes = zip(*mesh_axes)
    mesh = jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    config = probjax_nn.AttentionConfig(impl=impl, context_axis="sp")
    with jax.set_mesh(mesh):
        placed = (jax.device_put(q, q_spec), *(jax.device_put(x, kv_spec) for x in (k, v)))
        out = jax.jit(functools.partial(probjax_nn.attention, is_causal=True, impl=config))(*placed)
    assert_close(out, expected, jnp.float32)
