#!/usr/bin/env bash
# Runs examples/train_lm.py as NPROC processes of one jax.distributed run on this machine.
#
#     scripts/launch_local.sh NPROC -- TRAIN_LM_FLAGS...
#     XLA_FLAGS=--xla_force_host_platform_device_count=2 scripts/launch_local.sh 2 -- --mesh data=4 --out runs/mp
#
# Process i gets `--coordinator-address 127.0.0.1:PORT --num-processes NPROC --process-id i` after the flags
# given (PORT: a free one). Process 0 writes to this terminal; process i > 0 to LOG_DIR/process_i.log
# (LAUNCH_LOG_DIR, default a new temporary folder, named on stderr). When one process fails, the others are
# stopped at once (a survivor would otherwise wait for its dead peer in a collective until jax.distributed's
# heartbeat timeout), the failing process's last lines are printed, and this script exits with its status.
# A TERM, INT (Ctrl-C) or HUP to this script is passed on to every process as a TERM, which makes them stop at
# a common step and save a checkpoint (docs/examples.md); they get LAUNCH_GRACE_S seconds (default 300) for
# it before they are killed, and this script exits 0 if they all did. Each process runs in its own process
# group, signalled as a whole, and stops by itself if this script dies (it watches LAUNCH_LOCAL_PID).
#
# GPUs: on a machine whose `nvidia-smi -L` lists G GPUs (or with CUDA_VISIBLE_DEVICES set to G of them), each
# process gets G / NPROC of them through CUDA_VISIBLE_DEVICES (NPROC must divide G), so that no two processes
# drive one GPU.
#
# Environment: PYTHON (default .venv/bin/python beside this script, else python3), LAUNCH_SCRIPT (default
# examples/train_lm.py), LAUNCH_LOG_DIR, LAUNCH_GRACE_S. Needs bash >= 5.1 (`wait -n -p`).
set -u

usage() { echo "usage: $0 NPROC -- TRAIN_LM_FLAGS..." >&2; exit 2; }
[[ $# -ge 2 && $1 =~ ^[1-9][0-9]*$ && $2 == "--" ]] || usage
nproc=$1
shift 2

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
[[ -x $python ]] || python=python3
script=${LAUNCH_SCRIPT:-$root/examples/train_lm.py}
logs=${LAUNCH_LOG_DIR:-$(mktemp -d -t launch_local.XXXXXX)}
mkdir -p "$logs"
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') || exit 1
[[ $nproc -gt 1 ]] && echo "launch_local: $nproc processes, coordinator 127.0.0.1:$port; logs of 1..$((nproc - 1)) in $logs" >&2

gpus=()
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
elif command -v nvidia-smi >/dev/null; then
    mapfile -t gpus < <(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \([0-9]*\):.*/\1/p')
fi
if [[ ${#gpus[@]} -gt 0 ]] && (( ${#gpus[@]} % nproc )); then
    echo "launch_local: $nproc processes cannot share ${#gpus[@]} GPUs (${gpus[*]}) evenly" >&2
    exit 2
fi
per=$(( ${#gpus[@]} / nproc ))

set -m  # every background job its own process group, so that a signal reaches whatever a process started
export LAUNCH_LOCAL_PID=$$
pids=()
declare -A exited  # the pids already waited for, which exited with status 0
# stop_all GRACE: TERM to every process group, up to GRACE seconds for them to exit, then KILL. Returns 0 if
# every process exited with status 0.
stop_all() {
    local grace=$1 pid alive status=0
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    for ((tick = 0; tick < grace * 2; tick++)); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [[ $alive == 0 ]] && break
        sleep 0.5
    done
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do [[ -n ${exited[$pid]:-} ]] || wait "$pid" 2>/dev/null || status=1; done
    return $status
}
on_signal() {
    echo "launch_local: got $1; asking every process to save a checkpoint and stop" >&2
    trap '' INT TERM HUP
    stop_all "${LAUNCH_GRACE_S:-300}" && exit 0
    exit "$2"
}
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
trap 'on_signal HUP 129' HUP

for ((i = 0; i < nproc; i++)); do
    flags=(--coordinator-address "127.0.0.1:$port" --num-processes "$nproc" --process-id "$i")
    if [[ $per -gt 0 ]]; then
        mine=("${gpus[@]:i*per:per}")
        export CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${mine[*]}")
    fi
    if [[ $i == 0 ]]; then
        "$python" "$script" "$@" "${flags[@]}" &
    else
        "$python" "$script" "$@" "${flags[@]}" >"$logs/process_$i.log" 2>&1 &
    fi
    pids+=($!)
done

for ((left = nproc; left > 0; left--)); do
    wait -n -p finished
    status=$?
    [[ $status == 0 ]] && exited[$finished]=1
    if [[ $status != 0 ]]; then
        for ((i = 0; i < nproc; i++)); do [[ ${pids[$i]} == "$finished" ]] && failed=$i; done
        reason="exited with status $status"
        [[ $status -gt 128 ]] && reason="was killed by signal $((status - 128)) ($(kill -l $((status - 128)) 2>/dev/null))"
        echo "launch_local: process $failed $reason; stopping the others" >&2
        if [[ $failed != 0 ]]; then
            echo "launch_local: the last lines of process $failed ($logs/process_$failed.log):" >&2
            tail -n 20 "$logs/process_$failed.log" >&2
        fi
        stop_all 5
        exit "$status"
    fi
done
