"""The TPU figures the kernels plan with (`probjax_kernels.tpu.chips`): per-TensorCore figures matching JAX's own
table, the VMEM limit the in-place kernels ask for, and the forward step model against hand arithmetic."""

import pytest
from jax._src import tpu_info

from probjax_kernels.tpu import chips, tile_model

JAX_NAMES = {"v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "tpu7x": "7x"}


@pytest.mark.parametrize("name", sorted(chips.CHIPS))
def test_figures_match_jax_tpu_info(name):
    info = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion(JAX_NAMES[name]), 1)
    chip = chips.CHIPS[name]
    assert (chip.vmem, chip.mxu) == (info.vmem_capacity_bytes, info.mxu_column_size)
    assert chip.hbm_bandwidth == pytest.approx(info.mem_bw_bytes_per_second, rel=0.01)
    assert chip.bf16_flops == pytest.approx(info.bf16_ops_per_second, rel=0.01)
    assert chip.scoped_vmem <= chip.vmem_limit <= chip.vmem


def test_vmem_limits():
    assert {n: c.vmem_limit >> 20 for n, c in chips.CHIPS.items()} == {
        "v4": 16, "v5e": 32, "v5p": 32, "v6e": 64, "tpu7x": 48}


def test_forward_step_model():
    """v5e, 256 x 512 tile, 8 heads over 8 kv heads, head dim 128: 4 * 256 * 512 * 128 * 8 flops at 197 TFLOP/s
    and 2 * 512 * 128 * 8 bf16 values at 820 GB/s, plus 0.35 us."""
    cost = tile_model.step_cost(chips.CHIPS["v5e"], "forward", 256, 512, 8, 8, 128)
    assert cost.mxu_s == pytest.approx(4 * 256 * 512 * 128 * 8 / 197e12)
    assert cost.hbm_s == pytest.approx(2 * 512 * 128 * 8 * 2 / 820e9)
    assert cost.efficiency == pytest.approx(cost.mxu_s / (cost.mxu_s + 0.35e-6))
    one_head = tile_model.step_cost(chips.CHIPS["v5e"], "forward", 256, 512, 1, 1, 128)
    assert one_head.efficiency < 0.5 < cost.efficiency  # the step overhead a head block amortises
