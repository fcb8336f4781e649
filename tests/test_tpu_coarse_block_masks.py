"""FlashConfig(backend="tpu_interpret"): BlockMasks whose blocks the TPU kernels' tiles (multiples of 128) do
not divide run in the Mosaic TPU kernels on the generation's tiles, their tables coarsened onto each kernel's
tile (`_table_tiles.tables_on_tiles`): blocks of 16, 64 and (32, 96), ragged last blocks, and document masks
sliced by query block (`block_mask[:, :, i]`, chunked prefill), whose shifted reads of the ids stay tiles
(`flex.shifted_queries`). Out, lse, the gradients of q, k, v (and of a captured per-key bias) and the jvp
against float64 NumPy, with no XLA-path warning and every pass in the kernels. Tiny shapes: each kernel config costs
an interpret-mode compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, numpy_allowed, numpy_attention, random_qkv
from test_tpu_tile_reads import kernel_calls, numpy_derivatives  # noqa: F401 (a fixture)

from probjax_kernels import (
    BlockMask, FlashConfig, and_masks, causal_mask, create_block_mask, document_mask, flex_attention,
)
from probjax_kernels._table_tiles import ordered_indices, tables_on_tiles, tiles_of
from probjax_kernels.tpu import plan as tpu_plan

TPU = FlashConfig(backend="tpu_interpret")


def finite(x):
    return np.where(np.isfinite(x), x, 0.0)


def run_and_check(block_mask, q, k, v, allowed, kv_bias=None):
    """flex_attention on the TPU kernels: out, lse, the gradients of q, k, v (and `kv_bias` `[B, S]`, added to
    every score by a score_mod that reads it at kv_idx) and the jvp in all of them (the tangent kernel) against
    `numpy_derivatives` on the bool `allowed`."""
    args = (q, k, v) if kv_bias is None else (q, k, v, kv_bias)

    def call(q, k, v, *bias):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[0][b, kv_idx]

        return flex_attention(q, k, v, score_mod=score_mod if bias else None, block_mask=block_mask,
                              enable_gqa=True, return_lse=True, config=TPU)

    @jax.jit
    def run(args, out_cotangent, tangents):
        (out, lse), vjp = jax.vjp(call, *args)
        cotangents = (out_cotangent, jnp.isfinite(lse).astype(jnp.float32))
        return (out, lse), cotangents, vjp(cotangents), jax.jvp(call, args, tangents)[1]

    tangents = tuple(normal(10 + i, x.shape) for i, x in enumerate(args))
    (out, lse), cotangents, grads, (d_out, d_lse) = run(args, normal(9, q.shape),
                                                        tangents)
    bias = 0.0 if kv_bias is None else np.asarray(kv_bias, np.float64)[:, None, None, :]
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed, bias=bias)
    assert_close(out, expected, jnp.float32, "out")
    assert np.array_equal(np.isfinite(lse), np.isfinite(expected_lse))
    assert_close(finite(np.asarray(lse)), finite(expected_lse), jnp.float32, "lse")
    *want, d_score = numpy_derivatives(q, k, v, allowed, bias, cotangents=cotangents)
    if kv_bias is not None:
        want.append(d_score.sum(axis=(1, 2)))
    for name, got, expected_grad in zip(("q", "k", "v", "kv_bias"), grads, want):
        assert_close(got, expected_grad, jnp.float32, f"d {name}")
    d_bias = 0.0 if kv_bias is None else np.asarray(tangents[3], np.float64)[:, None, None, :]
    want_out, want_lse = numpy_derivatives(q, k, v, allowed, bias, tangents=(*tangents[:3], d_bias))
    assert_close(d_out, want_out, jnp.float32, "jvp out")
    assert_close(finite(np.asarray(d_lse)), finite(want_lse), jnp.float32, "jvp lse")


def document_ids(lengths: list[list[int]]) -> np.ndarray:
    """`[B, T]` int32 ids of packed documents of the given lengths per batch row."""
    return np.stack([np.repeat(np.arange(len(row)), row) for row in lengths]).astype(np.int32)


def same_document(ids: np.ndarray) -> np.ndarray:
    return ids[:, None, :, None] == ids[:, None, None, :]


@pytest.mark.parametrize("block_size", [64, (32, 96)])
def test_document_masks_of_small_and_mixed_blocks(kernel_calls, block_size):
    """A causal document mask (two batch rows with their own documents) of 64 x 64 or 32 x 96 blocks (run as
    32 x 32: `for_kernel`) over T = S = 200 (a ragged last block) on v5e's tiles (forward 256 x 256 here, the
    sequence's), GQA 2:1; with 64 x 64 also a per-key bias whose gradient the kernels accumulate."""
    ids = document_ids([[70, 50, 80], [128, 72]])
    q, k, v = random_qkv(1, 2, 200, 200, 2, 1, 32)
    mask_mod = and_masks(causal_mask, document_mask(jnp.asarray(ids)))
    block_mask = create_block_mask(mask_mod, 2, None, 200, 200, BLOCK_SIZE=block_size)
    allowed = numpy_allowed(2, 200, 200, causal=True) & same_document(ids)
    kv_bias = normal(2, (2, 200)) if block_size == 64 else None
    run_and_check(block_mask, q, k, v, allowed, kv_bias)
    assert all(kernel_calls.values()), kernel_calls


@pytest.mark.parametrize("block_size", [16, 100])
def test_causal_small_blocks_with_a_ragged_last_block(kernel_calls, block_size):
    """Causal 16 x 16 blocks over T = 200, S = 232 (both last blocks ragged, 8 rows / keys): a 256-row kernel
    tile covers 16 x 16 blocks, empty, full and partial ones, exactly; 100 x 100 blocks (merged into 64 x 64
    ones by `for_kernel`, whose mask_mod stays the causal one) too."""
    q, k, v = random_qkv(3, 1, 200, 232, 2, 2, 64)
    block_mask = create_block_mask(causal_mask, None, None, 200, 232, BLOCK_SIZE=block_size)
    run_and_check(block_mask, q, k, v, numpy_allowed(1, 200, 232, causal=True))
    assert all(kernel_calls.values()), kernel_calls


@pytest.mark.parametrize("block_size, rows", [(128, slice(1, 3)), (64, 4)])
def test_chunked_prefill_of_packed_documents(kernel_calls, block_size, rows):
    """`block_mask[:, :, rows]` of a causal document mask over T = S = 300: query blocks 1-2 of 128 (queries
    128-383 cut at 300: a ragged chunk), or the ragged last block of 64 (queries 256-299, at an offset that is
    no multiple of the kernel tiles), against the matching rows of the whole mask."""
    ids = document_ids([[90, 110, 100]])
    q_all, k, v = random_qkv(4, 1, 300, 300, 2, 1, 32)
    mask_mod = and_masks(causal_mask, document_mask(jnp.asarray(ids)))
    sliced = create_block_mask(mask_mod, 1, None, 300, 300, BLOCK_SIZE=block_size)[:, :, rows]
    first = (rows.start if isinstance(rows, slice) else rows) * block_size
    queries = np.arange(first, first + sliced.seq_lengths[0])
    allowed = (numpy_allowed(1, 300, 300, causal=True) & same_document(ids))[:, :, queries]
    run_and_check(sliced, q_all[:, queries], k, v, allowed)
    assert all(kernel_calls.values()), kernel_calls


def test_tables_from_from_kv_blocks_keep_their_blocks():
    """Tables given by hand (`from_kv_blocks`) need not match their mask_mod, so the kernels do not coarsen
    them: 64 x 64 blocks run the XLA path, with a warning that says why, where the tables decide the mask with
    the mask_mod (here none: the causal mask's tables with no mask_mod attend their diagonal blocks whole)."""
    q, k, v = random_qkv(22, 1, 130, 130, 1, 1, 32)
    built = create_block_mask(causal_mask, None, None, 130, 130, BLOCK_SIZE=64)
    by_hand = BlockMask.from_kv_blocks(*built.kv_tables, BLOCK_SIZE=64, seq_lengths=(130, 130))
    with pytest.warns(UserWarning, match=r"not multiples of 128 \(kernel tiles divide the \(64, 64\) blocks of a "
                                         r"BlockMask from from_kv_blocks\)"):
        out = flex_attention(q, k, v, block_mask=by_hand, config=TPU)
    blocks = np.arange(130) // 64
    expected, _ = numpy_attention(q, k, v, allowed=blocks[:, None] >= blocks[None, :])
    assert_close(out, expected, jnp.float32, "out")


def brute_force(classes: np.ndarray, block: tuple, tile: tuple, grid: tuple) -> np.ndarray:
    """Kernel tile classes (0 empty, 1 partial, 2 full) of block `classes` `[B, H, R, C]`, element by element:
    positions past the blocks are empty."""
    rows, cols = grid[0] * tile[0], grid[1] * tile[1]
    dense = np.zeros(classes.shape[:2] + (rows, cols), np.int8)
    expanded = np.repeat(np.repeat(classes, block[0], axis=2), block[1], axis=3)
    r, c = min(rows, expanded.shape[2]), min(cols, expanded.shape[3])
    dense[..., :r, :c] = expanded[..., :r, :c]
    tiles = dense.reshape(*classes.shape[:2], grid[0], tile[0], grid[1], tile[1])
    full = (tiles == 2).all(axis=(3, 5))
    return np.where(full, 2, np.where((tiles > 0).any(axis=(3, 5)), 1, 0))


@pytest.mark.parametrize("block, tile, grid, short", [
    ((16, 16), (256, 128), (2, 3), True), ((64, 512), (256, 256), (2, 4), True),
    ((512, 32), (256, 512), (2, 1), True), ((128, 128), (128, 256), (3, 2), True),
    ((256, 256), (128, 128), (6, 6), True), ((256, 512), (128, 256), (4, 2), False),
])
def test_tables_on_tiles_against_brute_force(block, tile, grid, short):
    """Random partial / full tables of `block` blocks on kernel `tile`s over a `grid` as large as the blocks'
    extent, or larger (`short`: the padding counts as empty), traced under jit, against the tile classes
    computed element by element."""
    extent = (-(-grid[0] * tile[0] // block[0]), -(-grid[1] * tile[1] // block[1]))
    rows, cols = (max(1, e - 1) for e in extent) if short else extent
    classes = np.random.RandomState(sum(block + tile)).randint(0, 3, (2, 1, rows, cols))
    tables = (*ordered_indices(jnp.asarray(classes == 1)), *ordered_indices(jnp.asarray(classes == 2)))
    num_partial, partial, num_full, full = jax.jit(tables_on_tiles, static_argnums=(1, 2, 3))(
        tables, block, tile, grid)
    got = np.asarray(tiles_of(num_partial, partial)) * 1 + np.asarray(tiles_of(num_full, full)) * 2
    np.testing.assert_array_equal(got, brute_force(classes, block, tile, grid))


def test_plan_keeps_the_generation_tiles_for_small_blocks():
    """The dispatch keeps v5e's tiles for a 16 x 16 block mask (no shrinking to the blocks) on the TPU backend,
    and shrinks them to the blocks on the Triton one, whose kernels walk tables on tiles inside blocks."""
    from probjax_kernels import _dispatch
    from probjax_kernels._problem import Features

    features = Features(scale=1.0, block_sizes=(16, 16), exact_mask_mod=True)
    shapes = dict(q_shape=(1, 1024, 2, 64), k_shape=(1, 1024, 2, 64), value_dim=64, dtype=jnp.float32,
                  bias_shape=None, mask_shape=None, table_shape=(1, 1), has_segments=False, num_score_consts=0,
                  num_mask_consts=0)
    tpu = _dispatch.plan(features, TPU, **shapes).problem.config
    assert (tpu.block_q, tpu.block_k) == tpu_plan.TILES["v5e"][:2]
    triton = _dispatch.plan(features, FlashConfig(backend="interpret"), **shapes).problem.config
    assert (triton.block_q, triton.block_k) == (16, 16)
