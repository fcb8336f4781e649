#!/usr/bin/env bash
# The former name of scripts/compile_check.sh (the compile check for every target), kept so that commands
# written before the rename still run. Same arguments.
exec bash "$(dirname "${BASH_SOURCE[0]}")/compile_check.sh" "$@"
