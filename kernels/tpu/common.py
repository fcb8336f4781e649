"""What the Mosaic TPU kernels share: how they read q, k, v (`SeqLayout`), the BlockSpecs of the optional
inputs, the float32 tile matmul and the score context of one tile. The tile walk is `walk.py`'s.

Layout. In place: when every head dim is 128, a program takes a block of heads of a tile of
rows straight from `[B, T, N, D]` (block (rows, heads, D): its last two dims are whole heads x a lane-aligned
head dim, so a legal TPU block with no copy in XLA) and loops over its heads, which share the program's walk
and each step's K / V blocks. Transposed: one head per program from the `[B, N, T, D]` transpose (head dims
of 64 or 256, per-head `BlockMask` tables, hook arrays read as tiles along a head index). Row vectors (lse, delta,
d lse, the row max) live in HBM as lane-dense `[B, N, 1, T]` rows either way (a `[B, N, T, 1]` column pads
each float32 to 128 lanes).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._linear import widest_manual_axis_type
from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels.tpu import chips, vet
from probjax_kernels.tpu.kernel_refs import (  # noqa: F401  (re-exported for the kernels)
    Refs, ScalarRef, Scalars, TileRefs, dot, head_tile, num_scalars, scalars_of, split_stages, store_head_tile,
    tile_context)
from probjax_kernels.tpu.walk import Walk, kv_walk, q_walk, run_step  # noqa: F401  (re-exported for the kernels)

M_INIT = float(jnp.finfo(jnp.float32).min)  # finite, so exp2(m_old - m_new) is never (-inf) - (-inf)
TPU_BACKENDS = ("tpu", "tpu_interpret")
MIN_TILE = 128  # lse / delta rows are lane vectors in the key-tile kernel: multiples of 128


def interpreted(problem: _Problem) -> bool:
    return problem.config.backend == "tpu_interpret"


def compute_dtype(dtype):
    """float16 runs as float32 inside the TPU kernels (the MXU and the v5e VPU have no float16)."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """How a kernel reads the core's `[B, T, N, D]` arrays and lays out its grid's head axis.

    `heads > 0` (in place): each program takes `heads` consecutive query heads (a multiple of 8: whole
    sublane tiles) of a tile of rows straight from `[B, T, N, D]`, as a (rows, heads, D) block, and loops over
    them; the grid's head axis counts head blocks. Their `heads // group` kv heads come the same way when
    they are a multiple of 8 too (`kv_in_place`), else from the `[B, K, S, D]` transpose as a
    (kv heads, rows, D) block (fewer heads on the sublanes of a tile stall Mosaic's compile). `heads == 0`
    (transposed): one head per program from the `[B, N, T, D]` transpose. Either way a kernel sees head
    `slot` of its block as a (rows, D) tile (`tile`, `store`) and its row vectors as (1, rows) rows."""

    heads: int = 0
    group: int = 1
    kv_in_place: bool = False
    strided: bool = True  # read a head of an in-place block as a strided load (TPU interpret mode cannot)

    @property
    def in_place(self) -> bool:
        return self.heads > 0

    @property
    def q_heads(self) -> int:
        """Query heads per program."""
        return max(self.heads, 1)

    @property
    def kv_heads(self) -> int:
        """Kv heads per program (in place; the transposed dK/dV grid takes one)."""
        return self.heads // self.group if self.in_place else 1

    def head(self, block, slot: int):
        """The query head of `slot` in head block `block`."""
        return block * self.q_heads + slot

    def kv_block(self, block):
        """The kv head block (in place) or kv head (transposed) that query head block `block` reads."""
        return block if self.in_place else block // self.group

    def kv_slot(self, slot: int) -> int:
        return slot // self.group if self.in_place else 0

    def _rows_major(self, kv: bool) -> bool:
        """Whether the array is read in place (rows before heads) rather than transposed."""
        return self.in_place and (self.kv_in_place or not kv)

    def view(self, x, kv: bool = False):
        """[B, T, N, D] (kv: [B, S, K, D]) -> the kernels' array."""
        return x if self._rows_major(kv) else jnp.swapaxes(x, 1, 2)

    def unview(self, x, kv: bool = False):
        """The kernels' array -> [B, T, N, D]."""
        return x if self._rows_major(kv) else jnp.swapaxes(x, 1, 2)

    def shape(self, batch: int, length: int, heads: int, dim: int, kv: bool = False) -> tuple[int, ...]:
        return (batch, length, heads, dim) if self._rows_major(kv) else (batch, heads, length, dim)

    def spec(self, rows: int, dim: int, where: Callable, kv: bool = False) -> pl.BlockSpec:
        """The block of `rows` x `dim` at `where(*grid ids, *scalar refs) = (batch, head block, tile)`, of the
        query heads' arrays or (`kv`) the kv heads' ones."""
        heads = (self.kv_heads if kv else self.q_heads) if self.in_place else None
        if self._rows_major(kv):
            def rows_map(*a):
                b, block, tile = where(*a)
                return b, tile, block, 0
            return pl.BlockSpec((None, rows, heads, dim), rows_map)

        def heads_map(*a):
            b, block, tile = where(*a)
            return b, block, tile, 0
        return pl.BlockSpec((None, heads, rows, dim), heads_map)

    def row_spec(self, rows: int, where: Callable) -> pl.BlockSpec:
        """The block of a lane-dense `[B, N, 1, T]` row vector (lse, delta) at `where(*a)`."""
        def index_map(*a):
            b, block, tile = where(*a)
            return b, block, 0, tile
        return pl.BlockSpec((None, self.q_heads if self.in_place else None, 1, rows), index_map)

    def tile(self, ref, slot: int, kv: bool = False):
        """Head `slot`'s (rows, D) tile of a block."""
        if not self.in_place:
            return ref[...]
        return ref[:, slot, :] if self._rows_major(kv) else ref[slot]

    def store(self, ref, slot: int, value, kv: bool = False) -> None:
        if not self.in_place:
            ref[...] = value
        elif self._rows_major(kv) and self.strided and jnp.dtype(ref.dtype).itemsize == 4 and ref.shape[2] == 128:
            rows, heads, dim = ref.shape  # Mosaic strides stores of 32 bits x 128 lanes only
            ref.reshape(rows * heads, dim)[pl.ds(slot, rows, stride=heads), :] = value
        elif self._rows_major(kv):
            ref[:, slot, :] = value
        else:
            ref[slot] = value

    def stage_shape(self, rows: int, dim: int, dtype, kv: bool = False) -> list:
        """The VMEM scratch `stage` copies an in-place block into: (heads, rows, dim), or none."""
        if not self._rows_major(kv):
            return []
        return [pltpu.VMEM((self.kv_heads if kv else self.q_heads, rows, dim), dtype)]

    def stage(self, ref, stage: list, kv: bool = False) -> None:
        """Copies an in-place (rows, heads, D) block to its (heads, rows, D) scratch, head by head at static
        indices (strided loads), so that the per-head math runs in a loop indexing heads dynamically: Mosaic
        takes no dynamic sublane index into a packed bfloat16 block, and 8 unrolled copies of the math compile
        about 10x slower than one."""
        for slot in range(stage[0].shape[0] if stage else 0):
            stage[0][slot] = self.load(ref, slot, kv)

    def read(self, ref, stage: list, slot, kv: bool = False):
        """Head `slot`'s (rows, D) tile: from the staged copy, the transposed block or the one-head block."""
        if not self.in_place:
            return ref[...]
        return stage[0][slot] if stage else ref[slot]

    def load(self, ref, slot: int, kv: bool = False):
        """Head `slot`'s (rows, D) tile of a block at a static slot, without a staged copy."""
        if not self.in_place:
            return ref[...]
        if not self._rows_major(kv):
            return ref[slot]
        rows, heads, dim = ref.shape
        if not self.strided or dim != 128:  # Mosaic strides a load of 128 lanes only
            return ref[:, slot, :]
        return ref.reshape(rows * heads, dim)[pl.ds(slot, rows, stride=heads), :]  # no shuffles, fast to compile

    def unstage(self, source, ref, kv: bool = False) -> None:
        """Writes each head's (rows, D) float32 tile of scratch `source` (heads, rows, D) to output block `ref`,
        cast to its dtype."""
        for slot in range(self.kv_heads if kv else self.q_heads):
            self.store(ref, slot, source[slot].astype(ref.dtype), kv)

    def for_heads(self, body: Callable, kv: bool = False) -> None:
        """body(slot) for each query head (kv: kv head) of the program, in a loop (one copy of its code)."""
        if not self.in_place:
            body(0)
            return
        count = self.kv_heads if kv else self.q_heads

        def step(slot, carry):
            body(slot)
            return carry
        lax.fori_loop(0, count, step, 0)

    def row(self, ref, slot: int):
        """Head `slot`'s (1, rows) row of a row-vector block."""
        return ref[slot] if self.in_place else ref[...]

    def store_row(self, ref, slot: int, value) -> None:
        if self.in_place:
            ref[slot] = value
        else:
            ref[...] = value


def kernel_vmem(kernel: str, heads: int, kv_heads: int, tile: tuple[int, int], head_dims: tuple[int, int],
                itemsize: int, tile_arrays: tuple[bool, ...] = ()) -> int:
    """Bytes of VMEM a kernel plans on (rows, keys) `tile` for `heads` query heads and `kv_heads` kv heads a
    program: its pipelined blocks (double-buffered), its float32 scratch (row statistics pad to 128 lanes) and
    a few float32 score tiles, the staged copies of its input blocks, and a double-buffered float32 (rows,
    keys) block of each dense array read or written as tiles (`tile_arrays`: whether each is per head, a
    block of `heads` tiles). `kernel`: "forward", "dq", "dkv" or "tangent"."""
    rows, keys = tile
    d, dv = head_dims
    q_side, kv_side, scratch = {
        "forward": (d + dv, d + dv, heads * rows * (dv + 256)),
        "dq": (2 * d + 2 * dv, d + dv, heads * rows * (d + 128)),
        "dkv": (d + dv, 2 * (d + dv), kv_heads * keys * (d + dv)),
        "tangent": (2 * d + 2 * dv, 2 * (d + dv), heads * rows * (dv + 128)),
    }[kernel]
    blocks = 2 * itemsize * (rows * heads * q_side + keys * kv_heads * kv_side)
    staging = blocks // 4  # the (heads, rows, D) copies of the in-place input blocks (`SeqLayout.stage`)
    arrays = sum(2 * 4 * rows * keys * (heads if per_head else 1) for per_head in tile_arrays)
    return blocks + staging + 4 * scratch + 4 * 4 * rows * keys + arrays


def seq_layout(problem: _Problem, num_heads: int, num_kv_heads: int, head_dims: tuple[int, int], dtype,
               kernel: str, tile: tuple[int, int], tile_consts: bool, budget: int,
               tile_arrays: tuple[bool, ...] = ()) -> SeqLayout:
    """The in-place layout when a kernel can read `[B, T, N, D]` without a copy: bfloat16 inputs, every head
    dim 128 (a lane block, which Mosaic reads one head of by a strided load; 256 compiles 25x slower), a head
    block of a multiple of 8 query heads (whole sublane tiles) and of the GQA group, one walk for all heads of
    a program (no per-head `BlockMask` tables), no hook array read as tiles along a head index (`tile_consts`:
    the transposed path serves those), and `kernel_vmem` within `budget` bytes on its (rows, keys) `tile`;
    else the transposed layout. float32 (and float16, which runs as float32) stays transposed: Mosaic's
    multi-pass float32 matmuls keep temporaries `kernel_vmem` does not model (8-head float32 blocks compiled
    to 35-44 MiB of VMEM on v5e / v5p against a modelled 24)."""
    group = num_heads // num_kv_heads
    transposed = SeqLayout(0, group)
    per_head_tables = problem.table_shape is not None and problem.table_shape[1] > 1
    if jnp.dtype(dtype) != jnp.bfloat16 or any(d != 128 for d in head_dims) or per_head_tables or tile_consts:
        return transposed
    for heads in range(8, num_heads + 1, 8):
        if num_heads % heads or heads % group:
            continue
        kv_heads = heads // group
        fits = kernel_vmem(kernel, heads, kv_heads, tile, head_dims, jnp.dtype(dtype).itemsize, tile_arrays) <= budget
        return SeqLayout(heads, group, kv_heads % 8 == 0) if fits else transposed
    return transposed


def kernel_layout(problem: _Problem, q, v, num_kv_heads: int, kernel: str, tile: tuple[int, int],
                  tile_grads: bool = False) -> SeqLayout:
    """`seq_layout` of a kernel on padded q `[B, T, N, D]`, v `[B|1, S, K, Dv]` with (rows, keys) `tile`,
    within 3/4 of the VMEM limit it asks of the target chip (`chips.Chip.vmem_limit`); `tile_grads`: the
    kernel accumulates gradients of hook arrays read as tiles (their per-head blocks need the transposed
    layout)."""
    f, cfg = problem.features, problem.config
    layouts = [*vet.const_layouts(f.score_mod, cfg, True), *vet.const_layouts(f.mask_mod, cfg, False)]
    head_tiles = any("h" in kinds for layout in layouts for _, kinds, _ in layout.tiles)
    budget = chips.target_chip(cfg.backend).vmem_limit * 3 // 4
    dense = [shape for shape in (problem.bias_shape, problem.mask_shape)
             if shape is not None and shape[2] > 1 and shape[3] > 1]
    tile_arrays = [shape[1] > 1 for shape in dense]
    if kernel == "dq" and problem.bias_shape in dense:  # dS, per head, when the bias gets a gradient
        tile_arrays.append(True)
    layout = seq_layout(problem, q.shape[2], num_kv_heads, (q.shape[3], v.shape[3]), q.dtype, kernel, tile,
                        head_tiles or tile_grads, budget, tuple(tile_arrays))
    return dataclasses.replace(layout, strided=cfg.backend != "tpu_interpret")


def as_rows(x):
    """[B, N, T] -> the lane-dense `[B, N, 1, T]` the kernels read."""
    return x[:, :, None, :]


def output(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A kernel output that varies over the `shard_map` axes its inputs vary over."""
    manual = widest_manual_axis_type([jax.typeof(x) for x in inputs])
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


def compiler_params(problem: _Problem, semantics: tuple[str, ...], layout: SeqLayout | None = None) -> dict:
    """Interpret mode, or the grid's semantics (and, for an in-place `layout`, the chip's raised VMEM limit)."""
    if interpreted(problem):
        return dict(interpret=pltpu.InterpretParams())
    limit = chips.target_chip(problem.config.backend).vmem_limit if layout is not None and layout.in_place else None
    return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit))


def scalar_inputs(problem: _Problem, q_len, kv_len, optional: dict, kind: str) -> list:
    inputs = [q_len.astype(jnp.int32), kv_len.astype(jnp.int32)]
    if problem.table_shape is not None:
        tables = optional["kv_tables"] if kind == "q" else optional["q_tables"]
        inputs += [t.astype(jnp.int32) for t in tables]
    return inputs


# -------------------------------------------------------------------------------------- optional inputs


def _smem_whole() -> pl.BlockSpec:
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def smem_array(x):
    """A hook array (float32 / int32: `vet.py`) or the dropout seed (uint32, bit-cast to int32 and back by
    `keep_mask`'s conversion) as SMEM takes it: 32-bit, at least 1-d."""
    x = jnp.asarray(x)
    if x.dtype == jnp.uint32:
        x = lax.bitcast_convert_type(x, jnp.int32)
    return x.reshape(1) if x.ndim == 0 else x


def optional_inputs(problem: _Problem, arrays: dict, kind: str, tile_maps: dict, lengths: tuple[int, int],
                    tangents: _Tangents | None = None, heads: int = 0):
    """(arrays, specs, to_refs) of the optional inputs on a query-tile ("q") or key-tile ("kv") grid.

    `tile_maps` maps "b", "h", "q", "kv" to functions of the grid ids (and scalar refs) giving the batch,
    query head, query tile and key tile a step reads; `lengths` are the padded (T, S). Query-tile grids see
    (bq, bk) tiles; the key-tile grid sees transposed (bk, bq) ones: its bias / mask arrive transposed
    `[B, N, S, T]`, its query segment ids as a row and its key segment ids as a column. Hook arrays read along
    q_idx / kv_idx arrive the same way, as the tile of their last axis (`vet.const_layouts`). `heads`: the
    query heads of a program in the in-place layout (`SeqLayout.heads`; "h" then maps to the head block), whose
    per-head bias / mask tiles arrive as one block (`head_tile`); 0 for one head per program.
    """
    bq, bk = problem.config.block_q, problem.config.block_k
    b_of, h_of, q_of, kv_of = tile_maps["b"], tile_maps["h"], tile_maps["q"], tile_maps["kv"]
    inputs, specs, fields = [], [], []
    if problem.has_segments:
        q_seg, kv_seg = arrays["q_segment_ids"].astype(jnp.int32), arrays["kv_segment_ids"].astype(jnp.int32)
        if kind == "q":
            inputs += [q_seg[:, :, None], kv_seg[:, None, :]]
            specs += [pl.BlockSpec((None, bq, 1), lambda *a: (b_of(*a), q_of(*a), 0)),
                      pl.BlockSpec((None, 1, bk), lambda *a: (b_of(*a), 0, kv_of(*a)))]
        else:
            inputs += [q_seg[:, None, :], kv_seg[:, :, None]]
            specs += [pl.BlockSpec((None, 1, bq), lambda *a: (b_of(*a), 0, q_of(*a))),
                      pl.BlockSpec((None, bk, 1), lambda *a: (b_of(*a), kv_of(*a), 0))]
        fields += ["q_segment_ids", "kv_segment_ids"]
    for name in ("bias", "mask"):
        if arrays.get(name) is not None:
            inputs.append(_broadcast_input(arrays[name], kind))
            specs.append(_broadcast_spec(arrays[name].shape, kind, bq, bk, tile_maps, heads))
            fields.append(name)
    if problem.features.dropout_rate > 0:
        inputs.append(smem_array(arrays["dropout_seed"]))
        specs.append(_smem_whole())
        fields.append("dropout_seed")
    f, cfg = problem.features, problem.config
    layouts = [*vet.const_layouts(f.score_mod, cfg, True), *vet.const_layouts(f.mask_mod, cfg, False)]
    holders = []  # per hook array: how `to_refs` rebuilds it from its refs

    def add_const(const, layout):
        holders.append(_const_inputs(const, layout, kind, tile_maps, lengths, (bq, bk), inputs, specs))

    for const, layout in zip((*arrays["score_consts"], *arrays["mask_consts"]), layouts):
        add_const(const, layout)
    if tangents is not None:
        if tangents.bias:
            inputs.append(_broadcast_input(arrays["d_bias"], kind))
            specs.append(_broadcast_spec(arrays["d_bias"].shape, kind, bq, bk, tile_maps, heads))
        moving = [layout for layout, moved in zip(layouts, tangents.score_consts) if moved]
        for const, layout in zip(arrays.get("d_score_consts", ()), moving):
            add_const(const, layout)
    num_score, num_mask = problem.num_score_consts, problem.num_mask_consts
    num_d = 0 if tangents is None else sum(tangents.score_consts)
    has_d_bias = tangents is not None and tangents.bias

    def to_refs(refs) -> Refs:
        refs = list(refs)
        values = {name: refs.pop(0) for name in fields}
        holder = iter(holders)
        const = lambda: next(holder)(refs)  # noqa: E731
        score = tuple(const() for _ in range(num_score))
        mask = tuple(const() for _ in range(num_mask))
        d_bias = refs.pop(0) if has_d_bias else None
        d_consts = tuple(const() for _ in range(num_d))
        assert not refs
        return Refs(**values, score_consts=score, mask_consts=mask, d_bias=d_bias, d_score_consts=d_consts)

    return inputs, specs, to_refs


def _const_inputs(const, layout, kind: str, maps: dict, lengths: tuple[int, int], blocks: tuple[int, int],
                  inputs: list, specs: list):
    """Appends the inputs of one hook array (an SMEM copy, and a VMEM copy per axis it is read along as
    tiles); returns the function that takes its refs off the front of a list and gives what the hook reads."""
    if not layout.tiles:
        inputs.append(smem_array(const))
        specs.append(_smem_whole())
        return (lambda refs: ScalarRef(refs.pop(0))) if jnp.ndim(const) == 0 else (lambda refs: refs.pop(0))
    if layout.smem:
        inputs.append(smem_array(const))
        specs.append(_smem_whole())
    tiles = []
    for axis, kinds, fill in layout.tiles:
        array, spec, column = _tile_input(const, axis, kinds, fill, kind, maps, lengths, blocks)
        inputs.append(array)
        specs.append(spec)
        tiles.append((axis, column, kinds, fill))
    shape = tuple(jnp.shape(const))

    def holder(refs):
        smem = refs.pop(0) if layout.smem else None
        return TileRefs(smem, {axis: (refs.pop(0), column, kinds, fill) for axis, column, kinds, fill in tiles},
                      shape)

    return holder


def _tile_input(const, axis: str, kinds: tuple, fill, kind: str, maps: dict, lengths: tuple[int, int],
                blocks: tuple[int, int]):
    """(array, BlockSpec, column) of a hook array `[*lead, L]` read as `array[..., q_idx]` (axis "q") or
    `[..., kv_idx]` ("kv"): its last axis taken at 0 .. T-1 (or S-1), clamped past L (or `fill`), as a
    `[*lead, T, 1]` column where the grid's tiles hold that index on the sublanes (the query axis of a
    query-tile kernel, the key axis of the key-tile kernel), else as a lane-dense `[*lead, 1, T]` row. The
    leading axes indexed exactly by b / h are selected by the BlockSpec (clamped, as the read), the others
    held whole."""
    taken = sequence_take(const, fill, lengths[0] if axis == "q" else lengths[1])
    column = (axis == "q") == (kind == "q")
    array = taken[..., None] if column else taken[..., None, :]
    tile = maps["q"] if axis == "q" else maps["kv"]
    lead = const.shape[:-1]

    def index_map(*a):
        index = [jnp.minimum(maps[k](*a), dim - 1) if k is not None else 0 for k, dim in zip(kinds, lead)]
        return (*index, tile(*a), 0) if column else (*index, 0, tile(*a))

    rows = blocks[0] if axis == "q" else blocks[1]
    lead_block = tuple(None if k is not None else dim for k, dim in zip(kinds, lead))
    block = (*lead_block, rows, 1) if column else (*lead_block, 1, rows)
    return array, pl.BlockSpec(block, index_map), column


def sequence_take(const, fill, length: int):
    """`const[..., 0 .. length-1]`, clamped past its last axis as the kernels' reads are (or `fill`)."""
    size = const.shape[-1]
    positions = jnp.arange(length)
    taken = jnp.take(const, jnp.minimum(positions, size - 1), axis=-1)
    if fill is not None:
        taken = jnp.where(positions < size, taken, jnp.asarray(fill, const.dtype))
    return taken


def _broadcast_input(x, kind: str):
    return x if kind == "q" else jnp.swapaxes(x, 2, 3)


def _broadcast_spec(shape, kind: str, bq: int, bk: int, maps: dict, heads: int = 0) -> pl.BlockSpec:
    """The BlockSpec of a [B|1, N|1, T|1, S|1] bias / mask (transposed to [.., S|1, T|1] on a "kv" grid); per
    head, a block of `heads` heads when a program takes several (`SeqLayout`)."""
    nb, nh, nt, ns = shape
    rows, cols = (bq if nt > 1 else 1, bk if ns > 1 else 1)
    row_of, col_of = maps["q"], maps["kv"]
    if kind != "q":
        rows, cols, row_of, col_of = cols, rows, col_of, row_of
    row_whole, col_whole = rows == 1, cols == 1

    def index_map(*a):
        return (maps["b"](*a) if nb > 1 else 0, maps["h"](*a) if nh > 1 else 0,
                0 if row_whole else row_of(*a), 0 if col_whole else col_of(*a))

    return pl.BlockSpec((None, heads if heads and nh > 1 else None, rows, cols), index_map)


# ------------------------------------------------------------------------------------------ step grid

# A flattened step is one int32 code: tile * 2**16 + step * 2 + last (tile and step under 2**15).
_TILE_SHIFT, _MAX_CODE_FIELD = 1 << 16, 1 << 15
# Most codes a flattened grid scalar-prefetches into SMEM (4 bytes each, 64 KiB; a larger grid keeps two axes).
MAX_FLAT_STEPS = 1 << 14


@dataclasses.dataclass(frozen=True)
class StepGrid:
    """The (tile, step) axes of a kernel's (B, head block, tile, step) grid: two axes of `num_tiles` x
    `num_steps`, or (`codes` set) one flattened "arbitrary" axis over the (tile, step) pairs a program may
    visit, in tile order, as scalar-prefetched int32 codes (tile * 2**16 + step * 2 + last). Kernels and index
    maps see (b, block, tile, step) either way; `last` marks a tile's last step, where its outputs are written.
    The flattened axis gives up the tile axis' "parallel" semantics (a megacore chip then splits only the batch
    and head-block axes)."""

    num_tiles: int
    num_steps: int
    codes: np.ndarray | None = None

    @property
    def flat(self) -> bool:
        return self.codes is not None

    @property
    def num_visits(self) -> int:
        """Grid steps a program runs on these axes."""
        return len(self.codes) if self.flat else self.num_tiles * self.num_steps

    def shape(self, *outer: int) -> tuple[int, ...]:
        return (*outer, len(self.codes)) if self.flat else (*outer, self.num_tiles, self.num_steps)

    def semantics(self, num_outer: int = 2) -> tuple[str, ...]:
        return ("parallel",) * num_outer + (("arbitrary",) if self.flat else ("parallel", "arbitrary"))

    def scalar_inputs(self) -> list:
        """The codes, first of the scalar-prefetched inputs (none on two axes)."""
        return [jnp.asarray(self.codes, jnp.int32)] if self.flat else []

    def ids(self, refs: tuple) -> tuple[tuple, tuple]:
        """((b, block, tile, step, last), the kernel's other refs) inside a kernel."""
        if not self.flat:
            b, block, tile, step = (pl.program_id(axis) for axis in range(4))
            return (b, block, tile, step, step == pl.num_programs(3) - 1), refs
        code = refs[0][pl.program_id(2)]
        tile, step, last = _decode(code)
        return (pl.program_id(0), pl.program_id(1), tile, step, last == 1), refs[1:]

    def spec(self, spec: pl.BlockSpec) -> pl.BlockSpec:
        """`spec` with its index map, written for (b, block, tile, step, *scalar refs), read off the codes."""
        if not self.flat or spec.index_map is None:
            return spec
        index_map = spec.index_map

        def flat_index_map(b, block, visit, codes_ref, *scalar_refs):
            tile, step, _ = _decode(codes_ref[visit])
            return index_map(b, block, tile, step, *scalar_refs)

        return dataclasses.replace(spec, index_map=flat_index_map)

    def specs(self, specs) -> list:
        return [self.spec(spec) for spec in specs]


def _decode(code):
    return code // _TILE_SHIFT, (code % _TILE_SHIFT) // 2, code % 2


def full_length_ranges(kind: str, tile: tuple[int, int], lengths: tuple[int, int], window, num_steps: int):
    """(lo, hi) per tile of `_tiles.kv_tile_range` (`kind` "q") or `q_tile_range` ("kv") at the full padded
    (T, S) `lengths`, in NumPy: static, with no device to evaluate jnp on (a deviceless compile has none)."""
    (bq, bk), (t_pad, s_pad), (left, right) = tile, lengths, window
    size, other, length = (bq, bk, t_pad) if kind == "q" else (bk, bq, s_pad)
    start = np.arange(length // size) * size
    end = np.minimum(start + size, length)
    if kind == "q":  # keys [start - left, end - 1 + right] of rows [start, end)
        first = np.zeros_like(start) if left is None else np.maximum(start - left, 0)
        stop = np.full_like(start, s_pad) if right is None else np.minimum(s_pad, end + right)
    else:  # rows [start - right, end - 1 + left] that see keys [start, end)
        first = np.zeros_like(start) if right is None else np.maximum(start - right, 0)
        stop = np.full_like(start, t_pad) if left is None else np.minimum(t_pad, end + left)
    hi = np.where((end > start) & (stop > first), -(-stop // other), 0)
    lo = np.minimum(first // other, hi)
    return np.minimum(lo, num_steps), np.minimum(hi, num_steps)


def step_grid(problem: _Problem, kind: str, lengths: tuple[int, int], num_steps: int, parallel_programs: int,
              head_steps: int = 1, every_step: bool = False, chip: chips.Chip | None = None) -> StepGrid:
    """The step axes of a kernel walking key tiles per query tile (`kind` "q": forward, dQ, tangent) or query
    tiles per key tile ("kv": dK/dV) over the padded (T, S) `lengths`, `num_steps` steps a tile (times
    `head_steps`: the transposed dK/dV walks the query heads of a group in turn, `num_steps` apart).

    Flattened when the static shapes leave idle steps (whose compute `walk` skips, but which each cost a grid
    step's fixed overhead: docs/perf-notes.md, TPU tile model): a tile visits at most the tiles of its range
    at the full lengths (shorter runtime lengths only shrink a range, `_tiles`), so only those are listed.
    Kept on two axes when nothing is idle, for a `BlockMask` (its tables' rows set the steps) or `every_step`
    (dQ writing every dS block), when the codes would not fit (`MAX_FLAT_STEPS`), and on a megacore chip
    whose `parallel_programs` (batch x head blocks) are odd: its second core would idle for a whole program,
    where the tile axis splits evenly. `chip`: the target's (`chips.target_chip`) unless given."""
    chip = chip or chips.target_chip(problem.config.backend)
    bq, bk = problem.config.block_q, problem.config.block_k
    t_pad, s_pad = lengths
    num_tiles = t_pad // bq if kind == "q" else s_pad // bk
    two_axes = StepGrid(num_tiles, head_steps * num_steps)
    if problem.table_shape is not None or every_step or (chip.megacore and parallel_programs % 2):
        return two_axes
    window = problem.features.window_left, problem.features.window_right
    lo, hi = full_length_ranges(kind, (bq, bk), lengths, window, num_steps)
    counts = np.maximum(hi - lo, 1)  # every tile's first step writes its outputs
    visits = int(counts.sum()) * head_steps
    if (visits >= num_tiles * num_steps * head_steps or visits > MAX_FLAT_STEPS
            or num_tiles > _MAX_CODE_FIELD or head_steps * num_steps > _MAX_CODE_FIELD):
        return two_axes
    codes = []
    for tile, count in enumerate(counts.tolist()):
        steps = [head * num_steps + step for head in range(head_steps) for step in range(count)]
        codes += [tile * _TILE_SHIFT + step * 2 + (n == len(steps) - 1) for n, step in enumerate(steps)]
    return StepGrid(num_tiles, head_steps * num_steps, np.asarray(codes, np.int32))
