"""Joining a multi-process run (`jax.distributed`) and agreeing on things across its processes.

`start_distributed` joins the run: with the three explicit values, or with what `jax.distributed.initialize()`
detects (SLURM, Open MPI), which it also does without `--distributed` when the cluster has more than one task
(two tasks of one `srun` must not train twice into one folder). It says what it waits for, and gives up after
`--startup-timeout`. The start-up checks of `train.run` end the same way on every process (`agree`,
`same_config`, `check_shared_out`), so that no process waits in a collective for a peer that has exited. All
of it goes through `jax.experimental.multihost_utils` over the processes' devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from lm.config import Config, ConfigError, Launch

# The variables jax.distributed.initialize() reads to detect a cluster (jax/_src/clusters), by cluster.
_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OPEN_MPI = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
# Set by scripts/launch_local.sh to its own pid: a process whose launcher is gone stops (`watch_launcher`).
LAUNCHER_PID = "LAUNCH_LOCAL_PID"


def detected_cluster(environ: Mapping[str, str] = os.environ) -> tuple[str, int, int] | None:
    """`(cluster, tasks, this task)` of the cluster jax.distributed would detect (SLURM, Open MPI), or None."""
    if all(name in environ for name in _SLURM):
        return "SLURM", int(environ["SLURM_NTASKS"]), int(environ["SLURM_PROCID"])
    if all(name in environ for name in _OPEN_MPI):
        return "Open MPI", int(environ["OMPI_COMM_WORLD_SIZE"]), int(environ["OMPI_COMM_WORLD_RANK"])
    return None


def _expand_counts(text: str) -> list[int]:
    """SLURM's task counts per node, "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _visible_gpus(environ: Mapping[str, str]) -> list[str] | None:
    """The entries of `CUDA_VISIBLE_DEVICES`, or None when it leaves the choice open (unset, empty, NoDevFiles)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return None if not visible or visible == "NoDevFiles" else [entry.strip() for entry in visible.split(",")]


def gpu_share(environ: Mapping[str, str] = os.environ) -> tuple[list[int] | None, str | None]:
    """`(local_device_ids, note)`: the GPUs (CUDA ordinals) this process should drive, for
    `jax.distributed.initialize(local_device_ids=)`, and a line to print when some of the node's GPUs sit idle.

    Without it, jax gives each SLURM or Open MPI task the one GPU of its local rank (jax#16788), so one task
    per node with 8 GPUs would use one. Here:
    - a `CUDA_VISIBLE_DEVICES` of the task's own (SLURM's `--gpus-per-task`, a launcher that splits the GPUs,
      a Kubernetes pod, Open MPI with a per-rank wrapper): all of it;
    - on SLURM, one list of every GPU of the node shared by its L > 1 tasks (`--ntasks-per-node=8
      --gres=gpu:8` gives each task `0,...,7`; a list is shared when it holds `SLURM_GPUS_ON_NODE` GPUs), or
      no list and `SLURM_GPUS_ON_NODE`: split by local rank (`SLURM_LOCALID`), G // L consecutive GPUs each;
      when L does not divide G the last G % L sit idle (said in `note`);
    - `[]` (every GPU the process sees) for one task on its node; None (jax's default) when nothing says.

    Raises ValueError, naming the variables, when a node's tasks outnumber its GPUs.
    """
    visible = _visible_gpus(environ)
    if not all(name in environ for name in _SLURM):
        return (None if visible is None else list(range(len(visible)))), None
    layout = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ else "SLURM_TASKS_PER_NODE"
    counts = _expand_counts(environ.get(layout, ""))
    node = int(environ.get("SLURM_NODEID", "0"))
    tasks = counts[node] if node < len(counts) else None
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    on_node = int(on_node) if on_node.isdigit() else None
    if visible is not None:
        if tasks is None or tasks == 1 or on_node is None or len(visible) != on_node:
            return list(range(len(visible))), None  # the task's own GPUs
        shared, where = visible, f"CUDA_VISIBLE_DEVICES={','.join(visible)}"
    elif tasks == 1:
        return [], None  # an empty list restricts nothing: the task drives every GPU of its node
    elif tasks and on_node:
        shared, where = [str(gpu) for gpu in range(on_node)], f"SLURM_GPUS_ON_NODE={on_node}"
    else:
        return None, None
    if tasks > len(shared):
        raise ValueError(
            f"{tasks} tasks on node {node} ({layout}) share its {len(shared)} GPUs ({where}): "
            f"each task needs a GPU of its own; run at most {len(shared)} tasks per node (--ntasks-per-node) or "
            "ask for more GPUs."
        )
    per_task, local = len(shared) // tasks, int(environ["SLURM_LOCALID"])
    note = None
    if len(shared) % tasks and local == 0:  # one line per node, not one per task
        idle = ", ".join(shared[tasks * per_task:])
        note = (f"{tasks} tasks on node {node} share its {len(shared)} GPUs ({where}): each drives {per_task}, "
                f"GPUs {idle} sit idle (a task count that divides {len(shared)} uses them all).")
    return list(range(local * per_task, (local + 1) * per_task)), note


def _port_in_use(port: int) -> bool:
    """Whether this host has `port` taken (by a listening socket: where process 0's coordinator would bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def start_distributed(launch: Launch, environ: Mapping[str, str] = os.environ) -> None:
    """Joins the multi-process run that `launch` (or the cluster) describes; call it before anything touches a
    device. Raises ConfigError (before joining) for what cannot work; exits with status 1 when the other
    processes do not join within `launch.startup_timeout` seconds.

    Without explicit values `jax.distributed.initialize()` reads the cluster's own variables; a cluster of
    more than one task is joined without `--distributed`. On CPUs the processes talk through gloo (GPUs use
    NCCL whatever this says). A process started by scripts/launch_local.sh stops when the launcher dies
    (`watch_launcher`), whether it joins a run or runs alone.
    """
    watch_launcher()
    cluster = detected_cluster(environ)
    explicit = launch.num_processes is not None
    if not launch.distributed and not (cluster is not None and cluster[1] > 1):
        return
    if explicit:
        where, processes, process = launch.coordinator_address, launch.num_processes, launch.process_id
        if process == 0 and _port_in_use(int(where.rpartition(":")[2])):
            raise ConfigError(
                "coordinator_address", f"coordinator_address={where!r}: port {where.rpartition(':')[2]} is in use on "
                "this host (process 0 runs the coordinator there); choose a free one.",
            )
    elif cluster is not None:
        where, processes, process = f"the {cluster[0]} job's coordinator", cluster[1], cluster[2]
    else:  # left to jax's other detectors (Kubernetes, cloud TPUs)
        where, processes, process = "the detected cluster's coordinator", "all", "?"
    try:
        device_ids, note = gpu_share(environ)
    except ValueError as error:
        raise ConfigError("distributed", f"the GPUs of this node cannot be shared out: {error}") from None
    if note is not None:
        print(f"process {process}: {note}", file=sys.stderr, flush=True)
    print(f"process {process}: waiting for {processes} processes at {where} (up to {launch.startup_timeout} s, "
          "--startup-timeout)", file=sys.stderr, flush=True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def give_up():
        # jax's own timeout aborts the process with a C++ stack trace; this says what happened first.
        print(f"process {process}: not all {processes} processes joined {where} within {launch.startup_timeout} s "
              "(--startup-timeout); start every process, with the same --coordinator-address and --num-processes.",
              file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(launch.startup_timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            launch.coordinator_address, launch.num_processes, launch.process_id,
            local_device_ids=device_ids, initialization_timeout=launch.startup_timeout + 30,
        )
    except ValueError as error:  # "coordinator_address should be defined.": no cluster was detected
        raise ConfigError(
            "distributed", f"--distributed: jax.distributed.initialize() detected no cluster ({error}); outside SLURM, "
            "Open MPI and Kubernetes give --coordinator-address, --num-processes and --process-id instead.",
        ) from None
    finally:
        timer.cancel()


def watch_launcher(interval: float = 1.0) -> threading.Thread | None:
    """When scripts/launch_local.sh started this process (`LAUNCH_LOCAL_PID`), sends it a TERM (a clean stop,
    `Preemption`) once that launcher is gone, so that killing the launcher does not leave it training."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    if not launcher.isdigit():
        return None

    def watch():
        while os.getppid() == int(launcher):
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="watch-launcher", daemon=True)
    thread.start()
    return thread


def is_primary() -> bool:
    """Whether this process prints and writes the run's files: process 0 of a multi-process run."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Waits until every process of a multi-process run gets here."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def gather_bytes(payload: bytes) -> list[bytes]:
    """Every process's `payload`, by process index (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return [payload]
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(payload)))).reshape(-1)
    padded = np.zeros(max(int(lengths.max()), 1), np.uint8)
    padded[: len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [row[:length].tobytes() for row, length in zip(gathered, lengths)]


def agree(error: ConfigError | None) -> None:
    """Returns on every process when every process's start-up checks passed (`error`: this process's failure
    or None); otherwise raises on every process: its own error, or on a process whose checks passed the error
    of the first process that failed, named by its process. A collective."""
    mine = b"" if error is None else json.dumps([error.field, str(error)]).encode()
    failures = [(process, payload) for process, payload in enumerate(gather_bytes(mine)) if payload]
    if error is not None:
        raise error
    if failures:
        process, payload = failures[0]
        field, message = json.loads(payload)
        raise ConfigError(field, f"on process {process}: {message}")


def same_config(config: Config) -> None:
    """Raises ConfigError on every process, naming the first field (as its flag) and the processes, unless every
    process runs `config`. A collective."""
    configs = [json.loads(text) for text in gather_bytes(json.dumps(dataclasses.asdict(config)).encode())]
    for process, other in enumerate(configs[1:], 1):
        differs = [name for name in configs[0] if configs[0][name] != other[name]]
        if differs:
            name = differs[0]
            raise ConfigError(
                name, f"--{name.replace('_', '-')} differs between the processes: {configs[0][name]!r} on process 0, "
                f"{other[name]!r} on process {process}{f' (and {len(differs) - 1} more)' if len(differs) > 1 else ''}; "
                "every process needs the same flags.",
            )


def check_shared_out(out: Path, tries: int = 10, interval: float = 0.5) -> None:
    """Raises ConfigError on every process unless they all see one folder at `out` (a filesystem they share;
    checkpoints would otherwise hang in their first save). Process 0 creates `out` and a marker file in it,
    the others look for the marker (for a few seconds: a network filesystem may show it late). On failure
    the marker and the folders created for it are removed. A collective."""
    if jax.process_count() == 1:
        return
    created = []
    marker = None
    if is_primary():
        folder = out
        while not folder.exists():
            created.append(folder)
            folder = folder.parent
        out.mkdir(parents=True, exist_ok=True)
        marker = out / f".shared-check-{os.getpid()}-{time.time_ns()}"
        marker.touch()
    name = gather_bytes(b"" if marker is None else marker.name.encode())[0].decode()
    seen = False
    for _ in range(tries):
        if (out / name).exists():
            seen = True
            break
        time.sleep(interval)
    sees = [payload == b"1" for payload in gather_bytes(b"1" if seen else b"0")]
    if marker is not None:
        marker.unlink()
    if all(sees):
        return
    if is_primary():
        for folder in created:  # deepest first: nothing is left of the check
            folder.rmdir()
    blind = [str(process) for process, ok in enumerate(sees) if not ok]
    raise ConfigError(
        "out", f"{out} is not one folder shared by all processes: process {', '.join(blind)} does not see the file "
        "process 0 wrote there. --out must be on a filesystem every process shares, at the same path.",
    )


class Preemption:
    """Whether a TERM (SLURM preemption, `scancel`, a time limit, a launcher stopping) or an INT (Ctrl-C) asks
    the run to stop.

    In one process a handler notes the first TERM or INT, from `install` to `restore`. In a multi-process run
    jax's preemption service catches the TERM of any process and `multihost_utils.reached_preemption_sync_point`
    names one step at which every process sees it; an INT is passed on to it as a TERM to this process. Every
    process calls `reached(step)` after every step.

    The stop's checkpoint must not be lost to the signals that often follow the first (`scancel` and a batch
    script that passes the TERM on, a launcher's TERM and a Ctrl-C): further TERMs and INTs are noted with a
    line on stderr and ignored until `restore`, which the run calls once the checkpoint is committed. (In a
    multi-process run jax's own handler ignores the TERMs after the first, without a line.)
    """

    def __init__(self):
        self.signalled: str | None = None  # "TERM" or "INT": the signal that stops the run
        self.previous: dict[int, object] = {}

    def install(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in (signal.SIGTERM, signal.SIGINT) if jax.process_count() == 1 else (signal.SIGINT,):
            if signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # started with INT ignored (nohup, a background job): it stays so
            self.previous[signum] = signal.signal(signum, self._note)
        return self

    def restore(self) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        self.previous = {}

    def _note(self, signum, frame) -> None:
        name = signal.Signals(signum).name.removeprefix("SIG")
        if self.signalled is None:
            self.signalled = name
            if jax.process_count() > 1:  # jax's preemption service stops every process after one step
                os.kill(os.getpid(), signal.SIGTERM)
            return
        # os.write, not print: the handler may run while the main thread is inside a write to sys.stderr.
        line = (f"got {name} while stopping (after {self.signalled}): ignored until the checkpoint of the stop is "
                "saved\n")
        try:
            os.write(2, line.encode())
        except OSError:
            pass

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signalled is not None
