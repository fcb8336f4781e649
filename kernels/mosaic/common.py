"""What the Mosaic GPU forward and backward kernels share: the CTA's constants (consumer warpgroups, shared
memory, swizzle), the argument checks, the per-consumer tile ranges, the score rule applied to a tile of
q k^T (scale, window, FlexAttention's hooks), the P V / dS K accumulation, the walk over a `BlockMask`'s
tables, and the producer's side of the K / V ring. See `mosaic/forward.py` for the CTA layout.
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

from probjax_kernels._config import FlashConfig
from probjax_kernels._dropout import SEED_PARTS, keep_mask, positions_of
from probjax_kernels._scores import backward_delta, base2_lse

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_M_INIT = float(jnp.finfo(jnp.float32).min)  # finite, so exp2(m_old - m_new) is never (-inf) - (-inf)
_BIG = jnp.iinfo(jnp.int32).max
_CONSUMERS = 2  # consumer warpgroups per CTA; the producer is warpgroup _CONSUMERS
# Registers per thread after `set_max_registers`: the two consumer warpgroups take what the producer (TMA
# issue only) gives up, 2 x 240 + 24 = 504 of the 3 x 168 a 384-thread CTA launches with. 232 / 40 left the
# forward with hook vectors beside a 128-column accumulator 4 B short (a spill on sm_90a), and the backward's
# programs on head-dim pieces (`PIECE`) 8-36 B short. The other backward kernels keep 232 / 40.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 240, 24
SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on sm_90
_SWIZZLE = 128  # bytes; the head dim is tiled in 64-element (128-byte) columns
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


_SMEM_ALIGNMENT = 1024  # bytes: Mosaic GPU starts every shared-memory buffer at a multiple of this
_REDUCTION_SCRATCH = 2048  # bytes: what Mosaic GPU reserves for a kernel's cross-thread reductions (its default)


def allocated_smem(buffers, barriers: int, reductions: bool = False) -> int:
    """The shared memory Mosaic GPU allocates for a kernel's scratch `buffers` (bytes each; 0 for none), each
    aligned to 1 KiB, then the reduction scratch of a kernel that reduces across threads (`reductions`: a row
    max or sum) and `barriers` 8-byte mbarriers: the figure its own shared-memory check compares."""
    aligned = sum(-(-size // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT for size in buffers)
    return aligned + (_REDUCTION_SCRATCH if reductions else 0) + 8 * barriers


def check_layout(q, k, v, q_lengths, kv_lengths, scale: float, *, block_q: int, q_multiple: int, block_kv: int,
                 kv_multiple: int, num_stages: int, min_stages: int, head_dims: tuple[int, ...], smem_need: int,
                 kernel: str = "the Mosaic GPU kernel"):
    """The argument checks the Mosaic kernels share: shapes, GQA, dtypes, head dims (q / k's and v's, each in
    `head_dims`), tile multiples, padding, lengths and shared memory (`smem_need` bytes for the chosen tiles)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, N, D] / [B, S, K, D] / [B, S, K, Dv]; got {q.shape=}, {k.shape=}, "
                         f"{v.shape=}")
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    if k.shape[0] not in (1, batch) or k.shape[1:] != (kv_len, num_kv_heads, head_dim) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k and v must be [B|1, S, K, D] / [B|1, S, K, Dv] matching q; got {q.shape=}, {k.shape=}, "
                         f"{v.shape=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise NotImplementedError(f"{kernel} takes bfloat16 / float16, not {q.dtype}")
    if head_dim not in head_dims or v.shape[3] not in head_dims:
        raise NotImplementedError(f"{kernel} takes head_dim and v's head dim in {head_dims}, not {head_dim} and "
                                  f"{v.shape[3]}")
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


def check_outputs(q, v, out, lse, d_out):
    """The backward kernels' check of the forward's outputs: out and d_out `[B, T, N, Dv]` (v's head dim), lse
    `[B, N, T]`."""
    batch, q_len, num_heads, _ = q.shape
    out_shape = (batch, q_len, num_heads, v.shape[3])
    if out.shape != out_shape or d_out.shape != out_shape or lse.shape != (batch, num_heads, q_len):
        raise ValueError(f"out / d_out must be [B, T, N, Dv] = {list(out_shape)} and lse [B, N, T]; got "
                         f"{out.shape=}, {d_out.shape=}, {lse.shape=}")


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
    segments: bool = False  # a query attends only keys of its own segment (packed sequences)
    dense_mask: bool = False  # a query attends only keys its row of a dense [T, S] mask keeps
    # Dropout (`_dropout.keep_mask`, every backend's bits): its rate, the (q_split, kv_split) of a positional
    # seed (`_dropout.positional_seed`) or None, and the number of heads the hash counts.
    dropout_rate: float = 0.0
    dropout_positions: tuple[int, int] | None = None
    dropout_heads: int = 1
    bias: bool = False  # a dense bias is added to the scaled scores, before the score_fn (`check_bias`)

    @property
    def causal_only(self) -> bool:
        return self.window_right is not None and self.window_left is None

    @property
    def window(self) -> tuple[int | None, int | None]:
        return self.window_left, self.window_right

    @property
    def mask_everywhere(self) -> bool:
        """Without block tables a mask_fn, a segment boundary or a dense mask may cut any tile, so no tile skips
        the per-element mask."""
        return self.mask_fn is not None or self.segments or self.dense_mask

    def scores(self, s, indices: Callable, batch, head, kv_len, *, masked: bool, user_mask: bool,
               score_arrays=(), mask_arrays=(), same_segment: Callable | None = None,
               dense: Callable | None = None, with_derivative: bool = False, bias: Callable | None = None):
        """(s, s_scale, derivative) for s = q k^T: the base-2 scores are s * s_scale, -inf where masked.

        `indices()` gives (q_idx, kv_idx), computed only when needed. With `bias` (the rule's), `bias()` is the
        tile's float32 bias, added to the scaled scores. `masked`: apply the length mask and, with `segments`,
        `same_segment()` (True where query and key share a segment), with `dense_mask`, `dense()` (the tile of
        the dense mask, True = attend), and with `user_mask` also the window and `mask_fn`. Without a score_fn
        or a bias, s_scale = scale * log2(e), one FMA with the exp2's subtraction. `derivative`: d score_fn /
        d score with `with_derivative`, else None.
        """
        derivative = None
        s_scale = self.scale * LOG2E
        if masked or self.score_fn is not None:
            q_idx, kv_idx = indices()
        if self.bias:
            s, s_scale = s * self.scale + bias(), LOG2E
        if self.score_fn is not None:
            hook_args = (s if self.bias else s * self.scale, batch, head, q_idx, kv_idx, *score_arrays)
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
            if self.segments:
                allowed &= same_segment()
            if self.dense_mask:
                allowed &= dense()
            s = jnp.where(allowed, s, -jnp.inf)
        return s, s_scale, derivative

    def kept(self, indices: Callable, batch, head, seed_parts) -> jax.Array:
        """The dropout keep mask of a tile (True = kept): `indices()` gives its (q_idx, kv_idx), `seed_parts`
        the scalars of the seed (one, or `positional_seed`'s seven)."""
        q_idx, kv_idx = indices()
        seed = seed_parts[0]
        if self.dropout_positions is not None:
            seed, batch, head, q_idx, kv_idx = positions_of(seed_parts, self.dropout_positions, batch, head, q_idx,
                                                            kv_idx)
        return keep_mask(seed, batch, head, q_idx, kv_idx, self.dropout_rate, self.dropout_heads)

    def dropped(self, x, indices: Callable, batch, head, seed_parts, scaled: bool = True) -> jax.Array:
        """x with dropout applied: 0 where dropped, x / (1 - rate) where kept (x unchanged without dropout);
        x where kept without `scaled` (the caller then owes the factor `kept_scale`)."""
        if not self.dropout_rate:
            return x
        keep = self.kept(indices, batch, head, seed_parts)
        return jnp.where(keep, x * self.kept_scale if scaled else x, jnp.zeros_like(x))

    @property
    def kept_scale(self) -> float:
        """1 / (1 - rate): the factor on kept weights (1 without dropout)."""
        return 1.0 / (1.0 - self.dropout_rate)


def dropout_options(dropout_rate: float, dropout_seed, dropout_positions, dropout_heads: int | None,
                    num_heads: int) -> tuple[dict, tuple]:
    """(ScoreRule's dropout fields, the kernel's seed input: uint32 [1] or [7] or none), checked."""
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if not dropout_rate:
        return {}, ()
    if dropout_seed is None:
        raise ValueError("dropout_rate > 0 needs a dropout_seed")
    seed = jnp.asarray(dropout_seed).astype(jnp.uint32).reshape(-1)
    parts = SEED_PARTS if dropout_positions is not None else 1
    if seed.shape != (parts,):
        raise ValueError(f"dropout_seed must be a scalar, or positional_seed's [7] with dropout_positions; got "
                         f"shape {jnp.shape(dropout_seed)}")
    rule = dict(dropout_rate=float(dropout_rate), dropout_positions=dropout_positions,
                dropout_heads=dropout_heads or num_heads)
    return rule, (seed,)


def read_seed(seed_refs) -> tuple:
    """The seed's uint32 scalars from its global-memory ref (none without dropout)."""
    return tuple(seed_refs[0][i] for i in range(seed_refs[0].shape[0])) if seed_refs else ()


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


def split_hook_refs(refs, has_tables: bool, num_score_arrays: int, num_mask_arrays: int,
                    has_segments: bool = False, has_dropout: bool = False, has_mask: bool = False) -> tuple:
    """(tables, score_arrays, mask_arrays, segments, seed, mask, rest) of the kernels' refs after the lengths:
    the 4 block-table refs (None without tables), the refs of the score_fn's and the mask_fn's arrays, the query
    and key segment ids (None without segments), the dropout seed's ref (() without dropout), then the dense
    mask's ref (None without one)."""
    tables = segments = mask = None
    if has_tables:
        tables, refs = refs[:4], refs[4:]
    score_arrays, refs = refs[:num_score_arrays], refs[num_score_arrays:]
    mask_arrays, refs = refs[:num_mask_arrays], refs[num_mask_arrays:]
    if has_segments:
        segments, refs = refs[:2], refs[2:]
    seed, refs = (refs[:1], refs[1:]) if has_dropout else ((), refs)
    if has_mask:
        mask, refs = refs[0], refs[1:]
    return tables, score_arrays, mask_arrays, segments, seed, mask, refs


def check_dense_mask(mask, batch: int, num_heads: int, q_len: int, kv_len: int) -> jax.Array | None:
    """A dense mask `[B|1, N|1, T, S]` (True / nonzero = attend) over the padded sequences as int8; None passes."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if (mask.ndim != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, num_heads)
            or mask.shape[2:] != (q_len, kv_len)):
        raise ValueError(f"mask must be [B|1, N|1, T, S] = [{batch}|1, {num_heads}|1, {q_len}, {kv_len}] (the padded "
                         f"sequences); got {list(mask.shape)}")
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise ValueError(f"mask must be bool or integer, got {mask.dtype}")
    if mask.dtype == jnp.bool_:
        return mask.astype(jnp.int8)
    return mask if mask.dtype == jnp.int8 else (mask != jnp.zeros((), mask.dtype)).astype(jnp.int8)


def check_bias(bias, batch: int, num_heads: int, q_len: int, kv_len: int) -> tuple[str | None, jax.Array | None]:
    """(how the kernels read it, the array) of a dense bias `[B|1, N|1, T|1, S|1]` over the padded sequences
    (float32 or 16-bit; added to the scaled scores, before a score_fn): "tiles" of its own dtype where T and S
    are both whole; float32 vectors where not: "keys" `[B|1, N|1, S]` where T is 1 (an S of 1 broadcast too),
    "rows" `[B|1, N|1, T]` where only S is 1. (None, None) without a bias."""
    if bias is None:
        return None, None
    bias = jnp.asarray(bias)
    if (bias.ndim != 4 or bias.shape[0] not in (1, batch) or bias.shape[1] not in (1, num_heads)
            or bias.shape[2] not in (1, q_len) or bias.shape[3] not in (1, kv_len)):
        raise ValueError(f"bias must be [B|1, N|1, T|1, S|1] = [{batch}|1, {num_heads}|1, {q_len}|1, {kv_len}|1] "
                         f"(the padded sequences); got {list(bias.shape)}")
    if bias.dtype not in (*_DTYPES, jnp.dtype(jnp.float32)):
        raise TypeError(f"bias must be bfloat16, float16 or float32, got {bias.dtype}")
    kind = bias_kind(bias.shape)
    if kind == "tiles":
        return kind, bias
    if kind == "keys":
        return kind, jnp.broadcast_to(bias[:, :, 0, :], (*bias.shape[:2], kv_len)).astype(jnp.float32)
    return kind, bias[:, :, :, 0].astype(jnp.float32)


def bias_kind(shape: tuple) -> str:
    """How the kernels read a `[B|1, N|1, T|1, S|1]` bias (`check_bias`): "tiles" where T and S are whole, else
    float32 vectors, "keys" where T is 1, "rows" where only S is."""
    return "tiles" if shape[2] > 1 and shape[3] > 1 else "keys" if shape[2] == 1 else "rows"


def bias_smem_bytes(kind: str | None, itemsize: int, block_q: int, block_kv: int, num_stages: int) -> int:
    """Shared memory of a bias read as `check_bias`'s `kind`: a ring of (block_q, block_kv) tiles of
    `itemsize` bytes, a ring of float32 key vectors, or the CTA's float32 rows."""
    return {None: 0, "tiles": num_stages * block_q * block_kv * itemsize, "keys": num_stages * block_kv * 4,
            "rows": block_q * 4}[kind]


def bias_tiles(itemsize: int) -> tuple:
    """The shared-memory transforms of a bias tile of `itemsize`-byte elements (128-byte swizzled columns)."""
    return plgpu.TilingTransform((8, _SWIZZLE // itemsize)), plgpu.SwizzleTransform(_SWIZZLE)


def bias_scratch(kind: str | None, bias, tile: tuple, parts: int, keys: tuple, rows: tuple):
    """The shared memory a backward kernel reads a bias of `kind` (`bias_kind`) into: "tiles", `parts` rings of
    `tile`-shaped tiles of the bias's dtype (one per part of a step); "keys" / "rows", a float32 buffer of key
    vectors shaped `keys` or of row vectors shaped `rows`; None without a bias."""
    if kind == "tiles":
        return tuple(plgpu.SMEM(tile, bias.dtype, transforms=bias_tiles(bias.itemsize)) for _ in range(parts))
    return None if kind is None else plgpu.SMEM(keys if kind == "keys" else rows, jnp.float32)


def mask_tiles(columns: int) -> tuple:
    """The shared-memory transforms of an int8 mask tile `columns` wide (64 or 128 bytes a row)."""
    return plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(columns)


def mask_index(mask_ref, batch, head) -> tuple:
    """The (batch, head) of this CTA's rows in a `[B|1, N|1, ...]` mask (axes of size 1 broadcast)."""
    return batch if mask_ref.shape[0] > 1 else 0, head if mask_ref.shape[1] > 1 else 0


def same_segment(row_segments, column_segments, shape):
    """A `shape` tile: True where its row's segment id (`row_segments`, a WGMMA.reduce(1) vector) equals its
    column's (`column_segments`, a WGMMA.reduce(0) vector)."""
    return lax.broadcast_in_dim(row_segments, shape, [0]) == lax.broadcast_in_dim(column_segments, shape, [1])


def check_segments(q_segment_ids, kv_segment_ids, batch: int, q_len: int, kv_len: int) -> tuple | None:
    """int32 (q_segment_ids [B, T], kv_segment_ids [B, S]), both or neither, checked against the padded
    sequences; None without segments."""
    if q_segment_ids is None and kv_segment_ids is None:
        return None
    if q_segment_ids is None or kv_segment_ids is None:
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    segments = tuple(jnp.asarray(ids) for ids in (q_segment_ids, kv_segment_ids))
    for name, axis, ids, length in zip(("q_segment_ids", "kv_segment_ids"), "TS", segments, (q_len, kv_len)):
        if ids.shape != (batch, length) or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer [B, {axis}] = [{batch}, {length}] (the padded sequence); "
                             f"got {ids.dtype}{list(ids.shape)}")
    return tuple(ids.astype(jnp.int32) for ids in segments)


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


def mosaic_hook_shapes(config: FlashConfig) -> tuple:
    """Shapes of (b, h, q_idx, kv_idx, score) where the Mosaic forward calls the hooks: scalar b and h, and
    [block_q // 2, block_k] tiles of a consumer warpgroup for the rest."""
    tile = (config.block_q // 2, config.block_k)
    return (), (), tile, tile, tile


# The backward kernels split a step into parts of at most PART columns of S (dQ: keys) / S^T (dK/dV: queries):
# with the forward's 128 x 128 tiles (hooks, block tables) a whole step's S / dP tiles of 128 columns beside the
# accumulators spilled at head dim 128 (docs/perf-notes.md, Version 6).
PART = 64
# Columns of a head-dim piece: at head dim 256 the dQ kernel and dK/dV's dK program run as one program per piece of
# their gradient's columns, their 64 x 256 float32 accumulators having spilled beside S and dP (Version 26).
PIECE = 128


def last_piece(piece: int, *operands: list) -> tuple[list, ...]:
    """Each list of per-piece operands (a sum's wgmmas) reordered so that `piece`'s comes last: the sum then ends
    on the piece the gradient's matmul reads next, whose operand was otherwise held across the other piece's
    wgmma (dQ's piece 0 spilled 12 B on sm_90a with it first)."""
    order = [p for p in range(len(operands[0])) if p != piece] + [piece]
    return tuple([pieces[p] for p in order] for pieces in operands)


def mosaic_backward_hook_shapes(config: FlashConfig) -> tuple:
    """Shapes of (b, h, q_idx, kv_idx, score) where the Mosaic backward kernels call the hooks, on the forward's
    square tiles (`_dispatch._mosaic_backward_tiles`): [block_q // 2, min(block_q, PART)] parts (dK/dV's
    transposed (keys, queries) part has the same shape)."""
    tile = (config.block_q // 2, min(config.block_q, PART))
    return (), (), tile, tile, tile


# ------------------------------------------------------------------------------- the backward kernels' launch


def _prologue(q, k, out, lse, d_out, d_lse, q_lengths, tables, block_q: int, block_kv: int, tables_name: str):
    """What both backward kernels take besides the inputs: the checked block tables, and the
    FlashAttention-2 preprocess in XLA: delta = rowsum(dO * O) and lse in base 2 (+inf where no key attends,
    and for rows >= `q_lengths` when given, so that those rows give p = 0 without a per-element row mask);
    with the SMEM tiling / swizzle transforms of q's dtype."""
    batch, q_len, num_heads, _ = q.shape
    tables = _check_tables(tables, batch, num_heads, q_len // block_q, k.shape[1] // block_kv, block_q, block_kv,
                           name=tables_name)
    delta, lse2 = backward_delta(out, lse, d_out, d_lse), base2_lse(lse)
    if q_lengths is not None:
        lse2 = jnp.where(jnp.arange(q_len)[None, None, :] < q_lengths[:, None, None], lse2, jnp.inf)
    transforms = (plgpu.TilingTransform((8, _SWIZZLE // q.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    return tables, delta, lse2, transforms


def _launch(body, name: str, inputs: tuple, tables, score_arrays, mask_arrays, *, interpret: bool, block_q: int,
            block_kv: int, num_stages: int, rule: ScoreRule, out_type, scratch_types, grid, grid_names,
            segments=None, seed=(), mask=None, bias=None, bias_kind: str | None = None, **static):
    """A backward kernel `body` over `grid`: two consumer warpgroups and a producer, its inputs (q, k, v, dO,
    lse2, delta, q_lengths, kv_lengths), then the tables, the hooks' arrays, the segment ids, the dropout
    seed, the dense mask and the bias (read as `bias_kind`); `static`: more of `body`'s static options."""
    q, k = inputs[:2]
    kernel = functools.partial(
        body, rule=rule, block_q=block_q, block_kv=block_kv, num_stages=num_stages, group=q.shape[2] // k.shape[2],
        interpret=interpret, has_tables=tables is not None, num_score_arrays=len(score_arrays),
        num_mask_arrays=len(mask_arrays), has_segments=segments is not None, has_dropout=bool(seed),
        has_mask=mask is not None, bias=bias_kind, **static,
    )
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch_types, grid=grid, grid_names=grid_names,
        num_threads=_CONSUMERS + 1, thread_name="wg", kernel_name=name,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(*inputs, *(tables or ()), *score_arrays, *mask_arrays, *(segments or ()), *seed,
      *(() if mask is None else (mask,)), *(() if bias is None else (bias,)))


def _backward_rule(scale: float, causal: bool, window, mask_fn, score_fn, score_jvp, segments,
                   dropout: dict, mask=None, bias: bool = False) -> ScoreRule:
    if score_fn is not None and score_jvp is None:
        raise ValueError("the backward kernels need score_jvp (the score_fn's value and derivative) with a score_fn")
    return ScoreRule(scale, **window_options(causal, window), mask_fn=mask_fn, score_fn=score_fn, score_jvp=score_jvp,
                     segments=segments is not None, dense_mask=mask is not None, bias=bias, **dropout)


def after(value, earlier, interpret: bool):
    """`value`, held until `earlier` is computed where the kernels run in the Mosaic GPU interpreter: an
    interpreted kernel holds one of XLA's CPU threads while its warpgroups run nested computations on others, so
    two kernels scheduled at once can take every thread and wait on each other for good."""
    return value if earlier is None or not interpret else lax.optimization_barrier((value, earlier))[0]


def check_pieces(head_dim: int, pieces: int, kernel: str, narrowest: int = PIECE) -> None:
    """Raises ValueError unless `pieces` (programs of head_dim / pieces columns each) fits q / k's head dim: 1 up
    to `PIECE`, head_dim / `PIECE` above it (one program's 64 x 256 float32 accumulator spilled), or more where
    the kernel takes pieces as narrow as `narrowest` (dK's with a score_mod: 64)."""
    widths = [width for width in (PIECE, PIECE // 2) if width >= narrowest]
    if pieces == 1 and head_dim <= PIECE or pieces > 1 and head_dim % pieces == 0 and head_dim // pieces in widths:
        return
    raise ValueError(f"pieces={pieces} at {head_dim=}: {kernel} takes pieces=1 up to head dim {PIECE}, above it "
                     f"pieces of {' or '.join(map(str, widths))} columns")
