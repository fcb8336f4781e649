"""Which calls the Mosaic TPU kernels take: `unsupported` names the first feature of a call they cannot run
(None when they run all of it), vetting a score_mod / mask_mod's jaxpr against the Mosaic TPU lowering
rules the way `_dispatch` vets hooks for Mosaic GPU.

A hook runs in the kernels when every primitive it uses has a Mosaic TPU lowering rule and it reads each
captured array one element at a time at scalar indices (`slopes[h]`: a size-1 `dynamic_slice` then a
squeeze, a scalar load from SMEM), whole when it is 0-d, or along its last axis at exactly q_idx / kv_idx
with scalar leading indices (`doc[b, q_idx]`, `bias[h, kv_idx]`: `_hooks.tile_reads`), which the kernels
give as the VMEM tile of the array along that axis (`const_layouts`). Any other read along q_idx / kv_idx
(`table[q_idx - kv_idx]`) is a vector gather, which Mosaic TPU has no lowering for.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic import core as tpu_core  # the Mosaic TPU lowering rules, to vet hooks
from jax._src.pallas.mosaic import lowering as tpu_lowering
from jax.extend import core as jex_core

from probjax_kernels._hooks import Hook, live_equations, tile_hook_shapes, tile_reads
from probjax_kernels._problem import _Problem
from probjax_kernels._table_tiles import check_tiles

_SMEM_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.int32))


def _specs(shapes, with_score: bool) -> list:
    b, h, q_idx, kv_idx, score = shapes
    specs = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in (b, h, q_idx, kv_idx)]
    if with_score:
        specs.insert(0, jax.ShapeDtypeStruct(score, jnp.float32))
    return specs


def hook_problem(hook: Hook, shapes, with_score: bool, derivative: bool, tiles: bool = True) -> str | None:
    """Why `hook` cannot run in the Mosaic TPU kernels at these shapes (None when it can); with `derivative`,
    its jvp in the score too (the backward kernels); `tiles`: whether the kernel reads hook arrays along
    q_idx / kv_idx as tiles (the decode kernel does not)."""
    for shape, dtype in hook.const_avals:
        if jnp.dtype(dtype) not in _SMEM_DTYPES:
            return (f"it captures a {jnp.dtype(dtype).name} array (the kernels read hook arrays as 32-bit SMEM "
                    "scalars or VMEM tiles)")
    specs = _specs(shapes, with_score)
    jaxpr = hook._jaxpr(specs)
    reason = jaxpr_problem(jaxpr, set(jaxpr.constvars), tiles)
    if reason is None and derivative:
        closed = hook.jvp_jaxpr((False,) * len(hook.const_avals), *specs)
        captured = closed.jaxpr.invars[: len(hook.const_avals)]
        reason = "its derivative captures arrays" if closed.consts else jaxpr_problem(closed.jaxpr, set(captured),
                                                                                      tiles)
    return reason


def jaxpr_problem(jaxpr, consts: set, tiles: bool = True) -> str | None:
    """The first op of `jaxpr` without a Mosaic TPU lowering, or the first read of a captured array in
    `consts` other than one element at scalar indices or a tile along q_idx / kv_idx; None when there is
    none. The index arithmetic only tile reads use is never evaluated, so it is not vetted."""
    elements = set()
    consts = {var for var in consts if var.aval.shape}
    reads = tile_reads(jaxpr, consts) if tiles else {}
    live = live_equations(jaxpr, reads)
    for n, eqn in enumerate(jaxpr.eqns):
        if not live[n] or n in reads:
            continue
        name = eqn.primitive.name
        reads_element = (
            name == "dynamic_slice" and eqn.invars[0] in consts
            and all(size == 1 for size in eqn.params["slice_sizes"])
            and all(not v.aval.shape for v in eqn.invars[1:])
        )
        if reads_element:
            elements.add(eqn.outvars[0])
        else:
            missing = _missing_rule(eqn)
            if missing is not None:
                return f"op `{missing}` has no Mosaic TPU lowering"
        for position, var in enumerate(eqn.invars):
            if isinstance(var, jex_core.Literal):
                continue
            if var in consts and not (reads_element and position == 0):
                return f"op `{name}` reads a captured array {list(var.aval.shape)} as a vector (a gather)"
            if var in elements and not (name == "squeeze" and not eqn.outvars[0].aval.shape):
                return f"op `{name}` uses an element of a captured array as an array"
    outputs = {var for var in jaxpr.outvars if not isinstance(var, jex_core.Literal)}
    if outputs & (consts | elements):
        return "it returns a captured array"
    return None


@dataclasses.dataclass(frozen=True)
class ConstLayout:
    """How the kernels hold one hook array: `smem`, a 32-bit SMEM copy for scalar reads (and 0-d arrays);
    `tiles`, `(axis, kinds, fill)` per axis ("q" / "kv") the hook reads it along (`_hooks.TileRead`: `kinds`
    "b" / "h" for a leading axis indexed exactly by b / h, which the BlockSpec then selects, None for one
    held whole), as VMEM blocks of the array's last axis."""

    smem: bool
    tiles: tuple = ()


def const_layouts(hook: Hook | None, config, with_score: bool) -> tuple[ConstLayout, ...]:
    """The `ConstLayout` of each of `hook`'s arrays, from its jaxprs at every tile shape of `config` (and its
    score derivative's, for a score_mod); () without a hook. Traced jaxprs are cached on the hook."""
    if hook is None:
        return ()
    tiles = {(config.block_q, config.block_k), (config.block_q_dq, config.block_k_dq),
             (config.block_q_dkv, config.block_k_dkv)}
    transposed = tile_hook_shapes(config.block_q_dkv, config.block_k_dkv, True)
    all_shapes = sorted({tile_hook_shapes(*t, False) for t in tiles} | {transposed})
    key = ("tpu_layouts", with_score, tuple(all_shapes))
    if key in hook.jaxprs:
        return hook.jaxprs[key]
    n = len(hook.const_avals)
    smem = [not shape for shape, _ in hook.const_avals]
    axes = [dict() for _ in range(n)]
    for shapes in all_shapes:
        specs = _specs(shapes, with_score)
        jaxpr = hook._jaxpr(specs)
        jaxprs = [(jaxpr, list(jaxpr.constvars))]
        if with_score:
            closed = hook.jvp_jaxpr((False,) * n, *specs)
            jaxprs.append((closed.jaxpr, list(closed.jaxpr.invars[:n])))
        for jaxpr, const_vars in jaxprs:
            reads = tile_reads(jaxpr, const_vars)
            live = live_equations(jaxpr, reads)
            for i, var in enumerate(const_vars):
                for eqn_number, eqn in enumerate(jaxpr.eqns):
                    if not live[eqn_number]:
                        continue
                    read = reads.get(eqn_number)
                    if read is not None and read.const is var:
                        kinds, fill = axes[i].get(read.axis, (read.kinds, read.fill))
                        kinds = tuple(k if k == r else None for k, r in zip(kinds, read.kinds))
                        axes[i][read.axis] = (kinds, fill)
                    elif var in eqn.invars:
                        smem[i] = True
    layouts = tuple(ConstLayout(smem[i], tuple((axis, *axes[i][axis]) for axis in sorted(axes[i])))
                    for i in range(n))
    hook.jaxprs[key] = layouts
    return layouts


def _missing_rule(eqn) -> str | None:
    rules = tpu_lowering.lowering_rules[tpu_core.CoreType.TC]
    if eqn.primitive.name == "gather" or eqn.primitive not in rules:
        return eqn.primitive.name
    for sub in jex_core.jaxprs_in_params(eqn.params):
        for inner in sub.eqns:
            missing = _missing_rule(inner)
            if missing is not None:
                return missing
    return None


def unsupported(problem: _Problem, tangent: bool = False) -> str | None:
    """The first feature of this call the Mosaic TPU kernels cannot run, as words for a warning; None when
    they run it all. `tangent`: the forward-mode kernel (which evaluates a score_mod's jvp in its arrays)."""
    f, cfg = problem.features, problem.config
    tiles = {(cfg.block_q, cfg.block_k), (cfg.block_q_dq, cfg.block_k_dq), (cfg.block_q_dkv, cfg.block_k_dkv)}
    if f.block_sizes is not None:  # each kernel walks the tables on its own tile (`_table_tiles.tables_on_tiles`)
        for block_q, block_k in sorted(tiles):
            reason = check_tiles(f.block_sizes, (block_q, block_k))
            coarser = f.block_sizes[0] % block_q or f.block_sizes[1] % block_k
            if reason is None and coarser and not f.exact_mask_mod:
                reason = (f"kernel tiles ({block_q}, {block_k}) cover several of its blocks, where its mask_mod "
                          "need not give the mask its tables describe (tables from from_kv_blocks)")
            if reason is not None:
                return f"a BlockMask of {f.block_sizes} blocks: {reason}"
    for block_q, block_k in tiles:
        if block_q % 128 or block_k % 128:
            bound = ""
            if f.block_sizes is not None and not f.exact_mask_mod:
                bound = f" (kernel tiles divide the {f.block_sizes} blocks of a BlockMask from from_kv_blocks)"
            return f"tiles ({block_q}, {block_k}) that are not multiples of 128{bound}"
    for kind, hook in (("score_mod", f.score_mod), ("mask_mod", f.mask_mod)):
        if hook is None:
            continue
        for (block_q, block_k), transposed in [(t, False) for t in tiles] + [((cfg.block_q_dkv, cfg.block_k_dkv),
                                                                             True)]:
            reason = hook_problem(hook, tile_hook_shapes(block_q, block_k, transposed), kind == "score_mod",
                                  derivative=kind == "score_mod")
            if reason is not None:
                return f"the {kind} ({reason})"
    return None
