"""The pod-slice part of the compile check: the LM example's training step and batched generation compiled for
TPU slices without a TPU (examples/compile_for_tpu.py), its figures in docs/compile/tpu_slices.json and in
docs/tpu.md ("Pod slices"), and the gate over them. Run it through scripts/compile/tpu_slices.sh, which
finds the TPU toolchain and adds the examples' packages to it.

    python scripts/compile/tpu_slices.py run [--out docs/compile/tpu_slices.json] [--doc docs/tpu.md] [--gated]
                                             [--jobs 2] [--reuse docs/compile/tpu_slices.json [--verify 1]]
    python scripts/compile/tpu_slices.py check [--gated] [docs/compile/tpu_slices.json]
    python scripts/compile/tpu_slices.py markdown [docs/compile/tpu_slices.json]
    python scripts/compile/tpu_slices.py doc [--gated] [docs/compile/tpu_slices.json]   # docs/tpu.md's table, check

`run` compiles head dims 64 and 128 at seq 2048 and 8192 on each slice (12 slice shapes: the committed
record), or with `--gated` head dim 128 only (6: what CI compiles, to keep its time), in `--jobs` processes
side by side; writes the JSON and the docs section, then checks. With `--reuse`, a program whose lowered
module is unchanged since that record takes its figures uncompiled, and `--verify` of them are compiled again
and must give the same figures (examples/compile_for_tpu.py). `check` exits 1 when a (slice, mesh, head
dim, seq) row is missing (of head dims 64 and 128; 128 only with `--gated`), a program failed to compile, a
chip's planned HBM exceeds its capacity, the training step's or the generation's temporaries grow faster
than linearly from seq 2048 to 8192, a ring step (a "seq" mesh axis) all-gathers or sends no block by
collective-permute, or a training step holds no Mosaic TPU kernel (the attention fell back to XLA).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sources import head_commit, source_paths_regex  # noqa: E402 - jax-free, shared with report.py

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "docs" / "compile" / "tpu_slices.json"
DOC = REPO / "docs" / "tpu.md"
SCRIPT = REPO / "examples" / "compile_for_tpu.py"
# (topology, mesh): the slices the check compiles. Kept equal to examples/compile_for_tpu.py's SLICES (a test
# compares them); repeated here so that checking a report needs neither jax nor the example.
SLICES = (("v5e:2x2", "data=2,seq=2"), ("v5p:2x2x1", "data=2,model=2"), ("v6e:2x2", "data=4"))
GATED_HEAD_DIMS, ALL_HEAD_DIMS, SEQ_LENS = (128,), (64, 128), (2048, 8192)
# HBM per chip, GiB, by generation; the checker's own figure, not the report's.
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
# Temporaries at seq 8192 over those at 2048, per program: 4 when they grow linearly (flash attention keeps no
# T x T matrix, the paged decode reads the cache in place), 16 when quadratically. A bound above 4 leaves room
# for XLA's buffer plan, which shares more buffers at the short length: the generation's temporaries on v5e at
# head dim 64 lie on a line through seq 2048, 4096 and 8192 (0.33, 0.76, 1.68 GiB) that meets zero above T = 0,
# so linear growth reads 5.0x there. The record's generations read 3.3x-5.3x, its training steps 3.9x-4.7x.
MAX_TEMP_RATIO = {"train": 5.0, "generate": 6.0}
PROGRAMS = ("train", "generate")
BEGIN, END = "<!-- pod-slices:begin (scripts/compile/tpu_slices.py writes this table) -->", "<!-- pod-slices:end -->"


def expected(head_dims=ALL_HEAD_DIMS) -> list[tuple[str, str, int, int]]:
    return [(topology, mesh, hd, seq) for topology, mesh in SLICES for hd in head_dims for seq in SEQ_LENS]


def _key(row: dict) -> tuple:
    return row.get("topology"), row.get("mesh"), row.get("head_dim"), row.get("seq_len")


def _is_ring(mesh: str) -> bool:
    return any(part.strip().startswith("seq=") and part.split("=")[1].strip() != "1" for part in mesh.split(","))


def check(report: dict, head_dims=ALL_HEAD_DIMS) -> list[str]:
    """The gate's problems with `report` (examples/compile_for_tpu.py's JSON); empty when it passes. Fails
    closed: a field it needs that is missing or of the wrong kind is a problem too. `head_dims`: those whose
    rows must all be there (every row present is checked)."""
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        return ["the report has no list of rows"]
    problems = []
    by_key = {}
    for row in rows:
        if not isinstance(row, dict):
            problems.append(f"a row is not an object: {row!r:.80}")
            continue
        by_key[_key(row)] = row
    for key in expected(head_dims):
        if key not in by_key:
            problems.append("missing: %s mesh %s head dim %s seq %s" % key)
    for key, row in by_key.items():
        name = "%s %s hd%s T=%s" % key
        generation = str(key[0]).split(":")[0]
        if generation not in HBM_GIB:
            problems.append(f"{name}: unknown TPU generation {generation!r}")
            continue
        capacity = HBM_GIB[generation] * 2**30
        for program in PROGRAMS:
            figures = row.get(program)
            if not isinstance(figures, dict):
                problems.append(f"{name} {program}: not compiled")
                continue
            if "error" in figures:
                problems.append(f"{name} {program}: compile error: {str(figures['error'])[:300]}")
                continue
            try:
                hbm = figures["hbm"]
                total = hbm["arguments"] + hbm["outputs"] - hbm["alias"] + hbm["temp"] + hbm["generated_code"]
                collectives, kernels = figures["collectives"], figures["tpu_kernels"]
                gathers, permutes = collectives["all-gather"], collectives["collective-permute"]
            except (KeyError, TypeError) as error:
                problems.append(f"{name} {program}: incomplete figures ({type(error).__name__}: {error})")
                continue
            if total > capacity:
                problems.append(f"{name} {program}: {total / 2**30:.2f} GiB of HBM per chip planned, the chip has "
                                f"{HBM_GIB[generation]} GiB")
            if program == "train":
                if kernels < 1:
                    problems.append(f"{name} train: no Mosaic TPU kernel (attention fell back to XLA)")
                if _is_ring(str(key[1])) and gathers:
                    problems.append(f"{name} train: the ring all-gathers ({gathers} all-gather ops; K/V must "
                                    "travel by collective-permute)")
                if _is_ring(str(key[1])) and not permutes:
                    problems.append(f"{name} train: a ring with no collective-permute")
    for (topology, mesh, hd, seq), row in by_key.items():
        longer = by_key.get((topology, mesh, hd, seq * 4))
        if seq != SEQ_LENS[0] or longer is None:
            continue
        for program in PROGRAMS:
            try:
                ratio = longer[program]["hbm"]["temp"] / row[program]["hbm"]["temp"]
            except (KeyError, TypeError, ZeroDivisionError):
                continue  # a failed or incomplete row is a problem above already
            if ratio > MAX_TEMP_RATIO[program]:
                problems.append(f"{topology} {mesh} hd{hd} {program}: temporaries grow {ratio:.1f}x from seq {seq} "
                                f"to {seq * 4} (linear: 4x, at most {MAX_TEMP_RATIO[program]}x)")
    return problems


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f}"


def markdown(report: dict) -> str:
    """The slice table of docs/tpu.md."""
    lines = [
        "| slice | mesh | hd | seq | program | HBM / chip: args | temp | total | of | collectives | TPU kernels "
        "| compile s |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in report["rows"]:
        capacity = HBM_GIB.get(row["topology"].split(":")[0])
        for program in PROGRAMS:
            figures = row.get(program)
            if figures is None:
                continue
            head = f"| {row['topology']} | {row['mesh'] if program == 'train' else '1 chip'} | {row['head_dim']} | " \
                   f"{row['seq_len']} | {program} |"
            if "error" in figures:
                lines.append(f"{head} FAILED: {figures['error'][:120]} | | | | | | |")
                continue
            hbm = figures["hbm"]
            total = hbm["arguments"] + hbm["outputs"] - hbm["alias"] + hbm["temp"] + hbm["generated_code"]
            used = ", ".join(f"{name} {count}" for name, count in figures["collectives"].items() if count) or "none"
            lines.append(f"{head} {_gib(hbm['arguments'])} | {_gib(hbm['temp'])} | {_gib(total)} | {capacity} GiB | "
                         f"{used} | {figures['tpu_kernels']} | {figures['compile_s']} |")
    return "\n".join(lines) + "\n"


def write_doc(report: dict, doc: Path) -> None:
    """Replaces the table between the markers in `doc` (the "Pod slices" section of docs/tpu.md)."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no pod-slices markers ({BEGIN} ... {END}): add them to its Pod slices section")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    meta = report.get("note") or f"jax {report.get('jax')}, {report.get('wall_s')} s wall for {len(report['rows'])} " \
                                  "slice shapes"
    doc.write_text(f"{head}{BEGIN}\n{markdown(report)}\n({meta}.)\n{END}{tail}")


def _report_problems(report: dict, head_dims) -> int:
    problems = check(report, head_dims)
    for problem in problems:
        print(f"tpu_slices: FAIL: {problem}", file=sys.stderr)
    print(f"tpu_slices: {len(report.get('rows', []))} slice shapes, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


def _compile(head_dims, jobs: int, out: Path, reuse: list[str] = ()) -> dict:
    """examples/compile_for_tpu.py over the slices at `head_dims` x SEQ_LENS, its cases shared by `jobs`
    processes (`--shard i/jobs`) run side by side; their rows merged in the order of `expected`. `reuse`: the
    script's --reuse / --verify / --seed options."""
    command = [sys.executable, str(SCRIPT), "--head-dims", *map(str, head_dims), "--seq-lens", *map(str, SEQ_LENS),
               "--slices", *(f"{t}={m}" for t, m in SLICES), *reuse]
    with tempfile.TemporaryDirectory() as folder:
        # The toolchain venv does not install the project: kernels/ is imported as probjax_kernels through a link,
        # probjax_nn from the repo root. No TPU is used (JAX_PLATFORMS=cpu); the other libtpu processes (the jobs,
        # a second compile check) must not lock one another out.
        (Path(folder) / "probjax_kernels").symlink_to(REPO / "kernels", target_is_directory=True)
        # Source file names in the lowered kernels lose the machine's folders: the same program lowers to the same
        # module wherever it is compiled (the fingerprint --reuse compares).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([folder, str(REPO)]), JAX_PLATFORMS="cpu",
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                   JAX_HLO_SOURCE_FILE_CANONICALIZATION_REGEX=source_paths_regex(REPO, Path(folder), Path(sys.prefix)))
        parts = [Path(folder) / f"part{i}.json" for i in range(jobs)]
        # Each process compiles one program at a time, mostly on one core (tracing and lowering are Python, much
        # of XLA's compile one thread): `jobs` of them keep that many cores busy. Their exit statuses say
        # whether everything compiled; the check says it in full.
        processes = []
        try:
            for i, part in enumerate(parts):
                processes.append(subprocess.Popen([*command, "--shard", f"{i}/{jobs}", "--json", str(part)], cwd=REPO,
                                                  env=env))
            for process in processes:
                process.wait()
        finally:  # stopped (Ctrl-C) or failed to start one: no compile outlives this script
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        reports = [json.loads(part.read_text()) for part in parts if part.exists()]
    if not reports:
        return {}
    order = {key: i for i, key in enumerate(expected(head_dims))}
    rows = sorted((row for report in reports for row in report.get("rows", [])),
                  key=lambda row: order.get(_key(row), len(order)))
    report = dict(reports[0], rows=rows, jobs=jobs)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="compile, write the JSON and the docs table, check")
    run.add_argument("--out", type=Path, default=REPORT)
    run.add_argument("--doc", type=Path, default=DOC, help="the page with the pod-slices markers; 'none': no page")
    run.add_argument("--jobs", type=int, default=2, help="compile processes side by side (default 2)")
    run.add_argument("--reuse", type=Path, help="an earlier record (docs/compile/tpu_slices.json): a program whose "
                     "lowered module has the fingerprint of its row there takes that row's figures, uncompiled")
    run.add_argument("--verify", type=int, default=1, help="with --reuse: how many of the reusable programs are "
                     "compiled all the same, their figures required equal (default 1)")
    readers = {name: commands.add_parser(name) for name in ("check", "markdown", "doc")}
    for command in readers.values():
        command.add_argument("report", nargs="?", type=Path, default=REPORT)
    for command in (run, readers["check"], readers["doc"]):
        command.add_argument("--gated", action="store_true",
                             help="head dim 128 only (what CI compiles: 6 slice shapes, not the record's 12)")
    args = parser.parse_args(argv)
    head_dims = GATED_HEAD_DIMS if getattr(args, "gated", False) else ALL_HEAD_DIMS
    if args.command != "run":
        report = json.loads(args.report.read_text())
        if args.command == "markdown":
            print(markdown(report), end="")
            return 0
        if args.command == "doc":
            write_doc(report, DOC)
        return _report_problems(report, head_dims)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    start = time.perf_counter()
    reuse = []
    if args.reuse:
        if not args.reuse.exists():
            parser.error(f"--reuse {args.reuse}: no such record")
        reuse = ["--reuse", str(args.reuse.resolve()), "--verify", str(args.verify), "--seed", head_commit(REPO)]
    report = _compile(head_dims, args.jobs, args.out, reuse)
    if not report:
        print(f"tpu_slices: FAIL: {SCRIPT.name} wrote no report", file=sys.stderr)
        return 1
    report["wall_s"] = round(time.perf_counter() - start)
    if args.reuse:
        programs = [row[p] for row in report["rows"] for p in PROGRAMS if p in row]
        report.update(reused_from=args.reuse.name, reused=sum(bool(p.get("reused")) for p in programs),
                      reproduced=sum(bool(p.get("reproduced")) for p in programs))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if str(args.doc) != "none":
        write_doc(report, args.doc)
    return _report_problems(report, head_dims)


if __name__ == "__main__":
    sys.exit(main())
