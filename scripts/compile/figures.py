"""How a compile's figures are made and read: the target's limits, the worker's environment (a deviceless compile
with ptxas' logs, XLA's and Mosaic GPU's dumps kept), and each kernel's registers, spills, shared memory,
occupancy and tensor-core / copy instructions read from those dumps. The source of this code is part of every
fingerprint (`FIGURE_CODE`, fingerprints.py): an edit of it compiles every row again under `run --reuse`.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import struct
import subprocess
import tempfile
from pathlib import Path

from sources import REPO, source_paths_regex

TARGETS_DIR = Path(__file__).resolve().parent / "gpu_targets"
SASS_OPS = ("HGMMA", "HMMA", "UTMALDG", "LDGSTS")
# Counted beyond SASS_OPS on the arches that have them: tcgen05's MMA of 16-bit inputs on sm_100a (UTCHMMA). A
# worker compiles one target, and counts its arch's set (it extends SASS_OPS for its process: worker.py); the
# compile key of such a target names the extra ones (fingerprints._compile_key), so the fingerprints of the
# other targets, and their rows, are unchanged.
ARCH_SASS_OPS = {"sm_100a": ("UTCHMMA",)}

# The Pallas Triton kernels' names: ours, then the peers' (JAX's mha, tokamax's); Mosaic GPU kernels come from
# their own dumps.
KERNEL_PREFIXES = ("probjax_", "mha_", "pallas_flash_attention")

# Mosaic GPU's dumps (jaxlib's mosaic/gpu/dump.cc) without MOSAIC_GPU_DUMP_TO: each on stdout.
MOSAIC_DUMPS = dict(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS_CTRL="1",
                    MOSAIC_GPU_DUMP_RESOURCES="1")


# ------------------------------------------------------------------------------------------------ target


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


# Where nvdisasm's listing starts in Mosaic GPU's stdout dump on an arch whose listing has no `.headerflags` line,
# which `_split_mosaic_stdout` looks for: on sm_100a it starts at its `.target` line (JAX's own Blackwell matmul's
# too). Such an arch's compile key holds this and `_mark_sass_listings` (fingerprints._compile_key).
ARCH_SASS_START = {"sm_100a": "\t.target\tsm_100a"}


def _mark_sass_listings(text: str, arch: str) -> str:
    """Mosaic GPU's stdout dump `text` with a `.headerflags` line where each nvdisasm listing starts on an arch of
    `ARCH_SASS_START`, so that `_split_mosaic_stdout` reads it as it reads the other arches' dumps."""
    start = ARCH_SASS_START.get(arch)
    return text if start is None else text.replace(start, "\t.headerflags\n" + start)


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

