"""Ragged paged attention in Pallas Triton: the new tokens of many sequences, packed in one array, against
their paged KV caches (decode rows, prompt chunks and whole prompts in one launch).

Grid: one program per (work item, key/value head g). An item is up to `block_q` consecutive packed tokens of
one sequence (`_ragged_schedule.ragged_work_items`); its tile's rows pack those tokens times the N / K query
heads of group g (row r = t * group + j, padded to a power of two >= 16), gathered into a per-item layout in
XLA so that no program reads or writes another item's rows. The program walks the pages of its sequence
through the item's row of the page table, from the page its first token's window reaches (0 without a window)
to the page of its last token's position, in steps of `block_k` keys (several small pages a step), with the
online softmax of FlashAttention-2 in base 2. Pages outside that range are never read.

Masks: the steps wholly below the first token's position and inside the last token's window need none (no
key there is in the future of a row or out of its window), so they run without the per-element mask; the
edge steps, and every step with a mask_mod, take it (causal, window, mask_mod; padding rows). Quantized pages
(int8 / float8_e4m3fn) are converted tile by tile to q's dtype for the dots, with `k_scale[g]` folded into the
score scale and `v_scale[g]` into the output. Sinks join the denominator at the end, as one more base-2
partial of the running (max, sum). Rows of padding tokens and idle items are 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from probjax_kernels import _backend
from probjax_kernels._decode_inputs import decode_hook_args
from probjax_kernels._hooks import Hook
from probjax_kernels._ragged_schedule import WorkItems, item_steps, ragged_work_items
from probjax_kernels._scores import LOG2E
from probjax_kernels.triton import lowering
from probjax_kernels.triton.decode import _default_stages, _pad_last, _pow2, _precision
from probjax_kernels.triton.forward import _M_INIT
from probjax_kernels.triton.specs import _output
from probjax_kernels.triton.tiles import _dot, _run_ranges, online_softmax_step


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """The static shape of one call's kernel (hashable: part of the jaxpr)."""

    block_q: int  # tokens of an item
    group: int  # N / K
    rows: int  # rows of a program's tile: block_q * group padded to a power of two >= 16
    page: int  # keys per page
    pages_per_seq: int
    tile: int  # keys per tile: a page, or a slice of one when pages are larger than block_k
    tiles_per_step: int
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    score_mod: Hook | None
    mask_mod: Hook | None
    num_score_consts: int
    has_sinks: bool
    quantized: bool
    interpret: bool
    num_warps: int
    num_stages: int

    @property
    def keys_per_step(self) -> int:
        return self.tile * self.tiles_per_step


def _plan(q, k_pages, v_pages, page_indices, *, block_q: int, interpret: bool, num_warps, num_stages, **fields):
    _, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    itemsize = q.dtype.itemsize
    widest = max(_pow2(head_dim), _pow2(v_pages.shape[3]))
    rows = _pow2(block_q * group)
    # Keys per step as the decode kernel takes them: 64 up to head dim 128 (32 for float32), 16 at 256; 32
    # in interpret mode. Before Hopper, a 64-row tile's step holds 32 (four 16-key pages of scores and
    # tiles in flight spilled on sm_80 and sm_86; wgmma's accumulators live elsewhere on sm_90a), and 16 over
    # quantized pages with a soft cap (their dequantized tiles beside the cap's tanh spilled 8 B at 255
    # registers on sm_80 at 32) and, on sm_120, at head dims up to 64 (8 B at 128 registers on 32-key steps
    # with 4 warps, or with the hooks on 8; 96-113 registers on 16).
    block_k = 32 if interpret else (64 if itemsize <= 2 else 32) if widest <= 128 else 16
    device = _backend.target_device()
    if not interpret and rows >= 64 and not _backend.is_hopper(device):
        block_k = min(block_k, 16 if fields["quantized"] and fields["soft_cap"] is not None else 32)
        if widest <= 64 and _backend.is_consumer_blackwell(device):
            block_k = 16
    tile = min(page, block_k)
    pages_per_seq = page_indices.shape[1]
    tiles_per_step = min(block_k // tile, _pow2(pages_per_seq))
    return RaggedPlan(
        block_q=block_q, group=group, rows=rows, page=page, pages_per_seq=pages_per_seq, tile=tile,
        tiles_per_step=tiles_per_step, interpret=interpret,
        num_warps=num_warps or _ragged_warps(rows, _pow2(v_pages.shape[3]), itemsize),
        num_stages=num_stages or _default_stages(tile * tiles_per_step, (head_dim, v_pages.shape[3]), itemsize),
        **fields,
    )


def _ragged_warps(rows: int, value_dim: int, itemsize: int) -> int:
    """8 warps from a 64 x 128 (rows x Dv) float32 accumulator on, or float32 inputs; else 4. (The decode kernel
    takes 8 from 32 x 128, `decode._default_warps`; here a 64 x 64 tile on 8 warps spilled 8 B at 128 registers
    with the ALiBi and window hooks on sm_120.)"""
    return 8 if rows * value_dim >= 64 * 128 or itemsize == 4 else 4


# ------------------------------------------------------------------------------------------------ the kernel


def _ragged_kernel(q_ref, k_ref, v_ref, table_ref, first_ref, length_ref, seq_ref, *refs, plan: RaggedPlan):
    *optional, out_ref = refs
    optional = list(optional)
    sinks_ref = optional.pop(0) if plan.has_sinks else None
    k_scale_ref, v_scale_ref = (optional.pop(0), optional.pop(0)) if plan.quantized else (None, None)
    score_refs, mask_refs = optional[:plan.num_score_consts], optional[plan.num_score_consts:]
    kv_head = pl.program_id(1)
    rows, tile = plan.rows, plan.tile
    first, length, b = first_ref[...], length_ref[...], seq_ref[...]
    last = first + length - 1  # the item's last position; keys past it are never needed
    lo = 0 if plan.sliding_window is None else jnp.maximum(first - plan.sliding_window + 1, 0)  # first key needed
    num_pages_cache = k_ref.shape[0]
    q = q_ref[...]
    row = jnp.arange(rows, dtype=jnp.int32)[:, None]
    row_real = row < length * plan.group
    q_idx = first + row // plan.group
    h = kv_head * plan.group + row % plan.group
    scale = plan.scale * (k_scale_ref[...] if plan.quantized else 1.0)
    per_page = -(-plan.page // tile)
    offsets = jnp.arange(tile, dtype=jnp.int32)

    def load(ref, width, index, within):
        """A (tile, width) tile of a page, width the power of two >= the ref's head dim (lanes past it 0)."""
        dim = ref.shape[-1]
        if width == dim:
            return ref[index, within, :]
        mask = (jnp.arange(width, dtype=jnp.int32) < dim)[None, :]
        return lowering.load(ref.at[index, within, pl.ds(0, width)], mask=mask, other=0)

    def read_tile(i, masked: bool):
        """(k, v, kv_idx) of tile i of the sequence (key positions i * tile ...), in q's dtype."""
        index = jnp.clip(table_ref[jnp.minimum(i // per_page, plan.pages_per_seq - 1)], 0, num_pages_cache - 1)
        within = pl.ds((i % per_page) * tile, tile) if per_page > 1 else slice(None)
        positions = i * tile + offsets
        k = load(k_ref, q.shape[-1], index, within).astype(q.dtype)
        v = load(v_ref, out_ref.shape[-1], index, within).astype(q.dtype)
        if masked:  # slots outside [lo, last] may hold anything (NaN in a recycled page): 0 * NaN is NaN
            v = jnp.where((positions[:, None] >= lo) & (positions[:, None] <= last), v, 0)
        return k, v, positions[None, :]

    def scores(k, kv_idx, masked: bool):
        """Base-2 scores: scale * q k^T, then score_mod, then the soft cap; -inf where masked."""
        s = _dot(q, k, (1, 1), _precision(q)) * scale
        if plan.score_mod is not None:
            s = plan.score_mod.in_kernel(score_refs, s, b, h, q_idx, kv_idx)
        if plan.soft_cap is not None:
            s = plan.soft_cap * jnp.tanh(s / plan.soft_cap)
        s2 = s * LOG2E
        if not masked:
            return s2
        allowed = (kv_idx <= q_idx) & row_real
        if plan.sliding_window is not None:
            allowed &= q_idx - kv_idx < plan.sliding_window
        if plan.mask_mod is not None:
            allowed &= plan.mask_mod.in_kernel(mask_refs, b, h, q_idx, kv_idx)
        return jnp.where(allowed, s2, -jnp.inf)

    def body(step, carry, masked: bool):
        tiles = [read_tile(step * plan.tiles_per_step + i, masked) for i in range(plan.tiles_per_step)]
        s2 = [scores(k, kv_idx, masked) for k, _, kv_idx in tiles]
        return online_softmax_step(carry, s2, [v for _, v, _ in tiles], _precision(q))

    carry = (
        jnp.zeros((rows, out_ref.shape[-1]), jnp.float32),
        jnp.full((rows,), _M_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = _run_ranges(item_steps(first, length, plan.keys_per_step, plan.sliding_window,
                                       plan.mask_mod is not None), body, carry)
    if plan.has_sinks:  # one more partial: a key of score sink[h] and value 0
        sink2 = sinks_ref[...] * LOG2E
        m_new = jnp.maximum(m, sink2)
        alpha = jnp.exp2(m - m_new)
        acc, l = acc * alpha[:, None], l * alpha + jnp.exp2(sink2 - m_new)
    valid = (l != 0) & row_real[:, 0]
    out = acc / jnp.where(valid, l, 1.0)[:, None]
    if plan.quantized:
        out = out * v_scale_ref[...]
    out_ref[...] = jnp.where(valid[:, None], out, 0.0).astype(out_ref.dtype)


# ------------------------------------------------------------------------------------------- pallas_call glue


def _token_index(items: WorkItems, block_q: int) -> jax.Array:
    """`[W, block_q]` packed row of each item row; rows past an item's length get -1."""
    t = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    return jnp.where(t < items.length[:, None], items.start[:, None] + t, -1)


def pack_items(q, tokens, plan: RaggedPlan, num_kv_heads: int, head_dim: int):
    """q `[T, N, D]` -> `[W, K, rows, Dp]`: row t * group + j of (item w, head g) holds the item's token t of
    query head g * group + j; zeros elsewhere (interpret mode pads with NaN, and 0 * NaN poisons a dot)."""
    items, block_q = tokens.shape
    gathered = jnp.where((tokens >= 0)[..., None, None], q[jnp.maximum(tokens, 0)], 0)  # [W, block_q, N, D]
    gathered = gathered.reshape(items, block_q, num_kv_heads, plan.group, -1).transpose(0, 2, 1, 3, 4)
    gathered = gathered.reshape(items, num_kv_heads, block_q * plan.group, -1)
    gathered = jnp.pad(gathered, ((0, 0), (0, 0), (0, plan.rows - block_q * plan.group), (0, 0)))
    return _pad_last(gathered, head_dim)


def unpack_items(out, tokens, plan: RaggedPlan, num_tokens: int, value_dim: int):
    """`[W, K, rows, Dvp]` -> `[T, N, Dv]`, each item row scattered to its packed row; other rows 0."""
    items, num_kv_heads = out.shape[:2]
    block_q = tokens.shape[1]
    out = out[:, :, : block_q * plan.group, :value_dim]
    out = out.reshape(items, num_kv_heads, block_q, plan.group, value_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(items * block_q, num_kv_heads * plan.group, value_dim)
    where = jnp.where(tokens >= 0, tokens, num_tokens).reshape(-1)  # out of range: dropped
    return jnp.zeros((num_tokens, *out.shape[1:]), out.dtype).at[where].set(out, mode="drop")


def ragged_paged_attention_kernel(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
                                  k_scale, v_scale, hook_consts, *, scale: float, sliding_window: int | None,
                                  soft_cap: float | None, score_hook: Hook | None, mask_hook: Hook | None,
                                  num_score_consts: int, block_q: int, interpret: bool,
                                  num_warps: int | None = None, num_stages: int | None = None):
    """Ragged paged attention of checked inputs on an NVIDIA GPU (or in interpret mode): out `[T, N, Dv]`.

    q `[T, N, D]`; pages `[P, page_size, K, D|Dv]` in q's dtype or int8 / float8_e4m3fn (with k_scale /
    v_scale `[K]` float32); kv_lens `[S]`, page_indices `[S, pages_per_seq]`, cu_q_lens `[S + 1]` int32;
    num_seqs a traced int32 scalar; sinks `[N]` float32 or None; hook_consts: the score hook's arrays, then
    the mask hook's (whole arrays, read by the hooks in the kernel)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, value_dim = k_pages.shape[2], v_pages.shape[3]
    plan = _plan(q, k_pages, v_pages, page_indices, block_q=block_q, interpret=interpret, num_warps=num_warps,
                 num_stages=num_stages, scale=float(scale), sliding_window=sliding_window, soft_cap=soft_cap,
                 score_mod=score_hook, mask_mod=mask_hook, num_score_consts=num_score_consts,
                 has_sinks=sinks is not None, quantized=k_scale is not None)
    items = ragged_work_items(cu_q_lens, num_seqs, num_tokens, block_q)
    tokens = _token_index(items, block_q)
    seq_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    first = kv_lens[items.seq] - seq_lens[items.seq] + (items.start - cu_q_lens[items.seq])
    tables = page_indices[items.seq].astype(jnp.int32)  # [W, pages_per_seq]: each item's page table
    packed = pack_items(q, tokens, plan, num_kv_heads, _pow2(head_dim))
    if plan.score_mod is not None:
        plan.score_mod.prepare(*decode_hook_args(True, plan.rows, plan.tile))
    if plan.mask_mod is not None:
        plan.mask_mod.prepare(*decode_hook_args(False, plan.rows, plan.tile))

    def kv_spec(dim):
        return pl.BlockSpec((k_pages.shape[0], plan.page, None, dim), lambda w, g: (0, 0, g, 0))

    def per_item(x):
        return pl.BlockSpec((None, *x.shape[1:]), lambda w, g, n=x.ndim: (w,) + (0,) * (n - 1))

    def per_head(x):
        return pl.BlockSpec((None, *x.shape[1:]), lambda w, g, n=x.ndim: (g,) + (0,) * (n - 1))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n)

    arrays = [packed, k_pages, v_pages, tables, first.astype(jnp.int32), items.length, items.seq]
    specs = [pl.BlockSpec((None, None, plan.rows, packed.shape[-1]), lambda w, g: (w, g, 0, 0)),
             kv_spec(head_dim), kv_spec(value_dim), *(per_item(x) for x in arrays[3:])]
    if sinks is not None:  # [K, rows]: row r of group g holds the sink of head g * group + r % group
        heads = jnp.arange(num_kv_heads)[:, None] * plan.group + jnp.arange(plan.rows)[None, :] % plan.group
        arrays.append(sinks.astype(jnp.float32)[heads])
        specs.append(per_head(arrays[-1]))
    if k_scale is not None:
        arrays += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
        specs += [per_head(arrays[-2]), per_head(arrays[-1])]
    arrays += list(hook_consts)
    specs += [whole(c) for c in hook_consts]
    value_pad = _pow2(value_dim)
    params = dict(interpret=True) if interpret else dict(
        compiler_params=lowering.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages))
    out = pl.pallas_call(
        functools.partial(_ragged_kernel, plan=plan),
        grid=(items.seq.shape[0], num_kv_heads),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, None, plan.rows, value_pad), lambda w, g: (w, g, 0, 0)),
        out_shape=_output((items.seq.shape[0], num_kv_heads, plan.rows, value_pad), q.dtype, q, k_pages, v_pages),
        name="probjax_ragged_paged_attention",
        **params,
    )(*arrays)
    return unpack_items(out, tokens, plan, num_tokens, value_dim)


def pages_refused(page_dtype, interpret: bool) -> str | None:
    """Why this kernel cannot read pages of `page_dtype` on the target GPU, or None: Triton converts
    float8_e4m3fn only from compute capability 8.9 on (sm_80 / sm_86 fail to compile the cast)."""
    if interpret or jnp.dtype(page_dtype) != jnp.float8_e4m3fn:
        return None
    capability = _backend.compute_capability(_backend.target_device())
    if capability is not None and capability < (8, 9):
        return (f"float8_e4m3fn pages on a GPU of compute capability {capability[0]}.{capability[1]} (Triton "
                "converts float8 from 8.9 on: L4 / L40S, H100 and later)")
    return None
