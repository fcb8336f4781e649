"""Gradients of a score_mod's arrays read as tiles along q_idx / kv_idx (a per-token bias `bias[b, kv_idx]`,
`bias[h, q_idx]`: `vet.const_layouts`), accumulated in the backward kernels without atomics: reads along
kv_idx in the dK/dV kernel (per key tile, over the query tiles and the GQA group's heads it walks), reads
along q_idx in the dQ kernel (per query tile, over its key tiles). Each program writes its own float32 block
`[B, N, *whole, T, 1]` (whole: the leading axes the hook indexes by a computed scalar, accumulated at that
index in VMEM); XLA then sums the blocks over the batch and heads (into the leading index where it is
exactly b or h) and transposes the padding of `common._tile_input`. Deterministic: fixed sums, no races.

Other moving score_mod arrays (read at scalar indices, or also whole) keep the XLA pass over query chunks
(`_chunked._score_const_gradients`) that every backend uses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels.tpu import common, vet


@dataclasses.dataclass(frozen=True)
class TileGrad:
    """The gradient of score_mod array `index` from its reads along `axis` ("q" / "kv")."""

    index: int
    axis: str
    kinds: tuple  # per leading axis: "b" / "h" (the BlockSpec's b / h) or None (held whole)
    lead: tuple  # the leading dims

    @property
    def whole(self) -> tuple:
        return tuple(dim for kind, dim in zip(self.kinds, self.lead) if kind is None)


def tile_grads(problem: _Problem, tangents: _Tangents) -> tuple[TileGrad, ...]:
    """The moving score_mod arrays whose gradient the kernels accumulate: float32, read only as tiles (no
    SMEM reads), with clamped (not "fill") reads and at most one leading axis indexed by b and one by h."""
    hook = problem.features.score_mod
    if hook is None or not any(tangents.score_consts):
        return ()
    out = []
    layouts = vet.const_layouts(hook, problem.config, True)
    for index, (moving, layout, (shape, dtype)) in enumerate(zip(tangents.score_consts, layouts, hook.const_avals)):
        if not moving or layout.smem or not layout.tiles or jnp.dtype(dtype) != jnp.float32:
            continue
        if any(fill is not None or kinds.count("b") > 1 or kinds.count("h") > 1 for _, kinds, fill in layout.tiles):
            continue
        out += [TileGrad(index, axis, kinds, tuple(shape[:-1])) for axis, kinds, _ in layout.tiles]
    return tuple(out)


def computed(grads: tuple[TileGrad, ...]) -> set[int]:
    """The array positions whose whole gradient the kernels give (every axis they are read along is one)."""
    return {g.index for g in grads}


# ------------------------------------------------------------------------------------------- in the kernels


def outputs(grads, axis: str, shape_prefix: tuple, block_prefix: tuple, index_prefix, length: int, tile: int,
            varying) -> tuple[list, list, list]:
    """(out_shapes, out_specs, scratch_shapes) of the accumulators of the reads along `axis`: an output
    `[*shape_prefix, *whole, length, 1]` in blocks `(*block_prefix, *whole, tile, 1)` at
    `(*index_prefix(grid ids), 0.., tile index, 0)`, and a VMEM scratch of the block without squeezed dims."""
    shapes, specs, scratch = [], [], []
    for g in (g for g in grads if g.axis == axis):
        whole = g.whole
        shapes.append(common.output((*shape_prefix, *whole, length, 1), jnp.float32, *varying))
        specs.append(pl.BlockSpec((*block_prefix, *whole, tile, 1),
                                  lambda *a, w=len(whole): (*index_prefix(*a), *(0,) * w, a[2], 0)))
        scratch.append(pltpu.VMEM(tuple(d for d in (*block_prefix, *whole) if d is not None) + (tile, 1),
                                  jnp.float32))
    return shapes, specs, scratch


def accumulate(grads, axis: str, problem: _Problem, consts, accs, head, score, cotangent, ctx) -> None:
    """Adds this tile's contribution to each accumulator `accs` (aligned with the reads along `axis` in
    `grads`): the vjp of the score_mod in its tiles at `score` (before the hook) for `cotangent` = d loss /
    d score_mod(score); `head` indexes a leading group axis of the accumulators (dK/dV) or is None."""
    mine = [g for g in grads if g.axis == axis]
    if not mine:
        return
    hook = problem.features.score_mod
    found = hook.tile_cotangents(consts, tuple(g.index for g in mine), axis, cotangent, score, ctx.b, ctx.h,
                                 ctx.q_idx, ctx.kv_idx)
    for g, acc in zip(mine, accs):
        for index, read, leading, tile in found:
            if index != g.index:
                continue
            at = [] if head is None else [head]
            for value, kind, dim in zip(leading, g.kinds, g.lead):
                if kind is None:
                    at.append(jnp.clip(jnp.asarray(value, jnp.int32), 0, dim - 1))
            spot = (*at, slice(None), slice(None))
            acc[spot] = acc[spot] + tile.astype(jnp.float32).reshape(acc.shape[-2:])


def zero(accs) -> None:
    for acc in accs:
        acc[...] = jnp.zeros(acc.shape, jnp.float32)


def store(accs, out_refs) -> None:
    for acc, out in zip(accs, out_refs):
        out[...] = acc[...]


# ------------------------------------------------------------------------------------------------ in XLA


def finish(g: TileGrad, blocks, const, length: int):
    """d loss / d const from its accumulated blocks `[B, N, *whole, length, 1]`: summed over the batch and
    heads (into the leading index where the hook reads it at exactly b / h, clamped as the read), then the
    transpose of `common.sequence_take`."""
    batch, heads = blocks.shape[:2]
    letters = iter("cdefgijkmopqrstuvw")
    whole, out, operands, subscripts = [], [], [], []
    for kind, dim in zip(g.kinds, g.lead):
        if kind is None:
            letter = next(letters)
            whole.append(letter)
        else:
            letter = "x" if kind == "b" else "y"
            count = batch if kind == "b" else heads
            rows = jnp.minimum(jnp.arange(count), dim - 1)
            operands.append((rows[:, None] == jnp.arange(dim)[None, :]).astype(jnp.float32))
            subscripts.append(("B" if kind == "b" else "N") + letter)
        out.append(letter)
    spec = ",".join(["BN" + "".join(whole) + "L", *subscripts]) + "->" + "".join(out) + "L"
    summed = jnp.einsum(spec, blocks[..., 0], *operands, precision=lax.Precision.HIGHEST)
    _, transpose = jax.vjp(lambda c: common.sequence_take(c, None, length), const.astype(jnp.float32))
    (grad,) = transpose(summed)
    return grad.astype(const.dtype)
