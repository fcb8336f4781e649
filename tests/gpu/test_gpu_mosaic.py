"""The Mosaic GPU (Hopper) kernels compiled on the GPU against the plain-jnp reference: forward, dQ, dK/dV,
and flash_attention with FlashConfig(backend="mosaic").

Skipped off the GPU and on GPUs older than sm_90; tests/gpu/run_gpu_checks.sh runs it. The CPU suite runs the
same kernels in the Mosaic GPU interpreter (tests/test_mosaic_*.py).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import random_qkv
from test_gpu_flash import TOLERANCE, _assert_close, _normal

from probjax_kernels import (
    FlashConfig,
    alibi,
    alibi_slopes,
    and_masks,
    causal_mask,
    create_block_mask,
    document_mask,
    flash_attention,
    flash_attention_reference,
    flex_attention,
    flex_attention_reference,
    sliding_window,
    softcap,
)
from probjax_kernels.mosaic.backward import mosaic_backward_dq
from probjax_kernels.mosaic.backward_dkv import mosaic_backward_dkv
from probjax_kernels.mosaic.forward import mosaic_forward


def _is_hopper() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0" or "H100" in jax.devices()[0].device_kind or (
        "H200" in jax.devices()[0].device_kind)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90) GPU")]
TOL = TOLERANCE["bfloat16"]


@pytest.mark.parametrize("p_in_smem", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward(causal, head_dim, p_in_smem):
    q, k, v = random_qkv(0, 2, 1024, 1024, 8, 2, head_dim, jnp.bfloat16)
    q_lengths, kv_lengths = jnp.array([1024, 700]), jnp.array([1024, 333])
    out, lse = jax.jit(lambda q, k, v: mosaic_forward(
        q, k, v, q_lengths, kv_lengths, scale=head_dim**-0.5, causal=causal, p_in_smem=p_in_smem))(q, k, v)
    expected, expected_lse = flash_attention_reference(q, k, v, causal=causal, q_lengths=q_lengths,
                                                       kv_lengths=kv_lengths, return_lse=True)
    _assert_close("out", out, expected, TOL)
    _assert_close("lse", lse, expected_lse, TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_dq(causal):
    q, k, v = random_qkv(1, 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    lengths = jnp.array([1024, 500])
    d_out = _normal(2, q.shape, jnp.bfloat16)
    out, lse = flash_attention_reference(q, k, v, causal=causal, kv_lengths=lengths, return_lse=True)
    dq = jax.jit(lambda *a: mosaic_backward_dq(*a, jnp.full((2,), 1024), lengths, scale=128**-0.5,
                                               causal=causal))(q, k, v, out, lse, d_out)
    _, vjp = jax.vjp(lambda q: flash_attention_reference(q, k, v, causal=causal, kv_lengths=lengths), q)
    _assert_close("dq", dq, vjp(d_out)[0], 2 * TOL)


@pytest.mark.parametrize("p_in_smem", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_dkv(causal, p_in_smem):
    q, k, v = random_qkv(5, 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
    q_lengths, kv_lengths = jnp.array([1024, 600]), jnp.array([1024, 500])
    d_out = _normal(6, q.shape, jnp.bfloat16)
    kwargs = {"causal": causal, "q_lengths": q_lengths, "kv_lengths": kv_lengths}
    out, lse = flash_attention_reference(q, k, v, return_lse=True, **kwargs)
    dk, dv = jax.jit(lambda *a: mosaic_backward_dkv(*a, q_lengths, kv_lengths, scale=128**-0.5, causal=causal,
                                                    p_in_smem=p_in_smem))(q, k, v, out, lse, d_out)
    _, vjp = jax.vjp(lambda k, v: flash_attention_reference(q, k, v, **kwargs), k, v)
    expected_dk, expected_dv = vjp(d_out)
    _assert_close("dk", dk, expected_dk, 2 * TOL)
    _assert_close("dv", dv, expected_dv, 2 * TOL)


def _assert_mosaic_matches_reference(q, k, v, seed: int, *args, attention=flash_attention,
                                     reference=flash_attention_reference, **kwargs):
    """The loss sum(attention(q, k, v, *args, **kwargs) * cotangent) and its gradients, compiled on backend
    "mosaic", against the plain-jnp `reference`'s."""
    cotangent = _normal(seed, (*q.shape[:3], v.shape[3]))

    def value_and_grads(fn, **extra):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v, *args, **kwargs, **extra).astype(jnp.float32) * cotangent)

        return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)

    (value, grads), (expected_value, expected_grads) = (
        value_and_grads(attention, config=FlashConfig(backend="mosaic")),
        value_and_grads(reference),
    )
    _assert_close("loss", value, expected_value, TOL)
    for name, a, e in zip(("dq", "dk", "dv"), grads, expected_grads):
        _assert_close(name, a, e, 2 * TOL)


def _assert_mosaic_jvp_matches_reference(attention, reference, primals: tuple, tangents: tuple):
    """jax.jvp of `attention(*primals, config=FlashConfig(backend="mosaic"))` compiled against the float32 jvp of
    the plain-jnp `reference(*primals)`: out within bfloat16's tolerance, d out within twice it."""
    mosaic = FlashConfig(backend="mosaic")
    out, d_out = jax.jit(lambda p, t: jax.jvp(lambda *a: attention(*a, config=mosaic), p, t))(primals, tangents)
    f32 = [tuple(x.astype(jnp.float32) for x in xs) for xs in (primals, tangents)]
    want, want_d_out = jax.jit(lambda p, t: jax.jvp(reference, p, t))(*f32)
    _assert_close("out", out, want, TOL)
    _assert_close("d out", d_out, want_d_out, 2 * TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_with_the_mosaic_backend(causal):
    q, k, v = random_qkv(3, 2, 2048, 2048, 8, 8, 128, jnp.bfloat16)
    _assert_mosaic_matches_reference(q, k, v, 4, causal=causal)


def test_flex_block_mask_through_the_mosaic_forward():
    """Block tables walked by the compiled Mosaic forward (partial and full tiles, ring wrap-around)."""
    q, k, v = random_qkv(7, 2, 2048, 2048, 8, 8, 128, jnp.bfloat16)
    block_mask = create_block_mask(and_masks(causal_mask, sliding_window(700)), None, None, 2048, 2048)
    out = jax.jit(lambda q, k, v: flex_attention(q, k, v, None, block_mask,
                                                 config=FlashConfig(backend="mosaic")))(q, k, v)
    _assert_close("out", out, flex_attention_reference(q, k, v, None, block_mask), TOL)


@pytest.mark.parametrize("hook", ["softcap", "alibi"])
def test_flex_score_mod_inside_the_mosaic_forward(hook):
    """score_mod in the compiled Mosaic kernels (tanh; a scalar GMEM read of the slope table) with a per-head
    mask_mod over block tables: the forward, and dQ / dK/dV with the score_mod's derivative."""
    q, k, v = random_qkv(8, 2, 2048, 2048, 8, 2, 128, jnp.bfloat16)
    score_mod = softcap(20.0) if hook == "softcap" else alibi(alibi_slopes(8))

    def head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 300 + 100 * h)

    block_mask = create_block_mask(head_window, None, 8, 2048, 2048)
    cotangent = _normal(9, q.shape)

    def value_and_grads(attention, **extra):
        def loss(q, k, v):
            return jnp.sum(attention(q, k, v, score_mod, block_mask, enable_gqa=True, **extra).astype(jnp.float32)
                           * cotangent)

        return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)

    (value, grads), (expected_value, expected_grads) = (
        value_and_grads(flex_attention, config=FlashConfig(backend="mosaic")),
        value_and_grads(flex_attention_reference),
    )
    _assert_close("loss", value, expected_value, TOL)
    for name, a, e in zip(("dq", "dk", "dv"), grads, expected_grads):
        _assert_close(name, a, e, 2 * TOL)


@pytest.mark.parametrize("case", ["segments", "dropout", "dv64", "dv256", "key_mask", "dense_mask", "kv_batch1",
                                  "bias_bf16", "bias_f32", "key_bias"])
def test_features_that_run_in_the_mosaic_kernels(case):
    """Segment ids (read beside the tiles), dropout (the keep mask hashed in the kernels: the reference's bits),
    a value head dim of v's own, a key padding mask (as segment ids), a dense mask (int8 tiles), k / v of batch
    1 and a dense bias (16-bit tiles on 128-key steps, float32 tiles on 64-key steps, float32 key vectors; the
    bias gradient is checked in the interpreters), through FlashConfig(backend="mosaic") compiled: loss and
    gradients (the bias's in `test_a_dense_bias_gradient_from_the_mosaic_kernels`)."""
    q, k, v = random_qkv(10, 2, 2048, 2048, 8, 2, 128, jnp.bfloat16)
    kwargs = {"causal": True, "kv_lengths": jnp.array([2048, 1500])}
    if case == "segments":
        segments = jnp.stack([jnp.repeat(jnp.arange(4), 512), jnp.repeat(jnp.arange(2), 1024)])
        kwargs |= {"q_segment_ids": segments, "kv_segment_ids": segments}
    elif case == "dropout":
        kwargs |= {"dropout_rate": 0.1, "dropout_seed": 5}
    elif case in ("key_mask", "dense_mask"):
        shape = (2, 1, 1, 2048) if case == "key_mask" else (2, 1, 2048, 2048)
        kwargs |= {"mask": jax.random.bernoulli(jax.random.key(13), 0.8, shape)}
    elif case == "kv_batch1":
        k, v = k[:1], v[:1]
    elif case.endswith("bias"):
        shape, dtype = {"bias_bf16": ((1, 8, 2048, 2048), jnp.bfloat16), "bias_f32": ((2, 1, 2048, 2048), jnp.float32),
                        "key_bias": ((2, 1, 1, 2048), jnp.float32)}[case]
        kwargs |= {"bias": (2 * _normal(14, shape)).astype(dtype)}
    else:
        v = random_qkv(11, 2, 2048, 2048, 8, 2, 64 if case == "dv64" else 256, jnp.bfloat16)[2]
    _assert_mosaic_matches_reference(q, k, v, 12, **kwargs)


@pytest.mark.parametrize("shape, dtype", [((1, 8, 2048, 2048), jnp.bfloat16), ((2, 1, 2048, 2048), jnp.float32),
                                          ((2, 1, 1, 2048), jnp.float32), ((1, 8, 2048, 1), jnp.bfloat16)])
def test_a_dense_bias_gradient_from_the_mosaic_kernels(shape, dtype):
    """The bias gradient the Mosaic kernels make (dQ's dS tiles summed in XLA, dQ's row sums, dK/dV's key
    sums) against the reference's, compiled, with GQA, causality and lengths."""
    q, k, v = random_qkv(15, 2, 2048, 2048, 8, 2, 128, jnp.bfloat16)
    bias = (2 * _normal(16, shape)).astype(dtype)
    cotangent = _normal(17, q.shape)
    kwargs = {"causal": True, "kv_lengths": jnp.array([2048, 1500])}

    def grads(attention, **extra):
        loss = lambda q, k, v, bias: jnp.sum(  # noqa: E731
            attention(q, k, v, bias=bias, **kwargs, **extra).astype(jnp.float32) * cotangent)
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(q, k, v, bias)

    (value, got), (expected_value, expected) = (grads(flash_attention, config=FlashConfig(backend="mosaic")),
                                                grads(flash_attention_reference))
    _assert_close("loss", value, expected_value, TOL)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), got, expected):
        if name == "dbias" and shape[3] == 1:  # 0 up to rounding: a row's shift
            assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - e.astype(jnp.float32)))) < 0.5, name
        else:
            _assert_close(name, a, e, 2 * TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_document_mask_in_the_mosaic_kernels(head_dim):
    """Packed documents (a flex BlockMask, causal within each document): the ids travel as vectors beside Q
    and K (`hook_vectors`), compiled, forward and gradients (at 128 on the consumers' 240 registers)."""
    q, k, v = random_qkv(18, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    ids = jnp.stack([jnp.repeat(jnp.arange(8), 256), jnp.repeat(jnp.arange(2), 1024)])
    block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 2, None, 2048, 2048)
    _assert_mosaic_matches_reference(q, k, v, 19, None, block_mask, attention=flex_attention,
                                     reference=flex_attention_reference, enable_gqa=True)


@pytest.mark.parametrize("case", ["causal_hd64", "causal_hd128", "dropout", "segments", "dense_mask"])
def test_the_mosaic_tangent_kernel(case):
    """jax.jvp through FlashConfig(backend="mosaic") compiled: the Mosaic forward and the Mosaic tangent kernel
    (`mosaic.tangent`: four K / V-shaped rings, the final `- c out` from Q's tile) against the reference's jvp,
    GQA 4:1, ragged key lengths, every input moving."""
    head_dim = 64 if case == "causal_hd64" else 128
    q, k, v = random_qkv(20, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    tangents = random_qkv(21, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    kwargs = {"causal": True, "kv_lengths": jnp.array([2048, 1500])}
    if case == "dropout":
        kwargs |= {"dropout_rate": 0.1, "dropout_seed": 5}
    elif case == "segments":
        segments = jnp.stack([jnp.repeat(jnp.arange(4), 512), jnp.repeat(jnp.arange(2), 1024)])
        kwargs |= {"q_segment_ids": segments, "kv_segment_ids": segments}
    elif case == "dense_mask":
        kwargs |= {"mask": jax.random.bernoulli(jax.random.key(22), 0.8, (2, 8, 2048, 2048))}
    _assert_mosaic_jvp_matches_reference(functools.partial(flash_attention, **kwargs),
                                         functools.partial(flash_attention_reference, **kwargs), (q, k, v), tangents)


def test_a_head_dim_under_64_runs_the_mosaic_kernels_widened():
    """Head dim 32 (q, k, v widened to 64 with zero columns, the results cut back) through
    FlashConfig(backend="mosaic") compiled: loss and gradients against the reference, GQA 4:1, ragged keys."""
    q, k, v = random_qkv(30, 2, 2048, 2048, 8, 2, 32, jnp.bfloat16)
    _assert_mosaic_matches_reference(q, k, v, 32, causal=True, kv_lengths=jnp.array([2048, 1500]))


@pytest.mark.parametrize("head_dims, num_kv_heads, window", [((256, 256), 2, None), ((256, 256), 8, (255, 0)),
                                                             ((128, 256), 8, None), ((256, 64), 2, None)])
def test_the_mosaic_backward_at_head_dim_256(head_dims, num_kv_heads, window):
    """Head dim 256 (q / k's, v's): the Mosaic forward, dQ and dK from a program per 128 of their columns, dV from
    its own, on one K / V (Q / dO) slot, compiled; loss and gradients against the reference, causal or a
    sliding window, GQA 4:1 or none, ragged keys."""
    head_dim, value_dim = head_dims
    q, k, _ = random_qkv(31, 2, 2048, 2048, 8, num_kv_heads, head_dim, jnp.bfloat16)
    v = random_qkv(32, 2, 2048, 2048, 8, num_kv_heads, value_dim, jnp.bfloat16)[2]
    kwargs = dict(causal=True) if window is None else dict(window=window)
    _assert_mosaic_matches_reference(q, k, v, 33, kv_lengths=jnp.array([2048, 1500]), **kwargs)


@pytest.mark.parametrize("head_dims", [(256, 256), (64, 256)])
def test_dropout_at_head_dim_256_on_the_mosaic_kernels(head_dims):
    """Dropout at head dim 256 (q / k's, v's): the Mosaic forward hashing each tile by halves beside v's 256
    columns, dQ / dK / dV at 256, the tangent's programs, compiled; loss, gradients and jvp against the reference
    (the same keep mask), causal, GQA 4:1, ragged keys."""
    head_dim, value_dim = head_dims
    q, k, _ = random_qkv(41, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    v = random_qkv(42, 2, 2048, 2048, 8, 2, value_dim, jnp.bfloat16)[2]
    _assert_mosaic_matches_reference(q, k, v, 43, causal=True, kv_lengths=jnp.array([2048, 1500]), dropout_rate=0.1,
                                     dropout_seed=5)
    # The jvp: the tangent's programs with d out in 64-column pieces, hashing the same keep mask.
    dq, dk, _ = random_qkv(49, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    dv = random_qkv(50, 2, 2048, 2048, 8, 2, value_dim, jnp.bfloat16)[2]
    kwargs = dict(causal=True, kv_lengths=jnp.array([2048, 1500]), dropout_rate=0.1, dropout_seed=5)
    _assert_mosaic_jvp_matches_reference(functools.partial(flash_attention, **kwargs),
                                         functools.partial(flash_attention_reference, **kwargs), (q, k, v),
                                         (dq, dk, dv))


@pytest.mark.parametrize("head_dims, num_kv_heads, window", [((256, 256), 2, None), ((256, 64), 8, (255, 0)),
                                                             ((128, 256), 8, None)])
def test_the_mosaic_tangent_at_head_dim_256(head_dims, num_kv_heads, window):
    """jax.jvp at head dim 256 through FlashConfig(backend="mosaic") compiled: d out in 128-column pieces where v's
    head dim is 256, the tangents of q, k and v from programs of their own (one slot) where q / k's is, added in
    XLA; against the reference's jvp, causal or a sliding window, GQA 4:1 or none, ragged keys, every input
    moving."""
    head_dim, value_dim = head_dims
    q, k, _ = random_qkv(34, 2, 2048, 2048, 8, num_kv_heads, head_dim, jnp.bfloat16)
    v = random_qkv(35, 2, 2048, 2048, 8, num_kv_heads, value_dim, jnp.bfloat16)[2]
    dq, dk, _ = random_qkv(36, 2, 2048, 2048, 8, num_kv_heads, head_dim, jnp.bfloat16)
    dv = random_qkv(37, 2, 2048, 2048, 8, num_kv_heads, value_dim, jnp.bfloat16)[2]
    kwargs = {"kv_lengths": jnp.array([2048, 1500]), **(dict(causal=True) if window is None else dict(window=window))}
    _assert_mosaic_jvp_matches_reference(functools.partial(flash_attention, **kwargs),
                                         functools.partial(flash_attention_reference, **kwargs), (q, k, v),
                                         (dq, dk, dv))


@pytest.mark.parametrize("head_dims", [(256, 256), (256, 128)])
def test_the_mosaic_backward_at_head_dim_256_under_a_document_mask(head_dims):
    """Loss and gradients of flex_attention at head dim 256 under packed documents, causal within each (a
    BlockMask, the ids as vectors beside the tiles), compiled: dQ's pieces read the tables refined to their
    128 x 64 tiles, dK/dV's programs to their 128 x 128 ones; against the reference, GQA 4:1."""
    head_dim, value_dim = head_dims
    q, k, _ = random_qkv(40, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    v = random_qkv(41, 2, 2048, 2048, 8, 2, value_dim, jnp.bfloat16)[2]
    ids = jnp.stack([jnp.repeat(jnp.arange(8), 256), jnp.repeat(jnp.arange(2), 1024)])
    block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 2, None, 2048, 2048)
    _assert_mosaic_matches_reference(q, k, v, 42, None, block_mask, attention=flex_attention,
                                     reference=flex_attention_reference, enable_gqa=True)


@pytest.mark.parametrize("head_dim, kind", [(64, "tiles"), (128, "keys"), (256, "rows"), (128, "tiles"),
                                            (128, "tiles_f32"), (64, "tiles_f32"), (256, "tiles")])
def test_the_mosaic_tangent_with_a_moving_bias(head_dim, kind):
    """jax.jvp of flash_attention in q, k, v and the bias through FlashConfig(backend="mosaic") compiled: the
    bias's tangent read as the bias is (tiles of its dtype, float32 key or row vectors; at 256, and beside tiles at
    128, in programs of its own; float32 tiles on one ring slot; tiles at 256 beside d out's 64-column pieces),
    against the reference's jvp, causal, GQA 4:1."""
    q, k, v = random_qkv(43, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    tangents = random_qkv(44, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    shape = {"keys": (2, 1, 1, 2048), "rows": (1, 8, 2048, 1)}.get(kind, (2, 8, 2048, 2048))
    dtype = jnp.bfloat16 if kind == "tiles" else jnp.float32
    bias, d_bias = (_normal(seed, shape).astype(dtype) for seed in (45, 46))

    def with_bias(attention):
        return lambda q, k, v, bias, **config: attention(q, k, v, bias=bias, causal=True, **config)

    _assert_mosaic_jvp_matches_reference(with_bias(flash_attention), with_bias(flash_attention_reference),
                                         (q, k, v, bias), (*tangents, d_bias))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_the_mosaic_tangent_with_moving_alibi_slopes(head_dim):
    """jax.jvp of flex_attention in q, k, v and ALiBi's slopes through FlashConfig(backend="mosaic") compiled: the
    tangent kernel reads the slopes' tangent one element at a time, as the slopes (at head dim 256 in q's programs
    of the split, four 64-column pieces each); against the reference's jvp, causal, GQA 4:1."""
    q, k, v = random_qkv(47, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    tangents = random_qkv(48, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    slopes, d_slopes = alibi_slopes(8), jnp.linspace(-0.5, 0.5, 8)
    block_mask = create_block_mask(causal_mask, None, None, 2048, 2048)

    def with_alibi(attention):
        return lambda q, k, v, s, **config: attention(q, k, v, alibi(s), block_mask, enable_gqa=True, **config)

    _assert_mosaic_jvp_matches_reference(with_alibi(flex_attention), with_alibi(flex_attention_reference),
                                         (q, k, v, slopes), (*tangents, d_slopes))


def test_the_mosaic_tangent_with_a_learnable_soft_cap():
    """jax.jvp of flex_attention in q, k, v and a soft cap's 0-d cap compiled: the cap's tangent read as a scalar,
    its jvp's add_any bound as an add and cap ** -2 as 1 / cap ** 2; against the reference's jvp, causal, GQA 4:1,
    head dim 64."""
    q, k, v = random_qkv(49, 2, 2048, 2048, 8, 2, 64, jnp.bfloat16)
    tangents = random_qkv(50, 2, 2048, 2048, 8, 2, 64, jnp.bfloat16)
    block_mask = create_block_mask(causal_mask, None, None, 2048, 2048)

    def with_cap(attention):
        def attend(q, k, v, cap, **config):
            return attention(q, k, v, lambda s, b, h, q_idx, kv_idx: cap * jnp.tanh(s / cap), block_mask,
                             enable_gqa=True, **config)
        return attend

    _assert_mosaic_jvp_matches_reference(with_cap(flex_attention), with_cap(flex_attention_reference),
                                         (q, k, v, jnp.asarray(20.0)), (*tangents, jnp.asarray(-4.0)))


def test_the_mosaic_tangent_at_head_dim_256_under_a_document_mask():
    """jax.jvp of flex_attention at head dim 256 under packed documents, causal within each (a BlockMask, the
    ids as vectors beside Q and K), compiled: the tangent's programs read the tables refined to their 128 x 64
    tiles; against the reference's jvp, GQA 4:1."""
    q, k, v = random_qkv(38, 2, 2048, 2048, 8, 2, 256, jnp.bfloat16)
    tangents = random_qkv(39, 2, 2048, 2048, 8, 2, 256, jnp.bfloat16)
    ids = jnp.stack([jnp.repeat(jnp.arange(8), 256), jnp.repeat(jnp.arange(2), 1024)])
    block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 2, None, 2048, 2048)
    _assert_mosaic_jvp_matches_reference(
        functools.partial(flex_attention, block_mask=block_mask, enable_gqa=True),
        functools.partial(flex_attention_reference, block_mask=block_mask, enable_gqa=True), (q, k, v), tangents)


@pytest.mark.parametrize("head_dims", [(256, 256), (128, 256)])
def test_score_mods_at_head_dim_256_on_the_mosaic_kernels(head_dims):
    """A soft cap at head dim 256 (q / k's, v's) compiled on backend "mosaic": dK in 64-column pieces (dQ's at
    128 columns where q / k's head dim is 256), and the jvp's d out in 64-column pieces; loss, gradients and jvp
    against the reference, GQA 4:1: causal (a BlockMask) at (256, 256), full at (128, 256) (a BlockMask there
    runs Triton's forward)."""
    head_dim, value_dim = head_dims
    q, k, _ = random_qkv(44, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    v = random_qkv(45, 2, 2048, 2048, 8, 2, value_dim, jnp.bfloat16)[2]
    block_mask = create_block_mask(causal_mask, None, None, 2048, 2048) if head_dim == 256 else None
    kwargs = dict(score_mod=softcap(20.0), block_mask=block_mask, enable_gqa=True)
    _assert_mosaic_matches_reference(q, k, v, 46, attention=flex_attention, reference=flex_attention_reference,
                                     **kwargs)
    dq, dk, _ = random_qkv(47, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    dv = random_qkv(48, 2, 2048, 2048, 8, 2, value_dim, jnp.bfloat16)[2]
    _assert_mosaic_jvp_matches_reference(functools.partial(flex_attention, **kwargs),
                                         functools.partial(flex_attention_reference, **kwargs), (q, k, v),
                                         (dq, dk, dv))
