"""Compile every kernel variant for NVIDIA GPUs without a GPU (deviceless ahead-of-time compilation through
XLA, Triton, Mosaic GPU and ptxas) and report registers, spills, shared memory, occupancy and the tensor-core
/ copy instructions of each kernel. Run it through scripts/compile_check.sh, which installs the toolchain.

    python scripts/compile/report.py run --toolchain DIR [--targets sm90a_h100,...] [--only REGEX]
    python scripts/compile/report.py check [docs/compile/report.json] [--targets ...] [--only REGEX]
    python scripts/compile/report.py markdown [docs/compile/report.json]

`run` starts one worker process per (target, group) shard, two at a time (`--jobs`), writes
docs/compile/report.json and docs/compile/index.md, then checks what it compiled. `check` fails closed: the
registry (scripts/compile/variants.py) is the expected set, and a (target, variant) pair missing from the
report, a row the registry lacks, a required kernel missing (or one not expected), a compile error (a variant
that raised while being built included), or an empty expected set fails it; then, per kernel, a spill outside
`SPILLS`' capped entries, shared memory over the target's limit, and the instruction checks: on Hopper, TMA
and wgmma in Mosaic kernels and a wgmma share of at least `MIN_WGMMA_SHARE` (`LOW_WGMMA_SHARE` per kernel);
on sm_80 / sm_86, mma.sync and cp.async in 16-bit kernels.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import bisect
import concurrent.futures
import contextlib
import hashlib
import inspect
import itertools
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGETS_DIR = Path(__file__).resolve().parent / "gpu_targets"
REPORT = REPO / "docs" / "compile" / "report.json"
PAGE = REPO / "docs" / "compile" / "index.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants as registry  # noqa: E402 - the expected set: scripts/compile/variants.py

TARGETS = registry.GPU_TARGETS
SASS_OPS = ("HGMMA", "HMMA", "UTMALDG", "LDGSTS")
# The Pallas Triton kernels' names: ours, then the peers' (JAX's mha, tokamax's); Mosaic GPU kernels come from
# their own dumps.
KERNEL_PREFIXES = ("probjax_", "mha_", "pallas_flash_attention")

from sources import head_commit, source_paths_regex  # noqa: E402 - jax-free, shared with tpu_slices.py
from rules import (  # noqa: E402 - the exceptions the check allows, each with its figure and why
    LOW_WGMMA_SHARE, MIN_WGMMA_SHARE, NO_WGMMA_VARIANTS, SPILLS,
)


def spill_cap(kernel: str, target: str, variant: str) -> tuple | None:
    return SPILLS.get((kernel, target, variant))


def expected(targets=None, only: str | None = None) -> list[tuple[str, registry.Variant]]:
    """The (target, variant) pairs a report must hold: every variant of the registry on each target it applies
    to, among `targets` (all the registry's by default) and the variants whose name matches `only`."""
    targets = targets or TARGETS
    return [(t, v) for v in registry.variants() for t in targets
            if t in v.targets and not (only and not re.search(only, v.name))]


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


def worker(target: str, group: str, toolchain: Path, only: str | None, journal: Path | None = None,
           first: str | None = None, reuse: Path | None = None, verify: int = 0, seed: str = "") -> list[dict]:
    """Compile the group's variants for one target in this process; return one row per variant (a call's
    fwd+bwd and jvp variants compiled as one program: `_compile_units`, `compile_together`). With a
    `journal` (JSON lines), each row is appended to it as it is made and the pairs it already holds are not
    compiled again (their rows are returned from it); `first`: a regex of the variants to compile first.
    With `reuse` (an earlier report), a compile unit whose lowered module has the fingerprint of that report's
    row (`_fingerprint`) takes that row's kernels instead of compiling; `verify` of those units (chosen by
    `seed`: `_verify_units`) are compiled all the same, and a kernel figure that differs from the earlier
    row's fails the row."""

    def done() -> dict:  # read before each variant: another run may share the journal
        if journal is None or not journal.exists():
            return {}
        rows = (json.loads(line) for line in journal.read_text().splitlines() if line.strip())
        return {row["variant"]: row for row in rows if row["target"] == target}

    scratch = Path(tempfile.mkdtemp(prefix=f"probjax-compile-{target}-"))
    atexit.register(shutil.rmtree, scratch, True)  # the dumps and cubins: GBs over a full run
    ptxas_dir, xla_dir, mosaic_dir = scratch / "ptxas", scratch / "xla", scratch / "mosaic"
    for folder in (ptxas_dir, xla_dir, mosaic_dir):
        folder.mkdir()
    cuda_root = toolchain / "cuda_root"
    os.environ.update(_compile_environment(cuda_root, ptxas_dir, xla_dir))
    _import_kernels()
    sys.path.append(str(toolchain / "peers"))  # tokamax (a peer), after the venv: gpu_toolchain.sh
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from probjax_kernels import default_config

    from jax.experimental.mosaic.gpu import utils as mosaic_utils

    def dump_resources(content: str, name: str, path: str):  # Pallas' dump of a kernel's shared memory
        (mosaic_dir / name).write_text(content + "\n")

    mosaic_utils.dump_to_file_or_stdout = dump_resources

    # With its dumps on, Mosaic GPU names each kernel's module `mosaic_gpu.dump_basename` = its name and a count
    # kept per process in jaxlib, and that attribute is in the lowered module. `named_per_unit` sets it first,
    # from the compile's variants and a count per compile (`fresh_unit`), so that a unit's module, and its
    # fingerprint, are the same whatever the worker lowered before it. The name stays unique in the process:
    # jaxlib caches a compiled Mosaic kernel by its module, and a second compile of the same name would print no
    # PTX / ptxas / SASS to read the figures from (the jvp's forward after the grad's, a pair compiled alone
    # after its joint compile failed).
    from jax._src.lib import mosaic_gpu_dialect
    from jax._src.lib.mlir import ir

    dump_options_of = mosaic_gpu_dialect.get_or_set_dump_options
    dump_names = iter(())

    def named_per_unit(module):
        attributes = module.operation.attributes
        if "mosaic_gpu.dump_basename" not in attributes and "sym_name" in attributes:
            name = ir.StringAttr(attributes["sym_name"]).value
            attributes["mosaic_gpu.dump_basename"] = ir.StringAttr.get(f"{name}_{next(dump_names)}")
        return dump_options_of(module)

    mosaic_gpu_dialect.get_or_set_dump_options = named_per_unit

    def fresh_unit(variants):
        """Before each compile (see `compile_unit`): empty JAX caches, and Mosaic GPU dump names numbered from
        the variants' names (a count: `_split_mosaic_stdout` reads the kernel's name before it)."""
        nonlocal dump_names
        jax.clear_caches()
        tag = int(hashlib.sha256(" ".join(v.name for v in variants).encode()).hexdigest()[:12], 16) % 10**9
        dump_names = (f"{tag:09d}{count:03d}" for count in itertools.count())

    limits = target_limits(target)
    device = topologies.get_topology_desc(
        platform="cuda", topology_name=target, target_config=(TARGETS_DIR / f"{target}.txtpb").read_text(),
        topology="1x1x1").devices[0]
    sharding = SingleDeviceSharding(device)
    seen = {dirname: set() for dirname in (ptxas_dir, xla_dir, mosaic_dir)}
    key = _compile_key(target, toolchain)
    earlier = _reusable_rows(json.loads(reuse.read_text()), target) if reuse else {}

    def fingerprint(lowered) -> str:
        return _fingerprint(lowered.as_text(), key, (REPO, toolchain))

    def reused(variants, rows, fingerprint) -> bool:
        """Fill `rows` from the earlier report's when each has `fingerprint` (then nothing is compiled)."""
        old = [earlier.get(v.name) for v in variants]
        if not all(o and o["fingerprint"] == fingerprint for o in old):
            return False
        discard_dumps()
        for row, o in zip(rows, old):
            row.update(status="ok", fingerprint=fingerprint, reused=True, compile_s=o["compile_s"],
                       kernels=o["kernels"], **({"compiled_with": o["compiled_with"]} if o.get("compiled_with") else {}))
        return True

    def new_row(variant) -> dict:
        return dict(variant=variant.name, group=variant.group, target=target, arch=limits["arch"],
                    head_dim=variant.head_dim, value_dim=variant.value_dim, dtype=variant.dtype,
                    mode=variant.mode, backend=variant.backend, q_len=variant.q_len, kv_len=variant.kv_len,
                    requires=list(variant.requires))

    def built(variant, row):
        """The variant's function and argument specs, its row given the config it runs at."""
        from probjax_kernels import FlashConfig

        config = default_config(FlashConfig(backend=variant.backend, **(variant.tiles or {})),
                                q_len=variant.q_len, kv_len=variant.kv_len,
                                head_dim=max(variant.head_dim, variant.value_dim or 0),
                                dtype=registry.dtype_of(variant.dtype))
        if variant.group not in ("decode", "peer"):  # those have configs of their own
            row["config"] = {k: v for k, v in vars(config).items() if k != "backend"}
        if variant.mode == "jvp":
            row["tangent_config"] = _tangent_tiles(config, variant)
        fn, specs = variant.build()
        return fn, [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]

    def compiled_kernels() -> list[dict]:
        """The kernels of the last compile (its dumps, which are then marked as read)."""
        _split_mosaic_stdout((scratch / "stdout.txt").read_text(errors="replace"), mosaic_dir)
        mosaic_files = _new_files(mosaic_dir, seen[mosaic_dir])
        kernels = _kernels(limits, _new_files(ptxas_dir, seen[ptxas_dir]), _new_files(xla_dir, seen[xla_dir]),
                           mosaic_files, cuda_root)
        for path in mosaic_files:  # a later kernel dumped under the same name (a peer's "entry") is new again
            path.unlink()
            seen[mosaic_dir].discard(path)
        return kernels

    def discard_dumps():
        for folder in (ptxas_dir, xla_dir):
            _new_files(folder, seen[folder])
        for path in mosaic_dir.iterdir():
            path.unlink()
        seen[mosaic_dir].clear()

    def compile_alone(variant, may_reuse=True) -> dict:
        fresh_unit([variant])
        row = new_row(variant)
        # The peers name several Mosaic kernels alike: their dumps go to files named per kernel (MOSAIC_GPU_DUMP_TO,
        # which also dumps the IR before every MLIR pass, ~180 MB a call); ours have distinct names, and their
        # PTX / ptxas / SASS dumps come on stdout, told apart by the kernel's name (`_split_mosaic_stdout`).
        if variant.group == "peer":
            os.environ["MOSAIC_GPU_DUMP_TO"] = str(mosaic_dir)
        else:
            os.environ.pop("MOSAIC_GPU_DUMP_TO", None)
        start = time.perf_counter()
        try:
            with jax.default_device(device), _stdout_to(scratch / "stdout.txt"):
                fn, specs = built(variant, row)
                with _traced_tiles(row.setdefault("kernel_configs", {})):
                    lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
                row["fingerprint"] = fingerprint(lowered)
                if may_reuse and reused([variant], [row], row["fingerprint"]):
                    return row
                lowered.compile()
            row["status"] = "ok"
        except Exception as error:  # noqa: BLE001 - a compile error is a row of the report
            row.update(_error_fields(error))
        row["compile_s"] = round(time.perf_counter() - start, 2)
        try:
            row["kernels"] = compiled_kernels()
        except ValueError as error:
            row.update(status="error", error=str(error), kernels=[])
            discard_dumps()
        return row

    def compile_together(pair, may_reuse=True) -> tuple[list[dict] | None, str | None]:
        """The two variants (fwd+bwd and jvp of one call: the same arguments) compiled as one program, so that
        the forward kernel both run is compiled once (XLA merges the identical kernel calls); each row holds
        the kernels its own function lowers to (`_kernels_by_function`). None, the dumps discarded, when they
        must be compiled one by one: the joint compile failed, or a compiled kernel is not one function's
        alone or both's shared (a name twice: the two did not share it); the earlier report's rows say so
        for the same joint module (`joint_fingerprint`) and then it is not tried again. Second: the joint
        module's fingerprint."""
        fresh_unit(pair)
        os.environ.pop("MOSAIC_GPU_DUMP_TO", None)
        rows = [new_row(v) for v in pair]
        traced = {}
        joint = None
        start = time.perf_counter()
        try:
            with jax.default_device(device), _stdout_to(scratch / "stdout.txt"):
                functions, arguments = [], []
                for variant, row in zip(pair, rows):
                    fn, specs = built(variant, row)
                    functions.append(jax.jit(_named(fn, variant.name)))
                    arguments.append([(s.shape, s.dtype) for s in specs])
                if arguments[0] != arguments[1]:
                    raise ValueError("the two variants take different arguments")
                with _traced_tiles(traced):
                    lowered = jax.jit(lambda *args: tuple(f(*args) for f in functions)).trace(*specs).lower(
                        lowering_platforms=("cuda",))
                own = _kernels_by_function(lowered.as_text(), [v.name for v in pair])
                joint = fingerprint(lowered)
                for row, names in zip(rows, own):
                    row["kernel_configs"] = {k: v for k, v in traced.items() if k in names}
                if may_reuse and reused(pair, rows, joint):
                    return rows, joint
                if may_reuse and all((earlier.get(v.name) or {}).get("joint_fingerprint") == joint for v in pair):
                    return None, joint
                lowered.compile()
            elapsed = round(time.perf_counter() - start, 2)
            kernels = compiled_kernels()
        except Exception:  # noqa: BLE001 - compiled one by one, each error in its own row
            discard_dumps()
            return None, joint
        found = [k["kernel"] for k in kernels]
        if len(set(found)) != len(found) or set(found) != set().union(*own):
            return None, joint
        for row, names in zip(rows, own):
            partner = next(r["variant"] for r in rows if r is not row)
            row.update(status="ok", compile_s=elapsed, compiled_with=partner, fingerprint=joint,
                       kernels=[k for k in kernels if k["kernel"] in names])
        return rows, joint

    def compile_unit(variants, may_reuse=True) -> list[dict]:
        """The rows of one unit. Each compile starts from empty JAX caches (a jaxpr cached by an earlier unit
        keeps the source locations of the call that traced it first) and names its Mosaic GPU dumps from its
        own variants (`named_per_unit`): without them a unit's lowered module (and its fingerprint) would depend
        on which units this worker compiled before it."""
        made, joint = compile_together(variants, may_reuse) if len(variants) == 2 else (None, None)
        if made is None:
            made = [compile_alone(v, may_reuse) for v in variants]
            for row in made if joint else ():
                row["joint_fingerprint"] = joint
        return made

    rows = []
    todo = [v for _, v in expected([target], only) if v.group == group]
    todo.sort(key=lambda v: not (first and re.search(first, v.name)))
    units = _compile_units(todo)
    checked = _verify_units(units, earlier, verify, seed)
    for unit in units:
        journaled = done()
        pending = [v for v in unit if v.name not in journaled]
        rows += [journaled[v.name] for v in unit if v.name in journaled]
        made = compile_unit(pending, may_reuse=unit not in checked)
        if unit in checked:
            for row in made:
                row.update(_reproduces(row, earlier.get(row["variant"])))
        for row in made:
            rows.append(row)
            if journal is not None:
                with journal.open("a") as file:  # one line per write: shards appending at once do not interleave
                    file.write(json.dumps(row) + "\n")
            print(f"[{target}] {row['variant']}: {row['status']} {row['compile_s']} s"
                  f"{' (reused)' if row.get('reused') else ''} "
                  + " ".join(f"{k['kernel']}:{k['registers']}r/{k['spill_stores']}s" for k in row["kernels"]),
                  file=sys.stderr, flush=True)
    return rows


def _compile_environment(cuda_root: Path, ptxas_dir: Path, xla_dir: Path) -> dict:
    """The worker's environment: a deviceless CUDA compile with the pinned ptxas, its logs and XLA's dumps kept,
    and source file names relative to the checkout or the toolchain. A kernel's IR locates each op by the line
    that made it, without the calls around it: with the whole traceback, the lines of this script and of the
    registry that lead to a kernel were in every kernel's module, so an edit of either made every fingerprint
    new."""
    return dict(
        JAX_HLO_SOURCE_FILE_CANONICALIZATION_REGEX=source_paths_regex(REPO, cuda_root.parent),
        JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS="0",
        JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", CUDA_ROOT=str(cuda_root),
        # Mosaic GPU runs the first ptxas on PATH, not CUDA_ROOT's: put the pinned one first.
        PATH=f"{cuda_root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        PROBJAX_PTXAS_LOG=str(ptxas_dir), XLA_FLAGS=f"--xla_gpu_enable_libnvptxcompiler=false --xla_dump_to={xla_dir}",
        **MOSAIC_DUMPS,
    )


def _compile_key(target: str, toolchain: Path) -> str:
    """What a compile's figures depend on besides its lowered module: the target's description, the toolchain's
    versions and ptxas wrapper, and the source of the code that compiles and reads the figures
    (`FIGURE_CODE`). A change to any of them makes every fingerprint new."""
    parts = [target, (TARGETS_DIR / f"{target}.txtpb").read_text(), json.dumps(_versions(toolchain), sort_keys=True),
             (Path(toolchain) / "cuda_root" / "bin" / "ptxas").read_text(), json.dumps(MOSAIC_DUMPS, sort_keys=True)]
    parts += [inspect.getsource(fn) for fn in FIGURE_CODE]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _fingerprint(module: str, key: str, roots=()) -> str:
    """The identity of one compile: its lowered StableHLO text (the Pallas kernels' Triton / Mosaic GPU IR
    inside it, Mosaic TPU's base64-encoded, with their source locations) under `key` (`_compile_key`). The
    folders in `roots` (the checkout, the toolchain: they differ between machines) are left out of the text and
    of the encoded kernels, and so is Mosaic GPU's `kernel_hash`, a hash of its serialized module, those paths
    included."""
    spellings = [(s, f"<root {i}>") for i, root in enumerate(roots) for s in {str(root), str(Path(root).resolve())}]

    def without_roots(text):
        for spelling, placeholder in spellings:
            text = text.replace(spelling, placeholder)
        return text

    def decoded(match):  # a Mosaic TPU kernel: its module in base64
        body = without_roots(base64.b64decode(match.group(1)).decode("latin-1")).encode("latin-1")
        return f"body {hashlib.sha256(body).hexdigest()}"

    module = re.sub(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", decoded, module)
    module = re.sub(r'kernel_hash = "(?:[^"\\]|\\.)*"', "kernel_hash", without_roots(module))
    return hashlib.sha256(f"{key}\n{module}".encode()).hexdigest()[:32]


def _reusable_rows(report: dict, target: str) -> dict[str, dict]:
    """An earlier report's rows for `target` that a compile may take over: compiled without error, with a
    fingerprint, and not themselves failed as a re-check (`_reproduces`)."""
    return {r["variant"]: r for r in report.get("rows", [])
            if r["target"] == target and r.get("status") == "ok" and r.get("fingerprint")}


def _verify_units(units: list[tuple], earlier: dict, count: int, seed: str) -> list[tuple]:
    """`count` of the units the earlier report holds every row of, picked by a hash of `seed` and their
    names: compiled although they may be reused, to show the reused figures reproduce (`_reproduces`)."""
    candidates = [u for u in units if all(v.name in earlier for v in u)]
    candidates.sort(key=lambda u: hashlib.sha256(f"{seed}:{u[0].name}".encode()).hexdigest())
    return candidates[:count]


def _reproduces(row: dict, earlier: dict | None, fields=("kernels",)) -> dict:
    """A re-compiled row against the earlier report's row of the same variant: `reproduced` when both have one
    fingerprint and the same `fields` (a list field compared as a multiset); an error when they have one
    fingerprint and differ (the fingerprint would not stand for the figures); nothing when the module changed."""
    if earlier is None or earlier.get("fingerprint") != row.get("fingerprint"):
        return {}
    def figures(r):
        return [sorted(json.dumps(x, sort_keys=True) for x in r.get(f) or []) if isinstance(r.get(f), list)
                else json.dumps(r.get(f), sort_keys=True) for f in fields]

    if row["status"] == "ok" and figures(row) == figures(earlier):
        return dict(reproduced=True)
    return dict(status="error", reproduced=False,
                error=f"the same lowered module as the earlier report's row compiled to other figures "
                      f"(status {row['status']}, kernels {figures(row)} vs {figures(earlier)})"[:600])


def _compile_units(variants: list) -> list[tuple]:
    """`variants` in compile units, in their order (a pair where its first member is): a fwd+bwd variant and
    the jvp of the same call (its name with `_jvp_` for `_grad_`, same group) are compiled together, as one
    program (`worker`'s `compile_together`); every other variant alone."""
    by_name = {v.name: v for v in variants}
    units, placed = [], set()
    for variant in variants:
        if variant.name in placed:
            continue
        swap = {"fwd+bwd": ("_grad_", "_jvp_"), "jvp": ("_jvp_", "_grad_")}.get(variant.mode)
        partner = by_name.get(variant.name.replace(*swap, 1)) if swap else None
        if partner is None or partner.name in placed or partner.group != variant.group or partner.mode == variant.mode:
            units.append((variant,))
            placed.add(variant.name)
            continue
        units.append((variant, partner) if variant.mode == "fwd+bwd" else (partner, variant))
        placed |= {variant.name, partner.name}
    return units


def _named(fn, name: str):
    """`fn` under `name`: the name of its function in the lowered module."""
    def named(*args):
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    return named


def _kernels_by_function(module: str, functions: list[str]) -> list[set[str]]:
    """The names of the Pallas kernels each of `functions` (its `func.func` in the lowered StableHLO text
    `module`) calls, through the functions it calls: Triton's custom calls name theirs, Mosaic GPU's carry
    theirs in the serialized module (`{name}_mosaic_gpu_kernel`)."""
    bodies, name = {}, None
    for line in module.splitlines():
        header = re.match(r"\s*func\.func (?:public |private )?@([\w.$-]+)\(", line)
        if header:
            name = header.group(1)
            bodies[name] = []
        elif name:
            bodies[name].append(line)
    kernels, calls = {}, {}
    for fn, lines in bodies.items():
        kernels[fn], calls[fn] = set(), set()
        for line in lines:
            if "custom_call @__gpu$xla.gpu.triton(" in line:
                kernels[fn].update(re.findall(r', name = "([\w.-]+)", num_stages', line))
            elif "custom_call @mosaic_gpu_v2(" in line:
                kernels[fn].update(re.findall(r"(probjax_\w+?)_mosaic_gpu", line))
            calls[fn].update(re.findall(r"(?<!custom_)call @([\w.$-]+)\(", line))

    def reach(fn, seen) -> set[str]:
        if fn in seen or fn not in kernels:
            return set()
        seen.add(fn)
        return kernels[fn].union(*(reach(callee, seen) for callee in calls[fn]))

    missing = [fn for fn in functions if fn not in bodies]
    if missing:
        raise ValueError(f"the lowered module has no function {', '.join(missing)}")
    return [reach(fn, set()) for fn in functions]


def _error_fields(error: Exception) -> dict:
    """A failed compile's row fields: the error's first line, and the shared memory asked for when that is why."""
    message = str(error).strip().splitlines()
    out = dict(status="error", error=f"{type(error).__name__}: {message[0][:300] if message else ''}")
    smem = re.search(r"requested (\d+), available: (\d+)", str(error))
    if smem:
        out["error_smem"] = [int(smem.group(1)), int(smem.group(2))]
    return out


# Mosaic GPU's dumps (jaxlib's mosaic/gpu/dump.cc) without MOSAIC_GPU_DUMP_TO: each on stdout.
MOSAIC_DUMPS = dict(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS_CTRL="1",
                    MOSAIC_GPU_DUMP_RESOURCES="1")


@contextlib.contextmanager
def _stdout_to(path: Path):
    """File descriptor 1 (where Mosaic GPU's C++ dumps go) redirected to `path` for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    with path.open("wb") as file:
        os.dup2(file.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _split_mosaic_stdout(text: str, mosaic_dir: Path):
    """Writes the PTX, ptxas and SASS that Mosaic GPU printed on stdout for each kernel it compiled as
    `{stem}.ptx` / `.ptxas` / `.sass_ctrl` beside the kernel's `{stem}.resources.txt` (stem: the kernel's
    name and Mosaic's count, `probjax_mosaic_forward_3`), as MOSAIC_GPU_DUMP_TO would. Each kernel prints its
    PTX (from LLVM's header on), then ptxas' report, then nvdisasm's listing."""
    stems = {}
    for path in mosaic_dir.glob("*.resources.txt"):
        stem = path.name.removesuffix(".resources.txt")
        if not (mosaic_dir / f"{stem}.ptxas").exists():
            stems.setdefault(re.sub(r"_\d+$", "", stem), []).append(stem)
    for chunk in re.split(r"^(?=//\n// Generated by LLVM NVPTX Back-End$)", text, flags=re.M)[1:]:
        entry = re.search(r"^\.(?:visible \.)?entry (\w+)_mosaic_gpu_kernel\(", chunk, re.M)
        ptxas_at, sass_at = chunk.find("ptxas info"), chunk.find("\t.headerflags")
        if not entry or ptxas_at < 0 or sass_at < ptxas_at:
            raise ValueError("Mosaic GPU's stdout dump: a kernel without its PTX entry, ptxas report or SASS")
        name = entry.group(1)
        if len(stems.get(name, [])) != 1:
            raise ValueError(f"Mosaic GPU's stdout dump: {len(stems.get(name, []))} kernels named {name} in one "
                             "compile (their dumps need MOSAIC_GPU_DUMP_TO)")
        stem = stems.pop(name)[0]
        (mosaic_dir / f"{stem}.ptx").write_text(chunk[:ptxas_at])
        (mosaic_dir / f"{stem}.ptxas").write_text(chunk[ptxas_at:sass_at])
        (mosaic_dir / f"{stem}.sass_ctrl").write_text(chunk[sass_at:])


@contextlib.contextmanager
def _traced_tiles(into: dict):
    """Records, by kernel name, the tiles each Triton kernel is traced at: the Triton backend's plan may retile a
    kernel for a call's features (`triton.plan.forward_config`, `backward_configs`, `tangent_config`)."""
    from probjax_kernels.triton import backward, forward, tangent

    saved = forward.forward, backward.backward, tangent.tangent

    def tiles(problem):
        return {k: v for k, v in vars(problem.config).items() if k != "backend"}

    def fwd(problem, *args):
        into["probjax_flash_forward"] = tiles(problem)
        return saved[0](problem, *args)

    def bwd(problem, tangents, res, d_out, d_lse, dkv_problem=None):
        into["probjax_flash_backward_dq"] = tiles(problem)
        split = dkv_problem is not None and dkv_problem.dkv_split  # dV's and dK's programs (`triton.plan`)
        into["probjax_flash_backward_dkv"] = dict(tiles(dkv_problem or problem), **({"splits": 2} if split else {}))
        return saved[1](problem, tangents, res, d_out, d_lse, dkv_problem)

    def tan(problem, *args, **kwargs):  # kwargs: value_splits (`triton.plan.tangent_value_splits`)
        splits = kwargs.get("value_splits", 1)
        into["probjax_flash_tangent"] = dict(tiles(problem), **({"splits": splits} if splits > 1 else {}))
        return saved[2](problem, *args, **kwargs)

    forward.forward, backward.backward, tangent.tangent = fwd, bwd, tan
    try:
        yield
    finally:
        forward.forward, backward.backward, tangent.tangent = saved


def _tangent_tiles(config, variant) -> dict:
    """The tangent kernel's tiles for a jvp variant (`triton.plan.tangent_config`, told whether the call has a
    BlockMask's tables)."""
    from probjax_kernels.triton import plan as triton_plan

    tables = variant.name.endswith(("_sliding_window", "_document_mask"))
    tangent = triton_plan.tangent_config(config, max(variant.head_dim, variant.value_dim or 0), tables,
                                         dtype=registry.dtype_of(variant.dtype))
    return {k: v for k, v in vars(tangent).items() if k != "backend"}


def _fallback_tiles(row: dict) -> dict:
    """The tiles the Triton forward runs at when backend "mosaic" falls back to it
    (`triton.plan.fallback_config`), for the page's tiles column."""
    if "probjax_kernels" not in sys.modules:
        _import_kernels()
    from probjax_kernels import FlashConfig
    from probjax_kernels.triton import plan as triton_plan

    config = FlashConfig(**row["config"], backend="mosaic")
    head_dim = max(row["head_dim"], row["value_dim"] or 0)
    return {k: v for k, v in vars(triton_plan.fallback_config(config, head_dim)).items() if k != "backend"}


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
    triton = []  # (ptxas entry, threads, smem, machine code)
    for log in (p for p in ptxas_files if p.suffix == ".log"):
        for entry in parse_ptxas(log.read_text()):
            if not entry["name"].startswith(KERNEL_PREFIXES) or entry["name"].endswith("_mosaic_gpu_kernel"):
                continue  # XLA's own kernels (fusions, slices, sorts); Mosaic GPU's come from its own dumps
            threads, smem = launches.get(entry["name"], (None, None))
            ptx = log.with_suffix(".ptx")
            threads = threads or (ptx_threads(ptx.read_text()) if ptx.exists() else None)
            cubin = log.with_suffix(".cubin")
            triton.append((entry, threads, smem, elf_code(cubin.read_bytes()) if cubin.exists() else b""))
    for (entry, threads, smem, _), sass in zip(triton, _disassembled([t[3] for t in triton], limits["arch"],
                                                                     cuda_root)):
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


def elf_code(cubin: bytes) -> bytes:
    """The machine code of a cubin: its `.text.*` sections (a kernel and the functions it calls), in order."""
    section_table, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<I4xQQQQ", cubin, section_table + i * entry_size) for i in range(count)]
    names_at = sections[names_index][3]

    def name(offset: int) -> bytes:
        start = names_at + offset
        return cubin[start:cubin.index(b"\0", start)]

    return b"".join(cubin[at:at + size] for name_at, _, _, at, size in sections if name(name_at).startswith(b".text."))


def _disassembled(codes: list[bytes], arch: str, cuda_root: Path) -> list[str]:
    """The SASS of each machine code in `codes` (`elf_code`'s), from one nvdisasm call over them all as a raw
    instruction stream (each call costs ~0.5 s of CPU before it reads a byte): the listing split back by
    instruction offset."""
    if not any(codes):
        return ["" for _ in codes]
    with tempfile.NamedTemporaryFile(suffix=".bin") as raw:
        raw.write(b"".join(codes))
        raw.flush()
        listing = subprocess.run([str(cuda_root / "bin" / "nvdisasm"), "--binary", arch.replace("sm_", "SM"),
                                  "--print-code", "--no-dataflow", raw.name],
                                 capture_output=True, text=True, check=True).stdout
    ends = list(itertools.accumulate(len(code) for code in codes))
    pieces = [[] for _ in codes]
    for line in listing.splitlines():
        at = re.match(r"\s*/\*([0-9a-f]+)\*/", line)
        if at:
            pieces[bisect.bisect_right(ends, int(at.group(1), 16))].append(line)
    return ["\n".join(lines) for lines in pieces]


def _kernel_row(limits, entry, lowering, threads, smem, sass) -> dict:
    row = dict(kernel=entry["name"], lowering=lowering, registers=entry["registers"], threads=threads,
               smem=smem, spill_stores=entry["spill_stores"], spill_loads=entry["spill_loads"],
               stack=entry["stack"], **sass_counts(sass))
    if entry["registers"] and threads and smem is not None:
        row.update(occupancy(limits, entry["registers"], threads, smem))
    return row


# The code between a lowered module and a row's figures: its source is part of every fingerprint.
FIGURE_CODE = (_compile_environment, _kernels, elf_code, _disassembled, _kernel_row, parse_ptxas, sass_counts,
               ptx_threads, occupancy, target_limits, _split_mosaic_stdout, _kernels_by_function)


# ------------------------------------------------------------------------------------------------- check


def row_problems(row: dict, limits: dict, variant: registry.Variant | None) -> list[str]:
    """Every reason one compile fails CI, one line each (`limits`: its target's, from `target_limits`;
    `variant`: the registry's entry of the row, None when the registry has none)."""
    where = f"{row['target']} {row['variant']}"
    if variant is None:
        return [f"{where}: not in the registry (scripts/compile/variants.py): a stale report"]
    if row["group"] == "peer":
        return []  # peers (JAX's own kernels) are shown side by side, not held to our checks
    if row["status"] != "ok":
        return [f"{where}: compile error: {row.get('error')}"]
    out = kernel_set_problems(where, [k["kernel"] for k in row["kernels"]], variant.requires)
    for kernel in row["kernels"]:
        out += gpu_kernel_problems(row, kernel, limits)
    return out


def kernel_set_problems(where: str, found: list[str], requires: tuple[str, ...]) -> list[str]:
    """A compile must hold exactly the kernels the registry requires of it (`Variant.requires`): one missing
    (a backward kernel gone, a Mosaic call that ran on Triton) or one it does not expect fails."""
    ours = {name for name in found if name.startswith("probjax_")}
    out = []
    if not requires:
        out.append(f"{where}: the registry requires no kernel of it (it would prove nothing)")
    missing = sorted(set(requires) - ours)
    if missing:
        out.append(f"{where}: missing kernel(s) {', '.join(missing)} (found: {', '.join(sorted(ours)) or 'none'})")
    extra = sorted(ours - set(requires))
    if extra:
        out.append(f"{where}: kernel(s) the registry does not expect: {', '.join(extra)}")
    return out


def gpu_kernel_problems(row: dict, kernel: dict, limits: dict) -> list[str]:
    """An NVIDIA kernel's figures against the rules: no spill (outside `SPILLS`' capped entries), shared
    memory within the target's limit; on Hopper, Mosaic kernels with TMA and wgmma and 16-bit kernels whose
    matmuls are mostly wgmma (`MIN_WGMMA_SHARE`, `LOW_WGMMA_SHARE`); on sm_80 / sm_86, 16-bit kernels with
    mma.sync (HMMA) and cp.async (LDGSTS) where the kernel pipelines (num_stages >= 2, and decode)."""
    name = f"{row['target']} {row['variant']} {kernel['kernel']}"
    out = []
    cap = spill_cap(kernel["kernel"], row["target"], row["variant"])
    if (kernel["spill_stores"] or kernel["spill_loads"]) and not (
            cap and kernel["spill_stores"] <= cap[0] and kernel["spill_loads"] <= cap[1]):
        out.append(f"{name}: spills {kernel['spill_stores']} B stores / {kernel['spill_loads']} B loads")
    if kernel["smem"] is not None and kernel["smem"] > limits["smem_per_block"]:
        out.append(f"{name}: {kernel['smem']} B shared memory over the target's {limits['smem_per_block']}")
    sixteen_bit = row["dtype"] != "f32"  # float32 dots run at Precision.HIGHEST: FMA, no tensor cores
    if limits["arch"].startswith("sm_90"):
        if kernel["lowering"] == "mosaic" and not (kernel["UTMALDG"] and kernel["HGMMA"]):
            out.append(f"{name}: a Mosaic kernel without TMA (UTMALDG {kernel['UTMALDG']}) or wgmma "
                       f"(HGMMA {kernel['HGMMA']})")
        if sixteen_bit and not any(re.search(p, row["variant"]) for p in NO_WGMMA_VARIANTS):
            share = wgmma_share(kernel)
            least, _ = LOW_WGMMA_SHARE.get((kernel["kernel"], max(row["head_dim"], row["value_dim"] or 0)),
                                           (MIN_WGMMA_SHARE, ""))
            if share is None or share < least:
                out.append(f"{name}: wgmma share {share if share is None else round(share, 2)} (HGMMA "
                           f"{kernel['HGMMA']}, HMMA {kernel['HMMA']}) under {least}")
    elif sixteen_bit:
        if not kernel["HMMA"]:
            out.append(f"{name}: 16-bit matmuls without mma.sync (HMMA 0)")
        pipelined = row["group"] == "decode" or (row.get("config") or {}).get("num_stages", 1) >= 2
        if pipelined and not kernel["LDGSTS"]:
            out.append(f"{name}: a pipelined kernel without cp.async (LDGSTS 0)")
    return out


def wgmma_share(kernel: dict) -> float | None:
    """HGMMA / (HGMMA + HMMA) of a kernel's SASS; None when it has neither (no tensor-core matmul)."""
    total = kernel["HGMMA"] + kernel["HMMA"]
    return kernel["HGMMA"] / total if total else None


def problems(report: dict, targets=None, only: str | None = None) -> list[str]:
    """Every reason the report fails CI, one line each: the registry's expected (target, variant) pairs
    (`expected(targets, only)`) each present exactly once and passing `row_problems`, and nothing else. An
    empty expected set fails: a check of nothing proves nothing."""
    pairs = expected(targets, only)
    whole = not only and set(targets or TARGETS) == set(TARGETS)  # then a row the registry lacks is stale
    if not pairs:
        return [f"no variant of the registry matches (targets {targets or 'all'}, only {only!r}): nothing checked"]
    want = {(t, v.name): v for t, v in pairs}
    limits = {t: target_limits(t) for t in {t for t, _ in pairs}}
    out, seen = [], set()
    for row in report.get("rows", []):
        key = (row["target"], row["variant"])
        if key in seen:
            out.append(f"{key[0]} {key[1]}: compiled twice in the report")
            continue
        seen.add(key)
        if key in want:
            out += row_problems(row, limits[row["target"]], want[key])
        elif whole:
            out += row_problems(row, {}, None)
    out += [f"{t} {name}: missing from the report (the registry expects it on {t})"
            for (t, name) in want if (t, name) not in seen]
    return out


def check(path: Path, targets=None, only: str | None = None) -> int:
    report = json.loads(path.read_text())
    found = problems(report, targets, only)
    for line in found:
        print(f"compile_report: FAIL {line}")
    kernels = sum(len(r["kernels"]) for r in report.get("rows", []))
    print(f"compile_report: {len(report.get('rows', []))} compiles, {kernels} kernels, "
          f"{len(expected(targets, only))} expected, {len(found)} problems")
    return 1 if found else 0


# --------------------------------------------------------------------------------------------------- run


def run(args) -> int:
    targets = args.targets.split(",")
    groups = ["mosaic", "triton", "control", "decode", "peer"]  # the longest shard first
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise SystemExit(f"compile_report: --targets {','.join(unknown)}: not a target of the registry {TARGETS}")
    pairs = expected(targets, args.only)
    if not pairs:  # a run of nothing must not pass
        raise SystemExit(f"compile_report: FAIL: no variant matches --only {args.only!r} on {','.join(targets)}")
    shards = [(t, g) for g in groups for t in targets if any(pt == t and v.group == g for pt, v in pairs)]
    start = time.perf_counter()
    rows = []
    if args.assemble:  # no compile: the journal's rows of the expected pairs (a missing one fails the check)
        want = {(t, v.name) for t, v in pairs}
        journaled = {(r["target"], r["variant"]): r for r in map(json.loads, args.journal.read_text().splitlines())}
        rows = [row for key, row in journaled.items() if key in want]
        shards = []
    if args.reuse and not args.reuse.exists():
        raise SystemExit(f"compile_report: --reuse {args.reuse}: no such report")
    seed = args.seed if args.seed is not None else head_commit(REPO)
    with _removing_sass_scratch(), concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_shard, t, g, args.toolchain, args.only, args.journal, args.first,
                               args.reuse, args.verify, seed)
                   for t, g in shards]
        for future in futures:
            rows += future.result()
    order = {name: i for i, name in enumerate(targets)}
    rows.sort(key=lambda r: (order[r["target"]], r["group"], r["variant"]))
    report = _with_verdicts(dict(
        targets=targets, limits={t: target_limits(t) for t in targets}, toolchain=_versions(args.toolchain),
        wall_s=round(_compile_seconds(rows) / args.jobs if args.assemble else time.perf_counter() - start, 1),
        jobs=args.jobs, only=args.only, expected=len(pairs), assembled=bool(args.assemble),
        reused_from=_shown_path(args.reuse) if args.reuse else None, rows=rows,
    ))
    out = Path(args.out)
    if out.exists() and "tpu" in json.loads(out.read_text()):  # the TPU part's section (tpu_report.py) stays
        report["tpu"] = json.loads(out.read_text())["tpu"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    found = problems(report, targets, args.only)
    _write_pages(report, found, Path(args.page))
    print(f"compile_report: wrote {out} and {args.page} in {report['wall_s']} s"
          + (f"; {sum(bool(r.get('reused')) for r in rows)} of {len(rows)} rows reused from {args.reuse} (their "
             f"lowered module unchanged), {sum('reproduced' in r for r in rows)} re-compiled to check they "
             f"reproduce it" if args.reuse else ""))
    return check(out, targets, args.only)


def _compile_seconds(rows: list[dict]) -> float:
    """The compile time of `rows`, a compile two rows shared (`compiled_with`) counted once."""
    return sum(r["compile_s"] / (2 if r.get("compiled_with") else 1) for r in rows)


@contextlib.contextmanager
def _removing_sass_scratch():
    """Removes, once the workers are done, the folders Mosaic GPU's SASS dump leaves behind (dump.cc: a
    `mosaic-gpu-XXXXXX` folder holding kernel.bin per kernel, in the root temp folder whatever TMPDIR says)
    that appeared during the run."""
    before = set(Path("/tmp").glob("mosaic-gpu-*"))
    try:
        yield
    finally:
        for folder in set(Path("/tmp").glob("mosaic-gpu-*")) - before:
            if {p.name for p in folder.iterdir()} <= {"kernel.bin"}:
                shutil.rmtree(folder, ignore_errors=True)


def _shown_path(path: Path) -> str:
    """`path` relative to the checkout when it lies in it (a report names no machine's folders)."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return Path(path).name


def _shard(target, group, toolchain, only, journal=None, first=None, reuse=None, verify=0, seed="") -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, __file__, "worker", target, group, "--toolchain", str(toolchain),
                   "--json", str(out)]
        if only:
            command += ["--only", only]
        if journal:
            command += ["--journal", str(journal)]
        if first:
            command += ["--first", first]
        if reuse:
            command += ["--reuse", str(Path(reuse).resolve()), "--verify", str(verify), "--seed", seed]
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
    p.add_argument("--journal", type=Path, help="a JSON-lines file each row is appended to as it is made; a run "
                   "with the same file resumes, compiling only the pairs it lacks (same checkout and toolchain)")
    p.add_argument("--first", help="a regex: compile the variants whose name matches first")
    p.add_argument("--assemble", action="store_true", help="compile nothing: write the report from --journal's rows")
    p.add_argument("--reuse", type=Path, help="an earlier report (docs/compile/report.json): a compile unit whose "
                   "lowered module has the fingerprint of its row there takes that row's figures, uncompiled")
    p.add_argument("--verify", type=int, default=1, help="with --reuse: how many reusable units per (target, "
                   "group) shard are compiled all the same, their figures required equal to the reused ones")
    p.add_argument("--seed", help="with --reuse: picks the --verify units (default: the checkout's commit)")
    p.add_argument("--out", default=str(REPORT))
    p.add_argument("--page", default=str(PAGE))
    w = sub.add_parser("worker")
    w.add_argument("target")
    w.add_argument("group")
    w.add_argument("--toolchain", type=Path, required=True)
    w.add_argument("--only")
    w.add_argument("--journal", type=Path)
    w.add_argument("--first")
    w.add_argument("--reuse", type=Path)
    w.add_argument("--verify", type=int, default=0)
    w.add_argument("--seed", default="")
    w.add_argument("--json", type=Path, required=True)
    c = sub.add_parser("check", help="check a report against the whole registry (or --targets / --only of it)")
    c.add_argument("report", nargs="?", default=str(REPORT))
    c.add_argument("--targets", help="a comma-separated subset of the targets (default: all)")
    c.add_argument("--only", help="a regex: check only the registry's variants whose name matches")
    m = sub.add_parser("markdown")
    m.add_argument("report", nargs="?", default=str(REPORT))
    args = parser.parse_args()
    if args.command == "run":
        if args.assemble and not args.journal:
            parser.error("--assemble needs --journal")
        return run(args)
    if args.command == "worker":
        args.json.write_text(json.dumps(worker(args.target, args.group, args.toolchain, args.only, args.journal,
                                               args.first, args.reuse, args.verify, args.seed)))
        return 0
    if args.command == "check":
        return check(Path(args.report), args.targets.split(",") if args.targets else None, args.only)
    path = Path(args.report)
    report = _with_verdicts(json.loads(path.read_text()))
    path.write_text(json.dumps(report, indent=1) + "\n")
    _write_pages(report, problems(report), PAGE)
    return 0


def _write_pages(report: dict, found: list[str], page: Path):
    """The report's page, and, when that is the committed one (docs/compile/index.md), the generated figures
    of docs/perf-notes.md; a run to a temporary --page (CI's) leaves the clone's docs as they are."""
    import page as compile_page

    page.write_text(compile_page.markdown(report, found))
    if page.resolve() == PAGE.resolve():
        notes = REPO / "docs" / "perf-notes.md"
        notes.write_text(compile_page.with_perf_figures(notes.read_text(), report))


def _with_verdicts(report: dict) -> dict:
    """The report with this script's verdicts (each row's problems, the rules' lists), recomputed from the
    figures: `markdown` refreshes a committed report after a rule changes, without compiling."""
    by_name = {v.name: v for v in registry.variants()}
    for row in report["rows"]:  # the verdict travels with the row (tests/test_compile_report.py reads it)
        row["problems"] = row_problems(row, target_limits(row["target"]), by_name.get(row["variant"]))
        if row.get("backend") == "mosaic" and row.get("config") and "fallback_config" not in row:
            row["fallback_config"] = _fallback_tiles(row)
    report.update(
        min_wgmma_share=MIN_WGMMA_SHARE,
        low_wgmma_share=[dict(kernel=k, head_dim=d, least=c[0], why=c[1]) for (k, d), c in LOW_WGMMA_SHARE.items()],
        no_wgmma_variants=[dict(variants=k, why=v) for k, v in NO_WGMMA_VARIANTS.items()],
        spills=[dict(kernel=k, target=t, variant=v, max_stores=c[0], max_loads=c[1], why=c[2])
                for (k, t, v), c in SPILLS.items()],
    )
    return report


if __name__ == "__main__":
    sys.exit(main())
