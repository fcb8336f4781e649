"""The training configuration: one frozen dataclass, named presets, and overrides from a file and the CLI.

Precedence, lowest first: the dataclass defaults, the preset, a JSON or YAML file (`--config`), then one
command-line flag per field (`--seq-len 4096`, `--no-tie-embeddings`, `--num-kv-heads none`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FRAMEWORKS = ("nnx", "linen", "equinox")
ATTENTION_IMPLS = ("auto", "pallas", "flex", "xla", "cudnn")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Config:
    # Model. Every framework builds the same network: pre-norm blocks of RoPE attention and a GELU MLP.
    framework: str = "nnx"  # "nnx" | "linen" | "equinox": which model file builds the network
    attention: str = "auto"  # probjax_nn impl: "auto" | "pallas" | "flex" | "xla" | "cudnn"
    vocab_size: int = 256  # byte-level tokens
    num_layers: int = 4  # transformer blocks
    d_model: int = 128  # width of the residual stream
    num_heads: int = 4  # query heads; head_dim = d_model // num_heads
    num_kv_heads: int | None = None  # key/value heads for grouped-query attention; None: num_heads
    d_ff: int | None = None  # MLP hidden width; None: 4 * d_model
    tie_embeddings: bool = True  # the output layer reuses the token embedding
    rope_theta: float = 10_000.0  # RoPE base frequency
    dtype: str = "float32"  # compute dtype; "bfloat16" computes in bf16 with float32 parameters
    # Data.
    data: str | None = None  # a text file or folder of them; None: the Python standard library's sources
    data_cache: str = "~/.cache/probjax_nn/lm_data"  # folder of token caches, one per corpus
    val_fraction: float = 0.05  # share of files held out for validation, chosen by a hash of the path
    seq_len: int = 128  # tokens per training sequence
    batch_size: int = 8  # sequences per step (the global batch when sharded)
    # Optimisation: AdamW, linear warmup then cosine decay.
    steps: int = 400  # optimiser steps; also the length of the schedule
    learning_rate: float = 4e-3  # peak learning rate, reached after warmup
    warmup_steps: int = 40  # linear warmup from 0
    min_lr_ratio: float = 0.1  # the cosine ends at learning_rate * min_lr_ratio
    weight_decay: float = 0.1  # decoupled, on matrices only (not norms)
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    grad_clip: float | None = 1.0  # clip the global gradient norm to this; None: off
    seed: int = 0  # parameters and batches; one seed gives the same run
    # Running.
    log_every: int = 10  # steps between metrics rows (train loss averaged over them)
    eval_every: int = 50  # steps between validation losses
    eval_batches: int = 4  # validation batches per evaluation (the same ones every time)
    checkpoint_every: int | None = 100  # steps between orbax checkpoints (and one at the end); None: none
    out: str = "runs/lm"  # folder for config.json, metrics.jsonl, loss.png, checkpoints/, samples.txt
    resume: bool = False  # continue from the latest checkpoint in out/checkpoints
    mesh: str | None = None  # "data=N[,seq=S][,model=M]": batch over N devices, sequence (ring) over S, heads over M
    peak_tflops: float | None = None  # device peak for MFU; None: looked up for known GPUs, n/a otherwise
    # Sampling at the end of training (and the defaults of sample.py).
    num_samples: int = 2  # samples printed at the end; 0: none
    sample_tokens: int = 200  # bytes generated per sample
    sample_prompt: str = "def "  # every sample starts with these bytes
    temperature: float = 0.8  # 0 picks the most likely byte

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def hidden_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    def __post_init__(self):
        for name, allowed in (("framework", FRAMEWORKS), ("attention", ATTENTION_IMPLS), ("dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}.")
        for name in ("num_heads", "num_kv_heads"):  # checked before they divide below
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}.")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE.")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}.")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction} must be in (0, 1).")
        if self.vocab_size < 256:
            # Tokens are bytes: an embedding lookup past the table would not fail, it would read garbage.
            raise ValueError(f"vocab_size={self.vocab_size} must be at least 256 (the tokens are bytes).")
        for name, least in _LOWER_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"{name}={value!r} must be at least {least}.")
        parse_mesh(self.mesh)


# The smallest value of each numeric field (None, where a field allows it, is always fine). Without these,
# checkpoint_every=0 failed with a ZeroDivisionError after the first step, eval_batches=0 gave a NaN
# validation loss, num_heads=0 a ZeroDivisionError and a negative temperature sampled the least likely bytes.
_LOWER_BOUNDS: dict[str, float] = {
    "num_layers": 1, "d_model": 1, "num_heads": 1, "num_kv_heads": 1, "d_ff": 1, "seq_len": 1, "batch_size": 1,
    "steps": 1, "log_every": 1, "eval_every": 1, "eval_batches": 1, "checkpoint_every": 1, "warmup_steps": 0,
    "num_samples": 0, "sample_tokens": 0, "temperature": 0.0, "learning_rate": 0.0, "min_lr_ratio": 0.0,
    "weight_decay": 0.0, "grad_clip": 0.0, "rope_theta": 0.0,
}


def parse_mesh(mesh: str | None) -> dict[str, int]:
    """`"data=2,seq=2"` as `{"data": 2, "seq": 2, "model": 1}`; every axis present (size 1 when not given)."""
    axes = {"data": 1, "seq": 1, "model": 1}
    if mesh is None:
        return axes
    for part in mesh.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in axes or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"mesh={mesh!r}: expected 'data=N,seq=S,model=M' (any of them) with sizes >= 1.")
        axes[name.strip()] = int(size)
    return axes


_BENCH = dict(
    batch_size=4, num_heads=8, num_layers=8, seq_len=4096, dtype="bfloat16", steps=1000, learning_rate=1e-3,
    warmup_steps=100, log_every=20, eval_every=200, eval_batches=4, checkpoint_every=500,
)
PRESETS: dict[str, dict[str, Any]] = {
    # About a minute on two CPU cores, compile included; the samples start to look like Python.
    "tiny": {},
    # A few minutes on a GPU.
    "small": dict(
        num_layers=6, d_model=384, num_heads=6, seq_len=256, batch_size=32, steps=3000, learning_rate=1e-3,
        warmup_steps=200, log_every=50, eval_every=250, eval_batches=8, checkpoint_every=1000,
    ),
    # The benchmark shapes: batch 4, 8 heads, head_dim 64 or 128, --seq-len 1024..8192.
    "bench-hd64": dict(_BENCH, d_model=512),
    "bench-hd128": dict(_BENCH, d_model=1024),
}


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def _convert(name: str, value: Any) -> Any:
    """A file or CLI value as the field's type; "none" (any case) is None for optional fields."""
    hint = _field_types()[name]
    optional = isinstance(hint, types.UnionType) and type(None) in hint.__args__
    if value is None or (optional and isinstance(value, str) and value.lower() == "none"):
        if not optional:
            raise ValueError(f"{name} cannot be None.")
        return None
    kind = next(t for t in typing.get_args(hint) if t is not type(None)) if optional else hint
    if kind is bool and isinstance(value, str):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"{name}={value!r} is not true or false.")
        return value.lower() == "true"
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        if not isinstance(value, str):
            raise ValueError(f"{name}={value!r} must be of type {kind.__name__}.")
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} must be of type {kind.__name__}.") from None
    return value


def make_config(preset: str = "tiny", overrides: Mapping[str, Any] | None = None) -> Config:
    """The preset's config with `overrides` (field name -> value, strings converted) on top."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not one of {', '.join(PRESETS)}.")
    values = dict(PRESETS[preset])
    for name, value in (overrides or {}).items():
        name = name.replace("-", "_")
        if name not in _field_types():
            raise ValueError(f"unknown config field {name!r}.")
        values[name] = _convert(name, value)
    return Config(**values)


def load_file(path: str | Path) -> dict[str, Any]:
    """The field -> value mapping of a JSON or YAML (.yaml / .yml) file."""
    text = Path(path).read_text()
    if Path(path).suffix in (".yaml", ".yml"):
        import yaml

        values = yaml.safe_load(text)
    else:
        values = json.loads(text)
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of config fields, got {type(values).__name__}.")
    return values


def parse_args(argv: Sequence[str] | None = None, description: str | None = None) -> Config:
    """`--preset`, `--config FILE` and one flag per `Config` field."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=tuple(PRESETS))
    parser.add_argument("--config", help="a JSON or YAML file of config fields, applied over the preset")
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if _field_types()[field.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, default=None, metavar=field.name.upper())
    args = vars(parser.parse_args(argv))
    preset, config_file = args.pop("preset"), args.pop("config")
    overrides = load_file(config_file) if config_file else {}
    overrides.update({name: value for name, value in args.items() if value is not None})
    return make_config(preset, overrides)


def to_json(config: Config) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2)


def from_json(path: str | Path) -> Config:
    """The config a run saved as out/config.json."""
    return Config(**json.loads(Path(path).read_text()))
