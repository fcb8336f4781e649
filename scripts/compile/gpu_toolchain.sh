#!/usr/bin/env bash
# Install (or reuse) the pinned toolchain that compiles the kernels for NVIDIA GPUs on a machine without one
# (scripts/compile/report.py). It lives outside the repo, cached between runs on the same machine:
#   $PROBJAX_GPU_TOOLCHAIN (default: ${XDG_CACHE_HOME:-$HOME/.cache}/probjax-gpu-toolchain/<pins hash>)
#     venv/        jax[cuda12] at the project's jax version and the nvcc wheel's ptxas (the compiler)
#     tools/       cuobjdump and nvdisasm (SASS), installed with pip --target OUTSIDE the venv: their
#                  nvidia/cu13 folder inside the venv breaks jax's CUDA path detection
#     cuda_root/   what XLA and Mosaic GPU look for under CUDA_ROOT: bin/ptxas (a wrapper that adds -v and
#                  keeps the cubins), bin/nvdisasm, bin/cuobjdump, nvvm/
# Prints the toolchain folder on its last line of stdout; everything else goes to stderr.
# Usage: bash scripts/compile/gpu_toolchain.sh
set -euo pipefail

JAX_VERSION="0.11.2"            # the project's (pyproject.toml's dev extra)
NVCC_VERSION="12.9.86"          # ptxas: register and spill figures depend on its version
CUOBJDUMP_VERSION="13.5.37"     # no -cu12 build exists; these only read cubins
NVDISASM_VERSION="13.5.37"
ABSL_VERSION="2.5.1"            # imported by JAX's Mosaic GPU attention (a peer in the report)

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
log() { echo "gpu_toolchain.sh: $*" >&2; }
# shellcheck source=scripts/compile/toolchain_common.sh
source scripts/compile/toolchain_common.sh

pins="jax[cuda12]==$JAX_VERSION nvidia-cuda-nvcc-cu12==$NVCC_VERSION"
pins="$pins nvidia-cuda-cuobjdump==$CUOBJDUMP_VERSION nvidia-cuda-nvdisasm==$NVDISASM_VERSION"
pins="$pins absl-py==$ABSL_VERSION"
root="$(toolchain_root probjax-gpu-toolchain "$pins" "${PROBJAX_GPU_TOOLCHAIN:-}")"

if toolchain_installed "$root" "$pins"; then
    log "reusing $root"
else
    log "installing $pins into $root (a few GB; minutes on a fresh machine)"
    toolchain_new_venv "$root"
    "$root/venv/bin/python" -m pip install --quiet "jax[cuda12]==$JAX_VERSION" \
        "nvidia-cuda-nvcc-cu12==$NVCC_VERSION" "absl-py==$ABSL_VERSION" numpy
    "$root/venv/bin/python" -m pip install --quiet --target "$root/tools" --no-deps \
        "nvidia-cuda-cuobjdump==$CUOBJDUMP_VERSION" "nvidia-cuda-nvdisasm==$NVDISASM_VERSION"

    # CUDA_ROOT: the nvcc wheel's bin/ and nvvm/, with ptxas behind a wrapper.
    nvcc="$("$root/venv/bin/python" -c 'import nvidia.cuda_nvcc as m, os; print(os.path.dirname(m.__file__))' 2>/dev/null \
        || echo "$root/venv/lib/python3.12/site-packages/nvidia/cuda_nvcc")"
    cuda="$root/cuda_root"
    mkdir -p "$cuda/bin"
    ln -sfn "$nvcc/nvvm" "$cuda/nvvm"
    ln -sfn "$nvcc/bin/ptxas" "$cuda/bin/ptxas.real"
    for tool in cuobjdump nvdisasm; do
        found="$(find "$root/tools" -type f -name "$tool" -perm -u+x | head -1)"
        [[ -n "$found" ]] || { log "no $tool in $root/tools"; exit 1; }
        ln -sfn "$found" "$cuda/bin/$tool"
    done
    cat >"$cuda/bin/ptxas" <<'WRAP'
#!/usr/bin/env bash
# ptxas with -v: its register / spill report goes to $PROBJAX_PTXAS_LOG (one file per call, with the cubin).
here="$(dirname "${BASH_SOURCE[0]}")"
if [[ -z "${PROBJAX_PTXAS_LOG:-}" ]]; then exec "$here/ptxas.real" "$@"; fi
mkdir -p "$PROBJAX_PTXAS_LOG"
id="$(date +%s%N)-$$"
out=""; args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    if [[ "${args[$i]}" == "-o" ]]; then out="${args[$((i + 1))]}"; fi
done
"$here/ptxas.real" -v "$@" 2>"$PROBJAX_PTXAS_LOG/$id.log"
rc=$?
cat "$PROBJAX_PTXAS_LOG/$id.log" >&2
for ((i = 0; i < ${#args[@]}; i++)); do  # the input: the one argument that is neither a flag nor -o's
    a="${args[$i]}"
    if [[ "$a" == "-o" ]]; then i=$((i + 1)); elif [[ "$a" != -* && -f "$a" ]]; then cp "$a" "$PROBJAX_PTXAS_LOG/$id.ptx"; fi
done
[[ -n "$out" && -f "$out" ]] && cp "$out" "$PROBJAX_PTXAS_LOG/$id.cubin"
exit $rc
WRAP
    chmod +x "$cuda/bin/ptxas"
    toolchain_mark_installed "$root" "$pins"
    log "installed"
fi

# Peers compiled beside ours (tokamax's Triton and Mosaic GPU attention): installed with pip --target into
# peers/, which the report's workers put at the END of sys.path, so the venv's jax stays the one imported.
# --no-deps with the pinned list of what tokamax and its imports need (its own requirements would bring in
# another jax). Not part of the toolchain's hash: a failed install leaves the peers' rows as compile errors
# (shown, not checked), never the toolchain unusable.
PEER_PINS="tokamax==0.0.17 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 pydantic==2.14.4"
PEER_PINS="$PEER_PINS pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"
PEER_PINS="$PEER_PINS qwix==0.1.8 flax==0.12.12 msgpack==1.2.4 treescope==0.1.10 rich==15.0.0 pyyaml==6.0.4"
PEER_PINS="$PEER_PINS markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 optax==0.2.8 chex==0.1.92 toolz==1.2.0"
PEER_PINS="$PEER_PINS tqdm==4.70.1 immutabledict==4.3.1 xprof==2.24.2 tensorboardx==2.6.5"
peer_stamp="$root/.peers-installed"
if [[ ! -f "$peer_stamp" || "$(cat "$peer_stamp")" != "$PEER_PINS" ]]; then
    log "installing the peers into $root/peers: $PEER_PINS"
    rm -rf "$root/peers"
    # shellcheck disable=SC2086
    if "$root/venv/bin/python" -m pip install --quiet --no-deps --target "$root/peers" $PEER_PINS; then
        echo "$PEER_PINS" >"$peer_stamp"
    else
        log "the peers did not install: their rows will show the import error"
    fi
fi

log "jax $("$root/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("jax"), "jaxlib", m.version("jaxlib"), "jax-cuda12-plugin", m.version("jax-cuda12-plugin"))')"
log "ptxas: $("$root/cuda_root/bin/ptxas.real" --version | tail -1)"
log "nvdisasm: $("$root/cuda_root/bin/nvdisasm" --version | tail -1)"
echo "$root"
