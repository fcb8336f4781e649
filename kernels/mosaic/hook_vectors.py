"""Hook arrays the Mosaic GPU kernels hold as vectors along the sequence.

A captured array that a score_mod / mask_mod reads only as `array[i0, ..., q_idx]` or `array[..., kv_idx]`
(`_hooks.tile_reads`), with each leading index the hook's b, its h or a constant (a document mask's ids,
`ids[b, q_idx] == ids[b, kv_idx]`; a per-token bias `bias[b, kv_idx]`), travels as one `[B|1, N|1, L]`
vector per axis (`vectors_of`: L the padded T or S), by TMA beside Q or K, and each read gets its tile
broadcast from the vector (`VectorTiles.read_tile`) instead of a gather, which Mosaic GPU cannot lower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend import core as jex_core

from probjax_kernels._config import FlashConfig
from probjax_kernels._hooks import Hook, TileRead, tile_reads
from probjax_kernels.mosaic.common import mosaic_hook_shapes

AXES = ("q", "kv")


def read_spec(read: TileRead) -> tuple | None:
    """The leading indices of a read as the kernels take them: "b" / "h" where one is exactly the hook's b / h,
    an int where it is a constant; None where one is anything else (then the array stays out of the kernels)."""
    spec = []
    for atom, kind in zip(read.leading, read.kinds):
        if kind in ("b", "h"):
            spec.append(kind)
        elif isinstance(atom, int) or isinstance(atom, jex_core.Literal) and not jnp.shape(atom.val):
            spec.append(int(atom if isinstance(atom, int) else atom.val))
        else:
            return None
    return tuple(spec) if spec.count("b") <= 1 and spec.count("h") <= 1 else None


def vector_reads(jaxpr, consts) -> dict | None:
    """{equation number: TileRead} of the reads of `consts` that the kernels can serve from vectors, or None
    where two reads of one array along one axis differ in their leading indices or fill (one vector each)."""
    reads = {n: read for n, read in tile_reads(jaxpr, consts).items() if read_spec(read) is not None}
    seen = {}
    for read in reads.values():
        key, value = (read.const, read.axis), (read_spec(read), read.fill)
        if seen.setdefault(key, value) != value:
            return None
    return reads


def hook_specs(config: FlashConfig, with_score: bool) -> list[jax.ShapeDtypeStruct]:
    """The argument specs of a hook where the Mosaic forward calls it (`mosaic_hook_shapes`): (score,) b, h,
    q_idx, kv_idx."""
    return specs_at(mosaic_hook_shapes(config), with_score)


def specs_at(shapes: tuple, with_score: bool) -> list[jax.ShapeDtypeStruct]:
    """The argument specs (score,) b, h, q_idx, kv_idx of a hook at `shapes`, (b, h, q_idx, kv_idx, score)'s."""
    b, h, q_idx, kv_idx, score = shapes
    specs = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in (b, h, q_idx, kv_idx)]
    return [jax.ShapeDtypeStruct(score, jnp.float32), *specs] if with_score else specs


def _specs(config: FlashConfig, with_score: bool, shapes: tuple | None) -> list[jax.ShapeDtypeStruct]:
    """A hook's argument specs at `shapes` (the kernels' where they call it), else the Hopper forward's."""
    return hook_specs(config, with_score) if shapes is None else specs_at(shapes, with_score)


def vector_counts(hooks, config: FlashConfig, shapes: tuple | None = None) -> tuple[int, int]:
    """How many vectors the kernels hold for the `hooks` ((hook or None, with_score) pairs): along queries,
    along keys. `shapes`: where the kernels call the hooks (`specs_at`'s), else the Hopper forward's tiles."""
    vectors = set()  # (hook, array, axis): one vector however often the hook reads it
    for hook, with_score in hooks:
        if hook is not None:
            jaxpr = hook._jaxpr(_specs(config, with_score, shapes))
            reads = vector_reads(jaxpr, jaxpr.constvars) or {}
            vectors |= {(id(jaxpr), read.const, read.axis) for read in reads.values()}
    axes = [axis for *_, axis in vectors]
    return axes.count("q"), axes.count("kv")


def hook_arrays(hook: Hook | None, consts, config: FlashConfig, with_score: bool, batch: int, heads: int,
                lengths: dict[str, int], shapes: tuple | None = None) -> tuple[tuple, tuple]:
    """(arrays, axes): a hook's captured arrays `consts` as the kernels take them, each as it is or as its
    vectors along q_idx / kv_idx (`vectors_of`, at the padded lengths {"q": T, "kv": S}), and per array the
    axes of its vectors (the kernels' `score_vectors` / `mask_vectors`); `shapes` as in `vector_counts`."""
    if hook is None or not consts:
        return tuple(consts), ()
    jaxpr = hook._jaxpr(_specs(config, with_score, shapes))
    reads = vector_reads(jaxpr, jaxpr.constvars) or {}
    arrays, axes = [], []
    for var, const in zip(jaxpr.constvars, consts):
        mine = {read.axis: read for read in reads.values() if read.const is var}
        own = tuple(axis for axis in AXES if axis in mine)
        axes.append(own)
        arrays += [vectors_of(const, mine[axis], lengths[axis], batch, heads) for axis in own] or [const]
    return tuple(arrays), tuple(axes)


def vectors_of(const: jax.Array, read: TileRead, length: int, batch: int, heads: int) -> jax.Array:
    """`const` as the kernels hold it for `read`'s axis: `[B|1, N|1, length]` (b / h axes where the read's
    leading indices are b / h, 1 elsewhere; constants taken), positions 0 .. length-1 clamped past the array's
    last axis (or `fill`, as the read), in a 32-bit dtype."""
    spec = read_spec(read)
    kept = []
    for axis, index in reversed(list(enumerate(spec))):
        if isinstance(index, int):
            const = jnp.take(const, jnp.clip(index, 0, const.shape[axis] - 1), axis=axis)
        else:
            kept.insert(0, index)
    for kind, size in (("b", batch), ("h", heads)):  # clamped as the read's b / h, or broadcast
        if kind in kept:
            axis = kept.index(kind)
            if const.shape[axis] not in (1, size):
                const = jnp.take(const, jnp.minimum(jnp.arange(size), const.shape[axis] - 1), axis=axis)
        else:
            const, kept = const[None], [kind, *kept]
    if kept != ["b", "h"]:
        const = jnp.swapaxes(const, 0, 1)
    size = const.shape[-1]
    positions = jnp.arange(length)
    taken = jnp.take(const, jnp.minimum(positions, size - 1), axis=-1)
    if read.fill is not None:
        taken = jnp.where(positions < size, taken, jnp.asarray(read.fill, const.dtype))
    wide = jnp.int32 if jnp.issubdtype(taken.dtype, jnp.integer) or taken.dtype == jnp.bool_ else jnp.float32
    return taken.astype(wide)


@dataclasses.dataclass(frozen=True)
class VectorTiles:
    """A hook array inside a kernel step: `tiles[axis]()` gives the step's tile of it along "q" / "kv" (the
    vector in shared memory, loaded and broadcast to the hook's tile), cast back to the array's dtype."""

    tiles: dict[str, Callable[[], jax.Array]]

    def read_tile(self, read: TileRead, leading) -> jax.Array:
        del leading  # b / h are the kernel's own, the constants were taken in `vectors_of`
        return self.tiles[read.axis]().astype(read.const.aval.dtype)


def tile_of(view, layout, shape: tuple, dim: int) -> Callable[[], jax.Array]:
    """A hook vector's tile, loaded only when a read asks for it (nothing held in registers across the step):
    the vector `view` in shared memory, loaded in `layout`, broadcast along `dim` of `shape`."""
    return lambda: lax.broadcast_in_dim(plgpu.load(view, layout=layout), shape, [dim])


def grouped(flat_refs, axes: tuple) -> list:
    """Per captured array of a hook, from the kernel's flat refs: its global-memory ref, or {axis: ref} of the
    vectors it travels as (`axes`: per array, the axes of its vectors; () for every array: refs alone)."""
    refs = iter(flat_refs)
    return [next(refs) if not a else {axis: next(refs) for axis in a} for a in (axes or ((),) * len(flat_refs))]


def vectors_in(groups) -> list[tuple[str, object]]:
    """(axis, global-memory ref) of every vector of `grouped` arrays, in order."""
    return [(axis, ref) for group in groups if isinstance(group, dict) for axis, ref in group.items()]


def views(groups, tiles: list[Callable[[], jax.Array]]) -> list:
    """The arrays a hook gets inside a kernel step: refs as they are, vectors as `VectorTiles` whose tile along
    an axis is `tiles[n]()` for the n-th vector of `vectors_in(groups)`."""
    out, n = [], 0
    for group in groups:
        if isinstance(group, dict):
            out.append(VectorTiles({axis: tiles[n + i] for i, axis in enumerate(group)}))
            n += len(group)
        else:
            out.append(group)
    return out
