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
lse -inf (the convention of `_core`).

The caller pads: T to a multiple of `block_q`, S to a multiple of `block_kv`, with finite values (zeros);
keys past `kv_lengths` are masked, but their V rows still meet p = 0 in the P V matmul, so they must not be
NaN / inf.

Interpret mode (`interpret=True`, the Mosaic GPU CPU interpreter) runs the same kernel with two differences,
both in `_accumulate_pv`: the interpreter's wgmma reads only SMEM operands, so P is staged in shared memory
(`p_in_smem`, also selectable on the GPU), and it cannot run a wgmma into an accumulator initialised from a
value (`pl.run_state` with `ACC.init`), so P V goes into a fresh accumulator that is then added.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from probjax_kernels._tiles import kv_tile_range

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_M_INIT = float(jnp.finfo(jnp.float32).min)  # finite, so exp2(m_old - m_new) is never (-inf) - (-inf)
_BIG = jnp.iinfo(jnp.int32).max
_CONSUMERS = 2  # consumer warpgroups per CTA; the producer is warpgroup _CONSUMERS
SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on sm_90
_SWIZZLE = 128  # bytes; the head dim is tiled in 64-element (128-byte) columns
_HEAD_DIMS = (64, 128, 256)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def smem_bytes(
    head_dim: int, block_q: int, block_kv: int, num_stages: int, p_in_smem: bool = False, itemsize: int = 2
) -> int:
    """Shared memory of one CTA: the Q / O tile, the K and V rings, the lse staging rows and, with
    `p_in_smem`, the P tiles (barriers aside)."""
    p_tiles = block_q * block_kv if p_in_smem else 0
    return itemsize * (head_dim * (block_q + 2 * num_stages * block_kv) + p_tiles) + 4 * block_q


def check_layout(q, k, v, q_lengths, kv_lengths, scale: float, *, block_q: int, q_multiple: int, block_kv: int,
                 kv_multiple: int, num_stages: int, min_stages: int, head_dims: tuple[int, ...], smem_need: int,
                 kernel: str = "the Mosaic GPU kernel"):
    """The argument checks the Mosaic kernels share: shapes, GQA, dtypes, head dim, tile multiples, padding,
    lengths and shared memory (`smem_need` bytes for the chosen tiles)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, N, D] / [B, S, K, D]; got {q.shape=}, {k.shape=}, {v.shape=}")
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    if k.shape != (batch, kv_len, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [B, S, K, D] matching q; got {q.shape=}, {k.shape=}, {v.shape=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise NotImplementedError(f"{kernel} takes bfloat16 / float16, not {q.dtype}")
    if head_dim not in head_dims:
        raise NotImplementedError(f"{kernel} takes head_dim in {head_dims}, not {head_dim}")
    if block_q % q_multiple:
        raise ValueError(f"{block_q=} must be a multiple of {q_multiple}")
    if block_kv % kv_multiple:
        raise ValueError(f"{block_kv=} must be a multiple of {kv_multiple}")
    if not scale > 0:
        raise ValueError(f"{scale=} must be positive")
    if num_stages < min_stages:
        raise ValueError(f"{num_stages=} must be at least {min_stages}")
    if q_len % block_q or kv_len % block_kv:
        raise ValueError(f"pad T={q_len} to a multiple of {block_q=} and S={kv_len} to a multiple of {block_kv=}")
    if q_lengths.shape != (batch,) or kv_lengths.shape != (batch,):
        raise ValueError(f"lengths must be [B]={batch}; got {q_lengths.shape=}, {kv_lengths.shape=}")
    if smem_need > SMEM_BYTES:
        raise ValueError(
            f"{block_q=}, {block_kv=}, {num_stages=} at {head_dim=} need {smem_need} bytes of SMEM (> {SMEM_BYTES})"
        )


def _check(q, k, v, q_lengths, kv_lengths, scale: float, block_q: int, block_kv: int, num_stages: int,
           p_in_smem: bool):
    # 64 query rows per consumer warpgroup; num_stages >= 2 because a consumer waits for the next K before
    # it frees the current V.
    check_layout(
        q, k, v, q_lengths, kv_lengths, scale, block_q=block_q, q_multiple=64 * _CONSUMERS, block_kv=block_kv,
        kv_multiple=64, num_stages=num_stages, min_stages=2, head_dims=_HEAD_DIMS,
        smem_need=smem_bytes(q.shape[-1], block_q, block_kv, num_stages, p_in_smem, q.dtype.itemsize),
    )


def union_of_ranges(ranges) -> tuple:
    """(lo, hi): the tiles some consumer visits, from each consumer's (lo, ..., hi); empty ranges are left out
    (lo = hi when all are empty)."""
    lo = functools.reduce(jnp.minimum, [jnp.where(hi > lo, lo, _BIG) for lo, *_, hi in ranges])
    hi = functools.reduce(jnp.maximum, [hi for *_, hi in ranges])
    return jnp.minimum(lo, hi), hi


def own_ranges(ranges, cta_lo) -> tuple:
    """One consumer's (lo, full_lo, full_hi, hi); a consumer without tiles gets the empty range at cta_lo, so
    that it skips every step of the CTA."""
    lo, full_lo, full_hi, hi = ranges
    lo, hi = (jnp.where(hi > lo, x, cta_lo) for x in (lo, hi))
    return lo, jnp.clip(full_lo, lo, hi), jnp.clip(full_hi, lo, hi), hi


def allowed_in_window(q_idx, kv_idx, kv_len, window_left: int | None, window_right: int | None):
    """The per-element mask of the Mosaic kernels: keys below kv_len inside the window."""
    allowed = kv_idx < kv_len
    if window_right is not None:
        allowed &= kv_idx <= q_idx + window_right
    if window_left is not None:
        allowed &= kv_idx >= q_idx - window_left
    return allowed


@dataclasses.dataclass(frozen=True)
class ScoreRule:
    """What the Mosaic kernels apply to a tile of q k^T (static and hashable): the scale, the window (causal),
    and FlexAttention's hooks.

    - `score_fn(score, b, h, q_idx, kv_idx, *score_refs) -> score`, on `scale * q k^T`, before any mask.
    - `score_jvp(...)`: the same arguments, returns (score_fn(score), d score_fn / d score); the backward
      kernels need it when there is a score_fn.
    - `mask_fn(b, h, q_idx, kv_idx, *mask_refs) -> bool`, True = attend.

    b, h are int32 scalars; q_idx, kv_idx int32 arrays of the tile's shape; the refs are global-memory refs of
    the arrays the hooks read (one element at a time, with scalar indices).
    """

    scale: float
    window_left: int | None = None
    window_right: int | None = None
    mask_fn: Callable | None = None
    score_fn: Callable | None = None
    score_jvp: Callable | None = None

    @property
    def causal_only(self) -> bool:
        return self.window_right is not None and self.window_left is None

    @property
    def window(self) -> tuple[int | None, int | None]:
        return self.window_left, self.window_right

    @property
    def mask_everywhere(self) -> bool:
        """Without block tables a mask_fn may cut any tile, so no tile skips the per-element mask."""
        return self.mask_fn is not None

    def scores(self, s, indices: Callable, batch, head, kv_len, *, masked: bool, user_mask: bool,
               score_arrays=(), mask_arrays=(), with_derivative: bool = False):
        """(s, s_scale, derivative) for s = q k^T: the base-2 scores are s * s_scale, -inf where masked.

        `indices()` gives (q_idx, kv_idx), computed only when needed. `masked`: apply the length mask, and
        with `user_mask` also the window and `mask_fn`. Without a score_fn, s_scale = scale * log2(e), one
        FMA with the exp2's subtraction. `derivative`: d score_fn / d score with `with_derivative`, else None.
        """
        derivative = None
        s_scale = self.scale * LOG2E
        if masked or self.score_fn is not None:
            q_idx, kv_idx = indices()
        if self.score_fn is not None:
            hook_args = (s * self.scale, batch, head, q_idx, kv_idx, *score_arrays)
            if with_derivative:
                s, derivative = self.score_jvp(*hook_args)
            else:
                s = self.score_fn(*hook_args)
            s_scale = LOG2E
        if masked:
            if user_mask:
                allowed = allowed_in_window(q_idx, kv_idx, kv_len, self.window_left, self.window_right)
                if self.mask_fn is not None:
                    allowed &= self.mask_fn(batch, head, q_idx, kv_idx, *mask_arrays)
            else:
                allowed = kv_idx < kv_len
            s = jnp.where(allowed, s, -jnp.inf)
        return s, s_scale, derivative


def _accumulate_pv(acc, p, v_smem, p_smem, in_place: bool, while_running):
    """acc + p @ v; `while_running()` is traced between issuing the wgmma and waiting for it.

    With `p_smem`, P is staged in shared memory (the interpreter's wgmma only reads SMEM operands); else it
    goes from registers. `in_place` accumulates into `acc` itself (not supported by the interpreter).
    """
    if p_smem is not None:
        p_smem[...] = p
        plgpu.commit_smem()
        p = p_smem
    if in_place:
        def body(acc_ref):
            plgpu.wgmma(acc_ref, p, v_smem)
            while_running()

        return pl.run_state(body)(plgpu.ACC.init(acc))

    def scoped(acc_ref):
        plgpu.wgmma(acc_ref, p, v_smem)
        while_running()
        return acc_ref[...]

    return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, jnp.float32))


def split_hook_refs(refs, has_tables: bool, num_score_arrays: int, num_mask_arrays: int) -> tuple:
    """(tables, score_arrays, mask_arrays, rest) of the kernels' refs after the lengths: the 4 block-table
    refs (None without tables), then the refs of the score_fn's and the mask_fn's arrays."""
    tables = None
    if has_tables:
        tables, refs = refs[:4], refs[4:]
    score_arrays, refs = refs[:num_score_arrays], refs[num_score_arrays:]
    mask_arrays, refs = refs[:num_mask_arrays], refs[num_mask_arrays:]
    return tables, score_arrays, mask_arrays, refs


def tile_indices(shape, row0, key0, transposed: bool = False):
    """(q_idx, kv_idx) of a WGMMA-layout tile whose rows start at query row0 and columns at key key0 (with
    `transposed`, rows are keys from key0 and columns queries from row0)."""
    q_axis, kv_axis = (1, 0) if transposed else (0, 1)
    q_idx = row0 + plgpu.broadcasted_iota(jnp.int32, shape, q_axis, layout=plgpu.Layout.WGMMA)
    kv_idx = key0 + plgpu.broadcasted_iota(jnp.int32, shape, kv_axis, layout=plgpu.Layout.WGMMA)
    return q_idx, kv_idx


def table_walk(tables, batch, head, tile) -> tuple:
    """(num_partial, steps, block_of) of one row of block tables `(num_partial, partial_indices, num_full,
    full_indices)`: the CTA's steps [0, steps) visit block_of(n), the partial blocks first."""
    num_partial_ref, partial_ref, num_full_ref, full_ref = tables
    num_partial = num_partial_ref[table_row(num_partial_ref, batch, head, tile)]
    steps = num_partial + num_full_ref[table_row(num_full_ref, batch, head, tile)]

    def block_of(n):
        in_full = n >= num_partial
        partial = partial_ref[(*table_row(partial_ref, batch, head, tile), jnp.where(in_full, 0, n))]
        full = full_ref[(*table_row(full_ref, batch, head, tile), jnp.where(in_full, n - num_partial, 0))]
        return jnp.where(in_full, full, partial)

    return num_partial, steps, block_of


def table_row(ref, batch, head, q_tile) -> tuple:
    """The index of this CTA's row in a `[B|1, H|1, nq(, nk)]` table (axes of size 1 broadcast)."""
    return (batch if ref.shape[0] > 1 else 0, head if ref.shape[1] > 1 else 0, q_tile)


def _forward_kernel(
    q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, *refs, rule: ScoreRule, block_q: int, block_kv: int,
    num_stages: int, group: int, interpret: bool, has_tables: bool, num_score_arrays: int, num_mask_arrays: int,
):
    tables, score_arrays, mask_arrays, refs = split_hook_refs(refs, has_tables, num_score_arrays, num_mask_arrays)
    if has_tables:
        num_partial_ref, partial_ref, num_full_ref, full_ref = tables
    out_ref, lse_ref, smem, ready, free, turn = refs
    qo_smem, k_smem, v_smem, lse_smem, p_smem = smem
    q_ready, k_ready, v_ready = ready
    k_free, v_free = free
    rows = block_q // _CONSUMERS
    head_dim = q_ref.shape[-1]
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
        plgpu.set_max_registers(232, action="increase")
        row0 = tile_row0 + wg * rows
        if has_tables:
            first_step, end_step = jnp.int32(0), cta_steps
        else:
            lo, full_lo, full_hi, hi = own_ranges(tile_ranges(row0), cta_lo)
            first_step, end_step = lo - cta_lo, hi - cta_lo  # this consumer's pipeline steps
        q_smem = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, rows), head], q_smem, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])

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
            plgpu.barrier_arrive(k_free.at[slot])
            # m_i is kept in the base-2 domain (s * s_scale); the scale > 0 commutes with the row max.
            s, s_scale, _ = rule.scores(
                s, lambda: tile_indices(s.shape, row0, block * block_kv), batch, head, kv_len, masked=masked,
                user_mask=user_mask, score_arrays=score_arrays, mask_arrays=mask_arrays,
            )
            m_new = jnp.maximum(m_i, s.max(axis=1) * s_scale)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s * s_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + p.sum(axis=1)
            p = p.astype(v_smem.dtype)
            if head_dim <= 128:
                # Pins the row sum before the hand-over below; tokamax / JAX measured this order to be faster.
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
            plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA),
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
        inv_l = jnp.where(valid, 1.0 / jnp.where(valid, l_i, 1.0), 0.0)
        qo_smem.at[wg][...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(qo_smem.dtype)
        lse_smem.at[wg][...] = jnp.where(valid, m_i * LN2 + jnp.log(jnp.where(valid, l_i, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem.at[wg], out_ref.at[batch, pl.ds(row0, rows), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(row0, rows)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        def load(kv_step, block):
            """Step `kv_step`: once both consumers freed its slot, TMA KV tile `block` into it."""
            tile = (batch, pl.ds(block * block_kv, block_kv), kv_head)
            fill_ring_slot(kv_step, num_stages, (k_free, v_free),
                           ((k_ref.at[tile], k_smem, k_ready), (v_ref.at[tile], v_smem, v_ready)))

        if has_tables:  # the consumers' sequence: partial blocks, then full ones
            pl.loop(0, num_partial)(lambda n: load(n, table_block(partial_ref, n)))
            pl.loop(num_partial, cta_steps)(lambda n: load(n, table_block(full_ref, n - num_partial)))
        else:
            pl.loop(0, cta_steps)(lambda n: load(n, cta_lo + n))

        drain_ring(cta_steps, num_stages, k_free, v_free)


def fill_ring_slot(step, num_stages: int, free_barriers, copies) -> None:
    """Producer side of a ring of `num_stages` SMEM slots: once the consumers have freed the slot of `step`
    (on every pass after the first), starts the TMA `copies` into it, each (GMEM source, SMEM ring, ready
    barrier ring)."""
    slot = lax.rem(step, num_stages)

    @pl.when(step >= num_stages)
    def _():
        for barrier in free_barriers:
            plgpu.barrier_wait(barrier.at[slot])

    for source, ring, ready in copies:
        plgpu.copy_gmem_to_smem(source, ring.at[slot], ready.at[slot])


def drain_ring(steps, num_stages: int, *free_barriers) -> None:
    """Producer side: awaits the consumers' releases of the last `num_stages` ring slots, so that no barrier
    phase is left pending when the CTA exits."""

    @pl.loop(jnp.maximum(steps - num_stages, 0), steps)
    def _(step):
        slot = lax.rem(step, num_stages)
        for barrier in free_barriers:
            plgpu.barrier_wait(barrier.at[slot])


def _check_window(window) -> tuple[int | None, int | None]:
    if not isinstance(window, tuple) or len(window) != 2 or not all(
        w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0) for w in window
    ):
        raise ValueError(f"window must be a (left, right) pair of ints >= 0 or None, got {window!r}")
    return window


def window_options(causal: bool, window) -> dict:
    """The kernels' window_left / window_right from `causal` and `window` (causal caps the right side at 0)."""
    window_left, window_right = _check_window(window)
    if causal:
        window_right = 0 if window_right is None else min(window_right, 0)
    return {"window_left": window_left, "window_right": window_right}


def _check_tables(kv_tables, batch: int, num_heads: int, num_q_blocks: int, num_kv_blocks: int,
                  block_q: int, block_kv: int, name: str = "kv_tables") -> tuple[jax.Array, ...] | None:
    """int32 block tables, checked against the kernel's grid: the table's tiles must be the kernel's.
    `kv_tables` rows are query blocks; with name="q_tables" (the transposed tables) rows are KV blocks."""
    if kv_tables is None:
        return None
    if len(kv_tables) != 4:
        raise ValueError(f"{name} must be (num_partial, partial_indices, num_full, full_indices)")
    tables = tuple(jnp.asarray(t) for t in kv_tables)
    grid = (num_q_blocks, num_kv_blocks) if name == "kv_tables" else (num_kv_blocks, num_q_blocks)
    for part, table, ndim in zip(("num_partial", "partial_indices", "num_full", "full_indices"), tables, (3, 4, 3, 4)):
        if not jnp.issubdtype(table.dtype, jnp.integer):
            raise ValueError(f"{name} {part} must be integer, got {table.dtype}")
        expected = grid[: ndim - 2]
        if (table.ndim != ndim or table.shape[0] not in (1, batch) or table.shape[1] not in (1, num_heads)
                or table.shape[2:] != expected):
            raise ValueError(
                f"{name} {part} must be [B|1={batch}, H|1={num_heads}, {', '.join(map(str, expected))}] "
                f"(tables of tiles block_size=({block_q}, {block_kv}), the kernel's block_q / block_kv, over the "
                f"padded sequences); got {table.shape}"
            )
    return tuple(t.astype(jnp.int32) for t in tables)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "causal", "window", "block_q", "block_kv", "num_stages", "p_in_smem", "interpret", "mask_fn",
        "score_fn",
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
) -> tuple[jax.Array, jax.Array]:
    """Flash-attention forward on Hopper through Pallas Mosaic GPU.

    **Arguments:**

    - `q`: `[B, T, N, D]`, bfloat16 or float16, D in {64, 128, 256}; T a multiple of `block_q`.
    - `k`, `v`: `[B, S, K, D]`, q's dtype, N a multiple of K (GQA / MQA); S a multiple of `block_kv`. Padding
      rows must be finite (zeros).
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
      scalar indices (`slopes_ref[h]`). Otherwise both hooks are elementwise jnp arithmetic, comparisons and
      math on their arguments, and hashable (static arguments).

    **Returns:** `(out, lse)`: out `[B, T, N, D]` in q's dtype and lse `[B, N, T]` float32, the natural-log
    sum-exp of the scaled, masked scores.
    """
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    p_in_smem = p_in_smem or interpret
    _check(q, k, v, q_lengths, kv_lengths, scale, block_q, block_kv, num_stages, p_in_smem)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    tables = _check_tables(kv_tables, batch, num_heads, q_len // block_q, kv_len // block_kv, block_q,
                           block_kv)
    num_stages = min(num_stages, kv_len // block_kv)
    rows = block_q // _CONSUMERS
    transforms = (plgpu.TilingTransform((8, _SWIZZLE // q.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    kernel = functools.partial(
        _forward_kernel, rule=ScoreRule(scale, **window_options(causal, window), mask_fn=mask_fn, score_fn=score_fn),
        block_q=block_q, block_kv=block_kv, num_stages=num_stages, group=num_heads // num_kv_heads,
        interpret=interpret, has_tables=tables is not None, num_score_arrays=len(score_arrays),
        num_mask_arrays=len(mask_arrays),
    )
    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32),
        ),
        scratch_types=(
            (
                plgpu.SMEM((_CONSUMERS, rows, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((_CONSUMERS, rows), jnp.float32),
                plgpu.SMEM((_CONSUMERS, rows, block_kv), q.dtype, transforms=transforms) if p_in_smem else None,
            ),
            (
                plgpu.Barrier(num_barriers=_CONSUMERS),
                plgpu.Barrier(num_barriers=num_stages),
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
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(q, k, v, q_lengths, kv_lengths, *(tables or ()), *score_arrays, *mask_arrays)
