# Sourced by gpu_toolchain.sh and tpu_toolchain.sh: the cache folder of a pinned toolchain and its fresh venv.
# The caller sets `log` and runs from the repository root.

# toolchain_root CACHE_NAME PINS [OVERRIDE]: OVERRIDE if set, else the cache folder named by the pins' hash
# (${XDG_CACHE_HOME:-$HOME/.cache}/CACHE_NAME/<12 hex digits>), so a change of pins installs afresh.
toolchain_root() {
    local hash
    hash="$(echo "$2" | sha256sum | cut -c1-12)"
    echo "${3:-${XDG_CACHE_HOME:-$HOME/.cache}/$1/$hash}"
}

# toolchain_installed ROOT PINS: true when ROOT holds a finished install of exactly these pins.
toolchain_installed() {
    [[ -f "$1/.installed" && "$(cat "$1/.installed")" == "$2" ]]
}

# toolchain_mark_installed ROOT PINS: written last, so an interrupted install is redone next time.
toolchain_mark_installed() {
    echo "$2" >"$1/.installed"
}

# toolchain_new_venv ROOT: empties ROOT and makes ROOT/venv from the base interpreter of the repo's .venv
# (scripts/setup.sh finds the Python 3.12 it holds), with an up-to-date pip.
toolchain_new_venv() {
    if [[ ! -x .venv/bin/python ]]; then
        log "no .venv: run 'bash scripts/setup.sh' first (it finds the Python 3.12 this uses)"
        exit 1
    fi
    local python
    python="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
    rm -rf "$1"
    mkdir -p "$1"
    "$python" -m venv "$1/venv"
    "$1/venv/bin/python" -m pip install --quiet --upgrade pip
}
