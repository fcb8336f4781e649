"""Block tables (`kv_tables`, the `BlockMask` layout) in the Mosaic GPU forward: numerics in the Mosaic GPU CPU
interpreter against a float64 numpy reference with the dense mask, tiles the tables skip are never read, argument
checks, and CUDA lowering on CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, numpy_allowed, numpy_attention, random_qkv
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    reset_gpu_interpret_mode_state,
)
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from probjax_kernels import and_masks, causal_mask, create_block_mask
from probjax_kernels.flex.mods import sliding_window
from probjax_kernels.mosaic.forward import mosaic_forward

BLOCK = 128
WINDOW = 300  # with 128-tiles: partial, full and empty tiles in the same query block
PREFIX = 100  # bidirectional over the first PREFIX keys, causal after


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # After an error inside the interpreter its global state must be reset before the next kernel runs.
    yield
    reset_gpu_interpret_mode_state()


def _window_fn(b, h, q_idx, kv_idx):
    del b, h
    return (kv_idx <= q_idx) & (jnp.abs(q_idx - kv_idx) <= WINDOW)


def _prefix_fn(b, h, q_idx, kv_idx):
    del b, h
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def _run_and_compare(tables, mask_fn, dense, *, batch, q_len, kv_len, num_heads, num_kv_heads, q_lengths, kv_lengths,
                     causal=False, poison=None):
    """`dense`: the attended pairs, broadcastable to [B, N, T, S]; `poison`: a [B, S] bool of keys that are NaN
    in the kernel's K and V (the tables must never load them)."""
    q, k, v = random_qkv(1, batch, q_len, kv_len, num_heads, num_kv_heads, 64, jnp.bfloat16)
    k_in, v_in = k, v
    if poison is not None:
        where = jnp.asarray(poison)[:, :, None, None]
        k_in, v_in = (jnp.where(where, jnp.nan, x).astype(x.dtype) for x in (k, v))
    out, lse = mosaic_forward(
        q, k_in, v_in, jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32), scale=0.125,
        causal=causal, kv_tables=tables, mask_fn=mask_fn, interpret=True,
    )
    allowed = numpy_allowed(batch, q_len, kv_len, q_lengths=q_lengths, kv_lengths=kv_lengths, mask=dense)
    expected_out, expected_lse = numpy_attention(q, k, v, allowed=allowed, scale=0.125)
    assert_close(out, expected_out, jnp.bfloat16, "out")
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse[finite], expected_lse[finite], rtol=1e-5, atol=1e-5)
    return out, lse


def _rows_cols(q_len, kv_len):
    return np.arange(q_len)[:, None], np.arange(kv_len)[None, :]


def test_sliding_window_causal_tables():
    seq = 384  # 3 x 3 tiles: query block 1 has a full, a partial (the diagonal) and an empty one
    block_mask = create_block_mask(and_masks(causal_mask, sliding_window(WINDOW)), None, None, seq, seq,
                                   block_size=(BLOCK, BLOCK))
    kinds = np.asarray(block_mask.to_dense())[0, 0]
    assert (kinds == 0).any() and (kinds == 1).any() and (kinds == 2).any()  # empty, partial and full tiles
    rows, cols = _rows_cols(seq, seq)
    dense = (cols <= rows) & (np.abs(rows - cols) <= WINDOW)
    # The diagonal's tiles are partial, so the causal flag (query tiles in reverse) changes nothing else.
    for causal in (False, True):
        _run_and_compare(block_mask.kv_tables, _window_fn, dense, batch=1, q_len=seq, kv_len=seq, num_heads=2,
                         num_kv_heads=1, q_lengths=[370], kv_lengths=[330], causal=causal)


def test_per_batch_and_head_tables_skip_unlisted_tiles():
    # Batch 1 drops key block 1 and head 1 drops key block 0, whole tiles only; the kernel evaluates the same
    # mask_mod (reading b and h) on the partial tiles.
    seq = 512

    def mod(b, h, q_idx, kv_idx):
        kv_block = kv_idx // BLOCK
        return _prefix_fn(b, h, q_idx, kv_idx) & ((b == 0) | (kv_block != 1)) & ((h == 0) | (kv_block != 0))

    block_mask = create_block_mask(mod, 2, 2, seq, seq, block_size=(BLOCK, BLOCK))
    assert block_mask.kv_num_blocks.shape == (2, 2, seq // BLOCK)
    rows, cols = _rows_cols(seq, seq)
    b = np.arange(2)[:, None, None, None]
    h = np.arange(2)[None, :, None, None]
    dense = ((cols < PREFIX) | (rows >= cols)) & ((b == 0) | (cols // BLOCK != 1)) & ((h == 0) | (cols // BLOCK != 0))
    # Batch 1's key block 1 is in no table row of that batch: NaN there must not reach the output. Batch 1's
    # kv_length 300 cuts the full tile of keys [256, 384) of the last query block (length mask on full tiles).
    poison = np.zeros((2, seq), bool)
    poison[1, BLOCK:2 * BLOCK] = True
    _run_and_compare(block_mask.kv_tables, mod, dense, batch=2, q_len=seq, kv_len=seq, num_heads=2,
                     num_kv_heads=1, q_lengths=[512, 450], kv_lengths=[512, 300], poison=poison)


def test_query_block_with_no_listed_blocks():
    # Query block 1 lists nothing (out 0, lse -inf); query block 0 lists key block 0 only, so key block 1 is
    # never loaded and its NaN stays out.
    seq = 256

    def mod(b, h, q_idx, kv_idx):
        del b, h
        return causal_mask(None, None, q_idx, kv_idx) & (q_idx < BLOCK)

    block_mask = create_block_mask(mod, None, None, seq, seq, block_size=(BLOCK, BLOCK))
    assert np.asarray(block_mask.kv_num_blocks + block_mask.full_kv_num_blocks)[0, 0, 1] == 0
    rows, cols = _rows_cols(seq, seq)
    poison = np.zeros((1, seq), bool)
    poison[0, BLOCK:] = True
    out, lse = _run_and_compare(block_mask.kv_tables, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                                (rows >= cols) & (rows < BLOCK), batch=1, q_len=seq, kv_len=seq, num_heads=2,
                                num_kv_heads=2, q_lengths=[seq], kv_lengths=[seq], poison=poison)
    assert not np.asarray(out[:, BLOCK:], np.float32).any()
    assert np.isneginf(lse[:, :, BLOCK:]).all()


def test_mask_fn_without_tables_masks_every_tile():
    # No tables: every visited tile is masked with mask_fn, here a per-(batch, head) window, GQA and causal. With
    # 3 x 3 tiles, mask_fn masks all of query block 2's first tile for (b, h) = (0, 0) and part of it elsewhere.
    seq = 384

    def mask_fn(b, h, q_idx, kv_idx):
        return jnp.abs(q_idx - kv_idx) < 100 + 50 * h + 20 * b

    rows, cols = _rows_cols(seq, seq)
    b = np.arange(2)[:, None, None, None]
    h = np.arange(2)[None, :, None, None]
    dense = (np.abs(rows - cols) < 100 + 50 * h + 20 * b) & (cols <= rows)
    _run_and_compare(None, mask_fn, dense, batch=2, q_len=seq, kv_len=seq, num_heads=2, num_kv_heads=1,
                     q_lengths=[384, 300], kv_lengths=[384, 250], causal=True)


@pytest.mark.parametrize(
    "table_block, kernel_tiles, mask_fn, match",
    [
        ((128, 64), {}, _window_fn, "kv_tables partial_indices"),  # table block_kv != the kernel's
        ((64, 128), {}, _window_fn, "kv_tables num_partial"),  # table block_q != the kernel's
        ((128, 128), {"block_kv": 64}, _window_fn, "kv_tables partial_indices"),
    ],
)
def test_rejects_mismatched_tables(table_block, kernel_tiles, mask_fn, match):
    seq = 256
    tables = None
    if table_block is not None:
        tables = create_block_mask(and_masks(causal_mask, sliding_window(WINDOW)), None, None, seq, seq,
                                   block_size=table_block).kv_tables
    q = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = functools.partial(mosaic_forward, scale=1.0, causal=False, kv_tables=tables, mask_fn=mask_fn,
                           **kernel_tiles)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(fn, q, q, q, lengths, lengths)


@pytest.mark.parametrize("causal, table_batch, table_heads", [(True, 2, 1), (False, 1, 8)])
def test_lowers_for_cuda_with_tables(causal, table_batch, table_heads):
    batch, seq, num_heads, num_kv_heads, head_dim = 2, 1024, 8, 2, 128
    nq = nk = seq // BLOCK
    fn = functools.partial(mosaic_forward, scale=head_dim**-0.5, causal=causal, block_q=BLOCK, block_kv=BLOCK,
                           mask_fn=_window_fn)
    counts = jax.ShapeDtypeStruct((table_batch, table_heads, nq), jnp.int32)
    indices = jax.ShapeDtypeStruct((table_batch, table_heads, nq, nk), jnp.int32)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", 132, "gpu"))
    with use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(
            jax.ShapeDtypeStruct((batch, seq, num_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, seq, num_kv_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            kv_tables=(counts, indices, counts, indices),
        ).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
