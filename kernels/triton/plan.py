"""The Triton backend as one object (`BACKEND`): its default tiles per GPU, and its plan of a call: the tiles of
each kernel (forward, dQ, dK/dV, tangent), the dK/dV kernel's orientation and program grid, the tangent's value
splits, and the shapes at which the kernels call the hooks. It serves `FlashConfig.backend` "triton" (the Pallas
Triton lowering, every CUDA GPU) and "interpret" (the same kernels in Pallas interpret mode, any device), and
runs what the Mosaic GPU kernels leave of a "mosaic" / "mosaic_interpret" call, on Hopper.

The tiles come from the compile report (docs/compile/index.md; the figures behind each choice are in
docs/perf-notes.md): no spill and within shared memory on sm_90a, sm_80 and sm_86, and on the subsets compiled
for sm_100a, sm_89 and sm_120. The rules have three classes of GPU (`_wide`, `smem_per_block`): a wide-MMA GPU
(compute capability 9.x, wgmma, and 10.x, tcgen05 with tensor memory: B200 / GB200 / B300) takes the tiles
whose every dot has at least 64 rows, the rules written `hopper` in `retile` and `tangent`; an mma.sync GPU with
over 160 KB of shared memory per CTA (sm_80) the A100's; one with 99 KB (sm_86, sm_89, sm_120 consumer
Blackwell) the RTX 3090's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from probjax_kernels import _backend
from probjax_kernels._backend import KernelPass, Passes, compute_capability, is_consumer_blackwell, wide_mma
from probjax_kernels._config import FlashConfig, fit_block
from probjax_kernels import _chunked
from probjax_kernels._hooks import flash_hook_shapes as hook_shapes  # the Triton kernels' hook shapes
from probjax_kernels._problem import _Problem
from probjax_kernels.triton import backward, forward, retile, tangent

MOSAIC_CONFIGS = ("mosaic", "mosaic_interpret")  # calls whose Triton kernels run on Hopper, beside Mosaic GPU's

# Shared memory one CTA may opt in to, by compute capability (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"); unknown capabilities count as the smallest of these.
_SMEM_PER_BLOCK = {(7, 0): 98_304, (7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912,
                   (8, 9): 101_376, (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376}
_LARGE_SMEM = 160 * 1024  # A100 / H100 class (163 / 227 KB per CTA) versus the RTX 30 / 40 class (99 KB)


def smem_per_block(device=None) -> int:
    """Shared memory per CTA (opt-in) of the device's compute capability (default: the target's), in bytes."""
    capability = compute_capability(device if device is not None else _backend.target_device())
    return _SMEM_PER_BLOCK.get(capability, min(_SMEM_PER_BLOCK.values()))


def _wide(device) -> bool:
    """Whether the Triton tile rules treat the device as Hopper (`hopper` in `retile` / `tangent`): wgmma on
    compute capability 9.x, tcgen05 on 10.x (`_backend.wide_mma`). A B200 on the A100's 32-row dK/dV steps ran
    96 of 108 dK/dV matmuls on mma.sync; on these rules every sm_100a Triton kernel is all tcgen05."""
    return wide_mma(device if device is not None else _backend.target_device()) is not None


def _tcgen05(device) -> bool:
    """Whether the device's wide MMA is tcgen05 (compute capability 10.x: B200 / GB200 / B300), where a few
    kernels take other tiles than on Hopper (`dkv_transposed`, `_tangent_tiles`)."""
    return wide_mma(device if device is not None else _backend.target_device()) == "tcgen05"


def _consumer_blackwell(device) -> bool:
    """Compute capability 12.x (`_backend.is_consumer_blackwell`): the RTX 3090's tiles but for the rules of
    `_consumer_blackwell_tiles` and `backward_configs`: ptxas (12.9) allocates registers differently there. It
    held 8-warp kernels to 128 registers where sm_86 gives them 255, and spilled (dK/dV with GQA or a bias at
    head dim 128 12-16 B, float32 dK/dV at 256 36-60 B, a float32 forward 16 B at 64 registers), and 4-warp
    head dim 64 kernels, at 255 on both, spilled 4-48 B (a relative-bias forward 224 B) where sm_86's did not."""
    return is_consumer_blackwell(device if device is not None else _backend.target_device())


def _consumer_blackwell_tiles(tiles: tuple[int, ...], head_dim: int, float32: bool) -> tuple[int, ...]:
    """The default tiles on compute capability 12.x (`_triton_tiles`' 99 KB ones, then these): 16-bit at head
    dim 64 steps over 32 keys in every kernel (forward 128 x 32, dQ and dK/dV 64 x 32). On 64 keys dK/dV spilled
    4-48 B on sm_120 with every feature tried (36 B plain causal; 32 x 64 still 16-56 B, 16 x 64 8-20 B), and
    the relative-bias forward 224 B; on 32 every kernel holds 255 registers or fewer without a spill."""
    fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages = tiles
    if not float32 and head_dim <= 64:
        fwd_k, dkv_k, dq_k = min(fwd_k, 32), min(dkv_k, 32), min(dq_k, 32)
    return fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages


def _triton_tiles(head_dim: int, large_smem: bool, hopper: bool = False) -> tuple[int, ...]:
    """(fwd q, fwd k, dK/dV q, dK/dV k, dQ q, dQ k, warps, stages) of the Triton kernels on a GPU, chosen from
    the compile report (docs/compile/index.md; the figures behind each choice are in docs/perf-notes.md):
    no spill and within shared memory on sm_90a, sm_80 and sm_86 (but for the capped entries of
    scripts/compile/rules.py). On a wide-MMA GPU (`hopper`: sm_90a, sm_100a) the backward tiles are the ones
    whose every dot has at least 64 rows, wgmma's M per warpgroup and tcgen05's least M (Triton emits mma.sync
    below it): 8 warps at 129-255 registers run
    one CTA per SM either way (65,536 registers / 256 threads), so the tiles may use up to 255 without
    spilling."""
    if head_dim <= 64:
        return 128, 64, 64, 64, 64, 64, 4, 2
    if head_dim <= 128:
        if hopper:
            # dK/dV at 64 x 64 on transposed scores (`dkv_transposed`): all four dots wgmma, 208-255
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
        # 16-20 B with 1. dK/dV at 16 queries x 64 keys on transposed scores (`dkv_transposed`): every
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


def fallback_config(config: FlashConfig, head_dim: int) -> FlashConfig:
    """The Triton forward's tiles for a call backend "mosaic" runs on Triton (what the Mosaic forward lacks):
    at most the Triton forward's own tiles for the head dim on a large-shared-memory GPU. The Mosaic forward's
    128 x 128 CTA holds 229,376 B of shared memory in the Triton forward at head dim 128 and spilled 32 B with
    a relative-bias table on sm_90a (docs/perf-notes.md). Halving a power-of-two tile keeps it a divisor of the
    padded lengths and of every block table's block ("mosaic_interpret" takes the same tiles, so the CPU tests
    run this path). Other backends keep `config`."""
    if config.backend not in MOSAIC_CONFIGS:
        return config
    block_q, block_k = _triton_tiles(head_dim, large_smem=True)[:2]
    return dataclasses.replace(config, block_q=min(config.block_q, block_q), block_k=min(config.block_k, block_k))


def dkv_transposed(config: FlashConfig, dtype, head_dim: int, bias: bool = False, device=None) -> bool:
    """Whether the Triton dK/dV kernel computes the transposed scores K Q^T (`triton/backward.py`): 16-bit
    inputs at (padded) head dim 128 and 256 on Hopper (the target device is compute capability 9.x or 10.x, or the
    backend is "mosaic" / "mosaic_interpret", whose Triton fallbacks run on Hopper). Every dot's M is then the
    64-key tile, so all four are wgmma whatever the query step: 16 at head dim 256, where Q K^T at 32 x 32 was
    mma.sync and 64 x 64 spilled; at 128 the 64 x 64 tile on K Q^T no longer spills with GQA
    (docs/perf-notes.md, Version 7x). Head dim 64, other backends, float32 (FMA dots), calls with a dense
    `bias` at head dim 128 (Q K^T at 64 x 64 holds its bias tile in 232-253 registers without a spill, K Q^T
    spilled 16 B with a float32 one; Version 7b) and tiles with fewer keys than queries (explicit, or shrunk to
    a short key sequence: K Q^T would put the smaller one on M) keep Q K^T. On tcgen05 (sm_100a) head dim 128
    keeps Q K^T too: its 64 x 64 tile is all tcgen05 there in 128-159 registers without a spill, where K Q^T
    spilled 4 B (causal, 128 registers); head dim 256 takes K Q^T, all tcgen05 at 16-query steps."""
    if config.backend not in ("triton", *MOSAIC_CONFIGS) or jnp.dtype(dtype).itemsize != 2:
        return False
    if config.backend in ("triton", "mosaic") and _tcgen05(device) and head_dim <= 128:
        return False
    hopper = config.backend != "triton" or _wide(device)
    return (hopper and head_dim > 64 and not (bias and head_dim <= 128)
            and config.block_k_dkv >= config.block_q_dkv)


def forward_config(problem: _Problem, config: FlashConfig, dtype, head_dim: int, device=None) -> FlashConfig:
    """The Triton forward's tiles for this call on the target GPU (`retile.forward_config`, whose docstring has
    the figures behind them); backends other than "triton" / "mosaic" keep `config`."""
    if config.backend not in ("triton", "mosaic"):
        return config
    device = device if device is not None else _backend.target_device()
    config = retile.forward_config(problem, config, dtype, head_dim, hopper=_wide(device))
    if (config.backend == "triton" and _consumer_blackwell(device) and problem.mask_shape is not None
            and jnp.dtype(dtype) == jnp.float32 and 64 < head_dim <= 128):
        # sm_120: the float32 forward with a dense mask at head dim 128 on 3 stages, as sm_80 / sm_86 take it
        # for a window, dropout or a bias (`retile.forward_config`): on 2 ptxas held it to 64 registers and
        # spilled 16 B; on 3 it holds 64-73 (4 warps spilled 688-872 B with every feature tried)
        config = dataclasses.replace(config, num_stages=max(config.num_stages, 3))
    return config


def backward_configs(problem: _Problem, dtype, head_dim: int, device=None) -> tuple[FlashConfig, FlashConfig]:
    """The configs of the dQ and dK/dV kernels for this call on the target GPU (`retile.backward_configs`, and
    `retile.tcgen05_backward_configs` on sm_100a); backends other than "triton" / "mosaic" keep
    `problem.config`."""
    if problem.config.backend not in ("triton", "mosaic"):
        return problem.config, problem.config
    device = device if device is not None else _backend.target_device()
    dq, dkv = retile.backward_configs(problem, dtype, head_dim, hopper=_wide(device),
                                      large_smem=smem_per_block(device) >= _LARGE_SMEM)
    if _tcgen05(device):
        return retile.tcgen05_backward_configs(problem, dtype, head_dim, dq, dkv)
    if problem.config.backend == "triton" and _consumer_blackwell(device):
        return _consumer_blackwell_backward(dq, dkv, dtype, head_dim)
    return dq, dkv


def _consumer_blackwell_backward(dq: FlashConfig, dkv: FlashConfig, dtype,
                                 head_dim: int) -> tuple[FlashConfig, FlashConfig]:
    """dQ and dK/dV on compute capability 12.x (sm_120), after the rules of sm_86: float32 dQ and dK/dV, and the
    16-bit dQ at head dim 256, on 4 warps (on 8 ptxas held float32 dK/dV to 64-128 registers and spilled 8-60
    B, the 16-bit head dim 256 dQ with a bias 4 B; on 4 they hold 87-255 without a spill; the 16-bit head dim
    256 dK/dV keeps 8: on 4 it spilled 24 B with a mask); 16-bit dK/dV at head dim 128 on 16-query steps (32 x
    64 spilled 12-16 B with GQA or a bias at 128 registers on 8 warps, 20-32 B with a float32 bias, a mask or
    a relative-bias table on 4; 16 x 64 on 8 warps holds 158-180 with every feature tried)."""
    if jnp.dtype(dtype) == jnp.float32:
        return tuple(dataclasses.replace(c, num_warps=min(c.num_warps, 4)) for c in (dq, dkv))
    if head_dim > 128:
        return dataclasses.replace(dq, num_warps=min(dq.num_warps, 4)), dkv
    if head_dim > 64:
        dkv = dataclasses.replace(dkv, block_q_dkv=min(dkv.block_q_dkv, 16))
    return dq, dkv


def _tangent_tiles(config: FlashConfig, head_dim: int, tables: bool, dtype, score_tile: bool,
                   device) -> tuple[FlashConfig, int]:
    if config.backend not in ("triton", "mosaic"):
        return config, 1
    device = device if device is not None else _backend.target_device()
    # backend "mosaic" runs on Hopper and Blackwell (wide-MMA GPUs): its tangent runs on Triton there (as
    # `dkv_transposed` reads it)
    hopper = config.backend == "mosaic" or _wide(device)
    tiles, splits = tangent.tangent_tiles(config, head_dim, tables, dtype, hopper=hopper,
                                          large_smem=smem_per_block(device) >= _LARGE_SMEM, score_tile=score_tile)
    sixteen_bit = dtype is None or jnp.dtype(dtype).itemsize == 2
    if config.backend in ("triton", "mosaic") and _tcgen05(device) and head_dim <= 64 and sixteen_bit:
        # tcgen05 (sm_100a), 16-bit, head dim 64: the forward's key tile (64), not the cap of 32. On 128 x 32 and
        # 8 warps ptxas held the tangent to 80 registers and spilled 4 B; 128 x 64 holds 126, all tcgen05.
        tiles = dataclasses.replace(tiles, block_k=config.block_k)
    return tiles, splits


def tangent_config(config: FlashConfig, head_dim: int, tables: bool = False, dtype=None, score_tile: bool = False,
                   device=None) -> FlashConfig:
    """The tangent kernel's tiles on the target GPU (`tangent.tangent_tiles`, whose docstring has the figures
    behind them; `score_tile`: the call reads a bias tile or gathers a score tile from a captured table);
    interpret mode keeps `config`."""
    return _tangent_tiles(config, head_dim, tables, dtype, score_tile, device)[0]


def tangent_value_splits(config: FlashConfig, head_dim: int, tables: bool = False, dtype=None,
                         score_tile: bool = False, device=None) -> int:
    """Programs per query tile of the tangent kernel, each owning a column block of the value head dim
    (`tangent.tangent`'s `value_splits`): 2 above head dim 128 for 16-bit inputs on Hopper (Version 7u), and
    for a `score_tile` on a 99 KB GPU (Version 7d; docs/perf-notes.md), else 1."""
    return _tangent_tiles(config, head_dim, tables, dtype, score_tile, device)[1]


def run_tangent(problem: _Problem, tangents, q, k, *arrays, value_splits: int):
    """The tangent pass: `tangent.tangent` on its own tiles, the hooks traced at them as it runs, inside the
    forward-mode trace. Traced at plan time instead, a hook that gathers from a captured table (`relative_bias`)
    lowered to a differently ordered tangent kernel, so every compile record of such a jvp changed."""
    _chunked._prepare_hooks(problem.features, hook_shapes(problem.config, problem.dkv_transposed), q.shape[0],
                            problem.num_heads, q.shape[1], k.shape[1])
    return tangent.tangent(problem, tangents, q, k, *arrays, value_splits=value_splits)


class _Triton:
    """The Pallas Triton kernels (`kernels/triton/`), on a GPU or in Pallas interpret mode."""

    name = "Triton"
    configs = ("triton", "interpret")
    warns_when_declining = False

    def defaults(self, config: FlashConfig, filled: FlashConfig | None, *, q_len: int, kv_len: int, head_dim: int,
                 dtype, device) -> FlashConfig:
        """`config` with its `None` fields filled (`filled` is ignored: Triton runs every call it is asked to).

        On a GPU the tiles depend on the target device: 128 x 64 forward tiles with 4 warps up to head dim 64
        and 8 above, 64 x 64 backward tiles, narrower backward tiles where a CTA gets 99 KB of shared memory
        (sm_86 / sm_89), small tiles at head dim 256. Interpret mode favours large tiles: it pays per grid step.
        """
        backend = config.backend
        float32 = dtype is not None and jnp.dtype(dtype) == jnp.float32
        if backend == "interpret":
            fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages = 128, 128, 128, 128, 128, 128, 4, 2
        elif float32:
            fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages = _triton_tiles_float32(head_dim)
        else:
            large = backend in MOSAIC_CONFIGS or smem_per_block(device) >= _LARGE_SMEM
            # The Mosaic backends run their Triton fallbacks on Hopper (the interpreter on the CPU: tests run them).
            hopper = backend in MOSAIC_CONFIGS or _wide(device)
            fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages = _triton_tiles(head_dim, large, hopper)
        if backend == "triton" and _consumer_blackwell(device):
            fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages = _consumer_blackwell_tiles(
                (fwd_q, fwd_k, dkv_q, dkv_k, dq_q, dq_k, warps, stages), head_dim, float32)

        def pick(value: int | None, default: int, seq_len: int) -> int:
            return value if value is not None else fit_block(default, seq_len)

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

    def unsupported(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> str | None:
        return None

    def hook_shapes(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> list[tuple]:
        """The shapes at which its kernels on the call's tiles call the hooks (the dK/dV kernel's transposed tile
        where it computes K Q^T)."""
        transposed = dkv_transposed(problem.config, dtype, max(head_dims), bias=problem.bias_shape is not None,
                                    device=device)
        return hook_shapes(problem.config, transposed)

    def plan(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> Passes:
        """The forward, dQ + dK/dV and tangent kernels' tiles for this call on the target GPU, where a call's
        features spill on the defaults (`retile`; the tangent's: `tangent.tangent_tiles`)."""
        head_dim = max(head_dims)
        problem = dataclasses.replace(problem, dkv_transposed=dkv_transposed(
            problem.config, dtype, head_dim, bias=problem.bias_shape is not None, device=device))
        shapes = []  # the shapes of the kernels retiled for the call (`hook_shapes` has the call's tiles')

        def retiled(config: FlashConfig, **fields) -> _Problem:
            if config != problem.config:
                shapes.extend(hook_shapes(config, problem.dkv_transposed))
            return dataclasses.replace(problem, config=config, **fields)

        forward_tiles = forward_config(problem, fallback_config(problem.config, head_dim), dtype, head_dim, device)
        dq_config, dkv_config = backward_configs(problem, dtype, head_dim, device)
        dkv_problem = retiled(dkv_config, dkv_per_query_head=retile.dkv_per_query_head(problem),
                              dkv_split=retile.dkv_split(problem, head_dim))
        tables = problem.features.block_sizes is not None
        score_tile = problem.bias_shape is not None or retile.gathers_score_tile_of(problem)
        tangent_tiles = tangent_config(problem.config, head_dim, tables, dtype, score_tile, device)
        if (problem.config.backend == "triton" and _consumer_blackwell(device) and head_dim > 128
                and problem.features.dropout_rate > 0 and jnp.dtype(dtype).itemsize == 2):
            # sm_120: the 16-bit dropout tangent at head dim 256 on 4 warps (8: 128 registers, 8 B spilled; 4:
            # 255 without a spill, as the other 16-bit head dim 256 tangents there on 8)
            tangent_tiles = dataclasses.replace(tangent_tiles, num_warps=4)
        splits = tangent_value_splits(problem.config, head_dim, tables, dtype, score_tile, device)
        splits = splits if head_dims[1] >= 64 else 1  # each split's columns stay a dot's 32 or more
        return Passes(
            forward=KernelPass(forward.forward, retiled(forward_tiles)),
            backward=KernelPass(backward.backward, retiled(dq_config), (("dkv_problem", dkv_problem),)),
            tangent=KernelPass(run_tangent, dataclasses.replace(problem, config=tangent_tiles),
                               (("value_splits", splits),)),
            hook_shapes=tuple(shapes),
        )


BACKEND = _Triton()
