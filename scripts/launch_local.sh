#!/usr/bin/env bash
# Runs examples/train_lm.py as NPROC processes of one jax.distributed run on this machine.
#
#     scripts/launch_local.sh NPROC -- TRAIN_LM_FLAGS...
#     XLA_FLAGS=--xla_force_host_platform_device_count=2 scripts/launch_local.sh 2 -- --mesh data=4 --out runs/mp
#
# Process i gets `--coordinator-address 127.0.0.1:PORT --num-processes NPROC --process-id i` after the flags
# given (PORT: a free one). Process 0 writes to this terminal; process i > 0 to LOG_DIR/process_i.log
# (LAUNCH_LOG_DIR, default a new temporary folder, named on stderr). When one process fails, the others are
# killed at once (a survivor would otherwise wait for its dead peer in a collective until jax.distributed's
# heartbeat timeout), the failing process's last lines are printed, and this script exits with its status.
# Ctrl-C or a TERM stops them all as well. Each process runs in its own process group, killed as a whole.
#
# Environment: PYTHON (default .venv/bin/python beside this script, else python3), LAUNCH_SCRIPT (default
# examples/train_lm.py), LAUNCH_LOG_DIR. Needs bash >= 5.1 (`wait -n -p`).
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

set -m  # every background job its own process group, so that a kill reaches whatever a process started
pids=()
stop_all() {
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    for _ in 1 2 3 4 5 6 7 8 9 10; do  # up to 5 s to exit cleanly, then KILL
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [[ $alive == 0 ]] && break
        sleep 0.5
    done
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    wait 2>/dev/null
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM

for ((i = 0; i < nproc; i++)); do
    flags=(--coordinator-address "127.0.0.1:$port" --num-processes "$nproc" --process-id "$i")
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
    if [[ $status != 0 ]]; then
        for ((i = 0; i < nproc; i++)); do [[ ${pids[$i]} == "$finished" ]] && failed=$i; done
        reason="exited with status $status"
        [[ $status -gt 128 ]] && reason="was killed by signal $((status - 128)) ($(kill -l $((status - 128)) 2>/dev/null))"
        echo "launch_local: process $failed $reason; stopping the others" >&2
        if [[ $failed != 0 ]]; then
            echo "launch_local: the last lines of process $failed ($logs/process_$failed.log):" >&2
            tail -n 20 "$logs/process_$failed.log" >&2
        fi
        stop_all
        exit "$status"
    fi
done
