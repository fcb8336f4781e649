"""What runs inside the Mosaic TPU kernels' bodies (and their index maps): the float32-accumulated tile
matmul, the scalar-prefetched refs (`Scalars`), the staged scratch, the per-head tiles of optional inputs and
the score context of one tile. Nothing here runs before a `pallas_call` traces its kernel."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax

from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._scores import _ScoreContext


@dataclasses.dataclass(frozen=True)
class Refs:
    """Refs of one program's optional inputs (None / empty when absent)."""

    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    bias: Any = None
    mask: Any = None
    dropout_seed: Any = None
    score_consts: tuple = ()
    mask_consts: tuple = ()
    d_bias: Any = None
    d_score_consts: tuple = ()


@dataclasses.dataclass(frozen=True)
class TileRefs:
    """A hook array held as VMEM tiles along q_idx / kv_idx (`common._tile_input`), with an SMEM copy for its scalar
    reads when it has any: `_hooks` gives a `TileRead` its tile through `read_tile`."""

    smem: Any
    tiles: dict  # axis -> (ref, column, kinds, fill)
    shape: tuple

    def __getitem__(self, index):
        return self.smem[index]

    def read_tile(self, read, leading):
        """The (tile, 1) column or (1, tile) row of `read` (`_hooks.TileRead`), at the leading scalars."""
        ref, _, kinds, _ = self.tiles[read.axis]
        index, in_bounds = [], True
        for value, kind, dim in zip(leading, kinds, self.shape[:-1]):
            if kind is None:  # held whole: a dynamic index on an untiled axis
                index.append(jnp.clip(jnp.asarray(value, jnp.int32), 0, dim - 1))
                in_bounds = in_bounds & (value >= 0) & (value < dim)
        tile = ref[(*index, slice(None), slice(None))]
        if read.fill is not None and index:
            tile = jnp.where(in_bounds, tile, jnp.asarray(read.fill, tile.dtype))
        return tile


@dataclasses.dataclass(frozen=True)
class ScalarRef:
    """A 0-d hook array, stored as a 1-element SMEM ref: reads give the scalar, as the hook's jaxpr expects."""

    ref: Any
    shape: tuple = ()

    def __getitem__(self, index):
        return self.ref[0]


def dot(a, b, contract: tuple[int, int]):
    """A float32-accumulated tile matmul. float32 operands at HIGHEST (exact products), bfloat16 at DEFAULT:
    Mosaic TPU rejects a bfloat16 matmul at HIGHEST ("Bad lhs type")."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Scalars:
    """The scalar-prefetched refs: lengths `[B]`, and a `BlockMask`'s tables (kv tables for query-tile
    kernels, q tables for the key-tile kernel)."""

    q_len: Any
    kv_len: Any
    tables: tuple | None = None
    q_tables: tuple | None = None


def scalars_of(problem: _Problem, refs: list, kind: str) -> Scalars:
    q_len, kv_len, *tables = refs
    if not tables:
        return Scalars(q_len, kv_len)
    return Scalars(q_len, kv_len, tables=tuple(tables)) if kind == "q" else Scalars(q_len, kv_len,
                                                                                   q_tables=tuple(tables))


def num_scalars(problem: _Problem) -> int:
    return 2 + (4 if problem.table_shape is not None else 0)


def split_stages(refs: list, counts: tuple[int, ...]) -> tuple[list, list]:
    """(the other refs, [the staged scratch of each count]) of a kernel whose scratch list ends with staging
    buffers (`SeqLayout.stage_shape`), `counts` of them per staged array (0 or 1)."""
    total = sum(counts)
    others, staged = list(refs[:len(refs) - total]), list(refs[len(refs) - total:])
    out = []
    for count in counts:
        out.append(staged[:count])
        staged = staged[count:]
    return others, out


def store_head_tile(ref, slot: int, value) -> None:
    """Writes head `slot`'s tile of an output block laid out as `head_tile` reads one."""
    if len(ref.shape) == 3:
        ref[slot] = value
    else:
        ref[...] = value


def head_tile(ref, slot: int):
    """An optional input's tile for head `slot`: per-head blocks hold one (rows, keys) tile per head of the
    program (in place), shared ones a single tile."""
    return ref[slot] if len(ref.shape) == 3 else ref[...]


def tile_context(refs: Refs, problem: _Problem, b, h, q_start, kv_start, kv_len, transposed: bool,
                 tangents: _Tangents | None = None, slot: int = 0) -> _ScoreContext:
    """The score context of tile (q_start:+bq, kv_start:+bk) of head h, the program's head `slot`: (bq, 1) /
    (1, bk) indices, or (1, bq) / (bk, 1) in the key-tile kernel (`transposed`), whose scores are k q^T."""
    bq, bk = problem.config.block_q, problem.config.block_k
    f = problem.features
    if transposed:
        q_idx = q_start + lax.broadcasted_iota(jnp.int32, (1, bq), 1)
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    else:
        q_idx = q_start + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    seed = None
    if refs.dropout_seed is not None:
        seed = refs.dropout_seed[0] if f.dropout_positions is None else tuple(
            refs.dropout_seed[i] for i in range(refs.dropout_seed.shape[0]))
    return _ScoreContext(
        b=b,
        h=h,
        q_idx=q_idx,
        kv_idx=kv_idx,
        kv_len=kv_len,
        bias=None if refs.bias is None else head_tile(refs.bias, slot),
        mask=None if refs.mask is None else head_tile(refs.mask, slot).astype(jnp.int32),
        q_seg=None if refs.q_segment_ids is None else refs.q_segment_ids[...],
        kv_seg=None if refs.kv_segment_ids is None else refs.kv_segment_ids[...],
        dropout_seed=seed,
        score_mod=None if f.score_mod is None else functools.partial(f.score_mod.in_kernel, refs.score_consts),
        mask_mod=None if f.mask_mod is None else functools.partial(f.mask_mod.in_kernel, refs.mask_consts),
        d_bias=None if refs.d_bias is None else head_tile(refs.d_bias, slot),
        score_mod_jvp=None if f.score_mod is None or tangents is None else functools.partial(
            f.score_mod.jvp_in_kernel, refs.score_consts, refs.d_score_consts, tangents.score_consts),
    )
