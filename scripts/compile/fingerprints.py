"""A compile's identity, so that `report.py run --reuse` takes an earlier report's row for a module that did not
change: the key of what the figures depend on besides the lowered module (`_compile_key`), the module's
fingerprint under it, the earlier rows a compile may take, and the units compiled again to show the figures
reproduce. tpu_report.py fingerprints its compiles with the same functions.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import inspect
import json
import re
import subprocess
from pathlib import Path

from figures import (
    ARCH_SASS_OPS, ARCH_SASS_START, MOSAIC_DUMPS, TARGETS_DIR, _compile_environment, _disassembled, _kernel_row,
    _kernels, _kernels_by_function, _mark_sass_listings, _split_mosaic_stdout, elf_code, occupancy, parse_ptxas,
    ptx_threads, sass_counts, target_limits,
)

# The code between a lowered module and a row's figures: its source is part of every fingerprint; that of
# `ARCH_FIGURE_CODE` only of the fingerprints of the arches it reads (`ARCH_SASS_START`).
FIGURE_CODE = (_compile_environment, _kernels, elf_code, _disassembled, _kernel_row, parse_ptxas, sass_counts,
               ptx_threads, occupancy, target_limits, _split_mosaic_stdout, _kernels_by_function)
ARCH_FIGURE_CODE = (_mark_sass_listings,)


def _versions(toolchain) -> dict:
    from importlib import metadata

    ptxas = subprocess.run([str(Path(toolchain) / "cuda_root" / "bin" / "ptxas.real"), "--version"],
                           capture_output=True, text=True).stdout.strip().splitlines()
    return dict(jax=metadata.version("jax"), jaxlib=metadata.version("jaxlib"),
                jax_cuda12_plugin=metadata.version("jax-cuda12-plugin"),
                nvidia_cuda_nvcc_cu12=metadata.version("nvidia-cuda-nvcc-cu12"),
                ptxas=ptxas[-1] if ptxas else None)


def _compile_key(target: str, toolchain: Path) -> str:
    """What a compile's figures depend on besides its lowered module: the target's description, the toolchain's
    versions and ptxas wrapper, and the source of the code that compiles and reads the figures
    (`FIGURE_CODE`), and the instructions counted beyond `SASS_OPS` on the target's arch (`ARCH_SASS_OPS`: a
    part only where there are some, so the keys of the earlier targets stay as they were) and how its Mosaic GPU
    dumps are read where they differ (`ARCH_SASS_START`, likewise). A change to any of
    them makes every fingerprint new."""
    parts = [target, (TARGETS_DIR / f"{target}.txtpb").read_text(), json.dumps(_versions(toolchain), sort_keys=True),
             (Path(toolchain) / "cuda_root" / "bin" / "ptxas").read_text(), json.dumps(MOSAIC_DUMPS, sort_keys=True)]
    parts += [inspect.getsource(fn) for fn in FIGURE_CODE]
    arch = target_limits(target)["arch"]
    extra = ARCH_SASS_OPS.get(arch)
    if extra:
        parts.append(json.dumps(extra))
    if arch in ARCH_SASS_START:  # how its dumps are read (`_mark_sass_listings`)
        parts += [ARCH_SASS_START[arch], *(inspect.getsource(fn) for fn in ARCH_FIGURE_CODE)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@functools.cache
def _mlir_context():
    from jax._src.interpreters import mlir

    context = mlir.make_ir_context()
    context.allow_unregistered_dialects = True  # Mosaic TPU's serialized ops ("stable_mosaic.*")
    return context


def _without_locations(body: bytes) -> str:
    """A Mosaic TPU kernel's serialized module (MLIR bytecode) as text without its source locations. With
    JAX's whole-traceback locations (which the TPU compile keeps: XLA names each kernel's instruction after
    its location) the locations hold the line of every frame that built the call, so a line moved in the
    compile's own scripts would otherwise change the kernel's identity; they change no figure."""
    from jax._src.lib.mlir import ir

    with _mlir_context():
        return ir.Module.parse(body).operation.get_asm(enable_debug_info=False)


def _fingerprint(module: str, key: str, roots=()) -> str:
    """The identity of one compile: its lowered StableHLO text without locations (the Pallas kernels' Triton /
    Mosaic GPU IR inside it; Mosaic TPU's, base64-encoded, decoded and printed without its locations,
    `_without_locations`) under `key` (`_compile_key`). The folders in `roots` (the checkout, the toolchain:
    they differ between machines) are left out of the text and of the encoded kernels, and so is Mosaic GPU's
    `kernel_hash`, a hash of its serialized module, those paths included."""
    spellings = [(s, f"<root {i}>") for i, root in enumerate(roots) for s in {str(root), str(Path(root).resolve())}]

    def without_roots(text):
        for spelling, placeholder in spellings:
            text = text.replace(spelling, placeholder)
        return text

    def decoded(match):  # a Mosaic TPU kernel: its module in base64
        body = without_roots(_without_locations(base64.b64decode(match.group(1))))
        return f"body {hashlib.sha256(body.encode()).hexdigest()}"

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

