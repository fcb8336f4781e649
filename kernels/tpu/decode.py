"""The split-KV decode kernel in Pallas Mosaic TPU (flash-decoding over dense and paged caches) and its glue.

Grid (sequence b, split s, step j). One program runs every key/value head g on the pages it reads once. Its
query block `[K, rows, D']` packs, per head g, the T new tokens times the N / K query heads of group g (row
r = t * group + j, padded to the sublane tile), so a group shares one pass. A cache `[P, page, K, D]`
(paged) or `[B, S, K, D]` (dense) is read in place, in one of two views (`decode_layout.py`): rows, the free
reshape `[.., S * K, D]` whose blocks `[tile * K, W]` are dense on sublanes and lanes, head g's keys the
strided rows `block[g::K]` (D > 128 in lane blocks of 128, one BlockSpec each); or, where only that one is
free (D > 128 with K in {2, 4}, K = 1 in float32), heads: `[tile, K, D]` blocks, head g's keys
`block[:, g, :]`. A paged step holds `tiles_per_step` pages, each page (and lane block) its own BlockSpec
whose index map reads `block_tables` (scalar-prefetched) for the page, so the Pallas pipeline DMAs the pages
of the next step from HBM while this one computes; a dense step is one block of the sequence's own cache.
In VMEM the step's pages are stacked into one (keys, W) tile per head. The steps of sequence b (its length,
not the capacity) are shared among the splits; steps past a split's share repeat its last pages in every
index map (no DMA) and skip the compute. Only a step that can hold a key some row must not see (past the
first new token's position, causal; past the length otherwise) runs the causal / length mask and zeroes V
past the length; the steps before it run an unmasked variant (a mask_mod applies on every step). Online
softmax per head: the running max and sum lane-broadcast in `[K, rows, 128]` float32 VMEM scratch, the
accumulator `[K, rows, Dv']`; each split writes (out, lse), which `_decode_merge.merge_splits` combines by
lse in XLA.

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
from probjax_kernels.tpu.decode_layout import CacheView, as_view, block_spec, cache_view, head_keys, pad_lanes
from probjax_kernels.tpu.vet import hook_problem

MAX_PAGES_PER_STEP = 16  # pages per step (each page's lane blocks a BlockSpec, double-buffered)
LANES = 128  # the running max and sum are held lane-broadcast: (rows, 128) float32, unmasked stores
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
    k_view: CacheView  # how the key cache is read (decode_layout.py)
    v_view: CacheView
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
    compute = common.compute_dtype(inputs.k.dtype)
    converted = jnp.dtype(compute) != jnp.dtype(inputs.k.dtype)
    return TpuDecodePlan(
        new_tokens=new_tokens, group=group, num_kv_heads=num_kv_heads, rows=rows, tile=tile,
        tiles_per_step=tiles_per_step, num_tiles=num_tiles, steps=-(-total_steps // splits), splits=splits,
        # `causal` is a field of DecodeInputs on branches that have decode_attention(causal=...); True before.
        paged=inputs.paged, causal=getattr(inputs, "causal", True), scale=inputs.scale, score_mod=score_mod,
        mask_mod=mask_mod, k_view=cache_view(num_kv_heads, inputs.k.shape[3], compute, tile, converted),
        v_view=cache_view(num_kv_heads, inputs.v.shape[3], compute, tile, converted),
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
    """(leading index, tile index) of the cache block that tile i of step j reads: the step's i-th tile,
    clamped to the sequence's last tile; a step past the split's share repeats its last step (the pipeline
    skips the DMA). Paged: (the page, 0); dense: (b, the tile)."""
    kv_len = lengths[b]
    first, end = _split_range(plan, kv_len, split)
    step = jnp.minimum(first + j, jnp.maximum(end - 1, 0))
    last_tile = jnp.maximum((kv_len + plan.tile - 1) // plan.tile - 1, 0)
    tile = jnp.minimum(step * plan.tiles_per_step + i, last_tile)
    if plan.paged:
        return jnp.clip(tables[b, tile], 0, num_pages - 1), 0
    return b, tile


def _step_masked(plan: TpuDecodePlan, kv_len, start):
    """Whether the step of keys start .. start + keys - 1 can hold a key some real row must not see: a key past
    the first new token's position (causal; the diagonal of the new tokens, or past the length), or past the
    length (causal=False). Every earlier step lies wholly inside the sequence and runs unmasked."""
    keys = plan.tile * plan.tiles_per_step
    seen_by_all = kv_len - plan.new_tokens if plan.causal else kv_len - 1
    return start + keys - 1 > seen_by_all


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


def _head_tile(view: CacheView, refs, head: int, chunk: int, dtype):
    """Head `head`'s (keys of a step, width) tile of lane block `chunk`: the step's tiles stacked on the
    sublanes. `refs`: the cache's blocks of the step, tile-major (tile i, chunk c at i * chunks + c)."""
    tiles = [head_keys(view, refs[i * view.chunks + chunk], head, chunk) for i in range(len(refs) // view.chunks)]
    return _stack(tiles).astype(dtype)


def _column(x):
    """A lane-broadcast (rows, 128) statistic as the (rows, 1) column it holds."""
    return x[:, :1]


def _step(plan: TpuDecodePlan, refs: dict, b, kv_len, start, masked: bool) -> None:
    """One step's keys for every KV head: the online softmax update of m, l, acc (base 2). `masked`: the
    step may hold keys a row must not see (`_step_masked`): the causal / length mask and the zeroing of V
    past the length (slots there may hold anything, NaN in a recycled page: p = 0 there, and 0 * NaN is NaN);
    an unmasked step runs neither. A mask_mod applies on every step."""
    rows, group, keys = plan.rows, plan.group, plan.tile * plan.tiles_per_step
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    q_idx = kv_len - plan.new_tokens + row // group  # the new token's global position
    kv_idx = start + lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    if masked:  # causal among the new tokens (which implies kv_idx < kv_len), or every key below the length
        allowed = ((kv_idx <= q_idx) if plan.causal else (kv_idx < kv_len)) & (row < plan.new_tokens * group)
        in_length = start + lax.broadcasted_iota(jnp.int32, (keys, 1), 0) < kv_len
    score_consts, mask_consts = refs["consts"]
    kv, vv = plan.k_view, plan.v_view
    for g in range(plan.num_kv_heads):
        q = refs["q"][g]
        h = g * group + row % group
        s = None
        for c in range(kv.chunks):
            part = common.dot(q[:, c * kv.width:(c + 1) * kv.width], _head_tile(kv, refs["k"], g, c, q.dtype), (1, 1))
            s = part if s is None else s + part
        if plan.score_mod is None:
            s = s * (plan.scale * LOG2E)
        else:
            s = _call_hook(plan.score_mod, score_consts, plan.score_per_head, g, group, s * plan.scale, b, h,
                           q_idx, kv_idx) * LOG2E
        keep = allowed if masked else None
        if plan.mask_mod is not None:
            chosen = _call_hook(plan.mask_mod, mask_consts, plan.mask_per_head, g, group, None, b, h, q_idx, kv_idx)
            keep = chosen if keep is None else keep & chosen
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
        m_prev = refs["m"][g]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp2(m_prev - m_new)
        weights = jnp.exp2(s - _column(m_new))
        refs["l"][g] = refs["l"][g] * alpha + jnp.sum(weights, axis=1, keepdims=True)
        refs["m"][g] = m_new
        for c in range(vv.chunks):
            v = _head_tile(vv, refs["v"], g, c, q.dtype)
            if masked:
                v = jnp.where(in_length, v, jnp.zeros((), v.dtype))
            lanes = pl.ds(c * vv.width, vv.width)
            refs["acc"][g, :, lanes] = (refs["acc"][g, :, lanes] * _column(alpha)
                                        + common.dot(weights.astype(v.dtype), v, (1, 0)))


def _decode_kernel(lengths_ref, *refs, plan: TpuDecodePlan, to_consts):
    n = plan.tiles_per_step
    num_k, num_v = n * plan.k_view.chunks, n * plan.v_view.chunks
    tables_ref, refs = (refs[0], refs[1:]) if plan.paged else (None, refs)
    del tables_ref
    named = dict(q=refs[0], k=refs[1:1 + num_k], v=refs[1 + num_k:1 + num_k + num_v],
                 consts=to_consts(refs[1 + num_k + num_v:-5]))
    out_ref, lse_ref = refs[-5:-3]
    named.update(zip(("m", "l", "acc"), refs[-3:]))
    b, split, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_len = lengths_ref[b]
    first, end = _split_range(plan, kv_len, split)

    @pl.when(j == 0)
    def _():
        named["m"][...] = jnp.full(named["m"].shape, common.M_INIT, jnp.float32)
        named["l"][...] = jnp.zeros(named["l"].shape, jnp.float32)
        named["acc"][...] = jnp.zeros(named["acc"].shape, jnp.float32)

    start = (first + j) * (plan.tile * n)
    visited, masked = first + j < end, _step_masked(plan, kv_len, start)
    pl.when(visited & masked)(lambda: _step(plan, named, b, kv_len, start, True))
    pl.when(visited & jnp.logical_not(masked))(lambda: _step(plan, named, b, kv_len, start, False))

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        value_dim = plan.v_view.dim
        for g in range(plan.num_kv_heads):
            l, m = _column(named["l"][g]), _column(named["m"][g])
            valid = l != 0  # l = 0: nothing attended in this split
            safe_l = jnp.where(valid, l, 1.0)
            out_ref[g] = jnp.where(valid, named["acc"][g][:, :value_dim] / safe_l, 0.0)
            lse_ref[g] = jnp.where(valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)


# ------------------------------------------------------------------------------------------ pallas_call glue


def pack_queries(q, plan: TpuDecodePlan):
    """q `[B, T, N, D]` -> `[B, K, rows, D']` in the compute dtype: row t * group + j of head g holds token t of
    query head g * group + j; zero padding (rows, and lanes up to the key blocks' width D')."""
    batch, new_tokens, num_heads, head_dim = q.shape
    packed = q.reshape(batch, new_tokens, plan.num_kv_heads, plan.group, head_dim).transpose(0, 2, 1, 3, 4)
    packed = packed.reshape(batch, plan.num_kv_heads, new_tokens * plan.group, head_dim)
    packed = jnp.pad(packed, ((0, 0), (0, 0), (0, plan.rows - packed.shape[2]), (0, 0)))
    return pad_lanes(packed, plan.k_view).astype(common.compute_dtype(q.dtype))


def unpack_rows(x, plan: TpuDecodePlan):
    """`[B, K, rows, ...]` -> `[B, T, N, ...]` (the inverse of `pack_queries` on the row axis)."""
    batch = x.shape[0]
    x = x[:, :, : plan.new_tokens * plan.group]
    x = x.reshape(batch, plan.num_kv_heads, plan.new_tokens, plan.group, *x.shape[3:])
    x = jnp.moveaxis(x, 2, 1)  # [B, T, K, group, ...]
    return x.reshape(batch, plan.new_tokens, plan.num_kv_heads * plan.group, *x.shape[4:])


def decode_partials(plan: TpuDecodePlan, q, k, v, kv_lengths, tables, consts):
    """Per-split (out `[B, K, splits, rows, Dv]`, lse `[B, K, splits, rows, 1]`), float32, natural log, of
    packed queries `[B, K, rows, D']` against the cache as given (pages `[P, page, K, D]` or `[B, S, K, D]`),
    read in the plan's views (`decode_layout.py`)."""
    batch, num_kv_heads, rows, padded_dim = q.shape
    value_dim = v.shape[3]
    num_pages = k.shape[0]
    scalars = [kv_lengths.astype(jnp.int32), *([tables.astype(jnp.int32)] if plan.paged else [])]

    def tile_index(i):
        def index_map(b, s, j, lengths, *tables_ref):
            return _block_index(plan, b, s, j, lengths, tables_ref[0] if plan.paged else None, i, num_pages)
        return index_map

    def cache_specs(view: CacheView):
        return [block_spec(view, plan.tile, c, tile_index(i)) for i in range(plan.tiles_per_step)
                for c in range(view.chunks)]

    k_specs, v_specs = cache_specs(plan.k_view), cache_specs(plan.v_view)
    const_arrays = [common.smem_array(c) for c in consts]
    scalar_flags = [jnp.ndim(c) == 0 for c in consts]

    def to_consts(refs):
        wrapped = [common.ScalarRef(r) if flag else r for r, flag in zip(refs, scalar_flags)]
        return tuple(wrapped[:plan.num_score_consts]), tuple(wrapped[plan.num_score_consts:])

    head_block = (None, num_kv_heads, None, rows)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(batch, plan.splits, plan.steps),
        in_specs=[
            pl.BlockSpec((None, num_kv_heads, rows, padded_dim), lambda b, s, j, *_: (b, 0, 0, 0)),
            *k_specs, *v_specs, *(pl.BlockSpec(memory_space=pltpu.SMEM) for _ in const_arrays),
        ],
        out_specs=[
            pl.BlockSpec((*head_block, value_dim), lambda b, s, j, *_: (b, 0, s, 0, 0)),
            pl.BlockSpec((*head_block, 1), lambda b, s, j, *_: (b, 0, s, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                        pltpu.VMEM((num_kv_heads, rows, plan.v_view.padded_dim), jnp.float32)],
    )
    if plan.backend == "tpu_interpret":
        params = dict(interpret=pltpu.InterpretParams())
    else:
        params = dict(compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")))
    shape = (batch, num_kv_heads, plan.splits, rows)
    k_view, v_view = as_view(k, plan.k_view), as_view(v, plan.v_view)
    return pl.pallas_call(
        functools.partial(_decode_kernel, plan=plan, to_consts=to_consts),
        grid_spec=grid_spec,
        out_shape=[common.output((*shape, value_dim), jnp.float32, q, k, v),
                   common.output((*shape, 1), jnp.float32, q, k, v)],
        name="probjax_tpu_decode_attention",
        **params,
    )(*scalars, q, *([k_view] * len(k_specs)), *([v_view] * len(v_specs)), *const_arrays)


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
