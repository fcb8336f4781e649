"""Flash-attention forward for Blackwell (sm_100a) in Pallas Mosaic GPU: tcgen05 MMAs into tensor memory, TMA
and a producer warpgroup.

One CTA owns a query tile of 128 rows of one (batch, query head): tcgen05's M, and one row per thread of the
softmax warpgroup, whose tensor-memory loads (`Layout.TCGEN05`) give each thread its row of a tile, so the row
max and sum never leave the thread. Two warpgroups:

- the softmax warpgroup issues the MMAs (one elected thread each): S = Q K^T into one of two (128, block_kv)
  float32 tensor-memory tiles, then, once it has turned S into P (16-bit, in shared memory), O += P V into a
  (128, Dv) float32 tensor-memory accumulator. The next tile's Q K^T is issued as soon as this tile's S is
  loaded, so the tensor core runs it during this tile's softmax. Before P V, once the previous P V has
  completed (`o_done`), it writes P and rescales O in tensor memory by exp2(m_old - m_new), in 64-column
  chunks. Scores live in the base-2 domain (s2 = scale * log2(e) * q k^T, one multiply) so every exponential
  is an exp2.
- a producer warpgroup that fills a ring of `num_stages` K / V slots with TMA copies. A slot is ready when
  both copies land (`k_ready`, `v_ready`) and free once the P V that read it has completed: the softmax
  warpgroup commits each step's MMAs to that slot's `kv_free` barrier (`tcgen05_commit_arrive`).

KV tiles visited (`kv_walk`): [lo, full_lo) and [full_hi, hi) with the per-element mask (keys >= kv_lengths[b],
the window / causal edge), [full_lo, full_hi) without it (`kv_tile_range`); tiles outside every row's window are
never loaded. With a BlockMask's tables, the query tile's partial tiles then its full ones. Rows >= q_lengths[b]
and rows that attend no key give output 0 and lse -inf (the convention of every backend, `_problem.py`).

The caller pads: T to a multiple of 128, S to a multiple of `block_kv`, with finite values (zeros); keys past
`kv_lengths` are masked, but their V rows still meet p = 0 in the P V matmul, so they must not be NaN / inf.

This kernel takes the plain call (scale, causal / window, lengths, GQA, Dv != D), FlexAttention's hooks whose
captured arrays are read one element at a time (a soft cap, ALiBi's `slopes[h]`, a prefix-LM or per-head window
mask_mod: `tile_scores`) with a BlockMask's tables, the row max, dropout (every backend's keep mask, hashed
on the P tile) and segment ids (packed sequences; a key padding or query mask comes as them, `glue._segments`):
the rows' ids arrive with Q, the keys' with each K tile into a ring beside it. The Hopper kernel's other features
run on the Triton kernels on Blackwell (`mosaic.plan`). It runs in the Mosaic GPU interpreter as it is compiled.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_kernels._tiles import kv_tile_range
from probjax_kernels.mosaic.common import (
    _M_INIT,
    _SWIZZLE,
    LN2,
    LOG2E,
    ScoreRule,
    _check_tables,
    allocated_smem,
    bias_smem_bytes,
    bias_tiles,
    check_bias,
    check_dense_mask,
    check_layout,
    check_segments,
    drain_ring,
    dropout_options,
    fill_ring_slot,
    mask_tiles,
    read_seed,
    same_segment,
    split_hook_refs,
    table_row,
    window_options,
)
from probjax_kernels.mosaic.forward import bias_layout
from probjax_kernels.mosaic.hook_vectors import grouped, vectors_in
from probjax_kernels.mosaic.tcgen05_inputs import (
    bias_tile,
    hook_views,
    key_sources,
    load_mask,
    load_segments,
    segment_smem_bytes,
    vector_counts,
    vector_scratch,
    vector_source,
    vector_tiles,
)

BLOCK_Q = 128  # tcgen05's M, and one row per thread of the softmax warpgroup
HEAD_DIMS = (64, 128)
_RESCALE_COLUMNS = 64  # O is rescaled in tensor memory in chunks of this many columns (registers)
# No reduction scratch (Mosaic GPU reserves 2 KiB by default): a thread holds its whole row of a tile.
_COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


def smem_bytes(head_dim: int, value_dim: int, block_kv: int, num_stages: int, itemsize: int = 2,
               return_max: bool = False, segments: bool = False, vectors: tuple[int, int] = (0, 0),
               dense_mask: bool = False, bias: str | None = None, bias_itemsize: int = 4) -> int:
    """Shared memory of one CTA as Mosaic GPU allocates it: the Q tile (which carries O out when Dv = D, else
    an O tile of its own), the K and V rings, the P tile, the lse (and with `return_max` the row max) staging
    rows, with `segments` the query rows' segment ids and a ring of the keys', the hooks' vectors (`vectors`:
    how many along queries, each the rows' 32-bit values; along keys, each a ring beside K), with `dense_mask`
    a ring of int8 mask tiles beside K, a bias read as `bias` (`check_bias`'s kind, tiles of `bias_itemsize`
    bytes an element; `bias_smem_bytes`), and the barriers."""
    buffers = [
        itemsize * BLOCK_Q * head_dim, itemsize * num_stages * block_kv * head_dim,
        itemsize * num_stages * block_kv * value_dim, itemsize * BLOCK_Q * block_kv, 4 * BLOCK_Q,
        itemsize * BLOCK_Q * value_dim if value_dim != head_dim else 0, 4 * BLOCK_Q if return_max else 0,
        *segment_smem_bytes(BLOCK_Q, num_stages * block_kv, segments),
        *[4 * BLOCK_Q] * vectors[0], *[4 * num_stages * block_kv] * vectors[1],
        num_stages * BLOCK_Q * block_kv if dense_mask else 0,
        bias_smem_bytes(bias, bias_itemsize, BLOCK_Q, block_kv, num_stages),
    ]
    return allocated_smem(buffers, barriers=1 + 3 * num_stages + 2)


def masked_scores(s, rule: ScoreRule, row0, key0, kv_len):
    """s (a tensor-memory-layout tile: rows are queries from row0, columns keys from key0) with -inf where a
    key is at or past kv_len or outside the row's window. The bounds are per-row columns, compared with the
    column index: a thread's columns are constants, where (q_idx, kv_idx) tiles took a register each."""
    rows = row0 + plgpu.broadcasted_iota(jnp.int32, s.shape[:1], 0, layout=plgpu.Layout.TCGEN05.reduce(1))
    end = jnp.full_like(rows, kv_len - key0)  # the row's first key column it does not see
    if rule.window_right is not None:
        end = jnp.minimum(end, rows + (rule.window_right + 1) - key0)
    column = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.TCGEN05)
    allowed = column < lax.broadcast_in_dim(end, s.shape, [0])
    if rule.window_left is not None:
        allowed &= column >= lax.broadcast_in_dim(rows - rule.window_left - key0, s.shape, [0])
    return jnp.where(allowed, s, -jnp.inf)


def hook_shapes(block_kv: int) -> tuple:
    """Shapes of (b, h, q_idx, kv_idx, score) where the tcgen05 kernels call the hooks on `block_kv`-key
    tiles: scalar b and h, (128, block_kv) tiles of a row per thread for the rest."""
    tile = (BLOCK_Q, block_kv)
    return (), (), tile, tile, tile


def tile_scores(s, rule: ScoreRule, row0, key0, kv_len, batch, head, *, masked: bool, user_mask: bool = True,
                hook_arrays: tuple = ((), ()), with_derivative: bool = False, segments: tuple | None = None,
                dense: Callable | None = None, bias: Callable | None = None):
    """(s, s_scale, derivative) of a tensor-memory-layout tile s = q k^T (rows: queries from row0, columns: keys
    from key0): the base-2 scores are s * s_scale, -inf where `masked` masks them (keys >= kv_len, with the
    rule's `segments` a query and a key of different segments, and with `user_mask` the window and the rule's
    mask_fn; a BlockMask's full blocks take the length and segment masks alone); with a score_fn the scores are
    its output (s_scale = log2(e)), and `derivative` its derivative with `with_derivative` (else None).
    `hook_arrays`: the score_fn's and the mask_fn's array refs; `segments`: the tile's rows' and columns' segment
    ids (`load_segments`); `dense()`: the tile of a dense mask (True = attend), with the rule's `dense_mask`;
    `bias()`: the tile's float32 bias, added to the scaled scores, with the rule's `bias`."""
    plain = not (rule.segments or rule.dense_mask or rule.bias)
    if rule.score_fn is None and rule.mask_fn is None and plain:
        if masked:
            s = masked_scores(s, rule if user_mask else ScoreRule(rule.scale), row0, key0, kv_len)
        return s, rule.scale * LOG2E, None

    score_arrays, mask_arrays = hook_arrays
    return rule.scores(s, lambda: tile_indices(s.shape, row0, key0), batch, head, kv_len, masked=masked,
                       user_mask=user_mask, score_arrays=score_arrays, mask_arrays=mask_arrays,
                       same_segment=segments and (lambda: same_segment(*segments, s.shape)), dense=dense,
                       bias=bias, with_derivative=with_derivative)


# A CTA's walk over the tiles it visits, in order: runs of (first step, steps, tile of the run's i-th step,
# masked, user_mask) (`tile_scores`); a step's K / V (or Q / dO) ring slot is its number modulo the stages.
Walk = tuple


def range_walk(lo, full_lo, full_hi, hi) -> Walk:
    """The tiles [lo, hi) of `kv_tile_range` / `q_tile_range`: those in [full_lo, full_hi) without the mask."""
    return ((0, full_lo - lo, lambda i: lo + i, True, True),
            (full_lo - lo, full_hi - full_lo, lambda i: full_lo + i, False, False),
            (full_hi - lo, hi - full_hi, lambda i: full_hi + i, True, True))


def table_walk(tables, batch, head, row) -> Walk:
    """The tiles of a BlockMask's table row `row` (a query tile's for kv tables, a key tile's for q tables) of
    (batch, head): its partial tiles (every mask), then its full ones (the length mask alone)."""
    num_partial_ref, partial_ref, num_full_ref, full_ref = tables
    num_partial = num_partial_ref[table_row(num_partial_ref, batch, head, row)]
    num_full = num_full_ref[table_row(num_full_ref, batch, head, row)]
    return ((0, num_partial, lambda i: partial_ref[(*table_row(partial_ref, batch, head, row), i)], True, True),
            (num_partial, num_full, lambda i: full_ref[(*table_row(full_ref, batch, head, row), i)], True, False))


def kv_walk(rule: ScoreRule, tables, batch, head, q_tile, q_len, kv_len, block_kv: int) -> Walk:
    """The KV tiles of `block_kv` keys that query tile `q_tile` (128 rows) of (batch, head) visits: its row of
    a BlockMask's `tables`, or without them `kv_tile_range`'s."""
    if tables is not None:
        return table_walk(tables, batch, head, q_tile)
    return range_walk(*kv_tile_range(q_tile * BLOCK_Q, BLOCK_Q, q_len, kv_len, block_kv, rule.window,
                                     mask_everywhere=rule.mask_everywhere))


def walk_steps(walk: Walk):
    """The number of steps of a walk."""
    return functools.reduce(lambda total, run: total + run[1], walk, jnp.int32(0))


def run_walk(walk: Walk, step: Callable, carry, first_step=0):
    """carry through `step(n, tile, carry, masked=, user_mask=)` for every step of the walk, n counted from
    `first_step`."""
    for first, count, tile_of, masked, user_mask in walk:
        def body(i, carry, first=first, tile_of=tile_of, masked=masked, user_mask=user_mask):
            return step(first_step + first + i, tile_of(i), carry, masked=masked, user_mask=user_mask)

        carry = lax.fori_loop(0, count, body, carry)
    return carry


def tile_indices(shape: tuple, row0, key0) -> tuple:
    """(q_idx, kv_idx) of a tensor-memory-layout tile whose rows are queries from row0 and columns keys from
    key0: a row's index is its thread's scalar, broadcast along its registers."""
    rows = row0 + plgpu.broadcasted_iota(jnp.int32, shape[:1], 0, layout=plgpu.Layout.TCGEN05.reduce(1))
    columns = key0 + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.TCGEN05)
    return lax.broadcast_in_dim(rows, shape, [0]), columns


def _forward_kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, *refs, rule: ScoreRule, block_kv: int,
                    num_stages: int, group: int, num_score_arrays: int, num_mask_arrays: int, return_max: bool,
                    has_tables: bool, has_dropout: bool, has_segments: bool, score_vectors: tuple = (),
                    mask_vectors: tuple = (), has_mask: bool = False, bias: str | None = None):
    tables, score_arrays, mask_arrays, segments, seed, mask_ref, refs = split_hook_refs(
        refs, has_tables, num_score_arrays, num_mask_arrays, has_segments, has_dropout, has_mask)
    bias_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)  # `check_bias`'s tiles, keys or rows
    # The hooks' arrays: global-memory refs, or vectors along q_idx / kv_idx (`hook_vectors`).
    groups = (grouped(score_arrays, score_vectors), grouped(mask_arrays, mask_vectors))
    vectors = vectors_in(groups[0] + groups[1])
    out_ref, lse_ref, *refs = refs
    max_ref = refs.pop(0) if return_max else None
    smem, tmem, barriers = refs
    (q_smem, k_smem, v_smem, p_smem, lse_smem, own_o_smem, max_smem, q_segment_smem, kv_segment_smem,
     vector_smem, mask_smem, bias_smem) = smem
    s_tmem, o_tmem = tmem
    q_ready, k_ready, v_ready, kv_free, s_done, o_done = barriers
    o_smem = q_smem if own_o_smem is None else own_o_smem
    value_dim = v_ref.shape[-1]
    q_tile, head, batch = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    if rule.causal_only:  # heaviest tiles first, so the short ones fill the tail of the grid
        q_tile = q_ref.shape[1] // BLOCK_Q - 1 - q_tile
    wg = lax.axis_index("wg")
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    row0 = q_tile * BLOCK_Q
    walk = kv_walk(rule, tables, batch, head, q_tile, q_len, kv_len, block_kv)
    steps = walk_steps(walk)

    @pl.when(wg == 0)
    def _softmax():
        seed_parts = read_seed(seed)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, BLOCK_Q), head], q_smem, q_ready)
        if has_segments:  # the rows' segment ids arrive with Q
            plgpu.copy_gmem_to_smem(segments[0].at[batch, pl.ds(row0, BLOCK_Q)], q_segment_smem, q_ready)
        for (axis, ref), buffer in zip(vectors, vector_smem):  # and so do the hooks' vectors along queries
            if axis == "q":
                plgpu.copy_gmem_to_smem(vector_source(ref, batch, head, row0, BLOCK_Q), buffer, q_ready)
        if bias == "rows":  # and the rows' bias
            plgpu.copy_gmem_to_smem(vector_source(bias_ref, batch, head, row0, BLOCK_Q), bias_smem, q_ready)
        plgpu.barrier_wait(q_ready)
        q_segments = load_segments(q_segment_smem, 0) if has_segments else None

        def issue_qk(n):
            """S(n) = Q K(n)^T into tensor-memory tile n % 2, once K(n) has landed."""
            slot = lax.rem(n, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.tcgen05_mma(s_tmem.at[lax.rem(n, 2)], q_smem, k_smem.at[slot].transpose((1, 0)),
                              s_done.at[lax.rem(n, 2)], accumulate=False)

        @pl.when(steps > 0)
        def _():
            issue_qk(0)

        def step(n, block, carry, masked: bool, user_mask: bool):
            """KV tile `block` at pipeline step n (ring slot n % num_stages)."""
            m_i, l_i = carry
            slot = lax.rem(n, num_stages)
            plgpu.barrier_wait(s_done.at[lax.rem(n, 2)])
            s = plgpu.async_load_tmem(s_tmem.at[lax.rem(n, 2)], layout=plgpu.Layout.TCGEN05)
            plgpu.wait_load_tmem()  # S(n) is read before S(n + 2) overwrites its tensor memory

            @pl.when(n + 1 < steps)
            def _():  # the next tile's Q K^T runs while this one's softmax does
                issue_qk(n + 1)

            tile_segments = None
            if has_segments:  # the keys' segment ids arrived with K(n); their slot is freed with it
                tile_segments = (q_segments, load_segments(kv_segment_smem.at[slot], 1))
            hook_arrays = hook_views(groups, vector_tiles(vectors, vector_smem, s.shape, slot))
            s, s_scale, _ = tile_scores(s, rule, row0, block * block_kv, kv_len, batch, head, masked=masked,
                                        user_mask=user_mask, hook_arrays=hook_arrays, segments=tile_segments,
                                        dense=(lambda: load_mask(mask_smem.at[slot])) if has_mask else None,
                                        bias=(lambda: bias_tile(bias, bias_smem, slot, s.shape)) if bias else None)
            m_new = jnp.maximum(m_i, s.max(axis=1) * s_scale)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s * s_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)  # dropout acts after the normalisation: l sums every weight
            # The kept weights' 1 / (1 - rate) is folded into the final 1 / l.
            p = rule.dropped(p, lambda: tile_indices(s.shape, row0, block * block_kv), batch, head, seed_parts,
                             scaled=False)

            @pl.when(n > 0)
            def _():  # the previous P V is done: the P tile and O are free
                plgpu.barrier_wait(o_done)

            p_smem[...] = p.astype(p_smem.dtype)  # P first: its registers are free before O's chunks load
            plgpu.commit_smem()

            @pl.when(n > 0)
            def _rescale():
                for c in range(0, value_dim, _RESCALE_COLUMNS):
                    chunk = o_tmem.at[:, pl.ds(c, _RESCALE_COLUMNS)]
                    o = plgpu.async_load_tmem(chunk, layout=plgpu.Layout.TCGEN05)
                    plgpu.async_store_tmem(chunk, o * lax.broadcast_in_dim(alpha, o.shape, [0]))
                plgpu.commit_tmem()

            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.tcgen05_mma(o_tmem, p_smem, v_smem.at[slot], o_done, accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(kv_free.at[slot])  # the slot is free once these MMAs complete
            return m_new, l_i

        carry = (
            plgpu.layout_cast(jnp.full((BLOCK_Q,), _M_INIT, jnp.float32), plgpu.Layout.TCGEN05.reduce(1)),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), plgpu.Layout.TCGEN05.reduce(1)),
        )
        m_i, l_i = run_walk(walk, step, carry)

        q_idx = row0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q,), 0, layout=plgpu.Layout.TCGEN05.reduce(1))
        valid = (q_idx < q_len) & (l_i != 0)  # l_i = 0: no key attended; a NaN l_i (NaN / inf inputs) stays NaN
        inv_l = jnp.where(valid, rule.kept_scale / jnp.where(valid, l_i, 1.0), 0.0)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(o_done)  # the last P V

        for c in range(0, value_dim, _RESCALE_COLUMNS):
            o = plgpu.async_load_tmem(o_tmem.at[:, pl.ds(c, _RESCALE_COLUMNS)], layout=plgpu.Layout.TCGEN05)
            # where, not a product: a tile without steps leaves O's tensor memory unwritten
            o = jnp.where(lax.broadcast_in_dim(valid, o.shape, [0]), o * lax.broadcast_in_dim(inv_l, o.shape, [0]),
                          0.0)
            o_smem[:, pl.ds(c, _RESCALE_COLUMNS)] = o.astype(o_smem.dtype)
        plgpu.wait_load_tmem()
        lse_smem[...] = jnp.where(valid, m_i * LN2 + jnp.log(jnp.where(valid, l_i, 1.0)), -jnp.inf)
        if return_max:  # the row max of the masked scores in natural units: m_i is base 2
            max_smem[...] = jnp.where(valid, m_i * LN2, -jnp.inf)
        plgpu.commit_smem()
        rows = (batch, head, pl.ds(row0, BLOCK_Q))
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[batch, pl.ds(row0, BLOCK_Q), head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[rows])
        if return_max:
            plgpu.copy_smem_to_gmem(max_smem, max_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        fill_kv_ring(k_ref, v_ref, (k_smem, v_smem), (k_ready, v_ready, kv_free), batch=batch,
                     kv_head=lax.div(head, jnp.int32(group)), walk=walk, block_kv=block_kv, num_stages=num_stages,
                     beside_k=key_sources(batch, head, pl.ds(row0, BLOCK_Q), (segments, kv_segment_smem),
                                          (vectors, vector_smem), (mask_ref, (mask_smem,) if has_mask else ()),
                                          (bias_ref, bias_smem if bias in ("tiles", "keys") else None)))


def fill_kv_ring(k_ref, v_ref, rings: tuple, barriers: tuple, *, batch, kv_head, walk: Walk, block_kv: int,
                 num_stages: int, beside_k: list = ()) -> None:
    """The producer warpgroup of the tcgen05 kernels that stream K / V: the KV tiles of `walk` of (batch,
    kv_head) in its order by TMA into the `rings` (K's, V's), batch 0 where k / v have batch 1; step n's slot
    once the MMAs that read it have completed (`kv_free`); then waits the last slots out. `barriers`: (k_ready,
    v_ready, kv_free). `beside_k`: (source, ring) of what arrives with K's tiles (`key_sources`)."""
    (k_smem, v_smem), (k_ready, v_ready, kv_free) = rings, barriers

    def load(n, block, carry, **_):
        tile = (batch if k_ref.shape[0] > 1 else 0, pl.ds(block * block_kv, block_kv), kv_head)
        copies = [(k_ref.at[tile], k_smem, k_ready), (v_ref.at[tile], v_smem, v_ready)]
        copies += [(source(block * block_kv, block_kv), ring, k_ready) for source, ring in beside_k]
        fill_ring_slot(n, num_stages, (kv_free,), copies)
        return carry

    run_walk(walk, load, None)
    drain_ring(walk_steps(walk), num_stages, kv_free)


def launch(kernel, name: str, inputs: tuple, *, out_type, scratch_types, grid: tuple, grid_names: tuple,
           interpret: bool):
    """`kernel` over `grid` as the tcgen05 kernels run: two warpgroups ("wg": the MMA-issuing one and a TMA
    producer), no reduction scratch; in the Mosaic GPU interpreter with `interpret`."""
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch_types, grid=grid, grid_names=grid_names, num_threads=2,
        thread_name="wg", kernel_name=name, compiler_params=_COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(*inputs)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "block_kv", "num_stages", "interpret",
                                             "score_fn", "mask_fn", "return_max", "dropout_rate",
                                             "dropout_positions", "dropout_heads", "score_vectors",
                                             "mask_vectors"))
def tcgen05_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_lengths: jax.Array,
    kv_lengths: jax.Array,
    *,
    scale: float,
    causal: bool,
    window: tuple[int | None, int | None] = (None, None),
    block_kv: int = 128,
    num_stages: int = 2,
    interpret: bool = False,
    score_fn: Callable | None = None,
    mask_fn: Callable | None = None,
    score_arrays: tuple = (),
    mask_arrays: tuple = (),
    return_max: bool = False,
    kv_tables: tuple | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | None = None,
    dropout_positions: tuple[int, int] | None = None,
    dropout_heads: int | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    score_vectors: tuple = (),
    mask_vectors: tuple = (),
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Flash-attention forward on Blackwell (sm_100a) through Pallas Mosaic GPU's tcgen05 MMAs.

    **Arguments:**

    - `q`: `[B, T, N, D]`, bfloat16 or float16, D in {64, 128}; T a multiple of 128.
    - `k`, `v`: `[B, S, K, D]` and `[B, S, K, Dv]` (Dv in {64, 128}; batch 1: shared by every query batch),
      q's dtype, N a multiple of K (GQA / MQA); S a multiple of `block_kv`. Padding rows must be finite (zeros).
    - `q_lengths`, `kv_lengths`: int32 `[B]`; query rows >= q_lengths[b] give output 0 and lse -inf, keys
      >= kv_lengths[b] are masked.
    - `scale`: multiplies q k^T, > 0. `causal`: query i sees keys j <= i (top-left alignment).
    - `window`: `(left, right)`, ints >= 0 or None (unbounded): query i sees keys in [i - left, i + right]
      (with `causal`, right is at most 0). Tiles outside every row's window are never loaded.
    - `block_kv`: keys per pipeline step, 64 or 128. `num_stages`: K / V slots in the shared-memory ring, >= 2.
    - `interpret`: run in the Mosaic GPU CPU interpreter instead of compiling for the GPU.
    - `score_fn(score, b, h, q_idx, kv_idx, *score_refs) -> score` on `scale * q k^T` before any mask, and
      `mask_fn(b, h, q_idx, kv_idx, *mask_refs) -> bool` (True = attend; every tile then takes the per-element
      mask), as `common.ScoreRule` has them: b, h int32 scalars, the rest (128, block_kv) tiles (`hook_shapes`);
      `score_arrays` / `mask_arrays`: the arrays they read, as global-memory refs, one element at a time, or
      along q_idx / kv_idx as vectors (`score_vectors` / `mask_vectors`: per array, the axes of its vectors,
      `hook_vectors.hook_arrays`; the vectors `[B|1, N|1, T or S]`, 32-bit, in place of the array), which
      arrive with Q and with each K tile.
    - `return_max`: also return the row max of the scaled, modified, masked scores.
    - `kv_tables`: a BlockMask's `(num_partial [B|1, H|1, nq], partial_indices [B|1, H|1, nq, nk], num_full,
      full_indices)` on this kernel's (128, block_kv) tiles over the padded sequences: a query tile visits its
      partial tiles (with the window and mask_fn) then its full ones (the length mask alone), and no other.
    - `dropout_rate`, `dropout_seed`, `dropout_positions`, `dropout_heads`: dropout of the attention weights after
      the softmax's normalisation (kept ones scaled by 1 / (1 - rate)), every backend's keep mask
      (`_dropout.keep_mask`), as the Hopper kernel takes them (`mosaic_forward`).
    - `q_segment_ids` `[B, T]`, `kv_segment_ids` `[B, S]`: integer, both or neither (packed sequences): a query
      attends only keys of its own segment, on every tile (full BlockMask blocks included).
    - `mask`: a dense `[B|1, N|1, T, S]` mask (bool or integer, nonzero = attend) over the padded sequences,
      read as int8 tiles beside K, on every tile.
    - `bias`: `[B|1, N|1, T|1, S|1]` bfloat16, float16 or float32, added to the scaled scores before a score_fn:
      tiles of its dtype beside K where T and S are whole, else float32 key vectors beside K or row vectors
      beside Q (`check_bias`).

    **Returns:** `(out, lse)`, with `return_max` `(out, lse, max_scores)`: out `[B, T, N, Dv]` in q's dtype,
    lse `[B, N, T]` float32, the natural-log sum-exp of the scaled, modified, masked scores; max_scores
    `[B, N, T]` float32 (-inf where lse is).
    """
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    if block_kv not in (64, 128):
        raise ValueError(f"block_kv must be 64 or 128 (a tensor-memory tile of S), got {block_kv}")
    check_layout(
        q, k, v, q_lengths, kv_lengths, scale, block_q=BLOCK_Q, q_multiple=BLOCK_Q, block_kv=block_kv,
        kv_multiple=64, num_stages=num_stages, min_stages=2, head_dims=HEAD_DIMS,
        smem_need=smem_bytes(q.shape[-1], v.shape[-1], block_kv, num_stages, q.dtype.itemsize, return_max,
                             q_segment_ids is not None, vector_counts(score_vectors, mask_vectors),
                             mask is not None, *bias_layout(bias)),
    )
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    segments = check_segments(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
    mask = check_dense_mask(mask, batch, num_heads, q_len, kv_len)
    bias_kind, bias = check_bias(bias, batch, num_heads, q_len, kv_len)
    tables = _check_tables(kv_tables, batch, num_heads, q_len // BLOCK_Q, kv_len // block_kv, BLOCK_Q, block_kv)
    num_stages = min(num_stages, kv_len // block_kv)
    transforms = (plgpu.TilingTransform((8, _SWIZZLE // q.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    dropout, seed = dropout_options(dropout_rate, dropout_seed, dropout_positions, dropout_heads, num_heads)
    rule = ScoreRule(scale, **window_options(causal, window), score_fn=score_fn, mask_fn=mask_fn,
                     segments=segments is not None, dense_mask=mask is not None, bias=bias is not None, **dropout)
    kernel = functools.partial(
        _forward_kernel, rule=rule, block_kv=block_kv, num_stages=num_stages, group=num_heads // num_kv_heads,
        num_score_arrays=len(score_arrays), num_mask_arrays=len(mask_arrays), return_max=return_max,
        has_tables=tables is not None, has_dropout=bool(seed), has_segments=segments is not None,
        score_vectors=score_vectors, mask_vectors=mask_vectors, has_mask=mask is not None, bias=bias_kind,
    )
    vectors = vectors_in(grouped(score_arrays, score_vectors) + grouped(mask_arrays, mask_vectors))
    counts = vector_counts(score_vectors, mask_vectors)
    tensor_core = dict(orders_tensor_core=True)
    rows = jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)
    return launch(
        kernel, "probjax_mosaic_forward_tcgen05",
        (q, k, v, q_lengths, kv_lengths, *(tables or ()), *score_arrays, *mask_arrays, *(segments or ()), *seed,
         *(() if mask is None else (mask,)), *(() if bias is None else (bias,))),
        out_type=(jax.ShapeDtypeStruct((batch, q_len, num_heads, value_dim), q.dtype), rows,
                  *((rows,) if return_max else ())),
        scratch_types=(
            (
                plgpu.SMEM((BLOCK_Q, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, value_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q, block_kv), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q,), jnp.float32),
                plgpu.SMEM((BLOCK_Q, value_dim), q.dtype, transforms=transforms) if value_dim != head_dim else None,
                plgpu.SMEM((BLOCK_Q,), jnp.float32) if return_max else None,
                plgpu.SMEM((BLOCK_Q,), jnp.int32) if segments else None,
                plgpu.SMEM((num_stages, block_kv), jnp.int32) if segments else None,
                vector_scratch(vectors, "q", BLOCK_Q, block_kv, num_stages),
                None if mask is None else plgpu.SMEM((num_stages, BLOCK_Q, block_kv), jnp.int8,
                                                     transforms=mask_tiles(block_kv)),
                {"tiles": plgpu.SMEM((num_stages, BLOCK_Q, block_kv), bias.dtype, transforms=bias_tiles(bias.itemsize)),
                 "keys": plgpu.SMEM((num_stages, block_kv), jnp.float32),
                 "rows": plgpu.SMEM((BLOCK_Q,), jnp.float32)}[bias_kind] if bias is not None else None,
            ),
            (
                plgpu.TMEM((2, BLOCK_Q, block_kv), jnp.float32),
                plgpu.TMEM((BLOCK_Q, value_dim), jnp.float32),
            ),
            (  # with segments, hook vectors or a mask, Q's and K's barriers also await their copies
                plgpu.Barrier(num_arrivals=1 + bool(segments) + counts[0] + (bias_kind == "rows")),
                plgpu.Barrier(num_arrivals=1 + bool(segments) + counts[1] + (mask is not None)
                              + (bias_kind in ("tiles", "keys")), num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages, **tensor_core),
                plgpu.Barrier(num_barriers=2, **tensor_core),
                plgpu.Barrier(**tensor_core),
            ),
        ),
        grid=(q_len // BLOCK_Q, num_heads, batch),
        grid_names=("q", "heads", "batch"),
        interpret=interpret,
    )
