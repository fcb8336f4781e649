#!/usr/bin/env bash
# The compile check that needs no accelerator, in two parts; it fails if either fails.
# - GPU: install (or reuse) the pinned toolchain (scripts/compile/gpu_toolchain.sh), compile every kernel
#   variant for sm_90a (H100 / H200), sm_80 (A100) and sm_86 (RTX 3090), and a subset of them for sm_100a (B200),
#   sm_89 (RTX 4090 / L40S) and sm_120 (RTX 5090), with the LM example's whole programs on an H200 and a B200,
#   through XLA, Triton, Mosaic GPU and ptxas, write docs/compile/report.json and docs/compile/index.md, and
#   fail closed: on a variant of the
#   registry (scripts/compile/variants.py) missing or without its kernels, a compile error, a spill, shared
#   memory over a target's limit, or the tensor-core / copy instructions the report requires.
# - TPU: install (or reuse) the pinned jax[tpu] toolchain (scripts/compile/tpu_toolchain.sh), compile every
#   Mosaic TPU kernel variant for v5e, v5p, v6e and TPU7x through libtpu, write the `tpu` section of
#   docs/compile/report.json and docs/compile/tpu.md, and fail on a compile error, VMEM over a generation's
#   scoped limit, a variant that should be a Mosaic TPU kernel compiling without its tpu_custom_call (or a
#   fallback that became one), superlinear HBM growth, or a missing (generation, variant) pair; then compile
#   the LM example for TPU pod slices (scripts/compile/tpu_slices.sh) and fail on a compile error, HBM over a
#   chip's capacity, superlinear temporaries or a ring that all-gathers.
# --reuse FILE (an earlier report, e.g. the committed docs/compile/report.json): both parts lower every variant
# and compile only those whose lowered module's fingerprint is not FILE's, plus a sample of those that are,
# whose figures must equal FILE's (report.py / tpu_report.py `--reuse`, `--verify`).
# --prepare installs (or reuses) the toolchains and the pod-slice step's packages and compiles nothing: .ci/run
# downloads them while the tests hold the CPUs.
# Usage: bash scripts/compile_check.sh [--prepare] [--part gpu|tpu|all] [--out FILE] [--page FILE]
#            [--tpu-only REGEX] [--tpu-targets tpu_v5e,...] [--reuse FILE] [other scripts/compile/report.py run options,
#            e.g. --only REGEX --targets sm86_rtx3090, which go to the GPU part]
# --page names the GPU page; the TPU page is tpu.md beside it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part=all
prepare=0
gpu_args=()
tpu_args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --part) part="$2"; shift 2 ;;
        --prepare) prepare=1; shift ;;
        --out) gpu_args+=(--out "$2"); tpu_args+=(--out "$2"); shift 2 ;;
        --page) gpu_args+=(--page "$2"); tpu_args+=(--page "$(dirname "$2")/tpu.md"); shift 2 ;;
        --tpu-only) tpu_args+=(--only "$2"); shift 2 ;;
        --tpu-targets) tpu_args+=(--targets "$2"); shift 2 ;;
        --reuse) gpu_args+=(--reuse "$2"); tpu_args+=(--reuse "$2"); shift 2 ;;
        *) gpu_args+=("$1"); shift ;;
    esac
done
if [[ "$prepare" == 1 ]]; then
    status=0
    if [[ "$part" != tpu ]]; then
        toolchain="$(bash scripts/compile/gpu_toolchain.sh | tail -1)" && bash scripts/compile/examples_packages.sh "$toolchain" || status=1
    fi
    if [[ "$part" != gpu ]]; then bash scripts/compile/tpu_slices.sh --prepare || status=1; fi
    exit $status
fi
status=0
if [[ "$part" != tpu ]]; then
    if ! toolchain="$(bash scripts/compile/gpu_toolchain.sh | tail -1)" || [[ ! -x "$toolchain/venv/bin/python" ]]; then
        echo "compile_check.sh: FAIL: the GPU toolchain did not install (scripts/compile/gpu_toolchain.sh; it needs PyPI)" >&2
        status=1
    elif ! bash scripts/compile/examples_packages.sh "$toolchain"; then  # the serving-step rows import examples/lm
        echo "compile_check.sh: FAIL: the examples' packages did not install in the GPU toolchain" >&2
        status=1
    elif ! "$toolchain/venv/bin/python" scripts/compile/report.py run --toolchain "$toolchain" ${gpu_args[@]+"${gpu_args[@]}"}; then
        echo "compile_check.sh: FAIL: the GPU compile report (scripts/compile/report.py)" >&2
        status=1
    fi
fi
if [[ "$part" != gpu ]]; then
    if ! toolchain="$(bash scripts/compile/tpu_toolchain.sh | tail -1)" || [[ ! -x "$toolchain/venv/bin/python" ]]; then
        echo "compile_check.sh: FAIL: the TPU toolchain did not install (scripts/compile/tpu_toolchain.sh; it needs PyPI)" >&2
        status=1
    elif ! bash scripts/compile/examples_packages.sh "$toolchain"; then  # the serving-step rows import examples/lm
        echo "compile_check.sh: FAIL: the examples' packages did not install in the TPU toolchain" >&2
        status=1
    elif ! "$toolchain/venv/bin/python" scripts/compile/tpu_report.py run --toolchain "$toolchain" ${tpu_args[@]+"${tpu_args[@]}"}; then
        echo "compile_check.sh: FAIL: the TPU compile report (scripts/compile/tpu_report.py)" >&2
        status=1
    fi
    # The LM example compiled for TPU pod slices (scripts/compile/tpu_slices.sh; docs/tpu.md "Pod slices").
    # PROBJAX_TPU_SLICES_ARGS: its options (.ci/run sends its JSON to a temporary folder);
    # PROBJAX_SKIP_TPU_SLICES=1 leaves it out.
    # shellcheck disable=SC2086
    if [[ "${PROBJAX_SKIP_TPU_SLICES:-0}" != 1 ]] && ! bash scripts/compile/tpu_slices.sh ${PROBJAX_TPU_SLICES_ARGS:-}; then
        echo "compile_check.sh: FAIL: the TPU pod-slice check (scripts/compile/tpu_slices.sh)" >&2
        status=1
    fi
fi
exit $status
