"""The LM training example (examples/train_lm.py, examples/lm/, examples/sample.py) on a micro config: a run's
losses and samples, resuming after an interruption, a TERM signal, damaged files or a diverging loss."""

from __future__ import annotations

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
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("flax")
pytest.importorskip("equinox")

from lm_micro import (  # noqa: E402, F401 - puts examples/ on sys.path; standard_promotion: autouse
    EXAMPLES, FRAMEWORKS, _load_script, _snapshot, _usage_error, micro, micro_flags, standard_promotion,
)
from lm import data, train  # noqa: E402


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
