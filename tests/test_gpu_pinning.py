"""The LM example's GPU pinning (`examples/lm/distributed.gpu_share`) on fake environments of the common
SLURM, Open MPI and Kubernetes layouts: which GPUs each task drives, those that sit idle, and too few refused."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from lm.config import ConfigError  # noqa: E402


# The node's variables of a SLURM task (process 1 of 2 unless said), and the GPUs it should drive.
@pytest.mark.parametrize(
    ("environment", "want"),
    [
        # One task per node with 8 GPUs (the docs' recipe): jax gave it GPU SLURM_LOCALID = 0 alone.
        (dict(SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NODEID="1", SLURM_LOCALID="0", SLURM_GPUS_ON_NODE="8"), []),
        (dict(SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NODEID="1", SLURM_LOCALID="0", SLURM_GPUS_ON_NODE="8",
              CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), [0, 1, 2, 3, 4, 5, 6, 7]),
        # --gpus-per-task=4: SLURM sets CUDA_VISIBLE_DEVICES to the task's 4, which the process sees as 0..3.
        (dict(SLURM_STEP_TASKS_PER_NODE="2", SLURM_LOCALID="1", CUDA_VISIBLE_DEVICES="4,5,6,7"), [0, 1, 2, 3]),
        (dict(SLURM_STEP_TASKS_PER_NODE="2", SLURM_LOCALID="1", SLURM_GPUS_ON_NODE="8",
              CUDA_VISIBLE_DEVICES="4,5,6,7"), [0, 1, 2, 3]),
        # --gpus-per-task=1 (or a wrapper that sets CUDA_VISIBLE_DEVICES=$SLURM_LOCALID): the task's one GPU.
        (dict(SLURM_STEP_TASKS_PER_NODE="8", SLURM_LOCALID="3", SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES="3"),
         [0]),
        # Two tasks on a node of 8 GPUs, nothing restricted: each takes its half, by local rank.
        (dict(SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_NODEID="1", SLURM_LOCALID="1", SLURM_GPUS_ON_NODE="8"),
         [4, 5, 6, 7]),
        # One GPU per task (8 tasks on 8 GPUs): GPU LOCALID, as jax chose.
        (dict(SLURM_STEP_TASKS_PER_NODE="8", SLURM_LOCALID="3", SLURM_GPUS_ON_NODE="8"), [3]),
        # --ntasks-per-node=8 --gres=gpu:8: every task sees all 8 GPUs in CUDA_VISIBLE_DEVICES; each drove all 8.
        (dict(SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_NODEID="1", SLURM_LOCALID="3", SLURM_GPUS_ON_NODE="8",
              CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), [3]),
        # --ntasks-per-node=2 --gres=gpu:8: halves of the shared list, by local rank.
        (dict(SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_NODEID="0", SLURM_LOCALID="1", SLURM_GPUS_ON_NODE="8",
              CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), [4, 5, 6, 7]),
        # Three tasks share 8 GPUs: two each (consecutive, by local rank); 6 and 7 sit idle.
        (dict(SLURM_STEP_TASKS_PER_NODE="3", SLURM_LOCALID="2", SLURM_GPUS_ON_NODE="8",
              CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), [4, 5]),
        (dict(SLURM_STEP_TASKS_PER_NODE="3", SLURM_LOCALID="1", SLURM_GPUS_ON_NODE="8"), [2, 3]),
        # Nothing to go by: jax's default.
        (dict(SLURM_STEP_TASKS_PER_NODE="2", SLURM_LOCALID="1"), None),
    ],
)
def test_slurm_layouts_give_each_task_its_gpus(environment, want):
    """jax.distributed.initialize() gives each SLURM task the one GPU of its local rank (jax#16788), so the docs'
    one task per node of 8 GPUs trained on one of them; then every task of `--ntasks-per-node=8 --gres=gpu:8`
    (which sees all 8 in CUDA_VISIBLE_DEVICES) drove all 8."""
    from lm.distributed import detected_cluster, gpu_share

    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="node[1-2]", SLURM_NTASKS="2", SLURM_PROCID="1", **environment)
    assert detected_cluster(slurm) == ("SLURM", 2, 1)
    assert gpu_share(slurm) == (want, None)


def test_gpus_outside_slurm_are_the_process_own():
    """Open MPI, Kubernetes and one process: CUDA_VISIBLE_DEVICES is the process's own list, or jax chooses."""
    from lm.distributed import gpu_share

    open_mpi = dict(OMPI_MCA_orte_hnp_uri="1", OMPI_COMM_WORLD_SIZE="16", OMPI_COMM_WORLD_RANK="9",
                    OMPI_COMM_WORLD_LOCAL_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1")
    assert gpu_share({**open_mpi, "CUDA_VISIBLE_DEVICES": "1"}) == ([0], None)
    assert gpu_share(open_mpi) == (None, None)
    assert gpu_share({"CUDA_VISIBLE_DEVICES": "2,3"}) == ([0, 1], None)
    assert gpu_share({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == gpu_share({}) == (None, None)


def test_gpus_that_do_not_split_evenly_are_named_and_too_few_are_refused(capsys):
    """Three tasks on 8 GPUs left two idle without a word; eight tasks on 4 GPUs all drove the same 4 (shared
    list) or failed in jax on a GPU number past the last (no list)."""
    from lm.config import Launch
    from lm.distributed import gpu_share, start_distributed

    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="node1", SLURM_NTASKS="3", SLURM_PROCID="0",
                 SLURM_STEP_TASKS_PER_NODE="3", SLURM_LOCALID="0", SLURM_GPUS_ON_NODE="8")
    ids, note = gpu_share({**slurm, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    assert ids == [0, 1] and note is not None
    assert "3 tasks on node 0 share its 8 GPUs (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7): each drives 2, GPUs 6, 7 " \
        "sit idle" in note, note
    ids, note = gpu_share({**slurm, "CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7,8,9"})  # named by the list's numbers
    assert ids == [0, 1] and "GPUs 8, 9 sit idle" in note, note
    ids, note = gpu_share(slurm)
    assert ids == [0, 1] and "(SLURM_GPUS_ON_NODE=8): each drives 2, GPUs 6, 7 sit idle" in note, note

    crowded = {**slurm, "SLURM_NTASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_LOCALID": "5",
               "SLURM_PROCID": "5", "SLURM_GPUS_ON_NODE": "4"}
    for environ, where in (({**crowded, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "CUDA_VISIBLE_DEVICES=0,1,2,3"),
                           (crowded, "SLURM_GPUS_ON_NODE=4")):
        with pytest.raises(ValueError, match=re.escape(f"8 tasks on node 0 (SLURM_STEP_TASKS_PER_NODE) share its 4 "
                                                       f"GPUs ({where}): each task needs a GPU of its own")):
            gpu_share(environ)
        # A usage error before the process waits for the others (it would wait up to --startup-timeout).
        with pytest.raises(ConfigError) as error:
            start_distributed(Launch(), environ)
        assert error.value.flag == "--distributed" and "the GPUs of this node cannot be shared out: 8 tasks" in str(
            error.value)
    assert "waiting for" not in capsys.readouterr().err


# A stand-in for train_lm.py (no jax: cheap): records its GPUs and its pid, and on TERM writes a file and exits 0.
