"""PyTorch FlexAttention's API around flex_attention: signature, aux outputs, kernel_options, create_block_mask's
spellings, create_mask / noop_mask and BlockMask's methods, each against an independent NumPy answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, numpy_attention, output_and_grads, random_qkv

import probjax_kernels
from probjax_kernels import (
    AuxOutput,
    AuxRequest,
    BlockMask,
    FlashConfig,
    and_masks,
    causal_mask,
    create_block_mask,
    create_mask,
    document_mask,
    flex_attention,
    flex_attention_reference,
    noop_mask,
    or_masks,
    softcap,
)
from probjax_kernels.flex.options import config_from_kernel_options

T = 64
CAUSAL = np.tril(np.ones((T, T), bool))


@pytest.mark.parametrize("fn", [flex_attention, flex_attention_reference], ids=["kernel", "reference"])
def test_scale_is_positional_and_gqa_needs_enable_gqa(fn):
    q, k, v = random_qkv(0, 1, T, T, 4, 2, 16)
    out = fn(q, k, v, None, None, 0.3, True)  # torch order: score_mod, block_mask, scale, enable_gqa
    expected, _ = numpy_attention(q, k, v, scale=0.3)
    assert_close(out, expected, jnp.float32)
    with pytest.raises(ValueError, match="N=4 heads and k / v have K=2; pass enable_gqa=True"):
        fn(q, k, v)
    with pytest.raises(TypeError):
        fn(q, k, v, None, None, 0.3, True, False, None, None)  # return_aux and the rest are keyword-only


def test_return_aux_lse_and_max_scores():
    q, k, v = random_qkv(1, 2, T, T, 2, 2, 16)
    q = 2.0 * q
    rows = np.arange(T)[:, None] >= 8  # rows < 8 attend nothing: lse and max -inf
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= 8) & (q_idx >= kv_idx), None, None, T, T,
                                   BLOCK_SIZE=32)
    cap = softcap(3.0)
    both = AuxRequest(lse=True, max_scores=True)
    # Under jit: eagerly, every op is an XLA compile of its own.
    out, aux = jax.jit(lambda q, k, v: flex_attention(q, k, v, cap, block_mask, return_aux=both))(q, k, v)
    assert isinstance(aux, AuxOutput)
    ref_out, ref_aux = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, cap, block_mask,
                                                                        return_aux=both))(q, k, v)
    assert_close(out, ref_out, jnp.float32)
    # max_scores: float64 NumPy, independent of the library
    qn, kn = (np.asarray(x, np.float64) for x in (q, k))
    scores = 3.0 * np.tanh(np.einsum("btnd,bsnd->bnts", qn, kn) * 16**-0.5 / 3.0)
    scores = np.where(CAUSAL & rows, scores, -np.inf)
    for max_scores in (aux.max_scores, ref_aux.max_scores):
        np.testing.assert_allclose(np.asarray(max_scores), scores.max(-1), rtol=1e-5)  # -inf rows included
    lse = np.asarray(aux.lse)
    assert np.all(np.isneginf(lse[:, :, :8]))
    np.testing.assert_allclose(lse[:, :, 8:], np.asarray(ref_aux.lse)[:, :, 8:], atol=1e-5)
    assert flex_attention_reference(q, k, v, cap, block_mask, return_aux=AuxRequest(lse=True))[1].max_scores is None
    with pytest.raises(ValueError, match="not both"):
        flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(TypeError, match="return_aux must be an AuxRequest"):
        flex_attention(q, k, v, return_aux=True)


def test_kernel_options_map_onto_flash_config(monkeypatch):
    options = {"BLOCK_M": 32, "BLOCK_N": 16, "bwd_BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "bwd_BLOCK_N2": 16,
               "num_warps": 8, "num_stages": 3}
    assert config_from_kernel_options(options, FlashConfig(backend="interpret")) == FlashConfig(
        block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16, num_warps=8,
        num_stages=3, backend="interpret")
    seen = []
    attention = probjax_kernels._autodiff.attention

    def spy(*args, **kwargs):
        seen.append(args[4])
        return attention(*args, **kwargs)

    monkeypatch.setattr(probjax_kernels._autodiff, "attention", spy)
    q, k, v = random_qkv(2, 1, T, T, 2, 2, 16)
    out = flex_attention(q, k, v, kernel_options={"BLOCK_M": 16, "BLOCK_N": 32})
    assert (seen[-1].block_q, seen[-1].block_k) == (16, 32)
    assert_close(out, numpy_attention(q, k, v)[0], jnp.float32)
    with pytest.warns(UserWarning, match="kernel_options\\['PRESCALE_QK'\\] has no effect"):
        ignored = config_from_kernel_options({"PRESCALE_QK": True, "BLOCK_M": 16, "BLOCK_N": 32}, None)
    assert ignored == FlashConfig(block_q=16, block_k=32)  # the ignored key changed nothing
    with pytest.raises(ValueError, match="disagrees with config.block_q=64"):
        flex_attention(q, k, v, kernel_options={"BLOCK_M": 16}, config=FlashConfig(block_q=64))
    with pytest.raises(ValueError, match="kernel_options: FlashConfig.block_k=24"):
        flex_attention(q, k, v, kernel_options={"BLOCK_N": 24})


def test_create_block_mask_takes_torch_spellings():
    mod = and_masks(causal_mask, lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 40)
    ours = create_block_mask(mod, 1, None, q_len=100, kv_len=90, block_size=(32, 16))
    for torch_style in (create_block_mask(mod, 1, None, 100, 90, "cuda", (32, 16), True),
                        create_block_mask(mod, B=1, H=None, Q_LEN=100, KV_LEN=90, device=None, BLOCK_SIZE=(32, 16))):
        for name in BlockMask._TABLES:
            np.testing.assert_array_equal(getattr(torch_style, name), getattr(ours, name), err_msg=name)
        assert torch_style.BLOCK_SIZE == (32, 16) and torch_style.shape == (1, 1, 100, 90)
    with pytest.raises(ValueError, match="Q_LEN=100 and q_len=64 disagree"):
        create_block_mask(mod, 1, None, 100, 90, q_len=64)
    with pytest.raises(ValueError, match="BLOCK_SIZE must be an int >= 1 or a pair of them"):
        create_block_mask(mod, 1, None, 100, 90, BLOCK_SIZE=(32, 0))


def test_create_mask_and_noop_mask():
    window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= h)  # noqa: E731
    mask = np.asarray(create_mask(window, None, 3, 6, 7))
    rows, cols = np.arange(6)[:, None], np.arange(7)[None, :]
    expected = np.stack([(rows >= cols) & (rows - cols <= h) for h in range(3)])[None]
    np.testing.assert_array_equal(mask, expected)
    as_score_mod = lambda s, b, h, q_idx, kv_idx: jnp.where(window(b, h, q_idx, kv_idx), s, -jnp.inf)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(create_mask(as_score_mod, 2, 3, 6, 7, "cpu")),
                                  np.broadcast_to(expected, (2, 3, 6, 7)))
    np.testing.assert_array_equal(np.asarray(create_mask(noop_mask, 1, 1, 3, 4)), np.ones((1, 1, 3, 4), bool))
    block_mask = create_block_mask(noop_mask, None, None, 48, 48, BLOCK_SIZE=16)
    assert np.all(np.asarray(block_mask.to_dense()) == 2)  # every tile full: nothing to evaluate


def block_classes(allowed: np.ndarray, block) -> np.ndarray:
    """0 empty / 1 partial / 2 full per tile of a [..., T, S] bool mask; positions past T / S count as
    masked, as PyTorch pads them (so a ragged tile is never full)."""
    block_q, block_kv = (block, block) if isinstance(block, int) else block
    *lead, q_len, kv_len = allowed.shape
    rows, cols = -(-q_len // block_q), -(-kv_len // block_kv)
    padded = np.zeros((*lead, rows * block_q, cols * block_kv), bool)
    padded[..., :q_len, :kv_len] = allowed
    tiles = padded.reshape(*lead, rows, block_q, cols, block_kv)
    anything, everything = tiles.any((-3, -1)), tiles.all((-3, -1))
    return np.where(everything, 2, anything.astype(int))


def test_block_mask_printing_and_sparsity():
    block_mask = create_block_mask(causal_mask, 2, 3, 128, 128, BLOCK_SIZE=16)  # 8 x 8 tiles, 36 visited
    assert block_mask.sparsity() == pytest.approx(100 * 28 / 64)
    np.testing.assert_allclose(np.asarray(block_mask.tile_sparsity()), np.full((2, 3), 28 / 64))
    text = str(block_mask)
    assert text.startswith("BlockMask(shape=(2, 3, 128, 128), sparsity=43.75%")
    assert text.count("(0, 0)\n") == 1 and "(1, 0)" in text and "(1, 1)" not in text  # limit=4 pairs
    assert "To print out more, set BlockMask.to_string(limit=N)" in text
    picture = block_mask[1, 2].to_string(grid_size=-1).strip().split("\n")[1:]
    expected = ["".join("██" if c <= r else "  " for c in range(8)) for r in range(8)]
    assert [line.rstrip() for line in picture] == [line.rstrip() for line in expected]
    coarse = block_mask[0, 0].to_string(grid_size=4).strip().split("\n")[1:]
    assert [line.rstrip() for line in coarse] == ["░░", "██░░", "████░░", "██████░░"]


def test_block_mask_indexing_keeps_the_attention_of_those_rows():
    ids = jnp.array([[0] * 20 + [1] * 44, [0] * 50 + [1] * 14, [0] * 64], jnp.int32)
    q, k, v = random_qkv(3, 3, T, T, 2, 2, 16)
    block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 3, None, T, T, BLOCK_SIZE=32)
    assert block_mask[1].shape == (1, 1, T, T) and block_mask[:, 0].shape == (3, 1, T, T)
    assert block_mask[::2].shape == (2, 1, T, T) and block_mask[-1].shape == (1, 1, T, T)
    np.testing.assert_array_equal(block_mask[::2].kv_indices, block_mask.kv_indices[::2])
    sliced = block_mask[1:]
    # its mask_mod still reads the documents of 1, 2
    out = jax.jit(lambda q, k, v: flex_attention(q, k, v, None, sliced))(q[1:], k[1:], v[1:])
    for row, b in enumerate((1, 2)):
        allowed = CAUSAL & (np.asarray(ids[b])[:, None] == np.asarray(ids[b])[None, :])
        expected, _ = numpy_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], allowed=allowed)
        assert_close(out[row:row + 1], expected, jnp.float32)
        np.testing.assert_array_equal(np.asarray(sliced.to_dense()[row, 0]), block_classes(allowed, 32))
    with pytest.raises(IndexError, match="batch index 3 is out of range"):
        block_mask[3]
    with pytest.raises(IndexError, match="takes at most 3 indices"):
        block_mask[0, 0, 0, 0]


def test_from_kv_blocks_derives_the_q_tables_and_runs():
    built = create_block_mask(causal_mask, None, 2, 96, 96, BLOCK_SIZE=32)
    derived = BlockMask.from_kv_blocks(built.kv_num_blocks, built.kv_indices, built.full_kv_num_blocks,
                                       built.full_kv_indices, 32, causal_mask, (96, 96))
    for name in BlockMask._TABLES:
        np.testing.assert_array_equal(getattr(derived, name), getattr(built, name), err_msg=name)
    # Block-causal attention from hand-written 2-D tables and no mask_mod: whole diagonal tiles attend.
    kv_num_blocks = jnp.array([1, 2, 3], jnp.int32)
    kv_indices = jnp.array([[0, 1, 2], [0, 1, 2], [0, 1, 2]], jnp.int32)
    block_causal = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=32)
    assert block_causal.shape == (96, 96) and block_causal.mask_mod is noop_mask  # PyTorch's: no B / H axes
    np.testing.assert_array_equal(block_causal.q_num_blocks[0, 0], [3, 2, 1])
    q, k, v = random_qkv(4, 1, 96, 96, 2, 2, 16)
    allowed = np.kron(np.tril(np.ones((3, 3), bool)), np.ones((32, 32), bool))
    out = jax.jit(lambda q, k, v: flex_attention(q, k, v, None, block_causal))(q, k, v)
    assert_close(out, numpy_attention(q, k, v, allowed=allowed)[0], jnp.float32)
    with pytest.raises(ValueError, match="kv_num_blocks must lie in \\[0, 3\\]"):
        BlockMask.from_kv_blocks(kv_num_blocks + 1, kv_indices, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="must have ceil\\(q_len / block_q\\)"):
        BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=32, seq_lengths=(40, 96))


def test_as_tuple_and_adjust():
    block_mask = create_block_mask(causal_mask, None, None, 100, 100, BLOCK_SIZE=32)
    flat = block_mask.as_tuple()
    assert flat[:2] == (100, 100) and flat[-3:] == (32, 32, causal_mask) and len(flat) == 13
    assert flat[2] is block_mask.kv_num_blocks and flat[9] is block_mask.full_q_indices
    nested = block_mask.as_tuple(flatten=False)
    assert nested[0] == (100, 100) and nested[-2] == (32, 32) and len(nested) == 11
    for q_len, kv_len in ((70, 50), (64, 64), (100, 100)):
        adjusted = block_mask.adjust(q_len, kv_len)
        allowed = np.tril(np.ones((q_len, kv_len), bool))
        np.testing.assert_array_equal(np.asarray(adjusted.to_dense()[0, 0]), block_classes(allowed, 32))
        assert adjusted.shape == (1, 1, q_len, kv_len)
    assert block_mask._adjust(70, 50).seq_lengths == (70, 50)
    q, k, v = random_qkv(5, 1, 70, 50, 2, 2, 16)
    assert_close(jax.jit(lambda q, k, v: flex_attention(q, k, v, None, block_mask.adjust(70, 50)))(q, k, v),
                 numpy_attention(q, k, v, allowed=np.tril(np.ones((70, 50), bool)))[0], jnp.float32)
    with pytest.raises(ValueError, match="crop it with block_mask.adjust\\(70, 50\\)"):
        flex_attention(q, k, v, None, block_mask)
    with pytest.raises(ValueError, match="kv_len must be an int in \\[1, 100\\]"):
        block_mask.adjust(100, 128)


def test_broadcast_block_mask_whose_mask_mod_reads_b_or_h_is_refused():
    """Issue 14 item 2: tables classified at h = 0 with the kernels' partial tiles at the real h gave neither
    mask (a per-head window [40, 5]: head 1 off by 2.1). Pass H and it is exact."""
    q, k, v = random_qkv(6, 2, T, T, 2, 2, 16)
    windows = jnp.array([40, 5])
    per_head = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])  # noqa: E731
    with pytest.raises(ValueError, match="built for H=1 \\(or None\\) but its mask_mod reads h.*pass H=2"):
        flex_attention(q, k, v, None, create_block_mask(per_head, None, None, T, T, BLOCK_SIZE=16))
    lengths = jnp.array([10, 64])
    per_batch = lambda b, h, q_idx, kv_idx: kv_idx < lengths[b]  # noqa: E731
    with pytest.raises(ValueError, match="built for B=1 \\(or None\\) but its mask_mod reads b.*pass B=2"):
        flex_attention(q, k, v, None, create_block_mask(per_batch, None, 2, T, T, BLOCK_SIZE=16))
    per_head_mask = create_block_mask(per_head, None, 2, T, T, BLOCK_SIZE=16)
    out = jax.jit(lambda q, k, v: flex_attention(q, k, v, None, per_head_mask))(q, k, v)
    rows, cols = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = np.stack([(rows >= cols) & (rows - cols <= w) for w in (40, 5)])[None]
    assert_close(out, numpy_attention(q, k, v, allowed=allowed)[0], jnp.float32)



def test_ragged_last_block_tables_match_torch():
    """Issue 22 item 13: PyTorch pads a ragged last block with masked positions, so it is never full; its
    tables for causal 100 x 100, BLOCK_SIZE 32 (from the issue) are kv_num_blocks [1 1 1 4] and
    full_kv_num_blocks [0 1 2 0] (ours were [1 1 1 1] and [0 1 2 3]); sparsity() is its block count."""
    block_mask = create_block_mask(causal_mask, None, None, 100, 100, BLOCK_SIZE=32)
    np.testing.assert_array_equal(block_mask.kv_num_blocks[0, 0], [1, 1, 1, 4])
    np.testing.assert_array_equal(block_mask.full_kv_num_blocks[0, 0], [0, 1, 2, 0])
    assert block_mask.sparsity() == pytest.approx(100 * (1 - 10 * 32 * 32 / (100 * 100)))  # PyTorch's formula
    windows = jnp.array([3, 50])
    per_head = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])  # noqa: E731
    rows, cols = np.arange(70)[:, None], np.arange(45)[None, :]
    allowed = np.stack([(rows >= cols) & (rows - cols <= w) for w in (3, 50)])
    for block in (16, (32, 16)):
        built = create_block_mask(per_head, None, 2, 70, 45, BLOCK_SIZE=block)
        np.testing.assert_array_equal(np.asarray(built.to_dense()[0]), block_classes(allowed, block))
    shorter = create_block_mask(causal_mask, None, None, 128, 128, BLOCK_SIZE=32).adjust(100, 100)
    np.testing.assert_array_equal(shorter.to_dense(), block_mask.to_dense())  # adjust classifies the same way


def effective_mask(block_mask, allowed: np.ndarray) -> np.ndarray:
    """What the tables and mask_mod attend, by brute force: full tiles attend, partial ones where `allowed`
    (the mask_mod's dense mask), empty ones nowhere."""
    classes = np.asarray(block_mask.to_dense())
    block_q, block_kv = block_mask.block_size
    q_len, kv_len = block_mask.seq_lengths
    per_element = classes[..., np.arange(q_len) // block_q, :][..., np.arange(kv_len) // block_kv]
    return (per_element == 2) | ((per_element == 1) & allowed)


@pytest.mark.parametrize("block", [(48, 8), (64, 24)])  # split and merged tiles on each axis
def test_any_block_size_maps_onto_kernel_tiles(block):
    """Issue 22 item 10: PyTorch takes BLOCK_SIZE 8, 48, 96, (64, 48); ours refused all but powers of two
    >= 16. The tables the kernels run (`for_kernel`) must stand for the same mask, element by element."""
    rows, cols = np.arange(100)[:, None], np.arange(90)[None, :]
    allowed = (rows >= cols) & (rows - cols <= 20)
    block_mask = create_block_mask(and_masks(causal_mask, lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 20), None,
                                   None, 100, 90, BLOCK_SIZE=block)
    assert block_mask.block_size == ((block, block) if isinstance(block, int) else block)
    np.testing.assert_array_equal(np.asarray(block_mask.to_dense()[0, 0]), block_classes(allowed, block))
    fitted = block_mask.for_kernel()
    assert all(b >= 16 and b & (b - 1) == 0 for b in fitted.block_size)
    mask_of_fitted = np.asarray(create_mask(fitted.mask_mod, None, None, 100, 90))
    np.testing.assert_array_equal(effective_mask(fitted, mask_of_fitted), allowed[None, None])
    # Hand-written tables with no mask_mod attend their whole partial tiles; merged tiles must keep that.
    pattern = np.random.RandomState(1).rand(*block_mask.kv_indices.shape[-2:]) < 0.4
    full = pattern & (np.random.RandomState(2).rand(*pattern.shape) < 0.5)
    by_hand = BlockMask.from_kv_blocks(
        jnp.asarray((pattern & ~full).sum(-1), jnp.int32), jnp.asarray(np.argsort(~(pattern & ~full), -1, kind="stable")),
        jnp.asarray(full.sum(-1), jnp.int32), jnp.asarray(np.argsort(~full, -1, kind="stable")), block,
        seq_lengths=(100, 90))
    expected = effective_mask(by_hand, np.ones((100, 90), bool))
    fitted = by_hand.for_kernel()
    np.testing.assert_array_equal(effective_mask(fitted, np.asarray(create_mask(fitted.mask_mod, 1, 1, 100, 90))),
                                  expected)


def test_odd_block_sizes_run_exactly():
    """Issue 22 item 10 through the kernels: merged tiles (BLOCK_SIZE 8, hand tables, no mask_mod, q tables
    left to derive) forward and backward, against float64."""
    q, k, v = random_qkv(7, 1, 40, 40, 2, 2, 16)
    pattern = np.random.RandomState(0).rand(5, 5) < 0.5
    np.fill_diagonal(pattern, True)
    block_mask = BlockMask.from_kv_blocks(jnp.asarray(pattern.sum(-1), jnp.int32),
                                          jnp.asarray(np.argsort(~pattern, -1, kind="stable"), jnp.int32),
                                          BLOCK_SIZE=8, compute_q_blocks=False)
    allowed = np.kron(pattern, np.ones((8, 8), bool))
    cotangent = jnp.cos(jnp.arange(40 * 2 * 16.0)).reshape(1, 40, 2, 16)
    out, grads = output_and_grads(lambda q, k, v: flex_attention(q, k, v, None, block_mask), (q, k, v), cotangent)
    assert_close(out, numpy_attention(q, k, v, allowed=allowed)[0], jnp.float32)
    with jax.enable_x64(True):
        wide = [jnp.asarray(x, jnp.float64) for x in (q, k, v, cotangent)]
        _, expected = output_and_grads(lambda q, k, v: probjax_kernels.flash_attention_reference(
            q, k, v, mask=jnp.asarray(allowed)), wide[:3], wide[3])
        assert all(x.dtype == jnp.float64 for x in expected)
    for name, got, want in zip("qkv", grads, expected):
        assert_close(got, want, jnp.float32, name)


def test_block_mask_indexing_by_query_block_and_integer_arrays():
    """Issue 22 item 11: `bm[:, :, i]` and integer-array indices, as PyTorch; ours keeps a working mask_mod, so
    the selected query blocks (in any order) and batches run as those rows of the original."""
    ids = jnp.array([[0] * 20 + [1] * 76, [0] * 50 + [1] * 46, [0] * 96], jnp.int32)
    block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 3, None, 96, 96, BLOCK_SIZE=32)
    row = block_mask[:, :, 1]
    assert row.kv_num_blocks.shape == (3, 1, 1) and row.shape == (3, 1, 32, 96)
    np.testing.assert_array_equal(row.kv_indices, block_mask.kv_indices[:, :, 1:2])
    picked = block_mask[jnp.array([2, 0]), :, np.array([2, 0])]
    assert picked.shape == (2, 1, 64, 96)
    np.testing.assert_array_equal(picked.full_kv_num_blocks, np.asarray(block_mask.full_kv_num_blocks)[[2, 0]][:, :, [2, 0]])
    q, k, v = random_qkv(9, 3, 96, 96, 2, 2, 16)
    rows, batches = np.r_[64:96, 0:32], np.array([2, 0])
    out = jax.jit(lambda q, k, v: flex_attention(q, k, v, None, picked))(q[batches][:, rows], k[batches], v[batches])
    for i, b in enumerate((2, 0)):
        allowed = (rows[:, None] >= np.arange(96)) & (np.asarray(ids[b])[rows][:, None] == np.asarray(ids[b]))
        assert_close(out[i:i + 1], numpy_attention(q[b:b + 1, rows], k[b:b + 1], v[b:b + 1], allowed=allowed)[0],
                     jnp.float32)
    ragged = create_block_mask(causal_mask, None, None, 100, 100, BLOCK_SIZE=32)
    assert ragged[:, :, -1].shape == (1, 1, 4, 100) and ragged[:, :, [0, 3]].shape == (1, 1, 36, 100)
    with pytest.raises(IndexError, match="ragged .* select it last"):
        ragged[:, :, [3, 0]]
    with pytest.raises(IndexError, match="query block index 4 is out of range"):
        ragged[:, :, 4]
    decode = ragged[:, :, 2]  # PyTorch's decoding pattern assigns the lengths and mask_mod
    decode.seq_lengths = (1, 100)
    assert decode.shape == (1, 1, 1, 100)


def test_torch_keywords_separate_full_blocks_and_compute_q_blocks():
    """Issue 22 item 12."""
    merged = create_block_mask(causal_mask, None, None, 64, 64, BLOCK_SIZE=16, separate_full_blocks=False)
    np.testing.assert_array_equal(merged.kv_num_blocks[0, 0], [1, 2, 3, 4])
    assert int(jnp.sum(merged.full_kv_num_blocks)) == 0
    separate = create_block_mask(causal_mask, None, None, 64, 64, 16)
    lazy = BlockMask.from_kv_blocks(*separate.kv_tables, BLOCK_SIZE=16, mask_mod=causal_mask, compute_q_blocks=False)
    assert lazy.q_indices is None and lazy.q_num_blocks is None
    for got, want in zip(lazy.q_tables, separate.q_tables):
        np.testing.assert_array_equal(got, want)


def test_torch_private_names_and_porting_errors():
    """Issue 22 items 14 and 15: attention-gym's imports; PyTorch tensor methods in hooks name the jnp
    spelling; a score_mod given to create_block_mask; torch's shape for tables without B / H."""
    from probjax_kernels import _DEFAULT_SPARSE_BLOCK_SIZE, _mask_mod_signature, _score_mod_signature

    assert _DEFAULT_SPARSE_BLOCK_SIZE == 128 and _mask_mod_signature is not None and _score_mod_signature is not None
    q, k, v = random_qkv(10, 1, 16, 16, 1, 1, 16)
    with pytest.raises(AttributeError, match="\\.clamp\\(\\).*jnp\\.clip\\(x, min, max\\)"):
        flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: s + (q_idx - kv_idx).clamp(0, 4))
    with pytest.raises(AttributeError, match="\\.float\\(\\).*x\\.astype\\(jnp\\.float32\\)"):
        create_block_mask(lambda b, h, q_idx, kv_idx: q_idx.float() >= kv_idx, None, None, 16, 16, BLOCK_SIZE=16)
    with pytest.raises(AttributeError, match="\\.to\\(\\).*x\\.astype\\(dtype\\)"):
        create_mask(lambda b, h, q_idx, kv_idx: q_idx.to(jnp.int32) >= kv_idx, None, None, 4, 4)
    with pytest.raises(TypeError, match="create_block_mask needs a mask_mod.*a score_mod"):
        create_block_mask(lambda score, b, h, q_idx, kv_idx: score, None, None, 16, 16)
    tables = create_block_mask(causal_mask, None, 2, 64, 64, BLOCK_SIZE=32)
    assert BlockMask.from_kv_blocks(tables.kv_num_blocks[0, 0], tables.kv_indices[0, 0], BLOCK_SIZE=32).shape == (64, 64)
    assert BlockMask.from_kv_blocks(tables.kv_num_blocks[0], tables.kv_indices[0], BLOCK_SIZE=32).shape == (2, 64, 64)


def test_block_mask_query_block_selection_rebuilds_the_key_block_tables():
    """Issue 30 item 2: `bm[:, :, i]` selected query blocks on the key-block tables' axis 2 (their key blocks),
    so the dK / dV kernel walked the wrong query blocks: the gradients of the selected rows against float64."""
    block_mask = create_block_mask(causal_mask, 1, 1, 64, 64, BLOCK_SIZE=16)
    row = block_mask[:, :, 1]
    assert row.q_num_blocks.shape == (1, 1, 4) and row.q_indices.shape == (1, 1, 4, 1)
    np.testing.assert_array_equal(row.q_num_blocks[0, 0], [0, 1, 0, 0])  # key block 1 is the diagonal: partial
    np.testing.assert_array_equal(row.full_q_num_blocks[0, 0], [1, 0, 0, 0])
    picked = block_mask[:, :, [2, 0]]
    rows = np.r_[32:48, 0:16]
    q, k, v = random_qkv(3, 1, 64, 64, 1, 1, 16)
    cotangent = jnp.sin(jnp.arange(32 * 16.0)).reshape(1, 32, 1, 16)
    _, grads = output_and_grads(lambda q, k, v: flex_attention(q, k, v, None, picked), (q[:, rows], k, v),
                                cotangent)
    allowed = rows[:, None] >= np.arange(64)
    with jax.enable_x64(True):
        wide = [jnp.asarray(x, jnp.float64) for x in (q[:, rows], k, v, cotangent)]
        _, expected = output_and_grads(lambda q, k, v: probjax_kernels.flash_attention_reference(
            q, k, v, mask=jnp.asarray(allowed)), wide[:3], wide[3])
        assert all(x.dtype == jnp.float64 for x in expected)
    for name, got, want in zip("qkv", grads, expected):
        assert_close(got, want, jnp.float32, name)


def test_and_masks_and_or_masks_of_no_mod_attend_everywhere_and_nowhere():
    """As PyTorch: and_masks() is all True, or_masks() all False, and each is the neutral part of its kind."""
    np.testing.assert_array_equal(np.asarray(create_mask(and_masks(), 1, 2, 5, 7)), np.ones((1, 2, 5, 7), bool))
    np.testing.assert_array_equal(np.asarray(create_mask(or_masks(), 1, 2, 5, 7)), np.zeros((1, 2, 5, 7), bool))
    for combined in (and_masks(and_masks(), causal_mask), or_masks(or_masks(), causal_mask)):
        np.testing.assert_array_equal(np.asarray(create_mask(combined, None, None, T, T))[0, 0], CAUSAL)
    q, k, v = random_qkv(5, 1, T, T, 2, 1, 16)
    everywhere = create_block_mask(and_masks(), None, None, T, T, BLOCK_SIZE=32)
    nowhere = create_block_mask(or_masks(), None, None, T, T, BLOCK_SIZE=32)
    np.testing.assert_array_equal(np.asarray(nowhere.kv_num_blocks), 0)
    np.testing.assert_array_equal(np.asarray(everywhere.full_kv_num_blocks), 2)
    run = jax.jit(lambda q, k, v, mask: flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True))
    out, lse = run(q, k, v, everywhere)
    expected, expected_lse = numpy_attention(q, k, v)
    assert_close(out, expected, jnp.float32)
    assert_close(lse, expected_lse, jnp.float32)
    out, lse = run(q, k, v, nowhere)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.isneginf(np.asarray(lse)).all()
