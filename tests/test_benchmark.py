"""`python -m probjax_nn.benchmark`, run in-process on the CPU at tiny shapes, and its `plot` subcommand."""

import json
import pathlib
import shlex
import subprocess
import sys

import jax
import pytest

from probjax_nn.benchmark import main
from probjax_nn.benchmark import _timing
from probjax_nn.benchmark._timing import attention_flops

SEED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "seed" / "gpu_attention_rtx3090.json"
# The seed's schema (../shared/seed/gpu_attention_rtx3090.json): top-level, device and config keys, in order,
# and the keys of its three kinds of row.
TOP_KEYS = ["device", "config", "results"]
DEVICE_KEYS = [
    "jax", "backend", "devices", "python", "device_kind", "gpu", "driver", "gpu_memory_gb", "torch", "torch_cuda",
]
CONFIG_KEYS = [
    "output", "batch", "heads", "head_dims", "seq_lens", "ragged_seq_lens", "dtypes", "modes", "causal", "impls",
    "append", "tag",
]
KEY_COLUMNS = ["impl", "dtype", "head_dim", "seq", "causal", "mode", "batch", "heads", "tag"]
TIMING = ["compile_s", "inner", "median_ms", "q1_ms", "q3_ms", "tflops"]
ROW_KEYS = {
    "jax": [*KEY_COLUMNS, "max_abs_err", "rel_err", "xla_temp_mb", "xla_arg_mb", "xla_out_mb", *TIMING],
    "torch": [*KEY_COLUMNS, "max_abs_err", "rel_err", "peak_mb", *TIMING],
    "error": [*KEY_COLUMNS, "error"],
}

BATCH, HEADS, HEAD_DIM, SEQS = 1, 2, 16, (40, 64)  # 40: a ragged length, not a multiple of any block
PROBJAX = ("probjax_flex", "probjax_default")  # probjax_mha runs the same kernel core; left out for time
# torch is not installed in CI, and has no CUDA device where it is: torch_math is missing either way.
# jax_cudnn and torch_flash never compute in float32, so they have no rows.
IMPLS = (*PROBJAX, "jax_xla", "jax_cudnn", "torch_math", "torch_flash")
RUN = [
    "--seq-lens", "64", "--ragged-seq-lens", "40", "--head-dims", str(HEAD_DIM), "--batch", str(BATCH),
    "--heads", str(HEADS), "--dtypes", "float32", "--modes", "fwd", "fwd_bwd", "--causal", "1",
    "--impls", *IMPLS,
]


SAMPLES = 3


@pytest.fixture(autouse=True)
def few_samples(monkeypatch):
    """SAMPLES timed samples per row, not seven: quartiles still exist, and interpret-mode calls are slow."""
    monkeypatch.setattr(_timing, "SAMPLES", SAMPLES)


# Session scope: a worker builds the report (an interpret-mode benchmark run) once, even when its tests of this
# file come in several chunks between other files' tests.
@pytest.fixture(scope="session")
def report_path(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("benchmark") / "cpu.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_timing, "SAMPLES", SAMPLES)  # set up before the function fixture above
        assert main(["--output", str(path), *RUN]) == 0
    return path


@pytest.fixture(scope="session")
def report(report_path) -> dict:
    return json.loads(report_path.read_text())


def test_schema_is_the_seeds(report):
    assert list(report) == TOP_KEYS
    assert list(report["device"]) == DEVICE_KEYS
    assert list(report["config"]) == CONFIG_KEYS
    assert report["config"]["impls"] == list(IMPLS)
    assert report["config"]["causal"] == [1]
    for row in report["results"]:
        assert list(row) in ROW_KEYS.values(), row
        assert isinstance(row["causal"], bool)


@pytest.mark.skipif(not SEED.exists(), reason="needs ../shared/seed beside the repository")
def test_schema_constants_match_the_seed_file():
    seed = json.loads(SEED.read_text())
    assert list(seed) == TOP_KEYS
    assert list(seed["device"]) == DEVICE_KEYS
    assert list(seed["config"]) == CONFIG_KEYS
    assert {tuple(row) for row in seed["results"]} == {tuple(keys) for keys in ROW_KEYS.values()}


def test_rows_cover_the_grid_in_the_seeds_order(report):
    rows = report["results"]
    ran = [impl for impl in IMPLS if impl not in ("jax_cudnn", "torch_flash")]
    expected = [
        (impl, seq, causal, mode)
        for seq in SEQS
        for causal in (True,)
        for mode in ("fwd", "fwd_bwd")
        for impl in ran
    ]
    assert [(row["impl"], row["seq"], row["causal"], row["mode"]) for row in rows] == expected
    assert all((row["dtype"], row["head_dim"], row["batch"], row["heads"]) == ("float32", HEAD_DIM, BATCH, HEADS)
               for row in rows)


def test_missing_impl_rows_record_an_error_and_the_run_goes_on(report):
    missing = [row for row in report["results"] if row["impl"] == "torch_math"]
    assert len(missing) == len(SEQS) * 2
    assert all(row["error"].startswith("missing: torch") for row in missing)
    measured = [row for row in report["results"] if row["impl"] != "torch_math"]
    assert measured and all("error" not in row for row in measured)


def test_probjax_matches_the_float32_reference(report):
    rows = [row for row in report["results"] if row["impl"] in PROBJAX]
    assert len(rows) == len(PROBJAX) * len(SEQS) * 2
    for row in rows:
        assert row["max_abs_err"] < 1e-4 and row["rel_err"] < 1e-4, row


def test_measurements_and_flop_count(report):
    for row in report["results"]:
        if "error" in row:
            continue
        assert row["tflops"] > 0 and row["inner"] >= 1 and row["compile_s"] > 0
        assert row["q1_ms"] <= row["median_ms"] <= row["q3_ms"]
        assert row["xla_arg_mb"] > 0 and row["xla_out_mb"] > 0
        flops = 4 * BATCH * HEADS * row["seq"] ** 2 * HEAD_DIM
        flops *= (0.5 if row["causal"] else 1) * {"fwd": 1, "fwd_bwd": 3.5, "jvp": 3}[row["mode"]]
        assert row["tflops"] == pytest.approx(flops / (row["median_ms"] * 1e-3) / 1e12, rel=1e-9)


def test_flop_formula():
    forward = attention_flops(2, 3, 100, 16, causal=False, mode="fwd")
    assert forward == 4 * 2 * 3 * 100 * 100 * 16
    assert attention_flops(2, 3, 100, 16, causal=True, mode="fwd") == forward / 2
    assert attention_flops(2, 3, 100, 16, causal=False, mode="fwd_bwd") == 3.5 * forward
    assert attention_flops(2, 3, 100, 16, causal=True, mode="fwd_bwd") == 1.75 * forward
    assert attention_flops(2, 3, 100, 16, causal=True, mode="jvp") == 1.5 * forward


def test_jvp_mode_rows(tmp_path):
    """Forward-mode AD rows: the output and its tangent against the reference's jax.jvp."""
    path = tmp_path / "jvp.json"
    args = ["--output", str(path), "--seq-lens", "40", "--ragged-seq-lens", "--head-dims", str(HEAD_DIM),
            "--batch", str(BATCH), "--heads", str(HEADS), "--dtypes", "float32", "--modes", "jvp", "--causal", "1",
            "--impls", *PROBJAX, "jax_xla"]
    assert main(args) == 0
    rows = json.loads(path.read_text())["results"]
    assert [(row["impl"], row["mode"]) for row in rows] == [(impl, "jvp") for impl in (*PROBJAX, "jax_xla")]
    for row in rows:
        assert row["max_abs_err"] < 1e-4 and row["rel_err"] < 1e-4, row


def test_append_keeps_old_rows(report_path, report, tmp_path):
    path = tmp_path / "appended.json"
    path.write_text(report_path.read_text())
    args = ["--output", str(path), "--seq-lens", "32", "--ragged-seq-lens", "--head-dims", str(HEAD_DIM),
            "--batch", str(BATCH), "--heads", str(HEADS), "--dtypes", "float32", "--modes", "fwd", "--causal", "1",
            "--impls", "jax_xla", "--append", "--tag", "second"]
    assert main(args) == 0
    appended = json.loads(path.read_text())
    old = report["results"]
    assert appended["results"][: len(old)] == old
    new = appended["results"][len(old):]
    assert [(row["impl"], row["seq"], row["causal"], row["mode"], row["tag"]) for row in new] == [
        ("jax_xla", 32, True, "fwd", "second")
    ]
    # The config covers every row: list-valued keys are the union of both runs.
    assert appended["config"]["seq_lens"] == [32, 64]
    assert appended["config"]["impls"] == list(IMPLS)
    assert appended["config"]["append"] is True


def test_plot_writes_pngs_and_a_summary(report_path, tmp_path, capsys):
    assert main(["plot", str(report_path), "--out-dir", str(tmp_path)]) == 0
    pngs = sorted(tmp_path.glob("*.png"))
    assert [png.name for png in pngs] == [f"cpu_float32_b{BATCH}_n{HEADS}_hd{HEAD_DIM}.png"]
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (tmp_path / "cpu.md").read_text()
    assert "python -m probjax_nn.benchmark --output" in summary
    assert "- torch_math: torch" in summary  # listed as missing
    assert "| best peer | probjax_flex / best | probjax_default / best |" in summary
    table = [line for line in summary.splitlines() if line.startswith("| float32 |")]
    assert len(table) == len(SEQS) * 2  # seq x mode, causal only
    assert all("jax_xla" in line for line in table)  # the only peer measured, so the best one
    assert f"![{pngs[0].stem}]({pngs[0].name})" in summary
    assert str(tmp_path / "cpu.md") in capsys.readouterr().out


def _usage_error(capsys, argv: list[str]) -> str:
    """The error line of a usage error: exit 2, no traceback, nothing measured."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert exit.value.code == 2 and lines[0].startswith("usage:") and "Traceback" not in captured.err, captured.err
    assert captured.out == ""  # no row was measured
    return lines[-1]


def test_a_bad_output_is_refused_before_measuring(tmp_path, capsys):
    """A folder or a path under a file failed only after the first row was measured, leaving a .partial file;
    --append onto a file that is not a benchmark's JSON gave a traceback."""
    folder, a_file = tmp_path / "folder", tmp_path / "file.txt"
    notes, other = tmp_path / "notes.json", tmp_path / "o.json"
    folder.mkdir()
    a_file.write_text("x")
    notes.write_text("measured by hand")
    other.write_text('{"rows": []}')
    tiny = ["--seq-lens", "32", "--ragged-seq-lens", "--head-dims", "16", "--batch", "1", "--heads", "1", "--dtypes",
            "float32", "--modes", "fwd", "--causal", "1", "--impls", "jax_xla"]
    cases = [
        (["--output", str(folder)], f"argument --output: {folder} is a folder"),
        (["--output", str(a_file / "sub" / "out.json")], f"argument --output: {a_file} is not a folder"),
        (["--output", str(notes), "--append"], f"argument --append: {notes} is not JSON"),
        (["--output", str(other), "--append"], f"argument --append: {other} is not a benchmark report"),
    ]
    for flags, message in cases:
        assert message in _usage_error(capsys, [*tiny, *flags])
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["file.txt", "folder", "notes.json", "o.json"]
    assert notes.read_text() == "measured by hand" and a_file.read_text() == "x"


def test_plot_of_a_missing_or_corrupt_file_is_a_usage_error(tmp_path, capsys):
    corrupt, wrong = tmp_path / "corrupt.json", tmp_path / "wrong.json"
    corrupt.write_text('{"device": ')
    wrong.write_text("[1, 2]")
    for path in (tmp_path / "missing.json", corrupt, wrong, tmp_path):
        line = _usage_error(capsys, ["plot", str(path)])
        assert "argument FILE: " in line and str(path) in line, line
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"device": {}, "config": {}, "results": []}))
    line = _usage_error(capsys, ["plot", str(empty), "--out-dir", str(wrong)])
    assert f"argument --out-dir: {wrong} is not a folder" in line, line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corrupt.json", "empty.json", "wrong.json"]


def test_import_probjax_nn_imports_no_benchmark_matplotlib_or_torch():
    code = (
        "import sys, probjax_nn; "
        "print([m for m in ('probjax_nn.benchmark', 'matplotlib', 'torch', 'tqdm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_decode_mode_rows(tmp_path):
    """`decode` on the CPU: the seed's schema plus decode's keys, errors against the float32 reference, no
    timing (interpret mode); impls that cannot take a paged cache record why."""
    path = tmp_path / "decode.json"
    assert main(["decode", "--output", str(path), "--batch", "2", "--cache-lens", "64", "--heads", "4:2",
                 "--head-dim", "16", "--page-sizes", "16", "--dtypes", "float32",
                 "--impls", "probjax_decode", "jax_xla"]) == 0
    report = json.loads(path.read_text())
    assert list(report) == TOP_KEYS and list(report["device"]) == DEVICE_KEYS
    assert list(report["config"])[: len(CONFIG_KEYS)] == CONFIG_KEYS
    rows = {(row["impl"], row["page_size"]): row for row in report["results"]}
    assert set(rows) == {("probjax_decode", 16), ("jax_xla", 16)}
    row = rows["probjax_decode", 16]
    assert list(row)[: len(KEY_COLUMNS)] == KEY_COLUMNS
    assert (row["mode"], row["seq"], row["heads"], row["kv_heads"], row["new_tokens"]) == ("decode", 64, 4, 2, 1)
    assert row["rel_err"] < 1e-5 and row["median_ms"] is None
    assert "dense cache only" in rows["jax_xla", 16]["error"]


def test_decode_plot_keeps_dense_and_paged_apart_and_quotes_a_runnable_command(tmp_path, capsys):
    """`plot` of a decode report: untimed rows (the CPU's tflops None) raised TypeError; dense and paged rows
    of one shape merged, so jax_xla's paged error hid its dense result; the quoted command had no `decode`
    and the attention benchmark's flags."""
    from probjax_nn.benchmark import _decode

    path = tmp_path / "decode.json"
    flags = ["--batch", "1", "--cache-lens", "32", "--heads", "2:1", "--head-dim", "16", "--page-sizes", "0", "16",
             "--dtypes", "float32", "--impls", "probjax_decode", "jax_xla"]
    assert main(["decode", "--output", str(path), *flags]) == 0
    assert main(["plot", str(path), "--out-dir", str(tmp_path / "cpu")]) == 0
    summary = (tmp_path / "cpu" / "decode.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| float32 |")]
    assert rows == ["| float32 | 1 | 2 | 16 | 32 | n | decode | 1 | 1 | dense | - | - |  |  |",
                    "| float32 | 1 | 2 | 16 | 32 | n | decode | 1 | 1 | 16 | - | ERR |  |  |"]
    command = next(line for line in summary.splitlines() if line.startswith("- command: "))
    words = command.removeprefix("- command: ").strip("`").split()
    assert words[:4] == ["python", "-m", "probjax_nn.benchmark", "decode"]
    again, wanted = _decode.parse_args(words[4:]), _decode.parse_args(["--output", str(path), *flags])
    assert vars(again) == vars(wanted)
    # Timed rows (as on a GPU): one figure per cache layout.
    report = json.loads(path.read_text())
    for row in report["results"]:
        if "error" not in row:
            row["tflops"] = 1.0
    timed = tmp_path / "timed.json"
    timed.write_text(json.dumps(report))
    assert main(["plot", str(timed), "--out-dir", str(tmp_path / "gpu")]) == 0
    pngs = sorted(png.name for png in (tmp_path / "gpu").glob("*.png"))
    assert pngs == ["timed_float32_b1_n2_hd16_k1_t1_dense.png", "timed_float32_b1_n2_hd16_k1_t1_page16.png"]
    assert "| 1 | 1 | dense | 1 | 1 | jax_xla 1 | 1.00 |" in (tmp_path / "gpu" / "timed.md").read_text()
    capsys.readouterr()


@pytest.mark.parametrize("flags, message", [
    (["--page-sizes", "-16"], "argument --page-sizes: -16 is not 0 (a dense cache) or a power of two >= 16"),
    (["--page-sizes", "8"], "argument --page-sizes: 8 is not 0 (a dense cache) or a power of two >= 16"),
    (["--page-sizes", "24"], "argument --page-sizes: 24 is not 0 (a dense cache) or a power of two >= 16"),
    (["--page-sizes", "32", "--cache-lens", "48"], "argument --page-sizes: 32 does not divide --cache-lens 48"),
    (["--new-tokens", "17"], "argument --new-tokens: 17 is not in 1..16"),
    (["--new-tokens", "4", "--cache-lens", "2"], "argument --cache-lens: 2 is shorter than --new-tokens 4"),
])
def test_decode_flags_no_row_could_measure_are_usage_errors(tmp_path, capsys, flags, message):
    """Each gave a report of rows with reshape or kernel errors."""
    argv = ["decode", "--output", str(tmp_path / "d.json"), "--cache-lens", "64", "--dtypes", "float32", *flags]
    assert message in _usage_error(capsys, argv)
    assert list(tmp_path.iterdir()) == []


def test_ragged_lengths_join_only_the_default_seq_lens(tmp_path):
    """A short --seq-lens is a quick run: the default ragged lengths (up to 3000) stay out of it."""
    from probjax_nn.benchmark._cli import parse_args

    output = ["--output", str(tmp_path / "out.json")]
    default = parse_args(output)
    assert default.seq_lens == [128, 512, 1024, 2048, 4096, 8192]
    assert default.ragged_seq_lens == [600, 1500, 3000]
    short = parse_args([*output, "--seq-lens", "32", "64"])
    assert (short.seq_lens, short.ragged_seq_lens) == ([32, 64], [])
    both = parse_args([*output, "--seq-lens", "32", "--ragged-seq-lens", "40"])
    assert (both.seq_lens, both.ragged_seq_lens) == ([32], [40])
    ragged_only = parse_args([*output, "--ragged-seq-lens", "40"])
    assert ragged_only.ragged_seq_lens == [40] and ragged_only.seq_lens == default.seq_lens


def test_cpu_mode_rows_and_ratios(tmp_path, capsys):
    """`cpu`: impl "auto" and jax.nn's "xla" path in one run, a row each per case with medians, XLA's temp bytes
    and the difference from jax.nn; one ratio per case that is the rows' quotient; a Markdown table beside it
    that quotes the command, which parses back to the same flags."""
    from probjax_nn.benchmark import _cpu

    path = tmp_path / "cpu.json"
    flags = ["--output", str(path), "--machine", "test machine", "--seq-lens", "40", "64", "--heads", "2",
             "--head-dim", "16", "--causal", "1", "--modes", "fwd", "fwd_bwd", "--samples", "2"]
    assert main(["cpu", *flags]) == 0
    report = json.loads(path.read_text())
    assert report["device"]["machine"] == "test machine" and report["device"]["jax"] == jax.__version__
    rows = {(row["impl"], row["seq"], row["mode"]): row for row in report["results"]}
    assert set(rows) == {(impl, seq, mode) for impl in _cpu.IMPLS for seq in (40, 64) for mode in ("fwd", "fwd_bwd")}
    for row in rows.values():
        assert row["causal"] is True and row["wall_ms"] > 0 and row["cpu_ms"] >= 0 and row["temp_mb"] >= 0
        assert row["max_abs_diff_vs_jax"] < 1e-5  # no row of this grid loses every key: the results agree
    assert len(report["ratios"]) == 4
    for ratio in report["ratios"]:
        ours, theirs = (rows[impl, ratio["seq"], ratio["mode"]] for impl in _cpu.IMPLS)
        assert ratio["wall"] == pytest.approx(ours["wall_ms"] / theirs["wall_ms"])
        assert ratio["temp"] == pytest.approx(ours["temp_mb"] / theirs["temp_mb"])
    summary = path.with_suffix(".md").read_text()
    assert "test machine" in summary and summary.count("| 64 | True |") == 2
    command = next(line for line in summary.splitlines() if line.startswith("Command: "))
    words = shlex.split(command.removeprefix("Command: ").strip("`"))
    assert words[:4] == ["python", "-m", "probjax_nn.benchmark", "cpu"]
    assert vars(_cpu.parse_args(words[4:])) == vars(_cpu.parse_args(flags))
    capsys.readouterr()
