"""The config a run stores (the seed's keys, in its order) and the command that measures its grid again.

Its own module because both sides need it and `_cli` already imports `_plot` (for `plot FILE`): `_cli` writes
the config from its flags, `_plot` quotes the command in the summary.
"""

from __future__ import annotations

CONFIG_KEYS = (
    "output", "batch", "heads", "head_dims", "seq_lens", "ragged_seq_lens", "dtypes", "modes", "causal", "impls",
    "append", "tag",
)


def command_line(config: dict) -> str:
    """A command that measures the grid of `config` (without --append)."""
    words = ["python", "-m", "probjax_nn.benchmark"]
    for key, value in config.items():
        if key == "append" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return " ".join(words)
