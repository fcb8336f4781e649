"""The split-KV decode kernel in Pallas Mosaic TPU (flash-decoding over dense and paged caches) and its glue.

Grid (sequence b, split s, step j). A cache `[P, page, K, D]` (paged) or `[B, S, K, D]` (dense) is tiled by
XLA on its last two dims (K, D), so one key/value head of a page is not a slice a DMA can take: each step
reads whole pages, all K heads, once, and one program runs every key/value head g on them. Its query block
`[K, rows, D]` packs, per head g, the T new tokens times the N / K query heads of group g (row r = t * group
+ j, padded to the sublane tile), so a group shares one pass; the head's keys are a strided load `k[:, g, :]`
from VMEM, the step's pages stacked into one (keys, D) tile. A paged step holds `tiles_per_step` pages, each
its own BlockSpec whose index map reads `block_tables` (scalar-prefetched) for the page, so the Pallas
pipeline DMAs the pages of the next step from HBM while this one computes; a dense step is one
`[tile, K, D]` block of the sequence's own cache. The steps of sequence b (its length, not the capacity)
are shared among the splits; steps past a split's share repeat its last pages in every index map (no DMA)
and skip the compute. Online softmax (m, l, the float32 accumulator in VMEM scratch) per head; each split
writes (out, lse), which `_decode_merge.merge_splits` combines by lse in XLA.

Hooks see a float32 (rows, keys of a step) score tile, b a scalar, q_idx an int32 (rows, 1) column (the
global position `kv_lengths[b] - T + t`), kv_idx a (1, keys) row and h an int32 (rows, 1) column, or, when
the hook reads a captured array at h (`slopes[h]`, a vector gather Mosaic TPU cannot lower), a scalar: the
hook then runs once per query head of the group and each row keeps its own head's result (group times the
hook's elementwise work).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._decode_inputs import DecodeConfig, DecodeInputs
from probjax_kernels._decode_merge import merge_splits
from probjax_kernels._hooks import Hook
from probjax_kernels._scores import LN2, LOG2E
from probjax_kernels.tpu import common
from probjax_kernels.tpu.vet import hook_problem

MAX_PAGES_PER_STEP = 16  # BlockSpecs per cache per step (each a page buffer, double-buffered)
_CORES = {"v4": 2, "v5p": 2}  # TensorCores a chip's "parallel" grid axes spread over (megacore); else 1


@dataclasses.dataclass(frozen=True)
class TpuDecodePlan:
    """The static shape of one decode call's TPU kernel (hashable: part of the jaxpr)."""

    new_tokens: int  # T
    group: int  # N / K
    num_kv_heads: int  # K
    rows: int  # packed rows per key/value head: T * group, padded to the sublane tile
    tile: int  # keys per block: a page, or a dense cache's block
    tiles_per_step: int  # blocks one step reads (pages: one BlockSpec each)
    num_tiles: int  # blocks per sequence: max_pages, or cdiv(S, tile)
    steps: int  # grid steps per split (the largest share)
    splits: int
    paged: bool
    causal: bool  # the new tokens see each other causally; False: every key below the length
    scale: float
    score_mod: Hook | None
    mask_mod: Hook | None
    score_per_head: bool  # the score_mod takes h as a scalar: called once per query head of the group
    mask_per_head: bool
    num_score_consts: int
    backend: str  # "tpu" or "tpu_interpret"


def _hook_specs(rows: int, tile: int, with_score: bool, scalar_head: bool) -> list[jax.ShapeDtypeStruct]:
    i32 = jnp.int32
    specs = [jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct(() if scalar_head else (rows, 1), i32),
             jax.ShapeDtypeStruct((rows, 1), i32), jax.ShapeDtypeStruct((1, tile), i32)]
    return [jax.ShapeDtypeStruct((rows, tile), jnp.float32), *specs] if with_score else specs


class HookNotInKernel(NotImplementedError):
    """A hook the Mosaic TPU decode kernel cannot run (`_dispatch.decode_plan` turns it into the XLA path)."""


def _vet_hook(name: str, hook: Hook | None, rows: int, tile: int) -> bool:
    """Prepares `hook` at the kernel's shapes; whether it runs per query head (h a scalar). Raises when it
    cannot run in Mosaic TPU either way."""
    if hook is None:
        return False
    with_score = name == "score_mod"
    reasons = []
    for scalar_head in (False, True):
        specs = _hook_specs(rows, tile, with_score, scalar_head)
        hook.prepare(*specs)
        # The decode kernel holds hook arrays in SMEM only: a read along q_idx / kv_idx is a vector gather here.
        reason = hook_problem(hook, _shapes(specs, with_score), with_score, derivative=False, tiles=False)
        if reason is None:
            return scalar_head
        reasons.append(reason)
    raise HookNotInKernel(f"the {name} cannot run in the Mosaic TPU decode kernel ({reasons[-1]})")


def _shapes(specs, with_score: bool) -> tuple:
    """(b, h, q_idx, kv_idx, score) shapes of hook specs, as `vet.hook_problem` takes them."""
    shapes = [s.shape for s in specs]
    score = shapes.pop(0) if with_score else (1, 1)
    return (*shapes, score)


def default_splits(batch: int, total_steps: int, generation: str) -> int:
    """Splits per sequence: 2 in interpret mode (so the tests run the merge), else enough programs for the
    chip's TensorCores (2 on megacore chips, v4 / v5p, when B = 1); each program streams its keys anyway."""
    if generation == "interpret":
        return min(2, total_steps)
    return max(1, min(-(-_CORES.get(generation, 1) // batch), total_steps))


def plan_for(inputs: DecodeInputs, config: DecodeConfig, score_mod: Hook | None, mask_mod: Hook | None,
             num_score_consts: int, generation: str) -> TpuDecodePlan:
    """The kernel's plan for `inputs` on `config.backend` ("tpu" or "tpu_interpret"); `generation` is the
    target's ("v5e", ...; "interpret" in interpret mode). `config.block_k`: keys per step (default 128, 32
    interpreted): pages of a paged cache are gathered up to it; num_warps / num_stages are ignored."""
    batch, new_tokens, num_heads, num_kv_heads, _, _ = inputs.shape
    group = num_heads // num_kv_heads
    align = 16 if jnp.dtype(common.compute_dtype(inputs.q.dtype)).itemsize == 2 else 8
    rows = -(-new_tokens * group // align) * align
    block_k = config.block_k or (32 if generation == "interpret" else 128)
    if inputs.paged:
        tile, num_tiles = inputs.page_size, inputs.block_tables.shape[1]
        tiles_per_step = max(1, min(block_k // tile, MAX_PAGES_PER_STEP, num_tiles))
    else:
        tile = min(block_k, inputs.k.shape[1])
        num_tiles, tiles_per_step = -(-inputs.k.shape[1] // tile), 1
    total_steps = -(-num_tiles // tiles_per_step)
    splits = min(inputs.num_splits or default_splits(batch, total_steps, generation), total_steps)
    return TpuDecodePlan(
        new_tokens=new_tokens, group=group, num_kv_heads=num_kv_heads, rows=rows, tile=tile,
        tiles_per_step=tiles_per_step, num_tiles=num_tiles, steps=-(-total_steps // splits), splits=splits,
        # `causal` is a field of DecodeInputs on branches that have decode_attention(causal=...); True before.
        paged=inputs.paged, causal=getattr(inputs, "causal", True), scale=inputs.scale, score_mod=score_mod,
        mask_mod=mask_mod,
        score_per_head=_vet_hook("score_mod", score_mod, rows, tile * tiles_per_step),
        mask_per_head=_vet_hook("mask_mod", mask_mod, rows, tile * tiles_per_step),
        num_score_consts=num_score_consts, backend=config.backend,
    )


# ------------------------------------------------------------------------------------------------ the walk


def _split_range(plan: TpuDecodePlan, kv_len, split):
    """(first, end): the steps of split `split` over a sequence of `kv_len` keys (its steps shared evenly)."""
    keys_per_step = plan.tile * plan.tiles_per_step
    steps = (kv_len + keys_per_step - 1) // keys_per_step
    per_split = (steps + plan.splits - 1) // plan.splits
    first = split * per_split
    return first, jnp.minimum(first + per_split, steps)


def _block_index(plan: TpuDecodePlan, b, split, j, lengths, tables, i: int, num_pages: int):
    """The cache block that block spec i reads at step j: the step's i-th tile, clamped to the sequence's last
    tile; a step past the split's share repeats its last step (the pipeline skips the DMA)."""
    kv_len = lengths[b]
    first, end = _split_range(plan, kv_len, split)
    step = jnp.minimum(first + j, jnp.maximum(end - 1, 0))
    last_tile = jnp.maximum((kv_len + plan.tile - 1) // plan.tile - 1, 0)
    tile = jnp.minimum(step * plan.tiles_per_step + i, last_tile)
    if plan.paged:
        return jnp.clip(tables[b, tile], 0, num_pages - 1), 0, 0, 0
    return b, tile, 0, 0


# ---------------------------------------------------------------------------------------------- the kernel


def _call_hook(hook: Hook, consts, per_head: bool, kv_head: int, group: int, score, b, h, q_idx, kv_idx):
    """The hook on a tile (a mask_mod when `score` is None): once with h the rows' head column, or (per_head)
    once per query head of kv head `kv_head` with h a scalar, each row keeping its own head's result."""
    lead = () if score is None else (score,)
    if not per_head:
        return hook.in_kernel(consts, *lead, b, h, q_idx, kv_idx)
    row_head = h - kv_head * group
    result = None
    for j in range(group):
        value = hook.in_kernel(consts, *lead, b, jnp.int32(kv_head * group + j), q_idx, kv_idx)
        result = value if result is None else jnp.where(row_head == j, value, result)
    return result


def _stack(tiles: list):
    return tiles[0] if len(tiles) == 1 else jnp.concatenate(tiles, axis=0)


def _decode_kernel(lengths_ref, *refs, plan: TpuDecodePlan, to_consts):
    n = plan.tiles_per_step
    tables_ref, refs = (refs[0], refs[1:]) if plan.paged else (None, refs)
    q_ref, k_refs, v_refs = refs[0], refs[1:1 + n], refs[1 + n:1 + 2 * n]
    score_consts, mask_consts = to_consts(refs[1 + 2 * n:-5])
    out_ref, lse_ref, m_ref, l_ref, acc_ref = refs[-5:]
    del tables_ref
    b, split, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_len = lengths_ref[b]
    first, end = _split_range(plan, kv_len, split)
    rows, group, keys = plan.rows, plan.group, plan.tile * n
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    row_head = row % group
    q_idx = kv_len - plan.new_tokens + row // group  # the new token's global position
    row_real = row < plan.new_tokens * group

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, common.M_INIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(first + j < end)
    def _():
        start = (first + j) * keys
        kv_idx = start + lax.broadcasted_iota(jnp.int32, (1, keys), 1)
        # Slots past the length may hold anything (NaN in a recycled page): p = 0 there, and 0 * NaN is NaN.
        in_length = start + lax.broadcasted_iota(jnp.int32, (keys, 1), 0) < kv_len
        # Causal among the new tokens (which implies kv_idx < kv_len), or every key below the length.
        allowed_base = ((kv_idx <= q_idx) if plan.causal else (kv_idx < kv_len)) & row_real
        for g in range(plan.num_kv_heads):
            q = q_ref[g]
            h = g * group + row_head
            # The step's pages stacked on the sublanes (whole tiles): one (rows, keys) score tile per head.
            k = _stack([ref[:, g, :] for ref in k_refs]).astype(q.dtype)
            v = jnp.where(in_length, _stack([ref[:, g, :] for ref in v_refs]).astype(q.dtype), 0)
            s = common.dot(q, k, (1, 1)) * plan.scale
            if plan.score_mod is not None:
                s = _call_hook(plan.score_mod, score_consts, plan.score_per_head, g, group, s, b, h, q_idx, kv_idx)
            allowed = allowed_base
            if plan.mask_mod is not None:
                allowed &= _call_hook(plan.mask_mod, mask_consts, plan.mask_per_head, g, group, None, b, h, q_idx,
                                      kv_idx)
            s = jnp.where(allowed, s * LOG2E, -jnp.inf)
            m = m_ref[g]
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp2(m - m_new)
            weights = jnp.exp2(s - m_new)
            l_ref[g] = l_ref[g] * alpha + jnp.sum(weights, axis=1, keepdims=True)
            acc_ref[g] = acc_ref[g] * alpha + common.dot(weights.astype(v.dtype), v, (1, 0))
            m_ref[g] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        for g in range(plan.num_kv_heads):
            l, m = l_ref[g], m_ref[g]
            valid = l != 0  # l = 0: nothing attended in this split
            safe_l = jnp.where(valid, l, 1.0)
            out_ref[g] = jnp.where(valid, acc_ref[g] / safe_l, 0.0)
            lse_ref[g] = jnp.where(valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)


# ------------------------------------------------------------------------------------------ pallas_call glue


def pack_queries(q, plan: TpuDecodePlan):
    """q `[B, T, N, D]` -> `[B, K, rows, D]` in the compute dtype: row t * group + j of head g holds token t of
    query head g * group + j; zero padding."""
    batch, new_tokens, num_heads, head_dim = q.shape
    packed = q.reshape(batch, new_tokens, plan.num_kv_heads, plan.group, head_dim).transpose(0, 2, 1, 3, 4)
    packed = packed.reshape(batch, plan.num_kv_heads, new_tokens * plan.group, head_dim)
    packed = jnp.pad(packed, ((0, 0), (0, 0), (0, plan.rows - packed.shape[2]), (0, 0)))
    return packed.astype(common.compute_dtype(q.dtype))


def unpack_rows(x, plan: TpuDecodePlan):
    """`[B, K, rows, ...]` -> `[B, T, N, ...]` (the inverse of `pack_queries` on the row axis)."""
    batch = x.shape[0]
    x = x[:, :, : plan.new_tokens * plan.group]
    x = x.reshape(batch, plan.num_kv_heads, plan.new_tokens, plan.group, *x.shape[3:])
    x = jnp.moveaxis(x, 2, 1)  # [B, T, K, group, ...]
    return x.reshape(batch, plan.new_tokens, plan.num_kv_heads * plan.group, *x.shape[4:])


def decode_partials(plan: TpuDecodePlan, q, k, v, kv_lengths, tables, consts):
    """Per-split (out `[B, K, splits, rows, Dv]`, lse `[B, K, splits, rows, 1]`), float32, natural log, of
    packed queries `[B, K, rows, D]` against the cache as given (pages `[P, page, K, D]` or `[B, S, K, D]`)."""
    batch, num_kv_heads, rows, head_dim = q.shape
    value_dim = v.shape[3]
    scalars = [kv_lengths.astype(jnp.int32), *([tables.astype(jnp.int32)] if plan.paged else [])]

    def cache_spec(dim, i):
        def index_map(b, s, j, lengths, *tables_ref):
            return _block_index(plan, b, s, j, lengths, tables_ref[0] if plan.paged else None, i, k.shape[0])
        return pl.BlockSpec((None, plan.tile, num_kv_heads, dim), index_map)

    n = plan.tiles_per_step
    const_arrays = [common.smem_array(c) for c in consts]
    scalar_flags = [jnp.ndim(c) == 0 for c in consts]

    def to_consts(refs):
        wrapped = [common._Scalar(r) if flag else r for r, flag in zip(refs, scalar_flags)]
        return tuple(wrapped[:plan.num_score_consts]), tuple(wrapped[plan.num_score_consts:])

    head_block = (None, num_kv_heads, None, rows)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(batch, plan.splits, plan.steps),
        in_specs=[
            pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b, s, j, *_: (b, 0, 0, 0)),
            *(cache_spec(head_dim, i) for i in range(n)), *(cache_spec(value_dim, i) for i in range(n)),
            *(pl.BlockSpec(memory_space=pltpu.SMEM) for _ in const_arrays),
        ],
        out_specs=[
            pl.BlockSpec((*head_block, value_dim), lambda b, s, j, *_: (b, 0, s, 0, 0)),
            pl.BlockSpec((*head_block, 1), lambda b, s, j, *_: (b, 0, s, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                        pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                        pltpu.VMEM((num_kv_heads, rows, value_dim), jnp.float32)],
    )
    if plan.backend == "tpu_interpret":
        params = dict(interpret=pltpu.InterpretParams())
    else:
        params = dict(compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")))
    shape = (batch, num_kv_heads, plan.splits, rows)
    return pl.pallas_call(
        functools.partial(_decode_kernel, plan=plan, to_consts=to_consts),
        grid_spec=grid_spec,
        out_shape=[common.output((*shape, value_dim), jnp.float32, q, k, v),
                   common.output((*shape, 1), jnp.float32, q, k, v)],
        name="probjax_tpu_decode_attention",
        **params,
    )(*scalars, q, *([k] * n), *([v] * n), *const_arrays)


def decode(plan: TpuDecodePlan, q, k, v, kv_lengths, block_tables, consts):
    """(out `[B, T, N, Dv]` in q's dtype, lse `[B, N, T]` float32) of checked inputs through the kernel."""
    # Mosaic TPU cannot load float16 vectors (v5e: "Invalid vector type for load"): a float16 cache is
    # converted to float32 by XLA first, a copy of the cache per call (bfloat16 caches are read in place).
    compute = common.compute_dtype(k.dtype)
    k, v = k.astype(compute), v.astype(compute)
    out, lse = decode_partials(plan, pack_queries(q, plan), k, v, kv_lengths, block_tables, consts)
    out, lse = merge_splits(out, lse[..., 0])
    out = unpack_rows(out, plan).astype(q.dtype)
    lse = unpack_rows(lse[..., None], plan)[..., 0]  # [B, T, N]
    return out, jnp.transpose(lse, (0, 2, 1))
