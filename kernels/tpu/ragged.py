"""Ragged paged attention in Pallas Mosaic TPU: mixed prefill and decode over a paged KV cache in one call.

Work split (`_ragged_schedule.ragged_work_items`): item w is up to `block_q` consecutive packed query rows of
one sequence; the grid is `(W,)`, one program per item running every KV head g (one pass over its pages
serves all heads). Each step walks `pages_per_step` pages of the item's sequence, from the first page its
window reaches (`max(0, p_first - w + 1) // page_size` with a sliding window of w, else 0) to the page of its
last position; pages outside that range are never read.

Tiles. q and out travel through BlockSpecs over a padded per-item layout `[W, K, rows, D]` that XLA gathers
from / back to the packed rows in the wrapper (so a program never touches another item's rows): row
`r = t * G + j` of KV head g holds the item's token t for query head `g * G + j` (G = N / K), rows =
block_q * G padded to the sublane tile. The schedule (item sequence, first position, length) and
`page_indices` are scalar-prefetched into SMEM; pages stay in HBM (`memory_space=pl.ANY`) and are fetched by
manual async DMA, double-buffered: step j + 1's pages load while step j computes, and the next item's first
pages while an item's last step computes (the grid runs in order, "arbitrary": the buffer slot an item
starts in is carried in SMEM scratch; a megacore chip's second TensorCore gets no share of it).
A DMA moves a whole page `[page_size, K, D]`: Mosaic refuses a DMA of one KV head's `[page_size, D]` slab
of a bfloat16 / int8 page (its offset along the (K, D)-tiled axes is not tile aligned), so a step's VMEM
buffer is `[keys, K, D]` and head g's keys are a strided load `buf[slot, :, g, :]` (keys, D), head dim on
the lanes. Online softmax in float32 per head: the running max and sum lane-dense in `[K, rows, 128]`
VMEM scratch (every lane equal), the accumulator `[K, rows, Dv]`.

Scores: `s = (scale * k_scale[g]) * q . k` (k_scale folded in, the page tile converted to q's dtype), then
score_mod, then the soft cap, then the mask, in the exp2 domain. Masked where: a step whose keys all lie at
or before the item's first position and (with a window) inside its last position's window runs unmasked
and without mask_mod; every other step (the causal diagonal, the window's edge, pages past the last
position, any step when a mask_mod is given) applies the per-element mask: key <= the row's position,
inside its window, mask_mod, row a real token; and zeroes V at keys outside the item's range (slots past the
length or not fetched may hold NaN). Sinks start the running max and sum (m = sink, l = 1), so they join
the denominator only. The end scales by v_scale[g] / l; padding rows and idle items write zeros.

Hooks: vetted and called as the decode kernel does (`tpu/decode.py`: h an int32 column, or a scalar per
query head of the group when the hook reads a captured array at h); one it cannot lower raises its
`HookNotInKernel`, which the dispatcher turns into the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._hooks import Hook
from probjax_kernels._ragged_schedule import ragged_work_items
from probjax_kernels._scores import LOG2E
from probjax_kernels.tpu import common
from probjax_kernels.tpu.decode import HookNotInKernel, _call_hook, _vet_hook

LANES = 128  # the running max / sum are held lane-broadcast: (rows, 128) f32 tiles, unmasked stores
KEYS_PER_STEP = 128  # default keys a step fetches per KV head (pages of 16: 8 pages; pages of 64: 2)


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """The static shape of one call's kernel (hashable: part of the jaxpr)."""

    num_items: int  # W
    block_q: int  # tokens per item
    group: int  # G = N / K
    num_kv_heads: int  # K
    rows: int  # block_q * G, padded to the sublane tile
    page_size: int
    pages_per_step: int
    pages_per_seq: int
    num_pages: int  # P
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    score_mod: Hook | None
    mask_mod: Hook | None
    score_per_head: bool  # the score_mod takes h as a scalar: called once per query head of the group
    mask_per_head: bool
    num_score_consts: int
    has_sinks: bool
    quantized: bool  # k_scale / v_scale given

    @property
    def keys(self) -> int:
        return self.page_size * self.pages_per_step


def _vet(name: str, hook: Hook | None, rows: int, keys: int) -> bool:
    try:
        return _vet_hook(name, hook, rows, keys)
    except HookNotInKernel as error:
        raise HookNotInKernel(str(error).replace("decode kernel", "ragged paged attention kernel")) from None


# ------------------------------------------------------------------------------------------------ the walk


@dataclasses.dataclass(frozen=True)
class _Item:
    """One program's item, from the scalar-prefetched schedule (scalars)."""

    seq: jax.Array
    first: jax.Array  # position of its first token
    last: jax.Array  # position of its last token (first - 1 when idle)
    lo_page: jax.Array  # first page read: the earliest page the first token's window reaches
    hi_page: jax.Array  # page of the last position
    steps: jax.Array  # steps of pages_per_step pages; 0 when idle


def _item(plan: RaggedPlan, w, seq_ref, first_ref, length_ref) -> _Item:
    length, first = length_ref[w], first_ref[w]
    last = first + length - 1
    lo_key = 0 if plan.sliding_window is None else jnp.maximum(first - plan.sliding_window + 1, 0)
    lo_page, hi_page = lo_key // plan.page_size, jnp.maximum(last, 0) // plan.page_size
    steps = (hi_page - lo_page + plan.pages_per_step) // plan.pages_per_step
    return _Item(seq_ref[w], first, last, lo_page, hi_page, jnp.where(length > 0, steps, 0))


def _copies(plan: RaggedPlan, item: _Item, step, slot, tables_ref, hbm: tuple, bufs: tuple, sems):
    """(fetched, k copy, v copy) of each page of `step` into buffer `slot`: pages past the item's last
    position are not fetched."""
    out = []
    for i in range(plan.pages_per_step):
        page = item.lo_page + step * plan.pages_per_step + i
        physical = tables_ref[item.seq, jnp.minimum(page, plan.pages_per_seq - 1)]
        physical = jnp.clip(physical, 0, plan.num_pages - 1)
        dst = pl.ds(i * plan.page_size, plan.page_size)
        copies = [pltpu.make_async_copy(src.at[physical], buf.at[slot, dst], sems.at[n, slot])
                  for n, (src, buf) in enumerate(zip(hbm, bufs))]
        out.append((page <= item.hi_page, *copies))
    return out


def _each(copies, method: str) -> None:
    """Starts (or waits for) the copies of the pages that are fetched."""
    for fetched, *pair in copies:

        @pl.when(fetched)
        def _(pair=pair):
            for copy in pair:
                getattr(copy, method)()


def _masked(plan: RaggedPlan, item: _Item, key_start):
    """Whether a step of keys key_start .. +keys can hold a key masked for some row of the item."""
    if plan.mask_mod is not None:
        return jnp.bool_(True)
    masked = key_start + plan.keys - 1 > item.first  # the causal diagonal, or pages past the last token
    if plan.sliding_window is not None:
        masked |= key_start < item.last - plan.sliding_window + 1  # the window edge of a later row
    return masked


# ---------------------------------------------------------------------------------------------- the kernel


def _lanes(x):
    """A lane-broadcast (rows, 128) statistic as the (rows, 1) column it holds."""
    return x[:, :1]


def _head_column(plan: RaggedPlan, ref, g: int, row_head):
    """`ref[g * G + row_head]` as a float32 (rows, 1) column, from an SMEM vector of N per-head scalars."""
    column = jnp.zeros(row_head.shape, jnp.float32)
    for j in range(plan.group):
        column = jnp.where(row_head == j, ref[g * plan.group + j], column)
    return column


def _step(plan: RaggedPlan, item: _Item, refs: dict, slot, key_start, masked: bool) -> None:
    """One step's keys for every KV head: the online softmax update of m, l, acc (FlashAttention-2 Alg. 1,
    base 2)."""
    rows, group = plan.rows, plan.group
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    q_idx = item.first + row // group
    kv_idx = key_start + lax.broadcasted_iota(jnp.int32, (1, plan.keys), 1)
    if masked:
        allowed = (kv_idx <= q_idx) & (row // group <= item.last - item.first)
        if plan.sliding_window is not None:
            allowed &= q_idx - kv_idx < plan.sliding_window
        key = key_start + lax.broadcasted_iota(jnp.int32, (plan.keys, 1), 0)
        lo_key = 0 if plan.sliding_window is None else item.first - plan.sliding_window + 1
        in_range = (key >= lo_key) & (key <= item.last)  # other slots may hold anything: NaN * 0 is NaN
    score_consts, mask_consts = refs["score_consts"], refs["mask_consts"]
    for g in range(plan.num_kv_heads):
        q = refs["q"][g]
        h = g * group + row % group
        k = refs["k_buf"][slot, :, g, :].astype(q.dtype)
        v = refs["v_buf"][slot, :, g, :].astype(q.dtype)
        scale = plan.scale * refs["k_scale"][g] if plan.quantized else plan.scale
        s = common.dot(q, k, (1, 1)) * scale
        if plan.score_mod is not None:
            s = _call_hook(plan.score_mod, score_consts, plan.score_per_head, g, group, s, item.seq, h, q_idx,
                           kv_idx)
        if plan.soft_cap is not None:
            s = plan.soft_cap * jnp.tanh(s / plan.soft_cap)
        s = s * LOG2E
        if masked:
            keep = allowed
            if plan.mask_mod is not None:
                keep &= _call_hook(plan.mask_mod, mask_consts, plan.mask_per_head, g, group, None, item.seq, h,
                                   q_idx, kv_idx)
            s = jnp.where(keep, s, -jnp.inf)
            v = jnp.where(in_range, v, jnp.zeros_like(v))
        m_prev = refs["m"][g]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp2(m_prev - m_new)
        weights = jnp.exp2(s - _lanes(m_new))
        refs["l"][g] = refs["l"][g] * alpha + jnp.sum(weights, axis=1, keepdims=True)
        refs["acc"][g] = refs["acc"][g] * _lanes(alpha) + common.dot(weights.astype(v.dtype), v, (1, 0))
        refs["m"][g] = m_new


def _kernel(seq_ref, first_ref, length_ref, tables_ref, *refs, plan: RaggedPlan, names: tuple, to_consts):
    refs = dict(zip(names, refs))
    refs["score_consts"], refs["mask_consts"] = to_consts(refs)
    w = pl.program_id(0)
    item = _item(plan, w, seq_ref, first_ref, length_ref)
    rows, group = plan.rows, plan.group
    row_head = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) % group
    for g in range(plan.num_kv_heads):
        if plan.has_sinks:  # the sink is a key of value 0 seen first: m = its logit, l = exp(0) = 1
            refs["m"][g] = jnp.broadcast_to(_head_column(plan, refs["sinks"], g, row_head) * LOG2E, (rows, LANES))
            refs["l"][g] = jnp.ones((rows, LANES), jnp.float32)
        else:
            refs["m"][g] = jnp.full((rows, LANES), common.M_INIT, jnp.float32)
            refs["l"][g] = jnp.zeros((rows, LANES), jnp.float32)
        refs["acc"][g] = jnp.zeros(refs["acc"].shape[1:], jnp.float32)

    hbm, bufs = (refs["k_hbm"], refs["v_hbm"]), (refs["k_buf"], refs["v_buf"])
    fetch = functools.partial(_copies, plan, tables_ref=tables_ref, hbm=hbm, bufs=bufs, sems=refs["sems"])
    # The slot of the item's first step: the previous items' steps alternate the two buffers.
    base = jnp.where(w == 0, 0, refs["slot"][0])
    following = _item(plan, jnp.minimum(w + 1, plan.num_items - 1), seq_ref, first_ref, length_ref)

    @pl.when((w == 0) & (item.steps > 0))
    def _():  # later items' first pages were started by the item before
        _each(fetch(item, 0, 0), "start")

    def body(step, carry):
        slot = (base + step) % 2

        @pl.when(step + 1 < item.steps)
        def _():
            _each(fetch(item, step + 1, 1 - slot), "start")

        @pl.when((step + 1 == item.steps) & (w + 1 < plan.num_items) & (following.steps > 0))
        def _():  # the next item's first pages load while this item's last step computes
            _each(fetch(following, 0, 1 - slot), "start")

        _each(fetch(item, step, slot), "wait")
        key_start = (item.lo_page + step * plan.pages_per_step) * plan.page_size
        masked = _masked(plan, item, key_start)
        pl.when(masked)(lambda: _step(plan, item, refs, slot, key_start, True))
        if plan.mask_mod is None:
            pl.when(jnp.logical_not(masked))(lambda: _step(plan, item, refs, slot, key_start, False))
        return carry

    lax.fori_loop(0, item.steps, body, 0)
    refs["slot"][0] = (base + item.steps) % 2
    real = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group <= item.last - item.first
    for g in range(plan.num_kv_heads):
        l = _lanes(refs["l"][g])
        safe = jnp.where(l != 0, l, 1.0)  # l = 0: the row attended nothing (and has no sink)
        if plan.quantized:
            safe = safe / refs["v_scale"][g]
        out = jnp.where(real & (l != 0), refs["acc"][g] / safe, 0.0)
        refs["out"][g] = out.astype(refs["out"].dtype)


# ------------------------------------------------------------------------------------------ pallas_call glue


def _item_layout(items, cu_q_lens, kv_lens):
    """(first position `[W]`) of each item: new token j of sequence i sits at `kv_lens[i] - n_i + j`."""
    seq = items.seq
    n = cu_q_lens[seq + 1] - cu_q_lens[seq]
    return (kv_lens[seq] - n + items.start - cu_q_lens[seq]).astype(jnp.int32)


def pack_items(q, items, plan: RaggedPlan):
    """q `[T, N, D]` -> `[W, K, rows, D]`: row t * G + j of head g holds the item's token t of query head
    g * G + j; rows past the item's length (and the sublane padding) are zero."""
    num_tokens, _, head_dim = q.shape
    t = jnp.arange(plan.block_q, dtype=jnp.int32)
    index = items.start[:, None] + t[None, :]  # [W, block_q]
    real = t[None, :] < items.length[:, None]
    taken = jnp.where(real[:, :, None, None], q[jnp.clip(index, 0, num_tokens - 1)], jnp.zeros((), q.dtype))
    taken = taken.reshape(plan.num_items, plan.block_q, plan.num_kv_heads, plan.group, head_dim)
    taken = taken.transpose(0, 2, 1, 3, 4).reshape(plan.num_items, plan.num_kv_heads, -1, head_dim)
    return jnp.pad(taken, ((0, 0), (0, 0), (0, plan.rows - taken.shape[2]), (0, 0)))


def unpack_items(out, items, num_tokens: int, plan: RaggedPlan):
    """`[W, K, rows, Dv]` -> the packed `[T, N, Dv]`: token t reads its item's row; tokens of no item
    (padding) are zero."""
    value_dim = out.shape[-1]
    out = out[:, :, : plan.block_q * plan.group]
    out = out.reshape(plan.num_items, plan.num_kv_heads, plan.block_q, plan.group, value_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(plan.num_items, plan.block_q, -1, value_dim)
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    w = jnp.searchsorted(items.start, tokens, side="right").astype(jnp.int32) - 1  # live starts increase
    w_safe = jnp.maximum(w, 0)
    r = tokens - items.start[w_safe]
    real = (w >= 0) & (r < items.length[w_safe])
    taken = out[w_safe, jnp.clip(r, 0, plan.block_q - 1)]
    return jnp.where(real[:, None, None], taken, jnp.zeros((), out.dtype))


def ragged_paged_attention_kernel(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
                                  k_scale, v_scale, hook_consts, *, scale: float, sliding_window: int | None,
                                  soft_cap: float | None, score_hook: Hook | None, mask_hook: Hook | None,
                                  num_score_consts: int, block_q: int, interpret: bool,
                                  pages_per_step: int | None = None, vmem_limit_bytes: int | None = None):
    """Ragged paged attention of checked inputs on a TPU (or its interpreter): out `[T, N, Dv]` in q's dtype.

    q `[T, N, D]`; pages `[P, page_size, K, D|Dv]` in q's dtype or int8 / float8_e4m3fn (with k_scale /
    v_scale `[K]` float32); kv_lens `[S]`, page_indices `[S, pages_per_seq]`, cu_q_lens `[S + 1]` int32;
    num_seqs a traced int32 scalar; sinks `[N]` float32 or None; hook_consts: the score hook's arrays, then
    the mask hook's. `pages_per_step`: pages a step fetches (default: 128 keys' worth);
    `vmem_limit_bytes`: the compiler's scoped VMEM limit (default: the compiler's). Raises
    `HookNotInKernel` for a hook Mosaic TPU cannot lower."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    value_dim = v_pages.shape[3]
    pages_per_seq = page_indices.shape[1]
    group = num_heads // num_kv_heads
    compute = common.compute_dtype(q.dtype)
    rows, pages_per_step = _tile(compute, block_q, group, page_size, pages_per_seq, pages_per_step)
    keys = page_size * pages_per_step
    items = ragged_work_items(cu_q_lens, num_seqs, num_tokens, block_q)
    plan = RaggedPlan(
        num_items=items.seq.shape[0], block_q=block_q, group=group, num_kv_heads=num_kv_heads, rows=rows,
        page_size=page_size, pages_per_step=pages_per_step, pages_per_seq=pages_per_seq, num_pages=num_pages,
        scale=float(scale), sliding_window=sliding_window, soft_cap=soft_cap, score_mod=score_hook,
        mask_mod=mask_hook, score_per_head=_vet("score_mod", score_hook, rows, keys),
        mask_per_head=_vet("mask_mod", mask_hook, rows, keys), num_score_consts=num_score_consts,
        has_sinks=sinks is not None, quantized=k_scale is not None,
    )
    if jnp.dtype(k_pages.dtype) == jnp.float16:  # Mosaic TPU loads no float16 vectors: a float32 copy
        k_pages, v_pages = k_pages.astype(jnp.float32), v_pages.astype(jnp.float32)
    scalars = [items.seq, _item_layout(items, cu_q_lens, kv_lens), items.length, page_indices.astype(jnp.int32)]
    names = ["q", "k_hbm", "v_hbm"]
    arrays = [pack_items(q.astype(compute), items, plan), k_pages, v_pages]
    specs = [pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda w, *_: (w, 0, 0, 0)),
             pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    for name, array in (("sinks", sinks), ("k_scale", k_scale), ("v_scale", v_scale)):
        if array is not None:
            names.append(name)
            arrays.append(jnp.asarray(array, jnp.float32))
            specs.append(smem)
    consts = [common.smem_array(c) for c in hook_consts]
    names += [f"const{i}" for i in range(len(consts))]
    arrays += consts
    specs += [smem] * len(consts)
    wrap = [common.ScalarRef if jnp.ndim(c) == 0 else (lambda r: r) for c in hook_consts]

    def to_consts(refs: dict):
        held = [f(refs[f"const{i}"]) for i, f in enumerate(wrap)]
        return tuple(held[:num_score_consts]), tuple(held[num_score_consts:])

    names += ["out", "k_buf", "v_buf", "sems", "m", "l", "acc", "slot"]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(plan.num_items,), in_specs=specs,
        out_specs=pl.BlockSpec((None, num_kv_heads, rows, value_dim), lambda w, *_: (w, 0, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, keys, num_kv_heads, head_dim), k_pages.dtype),
                        pltpu.VMEM((2, keys, num_kv_heads, value_dim), v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                        pltpu.VMEM((num_kv_heads, rows, value_dim), jnp.float32),
                        pltpu.SMEM((1,), jnp.int32)],
    )
    if interpret:
        params = dict(interpret=pltpu.InterpretParams())
    else:
        params = dict(compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                                           vmem_limit_bytes=vmem_limit_bytes))
    out = pl.pallas_call(
        functools.partial(_kernel, plan=plan, names=tuple(names), to_consts=to_consts),
        grid_spec=grid_spec,
        out_shape=common.output((plan.num_items, num_kv_heads, rows, value_dim), compute, q, k_pages, v_pages),
        name="probjax_tpu_ragged_paged_attention",
        **params,
    )(*scalars, *arrays)
    return unpack_items(out, items, num_tokens, plan).astype(q.dtype)


def _tile(compute, block_q: int, group: int, page_size: int, pages_per_seq: int,
          pages_per_step: int | None) -> tuple[int, int]:
    """(rows of a program's q tile: block_q tokens x the group's heads, padded to the sublane tile; pages
    per step: 128 keys' worth by default, at most a sequence's pages)."""
    align = 16 if jnp.dtype(compute).itemsize == 2 else 8
    rows = -(-block_q * group // align) * align
    return rows, min(pages_per_step or max(1, KEYS_PER_STEP // page_size), pages_per_seq)


def hooks_refused(score_hook: Hook | None, mask_hook: Hook | None, *, dtype, num_heads: int, num_kv_heads: int,
                  page_size: int, pages_per_seq: int, block_q: int, pages_per_step: int | None = None) -> str | None:
    """Why this kernel cannot run these hooks (Mosaic TPU cannot lower one of them on its tiles), or None."""
    rows, pages_per_step = _tile(common.compute_dtype(dtype), block_q, num_heads // num_kv_heads, page_size,
                                 pages_per_seq, pages_per_step)
    try:
        _vet("score_mod", score_hook, rows, page_size * pages_per_step)
        _vet("mask_mod", mask_hook, rows, page_size * pages_per_step)
    except HookNotInKernel as reason:
        return str(reason)
    return None
