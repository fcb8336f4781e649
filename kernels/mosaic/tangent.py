"""Forward-mode tangent kernel for Hopper (sm_90) in Pallas Mosaic GPU: (d out, d lse) of one query tile for
tangents of q, k and v, in one pass over the KV tiles (docs/forward_mode.md; Triton's is `triton.tangent`).

CTA layout of the dQ kernel (`mosaic.backward`): one CTA per (query tile of `block_q` rows, query head, batch),
two consumer warpgroups owning `block_q // 2` rows each and a producer warpgroup feeding a ring of K / V slots
(and of the tangents dK / dV) by TMA. With p = softmax(s) known from the forward's lse, d p_j = p_j (t_j - c)
for the tangent t of the natural-log scores and c = sum_j p_j t_j, so per part of `PART` keys a consumer
computes S = Q K^T and S' = dQ K^T + Q dK^T (wgmma from SMEM), p = exp2(s * scale * log2(e) - lse2),
t = scale * S' (times d score_fn / d score with a score_fn), then c += rowsum(p t) and
acc += (Z p t) V + (Z p) dV (Z: the dropout factor; wgmma, P from registers). At the end
d out = acc - c out and d lse = c. Rows without a key (lse2 = +inf) get p = 0, so zero tangents.

Window (causal) tile skipping, lengths, segment ids, dense masks, a bias, block tables, hooks and dropout are
those of the dQ kernel; the bias's tangent is read as the bias is and adds to t before the score_fn's derivative.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_kernels._tiles import kv_tile_range
from probjax_kernels.mosaic.common import (
    _CONSUMERS,
    CONSUMER_REGISTERS,
    PART,
    PRODUCER_REGISTERS,
    SMEM_BYTES,
    ScoreRule,
    _accumulate_pv,
    _backward_rule,
    _check_tables,
    _launch,
    after,
    allocated_smem,
    bias_scratch,
    bias_smem_bytes,
    check_bias,
    check_dense_mask,
    check_layout,
    check_pieces,
    check_segments,
    drain_ring,
    dropout_options,
    fill_ring_slot,
    read_seed,
    same_segment,
    split_hook_refs,
    table_walk,
    tile_indices,
    union_of_ranges,
    _SWIZZLE,
)
from probjax_kernels.mosaic.hook_vectors import grouped, vectors_in, views
from probjax_kernels.mosaic.side_inputs import (
    SideInputs,
    index_scratch,
    run_steps,
    side_scratch,
    store_indices,
    stored_indices,
    vector_scratch,
)

TANGENT_TILES = (128, 64)  # (block_q, block_kv): four K / V-shaped rings of 64-key slots fit at head dim 128


def tangent_smem_bytes(head_dim: int, block_q: int, block_kv: int, num_stages: int, itemsize: int = 2,
                       segments: bool = False, value_dim: int | None = None, dense_mask: bool = False,
                       bias: str | None = None, bias_itemsize: int = 4, vectors: tuple[int, int] = (0, 0),
                       moving: tuple[bool, bool, bool] = (True, True, True), indices: bool = False,
                       d_bias: bool = False) -> int:
    """Shared memory of one tangent CTA as Mosaic GPU allocates it (`allocated_smem`), for the tangents of
    (q, k, v) flagged in `moving`: Q (it takes `out` after the loop, and carries d out) and dQ tiles, lse2
    rows, the K / V rings and those of dK / dV (v's head dim `value_dim`, default q's), a separate `out` tile
    when v's head dim is not q's, then the dQ kernel's segment ids, mask tiles, bias and hook vectors, with
    `indices` the row and key index vectors (the programs of a head dim 256 call: `store_indices`), with
    `d_bias` the bias's tangent read as the bias is, and the barriers. The GPU's figure: the interpreter's P tile
    (its wgmma reads shared memory) is not counted."""
    value_dim = value_dim or head_dim
    moves_q, moves_k, moves_v = moving
    part = min(block_kv, PART)
    parts = block_kv // part
    q_tile, v_tile = itemsize * block_q * head_dim, itemsize * block_q * value_dim
    k_ring, v_ring = itemsize * num_stages * block_kv * head_dim, itemsize * num_stages * block_kv * value_dim
    buffers = [q_tile, q_tile if moves_q else 0, 4 * block_q, k_ring, v_ring, k_ring if moves_k else 0,
               v_ring if moves_v else 0, v_tile if value_dim != head_dim else 0, 4 * block_q if segments else 0,
               4 * num_stages * block_kv if segments else 0,
               *([num_stages * block_q * part] * parts if dense_mask else []),
               *([bias_smem_bytes(bias, bias_itemsize, block_q, part, num_stages)] * (parts if bias == "tiles" else 1)),
               *[4 * block_q] * vectors[0], *[4 * num_stages * block_kv] * vectors[1],
               *([4 * block_q, 4 * _CONSUMERS * part] if indices else []),
               *([bias_smem_bytes(bias, bias_itemsize, block_q, part, num_stages)] * (parts if bias == "tiles" else 1)
                 if d_bias else [])]
    row_barriers = 3 + moves_q + segments + (bias == "rows") * (1 + d_bias) + vectors[0]
    # c's row sums (the tangents of q or k) reduce across threads: Mosaic GPU's reduction scratch
    return allocated_smem(buffers, _CONSUMERS * row_barriers + 4 * num_stages, reductions=moves_q or moves_k)


def _tangent_kernel(
    q_ref, k_ref, v_ref, out_ref, lse2_ref, q_len_ref, kv_len_ref, *refs, rule: ScoreRule, block_q: int,
    block_kv: int, num_stages: int, group: int, interpret: bool, has_tables: bool, num_score_arrays: int,
    num_mask_arrays: int, has_segments: bool, has_dropout: bool, has_mask: bool, bias: str | None = None,
    moving: tuple[bool, bool, bool], score_vectors: tuple = (), mask_vectors: tuple = (), piece: int | None = None,
    moves_bias: bool = False, num_score_tangents: int = 0, score_const_jvp: Callable | None = None,
):
    # `piece` (the programs of a head dim 256 call, `mosaic_tangent`'s pieces / split): this program computes d
    # out's columns [piece * C, (piece + 1) * C) alone, C = d_out_ref's (at v's head dim 256 a 64 x 256 float32
    # accumulator beside S and S' would spill); V, dV and out are read in those columns only, S and S' whole.
    # `moves_bias`: the bias's tangent (read as the bias is, `d_side`) adds to the scores' tangent t.
    moves_q, moves_k, moves_v = moving
    refs = list(refs)
    dq_ref = refs.pop(0) if moves_q else None
    dk_ref = refs.pop(0) if moves_k else None
    dv_ref = refs.pop(0) if moves_v else None
    d_bias_ref = refs.pop(0) if moves_bias else None
    # The tangents of the score_fn's arrays (read one element at a time, as the arrays are): `score_const_jvp`
    # gives their part of the scores' tangent, added after the score_fn's derivative.
    score_tangents = [refs.pop(0) for _ in range(num_score_tangents)]
    tables, score_arrays, mask_arrays, segments, seed, mask_ref, refs = split_hook_refs(
        refs, has_tables, num_score_arrays, num_mask_arrays, has_segments, has_dropout, has_mask)
    score_groups, mask_groups = grouped(score_arrays, score_vectors), grouped(mask_arrays, mask_vectors)
    vectors = vectors_in(score_groups + mask_groups)
    num_score_vectors = len(vectors_in(score_groups))
    bias_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
    d_out_ref, d_lse_ref, smem, (row_ready, out_ready), ready, free = refs
    (q_smem, dq_smem, lse2_smem, k_smem, v_smem, dk_smem, dv_smem, out_smem, p_smem, q_segment_smem,
     kv_segment_smem, mask_rings, bias_smem, vector_smem, index_smem, d_bias_smem) = smem
    side = SideInputs(segments, q_segment_smem, kv_segment_smem, mask_ref, mask_rings, bias, bias_ref, bias_smem,
                      vectors, vector_smem)
    d_side = SideInputs(None, None, None, None, None, bias, d_bias_ref, d_bias_smem, (), ()) if moves_bias else None
    k_ready, v_ready = ready
    k_free, v_free = free
    rows = block_q // _CONSUMERS
    part = min(block_kv, PART)
    value_dim = d_out_ref.shape[-1]  # v's, or a piece's
    columns = () if piece is None else (pl.ds(piece * value_dim, value_dim),)
    num_q_tiles = q_ref.shape[1] // block_q
    q_tile = lax.axis_index("q")
    if rule.causal_only:  # heaviest tiles first
        q_tile = num_q_tiles - 1 - q_tile
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    tile_row0 = q_tile * block_q

    def tile_ranges(row0):
        return kv_tile_range(row0, rows, q_len, kv_len, block_kv, rule.window, mask_everywhere=rule.mask_everywhere)

    if has_tables:
        num_partial, cta_steps, block_of = table_walk(tables, batch, head, q_tile)
    else:
        cta_lo, cta_hi = union_of_ranges([tile_ranges(tile_row0 + c * rows) for c in range(_CONSUMERS)])
        cta_steps = cta_hi - cta_lo

        def block_of(n):
            return cta_lo + n

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232 if piece is None else CONSUMER_REGISTERS, action="increase")
        row0 = tile_row0 + wg * rows
        seed_parts = read_seed(seed)
        row_tile = (batch, pl.ds(row0, rows), head)
        row_vector = (batch, head, pl.ds(row0, rows))
        sources, own = side.row_copies(batch, head, row0, rows, wg)
        if d_side is not None:  # the bias tangent's rows
            sources, own = (a + b for a, b in zip((sources, own), d_side.row_copies(batch, head, row0, rows, wg)))
        sources = [q_ref.at[row_tile], lse2_ref.at[row_vector], *([dq_ref.at[row_tile]] if moves_q else []), *sources]
        own = [q_smem.at[wg], lse2_smem.at[wg], *([dq_smem.at[wg]] if moves_q else []), *own]
        for src, dst, barrier in zip(sources, own, row_ready):
            plgpu.copy_gmem_to_smem(src, dst, barrier.at[wg])
        for barrier in row_ready:
            plgpu.barrier_wait(barrier.at[wg])
        lse2 = plgpu.load(lse2_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        q_segments, row_bias = side.row_values(wg)
        d_row_bias = None if d_side is None else d_side.row_values(wg)[1]
        if index_smem is not None:
            store_indices(index_smem, wg)

        def scores(pairs):  # the sum over (a, b) of a (rows, D) @ b^T (D, part)
            def body(acc_ref):
                for a_smem, b_smem in pairs:
                    plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
                return acc_ref[...]

            return pl.run_scoped(body, plgpu.ACC((rows, part), jnp.float32))

        def step(kv_step, carry, masked: bool, user_mask: bool):
            acc, c = carry
            slot = lax.rem(kv_step, num_stages)
            # The resident tiles through an opaque copy of wg: see the dK/dV kernel's step.
            own = lax.optimization_barrier(wg)
            q_own = q_smem.at[own]
            plgpu.barrier_wait(k_ready.at[slot])
            for j in range(block_kv // part):
                keys = pl.ds(j * part, part)
                k_part = k_smem.at[slot, keys]
                s = scores([(q_own, k_part)])
                pairs = [(dq_smem.at[own], k_part)] if moves_q else []
                if moves_k:
                    pairs.append((q_own, dk_smem.at[slot, keys]))
                s_dot = scores(pairs) if pairs else None
                kv_segments, mask_tile, bias_tile, tiles = side.part_tiles(slot, j, keys, wg, rows, s.shape, row_bias)
                d_bias_tile = None if d_side is None else d_side.part_tiles(slot, j, keys, wg, rows, s.shape,
                                                                            d_row_bias)[2]

                def indices():
                    key0 = block_of(kv_step) * block_kv + j * part
                    if index_smem is None:
                        return tile_indices(s.shape, row0, key0)
                    return stored_indices(index_smem, own, s.shape, row0, key0)

                const_part = None
                if score_const_jvp is not None:  # at the scores the score_fn sees: scaled, biased
                    q_idx, kv_idx = indices()
                    const_part = score_const_jvp(s * rule.scale if bias_tile is None else s * rule.scale + bias_tile,
                                                 batch, head, q_idx, kv_idx, *score_arrays, *score_tangents)
                s, s_scale, derivative = rule.scores(
                    s, indices, batch, head, kv_len, masked=masked, user_mask=user_mask,
                    score_arrays=views(score_groups, tiles[:num_score_vectors]),
                    mask_arrays=views(mask_groups, tiles[num_score_vectors:]),
                    same_segment=lambda: same_segment(q_segments, kv_segments, s.shape),
                    dense=lambda: mask_tile != 0,
                    with_derivative=(bool(pairs) or moves_bias) and rule.score_fn is not None,
                    bias=lambda: bias_tile,
                )
                p = jnp.exp2(s * s_scale - lax.broadcast_in_dim(lse2, s.shape, [0]))
                keep = rule.kept(indices, batch, head, seed_parts) if rule.dropout_rate else None

                def dropped(x):
                    return x if keep is None else jnp.where(keep, x * rule.kept_scale, jnp.zeros_like(x))

                staged = None if p_smem is None else p_smem.at[wg]
                if j == 0:
                    plgpu.barrier_wait(v_ready.at[slot])
                if s_dot is not None or d_bias_tile is not None or const_part is not None:
                    if d_bias_tile is None and const_part is None:
                        t = s_dot * rule.scale if derivative is None else s_dot * rule.scale * derivative
                    else:  # the tangent of the biased scores, through the score_fn, then its arrays' part
                        parts = [x for x in (None if s_dot is None else s_dot * rule.scale, d_bias_tile)
                                 if x is not None]
                        t = sum(parts[1:], parts[0]) if parts else None
                        t = t if t is None or derivative is None else t * derivative
                        t = const_part if t is None else t if const_part is None else t + const_part
                    p_t = jnp.where(p > 0, p * t, 0.0)  # a non-finite tangent where p = 0 must not leak
                    c = c + p_t.sum(axis=1)
                    acc = _accumulate_pv(acc, dropped(p_t).astype(v_smem.dtype), v_smem.at[slot, keys], staged,
                                         not interpret, lambda: None)
                if moves_v:
                    acc = _accumulate_pv(acc, dropped(p).astype(v_smem.dtype), dv_smem.at[slot, keys], staged,
                                         not interpret, lambda: None)
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            return acc, c

        def skip(kv_step, _):
            slot = lax.rem(kv_step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])

        carry = (plgpu.layout_cast(jnp.zeros((rows, value_dim), jnp.float32), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
        if has_tables:
            acc, c = run_steps(step, skip, carry, tables=(num_partial, cta_steps))
        else:
            acc, c = run_steps(step, skip, carry, own=tile_ranges(row0), cta_lo=cta_lo, cta_steps=cta_steps)
        # Q is no longer read: its tile (or out's own, where v's head dim is not q's) takes out, then d out.
        out_own = (q_smem if out_smem is None else out_smem).at[wg]
        plgpu.copy_gmem_to_smem(out_ref.at[(*row_tile, *columns)], out_own, out_ready.at[wg])
        plgpu.barrier_wait(out_ready.at[wg])
        out = plgpu.load(out_own, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        out_own[...] = (acc - lax.broadcast_in_dim(c, acc.shape, [0]) * out).astype(out_own.dtype)
        lse2_smem.at[wg][...] = c
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_own, d_out_ref.at[row_tile])
        plgpu.copy_smem_to_gmem(lse2_smem.at[wg], d_lse_ref.at[row_vector])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40 if piece is None else PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        @pl.loop(0, cta_steps)
        def _(kv_step):
            key0 = block_of(kv_step) * block_kv
            tile = (batch if k_ref.shape[0] > 1 else 0, pl.ds(key0, block_kv), kv_head)
            copies = [(k_ref.at[tile], k_smem, k_ready), (v_ref.at[(*tile, *columns)], v_smem, v_ready)]
            if moves_k:  # the tangents arrive with their primals
                copies.append((dk_ref.at[tile], dk_smem, k_ready))
            if moves_v:
                copies.append((dv_ref.at[(*tile, *columns)], dv_smem, v_ready))
            copies += side.key_copies(key0, tile_row0, block_q, block_kv, part, batch, head, k_ready)
            if d_side is not None:
                copies += d_side.key_copies(key0, tile_row0, block_q, block_kv, part, batch, head, k_ready)
            fill_ring_slot(kv_step, num_stages, (k_free, v_free), copies)

        drain_ring(cta_steps, num_stages, k_free, v_free)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "causal", "window", "block_q", "block_kv", "num_stages", "interpret", "mask_fn",
                     "score_fn", "score_jvp", "dropout_rate", "dropout_positions", "dropout_heads", "score_vectors",
                     "mask_vectors", "pieces", "split", "score_const_jvp"),
)
def mosaic_tangent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse2: jax.Array,
    q_lengths: jax.Array,
    kv_lengths: jax.Array,
    *,
    dq: jax.Array | None = None,
    dk: jax.Array | None = None,
    dv: jax.Array | None = None,
    scale: float,
    causal: bool,
    window: tuple[int | None, int | None] = (None, None),
    block_q: int = TANGENT_TILES[0],
    block_kv: int = TANGENT_TILES[1],
    num_stages: int = 2,
    interpret: bool = False,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | None = None,
    dropout_positions: tuple[int, int] | None = None,
    dropout_heads: int | None = None,
    kv_tables: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None,
    mask_fn: Callable[..., jax.Array] | None = None,
    score_fn: Callable[..., jax.Array] | None = None,
    score_jvp: Callable[..., tuple[jax.Array, jax.Array]] | None = None,
    mask_arrays: tuple[jax.Array, ...] = (),
    score_arrays: tuple[jax.Array, ...] = (),
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    d_bias: jax.Array | None = None,
    score_tangents: tuple[jax.Array, ...] = (),
    score_const_jvp: Callable[..., jax.Array] | None = None,
    score_vectors: tuple = (),
    mask_vectors: tuple = (),
    pieces: int = 1,
    split: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The tangent of `mosaic_forward`'s (out, lse) on Hopper through Pallas Mosaic GPU, for tangents `dq`,
    `dk`, `dv` of q, k, v and `d_bias` of the bias (None: zero; the hooks' arrays hold still).

    **Arguments:** q, k, v, q_lengths, kv_lengths, scale, causal, window and the tiles as in `mosaic_forward`
    (same padding contract; head dims 64, 128 or 256, v's `[B, S, K, Dv]`); `out` `[B, T, N, Dv]` from the
    forward and `lse2` `[B, N, T]`, its lse in base 2 and +inf for rows with no key (`_scores.base2_lse`); dq,
    dk, dv shaped as q, k, v; at least one tangent given (of q, k, v, the bias or the score_fn's arrays).
    The dropout arguments, `kv_tables`, the hooks (a score_fn with its `score_jvp`), segment ids, `mask` and
    `bias` as in `mosaic_backward_dq`; `d_bias` shaped and typed as `bias`, read as it is (tiles, or float32
    key / row vectors), adds to the tangent of the scaled scores before the score_fn's derivative.
    `score_tangents`: tangents of some of `score_arrays` (none read as vectors), read one element at a time;
    `score_const_jvp(score, b, h, q_idx, kv_idx, *score_arrays, *score_tangents)` gives the score_fn's tangent
    in them at the scores it sees (with `split`, in the first group's programs: q's where it moves).
    `pieces`: d out from that many programs, each computing `PIECE` (128) or 64 of its columns (v's head dim
    256: 2 or 4; else 1 or 2), S and S' recomputed. `split`: the tangents of q, k and v each from programs of
    their own, whose (d out, d lse) XLA adds (q / k's head dim 256: Q, dQ, K and dK whole beside V, dV and out
    overflow shared memory, and a program moving k and v together spilled 8-148 B on sm_90a), d out rounded to
    out's dtype in each before the sum; the bias's tangent then runs in programs of its own too.

    **Returns:** (d out `[B, T, N, Dv]` in out's dtype, d lse `[B, N, T]` float32, natural log; 0 for rows with
    no key).
    """
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    # One ring slot suffices (head dim 256): a consumer frees a slot's K and V before it waits on the next.
    check_layout(q, k, v, q_lengths, kv_lengths, scale, block_q=block_q, q_multiple=64 * _CONSUMERS,
                 block_kv=block_kv, kv_multiple=64, num_stages=num_stages, min_stages=1, head_dims=(64, 128, 256),
                 smem_need=0, kernel="the Mosaic GPU tangent kernel")
    batch, q_len, num_heads, head_dim = q.shape
    value_dim = v.shape[3]
    for name, tangent, primal in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if tangent is not None and (tangent.shape != primal.shape or tangent.dtype != primal.dtype):
            raise ValueError(f"{name} must have the shape and dtype of its primal {primal.shape} {primal.dtype}; "
                             f"got {tangent.shape} {tangent.dtype}")
    if out.shape != (batch, q_len, num_heads, value_dim) or lse2.shape != (batch, num_heads, q_len):
        raise ValueError(f"out must be [B, T, N, Dv] = {[batch, q_len, num_heads, value_dim]} and lse2 [B, N, T]; "
                         f"got {out.shape=}, {lse2.shape=}")
    if d_bias is not None and (bias is None or jnp.shape(d_bias) != jnp.shape(bias)
                               or jnp.result_type(d_bias) != jnp.result_type(bias)):
        raise ValueError(f"d_bias must have the shape and dtype of bias "
                         f"{None if bias is None else (jnp.shape(bias), jnp.result_type(bias))}; got "
                         f"{jnp.shape(d_bias)} {jnp.result_type(d_bias)}")
    moving = (dq is not None, dk is not None, dv is not None, d_bias is not None)  # q, k, v, the bias
    if not any(moving) and not score_tangents:
        raise ValueError("mosaic_tangent needs a tangent of q, k, v, the bias or the score_fn's arrays (dq, dk, dv, "
                         "d_bias and score_tangents are all None)")
    if bool(score_tangents) != (score_const_jvp is not None) or (score_tangents and any(score_vectors)):
        raise ValueError("score_tangents need score_const_jvp (and the other way round) and no score_vectors")
    check_pieces(value_dim, pieces, "the tangent kernel (of v's head dim)", narrowest=64)
    groups = [tuple(i == j and m for j, m in enumerate(moving)) for i in range(4)] if split else [moving]
    groups = [group for group in groups if any(group)] or [moving]  # (the score_fn's arrays alone: one program)
    segments = check_segments(q_segment_ids, kv_segment_ids, batch, q_len, k.shape[1])
    dropout, seed = dropout_options(dropout_rate, dropout_seed, dropout_positions, dropout_heads, num_heads)
    mask = check_dense_mask(mask, batch, num_heads, q_len, k.shape[1])
    bias_kind, bias = check_bias(bias, batch, num_heads, q_len, k.shape[1])
    d_bias = check_bias(d_bias, batch, num_heads, q_len, k.shape[1])[1]
    vectors = vectors_in(grouped(score_arrays, score_vectors) + grouped(mask_arrays, mask_vectors))
    counts = tuple(sum(axis == a for axis, _ in vectors) for a in ("q", "kv"))
    columns = value_dim // pieces
    for group in groups:  # the GPU's shared memory: the interpreter's P tile (it has no limit) is not counted
        if (need := tangent_smem_bytes(
                head_dim, block_q, block_kv, num_stages, q.dtype.itemsize, segments=segments is not None,
                value_dim=columns, dense_mask=mask is not None, bias=bias_kind,
                bias_itemsize=4 if bias is None else bias.itemsize, vectors=counts, moving=group[:3],
                indices=pieces > 1 or split, d_bias=group[3])) > SMEM_BYTES:
            raise ValueError(f"{block_q=}, {block_kv=}, {num_stages=} at head dims {head_dim} / {columns} (v's, per "
                             f"piece) need {need} bytes of SMEM for the tangents of "
                             f"{[n for n, m in zip(('q', 'k', 'v', 'bias'), group) if m]} (split={split})")
    kv_len = k.shape[1]
    tables = _check_tables(kv_tables, batch, num_heads, q_len // block_q, kv_len // block_kv, block_q, block_kv,
                           name="kv_tables")
    lse2 = lse2.astype(jnp.float32)
    transforms = (plgpu.TilingTransform((8, _SWIZZLE // q.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    num_stages = min(num_stages, kv_len // block_kv)
    rows, part = block_q // _CONSUMERS, min(block_kv, PART)
    rule = _backward_rule(scale, causal, window, mask_fn, score_fn, score_jvp, segments, dropout, mask,
                          bias is not None)

    def launch(moving: tuple[bool, bool, bool, bool], piece: int | None, name: str, q=q):
        scores_move = bool(score_tangents) and moving == groups[0]  # the first group's programs carry them
        lin = (*(t for t, moves in zip((dq, dk, dv, d_bias), moving) if moves), *(score_tangents * scores_move))
        row_barriers = 2 + moving[0] + bool(segments) + (bias_kind == "rows") * (1 + moving[3]) + counts[0]
        static = {"moves_bias": True} if moving[3] else {}
        if scores_move:
            static.update(num_score_tangents=len(score_tangents), score_const_jvp=score_const_jvp)
        return _launch(
            _tangent_kernel, name, (q, k, v, out, lse2, q_lengths, kv_lengths, *lin), tables,
            score_arrays, mask_arrays, interpret=interpret, block_q=block_q, block_kv=block_kv, num_stages=num_stages,
            rule=rule, segments=segments, seed=seed, mask=mask, bias=bias, bias_kind=bias_kind, moving=moving[:3],
            score_vectors=score_vectors, mask_vectors=mask_vectors, piece=piece, **static,
            out_type=(jax.ShapeDtypeStruct((*out.shape[:3], columns), out.dtype),
                      jax.ShapeDtypeStruct(lse2.shape, jnp.float32)),
            scratch_types=(
                (
                    plgpu.SMEM((_CONSUMERS, rows, head_dim), q.dtype, transforms=transforms),
                    plgpu.SMEM((_CONSUMERS, rows, head_dim), q.dtype, transforms=transforms) if moving[0] else None,
                    plgpu.SMEM((_CONSUMERS, rows), jnp.float32),
                    plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                    plgpu.SMEM((num_stages, block_kv, columns), q.dtype, transforms=transforms),
                    plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms) if moving[1] else None,
                    plgpu.SMEM((num_stages, block_kv, columns), q.dtype, transforms=transforms) if moving[2] else None,
                    plgpu.SMEM((_CONSUMERS, rows, columns), q.dtype, transforms=transforms)
                    if columns != head_dim else None,
                    plgpu.SMEM((_CONSUMERS, rows, part), q.dtype, transforms=transforms) if interpret else None,
                    *side_scratch(segments, mask, bias_kind, bias, num_stages, block_q, block_kv, part, rows),
                    vector_scratch(vectors, num_stages, block_kv, rows),
                    None if piece is None else index_scratch(rows, part),
                    bias_scratch(bias_kind, d_bias, (num_stages, block_q, part), block_kv // part,
                                 keys=(num_stages, block_kv), rows=(_CONSUMERS, rows)) if moving[3] else None,
                ),
                (tuple(plgpu.Barrier(num_barriers=_CONSUMERS) for _ in range(row_barriers)),
                 plgpu.Barrier(num_barriers=_CONSUMERS)),
                (  # K's barrier also awaits dK, the segment ids, mask and bias tiles and key vectors; V's awaits dV
                    plgpu.Barrier(num_arrivals=1 + moving[1] + bool(segments) + (mask is not None) * (block_kv // part)
                                  + {"tiles": block_kv // part, "keys": 1}.get(bias_kind, 0) * (1 + moving[3])
                                  + counts[1], num_barriers=num_stages),
                    plgpu.Barrier(num_arrivals=1 + moving[2], num_barriers=num_stages),
                ),
                (
                    plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
                    plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
                ),
            ),
            grid=(q_len // block_q, num_heads, batch),
            grid_names=("q", "heads", "batch"),
        )

    if pieces == 1 and not split:
        return launch(moving, None, "probjax_mosaic_tangent")
    results, sums = [], []
    for group in groups:  # in the interpreter one program at a time (`after`)
        moved = [name for name, moves in zip(("q", "k", "v", "bias"), group) if moves] or ["scores"]
        prefix = "probjax_mosaic_tangent" + ("_d" + moved[0] if split else "")
        for piece in range(pieces):
            name = prefix + ("" if pieces == 1 else f"_piece{piece}")
            earlier = results[-1][0] if results else None
            results.append(launch(group, piece, name, after(q, earlier, interpret)))
        d_out = jnp.concatenate([r[0] for r in results[-pieces:]], axis=-1)
        sums.append((d_out, results[-pieces][1]))
    if len(sums) == 1:
        return sums[0]
    d_out = sum(d.astype(jnp.float32) for d, _ in sums).astype(out.dtype)
    return d_out, sum(d_lse for _, d_lse in sums)
