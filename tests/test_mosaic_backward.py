"""The Mosaic GPU (Hopper) dQ and dK / dV kernels: numerics in the Mosaic GPU CPU interpreter against `jax.vjp` of the
float32 plain-jnp reference, and CUDA lowering on CPU. As for the forward, the interpreter stages dS (dQ) and P^T / dS^T (dK / dV)
through shared memory and accumulates out of place; the compiled register-fed, in-place dS K matmul is only lowered.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, bernoulli, normal, random_qkv, to_float32
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    reset_gpu_interpret_mode_state,
)
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from probjax_kernels import create_block_mask, flash_attention_reference, flex_attention_reference
from probjax_kernels.mosaic.backward import dq_smem_bytes, mosaic_backward_dq
from probjax_kernels.mosaic.backward_dkv import dkv_smem_bytes, mosaic_backward_dkv


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    reset_gpu_interpret_mode_state()


def reference_vjp(reference, primals, d_out):
    """`reference(*primals)` (out, lse) and its vjp at (d_out, 0), under one jit: eagerly, every op of the
    reference and of its vjp is an XLA compile of its own."""

    @jax.jit
    def run(primals, d_out):
        (out, lse), vjp = jax.vjp(reference, *primals)
        return (out, lse), vjp((d_out, jnp.zeros_like(lse)))

    return run(tuple(primals), d_out)


@pytest.mark.parametrize(
    "causal, q_lengths, kv_lengths, num_kv_heads, window",
    [
        # One sequence where both lengths are full (the interpreter's time grows with the grid); two where they
        # differ per sequence.
        (False, [256], [256], 1, (None, None)), (True, [200, 256], [77, 256], 2, (None, None)),
        (False, [256, 100], [0, 130], 2, (None, None)),
        (False, [256, 200], [256, 100], 2, (70, 30)),  # two-sided window: tiles skipped on both edges
        (True, [256], [256], 1, (100, None)),  # causal sliding window
    ],
)
def test_dq_matches_reference_in_interpreter(causal, q_lengths, kv_lengths, num_kv_heads, window):
    batch, seq, num_heads, head_dim, dtype = len(q_lengths), 256, 2, 64, jnp.bfloat16
    q, k, v = random_qkv(0, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    d_out = random_qkv(1, batch, seq, seq, num_heads, num_heads, head_dim, dtype)[0]
    q_lengths, kv_lengths = jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)
    scale = head_dim**-0.5

    def reference(q):
        return flash_attention_reference(
            q, k.astype(jnp.float32), v.astype(jnp.float32), causal=causal, window=window, scale=scale,
            q_lengths=q_lengths, kv_lengths=kv_lengths, return_lse=True,
        )

    (out, lse), (expected,) = reference_vjp(reference, (q.astype(jnp.float32),), d_out.astype(jnp.float32))
    dq = jax.jit(functools.partial(mosaic_backward_dq, scale=scale, causal=causal, window=window, interpret=True))(
        q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths)
    assert dq.shape == q.shape and dq.dtype == q.dtype
    assert_close(dq, expected, dtype, "dq")


@pytest.mark.parametrize("head_dim, causal, window", [
    (64, True, (None, None)), (128, False, (None, None)), (128, True, (None, None)), (128, False, (256, 64)),
])
def test_dq_lowers_for_cuda(head_dim, causal, window):
    batch, seq, num_heads, num_kv_heads = 2, 1024, 8, 2
    q = jax.ShapeDtypeStruct((batch, seq, num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, num_heads, seq), jnp.float32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = functools.partial(mosaic_backward_dq, scale=head_dim**-0.5, causal=causal, window=window, block_q=128,
                           block_kv=64)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(q, kv, kv, q, lse, q, lengths, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    "causal, q_seq, kv_seq, q_lengths, kv_lengths, num_kv_heads, block_q, window",
    [
        (False, 256, 256, [256], [256], 1, 64, (None, None)),  # MQA, group of 2 summed in the kernel
        (True, 256, 256, [200, 256], [77, 256], 2, 64, (None, None)),  # ragged, GQA
        (False, 256, 256, [256, 100], [0, 130], 2, 64, (None, None)),  # batch 0 fully masked: zero grads
        (True, 128, 384, [128, 90], [384, 300], 1, 128, (None, None)),  # T < S: the last KV tile sees no row
        (False, 256, 384, [256, 200], [384, 100], 2, 64, (70, 30)),  # two-sided window, ragged
        (True, 384, 256, [384], [256], 1, 64, (100, None)),  # causal sliding window, T > S
    ],
)
def test_dkv_matches_reference_in_interpreter(causal, q_seq, kv_seq, q_lengths, kv_lengths, num_kv_heads, block_q,
                                               window):
    # Two query heads (one or two KV heads), and one sequence where both lengths are full: the Mosaic
    # interpreter's time grows with the grid.
    batch, num_heads, head_dim, dtype = len(q_lengths), 2, 64, jnp.bfloat16
    q, k, v = random_qkv(2, batch, q_seq, kv_seq, num_heads, num_kv_heads, head_dim, dtype)
    d_out = random_qkv(3, batch, q_seq, q_seq, num_heads, num_heads, head_dim, dtype)[0]
    q_lengths, kv_lengths = jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)
    scale = head_dim**-0.5

    def reference(k, v):
        return flash_attention_reference(
            q.astype(jnp.float32), k, v, causal=causal, window=window, scale=scale, q_lengths=q_lengths,
            kv_lengths=kv_lengths, return_lse=True,
        )

    (out, lse), (expected_dk, expected_dv) = reference_vjp(
        reference, (k.astype(jnp.float32), v.astype(jnp.float32)), d_out.astype(jnp.float32))
    dk, dv = jax.jit(functools.partial(mosaic_backward_dkv, scale=scale, causal=causal, window=window,
                                       block_q=block_q, interpret=True))(
        q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths)
    assert dk.shape == k.shape and dk.dtype == k.dtype and dv.shape == v.shape and dv.dtype == v.dtype
    # Observed errors sit at the bf16 rounding of the result (about 3e-3); a quarter of the bf16 tolerance.
    assert_close(dk, expected_dk, dtype, "dk", factor=0.25)
    assert_close(dv, expected_dv, dtype, "dv", factor=0.25)
    for b in range(batch):  # keys past kv_lengths (all of them where kv_lengths is 0) get exactly zero
        assert not np.any(np.asarray(dk)[b, int(kv_lengths[b]):]) and not np.any(np.asarray(dv)[b, int(kv_lengths[b]):])


@pytest.mark.parametrize(
    "head_dim, causal, block_q, p_in_smem, window",
    [(64, True, 64, False, (None, None)), (128, False, 64, False, (None, None)), (128, True, 64, False, (None, None)),
     (128, True, 128, False, (None, None)), (128, False, 64, True, (None, None)), (128, True, 64, False, (512, None))],
)
def test_dkv_lowers_for_cuda(head_dim, causal, block_q, p_in_smem, window):
    batch, seq, num_heads, num_kv_heads = 2, 1024, 8, 2
    q = jax.ShapeDtypeStruct((batch, seq, num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, num_heads, seq), jnp.float32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = functools.partial(
        mosaic_backward_dkv, scale=head_dim**-0.5, causal=causal, window=window, block_q=block_q, block_kv=128,
        p_in_smem=p_in_smem,
    )
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(q, kv, kv, q, lse, q, lengths, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_dkv_rejects_what_it_cannot_run():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    lengths = jnp.full((1,), 128, jnp.int32)
    args = (q, kv, kv, q, lse, q, lengths, lengths)
    with pytest.raises(ValueError, match="multiple of 128"):
        mosaic_backward_dkv(*args, scale=0.125, causal=False, block_kv=64)
    with pytest.raises(NotImplementedError, match="float32"):
        mosaic_backward_dkv(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args), scale=0.125,
                            causal=False)
    big = jnp.zeros((1, 128, 1, 256), jnp.bfloat16)
    big_args = (big, big, big, big, jnp.zeros((1, 1, 128)), big, lengths, lengths)
    with pytest.raises(ValueError, match="needs split=True"):  # two 64 x 256 float32 accumulators
        mosaic_backward_dkv(*big_args, scale=0.1, causal=False, num_stages=1)
    with pytest.raises(ValueError, match="SMEM"):  # K, V and two Q / dO slots of 256 columns
        mosaic_backward_dkv(*big_args, scale=0.1, causal=False, split=True, pieces=2)
    narrow = jnp.zeros((1, 128, 1, 32), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="head_dim"):  # the glue widens it (`glue.kernel_head_dims`)
        mosaic_backward_dkv(narrow, narrow, narrow, narrow, jnp.zeros((1, 1, 128)), narrow, lengths, lengths,
                            scale=0.1, causal=False)
    with pytest.raises(ValueError, match="tables_block_q"):  # a table tile must be whole steps
        mosaic_backward_dkv(*args, scale=0.125, causal=False, tables_block_q=96)
    assert dkv_smem_bytes(128, 64, 128, 2) <= 227 * 1024 < dkv_smem_bytes(128, 64, 128, 6)
    # segment ids: the resident keys' and a ring slot of the queries' per stage, int32 (1 KiB-aligned buffers)
    assert dkv_smem_bytes(128, 64, 128, 2, segments=True) == dkv_smem_bytes(128, 64, 128, 2) + 2 * 1024
    # Mosaic GPU's own counts of these kernels (lowered for sm_90a with its limit set below them)
    assert dkv_smem_bytes(128, 64, 128, 2) == 135_264
    assert dkv_smem_bytes(128, 64, 128, 2, segments=True, dense_mask=True) == 153_696
    assert dq_smem_bytes(128, 128, 64, 2, dense_mask=True) == 149_632
    assert dq_smem_bytes(128, 128, 128, 2, segments=True) == 200_848
    # a row / key bias's gradient sums dS in the kernel: Mosaic GPU reserves its 2 KiB of reduction scratch
    assert dq_smem_bytes(128, 128, 64, 2, bias="rows", bias_grad=True) == 137_360
    assert dkv_smem_bytes(128, 64, 128, 2, bias="keys", bias_grad=True) == 139_360


def _hooked_score(score, b, h, q_idx, kv_idx):
    # soft-capping and a per-head distance penalty: a nonlinear score_mod that reads h
    return 2.0 * jnp.tanh(score / 2.0) - 0.01 * jnp.abs(q_idx - kv_idx).astype(jnp.float32) * (h + 1).astype(jnp.float32)


def _hooked_score_jvp(score, b, h, q_idx, kv_idx):
    return jax.jvp(lambda s: _hooked_score(s, b, h, q_idx, kv_idx), (score,), (jnp.ones_like(score),))


def _head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 156 + 100 * h)


def test_block_tables_and_hooks_match_the_reference_in_interpreter():
    """dQ over kv_tables and dK/dV over q_tables with a score_mod (and its derivative) and a per-head mask_mod,
    GQA: against jax.vjp of flex_attention_reference. dK/dV as the dispatch runs it: 64-query steps, each
    128-query table tile in two."""
    batch, seq, num_heads, num_kv_heads, head_dim, dtype = 1, 256, 2, 1, 64, jnp.bfloat16  # the tables: per head
    q, k, v = random_qkv(4, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    d_out = random_qkv(5, batch, seq, seq, num_heads, num_heads, head_dim, dtype)[0]
    block_mask = create_block_mask(_head_window, None, num_heads, seq, seq, block_size=(128, 128))
    # 2 x 2 tiles: an empty one above the diagonal, partial ones, and below it a partial one for head 0 (a window
    # of 156 keys) and a full one for head 1 (256 keys).
    kinds = np.asarray(block_mask.to_dense())
    assert (kinds[:, :, 0, 1] == 0).all() and (kinds[:, 0, 1, 0] == 1).all() and (kinds[:, 1, 1, 0] == 2).all()
    lengths = jnp.full((batch,), seq, jnp.int32)

    def reference(q, k, v):
        return flex_attention_reference(q, k, v, _hooked_score, block_mask, scale=0.125, enable_gqa=True,
                                         return_lse=True)

    (out, lse), expected = reference_vjp(reference, tuple(x.astype(jnp.float32) for x in (q, k, v)),
                                         d_out.astype(jnp.float32))
    options = dict(scale=0.125, causal=False, block_q=128, block_kv=128, interpret=True, mask_fn=_head_window,
                   score_fn=_hooked_score, score_jvp=_hooked_score_jvp)
    args = (q, k, v, out.astype(dtype), lse, d_out, lengths, lengths)
    dq = jax.jit(lambda *args: mosaic_backward_dq(*args, kv_tables=block_mask.kv_tables, **options))(*args)
    dk, dv = jax.jit(lambda *args: mosaic_backward_dkv(*args, q_tables=block_mask.q_tables,
                                                       **{**options, "block_q": 64}, tables_block_q=128))(*args)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert_close(got, want, dtype, name)


@pytest.mark.parametrize("kernel, tables", [(mosaic_backward_dq, "kv_tables"), (mosaic_backward_dkv, "q_tables")])
def test_block_tables_and_hooks_lower_for_cuda(kernel, tables):
    batch, seq, num_heads, num_kv_heads, head_dim = 2, 1024, 8, 2, 128
    block_mask = create_block_mask(_head_window, None, num_heads, seq, seq)
    q = jax.ShapeDtypeStruct((batch, seq, num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, num_heads, seq), jnp.float32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = functools.partial(kernel, scale=head_dim**-0.5, causal=False, block_q=128, block_kv=128,
                           mask_fn=_head_window, score_fn=_hooked_score, score_jvp=_hooked_score_jvp,
                           **{tables: getattr(block_mask, tables)})
    if kernel is mosaic_backward_dkv:  # the dispatch's dK/dV tiles with tables: 64-query steps
        fn = functools.partial(fn, block_q=64, tables_block_q=128)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(q, kv, kv, q, lse, q, lengths, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_score_fn_needs_its_jvp():
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = functools.partial(mosaic_backward_dq, scale=0.125, causal=False, score_fn=_hooked_score)
    with pytest.raises(ValueError, match="score_jvp"):
        jax.eval_shape(fn, q, q, q, q, lse, q, lengths, lengths)


@pytest.mark.parametrize("causal, window, q_seq, kv_seq", [(True, (None, None), 384, 256), (False, (90, 40), 256, 384)])
def test_segment_ids_match_the_reference_in_interpreter(causal, window, q_seq, kv_seq):
    """dQ and dK/dV of packed documents (segment ids read beside the tiles), ragged lengths, documents ending
    inside tiles, with a causal mask or a two-sided window; keys past kv_lengths get zero gradient. One head:
    the ids are per sequence, not per head (GQA beside them, where dK/dV walks each query head's steps:
    test_mosaic_dispatch.py's segment ids test)."""
    batch, num_heads, num_kv_heads, head_dim, dtype = 2, 1, 1, 64, jnp.bfloat16
    q, k, v = random_qkv(6, batch, q_seq, kv_seq, num_heads, num_kv_heads, head_dim, dtype)
    d_out = random_qkv(7, batch, q_seq, q_seq, num_heads, num_heads, head_dim, dtype)[0]
    rng = np.random.default_rng(8)
    q_segments, kv_segments = (jnp.asarray(np.sort(rng.integers(0, 4, (batch, n)), axis=1), jnp.int32)
                               for n in (q_seq, kv_seq))
    q_lengths, kv_lengths = jnp.asarray([q_seq, q_seq - 60], jnp.int32), jnp.asarray([kv_seq - 77, kv_seq], jnp.int32)
    segments = dict(q_segment_ids=q_segments, kv_segment_ids=kv_segments)
    scale = head_dim**-0.5

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, causal=causal, window=window, scale=scale, q_lengths=q_lengths,
                                         kv_lengths=kv_lengths, return_lse=True, **segments)

    (out, lse), expected = reference_vjp(reference, tuple(x.astype(jnp.float32) for x in (q, k, v)),
                                         d_out.astype(jnp.float32))
    options = dict(scale=scale, causal=causal, window=window, interpret=True, **segments)
    args = (q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths)
    dq = jax.jit(functools.partial(mosaic_backward_dq, **options))(*args)
    dk, dv = jax.jit(functools.partial(mosaic_backward_dkv, **options))(*args)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert_close(got, want, dtype, name)
    assert not np.any(np.asarray(dk)[0, kv_seq - 77:]) and not np.any(np.asarray(dv)[0, kv_seq - 77:])


@pytest.mark.parametrize("kernel", [mosaic_backward_dq, mosaic_backward_dkv])
def test_segment_ids_lower_for_cuda(kernel):
    batch, seq, num_heads, num_kv_heads, head_dim = 2, 1024, 8, 2, 128
    q = jax.ShapeDtypeStruct((batch, seq, num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, num_heads, seq), jnp.float32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    segments = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def fn(q, k, v, out, lse, d_out, q_lengths, kv_lengths, q_segments, kv_segments):
        return kernel(q, k, v, out, lse, d_out, q_lengths, kv_lengths, scale=head_dim**-0.5, causal=True,
                      q_segment_ids=q_segments, kv_segment_ids=kv_segments)

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(q, kv, kv, q, lse, q, lengths, lengths, segments, segments).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("head_dim, value_dim, window", [(64, 128, (None, None)), (128, 64, (50, 20))])
def test_a_value_head_dim_of_its_own_matches_the_reference_in_interpreter(head_dim, value_dim, window):
    """dQ and dK/dV with v [B, S, K, Dv], Dv != D (dO and V in Dv columns, dK in D and dV in Dv), GQA, ragged.
    One sequence: the interpreter's time grows with the grid, and per-sequence lengths are the tests' above."""
    batch, seq, num_heads, num_kv_heads, dtype = 1, 256, 2, 1, jnp.bfloat16
    q, k, _ = random_qkv(9, batch, seq, seq, num_heads, num_kv_heads, head_dim, dtype)
    v = random_qkv(10, batch, seq, seq, num_heads, num_kv_heads, value_dim, dtype)[2]
    d_out = random_qkv(11, batch, seq, seq, num_heads, num_heads, value_dim, dtype)[0]
    q_lengths, kv_lengths = jnp.asarray([190], jnp.int32), jnp.asarray([210], jnp.int32)
    scale = head_dim**-0.5

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, causal=True, window=window, scale=scale, q_lengths=q_lengths,
                                         kv_lengths=kv_lengths, return_lse=True)

    (out, lse), expected = reference_vjp(reference, tuple(x.astype(jnp.float32) for x in (q, k, v)),
                                         d_out.astype(jnp.float32))
    options = dict(scale=scale, causal=True, window=window, interpret=True)
    args = (q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths)
    dq = jax.jit(functools.partial(mosaic_backward_dq, **options))(*args)
    dk, dv = jax.jit(functools.partial(mosaic_backward_dkv, **options))(*args)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert got.shape == want.shape
        assert_close(got, want, dtype, name)


def test_a_value_head_dim_of_its_own_lowers_for_cuda():
    batch, seq, num_heads, num_kv_heads = 2, 1024, 8, 2
    q = jax.ShapeDtypeStruct((batch, seq, num_heads, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, 128), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((batch, seq, num_kv_heads, 64), jnp.bfloat16)
    out = jax.ShapeDtypeStruct((batch, seq, num_heads, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, num_heads, seq), jnp.float32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    for kernel in (mosaic_backward_dq, mosaic_backward_dkv):
        fn = functools.partial(kernel, scale=0.1, causal=True)
        with use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(q, k, v, out, lse, out, lengths, lengths).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_rejects_outputs_of_the_wrong_value_head_dim():
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    for kernel in (mosaic_backward_dq, mosaic_backward_dkv):
        with pytest.raises(ValueError, match=r"out / d_out must be \[B, T, N, Dv\] = \[1, 256, 2, 128\]"):
            jax.eval_shape(functools.partial(kernel, scale=0.1, causal=False), q, q, v, q, lse, q, lengths, lengths)
    wide = jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.bfloat16)  # dK + dV accumulators of 64 + 256 columns
    with pytest.raises(ValueError, match="needs split=True"):
        jax.eval_shape(functools.partial(mosaic_backward_dkv, scale=0.1, causal=False), q, q, wide, wide, lse, wide,
                       lengths, lengths)


@pytest.mark.parametrize("mask_shape, dq_tiles, dkv_tiles", [
    ((2, 2, 256, 384), {}, {}),  # one part a step
    ((1, 1, 256, 384), {"block_kv": 128}, {"block_q": 128}),  # two parts a step: a ring of mask tiles each
])
def test_a_dense_mask_matches_the_reference_in_interpreter(mask_shape, dq_tiles, dkv_tiles):
    """dQ (mask tiles beside K) and dK/dV (the transposed mask's tiles beside Q), GQA, lengths, causal, T < S."""
    batch, q_seq, kv_seq, num_heads, num_kv_heads, head_dim, dtype = 2, 256, 384, 2, 1, 64, jnp.bfloat16
    q, k, v = random_qkv(12, batch, q_seq, kv_seq, num_heads, num_kv_heads, head_dim, dtype)
    d_out = random_qkv(13, batch, q_seq, q_seq, num_heads, num_heads, head_dim, dtype)[0]
    mask = bernoulli(14, 0.6, mask_shape)
    q_lengths, kv_lengths = jnp.asarray([256, 200], jnp.int32), jnp.asarray([384, 290], jnp.int32)

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, causal=True, scale=0.125, q_lengths=q_lengths,
                                         kv_lengths=kv_lengths, mask=mask, return_lse=True)

    (out, lse), expected = reference_vjp(reference, tuple(x.astype(jnp.float32) for x in (q, k, v)),
                                         d_out.astype(jnp.float32))
    options = dict(scale=0.125, causal=True, interpret=True, mask=mask)
    args = (q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths)
    dq = jax.jit(functools.partial(mosaic_backward_dq, **options, **dq_tiles))(*args)
    dk, dv = jax.jit(functools.partial(mosaic_backward_dkv, **options, **dkv_tiles))(*args)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert_close(got, want, dtype, name)


@pytest.mark.parametrize("bias_shape, bias_dtype", [
    ((2, 2, 256, 256), jnp.bfloat16),  # tiles: dQ writes dS, dK/dV reads the bias transposed
    ((1, 1, 256, 256), jnp.float32),  # broadcast float32 tiles
    ((2, 2, 1, 256), jnp.float32),  # a per-head key bias: dK/dV sums dS over each head's queries
    ((1, 2, 256, 1), jnp.bfloat16),  # per row: dQ sums dS over keys
])
def test_a_bias_and_its_gradient_match_the_reference_in_interpreter(bias_shape, bias_dtype):
    """dQ, dK, dV and d bias (the kernels' dS, key sums or row sums, reduced over the bias's broadcast axes as
    the glue does) with GQA, causality and ragged lengths; dS is compared where the window and lengths let a
    pair attend (the tiles elsewhere are never visited, and the glue masks them)."""
    batch, seq, num_heads, head_dim, dtype = 2, 256, 2, 64, jnp.bfloat16
    q, k, v = random_qkv(40, batch, seq, seq, num_heads, 1, head_dim, dtype)
    d_out = random_qkv(41, batch, seq, seq, num_heads, num_heads, head_dim, dtype)[0]
    bias = (2 * normal(42, bias_shape)).astype(bias_dtype)
    q_lengths, kv_lengths = jnp.array([256, 190], jnp.int32), jnp.array([256, 170], jnp.int32)
    scale = head_dim**-0.5

    def reference(q, k, v, bias):
        return flash_attention_reference(
            q, k, v, bias=bias.astype(jnp.float32), causal=True, scale=scale, q_lengths=q_lengths,
            kv_lengths=kv_lengths, return_lse=True)

    primals = (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), bias.astype(jnp.float32))
    (out, lse), (dq_ref, dk_ref, dv_ref, dbias_ref) = reference_vjp(reference, primals, d_out.astype(jnp.float32))
    args = (q, k, v, out.astype(dtype), lse, d_out, q_lengths, kv_lengths)
    options = dict(scale=scale, causal=True, interpret=True, bias_grad=True)
    dq_out = jax.jit(functools.partial(mosaic_backward_dq, **options))(*args, bias=bias)
    dkv_out = jax.jit(functools.partial(mosaic_backward_dkv, **options))(*args, bias=bias)
    for name, got, expected in (("dq", dq_out[0] if bias_shape[2] > 1 else dq_out, dq_ref),
                                ("dk", dkv_out[0], dk_ref), ("dv", dkv_out[1], dv_ref)):
        assert_close(got, expected, dtype, name)
    broadcast = tuple(axis for axis in range(2) if bias_shape[axis] == 1)
    if bias_shape[2] > 1 and bias_shape[3] > 1:
        ds = np.asarray(dq_out[1])
        rows, cols = np.arange(seq)[:, None], np.arange(seq)[None, :]
        attends = ((cols <= rows) & (rows < np.asarray(q_lengths)[:, None, None, None])
                   & (cols < np.asarray(kv_lengths)[:, None, None, None]))
        dbias = np.where(attends, ds, 0.0).sum(axis=broadcast, keepdims=True)
    elif bias_shape[2] == 1:
        assert len(dkv_out) == 3 and dkv_out[2].shape == (batch, num_heads, seq)
        dbias = np.asarray(dkv_out[2]).sum(axis=broadcast, keepdims=True)[:, :, None, :]
    else:
        assert dq_out[1].shape == (batch, num_heads, seq)
        dbias = np.asarray(dq_out[1]).sum(axis=broadcast, keepdims=True)[..., None]
    if bias_shape[3] == 1:  # a per-row bias's gradient is 0 up to rounding (rowsum(P dP) - delta)
        assert np.abs(dbias - to_float32(dbias_ref)).max() <= 0.1 * np.sqrt(batch // bias_shape[0])
    else:
        assert_close(dbias, dbias_ref, dtype, "dbias")
