"""The `pallas_call` plumbing of the Triton kernels: BlockSpecs of the optional inputs on a query-tile or
key-tile grid and the matching refs, the grid of a query tile, outputs that vary over `shard_map` axes, and
the compiler parameters (Triton, or Pallas interpret mode).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.experimental import pallas as pl

# Pallas' interpret-mode lowering imports the fuser on first use, and the fuser registers a config value that
# is part of the tracing context: imported mid-way, it makes every `jit` that traced before it retrace once.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401

from probjax_kernels._linear import widest_manual_axis_type
from probjax_kernels._problem import _interpreted, _Problem, _Tangents
from probjax_kernels.triton import lowering
from probjax_kernels.triton.tiles import _Refs


def _refs_fn(problem: _Problem, tangents: _Tangents | None = None):
    """Maps the trailing optional input refs of a kernel to `_Refs`, in the order `_optional_inputs` uses."""

    def to_refs(refs):
        refs = list(refs)
        take = lambda n: tuple(refs.pop(0) for _ in range(n))  # noqa: E731
        fields = {}
        if problem.has_segments:
            fields["q_segment_ids"], fields["kv_segment_ids"] = take(2)
        if problem.bias_shape is not None:
            (fields["bias"],) = take(1)
        if problem.mask_shape is not None:
            (fields["mask"],) = take(1)
        if problem.features.dropout_rate > 0:
            (fields["dropout_seed"],) = take(1)
        fields["score_consts"] = take(problem.num_score_consts)
        fields["mask_consts"] = take(problem.num_mask_consts)
        if problem.table_shape is not None:
            fields["tables"] = take(4)
        if tangents is not None:
            if tangents.bias:
                (fields["d_bias"],) = take(1)
            fields["d_score_consts"] = take(sum(tangents.score_consts))
        assert not refs
        return _Refs(**fields)

    return to_refs


def _whole(x) -> pl.BlockSpec:
    return pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n)


def _optional_inputs(arrays: dict, problem: _Problem, kind: str, block_q: int, block_k: int):
    """Arrays and BlockSpecs of the optional inputs for a "q" or "kv" kernel grid.

    "q" grids are (q_tile, b, h) and see one query tile against the whole key axis; "kv" grids are
    (kv_tile, b, kv_head) and see one key tile against the whole query axis of the group's query heads.
    The tangent kernel's `d_bias` and `d_score_consts` come last, laid out like the bias and the constants.
    """
    group = problem.group
    inputs, specs = [], []
    if problem.has_segments:
        t_pad, s_pad = arrays["q_segment_ids"].shape[1], arrays["kv_segment_ids"].shape[1]
        inputs += [arrays["q_segment_ids"], arrays["kv_segment_ids"]]
        if kind == "q":
            specs += [
                pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
                pl.BlockSpec((None, s_pad), lambda i, b, h: (b, 0)),
            ]
        else:
            specs += [
                pl.BlockSpec((None, t_pad), lambda j, b, h: (b, 0)),
                pl.BlockSpec((None, block_k), lambda j, b, h: (b, j)),
            ]
    for name in ("bias", "mask"):
        if arrays.get(name) is not None:
            inputs.append(arrays[name])
            specs.append(_broadcast_spec(arrays[name].shape, kind, block_q, block_k, group))
    if problem.features.dropout_rate > 0:
        inputs.append(arrays["dropout_seed"])
        specs.append(_whole(arrays["dropout_seed"]))
    for const in (*arrays["score_consts"], *arrays["mask_consts"]):
        inputs.append(const)
        specs.append(_whole(const))
    if problem.table_shape is not None:
        tb, th = problem.table_shape
        table_q, table_k = problem.features.block_sizes
        if kind == "q":
            tables = arrays["kv_tables"]
            row = lambda i: i * block_q // table_q  # noqa: E731
            num_spec = pl.BlockSpec((None, None, None), lambda i, b, h: (b if tb > 1 else 0, h if th > 1 else 0, row(i)))
            idx_spec = pl.BlockSpec(
                (None, None, None, tables[1].shape[-1]),
                lambda i, b, h: (b if tb > 1 else 0, h if th > 1 else 0, row(i), 0),
            )
        else:
            tables = arrays["q_tables"]
            col = lambda j: j * block_k // table_k  # noqa: E731
            heads = group if th > 1 else None
            num_spec = pl.BlockSpec((None, heads, None), lambda j, b, h: (b if tb > 1 else 0, h if th > 1 else 0, col(j)))
            idx_spec = pl.BlockSpec(
                (None, heads, None, tables[1].shape[-1]),
                lambda j, b, h: (b if tb > 1 else 0, h if th > 1 else 0, col(j), 0),
            )
        inputs += list(tables)
        specs += [num_spec, idx_spec, num_spec, idx_spec]
    if arrays.get("d_bias") is not None:
        inputs.append(arrays["d_bias"])
        specs.append(_broadcast_spec(arrays["d_bias"].shape, kind, block_q, block_k, group))
    for const in arrays.get("d_score_consts", ()):
        inputs.append(const)
        specs.append(_whole(const))
    return inputs, specs


def _broadcast_spec(shape, kind: str, block_q: int, block_k: int, group: int) -> pl.BlockSpec:
    """The BlockSpec of a [B|1, N|1, T|1, S|1] bias or mask on a "q" or "kv" grid (see `_optional_inputs`)."""
    nb, nh, nt, ns = shape
    if kind == "q":
        block = (None, None, block_q if nt > 1 else 1, ns)

        def index_map(i, b, h):
            return (b if nb > 1 else 0, h if nh > 1 else 0, i if nt > 1 else 0, 0)
    else:
        block = (None, group if nh > 1 else None, nt, block_k if ns > 1 else 1)

        def index_map(j, b, h):
            return (b if nb > 1 else 0, h if nh > 1 else 0, 0, j if ns > 1 else 0)

    return pl.BlockSpec(block, index_map)


def _compiler_params(problem: _Problem):
    cfg = problem.config
    if _interpreted(problem):
        return dict(interpret=True)
    return dict(compiler_params=lowering.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def _length_spec():
    return pl.BlockSpec((None,), lambda i, b, h: (b,))


def _output(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A kernel output that varies over the mesh axes its inputs vary over, so that the kernels run inside
    `jax.shard_map` with its default `check_vma=True` (outside one, no axis varies)."""
    manual = widest_manual_axis_type([jax.typeof(x) for x in inputs])
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


class _QGrid(NamedTuple):
    """The specs of a (q_tile, b, h) grid: a query tile (q, and out / dO with v's head dim), the whole K and
    V of the head's group, a row vector of the tile, and the optional inputs."""

    q: pl.BlockSpec
    out: pl.BlockSpec
    k: pl.BlockSpec
    v: pl.BlockSpec
    row: pl.BlockSpec
    extra: list
    extra_specs: list


def _kv_batch(problem: _Problem, b):
    """The batch index of k / v for query batch b: 0 when k / v are shared by the batch."""
    return 0 if problem.kv_broadcast else b


def _q_grid(problem: _Problem, q, k, v, block_q: int, block_k: int, optional: dict) -> _QGrid:
    d_pad, dv_pad, s_pad, group = q.shape[3], v.shape[3], k.shape[1], problem.group
    extra, extra_specs = _optional_inputs(optional, problem, "q", block_q, block_k)

    def kv_spec(dim):
        return pl.BlockSpec((None, s_pad, None, dim), lambda i, b, h: (_kv_batch(problem, b), 0, h // group, 0))

    return _QGrid(
        q=pl.BlockSpec((None, block_q, None, d_pad), lambda i, b, h: (b, i, h, 0)),
        out=pl.BlockSpec((None, block_q, None, dv_pad), lambda i, b, h: (b, i, h, 0)),
        k=kv_spec(d_pad),
        v=kv_spec(dv_pad),
        row=pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
        extra=extra,
        extra_specs=extra_specs,
    )
