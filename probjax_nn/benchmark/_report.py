"""The report a run writes, as both sides read it: the config keys (the seed's, in its order), the command
that measures a config's grid again, and `load_report`, which reads and checks a report file.

Its own module because both sides need it and `_cli` already imports `_plot` (for `plot FILE`): `_cli` writes
the config from its flags and reloads a report with --append, `_plot` reads the report and quotes the
command in the summary.
"""

from __future__ import annotations

import json
import pathlib

CONFIG_KEYS = (
    "output", "batch", "heads", "head_dims", "seq_lens", "ragged_seq_lens", "dtypes", "modes", "causal", "impls",
    "append", "tag",
)


# The decode benchmark's flags, from the config keys that hold them (`_decode.run` writes the config).
DECODE_FLAGS = (
    ("output", "--output"), ("batch", "--batch"), ("seq_lens", "--cache-lens"), ("heads", "--heads"),
    ("head_dims", "--head-dim"), ("new_tokens", "--new-tokens"), ("page_sizes", "--page-sizes"),
    ("dtypes", "--dtypes"), ("impls", "--impls"), ("tag", "--tag"),
)


def is_decode(config: dict) -> bool:
    return config.get("modes") == ["decode"]


def command_line(config: dict) -> str:
    """A command that measures the grid of `config` (without --append): `decode` and its flags for a decode
    report."""
    words = ["python", "-m", "probjax_nn.benchmark"]
    if is_decode(config):
        words.append("decode")
        items = [(flag, config.get(key)) for key, flag in DECODE_FLAGS]
    else:
        items = [("--" + key.replace("_", "-"), value) for key, value in config.items() if key != "append"]
    for flag, value in items:
        if value is None:
            continue
        words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return " ".join(words)


def load_report(path: pathlib.Path) -> dict:
    """The benchmark JSON at `path`: an object with device, config and results. Raises OSError when it cannot
    be read and ValueError, with a one-line reason, when it is not such a file."""
    try:
        report = json.loads(path.read_text())
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not JSON ({error})") from None
    kinds = {"device": dict, "config": dict, "results": list}
    if not isinstance(report, dict) or not all(isinstance(report.get(key), kind) for key, kind in kinds.items()):
        raise ValueError(f"{path} is not a benchmark report (an object with device, config and results)")
    return report
