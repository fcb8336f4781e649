"""The pod-slice part of the compile check: the LM example's training step and batched generation compiled for
TPU slices without a TPU (examples/compile_for_tpu.py), its figures in docs/compile/tpu_slices.json and in
docs/tpu.md ("Pod slices"), and the gate over them. Run it through scripts/compile/tpu_slices.sh, which
finds the TPU toolchain and adds the examples' packages to it.

    python scripts/compile/tpu_slices.py run [--out docs/compile/tpu_slices.json] [--doc docs/tpu.md] [--all]
    python scripts/compile/tpu_slices.py check [docs/compile/tpu_slices.json]
    python scripts/compile/tpu_slices.py markdown [docs/compile/tpu_slices.json]
    python scripts/compile/tpu_slices.py doc [docs/compile/tpu_slices.json]     # docs/tpu.md's table, then check

`run` compiles the gated set (head dim 128 at seq 2048 and 8192 on each slice; `--all` adds head dim 64),
writes the JSON and the docs section, then checks. `check` exits 1 when a gated (slice, mesh, head dim,
seq) row is missing, a program failed to compile, a chip's planned HBM exceeds its capacity, the training
step's temporaries grow faster than linearly from seq 2048 to 8192, a ring step (a "seq" mesh axis)
all-gathers or sends no block by collective-permute, or a training step holds no Mosaic TPU kernel (the
attention fell back to XLA).
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
# Temporaries at seq 8192 over those at 2048: 4 when they grow linearly (flash attention keeps no T x T
# matrix), 16 when quadratically; this bound leaves room for the parts that do not grow.
MAX_TEMP_RATIO = 5.0
PROGRAMS = ("train", "generate")
BEGIN, END = "<!-- pod-slices:begin (scripts/compile/tpu_slices.py writes this table) -->", "<!-- pod-slices:end -->"


def expected(head_dims=GATED_HEAD_DIMS) -> list[tuple[str, str, int, int]]:
    return [(topology, mesh, hd, seq) for topology, mesh in SLICES for hd in head_dims for seq in SEQ_LENS]


def _key(row: dict) -> tuple:
    return row.get("topology"), row.get("mesh"), row.get("head_dim"), row.get("seq_len")


def _is_ring(mesh: str) -> bool:
    return any(part.strip().startswith("seq=") and part.split("=")[1].strip() != "1" for part in mesh.split(","))


def check(report: dict) -> list[str]:
    """The gate's problems with `report` (examples/compile_for_tpu.py's JSON); empty when it passes. Fails
    closed: a field it needs that is missing or of the wrong kind is a problem too."""
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
    for key in expected():
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
        try:
            ratio = longer["train"]["hbm"]["temp"] / row["train"]["hbm"]["temp"]
        except (KeyError, TypeError, ZeroDivisionError):
            continue  # a failed or incomplete row is a problem above already
        if ratio > MAX_TEMP_RATIO:
            problems.append(f"{topology} {mesh} hd{hd} train: temporaries grow {ratio:.1f}x from seq {seq} to "
                            f"{seq * 4} (linear: 4x, at most {MAX_TEMP_RATIO}x)")
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


def _report_problems(report: dict) -> int:
    problems = check(report)
    for problem in problems:
        print(f"tpu_slices: FAIL: {problem}", file=sys.stderr)
    print(f"tpu_slices: {len(report.get('rows', []))} slice shapes, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="compile, write the JSON and the docs table, check")
    run.add_argument("--out", type=Path, default=REPORT)
    run.add_argument("--doc", type=Path, default=DOC, help="the page with the pod-slices markers; 'none': no page")
    run.add_argument("--all", action="store_true", help="head dim 64 too (12 compiles of each program, not 6)")
    for name in ("check", "markdown", "doc"):
        commands.add_parser(name).add_argument("report", nargs="?", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    if args.command != "run":
        report = json.loads(args.report.read_text())
        if args.command == "markdown":
            print(markdown(report), end="")
            return 0
        if args.command == "doc":
            write_doc(report, DOC)
        return _report_problems(report)
    head_dims = ALL_HEAD_DIMS if args.all else GATED_HEAD_DIMS
    command = [sys.executable, str(SCRIPT), "--json", str(args.out), "--head-dims", *map(str, head_dims),
               "--seq-lens", *map(str, SEQ_LENS), "--slices", *(f"{t}={m}" for t, m in SLICES)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as shim:
        # The toolchain venv does not install the project: kernels/ is imported as probjax_kernels through a link,
        # probjax_nn from the repo root. No TPU is used (JAX_PLATFORMS=cpu); another libtpu process (a second
        # compile check) must not lock this one out.
        (Path(shim) / "probjax_kernels").symlink_to(REPO / "kernels", target_is_directory=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim, str(REPO)]), JAX_PLATFORMS="cpu",
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        # The script's own exit status says whether everything compiled; the check below says it in full.
        subprocess.run(command, cwd=REPO, env=env, check=False)
    if not args.out.exists():
        print(f"tpu_slices: FAIL: {SCRIPT.name} wrote no report", file=sys.stderr)
        return 1
    report = json.loads(args.out.read_text())
    report["wall_s"] = round(time.perf_counter() - start)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if str(args.doc) != "none":
        write_doc(report, args.doc)
    return _report_problems(report)


if __name__ == "__main__":
    sys.exit(main())
