"""The TPU tile model, and the tiles it picks per generation (`chosen_tiles`; docs/perf-notes.md, "The TPU
tile model", has the figures and their sources).

One grid step of a kernel on a (rows, keys) tile, for a program of `heads` query heads over `kv_heads` K / V
heads, costs max(MXU time, HBM time) + the fixed step overhead (`chips.STEP_OVERHEAD_S`):

- forward: 2 matmuls (QK^T, PV) of 2 rows keys D flops per head; fetches the K and V tiles of the kv heads.
- dQ: 3 matmuls (QK^T, dO V^T, dS K); fetches the K and V tiles.
- dK/dV (the program holds `keys`, a step walks `rows` queries): 4 matmuls (KQ^T, V dO^T, P^T dO, dS^T Q);
  fetches the Q and dO tiles of the query heads and their lse / delta rows.

The MXU runs at its bf16 peak when both tile sides fill it (a side under the MXU's leaves a share idle). A
kernel's time over a T x T grid is its steps times that, counting only the steps a causal grid visits (the
flattened grid, `common.step_grid`), so a larger tile pays for its wasted diagonal work and gains on the step
overhead. The tiles picked are the fastest, over a causal and a full grid at the reference program (`SEED`),
among those whose blocks fit: the seed program in place within 3/4 of the VMEM limit the in-place kernels ask
for (the budget of `common.seq_layout`), and the worst transposed call (float32, head dim 256) within twice
`common.kernel_vmem` of the default scoped VMEM (float32 matmuls keep multi-pass temporaries the model leaves
out: 1.5-1.8x measured). Of tiles within `TOLERANCE` of the fastest, the smallest (less padding on short or
ragged sequences) wins. The same model picks the backward: one fused kernel (`fused_backward.py`) where it
beats the dQ and dK/dV kernels by more than `TOLERANCE`, its extra HBM traffic outside the steps counted
(`fused_backward_pays`).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from probjax_kernels.tpu import common
from probjax_kernels.tpu.chips import CHIPS, STEP_OVERHEAD_S, Chip

SIDES = (128, 256, 512, 1024)
TOLERANCE = 0.01
KERNELS = ("forward", "dq", "dkv")


@dataclasses.dataclass(frozen=True)
class Seed:
    """The program the tiles are chosen for: the modules' `[B, T, N, D]` layout in place, bfloat16."""

    seq_len: int = 8192
    heads: int = 8
    head_dim: int = 128
    itemsize: int = 2


SEED = Seed()


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The model's cost of one grid step: MXU time, HBM time of the blocks it fetches, and the share of the
    step spent on the MXU once the fixed step overhead is added (1.0: compute bound, no overhead)."""

    mxu_s: float
    hbm_s: float

    @property
    def time_s(self) -> float:
        return max(self.mxu_s, self.hbm_s) + STEP_OVERHEAD_S

    @property
    def efficiency(self) -> float:
        return self.mxu_s / self.time_s


def step_cost(chip: Chip, kernel: str, rows: int, keys: int, heads: int, kv_heads: int, head_dim: int,
              itemsize: int = 2) -> StepCost:
    """One step of `kernel` ("forward", "dq", "dkv") on a (rows, keys) tile."""
    matmuls = {"forward": 2, "dq": 3, "dkv": 4}[kernel]
    flops = matmuls * 2 * rows * keys * head_dim * heads
    if kernel == "dkv":
        fetched = 2 * rows * head_dim * heads * itemsize + 2 * rows * 4 * heads
    else:
        fetched = 2 * keys * head_dim * kv_heads * itemsize
    fill = min(1.0, min(rows, keys) / chip.mxu)
    return StepCost(flops / (chip.bf16_flops * fill), fetched / chip.hbm_bandwidth)


def grid_time(chip: Chip, kernel: str, tile: tuple[int, int], causal: bool, seed: Seed = SEED) -> float:
    """Seconds of one seed program's `kernel` over a T x T grid of `tile`, causal (the steps the flattened
    grid visits) or full."""
    rows, keys = tile
    kind = "kv" if kernel == "dkv" else "q"
    steps = seed.seq_len // (rows if kind == "kv" else keys)
    if causal:
        lo, hi = common.full_length_ranges(kind, tile, (seed.seq_len, seed.seq_len), (None, 0), steps)
        visits = int(np.maximum(hi - lo, 1).sum())
    else:
        visits = (seed.seq_len // rows) * (seed.seq_len // keys)
    cost = step_cost(chip, kernel, rows, keys, seed.heads, seed.heads, seed.head_dim, seed.itemsize)
    return visits * cost.time_s


def fits(chip: Chip, kernel: str, tile: tuple[int, int], seed: Seed = SEED) -> bool:
    """Whether `tile` keeps the seed program in place and the worst transposed call within the scoped VMEM."""
    dims = (seed.head_dim, seed.head_dim)
    in_place = common.kernel_vmem(kernel, seed.heads, seed.heads, tile, dims, seed.itemsize)
    worst = common.kernel_vmem(kernel, 1, 1, tile, (256, 256), 4)
    return in_place <= chip.vmem_limit * 3 // 4 and 2 * worst <= chip.scoped_vmem


def candidates(chip: Chip, kernel: str, seed: Seed = SEED) -> list[tuple[tuple[int, int], float]]:
    """(tile, modelled seconds over a causal plus a full grid) of every tile that fits, fastest first."""
    found = [(tile, grid_time(chip, kernel, tile, True, seed) + grid_time(chip, kernel, tile, False, seed))
             for tile in itertools.product(SIDES, SIDES) if fits(chip, kernel, tile, seed)]
    return sorted(found, key=lambda x: x[1])


def pick(chip: Chip, kernel: str, seed: Seed = SEED) -> tuple[int, int]:
    """The smallest tile within `TOLERANCE` of the fastest that fits."""
    found = candidates(chip, kernel, seed)
    best = found[0][1]
    return min((tile for tile, time in found if time <= best * (1 + TOLERANCE)), key=lambda t: (t[0] * t[1], t))


def chosen_tiles() -> dict[str, tuple[int, ...]]:
    """Per generation: (forward q, forward k, dQ q, dQ k, dK/dV q, dK/dV k), as `plan.TILES` holds them."""
    return {name: tuple(side for kernel in KERNELS for side in pick(chip, kernel)) for name, chip in CHIPS.items()}


def fused_step(chip: Chip, rows: int, keys: int, seed: Seed = SEED) -> float:
    """Seconds of one step of the fused backward (`fused_backward.py`) on a (rows, keys) dK/dV tile: the
    dK/dV step's fetches and a fifth matmul (dS^T K), plus reading its query tile's float32 dQ rows (during
    the matmuls) and writing them back (waited for, after them)."""
    cost = step_cost(chip, "dkv", rows, keys, seed.heads, seed.heads, seed.head_dim, seed.itemsize)
    dq_rows_s = rows * seed.head_dim * seed.heads * 4 / chip.hbm_bandwidth
    return max(cost.mxu_s * 5 / 4, cost.hbm_s + dq_rows_s) + dq_rows_s + STEP_OVERHEAD_S


def fused_xla_s(chip: Chip, seed: Seed = SEED) -> float:
    """Seconds of the HBM traffic the fused backward adds outside its steps, per program, against the two
    kernels: its dQ rows zeroed at the program's first step; in XLA, delta from O and dO (the dQ kernel reads
    O itself), the float32 dQ (already in `[B, T, N, D]` in the seed's in-place layout) read, scaled and cast
    (the compile report's XLA-side bytes measured this traffic: docs/perf-notes.md, Version 17)."""
    values, itemsize = seed.seq_len * seed.head_dim * seed.heads, seed.itemsize
    fused = 4 + 2 * itemsize + 4 + itemsize
    two_kernels = 2 * itemsize  # the dQ kernel reads O, writes dQ
    return values * (fused - two_kernels) / chip.hbm_bandwidth


def backward_times(chip: Chip, tiles: tuple[int, ...], seed: Seed = SEED) -> tuple[float, float]:
    """(fused, two kernels): modelled seconds of one seed program's backward over a causal plus a full grid,
    on `tiles` (`plan.TILES`' layout; the fused kernel takes the dK/dV tile)."""
    dkv = tiles[4:6]
    step = step_cost(chip, "dkv", *dkv, seed.heads, seed.heads, seed.head_dim, seed.itemsize).time_s
    fused = sum(grid_time(chip, "dkv", dkv, causal, seed) / step * fused_step(chip, *dkv, seed)
                + fused_xla_s(chip, seed) for causal in (True, False))
    two = sum(grid_time(chip, kernel, tiles[2 * n:2 * n + 2], causal, seed)
              for n, kernel in ((1, "dq"), (2, "dkv")) for causal in (True, False))
    return fused, two


def fused_backward_pays(chip: Chip, tiles: tuple[int, ...], seed: Seed = SEED) -> bool:
    """Whether the fused backward beats the dQ and dK/dV kernels by more than `TOLERANCE` (`backward_times`);
    within it, the two kernels (no float32 dQ in HBM, less HBM temp) stay."""
    fused, two = backward_times(chip, tiles, seed)
    return fused < two * (1 - TOLERANCE)
