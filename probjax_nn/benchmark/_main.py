"""The entry point: `decode ...` runs the decode benchmark (`_decode`), `cpu ...` impl "auto" beside jax.nn on
the CPU (`_cpu`), anything else the attention benchmark and its `plot` subcommand (`_cli`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from probjax_nn.benchmark import _cli, _cpu, _decode


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["decode"]:
        return _decode.decode_main(argv[1:])
    if argv[:1] == ["cpu"]:
        return _cpu.cpu_main(argv[1:])
    return _cli.main(argv)
