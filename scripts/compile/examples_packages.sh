#!/usr/bin/env bash
# Adds the LM example's packages (the versions the project's .venv runs the examples with) to a compile
# toolchain's Python, once (a stamp file beside its venv), keeping its jax as it is: the pod-slice step
# (tpu_slices.sh) and the serving-step rows of the GPU and TPU compile reports import examples/lm.
# Usage: bash scripts/compile/examples_packages.sh TOOLCHAIN_DIR   (its venv/bin/python gets them)
set -euo pipefail
EXAMPLES="flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8 equinox==0.13.8 jaxtyping==0.3.11 tqdm==4.70.1 PyYAML==6.0.4"
toolchain="$1"
python="$toolchain/venv/bin/python"
stamp="$toolchain/.examples"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$EXAMPLES" ]]; then
    echo "examples_packages.sh: adding the examples' packages to $toolchain/venv: $EXAMPLES" >&2
    # The toolchain's jax stays as it is: a constraint, not an upgrade.
    jax_pin="jax==$("$python" -c 'import jax; print(jax.__version__)')"
    # shellcheck disable=SC2086
    "$python" -m pip install --quiet $EXAMPLES "$jax_pin"
    echo "$EXAMPLES" > "$stamp"
fi
