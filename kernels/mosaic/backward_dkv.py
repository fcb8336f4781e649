"""Flash-attention backward for Hopper (sm_90) in Pallas Mosaic GPU: the dK / dV kernel (FlashAttention-2,
Alg. 2, split by KV tile, so no atomics), the companion of `mosaic.backward`'s dQ kernel (parts, padding and
masks as there).

dK / dV (`mosaic_backward_dkv`): one CTA per (KV tile of `block_kv` keys, KV head, batch). Each of the two
consumer warpgroups keeps its `block_kv // 2` keys of K and V resident in SMEM; the producer warpgroup streams
Q, dO, lse2 and delta tiles of `block_q` rows through a ring of `num_stages` slots, over the query tiles of
every query head of the GQA group (so the group sum happens in the kernel; the dK programs of a `split` run per
query head instead, and at head dim 256 per `PIECE` of dK's columns). Per tile a consumer computes
S^T = K Q^T and dP^T = V dO^T (wgmma from SMEM), P^T = exp2(S^T * scale * log2(e) - lse2),
dS^T = P^T * (dP^T - delta), then dV += P^T dO and dK += dS^T Q (wgmma, the left operand from registers;
staged in SMEM in interpret mode, through the same `_accumulate_pv` helper as the forward). With a window
(causal): only query tiles with a row that sees one of the consumer's keys are computed (the producer streams
the union of both consumers' tiles; a consumer waits for the others and releases them without compute) and
only tiles crossing a window edge, or holding keys >= kv_lengths[b],
evaluate the per-element mask. Rows >= q_lengths[b] get lse2 = +inf in the XLA preprocess, so p = 0 there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_kernels._tiles import q_tile_range
from probjax_kernels.mosaic.common import (
    _CONSUMERS,
    CONSUMER_REGISTERS,
    PART,
    PIECE,
    PRODUCER_REGISTERS,
    ScoreRule,
    _accumulate_pv,
    after,
    _backward_rule,
    allocated_smem,
    bias_scratch,
    bias_smem_bytes,
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
    mask_index,
    mask_tiles,
    own_ranges,
    read_seed,
    same_segment,
    split_hook_refs,
    table_walk,
    union_of_ranges,
)
from probjax_kernels.mosaic.hook_vectors import grouped, tile_of, vectors_in, views


DKV_TILES = (64, 128)  # the dK/dV kernel's default (block_q, block_kv): 64 resident keys per consumer


def dkv_smem_bytes(head_dim: int, block_q: int, block_kv: int, num_stages: int, p_in_smem: bool = False,
                   itemsize: int = 2, segments: bool = False, value_dim: int | None = None,
                   dense_mask: bool = False, bias: str | None = None, bias_itemsize: int = 4,
                   bias_grad: bool = False, vectors: tuple[int, int] = (0, 0)) -> int:
    """Shared memory of one dK / dV CTA: the resident K and V tiles (reused for dK / dV), the Q and dO rings,
    the lse2 / delta rows of each slot, each consumer's key and query index vectors, with `p_in_smem` one
    staging tile per consumer for P^T and dS^T (one part), with `segments` the keys' segment ids and a ring
    of the queries', with `dense_mask` a ring of int8 (keys, queries) mask tiles per part, a bias read as `bias`
    (`check_bias`'s kind: transposed tiles of `bias_itemsize` bytes, a ring per part, or a ring of float32 key
    or query vectors), with `bias_grad` a key bias's float32 key sums staged for their copy out, and a ring of
    each of the hooks' vectors (`vectors`: how many along queries, along keys). V and dO have v's head dim
    `value_dim` (default q's). As Mosaic GPU allocates it (`allocated_smem`), barriers
    included."""
    value_dim = value_dim or head_dim
    part = min(block_q, PART)
    buffers = [itemsize * block_kv * head_dim, itemsize * block_kv * value_dim,
               itemsize * num_stages * block_q * head_dim, itemsize * num_stages * block_q * value_dim,
               4 * num_stages * block_q, 4 * num_stages * block_q, itemsize * block_kv * part if p_in_smem else 0,
               4 * block_kv, 4 * _CONSUMERS * part, 4 * block_kv if segments else 0,
               4 * num_stages * block_q if segments else 0,
               *([num_stages * block_kv * part] * (block_q // part) if dense_mask else []),
               *([bias_smem_bytes("tiles", bias_itemsize, block_kv, part, num_stages)] * (block_q // part)
                 if bias == "tiles" else [4 * num_stages * {"keys": block_kv, "rows": block_q}.get(bias, 0)]),
               4 * block_kv if bias_grad and bias == "keys" else 0,
               *[4 * num_stages * block_q] * vectors[0], *[4 * num_stages * block_kv] * vectors[1]]
    return allocated_smem(buffers, 2 * _CONSUMERS + 4 * num_stages, reductions=bias_grad and bias == "keys")


_DKV_HEAD_DIMS = (64, 128, 256)
# The layouts of a (keys, queries) part's key and query index vectors (S^T's rows and columns).
_KEY_VECTOR, _QUERY_VECTOR = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)


def _check_dkv(q, k, v, out, lse, d_out, q_lengths, kv_lengths, scale: float, block_q: int, block_kv: int,
               num_stages: int, p_in_smem: bool, segments: bool = False, dense_mask: bool = False,
               bias: tuple = (None, 4), bias_grad: bool = False, vectors: tuple[int, int] = (0, 0)):
    # 64 keys per consumer warpgroup. D = 256 takes one Q / dO stage (K, V and two 64-query stages need 256 KiB of
    # SMEM) and `split` programs (the dK + dV accumulators would take 256 float32 registers a thread).
    check_layout(
        q, k, v, q_lengths, kv_lengths, scale, block_q=block_q, q_multiple=64, block_kv=block_kv,
        kv_multiple=64 * _CONSUMERS, num_stages=num_stages, min_stages=1, head_dims=_DKV_HEAD_DIMS,
        smem_need=dkv_smem_bytes(q.shape[-1], block_q, block_kv, num_stages, p_in_smem, q.dtype.itemsize, segments,
                                 v.shape[-1], dense_mask, *bias, bias_grad, vectors),
        kernel="the Mosaic GPU dK / dV kernel",
    )
    if d_out.dtype != q.dtype:
        raise ValueError(f"d_out must have q's dtype {q.dtype}, got {d_out.dtype}")
    check_outputs(q, v, out, lse, d_out)


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_len_ref, kv_len_ref, *refs, rule: ScoreRule, block_q: int,
    block_kv: int, num_stages: int, group: int, interpret: bool, has_tables: bool, num_score_arrays: int,
    num_mask_arrays: int, table_split: int, has_segments: bool, has_dropout: bool, has_mask: bool,
    bias: str | None = None, bias_grad: bool = False, score_vectors: tuple = (), mask_vectors: tuple = (),
    split: str | None = None, piece: int | None = None,
):
    # `split` "dk" / "dv": this program computes that gradient alone (`mosaic_backward_dkv`'s `split`); with
    # `piece` (dK at head dim 256) dK's columns [piece * width, (piece + 1) * width) alone, K and Q then sitting
    # in shared memory as pieces of that width (`k_smem[p][wg]`, `q_smem[p][slot]`), as in the dQ kernel.
    # With a dense mask, `mask_ref` is its transpose [B|1, N|1, S, T]: tiles of S^T's (keys, queries) shape; so
    # is `bias_ref` with bias tiles, else its keys' [B|1, N|1, S] or rows' [B|1, N|1, T] float32 vectors.
    tables, score_arrays, mask_arrays, segments, seed, mask_ref, refs = split_hook_refs(
        refs, has_tables, num_score_arrays, num_mask_arrays, has_segments, has_dropout, has_mask)
    # The hooks' arrays: global-memory refs, or vectors along q_idx / kv_idx (`hook_vectors`), a ring of each.
    score_groups, mask_groups = grouped(score_arrays, score_vectors), grouped(mask_arrays, mask_vectors)
    vectors = vectors_in(score_groups + mask_groups)
    num_score_vectors = len(vectors_in(score_groups))
    bias_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
    refs = list(refs)
    dk_ref = refs.pop(0) if split != "dv" else None
    dv_ref = refs.pop(0) if split != "dk" else None
    dbias_ref = refs.pop(0) if bias_grad else None  # a key bias's gradient: dS summed over queries, [B, N, S]
    smem, kv_ready, ready, free = refs
    (k_smem, v_smem, q_smem, do_smem, lse2_smem, delta_smem, p_smem, key_iota, query_iota, kv_segment_smem,
     q_segment_smem, mask_rings, bias_smem, dbias_smem, vector_smem) = smem  # mask_rings: a ring per part
    k_ready, v_ready = kv_ready
    q_ready, do_ready = ready  # lse2 arrives with Q, delta with dO: two barrier phases fewer held per step
    q_free, do_free = free
    keys = block_kv // _CONSUMERS
    part = min(block_q, PART)  # queries per part of a step
    head_dim, value_dim = q_ref.shape[-1], v_ref.shape[-1]
    dk_columns = width = head_dim if piece is None else head_dim // len(k_smem)  # PIECE, or 64 with a score_mod

    def k_pieces(own):
        return [k_smem.at[own]] if piece is None else [buffer.at[own] for buffer in k_smem]
    kv_tile, kv_head, batch = lax.axis_index("kv"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    tile_key0 = kv_tile * block_kv

    def tile_ranges(key0):
        return q_tile_range(key0, keys, q_len, kv_len, block_q, rule.window, mask_everywhere=rule.mask_everywhere)

    # Pipeline steps run over the query heads h of the group, each over its query tiles: without tables the
    # union [cta_lo, cta_hi) of what the two consumers need (each skips the tiles it does not see); with
    # tables the head's row of the transposed tables (q_tables) for this KV tile, partial tiles first.
    # Step g of the CTA uses ring slot g % num_stages.
    if not has_tables:
        cta_lo, cta_hi = union_of_ranges([tile_ranges(tile_key0 + c * keys) for c in range(_CONSUMERS)])

    def head_walk(h):
        """(num_partial, steps, tile_of) for query head h of the group."""
        if has_tables:  # a table tile of table_split * block_q queries is table_split steps
            num_partial, steps, block_of = table_walk(tables, batch, kv_head * group + h, kv_tile)
            if table_split == 1:
                return num_partial, steps, block_of
            return table_split * num_partial, table_split * steps, lambda n: (
                block_of(lax.div(n, table_split)) * table_split + lax.rem(n, table_split))
        return None, cta_hi - cta_lo, lambda n: cta_lo + n

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232 if piece is None else CONSUMER_REGISTERS, action="increase")
        key0 = tile_key0 + wg * keys
        seed_parts = read_seed(seed)
        v_own = v_smem.at[wg]
        key_tile = (batch, pl.ds(key0, keys), kv_head)  # of dK / dV: per query batch when k / v have batch 1
        kv_tile = (batch if k_ref.shape[0] > 1 else 0, *key_tile[1:])
        if piece is None:
            plgpu.copy_gmem_to_smem(k_ref.at[kv_tile], k_smem.at[wg], k_ready.at[wg])
        else:
            for p, buffer in enumerate(k_smem):
                plgpu.copy_gmem_to_smem(k_ref.at[(*kv_tile, pl.ds(p * width, width))], buffer.at[wg], k_ready.at[wg])
        if split != "dv":  # dV alone needs no V (dP^T = V dO^T is dK's)
            plgpu.copy_gmem_to_smem(v_ref.at[kv_tile], v_own, v_ready.at[wg])
        if has_segments:  # the keys' segment ids arrive with K
            plgpu.copy_gmem_to_smem(segments[1].at[batch, pl.ds(key0, keys)], kv_segment_smem.at[wg], k_ready.at[wg])
        plgpu.barrier_wait(k_ready.at[wg])
        if split != "dv":
            plgpu.barrier_wait(v_ready.at[wg])
        # The index tiles' iotas (functions of the thread index only) were hoisted out of the step loops and held
        # in registers across them with hooks (spills, docs/perf-notes.md, Version 7m): each thread stores the
        # entries of its own layout once and loads them back per step, which no loop invariant code motion lifts
        # over the barriers of the step.
        for ref, size, layout in ((key_iota, keys, _KEY_VECTOR), (query_iota, part, _QUERY_VECTOR)):
            ref.at[wg][...] = plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=layout)

        def part_indices(own, shape, row0):
            """(q_idx, kv_idx) of a (keys, queries) part of S^T whose queries start at row0; `own` is the step's
            opaque copy of wg, so that the keys' offset is not hoisted either."""
            keys_of, queries_of = (plgpu.load(ref.at[own], layout=layout)
                                   for ref, layout in ((key_iota, _KEY_VECTOR), (query_iota, _QUERY_VECTOR)))
            kv_idx = tile_key0 + own * keys + lax.broadcast_in_dim(keys_of, shape, [0])
            return row0 + lax.broadcast_in_dim(queries_of, shape, [1]), kv_idx

        def transposed_scores(a_pieces, b_pieces):  # the sum of a (keys, D) @ b^T (D, queries) over the pieces
            def body(acc_ref):
                for a_smem, b_smem in zip(a_pieces, b_pieces, strict=True):
                    plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
                return acc_ref[...]

            return pl.run_scoped(body, plgpu.ACC((keys, b_pieces[0].shape[0]), jnp.float32))

        def step(g, t, carry, head, masked: bool, user_mask: bool):
            """Step g: query tile t of query head `head`, in parts of `part` queries; `key_sums`: dS^T summed
            over queries for a key bias's gradient (None without)."""
            dk, dv, key_sums = carry
            slot = lax.rem(g, num_stages)
            # The resident K / V tiles' wgmma descriptors, loop-invariant, were hoisted out of the step loops and
            # held in registers across them (spills, docs/perf-notes.md, Version 6): an opaque copy of wg keeps
            # them in the step.
            own = lax.optimization_barrier(wg)
            k_own, v_own = k_pieces(own), v_smem.at[own]
            plgpu.barrier_wait(q_ready.at[slot])
            for j in range(block_q // part):
                queries = pl.ds(j * part, part)
                q_part = [q_smem.at[slot, queries]] if piece is None else [ring.at[slot, queries] for ring in q_smem]
                do_part = do_smem.at[slot, queries]
                s_t = transposed_scores(k_own, q_part)  # S^T = K Q^T, keys x queries
                lse2 = plgpu.load(lse2_smem.at[slot, queries], layout=plgpu.Layout.WGMMA.reduce(0))

                def same_segments():  # read per step, as the index vectors are (not held across the loops)
                    key_segments = plgpu.load(kv_segment_smem.at[own], layout=_KEY_VECTOR)
                    query_segments = plgpu.load(q_segment_smem.at[slot, queries], layout=_QUERY_VECTOR)
                    return same_segment(key_segments, query_segments, s_t.shape)

                def indices():
                    return part_indices(own, s_t.shape, t * block_q + j * part)

                def dense():  # this consumer's keys of the part's mask tile
                    tile = plgpu.load(mask_rings[j].at[slot, pl.ds(wg * keys, keys)], layout=plgpu.Layout.WGMMA)
                    return tile != 0

                def bias_tile():  # this consumer's keys of the part's bias tile, or its vectors
                    if bias == "tiles":
                        tile = plgpu.load(bias_smem[j].at[slot, pl.ds(wg * keys, keys)], layout=plgpu.Layout.WGMMA)
                        return tile.astype(jnp.float32)
                    if bias == "keys":
                        vector = plgpu.load(bias_smem.at[slot, pl.ds(wg * keys, keys)], layout=_KEY_VECTOR)
                        return lax.broadcast_in_dim(vector, s_t.shape, [0])
                    vector = plgpu.load(bias_smem.at[slot, queries], layout=_QUERY_VECTOR)
                    return lax.broadcast_in_dim(vector, s_t.shape, [1])

                tiles = [  # the hooks' vectors as tiles: the part's queries, this consumer's keys
                    tile_of(buffer.at[slot, queries], _QUERY_VECTOR, s_t.shape, 1) if axis == "q" else
                    tile_of(buffer.at[slot, pl.ds(wg * keys, keys)], _KEY_VECTOR, s_t.shape, 0)
                    for (axis, _), buffer in zip(vectors, vector_smem)]
                s_t, s_scale, derivative = rule.scores(
                    s_t, indices, batch, head, kv_len, masked=masked, user_mask=user_mask,
                    score_arrays=views(score_groups, tiles[:num_score_vectors]),
                    mask_arrays=views(mask_groups, tiles[num_score_vectors:]), same_segment=same_segments,
                    dense=dense, with_derivative=True, bias=bias_tile,
                )
                # Rows >= q_lengths and rows with no key have lse2 = +inf, so p = 0 there (and dS = 0).
                p_t = jnp.exp2(s_t * s_scale - lax.broadcast_in_dim(lse2, s_t.shape, [1]))
                # dV before dP^T (FlashAttention-2's order): S^T and P^T's bf16 copy are dead before the dP^T
                # accumulator is live (S^T and dP^T live together spilled at head dim 128).
                if j == 0:  # dO / delta's wait: with hooks on 64-query steps its place changed no spill (Version 7y)
                    plgpu.barrier_wait(do_ready.at[slot])
                staging = None if p_smem is None else p_smem.at[wg]
                # Dropout: dV takes the kept P^T / (1 - rate); dP^T gets the same mask (hashed again below
                # rather than held across the dP^T matmul).
                if dv is not None:
                    p_bf16 = rule.dropped(p_t, indices, batch, head, seed_parts).astype(do_part.dtype)
                    dv = _accumulate_pv(dv, p_bf16, do_part, staging, not interpret, lambda: None)
                if dk is None:
                    if j == block_q // part - 1:
                        plgpu.barrier_arrive(do_free.at[slot])
                    continue
                if derivative is not None:  # the chain rule through score_mod, folded into P^T before dP^T is
                    p_t = p_t * derivative  # live: P^T and the derivative held beside dP^T spilled
                dp_t = transposed_scores([v_own], [do_part])  # dP^T = V dO^T
                delta = plgpu.load(delta_smem.at[slot, queries], layout=plgpu.Layout.WGMMA.reduce(0))
                if j == block_q // part - 1:
                    plgpu.barrier_arrive(do_free.at[slot])
                dp_t = rule.dropped(dp_t, indices, batch, head, seed_parts)
                ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))
                if key_sums is not None:
                    key_sums = key_sums + ds_t.sum(axis=1)
                dk = _accumulate_pv(dk, ds_t.astype(do_part.dtype), q_part[piece or 0], staging, not interpret,
                                    lambda: None)
            plgpu.barrier_arrive(q_free.at[slot])
            return dk, dv, key_sums

        def skip(g, t, carry, head):
            del t, head
            slot = lax.rem(g, num_stages)
            for barrier in (q_ready, do_ready):
                plgpu.barrier_wait(barrier.at[slot])
            plgpu.barrier_arrive(do_free.at[slot])
            plgpu.barrier_arrive(q_free.at[slot])
            return carry

        def visit(start, end, base, tile_of, body, carry, head):
            return lax.fori_loop(start, end, lambda n, c: body(base + n, tile_of(n), c, head), carry)

        if not has_tables:  # this consumer's query tiles, in steps of each head (the same for every head)
            own_lo, full_lo, full_hi, own_hi = (x - cta_lo for x in own_ranges(tile_ranges(key0), cta_lo))

        def head_body(h, carry_and_base):
            carry, base = carry_and_base
            head = kv_head * group + h
            num_partial, steps, tile_of = head_walk(h)
            if dbias_ref is not None:  # a key bias's gradient is per query head: summed afresh for each
                carry = (*carry[:2], plgpu.layout_cast(jnp.zeros((keys,), jnp.float32), _KEY_VECTOR))
            if has_tables:  # partial tiles: every mask; full tiles: the length mask only
                carry = visit(0, num_partial, base, tile_of, functools.partial(step, masked=True, user_mask=True),
                              carry, head)
                carry = visit(num_partial, steps, base, tile_of,
                              functools.partial(step, masked=True, user_mask=False), carry, head)
            else:
                for start, end, body in (
                    (0, own_lo, skip), (own_lo, full_lo, functools.partial(step, masked=True, user_mask=True)),
                    (full_lo, full_hi, functools.partial(step, masked=False, user_mask=False)),
                    (full_hi, own_hi, functools.partial(step, masked=True, user_mask=True)), (own_hi, steps, skip),
                ):
                    carry = visit(start, end, base, tile_of, body, carry, head)
            if dbias_ref is not None:  # this head's key sums, out by TMA once the previous head's have been read
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                dbias_smem.at[wg][...] = carry[2]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dbias_smem.at[wg], dbias_ref.at[batch, head, pl.ds(key0, keys)])
            return carry, base + steps

        zeros = [plgpu.layout_cast(jnp.zeros((keys, dim), jnp.float32), plgpu.Layout.WGMMA) if split != other
                 else None for dim, other in ((dk_columns, "dv"), (value_dim, "dk"))]
        key_sums = None if dbias_ref is None else plgpu.layout_cast(jnp.zeros((keys,), jnp.float32), _KEY_VECTOR)
        (dk, dv, _), _ = lax.fori_loop(0, group, head_body, ((*zeros, key_sums), jnp.int32(0)))
        # K and V are no longer read: their tiles carry dK and dV out.
        k_out = k_smem.at[wg] if piece is None else k_smem[piece].at[wg]
        if dk is not None:
            k_out[...] = (dk * rule.scale).astype(k_out.dtype)
        if dv is not None:
            v_own[...] = dv.astype(v_own.dtype)
        plgpu.commit_smem()
        if dk is not None:
            plgpu.copy_smem_to_gmem(k_out, dk_ref.at[key_tile])
        if dv is not None:
            plgpu.copy_smem_to_gmem(v_own, dv_ref.at[key_tile])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40 if piece is None else PRODUCER_REGISTERS, action="decrease")

        def head_loads(h, base):
            head = kv_head * group + h
            _, steps, tile_of = head_walk(h)

            @pl.loop(0, steps)
            def _(n):
                t = tile_of(n)
                row_tile = (batch, pl.ds(t * block_q, block_q), head)
                row_vector = (batch, head, pl.ds(t * block_q, block_q))
                if piece is None:
                    copies = [(q_ref.at[row_tile], q_smem, q_ready)]
                else:
                    copies = [(q_ref.at[(*row_tile, pl.ds(p * width, width))], ring, q_ready)
                              for p, ring in enumerate(q_smem)]
                copies += [
                    (lse2_ref.at[row_vector], lse2_smem, q_ready),
                    (do_ref.at[row_tile], do_smem, do_ready), (delta_ref.at[row_vector], delta_smem, do_ready),
                ]
                if has_segments:  # the rows' segment ids arrive with Q
                    copies.append((segments[0].at[batch, pl.ds(t * block_q, block_q)], q_segment_smem, q_ready))
                if has_mask:  # and the (keys, queries) tile of the transposed mask, a tile per part
                    index = (*mask_index(mask_ref, batch, head), pl.ds(tile_key0, block_kv))
                    copies += [(mask_ref.at[(*index, pl.ds(t * block_q + j * part, part))], ring, q_ready)
                               for j, ring in enumerate(mask_rings)]
                if bias == "tiles":  # and of the transposed bias, or the head's key / query bias vector
                    index = (*mask_index(bias_ref, batch, head), pl.ds(tile_key0, block_kv))
                    copies += [(bias_ref.at[(*index, pl.ds(t * block_q + j * part, part))], ring, q_ready)
                               for j, ring in enumerate(bias_smem)]
                elif bias:
                    span = pl.ds(tile_key0, block_kv) if bias == "keys" else pl.ds(t * block_q, block_q)
                    copies.append((bias_ref.at[(*mask_index(bias_ref, batch, head), span)], bias_smem, q_ready))
                for (axis, ref), buffer in zip(vectors, vector_smem):  # and the hooks' vectors of the head
                    span = pl.ds(t * block_q, block_q) if axis == "q" else pl.ds(tile_key0, block_kv)
                    copies.append((ref.at[(*mask_index(ref, batch, head), span)], buffer, q_ready))
                fill_ring_slot(base + n, num_stages, (q_free, do_free), copies)

            return base + steps

        drain_ring(lax.fori_loop(0, group, head_loads, jnp.int32(0)), num_stages, q_free, do_free)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "causal", "window", "block_q", "block_kv", "num_stages", "p_in_smem", "interpret",
                     "tables_block_q", "mask_fn", "score_fn", "score_jvp", "dropout_rate", "dropout_positions",
                     "dropout_heads", "bias_grad", "score_vectors", "mask_vectors", "split", "pieces"),
)
def mosaic_backward_dkv(
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
    block_q: int = DKV_TILES[0],
    block_kv: int = DKV_TILES[1],
    num_stages: int = 2,
    p_in_smem: bool = False,
    interpret: bool = False,
    d_lse: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | None = None,
    dropout_positions: tuple[int, int] | None = None,
    dropout_heads: int | None = None,
    q_tables: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None,
    tables_block_q: int | None = None,
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
    split: bool = False,
    pieces: int = 1,
) -> tuple[jax.Array, ...]:
    """dK and dV of `mosaic_forward` on Hopper through Pallas Mosaic GPU (FlashAttention-2, Alg. 2, split by
    KV tile, so no atomics; the GQA group sum happens in the kernel).

    **Arguments:** q, k, v, q_lengths, kv_lengths, scale, causal, window as in `mosaic_forward` (same padding
    contract, with d_out's padding rows finite too; v `[B, S, K, Dv]`, Dv in {64, 128}); `out` `[B, T, N, Dv]` and
    `lse` `[B, N, T]` (natural log, -inf for empty rows) from the forward pass; `d_out` `[B, T, N, Dv]`, the
    cotangent of `out`.

    - `block_kv`: keys per CTA, a multiple of 128 (each of the two consumer warpgroups owns half, resident in
      SMEM). `block_q`: query rows per pipeline step, a multiple of 64. `num_stages`: Q / dO slots in the ring.
    - `p_in_smem`: stage P^T and dS^T in shared memory for the P^T dO and dS^T Q matmuls instead of feeding
      them from registers (always on in interpret mode).
    - `d_lse` `[B, N, T]`: a cotangent of lse, if any.
    - `q_tables`: the transposed block tables (`BlockMask.q_tables`: counts `[B|1, H|1, nk]`, indices
      `[B|1, H|1, nk, nq]` of query blocks per KV block) of tiles `(tables_block_q, block_kv)`; each CTA walks
      the rows of its KV block for every query head of its group. `tables_block_q` (default block_q): a multiple
      of block_q dividing T; each table tile is then tables_block_q // block_q steps. `mask_fn`, `score_fn`,
      `score_jvp`, `mask_arrays`, `score_arrays`, `score_vectors`, `mask_vectors` (each vector in a ring beside
      Q), `q_segment_ids`, `kv_segment_ids`, `mask` (transposed here in
      XLA: the kernel reads (keys, queries) tiles), `bias` (tiles transposed in XLA too) and the dropout
      arguments as in `mosaic_backward_dq`. `bias_grad`: with a bias whose T is 1 (keys, or one value), also
      return its gradient's parts.
    - `split`: dV and dK from two programs (kernels `..._dv` and `..._dk`), each holding one accumulator and
      recomputing S^T (dV's skips dP^T and V): at head dim 256 the two 64 x 256 float32 accumulators of one
      program would take 256 registers per thread. `pieces`: with `split`, dK from that many programs, each
      computing `PIECE` (128) or 64 of its columns (q / k's head dim 256 needs 2, as in `mosaic_backward_dq`, or
      4: a score_mod's derivative beside 128 columns spilled). With
      GQA the dK programs run per query head on copies of k and v, their partial dK summed over the group in
      XLA (in k's dtype, then float32).

    **Returns:** `(dk, dv)`: `[B, S, K, D]` and `[B, S, K, Dv]` in k's dtype; zero for keys >= kv_lengths[b]. With
    k / v of batch 1 each query batch's part is written, then summed in float32 (batch 1 again). With `bias_grad`
    and a key bias, `(dk, dv, dS summed over queries)`, the last `[B, N, S]` float32.
    """
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    p_in_smem = p_in_smem or interpret
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    if max(head_dim, value_dim) > 128 and not split:
        raise ValueError(f"head dims {head_dim} / {value_dim}: above 128 the dK / dV kernel needs split=True (one "
                         "accumulator per program)")
    check_pieces(head_dim, pieces, "dK", narrowest=PIECE // 2)
    if pieces > 1 and not split:
        raise ValueError(f"pieces={pieces}: dK's pieces are programs of a split, and split=False")
    bias_kind, bias = check_bias(bias, batch, num_heads, q_len, kv_len)
    bias_grad = bias_grad and bias_kind == "keys"
    vectors = vectors_in(grouped(score_arrays, score_vectors) + grouped(mask_arrays, mask_vectors))
    counts = tuple(sum(axis == a for axis, _ in vectors) for a in ("q", "kv"))
    _check_dkv(q, k, v, out, lse, d_out, q_lengths, kv_lengths, scale, block_q, block_kv, num_stages, p_in_smem,
               q_segment_ids is not None, mask is not None, (bias_kind, 4 if bias is None else bias.itemsize),
               bias_grad, counts)
    segments = check_segments(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
    dropout, seed = dropout_options(dropout_rate, dropout_seed, dropout_positions, dropout_heads, num_heads)
    mask = check_dense_mask(mask, batch, num_heads, q_len, kv_len)
    mask_t = None if mask is None else jnp.swapaxes(mask, 2, 3)
    if bias_kind == "tiles":
        bias = jnp.swapaxes(bias, 2, 3)
    keys, part = block_kv // _CONSUMERS, min(block_q, PART)
    tables_block_q = tables_block_q or block_q
    if tables_block_q % block_q or q_len % tables_block_q:
        raise ValueError(f"{tables_block_q=} must be a multiple of {block_q=} dividing T={q_len}")
    tables, delta, lse2, transforms = _prologue(q, k, out, lse, d_out, d_lse, q_lengths, q_tables, tables_block_q,
                                                block_kv, "q_tables")

    def launch(program: str | None, piece: int | None = None, q=q, kv=(k, v)):
        """Both gradients, or one ("dk" / "dv") of a split, or dK's columns of `piece`, of the keys and values
        `kv` (k and v, or their copies per query head)."""
        k, v = kv
        key_sums = bias_grad and program != "dv" and not piece
        return _launch(
            _dkv_kernel, "probjax_mosaic_backward_dkv" + (f"_{program}" if program else "")
            + ("" if piece is None else f"_piece{piece}"),
            (q, k, v, d_out, lse2, delta, q_lengths, kv_lengths), tables, score_arrays, mask_arrays,
            interpret=interpret, block_q=block_q, block_kv=block_kv, num_stages=num_stages,
            rule=_backward_rule(scale, causal, window, mask_fn, score_fn, score_jvp, segments, dropout, mask,
                                bias is not None),
            segments=segments, seed=seed, mask=mask_t, bias=bias, bias_kind=bias_kind,
            bias_grad=key_sums, score_vectors=score_vectors, mask_vectors=mask_vectors, split=program, piece=piece,
            out_type=(
                *((jax.ShapeDtypeStruct((batch, *k.shape[1:3], head_dim // (1 if piece is None else pieces)), k.dtype),)
                  if program != "dv" else ()),
                *((jax.ShapeDtypeStruct((batch, *v.shape[1:]), v.dtype),) if program != "dk" else ()),
                *((jax.ShapeDtypeStruct((batch, num_heads, kv_len), jnp.float32),) if key_sums else ())),
            scratch_types=scratch_types(1 if piece is None else pieces),
            grid=(kv_len // block_kv, k.shape[2], batch), grid_names=("kv", "heads", "batch"),
            table_split=tables_block_q // block_q,
        )

    def in_pieces(shape: tuple, pieces: int, dtype):  # a buffer of `shape`, or its head dim as `pieces` pieces
        if pieces == 1:
            return plgpu.SMEM(shape, dtype, transforms=transforms)
        return (plgpu.SMEM((*shape[:-1], shape[-1] // pieces), dtype, transforms=transforms),) * pieces

    def scratch_types(pieces: int):
        return (
            (
                in_pieces((_CONSUMERS, keys, head_dim), pieces, k.dtype),
                plgpu.SMEM((_CONSUMERS, keys, value_dim), v.dtype, transforms=transforms),
                in_pieces((num_stages, block_q, head_dim), pieces, q.dtype),
                plgpu.SMEM((num_stages, block_q, value_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_q), jnp.float32),
                plgpu.SMEM((num_stages, block_q), jnp.float32),
                plgpu.SMEM((_CONSUMERS, keys, part), q.dtype, transforms=transforms) if p_in_smem else None,
                plgpu.SMEM((_CONSUMERS, keys), jnp.int32),
                plgpu.SMEM((_CONSUMERS, part), jnp.int32),
                plgpu.SMEM((_CONSUMERS, keys), jnp.int32) if segments else None,
                plgpu.SMEM((num_stages, block_q), jnp.int32) if segments else None,
                tuple(plgpu.SMEM((num_stages, block_kv, part), jnp.int8, transforms=mask_tiles(part))
                      for _ in range(block_q // part)) if mask is not None else None,
                bias_scratch(bias_kind, bias, (num_stages, block_kv, part), block_q // part,
                             keys=(num_stages, block_kv), rows=(num_stages, block_q)),
                plgpu.SMEM((_CONSUMERS, keys), jnp.float32) if bias_grad else None,
                tuple(plgpu.SMEM((num_stages, block_q if axis == "q" else block_kv), ref.dtype)
                      for axis, ref in vectors),
            ),
            # With K's pieces or segments, K's barrier also awaits them.
            (plgpu.Barrier(num_arrivals=pieces + bool(segments), num_barriers=_CONSUMERS),
             plgpu.Barrier(num_barriers=_CONSUMERS)),
            # Q's slot (its pieces) with its lse2 rows (and segment ids), dO's with its delta rows: a copy is an
            # arrival.
            (plgpu.Barrier(num_arrivals=1 + pieces + bool(segments) + (mask is not None) * (block_q // part)
                           + {"tiles": block_q // part, "keys": 1, "rows": 1}.get(bias_kind, 0) + len(vectors),
                           num_barriers=num_stages),
             plgpu.Barrier(num_arrivals=2, num_barriers=num_stages)),
            (
                plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
            ),
        )
    if split:
        (dv,) = launch("dv")
        # dK's programs take each query head of a GQA group on its own (k and v copied per query head, dK summed
        # over the group in XLA): beside the group's loop, the dK piece spilled 8 B on sm_90a.
        group = num_heads // num_kv_heads
        kv = (k, v) if group == 1 else tuple(jnp.repeat(x, group, axis=2) for x in (k, v))
        # In the interpreter one program at a time (`after`).
        dk, *key_sums = launch("dk", None if pieces == 1 else 0, after(q, dv, interpret), kv)
        for piece in range(1, pieces):  # dK's other columns (head dim 256)
            (columns,) = launch("dk", piece, after(q, dk, interpret), kv)
            dk = jnp.concatenate([dk, columns], axis=-1)
        if group > 1:
            dk = dk.reshape(*dk.shape[:2], num_kv_heads, group, head_dim).sum(3, dtype=jnp.float32).astype(k.dtype)
    else:
        dk, dv, *key_sums = launch(None)
    if k.shape[0] != batch:
        dk, dv = (g.sum(0, keepdims=True, dtype=jnp.float32).astype(g.dtype) for g in (dk, dv))
    return dk, dv, *key_sums
