"""Flash-attention backward for Hopper (sm_90) in Pallas Mosaic GPU: the dQ kernel (FlashAttention-2, Alg. 2,
split by query tile, so no atomics); the dK / dV kernel is `mosaic.backward_dkv`.

Same CTA layout as `mosaic.forward`: one CTA per (query tile of `block_q` rows, batch, query head), two
consumer warpgroups owning `block_q // 2` rows each and a producer warpgroup feeding a ring of K / V slots
by TMA. Per KV tile a consumer recomputes S = Q K^T and dP = dO V^T (both wgmma from SMEM), then
p = exp2(s * scale * log2(e) - lse2), dS = p * (dP - delta) and dQ += dS K (wgmma, dS from registers; staged
in SMEM in interpret mode). `lse2` is the forward's lse in base 2, +inf for rows with no key so that p = 0
and their gradient is exactly zero; `delta` = rowsum(dO * O) comes from XLA.

Window (causal) tile skipping, lengths masking and the caller's padding contract are those of
`mosaic.forward`. Both backward kernels run a step in parts of at most `PART` (64) columns of S (dQ: keys) /
S^T (dK/dV: queries), so that the forward's 128 x 128 tiles (hooks, block tables) do not spill; with those
the dispatch runs dK/dV on one-part 64-query steps (a table tile in two, `tables_block_q`): its two-part steps
spilled with a score_mod. At head dim 256 dQ comes from a program per `PIECE` (128) of its columns (`pieces`).
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
    PIECE,
    PRODUCER_REGISTERS,
    SMEM_BYTES,
    ScoreRule,
    _accumulate_pv,
    after,
    _backward_rule,
    allocated_smem,
    bias_smem_bytes,
    bias_tiles,
    check_bias,
    _launch,
    _prologue,
    check_dense_mask,
    check_layout,
    check_outputs,
    check_pieces,
    check_segments,
    drain_ring,
    dropout_options,
    fill_ring_slot,
    last_piece,
    read_seed,
    same_segment,
    split_hook_refs,
    table_walk,
    tile_indices,
    union_of_ranges,
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


DQ_TILES = (128, 64)  # the dQ kernel's default (block_q, block_kv): one 64-key part a step


def dq_smem_bytes(head_dim: int, block_q: int, block_kv: int, num_stages: int, ds_in_smem: bool = False,
                  itemsize: int = 2, segments: bool = False, value_dim: int | None = None,
                  dense_mask: bool = False, bias: str | None = None, bias_itemsize: int = 4,
                  bias_grad: bool = False, vectors: tuple[int, int] = (0, 0), pieces: int = 1) -> int:
    """Shared memory of one dQ CTA as Mosaic GPU allocates it (`allocated_smem`): Q (reused for dQ) and dO
    tiles, the K / V rings (dO and V of v's head dim `value_dim`, default q's), lse2 / delta rows, with
    `ds_in_smem` the dS tiles of one part, with `segments` the rows' segment ids and a ring of the keys', with
    `dense_mask` a ring of int8 mask tiles per part, a bias read as `bias` (`check_bias`'s kind; tiles of
    `bias_itemsize` bytes, a ring per part) and with `bias_grad` its float32 dS tiles (one part) or row sums
    staged for their copy out, the hooks' vectors (`vectors`: how many along queries, along keys), and the
    barriers (a row barrier per piece of Q: `pieces`, whose programs also hold their index vectors)."""
    value_dim = value_dim or head_dim
    part = min(block_kv, PART)
    parts = block_kv // part
    buffers = [itemsize * block_q * head_dim, itemsize * block_q * value_dim, 4 * block_q, 4 * block_q,
               itemsize * num_stages * block_kv * head_dim, itemsize * num_stages * block_kv * value_dim,
               itemsize * block_q * part if ds_in_smem else 0, 4 * block_q if segments else 0,
               4 * num_stages * block_kv if segments else 0,
               *([num_stages * block_q * part] * parts if dense_mask else []),
               *([bias_smem_bytes(bias, bias_itemsize, block_q, part, num_stages)] * (parts if bias == "tiles" else 1)),
               {"tiles": 4 * block_q * part, "rows": 4 * block_q}.get(bias, 0) if bias_grad else 0,
               *[4 * block_q] * vectors[0], *[4 * num_stages * block_kv] * vectors[1],
               *([4 * block_q, 4 * _CONSUMERS * part] if pieces > 1 else [])]  # the pieces' index vectors
    row_barriers = 3 + pieces + segments + (bias == "rows") + vectors[0]
    return allocated_smem(buffers, _CONSUMERS * row_barriers + 4 * num_stages, reductions=bias_grad and bias == "rows")


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_len_ref, kv_len_ref, *refs, rule: ScoreRule, block_q: int,
    block_kv: int, num_stages: int, group: int, interpret: bool, has_tables: bool, num_score_arrays: int,
    num_mask_arrays: int, has_segments: bool, has_dropout: bool, has_mask: bool, bias: str | None = None,
    bias_grad: bool = False, score_vectors: tuple = (), mask_vectors: tuple = (), piece: int | None = None,
):
    # `piece`: this program computes dQ's columns [piece * PIECE, (piece + 1) * PIECE) alone (head dim 256). Q and
    # K then sit in shared memory as PIECE-column pieces (`q_smem[p][wg]`, `k_smem[p][slot]`): S sums their
    # products, dQ's columns take K's piece, and Q's piece carries them out (a TMA copy reads contiguous tiles).
    tables, score_arrays, mask_arrays, segments, seed, mask_ref, refs = split_hook_refs(
        refs, has_tables, num_score_arrays, num_mask_arrays, has_segments, has_dropout, has_mask)
    # The hooks' arrays: global-memory refs, or vectors along q_idx / kv_idx (`hook_vectors`).
    score_groups, mask_groups = grouped(score_arrays, score_vectors), grouped(mask_arrays, mask_vectors)
    vectors = vectors_in(score_groups + mask_groups)
    num_score_vectors = len(vectors_in(score_groups))
    bias_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)  # `check_bias`'s tiles, keys or rows
    dq_ref, *refs = refs
    # With `bias_grad`: dS [B, N, T, S] float32 for bias tiles, its row sums [B, N, T] for row biases.
    dbias_ref = refs.pop(0) if bias_grad and bias in ("tiles", "rows") else None
    smem, row_ready, ready, free = refs
    (q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, ds_smem, q_segment_smem, kv_segment_smem,
     mask_rings, bias_smem, dbias_smem, vector_smem, iota_smem) = smem  # mask_rings: a (block_q, part) ring per part
    side = SideInputs(segments, q_segment_smem, kv_segment_smem, mask_ref, mask_rings, bias, bias_ref, bias_smem,
                      vectors, vector_smem)
    k_ready, v_ready = ready
    k_free, v_free = free
    rows = block_q // _CONSUMERS
    part = min(block_kv, PART)  # keys per part of a step
    columns = q_ref.shape[-1] if piece is None else PIECE  # of dQ this program computes; dO and V have v's
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
        # As in the forward: both consumers and the producer walk the table row of the CTA's query block, its
        # partial blocks (steps [0, num_partial)) then its full ones.
        num_partial, cta_steps, block_of = table_walk(tables, batch, head, q_tile)
    else:
        # The producer loads the union of the consumers' KV tiles [cta_lo, cta_hi); step n holds tile cta_lo + n.
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
        if piece is None:
            q_sources, q_own = [q_ref.at[row_tile]], [q_smem.at[wg]]
        else:
            q_sources = [q_ref.at[(*row_tile, pl.ds(p * PIECE, PIECE))] for p in range(len(q_smem))]
            q_own = [buffer.at[wg] for buffer in q_smem]
        sources = [*q_sources, do_ref.at[row_tile], lse2_ref.at[row_vector], delta_ref.at[row_vector], *sources]
        own = [*q_own, *(x.at[wg] for x in (do_smem, lse2_smem, delta_smem)), *own]
        for src, dst, barrier in zip(sources, own, row_ready):
            plgpu.copy_gmem_to_smem(src, dst, barrier.at[wg])
        for barrier in row_ready:
            plgpu.barrier_wait(barrier.at[wg])
        lse2 = plgpu.load(lse2_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        q_segments, row_bias = side.row_values(wg)
        if iota_smem is not None:  # the piece programs read their index vectors from shared memory per step
            store_indices(iota_smem, wg)

        def matmul_t(a_pieces, b_pieces):  # the sum of a (rows, D) @ b^T (D, keys) over the pieces
            def body(acc_ref):
                for a_smem, b_smem in zip(a_pieces, b_pieces, strict=True):
                    plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
                return acc_ref[...]

            return pl.run_scoped(body, plgpu.ACC((rows, b_pieces[0].shape[0]), jnp.float32))

        def step(kv_step, carry, masked: bool, user_mask: bool):
            dq, row_sums = carry  # row_sums: dS summed over keys, for a row bias's gradient (else None)
            slot = lax.rem(kv_step, num_stages)
            # The resident Q / dO tiles through an opaque copy of wg: see the dK/dV kernel's step.
            own = lax.optimization_barrier(wg)
            q_own = [q_smem.at[own]] if piece is None else [buffer.at[own] for buffer in q_smem]
            do_own = do_smem.at[own]
            plgpu.barrier_wait(k_ready.at[slot])
            for j in range(block_kv // part):
                keys = pl.ds(j * part, part)
                k_part = [k_smem.at[slot, keys]] if piece is None else [ring.at[slot, keys] for ring in k_smem]
                v_part = v_smem.at[slot, keys]
                s = matmul_t(*(q_own, k_part) if piece is None else last_piece(piece, q_own, k_part))
                kv_segments, mask_tile, bias_tile, tiles = side.part_tiles(slot, j, keys, wg, rows, s.shape, row_bias)

                def indices():
                    key0 = block_of(kv_step) * block_kv + j * part
                    if iota_smem is None:
                        return tile_indices(s.shape, row0, key0)
                    return stored_indices(iota_smem, own, s.shape, row0, key0)

                s, s_scale, derivative = rule.scores(
                    s, indices, batch, head, kv_len, masked=masked, user_mask=user_mask,
                    score_arrays=views(score_groups, tiles[:num_score_vectors]),
                    mask_arrays=views(mask_groups, tiles[num_score_vectors:]),
                    same_segment=lambda: same_segment(q_segments, kv_segments, s.shape),
                    dense=lambda: mask_tile != 0, with_derivative=True, bias=lambda: bias_tile,
                )
                # P, with a score_mod's derivative folded in (the chain rule), before dP is live: S, dP and the
                # masks' index tiles held together spilled at head dim 256 (docs/perf-notes.md, Version 27).
                p = jnp.exp2(s * s_scale - lax.broadcast_in_dim(lse2, s.shape, [0]))
                if derivative is not None:
                    p = p * derivative
                if j == 0:
                    plgpu.barrier_wait(v_ready.at[slot])
                dp = matmul_t([do_own], [v_part])
                if j == block_kv // part - 1:
                    plgpu.barrier_arrive(v_free.at[slot])
                dp = rule.dropped(dp, indices, batch, head, seed_parts)  # dS = P (Z dP / (1 - rate) - delta)
                ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                if dbias_ref is not None and bias == "tiles":  # the bias gradient's tile, by TMA from shared memory
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous part's copy has read the tile
                    dbias_smem.at[wg][...] = ds
                    plgpu.commit_smem()
                    key0 = block_of(kv_step) * block_kv + j * part
                    plgpu.copy_smem_to_gmem(dbias_smem.at[wg], dbias_ref.at[batch, head, pl.ds(row0, rows),
                                                                            pl.ds(key0, part)])
                elif row_sums is not None:
                    row_sums = row_sums + ds.sum(axis=1)
                dq = _accumulate_pv(
                    dq, ds.astype(do_smem.dtype), k_part[piece or 0], None if ds_smem is None else ds_smem.at[wg],
                    not interpret, lambda: None,
                )
            plgpu.barrier_arrive(k_free.at[slot])
            return dq, row_sums

        def skip(kv_step, _):
            slot = lax.rem(kv_step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])

        carry = (plgpu.layout_cast(jnp.zeros((rows, columns), jnp.float32), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                 if dbias_ref is not None and bias == "rows" else None)
        if has_tables:  # partial blocks: every mask; full blocks: the length mask only
            carry = run_steps(step, skip, carry, tables=(num_partial, cta_steps))
        else:
            carry = run_steps(step, skip, carry, own=tile_ranges(row0), cta_lo=cta_lo, cta_steps=cta_steps)
        dq, row_sums = carry
        q_own = q_smem.at[wg] if piece is None else q_smem[piece].at[wg]
        q_own[...] = (dq * rule.scale).astype(q_own.dtype)  # Q is no longer read: its tile carries dQ out
        if row_sums is not None:
            dbias_smem.at[wg][...] = row_sums
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_own, dq_ref.at[row_tile])
        if row_sums is not None:
            plgpu.copy_smem_to_gmem(dbias_smem.at[wg], dbias_ref.at[row_vector])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40 if piece is None else PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        @pl.loop(0, cta_steps)
        def _(kv_step):
            key0 = block_of(kv_step) * block_kv
            tile = (batch if k_ref.shape[0] > 1 else 0, pl.ds(key0, block_kv), kv_head)
            if piece is None:
                copies = [(k_ref.at[tile], k_smem, k_ready)]
            else:
                copies = [(k_ref.at[(*tile, pl.ds(p * PIECE, PIECE))], ring, k_ready) for p, ring in enumerate(k_smem)]
            copies.append((v_ref.at[tile], v_smem, v_ready))
            copies += side.key_copies(key0, tile_row0, block_q, block_kv, part, batch, head, k_ready)
            fill_ring_slot(kv_step, num_stages, (k_free, v_free), copies)

        drain_ring(cta_steps, num_stages, k_free, v_free)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "causal", "window", "block_q", "block_kv", "num_stages", "ds_in_smem", "interpret",
                     "mask_fn", "score_fn", "score_jvp", "dropout_rate", "dropout_positions", "dropout_heads",
                     "bias_grad", "score_vectors", "mask_vectors", "pieces"),
)
def mosaic_backward_dq(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    q_lengths: jax.Array,
    kv_lengths: jax.Array,
    *,
    scale: float,
    causal: bool,
    window: tuple[int | None, int | None] = (None, None),
    block_q: int = DQ_TILES[0],
    block_kv: int = DQ_TILES[1],
    num_stages: int = 2,
    ds_in_smem: bool = False,
    interpret: bool = False,
    d_lse: jax.Array | None = None,
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
    bias_grad: bool = False,
    score_vectors: tuple = (),
    mask_vectors: tuple = (),
    pieces: int = 1,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """dQ of `mosaic_forward` on Hopper through Pallas Mosaic GPU.

    **Arguments:** q, k, v, q_lengths, kv_lengths, scale, causal, window and the tiles as in `mosaic_forward`
    (same padding contract; v `[B, S, K, Dv]`, Dv in {64, 128}); `out` `[B, T, N, Dv]` and `lse` `[B, N, T]`
    (natural log, -inf for empty rows) from the forward pass; `d_out` `[B, T, N, Dv]`, the cotangent of `out`.
    `ds_in_smem` stages dS in shared memory
    for the dS K matmul (always on in interpret mode). `d_lse` `[B, N, T]`: a cotangent of lse, if any.
    `kv_tables`, `mask_fn`, `score_fn`, `mask_arrays`, `score_arrays`, `score_vectors`, `mask_vectors` as in
    `mosaic_forward` (the tables' tiles must be this kernel's block_q x block_kv), and with a `score_fn` its
    `score_jvp` (see `ScoreRule`).
    `q_segment_ids`, `kv_segment_ids`, `mask`, `bias` and the dropout arguments as in `mosaic_forward` (the
    forward's). `bias_grad`: also return what the bias gradient is made of, where this kernel makes it (bias
    tiles or rows; a key bias's is `mosaic_backward_dkv`'s). `pieces`: dQ from that many programs, each
    computing `PIECE` (128) of its columns with S and dP recomputed, Q and K held as pieces of that width (head
    dim 256 needs 2: one program's 64 x 256 float32 accumulator spilled beside S and dP); otherwise 1.

    **Returns:** dQ `[B, T, N, D]` in q's dtype; with `bias_grad` and a bias of whole T and S, `(dQ, dS)`, dS
    `[B, N, T, S]` float32 (d loss / d biased score; undefined outside the window and lengths, whose tiles are
    never visited: the caller masks), with a bias whose S is 1, `(dQ, dS summed over keys)` `[B, N, T]` float32.
    """
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    ds_in_smem = ds_in_smem or interpret
    # The shapes' checks (shared memory below). One stage is enough (the producer refills a slot once both
    # consumers have freed its K and V): at head dim 256, Q, dO and two 64-key K / V slots would need 256 KiB.
    check_layout(q, k, v, q_lengths, kv_lengths, scale, block_q=block_q, q_multiple=64 * _CONSUMERS,
                 block_kv=block_kv, kv_multiple=64, num_stages=num_stages, min_stages=1, head_dims=(64, 128, 256),
                 smem_need=0, kernel="the Mosaic GPU dQ kernel")
    batch, q_len, num_heads, head_dim = q.shape
    value_dim = v.shape[3]
    segments = check_segments(q_segment_ids, kv_segment_ids, batch, q_len, k.shape[1])
    dropout, seed = dropout_options(dropout_rate, dropout_seed, dropout_positions, dropout_heads, num_heads)
    mask = check_dense_mask(mask, batch, num_heads, q_len, k.shape[1])
    bias_kind, bias = check_bias(bias, batch, num_heads, q_len, k.shape[1])
    bias_grad = bias_grad and bias_kind in ("tiles", "rows")
    check_outputs(q, v, out, lse, d_out)
    vectors = vectors_in(grouped(score_arrays, score_vectors) + grouped(mask_arrays, mask_vectors))
    counts = tuple(sum(axis == a for axis, _ in vectors) for a in ("q", "kv"))
    check_pieces(head_dim, pieces, "the dQ kernel")
    if (need := dq_smem_bytes(head_dim, block_q, block_kv, num_stages, ds_in_smem, segments=segments is not None,
                              value_dim=value_dim, dense_mask=mask is not None, bias=bias_kind,
                              bias_itemsize=4 if bias is None else bias.itemsize, bias_grad=bias_grad,
                              vectors=counts, pieces=pieces)) > SMEM_BYTES:
        raise ValueError(f"{block_q=}, {block_kv=}, {num_stages=} at {head_dim=} need {need} bytes of SMEM")
    kv_len = k.shape[1]
    tables, delta, lse2, transforms = _prologue(q, k, out, lse, d_out, d_lse, None, kv_tables, block_q, block_kv,
                                                "kv_tables")
    num_stages = min(num_stages, kv_len // block_kv)
    rows, part = block_q // _CONSUMERS, min(block_kv, PART)
    dbias_type = {"tiles": (batch, num_heads, q_len, kv_len), "rows": (batch, num_heads, q_len)}.get(bias_kind)

    def q_buffer(width: int):
        return plgpu.SMEM((_CONSUMERS, rows, width), q.dtype, transforms=transforms)

    def k_ring(width: int):
        return plgpu.SMEM((num_stages, block_kv, width), q.dtype, transforms=transforms)

    def launch(piece: int | None, q=q):  # dQ, or its columns of `piece` (with the bias gradient's parts: piece 0)
        grads_bias = bias_grad and not piece
        out_type = jax.ShapeDtypeStruct((*q.shape[:3], PIECE if piece is not None else head_dim), q.dtype)
        if grads_bias:
            out_type = (out_type, jax.ShapeDtypeStruct(dbias_type, jnp.float32))
        return _launch(
            _dq_kernel, "probjax_mosaic_backward_dq" + ("" if piece is None else f"_piece{piece}"),
            (q, k, v, d_out, lse2, delta, q_lengths, kv_lengths), tables, score_arrays, mask_arrays,
            interpret=interpret, block_q=block_q, block_kv=block_kv, num_stages=num_stages,
            rule=_backward_rule(scale, causal, window, mask_fn, score_fn, score_jvp, segments, dropout, mask,
                                bias is not None),
            segments=segments, seed=seed, mask=mask, bias=bias, bias_kind=bias_kind, bias_grad=grads_bias,
            score_vectors=score_vectors, mask_vectors=mask_vectors, piece=piece, out_type=out_type,
            scratch_types=(
                (
                    q_buffer(head_dim) if piece is None else (q_buffer(PIECE),) * pieces,
                    plgpu.SMEM((_CONSUMERS, rows, value_dim), q.dtype, transforms=transforms),
                    plgpu.SMEM((_CONSUMERS, rows), jnp.float32),
                    plgpu.SMEM((_CONSUMERS, rows), jnp.float32),
                    k_ring(head_dim) if piece is None else (k_ring(PIECE),) * pieces,
                    plgpu.SMEM((num_stages, block_kv, value_dim), q.dtype, transforms=transforms),
                    plgpu.SMEM((_CONSUMERS, rows, part), q.dtype, transforms=transforms) if ds_in_smem else None,
                    *side_scratch(segments, mask, bias_kind, bias, num_stages, block_q, block_kv, part, rows),
                    {"tiles": plgpu.SMEM((_CONSUMERS, rows, part), jnp.float32, transforms=bias_tiles(4)),
                     "rows": plgpu.SMEM((_CONSUMERS, rows), jnp.float32)}[bias_kind] if grads_bias else None,
                    vector_scratch(vectors, num_stages, block_kv, rows),
                    None if piece is None else index_scratch(rows, part),
                ),
                tuple(plgpu.Barrier(num_barriers=_CONSUMERS)  # a copy a barrier: Q's pieces, dO, lse2, delta, ...
                      for _ in range(3 + pieces + bool(segments) + (bias_kind == "rows") + counts[0])),
                (  # with Q's pieces / segments / a mask / a bias / hook vectors, K's barrier awaits their copies
                    plgpu.Barrier(num_arrivals=pieces + bool(segments) + (mask is not None) * (block_kv // part)
                                  + {"tiles": block_kv // part, "keys": 1}.get(bias_kind, 0) + counts[1],
                                  num_barriers=num_stages),
                    plgpu.Barrier(num_barriers=num_stages),
                ),
                (
                    plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
                    plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
                ),
            ),
            grid=(q_len // block_q, num_heads, batch),
            grid_names=("q", "heads", "batch"),
        )

    if pieces == 1:
        return launch(None)
    results = [launch(0)]
    for piece in range(1, pieces):  # in the interpreter one program at a time (`after`)
        results.append(launch(piece, after(q, results[-1], interpret)))
    first = results[0] if not bias_grad else results[0][0]
    dq = jnp.concatenate([first, *results[1:]], axis=-1)
    return (dq, results[0][1]) if bias_grad else dq
