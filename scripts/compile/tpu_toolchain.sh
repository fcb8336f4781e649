#!/usr/bin/env bash
# Install (or reuse) the pinned toolchain that compiles the Mosaic TPU kernels for TPUs on a machine without
# one (scripts/compile/tpu_report.py). It lives outside the repo, cached between runs on the same machine:
#   $PROBJAX_TPU_TOOLCHAIN (default: ${XDG_CACHE_HOME:-$HOME/.cache}/probjax-tpu-toolchain/<pins hash>)
#     venv/        jax[tpu] at the project's jax version (libtpu: the compiler), numpy, and tokamax (a peer in
#                  the report) when it installs; .tokamax records whether it did
# Prints the toolchain folder on its last line of stdout; everything else goes to stderr.
# Usage: bash scripts/compile/tpu_toolchain.sh
set -euo pipefail

JAX_VERSION="0.11.2"            # the project's (pyproject.toml's dev extra)
LIBTPU_VERSION="0.0.48.1"       # what jax[tpu]==0.11.2 pins; VMEM figures depend on its version
NUMPY_VERSION="2.5.5"
TOKAMAX_VERSION="0.0.17"        # a peer (its TPU attention); optional: the report records a failed install

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
log() { echo "tpu_toolchain.sh: $*" >&2; }

pins="jax[tpu]==$JAX_VERSION libtpu==$LIBTPU_VERSION numpy==$NUMPY_VERSION tokamax==$TOKAMAX_VERSION"
pins_hash="$(echo "$pins" | sha256sum | cut -c1-12)"
root="${PROBJAX_TPU_TOOLCHAIN:-${XDG_CACHE_HOME:-$HOME/.cache}/probjax-tpu-toolchain/$pins_hash}"
stamp="$root/.installed"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$pins" ]]; then
    log "reusing $root"
else
    # The repo's .venv (scripts/setup.sh) holds a Python 3.12; its base interpreter makes the toolchain venv.
    if [[ ! -x .venv/bin/python ]]; then
        log "no .venv: run 'bash scripts/setup.sh' first (it finds the Python 3.12 this uses)"
        exit 1
    fi
    python="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
    log "installing $pins into $root (about 1 GB; minutes on a fresh machine)"
    rm -rf "$root"
    mkdir -p "$root"
    "$python" -m venv "$root/venv"
    "$root/venv/bin/python" -m pip install --quiet --upgrade pip
    "$root/venv/bin/python" -m pip install --quiet "jax[tpu]==$JAX_VERSION" "libtpu==$LIBTPU_VERSION" \
        "numpy==$NUMPY_VERSION"
    # tokamax is a peer, not a dependency: a failed install is recorded (the report says so), not fatal.
    # It must not move jax: the constraint keeps the pinned one.
    echo "jax==$JAX_VERSION" >"$root/constraints.txt"
    echo "jaxlib==$JAX_VERSION" >>"$root/constraints.txt"
    if "$root/venv/bin/python" -m pip install --quiet -c "$root/constraints.txt" "tokamax==$TOKAMAX_VERSION" \
            >"$root/tokamax-install.log" 2>&1; then
        echo "tokamax $TOKAMAX_VERSION installed" >"$root/.tokamax"
    else
        echo "tokamax $TOKAMAX_VERSION did not install: $(tail -1 "$root/tokamax-install.log")" >"$root/.tokamax"
        log "$(cat "$root/.tokamax")"
    fi
    echo "$pins" >"$stamp"
    log "installed"
fi

log "jax $("$root/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("jax"), "jaxlib", m.version("jaxlib"), "libtpu", m.version("libtpu"))')"
log "$(cat "$root/.tokamax")"
echo "$root"
