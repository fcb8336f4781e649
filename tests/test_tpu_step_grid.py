"""The Mosaic TPU kernels' flattened step axis (`probjax_kernels.tpu.common.step_grid`): a causal or windowed
grid lists only the (tile, step) pairs the static shapes allow, checked against a mask built from first
principles, at every runtime length; and the forward, dQ, dK/dV and tangent kernels on it, in TPU interpret
mode against the float64 NumPy reference and the plain-jnp one, with ragged lengths, GQA (the transposed dK/dV
walks a group's heads on the flattened axis) and the in-place head blocks."""

import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, numpy_allowed, numpy_attention, random_qkv
from test_tpu_kernels import check_gradients, finite

from probjax_kernels import FlashConfig, flash_attention, flash_attention_reference
from probjax_kernels._tiles import kv_tile_range, q_tile_range
from probjax_kernels.tpu import chips, common

V5E = chips.CHIPS["v5e"]


def problem(bq: int, bk: int, window=(None, None), table_shape=None):
    """What `step_grid` reads of a call."""
    features = SimpleNamespace(window_left=window[0], window_right=window[1])
    return SimpleNamespace(config=SimpleNamespace(block_q=bq, block_k=bk), features=features,
                           table_shape=table_shape)


def decoded(grid: common.StepGrid) -> list[tuple[int, int, int]]:
    return [(int(c) // (1 << 16), (int(c) % (1 << 16)) // 2, int(c) % 2) for c in grid.codes]


def visible_tiles(t: int, s: int, bq: int, bk: int, window) -> list[list[int]]:
    """Per query tile, the key tiles holding a key one of its rows sees (first principles, full lengths)."""
    allowed = numpy_allowed(1, t, s, window=window)[0, 0]
    return [sorted({col // bk for col in np.nonzero(allowed[i * bq:(i + 1) * bq].any(axis=0))[0]})
            for i in range(t // bq)]


WINDOWS = [(None, 0), (256, 0), (100, 50), (None, None), (0, None)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("t, s, bq, bk", [(1024, 1024, 256, 512), (768, 1280, 128, 256), (512, 512, 128, 128)])
def test_codes_list_exactly_the_visible_tiles(t, s, bq, bk, window):
    """Query tile i's steps are 0 .. n_i - 1 with n_i its visible key tiles (at least one step: the first writes
    its outputs), in tile order, the last one marked; the same for key tiles over query tiles; no idle step
    (a full grid keeps two axes)."""
    q_tiles = visible_tiles(t, s, bq, bk, window)
    kv_tiles = [[i for i in range(t // bq) if j in q_tiles[i]] for j in range(s // bk)]
    for kind, tiles, steps in (("q", q_tiles, s // bk), ("kv", kv_tiles, t // bq)):
        grid = common.step_grid(problem(bq, bk, window), kind, (t, s), steps, 1, chip=V5E)
        counts = [max(len(x), 1) for x in tiles]
        if sum(counts) == len(tiles) * steps:
            assert not grid.flat
            continue
        assert grid.flat and grid.num_visits == sum(counts)
        assert grid.shape(2, 3) == (2, 3, sum(counts))
        assert grid.semantics() == ("parallel", "parallel", "arbitrary")
        expected = [(tile, step, int(step == n - 1)) for tile, n in enumerate(counts) for step in range(n)]
        assert decoded(grid) == expected
        for tile, visible in enumerate(tiles):  # contiguous: step j is tile lo + j
            assert not visible or visible == list(range(visible[0], visible[0] + len(visible)))


@pytest.mark.parametrize("window", WINDOWS[:3])
def test_runtime_lengths_never_need_more_steps_than_listed(window):
    """Shorter runtime lengths only shrink a tile's range (`_tiles`), so the codes at the padded lengths cover
    every runtime walk."""
    t, s, bq, bk = 640, 768, 128, 256
    for kind in ("q", "kv"):
        steps = s // bk if kind == "q" else t // bq
        grid = common.step_grid(problem(bq, bk, window), kind, (t, s), steps, 1, chip=V5E)
        listed = {}
        for tile, step, _ in decoded(grid):
            listed[tile] = step + 1
        lo, hi = common.full_length_ranges(kind, (bq, bk), (t, s), window, steps)
        for tile in range(len(lo)):  # the NumPy ranges are `_tiles`' at the full lengths
            ranges = (kv_tile_range(tile * bq, bq, t, s, bk, window, steps) if kind == "q" else
                      q_tile_range(tile * bk, bk, t, s, bq, window, steps))
            assert (int(ranges[0]), int(ranges[3])) == (lo[tile], hi[tile])
        for q_len, kv_len in itertools.product(range(0, t + 1, 64), range(0, s + 1, 96)):
            for tile in range(t // bq if kind == "q" else s // bk):
                if kind == "q":
                    lo, _, _, hi = kv_tile_range(tile * bq, bq, q_len, kv_len, bk, window, steps)
                else:
                    lo, _, _, hi = q_tile_range(tile * bk, bk, q_len, kv_len, bq, window, steps)
                assert int(hi) - int(lo) <= listed[tile], (kind, q_len, kv_len, tile)


def test_head_steps_and_when_two_axes_stay():
    """The transposed dK/dV walks a group's heads in turn, `num_steps` apart; a BlockMask, a dQ writing every
    dS block and an odd number of programs on a megacore chip (v4, v5p) keep two axes."""
    causal = problem(128, 128, (None, 0))
    grid = common.step_grid(causal, "kv", (384, 384), 3, 1, head_steps=2, chip=V5E)
    assert decoded(grid) == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 3, 0), (0, 4, 0), (0, 5, 1),
                             (1, 0, 0), (1, 1, 0), (1, 3, 0), (1, 4, 1), (2, 0, 0), (2, 3, 1)]
    v5p = chips.CHIPS["v5p"]
    assert v5p.megacore and not V5E.megacore and not chips.CHIPS["tpu7x"].megacore
    assert not common.step_grid(causal, "q", (384, 384), 3, 3, chip=v5p).flat
    assert common.step_grid(causal, "q", (384, 384), 3, 4, chip=v5p).flat
    assert not common.step_grid(problem(128, 128, (None, 0), (1, 1)), "q", (384, 384), 3, 1, chip=V5E).flat
    assert not common.step_grid(causal, "q", (384, 384), 3, 1, every_step=True, chip=V5E).flat


@pytest.fixture
def grids(monkeypatch):
    """The step grids the kernels took, by kind ("q": forward, dQ, tangent; "kv": dK/dV)."""
    taken = []
    original = common.step_grid

    def recording(problem, kind, *args, **kwargs):
        grid = original(problem, kind, *args, **kwargs)
        taken.append((kind, grid.flat))
        return grid

    monkeypatch.setattr(common, "step_grid", recording)
    return taken


TILES = FlashConfig(backend="tpu_interpret", block_q=128, block_k=128, block_q_dq=128, block_k_dq=128,
                    block_q_dkv=128, block_k_dkv=128)


@pytest.mark.parametrize("case", ["causal_gqa_lengths", "window_in_place_bf16"])
def test_kernels_on_the_flattened_grid(case, grids):
    """Forward (out, lse), gradients and the jvp on flattened grids against float64 and the plain-jnp
    reference: causal GQA 2:1 with ragged T / S and per-batch lengths in float32 (transposed, the dK/dV grid
    walking two heads), and a two-sided window on one in-place block of 8 bfloat16 heads of dim 128."""
    if case == "causal_gqa_lengths":
        dtype, (q, k, v) = jnp.float32, random_qkv(40, 2, 300, 420, 2, 1, 64)
        kwargs = dict(causal=True, q_lengths=jnp.array([300, 170]), kv_lengths=jnp.array([420, 250]))
        allowed = numpy_allowed(2, 300, 420, causal=True, q_lengths=np.array([300, 170]),
                                kv_lengths=np.array([420, 250]))
    else:
        dtype, (q, k, v) = jnp.bfloat16, random_qkv(41, 1, 384, 384, 8, 8, 128, jnp.bfloat16)
        kwargs = dict(window=(150, 60))
        allowed = numpy_allowed(1, 384, 384, window=(150, 60))
    (out, lse), _ = check_gradients(
        lambda q, k, v: flash_attention(q, k, v, return_lse=True, config=TILES, **kwargs),
        lambda q, k, v: flash_attention_reference(q, k, v, return_lse=True, **kwargs), (q, k, v), dtype)
    assert {kind for kind, flat in grids if flat} == {"q", "kv"}
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed)
    assert_close(out, expected, dtype, "out")
    assert np.array_equal(np.isfinite(lse), np.isfinite(expected_lse))
    assert_close(finite(lse), finite(jnp.asarray(expected_lse, jnp.float32)), jnp.float32, "lse")

    tangents = random_qkv(42, *q.shape[:2], k.shape[1], q.shape[2], k.shape[2], q.shape[3], dtype)
    grids.clear()
    _, d_out = jax.jit(lambda p, t: jax.jvp(lambda *a: flash_attention(*a, config=TILES, **kwargs), p, t))(
        (q, k, v), tangents)
    _, expected_d_out = jax.jvp(lambda *a: flash_attention_reference(*a, **kwargs), (q, k, v), tangents)
    assert ("q", True) in grids
    assert_close(d_out, expected_d_out, dtype, "jvp", factor=2.0)
