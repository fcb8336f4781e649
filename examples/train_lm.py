"""Train a byte-level decoder-only transformer with probjax_nn attention, in Flax NNX, Flax Linen or Equinox.

    .venv/bin/python examples/train_lm.py --preset tiny --out runs/tiny            # about a minute on a CPU
    .venv/bin/python examples/train_lm.py --preset bench-hd128 --seq-len 8192 --attention pallas --out runs/hd128
    .venv/bin/python examples/train_lm.py --framework equinox --config my.yaml --steps 500 --resume

Presets: tiny, small, bench-hd64, bench-hd128 (batch 4, 8 heads, head_dim 64 / 128). A JSON or YAML file
(--config) overrides the preset, and every flag overrides both. Writes config.json, metrics.jsonl, loss.png,
samples.txt and checkpoints/ to --out. An --out folder that holds a run needs --resume (continue it) or
--overwrite (start it afresh). docs/examples.md has the details.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lm.config import ConfigError, make_parser, parse_args  # noqa: E402
from lm.train import NonFiniteLoss, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__)
    try:
        run(parse_args(argv, parser))
    except ConfigError as error:  # found by the checks that run before anything is written
        parser.error(f"argument {error.flag}: {error}")
    except NonFiniteLoss as error:
        sys.exit(str(error))


if __name__ == "__main__":
    main()
