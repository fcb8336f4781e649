"""Train a byte-level decoder-only transformer with probjax_nn attention, in Flax NNX, Flax Linen or Equinox.

    .venv/bin/python examples/train_lm.py --preset tiny --out runs/tiny            # about a minute on a CPU
    .venv/bin/python examples/train_lm.py --preset bench-hd128 --seq-len 8192 --attention pallas --out runs/hd128
    .venv/bin/python examples/train_lm.py --framework equinox --config my.yaml --steps 500 --resume

Presets: tiny, small, bench-hd64, bench-hd128 (batch 4, 8 heads, head_dim 64 / 128). A JSON or YAML file
(--config) overrides the preset, and every flag overrides both. Writes config.json, metrics.jsonl, loss.png,
samples.txt and checkpoints/ to --out. An --out folder that holds a run needs --resume (continue it) or
--overwrite (start it afresh). docs/examples.md has the details.

Across several processes (one per host, or several on one machine: scripts/launch_local.sh), each process
runs this script with the same flags plus how it joins the run:

    srun python examples/train_lm.py --mesh data=16 ...                        # SLURM, Open MPI: detected
    python examples/train_lm.py --distributed --mesh data=16 ...               # Kubernetes
    python examples/train_lm.py --coordinator-address HOST0:1234 --num-processes 2 --process-id I --mesh data=16 ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lm.config import ConfigError, make_parser, parse_command  # noqa: E402
from lm.distributed import start_distributed  # noqa: E402
from lm.train import NonFiniteLoss, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__)
    config, launch = parse_command(argv, parser)
    try:
        start_distributed(launch)
        run(config)
    except ConfigError as error:  # found by the checks that run before anything is written
        parser.error(f"argument {error.flag}: {error}")
    except NonFiniteLoss as error:
        sys.exit(str(error))


if __name__ == "__main__":
    main()
