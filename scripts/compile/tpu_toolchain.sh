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
# shellcheck source=scripts/compile/toolchain_common.sh
source scripts/compile/toolchain_common.sh

pins="jax[tpu]==$JAX_VERSION libtpu==$LIBTPU_VERSION numpy==$NUMPY_VERSION tokamax==$TOKAMAX_VERSION"
root="$(toolchain_root probjax-tpu-toolchain "$pins" "${PROBJAX_TPU_TOOLCHAIN:-}")"

if toolchain_installed "$root" "$pins"; then
    log "reusing $root"
else
    log "installing $pins into $root (about 1 GB; minutes on a fresh machine)"
    toolchain_new_venv "$root"
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
    toolchain_mark_installed "$root" "$pins"
    log "installed"
fi

log "jax $("$root/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("jax"), "jaxlib", m.version("jaxlib"), "libtpu", m.version("libtpu"))')"
log "$(cat "$root/.tokamax")"
echo "$root"
