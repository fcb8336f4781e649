"""Flash-attention forward for Hopper (sm_90) in Pallas Mosaic GPU: wgmma, TMA and a warp-specialised
producer / consumer pipeline (FlashAttention-3 layout).

One CTA owns a query tile of `block_q` rows of one (batch, query head) and runs three warpgroups:

- two consumer warpgroups, each owning `block_q // 2` rows. Each keeps its Q half in SMEM and the running
  m_i, l_i (FlashAttention-2, Alg. 1) and the float32 accumulator in registers. S = Q K^T and O += P V are
  `wgmma`s; P goes from registers straight into the second one. Scores live in the base-2 domain
  (s2 = scale * log2(e) * q k^T, folded into one multiply) so every exponential is an exp2.
- one producer warpgroup that fills a ring of `num_stages` K / V slots with TMA copies. A slot is ready
  when its TMA lands (`k_ready` / `v_ready`, one arrival each) and free once both consumers have arrived
  on `k_free` / `v_free`.

The two consumers ping-pong on a two-arrival `turn` barrier so that one warpgroup's softmax overlaps the
other's matmuls (FlashAttention-3, Sec. 3.1): each step passes the turn once after issuing Q K^T and once
before issuing P V, and warpgroup 1 starts one turn behind.

KV tiles visited, per consumer: [0, full_hi) without any mask, then [full_hi, hi) with the per-element
mask (keys >= kv_lengths[b], and keys above the diagonal when causal). Causal tiles above the diagonal are
never loaded. The producer loads the tiles of the consumer that needs more; the other one passes the turn
and frees those slots without computing. With block tables (`kv_tables`, FlexAttention's `BlockMask`
layout) both consumers and the producer instead walk the table row of the CTA's query block, read as
scalars from GMEM: its partial KV blocks (per-element `mask_fn`, causal and length masks), then its full
ones (length mask only). Without tables, a `mask_fn` is evaluated on every visited tile. A `score_fn`
(FlexAttention's score_mod) is applied to every tile's natural-log scores before the mask; the scale then
no longer folds into the exp2 multiply. Rows >= q_lengths[b] and fully masked rows give output 0 and
lse -inf (the convention of every backend, `_problem.py`).

The caller pads: T to a multiple of `block_q`, S to a multiple of `block_kv`, with finite values (zeros);
keys past `kv_lengths` are masked, but their V rows still meet p = 0 in the P V matmul, so they must not be
NaN / inf.

Interpret mode (`interpret=True`, the Mosaic GPU CPU interpreter) runs the same kernel with two differences,
both in `_mosaic_common._accumulate_pv`: the interpreter's wgmma reads only SMEM operands, so P is staged in
shared memory (`p_in_smem`, also selectable on the GPU), and it cannot run a wgmma into an accumulator
initialised from a value (`pl.run_state` with `ACC.init`), so P V goes into a fresh accumulator that is then
added.

The pieces this kernel shares with the backward kernels (`mosaic/backward.py`, `mosaic/backward_dkv.py`) are in
`mosaic/common.py`.
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
    _M_INIT,
    _SWIZZLE,
    LN2,
    ScoreRule,
    _accumulate_pv,
    _check_tables,
    allocated_smem,
    bias_kind,
    bias_smem_bytes,
    bias_tiles,
    check_bias,
    check_dense_mask,
    check_layout,
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
    table_row,
    tile_indices,
    union_of_ranges,
    window_options,
)
from probjax_kernels.mosaic.common import CONSUMER_REGISTERS, PRODUCER_REGISTERS
from probjax_kernels.mosaic.common import SMEM_BYTES as SMEM_BYTES  # noqa: F401  (its name here since the start)
from probjax_kernels.mosaic.hook_vectors import grouped, tile_of, vectors_in, views

_HEAD_DIMS = (64, 128, 256)
# No reduction scratch (Mosaic GPU reserves 2 KiB by default): the row max / sum of WGMMA-layout tiles reduce
# within each warp's rows, and those 2 KiB are what 16-bit bias tiles lacked at 128 x 128, head dim 128.
_COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


def smem_bytes(
    head_dim: int, block_q: int, block_kv: int, num_stages: int, p_in_smem: bool = False, itemsize: int = 2,
    segments: bool = False, value_dim: int | None = None, return_max: bool = False, dense_mask: bool = False,
    bias: str | None = None, bias_itemsize: int = 4, vectors: tuple[int, int] = (0, 0),
) -> int:
    """Shared memory of one CTA as Mosaic GPU allocates it (`allocated_smem`): the Q tile (which carries O out
    when v's head dim `value_dim` is q's, else an O tile of its own), the K and V rings, the lse staging rows,
    with `p_in_smem` the P tiles and with `segments` the query rows' segment ids and a ring of the keys', with
    `return_max` the row max staging rows, with `dense_mask` a ring of int8 mask tiles, a bias read as `bias`
    (`check_bias`'s kind, its tiles of `bias_itemsize` bytes an element; `bias_smem_bytes`), the hooks' vectors
    (`hook_vectors`; `vectors`: how many along queries, along keys: rows, or a ring), and the barriers. The row
    max / sum reduce within a warp (WGMMA layout rows), so the kernel reserves no reduction scratch
    (`_COMPILER_PARAMS`)."""
    value_dim = value_dim or head_dim
    buffers = [
        itemsize * block_q * head_dim, itemsize * num_stages * block_kv * head_dim,
        itemsize * num_stages * block_kv * value_dim, 4 * block_q,
        itemsize * block_q * block_kv if p_in_smem else 0,
        4 * block_q if segments else 0, 4 * num_stages * block_kv if segments else 0,
        itemsize * block_q * value_dim if value_dim != head_dim else 0, 4 * block_q if return_max else 0,
        num_stages * block_q * block_kv if dense_mask else 0,
        bias_smem_bytes(bias, bias_itemsize, block_q, block_kv, num_stages),
        *[4 * block_q] * vectors[0], *[4 * num_stages * block_kv] * vectors[1],
    ]
    return allocated_smem(buffers, barriers=_CONSUMERS + 4 * num_stages + 1)


def _check(q, k, v, q_lengths, kv_lengths, scale: float, block_q: int, block_kv: int, num_stages: int,
           p_in_smem: bool, segments: bool = False, return_max: bool = False, dense_mask: bool = False,
           bias: str | None = None, bias_itemsize: int = 4, vectors: tuple[int, int] = (0, 0)):
    # 64 query rows per consumer warpgroup; num_stages >= 2 because a consumer waits for the next K before
    # it frees the current V.
    check_layout(
        q, k, v, q_lengths, kv_lengths, scale, block_q=block_q, q_multiple=64 * _CONSUMERS, block_kv=block_kv,
        kv_multiple=64, num_stages=num_stages, min_stages=2, head_dims=_HEAD_DIMS,
        smem_need=smem_bytes(q.shape[-1], block_q, block_kv, num_stages, p_in_smem, q.dtype.itemsize, segments,
                             v.shape[-1], return_max, dense_mask, bias, bias_itemsize, vectors),
    )


def bias_layout(bias) -> tuple[str | None, int]:
    """(how the kernels read a bias, its itemsize) for their shared-memory checks, before `check_bias` checks it
    (the Blackwell forward's too)."""
    if bias is None or jnp.ndim(bias) != 4:
        return None, 4
    return bias_kind(jnp.shape(bias)), jnp.dtype(bias.dtype).itemsize


def _forward_kernel(
    q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, *refs, rule: ScoreRule, block_q: int, block_kv: int,
    num_stages: int, group: int, interpret: bool, has_tables: bool, num_score_arrays: int, num_mask_arrays: int,
    has_segments: bool, has_dropout: bool, return_max: bool, has_mask: bool, bias: str | None,
    score_vectors: tuple = (), mask_vectors: tuple = (),
):
    tables, score_arrays, mask_arrays, segments, seed, mask_ref, refs = split_hook_refs(
        refs, has_tables, num_score_arrays, num_mask_arrays, has_segments, has_dropout, has_mask)
    # The hooks' arrays: global-memory refs, or vectors along q_idx / kv_idx (`hook_vectors`).
    score_groups, mask_groups = grouped(score_arrays, score_vectors), grouped(mask_arrays, mask_vectors)
    vectors = vectors_in(score_groups + mask_groups)
    num_score_vectors = len(vectors_in(score_groups))
    if has_tables:
        num_partial_ref, partial_ref, num_full_ref, full_ref = tables
    bias_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)  # `check_bias`'s tiles, keys or rows
    out_ref, lse_ref, *refs = refs
    max_ref = refs.pop(0) if return_max else None
    smem, ready, free, turn = refs
    (qo_smem, k_smem, v_smem, lse_smem, p_smem, q_segment_smem, kv_segment_smem, own_o_smem, max_smem,
     mask_smem, bias_smem, vector_smem) = smem
    o_smem = qo_smem if own_o_smem is None else own_o_smem  # Q's tile carries O out when Dv = D
    q_ready, k_ready, v_ready = ready
    k_free, v_free = free
    rows = block_q // _CONSUMERS
    value_dim = v_ref.shape[-1]
    num_q_tiles = q_ref.shape[1] // block_q
    q_tile = lax.axis_index("q")
    if rule.causal_only:  # heaviest tiles first, so the short ones fill the tail of the grid
        q_tile = num_q_tiles - 1 - q_tile
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    tile_row0 = q_tile * block_q

    def tile_ranges(row0):
        return kv_tile_range(row0, rows, q_len, kv_len, block_kv, rule.window, mask_everywhere=rule.mask_everywhere)

    if has_tables:
        # Both consumers walk the table row of the CTA's query block: its partial blocks, then its full ones.
        num_partial = num_partial_ref[table_row(num_partial_ref, batch, head, q_tile)]
        cta_steps = num_partial + num_full_ref[table_row(num_full_ref, batch, head, q_tile)]

        def table_block(table_ref, n):
            return table_ref[(*table_row(table_ref, batch, head, q_tile), n)]
    else:
        # The producer loads the union of the consumers' tiles, [cta_lo, cta_lo + cta_steps).
        cta_lo, cta_hi = union_of_ranges([tile_ranges(tile_row0 + c * rows) for c in range(_CONSUMERS)])
        cta_steps = cta_hi - cta_lo

    def pass_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        row0 = tile_row0 + wg * rows
        seed_parts = read_seed(seed)
        if has_tables:
            first_step, end_step = jnp.int32(0), cta_steps
        else:
            lo, full_lo, full_hi, hi = own_ranges(tile_ranges(row0), cta_lo)
            first_step, end_step = lo - cta_lo, hi - cta_lo  # this consumer's pipeline steps
        q_smem = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, rows), head], q_smem, q_ready.at[wg])
        if has_segments:  # the rows' segment ids arrive with Q
            plgpu.copy_gmem_to_smem(segments[0].at[batch, pl.ds(row0, rows)], q_segment_smem.at[wg], q_ready.at[wg])
        if bias == "rows":  # and so does their bias
            plgpu.copy_gmem_to_smem(bias_ref.at[(*mask_index(bias_ref, batch, head), pl.ds(row0, rows))],
                                    bias_smem.at[wg], q_ready.at[wg])
        for (axis, ref), buffer in zip(vectors, vector_smem):  # and the hooks' vectors along queries
            if axis == "q":
                plgpu.copy_gmem_to_smem(ref.at[(*mask_index(ref, batch, head), pl.ds(row0, rows))], buffer.at[wg],
                                        q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        if has_segments:
            q_segments = plgpu.load(q_segment_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        if bias == "rows":
            row_bias = plgpu.load(bias_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))

        def step(kv_step, carry, block, masked: bool, user_mask: bool):
            """Pipeline step `kv_step` (ring slot kv_step % num_stages) computes KV tile `block`. `masked`:
            apply the length mask, and with `user_mask` also the window (causality) and `mask_fn`."""
            acc, m_i, l_i = carry
            slot = lax.rem(kv_step, num_stages)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                pass_turn()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((rows, block_kv), jnp.float32))
            kv_segments = mask_tile = None
            if has_segments:  # the key segment ids' slot is freed with K's
                kv_segments = plgpu.load(kv_segment_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            if has_mask:  # so is the mask tile's (this consumer's rows of it)
                mask_tile = plgpu.load(mask_smem.at[slot, pl.ds(wg * rows, rows)], layout=plgpu.Layout.WGMMA)
            bias_tile = None
            if bias == "tiles":  # and the bias tile's, or the keys' bias
                bias_tile = plgpu.load(bias_smem.at[slot, pl.ds(wg * rows, rows)], layout=plgpu.Layout.WGMMA)
                bias_tile = bias_tile.astype(jnp.float32)
            elif bias == "keys":
                bias_tile = lax.broadcast_in_dim(
                    plgpu.load(bias_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)), s.shape, [1])
            elif bias == "rows":
                bias_tile = lax.broadcast_in_dim(row_bias, s.shape, [0])
            # The hooks' vectors as tiles, loaded where a read asks: the rows', and the keys' of this slot, which the
            # producer refills only once V's is free too.
            tiles = [tile_of(buffer.at[wg], plgpu.Layout.WGMMA.reduce(1), s.shape, 0) if axis == "q" else
                     tile_of(buffer.at[slot], plgpu.Layout.WGMMA.reduce(0), s.shape, 1)
                     for (axis, _), buffer in zip(vectors, vector_smem)]
            plgpu.barrier_arrive(k_free.at[slot])
            # m_i is kept in the base-2 domain (s * s_scale); the scale > 0 commutes with the row max.
            s, s_scale, _ = rule.scores(
                s, lambda: tile_indices(s.shape, row0, block * block_kv), batch, head, kv_len, masked=masked,
                user_mask=user_mask, score_arrays=views(score_groups, tiles[:num_score_vectors]),
                mask_arrays=views(mask_groups, tiles[num_score_vectors:]),
                same_segment=lambda: same_segment(q_segments, kv_segments, s.shape), dense=lambda: mask_tile != 0,
                bias=lambda: bias_tile,
            )
            m_new = jnp.maximum(m_i, s.max(axis=1) * s_scale)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s * s_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + p.sum(axis=1)  # dropout acts after the normalisation: l sums every weight
            p = p.astype(v_smem.dtype)
            # Dropped on the 16-bit P (half the registers of float32 beside the hash), by halves beside a 256-column
            # accumulator (`dropped_by_halves`); the 1 / (1 - rate) of the kept weights folded into the final 1 / l.
            p = rule.dropped(p, lambda: tile_indices(s.shape, row0, block * block_kv), batch, head, seed_parts,
                             scaled=False) if value_dim <= 128 else dropped_by_halves(
                rule, p, row0, block * block_kv, batch, head, seed)
            if value_dim <= 128:  # pins the row sum before the hand-over: tokamax / JAX measured it faster
                acc, m_new, l_i, p = lax.optimization_barrier((acc, m_new, l_i, p))
            plgpu.barrier_arrive(turn)  # softmax done: the other consumer may issue its matmuls
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)

            def prefetch_wait():  # wait for the next K while P V runs
                @pl.when(kv_step + 1 < end_step)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(kv_step + 1, num_stages)])

            acc = _accumulate_pv(
                acc, p, v_smem.at[slot], None if p_smem is None else p_smem.at[wg], not interpret, prefetch_wait
            )
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        def skip(kv_step, _):
            # Tiles only the other consumer needs: keep the turn order and free the slot. Waiting for the
            # loads costs nothing (the turn ties this consumer to the other one, which waits for them anyway)
            # and keeps this warpgroup's view of the barrier phases whole.
            slot = lax.rem(kv_step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            pass_turn()
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            pass_turn()
            plgpu.barrier_arrive(v_free.at[slot])

        carry = (
            plgpu.layout_cast(jnp.zeros((rows, value_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((rows,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )

        def wait_first_k():  # later steps wait for their K while the step before runs P V
            @pl.when(end_step > first_step)
            def _():
                plgpu.barrier_wait(k_ready.at[lax.rem(first_step, num_stages)])

        pl.when(wg == 1)(pass_turn)
        if has_tables:
            wait_first_k()
            carry = lax.fori_loop(
                0, num_partial,
                lambda n, c: step(n, c, table_block(partial_ref, n), masked=True, user_mask=True), carry,
            )
            acc, m_i, l_i = lax.fori_loop(
                num_partial, cta_steps,
                lambda n, c: step(n, c, table_block(full_ref, n - num_partial), masked=True, user_mask=False),
                carry,
            )
        else:
            def visit(start, end, carry, masked: bool):
                return lax.fori_loop(
                    start, end, lambda n, c: step(n - cta_lo, c, n, masked=masked, user_mask=masked), carry
                )

            lax.fori_loop(0, first_step, skip, None)  # tiles only the other consumer needs, before and after
            wait_first_k()
            carry = visit(lo, full_lo, carry, masked=True)
            carry = visit(full_lo, full_hi, carry, masked=False)
            acc, m_i, l_i = visit(full_hi, hi, carry, masked=True)
            lax.fori_loop(end_step, cta_steps, skip, None)
        pl.when(wg == 0)(pass_turn)

        q_idx = row0 + plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
        valid = (q_idx < q_len) & (l_i != 0)  # l_i = 0: no key attended; a NaN l_i (NaN / inf inputs) stays NaN
        inv_l = jnp.where(valid, rule.kept_scale / jnp.where(valid, l_i, 1.0), 0.0)
        o_smem.at[wg][...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(o_smem.dtype)
        lse_smem.at[wg][...] = jnp.where(valid, m_i * LN2 + jnp.log(jnp.where(valid, l_i, 1.0)), -jnp.inf)
        if return_max:
            max_smem.at[wg][...] = jnp.where(valid, m_i * LN2, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[batch, pl.ds(row0, rows), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(row0, rows)])
        if return_max:  # the row max of the masked scores in natural units: m_i is base 2
            plgpu.copy_smem_to_gmem(max_smem.at[wg], max_ref.at[batch, head, pl.ds(row0, rows)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        def load(kv_step, block):
            """Step `kv_step`: once both consumers freed its slot, TMA KV tile `block` into it."""
            tile = (batch if k_ref.shape[0] > 1 else 0, pl.ds(block * block_kv, block_kv), kv_head)
            copies = [(k_ref.at[tile], k_smem, k_ready), (v_ref.at[tile], v_smem, v_ready)]
            if has_segments:  # the keys' segment ids arrive with K
                copies.append((segments[1].at[batch, pl.ds(block * block_kv, block_kv)], kv_segment_smem, k_ready))
            if has_mask:  # and the CTA's tile of the dense mask
                copies.append((mask_ref.at[(*mask_index(mask_ref, batch, head), pl.ds(tile_row0, block_q),
                                            pl.ds(block * block_kv, block_kv))], mask_smem, k_ready))
            if bias == "tiles":  # and of the bias, or the keys' bias
                copies.append((bias_ref.at[(*mask_index(bias_ref, batch, head), pl.ds(tile_row0, block_q),
                                            pl.ds(block * block_kv, block_kv))], bias_smem, k_ready))
            elif bias == "keys":
                copies.append((bias_ref.at[(*mask_index(bias_ref, batch, head), pl.ds(block * block_kv, block_kv))],
                               bias_smem, k_ready))
            copies += [(ref.at[(*mask_index(ref, batch, head), pl.ds(block * block_kv, block_kv))], buffer, k_ready)
                       for (axis, ref), buffer in zip(vectors, vector_smem) if axis == "kv"]
            fill_ring_slot(kv_step, num_stages, (k_free, v_free), copies)

        if has_tables:  # the consumers' sequence: partial blocks, then full ones
            pl.loop(0, num_partial)(lambda n: load(n, table_block(partial_ref, n)))
            pl.loop(num_partial, cta_steps)(lambda n: load(n, table_block(full_ref, n - num_partial)))
        else:
            pl.loop(0, cta_steps)(lambda n: load(n, cta_lo + n))

        drain_ring(cta_steps, num_stages, k_free, v_free)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "causal", "window", "block_q", "block_kv", "num_stages", "p_in_smem", "interpret", "mask_fn",
        "score_fn", "dropout_rate", "dropout_positions", "dropout_heads", "return_max", "score_vectors",
        "mask_vectors",
    ),
)
def mosaic_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_lengths: jax.Array,
    kv_lengths: jax.Array,
    *,
    scale: float,
    causal: bool,
    window: tuple[int | None, int | None] = (None, None),
    block_q: int = 128,
    block_kv: int = 128,
    num_stages: int = 2,
    p_in_smem: bool = False,
    interpret: bool = False,
    kv_tables: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None,
    mask_fn: Callable[..., jax.Array] | None = None,
    score_fn: Callable[..., jax.Array] | None = None,
    mask_arrays: tuple[jax.Array, ...] = (),
    score_arrays: tuple[jax.Array, ...] = (),
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | None = None,
    dropout_positions: tuple[int, int] | None = None,
    dropout_heads: int | None = None,
    return_max: bool = False,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    score_vectors: tuple = (),
    mask_vectors: tuple = (),
) -> tuple[jax.Array, ...]:
    """Flash-attention forward on Hopper through Pallas Mosaic GPU.

    **Arguments:**

    - `q`: `[B, T, N, D]`, bfloat16 or float16, D in {64, 128, 256}; T a multiple of `block_q`.
    - `k`, `v`: `[B, S, K, D]` and `[B, S, K, Dv]` (Dv in {64, 128, 256} too; batch 1: shared by every query
      batch), q's dtype, N a multiple of K (GQA / MQA); S a multiple of `block_kv`. Padding rows must be finite
      (zeros).
    - `q_lengths`, `kv_lengths`: int32 `[B]`; query rows >= q_lengths[b] give output 0 and lse -inf, keys
      >= kv_lengths[b] are masked.
    - `scale`: multiplies q k^T, > 0. `causal`: query i sees keys j <= i (top-left alignment).
    - `window`: `(left, right)`, ints >= 0 or None (unbounded): query i sees keys in [i - left, i + right]
      (with `causal`, right is at most 0). Tiles outside every row's window are never loaded.
    - `block_q`: query rows per CTA, a multiple of 128 (each of the two consumer warpgroups owns half).
      `block_kv`: keys per pipeline step, a multiple of 64. `num_stages`: K / V slots in the SMEM ring.
    - `p_in_smem`: stage P in shared memory for the P V matmul instead of feeding it from registers (always
      on in interpret mode, whose wgmma reads only SMEM operands).
    - `interpret`: run in the Mosaic GPU CPU interpreter instead of compiling for the GPU.
    - `kv_tables`: optional block tables `(num_partial, partial_indices, num_full, full_indices)`, integer,
      counts `[B|1, H|1, nq]` and indices `[B|1, H|1, nq, nk]` with nq = T / block_q and nk = S / block_kv:
      the layout of `BlockMask.kv_tables` built with `block_size=(block_q, block_kv)` (the kernel's tiles;
      other shapes raise ValueError), axes of size 1 broadcast over batch / query heads. Each CTA then
      visits exactly the listed KV blocks of its query block, the partial ones (with `mask_fn`, the causal
      and window masks, and the length mask), then the full ones (length mask only), instead of the window
      / length tile ranges; unlisted blocks are never loaded, listed indices must be < nk. `causal` still
      orders the query tiles heaviest first.
    - `mask_fn`: `mask_fn(b, h, q_idx, kv_idx) -> bool` (True = attend): b, h int32 scalars (batch and
      query head), q_idx, kv_idx int32 `[block_q // 2, block_kv]` global query / key positions. Evaluated
      inside the kernel on the partial blocks of `kv_tables`, or on every visited tile without tables.
    - `score_fn`: `score_fn(score, b, h, q_idx, kv_idx) -> score` (FlexAttention's score_mod) on the float32
      tile of `scale * q k^T`, before any mask; indices as for `mask_fn`.
    - `mask_arrays`, `score_arrays`: arrays the hooks read, passed to them after the indices as global-memory
      refs (`mask_fn(b, h, q_idx, kv_idx, *mask_refs)`); a hook may read them only one element at a time with
      scalar indices (`slopes_ref[h]`), or along q_idx / kv_idx as vectors. Otherwise both hooks are
      elementwise jnp arithmetic, comparisons and math on their arguments, and hashable (static arguments).
    - `score_vectors`, `mask_vectors`: per hook array, the axes ("q", "kv") of the vectors it travels as
      (`hook_vectors.vectors_of`: `[B|1, N|1, T or S]`, 32-bit, one entry of `*_arrays` each, in place of the
      array), () for an array passed as it is; empty: every array as it is.
    - `q_segment_ids` `[B, T]`, `kv_segment_ids` `[B, S]`: integer, both or neither (packed sequences): query
      i sees key j only where their ids are equal, on top of every other mask. Every tile then takes the
      per-element mask.
    - `dropout_rate`: in [0, 1): each attention weight is dropped with this probability (after the softmax's
      normalisation; kept ones scaled by 1 / (1 - rate)), by `_dropout.keep_mask` of `dropout_seed` (uint32
      scalar) and the global (batch, query head, query, key) indices: every backend's mask, bit for bit. With
      `dropout_positions` (q_split, kv_split) the seed is `_dropout.positional_seed`'s [7] and the hash takes
      positions; `dropout_heads`: the head count the hash takes (default N).
    - `return_max`: also return the row max of the scaled, modified, masked scores (`AuxRequest.max_scores`).
    - `mask`: `[B|1, N|1, T, S]` bool / integer (True / nonzero = attend), on top of every other mask; read as
      int8 tiles beside K. Every tile then takes the per-element mask.
    - `bias`: `[B|1, N|1, T|1, S|1]` bfloat16, float16 or float32, added to the scaled scores before
      `score_fn`: tiles of its dtype beside K where T and S are whole, else float32 key vectors beside K or
      row vectors beside Q (`check_bias`).

    **Returns:** `(out, lse)`, with `return_max` `(out, lse, max_scores)`: out `[B, T, N, Dv]` in q's dtype, lse
    `[B, N, T]` float32, the natural-log sum-exp of the scaled, masked scores, and max_scores `[B, N, T]` float32
    (-inf where a row attends no key).
    """
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    p_in_smem = p_in_smem or interpret
    counts = tuple(sum(axes.count(axis) for axes in (*score_vectors, *mask_vectors)) for axis in ("q", "kv"))
    # The interpreter's P staging is left out of the shared-memory check: the compiled kernel has none.
    _check(q, k, v, q_lengths, kv_lengths, scale, block_q, block_kv, num_stages, p_in_smem and not interpret,
           q_segment_ids is not None, return_max, mask is not None, *bias_layout(bias), counts)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    bias_kind, bias = check_bias(bias, batch, num_heads, q_len, kv_len)
    segments = check_segments(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
    dropout, seed = dropout_options(dropout_rate, dropout_seed, dropout_positions, dropout_heads, num_heads)
    mask = check_dense_mask(mask, batch, num_heads, q_len, kv_len)
    tables = _check_tables(kv_tables, batch, num_heads, q_len // block_q, kv_len // block_kv, block_q,
                           block_kv)
    num_stages = min(num_stages, kv_len // block_kv)
    rows = block_q // _CONSUMERS
    transforms = (plgpu.TilingTransform((8, _SWIZZLE // q.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    kernel = functools.partial(
        _forward_kernel,
        rule=ScoreRule(scale, **window_options(causal, window), mask_fn=mask_fn, score_fn=score_fn,
                       segments=segments is not None, dense_mask=mask is not None, bias=bias is not None, **dropout),
        block_q=block_q, block_kv=block_kv, num_stages=num_stages, group=num_heads // num_kv_heads,
        interpret=interpret, has_tables=tables is not None, num_score_arrays=len(score_arrays),
        num_mask_arrays=len(mask_arrays), has_segments=segments is not None, has_dropout=bool(seed),
        return_max=return_max, has_mask=mask is not None, bias=bias_kind, score_vectors=score_vectors,
        mask_vectors=mask_vectors,
    )
    vectors = []  # (axis, array) of the hooks' vectors
    if score_vectors or mask_vectors:
        vectors = vectors_in(grouped(score_arrays, score_vectors) + grouped(mask_arrays, mask_vectors))
    rows_out = jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)
    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((batch, q_len, num_heads, value_dim), q.dtype), rows_out,
            *((rows_out,) if return_max else ()),
        ),
        scratch_types=(
            (
                plgpu.SMEM((_CONSUMERS, rows, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, value_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((_CONSUMERS, rows), jnp.float32),
                plgpu.SMEM((_CONSUMERS, rows, block_kv), q.dtype, transforms=transforms) if p_in_smem else None,
                plgpu.SMEM((_CONSUMERS, rows), jnp.int32) if segments else None,
                plgpu.SMEM((num_stages, block_kv), jnp.int32) if segments else None,
                plgpu.SMEM((_CONSUMERS, rows, value_dim), q.dtype, transforms=transforms)
                if value_dim != head_dim else None,
                plgpu.SMEM((_CONSUMERS, rows), jnp.float32) if return_max else None,
                plgpu.SMEM((num_stages, block_q, block_kv), jnp.int8, transforms=mask_tiles(block_kv))
                if mask is not None else None,
                {"tiles": plgpu.SMEM((num_stages, block_q, block_kv), bias.dtype, transforms=bias_tiles(bias.itemsize)),
                 "keys": plgpu.SMEM((num_stages, block_kv), jnp.float32),
                 "rows": plgpu.SMEM((_CONSUMERS, rows), jnp.float32)}[bias_kind] if bias is not None else None,
                tuple(plgpu.SMEM((_CONSUMERS, rows) if axis == "q" else (num_stages, block_kv), ref.dtype)
                      for axis, ref in vectors),
            ),
            (  # with segments, a mask, a bias or hook vectors, Q's and K's barriers also await their copies
                plgpu.Barrier(num_arrivals=1 + bool(segments) + (bias_kind == "rows") + counts[0],
                              num_barriers=_CONSUMERS),
                plgpu.Barrier(num_arrivals=1 + bool(segments) + (mask is not None) + (bias_kind in ("tiles", "keys"))
                              + counts[1], num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages),
            ),
            (
                plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
            ),
            plgpu.Barrier(num_arrivals=_CONSUMERS),
        ),
        grid=(q_len // block_q, num_heads, batch),
        grid_names=("q", "heads", "batch"),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        kernel_name="probjax_mosaic_forward",
        compiler_params=_COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(q, k, v, q_lengths, kv_lengths, *(tables or ()), *score_arrays, *mask_arrays, *(segments or ()), *seed,
      *(() if mask is None else (mask,)), *(() if bias is None else (bias,)))


def dropped_by_halves(rule: ScoreRule, p, row0, key0, batch, head, seed):
    """`rule.dropped(p, ..., scaled=False)` of a WGMMA-layout tile whose rows start at query row0 and columns at key
    key0, for the forward beside a 64 x 256 float32 accumulator, where the whole tile's hash spilled 20 B (sm_90a):
    one half of its columns after the other, the second half's P and indices through an optimization barrier with
    the first half's result (so its hash starts when the first one's ends), and the seed (`seed`: its ref, as
    `read_seed` takes it) read at the step, so that no value of the hash is held across the loop (which spilled
    4 B)."""
    if not rule.dropout_rate:
        return p
    seed_parts = read_seed(seed)
    rows, cols = p.shape
    half = cols // 2
    q_idx = row0 + plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
    kv_idx = key0 + plgpu.broadcasted_iota(jnp.int32, (half,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
    first = None
    for n in range(2):
        part = p[:, n * half:(n + 1) * half]
        if first is not None:
            first, part, q_idx, kv_idx = lax.optimization_barrier((first, part, q_idx, kv_idx + half))

        def indices(shape=part.shape, q_idx=q_idx, kv_idx=kv_idx):
            return lax.broadcast_in_dim(q_idx, shape, [0]), lax.broadcast_in_dim(kv_idx, shape, [1])

        dropped = rule.dropped(part, indices, batch, head, seed_parts, scaled=False)
        first = dropped if first is None else first
    return jnp.concatenate([first, dropped], axis=1)
