"""Whether `decode_attention`'s Mosaic TPU kernel reads the caller's KV cache in place, and what it costs
around and inside the kernel; deviceless compiles through libtpu.

`views`: over cache dtypes, KV head counts K and head dims D, per cache the view the kernel chose
(kernels/tpu/decode_layout.py: rows `[.., S * K, D]` or heads `[.., S, K, D]`) and whether the cache reaches
the kernel's `tpu_custom_call` through bitcasts only ("free") or through an XLA copy ("copy": the whole cache
rewritten into the kernel's layout on every call), with the kernel's scoped VMEM.

`registry`: the decode rows of the TPU compile report (tpu_variants.decode_variants: ours and JAX's paged
attention peers), per generation: tpu_custom_calls, scoped VMEM, HBM temp, the bytes XLA's cost model counts
for the ops outside the kernels (`cost_analysis()["bytes accessed"]`: a layout copy or transpose of the cache
shows here; on v5e / v6e XLA may keep such a copy in VMEM, so the HBM temp column can miss it), whether our
caches are copied, and the static size of the kernel's final Mosaic LLO (ops in the module, of which vector
loads and selects: both step variants, masked and unmasked, are in it; not executed instructions), and for
ours that size with only the masked and only the unmasked step variant compiled in.

    JAX_PLATFORMS=cpu TOOLCHAIN_PYTHON scripts/compile/tpu_decode_layout.py views [--generations v5e v6e]
        [--dtypes bfloat16 float32] [--heads 1 2 3 4 8 16] [--dims 64 128 192 256] [--pages 1024] [--json F]
    JAX_PLATFORMS=cpu TOOLCHAIN_PYTHON scripts/compile/tpu_decode_layout.py registry [--generations ...]
        [--only REGEX] [--json F]

The cache's layout is XLA's default for its shape (what a jitted function's argument, or a `jnp.zeros` cache,
gets on a TPU): tiled on (K, D), and for some D (64, 192) with another dim moved to the lanes when the page
count is a multiple of 128, which no kernel reading `[.., K, D]` blocks can take without a copy. A deviceless
compile, not a run: no timing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERATIONS = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
_SCOPED = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')
_SIZE = re.compile(r'"size":"(\d+)"')
_LLO_OP = re.compile(r'"(llo\.[\w.]+)"\(|= (llo\.[\w.]+)[ (]|^\s*(llo\.[\w.]+)[ (]', re.M)
_DUMP = tempfile.mkdtemp(prefix="mosaic-dump-")  # Mosaic's per-pass dumps, read and cleared after each compile


def cache_copied(hlo: str, param: int) -> bool:
    """Whether the entry computation's parameter `param` reaches the module's tpu_custom_call through any op
    other than bitcasts (a layout copy in XLA)."""
    lines = hlo.split("\nENTRY")[1].splitlines()[1:]
    names = {m.group(1) for m in (re.match(r"\s*(?:ROOT )?(%\S+) = .* parameter\((\d+)\)", line) for line in lines)
             if m and int(m.group(2)) == param}
    grew = True
    while grew:
        grew = False
        for line in lines:
            m = re.match(r"\s*(?:ROOT )?(%\S+) = \S+ bitcast\((%[^)]+)\)", line)
            if m and m.group(2) in names and m.group(1) not in names:
                names.add(m.group(1))
                grew = True
    for line in lines:
        if 'custom_call_target="tpu_custom_call"' in line:
            operands = re.search(r"custom-call\(([^)]*)\)", line).group(1)
            return not {a.strip().split("*/")[-1] for a in operands.split(",")} & names
    raise ValueError("the module has no tpu_custom_call")


def scoped_vmem(hlo: str) -> int:
    """Scoped VMEM of the module's first tpu_custom_call, in bytes."""
    start = hlo.index('custom_call_target="tpu_custom_call"')
    used = _SCOPED.search(hlo, start)
    return sum(int(s) for s in _SIZE.findall(used.group(1))) if used else 0


def llo_ops() -> dict:
    """Op counts of the final LLO of the Mosaic kernels compiled since the last call (then forgets them)."""
    ops = collections.Counter()
    for path in Path(_DUMP).glob("*finalize-llo.txt"):
        ops.update(next(x for x in m if x) for m in _LLO_OP.findall(path.read_text()))
    shutil.rmtree(_DUMP, ignore_errors=True)
    os.makedirs(_DUMP, exist_ok=True)
    loads = sum(n for op, n in ops.items() if op.startswith("llo.vector_load"))
    return dict(llo_ops=sum(ops.values()), llo_vector_loads=loads, llo_vselects=ops["llo.vselect"],
                llo_matmuls=ops["llo.vmatmul"])


def _device(generation: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=GENERATIONS[generation], platform="tpu",
                                        chips_per_host_bounds=[1, 1, 1]).devices[0]


def _compile(fn, specs, device):
    import jax
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    with jax.default_device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).compile()


def registry_row(generation: str, variant) -> dict:
    """One decode row of the compile report's registry, compiled for `generation`, with the figures above."""
    fn, specs = variant.build()
    llo_ops()  # forget earlier dumps
    compiled = _compile(fn, specs, _device(generation))
    hlo = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    row = dict(generation=generation, variant=variant.name, group=variant.group,
               tpu_custom_calls=hlo.count('custom_call_target="tpu_custom_call"'), scoped_vmem=scoped_vmem(hlo),
               hbm_temp=compiled.memory_analysis().temp_size_in_bytes, xla_bytes=int(cost.get("bytes accessed", 0)))
    if variant.group != "peer":  # ours: q, k, v, lengths[, tables]
        row["cache_copied"] = cache_copied(hlo, 1) or cache_copied(hlo, 2)
    row.update(llo_ops())
    if variant.group != "peer":
        row.update(_one_step_variant_ops(generation, variant))
    return row


def _one_step_variant_ops(generation: str, variant) -> dict:
    """LLO ops of our kernel compiled with every step masked and with every step unmasked (its step rule
    `decode._step_masked` replaced by a constant, so the other step body folds away): the size of each step
    variant with the kernel's fixed prologue and epilogue."""
    import jax.numpy as jnp

    from probjax_kernels.tpu import decode as tpu_decode

    rule = getattr(tpu_decode, "_step_masked", None)
    if rule is None:  # a kernel with one step body
        return {}
    out = {}
    try:
        for name, masked in (("masked", True), ("unmasked", False)):
            tpu_decode._step_masked = lambda *args, masked=masked: jnp.bool_(masked)
            fn, specs = variant.build()
            _compile(fn, specs, _device(generation))
            out[f"llo_ops_{name}_only"] = llo_ops()["llo_ops"]
    finally:
        tpu_decode._step_masked = rule
    return out


def probe(generation: str, dtype_name: str, num_kv_heads: int, head_dim: int, num_pages: int) -> dict:
    """One paged decode call (B = 8, T = 1, N = 4 K, 16-key pages, D = Dv) compiled for `generation`."""
    import jax
    import jax.numpy as jnp

    from probjax_kernels import decode_attention
    from probjax_kernels.tpu import decode as tpu_decode

    dtype, batch, page = jnp.dtype(dtype_name), 8, 16
    cache = jax.ShapeDtypeStruct((num_pages, page, num_kv_heads, head_dim), dtype)
    specs = [jax.ShapeDtypeStruct((batch, 1, 4 * num_kv_heads, head_dim), dtype), cache, cache,
             jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch, num_pages // batch), jnp.int32)]
    plans = []
    original = tpu_decode.decode_partials

    def recording(plan, *args):
        plans.append(plan)
        return original(plan, *args)

    def fn(q, k, v, lengths, tables):
        return decode_attention(q, k, v, kv_lengths=lengths, block_tables=tables)

    tpu_decode.decode_partials = recording
    try:
        hlo = _compile(fn, specs, _device(generation)).as_text()
    finally:
        tpu_decode.decode_partials = original
    view = plans[0].k_view
    return dict(generation=generation, dtype=dtype_name, num_kv_heads=num_kv_heads, head_dim=head_dim,
                num_pages=num_pages, view="rows" if view.rows else "heads", lane_blocks=view.chunks,
                k_copied=cache_copied(hlo, 1), v_copied=cache_copied(hlo, 2), scoped_vmem=scoped_vmem(hlo))


def views(args) -> list[dict]:
    rows = []
    for generation in args.generations:
        for dtype in args.dtypes:
            for num_pages in args.pages:
                for head_dim in args.dims:
                    cells = []
                    for heads in args.heads:
                        try:
                            row = probe(generation, dtype, heads, head_dim, num_pages)
                            copied = "copy" if row["k_copied"] or row["v_copied"] else "free"
                            cells.append(f"K={heads} {row['view']}/{copied}/{row['scoped_vmem'] / 2**20:.2f}M")
                        except Exception as error:  # noqa: BLE001 - a failure is a cell of the table
                            row = dict(generation=generation, dtype=dtype, num_kv_heads=heads, head_dim=head_dim,
                                       num_pages=num_pages, error=str(error).splitlines()[0][:300])
                            cells.append(f"K={heads} FAILED")
                        rows.append(row)
                    print(f"{generation} {dtype} P={num_pages} D={head_dim}: " + "  ".join(cells), flush=True)
    return rows


def registry(args) -> list[dict]:
    import tpu_variants

    rows = []
    for generation in args.generations:
        for variant in tpu_variants.decode_variants():
            if args.only and not re.search(args.only, variant.name):
                continue
            try:
                row = registry_row(generation, variant)
            except Exception as error:  # noqa: BLE001 - a failure is a row of the table
                row = dict(generation=generation, variant=variant.name, error=str(error).splitlines()[0][:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    grid = sub.add_parser("views")
    grid.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    grid.add_argument("--heads", nargs="*", type=int, default=[1, 2, 3, 4, 8, 16])
    grid.add_argument("--dims", nargs="*", type=int, default=[64, 128, 192, 256])
    grid.add_argument("--pages", nargs="*", type=int, default=[1024])
    rows_parser = sub.add_parser("registry")
    rows_parser.add_argument("--only", help="a regex on the variant names")
    for p in (grid, rows_parser):
        p.add_argument("--generations", nargs="*", default=list(GENERATIONS))
        p.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if args.command == "registry":  # before libtpu starts
        flags = os.environ.get("LIBTPU_INIT_ARGS", "")
        os.environ["LIBTPU_INIT_ARGS"] = f"{flags} --xla_mosaic_dump_to={_DUMP}".strip()
    sys.path.insert(0, str(HERE))
    from kernel_tiles import _import_kernels

    _import_kernels()
    rows = views(args) if args.command == "views" else registry(args)
    shutil.rmtree(_DUMP, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
