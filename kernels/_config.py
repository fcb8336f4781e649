"""Kernel choices for the flash-attention core: one frozen, hashable dataclass. Its per-device defaults
(`default_backend`, `default_config`) are in `_dispatch.py`, with the rest of the choice of backend."""

from __future__ import annotations

import dataclasses
from typing import Literal

Backend = Literal["triton", "interpret", "mosaic", "mosaic_interpret", "tpu", "tpu_interpret"]
# The interpreters that run kernels through ordered IO callbacks (effects a `jit` threads a token through).
CALLBACK_INTERPRETERS = ("mosaic_interpret", "tpu_interpret")

_MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16.


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Block sizes and launch parameters of the flash-attention kernels.

    Every block size is a power of two >= 16; the wrapper pads sequences to a multiple of the block and never
    asks the caller to. `None` fields are filled by `default_config` for the current device and problem size.

    **Arguments:**

    - `block_q`, `block_k`: query / key tile of the forward kernel.
    - `block_q_dkv`, `block_k_dkv`: tiles of the backward dK/dV kernel (K/V resident, loop over Q tiles).
    - `block_q_dq`, `block_k_dq`: tiles of the backward dQ kernel (Q resident, loop over K/V tiles).
    - `num_warps`, `num_stages`: Triton launch parameters (ignored in interpret mode).
    - `backend`: `"triton"` (Pallas Triton lowering, NVIDIA GPUs), `"interpret"` (Pallas interpret mode,
      any device, used on the CPU) or `"mosaic"`: the forward in Pallas Mosaic GPU for Hopper (wgmma, TMA,
      warp specialisation; `mosaic/forward.py`) where the call fits it (bfloat16 / float16, padded head
      dims 64, 128 or 256 (v's may differ), segment ids, dropout below head dim 256, dense masks (per-head key /
      query ones, and key masks beside segment ids, as a 0 / -inf bias: not beside a score_mod or a bias), k /
      v of batch 1, a dense bias (not float32 tiles at head dim 256), tiles that are multiples of 128 x 64;
      windows too; flex calls when their score_mod and mask_mod use only ops with a Mosaic GPU lowering and
      read captured arrays only as scalars or at exactly q_idx / kv_idx (`document_mask`), and their
      `BlockMask` tiles are the kernel's), and the Mosaic
      dQ and dK/dV kernels for the backward of those calls at head dims 64 or 128 (a bias's gradient too;
      with a score_mod, when its derivative lowers too); the Triton kernels for everything else. `"mosaic_interpret"`
      makes the same choices and runs both in their CPU interpreters. `None` picks from the default device
      (`default_backend`: "mosaic" on Hopper only with PROBJAX_MOSAIC=1 until it has run on a GPU).
      `"tpu"`: the Pallas Mosaic TPU kernels (`kernels/tpu/`) for forward, backward and tangent; what they
      cannot take (a hook with an op Mosaic TPU cannot lower, or that reads a captured array other than one
      element at a time) runs the XLA path with a warning. `"tpu_interpret"` runs them in Pallas' TPU
      interpret mode on any machine. TPU tiles are multiples of 128; `None` picks "tpu" on a TPU device.
    - `fused_backward`: the Mosaic TPU backward as one kernel (dQ accumulated in HBM by the dK/dV kernel's
      walk: 5 tile matmuls a tile pair against the two kernels' 7, deterministic) rather than a dQ and a dK/dV
      kernel; calls that give a bias or a hook array a gradient take the two kernels. `None`: the TPU tile
      model's choice for the generation, at head dims that are multiples of 128 (`tpu/plan.py`,
      `default_fused_backward`). The GPU backends ignore it.
    """

    block_q: int | None = None
    block_k: int | None = None
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    backend: Backend | None = None
    fused_backward: bool | None = None

    def __post_init__(self):
        for field in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, int) or value < _MIN_BLOCK or value & (value - 1):
                raise ValueError(f"FlashConfig.{field}={value!r} must be a power of two >= {_MIN_BLOCK}.")
        for field in ("num_warps", "num_stages"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"FlashConfig.{field}={value!r} must be a positive int.")
        if self.fused_backward not in (None, True, False):
            raise TypeError(f"FlashConfig.fused_backward={self.fused_backward!r} must be True, False or None.")
        if self.backend not in (None, "triton", "interpret", "mosaic", "mosaic_interpret", "tpu", "tpu_interpret"):
            raise ValueError(
                f"FlashConfig.backend={self.backend!r} must be 'triton', 'interpret', 'mosaic', "
                "'mosaic_interpret', 'tpu', 'tpu_interpret' or None."
            )


def fit_block(block: int, seq_len: int) -> int:
    """Shrink a block to the sequence (rounded up to a power of two, at least 16) so short inputs pad little."""
    return max(_MIN_BLOCK, min(block, 1 << max(seq_len - 1, 0).bit_length()))
