"""The split-KV decode kernel in Pallas Triton (flash-decoding) and its glue.

One program per (sequence b, key/value head g and row block, split s): its tile's rows pack the T new tokens
times the N / K query heads of group g (row r = t * group + j, padded to a power of two >= 16), so the group
shares one pass over its keys. The program walks its split's share of the keys of sequence b (a dense cache
is read as one page of S keys per sequence) in tiles of min(page, block_k) keys, `block_k` keys a step
(small pages: several independent loads in flight, one rescale per step), reading each page through a
scalar from `block_tables`, with the online softmax of FlashAttention-2 (m_i, l_i: running max and sum,
base-2 scores). It writes a partial (out, lse) per split; `merge_splits` combines them by lse in float32.

The cache is read in place, whatever its length and head dims: Triton's in-kernel arrays are powers of two,
so a tile loads a power-of-two width with a mask on the head dim past D and on the keys past the length
(which also covers a dense cache's tail past S), instead of a padded copy of the cache per call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import fuser as _fuser  # noqa: F401  (see _triton_specs: avoids a retrace)

from probjax_kernels._config import _MIN_BLOCK
from probjax_kernels._decode_inputs import DecodeConfig, DecodeInputs, decode_hook_args
from probjax_kernels._decode_merge import merge_splits
from probjax_kernels._hooks import Hook
from probjax_kernels._scores import LN2, LOG2E
from probjax_kernels.triton import lowering
from probjax_kernels.triton.forward import _M_INIT
from probjax_kernels.triton.specs import _output
from probjax_kernels.triton.tiles import _dot, online_softmax_step

# Rows of one program's tile at head dim 128 and below (128 for 2-byte dtypes, 64 for float32; half that at
# head dim 256): beyond, ptxas spilled or shared memory ran out (sm_80, sm_86, sm_90a). Larger groups x new
# tokens take several row blocks.
MAX_ROWS = 128


def _pow2(n: int) -> int:
    return max(_MIN_BLOCK, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The static shape of one decode call's kernel (hashable: part of the jaxpr)."""

    new_tokens: int  # T
    group: int  # N / K
    rows: int  # rows of a program's tile (power of two >= 16)
    row_blocks: int  # tiles per key/value head
    page: int  # keys per page: the page size, or a dense cache's S
    max_pages: int  # pages per sequence (1 for a dense cache)
    tile: int  # keys per tile: a page, or a slice of a page larger than block_k (a power of two)
    tiles_per_step: int  # tiles one loop step reads (several small pages: independent loads in flight)
    splits: int
    scale: float
    causal: bool
    lookback: int | None  # keys before a new token its mask can attend (a window), None: unknown
    score_mod: Hook | None
    mask_mod: Hook | None
    num_score_consts: int
    backend: str
    num_warps: int
    num_stages: int

    @property
    def tiles_per_page(self) -> int:
        return -(-self.page // self.tile)  # a dense cache's last tile may reach past S (masked)


def default_splits(batch: int, num_kv_heads: int, row_blocks: int, capacity: int, steps: int, backend: str) -> int:
    """Programs per (sequence, key/value head): enough to fill the GPU about twice over, each with at least
    256 keys and a step of its own (on the CPU, 2: interpret mode pays per program)."""
    if backend == "interpret":
        return min(2, steps)
    device = jax.devices()[0]
    cores = getattr(device, "core_count", None) or 108
    programs = batch * num_kv_heads * row_blocks
    wanted = -(-2 * cores // programs)
    most = max(1, capacity // 256)
    return max(1, min(wanted, most, steps))


def plan_for(inputs: DecodeInputs, config: DecodeConfig, score_mod: Hook | None, mask_mod: Hook | None,
             num_score_consts: int) -> DecodePlan:
    """The kernel's plan for `inputs` on `config.backend` ("triton" or "interpret"; `_dispatch.decode_plan`
    fills it) and `config`'s other fields (None: the defaults below)."""
    backend = config.backend
    batch, new_tokens, num_heads, num_kv_heads, head_dim, value_dim = inputs.shape
    group = num_heads // num_kv_heads
    itemsize = inputs.q.dtype.itemsize
    widest = max(128, _pow2(head_dim), _pow2(value_dim))
    packed = _pow2(new_tokens * group)
    rows = min(packed, max(_MIN_BLOCK, (MAX_ROWS if itemsize <= 2 else MAX_ROWS // 8) * 128 // widest))
    # Keys per step: 64 up to head dim 128 (16 for float32, whose tiles take twice the registers and shared
    # memory), 16 at head dim 256: the largest that ptxas compiled without a spill on every target. A paged
    # cache whose pages are shorter than that reads each page of a step as a tile of its own (its own page
    # table entry and addresses): 16-bit steps there take 32 keys (64 keys over pages of 16 spilled 8 B at 128
    # registers on sm_86 / sm_89 / sm_100a). Interpret mode takes 32, fewer unrolled pages to compile.
    if backend == "interpret":
        block_k = config.block_k or 32
    else:
        block_k = config.block_k or ((64 if itemsize <= 2 else 16) if widest <= 128 else _MIN_BLOCK)
        if not config.block_k and inputs.paged and itemsize <= 2 and inputs.page_size < block_k:
            block_k = max(_MIN_BLOCK, block_k // 2)
    if inputs.paged:
        page, max_pages = inputs.page_size, inputs.block_tables.shape[1]
        tile = min(page, block_k)
        tiles_per_step = min(block_k // tile, _pow2(max_pages))
    else:  # one page of S keys per sequence, read in block_k tiles (the last one masked past S)
        page, max_pages = inputs.capacity, 1
        tile, tiles_per_step = min(block_k, _pow2(page)), 1
    steps = -(-max_pages * -(-page // tile) // tiles_per_step)
    keys_per_step = tile * tiles_per_step
    # With a window, a sequence's splits share only the steps from its earliest new token's window on.
    reach = inputs.capacity if inputs.lookback is None else min(
        inputs.capacity, inputs.lookback + new_tokens + keys_per_step)
    splits = inputs.num_splits or default_splits(batch, num_kv_heads, packed // rows, reach,
                                                 min(steps, -(-reach // keys_per_step)), backend)
    splits = min(splits, steps)  # every program has a step of its own
    return DecodePlan(
        new_tokens=new_tokens, group=group, rows=rows, row_blocks=packed // rows, page=page, max_pages=max_pages,
        tile=tile, tiles_per_step=tiles_per_step, splits=splits, scale=inputs.scale, causal=inputs.causal,
        lookback=inputs.lookback, score_mod=score_mod, mask_mod=mask_mod, num_score_consts=num_score_consts,
        backend=backend,
        num_warps=config.num_warps or _default_warps(rows, _pow2(value_dim), itemsize),
        num_stages=config.num_stages or _default_stages(tile * tiles_per_step, (head_dim, value_dim), itemsize),
    )


def _default_warps(rows: int, value_dim: int, itemsize: int) -> int:
    """8 warps once the float32 accumulator (rows x Dv) or float32 inputs would need over ~128 registers per
    thread at 4 (ptxas spilled there: rows 128 x Dv 128 in bfloat16, float32 at hd 128, sm_80 / sm_90a)."""
    return 8 if rows * value_dim >= 32 * 128 or itemsize == 4 else 4


def _default_stages(keys: int, head_dims: tuple[int, int], itemsize: int) -> int:
    """Two pipeline stages of K / V tiles when they fit in the smallest shared memory of the targets
    (sm_86's 101,376 B per block, with room for the rest), else one."""
    stage_bytes = keys * sum(_pow2(d) for d in head_dims) * itemsize
    return 2 if 2 * stage_bytes <= 96 * 1024 else 1


# ------------------------------------------------------------------------------------------------ the kernel


def _decode_kernel(q_ref, k_ref, v_ref, table_ref, len_ref, *refs, plan: DecodePlan):
    *const_refs, out_ref, lse_ref = refs
    score_refs, mask_refs = const_refs[:plan.num_score_consts], const_refs[plan.num_score_consts:]
    b, head_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head, row_block = head_block // plan.row_blocks, head_block % plan.row_blocks
    rows = plan.rows
    num_pages_cache = k_ref.shape[0]
    kv_len = len_ref[...]
    q = q_ref[...]
    row = row_block * rows + jnp.arange(rows, dtype=jnp.int32)[:, None]  # (rows, 1) packed row t * group + j
    row_real = row < plan.new_tokens * plan.group
    q_idx = kv_len - plan.new_tokens + row // plan.group  # the new token's global position
    h = kv_head * plan.group + row % plan.group
    tile, per_page = plan.tile, plan.tiles_per_page
    offsets = jnp.arange(tile, dtype=jnp.int32)

    def load(ref, width, index, within, rows_ok):
        """A (tile, width) tile of a page, width the power of two >= the ref's head dim: the lanes past it,
        and the rows where `rows_ok` is False (when given), read as 0 without touching memory."""
        dim = ref.shape[-1]
        lanes = slice(None) if width == dim else pl.ds(0, width)
        mask = None if width == dim else (jnp.arange(width, dtype=jnp.int32) < dim)[None, :]
        if rows_ok is not None:
            mask = rows_ok[:, None] if mask is None else rows_ok[:, None] & mask
        if mask is None:
            return ref[index, within, lanes]
        return lowering.load(ref.at[index, within, lanes], mask=mask, other=0)

    def read_tile(i):
        """(k, v, kv_idx) of tile i of the sequence (keys i * tile ...); a tile past the table re-reads the
        last page (masked)."""
        page_slot = jnp.minimum(i // per_page, plan.max_pages - 1)
        index = jnp.clip(table_ref[page_slot], 0, num_pages_cache - 1)
        within = pl.ds((i % per_page) * tile, tile) if per_page > 1 or plan.page != tile else slice(None)
        positions = i * tile + offsets
        # A dense cache's last tile reaches past S (max_pages = 1: positions are rows of the page): no memory
        # there. Other rows load unmasked, which keeps the loads pipelined (a mask on the length did not).
        in_page = positions < plan.page if plan.page % tile else None
        # Slots past the length may hold anything (NaN in a recycled page): p = 0 there, but 0 * NaN is NaN.
        v = jnp.where(positions[:, None] < kv_len, load(v_ref, out_ref.shape[-1], index, within, in_page), 0)
        return load(k_ref, q.shape[-1], index, within, in_page), v, positions[None, :]

    def scores(k, kv_idx):
        """Base-2 scores s2 = log2(e) * score_mod(scale * q k^T), -inf where not attended."""
        dot = _dot(q, k, (1, 1), _precision(q))
        if plan.score_mod is None:
            s2 = dot * (plan.scale * LOG2E)
        else:
            s2 = plan.score_mod.in_kernel(score_refs, dot * plan.scale, b, h, q_idx, kv_idx) * LOG2E
        # Causal among the new tokens implies kv_idx < kv_len; without it the length masks.
        allowed = ((kv_idx <= q_idx) if plan.causal else (kv_idx < kv_len)) & row_real
        if plan.mask_mod is not None:
            allowed &= plan.mask_mod.in_kernel(mask_refs, b, h, q_idx, kv_idx)
        return jnp.where(allowed, s2, -jnp.inf)

    def body(step, carry):
        tiles = [read_tile(step * plan.tiles_per_step + i) for i in range(plan.tiles_per_step)]
        s2 = [scores(k, kv_idx) for k, _, kv_idx in tiles]
        return online_softmax_step(carry, s2, [v for _, v, _ in tiles], _precision(q))

    # The splits share the steps that hold keys of this sequence (its length, not the cache's capacity), so
    # a short sequence in a long cache still spreads over every split; with a known window, only the steps
    # from the one holding the earliest new token's first key (kv_len - T - lookback) on.
    keys_per_step = tile * plan.tiles_per_step
    steps = (kv_len + keys_per_step - 1) // keys_per_step
    start = 0
    if plan.lookback is not None:
        start = jnp.minimum(jnp.maximum(kv_len - plan.new_tokens - plan.lookback, 0) // keys_per_step, steps)
    per_split = (steps - start + plan.splits - 1) // plan.splits
    first = start + split * per_split
    last = jnp.minimum(first + per_split, steps)
    carry = (
        jnp.zeros((rows, out_ref.shape[-1]), jnp.float32),
        jnp.full((rows,), _M_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(first, jnp.maximum(first, last), body, carry)
    valid = l != 0  # l = 0: nothing attended in this split
    safe_l = jnp.where(valid, l, 1.0)
    out_ref[...] = jnp.where(valid[:, None], acc / safe_l[:, None], 0.0)
    lse_ref[...] = jnp.where(valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)


def _precision(q):
    return lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT


# ------------------------------------------------------------------------------------------- pallas_call glue


def _pad_last(x, size: int):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def pack_queries(q, plan: DecodePlan, head_dim: int):
    """q `[B, T, N, D]` -> `[B, K * row_blocks, rows, Dp]`: row t * group + j of head block g holds token t of
    query head g * group + j; zero padding (interpret mode pads with NaN, and 0 * NaN poisons a dot)."""
    batch, new_tokens, num_heads, _ = q.shape
    num_kv_heads = num_heads // plan.group
    packed = q.reshape(batch, new_tokens, num_kv_heads, plan.group, -1).transpose(0, 2, 1, 3, 4)
    packed = packed.reshape(batch, num_kv_heads, new_tokens * plan.group, -1)
    total = plan.rows * plan.row_blocks
    packed = jnp.pad(packed, ((0, 0), (0, 0), (0, total - packed.shape[2]), (0, 0)))
    return _pad_last(packed, head_dim).reshape(batch, num_kv_heads * plan.row_blocks, plan.rows, head_dim)


def unpack_rows(x, plan: DecodePlan, batch: int, num_heads: int):
    """`[B, K * row_blocks, rows, ...]` -> `[B, T, N, ...]` (the inverse of `pack_queries` on the row axis)."""
    num_kv_heads = num_heads // plan.group
    x = x.reshape(batch, num_kv_heads, plan.rows * plan.row_blocks, *x.shape[3:])
    x = x[:, :, : plan.new_tokens * plan.group]
    x = x.reshape(batch, num_kv_heads, plan.new_tokens, plan.group, *x.shape[3:])
    x = jnp.moveaxis(x, 2, 1)  # [B, T, K, group, ...]
    return x.reshape(batch, plan.new_tokens, num_heads, *x.shape[4:])


def paged_view(inputs: DecodeInputs):
    """(k pages `[P, page, K, D]`, v pages `[P, page, K, Dv]`, block tables `[B, max_pages]`), the cache as
    given (never a copy): a paged one with its tables, a dense `[B, S, K, D]` one as one page of S keys per
    sequence (table `[[0], [1], ...]`)."""
    if inputs.paged:
        return inputs.k, inputs.v, inputs.block_tables
    batch = inputs.k.shape[0]
    return inputs.k, inputs.v, jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1)


def decode_partials(plan: DecodePlan, q, k_pages, v_pages, tables, kv_lengths, consts):
    """Per-split (out `[B, K * row_blocks, splits, rows, Dvp]` float32, lse `[B, K * row_blocks, splits,
    rows]` float32, natural log) of packed queries against pages."""
    batch, head_blocks, rows, head_dim = q.shape  # head dims padded to powers of two (the cache's are not)
    num_pages, page = v_pages.shape[:2]
    value_dim = _pow2(v_pages.shape[3])
    grid = (batch, head_blocks, plan.splits)

    def kv_spec(dim):
        return pl.BlockSpec((num_pages, page, None, dim), lambda b, g, s: (0, 0, g // plan.row_blocks, 0))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n)

    params = dict(interpret=True) if plan.backend == "interpret" else dict(
        compiler_params=lowering.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages))
    return pl.pallas_call(
        functools.partial(_decode_kernel, plan=plan),
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, g, s: (b, g, 0, 0)),
            kv_spec(k_pages.shape[3]), kv_spec(v_pages.shape[3]),
            pl.BlockSpec((None, tables.shape[1]), lambda b, g, s: (b, 0)),
            pl.BlockSpec((None,), lambda b, g, s: (b,)),
            *(whole(c) for c in consts),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, value_dim), lambda b, g, s: (b, g, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, g, s: (b, g, s, 0)),
        ],
        out_shape=[
            _output((batch, head_blocks, plan.splits, rows, value_dim), jnp.float32, q, k_pages, v_pages),
            _output((batch, head_blocks, plan.splits, rows), jnp.float32, q, k_pages, v_pages),
        ],
        name="probjax_decode_attention",
        **params,
    )(q, k_pages, v_pages, tables, kv_lengths, *consts)


def decode(plan: DecodePlan, q, k, v, kv_lengths, block_tables, consts):
    """(out `[B, T, N, Dv]` in q's dtype, lse `[B, N, T]` float32) of checked inputs through the kernel."""
    checked = DecodeInputs(q, k, v, kv_lengths, block_tables, plan.scale, plan.splits, True)
    batch, _, num_heads, _, head_dim, value_dim = checked.shape
    k_pages, v_pages, tables = paged_view(checked)
    packed = pack_queries(q, plan, _pow2(head_dim))
    if plan.score_mod is not None:
        plan.score_mod.prepare(*decode_hook_args(True, plan.rows, plan.tile))
    if plan.mask_mod is not None:
        plan.mask_mod.prepare(*decode_hook_args(False, plan.rows, plan.tile))
    out, lse = decode_partials(plan, packed, k_pages, v_pages, tables, kv_lengths, consts)
    out, lse = merge_splits(out, lse)
    out = unpack_rows(out[..., :value_dim], plan, batch, num_heads).astype(q.dtype)
    lse = unpack_rows(lse[..., None], plan, batch, num_heads)[..., 0]  # [B, T, N]
    return out, jnp.transpose(lse, (0, 2, 1))

