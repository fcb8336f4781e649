"""Per-call configs of the Triton kernels: where a call's features (a gathered table, a window, dropout, GQA, a
BlockMask, a dense bias or mask) spill on `default_config`'s tiles, which are chosen by dtype and head dim
alone, the kernel that spilled takes other tiles, warps or stages, or (dK/dV) another program grid. Each rule
states the figures it rests on (deviceless compiles: docs/compile/index.md, docs/perf-notes.md Versions 7, 7b
and 7c). `_dispatch` passes the target GPU's facts (`hopper`, `large_smem`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from probjax_kernels._config import FlashConfig
from probjax_kernels._hooks import Hook
from probjax_kernels._problem import _interpreted, _Problem


def _float32_d128(dtype, head_dim: int) -> bool:
    return jnp.dtype(dtype) == jnp.float32 and 64 < head_dim <= 128


def _float32_local(problem: _Problem, dtype, head_dim: int, hopper: bool) -> tuple[dict, dict]:
    """The float32 retile at head dim 64 and 256 for the calls that spilled on `default_config`'s tiles there
    (docs/perf-notes.md, Versions 7c and 7d): the FlashConfig fields to set in the forward and dK/dV kernels,
    and those to set in dQ ({} where no rule applies):

    - head dim 64 with a local window, dropout or a BlockMask: 3 stages (1 by default), forward and dK/dV
      only. On 1 stage the forward spilled 4-8 B on sm_80, dK/dV 4-20 B on every GPU; on 3 both hold 58-80
      registers without a spill. dQ keeps 1 stage (3 spilled 8 B on sm_80 with a document mask); with a
      BlockMask on sm_80 / sm_86 (not `hopper`) it steps over 16 keys: 32 spilled 8-60 B there with a soft cap
      on a sliding window, 16 holds 104-180 registers with every BlockMask; on sm_90a 16 spilled 8-20 B with a
      document mask or a sliding window, 32 does not;
    - head dim 256 with a BlockMask: 4 warps (8 by default) in the forward and dK/dV, 2 in dQ. On 8 dQ spilled
      16-20 B and dK/dV 20-52 B on sm_80 / sm_86 (24-36 B on sm_90a); on 4 dK/dV holds 144-185 registers,
      dQ still spilled 8 B with a document mask on sm_80; on 2 dQ holds 228-240 (dK/dV spilled 1.8 KB there);
    - head dim 256 with a local window, dropout or Dv != D: 4 warps in every kernel. On 8 dK/dV spilled
      12-16 B, dQ 24 B with dropout on sm_90a; on 4 they hold 108-185."""
    f = problem.features
    if jnp.dtype(dtype) != jnp.float32:
        return {}, {}
    local = f.window_left is not None or f.dropout_rate > 0
    masked = f.block_sizes is not None
    if head_dim <= 64 and (local or masked):
        dq = dict(block_k_dq=min(problem.config.block_k_dq, 16)) if masked and not hopper else {}
        return dict(num_stages=max(problem.config.num_stages, 3)), dq
    if head_dim > 128 and masked:
        return dict(num_warps=4), dict(num_warps=2)
    if head_dim > 128 and (local or not problem.same_value_dim):
        return dict(num_warps=4), dict(num_warps=4)
    return {}, {}


def forward_config(problem: _Problem, config: FlashConfig, dtype, head_dim: int, *, hopper: bool) -> FlashConfig:
    """The forward's tiles for this call on a GPU (`hopper`: compute capability 9.x), where `default_config`'s
    (chosen by dtype and head dim alone) spill with its features (docs/perf-notes.md, Versions 7 and 7b):

    - 16-bit inputs at head dim 64 with a `bias` or `mask`: 8 warps (every GPU). On 4 the 128 x 64 tile
      spilled 28 B on sm_90a and 8 B on sm_80 with a float32 bias tile, 32 B on sm_86 with a mask tile; on 8
      a bias holds 173-182 registers. Dropout too: on 4 it spilled 24-52 B, on 8 it holds 163-172 (7c);
    - 16-bit inputs at head dim 128 on a GPU without wgmma (sm_80 / sm_86) with a score_mod that gathers a
      whole score tile from a captured array (a relative bias's `table[h, q_idx - kv_idx]`: an address and a
      value per score): a key tile of at most 32; 128 x 64 used 255 registers and spilled 40-56 B, 128 x 32
      uses 197-225 and does not;
    - float32 at head dim 128 with a sliding window, dropout or a dense bias on a GPU without wgmma (sm_80 /
      sm_86): 3 stages; ptxas held the 2-stage kernel to 64 registers and spilled 8-12 B there. Only those: 3
      stages for every float32 forward spilled 12 B with a document mask on sm_80 and 8 B with segment ids on
      sm_90a.

    Halving a power-of-two tile keeps it a divisor of the padded lengths and of every block table's block."""
    sixteen_bit = jnp.dtype(dtype).itemsize == 2
    if sixteen_bit and head_dim <= 64 and (problem.bias_shape is not None or problem.mask_shape is not None
                                           or problem.features.dropout_rate > 0):
        config = dataclasses.replace(config, num_warps=max(config.num_warps, 8))
    config = dataclasses.replace(config, **_float32_local(problem, dtype, head_dim, hopper)[0])
    if hopper:
        return config
    if sixteen_bit and 64 < head_dim <= 128 and gathers_score_tile_of(problem):
        config = dataclasses.replace(config, block_k=min(config.block_k, 32))
    f = problem.features
    local = f.window_left is not None or f.dropout_rate > 0 or problem.bias_shape is not None
    if local and _float32_d128(dtype, head_dim):
        config = dataclasses.replace(config, num_stages=max(config.num_stages, 3))
    if head_dim > 128 and not problem.same_value_dim:
        # Dv != D above head dim 128 (MLA's D 192 / Dv 128) on 2 stages, 16-bit and float32: on 1 the forward
        # spilled 8-16 B on sm_86 / sm_120 (16-bit, 128 registers) and 16 B on sm_80 (float32 on 4 warps); on 2
        # it holds 126 / 72 registers (Version 12, found by the plan-derived registry).
        config = dataclasses.replace(config, num_stages=max(config.num_stages, 2))
    return config


def backward_configs(problem: _Problem, dtype, head_dim: int, *, hopper: bool,
                     large_smem: bool) -> tuple[FlashConfig, FlashConfig]:
    """The configs of the dQ and dK/dV kernels for this call on a GPU (`hopper`; `large_smem`: over 160 KB of
    shared memory per CTA), where `default_config`'s spill with its features (docs/perf-notes.md, Versions 7
    and 7b):

    - 16-bit inputs with a dense `bias` or GQA on a GPU without wgmma (sm_80 / sm_86): dK/dV steps over 32
      queries at head dim 64 (64 x 64 spilled 16-28 B there with a float32 bias tile, 16 B per query head of
      GQA: its float32 dK / dV outputs, `dkv_per_query_head`; a local window too: 16-24 B, 241-242 registers
      on 32, Version 7c), and over 16 at head dim 256 on a 99 KB GPU (sm_86: 32 x 32 with a float32 bias
      tile needed 102,400 B of shared memory, and spilled 8 B with GQA; a score_mod that gathers a score
      tile, a relative-bias table, needed 102,400 B too, Version 7c);
    - 16-bit inputs at head dim 64 with a BlockMask on sm_80 / sm_86: dK/dV on 32-key tiles. 64 x 64 spilled
      16-40 B with a document mask or a sliding window (a soft cap on it too), 32 x 64 still 8-24 B; 64 x 32
      holds 128-154 registers (Version 7d);
    - float32 at head dim 64 and 256 with GQA on sm_90a: dK/dV on 4 warps (4-8 B spilled on 8);
    - float32 at head dim 128, dQ: on sm_90a 3 stages, on sm_80 / sm_86 4 warps. On 8 warps and 2 stages
      ptxas held it to 64 registers and spilled 4-32 B with a window, dropout, ALiBi, a dense mask or a
      BlockMask; 3 stages hold every feature's dQ in 64-126 registers on sm_90a without a spill (4 warps
      spilled 676 B there with a soft cap on a BlockMask), 4 warps in 102-192 on sm_80 / sm_86;
    - float32 at head dim 256 with a dense `mask`, dK/dV on 4 warps on sm_80 / sm_86: on 8 (16 x 16, 1 stage)
      it spilled 8 B there, on 4 it holds 142-184 registers and 69,632 B of shared memory."""
    config = problem.config
    dq = dkv = config
    if dkv_split(problem, head_dim):  # 32-query steps (16 unsplit); 64 spilled 84 B (Version 7f)
        dkv = dataclasses.replace(dkv, block_q_dkv=min(max(dkv.block_q_dkv, 32), dkv.block_k_dkv))
    tiled = problem.bias_shape is not None or problem.group > 1  # a bias tile, or float32 dK / dV per head
    if jnp.dtype(dtype).itemsize == 2 and not hopper:
        if head_dim <= 64:
            if tiled or problem.features.window_left is not None:
                dkv = dataclasses.replace(dkv, block_q_dkv=min(dkv.block_q_dkv, 32))
            if problem.features.block_sizes is not None:
                dkv = dataclasses.replace(dkv, block_k_dkv=min(dkv.block_k_dkv, 32))
        elif head_dim > 128 and not large_smem and (tiled or gathers_score_tile_of(problem)):
            dkv = dataclasses.replace(config, block_q_dkv=min(config.block_q_dkv, 16))
    if _float32_d128(dtype, head_dim):
        dq = dataclasses.replace(config, num_stages=3) if hopper else dataclasses.replace(config, num_warps=4)
    if jnp.dtype(dtype) == jnp.float32 and head_dim > 128 and problem.mask_shape is not None and not hopper:
        dkv = dataclasses.replace(config, num_warps=4)
    if jnp.dtype(dtype) == jnp.float32 and not 64 < head_dim <= 128 and problem.group > 1 and hopper:
        dkv = dataclasses.replace(config, num_warps=4)
    fields, dq_fields = _float32_local(problem, dtype, head_dim, hopper)
    dkv = dataclasses.replace(dkv, **fields)
    dq = dataclasses.replace(dq, **dq_fields)
    dkv = dataclasses.replace(dkv, **_float32_dkv(problem, dtype, head_dim, hopper))
    return dq, dkv


def _float32_dkv(problem: _Problem, dtype, head_dim: int, hopper: bool) -> dict:
    """The float32 dK/dV fields for calls the plan-derived registry found spilling (docs/perf-notes.md,
    Version 12), on top of the rules above:

    - head dim 64 with GQA and a dense mask or a window on sm_80 / sm_86: 4 warps. On 8 it spilled 4 B at 64
      registers (per query head, `dkv_per_query_head`); on 4 it holds 96;
    - head dim 256 with GQA and Dv != D on sm_80 / sm_86: 2 stages. On 4 warps and 1 stage it spilled 20 B at
      128 registers; on 2 stages it holds 128;
    - head dim 256 causal on a wide-MMA GPU: 4 warps. On 8 it spilled 8 B at 128 registers at seq 8192 (not at
      1024: ptxas schedules the longer loop differently); on 4 it holds 144."""
    f = problem.features
    if jnp.dtype(dtype) != jnp.float32:
        return {}
    if not hopper and head_dim <= 64 and problem.group > 1 and (problem.mask_shape is not None
                                                                or f.window_left is not None):
        return dict(num_warps=4)
    if not hopper and head_dim > 128 and problem.group > 1 and not problem.same_value_dim:
        return dict(num_stages=2)
    if hopper and head_dim > 128 and f.window_right == 0 and f.window_left is None and problem.group == 1:
        return dict(num_warps=4)
    return {}


def gathers_score_tile_of(problem: _Problem) -> bool:
    """Whether the call's score_mod gathers a score tile (`gathers_score_tile`) at the tiles it was traced at."""
    hook, traced = problem.features.score_mod, problem.config  # the hooks were traced at its tiles (`hook_shapes`)
    return hook is not None and gathers_score_tile(hook, traced.block_q, traced.block_k)


def gathers_score_tile(hook: Hook, block_q: int, block_k: int) -> bool:
    """Whether a score_mod traced at the (block_q, block_k) tile gathers a value per score from a captured
    array (an index tile of both axes, such as `table[h, q_idx - kv_idx]`), not a scalar or a row / column."""
    jaxpr = hook._jaxpr([jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((block_q, block_k), jnp.float32), ((), jnp.int32), ((), jnp.int32), ((block_q, 1), jnp.int32),
        ((1, block_k), jnp.int32))])
    consts = set(jaxpr.constvars)
    return any(eqn.primitive.name == "gather" and eqn.invars[0] in consts
               and sum(size > 1 for size in eqn.outvars[0].aval.shape) >= 2 for eqn in jaxpr.eqns)


def dkv_per_query_head(problem: _Problem) -> bool:
    """Whether the dK/dV kernel runs one program per query head rather than per KV head (its dK / dV
    summed over the group by XLA, in float32): with GQA / MQA, as FlashAttention-2's backward does. The loop
    over the group's query heads around the query loop spilled on every GPU with every feature tried
    (docs/perf-notes.md, Version 7b: plain causal GQA 8 -> 2 at head dim 64 72-76 B on sm_80 / sm_86, 256 76 B
    on sm_90a, float32 256 over sm_86's shared memory; with a bias 20-204 B, a window, dropout or segment ids
    8-112 B); per query head the kernel is the one without GQA, whose tiles the compile report checks. K and V
    are then read once per query head instead of once per KV head, and dK / dV written once per query head in
    float32 and summed: next to the query tiles each program streams, a few percent of the memory traffic at
    long sequences, and group x more programs for the GPU to spread. The loop stays for a GPU run to time
    against (forced through `_dispatch.triton_dkv_per_query_head`), and in interpret mode, whose interpreter
    pays per grid step (the test suite took a third longer on per-head grids): tests force the per-head grid
    where they check it."""
    return problem.group > 1 and not _interpreted(problem)


def dkv_split(problem: _Problem, head_dim: int) -> bool:
    """Whether the dK/dV kernel computes dV and dK in two programs per key tile, each holding one block_k x D
    float32 accumulator and recomputing the scores (5 dots per query step in all, against 4): on transposed
    scores (`problem.dkv_transposed`, Hopper) at head dim 256 with a score tile read per element, a dense bias
    or a score_mod that gathers one from a captured array (a relative-bias table), as the tangent splits its
    value head dim for them (`triton.tangent.tangent_tiles`). Unsplit, dK and dV (64 x 256 float32) held 128
    of the 255 registers, and a float32 tile spilled 8 B on every tile, stage and warp count tried; split, the
    32-query steps of `backward_configs` hold 239 registers, all wgmma (docs/perf-notes.md, Version 7f)."""
    score_tile = problem.bias_shape is not None or gathers_score_tile_of(problem)
    return problem.dkv_transposed and head_dim > 128 and score_tile


def tcgen05_backward_configs(problem: _Problem, dtype, head_dim: int, dq: FlashConfig,
                             dkv: FlashConfig) -> tuple[FlashConfig, FlashConfig]:
    """The dQ and dK/dV configs on a tcgen05 GPU (compute capability 10.x: `backward_configs`' wide-MMA ones,
    then these), where Hopper's tiles spilled on sm_100a (Triton moves the tensor-memory accumulators through
    registers there, so the same tiles hold more of them than with wgmma; docs/perf-notes.md, Version 9), for
    16-bit inputs:

    - dQ with a BlockMask at head dim 256, and with a BlockMask and a score_mod at 64: 1 stage. On 2, 255
      registers and 44-68 B spilled at 256 (a document mask, a sliding window, a soft cap on it), 4 B with the
      soft-capped window at 64; on 1 they hold 127-201 registers, all tcgen05 (a 16-key step spilled 12 B
      with the document mask at 256; at 64 one stage spilled 8-16 B with a BlockMask alone, which holds on 2);
    - dK/dV at head dim 256 with a BlockMask or a score_mod that gathers a score tile (a relative-bias table:
      split in two programs, `dkv_split`): 1 stage. On 2 the BlockMask's 16 x 64 on K Q^T spilled 756-792 B (split at 32
      x 64 still 60-64 B, 4 warps 5.8 KB) and the split relative-bias kernel 8 B at 128 registers; on 1 they hold
      178-255 registers without a spill, all tcgen05;
    - dK/dV at head dim 64 with a dense bias and GQA (its per-query-head grid, `dkv_per_query_head`): 1 stage.
      On 2 the bfloat16 bias's 64 x 64 tile spilled 4 B at 128 registers on sm_100a (sm_90a holds it in 227
      without a spill); the row of backend "mosaic" with a bias found it (docs/perf-notes.md, Version 25)."""
    if jnp.dtype(dtype).itemsize != 2:
        return dq, dkv
    if head_dim <= 64 and problem.bias_shape is not None and problem.group > 1:
        dkv = dataclasses.replace(dkv, num_stages=1)
    masked = problem.features.block_sizes is not None
    if masked and (head_dim > 128 or (head_dim <= 64 and problem.features.score_mod is not None)):
        dq = dataclasses.replace(dq, num_stages=1)
    if head_dim > 128 and (masked or gathers_score_tile_of(problem)):
        dkv = dataclasses.replace(dkv, num_stages=1)
    return dq, dkv
