"""examples/train_lm.py as two processes of one jax.distributed run (scripts/launch_local.sh), two CPU devices
each, against the one-process run over the same four-device mesh (in this process: conftest gives it 8).

What the three launches cover (each starts two processes that import jax and compile, so they are few):
- `seq=2,data=2` (Linen: the ring attention's K/V blocks pass between the processes) and `data=2,model=2`
  (Equinox: the batch split between the processes, the heads within each), one launch that runs both:
  every train and validation loss equals the one-process run's (rtol 1e-5); each process read only the
  batch rows of its own devices; only process 0 prints and writes the run's files.
- `data=4` (NNX), one launch whose process 1 SIGKILLs itself right after it starts the checkpoint of step 4:
  the launcher stops process 0 (no hang on the dead peer) and exits with the signal's status, naming the
  process; the step being saved is not taken as complete. A second launch `--resume`s: it continues from
  the newest committed checkpoint and ends with the one-process run's losses of every step; both processes
  wrote checkpoint shards; process 0 wrote the samples.
- A failing process that is not killed (a Python error) ends the launch with its status and its error
  while its peer hangs (a stand-in script, no jax: cheap).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("flax")
pytest.importorskip("equinox")

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "scripts" / "launch_local.sh"
sys.path.insert(0, str(ROOT / "examples"))

from lm import train  # noqa: E402
from lm.config import make_config  # noqa: E402

TINY = dict(
    num_layers=1, d_model=32, num_heads=4, seq_len=32, batch_size=4, attention="xla", learning_rate=1e-2,
    warmup_steps=2, log_every=1, eval_batches=1, num_samples=0, checkpoint_every="none",
)
# The mesh axis named first is the outermost, which spans the processes: seq=2,data=2 runs the ring between them.
LAYOUTS = {"seq=2,data=2": "linen", "data=2,model=2": "equinox"}
# Bounds for a machine much busier than this one; a slow machine is not a failure.
WAIT_S = 900

# examples/train_lm.py with test hooks from the environment: MP_RUNS, a JSON list of flag lists, runs one
# training per list in the same jax.distributed session (flags added to the command line's), and writes to
# MP_ROWS.<process id> the batch rows (start, stop) this process read for each run's devices; MP_KILL,
# "PROCESS:STEP", makes that process SIGKILL itself right after it starts saving that step's checkpoint.
_WORKER = """
    import json, os, signal, sys
    sys.path.insert(0, {examples!r})
    import jax
    from lm import checkpoint, train
    from lm.config import parse_args, parse_command

    rows = set()
    make_array = jax.make_array_from_callback

    def recording(shape, sharding, callback, *args, **kwargs):
        def read(index):
            rows.add(index[0].indices(shape[0])[:2])
            return callback(index)
        return make_array(shape, sharding, read, *args, **kwargs)

    jax.make_array_from_callback = recording

    argv = sys.argv[1:]
    _, launch = parse_command(argv)
    train.start_distributed(launch)
    if os.environ.get("MP_KILL"):
        process, step = map(int, os.environ["MP_KILL"].split(":"))
        save = checkpoint.Checkpoints.save

        def save_then_die(self, saved_step, *args, **kwargs):
            save(self, saved_step, *args, **kwargs)
            if saved_step == step and launch.process_id == process:
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.Checkpoints.save = save_then_die
    read = []
    for flags in json.loads(os.environ.get("MP_RUNS", "[[]]")):
        rows.clear()
        train.run(parse_args(argv + flags))
        read.append(sorted(rows))
    if os.environ.get("MP_ROWS"):
        with open(os.environ["MP_ROWS"] + f".{{launch.process_id}}", "w") as file:
            json.dump(read, file)
"""


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's Adam is not written for conftest's strict promotion; the example runs under the standard one."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lm_data"))


def flags(values: dict) -> list[str]:
    return [word for name, value in values.items() for word in ("--" + name.replace("_", "-"), str(value))]


def launch(tmp_path: Path, name: str, argv: list[str], **environment: str) -> subprocess.CompletedProcess:
    """scripts/launch_local.sh 2 -- argv, running the worker; process 1's log goes to tmp_path/name."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(_WORKER).format(examples=str(ROOT / "examples")))
    env = {key: value for key, value in os.environ.items() if not key.startswith("MP_")}
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHON=sys.executable, LAUNCH_SCRIPT=str(worker),
        LAUNCH_LOG_DIR=str(tmp_path / name), **environment,
    )
    # The launcher bounds its own children's lives; the timeout only keeps a broken launcher from hanging CI.
    return subprocess.run(
        ["bash", str(LAUNCHER), "2", "--", *argv], env=env, capture_output=True, text=True, timeout=WAIT_S
    )


def one_process_run(data_cache: str, out: Path, **overrides) -> list[dict]:
    """The run in this process, over the first four of its devices."""
    return train.run(make_config("tiny", {**TINY, "data_cache": data_cache, "out": str(out), **overrides}))


def assert_same_losses(got: list[dict], want: list[dict]) -> None:
    assert [row["step"] for row in got] == [row["step"] for row in want]
    for name in ("train_loss", "val_loss"):
        values = [(row[name], reference[name]) for row, reference in zip(got, want) if reference[name] is not None]
        assert values and all(value is not None for value, _ in values)
        np.testing.assert_allclose(*zip(*values), rtol=1e-5, err_msg=name)


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_with_sequence_and_tensor_parallelism(data_cache, tmp_path):
    base = {**TINY, "data_cache": data_cache, "steps": 3, "eval_every": 3}
    runs = [["--mesh", mesh, "--framework", framework, "--out", str(tmp_path / framework)]
            for mesh, framework in LAYOUTS.items()]
    result = launch(tmp_path, "logs", flags(base), MP_RUNS=json.dumps(runs), MP_ROWS=str(tmp_path / "rows"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    # Each process read the rows of its own devices only: with data between the processes, half the batch.
    read = [json.loads((tmp_path / f"rows.{process}").read_text()) for process in (0, 1)]
    assert read[0][0] == read[1][0] == [[0, 2], [2, 4]]  # seq=2,data=2: data within each process
    assert (read[0][1], read[1][1]) == ([[0, 2]], [[2, 4]])  # data=2,model=2: data between the processes
    log = (tmp_path / "logs" / "process_1.log").read_text()
    assert "model," not in log and "step 3" not in log  # process 1 printed nothing of the run's
    for mesh, framework in LAYOUTS.items():
        spanning = mesh.split("=")[0]
        assert f"cpu x 4 in 2 processes (mesh axes across processes: {spanning})" in result.stdout, result.stdout
        want = one_process_run(data_cache, tmp_path / f"one_{framework}", steps=3, eval_every=3, mesh=mesh,
                               framework=framework)
        assert_same_losses(read_rows(tmp_path / framework), want)
        print(mesh, framework, "two processes:", [row["train_loss"] for row in read_rows(tmp_path / framework)],
              "one:", [row["train_loss"] for row in want])


def test_a_killed_process_stops_the_run_and_resume_reproduces_the_losses(data_cache, tmp_path):
    values = {**TINY, "data_cache": data_cache, "steps": 6, "eval_every": 3, "checkpoint_every": 2, "mesh": "data=4",
              "framework": "nnx", "out": str(tmp_path / "run")}
    killed = launch(tmp_path, "killed", flags(values), MP_KILL="1:4")
    assert killed.returncode == 128 + 9, killed.stdout[-3000:] + killed.stderr[-5000:]
    assert "launch_local: process 1 was killed by signal 9 (KILL)" in killed.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    committed = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert committed in ([2], [2, 4]), committed  # step 4 only if process 1 finished its part before dying
    assert [row["step"] for row in read_rows(tmp_path / "run")] == [1, 2, 3, 4]

    resumed = launch(tmp_path, "resumed", [*flags({**values, "num_samples": 1, "sample_tokens": 4}), "--resume"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert f"resumed from step {committed[-1]}" in resumed.stdout
    same = ("steps", "eval_every", "checkpoint_every", "mesh", "framework")
    want = one_process_run(data_cache, tmp_path / "one", **{name: values[name] for name in same})
    assert_same_losses(read_rows(tmp_path / "run"), want)
    print(f"data=4 nnx, killed after step 4, resumed from step {committed[-1]}:",
          [row["train_loss"] for row in read_rows(tmp_path / "run")], "one:", [row["train_loss"] for row in want])
    # Every process wrote shards of its own; process 0 alone sampled.
    shards = {p.name for p in (checkpoints / "6" / "params").glob("ocdbt.process_*") if any(p.rglob("d/*"))}
    assert shards == {"ocdbt.process_0", "ocdbt.process_1"}, shards
    assert (tmp_path / "run" / "samples.txt").read_text().startswith("--- sample 0 ---\ndef ")
    assert "--- sample" not in (tmp_path / "resumed" / "process_1.log").read_text()


def test_a_failing_process_ends_the_launch_with_its_error(tmp_path):
    """Process 1 fails at once while process 0 waits forever for it, as a survivor waits in a collective."""
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        if sys.argv[sys.argv.index("--process-id") + 1] == "1":
            sys.exit("process 1: the data folder is gone")
        time.sleep(3600)
    """))
    env = {**os.environ, "PYTHON": sys.executable, "LAUNCH_SCRIPT": str(script), "LAUNCH_LOG_DIR": str(tmp_path)}
    result = subprocess.run(["bash", str(LAUNCHER), "2", "--", "--steps", "3"], env=env, capture_output=True,
                            text=True, timeout=WAIT_S)
    assert result.returncode == 1, result.stderr
    assert "launch_local: process 1 exited with status 1" in result.stderr
    assert "process 1: the data folder is gone" in result.stderr
    port = re.search(r"coordinator 127\.0\.0\.1:(\d+)", result.stderr)[1]
    survivors = subprocess.run(["pgrep", "-f", f"{script}.*127.0.0.1:{port}"], capture_output=True, text=True)
    assert survivors.stdout == "", survivors.stdout  # process 0 was killed, not left sleeping
