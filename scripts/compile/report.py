"""Compile every kernel variant for NVIDIA GPUs without a GPU (deviceless ahead-of-time compilation through
XLA, Triton, Mosaic GPU and ptxas) and report registers, spills, shared memory, occupancy and the tensor-core
/ copy instructions of each kernel. Run it through scripts/compile_check.sh, which installs the toolchain.

    python scripts/compile/report.py run --toolchain DIR [--targets sm90a_h100,...] [--only REGEX]
    python scripts/compile/report.py check [docs/compile/report.json] [--targets ...] [--only REGEX] [--earlier R]
    python scripts/compile/report.py markdown [docs/compile/report.json]

`run` starts one worker process per (target, group) shard, two at a time (`--jobs`), writes
docs/compile/report.json and docs/compile/index.md, then checks what it compiled. `check` fails closed: the
registry (scripts/compile/variants.py) is the expected set, and a (target, variant) pair missing from the
report, a row the registry lacks, a required kernel missing (or one not expected), a compile error (a variant
that raised while being built included), or an empty expected set fails it; then, per kernel, a spill outside
`SPILLS`' capped entries, shared memory over the target's limit, a figure those checks read missing, and the
instruction checks: on Hopper, TMA and wgmma in Mosaic kernels; on sm_90a / sm_100a, 16-bit matmuls all wgmma /
tcgen05 (`MIN_WIDE_SHARE`, `LOW_WIDE_SHARE` per kernel, the small decode tiles of `small_decode_tiles`); on
sm_80 / sm_86 / sm_89 / sm_120, mma.sync and cp.async in 16-bit kernels. rules.py lists every tolerance.

This file is the command line; the jobs live beside it: worker.py (a shard's compiles), figures.py (the figures
read from a compile's dumps), fingerprints.py (what `--reuse` takes over), check.py (the check) and
kernel_tiles.py (the tiles the checkout's kernels/ pick).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The jobs, each in a module beside this one; their names stay importable from here (tpu_report.py, the tests).
from check import (  # noqa: E402, F401
    TARGETS, _with_verdicts, check, expected, gpu_kernel_problems, kernel_set_problems, problems, row_problems,
    device_memory, figures_needed, lm_problems, rule_problems, spill_cap, wide_share,
)
from figures import (  # noqa: E402, F401
    KERNEL_PREFIXES, MOSAIC_DUMPS, SASS_OPS, TARGETS_DIR, _compile_environment, _disassembled, _kernel_row, _kernels,
    _kernels_by_function, _split_mosaic_stdout, elf_code, occupancy, parse_ptxas, ptx_threads, sass_counts,
    target_limits,
)
from fingerprints import (  # noqa: E402, F401
    FIGURE_CODE, _compile_key, _fingerprint, _reproduces, _reusable_rows, _verify_units, _versions,
)
from kernel_tiles import _fallback_tiles, _import_kernels, _tangent_tiles, _traced_tiles  # noqa: E402, F401
from rules import LOW_WIDE_SHARE, MIN_WIDE_SHARE, SPILLS, WIDE_MMA, small_decode_tiles  # noqa: E402, F401
# (check.py reads them from `rules` as it runs: a test that patches one patches `rules`)
from sources import REPO, head_commit, source_paths_regex  # noqa: E402, F401
from worker import _compile_units, _error_fields, _named, _new_files, _stdout_to, worker  # noqa: E402, F401

REPORT = REPO / "docs" / "compile" / "report.json"
PAGE = REPO / "docs" / "compile" / "index.md"


# --------------------------------------------------------------------------------------------------- run


def run(args) -> int:
    targets = args.targets.split(",")
    groups = ["mosaic", "triton", "control", "decode", "peer", "lm"]  # the longest shard first
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
        targets=targets, limits={t: dict(target_limits(t), device_memory=device_memory(t)) for t in targets},
        toolchain=_versions(args.toolchain),
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
    return check(out, targets, args.only, earlier=args.reuse)


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
    c.add_argument("--earlier", type=Path, help="the report this one was made from: a row of it the registry "
                   "no longer has fails (rules.RETIRED lists those retired on purpose)")
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
        return check(Path(args.report), args.targets.split(",") if args.targets else None, args.only,
                     earlier=args.earlier)
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


if __name__ == "__main__":
    sys.exit(main())
