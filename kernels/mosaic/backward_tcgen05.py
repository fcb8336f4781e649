"""Flash-attention backward for Blackwell (sm_100a) in Pallas Mosaic GPU: a dQ kernel and a dK / dV kernel
(FlashAttention-2, Alg. 2, split by query tile and by key tile, so no atomics), both with tcgen05 MMAs into
tensor memory, TMA and a producer warpgroup, the companions of `mosaic.forward_tcgen05`.

Both kernels keep the forward's orientation: a tensor-memory tile of S = Q K^T has 128 query rows (tcgen05's M,
one row per thread of the compute warpgroup under `Layout.TCGEN05`), so a row's lse and delta are scalars of its
thread. S and dP = dO V^T are read back in 64-column chunks, p = exp2(s * scale * log2(e) - lse2) and
dS = p * (dP - delta) computed there and written to shared memory as 16-bit tiles, which the next MMAs read:

- dQ (`tcgen05_backward_dq`): one CTA per (128 query rows, query head, batch), resident Q and dO; a producer
  streams K / V tiles of `block_kv` keys through a ring; per tile S and dP go to tensor memory, then
  dQ += dS K accumulates in a (128, D) float32 tensor-memory tile. On 64-key steps S and dP have two
  tensor-memory pairs: the next tile's are issued before this tile's are read, so the tensor core computes them
  while the warpgroup turns this tile into dS.
- dK / dV (`tcgen05_backward_dkv`): one CTA per (128 keys, KV head, batch), resident K and V; a producer streams
  Q, dO, lse2 and delta tiles of 128 rows over every query head of the GQA group (so the group's sum happens in
  the kernel); per tile dV += P^T dO and dK += dS^T Q, the transposed left operands read from shared memory,
  into (128, Dv) and (128, D) float32 tensor-memory tiles. S, dP, dK and dV take 256 + D + Dv of tensor memory's
  512 columns. At head dim 128 the Q / dO ring has one slot (two do not fit in shared memory beside P and dS).

`lse2` is the forward's lse in base 2, +inf for rows with no key and rows >= q_lengths[b] (the XLA preprocess,
`common._prologue`), so p = 0 there; `delta` = rowsum(dO * O) comes from XLA. Tiles visited and the
per-element mask (keys >= kv_lengths[b], the window / causal edge) as in the forward (`kv_tile_range`,
`q_tile_range`); the caller's padding contract is the forward's. The kernels take the forward's calls but a
bias: with a score_fn dS carries its derivative (`score_jvp`); dQ walks its query tile's row of a BlockMask's
kv tables, dK/dV its key tile's row of the q tables per query head; dropout's keep mask is hashed again per
chunk; what arrives beside Q and K (`tcgen05_inputs`) comes with Q and each K tile in dQ, with each Q tile in
dK/dV (segment ids of the keys with K). They run in the Mosaic GPU interpreter as they are compiled.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_kernels._tiles import q_tile_range
from probjax_kernels.mosaic.common import (
    SMEM_BYTES,
    ScoreRule,
    _backward_rule,
    _prologue,
    allocated_smem,
    check_layout,
    check_dense_mask,
    check_outputs,
    check_segments,
    drain_ring,
    dropout_options,
    fill_ring_slot,
    mask_index,
    read_seed,
    split_hook_refs,
)
from probjax_kernels.mosaic.forward_tcgen05 import (
    BLOCK_Q,
    HEAD_DIMS,
    fill_kv_ring,
    kv_walk,
    launch,
    range_walk,
    run_walk,
    table_walk,
    tile_indices,
    tile_scores,
    walk_steps,
)
from probjax_kernels.mosaic.hook_vectors import grouped, vectors_in
from probjax_kernels.mosaic import tcgen05_inputs as inputs

BLOCK_KV = 128  # keys per dK / dV CTA: tcgen05's M for dV += P^T dO and dK += dS^T Q
DQ_BLOCK_KV = 64  # keys per dQ step by default
CHUNK = 64  # columns of S / dP read from tensor memory at a time (registers), where the hooks are called
_ROW = plgpu.Layout.TCGEN05.reduce(1)  # a row's scalar in its thread
_TMEM_COLUMNS = 512  # 32-bit columns of tensor memory per SM


def dq_score_pairs(head_dim: int, block_kv: int, num_stages: int) -> int:
    """The dQ kernel's S / dP tensor-memory pairs: 2 where they fit in tensor memory's 512 columns beside dQ
    (64-key steps) and the ring has a slot for the next step's K / V while this one's are read, else 1."""
    return 2 if num_stages >= 2 and 4 * block_kv + head_dim <= _TMEM_COLUMNS else 1


def dq_smem_bytes(head_dim: int, value_dim: int, block_kv: int, num_stages: int, itemsize: int = 2,
                  segments: bool = False, vectors: tuple[int, int] = (0, 0), dense_mask: bool = False) -> int:
    """Shared memory of one dQ CTA: Q (which carries dQ out) and dO, the lse2 / delta rows, the K / V ring and
    the dS tile, with `segments` the rows' segment ids and a ring of the keys', the hooks' vectors (`vectors`:
    how many along queries, along keys: the rows' values, a ring beside K), with `dense_mask` a ring of int8
    mask tiles beside K, with the barriers (the rows', the ring's three, S's and dP's per pair, dQ's)."""
    buffers = [itemsize * BLOCK_Q * head_dim, itemsize * BLOCK_Q * value_dim, 4 * BLOCK_Q, 4 * BLOCK_Q,
               itemsize * num_stages * block_kv * head_dim, itemsize * num_stages * block_kv * value_dim,
               itemsize * BLOCK_Q * block_kv, *inputs.segment_smem_bytes(BLOCK_Q, num_stages * block_kv, segments),
               *[4 * BLOCK_Q] * vectors[0], *[4 * num_stages * block_kv] * vectors[1],
               num_stages * BLOCK_Q * block_kv if dense_mask else 0]
    pairs = dq_score_pairs(head_dim, block_kv, num_stages)
    return allocated_smem(buffers, barriers=1 + 3 * num_stages + 2 * pairs + 1)


def dkv_smem_bytes(head_dim: int, value_dim: int, num_stages: int, itemsize: int = 2, segments: bool = False,
                   vectors: tuple[int, int] = (0, 0), dense_mask: bool = False) -> int:
    """Shared memory of one dK / dV CTA: K and V (which carry dK and dV out), the Q / dO / lse2 / delta ring,
    the P and dS tiles, with `segments` a ring of the rows' segment ids and the keys' ids, the hooks' vectors
    in the ring (`vectors`: how many along queries, along keys; a query head's key vectors change with it),
    with `dense_mask` the mask's int8 tiles in the ring too, with the barriers."""
    buffers = [itemsize * BLOCK_KV * head_dim, itemsize * BLOCK_KV * value_dim,
               itemsize * num_stages * BLOCK_Q * head_dim, itemsize * num_stages * BLOCK_Q * value_dim,
               4 * num_stages * BLOCK_Q, 4 * num_stages * BLOCK_Q, 2 * itemsize * BLOCK_Q * BLOCK_KV,
               *inputs.segment_smem_bytes(num_stages * BLOCK_Q, BLOCK_KV, segments),
               *[4 * num_stages * BLOCK_Q] * vectors[0], *[4 * num_stages * BLOCK_KV] * vectors[1],
               num_stages * BLOCK_Q * BLOCK_KV if dense_mask else 0]
    return allocated_smem(buffers, barriers=1 + 3 * num_stages + 3)  # K / V's, the ring's three, S's, dP's, dK/dV's


def dkv_stages(head_dim: int, value_dim: int, itemsize: int = 2, segments: bool = False,
               vectors: tuple[int, int] = (0, 0), dense_mask: bool = False) -> int:
    """The Q / dO ring's slots of the dK / dV kernel: two where they fit in shared memory, else one."""
    fits = dkv_smem_bytes(head_dim, value_dim, 2, itemsize, segments, vectors, dense_mask) <= SMEM_BYTES
    return 2 if fits else 1


def _scores_to_ds(s_tmem, dp_tmem, lse2, delta, rule: ScoreRule, row0, key0, kv_len, masked: bool, user_mask: bool,
                  p_smem, ds_smem, batch, head, hook_arrays: Callable, seed_parts: tuple, segments: tuple | None,
                  mask_parts: tuple = ()):
    """P (with `p_smem`) and dS of a (128, keys) tile into 16-bit shared-memory tiles, from S and dP in tensor
    memory, `CHUNK` columns at a time; rows are queries from row0, columns keys from key0, of query head `head`.
    `hook_arrays(columns)`: the hooks' (score_arrays, mask_arrays) for a chunk's columns of the tile;
    `segments`: the rows' segment ids (`load_segments`) and the shared-memory ref of the tile's keys' ids;
    `mask_parts`: a dense mask's int8 (128, `CHUNK`) tiles in shared memory, one per chunk.
    With a score_fn, dS carries its derivative (the caller's factor `scale` completes the chain rule); with
    dropout, dS = P (Z dP / (1 - rate) - delta) and the P for dV is Z P / (1 - rate) (Z the keep mask)."""
    for c in range(0, s_tmem.shape[1], CHUNK):
        columns = pl.ds(c, CHUNK)
        s = plgpu.async_load_tmem(s_tmem.at[:, columns], layout=plgpu.Layout.TCGEN05)
        dp = plgpu.async_load_tmem(dp_tmem.at[:, columns], layout=plgpu.Layout.TCGEN05)
        plgpu.wait_load_tmem()
        chunk_segments = None
        if segments is not None:
            chunk_segments = (segments[0], inputs.load_segments(segments[1].at[columns], 1))
        s, s_scale, derivative = tile_scores(s, rule, row0, key0 + c, kv_len, batch, head, masked=masked,
                                             user_mask=user_mask, hook_arrays=hook_arrays(columns),
                                             with_derivative=True, segments=chunk_segments,
                                             dense=(lambda c=c: inputs.load_mask(mask_parts[c // CHUNK])) if mask_parts
                                             else None)
        p = jnp.exp2(s * s_scale - lax.broadcast_in_dim(lse2, s.shape, [0]))
        keep = None
        if rule.dropout_rate:  # hashed once for dP and P^T
            keep = rule.kept(lambda: tile_indices(s.shape, row0, key0 + c), batch, head, seed_parts)
            dp = jnp.where(keep, dp * rule.kept_scale, 0.0)
        if p_smem is not None:
            kept = p if keep is None else jnp.where(keep, p * rule.kept_scale, 0.0)
            p_smem[:, columns] = kept.astype(p_smem.dtype)
        ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
        if derivative is not None:  # the chain rule through score_fn
            ds = ds * derivative
        ds_smem[:, columns] = ds.astype(ds_smem.dtype)
    plgpu.commit_smem()


def _store_accumulator(acc_tmem, smem, factor: float, visited) -> None:
    """factor * the float32 accumulator into `smem` (its dtype), 64 columns at a time; zeros where no step ran
    (`visited` false: the tensor memory was never written)."""
    rows = plgpu.broadcasted_iota(jnp.int32, smem.shape[:1], 0, layout=_ROW)
    visited = jnp.full_like(rows, visited.astype(jnp.int32)) != 0  # a row vector: no implicit broadcast
    for c in range(0, smem.shape[1], CHUNK):
        columns = pl.ds(c, CHUNK)
        acc = plgpu.async_load_tmem(acc_tmem.at[:, columns], layout=plgpu.Layout.TCGEN05)
        smem[:, columns] = jnp.where(lax.broadcast_in_dim(visited, acc.shape, [0]), acc * factor,
                                     0.0).astype(smem.dtype)
    plgpu.wait_load_tmem()
    plgpu.commit_smem()


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_len_ref, kv_len_ref, *refs, rule: ScoreRule,
               block_kv: int, num_stages: int, group: int, num_score_arrays: int, num_mask_arrays: int,
               has_tables: bool, has_dropout: bool, has_segments: bool, score_vectors: tuple = (),
               mask_vectors: tuple = (), has_mask: bool = False):
    tables, score_arrays, mask_arrays, segments, seed, mask_ref, (dq_ref, smem, tmem, barriers) = split_hook_refs(
        refs, has_tables, num_score_arrays, num_mask_arrays, has_segments, has_dropout, has_mask)
    groups = (grouped(score_arrays, score_vectors), grouped(mask_arrays, mask_vectors))
    vectors = vectors_in(groups[0] + groups[1])
    (q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, ds_smem, q_segment_smem, kv_segment_smem,
     vector_smem, mask_rings) = smem
    s_tmem, dp_tmem, dq_tmem = tmem
    rows_ready, k_ready, v_ready, kv_free, s_done, dp_done, dq_done = barriers
    q_tile, head, batch = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    if rule.causal_only:  # heaviest tiles first
        q_tile = q_ref.shape[1] // BLOCK_Q - 1 - q_tile
    wg = lax.axis_index("wg")
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    row0 = q_tile * BLOCK_Q
    walk = kv_walk(rule, tables, batch, head, q_tile, q_len, kv_len, block_kv)
    steps = walk_steps(walk)

    @pl.when(wg == 0)
    def _compute():
        seed_parts = read_seed(seed)
        row_tile, row_vector = (batch, pl.ds(row0, BLOCK_Q), head), (batch, head, pl.ds(row0, BLOCK_Q))
        copies = [(q_ref.at[row_tile], q_smem), (do_ref.at[row_tile], do_smem),
                  (lse2_ref.at[row_vector], lse2_smem), (delta_ref.at[row_vector], delta_smem)]
        if has_segments:
            copies.append((segments[0].at[batch, pl.ds(row0, BLOCK_Q)], q_segment_smem))
        copies += [(inputs.vector_source(ref, batch, head, row0, BLOCK_Q), buffer)  # the hooks' vectors along queries
                   for (axis, ref), buffer in zip(vectors, vector_smem) if axis == "q"]
        for src, dst in copies:
            plgpu.copy_gmem_to_smem(src, dst, rows_ready)
        plgpu.barrier_wait(rows_ready)
        lse2 = plgpu.load(lse2_smem, layout=_ROW)
        delta = plgpu.load(delta_smem, layout=_ROW)
        q_segments = inputs.load_segments(q_segment_smem, 0) if has_segments else None

        pairs = s_tmem.shape[0]  # S / dP tensor-memory pairs: with 2, step n + 1's run during step n's work

        def issue_scores(n):
            """S(n) = Q K(n)^T and dP(n) = dO V(n)^T into pair n % pairs, once K(n) and V(n) have landed."""
            slot, pair = lax.rem(n, num_stages), lax.rem(n, pairs)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.tcgen05_mma(s_tmem.at[pair], q_smem, k_smem.at[slot].transpose((1, 0)), s_done.at[pair],
                              accumulate=False)
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.tcgen05_mma(dp_tmem.at[pair], do_smem, v_smem.at[slot].transpose((1, 0)), dp_done.at[pair],
                              accumulate=False)

        if pairs == 2:
            @pl.when(steps > 0)
            def _():
                issue_scores(0)

        def step(n, block, _, masked: bool, user_mask: bool):
            slot, pair = lax.rem(n, num_stages), lax.rem(n, pairs)
            if pairs == 1:
                issue_scores(n)
            else:  # the other pair was read in step n - 1: the next step's S and dP go there now

                @pl.when(n + 1 < steps)
                def _():
                    issue_scores(n + 1)

            plgpu.barrier_wait(s_done.at[pair])
            plgpu.barrier_wait(dp_done.at[pair])

            @pl.when(n > 0)
            def _():  # the previous dS K has read the dS tile
                plgpu.barrier_wait(dq_done)

            tile_segments = (q_segments, kv_segment_smem.at[slot]) if has_segments else None
            hook_arrays = inputs.chunk_views(groups, vectors, vector_smem, (BLOCK_Q, CHUNK), slot)
            _scores_to_ds(s_tmem.at[pair], dp_tmem.at[pair], lse2, delta, rule, row0, block * block_kv, kv_len,
                          masked, user_mask, None, ds_smem, batch, head, hook_arrays, seed_parts, tile_segments,
                          tuple(ring.at[slot] for ring in mask_rings))
            plgpu.tcgen05_mma(dq_tmem, ds_smem, k_smem.at[slot], dq_done, accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(kv_free.at[slot])  # the slot is free once these MMAs complete

        run_walk(walk, step, None)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(dq_done)  # the last dS K

        _store_accumulator(dq_tmem, q_smem, rule.scale, steps > 0)  # Q is no longer read: its tile carries dQ out
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[row_tile])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        fill_kv_ring(k_ref, v_ref, (k_smem, v_smem), (k_ready, v_ready, kv_free), batch=batch,
                     kv_head=lax.div(head, jnp.int32(group)), walk=walk, block_kv=block_kv, num_stages=num_stages,
                     beside_k=inputs.key_sources(batch, head, pl.ds(row0, BLOCK_Q), (segments, kv_segment_smem),
                                                 (vectors, vector_smem), (mask_ref, mask_rings)))


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_len_ref, kv_len_ref, *refs, rule: ScoreRule,
                num_stages: int, group: int, num_score_arrays: int, num_mask_arrays: int, has_tables: bool,
                has_dropout: bool, has_segments: bool, score_vectors: tuple = (), mask_vectors: tuple = (),
                has_mask: bool = False):
    tables, score_arrays, mask_arrays, segments, seed, mask_ref, (dk_ref, dv_ref, smem, tmem, barriers) = (
        split_hook_refs(refs, has_tables, num_score_arrays, num_mask_arrays, has_segments, has_dropout, has_mask))
    groups = (grouped(score_arrays, score_vectors), grouped(mask_arrays, mask_vectors))
    vectors = vectors_in(groups[0] + groups[1])
    (k_smem, v_smem, q_smem, do_smem, lse2_smem, delta_smem, p_smem, ds_smem, q_segment_smem, kv_segment_smem,
     vector_smem, mask_rings) = smem
    s_tmem, dp_tmem, dk_tmem, dv_tmem = tmem
    kv_ready, q_ready, do_ready, rows_free, s_done, dp_done, kv_done = barriers
    kv_tile, kv_head, batch = lax.axis_index("kv"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    key0 = kv_tile * BLOCK_KV
    # The query tiles that see this CTA's keys: without tables the same for every query head of the group.
    shared = None if has_tables else range_walk(*q_tile_range(key0, BLOCK_KV, q_len, kv_len, BLOCK_Q, rule.window,
                                                              mask_everywhere=rule.mask_everywhere))

    def over_heads(visit: Callable):
        """`visit(walk, head, base)` for each query head of the group in order (its walk; base: the pipeline steps
        of the heads before it, so that a step's ring slot is its number in the CTA modulo the stages); returns
        the CTA's steps."""
        def body(h, base):
            head = kv_head * group + h
            walk = table_walk(tables, batch, head, kv_tile) if has_tables else shared
            visit(walk, head, base)
            return base + walk_steps(walk)

        return lax.fori_loop(0, group, body, jnp.int32(0))

    @pl.when(wg == 0)
    def _compute():
        seed_parts = read_seed(seed)
        key_tile = (batch, pl.ds(key0, BLOCK_KV), kv_head)  # of dK / dV: per query batch when k / v have batch 1
        kv_source = (batch if k_ref.shape[0] > 1 else 0, *key_tile[1:])
        plgpu.copy_gmem_to_smem(k_ref.at[kv_source], k_smem, kv_ready)
        plgpu.copy_gmem_to_smem(v_ref.at[kv_source], v_smem, kv_ready)
        if has_segments:  # the keys' segment ids arrive with K and V, each query tile's with its Q
            plgpu.copy_gmem_to_smem(segments[1].at[batch, pl.ds(key0, BLOCK_KV)], kv_segment_smem, kv_ready)
        plgpu.barrier_wait(kv_ready)

        def step(n, t, carry, masked: bool, user_mask: bool, head):
            """Query tile t of query head `head` at pipeline step n."""
            slot = lax.rem(n, num_stages)
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.tcgen05_mma(s_tmem, q_smem.at[slot], k_smem.transpose((1, 0)), s_done, accumulate=False)
            plgpu.barrier_wait(do_ready.at[slot])
            plgpu.tcgen05_mma(dp_tmem, do_smem.at[slot], v_smem.transpose((1, 0)), dp_done, accumulate=False)
            lse2 = plgpu.load(lse2_smem.at[slot], layout=_ROW)
            delta = plgpu.load(delta_smem.at[slot], layout=_ROW)
            tile_segments = None
            if has_segments:
                tile_segments = (inputs.load_segments(q_segment_smem.at[slot], 0), kv_segment_smem)
            plgpu.barrier_wait(s_done)
            plgpu.barrier_wait(dp_done)

            @pl.when(n > 0)
            def _():  # the previous step's P^T dO and dS^T Q have read the P and dS tiles
                plgpu.barrier_wait(kv_done)
            # every vector in the ring: the step's query head's
            hook_arrays = inputs.chunk_views(groups, vectors, vector_smem, (BLOCK_Q, CHUNK), slot)
            _scores_to_ds(s_tmem, dp_tmem, lse2, delta, rule, t * BLOCK_Q, key0, kv_len, masked, user_mask, p_smem,
                          ds_smem, batch, head, hook_arrays, seed_parts, tile_segments,
                          tuple(ring.at[slot] for ring in mask_rings))
            plgpu.tcgen05_mma(dv_tmem, p_smem.transpose((1, 0)), do_smem.at[slot], accumulate=n > 0)
            plgpu.tcgen05_mma(dk_tmem, ds_smem.transpose((1, 0)), q_smem.at[slot], kv_done, accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(rows_free.at[slot])  # the slot is free once these MMAs complete
            return carry

        steps = over_heads(lambda walk, head, base: run_walk(walk, functools.partial(step, head=head), None, base))

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(kv_done)  # the last MMAs

        # K and V are no longer read: their tiles carry dK and dV out.
        _store_accumulator(dk_tmem, k_smem, rule.scale, steps > 0)
        _store_accumulator(dv_tmem, v_smem, 1.0, steps > 0)
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[key_tile])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[key_tile])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        def load(n, t, carry, head, **_):
            rows = pl.ds(t * BLOCK_Q, BLOCK_Q)
            row_tile, row_vector = (batch, rows, head), (batch, head, rows)
            copies = [
                (q_ref.at[row_tile], q_smem, q_ready), (lse2_ref.at[row_vector], lse2_smem, q_ready),
                (do_ref.at[row_tile], do_smem, do_ready), (delta_ref.at[row_vector], delta_smem, do_ready),
            ]
            if has_segments:
                copies.append((segments[0].at[batch, rows], q_segment_smem, q_ready))
            spans = {"q": (t * BLOCK_Q, BLOCK_Q), "kv": (key0, BLOCK_KV)}  # the hooks' vectors of (head, t)
            copies += [(inputs.vector_source(ref, batch, head, *spans[axis]), buffer, q_ready)
                       for (axis, ref), buffer in zip(vectors, vector_smem)]
            for part, ring in enumerate(mask_rings):  # the mask's tile of (head, t), in CHUNK-column parts
                columns = pl.ds(key0 + part * CHUNK, CHUNK)
                copies.append((mask_ref.at[(*mask_index(mask_ref, batch, head), rows, columns)], ring, q_ready))
            fill_ring_slot(n, num_stages, (rows_free,), copies)
            return carry

        steps = over_heads(lambda walk, head, base: run_walk(walk, functools.partial(load, head=head), None, base))
        drain_ring(steps, num_stages, rows_free)


def _check(q, k, v, out, lse, d_out, q_lengths, kv_lengths, scale: float, block_kv: int, num_stages: int,
           smem_need: int, kernel: str):
    if block_kv not in (64, 128):
        raise ValueError(f"block_kv must be 64 or 128 (a tensor-memory tile of S), got {block_kv}")
    check_layout(q, k, v, q_lengths, kv_lengths, scale, block_q=BLOCK_Q, q_multiple=BLOCK_Q, block_kv=block_kv,
                 kv_multiple=64, num_stages=num_stages, min_stages=1, head_dims=HEAD_DIMS, smem_need=smem_need,
                 kernel=kernel)
    if d_out.dtype != q.dtype:
        raise ValueError(f"d_out must have q's dtype {q.dtype}, got {d_out.dtype}")
    check_outputs(q, v, out, lse, d_out)


_STATIC = ("scale", "causal", "window", "block_kv", "num_stages", "interpret", "score_fn", "score_jvp", "mask_fn",
           "dropout_rate", "dropout_positions", "dropout_heads", "score_vectors", "mask_vectors")


def _backward_options(scale: float, causal: bool, window, score_fn, score_jvp, mask_fn, num_heads: int,
                      dropout_rate: float, dropout_seed, dropout_positions, dropout_heads, segments, mask) -> tuple:
    """(the backward kernels' ScoreRule, the dropout seed's inputs: () without dropout), checked; `segments`:
    `check_segments`' ids or None; `mask`: `check_dense_mask`'s or None."""
    dropout, seed = dropout_options(dropout_rate, dropout_seed, dropout_positions, dropout_heads, num_heads)
    return _backward_rule(scale, causal, window, mask_fn, score_fn, score_jvp, segments, dropout, mask), seed

_TENSOR_CORE = dict(orders_tensor_core=True)


@functools.partial(jax.jit, static_argnames=_STATIC)
def tcgen05_backward_dq(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, d_out: jax.Array,
                        q_lengths: jax.Array, kv_lengths: jax.Array, *, scale: float, causal: bool,
                        window: tuple[int | None, int | None] = (None, None), block_kv: int = DQ_BLOCK_KV,
                        num_stages: int = 2, interpret: bool = False, d_lse: jax.Array | None = None,
                        score_fn: Callable | None = None, score_jvp: Callable | None = None,
                        mask_fn: Callable | None = None, score_arrays: tuple = (), mask_arrays: tuple = (),
                        kv_tables: tuple | None = None, dropout_rate: float = 0.0, dropout_seed=None,
                        dropout_positions: tuple[int, int] | None = None, dropout_heads: int | None = None,
                        q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                        score_vectors: tuple = (), mask_vectors: tuple = (),
                        mask: jax.Array | None = None) -> jax.Array:
    """dQ of `tcgen05_forward` on Blackwell (sm_100a) through Pallas Mosaic GPU's tcgen05 MMAs.

    **Arguments:** q, k, v, q_lengths, kv_lengths, scale, causal, window and the padding contract as in
    `tcgen05_forward`; `out` `[B, T, N, Dv]` and `lse` `[B, N, T]` (natural log, -inf for rows without a key)
    from it; `d_out` `[B, T, N, Dv]` in q's dtype, the cotangent of out; `d_lse` `[B, N, T]`: a cotangent of
    lse, if any. `block_kv`: keys per step, 64 or 128 (S is divisible by it); `num_stages`: K / V ring slots
    (>= 1). `interpret`: run in the Mosaic GPU CPU interpreter. `score_fn`, `mask_fn`, `score_arrays`,
    `mask_arrays`, `score_vectors`, `mask_vectors`: the forward's hooks and their arrays (`tcgen05_forward`),
    called on (128, `CHUNK`) parts of S; with a score_fn, `score_jvp` (score_fn's arguments; returns its value
    and d score_fn / d score).
    `kv_tables`: a BlockMask's tables on this kernel's (128, block_kv) tiles (`tcgen05_forward`'s). `dropout_*`:
    the forward's dropout (its keep mask hashed again here). `q_segment_ids` `[B, T]`, `kv_segment_ids` `[B, S]`,
    `mask` `[B|1, N|1, T, S]`: the forward's segment ids and dense mask.

    **Returns:** dQ `[B, T, N, D]` in q's dtype; zero in rows >= q_lengths[b] and rows without a key.
    """
    q_lengths, kv_lengths = jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    counts = inputs.vector_counts(score_vectors, mask_vectors)
    _check(q, k, v, out, lse, d_out, q_lengths, kv_lengths, scale, block_kv, num_stages,
           dq_smem_bytes(head_dim, value_dim, block_kv, num_stages, q.dtype.itemsize, q_segment_ids is not None,
                         counts, mask is not None),
           "the Mosaic GPU dQ kernel for Blackwell")
    batch, q_len, num_heads, _ = q.shape
    kv_len = k.shape[1]
    segments = check_segments(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
    mask = check_dense_mask(mask, batch, num_heads, q_len, kv_len)
    tables, delta, lse2, transforms = _prologue(q, k, out, lse, d_out, d_lse, q_lengths, kv_tables, BLOCK_Q,
                                                block_kv, "kv_tables")
    num_stages = min(num_stages, kv_len // block_kv)
    pairs = dq_score_pairs(head_dim, block_kv, num_stages)
    rule, seed = _backward_options(scale, causal, window, score_fn, score_jvp, mask_fn, num_heads, dropout_rate,
                                   dropout_seed, dropout_positions, dropout_heads, segments, mask)
    kernel = functools.partial(_dq_kernel, rule=rule, block_kv=block_kv, num_stages=num_stages,
                               group=num_heads // k.shape[2], num_score_arrays=len(score_arrays),
                               num_mask_arrays=len(mask_arrays), has_tables=tables is not None,
                               has_dropout=bool(seed), has_segments=segments is not None,
                               score_vectors=score_vectors, mask_vectors=mask_vectors, has_mask=mask is not None)
    vectors = vectors_in(grouped(score_arrays, score_vectors) + grouped(mask_arrays, mask_vectors))
    mask_rings = inputs.mask_rings(mask, num_stages, BLOCK_Q, block_kv, CHUNK)
    return launch(
        kernel, "probjax_mosaic_backward_dq_tcgen05",
        (q, k, v, d_out, lse2, delta, q_lengths, kv_lengths, *(tables or ()), *score_arrays, *mask_arrays,
         *(segments or ()), *seed, *(() if mask is None else (mask,))),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=(
            (
                plgpu.SMEM((BLOCK_Q, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q, value_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q,), jnp.float32),
                plgpu.SMEM((BLOCK_Q,), jnp.float32),
                plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, value_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q, block_kv), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q,), jnp.int32) if segments else None,
                plgpu.SMEM((num_stages, block_kv), jnp.int32) if segments else None,
                inputs.vector_scratch(vectors, "q", BLOCK_Q, block_kv, num_stages),
                mask_rings,
            ),
            (
                plgpu.TMEM((pairs, BLOCK_Q, block_kv), jnp.float32),
                plgpu.TMEM((pairs, BLOCK_Q, block_kv), jnp.float32),
                plgpu.TMEM((BLOCK_Q, head_dim), jnp.float32),
            ),
            (
                # Q, dO, lse2, delta (and the rows' segment ids and hook vectors)
                plgpu.Barrier(num_arrivals=4 + bool(segments) + counts[0]),
                # K (and its keys' segment ids, hook vectors and mask parts)
                plgpu.Barrier(num_arrivals=1 + bool(segments) + counts[1] + len(mask_rings), num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages, **_TENSOR_CORE),
                plgpu.Barrier(num_barriers=pairs, **_TENSOR_CORE),
                plgpu.Barrier(num_barriers=pairs, **_TENSOR_CORE),
                plgpu.Barrier(**_TENSOR_CORE),
            ),
        ),
        grid=(q_len // BLOCK_Q, num_heads, batch),
        grid_names=("q", "heads", "batch"),
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def tcgen05_backward_dkv(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
                         d_out: jax.Array, q_lengths: jax.Array, kv_lengths: jax.Array, *, scale: float,
                         causal: bool, window: tuple[int | None, int | None] = (None, None),
                         block_kv: int = BLOCK_KV, num_stages: int | None = None, interpret: bool = False,
                         d_lse: jax.Array | None = None, score_fn: Callable | None = None,
                         score_jvp: Callable | None = None, mask_fn: Callable | None = None, score_arrays: tuple = (),
                         mask_arrays: tuple = (), q_tables: tuple | None = None, dropout_rate: float = 0.0,
                         dropout_seed=None, dropout_positions: tuple[int, int] | None = None,
                         dropout_heads: int | None = None, q_segment_ids: jax.Array | None = None,
                         kv_segment_ids: jax.Array | None = None, score_vectors: tuple = (),
                         mask_vectors: tuple = (), mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """dK and dV of `tcgen05_forward` on Blackwell (sm_100a) through Pallas Mosaic GPU's tcgen05 MMAs.

    **Arguments:** as `tcgen05_backward_dq`, except: S a multiple of 128 (`block_kv`: 128 keys per CTA, the only
    value); `num_stages`: Q / dO ring slots, default `dkv_stages` (2 at head dims 64, 1 where two do not fit).
    `q_tables` instead of kv_tables: a BlockMask's transposed tables (rows: key tiles; columns: query tiles) on
    (128, 128) tiles: a key tile visits, per query head, its partial query tiles then its full ones.

    **Returns:** `(dK, dV)`, `[B, S, K, D]` and `[B, S, K, Dv]` in k's dtype (batch 1 when k / v have it: the
    query batches' parts summed); summed over each KV head's query heads, zero for keys >= kv_lengths[b] and
    keys no query attends.
    """
    q_lengths, kv_lengths = jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    if block_kv != BLOCK_KV:
        raise ValueError(f"block_kv must be {BLOCK_KV} (tcgen05's M: the keys of a dK / dV tile), got {block_kv}")
    has_segments, counts = q_segment_ids is not None, inputs.vector_counts(score_vectors, mask_vectors)
    if num_stages is None:
        num_stages = dkv_stages(head_dim, value_dim, q.dtype.itemsize, has_segments, counts, mask is not None)
    _check(q, k, v, out, lse, d_out, q_lengths, kv_lengths, scale, block_kv, num_stages,
           dkv_smem_bytes(head_dim, value_dim, num_stages, q.dtype.itemsize, has_segments, counts, mask is not None),
           "the Mosaic GPU dK / dV kernel for Blackwell")
    batch, q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    segments = check_segments(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
    mask = check_dense_mask(mask, batch, num_heads, q_len, kv_len)
    tables, delta, lse2, transforms = _prologue(q, k, out, lse, d_out, d_lse, q_lengths, q_tables, BLOCK_Q,
                                                block_kv, "q_tables")
    rule, seed = _backward_options(scale, causal, window, score_fn, score_jvp, mask_fn, num_heads, dropout_rate,
                                   dropout_seed, dropout_positions, dropout_heads, segments, mask)
    kernel = functools.partial(_dkv_kernel, rule=rule, num_stages=num_stages, group=num_heads // num_kv_heads,
                               num_score_arrays=len(score_arrays), num_mask_arrays=len(mask_arrays),
                               has_tables=tables is not None, has_dropout=bool(seed),
                               has_segments=segments is not None, score_vectors=score_vectors,
                               mask_vectors=mask_vectors, has_mask=mask is not None)
    vectors = vectors_in(grouped(score_arrays, score_vectors) + grouped(mask_arrays, mask_vectors))
    mask_rings = inputs.mask_rings(mask, num_stages, BLOCK_Q, BLOCK_KV, CHUNK)
    dk, dv = launch(
        kernel, "probjax_mosaic_backward_dkv_tcgen05",
        (q, k, v, d_out, lse2, delta, q_lengths, kv_lengths, *(tables or ()), *score_arrays, *mask_arrays,
         *(segments or ()), *seed, *(() if mask is None else (mask,))),
        out_type=(jax.ShapeDtypeStruct((batch, *k.shape[1:]), k.dtype),
                  jax.ShapeDtypeStruct((batch, *v.shape[1:]), v.dtype)),
        scratch_types=(
            (
                plgpu.SMEM((BLOCK_KV, head_dim), k.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_KV, value_dim), v.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, BLOCK_Q, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, BLOCK_Q, value_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, BLOCK_Q), jnp.float32),
                plgpu.SMEM((num_stages, BLOCK_Q), jnp.float32),
                plgpu.SMEM((BLOCK_Q, BLOCK_KV), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q, BLOCK_KV), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, BLOCK_Q), jnp.int32) if segments else None,
                plgpu.SMEM((BLOCK_KV,), jnp.int32) if segments else None,
                inputs.vector_scratch(vectors, None, BLOCK_Q, BLOCK_KV, num_stages),
                mask_rings,
            ),
            (
                plgpu.TMEM((BLOCK_Q, BLOCK_KV), jnp.float32),
                plgpu.TMEM((BLOCK_Q, BLOCK_KV), jnp.float32),
                plgpu.TMEM((BLOCK_KV, head_dim), jnp.float32),
                plgpu.TMEM((BLOCK_KV, value_dim), jnp.float32),
            ),
            (
                plgpu.Barrier(num_arrivals=2 + bool(segments)),  # K and V (and the keys' segment ids)
                # a slot's Q, lse2 (and its segment ids, the hook vectors of its query head, its mask parts)
                plgpu.Barrier(num_arrivals=2 + bool(segments) + sum(counts) + len(mask_rings),
                              num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),  # its dO and delta
                plgpu.Barrier(num_barriers=num_stages, **_TENSOR_CORE),
                plgpu.Barrier(**_TENSOR_CORE),
                plgpu.Barrier(**_TENSOR_CORE),
                plgpu.Barrier(**_TENSOR_CORE),
            ),
        ),
        grid=(kv_len // BLOCK_KV, num_kv_heads, batch),
        grid_names=("kv", "heads", "batch"),
        interpret=interpret,
    )
    if k.shape[0] != batch:
        dk, dv = (g.sum(0, keepdims=True, dtype=jnp.float32).astype(g.dtype) for g in (dk, dv))
    return dk, dv

