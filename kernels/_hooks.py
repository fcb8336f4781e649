"""Running user hooks (score_mod / mask_mod) inside the Pallas kernels.

A hook is traced once to a jaxpr. The arrays it closes over (tables, slopes, document ids, also tracers of
an enclosing `jit`) become its constants, and the kernels receive them as ordinary inputs: a Pallas kernel
may not capture arrays. Inside a kernel those constants are refs, and neither GPU lowering has a value
gather, so `_eval_in_kernel` runs the hook's jaxpr with the constants kept as refs and turns the indexing
patterns that jnp emits (a pointwise `gather` whose index vector is a `concatenate` of `[..., 1]` pieces,
and `dynamic_slice`) into ref loads with array indices. Any other use of a constant loads it whole.
`tile_reads` finds the reads `array[i0, ..., q_idx]` / `array[..., kv_idx]` (leading indices scalars, the last
one exactly a hook index): a kernel that holds such an array as tiles along the sequence (the Mosaic TPU
kernels) gives the read its tile through the constant's `read_tile` instead, and skips the index arithmetic.
Outside the kernels (reference, block-mask construction, gradients of the constants) the same jaxpr is
evaluated on values with `jax.core.eval_jaxpr`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jex_core
from jax.tree_util import Partial

EXAMPLE_TILE = 16  # hooks are checked on a (16, 16) tile, the smallest the kernels use


@dataclasses.dataclass(frozen=True, eq=False)
class Hook:
    """A user hook traced at every argument shape it will be called with. Hashable by identity.

    A jaxpr is specialised to its argument shapes, and the kernels call a hook on (bq, bk) tiles while the
    XLA side calls it on 4-D index grids, so `prepare` traces it once per shape, in the caller's context.
    Later evaluations (kernel traces, the backward pass) reuse those jaxprs and never re-run the user's
    Python code, whose closure may hold tracers of the caller's transformations. The captured arrays are
    matched by position against the ones `trace_hook` returned (and passed to the kernels).
    """

    name: str
    fn: Callable
    const_avals: tuple[tuple[tuple[int, ...], Any], ...]
    jaxprs: dict = dataclasses.field(default_factory=dict)

    def prepare(self, *arg_specs: jax.ShapeDtypeStruct) -> None:
        key = _key(arg_specs)
        if key in self.jaxprs:
            return
        closed = jax.make_jaxpr(self.fn)(*arg_specs)
        avals = tuple((tuple(jnp.shape(c)), jnp.result_type(c)) for c in closed.consts)
        if avals != self.const_avals:
            raise ValueError(
                f"{self.name} closes over different arrays at different shapes ({avals} vs {self.const_avals}); "
                "create its arrays outside the function and close over them."
            )
        self.jaxprs[key] = closed.jaxpr

    def _jaxpr(self, args):
        key = _key(args)
        if key not in self.jaxprs:
            raise AssertionError(f"{self.name} was not prepared for argument shapes {key}.")
        return self.jaxprs[key]

    def on_values(self, consts, *args):
        """Evaluates the hook on arrays (XLA side), with `consts` in place of its captured arrays."""
        (result,) = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(self._jaxpr(args), list(consts)))(*args)
        return result

    def in_kernel(self, const_refs, *args):
        """Evaluates the hook inside a Pallas kernel, reading its captured arrays from `const_refs`."""
        jaxpr = self._jaxpr(args)
        env = {var: _RefValue(ref) for var, ref in zip(jaxpr.constvars, const_refs)}
        env.update(zip(jaxpr.invars, args))
        (result,) = _eval(jaxpr, env, _kernel_tile_reads(jaxpr, jaxpr.constvars, const_refs))
        return result


    def tile_cotangents(self, const_refs, wanted: tuple[int, ...], axis: str, cotangent, *args) -> list:
        """Inside a Pallas kernel, for a cotangent of the hook's output at `args`: (array position, TileRead,
        leading scalars, the tile's cotangent) of each tile read along `axis` of the captured arrays at
        positions `wanted` (the vjp of the hook in those tiles, the others held fixed)."""
        jaxpr = self._jaxpr(args)
        reads = _kernel_tile_reads(jaxpr, jaxpr.constvars, const_refs) or {}
        position = {var: i for i, var in enumerate(jaxpr.constvars)}
        chosen = sorted(n for n, read in reads.items() if position[read.const] in wanted and read.axis == axis)
        if not chosen:
            return []

        def run(tiles, record=None):
            env = {var: _RefValue(ref) for var, ref in zip(jaxpr.constvars, const_refs)}
            env.update(zip(jaxpr.invars, args))
            given = None if tiles is None else dict(zip(chosen, tiles))
            return _eval(jaxpr, env, reads, given=given, record=record)[0]

        record = {}
        run(None, record)  # the tiles and their leading scalars (the primal, also the vjp's)
        _, vjp = jax.vjp(run, [record[n][0] for n in chosen])
        (tile_cotangents,) = vjp(cotangent)
        return [(position[reads[n].const], reads[n], record[n][1], g) for n, g in zip(chosen, tile_cotangents)]

    def jvp_jaxpr(self, moved: tuple[bool, ...], *arg_specs) -> jex_core.ClosedJaxpr:
        """The jaxpr of `(consts, moving tangents, score, d_score, *indices) -> (hook(score), its tangent)` at
        `arg_specs` (score, *indices), for tangents of the captured arrays flagged in `moved`; traced once."""
        key = ("jvp", moved, _key(arg_specs))
        if key not in self.jaxprs:
            self._jaxpr(arg_specs)  # the primal must have been prepared at this shape

            def tangent(consts, d_consts, s, ds, *idx):
                def of_moving(s, moving):
                    it = iter(moving)
                    full = [next(it) if m else c for c, m in zip(consts, moved)]
                    return self.on_values(full, s, *idx)

                moving = [c for c, m in zip(consts, moved) if m]
                return jax.jvp(of_moving, (s, moving), (ds, list(d_consts)))

            specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.const_avals]
            d_specs = [s for s, m in zip(specs, moved) if m]
            specs_of_args = [jax.ShapeDtypeStruct(jnp.shape(a), a.dtype) for a in arg_specs]
            self.jaxprs[key] = jax.make_jaxpr(tangent)(
                specs, d_specs, specs_of_args[0], specs_of_args[0], *specs_of_args[1:]
            )
        return self.jaxprs[key]

    def jvp_in_kernel(self, const_refs, tangent_refs, moved: tuple[bool, ...], score, d_score, *indices):
        """(hook(score), its tangent) inside a Pallas kernel, for a score tangent `d_score` and tangents
        `tangent_refs` of the captured arrays flagged in `moved` (the others are held fixed)."""
        closed = self.jvp_jaxpr(moved, score, *indices)
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        refs = [*const_refs, *tangent_refs]
        env.update(zip(closed.jaxpr.invars, [*map(_RefValue, refs), score, d_score, *indices]))
        reads = _kernel_tile_reads(closed.jaxpr, closed.jaxpr.invars[: len(refs)], refs)
        value, tangent = _eval(closed.jaxpr, env, reads)
        return value, tangent


# PyTorch tensor methods that jax arrays lack, with the jnp spelling (hooks ported from PyTorch hit these).
TENSOR_METHODS = {
    "clamp": "jnp.clip(x, min, max)", "clamp_min": "jnp.maximum(x, min)", "clamp_max": "jnp.minimum(x, max)",
    "float": "x.astype(jnp.float32)", "half": "x.astype(jnp.float16)", "bfloat16": "x.astype(jnp.bfloat16)",
    "double": "x.astype(jnp.float64)", "int": "x.astype(jnp.int32)", "long": "x.astype(jnp.int32)",
    "bool": "x.astype(bool)", "to": "x.astype(dtype)", "type_as": "x.astype(y.dtype)", "abs": "jnp.abs(x)",
    "neg": "-x", "exp": "jnp.exp(x)", "log": "jnp.log(x)", "sqrt": "jnp.sqrt(x)", "tanh": "jnp.tanh(x)",
    "sigmoid": "jax.nn.sigmoid(x)", "floor": "jnp.floor(x)", "ceil": "jnp.ceil(x)", "where": "jnp.where(c, x, y)",
    "masked_fill": "jnp.where(mask, value, x)", "unsqueeze": "jnp.expand_dims(x, axis)",
    "expand": "jnp.broadcast_to(x, shape)", "remainder": "x % y", "fmod": "jnp.fmod(x, y)",
    "floor_divide": "x // y", "logical_and": "x & y", "logical_or": "x | y", "logical_not": "~x",
    "eq": "x == y", "ne": "x != y", "lt": "x < y", "le": "x <= y", "gt": "x > y", "ge": "x >= y",
    "new_ones": "jnp.ones(shape, dtype)", "new_zeros": "jnp.zeros(shape, dtype)", "new_tensor": "jnp.asarray(v)",
    "numel": "x.size", "dim": "x.ndim", "contiguous": "x", "detach": "jax.lax.stop_gradient(x)",
    "permute": "jnp.transpose(x, axes)", "flip": "jnp.flip(x, axis)",
}


@contextlib.contextmanager
def tensor_method_hint(name: str):
    """Turns the AttributeError of a PyTorch tensor method called on a jax array inside hook `name` into one
    that names the method and its jnp spelling (`x.clamp(0, 8)` -> `jnp.clip(x, 0, 8)`)."""
    try:
        yield
    except AttributeError as error:
        method, owner = getattr(error, "name", None), getattr(error, "obj", None)
        if method not in TENSOR_METHODS or not isinstance(owner, (jax.Array, jax.core.Tracer)):
            raise
        raise AttributeError(
            f"{name} calls the PyTorch tensor method .{method}(), which jax arrays do not have; write "
            f"{TENSOR_METHODS[method]} instead (hooks are written with jnp on jax arrays; docs/from_pytorch.md "
            "lists the translations)."
        ) from error


def _key(args) -> tuple:
    return tuple((tuple(jnp.shape(a)), jnp.dtype(a.dtype)) for a in args)


def trace_hook(name: str, fn: Callable, example_args) -> tuple[Hook, list[jax.Array], jax.ShapeDtypeStruct]:
    """Traces `fn(*example_args)`; returns the Hook, the arrays it closes over (to become kernel inputs, in
    order) and the shape / dtype of its result."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}.")
    try:
        with tensor_method_hint(name):
            closed = jax.make_jaxpr(fn)(*example_args)
    except (TypeError, jax.errors.JAXTypeError, jax.errors.JAXIndexError) as error:
        shapes = ", ".join(f"{jnp.dtype(a.dtype)}{list(jnp.shape(a))}" for a in example_args)
        raise TypeError(
            f"{name} could not be traced with array arguments ({shapes}); it must compute with jnp on arrays "
            f"and close over arrays only. The error was: {error}"
        ) from error
    if len(closed.out_avals) != 1:
        raise TypeError(f"{name} must return one array, got {len(closed.out_avals)} outputs.")
    consts = [jnp.asarray(c) for c in closed.consts]
    hook = Hook(name, fn, tuple((tuple(c.shape), c.dtype) for c in consts))
    hook.jaxprs[_key(example_args)] = closed.jaxpr
    out = closed.out_avals[0]
    return hook, consts, jax.ShapeDtypeStruct(out.shape, out.dtype)


def reads_argument(jaxpr, position: int) -> bool:
    """Whether the output of `jaxpr` depends on its input `position` (an argument the hook may ignore, such
    as b or h). Conservative: an equation with any dependent input makes all its outputs dependent."""
    dependent = {jaxpr.invars[position]}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jex_core.Literal) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return any(not isinstance(v, jex_core.Literal) and v in dependent for v in jaxpr.outvars)


def example_indices() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(b, h, q_idx, kv_idx) as the kernels pass them: int32 scalars, a (16, 1) column and a (1, 16) row."""
    i32 = jnp.int32
    return (
        jnp.zeros((), i32), jnp.zeros((), i32),
        jnp.zeros((EXAMPLE_TILE, 1), i32), jnp.zeros((1, EXAMPLE_TILE), i32),
    )


def trace_score_mod(score_mod: Callable) -> tuple[Hook, list[jax.Array]]:
    """`trace_hook` for a score_mod, which must return a score of its input's shape and dtype (float32)."""
    score = jnp.zeros((EXAMPLE_TILE, EXAMPLE_TILE), jnp.float32)
    hook, consts, out = trace_hook("score_mod", score_mod, (score, *example_indices()))
    if out.shape != score.shape or out.dtype != score.dtype:
        raise TypeError(
            f"score_mod must return a score of the input's shape and dtype, float32{list(score.shape)}; "
            f"it returned {out.dtype}{list(out.shape)} for that input."
        )
    return hook, consts


def broadcast_lookup(array: jax.Array, b, h, q_idx, kv_idx) -> jax.Array:
    """array[b, h, q_idx, kv_idx] for a `[B|1, N|1, T|1, S|1]` array (index 0 on broadcast axes)."""
    index = [i if size > 1 else 0 for i, size in zip((b, h, q_idx, kv_idx), array.shape)]
    return array[tuple(index)]


def _affine_score_mod(scale, bias, score_mod, score, b, h, q_idx, kv_idx):
    if scale is not None:
        score = score * scale
    if bias is not None:
        score = score + broadcast_lookup(bias, b, h, q_idx, kv_idx).astype(score.dtype)
    return score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)


def affine_score_mod(
    scale: jax.Array | None = None, bias: jax.Array | None = None, score_mod: Callable | None = None
) -> Partial:
    """The score_mod `score_mod(scale * score + bias[b, h, q_idx, kv_idx])` (None parts left out).

    A traced scale (a jit argument, a learnable temperature) cannot be compiled into the kernels, which then
    run with scale 1: as a 0-d float32 array that this hook closes over it multiplies the float32 scores
    inside them, exactly as a static scale would (folded into q it would be rounded to q's dtype), and
    receives its gradient as a hook array. A dense `bias` `[B|1, N|1, T|1, S|1]` moves into the hook with
    it (the kernels add their own bias before the score_mod, where it would be scaled); flex calls of
    `probjax_nn.attention` pass their bias this way too.
    """
    return Partial(_affine_score_mod, scale, bias, score_mod)


# ----------------------------------------------------------------------------------------- kernel evaluation


@dataclasses.dataclass(frozen=True)
class _RefValue:
    """A hook constant inside a kernel: a ref, loaded only where the hook reads it."""

    ref: Any

    def load(self):
        return self.ref[...]


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """An index vector `concatenate([p0[..., None], p1[..., None], ...], -1)` kept as its pieces."""

    pieces: tuple

    def materialize(self):
        return jnp.stack(self.pieces, axis=-1)


@dataclasses.dataclass(frozen=True)
class _Element:
    """A `dynamic_slice` of size 1 on every axis of a ref constant (`slopes[h]` with a scalar h): kept as the
    scalar it reads, so that a following squeeze needs no 1-element array (Mosaic GPU has none)."""

    value: Any
    ndim: int

    def materialize(self):
        return jnp.reshape(self.value, (1,) * self.ndim)


def _materialize(value):
    if isinstance(value, _RefValue):
        return value.load()
    if isinstance(value, (_Stacked, _Element)):
        return value.materialize()
    return value


def _eval(jaxpr, env: dict, reads: dict | None = None, given: dict | None = None, record: dict | None = None):
    """Evaluates `jaxpr` on `env`; `reads` (`tile_reads`) are given their tile by the constant's `read_tile`
    (or by `given`, {equation number: tile}; `record` receives {equation number: (tile, leading scalars)}),
    and the equations only they used (the index arithmetic) are skipped."""

    def read(atom):
        return atom.val if isinstance(atom, jex_core.Literal) else env[atom]

    live = live_equations(jaxpr, reads) if reads else None
    for n, eqn in enumerate(jaxpr.eqns):
        if live is not None and not live[n]:
            continue
        if reads and n in reads:
            tile_read = reads[n]
            leading = [read(a) if isinstance(a, (jex_core.Var, jex_core.Literal)) else a for a in tile_read.leading]
            if given is not None and n in given:
                tile = given[n]
            else:
                tile = env[tile_read.const].ref.read_tile(tile_read, leading)
            if record is not None:
                record[n] = (tile, leading)
            env[eqn.outvars[0]] = tile
            continue
        invals = [read(v) for v in eqn.invars]
        # Index vectors are stacked lazily: the concatenate that builds them has only plain inputs.
        special = eqn.primitive.name == "concatenate" or any(
            isinstance(x, (_RefValue, _Stacked, _Element)) for x in invals
        )
        outvals = _special_rule(eqn, invals) if special else None
        if outvals is None:
            invals = [_materialize(x) for x in invals]
            with eqn.ctx.manager:
                outvals = KERNEL_BINDS.get(eqn.primitive, eqn.primitive.bind)(
                    *invals, **eqn.primitive.get_bind_params(eqn.params))
            outvals = outvals if eqn.primitive.multiple_results else [outvals]
        env.update(zip(eqn.outvars, outvals))
    return [read(v) for v in jaxpr.outvars]


def _special_rule(eqn, invals):
    """Handles an equation that reads a ref constant or a stacked index vector, or returns None."""
    name = eqn.primitive.name
    params = eqn.params
    if name == "concatenate" and params["dimension"] == eqn.outvars[0].aval.ndim - 1:
        if all(not isinstance(x, _RefValue) and jnp.shape(_materialize(x))[-1] == 1 for x in invals):
            pieces = []
            for x in invals:
                pieces.extend(x.pieces if isinstance(x, _Stacked) else (lax.squeeze(x, (x.ndim - 1,)),))
            return [_Stacked(tuple(pieces))]
    if name == "convert_element_type" and isinstance(invals[0], _Stacked):
        dtype = params["new_dtype"]
        return [_Stacked(tuple(p.astype(dtype) for p in invals[0].pieces))]
    if name == "gather" and isinstance(invals[0], _RefValue):
        return _gather_from_ref(invals[0].ref, invals[1], params)
    if name == "dynamic_slice" and isinstance(invals[0], _RefValue):
        ref = invals[0].ref
        starts = [jnp.clip(s, 0, dim - size) for s, dim, size in zip(invals[1:], ref.shape, params["slice_sizes"])]
        if all(size == 1 for size in params["slice_sizes"]):
            return [_Element(ref[tuple(starts)], len(starts))]
        return [ref[tuple(pl.ds(s, size) for s, size in zip(starts, params["slice_sizes"]))]]
    if name == "squeeze" and isinstance(invals[0], _Element) and len(params["dimensions"]) == invals[0].ndim:
        return [invals[0].value]
    if name in ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "remat", "checkpoint"):
        inner = params.get("jaxpr") or params.get("call_jaxpr")
        closed = inner if hasattr(inner, "consts") else jex_core.ClosedJaxpr(inner, ())
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        env.update(zip(closed.jaxpr.invars, invals))
        return _eval(closed.jaxpr, env)
    return None


def _gather_from_ref(ref, indices, params):
    """A pointwise gather (every slice size 1) from a ref constant, as one ref load with array indices."""
    dims = params["dimension_numbers"]
    if params["slice_sizes"] != (1,) * len(ref.shape) or dims.offset_dims or dims.operand_batching_dims:
        return None
    if isinstance(indices, _Stacked):
        pieces = indices.pieces
    else:
        indices = _materialize(indices)
        if indices.shape[-1] != 1:
            return None
        pieces = (lax.squeeze(indices, (indices.ndim - 1,)),)
    index = [0] * len(ref.shape)
    for piece, axis in zip(pieces, dims.start_index_map):
        index[axis] = piece
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in index))
    # Out-of-range indices (padding rows and keys) read a clamped element; every mode but "fill" agrees.
    clamped = [jnp.broadcast_to(jnp.clip(i, 0, dim - 1), shape) for i, dim in zip(index, ref.shape)]
    value = ref[tuple(clamped)]
    if params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        in_bounds = jnp.ones(shape, jnp.bool_)
        for i, dim in zip(index, ref.shape):
            in_bounds &= (i >= 0) & (i < dim)
        fill = params["fill_value"]
        if fill is None:
            fill = jnp.nan if jnp.issubdtype(value.dtype, jnp.inexact) else jnp.iinfo(value.dtype).min
        value = jnp.where(in_bounds, value, jnp.asarray(fill, value.dtype))
    return [value]


# ----------------------------------------------------------------------------------------- tile reads


@dataclasses.dataclass(frozen=True)
class TileRead:
    """A read `array[i0, ..., q_idx]` (axis "q") or `array[..., kv_idx]` (axis "kv") of a captured array: the
    last index exactly the hook's q_idx / kv_idx, the leading ones scalars. `leading` holds their jaxpr atoms
    (or the int 0 for an axis the gather leaves at 0), `kinds` "b" / "h" where one is exactly the hook's b / h
    (else None), `fill` the value of out-of-range reads of a "fill" gather (None: clamped, as every other mode
    of an in-kernel read)."""

    const: Any
    axis: str
    leading: tuple
    kinds: tuple
    fill: Any = None


def tile_reads(jaxpr, consts) -> dict:
    """{equation number: TileRead} of the gathers of `jaxpr` that read one of `consts` (its captured arrays'
    vars) as `array[scalars..., q_idx]` / `[..., kv_idx]`, in the pattern jnp emits: each index normalised
    for negative values (`select_n(i < 0, i, i + n)`, a no-op for the kernels' non-negative indices), the
    scalars broadcast and stacked with the sequence index by a `concatenate`. The jaxpr's last four inputs
    are b, h, q_idx, kv_idx. Top-level equations only (a read inside a sub-jaxpr is not one)."""
    consts = set(consts)
    b, h, q, kv = jaxpr.invars[-4:]
    tags = {b: ("scalar", b, "b"), h: ("scalar", h, "h"), q: ("idx", "q"), kv: ("idx", "kv")}
    index_shapes = {"q": q.aval.shape, "kv": kv.aval.shape}

    def tag(atom):
        if isinstance(atom, jex_core.Literal):
            return ("scalar", atom, None) if not jnp.shape(atom.val) else None
        if atom in tags:
            return tags[atom]
        if not atom.aval.shape and atom not in consts:  # any other 0-d value is a scalar index
            return ("scalar", atom, None)
        return None

    reads = {}
    for n, eqn in enumerate(jaxpr.eqns):
        name, ins = eqn.primitive.name, [tag(v) for v in eqn.invars]
        first, out = ins[0] if ins else None, eqn.outvars[0] if eqn.outvars else None
        result = None
        if name == "gather" and eqn.invars[0] in consts:
            read = _tile_read(eqn, ins[1], index_shapes)
            if read is not None:
                reads[n] = read
        elif first is None:
            continue
        elif name == "lt" and _is_zero(eqn.invars[1]) and (first[0] == "idx" or first[0] == "scalar" and first[2]):
            result = ("false",)  # b, h, q_idx and kv_idx are never negative
        elif name == "select_n" and len(ins) == 3 and first == ("false",):
            result = ins[1]
        elif name == "convert_element_type" and not jnp.issubdtype(eqn.params["new_dtype"], jnp.integer):
            pass
        elif name in ("broadcast_in_dim", "reshape", "squeeze", "convert_element_type"):
            if first[0] == "scalar":
                result = first if not out.aval.shape else ("uniform", first[1], first[2])
            elif first[0] in ("uniform", "stack") or out.aval.size == eqn.invars[0].aval.size:
                result = None if first[0] == "stack" and name != "convert_element_type" else first
        elif name == "concatenate" and eqn.params["dimension"] == out.aval.ndim - 1 and all(
                v.aval.shape[-1] == 1 for v in eqn.invars):
            pieces = []
            for t in ins:
                pieces.extend(t[1] if t is not None and t[0] == "stack" else (t,))
            result = ("stack", tuple(pieces))
        if result is not None:
            tags[out] = result
    return reads


def _is_zero(atom) -> bool:
    return isinstance(atom, jex_core.Literal) and not jnp.shape(atom.val) and atom.val == 0


def _tile_read(eqn, index, index_shapes) -> TileRead | None:
    """The TileRead of a gather from a captured array with index tag `index`, or None."""
    dims, operand = eqn.params["dimension_numbers"], eqn.invars[0].aval
    if index is None or eqn.params["slice_sizes"] != (1,) * operand.ndim or dims.offset_dims or (
            dims.operand_batching_dims):
        return None
    if index[0] == "stack":
        pieces = index[1]
    elif eqn.invars[1].aval.shape[-1] == 1:
        pieces = (index,)
    else:
        return None
    if len(pieces) != len(dims.start_index_map):
        return None
    per_axis = [("scalar", 0, None)] * operand.ndim
    for piece, axis in zip(pieces, dims.start_index_map):
        per_axis[axis] = piece
    *leading, last = per_axis
    if last is None or last[0] != "idx" or eqn.outvars[0].aval.shape != index_shapes[last[1]]:
        return None
    if any(t is None or t[0] not in ("scalar", "uniform") for t in leading):
        return None
    fill = None
    if eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        fill = eqn.params["fill_value"]
        if fill is None:
            dtype = operand.dtype
            fill = jnp.nan if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min
    kinds = tuple(None if fill is not None else t[2] for t in leading)
    return TileRead(eqn.invars[0], last[1], tuple(t[1] for t in leading), kinds, fill)


def live_equations(jaxpr, reads: dict) -> list[bool]:
    """Which equations of `jaxpr` its outputs need when the `reads` (`tile_reads`) take only their leading
    scalars: the index vectors they would gather with are dead."""
    needed = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    live = [False] * len(jaxpr.eqns)
    for n in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[n]
        if not eqn.effects and not any(v in needed for v in eqn.outvars):
            continue
        live[n] = True
        uses = reads[n].leading if n in reads else eqn.invars
        needed.update(v for v in uses if isinstance(v, jex_core.Var))
    return live


def _kernel_tile_reads(jaxpr, const_vars, const_refs) -> dict | None:
    """The `tile_reads` of the constants that a kernel holds as tiles (refs with `read_tile`), or None."""
    tiled = [var for var, ref in zip(const_vars, const_refs) if hasattr(ref, "read_tile")]
    if not tiled:
        return None
    return {n: read for n, read in tile_reads(jaxpr, const_vars).items() if read.const in tiled}


def tile_hook_shapes(block_q: int, block_k: int, transposed: bool = False) -> tuple:
    """(b, h, q_idx, kv_idx, score) shapes a hook sees on a (block_q, block_k) score tile, or on the transposed
    (block_k, block_q) tile K Q^T of a dK/dV kernel that computes it so (Mosaic TPU; Triton on Hopper)."""
    if transposed:
        return (), (), (1, block_q), (block_k, 1), (block_k, block_q)
    return (), (), (block_q, 1), (1, block_k), (block_q, block_k)


@contextlib.contextmanager
def hook_hint(name: str):
    """`tensor_method_hint`, and Python control flow on the array arguments of hook `name` (`True if q_idx >
    kv_idx else False`, `and`, `not`): NumPy's "truth value of an array ... is ambiguous" (eager index grids,
    traced tiles) or jax's TracerBoolConversionError (scalars under jit) becomes the TypeError that
    docs/flex_attention.md lists. Wraps the first evaluation of a hook on each path."""
    try:
        with tensor_method_hint(name):
            yield
    except (ValueError, jax.errors.TracerBoolConversionError) as error:
        if isinstance(error, ValueError) and "truth value of an array" not in str(error):
            raise
        raise TypeError(
            f"{name} could not be traced with array arguments: it uses Python control flow (if / else, and, or, "
            "not, bool()) on its arguments, which are arrays (a tile of scores and index grids that broadcast "
            "against each other), not Python scalars; write it with jnp.where, &, | and ~. The error was: "
            f"{error}"
        ) from error


def _soft_capped(cap, score_mod, score, b, h, q_idx, kv_idx):
    if score_mod is not None:
        score = score_mod(score, b, h, q_idx, kv_idx)
    return cap * jnp.tanh(score / cap)  # probjax_kernels.softcap's


def soft_capped(score_mod: Callable | None, cap: float | None) -> Callable | None:
    """`score_mod` followed by the soft cap `cap * tanh(score / cap)` (a checked `logits_soft_cap`), as one
    score_mod: how `flash_attention` and `probjax_nn.attention` run `logits_soft_cap` in the kernels.
    `score_mod` itself without a cap."""
    return score_mod if cap is None else Partial(_soft_capped, cap, score_mod)


def flash_hook_shapes(config, transposed: bool = False) -> list[tuple]:
    """The (b, h, q_idx, kv_idx, score) shapes at which the forward, dQ and dK/dV kernels on `config`'s tiles (a
    `FlashConfig`) call the hooks; with `transposed` also the dK/dV kernel's (keys, queries) tile K Q^T (Mosaic
    TPU always, Triton on Hopper)."""
    shapes = [tile_hook_shapes(bq, bk) for bq, bk in (
        (config.block_q, config.block_k), (config.block_q_dq, config.block_k_dq),
        (config.block_q_dkv, config.block_k_dkv))]
    if transposed:
        shapes.append(tile_hook_shapes(config.block_q_dkv, config.block_k_dkv, transposed=True))
    return shapes


def _integer_pow(x, *, y: int):
    """x ** y, a power under -1 as 1 / x ** -y: Mosaic GPU's rule takes y >= 2 and y = -1 only (a soft cap's
    derivative in its cap holds cap ** -2)."""
    return 1 / lax.integer_pow(x, -y) if y < -1 else lax.integer_pow_p.bind(x, y=y)


# How the kernels bind some primitives of the hooks' jaxprs, for Mosaic GPU's rules: a jvp's sum of two tangents
# (`add_any`, which it has no rule for) as an add, as Triton's rules lower it; negative powers by `_integer_pow`.
KERNEL_BINDS = {jex_core.primitives.add_jaxvals_p: lax.add_p.bind, lax.integer_pow_p: _integer_pow}
