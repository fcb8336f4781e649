#!/usr/bin/env bash
# The GPU checks, in one run that ends inside BUDGET_S seconds (default 540): nvidia-smi, versions, the GPU
# tests of the Triton and tangent kernels, the benchmark (python -m probjax_nn.benchmark: bf16, B=4, N=8,
# head dims 64 and 128, seq 1024..8192, causal and not, fwd and fwd_bwd; probjax_default, probjax_mosaic,
# probjax_flex, probjax_flex_mosaic, jax_xla, jax_cudnn and the torch impls, which record themselves as
# missing where torch or CUDA is not there), after seq 8192 the jvp rows and the Mosaic tile sweep
# (tests/gpu/mosaic_sweep.py -> mosaic_sweep.jsonl), and the plots. The Mosaic GPU tests run before the
# benchmark, whose Mosaic rows and sweep run only if they pass. Later steps are cut when the budget
# runs out, so the order is the priority. Last, the decode kernel's GPU test and its benchmark grid
# (gpu_decode_bf16*.json). Usage, from anywhere, on a machine with jax[cuda] installed:
#
#     OUT=/some/folder bash tests/gpu/run_gpu_checks.sh
#
# Results go to ${OUT:-docs/benchmarks} (relative to the repository root): nvidia-smi.txt, versions.txt,
# pytest_gpu.log, gpu_attention_bf16.json with benchmark_*.log, the plots and gpu_attention_bf16.md (when
# matplotlib is installed; otherwise run `python -m probjax_nn.benchmark plot` on the JSON elsewhere), and
# run_gpu_checks.log (each step's exit status).
# Needs no network: the packages are imported from this checkout through symlinks on PYTHONPATH, not installed.
#
# The benchmark's time: on a GPU each JAX row costs its compile (about 1-10 s; jax_xla's fwd_bwd at seq 8192
# took 17 s on an H200) plus about 0.3 s of timing, and each shape adds one float32 reference (a compile and a
# run); a torch row costs about 0.3 s, a torch_flex row about 5 s of torch.compile. One seq (2 head dims x
# 2 causal x 2 modes: 8 shapes x 8 impls) is so about one to three minutes, more than the budget holds for
# all four after the tests. Hence one step per seq, the most telling first (4096, 8192, 1024, 2048), then
# torch_flex: every step appends to the same JSON, which the benchmark rewrites after every row, so a step
# cut short by the budget keeps the rows it measured and the later steps are skipped.
set -uo pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="${OUT:-docs/benchmarks}"
mkdir -p "$out"
budget_s="${BUDGET_S:-540}"
python="${PYTHON:-python3}"
log="$out/run_gpu_checks.log"
: >"$log"

# kernels/ installs as probjax_kernels (pyproject's package-dir); symlinks give the same mapping uninstalled.
links="$(mktemp -d)"
ln -sfn "$PWD/kernels" "$links/probjax_kernels"
ln -sfn "$PWD/probjax_nn" "$links/probjax_nn"
export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}"

# step LIMIT NAME FILE COMMAND...: runs COMMAND under `timeout` (at most LIMIT seconds, never past the
# budget) with its output copied to $out/FILE, and logs its exit status (124: timed out).
step() {
    local limit=$1 name=$2 file=$3 left
    shift 3
    left=$((budget_s - SECONDS - 5))
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "$name: skipped, the budget is spent" | tee -a "$log"
        return
    fi
    echo "== $name (limit ${limit}s, at ${SECONDS}s)" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$file"
    echo "$name: exit $? after ${SECONDS}s" | tee -a "$log"
}

versions='
import platform, jax, jaxlib, probjax_kernels, probjax_nn
print("python", platform.python_version())
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("backend", jax.default_backend(), "devices", jax.devices())
print("device_kind", jax.devices()[0].device_kind)
print("probjax_kernels from", probjax_kernels.__file__)
print("probjax_nn from", probjax_nn.__file__)
from importlib import metadata
for name in ("torch", "triton", "tokamax", "matplotlib", "tqdm"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
'

pytest_args=(-p no:cacheprovider -q -rA --durations=15)
if "$python" -c "import xdist" 2>/dev/null; then
    pytest_args+=(-n 4)
fi
if "$python" -c "import pytest_timeout" 2>/dev/null; then
    pytest_args+=(--timeout 150)
fi

step 30 nvidia-smi nvidia-smi.txt nvidia-smi
step 120 versions versions.txt "$python" -c "$versions"
# The test workers share the GPU (each compiles its own Triton kernels), so none may preallocate its memory.
step 200 pytest-gpu pytest_gpu.log \
    env XLA_PYTHON_CLIENT_PREALLOCATE=false "$python" -m pytest "${pytest_args[@]}" \
    tests/gpu/test_gpu_flash.py tests/gpu/test_gpu_forward_ad.py
# The Mosaic GPU kernels (issue 7, opt-in) before any timing: they have never run on a GPU, and a barrier
# mistake hangs rather than fails (-v: a hang or a cut leaves the test names). Only when they pass do the
# benchmark steps time them, so a hang cannot eat a benchmark step's budget.
step 150 pytest-mosaic pytest_mosaic.log \
    env XLA_PYTHON_CLIENT_PREALLOCATE=false "$python" -m pytest "${pytest_args[@]}" -v tests/gpu/test_gpu_mosaic.py \
    tests/gpu/test_gpu_mosaic_blackwell.py
mosaic_ok=0
grep -q "^pytest-mosaic: exit 0 " "$log" && mosaic_ok=1
results="$out/gpu_attention_bf16.json"
rm -f "$results"
bench=("$python" -m probjax_nn.benchmark --output "$results" --append
    --batch 4 --heads 8 --head-dims 64 128 --ragged-seq-lens --dtypes bfloat16 --modes fwd fwd_bwd --causal 0 1)
impls=(probjax_default probjax_flex jax_xla jax_cudnn torch_flash torch_efficient torch_math torch_cudnn)
((mosaic_ok)) && impls=(probjax_mosaic probjax_flex_mosaic "${impls[@]}")
for seq in 4096 8192 1024 2048; do
    step 300 "benchmark-$seq" "benchmark_$seq.log" "${bench[@]}" --seq-lens "$seq" --impls "${impls[@]}"
    if [[ $seq == 8192 ]]; then
        # forward mode (issue 8): the tangent kernel against dense jax.jvp
        step 120 benchmark-jvp benchmark_jvp.log "${bench[@]}" --seq-lens 4096 8192 --modes jvp \
            --impls probjax_default probjax_flex jax_xla jax_cudnn
        # the Mosaic tile configs, hd 128 at seq 8192 first; one JSON line per config
        ((mosaic_ok)) && step 120 mosaic-sweep mosaic_sweep.log "$python" tests/gpu/mosaic_sweep.py \
            "$out/mosaic_sweep.jsonl"
        # head dim 256 fwd+bwd: the Mosaic backward's 128-column pieces against Triton's (perf-notes item 21)
        ((mosaic_ok)) && step 120 benchmark-hd256 benchmark_hd256.log "${bench[@]}" --head-dims 256 \
            --seq-lens 4096 8192 --modes fwd_bwd --causal 1 --impls probjax_mosaic probjax_default
        # and the jvp: the Mosaic tangent's programs (q's, k's, v's; d out in pieces) against Triton's (item 22)
        ((mosaic_ok)) && step 90 benchmark-hd256-jvp benchmark_hd256_jvp.log "${bench[@]}" --head-dims 256 \
            --seq-lens 4096 --modes jvp --causal 1 --impls probjax_mosaic probjax_default
    fi
done
step 300 benchmark-torch-flex benchmark_torch_flex.log "${bench[@]}" --seq-lens 1024 2048 4096 8192 \
    --impls torch_flex
step 60 plot plot.log "$python" -m probjax_nn.benchmark plot "$results"
# decode (issue 24): the kernel against the reference, then the decode grid (hd 128, GQA 8:1 and 32:8, dense
# and pages of 16 and 64), smallest caches first so that a cut keeps whole rows; each step only if time is left.
step 150 pytest-decode pytest_decode.log \
    env XLA_PYTHON_CLIENT_PREALLOCATE=false "$python" -m pytest "${pytest_args[@]}" tests/gpu/test_gpu_decode.py
decode_bench=("$python" -m probjax_nn.benchmark decode --batch 1 8 64 --heads 8:1 32:8 --head-dim 128
    --page-sizes 0 16 64 --dtypes bfloat16)
step 240 benchmark-decode benchmark_decode.log "${decode_bench[@]}" --output "$out/gpu_decode_bf16.json" \
    --cache-lens 1024 8192 32768
# pages of 16 on 32-key steps (the planner's default, perf-notes Version 22) against 64-key steps
step 90 decode-key-steps decode_key_steps.log "$python" tests/gpu/decode_key_steps_ab.py "$out/decode_key_steps.jsonl"
step 180 benchmark-decode-128k benchmark_decode_128k.log "${decode_bench[@]}" \
    --output "$out/gpu_decode_bf16_128k.json" --cache-lens 131072

rm -rf "$links"
echo "done after ${SECONDS}s" | tee -a "$log"
