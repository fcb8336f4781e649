"""The Mosaic GPU (Hopper) tangent kernel with a bias's tangent: the bias read as tiles of its dtype or as float32
key / row vectors, its tangent read the same way and added to the tangent of the scaled scores (before a
score_mod's derivative), in the Mosaic GPU CPU interpreter against `jax.jvp` of the float32 plain-jnp reference;
through `flash_attention` on backend "mosaic_interpret" with the bias moving or holding still, and its tiles
beside head dim 128 (the tangents in programs of their own) or of float32 (one ring slot)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close, normal, random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
from test_mosaic_tangent import MOSAIC, _float32, assert_lse_tangent_close, reference_jvp

from probjax_kernels import flash_attention, flash_attention_reference
from probjax_kernels._scores import base2_lse
from probjax_kernels.mosaic.plan import WIDE_STAGES
from probjax_kernels.mosaic.tangent import mosaic_tangent, tangent_smem_bytes

BIAS_SHAPES = {"tiles": lambda b, n, t, s: (b, n, t, s), "keys": lambda b, n, t, s: (b, 1, 1, s),
               "rows": lambda b, n, t, s: (1, n, t, 1)}


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize("head_dim, kind, moving, options", [
    (64, "tiles", "qkv", {}),
    (64, "keys", "", {}),  # the bias's tangent alone
    (128, "rows", "k", {}),
    (256, "keys", "qv", dict(num_stages=WIDE_STAGES, pieces=2, split=True)),
])
def test_the_kernel_matches_the_reference_with_a_moving_bias(head_dim, kind, moving, options):
    """(d out, d lse) for the tangents of the inputs in `moving` and of the bias, causal on ragged lengths (a
    sequence whose last rows and keys are padding); at head dim 256 the bias's tangent runs in programs of its
    own (`split`)."""
    batch, seq, num_heads, dtype = 2, 256, 2, jnp.bfloat16
    q, k, v = random_qkv(20, batch, seq, seq, num_heads, 1, head_dim, dtype)
    dq, dk, dv = random_qkv(21, batch, seq, seq, num_heads, 1, head_dim, dtype)
    shape = BIAS_SHAPES[kind](batch, num_heads, seq, seq)
    bias_dtype = jnp.bfloat16 if kind == "tiles" else jnp.float32
    bias, d_bias = (normal(seed, shape).astype(bias_dtype) for seed in (22, 23))
    q_lengths, kv_lengths = jnp.array([256, 200], jnp.int32), jnp.array([130, 256], jnp.int32)
    scale = head_dim**-0.5
    tangents = {name: t for name, t in (("dq", dq), ("dk", dk), ("dv", dv)) if name[1] in moving}

    def reference(q, k, v, bias):
        return flash_attention_reference(q, k, v, bias=bias, causal=True, scale=scale, q_lengths=q_lengths,
                                         kv_lengths=kv_lengths, return_lse=True)

    zero_or = [tangents.get(name, jnp.zeros_like(x)) for name, x in (("dq", q), ("dk", k), ("dv", v))]
    (out, lse), (d_out, d_lse) = reference_jvp(reference, _float32(q, k, v, bias), _float32(*zero_or, d_bias))
    got_out, got_lse = jax.jit(functools.partial(mosaic_tangent, scale=scale, causal=True, interpret=True,
                                                 **options))(
        q, k, v, out.astype(dtype), base2_lse(lse), q_lengths, kv_lengths, bias=bias, d_bias=d_bias, **tangents)
    assert got_out.shape == out.shape and got_out.dtype == dtype
    assert_close(got_out, d_out, dtype, "d out")
    assert_lse_tangent_close(got_lse, d_lse, lse)


@pytest.mark.parametrize("head_dim, kind, bias_moves", [(64, "tiles", True), (128, "keys", True),
                                                         (256, "rows", True), (64, "tiles", False)])
def test_flash_attention_jvp_with_a_bias_runs_the_mosaic_tangent(head_dim, kind, bias_moves, tangent_calls):
    """jax.jvp of flash_attention with a bias on backend "mosaic_interpret" runs the Mosaic tangent kernel (at
    head dim 256: the tangents of q, k, v and the bias in programs of their own) and matches the reference's,
    with the bias moving (bfloat16 tiles, float32 key or row vectors) or holding still; GQA 2:1, ragged keys."""
    batch, seq, num_heads = 2, 192, 4
    q, k, v = random_qkv(24, batch, seq, seq, num_heads, 2, head_dim, jnp.bfloat16)
    tangents = random_qkv(25, batch, seq, seq, num_heads, 2, head_dim, jnp.bfloat16)
    shape = BIAS_SHAPES[kind](batch, num_heads, seq, seq)
    bias_dtype = jnp.bfloat16 if kind == "tiles" else jnp.float32
    bias, d_bias = (normal(seed, shape).astype(bias_dtype) for seed in (26, 27))
    options = dict(causal=True, kv_lengths=jnp.array([192, 150]))
    if bias_moves:
        def fn(attention, **config):
            return lambda q, k, v, bias: attention(q, k, v, bias=bias, **options, **config)
        args, moving = (q, k, v, bias), (*tangents, d_bias)
    else:
        def fn(attention, **config):
            return lambda q, k, v: attention(q, k, v, bias=bias, **options, **config)
        args, moving = (q, k, v), tangents
    got = jax.jit(lambda p, t: jax.jvp(fn(flash_attention, config=MOSAIC), p, t))(args, moving)
    want = reference_jvp(fn(flash_attention_reference), _float32(*args), _float32(*moving))
    assert tangent_calls
    assert_close(got[0], want[0], jnp.bfloat16, "out")
    assert_close(got[1], want[1], jnp.bfloat16, "d out")


@pytest.mark.parametrize("head_dim, bias_dtype, expected", [
    (128, jnp.bfloat16, dict(num_stages=2, pieces=1, split=True)),  # one program spilled: q, k, v, bias apart
    (128, jnp.float32, dict(num_stages=WIDE_STAGES, pieces=1, split=True)),  # and the bias's on one slot
    (64, jnp.float32, dict(num_stages=WIDE_STAGES, split=None)),  # one program on one slot
    (256, jnp.bfloat16, dict(num_stages=WIDE_STAGES, pieces=4, split=True)),  # q's program fits with 64 columns
])
def test_bias_tiles_beside_wide_tiles_run_the_mosaic_tangent(head_dim, bias_dtype, expected, tangent_calls):
    """Bias tiles where one program on two ring slots does not fit: at head dim 128 (a 64 x 128 accumulator) the
    tangents of q, k, v and the bias run in programs of their own, float32 tiles on one slot; float32 tiles at 64
    in one program on one slot; at 256 those programs with d out in 64-column pieces (q's overflows shared memory
    with 128). The jvp in q, k, v and the bias matches the reference's; GQA 2:1, ragged keys."""
    options = tangent_calls
    q, k, v = random_qkv(28, 2, 192, 192, 4, 2, head_dim, jnp.bfloat16)
    tangents = random_qkv(29, 2, 192, 192, 4, 2, head_dim, jnp.bfloat16)
    bias, d_bias = (normal(seed, (2, 4, 192, 192)).astype(bias_dtype) for seed in (30, 31))

    def fn(attention, **config):
        return lambda q, k, v, bias: attention(q, k, v, bias=bias, causal=True, kv_lengths=jnp.array([192, 150]),
                                               **config)

    got = jax.jit(lambda p, t: jax.jvp(fn(flash_attention, config=MOSAIC), p, t))((q, k, v, bias), (*tangents, d_bias))
    want = reference_jvp(fn(flash_attention_reference), _float32(q, k, v, bias), _float32(*tangents, d_bias))
    assert options and all({name: call.get(name, 2 if name == "num_stages" else None) for name in expected}
                           == expected for call in options)
    assert_close(got[0], want[0], jnp.bfloat16, "out")
    assert_close(got[1], want[1], jnp.bfloat16, "d out")


def test_the_bias_tangent_shared_memory_and_checks():
    """The bias tangent's buffers are the bias's again (a ring of tiles per part, a ring of key vectors, or the
    rows); d_bias must match the bias, and needs one."""
    tiles = tangent_smem_bytes(64, 128, 64, 2, bias="tiles", bias_itemsize=2)
    assert tangent_smem_bytes(64, 128, 64, 2, bias="tiles", bias_itemsize=2, d_bias=True) == tiles + 2 * 128 * 64 * 2
    keys = tangent_smem_bytes(64, 128, 64, 2, bias="keys")
    assert tangent_smem_bytes(64, 128, 64, 2, bias="keys", d_bias=True) == keys + 1024  # 2 x 64 floats, aligned
    q, k, v = random_qkv(0, 1, 128, 128, 2, 2, 64, jnp.bfloat16)
    lengths = jnp.full((1,), 128, jnp.int32)
    out, lse2 = jnp.zeros_like(q), jnp.zeros((1, 2, 128), jnp.float32)
    bias = jnp.zeros((1, 2, 128, 128), jnp.bfloat16)
    call = functools.partial(mosaic_tangent, q, k, v, out, lse2, lengths, lengths, scale=0.125, causal=True,
                             interpret=True)
    with pytest.raises(ValueError, match="needs a tangent of q, k, v, the bias or the score_fn"):
        call(bias=bias)
    with pytest.raises(ValueError, match="d_bias must have the shape and dtype of bias"):
        call(bias=bias, d_bias=bias.astype(jnp.float32))
    with pytest.raises(ValueError, match="d_bias must have the shape and dtype of bias"):
        call(d_bias=bias)
