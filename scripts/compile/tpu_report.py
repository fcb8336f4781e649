"""Compile every TPU kernel variant for TPU generations without a TPU (deviceless ahead-of-time compilation
through libtpu) and report, per kernel, its block sizes, grid and scoped VMEM against the generation's limit,
the HBM temp memory of each compile and its compile time; the peers (JAX's splash and flash attention,
tokamax) beside. Run it through scripts/compile_check.sh, which installs the toolchain
(scripts/compile/tpu_toolchain.sh).

    python scripts/compile/tpu_report.py run --toolchain DIR [--targets tpu_v5e,...] [--only REGEX]
    python scripts/compile/tpu_report.py check [docs/compile/report.json]
    python scripts/compile/tpu_report.py markdown [docs/compile/report.json]

`run` starts one worker process per (target, group) shard, two at a time, writes the `tpu` section of the
report JSON (the GPU rows beside it are kept) and docs/compile/tpu.md, then checks (`tpu_check.py`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REPORT = REPO / "docs" / "compile" / "report.json"
PAGE = REPO / "docs" / "compile" / "tpu.md"
GROUPS = ("tpu", "flex", "hbm", "side", "decode", "peer")
_CALL = re.compile(r"%(\S+?)(?:\.\d+)? = [^\n]*custom_call_target=\"tpu_custom_call\"")
_USED = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')
_SIZE = re.compile(r'"size":"(\d+)"')


# ----------------------------------------------------------------------------------------------- parsing


def custom_calls(hlo: str) -> list[dict]:
    """Each `tpu_custom_call` of a compiled module's text (one per Mosaic TPU kernel), with the scoped VMEM the
    compiler allotted it (its pipelined blocks, double-buffered, and its scratch), in bytes. An instruction
    can span lines (splash attention's kernel metadata holds newlines): its figure is the first
    `used_scoped_memory_configs` after its name, before the next kernel's."""
    calls = [(m.start(), m.group(1)) for m in _CALL.finditer(hlo)]
    out = []
    for i, (start, name) in enumerate(calls):
        end = calls[i + 1][0] if i + 1 < len(calls) else len(hlo)
        used = _USED.search(hlo, start, end)
        sizes = [int(s) for s in _SIZE.findall(used.group(1))] if used else []
        out.append(dict(kernel=name, scoped_vmem=sum(sizes) if used else None))
    return out


_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_MOVES_NOTHING = ("parameter(", "get-tuple-element(", "tuple(", "bitcast(", "constant(", "custom-call(",
                  "copy-done(", "slice-done(", "after-all(", "partition-id(", "replica-id(")


def xla_side_bytes(hlo: str) -> int:
    """HBM bytes the compiled program moves outside its Mosaic kernels: for each instruction of the entry
    computation other than the kernels (custom-calls) and the ops that move nothing (parameters, tuples,
    bitcasts, the done halves of async copies), the bytes of its result and of its operands, by their shapes
    in the optimized HLO text. An estimate of the XLA-side traffic (a fusion reads each operand once)."""
    entry = hlo[hlo.find("\nENTRY"):]
    entry = entry[:entry.find("\n}")].splitlines()[1:]
    sizes, lines = {}, []
    for line in entry:
        if " = " not in line:
            continue
        name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
        rest = rest.split(", metadata=")[0].split(", backend_config=")[0]
        op_at = re.search(r" [a-z][a-z0-9_-]*\(", rest)
        result = rest[:op_at.start()] if op_at else rest
        sizes[name] = sum(_size(dtype, dims) for dtype, dims in _SHAPE.findall(result))
        lines.append((name, rest, rest[op_at.start():] if op_at else ""))
    total = 0
    for name, rest, call in lines:
        if any(op in rest for op in _MOVES_NOTHING):
            continue
        operands = re.findall(r"%([\w.\-]+)", call.split("), ")[0])
        total += sizes[name] + sum(sizes.get("%" + x, 0) for x in operands)
    return total


def _size(dtype: str, dims: str) -> int:
    size = _BYTES[dtype]
    for d in filter(None, dims.split(",")):
        size *= int(d)
    return size


def record_pallas_calls(log: list) -> None:
    """Make `jax.experimental.pallas.pallas_call` append each kernel's name, grid and blocks to `log` when a
    function is traced or lowered (a backward is traced at lowering, inside our custom_linear primitive, so a
    jaxpr walk would miss it). Kernels look `pl.pallas_call` up at call time, so this sees them all; the grid
    is the kernel's own (a vmap over it, as in the splash peer, adds an axis not shown)."""
    from jax.experimental import pallas as pl

    original = pl.pallas_call

    def recording(kernel, *args, **kwargs):
        spec = kwargs.get("grid_spec")
        grid = kwargs.get("grid", getattr(spec, "grid", ()))
        grid = grid if isinstance(grid, (tuple, list)) else (grid,)
        in_specs = kwargs.get("in_specs", getattr(spec, "in_specs", ()))
        out_specs = kwargs.get("out_specs", getattr(spec, "out_specs", ()))
        specs = [*_flat(in_specs), *_flat(out_specs)]
        log.append(dict(name=kwargs.get("name") or getattr(kernel, "__name__", "?"),
                        grid=[int(g) if isinstance(g, int) else str(g) for g in grid],
                        blocks=[b for b in (_block(x) for x in specs) if b is not None]))
        return original(kernel, *args, **kwargs)

    pl.pallas_call = recording


def _flat(specs) -> list:
    if specs is None:
        return []
    if isinstance(specs, (list, tuple)):
        return [x for s in specs for x in _flat(s)]
    return [specs]


def _block(spec) -> list | None:
    """A BlockSpec's block without its squeezed dims; None for a whole-array one (SMEM tables, scalars)."""
    shape = getattr(spec, "block_shape", None)
    if shape is None:
        return None
    dims = []
    for d in shape:
        if d is None or type(d).__name__ == "Squeezed":
            continue
        size = getattr(d, "block_size", d)
        dims.append(int(size) if isinstance(size, int) else str(size))
    return dims


# ------------------------------------------------------------------------------------------------ worker


def worker(target: str, group: str, only: str | None, reuse: Path | None = None, verify: int = 0,
           seed: str = "") -> list[dict]:
    """Compile the group's variants for one generation in this process; one row per variant. With `reuse` (an
    earlier report), a variant whose lowered module has the fingerprint of that report's row takes that row's
    kernels and HBM figures instead of compiling (`_fingerprint`, fingerprints.py); `verify` of them, chosen by
    `seed`, are compiled all the same and must give the same figures."""
    sys.path.insert(0, str(HERE))
    import report as gpu_report

    os.environ.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",  # file names without the machine's folders
                      JAX_HLO_SOURCE_FILE_CANONICALIZATION_REGEX=gpu_report.source_paths_regex(REPO, Path(sys.prefix)))

    gpu_report._import_kernels()
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    import tpu_variants
    from probjax_kernels import FlashConfig, default_config

    topology = topologies.get_topology_desc(topology_name=tpu_variants.TOPOLOGIES[target], platform="tpu",
                                            chips_per_host_bounds=[1, 1, 1])
    device = topology.devices[0]
    sharding = SingleDeviceSharding(device)
    calls = []
    record_pallas_calls(calls)
    key = _compile_key(target)
    earlier = gpu_report._reusable_rows(json.loads(reuse.read_text()).get("tpu", {}), target) if reuse else {}
    todo = [v for v in tpu_variants.variants() if v.group == group and not (only and not re.search(only, v.name))]
    checked = {unit[0].name for unit in gpu_report._verify_units([(v,) for v in todo], earlier, verify, seed)}
    rows = []
    for variant in todo:
        row = dict(target=target, device_kind=device.device_kind, variant=variant.name, group=variant.group,
                   mode=variant.mode, dtype=variant.dtype, head_dim=variant.head_dim, q_len=variant.q_len,
                   path=variant.path, required=list(variant.required_kernels(target)))
        if variant.group == "peer":
            row["features"] = variant.features
        start = time.perf_counter()
        try:
            with jax.default_device(device), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if variant.group not in ("peer", "decode"):
                    config = default_config(FlashConfig(backend="tpu"), q_len=variant.q_len, kv_len=variant.q_len,
                                            head_dim=variant.head_dim)
                    row["config"] = {k: v for k, v in vars(config).items()
                                     if k.startswith("block_") and v is not None} | (variant.tiles or {})
                fn, specs = variant.build()
                specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
                calls.clear()
                lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",))
                options = dict(variant.compiler_options)
                if options:
                    row["compiler_options"] = options
                row["fingerprint"] = gpu_report._fingerprint(
                    lowered.as_text(), key + json.dumps(options, sort_keys=True) * bool(options),
                    (REPO, Path(sys.prefix)))
                old = earlier.get(variant.name)
                if variant.name not in checked and old and old["fingerprint"] == row["fingerprint"]:
                    compiled = None
                    row.update(reused=True, kernels=[dict(kernel=k["kernel"], scoped_vmem=k["scoped_vmem"])
                                                     for k in old["kernels"]], hbm=old["hbm"])
                else:
                    compiled = lowered.compile(compiler_options=options or None)
            fallbacks = [str(w.message) for w in caught if "XLA path" in str(w.message)]
            row["dispatch"] = "fallback" if fallbacks else "kernel"
            if fallbacks:
                row["fallback_warning"] = fallbacks[0][:400]
            if compiled is not None:
                text = compiled.as_text()
                row["kernels"] = custom_calls(text)
                memory = compiled.memory_analysis()
                row["hbm"] = {name: getattr(memory, f"{name}_size_in_bytes", None)
                              for name in ("temp", "argument", "output")}
                row["hbm"]["xla_bytes"] = xla_side_bytes(text)
            row["status"] = "ok"
        except Exception as error:  # noqa: BLE001 - a compile error is a row of the report
            message = str(error).strip().splitlines()
            row.update(status="error", kernels=[],
                       error=f"{type(error).__name__}: {message[0][:400] if message else ''}")
        row["compile_s"] = earlier[variant.name]["compile_s"] if row.get("reused") else round(
            time.perf_counter() - start, 2)
        _attach_grids(row, calls)
        if variant.name in checked:
            row.update(gpu_report._reproduces(row, earlier.get(variant.name), ("kernels", "hbm")))
        rows.append(row)
        print(f"[{target}] {variant.name}: {row['status']} {row['compile_s']} s{' (reused)' * bool(row.get('reused'))} "
              f"{row.get('dispatch', '')} "
              + " ".join(f"{k['kernel']}:{(k['scoped_vmem'] or 0) / 2**20:.2f}MiB" for k in row["kernels"]),
              file=sys.stderr, flush=True)
    return rows


def _compile_key(target: str) -> str:
    """What a compile's figures depend on besides its lowered module: the generation, the toolchain's versions and
    the source of the code that reads the figures."""
    parts = [target, json.dumps(_versions(None), sort_keys=True),
             *(inspect.getsource(fn) for fn in (custom_calls, _attach_grids, record_pallas_calls, _block,
                                                 xla_side_bytes, _size))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _attach_grids(row: dict, calls: list) -> None:
    """Give each compiled kernel the grid and blocks of the pallas_call of the same name (in order)."""
    calls = list(calls)
    for kernel in row["kernels"]:
        match = next((c for c in calls if c["name"] == kernel["kernel"]), None)
        if match is not None:
            calls.remove(match)
            kernel.update(grid=match["grid"], blocks=match["blocks"])


# --------------------------------------------------------------------------------------------------- run


def run(args) -> int:
    sys.path.insert(0, str(HERE))
    import tpu_check
    import tpu_page

    targets = args.targets.split(",")
    tpu_check._registry()  # makes probjax_kernels importable, which building the registry needs
    import tpu_variants

    wanted = {v.group for v in tpu_variants.variants() if not args.only or re.search(args.only, v.name)}
    # The peers compile for the gated generations only (shown beside ours, not checked).
    shards = [(t, g) for g in ("tpu", "peer", "flex", "hbm", "side", "decode") for t in targets
              if g in wanted and (g != "peer" or t in tpu_check.GATED_TARGETS)]
    if args.reuse and not args.reuse.exists():
        raise SystemExit(f"tpu_report: --reuse {args.reuse}: no such report")
    import report as gpu_report

    reuse = (args.reuse, args.verify, args.seed if args.seed is not None else gpu_report.head_commit(REPO))
    start = time.perf_counter()
    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(_shard, t, g, args.only, *reuse) for t, g in shards]:
            rows += future.result()
    order = {name: i for i, name in enumerate(targets)}
    rows.sort(key=lambda r: (order[r["target"]], GROUPS.index(r["group"]), r["variant"]))
    section = dict(targets=targets, toolchain=_versions(args.toolchain), wall_s=round(time.perf_counter() - start, 1),
                   jobs=args.jobs, only=args.only, reused_from=gpu_report._shown_path(args.reuse) if args.reuse else None,
                   rows=rows)
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    if args.keep_others and report.get("tpu"):  # a partial rerun: the other rows of the last run stay
        done = {(r["target"], r["variant"]) for r in rows}
        kept = [r for r in report["tpu"]["rows"] if (r["target"], r["variant"]) not in done]
        order = {name: i for i, name in enumerate(report["tpu"]["targets"])}
        rows = sorted(kept + rows, key=lambda r: (order.get(r["target"], 99), GROUPS.index(r["group"]), r["variant"]))
        section.update(rows=rows, targets=report["tpu"]["targets"], wall_s=report["tpu"]["wall_s"],
                       reran=dict(only=args.only, targets=targets, wall_s=section["wall_s"]))
    report["tpu"] = tpu_check.with_verdicts(section)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    Path(args.page).write_text(tpu_page.markdown(report["tpu"]))
    print(f"tpu_report: wrote the tpu section of {out} and {args.page} in {section['wall_s']} s"
          + (f"; {sum(bool(r.get('reused')) for r in rows)} of {len(rows)} rows reused from {args.reuse}, "
             f"{sum('reproduced' in r for r in rows)} re-compiled to check they reproduce it" if args.reuse else ""))
    return tpu_check.check(report)


def _shard(target, group, only, reuse=None, verify=0, seed="") -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, __file__, "worker", target, group, "--json", str(out)]
        if only:
            command += ["--only", only]
        if reuse:
            command += ["--reuse", str(Path(reuse).resolve()), "--verify", str(verify), "--seed", seed]
        result = subprocess.run(command, stdout=subprocess.DEVNULL)
        if result.returncode:  # the rows stay missing: the check reports each expected one as absent
            print(f"tpu_report: the worker for {target} / {group} failed (exit {result.returncode})", file=sys.stderr)
            return []
        return json.loads(out.read_text())


def _versions(toolchain) -> dict:
    from importlib import metadata

    versions = {name: metadata.version(name) for name in ("jax", "jaxlib", "libtpu")}
    try:
        versions["tokamax"] = metadata.version("tokamax")
    except metadata.PackageNotFoundError:
        note = Path(toolchain) / ".tokamax" if toolchain else None
        versions["tokamax"] = note.read_text().strip() if note and note.exists() else "not installed"
    return versions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("--toolchain", type=Path)
    p.add_argument("--targets", default="tpu_v5e,tpu_v5p,tpu_v6e,tpu_7x")
    p.add_argument("--only", help="a regex: compile only the variants whose name matches (the check then fails: "
                                  "the others are missing)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=str(REPORT))
    p.add_argument("--page", default=str(PAGE))
    p.add_argument("--keep-others", action="store_true",
                   help="replace only the rows this run compiles in the report's tpu section, keep the others")
    p.add_argument("--reuse", type=Path, help="an earlier report (docs/compile/report.json): a variant whose lowered "
                   "module has the fingerprint of its tpu row there takes that row's figures, uncompiled")
    p.add_argument("--verify", type=int, default=1, help="with --reuse: how many reusable variants per (target, "
                   "group) shard are compiled all the same, their figures required equal to the reused ones")
    p.add_argument("--seed", help="with --reuse: picks the --verify variants (default: the checkout's commit)")
    w = sub.add_parser("worker")
    w.add_argument("target")
    w.add_argument("group")
    w.add_argument("--only")
    w.add_argument("--reuse", type=Path)
    w.add_argument("--verify", type=int, default=0)
    w.add_argument("--seed", default="")
    w.add_argument("--json", type=Path, required=True)
    for name in ("check", "markdown"):
        c = sub.add_parser(name)
        c.add_argument("report", nargs="?", default=str(REPORT))
        c.add_argument("--page", default=str(PAGE))
    args = parser.parse_args()
    if args.command == "run":
        return run(args)
    if args.command == "worker":
        args.json.write_text(json.dumps(worker(args.target, args.group, args.only, args.reuse, args.verify,
                                               args.seed)))
        return 0
    sys.path.insert(0, str(HERE))
    import tpu_check
    import tpu_page

    path = Path(args.report)
    report = json.loads(path.read_text())
    if args.command == "check":
        return tpu_check.check(report)
    report["tpu"] = tpu_check.with_verdicts(report["tpu"])
    path.write_text(json.dumps(report, indent=1) + "\n")
    Path(args.page).write_text(tpu_page.markdown(report["tpu"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
