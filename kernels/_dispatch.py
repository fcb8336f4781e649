"""Which backend runs a call, and on which tiles: the one place that chooses between the Triton kernels, the
Mosaic GPU ones and the Mosaic TPU ones, and that routes `_autodiff`'s forward, backward and tangent to them.

- `default_backend`: what `FlashConfig.backend=None` means on this device; `default_config` fills the other
  `None` fields with that backend's tiles.
- `_mosaic_takes`, `_fits_mosaic`, `_mosaic_backward_tiles`: per call, whether the Mosaic GPU kernels take
  its forward and its backward (dtype, head dim, tiles, features, shared memory), with `_is_mosaic_hook` /
  `_runs_in_mosaic` vetting a score_mod / mask_mod for a Mosaic GPU lowering.
- `triton_forward_config`, `triton_backward_configs`, `tangent_config`, `tangent_value_splits`: per call, the
  Triton kernels' configs where a feature (a gathered table, a window, dropout, GQA, a BlockMask, a dense bias)
  spills on `default_config`'s; `triton_dkv_transposed`, `triton_dkv_per_query_head` and `triton_dkv_split`:
  the dK/dV kernel's orientation and program grid.
- `forward`, `backward`, `tangent`: run the chosen kernels. Whatever the Mosaic GPU kernels cannot take runs
  on Triton (Pallas interpret mode on the CPU); the tangent always does. On the TPU backends ("tpu" on a
  TPU device, "tpu_interpret") the Mosaic TPU kernels (`kernels/tpu/`) run forward, backward and tangent,
  on `_TPU_TILES` per generation; what `tpu.unsupported` names runs the XLA path of `_chunked` with a
  warning, never a GPU kernel.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu import core as mosaic_gpu_core  # the Mosaic GPU lowering rules, to vet hooks
from jax._src.pallas.mosaic_gpu import lowering as mosaic_lowering
from jax.extend import core as jex_core

from probjax_kernels import _chunked, tpu
from probjax_kernels._config import _MIN_BLOCK, Backend, FlashConfig
from probjax_kernels._decode_inputs import DecodeConfig, DecodeInputs
from probjax_kernels._hooks import Hook, tile_hook_shapes
from probjax_kernels._problem import _interpreted, _Problem, _Tangents
from probjax_kernels._tiles import refined_tables
from probjax_kernels.mosaic import glue as mosaic_glue
from probjax_kernels.mosaic.backward import dkv_smem_bytes, dq_smem_bytes
from probjax_kernels.mosaic.common import PART as MOSAIC_PART
from probjax_kernels.mosaic.common import SMEM_BYTES as MOSAIC_SMEM_BYTES
from probjax_kernels.mosaic.common import mosaic_backward_hook_shapes, mosaic_hook_shapes
from probjax_kernels.mosaic.forward import smem_bytes as mosaic_smem_bytes
from probjax_kernels.tpu import decode as tpu_decode
from probjax_kernels.triton import backward as triton_backward
from probjax_kernels.triton import decode as triton_decode
from probjax_kernels.triton import forward as triton_forward
from probjax_kernels.triton import retile as triton_retile
from probjax_kernels.triton import tangent as triton_tangent

MOSAIC_BACKWARD_HEAD_DIMS = (64, 128)  # the Mosaic dK/dV kernel's; D = 256 keeps the Triton backward


# ------------------------------------------------------------------------------------------ device defaults


MOSAIC_ENV = "PROBJAX_MOSAIC"  # "1": `backend=None` picks Mosaic GPU on Hopper


def target_device():
    """The device a call compiles for: `jax.default_device`'s when one is set (deviceless ahead-of-time
    compilation for a GPU sets it to a topology device: scripts/compile/report.py), else the first device of
    the default backend."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def default_backend() -> Backend:
    """The Pallas Triton lowering on NVIDIA GPUs, interpret mode everywhere else; on Hopper (compute
    capability 9.x) Mosaic GPU instead when the environment sets PROBJAX_MOSAIC=1. The device is
    `target_device()`.

    Mosaic GPU is opt-in until it has run on a GPU (docs/perf-notes.md); then this becomes the default on
    Hopper. Calls the Mosaic kernels cannot take run the Triton ones either way.
    """
    device = target_device()
    platform = jax.default_backend() if jax.config.jax_default_device is None else device.platform
    if platform == "tpu":
        return "tpu"
    if platform != "gpu":
        return "interpret"
    if os.environ.get(MOSAIC_ENV, "0") == "1" and _is_hopper(device):
        return "mosaic"
    return "triton"


def _is_hopper(device) -> bool:
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def _fit_block(block: int, seq_len: int) -> int:
    """Shrink a block to the sequence (rounded up to a power of two, at least 16) so short inputs pad little."""
    return max(_MIN_BLOCK, min(block, 1 << max(seq_len - 1, 0).bit_length()))


# Shared memory one CTA may opt in to, by compute capability (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"); unknown capabilities count as the smallest of these.
_SMEM_PER_BLOCK = {(7, 0): 98_304, (7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912,
                   (8, 9): 101_376, (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376}
_LARGE_SMEM = 160 * 1024  # A100 / H100 class (163 / 227 KB per CTA) versus the RTX 30 / 40 class (99 KB)


def smem_per_block(device=None) -> int:
    """Shared memory per CTA (opt-in) of the target device's compute capability, in bytes."""
    device = device if device is not None else target_device()
    try:
        major, minor = (int(x) for x in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        return min(_SMEM_PER_BLOCK.values())
    return _SMEM_PER_BLOCK.get((major, minor), min(_SMEM_PER_BLOCK.values()))


def _triton_tiles(head_dim: int, large_smem: bool, hopper: bool = False) -> tuple[int, ...]:
    """(fwd q, fwd k, dK/dV q, dK/dV k, dQ q, dQ k, warps, stages) of the Triton kernels on a GPU, chosen from
    the compile report (docs/compile/index.md; the figures behind each choice are in docs/perf-notes.md):
    no spill and within shared memory on sm_90a, sm_80 and sm_86 (but for the capped entries of
    scripts/compile/rules.py). On Hopper (`hopper`) the backward tiles are the ones whose every dot has at
    least 64 rows, wgmma's M per warpgroup (Triton emits mma.sync below it): 8 warps at 129-255 registers run
    one CTA per SM either way (65,536 registers / 256 threads), so the tiles may use up to 255 without
    spilling."""
    if head_dim <= 64:
        return 128, 64, 64, 64, 64, 64, 4, 2
    if head_dim <= 128:
        if hopper:
            # dK/dV at 64 x 64 on transposed scores (`triton_dkv_transposed`): all four dots wgmma, 208-255
            # registers, no spill (Q K^T at 64 x 64 spilled 96 B with GQA 8 -> 2; 32-query steps on Q K^T
            # were mma.sync for S / dP).
            return 128, 64, 64, 64, 64, 64, 8, 2
        if large_smem:
            # sm_80: dK/dV at 32 x 64 (64 x 64 spilled 96 B on sm_90a with GQA 8 -> 2, before the Hopper tiles).
            return 128, 64, 32, 64, 64, 64, 8, 2
        # 99 KB (sm_86): 64 x 64 backward tiles need 107,008 B; 32-query steps in both backward kernels fit
        # (86,272 B dK/dV, 53,248 B dQ), and unlike 64 x 32 dK/dV tiles do not spill with GQA.
        return 128, 64, 32, 64, 32, 64, 8, 2
    if hopper:
        # Head dim 256 on Hopper: dQ at 64 x 32 is all wgmma (184-186 registers) with 2 stages, and spills
        # 16-20 B with 1. dK/dV at 16 queries x 64 keys on transposed scores (`triton_dkv_transposed`): every
        # dot's M is the 64-key tile, so all wgmma, 252 registers, no spill; dK and dV are 64 x 256 float32
        # accumulators (128 registers of 255), so 32-query steps spilled 8-56 B and 64 x 64 272-420 B.
        return 64, 32, 16, 64, 64, 32, 8, 2
    # Head dim 256: dQ at 32 x 32 spills on sm_86 (16 x 32 does not).
    return (64, 32, 32, 32, 32, 32, 8, 1) if large_smem else (64, 32, 32, 32, 16, 32, 8, 1)


def _triton_tiles_float32(head_dim: int) -> tuple[int, ...]:
    """The Triton tiles for float32 inputs. Their dots run at Precision.HIGHEST, which Pallas Triton lowers to
    FMA loops holding both operand tiles in registers (no tensor cores): at the 16-bit tiles every kernel
    spills 1.6-42 KB per thread (docs/compile/index.md). These are the tiles at which the kernels' float32
    paths (dK/dV reads K / V per step and slices its score dots, `triton/backward.py`) do not spill on
    sm_90a / sm_80 / sm_86 but for the capped cases of scripts/compile/rules.py (docs/perf-notes.md).
    3xTF32 dots were worse."""
    if head_dim <= 64:
        return 32, 32, 32, 16, 32, 32, 8, 1
    if head_dim <= 128:
        return 32, 16, 16, 16, 32, 16, 8, 2
    return 16, 16, 16, 16, 16, 16, 8, 1


def default_config(
    config: FlashConfig | None, *, q_len: int, kv_len: int, head_dim: int, dtype=None
) -> FlashConfig:
    """Fill the `None` fields of `config` with defaults for the backend, sequence lengths and padded head dim.

    On a GPU the tiles depend on the target device (`target_device()`: `jax.default_device` when set, so
    compiling ahead of time for a GPU picks that GPU's tiles): 128 x 64 forward tiles with 4 warps up to head
    dim 64 and 8 above, 64 x 64 backward tiles, narrower backward tiles where a CTA gets 99 KB of shared
    memory (sm_86 / sm_89), small tiles at head dim 256 (`triton.tiles`; the compile report,
    docs/compile/index.md, checks every one). Interpret mode favours large tiles: it pays per grid step.
    """
    config = config or FlashConfig()
    backend = config.backend or default_backend()
    if backend in tpu.TPU_BACKENDS:
        return _tpu_config(config, backend, q_len, kv_len)
    float32 = dtype is not None and jnp.dtype(dtype) == jnp.float32
    if backend == "interpret":
        fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages = 128, 128, 128, 128, 128, 128, 4, 2
    elif float32:
        fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages = _triton_tiles_float32(head_dim)
    else:
        large = backend in ("mosaic", "mosaic_interpret") or smem_per_block() >= _LARGE_SMEM
        # The Mosaic backends run their Triton fallbacks on Hopper (the interpreter on the CPU: tests run them).
        hopper = backend in ("mosaic", "mosaic_interpret") or _is_hopper(target_device())
        fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages = _triton_tiles(head_dim, large, hopper)

    def pick(value: int | None, default: int, seq_len: int) -> int:
        return value if value is not None else _fit_block(default, seq_len)

    if backend == "mosaic_interpret" or (backend == "mosaic" and not float32):
        # The Mosaic forward's CTA: 128 query rows over two consumer warpgroups, 128-key steps (64 at head
        # dim 256, for shared memory), a 2-slot K/V ring. The backward keeps the Triton tiles. float32 inputs
        # run on the Triton kernels (the Mosaic ones take 16-bit), so they keep the float32 Triton tiles: the
        # Mosaic forward's 128 x 128 needed 262,144 B of shared memory there (sm_90a has 232,448).
        fwd_q, fwd_k, stages = 128, 128 if head_dim <= 128 else 64, 2
    return FlashConfig(
        block_q=pick(config.block_q, fwd_q, q_len),
        block_k=pick(config.block_k, fwd_k, kv_len),
        block_q_dkv=pick(config.block_q_dkv, dkv_q, q_len),
        block_k_dkv=pick(config.block_k_dkv, dkv_k, kv_len),
        block_q_dq=pick(config.block_q_dq, dq_q, q_len),
        block_k_dq=pick(config.block_k_dq, dq_k, kv_len),
        num_warps=config.num_warps if config.num_warps is not None else warps,
        num_stages=config.num_stages if config.num_stages is not None else stages,
        backend=backend,
    )


# The TPU kernels' (forward q, forward k, dQ q, dQ k, dK/dV q, dK/dV k) tiles by TPU generation (the
# `device_kind` of the target device), chosen from deviceless compiles (docs/perf-notes.md, TPU section):
# 128-wide MXUs (v4, v5e, v5p) take 256-row steps, v6e's 256-wide MXU 512; every variant of the
# TPU compile report (docs/compile/tpu.md) fits the default scoped VMEM. Interpret mode takes the v5e tiles.
_TPU_TILES = {"v4": (256, 512, 256, 256, 256, 256), "v5e": (256, 512, 256, 256, 256, 256),
              "v5p": (256, 512, 256, 256, 256, 256), "v6e": (512, 512, 512, 256, 256, 512)}


def tpu_generation(device=None) -> str:
    """"v4", "v5e", "v5p" or "v6e" from a TPU device's kind ("TPU v5 lite", "TPU v6 lite", ...); "v5e" for
    anything else (the interpreter, unknown kinds)."""
    device = device if device is not None else target_device()
    kind = str(getattr(device, "device_kind", "")).lower()
    if "v6" in kind:
        return "v6e"
    if "v5" in kind:
        return "v5e" if ("lite" in kind or "v5e" in kind) else "v5p"
    return "v4" if "v4" in kind else "v5e"


def _tpu_config(config: FlashConfig, backend: str, q_len: int, kv_len: int) -> FlashConfig:
    """The TPU backends' tiles: the generation's (`_TPU_TILES`), shrunk to the sequence but never below 128
    (lse rows are lane vectors); explicit fields are kept (`tpu.unsupported` sends tiles that are not
    multiples of 128 to the XLA path)."""
    generation = "v5e" if backend == "tpu_interpret" else tpu_generation()
    tiles = dict(zip(("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv"),
                     _TPU_TILES[generation]))
    fields = {}
    for name, default in tiles.items():
        seq_len = q_len if name.startswith("block_q") else kv_len
        value = getattr(config, name)
        fields[name] = value if value is not None else max(128, _fit_block(default, seq_len))
    return FlashConfig(**fields, num_warps=config.num_warps or 4, num_stages=config.num_stages or 2, backend=backend)


def tangent_config(config: FlashConfig, head_dim: int, tables: bool = False, dtype=None,
                   score_tile: bool = False) -> FlashConfig:
    """The Triton tangent kernel's tiles on the target GPU (`triton.tangent.tangent_tiles`, whose docstring
    has the figures behind them; `score_tile`: the call reads a bias tile or gathers a score tile from a
    captured table); interpret mode keeps `config`."""
    return _tangent_tiles(config, head_dim, tables, dtype, score_tile)[0]


def tangent_value_splits(config: FlashConfig, head_dim: int, tables: bool = False, dtype=None,
                         score_tile: bool = False) -> int:
    """Programs per query tile of the Triton tangent kernel, each owning a column block of the value head dim
    (`triton.tangent.tangent`'s `value_splits`): 2 above head dim 128 for 16-bit inputs on Hopper (Version
    7u), and for a `score_tile` on a 99 KB GPU (Version 7d; docs/perf-notes.md), else 1."""
    return _tangent_tiles(config, head_dim, tables, dtype, score_tile)[1]


def _tangent_tiles(config: FlashConfig, head_dim: int, tables: bool, dtype,
                   score_tile: bool) -> tuple[FlashConfig, int]:
    if config.backend not in ("triton", "mosaic"):
        return config, 1
    # backend "mosaic" is Hopper-only: its tangent runs on Triton there (as `triton_dkv_transposed` reads it)
    hopper = config.backend == "mosaic" or _is_hopper(target_device())
    return triton_tangent.tangent_tiles(config, head_dim, tables, dtype, hopper=hopper,
                                        large_smem=smem_per_block() >= _LARGE_SMEM, score_tile=score_tile)


# --------------------------------------------------------------------------------------------- per call


def _mosaic_takes(problem: _Problem, q) -> bool:
    """Whether backend "mosaic" is asked for and the Mosaic GPU forward takes this call's dtype, head dim,
    tiles and hooks, and none of what it lacks (dropout, bias, dense masks, segments, hooks that read
    captured arrays other than as scalars or use an op Mosaic GPU cannot lower)."""
    f, cfg = problem.features, problem.config
    return (
        cfg.backend in ("mosaic", "mosaic_interpret") and f.dropout_rate == 0 and problem.bias_shape is None
        and f.scale > 0  # the Mosaic kernels take the row max before scaling
        # Mosaic has no max_scores output, no shared (batch-1) k / v and one head dim for q, k and v.
        and not f.return_max and not problem.kv_broadcast and problem.same_value_dim
        and problem.mask_shape is None and not problem.has_segments
        and (f.score_mod is None or _is_mosaic_hook(f.score_mod, cfg, with_score=True))
        and (f.mask_mod is None or _is_mosaic_hook(f.mask_mod, cfg, with_score=False))
        # A BlockMask's tables on the kernel's tiles or coarser ones (`_tiles.refined_tables`).
        and (f.block_sizes is None or (f.block_sizes[0] % cfg.block_q == 0 and f.block_sizes[1] % cfg.block_k == 0))
        and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[3] in (64, 128, 256)
        and cfg.block_q % 128 == 0 and cfg.block_k % 64 == 0 and cfg.num_stages >= 2
        and mosaic_smem_bytes(q.shape[3], cfg.block_q, cfg.block_k, cfg.num_stages) <= MOSAIC_SMEM_BYTES
    )


def _fits_mosaic(problem: _Problem, q) -> bool:
    """Whether the Mosaic GPU kernels run the backward of this call too (at head dim 64 / 128): when they run
    its forward and a score_mod's derivative also runs in Mosaic GPU."""
    f = problem.features
    return _mosaic_takes(problem, q) and (
        f.score_mod is None or _is_mosaic_score_derivative(f.score_mod, problem.config)
    )


def _hook_specs(config: FlashConfig, with_score: bool) -> list[jax.ShapeDtypeStruct]:
    b, h, q_idx, kv_idx, score = mosaic_hook_shapes(config)
    specs = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in (b, h, q_idx, kv_idx)]
    if with_score:
        specs.insert(0, jax.ShapeDtypeStruct(score, jnp.float32))
    return specs


def _is_mosaic_hook(hook: Hook, config: FlashConfig, with_score: bool) -> bool:
    """Whether a hook can run inside the Mosaic GPU kernels (see `_runs_in_mosaic`), at their tile shapes."""
    jaxpr = hook._jaxpr(_hook_specs(config, with_score))
    return _runs_in_mosaic(jaxpr, set(jaxpr.constvars))


def _is_mosaic_score_derivative(hook: Hook, config: FlashConfig) -> bool:
    """Whether a score_mod's value and derivative (its jvp, for the backward kernels) run in Mosaic GPU."""
    closed = hook.jvp_jaxpr((False,) * len(hook.const_avals), *_hook_specs(config, with_score=True))
    captured = closed.jaxpr.invars[: len(hook.const_avals)]  # the refs of the hook's arrays
    return not closed.consts and _runs_in_mosaic(closed.jaxpr, set(captured))


def _runs_in_mosaic(jaxpr, consts: set) -> bool:
    """Whether every primitive of `jaxpr` has a Mosaic GPU lowering rule, and it reads the arrays `consts`
    only one element at a time (`slopes[h]`: a `dynamic_slice` of size 1 then squeezed, a scalar load from
    global memory), never as arrays; 0-d arrays (a learnable soft cap) are scalar loads wherever used."""
    elements = set()  # the size-1 slices of constants, which may only be squeezed to scalars
    consts = {var for var in consts if var.aval.shape}
    for eqn in jaxpr.eqns:
        reads_element = (
            eqn.primitive.name == "dynamic_slice" and eqn.invars[0] in consts
            and all(size == 1 for size in eqn.params["slice_sizes"])
        )
        if reads_element:  # a scalar load in the kernel (`_hooks._Element`), not a lowered dynamic_slice
            elements.add(eqn.outvars[0])
        elif not _lowers_in_mosaic(eqn):
            return False
        for position, var in enumerate(eqn.invars):
            if isinstance(var, jex_core.Literal):
                continue
            if var in consts and not (reads_element and position == 0):
                return False
            if var in elements and not (eqn.primitive.name == "squeeze" and not eqn.outvars[0].aval.shape):
                return False
    outputs = {var for var in jaxpr.outvars if not isinstance(var, jex_core.Literal)}
    return not outputs & (consts | elements)


def _lowers_in_mosaic(eqn) -> bool:
    """Whether Mosaic GPU has a lowering rule for the equation's primitive and those of its sub-jaxprs."""
    rules = mosaic_lowering.mosaic_lowering_rules[mosaic_gpu_core.LANExWG_SEMANTICS]
    return eqn.primitive in rules and all(
        _lowers_in_mosaic(inner) for sub in jex_core.jaxprs_in_params(eqn.params) for inner in sub.eqns
    )


def _mosaic_backward_tiles(problem: _Problem, q) -> tuple[dict, dict] | None:
    """The tile options of the Mosaic dQ and dK/dV kernels for this call, or None when it runs on Triton.

    Plain calls take the kernels' defaults. Calls with hooks or block tables run both kernels on the forward's
    tiles (the tables' tile), which must be square: dQ's (block_q / 2, block_k) tile and dK/dV's transposed
    (block_k / 2, block_q) one then run in parts of `mosaic_backward_hook_shapes`' shape, where the hooks
    were traced. dK/dV steps over `PART` queries (one part; a table tile in block_q // PART steps): its
    128-query steps with a score_mod spilled at head dim 128 (docs/perf-notes.md, Version 7y)."""
    if not _fits_mosaic(problem, q) or q.shape[3] not in MOSAIC_BACKWARD_HEAD_DIMS:
        return None
    f, cfg = problem.features, problem.config
    if f.score_mod is None and f.mask_mod is None and f.block_sizes is None:
        return {}, {}
    staged = _interpreted(problem)  # the interpreters stage dS / P in shared memory
    head_dim, tile = q.shape[3], cfg.block_q
    if cfg.block_k != tile or max(dq_smem_bytes(head_dim, tile, tile, 2, staged),
                                  dkv_smem_bytes(head_dim, MOSAIC_PART, tile, 2, staged)) > MOSAIC_SMEM_BYTES:
        return None
    dkv = {"block_q": MOSAIC_PART, "block_kv": tile}
    return {"block_q": tile, "block_kv": tile}, dkv if f.block_sizes is None else {**dkv, "tables_block_q": tile}


# ------------------------------------------------------------------------------------------------ routing


def hook_shapes(config: FlashConfig, dkv_transposed: bool = False) -> list[tuple]:
    """The (b, h, q_idx, kv_idx, score) shapes at which the kernels of `config.backend` call the hooks: the
    Triton forward, dQ and dK/dV tiles, and the Mosaic GPU consumer tiles (the forward's, the backward's parts)
    on that backend; the Mosaic TPU dK/dV kernel's transposed (keys, queries) tiles on the TPU backends, and the
    Triton dK/dV kernel's with `dkv_transposed` (`triton_dkv_transposed`)."""
    shapes = [tile_hook_shapes(bq, bk) for bq, bk in (
        (config.block_q, config.block_k), (config.block_q_dq, config.block_k_dq),
        (config.block_q_dkv, config.block_k_dkv))]
    if config.backend in ("mosaic", "mosaic_interpret"):
        shapes += [mosaic_hook_shapes(config), mosaic_backward_hook_shapes(config)]
    if config.backend in tpu.TPU_BACKENDS or dkv_transposed:
        shapes.append(tile_hook_shapes(config.block_q_dkv, config.block_k_dkv, transposed=True))
    return shapes


def triton_dkv_transposed(config: FlashConfig, dtype, head_dim: int, bias: bool = False) -> bool:
    """Whether the Triton dK/dV kernel computes the transposed scores K Q^T (`triton/backward.py`): 16-bit
    inputs at (padded) head dim 128 and 256 on Hopper (the target device is compute capability 9.x, or the
    backend is "mosaic" / "mosaic_interpret", whose Triton fallbacks run on Hopper). Every dot's M is then the
    64-key tile, so all four are wgmma whatever the query step: 16 at head dim 256, where Q K^T at 32 x 32 was
    mma.sync and 64 x 64 spilled; at 128 the 64 x 64 tile on K Q^T no longer spills with GQA
    (docs/perf-notes.md, Version 7x). Head dim 64, other backends, float32 (FMA dots), calls with a dense
    `bias` at head dim 128 (Q K^T at 64 x 64 holds its bias tile in 232-253 registers without a spill, K Q^T
    spilled 16 B with a float32 one; Version 7b) and tiles with fewer keys than queries (explicit, or shrunk to
    a short key sequence: K Q^T would put the smaller one on M) keep Q K^T."""
    if config.backend not in ("triton", "mosaic", "mosaic_interpret") or jnp.dtype(dtype).itemsize != 2:
        return False
    hopper = config.backend != "triton" or _is_hopper(target_device())
    return (hopper and head_dim > 64 and not (bias and head_dim <= 128)
            and config.block_k_dkv >= config.block_q_dkv)


def forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    """(out, lse[, row max]) of the padded inputs, by the Mosaic GPU forward where it takes the call, else
    Triton (`triton_fallback_config`'s tiles on backend "mosaic"); on the TPU backends by the Mosaic TPU
    forward, or the XLA path where it cannot take the call."""
    if problem.config.backend in tpu.TPU_BACKENDS:
        if _tpu_takes(problem):
            optional = _tpu_tables(problem, optional)
            return tpu.forward(problem, q, k, v, q_len, kv_len, optional)
        return _chunked.dense_forward(problem, q, k, v, q_len, kv_len, optional)
    if _mosaic_takes(problem, q):
        return mosaic_glue.forward(problem, q, k, v, q_len, kv_len, optional)
    head_dim = max(q.shape[3], v.shape[3])
    config = triton_forward_config(problem, triton_fallback_config(problem.config, head_dim), q.dtype, head_dim)
    return triton_forward.forward(_retiled(problem, config), q, k, v, q_len, kv_len, optional)


def triton_fallback_config(config: FlashConfig, head_dim: int) -> FlashConfig:
    """The Triton forward's tiles for a call backend "mosaic" runs on Triton (what the Mosaic forward lacks,
    `_mosaic_takes`): at most the Triton forward's own tiles for the head dim on a large-shared-memory GPU.
    The Mosaic forward's 128 x 128 CTA holds 229,376 B of shared memory in the Triton forward at head dim 128
    and spilled 32 B with a relative-bias table on sm_90a (docs/perf-notes.md). Halving a power-of-two tile
    keeps it a divisor of the padded lengths and of every block table's block ("mosaic_interpret" takes the
    same tiles, so the CPU tests run this path). Other backends keep `config`."""
    if config.backend not in ("mosaic", "mosaic_interpret"):
        return config
    block_q, block_k = _triton_tiles(head_dim, large_smem=True)[:2]
    return dataclasses.replace(config, block_q=min(config.block_q, block_q), block_k=min(config.block_k, block_k))


def triton_forward_config(problem: _Problem, config: FlashConfig, dtype, head_dim: int) -> FlashConfig:
    """The Triton forward's tiles for this call on the target GPU (`triton.retile.forward_config`, whose
    docstring has the figures behind them); backends other than "triton" / "mosaic" keep `config`."""
    if config.backend not in ("triton", "mosaic"):
        return config
    return triton_retile.forward_config(problem, config, dtype, head_dim, hopper=_is_hopper(target_device()))


def triton_backward_configs(problem: _Problem, dtype, head_dim: int) -> tuple[FlashConfig, FlashConfig]:
    """The configs of the Triton dQ and dK/dV kernels for this call on the target GPU
    (`triton.retile.backward_configs`); backends other than "triton" / "mosaic" keep `problem.config`."""
    if problem.config.backend not in ("triton", "mosaic"):
        return problem.config, problem.config
    return triton_retile.backward_configs(problem, dtype, head_dim, hopper=_is_hopper(target_device()),
                                          large_smem=smem_per_block() >= _LARGE_SMEM)


def backward_hook_shapes(problem: _Problem, dtype, head_dim: int) -> list[tuple]:
    """The hook shapes of the Triton backward's per-call tiles (`triton_backward_configs`) where they are not
    `problem.config`'s. `_autodiff` traces the hooks at them with the forward's: in the backward pass the
    hooks' captured arrays may be tracers of a transformation that has finished (a linearize)."""
    f = problem.features
    if problem.config.backend not in ("triton", "mosaic") or (f.score_mod is None and f.mask_mod is None):
        return []
    return [shape for config in triton_backward_configs(problem, dtype, head_dim) if config != problem.config
            for shape in hook_shapes(config, problem.dkv_transposed)]


# Whether the Triton dK/dV kernel runs one program per query head (`triton.retile.dkv_per_query_head`).
triton_dkv_per_query_head = triton_retile.dkv_per_query_head
# Whether it computes dV and dK in two programs per key tile (`triton.retile.dkv_split`).
triton_dkv_split = triton_retile.dkv_split


def _retiled(problem: _Problem, config: FlashConfig) -> _Problem:
    """`problem` on `config`'s tiles, its hooks traced at every kernel tile of `config` too
    (`_chunked._prepare_hooks` traced them at the tiles of `hook_shapes(problem.config, ...)`)."""
    if config == problem.config:
        return problem
    f = problem.features
    for b, h, rows, cols, score in hook_shapes(config, problem.dkv_transposed):
        indices = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in (b, h, rows, cols)]
        if f.score_mod is not None:
            f.score_mod.prepare(jax.ShapeDtypeStruct(score, jnp.float32), *indices)
        if f.mask_mod is not None:
            f.mask_mod.prepare(*indices)
    return dataclasses.replace(problem, config=config)


def backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse) -> dict:
    """Gradients of q, k, v and the bias flagged in `tangents`, by the Mosaic GPU dQ and dK/dV kernels where
    they take the call (`_mosaic_backward_tiles`), else Triton's; on the TPU backends the Mosaic TPU kernels,
    or the XLA path."""
    if problem.config.backend in tpu.TPU_BACKENDS:
        if _tpu_takes(problem):
            others = _tpu_tables(problem, res["others"], backward=True)
            return tpu.backward(problem, tangents, dict(res, others=others), d_out, d_lse)
        return _chunked.dense_backward(problem, tangents, res, d_out, d_lse)
    tiles = _mosaic_backward_tiles(problem, res["q"])
    if tiles is not None:
        return mosaic_glue.backward(problem, tangents, res, d_out, d_lse, tiles)
    head_dim = max(res["q"].shape[3], res["v"].shape[3])
    dq_config, dkv_config = triton_backward_configs(problem, res["q"].dtype, head_dim)
    dkv_problem = dataclasses.replace(_retiled(problem, dkv_config),
                                      dkv_per_query_head=triton_dkv_per_query_head(problem),
                                      dkv_split=triton_dkv_split(problem, head_dim))
    return triton_backward.backward(_retiled(problem, dq_config), tangents, res, d_out, d_lse, dkv_problem)


def tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, out, lse2, linear: dict,
            optional: dict):
    """(d out, d lse) of a forward-mode pass: the Triton tangent kernel on every backend, on
    `tangent_config`'s tiles; on the TPU backends the Mosaic TPU tangent kernel on the forward's tiles, or
    the XLA path."""
    if problem.config.backend in tpu.TPU_BACKENDS:
        if _tpu_takes(problem):
            optional = _tpu_tables(problem, optional)
            return tpu.tangent(problem, tangents, q, k, v, q_len, kv_len, out, lse2, linear, optional)
        return _chunked.dense_tangent(problem, tangents, q, k, v, q_len, kv_len, linear, optional)
    head_dim = max(q.shape[3], v.shape[3])
    f = problem.features
    tables = f.block_sizes is not None
    score_tile = problem.bias_shape is not None or triton_retile.gathers_score_tile_of(problem)
    config = tangent_config(problem.config, head_dim, tables, dtype=q.dtype, score_tile=score_tile)
    splits = tangent_value_splits(problem.config, head_dim, tables, dtype=q.dtype, score_tile=score_tile)
    splits = splits if v.shape[3] >= 64 else 1  # each split's columns stay a dot's 32 or more
    problem = _retiled(problem, config)
    return triton_tangent.tangent(problem, tangents, q, k, v, q_len, kv_len, out, lse2, linear, optional,
                                  value_splits=splits)


def decode_plan(inputs: DecodeInputs, config: DecodeConfig | None, score_mod: Hook | None, mask_mod: Hook | None,
                num_score_consts: int) -> triton_decode.DecodePlan | tpu_decode.TpuDecodePlan | None:
    """The decode kernel's static plan. `config.backend=None` is the Triton decode kernel on every GPU
    (Mosaic included: the GPU decode kernel is Triton's alone), the Mosaic TPU one on a TPU and interpret
    mode elsewhere. None, with a warning naming the op, for a hook the Mosaic TPU decode kernel cannot run
    (a gather such as `table[q_idx - kv_idx]`): the caller runs the XLA path, as flash calls do."""
    config = config or DecodeConfig()
    if config.backend is None:
        backend = {"triton": "triton", "mosaic": "triton", "tpu": "tpu"}.get(default_backend(), "interpret")
        config = dataclasses.replace(config, backend=backend)
    if config.backend in tpu.TPU_BACKENDS:
        generation = "interpret" if config.backend == "tpu_interpret" else tpu_generation()
        try:
            return tpu_decode.plan_for(inputs, config, score_mod, mask_mod, num_score_consts, generation)
        except tpu_decode.HookNotInKernel as reason:
            warnings.warn(f"DecodeConfig(backend={config.backend!r}): {reason}; this call runs the XLA path "
                          "(decode_attention_reference, not a Pallas kernel).", stacklevel=3)
            return None
    return triton_decode.plan_for(inputs, config, score_mod, mask_mod, num_score_consts)


def decode(plan, q, k, v, kv_lengths, block_tables, consts):
    """(out [B, T, N, Dv], lse [B, N, T]) of a decode call, by the kernel its plan was made for."""
    kernel = tpu_decode if isinstance(plan, tpu_decode.TpuDecodePlan) else triton_decode
    return kernel.decode(plan, q, k, v, kv_lengths, block_tables, consts)


def decode_hook_args(score: bool, rows: int, cols: int) -> list[jax.ShapeDtypeStruct]:
    """The decode kernels' hook arguments for a (rows, cols) tile (`triton/decode.hook_args`): a float32 score
    tile, b a scalar, h and q_idx columns, kv_idx a row. The TPU kernel passes the same (h a scalar instead
    for a hook that reads a captured array at h: `tpu/decode.py`)."""
    return triton_decode.hook_args(score, rows, cols)


# ------------------------------------------------------------------------------------------ TPU and XLA


def _tpu_tables(problem: _Problem, arrays: dict, backward: bool = False) -> dict:
    """`arrays` with a BlockMask's tables on the tiles of the TPU kernels that walk them, which divide its blocks
    (`tpu.unsupported`; `_tiles.refined_tables`): "kv_tables" on the forward's tile (forward, tangent) or, in
    the `backward` pass, dQ's; "q_tables" on dK/dV's."""
    block_sizes, cfg = problem.features.block_sizes, problem.config
    if block_sizes is None:
        return arrays
    kv_tile = (cfg.block_q_dq, cfg.block_k_dq) if backward else (cfg.block_q, cfg.block_k)
    return dict(arrays, kv_tables=refined_tables(arrays["kv_tables"], block_sizes, kv_tile),
                q_tables=refined_tables(arrays["q_tables"], block_sizes[::-1], (cfg.block_k_dkv, cfg.block_q_dkv)))


def _tpu_takes(problem: _Problem) -> bool:
    """Whether the Mosaic TPU kernels run this call; if not, warns once per trace naming what they lack."""
    reason = tpu.unsupported(problem)
    if reason is not None:
        warnings.warn(f"FlashConfig(backend={problem.config.backend!r}): the Mosaic TPU kernels cannot run "
                      f"{reason}; this call runs the XLA path (query chunks, not a Pallas kernel).", stacklevel=4)
    return reason is None
