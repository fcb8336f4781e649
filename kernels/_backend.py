"""The one protocol every backend keeps (Triton, Mosaic GPU, Mosaic TPU, the XLA path), and the frozen plan of
one call that `_dispatch.plan` assembles from them.

A backend is one object (`triton.BACKEND`, `mosaic.BACKEND`, `tpu.BACKEND`, `xla.BACKEND`) that answers, for a
call's static `_Problem` on a target device:

- `defaults`: its tiles for the `None` fields of a `FlashConfig` (before the problem exists: the tiles set the
  padding), over those of the backends after it in the order;
- `hook_shapes`: the (b, h, q_idx, kv_idx, score) shapes at which its kernels call the hooks, traced before it
  vets them;
- `unsupported`: why it runs no pass of this call (None: it runs some);
- `coarsens_block_masks` (optional, default False): its kernels walk a BlockMask's tables on tiles coarser
  than the blocks when the mask_mod is exact (`Features.exact_mask_mod`), so `_dispatch.plan` keeps its tiles
  instead of shrinking them to the blocks;
- `plan`: which passes it runs and how (`Passes`: each pass a kernel entry of its folder, the `_Problem` on
  that kernel's tiles and the entry's options), and any further hook shapes of kernels it retiles for the call.

`_autodiff` then runs `Plan.forward` / `backward` / `tangent` and asks nothing more.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax

from probjax_kernels._config import FlashConfig
from probjax_kernels._problem import _Problem


def target_device():
    """The device a call compiles for: `jax.default_device`'s when one is set (deviceless ahead-of-time
    compilation sets it to a topology device: scripts/compile/report.py), else the first device of the default
    backend. The one answer to "which device" in probjax_kernels and, through `layer_api`, probjax_nn."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def target_platform() -> str:
    """The platform of `target_device()` ("gpu", "tpu", "cpu"): the default backend's when no default device
    is set."""
    return jax.default_backend() if jax.config.jax_default_device is None else target_device().platform


def config_backend(config: FlashConfig | None) -> str:
    """What a call's kernels run on, as far as a front-end needs to know it: `config.backend` when set, else
    "interpret" off a GPU or TPU (the default there, `_dispatch.default_backend`), else the platform's name
    ("gpu", "tpu"; `_dispatch` picks that platform's backend). Front-ends ask this, not `_dispatch`, whether
    their kernels run in a CPU interpreter (`ring_attention`'s autodiff, a call inside a check_vma
    shard_map)."""
    if config is not None and config.backend is not None:
        return config.backend
    platform = target_platform()
    return platform if platform in ("gpu", "tpu") else "interpret"


def compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device's compute capability; None for other devices."""
    try:
        major, minor = (int(x) for x in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        return None
    return major, minor


def is_hopper(device) -> bool:
    """Compute capability 9.x (H100 / H200): the GPUs the Mosaic GPU kernels target (wgmma, TMA)."""
    capability = compute_capability(device)
    return capability is not None and capability[0] == 9


# The compute capabilities whose tensor cores take a matmul per warpgroup or per CTA with at least 64 rows: wgmma
# on 9.x (H100 / H200), tcgen05 with tensor memory on 10.x (B200 / GB200, B300). Triton emits mma.sync (HMMA)
# for a dot with fewer rows there, and for every dot on 8.x (A100, RTX 30 / 40, L4 / L40S) and on 12.x (RTX 50,
# RTX PRO 6000 Blackwell, GB10: consumer Blackwell has mma.sync only, and 99 KB of shared memory per block).
WIDE_MMA_MAJORS = {9: "wgmma", 10: "tcgen05"}


def wide_mma(device) -> str | None:
    """The wide tensor-core instruction of a CUDA device ("wgmma" on 9.x, "tcgen05" on 10.x), or None (mma.sync
    only, or not a CUDA device): where it is not None, the Triton tile rules keep every dot at 64 rows or more
    (`triton.plan._triton_tiles`)."""
    capability = compute_capability(device)
    return None if capability is None else WIDE_MMA_MAJORS.get(capability[0])


def is_consumer_blackwell(device) -> bool:
    """Compute capability 12.x (RTX 50, RTX PRO 6000 Blackwell, GB10): mma.sync and 99 KB of shared memory per
    block, as sm_86, where ptxas allocates registers differently (`triton.plan._consumer_blackwell_tiles`)."""
    capability = compute_capability(device)
    return capability is not None and capability[0] == 12


@dataclasses.dataclass(frozen=True)
class KernelPass:
    """One pass of a call as a backend plans it: `run(problem, *arrays, **dict(options))`.

    `run` is a kernel entry of the backend's folder (forward: `(problem, q, k, v, q_len, kv_len, optional)`;
    backward: `(problem, tangents, res, d_out, d_lse)`; tangent: `(problem, tangents, q, k, v, q_len, kv_len,
    out, lse2, linear, optional)`), `problem` the call on that kernel's tiles, `options` hashable keyword
    arguments of the entry (a split count, a second kernel's problem)."""

    run: Callable
    problem: _Problem
    options: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Passes:
    """What one backend runs of a call: a pass it leaves to the next backend in order is None. `hook_shapes`:
    the (b, h, q_idx, kv_idx, score) shapes at which kernels it retiled for the call call score_mod / mask_mod,
    beyond its `Backend.hook_shapes` on the call's own tiles."""

    forward: KernelPass | None = None
    backward: KernelPass | None = None
    tangent: KernelPass | None = None
    hook_shapes: tuple[tuple, ...] = ()


class Backend(Protocol):
    """The protocol of a backend object (see the module docstring)."""

    name: str  # for messages: "Triton", "Mosaic GPU", "Mosaic TPU", "XLA"
    configs: tuple[str, ...]  # the `FlashConfig.backend` values it serves first
    warns_when_declining: bool  # a call it cannot take runs elsewhere with a warning (Mosaic TPU -> XLA)

    def defaults(self, config: FlashConfig, filled: FlashConfig | None, *, q_len: int, kv_len: int, head_dim: int,
                 dtype, device) -> FlashConfig | None: ...

    def hook_shapes(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> list[tuple]: ...

    def unsupported(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> str | None: ...

    def plan(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> Passes: ...


@dataclasses.dataclass(frozen=True)
class Plan:
    """The frozen plan of one call (the static argument of `_autodiff`'s custom_jvp): the padded sizes, the
    call's `_Problem` (the XLA passes beside the kernels read it), and the kernel pass run for each of forward,
    backward and tangent, each chosen from the first backend in the device's order that runs it."""

    problem: _Problem
    t_pad: int
    s_pad: int
    d_pad: int
    dv_pad: int
    forward: KernelPass
    backward: KernelPass
    tangent: KernelPass
