#!/usr/bin/env bash
# The pod-slice compile check: train_lm.py's training step and batched generation compiled for TPU slices
# (v5e:2x2 data=2,seq=2; v5p:2x2x1 data=2,model=2; v6e:2x2 data=4) without a TPU, at the benchmark shapes;
# writes docs/compile/tpu_slices.json and the "Pod slices" table of docs/tpu.md, and fails on a compile error,
# HBM over a chip's capacity, temporaries growing faster than linearly with the sequence, or a ring that
# all-gathers (scripts/compile/tpu_slices.py). Head dims 64 and 128 (12 slice shapes); --gated: 128 only (6,
# what CI compiles).
# The Python: $PROBJAX_TPU_PYTHON, or the TPU toolchain's venv (scripts/compile/tpu_toolchain.sh), to which
# this adds the examples' packages (pinned below) once.
# Usage: bash scripts/compile/tpu_slices.sh [--prepare | scripts/compile/tpu_slices.py run options: --gated
#            --jobs N --out F --doc F]   (--prepare: install the toolchain and the packages, compile nothing)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
log() { echo "tpu_slices.sh: $*" >&2; }

python="${PROBJAX_TPU_PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ ! -f scripts/compile/tpu_toolchain.sh ]]; then
        log "FAIL: no scripts/compile/tpu_toolchain.sh and no PROBJAX_TPU_PYTHON (a python with jax[tpu])"
        exit 1
    fi
    if ! toolchain="$(bash scripts/compile/tpu_toolchain.sh | tail -1)" || [[ ! -x "$toolchain/venv/bin/python" ]]; then
        log "FAIL: the TPU toolchain did not install (scripts/compile/tpu_toolchain.sh; it needs PyPI)"
        exit 1
    fi
    python="$toolchain/venv/bin/python"
    bash scripts/compile/examples_packages.sh "$toolchain"
fi
if ! "$python" -c "import jax, flax, optax, orbax.checkpoint, equinox, tqdm, yaml; from jax.experimental import topologies" 2>/dev/null; then
    log "FAIL: $python lacks jax[tpu] or the examples' packages (scripts/compile/examples_packages.sh)"
    exit 1
fi
if [[ "${1:-}" == --prepare ]]; then
    exit 0
fi
exec "$python" scripts/compile/tpu_slices.py run "$@"
