"""Compile every kernel variant for NVIDIA GPUs without a GPU (deviceless ahead-of-time compilation through
XLA, Triton, Mosaic GPU and ptxas) and report registers, spills, shared memory, occupancy and the tensor-core
/ copy instructions of each kernel. Run it through scripts/compile_check.sh, which installs the toolchain.

    python scripts/compile/report.py run --toolchain DIR [--targets sm90a_h100,...] [--only REGEX]
    python scripts/compile/report.py check [docs/compile/report.json]
    python scripts/compile/report.py markdown [docs/compile/report.json]

`run` starts one worker process per (target, group) shard, two at a time (`--jobs`), writes
docs/compile/report.json and docs/compile/index.md, then checks. `check` exits 1 on a compile error, a spill,
shared memory over the target's limit, a Hopper Triton kernel without wgmma where the report expects it, or a
Mosaic kernel without TMA or wgmma.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGETS_DIR = Path(__file__).resolve().parent / "gpu_targets"
REPORT = REPO / "docs" / "compile" / "report.json"
PAGE = REPO / "docs" / "compile" / "index.md"
TARGETS = ("sm90a_h100", "sm80_a100", "sm86_rtx3090")
SASS_OPS = ("HGMMA", "HMMA", "UTMALDG", "LDGSTS")
KERNEL_PREFIXES = ("probjax_", "mha_")  # the Pallas kernels' names: ours, then the peers' (JAX's mha)
# Triton kernels that use no wgmma on Hopper by design, with the reason (docs/compile/index.md repeats it):
# Triton picks mma.sync (HMMA) for a dot whose operands it cannot stage in shared memory in wgmma's layout
# within its shared-memory budget; at head dim 256 the backward's tiles are 32 wide.
NO_WGMMA_OK = {
    ("probjax_flash_backward_dq", 256): "hd256 backward: 32-wide tiles, Triton emits mma.sync",
    ("probjax_flash_backward_dkv", 256): "hd256 backward: 32-wide tiles, Triton emits mma.sync",
    ("probjax_flash_tangent", 256): "hd256 tangent: 32 x 16 tiles (wgmma's spill 1,080 B), mma.sync",
}
# A decode tile holds T x (N / K) query rows, padded to 16: under 64 rows wgmma (M = 64 per warpgroup) does not
# apply and Triton emits mma.sync. Decoding reads the whole cache for a few rows, so memory, not the matmuls,
# bounds it. The T = 16, GQA 32:8 variants (64 rows) must use wgmma.
NO_WGMMA_VARIANTS = {r"^decode_.*(_t1|_t4|_gqa8to2)": "decode tiles of under 64 query rows: mma.sync"}

# Spills the report knows of and CI tolerates, each capped (a larger spill, or one in any other kernel or
# variant, fails): in the Mosaic GPU backward, which is opt-in (FlashConfig(backend="mosaic") or
# PROBJAX_MOSAIC=1; no default picks it), at head dim 128, and in the float32 Triton dK/dV at head dim >= 128. docs/compile/index.md and docs/perf-notes.md give
# the figures; removing them needs kernel work (dS^T / dP^T tiles of 64 queries, or hooks on 64-row tiles).
KNOWN_SPILLS = {
    # (kernel, variant regex): (max spill store bytes, max spill load bytes, why)
    ("probjax_mosaic_backward_dkv", r"^mosaic_grad_d128_.*(causal|window)"):
        (128, 240, "masked steps at head dim 128 (40-48 B; 120 B stores / 228 B loads with GQA 8 -> 2, ptxas "
                   "12.9.86): the causal / window index tiles on top of dK, dV, P^T and dP^T"),
    ("probjax_mosaic_backward_dkv", r"^mosaic_flex_grad_d128_"):
        (2600, 3200, "hooks at head dim 128 run on 128 x 128 tiles: S^T and dP^T of 128 queries per step"),
    ("probjax_flash_backward_dkv", r"^flash_grad_d(128|256)_f32_"):
        (2400, 4000, "float32 dK/dV at head dim 128 / 256 (about 0.3 / 2 KB): FMA dots (Precision.HIGHEST) "
                     "with K, V, dK and dV resident spill at every tile tried; the default kernel's only spill"),
    ("probjax_mosaic_backward_dq", r"^mosaic_flex_grad_d128_"):
        (600, 640, "hooks at head dim 128 run on 128 x 128 tiles: S and dP of 128 keys per step"),
}


# Variants the report compiles and shows failing, which CI reports as OPEN instead of failing, each with why.
OPEN = {
    r"^flex_grad_d128_bf16_relative_bias$": "the relative-bias table's gather in the forward at head dim 128 "
                                            "spills 40-48 B on sm_80 / sm_86 (none on sm_90a)",
}


def is_open(variant: str) -> str | None:
    return next((why for pattern, why in OPEN.items() if re.search(pattern, variant)), None)


def known_spill(kernel: str, variant: str) -> tuple | None:
    for (name, pattern), cap in KNOWN_SPILLS.items():
        if name == kernel and re.search(pattern, variant):
            return cap
    return None


# ---------------------------------------------------------------------------------------------- target


def target_limits(name: str) -> dict:
    """The figures of a target config (scripts/compile/gpu_targets/NAME.txtpb) that bound a kernel."""
    text = (TARGETS_DIR / f"{name}.txtpb").read_text()

    def field(key, cast=int):
        match = re.search(rf"^\s*{key}:\s*(\S+)", text, re.M)
        return cast(match.group(1).strip('"')) if match else None

    capability = re.search(r"cuda_compute_capability\s*{([^}]*)}", text).group(1)
    major = int(re.search(r"major:\s*(\d+)", capability).group(1))
    minor = int(re.search(r"minor:\s*(\d+)", capability).group(1)) if "minor" in capability else 0
    arch = f"sm_{major}{minor}" + ("a" if "ACCELERATED_FEATURES" in text else "")
    return dict(
        name=name, arch=arch, device=re.search(r'device_description_str:\s*"([^"]+)"', text).group(1),
        smem_per_block=field("shared_memory_per_block_optin"), smem_per_sm=field("shared_memory_per_core"),
        threads_per_sm=field("threads_per_core_limit"), regs_per_sm=field("registers_per_core_limit"),
        sms=field("core_count"),
        # Resident CTAs per SM: 16 on compute capability 8.6 / 8.9, 32 on 8.0 and 9.0 (CUDA programming guide).
        ctas_per_sm=16 if (major, minor) in ((8, 6), (8, 9)) else 32,
    )


def occupancy(limits: dict, registers: int, threads: int, smem: int) -> dict:
    """CTAs per SM allowed by registers (allocated per warp in units of 256, 4 sub-partitions of 16 K) and by
    shared memory (1 KB reserved per CTA), each also capped by threads and resident CTAs per SM."""
    warps = max(1, -(-threads // 32))
    cap = min(limits["ctas_per_sm"], limits["threads_per_sm"] // max(threads, 1))
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    warps_by_regs = (limits["regs_per_sm"] // 4 // per_warp) * 4
    by_smem = limits["smem_per_sm"] // (smem + 1024) if smem else cap
    return dict(ctas_by_registers=min(cap, warps_by_regs // warps), ctas_by_smem=min(cap, by_smem))


# ----------------------------------------------------------------------------------------------- parsing


def parse_ptxas(text: str) -> list[dict]:
    """Per entry function of a `ptxas -v` log: registers, spill stores / loads, stack frame."""
    out = []
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", text)[1:]:
        name = re.search(r"entry function '([^']+)'", block).group(1)
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block)
        regs = re.search(r"Used (\d+) registers", block)
        out.append(dict(name=name, registers=int(regs.group(1)) if regs else None,
                        stack=int(spill.group(1)), spill_stores=int(spill.group(2)),
                        spill_loads=int(spill.group(3))))
    return out


def sass_counts(sass: str) -> dict:
    """How many of each instruction of `SASS_OPS` the disassembly holds (an opcode prefix: HGMMA.64x128x16)."""
    return {op: len(re.findall(rf"\b{op}\b", sass)) for op in SASS_OPS}


def ptx_threads(ptx: str) -> int | None:
    match = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", ptx)
    return int(match.group(1)) if match else None


# ----------------------------------------------------------------------------------------------- worker


def _new_files(folder: Path, seen: set) -> list[Path]:
    files = sorted((p for p in folder.iterdir() if p not in seen), key=lambda p: p.name)
    seen.update(files)
    return files


def worker(target: str, group: str, toolchain: Path, only: str | None) -> list[dict]:
    """Compile the group's variants for one target in this process; return one row per variant."""
    scratch = Path(tempfile.mkdtemp(prefix=f"probjax-compile-{target}-"))
    ptxas_dir, xla_dir, mosaic_dir = scratch / "ptxas", scratch / "xla", scratch / "mosaic"
    for folder in (ptxas_dir, xla_dir, mosaic_dir):
        folder.mkdir()
    cuda_root = toolchain / "cuda_root"
    os.environ.update(
        JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", CUDA_ROOT=str(cuda_root),
        # Mosaic GPU runs the first ptxas on PATH, not CUDA_ROOT's: put the pinned one first.
        PATH=f"{cuda_root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        PROBJAX_PTXAS_LOG=str(ptxas_dir), MOSAIC_GPU_DUMP_TO=str(mosaic_dir), MOSAIC_GPU_DUMP_PTX="1",
        MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1",
        XLA_FLAGS=f"--xla_gpu_enable_libnvptxcompiler=false --xla_dump_to={xla_dir}",
    )
    sys.path.insert(0, str(REPO / "scripts"))
    _import_kernels()
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    import variants as compile_variants
    from probjax_kernels import default_config

    limits = target_limits(target)
    device = topologies.get_topology_desc(
        platform="cuda", topology_name=target, target_config=(TARGETS_DIR / f"{target}.txtpb").read_text(),
        topology="1x1x1").devices[0]
    sharding = SingleDeviceSharding(device)
    seen = {dirname: set() for dirname in (ptxas_dir, xla_dir, mosaic_dir)}
    rows = []
    for variant in compile_variants.variants():
        if variant.group != group or (only and not re.search(only, variant.name)):
            continue
        hopper_only = variant.group in ("mosaic", "control") or variant.backend == "mosaic"
        if hopper_only and not limits["arch"].startswith("sm_90"):
            continue
        row = dict(variant=variant.name, group=variant.group, target=target, arch=limits["arch"],
                   head_dim=variant.head_dim, value_dim=variant.value_dim, dtype=variant.dtype,
                   mode=variant.mode, backend=variant.backend, q_len=variant.q_len, kv_len=variant.kv_len)
        start = time.perf_counter()
        try:
            with jax.default_device(device):
                from probjax_kernels import FlashConfig

                config = default_config(FlashConfig(backend=variant.backend, **(variant.tiles or {})),
                                        q_len=variant.q_len, kv_len=variant.kv_len,
                                        head_dim=max(variant.head_dim, variant.value_dim or 0),
                                        dtype=compile_variants._DTYPES[variant.dtype])
                if variant.group not in ("decode", "peer"):  # those have configs of their own
                    row["config"] = {k: v for k, v in vars(config).items() if k != "backend"}
                fn, specs = variant.build()
                specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
                jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).compile()
            row["status"] = "ok"
        except Exception as error:  # noqa: BLE001 - a compile error is a row of the report
            message = str(error).strip().splitlines()
            row["status"] = "error"
            row["error"] = f"{type(error).__name__}: {message[0][:300] if message else ''}"
            smem = re.search(r"requested (\d+), available: (\d+)", str(error))
            if smem:
                row["error_smem"] = [int(smem.group(1)), int(smem.group(2))]
        row["compile_s"] = round(time.perf_counter() - start, 2)
        row["kernels"] = _kernels(limits, _new_files(ptxas_dir, seen[ptxas_dir]),
                                  _new_files(xla_dir, seen[xla_dir]), _new_files(mosaic_dir, seen[mosaic_dir]),
                                  cuda_root)
        rows.append(row)
        print(f"[{target}] {variant.name}: {row['status']} {row['compile_s']} s "
              + " ".join(f"{k['kernel']}:{k['registers']}r/{k['spill_stores']}s" for k in row["kernels"]),
              file=sys.stderr, flush=True)
    return rows


def _import_kernels():
    """Import the repo's kernels/ as `probjax_kernels` (the toolchain venv does not install the project)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "probjax_kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["probjax_kernels"] = module
    spec.loader.exec_module(module)


def _kernels(limits: dict, ptxas_files, xla_files, mosaic_files, cuda_root: Path) -> list[dict]:
    """The Pallas kernels one compile built: Triton ones from the ptxas wrapper's logs / cubins and XLA's
    thunk sequence (threads, dynamic shared memory); Mosaic GPU ones from its dumps."""
    out = []
    launches = {}  # kernel name -> (threads, shared memory) from XLA's thunk sequence
    for path in xla_files:
        if path.name.endswith("thunk_sequence.txt"):
            for name, threads, smem in re.findall(
                    r"\] (\S+) grid: \[[^\]]*\] threads: \[(\d+), 1, 1\]\s+shared_memory: (\d+) bytes",
                    path.read_text()):
                launches[name] = (int(threads), int(smem))
    for log in (p for p in ptxas_files if p.suffix == ".log"):
        for entry in parse_ptxas(log.read_text()):
            if not entry["name"].startswith(KERNEL_PREFIXES) or entry["name"].endswith("_mosaic_gpu_kernel"):
                continue  # XLA's own kernels (fusions, slices, sorts); Mosaic GPU's come from its own dumps
            threads, smem = launches.get(entry["name"], (None, None))
            ptx = log.with_suffix(".ptx")
            threads = threads or (ptx_threads(ptx.read_text()) if ptx.exists() else None)
            cubin = log.with_suffix(".cubin")
            sass = subprocess.run([str(cuda_root / "bin" / "nvdisasm"), str(cubin)], capture_output=True,
                                  text=True).stdout if cubin.exists() else ""
            out.append(_kernel_row(limits, entry, "triton", threads, smem, sass))
    by_stem = {}
    for path in mosaic_files:
        by_stem.setdefault(path.name.split(".")[0], {})[path.name.split(".", 1)[1]] = path
    for stem, files in sorted(by_stem.items()):
        if "ptxas" not in files:
            continue
        for entry in parse_ptxas(files["ptxas"].read_text()):
            resources = files["resources.txt"].read_text() if "resources.txt" in files else ""
            smem = re.search(r"smem_scratch_bytes=(\d+)", resources)
            threads = ptx_threads(files["ptx"].read_text()) if "ptx" in files else None
            sass = files["sass_ctrl"].read_text() if "sass_ctrl" in files else ""
            entry["name"] = re.sub(r"_\d+$", "", stem)
            out.append(_kernel_row(limits, entry, "mosaic", threads, int(smem.group(1)) if smem else None, sass))
    return out


def _kernel_row(limits, entry, lowering, threads, smem, sass) -> dict:
    row = dict(kernel=entry["name"], lowering=lowering, registers=entry["registers"], threads=threads,
               smem=smem, spill_stores=entry["spill_stores"], spill_loads=entry["spill_loads"],
               stack=entry["stack"], **sass_counts(sass))
    if entry["registers"] and threads and smem is not None:
        row.update(occupancy(limits, entry["registers"], threads, smem))
    return row


# ------------------------------------------------------------------------------------------------- check


def row_problems(row: dict, limits: dict) -> list[str]:
    """Every reason one compile fails CI, one line each (`limits`: its target's, from `target_limits`)."""
    where = f"{row['target']} {row['variant']}"
    if row["group"] == "peer":
        return []  # peers (JAX's own kernels) are shown side by side, not held to our checks
    if row["status"] != "ok":
        return [f"{where}: compile error: {row.get('error')}"]
    out = [] if row["kernels"] else [f"{where}: no Pallas kernel found in the compile (it would prove nothing)"]
    for kernel in row["kernels"]:
        name = f"{where} {kernel['kernel']}"
        cap = known_spill(kernel["kernel"], row["variant"])
        if (kernel["spill_stores"] or kernel["spill_loads"]) and not (
                cap and kernel["spill_stores"] <= cap[0] and kernel["spill_loads"] <= cap[1]):
            out.append(f"{name}: spills {kernel['spill_stores']} B stores / {kernel['spill_loads']} B loads")
        if kernel["smem"] is not None and kernel["smem"] > limits["smem_per_block"]:
            out.append(f"{name}: {kernel['smem']} B shared memory over the target's {limits['smem_per_block']}")
        if not row["arch"].startswith("sm_90"):
            continue
        if kernel["lowering"] == "mosaic" and not (kernel["UTMALDG"] and kernel["HGMMA"]):
            out.append(f"{name}: a Mosaic kernel without TMA (UTMALDG {kernel['UTMALDG']}) or wgmma "
                       f"(HGMMA {kernel['HGMMA']})")
        exempt = ((kernel["kernel"], row["head_dim"]) in NO_WGMMA_OK or row["dtype"] == "f32"
                  or any(re.search(pattern, row["variant"]) for pattern in NO_WGMMA_VARIANTS))
        if kernel["lowering"] == "triton" and not kernel["HGMMA"] and not exempt:
            out.append(f"{name}: a Hopper Triton kernel without wgmma (HGMMA 0)")
    return out


def problems(report: dict, open_ones: bool = False) -> list[str]:
    """Every reason the report fails CI, one line each; with `open_ones`, the problems of the `OPEN` variants
    instead (reported, not failing)."""
    limits = {t: target_limits(t) for t in report["targets"]}
    return [line for row in report["rows"] if bool(is_open(row["variant"])) == open_ones
            for line in row_problems(row, limits[row["target"]])]


def check(path: Path) -> int:
    report = json.loads(path.read_text())
    found = problems(report)
    for line in problems(report, open_ones=True):
        print(f"compile_report: OPEN {line}")
    for line in found:
        print(f"compile_report: FAIL {line}")
    kernels = sum(len(r["kernels"]) for r in report["rows"])
    print(f"compile_report: {len(report['rows'])} compiles, {kernels} kernels, {len(found)} problems")
    return 1 if found else 0


# --------------------------------------------------------------------------------------------------- run


def run(args) -> int:
    targets = args.targets.split(",")
    sys.path.insert(0, str(REPO / "scripts"))
    groups = ["mosaic", "triton", "control", "decode", "peer"]  # the longest shard first
    shards = [(t, g) for g in groups for t in targets if not (g in ("mosaic", "control") and not
                                                              target_limits(t)["arch"].startswith("sm_90"))]
    start = time.perf_counter()
    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_shard, t, g, args.toolchain, args.only) for t, g in shards]
        for future in futures:
            rows += future.result()
    order = {name: i for i, name in enumerate(targets)}
    rows.sort(key=lambda r: (order[r["target"]], r["group"], r["variant"]))
    report = _with_verdicts(dict(
        targets=targets, limits={t: target_limits(t) for t in targets}, toolchain=_versions(args.toolchain),
        wall_s=round(time.perf_counter() - start, 1), jobs=args.jobs, rows=rows,
    ))
    out = Path(args.out)
    if out.exists() and "tpu" in json.loads(out.read_text()):  # the TPU part's section (tpu_report.py) stays
        report["tpu"] = json.loads(out.read_text())["tpu"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    import page as compile_page

    Path(args.page).write_text(compile_page.markdown(report, problems(report), problems(report, True)))
    print(f"compile_report: wrote {out} and {args.page} in {report['wall_s']} s")
    return check(out)


def _shard(target, group, toolchain, only) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, __file__, "worker", target, group, "--toolchain", str(toolchain),
                   "--json", str(out)]
        if only:
            command += ["--only", only]
        result = subprocess.run(command, stdout=subprocess.DEVNULL)  # Mosaic GPU prints its IR on stdout
        if result.returncode:
            raise SystemExit(f"compile_report: the worker for {target} / {group} failed (exit {result.returncode})")
        return json.loads(out.read_text())


def _versions(toolchain) -> dict:
    from importlib import metadata

    ptxas = subprocess.run([str(Path(toolchain) / "cuda_root" / "bin" / "ptxas.real"), "--version"],
                           capture_output=True, text=True).stdout.strip().splitlines()
    return dict(jax=metadata.version("jax"), jaxlib=metadata.version("jaxlib"),
                jax_cuda12_plugin=metadata.version("jax-cuda12-plugin"),
                nvidia_cuda_nvcc_cu12=metadata.version("nvidia-cuda-nvcc-cu12"),
                ptxas=ptxas[-1] if ptxas else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("--toolchain", type=Path, required=True)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--only", help="a regex: compile only the variants whose name matches")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=str(REPORT))
    p.add_argument("--page", default=str(PAGE))
    w = sub.add_parser("worker")
    w.add_argument("target")
    w.add_argument("group")
    w.add_argument("--toolchain", type=Path, required=True)
    w.add_argument("--only")
    w.add_argument("--json", type=Path, required=True)
    c = sub.add_parser("check")
    c.add_argument("report", nargs="?", default=str(REPORT))
    m = sub.add_parser("markdown")
    m.add_argument("report", nargs="?", default=str(REPORT))
    args = parser.parse_args()
    if args.command == "run":
        return run(args)
    if args.command == "worker":
        args.json.write_text(json.dumps(worker(args.target, args.group, args.toolchain, args.only)))
        return 0
    if args.command == "check":
        return check(Path(args.report))
    sys.path.insert(0, str(REPO / "scripts"))
    import page as compile_page

    path = Path(args.report)
    report = _with_verdicts(json.loads(path.read_text()))
    path.write_text(json.dumps(report, indent=1) + "\n")
    PAGE.write_text(compile_page.markdown(report, problems(report), problems(report, True)))
    return 0


def _with_verdicts(report: dict) -> dict:
    """The report with this script's verdicts (each row's problems / open, the rules' lists), recomputed from
    the figures: `markdown` refreshes a committed report after a rule changes, without compiling."""
    for row in report["rows"]:  # the verdict travels with the row (tests/test_compile_report.py reads it)
        row["problems"] = row_problems(row, target_limits(row["target"]))
        row["open"] = is_open(row["variant"])
    report.update(
        no_wgmma_ok=[dict(kernel=k, head_dim=d, why=w) for (k, d), w in NO_WGMMA_OK.items()],
        no_wgmma_variants=[dict(variants=k, why=v) for k, v in NO_WGMMA_VARIANTS.items()],
        open=[dict(variants=k, why=v) for k, v in OPEN.items()],
        known_spills=[dict(kernel=k, variants=v, max_stores=c[0], max_loads=c[1], why=c[2])
                      for (k, v), c in KNOWN_SPILLS.items()],
    )
    return report


if __name__ == "__main__":
    sys.exit(main())
