"""The worker of one (target, group) shard (`report.py worker`, started by `run`): compiles the group's variants
for the target in its own process, one compile unit at a time, and reads each compile's kernels from its dumps
(figures.py).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import figures
import variants as registry
from check import expected
from figures import (
    TARGETS_DIR, _compile_environment, _kernels, _kernels_by_function, _mark_sass_listings, _split_mosaic_stdout,
    target_limits,
)
from fingerprints import _compile_key, _fingerprint, _reproduces, _reusable_rows, _verify_units
from kernel_tiles import _import_kernels, _tangent_tiles, _traced_tiles
from sources import REPO


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
    # This process compiles one target: `sass_counts` counts its arch's instructions too (figures.ARCH_SASS_OPS).
    figures.SASS_OPS = figures.SASS_OPS + figures.ARCH_SASS_OPS.get(limits["arch"], ())
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
                       kernels=o["kernels"], **({"compiled_with": o["compiled_with"]} if o.get("compiled_with") else {}),
                       **{key: o[key] for key in ("hbm", "collectives") if key in o})
        return True

    def new_row(variant) -> dict:
        return dict(variant=variant.name, group=variant.group, target=target, arch=limits["arch"],
                    head_dim=variant.head_dim, value_dim=variant.value_dim, dtype=variant.dtype,
                    mode=variant.mode, backend=variant.backend, q_len=variant.q_len, kv_len=variant.kv_len,
                    requires=list(registry.requires_for(variant, target)))

    def built(variant, row):
        """The variant's function and argument specs, its row given the config it runs at."""
        from probjax_kernels import FlashConfig

        backend = "triton" if variant.group == "peer" else variant.backend  # a peer's is its own kernels' name
        config = default_config(FlashConfig(backend=backend, **(variant.tiles or {})), q_len=variant.q_len,
                                kv_len=variant.kv_len, head_dim=max(variant.head_dim, variant.value_dim or 0),
                                dtype=registry.dtype_of(variant.dtype))
        if variant.group not in ("decode", "peer"):  # those have configs of their own
            row["config"] = {k: v for k, v in vars(config).items() if k not in ("backend", "fused_backward")}
        if variant.mode == "jvp":
            row["tangent_config"] = _tangent_tiles(config, variant)
        fn, specs = variant.build()
        return fn, [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding or sharding) for s in specs]

    def compiled_kernels() -> list[dict]:
        """The kernels of the last compile (its dumps, which are then marked as read)."""
        _split_mosaic_stdout(_mark_sass_listings((scratch / "stdout.txt").read_text(errors="replace"), limits["arch"]),
                             mosaic_dir)
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
                compiled = lowered.compile()
            if variant.group in ("lm", "peer") or variant.name.startswith("side_"):  # whole programs compared
                row.update(_program_figures(compiled))
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


def _hbm(compiled) -> dict:
    """The device memory XLA plans for a compiled program, in bytes: arguments, outputs, temporaries, the
    arguments aliased to outputs (counted once in `total`) and the generated code."""
    memory = compiled.memory_analysis()
    out = dict(arguments=memory.argument_size_in_bytes, outputs=memory.output_size_in_bytes,
               temp=memory.temp_size_in_bytes, alias=memory.alias_size_in_bytes,
               generated_code=memory.generated_code_size_in_bytes)
    out["total"] = out["arguments"] + out["outputs"] - out["alias"] + out["temp"] + out["generated_code"]
    return out


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COLLECTIVE = re.compile(r" (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def _program_figures(compiled) -> dict:
    """A whole program's figures (the LM example's, the peers', ours beside tokamax's: `side_` variants): its
    planned HBM per device (`_hbm`) with the bytes it moves outside the Pallas kernels (`xla_bytes`, as the TPU
    report counts them: every instruction of the entry computation but the custom calls), and the collectives
    of its compiled HLO, counted by kind (an async pair's start once): an all-reduce of the gradients on a data
    axis, the ring's collective-permutes on a "seq" axis."""
    from tpu_report import xla_side_bytes

    text = compiled.as_text()
    counts = {name: 0 for name in COLLECTIVES}
    for match in _COLLECTIVE.finditer(text):
        counts[match.group(1)] += 1
    return dict(hbm=dict(_hbm(compiled), xla_bytes=xla_side_bytes(text)), collectives=counts)


def _named(fn, name: str):
    """`fn` under `name`: the name of its function in the lowered module."""
    def named(*args):
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    return named


def _error_fields(error: Exception) -> dict:
    """A failed compile's row fields: the error's first line, and the shared memory asked for when that is why."""
    message = str(error).strip().splitlines()
    out = dict(status="error", error=f"{type(error).__name__}: {message[0][:300] if message else ''}")
    smem = re.search(r"requested (\d+), available: (\d+)", str(error))
    if smem:
        out["error_smem"] = [int(smem.group(1)), int(smem.group(2))]
    return out


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

