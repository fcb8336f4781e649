"""Kernel choices for the flash-attention core: one frozen, hashable dataclass and its per-device defaults."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import jax

Backend = Literal["triton", "interpret", "mosaic", "mosaic_interpret"]

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
      warp specialisation; `_mosaic_forward.py`) where the call fits it (bfloat16 / float16, padded head
      dim 64, 128 or 256, no bias / dense mask / segments / dropout, tiles that are multiples of 128 x 64;
      windows too; flex calls when their score_mod and mask_mod use only ops with a Mosaic GPU lowering and
      read captured arrays only as scalars, and their `BlockMask` tiles are the kernel's), and the Mosaic
      dQ and dK/dV kernels for the backward of those calls at head dim 64 or 128 (with a score_mod, when
      its derivative lowers too); the Triton kernels for everything else. `"mosaic_interpret"`
      makes the same choices and runs both in their CPU interpreters. `None` picks from the default device
      (`default_backend`: "mosaic" on Hopper only with PROBJAX_MOSAIC=1 until it has run on a GPU).
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
        if self.backend not in (None, "triton", "interpret", "mosaic", "mosaic_interpret"):
            raise ValueError(
                f"FlashConfig.backend={self.backend!r} must be 'triton', 'interpret', 'mosaic', "
                "'mosaic_interpret' or None."
            )


MOSAIC_ENV = "PROBJAX_MOSAIC"  # "1": `backend=None` picks Mosaic GPU on Hopper


def default_backend() -> Backend:
    """The Pallas Triton lowering on NVIDIA GPUs, interpret mode everywhere else; on Hopper (compute
    capability 9.x) Mosaic GPU instead when the environment sets PROBJAX_MOSAIC=1.

    Mosaic GPU is opt-in until it has run on a GPU (docs/perf-notes.md); then this becomes the default on
    Hopper. Calls the Mosaic kernels cannot take run the Triton ones either way.
    """
    if jax.default_backend() != "gpu":
        return "interpret"
    if os.environ.get(MOSAIC_ENV, "0") == "1" and _is_hopper(jax.devices()[0]):
        return "mosaic"
    return "triton"


def _is_hopper(device) -> bool:
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def _fit_block(block: int, seq_len: int) -> int:
    """Shrink a block to the sequence (rounded up to a power of two, at least 16) so short inputs pad little."""
    return max(_MIN_BLOCK, min(block, 1 << max(seq_len - 1, 0).bit_length()))


def default_config(
    config: FlashConfig | None, *, q_len: int, kv_len: int, head_dim: int
) -> FlashConfig:
    """Fill the `None` fields of `config` with defaults for the backend, sequence lengths and padded head dim.

    GPU defaults follow the Triton flash-attention heuristics (JAX's Pallas example, tokamax): 128 x 64
    forward tiles with 4 warps up to head dim 64 and 8 above, 64 x 64 backward tiles; they shrink for head
    dim 256 to stay inside shared memory. Interpret mode favours large tiles: it pays per grid step.
    """
    config = config or FlashConfig()
    backend = config.backend or default_backend()
    if backend == "interpret":
        fwd_q, fwd_k, bwd_q, bwd_k, warps, stages = 128, 128, 128, 128, 4, 2
    elif head_dim <= 64:
        fwd_q, fwd_k, bwd_q, bwd_k, warps, stages = 128, 64, 64, 64, 4, 2
    elif head_dim <= 128:
        fwd_q, fwd_k, bwd_q, bwd_k, warps, stages = 128, 64, 64, 64, 8, 2
    else:
        fwd_q, fwd_k, bwd_q, bwd_k, warps, stages = 64, 32, 32, 32, 8, 1

    def pick(value: int | None, default: int, seq_len: int) -> int:
        return value if value is not None else _fit_block(default, seq_len)

    if backend in ("mosaic", "mosaic_interpret"):
        # The Mosaic forward's CTA: 128 query rows over two consumer warpgroups, 128-key steps (64 at head
        # dim 256, for shared memory), a 2-slot K/V ring. The backward keeps the Triton tiles.
        fwd_q, fwd_k, stages = 128, 128 if head_dim <= 128 else 64, 2
    return FlashConfig(
        block_q=pick(config.block_q, fwd_q, q_len),
        block_k=pick(config.block_k, fwd_k, kv_len),
        block_q_dkv=pick(config.block_q_dkv, bwd_q, q_len),
        block_k_dkv=pick(config.block_k_dkv, bwd_k, kv_len),
        block_q_dq=pick(config.block_q_dq, bwd_q, q_len),
        block_k_dq=pick(config.block_k_dq, bwd_k, kv_len),
        num_warps=config.num_warps if config.num_warps is not None else warps,
        num_stages=config.num_stages if config.num_stages is not None else stages,
        backend=backend,
    )
