"""The TPU generations the Mosaic TPU kernels plan for: per TensorCore, the figures their tile and layout
choices read (docs/perf-notes.md, "TPU tile model", shows the model and its sources).

- `vmem`, `mxu`, `hbm_bandwidth`, `bf16_flops`: jax 0.11.2's own table (`jax._src.tpu_info`, the figures
  Pallas' TPU ops plan with; they match the Cloud TPU system-architecture pages: v5e 197 TFLOP/s bf16 and
  819 GB/s per chip, v6e 918 TFLOP/s and 1,640 GB/s, TPU7x 4.6 PFLOP/s fp8 and 7.4 TB/s per chip of two
  TensorCores).
- `scoped_vmem`: the VMEM a kernel's pipelined blocks may take without raising `vmem_limit_bytes`, as libtpu
  0.0.48.1's deviceless compile enforces it ("Scoped allocation with size 20.00M and limit 16.00M" on v5e /
  v5p; 20 MiB passes and 40 MiB fails on v6e and TPU7x, which the table takes as 32 MiB like v6e).
- `megacore`: whether one device is two TensorCores that split a kernel's "parallel" grid axes between them
  (v4, v5p; `jax._src.tpu_info`'s table: TPU7x's two cores are two devices).
- `STEP_OVERHEAD_S`: the fixed cost of one grid step of a pipelined Pallas TPU kernel, about 0.35 us (the
  Pallas TPU pipelining guide), which every step pays, idle or not.
"""

from __future__ import annotations

import dataclasses

STEP_OVERHEAD_S = 0.35e-6


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TensorCore of a TPU generation."""

    name: str
    scoped_vmem: int  # bytes
    vmem: int  # bytes
    mxu: int  # the MXU's side: 128 x 128 before v6e, 256 x 256 from v6e
    hbm_bandwidth: float  # bytes / s
    bf16_flops: float  # flop / s
    megacore: bool = False

    @property
    def vmem_limit(self) -> int:
        """The `vmem_limit_bytes` the in-place kernels ask for (`common.SeqLayout`): twice the default scoped
        limit, at most 3/4 of the core's VMEM, never under the default (v4's 16 MiB of VMEM keeps 16)."""
        return max(self.scoped_vmem, min(2 * self.scoped_vmem, self.vmem * 3 // 4))

    @property
    def balance(self) -> float:
        """bf16 flops per HBM byte at which a kernel stops being bandwidth bound."""
        return self.bf16_flops / self.hbm_bandwidth


MIB = 1 << 20
CHIPS = {
    "v4": Chip("v4", 16 * MIB, 16 * MIB, 128, 615e9, 137.5e12, megacore=True),
    "v5e": Chip("v5e", 16 * MIB, 128 * MIB, 128, 820e9, 197e12),
    "v5p": Chip("v5p", 16 * MIB, 64 * MIB, 128, 1230e9, 229.5e12, megacore=True),
    "v6e": Chip("v6e", 32 * MIB, 128 * MIB, 256, 1640e9, 920e12),
    "tpu7x": Chip("tpu7x", 32 * MIB, 64 * MIB, 256, 3700e9, 1155e12),
}


def tpu_generation(device) -> str:
    """"v4", "v5e", "v5p", "v6e" or "tpu7x" from a TPU device's kind ("TPU v5 lite", "TPU v6 lite", "TPU7x",
    ...); "v5e" for anything else (the interpreter, unknown kinds)."""
    kind = str(getattr(device, "device_kind", "")).lower()
    if "tpu7" in kind or "v7" in kind:
        return "tpu7x"
    if "v6" in kind:
        return "v6e"
    if "v5" in kind:
        return "v5e" if ("lite" in kind or "v5e" in kind) else "v5p"
    return "v4" if "v4" in kind else "v5e"


def target_chip(backend: str) -> Chip:
    """The chip a call with `FlashConfig.backend` compiles for: v5e in TPU interpret mode, else the target
    device's generation."""
    if backend == "tpu_interpret":
        return CHIPS["v5e"]
    from probjax_kernels._backend import target_device

    return CHIPS[tpu_generation(target_device())]
