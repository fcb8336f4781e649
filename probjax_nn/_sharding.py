"""How `attention` runs the Pallas kernels on inputs sharded over a mesh: per shard of the batch and heads,
and context parallel over a mesh axis (`AttentionConfig.context_axis`).

A Pallas kernel is one custom call that the SPMD partitioner cannot split: under Explicit mesh axes it
refuses a batch-sharded input, and under Auto axes XLA would gather the inputs and run the whole kernel on
every device. So the kernel runs inside `jax.shard_map`, each device on its own examples and heads:

- Explicit axes: the layout is the inputs' own (their types say which axes split the batch and the heads);
  an axis that splits the sequence or the head dim is gathered first (`jax.reshard`), since a sequence shard
  alone cannot attend to the rest of the sequence (that is `context_axis`'s job).
- Auto axes: the compiler picks the layout only after tracing, so none is visible here. The kernel asks for
  the layout that gives every device its own share of the work: the batch over the Auto axes whose sizes
  divide it (in mesh order), then the heads over those left that divide N and K; XLA reshards to it where
  its propagation chose another. (`custom_partitioning` would see the compiler's layout, but it would have
  to wrap the forward, backward and tangent kernels one by one, and gives up jax's autodiff of the whole.)
  No mesh in context (`jax.set_mesh`): the call runs as it is.
- Inputs not split over any Explicit axis (replicated, or the examples of `jax.vmap` over a sharded batch,
  which a shard_map inside cannot batch in jax 0.11): the kernel runs with the mesh axes turned Auto
  (`jax.sharding.auto_axes`), where XLA partitions what the kernel's interpret mode lowers to and runs a GPU
  kernel whole on each device.

Hooks and dropout see the whole attention's indices: every shard adds its batch / head offset (from
`lax.axis_index` of the axes that split them) to b and h before a score_mod / mask_mod reads them, and the
kernels hash the global (b, h) with the whole head count, so the same weights drop as in the unsharded call.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from jax.tree_util import Partial

from probjax_kernels import ring_attention
from probjax_kernels.layer_api import runs_reference, soft_capped


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The mesh axes that split the batch and the heads of one call, and whether its inputs are resharded to
    that layout first (Explicit axes: gathering an axis that splits the sequence or the head dim)."""

    batch: tuple[str, ...]
    heads: tuple[str, ...]
    reshard: bool
    # Nothing here is split over the (Explicit) axes: run under them as Auto axes (`jax.sharding.auto_axes`)
    # rather than in a shard_map, which jax.vmap over an Explicit axis cannot batch (Equinox's modules).
    whole: bool = False


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _axis_types(mesh) -> dict:
    """The mesh's axes that are not already manual (a caller's shard_map), with their types."""
    return {a: t for a, t in zip(mesh.axis_names, mesh.axis_types) if a not in mesh.manual_axes}


def _spec(x, ndim: int) -> list:
    return (list(jax.typeof(x).sharding.spec) + [None] * ndim)[:ndim]


def _layout(mesh, inputs) -> _Layout | None:
    """How `inputs` (checked `AttentionInputs`) split over `mesh`, or None without a mesh (or free axes)."""
    if mesh.empty:
        return None
    types = _axis_types(mesh)
    explicit = [a for a, t in types.items() if t == AxisType.Explicit]
    auto = [a for a, t in types.items() if t == AxisType.Auto]
    batch, q_len, kv_len, num_heads, num_kv_heads, _ = inputs.shape
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    arrays = (inputs.q, inputs.k, inputs.v)
    specs = [_spec(x, 4) for x in arrays]
    used = {a for spec in specs for entry in spec for a in _names(entry) if a in explicit}
    batch_axes = tuple(a for a in _names(specs[0][0]) if a in explicit)
    head_axes = tuple(a for a in _names(specs[0][2]) if a in explicit)
    if num_heads % size(head_axes) or num_kv_heads % size(head_axes):
        head_axes = ()  # GQA groups would straddle shards: gather the heads
    for axis in auto:
        if batch % (size(batch_axes) * mesh.shape[axis]) == 0:
            batch_axes += (axis,)
        elif all(heads % (size(head_axes) * mesh.shape[axis]) == 0 for heads in (num_heads, num_kv_heads)):
            head_axes += (axis,)
    if not types:
        return None
    if not used and not auto:  # under jax.vmap too, whose batch axis the types here do not show
        return _Layout((), (), reshard=False, whole=True)
    # On Explicit axes every input (bias, mask and lengths too) is resharded to the layout (a no-op where it
    # has it); on Auto ones the shard_map's specs say it, and XLA moves the data.
    return _Layout(batch_axes, head_axes, reshard=bool(explicit) and not auto, whole=False)


def _shard_index(axes: tuple[str, ...]):
    """This device's index along `axes` taken together (the first the slowest), int32."""
    index = jnp.int32(0)
    for axis in axes:
        index = index * lax.axis_size(axis) + lax.axis_index(axis)
    return index


def _offset_score_mod(score_mod, batch_offset, head_offset, score, b, h, q_idx, kv_idx):
    return score_mod(score, b + batch_offset, h + head_offset, q_idx, kv_idx)


def _offset_mask_mod(mask_mod, batch_offset, head_offset, b, h, q_idx, kv_idx):
    return mask_mod(b + batch_offset, h + head_offset, q_idx, kv_idx)


def _global_indices(call, layout: _Layout, batch: int, num_heads: int, total_heads: int):
    """`call` with hooks and dropout on the whole attention's b and h, inside the shard_map of `layout`."""
    if not layout.batch and not layout.heads:
        return call
    batch_offset = _shard_index(layout.batch) * batch
    head_offset = _shard_index(layout.heads) * num_heads
    score_mod, mask_mod = call.score_mod, call.mask_mod
    if score_mod is not None:
        score_mod = Partial(_offset_score_mod, score_mod, batch_offset, head_offset)
    if mask_mod is not None:
        mask_mod = Partial(_offset_mask_mod, mask_mod, batch_offset, head_offset)
    shard = (batch_offset, head_offset, total_heads) if call.dropout_rate else None
    return dataclasses.replace(call, score_mod=score_mod, mask_mod=mask_mod, dropout_shard=shard)


def _broadcast_spec(x, batch, heads) -> P | None:
    """The spec of a `[B|1, N|1, T|1, S|1]` bias / mask: split where it is not broadcast."""
    return None if x is None else P(batch if x.shape[0] > 1 else None, heads if x.shape[1] > 1 else None)


def _array_arguments(call):
    """The arrays that `call` holds besides its inputs (a traced scale, the dropout seed, a hook's captured
    arrays), and `restore(call, arrays)`, which puts arrays in their places. They enter a shard_map as
    replicated arguments: shard_map may not close over arrays typed with Explicit axes (a dropout seed made
    from a Python int under an Explicit mesh is one)."""
    leaves, tree = jax.tree.flatten((call.inputs.scale, call.dropout_seed, call.score_mod, call.mask_mod))
    is_array = [isinstance(leaf, jax.Array) for leaf in leaves]

    def restore(call, arrays):
        it = iter(arrays)
        scale, seed, score_mod, mask_mod = jax.tree.unflatten(
            tree, [next(it) if array else leaf for leaf, array in zip(leaves, is_array)])
        return dataclasses.replace(call, inputs=dataclasses.replace(call.inputs, scale=scale), dropout_seed=seed,
                                   score_mod=score_mod, mask_mod=mask_mod)

    return [leaf for leaf, array in zip(leaves, is_array) if array], restore


def per_shard(call, run):
    """`run(call)` (a kernel runner of `attention`) per shard of the batch and heads, when the inputs are
    sharded over the context mesh (module docstring); as it is otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    i = call.inputs
    layout = _layout(mesh, i)
    # Inside a caller's shard_map that checks varying axes, the CPU runs the plain-jnp path, which XLA
    # partitions itself (and a nested shard_map without those checks could not be transposed there).
    if layout is None or runs_reference(call.flash, i):
        return run(call)
    arrays = (i.q, i.k, i.v, i.bias, i.mask, i.q_lengths, i.kv_lengths)

    def local(q, k, v, bias, mask, q_lengths, kv_lengths):
        inputs = dataclasses.replace(i, q=q, k=k, v=v, bias=bias, mask=mask, q_lengths=q_lengths,
                                     kv_lengths=kv_lengths)
        return dataclasses.replace(call, inputs=inputs)

    if layout.whole:
        replicated = (P(), P()) if call.return_residual else P()
        # Only the free axes turn Auto: inside a caller's partly-manual shard_map the manual ones cannot.
        return jax.sharding.auto_axes(lambda *arrays: run(local(*arrays)), axes=tuple(_axis_types(mesh)),
                                      out_sharding=replicated)(*arrays)
    batch, heads = _entry(layout.batch), _entry(layout.heads)
    kv_batch = None if i.kv_broadcast else batch
    specs = (P(batch, None, heads), P(kv_batch, None, heads), P(kv_batch, None, heads),
             _broadcast_spec(i.bias, batch, heads), _broadcast_spec(i.mask, batch, heads),
             None if i.q_lengths is None else P(batch), None if i.kv_lengths is None else P(batch))
    if layout.reshard:
        arrays = tuple(x if x is None else jax.reshard(x, spec) for x, spec in zip(arrays, specs))
    total_heads = i.q.shape[2]
    arguments, restore = _array_arguments(call)

    def body(arrays, arguments):
        q = arrays[0]
        shard = restore(local(*arrays), arguments)
        return run(_global_indices(shard, layout, q.shape[0], q.shape[2], total_heads))

    out_spec = P(batch, None, heads)
    out_specs = (out_spec, P(batch, None, heads)) if call.return_residual else out_spec
    # Over every free mesh axis: an axis that splits neither is replicated, and Pallas' interpret mode cannot
    # run under a mesh with Explicit axes left outside. check_vma=False: the interpret mode (CPU) loses the
    # varying-axes types inside the kernels' loops.
    return jax.shard_map(body, in_specs=(specs, P()), out_specs=out_specs, axis_names=set(_axis_types(mesh)),
                         check_vma=False)(arrays, arguments)


# ------------------------------------------------------------------------------------- context parallelism


def _explicit(mesh, axis: str) -> bool:
    return dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Explicit


def _context_layout(mesh, inputs) -> _Layout:
    """The batch / head layout of a context-parallel call: the Explicit axes that split the query's batch and
    heads (the heads gathered where a GQA group would straddle two shards), one layout for query, key and
    value alike. Each input taking its own spec while the ring pairs them by the query's made a replicated
    key meet a head-split query, or a batch-split key pass as the whole batch's (wrong outputs)."""
    batch, _, _, num_heads, num_kv_heads, _ = inputs.shape
    q_spec = _spec(inputs.q, 4)
    batch_axes, head_axes = ([a for a in _names(entry) if _explicit(mesh, a)] for entry in (q_spec[0], q_spec[2]))
    if len(batch_axes) != len(_names(q_spec[0])):
        batch_axes = []  # partly Auto: the compiler's to place
    if len(head_axes) != len(_names(q_spec[2])) or any(
            heads % math.prod(mesh.shape[a] for a in head_axes) for heads in (num_heads, num_kv_heads)):
        head_axes = []
    return _Layout(tuple(batch_axes), tuple(head_axes), reshard=True)


def context_parallel(config, name: str, call):
    """`call` through `ring_attention` over `config.context_axis`, in a `shard_map` of that axis (and of the
    Explicit axes the inputs are sharded over) unless the caller's shard_map already made it manual; returns
    (out, lse `[B, T, N]`) with `call.return_residual`, else out."""
    i, axis = call.inputs, config.context_axis
    for feature, present in (("bias", i.bias is not None), ("mask", i.mask is not None),
                             ("query_seq_lengths", i.q_lengths is not None),
                             ("key_value_seq_lengths", i.kv_lengths is not None),
                             ("key / value of batch 1 shared by the batch", i.kv_broadcast)):
        if present:
            raise NotImplementedError(
                f"context parallelism (context_axis={axis!r}) does not support {feature}; express masks as a "
                "mask_mod and biases as a score_mod on global positions."
            )
    if name == "cudnn":
        raise NotImplementedError(f"impl='cudnn' cannot run context parallel (context_axis={axis!r}).")

    def attend(call, q, k, v):
        out, lse = ring_attention(
            q, k, v, axis_name=axis, layout=config.context_layout, strategy=config.context_strategy,
            causal=call.causal, scale=call.inputs.scale, window=i.window, mask_mod=call.mask_mod,
            score_mod=soft_capped(call.score_mod, call.logits_soft_cap),
            return_lse=True, config=call.flash, dropout_rate=call.dropout_rate, dropout_seed=call.dropout_seed,
            _backend="reference" if name == "xla" else "kernel", _dropout_shard=call.dropout_shard,
        )
        return (out, jnp.swapaxes(lse, 1, 2)) if call.return_residual else out

    mesh = jax.sharding.get_abstract_mesh()
    if axis in mesh.manual_axes:
        return attend(call, i.q, i.k, i.v)
    if mesh.empty or axis not in mesh.axis_names:
        raise ValueError(
            f"context_axis={axis!r} needs a mesh with that axis: call under jax.set_mesh(mesh); the current "
            f"mesh has axes {tuple(mesh.axis_names)}."
        )
    size = mesh.shape[axis] * (2 if config.context_layout == "zigzag" else 1)
    for arg, length in (("query", i.q.shape[1]), ("key", i.k.shape[1])):
        if length % size:
            raise ValueError(
                f"{arg} has sequence length {length}, which context_axis={axis!r} with layout "
                f"{config.context_layout!r} needs to be a multiple of {size}."
            )
    layout = _context_layout(mesh, i)
    spec = P(_entry(layout.batch), axis, _entry(layout.heads))
    # Explicit axes that split none of them run inside too (replicated): Pallas' interpret mode cannot run
    # under a mesh with Explicit axes left outside.
    manual = {axis, *layout.batch, *layout.heads, *(a for a in _axis_types(mesh) if _explicit(mesh, a))}
    if any(_explicit(mesh, a) for a in _axis_types(mesh)):
        # Every input to the one layout (a no-op where it has it); an Auto context axis is the shard_map's
        # to split, and Explicit axes that split none of batch / heads / sequence are gathered.
        explicit = P(*(entry if entry is not None and all(_explicit(mesh, a) for a in _names(entry)) else None
                       for entry in spec))
        q, k, v = (jax.reshard(x, explicit) for x in (i.q, i.k, i.v))
    else:
        q, k, v = i.q, i.k, i.v
    residual_spec = P(spec[0], axis, spec[2])
    arguments, restore = _array_arguments(call)

    def body(q, k, v, arguments):
        return attend(_global_indices(restore(call, arguments), layout, q.shape[0], q.shape[2], i.q.shape[2]),
                      q, k, v)

    # check_vma=False: Pallas' interpret mode (CPU) loses the varying-axes types inside the kernels' loops.
    # Always traced (jax.jit): run eagerly (under jax.grad too), jax 0.11 executes a shard_map that leaves mesh
    # axes outside (an Auto batch axis here) through a path that refuses the inputs' own sharding over them.
    return jax.jit(jax.shard_map(
        body, in_specs=(spec,) * 3 + (P(),), out_specs=(spec, residual_spec) if call.return_residual else spec,
        axis_names=manual, check_vma=False,
    ))(q, k, v, arguments)
