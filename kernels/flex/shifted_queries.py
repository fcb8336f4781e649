"""A mask_mod at query positions shifted by a static offset whose reads of captured arrays at q_idx stay reads
at exactly q_idx: the mask_mod of contiguous query blocks sliced from a BlockMask (`BlockMask.__getitem__`,
chunked prefill), in the form the Mosaic TPU kernels hold as VMEM tiles.

`shifted_queries(mask_mod, offset)(b, h, q_idx, kv_idx) == mask_mod(b, h, q_idx + offset, kv_idx)`. Written
plainly, a document mask's read `ids[b, q_idx + offset]` is a gather along the query axis, which Mosaic TPU
cannot lower (the TPU kernels hold an array read at exactly q_idx or kv_idx as tiles: `_hooks.tile_reads`),
so the call ran the XLA path. Here each captured array that mask_mod reads at exactly q_idx is also kept
shifted by the offset along its last axis (`copy[..., i] = array[..., min(i + offset, n - 1)]`, made once
with the mask, outside the kernels), and each such read takes the copy at the unshifted q_idx; every other
use of the arrays (the keys' read of the same ids) and of q_idx sees the original values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.tree_util import Partial

from probjax_kernels._hooks import example_indices, live_equations, tile_reads


def shifted_queries(mask_mod, offset: int) -> Partial:
    """`mask_mod(b, h, q_idx + offset, kv_idx)` (offset >= 0) as a mask_mod that reads the arrays mask_mod
    reads at exactly q_idx from copies shifted by `offset` (see the module docstring); a pytree whose leaves
    are mask_mod's and the copies."""
    closed = jax.make_jaxpr(mask_mod)(*example_indices())
    along_q = {read.const for read in tile_reads(closed.jaxpr, closed.jaxpr.constvars).values() if read.axis == "q"}
    copies = tuple(_shifted(jnp.asarray(value), offset) if var in along_q else None
                   for var, value in zip(closed.jaxpr.constvars, closed.consts))
    return Partial(_shifted_mask_mod, mask_mod, offset, copies)


def _shifted(array: jax.Array, offset: int) -> jax.Array:
    """`array[..., min(i + offset, n - 1)]` for each i < n along the last axis."""
    n = array.shape[-1]
    return jnp.take(array, jnp.minimum(jnp.arange(n) + offset, n - 1), axis=-1)


def _shifted_mask_mod(mask_mod, offset: int, copies: tuple, b, h, q_idx, kv_idx):
    """mask_mod at q_idx + offset, evaluated from its jaxpr with each read at exactly that index taken from the
    shifted copy at q_idx. q_idx is broadcast with b and h first, so that the reads of 4-D index grids (XLA
    side) are found as the kernels' are and the hook closes over the same arrays at every shape."""
    q_idx = jnp.broadcast_to(q_idx, jnp.broadcast_shapes(jnp.shape(b), jnp.shape(h), jnp.shape(q_idx)))
    closed = jax.make_jaxpr(mask_mod)(b, h, q_idx, kv_idx)
    jaxpr = closed.jaxpr
    copy_of = {var: copy for var, copy in zip(jaxpr.constvars, copies) if copy is not None}
    reads = {n: read for n, read in tile_reads(jaxpr, jaxpr.constvars).items()
             if read.axis == "q" and read.fill is None and read.const in copy_of
             and copy_of[read.const].shape == read.const.aval.shape}
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, (b, h, q_idx + offset, kv_idx)))

    def value(atom):
        if isinstance(atom, jex_core.Literal):
            return atom.val
        return env[atom] if isinstance(atom, jex_core.Var) else atom

    for n, (eqn, live) in enumerate(zip(jaxpr.eqns, live_equations(jaxpr, reads))):
        if not live:
            continue
        if n in reads:
            leading = tuple(jnp.asarray(value(atom), jnp.int32) for atom in reads[n].leading)
            env[eqn.outvars[0]] = copy_of[reads[n].const][(*leading, q_idx)]
            continue
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*map(value, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    (out,) = map(value, jaxpr.outvars)
    return out
