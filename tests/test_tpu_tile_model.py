"""The TPU tile model (`probjax_kernels.tpu.tile_model`): step costs against hand arithmetic, causal step counts
against a mask built from first principles, and the tiles `plan.TILES` holds being the model's pick: the
smallest of the tiles within the tolerance of the fastest, every one of which fits the VMEM budgets."""

import itertools

import numpy as np
import pytest

from probjax_kernels.tpu import chips, common, plan, tile_model

SMALL = tile_model.Seed(seq_len=2048)


def test_step_costs_by_hand():
    """v6e (256-wide MXU), 8 heads over 2, head dim 128: dQ runs 3 matmuls and fetches K and V; dK/dV runs 4
    and fetches Q, dO and two float32 rows per query head; a 128-row tile fills half the MXU."""
    v6e = chips.CHIPS["v6e"]
    dq = tile_model.step_cost(v6e, "dq", 512, 256, 8, 2, 128)
    assert dq.mxu_s == pytest.approx(3 * 2 * 512 * 256 * 128 * 8 / 920e12)
    assert dq.hbm_s == pytest.approx(2 * 256 * 128 * 2 * 2 / 1640e9)
    dkv = tile_model.step_cost(v6e, "dkv", 128, 512, 8, 2, 128)
    assert dkv.mxu_s == pytest.approx(4 * 2 * 128 * 512 * 128 * 8 / (920e12 * 0.5))
    assert dkv.hbm_s == pytest.approx((2 * 128 * 128 * 8 * 2 + 2 * 128 * 4 * 8) / 1640e9)
    assert dkv.time_s == pytest.approx(max(dkv.mxu_s, dkv.hbm_s) + chips.STEP_OVERHEAD_S)


@pytest.mark.parametrize("kernel", tile_model.KERNELS)
@pytest.mark.parametrize("tile", [(256, 512), (512, 256), (1024, 128)])
def test_causal_steps_are_the_visible_tile_pairs(kernel, tile):
    t = SMALL.seq_len
    rows, cols = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = (cols <= rows).reshape(t // tile[0], tile[0], t // tile[1], tile[1]).any(axis=(1, 3))
    cost = tile_model.step_cost(chips.CHIPS["v5e"], kernel, *tile, SMALL.heads, SMALL.heads, SMALL.head_dim)
    causal = tile_model.grid_time(chips.CHIPS["v5e"], kernel, tile, True, SMALL)
    full = tile_model.grid_time(chips.CHIPS["v5e"], kernel, tile, False, SMALL)
    assert causal == pytest.approx(int(visible.sum()) * cost.time_s)
    assert full == pytest.approx(visible.size * cost.time_s)


@pytest.mark.parametrize("name", sorted(chips.CHIPS))
def test_plan_tiles_are_the_models_pick(name):
    chip = chips.CHIPS[name]
    tiles = plan.TILES[name]
    assert tiles == tile_model.chosen_tiles()[name]
    for n, kernel in enumerate(tile_model.KERNELS):
        picked = tiles[2 * n:2 * n + 2]
        found = dict(tile_model.candidates(chip, kernel))
        assert picked in found and tile_model.fits(chip, kernel, picked)
        fastest = min(found.values())
        assert found[picked] <= fastest * (1 + tile_model.TOLERANCE)
        smaller = [t for t, s in found.items() if t[0] * t[1] < picked[0] * picked[1]]
        assert all(found[t] > fastest * (1 + tile_model.TOLERANCE) for t in smaller)
        unfit = [t for t in itertools.product(tile_model.SIDES, repeat=2) if t not in found]
        for t in unfit:  # left out only for VMEM
            worst = common.kernel_vmem(kernel, 1, 1, t, (256, 256), 4)
            in_place = common.kernel_vmem(kernel, 8, 8, t, (128, 128), 2)
            assert in_place > chip.vmem_limit * 3 // 4 or 2 * worst > chip.scoped_vmem


def test_the_seed_program_stays_in_place_on_the_picked_tiles():
    """8 bfloat16 heads of dim 128 keep the in-place layout on every generation's picked tiles."""

    class Problem:  # what the layout reads of a call
        table_shape = None
        features = type("F", (), {"score_mod": None, "mask_mod": None})()
        config = None

    for name, tiles in plan.TILES.items():
        budget = chips.CHIPS[name].vmem_limit * 3 // 4
        for n, kernel in enumerate(tile_model.KERNELS):
            layout = common.seq_layout(Problem, 8, 8, (128, 128), "bfloat16", kernel, tiles[2 * n:2 * n + 2], False,
                                       budget)
            assert layout.heads == 8, (name, kernel)
