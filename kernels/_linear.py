"""`custom_linear`: a linear map with a fast implementation, a fast transpose and a differentiable reference.

Forward-mode autodiff of the attention kernels needs a tangent map `t -> T(r, t)` (linear in t) that
  - runs as a Pallas kernel when applied (`jax.jvp`),
  - transposes to the existing backward kernels (`jax.grad` through `jax.linearize`),
  - batches (`jax.jacfwd`, `jax.vmap`), and
  - can itself be differentiated in the residuals r (`jax.grad` of a `jax.jvp`, `jax.hessian`).
`jax.custom_derivatives.linear_call` has the first two but neither a batching rule nor a derivative in its
residuals, so this module defines a primitive that has all four. Derivatives in r (second order) come from
`reference`, a plain-jnp function equal to `apply`; they are the only place it runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax._src import api_util  # tracing at given avals (`_effects`) has no public name
from jax._src import core as jax_src_core  # get_cur_mesh_sharding has no public name
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

# A flat linear map: f(residuals: list, linear: list) -> list of outputs, linear in `linear`.
FlatMap = Callable[[list, list], list]


@dataclasses.dataclass(frozen=True, eq=False)
class _Maps:
    """The four views of one linear map (hashable by identity, so it can be a primitive parameter).

    `apply` and `reference` compute y = A(r) t; `transpose` and `transpose_reference` compute A(r)^T y.
    `out_avals` are the outputs of `apply`; `in_avals` those of `transpose` (the avals of t).
    """

    apply: FlatMap
    transpose: FlatMap
    reference: FlatMap
    transpose_reference: FlatMap
    out_avals: tuple
    in_avals: tuple
    interpreted: bool  # its maps may have effects (`_effects`)

    def transposed(self) -> _Maps:
        return _Maps(self.transpose, self.apply, self.transpose_reference, self.reference, self.in_avals,
                     self.out_avals, self.interpreted)


custom_linear_p = jex_core.Primitive("probjax_custom_linear")
custom_linear_p.multiple_results = True


def custom_linear(
    apply: FlatMap, transpose: FlatMap, reference: FlatMap, residuals: Sequence, linear: Sequence,
    out_specs: Sequence[jax.ShapeDtypeStruct], interpreted: bool = False,
) -> list:
    """y = apply(residuals, linear), a map linear in `linear`, with every transformation defined.

    - `apply(residuals, linear)` -> list of arrays shaped like `out_specs`; the fast implementation.
    - `transpose(residuals, cotangents)` -> list shaped like `linear`: the transpose (fast backward).
    - `reference(residuals, linear)`: equal to `apply`, written in differentiable jnp; used only for
      derivatives in `residuals` and their transposes.
    - `interpreted`: `apply` / `transpose` run kernels in a Pallas interpreter, whose ordered callbacks are
      effects that a `jit` must thread through this primitive: they are found by tracing each map once when
      it is bound (compiled kernels have none, and skip that trace).
    All arguments and results are flat lists of arrays.
    """
    residuals, linear = list(residuals), list(linear)
    # Inside `jax.shard_map` (with its varying-axes checks) every output varies over the axes any input
    # varies over (`_abstract_eval`), and so do the cotangents of the linear inputs. A linear input that
    # varies over fewer axes is cast to vary over them here: JAX transposes that cast into the psum that its
    # cotangent needs, so `transpose` returns per-device parts for it and never sums over devices itself.
    axes = widest_manual_axis_type([jax.typeof(x) for x in (*residuals, *linear)]).varying
    linear = [_vary(x, axes) for x in linear]
    in_avals = tuple(_aval(x) for x in linear)

    def transpose_reference(res, cts):
        transposed = jax.linear_transpose(lambda *lin: reference(res, list(lin)), *in_avals)
        return list(transposed(list(cts)))

    maps = _Maps(apply, transpose, reference, transpose_reference, tuple(map(_aval, out_specs)), in_avals,
                 interpreted)
    return custom_linear_p.bind(*residuals, *linear, maps=maps, num_res=len(residuals))


def _aval(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)


def _vary(x, axes):
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def widest_manual_axis_type(avals):
    """The manual axis type of the aval that varies over the most mesh axes: what an output computed from
    all of `avals` varies over inside `jax.shard_map` (outside one, no axis varies)."""
    return max((a.manual_axis_type for a in avals), key=lambda t: len(t.varying))


def _impl(*args, maps: _Maps, num_res: int):
    return maps.apply(list(args[:num_res]), list(args[num_res:]))


def _abstract_eval(*avals, maps: _Maps, num_res: int):
    del num_res
    manual = widest_manual_axis_type(avals)
    sharding = jax_src_core.get_cur_mesh_sharding()  # what pallas_call gives its outputs, too
    outs = [jax.core.ShapedArray(a.shape, a.dtype, sharding=sharding, manual_axis_type=manual)
            for a in maps.out_avals]
    return outs, _effects(maps, avals)


def _effects(maps: _Maps, avals) -> set:
    """The effects of `maps.apply` at the bound arguments' `avals`: the Pallas interpreters run kernels through
    ordered IO callbacks, and a `jit` can only thread their token through this primitive when it declares
    them. Traced once per map, and only for interpreted maps (compiled kernels have none)."""
    if not maps.interpreted:
        return set()
    if not hasattr(maps, "effects"):
        # Traced at the avals themselves, in the caller's context (inside `jax.shard_map`, the branches of
        # the maps must agree on the avals' manual axis types, which a `jax.make_jaxpr` would drop).
        num_res = len(avals) - len(maps.in_avals)

        def flat(*args):
            return maps.apply(list(args[:num_res]), list(args[num_res:]))

        debug = api_util.debug_info("custom_linear", flat, avals, {})
        jaxpr, _, _ = pe.trace_to_jaxpr_dynamic(lu.wrap_init(flat, debug_info=debug), avals)
        object.__setattr__(maps, "effects", frozenset(jaxpr.effects))
    return set(maps.effects)


def _jvp(primals, tangents, *, maps: _Maps, num_res: int):
    res, lin = primals[:num_res], primals[num_res:]
    d_res, d_lin = tangents[:num_res], tangents[num_res:]
    out = custom_linear_p.bind(*primals, maps=maps, num_res=num_res)
    parts = []
    if any(type(t) is not ad.Zero for t in d_lin):
        d_lin = [ad.instantiate_zeros(t) for t in d_lin]
        parts.append(custom_linear_p.bind(*res, *d_lin, maps=maps, num_res=num_res))
    moved = [i for i, t in enumerate(d_res) if type(t) is not ad.Zero]
    if moved:
        # d/dr of A(r) t: second order in the original function, taken through the reference.
        def of_moved(*values):
            full = list(res)
            for i, value in zip(moved, values):
                full[i] = value
            return maps.reference(full, list(lin))

        _, d_out = jax.jvp(of_moved, [res[i] for i in moved], [d_res[i] for i in moved])
        parts.append(list(d_out))
    if not parts:
        return out, [ad.Zero(jax.core.ShapedArray(a.shape, a.dtype)) for a in maps.out_avals]
    return out, [functools.reduce(jnp.add, terms) for terms in zip(*parts)]


def _transpose(cotangents, *args, maps: _Maps, num_res: int):
    res, lin = args[:num_res], args[num_res:]
    if any(ad.is_undefined_primal(x) for x in res):
        raise NotImplementedError("custom_linear is transposed in its linear arguments only.")
    cotangents = [
        jnp.zeros(a.shape, a.dtype) if type(ct) is ad.Zero else ct for ct, a in zip(cotangents, maps.out_avals)
    ]
    cts_in = custom_linear_p.bind(*res, *cotangents, maps=maps.transposed(), num_res=num_res)
    return [None] * num_res + [ct if ad.is_undefined_primal(x) else None for ct, x in zip(cts_in, lin)]


def _batch(args, dims, *, maps: _Maps, num_res: int):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    res_axes = [None if d is None else 0 for d in dims[:num_res]]
    res = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args[:num_res], dims)]
    # Linear arguments are always batched, so that the transpose has one batch axis to return.
    lin = [batching.bdim_at_front(x, d, size) for x, d in zip(args[num_res:], dims[num_res:])]

    def batched(f: FlatMap) -> FlatMap:
        return jax.vmap(f, in_axes=(res_axes, 0))

    def with_batch(avals):
        return tuple(jax.ShapeDtypeStruct((size, *a.shape), a.dtype) for a in avals)

    batched_maps = _Maps(batched(maps.apply), batched(maps.transpose), batched(maps.reference),
                         batched(maps.transpose_reference), with_batch(maps.out_avals), with_batch(maps.in_avals),
                         maps.interpreted)
    out = custom_linear_p.bind(*res, *lin, maps=batched_maps, num_res=num_res)
    return out, [0] * len(out)


custom_linear_p.def_impl(_impl)
custom_linear_p.def_effectful_abstract_eval(_abstract_eval)
ad.primitive_jvps[custom_linear_p] = _jvp
ad.primitive_transposes[custom_linear_p] = _transpose
batching.primitive_batchers[custom_linear_p] = _batch
mlir.register_lowering(custom_linear_p, mlir.lower_fun(_impl, multiple_results=True))
