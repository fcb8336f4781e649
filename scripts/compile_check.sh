#!/usr/bin/env bash
# The compile check that needs no accelerator: install (or reuse) the pinned toolchain
# (scripts/compile/gpu_toolchain.sh), compile
# every kernel variant for sm_90a (H100 / H200), sm_80 (A100) and sm_86 (RTX 3090) through XLA, Triton,
# Mosaic GPU and ptxas, write docs/compile/report.json and docs/compile/index.md, and fail closed: on a
# variant of the registry (scripts/compile/variants.py) missing or without its kernels, a compile error, a
# spill, shared memory over a target's limit, or the tensor-core / copy instructions the report requires.
# Usage: bash scripts/compile_check.sh [scripts/compile/report.py run options, e.g. --only REGEX --targets sm86_rtx3090]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! toolchain="$(bash scripts/compile/gpu_toolchain.sh | tail -1)" || [[ ! -x "$toolchain/venv/bin/python" ]]; then
    echo "compile_check.sh: FAIL: the GPU toolchain did not install (scripts/compile/gpu_toolchain.sh; it needs PyPI)" >&2
    exit 1
fi
exec "$toolchain/venv/bin/python" scripts/compile/report.py run --toolchain "$toolchain" "$@"
