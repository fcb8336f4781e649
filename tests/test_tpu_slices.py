"""The pod-slice gate (scripts/compile/tpu_slices.py) on made-up reports: a complete, healthy one passes, and each
kind of broken one fails with the problem named. No libtpu needed: the gate reads examples/compile_for_tpu.py's
JSON only."""

import ast
import copy
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("tpu_slices", REPO / "scripts" / "compile" / "tpu_slices.py")
tpu_slices = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tpu_slices)

GiB = 2**30


def _figures(temp: float, kernels: int = 16, permutes: int = 0, gathers: int = 0, arguments: float = 0.5) -> dict:
    return dict(
        compile_s=10.0, capacity=None, tpu_kernels=kernels,
        hbm=dict(arguments=int(arguments * GiB), outputs=int(arguments * GiB), alias=int(arguments * GiB),
                 temp=int(temp * GiB), generated_code=2**20),
        collectives={"collective-permute": permutes, "all-gather": gathers, "all-reduce": 3, "reduce-scatter": 0,
                     "all-to-all": 0},
    )


def healthy() -> dict:
    rows = []
    for topology, mesh, head_dim, seq in tpu_slices.expected():
        ring = tpu_slices._is_ring(mesh)
        temp = 1.0 * seq / 2048  # linear in the sequence
        rows.append(dict(topology=topology, mesh=mesh, head_dim=head_dim, seq_len=seq,
                         train=_figures(temp, permutes=48 if ring else 0), generate=_figures(temp / 2, kernels=8)))
    return dict(jax="0.11.2", rows=rows)


def _row(report: dict, topology: str, seq: int = 2048, head_dim: int = 128) -> dict:
    return next(r for r in report["rows"]
                if r["topology"] == topology and r["seq_len"] == seq and r["head_dim"] == head_dim)


def test_a_complete_healthy_report_passes():
    assert tpu_slices.check(healthy()) == []


def _broken(change) -> list[str]:
    report = copy.deepcopy(healthy())
    change(report)
    return tpu_slices.check(report)


@pytest.mark.parametrize("change, problem", [
    (lambda r: r["rows"].pop(), "missing: v6e:2x2 mesh data=4 head dim 128 seq 8192"),
    (lambda r: r["rows"].remove(_row(r, "v5e:2x2", 8192, head_dim=64)), "missing: v5e:2x2 mesh data=2,seq=2 head dim 64"),
    (lambda r: _row(r, "v5p:2x2x1").__setitem__("train", dict(error="XlaRuntimeError: RESOURCE_EXHAUSTED")),
     "v5p:2x2x1 data=2,model=2 hd128 T=2048 train: compile error: XlaRuntimeError"),
    (lambda r: _row(r, "v6e:2x2").pop("generate"), "v6e:2x2 data=4 hd128 T=2048 generate: not compiled"),
    # 17 GiB of arguments (+ 1 GiB of temporaries) on a 16 GiB v5e chip
    (lambda r: _row(r, "v5e:2x2")["train"]["hbm"].__setitem__("arguments", 17 * GiB),
     "v5e:2x2 data=2,seq=2 hd128 T=2048 train: 18.00 GiB of HBM per chip planned, the chip has 16 GiB"),
    (lambda r: _row(r, "v5e:2x2")["train"]["collectives"].__setitem__("all-gather", 2),
     "v5e:2x2 data=2,seq=2 hd128 T=2048 train: the ring all-gathers (2 all-gather ops"),
    (lambda r: _row(r, "v5e:2x2")["train"]["collectives"].__setitem__("collective-permute", 0),
     "a ring with no collective-permute"),
    (lambda r: _row(r, "v6e:2x2")["train"].__setitem__("tpu_kernels", 0), "no Mosaic TPU kernel"),
    # quadratic growth: 16x the temporaries for 4x the sequence
    (lambda r: _row(r, "v5p:2x2x1", 8192)["train"]["hbm"].__setitem__("temp", 16 * GiB),
     "v5p:2x2x1 data=2,model=2 hd128 train: temporaries grow 16.0x"),
    # the generation too: a prefill that materialised T x T scores would grow its temporaries 16x
    (lambda r: _row(r, "v5e:2x2", 8192)["generate"]["hbm"].__setitem__("temp", 8 * GiB),
     "v5e:2x2 data=2,seq=2 hd128 generate: temporaries grow 16.0x"),
    (lambda r: _row(r, "v6e:2x2", 8192, head_dim=64)["generate"]["hbm"].__setitem__("temp", int(3.2 * GiB)),
     "v6e:2x2 data=4 hd64 generate: temporaries grow 6.4x from seq 2048 to 8192 (linear: 4x, at most 6.0x)"),
    (lambda r: _row(r, "v5p:2x2x1")["train"]["hbm"].pop("temp"), "incomplete figures (KeyError"),
    (lambda r: _row(r, "v5p:2x2x1")["train"].__setitem__("collectives", None), "incomplete figures (TypeError"),
    (lambda r: _row(r, "v5p:2x2x1").__setitem__("topology", "v9x:2x2"), "unknown TPU generation 'v9x'"),
    (lambda r: r.__setitem__("rows", None), "the report has no list of rows"),
])
def test_a_broken_report_fails_naming_the_problem(change, problem):
    problems = _broken(change)
    assert any(problem in p for p in problems), problems


def test_the_generation_may_read_up_to_six_times():
    # its plan's linear growth reads 5.0x on v5e at head dim 64 (scripts/compile/tpu_slices.py, MAX_TEMP_RATIO)
    assert _broken(lambda r: _row(r, "v5e:2x2", 8192, head_dim=64)["generate"]["hbm"].__setitem__(
        "temp", int(2.9 * GiB))) == []


def test_an_all_gather_outside_a_ring_is_no_problem():
    # data / model parallel steps may gather (GSPMD's choice); only the ring must move K/V by collective-permute.
    assert _broken(lambda r: _row(r, "v5p:2x2x1")["train"]["collectives"].__setitem__("all-gather", 4)) == []


def test_the_gate_and_the_script_name_the_same_slices():
    tree = ast.parse((REPO / "examples" / "compile_for_tpu.py").read_text())
    constants = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                 and node.targets[0].id in ("SLICES", "HBM_GIB", "SEQ_LENS")}
    assert constants["SLICES"] == tpu_slices.SLICES
    assert constants["HBM_GIB"] == tpu_slices.HBM_GIB
    assert constants["SEQ_LENS"] == tpu_slices.SEQ_LENS


def test_the_table_lands_between_the_markers(tmp_path):
    doc = tmp_path / "tpu.md"
    doc.write_text(f"# TPU\n\n## Pod slices\n\n{tpu_slices.BEGIN}\nold\n{tpu_slices.END}\n\n## After\n")
    report = healthy()
    tpu_slices.write_doc(report, doc)
    text = doc.read_text()
    assert "old" not in text and text.endswith("## After\n")
    table = text.split(tpu_slices.BEGIN)[1].split(tpu_slices.END)[0]
    assert table.count("| v5e:2x2 |") == 8  # 2 head dims x 2 seqs x (train, generate)
    assert "| v5e:2x2 | data=2,seq=2 | 128 | 8192 | train | 0.50 | 4.00 | 4.50 | 16 GiB | collective-permute 48" in table


def test_check_command_exit_status(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(healthy()))
    report = healthy()
    report["rows"].pop(0)
    bad.write_text(json.dumps(report))
    assert tpu_slices.main(["check", str(good)]) == 0
    assert tpu_slices.main(["check", str(bad)]) == 1


def test_ci_gates_head_dim_128_the_record_both():
    """CI compiles head dim 128 only (`run --gated`): its report passes the gated check and not the full one,
    which the committed record (head dims 64 and 128) must pass."""
    report = healthy()
    report["rows"] = [row for row in report["rows"] if row["head_dim"] == 128]
    assert tpu_slices.check(report, tpu_slices.GATED_HEAD_DIMS) == []
    assert sum("head dim 64" in problem for problem in tpu_slices.check(report)) == 6


def test_the_committed_record_passes_the_full_gate():
    report = json.loads(tpu_slices.REPORT.read_text())
    assert tpu_slices.check(report, tpu_slices.ALL_HEAD_DIMS) == []
    assert {(row["head_dim"], row["seq_len"]) for row in report["rows"]} == {
        (hd, seq) for hd in tpu_slices.ALL_HEAD_DIMS for seq in tpu_slices.SEQ_LENS}


_FAKE_SCRIPT = """
import argparse, json, os
parser = argparse.ArgumentParser()
parser.add_argument("--head-dims", nargs="*", type=int)
parser.add_argument("--seq-lens", nargs="*", type=int)
parser.add_argument("--slices", nargs="*")
parser.add_argument("--shard")
parser.add_argument("--json")
args = parser.parse_args()
index, count = map(int, args.shard.split("/"))
cases = [(s, hd, seq) for s in args.slices for hd in args.head_dims for seq in args.seq_lens]
rows = [dict(topology=s.split("=", 1)[0], mesh=s.split("=", 1)[1], head_dim=hd, seq_len=seq, pid=os.getpid())
        for s, hd, seq in cases[index::count]]
open(args.json, "w").write(json.dumps(dict(jax="fake", rows=rows)))
"""


def test_run_shares_the_cases_among_its_jobs(tmp_path, monkeypatch):
    """`run --jobs 2`: two processes, each compiling every other case, their rows merged in the gate's order."""
    script = tmp_path / "compile_for_tpu.py"
    script.write_text(_FAKE_SCRIPT)
    monkeypatch.setattr(tpu_slices, "SCRIPT", script)
    out = tmp_path / "report.json"
    report = tpu_slices._compile(tpu_slices.ALL_HEAD_DIMS, 2, out)
    assert [tpu_slices._key(row) for row in report["rows"]] == tpu_slices.expected(tpu_slices.ALL_HEAD_DIMS)
    assert len({row["pid"] for row in report["rows"]}) == 2 and report["jobs"] == 2
    assert json.loads(out.read_text()) == report


def test_a_reused_program_compiled_again_must_give_its_figures(monkeypatch):
    """examples/compile_for_tpu.py `--reuse --verify`: a program compiled again whose lowered module has the
    earlier run's fingerprint is marked reproduced when its figures are the same, and fails (an error, which
    the gate reports) when they differ; a changed module is a plain compile."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import compile_for_tpu

    earlier = dict(_figures(1.0), fingerprint="f")
    same = copy.deepcopy(earlier)
    compile_for_tpu._check_reproduced(same, earlier)
    assert same["reproduced"] and "error" not in same
    changed = dict(copy.deepcopy(earlier), fingerprint="g", tpu_kernels=3)
    compile_for_tpu._check_reproduced(changed, earlier)
    assert "error" not in changed and "reproduced" not in changed
    report = healthy()
    report["rows"][0]["train"].update(fingerprint="f", tpu_kernels=3)
    compile_for_tpu._check_reproduced(report["rows"][0]["train"], earlier)
    assert any("compiled to others" in problem for problem in tpu_slices.check(report))
