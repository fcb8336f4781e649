#!/usr/bin/env bash
# Create (or reuse) the repo's Python 3.12 virtual environment in .venv and install probjax-nn[dev] into it,
# editable. Safe to rerun: it does nothing when .venv already holds an install of the current pyproject.toml.
# Usage, from any directory: bash scripts/setup.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo_root="$(pwd -P)"
venv=".venv"
stamp="$venv/.probjax-setup"

is_python312() {
    "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1
}

# Prints the path of a working Python 3.12 interpreter, or fails.
find_python312() {
    # A pyenv shim named python3.12 exists even when pyenv's active version is not 3.12 (then it fails to
    # run), so test the command and resolve it to the real interpreter.
    if command -v python3.12 >/dev/null 2>&1 && is_python312 python3.12; then
        python3.12 -c 'import sys; print(sys.executable)'
        return
    fi
    local roots=()
    if command -v pyenv >/dev/null 2>&1; then
        roots+=("$(pyenv root)")
    fi
    roots+=("$HOME/.pyenv")
    local root candidate
    for root in "${roots[@]}"; do
        # Newest 3.12.x first.
        for candidate in $(printf '%s\n' "$root"/versions/3.12.*/bin/python3.12 | sort -V -r); do
            if [[ -x "$candidate" ]] && is_python312 "$candidate"; then
                echo "$candidate"
                return
            fi
        done
    done
    echo "setup.sh: no Python 3.12 found (looked for python3.12 on PATH and in pyenv's versions/3.12.*)." >&2
    echo "setup.sh: install one, e.g. 'pyenv install 3.12', and rerun." >&2
    return 1
}

if [[ -x "$venv/bin/python" ]] && is_python312 "$venv/bin/python"; then
    echo "setup.sh: reusing $repo_root/$venv ($("$venv/bin/python" --version))"
else
    python="$(find_python312)"
    if [[ -e "$venv" ]]; then
        echo "setup.sh: $venv is not a working Python 3.12 environment; recreating it"
        rm -rf "$venv"
    fi
    echo "setup.sh: creating $repo_root/$venv with $python"
    "$python" -m venv "$venv"
fi

# The stamp records what was installed: the build metadata and where the editable install points.
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $repo_root"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
    && "$venv/bin/python" -m pip show -q probjax-nn >/dev/null 2>&1; then
    echo "setup.sh: probjax-nn[dev] already installed; nothing to do"
    exit 0
fi

rm -f "$stamp"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet -e ".[dev]"
echo "$want" >"$stamp"
echo "setup.sh: installed probjax-nn[dev] (editable) into $repo_root/$venv"
