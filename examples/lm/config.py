"""The training configuration: one frozen dataclass, named presets, and overrides from a file and the CLI.

Precedence, lowest first: the dataclass defaults, the preset, a JSON or YAML file (`--config`), then one
command-line flag per field (`--seq-len 4096`, `--no-tie-embeddings`, `--num-kv-heads none`). A value that
cannot work is a `ConfigError` naming its field, which the scripts report as a usage error naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FRAMEWORKS = ("nnx", "linen", "equinox")
ATTENTION_IMPLS = ("auto", "pallas", "flex", "xla", "cudnn")
DTYPES = ("float32", "bfloat16")
_CHOICES = {"framework": FRAMEWORKS, "attention": ATTENTION_IMPLS, "dtype": DTYPES}


class ConfigError(ValueError):
    """A config value that cannot work; `field` is the one to change, reported as its flag (`--num-kv-heads`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


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
    overwrite: bool = False  # start afresh in an out folder that holds a run: delete that run's files first
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
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(name, f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}.")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # NaN passes every bound below (nan < x is False) and would end as NaN losses.
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(field.name, f"{field.name}={value} must be a finite number.")
        for name in ("num_heads", "num_kv_heads"):  # checked before they divide below
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(name, f"{name}={getattr(self, name)} must be at least 1.")
        if self.d_model % self.num_heads:
            raise ConfigError("d_model", f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}.")
        if self.head_dim % 2:
            raise ConfigError("d_model", f"head_dim={self.head_dim} must be even for RoPE.")
        if self.num_heads % self.kv_heads:
            message = f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}."
            raise ConfigError("num_kv_heads", message)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError("val_fraction", f"val_fraction={self.val_fraction} must be in (0, 1).")
        if self.vocab_size < 256:
            # Tokens are bytes: an embedding lookup past the table would not fail, it would read garbage.
            message = f"vocab_size={self.vocab_size} must be at least 256 (the tokens are bytes)."
            raise ConfigError("vocab_size", message)
        for name, least in _LOWER_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and value < least:
                raise ConfigError(name, f"{name}={value!r} must be at least {least}.")
        # Divisors and bases: peak_tflops 0 divided by zero after the first row (a negative one wrote a negative
        # MFU); rope_theta 0 makes every RoPE frequency infinite (NaN at step 1), and 1 makes them all equal.
        if self.peak_tflops is not None and self.peak_tflops <= 0.0:
            raise ConfigError("peak_tflops", f"peak_tflops={self.peak_tflops} must be positive (none: looked up).")
        if self.rope_theta <= 1.0:
            raise ConfigError("rope_theta", f"rope_theta={self.rope_theta} must be greater than 1 (10000 is usual).")
        if not self.sample_prompt:
            raise ConfigError("sample_prompt", "sample_prompt='' must hold at least one character.")
        check_prompt("sample_prompt", self.sample_prompt)
        if not 0 <= self.seed < 2**32:  # numpy's and jax's generators take unsigned 32-bit seeds
            raise ConfigError("seed", f"seed={self.seed} must be in [0, 2**32).")
        for name in ("beta1", "beta2"):  # 1.0 never forgets: Adam's bias correction divides by 1 - beta**t = 0
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, f"{name}={getattr(self, name)} must be in [0, 1).")
        if self.grad_clip is not None and self.grad_clip <= 0.0:  # 0 zeroes every update; off is None
            raise ConfigError("grad_clip", f"grad_clip={self.grad_clip} must be positive (none turns clipping off).")
        if self.resume and self.overwrite:
            raise ConfigError("overwrite", "resume and overwrite exclude each other: continue the run or start afresh.")
        try:
            parse_mesh(self.mesh)
        except ValueError as error:
            raise ConfigError("mesh", str(error)) from None


# The smallest value of each numeric field (None, where a field allows it, is always fine). Without these,
# checkpoint_every=0 failed with a ZeroDivisionError after the first step, eval_batches=0 gave a NaN
# validation loss, num_heads=0 a ZeroDivisionError and a negative temperature sampled the least likely bytes.
_LOWER_BOUNDS: dict[str, float] = {
    "num_layers": 1, "d_model": 1, "num_heads": 1, "num_kv_heads": 1, "d_ff": 1, "seq_len": 1, "batch_size": 1,
    "steps": 1, "log_every": 1, "eval_every": 1, "eval_batches": 1, "checkpoint_every": 1, "warmup_steps": 0,
    "num_samples": 0, "sample_tokens": 0, "temperature": 0.0, "learning_rate": 0.0, "min_lr_ratio": 0.0,
    "weight_decay": 0.0,
}


def check_prompt(field: str, prompt: str) -> bytes:
    """`prompt` as the UTF-8 bytes the model reads; a ConfigError naming `field` for text that has none (a
    lone surrogate, as Python decodes bytes that are not UTF-8 on the command line)."""
    try:
        return prompt.encode()
    except UnicodeEncodeError as error:
        bad = prompt[error.start : error.end]
        message = f"{field}={prompt!r} cannot be encoded as UTF-8 ({bad!r} at {error.start}): use UTF-8 text."
        raise ConfigError(field, message) from None


def parse_mesh(mesh: str | None) -> dict[str, int]:
    """`"data=2,seq=2"` as `{"data": 2, "seq": 2, "model": 1}`: every axis present (size 1 when not given), in
    the mesh's order, outermost first: the axes named, as named, then the others in the order data, seq,
    model. Devices are numbered process by process, so the outermost axis is the one that spans processes
    (hosts) first: `seq=2,data=2` on two hosts runs the ring between them, `data=2,seq=2` within each."""
    named: dict[str, int] = {}
    for part in [] if mesh is None else mesh.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in ("data", "seq", "model") or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"mesh={mesh!r}: expected 'data=N,seq=S,model=M' (any of them) with sizes >= 1.")
        if name in named:
            raise ValueError(f"mesh={mesh!r} names the {name} axis twice.")
        named[name] = int(size)
    return {**named, **{name: 1 for name in ("data", "seq", "model") if name not in named}}


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
    """The field -> value mapping of a JSON or YAML (.yaml / .yml) file, each value as its field's type.

    Raises OSError when the file cannot be read and ValueError (one line, naming the file) for anything else.
    """
    text = Path(path).read_text()
    try:
        if Path(path).suffix in (".yaml", ".yml"):
            import yaml

            try:
                values = yaml.safe_load(text)
            except yaml.YAMLError as error:
                raise ValueError(" ".join(str(error).split())) from None
        else:
            values = json.loads(text)
        if not isinstance(values, dict):
            raise ValueError(f"expected a mapping of config fields, got {type(values).__name__}.")
        for name in values:
            if str(name).replace("-", "_") not in _field_types():
                raise ValueError(f"unknown config field {name!r}.")
        return {name.replace("-", "_"): _convert(name.replace("-", "_"), value) for name, value in values.items()}
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def make_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`--preset`, `--config FILE` and one flag per `Config` field; a flag's value is converted (and its type
    checked) as argparse parses it, and a flag not given is absent from the result."""
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--preset NAME] [--config FILE] [--FIELD VALUE ...]  (-h lists the fields)",
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="tiny", choices=tuple(PRESETS))
    parser.add_argument("--config", help="a JSON or YAML file of config fields, applied over the preset")
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if _field_types()[field.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        elif field.name in _CHOICES:
            parser.add_argument(flag, choices=_CHOICES[field.name], default=argparse.SUPPRESS)
        else:
            parser.add_argument(
                flag, type=functools.partial(_flag_value, field.name), default=argparse.SUPPRESS,
                metavar=field.name.upper(),
            )
    group = parser.add_argument_group(
        "multi-process runs (jax.distributed; docs/examples.md)",
        "--distributed alone lets jax.distributed.initialize() detect the cluster (SLURM, Open MPI, Kubernetes); "
        "elsewhere give all three of the others (scripts/launch_local.sh does, on one machine).",
    )
    group.add_argument("--distributed", action="store_true", help="this is one process of several")
    group.add_argument("--coordinator-address", metavar="HOST:PORT", help="where process 0 listens")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    group.add_argument(
        "--startup-timeout", type=int, default=300, metavar="SECONDS",
        help="how long a process waits for the others to join (default 300)",
    )
    return parser


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins a multi-process run. Not part of the run's config: it differs from process to
    process and may change on resume (another cluster, another number of hosts)."""

    distributed: bool = False  # one process of several (jax.distributed); the three below imply it
    coordinator_address: str | None = None  # "host:port" of process 0; None: detected from the cluster
    num_processes: int | None = None  # None: detected
    process_id: int | None = None  # None: detected
    startup_timeout: int = 300  # seconds a process waits for the others to join

    def check(self) -> None:
        """Raises ConfigError unless the three values are all given (and agree) or all left to detection."""
        given = {
            "coordinator_address": self.coordinator_address, "num_processes": self.num_processes,
            "process_id": self.process_id,
        }
        missing = [name for name, value in given.items() if value is None]
        if 0 < len(missing) < len(given):
            message = (f"give all of --coordinator-address, --num-processes and --process-id, or none (the cluster's "
                       f"own variables), not only some; {', '.join(missing)} missing.")
            raise ConfigError(missing[0], message)
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError("num_processes", f"num_processes={self.num_processes} must be at least 1.")
        if self.process_id is not None and not 0 <= self.process_id < self.num_processes:
            message = f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})."
            raise ConfigError("process_id", message)
        address = self.coordinator_address
        if address is not None:
            host, _, port = address.rpartition(":")
            if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
                message = f"coordinator_address={address!r} must be HOST:PORT with a port in 1..65535 (10.0.0.1:1234)."
                raise ConfigError("coordinator_address", message)
        if self.startup_timeout < 1:
            raise ConfigError("startup_timeout", f"startup_timeout={self.startup_timeout} must be at least 1 second.")


def _flag_value(name: str, text: str) -> Any:
    try:
        return _convert(name, text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> Config:
    """The config of a command line (`make_parser`'s flags); a value that cannot work exits as a usage error
    (status 2, one line naming the flag), as argparse does for the flags it checks itself."""
    return parse_command(argv, parser)[0]


def parse_command(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> tuple[Config, Launch]:
    """`parse_args`, and how this process joins a multi-process run."""
    parser = make_parser() if parser is None else parser
    args = vars(parser.parse_args(argv))
    launch = Launch(**{field.name: args.pop(field.name) for field in dataclasses.fields(Launch)})
    launch = dataclasses.replace(launch, distributed=launch.distributed or launch.num_processes is not None)
    try:
        launch.check()
    except ConfigError as error:
        parser.error(f"argument {error.flag}: {error}")
    preset, config_file = args.pop("preset"), args.pop("config")
    values = {}
    if config_file is not None:
        try:
            values = load_file(config_file)
        except OSError as error:
            parser.error(f"argument --config: can't read {config_file!r}: {error.strerror}")
        except ValueError as error:
            parser.error(f"argument --config: {error}")
    try:
        return make_config(preset, {**values, **args}), launch
    except ConfigError as error:
        parser.error(f"argument {error.flag}: {error}")


def to_json(config: Config) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2)


def from_json(path: str | Path) -> Config:
    """The config a run saved as out/config.json."""
    return Config(**json.loads(Path(path).read_text()))


# What a checkpoint's params and optimiser state are shaped by, and what makes them another network; the
# attribute compared, so that num_kv_heads=None and num_kv_heads=num_heads count as the same.
_ARCHITECTURE = {
    "framework": "framework", "vocab_size": "vocab_size", "num_layers": "num_layers", "d_model": "d_model",
    "num_heads": "num_heads", "num_kv_heads": "kv_heads", "d_ff": "hidden_dim", "tie_embeddings": "tie_embeddings",
    "rope_theta": "rope_theta",
}


def resume_conflicts(saved: Config, config: Config) -> list[str]:
    """The differences ("num_layers 2 -> 3") that keep `config` from resuming the run that saved `saved`.
    Anything else (steps, the learning rate, the data, the mesh, the attention impl) may change."""
    conflicts = [
        f"{name} {getattr(saved, attribute)!r} -> {getattr(config, attribute)!r}"
        for name, attribute in _ARCHITECTURE.items() if getattr(saved, attribute) != getattr(config, attribute)
    ]
    if (saved.grad_clip is None) != (config.grad_clip is None):  # clipping has a state of its own in the optimiser's
        conflicts.append(f"grad_clip {saved.grad_clip!r} -> {config.grad_clip!r}")
    return conflicts


def finite_float(text: str) -> float:
    """An argparse `type` for float flags that rejects NaN and infinities."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value
