"""examples/train_lm.py as two processes of one jax.distributed run (scripts/launch_local.sh), two CPU devices
each, against the one-process run over the same four-device mesh (in this process: conftest gives it 8).

What the three launches cover (each starts two processes that import jax and compile, so they are few):
- Start-up checks that fail on one process, or that need two to find, then `seq=2,data=2` (Linen: the ring
  attention's K/V blocks pass between the processes) and `data=2,model=2` (Equinox: the batch split between
  the processes, the heads within each), one launch that runs them all: every check ends both processes'
  run with the same usage error; every train and validation loss of the two trainings equals the
  one-process run's (rtol 1e-5); each process read only the batch rows of its own devices; only process 0
  prints and writes the run's files.
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
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from lm_helpers import SMALL_CORPUS

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
    warmup_steps=2, log_every=1, eval_batches=1, num_samples=0, checkpoint_every="none", data=SMALL_CORPUS,
)
# The mesh axis named first is the outermost, which spans the processes: seq=2,data=2 runs the ring between them.
LAYOUTS = {"seq=2,data=2": "linen", "data=2,model=2": "equinox"}
# Bounds for a machine much busier than this one; a slow machine is not a failure.
WAIT_S = 900
# Steps of a run stopped by a signal at step 3: every later step takes at least 0.25 s, so jax's preemption
# service has over a minute to reach every process on a busy machine.
SIGNALLED_STEPS = 400
# Two CPU devices per process; LLVM optimizations off as in conftest.py (tiny shapes: compiling dominates).
TWO_DEVICE_XLA_FLAGS = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"

# examples/train_lm.py with test hooks from the environment: MP_RUNS, a JSON list of runs, runs one training
# per entry in the same jax.distributed session, with flags added to the command line's and a working folder
# of each process's own ({"flags": [...], "0": [...], "1": [...], "cwd": {"1": ...}}: the flags of all, then
# those of process 0 or 1); MP_ROWS: writes to MP_ROWS.<process id> the batch rows (start, stop) this process
# read for each run's devices; MP_OUT: writes to MP_OUT.<process id> each run's ConfigError (flag, message)
# or None (without MP_OUT a ConfigError ends the process); MP_KILL,
# "PROCESS:STEP", makes that process SIGKILL itself right after it starts saving that step's checkpoint;
# MP_SIGNAL, "PROCESS:STEP:SIGNAL" (or "PROCESS:STEP:SIGNAL:self"), makes that process send SIGNAL to the
# launcher (or to itself) as it starts that step, and every process take at least 0.25 s per later step (so
# that the run cannot end before the signal reaches it);
# MP_PIDS: each process writes its pid to MP_PIDS.<process id>; MP_FETCHED: each process writes to
# MP_FETCHED.<process id> the most bytes one `jax.device_get` fetched.
_WORKER = """
    import json, os, signal, sys, time
    sys.path.insert(0, {examples!r})
    import jax
    import numpy as np
    from lm import checkpoint, data, train
    from lm.config import ConfigError, parse_args, parse_command

    fetched = [0]
    device_get = jax.device_get

    def counting(tree):
        result = device_get(tree)
        fetched[0] = max(fetched[0], sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(result)))
        return result

    jax.device_get = counting

    rows = set()
    make_array = jax.make_array_from_callback

    def recording(shape, sharding, callback, *args, **kwargs):
        def read(index):
            if len(shape) == 2:  # a batch of token windows (the sampler's replicated arrays are not)
                rows.add(index[0].indices(shape[0])[:2])
            return callback(index)
        return make_array(shape, sharding, read, *args, **kwargs)

    jax.make_array_from_callback = recording

    argv = sys.argv[1:]
    _, launch = parse_command(argv)
    train.start_distributed(launch)
    if os.environ.get("MP_PIDS"):
        with open(os.environ["MP_PIDS"] + f".{{launch.process_id}}", "w") as file:
            file.write(str(os.getpid()))
    if os.environ.get("MP_SIGNAL"):
        process, step, name, *to = os.environ["MP_SIGNAL"].split(":")
        if name == "SIGINT":  # as from a terminal: a test run in the background (nohup, &) starts with INT ignored
            signal.signal(signal.SIGINT, signal.default_int_handler)
        train_starts = data.train_starts

        def signalling(tokens, config, at):
            if at == int(step) and launch.process_id == int(process):
                os.kill(os.getpid() if to == ["self"] else os.getppid(), getattr(signal, name))
            elif at > int(step):  # the steps after it outlast the launcher watch's poll (1 s) on a fast machine
                time.sleep(0.25)
            return train_starts(tokens, config, at)

        data.train_starts = signalling
    if os.environ.get("MP_KILL"):
        process, step = map(int, os.environ["MP_KILL"].split(":"))
        save = checkpoint.Checkpoints.save

        def save_then_die(self, saved_step, *args, **kwargs):
            save(self, saved_step, *args, **kwargs)
            if saved_step == step and launch.process_id == process:
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.Checkpoints.save = save_then_die
    me, home, read, results = str(launch.process_id), os.getcwd(), [], []
    for run in json.loads(os.environ.get("MP_RUNS", '[{{"flags": []}}]')):
        rows.clear()
        os.chdir(run.get("cwd", {{}}).get(me, home))
        try:
            train.run(parse_args(argv + run["flags"] + run.get(me, [])))
            results.append(None)
        except ConfigError as error:
            if not os.environ.get("MP_OUT"):
                raise
            results.append([error.flag, str(error)])
        finally:
            os.chdir(home)
        read.append(sorted(rows))
    if os.environ.get("MP_ROWS"):
        with open(os.environ["MP_ROWS"] + f".{{me}}", "w") as file:
            json.dump(read, file)
    if os.environ.get("MP_OUT"):
        with open(os.environ["MP_OUT"] + f".{{me}}", "w") as file:
            json.dump(results, file)
    if os.environ.get("MP_FETCHED"):
        with open(os.environ["MP_FETCHED"] + f".{{me}}", "w") as file:
            file.write(str(fetched[0]))
"""


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's Adam is not written for conftest's strict promotion; the example runs under the standard one."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def flags(values: dict) -> list[str]:
    return [word for name, value in values.items() for word in ("--" + name.replace("_", "-"), str(value))]


def launch(
    tmp_path: Path, name: str, argv: list[str], worker_text: str = _WORKER, **environment: str
) -> subprocess.CompletedProcess:
    """scripts/launch_local.sh 2 -- argv, running the worker; process 1's log goes to tmp_path/name."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(worker_text).format(examples=str(ROOT / "examples")))
    env = {key: value for key, value in os.environ.items() if not key.startswith("MP_")}
    env.update(
        XLA_FLAGS=TWO_DEVICE_XLA_FLAGS, PYTHON=sys.executable, LAUNCH_SCRIPT=str(worker),
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


def test_processes_agree_on_their_start_up_checks_then_match_one_with_sequence_and_tensor_parallelism(
    data_cache, tmp_path
):
    """One launch (two processes' start-ups are the cost here). First, each start-up failure that one process
    found alone (or that needed two to find) ends every process's run with the same usage error, naming the
    process and the flag. Before: a flag on one process only trained with other losses, a different --mesh or
    an --out that one process cannot write hung, an --out the processes do not share hung in the first save, a
    mesh of 2 of 4 devices crashed process 1 while process 0 trained alone. Then the same processes train
    `seq=2,data=2` and `data=2,model=2` to the one-process run's losses."""
    base = {**TINY, "data_cache": data_cache, "steps": 3, "eval_every": 3}
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    other.mkdir()
    checks = [
        {"flags": ["--out", str(tmp_path / "lr"), "--mesh", "data=4"], "1": ["--learning-rate", "0.02"]},
        {"flags": ["--out", str(tmp_path / "mesh"), "--mesh", "data=4"], "0": ["--mesh", "data=2,model=2"]},
        # Relative --out: process 1 resolves it in /proc (cannot be written), or in a folder of its own.
        {"flags": ["--out", "run", "--mesh", "data=4"], "cwd": {"0": str(home), "1": "/proc"}},
        {"flags": ["--out", "run", "--mesh", "data=4"], "cwd": {"0": str(home), "1": str(other)}},
        {"flags": ["--out", str(tmp_path / "small"), "--mesh", "data=2"]},
    ]
    trainings = [{"flags": ["--mesh", mesh, "--framework", framework, "--out", str(tmp_path / framework)]}
                 for mesh, framework in LAYOUTS.items()]
    result = launch(tmp_path, "logs", flags(base), MP_RUNS=json.dumps(checks + trainings),
                    MP_ROWS=str(tmp_path / "rows"), MP_OUT=str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    got = [json.loads((tmp_path / f"out.{process}").read_text()) for process in (0, 1)]
    print(json.dumps(got, indent=1))
    lr, mesh, unwritable, unshared, small, *trained = zip(*got)
    assert lr[0] == lr[1] and lr[0][0] == "--learning-rate", lr
    assert "0.01 on process 0, 0.02 on process 1" in lr[0][1]
    assert mesh[0] == mesh[1] and mesh[0][0] == "--mesh" and "'data=2,model=2' on process 0" in mesh[0][1], mesh
    assert unwritable[0][0] == unwritable[1][0] == "--out"
    assert unwritable[0][1].startswith("on process 1: cannot write to run"), unwritable  # process 0 names it
    assert unshared[0] == unshared[1] and "process 1 does not see" in unshared[0][1], unshared
    assert small[0] == small[1] and small[0][0] == "--mesh" and "needs all 4" in small[0][1], small
    assert trained == [(None, None)] * len(trainings)
    assert sorted(p.name for p in home.iterdir()) == [] and sorted(p.name for p in other.iterdir()) == []
    assert not (tmp_path / "lr").exists() and not (tmp_path / "small").exists()

    # Each process read the rows of its own devices only: with data between the processes, half the batch.
    read = [json.loads((tmp_path / f"rows.{process}").read_text())[len(checks):] for process in (0, 1)]
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

    resumed = launch(tmp_path, "resumed", [*flags({**values, "num_samples": 1, "sample_tokens": 4}), "--resume"],
                     MP_FETCHED=str(tmp_path / "fetched"))
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
    # Sampling ran on the sharded params: no process fetched the model to its host (each did, before).
    model_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(train.build_model(
        make_config("tiny", {**TINY, "framework": "nnx"}), jax.random.key(0)).params))
    fetched = [int((tmp_path / f"fetched.{process}").read_text()) for process in (0, 1)]
    assert max(fetched) < model_bytes / 10, (fetched, model_bytes)


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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def clean_environment(**environment: str) -> dict[str, str]:
    """This process's environment without a cluster's variables or the tests' hooks, plus `environment`."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("MP_", "SLURM_", "OMPI_", "JAX_COORDINATOR", "LAUNCH_"))}
    return {**env, "XLA_FLAGS": TWO_DEVICE_XLA_FLAGS, **environment}


def start_processes(tmp_path: Path, commands: list[tuple[list[str], dict, Path]]) -> list[tuple[int, str, str]]:
    """Runs each (argv, environment, cwd) as a process of its own, all at once; their (status, stdout, stderr).
    Every wait is bounded, and whatever still runs at the end is killed with its process group."""
    processes, files = [], []
    try:
        for number, (argv, env, cwd) in enumerate(commands):
            out, err = tmp_path / f"stdout.{number}", tmp_path / f"stderr.{number}"
            files.append((out, err))
            with out.open("w") as stdout, err.open("w") as stderr:
                processes.append(subprocess.Popen(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                                                  start_new_session=True))
        for process in processes:
            process.wait(timeout=WAIT_S)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=WAIT_S)
    return [(process.returncode, out.read_text(), err.read_text()) for process, (out, err) in zip(processes, files)]


TRAIN_LM = str(ROOT / "examples" / "train_lm.py")


def test_two_tasks_of_one_slurm_step_join_one_run_without_flags(data_cache, tmp_path):
    """Under srun (SLURM_NTASKS=2) without --distributed each task trained alone into the same --out: every
    metrics row twice and colliding checkpoints. jax.distributed.initialize() detects the job by itself."""
    values = {**TINY, "data_cache": data_cache, "steps": 2, "eval_every": 2, "checkpoint_every": 2,
              "mesh": "data=4", "out": str(tmp_path / "run")}
    # The variables jax's SLURM detection reads; JAX_COORDINATOR_PORT replaces the port it derives from the job id.
    slurm = dict(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                 JAX_COORDINATOR_PORT=str(free_port()))
    commands = [([sys.executable, TRAIN_LM, *flags(values)],
                 clean_environment(**slurm, SLURM_PROCID=str(task), SLURM_LOCALID=str(task)), tmp_path)
                for task in (0, 1)]
    results = start_processes(tmp_path, commands)
    for status, stdout, stderr in results:
        assert status == 0, stdout[-2000:] + stderr[-4000:]
    assert "waiting for 2 processes at the SLURM job's coordinator" in results[1][2]
    assert "cpu x 4 in 2 processes" in results[0][1] + results[0][2]
    assert [row["step"] for row in read_rows(tmp_path / "run")] == [1, 2]  # once, not twice
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]


def test_a_check_that_fails_on_one_process_exits_every_process_with_a_usage_error(data_cache, tmp_path):
    """An --out that process 1 alone cannot write: process 1 exited, process 0 waited in a collective and
    ended with `GetKeyValue() timed out`. Now both exit 2 at once and process 0 prints process 1's reason."""
    port = free_port()
    values = {**TINY, "data_cache": data_cache, "steps": 1, "mesh": "data=4", "out": "run"}
    commands = [
        ([sys.executable, TRAIN_LM, *flags(values), "--coordinator-address", f"127.0.0.1:{port}",
          "--num-processes", "2", "--process-id", str(process)], clean_environment(), cwd)
        for process, cwd in ((0, tmp_path), (1, Path("/proc")))
    ]
    results = start_processes(tmp_path, commands)
    assert [status for status, _, _ in results] == [2, 2], results
    assert "error: argument --out: on process 1: cannot write to run" in results[0][2], results[0][2]
    assert "error: argument --out: cannot write to run" in results[1][2], results[1][2]
    assert not (tmp_path / "run").exists()


def test_start_up_says_what_it_waits_for_and_refuses_what_cannot_join(data_cache, tmp_path, capsys):
    """Before: one process of two printed nothing for 300 s and aborted with a C++ stack trace; a coordinator port
    in use left process 1 silent; --coordinator-address :1234 passed the check and hung; --distributed outside a
    cluster was a `coordinator_address should be defined` traceback."""
    from lm.config import parse_command

    for address in (":1234", "host:0", "host:70000", "host"):
        with pytest.raises(SystemExit) as exit:
            parse_command(["--coordinator-address", address, "--num-processes", "2", "--process-id", "0"])
        assert exit.value.code == 2 and f"argument --coordinator-address: coordinator_address={address!r}" in (
            capsys.readouterr().err)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        base = [sys.executable, TRAIN_LM, *flags({**TINY, "data_cache": data_cache, "mesh": "data=4"})]
        alone = [[*base, "--out", str(tmp_path / f"alone{process}"), "--coordinator-address",
                  f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", str(process),
                  "--startup-timeout", "3"] for process in (0, 1)]
        in_use = [*base, "--out", str(tmp_path / "in_use"), "--coordinator-address",
                  f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"]
        nowhere = [*base, "--out", str(tmp_path / "nowhere"), "--distributed"]
        results = start_processes(tmp_path, [(argv, clean_environment(), tmp_path)
                                             for argv in (*alone, in_use, nowhere)])
    finally:
        taken.close()
    for process, (status, _, stderr) in enumerate(results[:2]):
        assert status == 1, stderr
        address = alone[process][alone[process].index("--coordinator-address") + 1]
        assert f"process {process}: waiting for 2 processes at {address} (up to 3 s" in stderr, stderr
        assert f"process {process}: not all 2 processes joined {address} within 3 s (--startup-timeout)" in stderr
    status, _, stderr = results[2]
    assert status == 2 and f"port {port} is in use on this host" in stderr, stderr
    status, _, stderr = results[3]
    assert status == 2 and "error: argument --distributed: " in stderr and "Traceback" not in stderr, stderr
    assert not any(path.name.startswith(("alone", "in_use", "nowhere")) for path in tmp_path.iterdir())


def _stopped_step(stdout: str) -> int:
    found = re.search(r"stopped by a TERM signal after step (\d+), saved in (\S+): run the same command with "
                      r"--resume to continue", stdout)
    assert found, stdout[-3000:]
    return int(found[1])


def test_a_term_to_the_launcher_stops_every_process_at_one_step_with_a_checkpoint(data_cache, tmp_path):
    """A TERM (SLURM preemption, scancel, a time limit) was ignored by the trainers until a KILL, losing up to
    --checkpoint-every steps. Now every process stops after one common step, saves it and exits 0."""
    values = {**TINY, "data_cache": data_cache, "steps": SIGNALLED_STEPS, "eval_every": SIGNALLED_STEPS,
              "mesh": "data=4", "out": str(tmp_path / "run")}
    result = launch(tmp_path, "logs", flags(values), MP_SIGNAL="1:3:SIGTERM")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "launch_local: got TERM" in result.stderr
    stopped = _stopped_step(result.stdout)
    assert 3 <= stopped < SIGNALLED_STEPS
    committed = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert committed == [stopped]  # checkpoint_every none: the TERM's save alone
    assert [row["step"] for row in read_rows(tmp_path / "run")] == list(range(1, stopped + 1))
    assert "Traceback" not in (tmp_path / "logs" / "process_1.log").read_text()


def test_an_int_to_one_process_stops_every_process_at_one_step_with_a_checkpoint(data_cache, tmp_path):
    """An INT that reaches one process (a Ctrl-C, srun passing it on) raised KeyboardInterrupt there: the launcher
    stopped the others and exited 1 with its traceback, losing the steps since the last checkpoint. Now it is
    passed on to jax's preemption service as a TERM: every process stops after one step and saves it."""
    values = {**TINY, "data_cache": data_cache, "steps": SIGNALLED_STEPS, "eval_every": SIGNALLED_STEPS,
              "mesh": "data=4", "out": str(tmp_path / "run")}
    result = launch(tmp_path, "logs", flags(values), MP_SIGNAL="1:3:SIGINT:self")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    stopped = _stopped_step(result.stdout)
    assert 3 <= stopped < SIGNALLED_STEPS
    committed = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert committed == [stopped]
    assert [row["step"] for row in read_rows(tmp_path / "run")] == list(range(1, stopped + 1))
    assert "Traceback" not in (tmp_path / "logs" / "process_1.log").read_text()


def test_processes_whose_launcher_dies_stop_with_a_checkpoint(data_cache, tmp_path):
    """A launcher killed (or its terminal hung up) left the trainers training on with parent 1."""
    values = {**TINY, "data_cache": data_cache, "steps": SIGNALLED_STEPS, "eval_every": SIGNALLED_STEPS,
              "mesh": "data=4", "out": str(tmp_path / "run")}
    pids = []
    try:
        # Returns when process 0, which holds the launcher's stdout, has exited.
        result = launch(tmp_path, "logs", flags(values), MP_SIGNAL="0:3:SIGKILL", MP_PIDS=str(tmp_path / "pid"))
        pids = [int((tmp_path / f"pid.{process}").read_text()) for process in (0, 1)]
        assert result.returncode == -signal.SIGKILL
        stopped = _stopped_step(result.stdout)
        assert 3 <= stopped < SIGNALLED_STEPS
        for _ in range(WAIT_S):
            if not any(_alive(pid) for pid in pids):
                break
            time.sleep(1)
        assert not any(_alive(pid) for pid in pids)
        assert "Traceback" not in (tmp_path / "logs" / "process_1.log").read_text()
        assert (tmp_path / "run" / "checkpoints" / str(stopped)).is_dir()
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


_STAND_IN = """
    import os, signal, sys, time
    for stream in (1, 2):  # not the launcher's pipes: the test's wait for them ends when the launcher does
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream)
    me = sys.argv[sys.argv.index("--process-id") + 1]
    folder = os.environ["STAND_IN_DIR"]
    with open(os.path.join(folder, "gpus." + me), "w") as file:
        file.write(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))

    def stop(signum, frame):
        open(os.path.join(folder, "stopped." + me), "w").close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    with open(os.path.join(folder, "started." + me), "w") as file:
        file.write(str(os.getpid()))
    time.sleep(3600)
"""


def test_the_launcher_passes_a_hang_up_on_and_splits_the_gpus(tmp_path):
    """A HUP (the terminal closed) killed the launcher and left its processes training; on a machine with GPUs
    every process saw all of them."""
    script = tmp_path / "stand_in.py"
    script.write_text(textwrap.dedent(_STAND_IN))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = "#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H200 (UUID: GPU-$i)\"; done\n"
    (bin_dir / "nvidia-smi").write_text(fake)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHON=sys.executable, LAUNCH_SCRIPT=str(script), LAUNCH_LOG_DIR=str(tmp_path / "logs"),
               STAND_IN_DIR=str(tmp_path), PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    # A shell cannot trap a signal ignored when it started, and a HUP ignored here (pytest run under nohup) would
    # be inherited: the launcher would never see the HUP and the test would wait out WAIT_S. It starts with
    # HUP's default disposition, as from a terminal.
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        launcher = subprocess.Popen(["bash", str(LAUNCHER), "2", "--", "--steps", "3"], env=env,
                                    start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        for _ in range(WAIT_S * 10):
            if all((tmp_path / f"started.{process}").exists() for process in (0, 1)):
                break
            time.sleep(0.1)
        launcher.send_signal(signal.SIGHUP)
        _, stderr = launcher.communicate(timeout=WAIT_S)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=WAIT_S)
        for started in tmp_path.glob("started.*"):  # stand-ins the launcher left behind
            pid = int(started.read_text() or 0)
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == 0, stderr
    assert "launch_local: got HUP" in stderr
    assert all((tmp_path / f"stopped.{process}").exists() for process in (0, 1))
    assert [(tmp_path / f"gpus.{process}").read_text() for process in (0, 1)] == ["0,1", "2,3"]
