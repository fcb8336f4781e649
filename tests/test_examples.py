"""The LM training example (examples/train_lm.py, examples/lm/, examples/sample.py) on a micro config."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from lm_helpers import SMALL_CORPUS

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("flax")
pytest.importorskip("equinox")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import data, train  # noqa: E402
from lm.config import Config, make_config, parse_args, to_json  # noqa: E402
from lm.sampling import generate  # noqa: E402

FRAMEWORKS = ("nnx", "linen", "equinox")
# Small enough for two CPU cores; "xla" keeps Pallas interpret mode out of all but one test.
MICRO = dict(
    num_layers=2, d_model=32, num_heads=2, seq_len=32, batch_size=4, attention="xla", learning_rate=1e-2,
    warmup_steps=2, log_every=5, eval_every=10, eval_batches=2, checkpoint_every=10, num_samples=1, sample_tokens=8,
    data=SMALL_CORPUS,
)


@pytest.fixture(autouse=True)
def standard_promotion():
    """conftest.py makes dtype promotion strict; optax's Adam is not written for it (`b1 ** count` with an
    int32 count), so the example runs under jax's standard promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def micro(data_cache: str, out: Path, **overrides) -> Config:
    return make_config("tiny", {**MICRO, "data_cache": data_cache, "out": str(out), **overrides})


@pytest.fixture(scope="module")
def thirty_steps(data_cache, tmp_path_factory):
    """`thirty_steps(framework)`: (out folder, metrics rows) of MICRO's 30-step run of `framework`, trained once
    per module, on first use, for the test that checks it and the resume tests that compare with it (where a
    run checkpoints does not change its losses). Its folder is read, never written."""
    runs = {}

    def run(framework: str) -> tuple[Path, list[dict]]:
        if framework not in runs:
            out = tmp_path_factory.mktemp(f"thirty_steps_{framework}")
            with jax.numpy_dtype_promotion("standard"):
                runs[framework] = out, train.run(micro(data_cache, out, framework=framework, steps=30))
        return runs[framework]

    return run


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_thirty_steps_loss_falls_and_samples(framework, thirty_steps, capsys):
    out, rows = thirty_steps(framework)
    assert [row["step"] for row in rows] == [5, 10, 15, 20, 25, 30]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 1.0
    validation = [row["val_loss"] for row in rows if row["val_loss"] is not None]
    assert len(validation) == 3 and validation[-1] < validation[0]
    assert all(row["tokens_per_s"] > 0 and row["mfu"] is None for row in rows)  # MFU: n/a on the CPU
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] == rows
    assert (out / "loss.png").stat().st_size > 0
    assert (out / "samples.txt").read_text().startswith("--- sample 0 ---\ndef ")

    sample = _load_script("sample")
    capsys.readouterr()
    sample.main(["--out", str(out), "--prompt", "import", "--tokens", "5", "--temperature", "0",
                 "--num-samples", "2"])
    printed = capsys.readouterr().out
    assert f"{framework} model, step 30" in printed and "--- sample 1 ---\nimport" in printed


def test_sample_takes_explicit_zeros_and_names_bad_flags(data_cache, tmp_path, capsys):
    # A checkpoint of step 1, trained on the default corpus (data None: the standard library's sources).
    rows = train.run(micro(data_cache, tmp_path, steps=1, num_samples=0, sample_tokens=8, data=None))
    assert [row["step"] for row in rows] == [1]
    # An untrained model (NNX, the default) is close to uniform over 256 bytes.
    assert abs(rows[0]["train_loss"] - math.log(256)) < 0.3
    assert abs(rows[0]["val_loss"] - math.log(256)) < 0.3
    sample = _load_script("sample")
    capsys.readouterr()
    # --tokens 0 is the prompt alone (it was the run's sample_tokens); the run's num_samples=0 means one.
    sample.main(["--out", str(tmp_path), "--prompt", "abc", "--tokens", "0", "--temperature", "0"])
    assert capsys.readouterr().out.endswith("--- sample 0 ---\nabc\n")
    with pytest.raises(SystemExit, match=r"--step 5: no checkpoint of that step .* it has steps \[1\]"):
        sample.main(["--out", str(tmp_path), "--step", "5"])
    for flags in (["--num-samples", "0"], ["--temperature", "-1"], ["--tokens", "-2"], ["--prompt", ""],
                  ["--temperature", "nan"], ["--temperature", "inf"],
                  ["--prompt", "caf\udce9"]):  # non-UTF-8 bytes of argv: was a UnicodeEncodeError traceback
        assert flags[0] in _usage_error(capsys, lambda: sample.main(["--out", str(tmp_path), *flags]))
    # A folder without a run was a FileNotFoundError traceback.
    for out in (tmp_path / "missing", tmp_path / "checkpoints"):
        line = _usage_error(capsys, lambda: sample.main(["--out", str(out)]))
        assert "argument --out: " in line and str(out) in line


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_resume_after_interruption_matches_an_unbroken_run(framework, data_cache, tmp_path, thirty_steps):
    _, unbroken = thirty_steps(framework)
    config = dict(framework=framework, steps=30, num_samples=0)
    interrupted = micro(data_cache, tmp_path / "interrupted", **config)
    first = train.run(interrupted, stop_after=13)  # "killed" after step 13; the last checkpoint is step 10
    assert [row["step"] for row in first] == [5, 10]
    resumed = train.run(micro(data_cache, tmp_path / "interrupted", resume=True, **config))
    assert [row["step"] for row in resumed] == [row["step"] for row in unbroken] == [5, 10, 15, 20, 25, 30]
    for got, want in zip(resumed, unbroken):
        assert got["step"] == want["step"]
        np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-6)
        if want["val_loss"] is not None:
            np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-6)


def test_resume_from_a_checkpoint_between_metrics_rows(data_cache, tmp_path, thirty_steps):
    """A checkpoint at step 7 with a metrics row every 5 steps: the resumed row of step 10 averages the losses
    of steps 6..10, as the unbroken run's does (steps 6 and 7 come from the checkpoint)."""
    _, unbroken = thirty_steps("linen")  # checkpoints every 10 steps, none of them read
    config = dict(framework="linen", steps=30, checkpoint_every=7, num_samples=0)
    train.run(micro(data_cache, tmp_path, **config), stop_after=9)
    resumed = train.run(micro(data_cache, tmp_path, resume=True, **config))
    assert [row["step"] for row in resumed] == [row["step"] for row in unbroken] == [5, 10, 15, 20, 25, 30]
    for got, want in zip(resumed, unbroken):
        np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-6)
    # Steps 1..7 of the interrupted run are the unbroken run's: the row's mean includes them exactly.
    assert resumed[1]["train_loss"] == unbroken[1]["train_loss"]


def micro_flags(data_cache: str, out: Path, **overrides) -> list[str]:
    """`micro`'s config as train_lm.py flags."""
    values = {**MICRO, "data_cache": data_cache, "out": str(out), **overrides}
    return [word for name, value in values.items() for word in ("--" + name.replace("_", "-"), str(value))]


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder`: its bytes and modification time."""
    files = [f for f in folder.rglob("*") if f.is_file()]
    return {str(f.relative_to(folder)): (f.read_bytes(), f.stat().st_mtime_ns) for f in files}


def _fake_run(out: Path, config: Config) -> None:
    """A finished run's files (checkpoints of a later step than any new run here would reach)."""
    (out / "checkpoints" / "50").mkdir(parents=True)
    (out / "checkpoints" / "50" / "params").write_text("old weights")
    (out / "config.json").write_text(to_json(config))
    (out / "metrics.jsonl").write_text('{"step": 50, "train_loss": 1.0}\n')
    (out / "notes.txt").write_text("the user's own file")


def _usage_error(capsys, run) -> str:
    """The one error line of a usage error (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exit:
        run()
    lines = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(lines) == 2 and lines[0].startswith("usage:"), lines
    return lines[1]


def test_a_used_out_folder_needs_resume_or_overwrite(data_cache, tmp_path, capsys):
    """Training into an old run's folder kept its checkpoints (orbax skips steps at or below its latest) next to
    new metrics; sample.py and --resume then loaded the old weights."""
    train_lm = _load_script("train_lm")
    _fake_run(tmp_path, micro(data_cache, tmp_path))
    before = _snapshot(tmp_path)
    line = _usage_error(capsys, lambda: train_lm.main(micro_flags(data_cache, tmp_path, steps=1, num_samples=0)))
    assert "argument --out: " in line and "--resume" in line and "--overwrite" in line
    assert _snapshot(tmp_path) == before

    # --overwrite starts the folder afresh: only the run's own files go.
    train_lm.main([*micro_flags(data_cache, tmp_path, steps=1, num_samples=0, checkpoint_every=1), "--overwrite"])
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [1]
    assert [row["step"] for row in train.Metrics.read(tmp_path / "metrics.jsonl")] == [1]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["steps"] == 1 and saved["overwrite"] is False  # a --config of it must not delete the folder
    assert (tmp_path / "notes.txt").read_text() == "the user's own file"


def test_failed_checks_write_nothing(data_cache, tmp_path, capsys):
    """A missing --data, or --resume with another architecture, rewrote config.json before failing."""
    train_lm = _load_script("train_lm")
    fresh = tmp_path / "fresh"
    line = _usage_error(capsys, lambda: train_lm.main(micro_flags(data_cache, fresh, data=str(tmp_path / "none"))))
    assert "argument --data: " in line and "none" in line
    assert not fresh.exists()

    _fake_run(tmp_path, micro(data_cache, tmp_path))
    before = _snapshot(tmp_path)
    line = _usage_error(capsys, lambda: train_lm.main(
        [*micro_flags(data_cache, tmp_path, data=str(tmp_path / "none")), "--resume"]))
    assert "argument --data: " in line
    changed = micro_flags(data_cache, tmp_path, num_layers=3, d_model=64, framework="linen", steps=99)
    line = _usage_error(capsys, lambda: train_lm.main([*changed, "--resume"]))
    assert "argument --resume: " in line and "--overwrite" in line
    assert "num_layers 2 -> 3" in line and "d_model 32 -> 64" in line and "framework 'nnx' -> 'linen'" in line
    assert "steps" not in line  # a longer schedule is a fine thing to resume with
    assert _snapshot(tmp_path) == before


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_data_loads(data_cache, tmp_path, capsys):
    """A missing --data is reported later than --out: the --out error shows the data was not loaded first."""
    train_lm = _load_script("train_lm")
    (tmp_path / "file").write_text("not a folder")
    outs = [tmp_path / "file" / "run"] + ([Path("/proc/probjax_nn_run")] if sys.platform == "linux" else [])
    for out in outs:
        line = _usage_error(capsys, lambda: train_lm.main(micro_flags(data_cache, out, data=str(tmp_path / "none"))))
        assert "error: argument --out: cannot " in line and str(out) in line, line
    assert not Path("/proc/probjax_nn_run").exists()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cudnn runs on a GPU")
def test_cudnn_without_a_gpu_is_refused_before_anything_is_written(data_cache, tmp_path, capsys):
    """Was a traceback after config.json and metrics.jsonl were written."""
    train_lm = _load_script("train_lm")
    line = _usage_error(capsys, lambda: train_lm.main(micro_flags(data_cache, tmp_path / "run", attention="cudnn")))
    assert "argument --attention: attention='cudnn' needs an NVIDIA GPU; this run's devices are cpu" in line, line
    assert not (tmp_path / "run").exists()


def test_a_term_signal_saves_a_checkpoint_and_resume_continues_the_run(
    data_cache, tmp_path, capsys, monkeypatch, thirty_steps
):
    """A TERM (SLURM preemption, scancel, a time limit) killed the run, losing the steps since its last
    checkpoint; now it stops after the step it arrives in, saves that step and exits 0 (checkpoint_every none:
    no other checkpoint), and --resume reaches the losses of an unbroken run (NNX's, which checkpointed every
    10 steps: that does not change its losses)."""
    import signal

    train_lm = _load_script("train_lm")
    config = dict(steps=30, checkpoint_every="none", num_samples=0)
    _, unbroken = thirty_steps("nnx")
    train_starts = data.train_starts

    def terminate_at_step_3(tokens, config, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_starts(tokens, config, step)

    monkeypatch.setattr(data, "train_starts", terminate_at_step_3)
    out = tmp_path / "run"
    handler = signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    train_lm.main(micro_flags(data_cache, out, **config))  # returns: exit status 0
    printed = capsys.readouterr().out
    assert f"stopped by a TERM signal after step 3, saved in {out / 'checkpoints' / '3'}: run the same command " \
        "with --resume to continue" in printed, printed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3"]
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler lasts as long as its loop
    monkeypatch.setattr(data, "train_starts", train_starts)
    resumed = train.run(micro(data_cache, out, resume=True, **config))
    assert [row["step"] for row in resumed] == [row["step"] for row in unbroken] == [5, 10, 15, 20, 25, 30]
    for got, want in zip(resumed, unbroken):
        np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-6)


def test_the_first_term_or_int_stops_and_the_later_ones_are_noted_and_ignored(monkeypatch, capfd):
    """A Ctrl-C raised KeyboardInterrupt wherever the run was (the steps since its last checkpoint lost); now
    the first TERM or INT asks for the stop and the later ones are noted. Several processes: jax's preemption
    service keeps the TERM; an INT is passed on to it as a TERM."""
    from lm.distributed import Preemption

    term = signal.getsignal(signal.SIGTERM)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal
    try:
        preemption = Preemption().install()
        try:
            assert not preemption.reached(1)
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:  # would end the whole test session
                pytest.fail("an INT raised KeyboardInterrupt instead of asking the run to stop")
            assert preemption.reached(1) and preemption.signalled == "INT"
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
        finally:
            preemption.restore()
        assert signal.getsignal(signal.SIGTERM) is term
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        err = capfd.readouterr().err
        for name in ("TERM", "INT"):
            assert f"got {name} while stopping (after INT): ignored until the checkpoint of the stop is saved" in err

        with monkeypatch.context() as patch:
            patch.setattr(jax, "process_count", lambda: 2)
            sent = []
            patch.setattr(os, "kill", lambda pid, signum: sent.append((pid, signum)))
            preemption = Preemption().install()
            try:
                assert signal.getsignal(signal.SIGTERM) is term  # jax's handler stays
                signal.raise_signal(signal.SIGINT)
            finally:
                preemption.restore()
        assert sent == [(os.getpid(), signal.SIGTERM)] and preemption.signalled == "INT"

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # started with INT ignored (nohup, a background job)
        Preemption().install().restore()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, interrupt)


# Bounds for a machine much busier than this one; a slow machine is not a failure.
WAIT_S = 600
# train_lm.py with orbax's commit of each checkpoint held until the file GATE.go exists (GATE.saving says that
# a commit has begun): the save lasts as long as the test needs, on a fast machine as on a slow one.
_HELD_SAVE = """
    import os, runpy, sys, time
    from orbax.checkpoint._src.path import atomicity

    gate, wait_s = sys.argv.pop(1), float(sys.argv.pop(1))

    def hold(finalize):
        async def held(self):
            open(gate + ".saving", "w").close()
            deadline = time.monotonic() + wait_s
            while not os.path.exists(gate + ".go") and time.monotonic() < deadline:
                time.sleep(0.05)
            await finalize(self)
        return held

    for kind in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        kind.finalize = hold(kind.finalize)
    sys.argv[0] = {script!r}
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_signals_during_the_save_of_a_stop_are_ignored_until_it_is_committed(data_cache, tmp_path, capsys):
    """A second TERM 0.3 s after the first (`scancel` and a batch script that passes the TERM on, a launcher's
    TERM and a Ctrl-C) killed the run while it saved the first one's checkpoint: status 143, only
    `S.orbax-checkpoint-tmp-*` left, the steps since the last checkpoint lost. Now the TERMs and INTs that come
    during the save are noted and ignored; the run commits the checkpoint, exits 0, and --resume continues."""
    worker = tmp_path / "held_save.py"
    worker.write_text(textwrap.dedent(_HELD_SAVE).format(script=str(EXAMPLES / "train_lm.py")))
    out, gate, stdout, stderr = tmp_path / "run", tmp_path / "gate", tmp_path / "stdout", tmp_path / "stderr"
    config = dict(steps=100_000, log_every=1, eval_every=100_000, checkpoint_every="none", num_samples=0,
                  num_layers=1)
    argv = [sys.executable, str(worker), str(gate), str(WAIT_S), *micro_flags(data_cache, out, **config)]
    # The run starts with INT's default disposition, as from a terminal (not SIG_IGN, were pytest run in the
    # background): a handler installed here is reset to the default in the child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with stdout.open("w") as out_file, stderr.open("w") as err_file:
            process = subprocess.Popen(argv, stdout=out_file, stderr=err_file, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)

    def wait_for(condition) -> bool:
        """Whether `condition()` came true within WAIT_S seconds, while the run ran."""
        for _ in range(WAIT_S * 10):
            if condition() or process.poll() is not None:
                break
            time.sleep(0.1)
        return condition()

    metrics = out / "metrics.jsonl"
    try:
        # The first TERM once a step is done: its metrics row is written inside the loop's signal handling.
        assert wait_for(lambda: metrics.exists() and metrics.read_text().strip()), stderr.read_text()[-3000:]
        process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: Path(f"{gate}.saving").exists()), stderr.read_text()[-3000:]
        unfinished = list((out / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
        assert len(unfinished) == 1, unfinished  # the stop's save has begun and is not committed
        step = int(unfinished[0].name.split(".")[0])
        for signum, name in ((signal.SIGTERM, "TERM"), (signal.SIGINT, "INT")):
            process.send_signal(signum)
            line = f"got {name} while stopping (after TERM): ignored until the checkpoint of the stop is saved"
            assert wait_for(lambda: line in stderr.read_text()), (process.returncode, stderr.read_text()[-3000:])
        Path(f"{gate}.go").touch()
        process.wait(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=WAIT_S)
    assert process.returncode == 0, stderr.read_text()[-3000:]
    assert f"stopped by a TERM signal after step {step}, saved in {out / 'checkpoints' / str(step)}: run the " \
        "same command with --resume to continue" in stdout.read_text(), stdout.read_text()[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [str(step)]

    capsys.readouterr()
    resumed = train.run(micro(data_cache, out, resume=True, **{**config, "steps": step + 2}))
    assert f"resumed from step {step}\n" in capsys.readouterr().out
    assert [row["step"] for row in resumed] == list(range(1, step + 3))


def test_resume_needs_a_checkpoint_and_says_what_is_there(data_cache, tmp_path, capsys):
    """--resume into a folder without a checkpoint started from step 0 and overwrote metrics.jsonl."""
    train_lm = _load_script("train_lm")
    line = _usage_error(capsys, lambda: train_lm.main([*micro_flags(data_cache, tmp_path / "new"), "--resume"]))
    assert "argument --resume: " in line and "holds no checkpoint" in line and "does not exist" in line, line
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    line = _usage_error(capsys, lambda: train_lm.main([*micro_flags(data_cache, tmp_path / "empty"), "--resume"]))
    assert "is empty" in line, line
    # A run killed before its first checkpoint, with orbax's unfinished folder of step 10.
    used = tmp_path / "used"
    (used / "checkpoints" / "10.orbax-checkpoint-tmp-1733").mkdir(parents=True)
    (used / "config.json").write_text(to_json(micro(data_cache, used)))
    (used / "metrics.jsonl").write_text('{"step": 5, "train_loss": 5.0}\n')
    before = _snapshot(used)
    line = _usage_error(capsys, lambda: train_lm.main([*micro_flags(data_cache, used), "--resume"]))
    assert "holds config.json, metrics.jsonl, checkpoints, an unfinished checkpoint 10.orbax-checkpoint-tmp" in line
    assert "--overwrite" in line, line
    assert _snapshot(used) == before


# A metrics row every step and a checkpoint every 2: a run to break and resume in several ways.
KILLED = dict(steps=6, log_every=1, checkpoint_every=2, eval_every=100, num_samples=0, num_layers=1)


@pytest.fixture(scope="module")
def killed_run(data_cache, tmp_path_factory):
    """`killed_run(out)`: copies into `out` a run of KILLED "killed" after step 5 (checkpoints 2 and 4, rows
    1..5), trained once per module on first use; returns its rows."""
    trained = []

    def copy(out: Path) -> list[dict]:
        if not trained:
            folder = tmp_path_factory.mktemp("killed") / "run"
            with jax.numpy_dtype_promotion("standard"):
                trained.append((folder, train.run(micro(data_cache, folder, **KILLED), stop_after=5)))
        folder, rows = trained[0]
        shutil.copytree(folder, out)
        return rows

    return copy


def test_resume_passes_over_a_cut_short_metrics_row_and_a_damaged_checkpoint(data_cache, tmp_path, capsys,
                                                                             killed_run):
    """A last metrics row cut short by a kill was a JSONDecodeError after config.json was rewritten; a damaged
    newest checkpoint was an orbax traceback in --resume and sample.py although an older one restored."""
    out = tmp_path / "run"
    config = KILLED
    killed_run(out)  # checkpoints 2 and 4; rows 1..5
    with (out / "metrics.jsonl").open("a") as file:
        file.write('{"step": 6, "train_lo')
    capsys.readouterr()
    resumed = train.run(micro(data_cache, out, resume=True, **config))
    printed = capsys.readouterr().out
    assert "resumed from step 4" in printed and "dropped the last line" in printed, printed
    assert [row["step"] for row in resumed] == list(range(1, 7))
    assert resumed == train.Metrics.read(out / "metrics.jsonl")

    # Cut the tree metadata of the newest checkpoint (step 6) in half, as a full disk or a bad copy would. (Its
    # array files would do as well, but orbax then leaves reads in flight that end after its event loop closed,
    # which pytest reports as unraisable exceptions in whatever test runs at the time.)
    for path in (out / "checkpoints" / "6").rglob("_METADATA"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    sample = _load_script("sample")
    sample.main(["--out", str(out), "--tokens", "2", "--temperature", "0"])
    captured = capsys.readouterr()
    assert "nnx model, step 4," in captured.out and "cannot restore the checkpoint of step 6" in captured.err

    resumed = train.run(micro(data_cache, out, resume=True, **{**config, "steps": 8}))
    printed = capsys.readouterr().out
    assert "cannot restore the checkpoint of step 6" in printed, printed
    assert "resumed from step 4, the newest checkpoint that restores" in printed, printed
    assert [row["step"] for row in resumed] == list(range(1, 9))
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [6, 8]  # 6 saved anew

    # Nothing restores: refused before anything is written.
    for path in (out / "checkpoints").rglob("_METADATA"):
        path.write_bytes(path.read_bytes()[:10])
    before = _snapshot(out)
    train_lm = _load_script("train_lm")
    line = _usage_error(capsys, lambda: train_lm.main(
        [*micro_flags(data_cache, out, **{**config, "steps": 10}), "--resume"]))
    assert "argument --resume: no checkpoint in" in line and "restores" in line, line
    assert _snapshot(out) == before


def test_resume_restores_lost_metrics_rows_and_passes_over_a_damaged_losses_item(data_cache, tmp_path, capsys,
                                                                                killed_run):
    """metrics.jsonl that lost rows resumed with a silent gap (steps 1, 2, then 5, 6); a damaged item of the
    losses in the newest checkpoint (named "metrics", as orbax names its own metrics item, which its
    CheckpointManager read on opening the folder) was a JSONDecodeError there, before any fallback."""
    out = tmp_path / "run"
    config = KILLED
    first = killed_run(out)  # checkpoints 2 and 4; rows 1..5
    kept = [row for row in first if row["step"] not in (3, 4)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept))
    capsys.readouterr()
    resumed = train.run(micro(data_cache, out, resume=True, **config))
    printed = capsys.readouterr().out
    assert "resumed from step 4" in printed, printed
    assert "metrics.jsonl lacked the rows of steps 3, 4: restored them from the checkpoint of step 4" in printed
    assert [row["step"] for row in resumed] == list(range(1, 7))
    assert resumed[:4] == first[:4] and resumed == train.Metrics.read(out / "metrics.jsonl")

    # The newest checkpoint's losses as a checkpoint of the last version kept them ("metrics"), cut short.
    step = out / "checkpoints" / "6"
    (step / "progress").rename(step / "metrics")
    (step / "metrics" / "metadata").rename(step / "metrics" / "metrics")
    (step / "metrics" / "metrics").write_text('{"pending_lo')
    resumed = train.run(micro(data_cache, out, resume=True, **{**config, "steps": 8}))
    printed = capsys.readouterr().out
    assert "cannot restore the checkpoint of step 6: JSONDecodeError" in printed, printed
    assert "resumed from step 4, the newest checkpoint that restores" in printed, printed
    assert [row["step"] for row in resumed] == list(range(1, 9))


def test_resume_with_fewer_steps_than_the_run_has_leaves_it_as_it_was(data_cache, tmp_path, capsys, killed_run):
    """`--resume --steps 3` on a run at step 4 exited 0 without a word, after rewriting config.json to 3 steps,
    cutting metrics.jsonl back to step 4 and plotting it; now it says so and changes nothing."""
    out = tmp_path / "run"
    killed_run(out)  # checkpoints 2 and 4; rows 1..5
    before = _snapshot(out)
    train_lm = _load_script("train_lm")
    capsys.readouterr()
    train_lm.main([*micro_flags(data_cache, out, **{**KILLED, "steps": 3}), "--resume"])  # returns: exit status 0
    printed = capsys.readouterr().out
    assert f"the run in {out} is already at step 4, past --steps 3: nothing to do, left as it was" in printed, printed
    assert _snapshot(out) == before


def test_a_diverging_loss_stops_the_run_and_keeps_the_last_good_checkpoint(data_cache, tmp_path):
    """A learning rate of 1e12 turns the loss to NaN within a few steps (step 1 has rate 0: warmup). The run
    wrote NaN into metrics.jsonl (invalid JSON) and checkpointed the weights that produced it."""
    train_lm = _load_script("train_lm")
    flags = micro_flags(data_cache, tmp_path, learning_rate=1e12, steps=8, log_every=1, checkpoint_every=1,
                        num_samples=0)
    with pytest.raises(SystemExit) as exit:
        train_lm.main(flags)
    message = str(exit.value.code)
    first = int(re.search(r"step (\d+): the train loss is nan", message)[1])
    assert 3 <= first <= 8, message

    def strict(constant):
        raise ValueError(f"{constant} in metrics.jsonl")

    rows = [json.loads(line, parse_constant=strict) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, first))
    # The weights after step first - 1 gave the NaN loss of step `first`: only earlier checkpoints stay.
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    assert kept and max(kept) == first - 2, (kept, message)
    assert f"checkpoint of step {first - 2}" in message


def test_pallas_and_xla_give_the_same_losses(data_cache, tmp_path):
    losses = {}
    for impl in ("pallas", "xla"):
        config = micro(data_cache, tmp_path / impl, steps=2, log_every=1, eval_every=2, eval_batches=1, num_samples=0)
        losses[impl] = [row["train_loss"] for row in train.run(config)]
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=2e-5)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bfloat16_models_hand_attention_bfloat16(framework, monkeypatch):
    """dtype="bfloat16" keeps float32 params and computes in bfloat16: q, k and v reach attention as bfloat16 in
    training and in the prefill (NNX's Embed once cast its output back to its float32 param_dtype, so the NNX
    model ran float32 attention kernels)."""
    import lm.common
    import lm.model_nnx

    seen = []
    shard_heads = lm.common.shard_heads

    def spy(attend):
        def run(query, key, value):
            seen.append((query.dtype, key.dtype, value.dtype))
            return shard_heads(attend)(query, key, value)
        return run

    # Every model's attention passes through shard_heads (NNX's RotaryAttention imports it by name).
    monkeypatch.setattr(lm.common, "shard_heads", spy)
    monkeypatch.setattr(lm.model_nnx, "shard_heads", spy)
    config = make_config("tiny", {**MICRO, "framework": framework, "dtype": "bfloat16"})
    model = train.build_model(config, jax.random.key(0))
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.float32)}
    params = train.compute_params(model.params, config)
    tokens = jnp.zeros((2, 8), jnp.int32)
    seen.clear()  # Linen's init ran the float32 model
    assert jax.eval_shape(model.apply, params, tokens).dtype == jnp.float32  # the logits
    jax.eval_shape(model.prefill, params, tokens)
    assert len(seen) == 2 * config.num_layers
    assert set(seen) == {(jnp.dtype(jnp.bfloat16),) * 3}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_decode_with_the_cache_matches_the_full_forward(framework):
    config = make_config("tiny", {**MICRO, "framework": framework, "num_kv_heads": 1, "tie_embeddings": False})
    model = train.build_model(config, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 256, jnp.int32)
    full = jax.jit(model.apply)(model.params, tokens)
    step, cache = model.decoder(model.params, 2, 12)
    step = jax.jit(step)
    for position in range(tokens.shape[1]):
        logits, cache = step(model.params, cache, tokens[:, position], jnp.int32(position))
        np.testing.assert_allclose(logits, full[:, position], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sharded_run_matches_the_unsharded_one(framework, data_cache, tmp_path):
    """`--mesh data=2,model=2` over 4 of conftest's 8 CPU devices (this ran in a subprocess, to get 4)."""
    base = {**MICRO, "data_cache": data_cache, "num_layers": 1, "steps": 2, "log_every": 1, "eval_every": 2,
            "eval_batches": 1, "checkpoint_every": 2, "num_samples": 0}
    # The run samples at the end, on the params as they are sharded (the decode is not split by shard_heads).
    config = make_config("tiny", dict(base, framework=framework, mesh="data=2,model=2", out=str(tmp_path),
                                      num_samples=1, sample_tokens=6, temperature=0))
    sharded = [row["train_loss"] for row in train.run(config)]
    # The same steps on one device, without the run's evaluation, checkpoints and plot.
    config = dataclasses.replace(config, mesh=None)
    model, optimizer = train.build_model(config, jax.random.key(config.seed)), train.make_optimizer(config)
    train_step, _ = train.make_steps(model, optimizer, config, train.Shardings())
    params, opt_state, unsharded = model.params, optimizer.init(model.params), []
    tokens, _ = data.load_tokens(config)
    for step in range(1, config.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(data.train_batch(tokens, config, step)))
        unsharded.append(float(loss))
    np.testing.assert_allclose(sharded, unsharded, rtol=1e-5)
    samples = generate(model, params, b"def ", 6, num_samples=1, temperature=0.0, key=jax.random.key(config.seed))
    assert (tmp_path / "samples.txt").read_text() == f"--- sample 0 ---\n{samples[0].decode(errors='replace')}\n"

    # The sharded gradient step, with the Pallas kernel: attention runs per shard, nothing is gathered.
    config = make_config("tiny", dict(base, framework=framework, attention="pallas", mesh="data=2,model=2"))
    mesh = train.make_mesh(config)
    model = train.build_model(config, jax.random.key(0))
    with jax.set_mesh(mesh):
        shardings = train.Shardings.on(mesh, model, train.make_optimizer(config))
        params = jax.device_put(model.params, shardings.params)
        step = jax.jit(jax.value_and_grad(functools.partial(train.loss_fn, model, config)))
        hlo = step.lower(params, shardings.place(np.zeros((4, 33), np.int32))).compile().as_text()
    gathers = re.findall(r" (all-gather|all-to-all)\(", hlo)
    assert not gathers, gathers
    assert sum(leaf.sharding.spec != P() for leaf in jax.tree.leaves(params)) == 6 * config.num_layers


def test_config_precedence_preset_file_cli(tmp_path):
    (tmp_path / "a.yaml").write_text("steps: 7\nseq_len: 2048\nnum_kv_heads: 2\n")
    (tmp_path / "b.json").write_text(json.dumps({"steps": 9, "grad_clip": None}))
    config = parse_args(["--preset", "bench-hd128", "--config", str(tmp_path / "a.yaml"), "--seq-len", "8192"])
    assert (config.head_dim, config.batch_size, config.num_heads) == (128, 4, 8)
    assert (config.steps, config.seq_len, config.kv_heads) == (7, 8192, 2)
    config = parse_args(["--config", str(tmp_path / "b.json"), "--no-tie-embeddings", "--mesh", "data=2"])
    assert (config.steps, config.grad_clip, config.tie_embeddings, config.mesh) == (9, None, False, "data=2")
    assert parse_args(["--preset", "bench-hd64"]).head_dim == 64
    with pytest.raises(ValueError, match="attention='flash'"):
        make_config("tiny", {"attention": "flash"})
    with pytest.raises(ValueError, match="unknown config field"):
        make_config("tiny", {"sequence_length": 3})
    with pytest.raises(ValueError, match="mesh"):
        make_config("tiny", {"mesh": "data=two"})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "abc"], "argument --steps: steps='abc' must be of type int"),
        (["--learning-rate", "fast"], "argument --learning-rate: learning_rate='fast' must be of type float"),
        # NaN passed every bound (nan < 0 is False) and reached metrics.jsonl as invalid JSON.
        (["--learning-rate", "nan"], "argument --learning-rate: learning_rate=nan must be a finite number"),
        (["--learning-rate", "inf"], "argument --learning-rate: learning_rate=inf must be a finite number"),
        (["--temperature", "nan"], "argument --temperature: temperature=nan must be a finite number"),
        (["--grad-clip=-inf"], "argument --grad-clip: grad_clip=-inf must be a finite number"),
        (["--sample-prompt", ""], "argument --sample-prompt: sample_prompt='' must hold at least one character"),
        (["--framework", "torch"], "argument --framework: invalid choice: 'torch'"),
        (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
        (["--mesh", "foo"], "argument --mesh: mesh='foo'"),
        (["--num-kv-heads", "3"], "argument --num-kv-heads: num_heads=4 must be a multiple of num_kv_heads=3"),
        # Was a ZeroDivisionError at step 1, and a NaN validation loss.
        (["--checkpoint-every", "0"], "argument --checkpoint-every: checkpoint_every=0 must be at least 1"),
        (["--eval-batches", "0"], "argument --eval-batches: eval_batches=0 must be at least 1"),
        (["--num-heads", "0"], "argument --num-heads: num_heads=0 must be at least 1"),  # was a ZeroDivisionError
        (["--num-kv-heads", "0"], "argument --num-kv-heads: num_kv_heads=0 must be at least 1"),
        (["--temperature", "-1"], "argument --temperature: temperature=-1.0 must be at least 0"),
        (["--warmup-steps", "-5"], "argument --warmup-steps: warmup_steps=-5 must be at least 0"),
        # Bytes past the table read garbage.
        (["--vocab-size", "100"], "argument --vocab-size: vocab_size=100 must be at least 256"),
        (["--resume", "--overwrite"], "argument --overwrite: "),
        (["--config", "missing.yaml"], "argument --config: can't read 'missing.yaml'"),
        # numpy's generator raised a ValueError for -1 and jax an OverflowError past 2**32, after the data loaded.
        (["--seed", "-1"], "argument --seed: seed=-1 must be in [0, 2**32)"),
        (["--seed", str(2**32)], "argument --seed: seed=4294967296 must be in [0, 2**32)"),
        # Adam divides by 1 - beta**t = 0: NaN from the first step.
        (["--beta1", "1.0"], "argument --beta1: beta1=1.0 must be in [0, 1)"),
        (["--beta2", "1"], "argument --beta2: beta2=1.0 must be in [0, 1)"),
        (["--grad-clip", "0"], "argument --grad-clip: grad_clip=0.0 must be positive"),  # froze the weights
        (["--mesh", "data=2,data=4"], "argument --mesh: mesh='data=2,data=4' names the data axis twice"),
        (["--sample-prompt", "caf\udce9"], "argument --sample-prompt: sample_prompt='caf\\udce9' cannot be encoded"),
        (["--num-processes", "2"], "argument --coordinator-address: give all of --coordinator-address"),
        (["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"],
         "argument --process-id: process_id=2 must be in [0, num_processes=2)"),
        (["--coordinator-address", "h", "--num-processes", "2", "--process-id", "0"],
         "argument --coordinator-address: coordinator_address='h' must be HOST:PORT"),
        # A ZeroDivisionError after the first metrics row (the folder then held a run), and a negative MFU.
        (["--peak-tflops", "0"], "argument --peak-tflops: peak_tflops=0.0 must be positive"),
        (["--peak-tflops", "-1"], "argument --peak-tflops: peak_tflops=-1.0 must be positive"),
        # Infinite RoPE frequencies: NaN at step 1, reported as a learning rate too high.
        (["--rope-theta", "0"], "argument --rope-theta: rope_theta=0.0 must be greater than 1"),
        (["--rope-theta", "1"], "argument --rope-theta: rope_theta=1.0 must be greater than 1"),
    ],
)
def test_invalid_flags_are_usage_errors_that_name_the_flag(flags, message, capsys):
    """argparse's way: exit 2, a short usage line and one error line; no traceback (all were tracebacks)."""
    with pytest.raises(SystemExit) as exit:
        parse_args(flags)
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage:"), lines
    assert ": error: " + message in lines[1], lines


def test_config_file_errors_name_the_file(tmp_path, capsys):
    files = {"bad.yaml": "steps: [1,\n", "bad.json": "{", "list.json": "[1]", "field.json": '{"sequence_length": 3}',
             "type.yaml": "steps: many\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as exit:
            parse_args(["--config", str(tmp_path / name)])
        lines = capsys.readouterr().err.splitlines()
        assert exit.value.code == 2 and len(lines) == 2 and "error: argument --config: " in lines[1], (name, lines)
        assert name in lines[1] or "sequence_length" in lines[1] or "steps='many'" in lines[1], lines


def test_valid_edge_values_are_accepted():
    config = parse_args(["--checkpoint-every", "none", "--grad-clip", "none", "--temperature", "0", "--warmup-steps",
                         "0", "--num-samples", "0", "--num-kv-heads", "1"])
    assert (config.checkpoint_every, config.grad_clip, config.temperature, config.kv_heads) == (None, None, 0.0, 1)


def test_data_split_is_deterministic_and_cached(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"file{i:02d}.py").write_text(f"x = {i}\n" * 50)
    config = make_config("tiny", dict(data=str(corpus), data_cache=str(tmp_path / "cache"), seq_len=16, batch_size=3))
    train_tokens, val_tokens = data.load_tokens(config)
    assert len(train_tokens) + len(val_tokens) == sum(f.stat().st_size for f in corpus.iterdir())
    assert 0 < len(val_tokens) < len(train_tokens)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    again = data.load_tokens(config)  # from the cache
    np.testing.assert_array_equal(again[1], val_tokens)
    batch = data.train_batch(train_tokens, config, step=5)
    assert batch.shape == (3, 17) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, data.train_batch(train_tokens, config, step=5))
    assert not np.array_equal(batch, data.train_batch(train_tokens, config, step=6))
    # One file: the last val_fraction of its bytes is the validation split.
    single = make_config("tiny", dict(data=str(corpus / "file00.py"), data_cache=str(tmp_path / "cache")))
    train_tokens, val_tokens = data.load_tokens(single)
    assert len(val_tokens) == 300 - int(300 * 0.95)


def test_mfu_counts_six_flops_per_parameter_and_half_of_attention():
    config = make_config("bench-hd64", {"peak_tflops": 100.0})
    assert train.flops_per_token(config, 1000) == 6 * 1000 + 12 * 8 * 8 * 64 * 4096 / 2
    assert train.peak_flops(config, num_devices=2) == 2e14


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_context_parallel_steps_match_the_unsharded_ones(framework):
    """`--mesh data=2,seq=2` (conftest gives this process 8 CPU devices): the sequence split over two devices,
    attention as a ring, trains to the unsharded losses; the compiled step moves the K/V blocks
    `[B / data, T / seq, K, D]` by collective-permute and all-gathers nothing."""
    batches = np.random.default_rng(0).integers(0, 256, (3, 4, 33), dtype=np.int32)
    losses = {}
    for mesh_flag in (None, "data=2,seq=2"):
        # Unsharded, test_sharded_run_matches_the_unsharded_one's step, compiled once for both (steps=2 as there:
        # the three losses see the warmup's rates alone, which every schedule shares).
        config = make_config("tiny", {**MICRO, "framework": framework, "num_layers": 1, "steps": 2,
                                      "mesh": mesh_flag})
        mesh, model = train.make_mesh(config), train.build_model(config, jax.random.key(0))
        optimizer = train.make_optimizer(config)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            shardings = train.Shardings.on(mesh, model, optimizer)
            params = model.params if mesh is None else jax.device_put(model.params, shardings.params)
            opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
            train_step, _ = train.make_steps(model, optimizer, config, shardings)
            compiled = train_step.lower(params, opt_state, shardings.place(batches[0])).compile()
            losses[mesh_flag] = []
            for batch in batches:
                params, opt_state, loss = compiled(params, opt_state, shardings.place(batch))
                losses[mesh_flag].append(float(loss))
    hlo = compiled.as_text()
    np.testing.assert_allclose(losses["data=2,seq=2"], losses[None], rtol=1e-5)
    assert " all-gather(" not in hlo
    kv_block = ",16,%d,%d]" % (config.kv_heads, config.head_dim)
    permutes = [line for line in hlo.splitlines() if " collective-permute(" in line and kv_block in line]
    assert len(permutes) >= 4, permutes
