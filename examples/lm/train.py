"""The training loop: data -> model -> jit-compiled train / eval steps -> metrics, checkpoints -> samples.

Whatever the framework, the loop sees a `LanguageModel`: a params pytree and pure functions over it. The
optimiser is optax AdamW with linear warmup, cosine decay and global-norm clipping. With `dtype="bfloat16"`
the float32 params are cast to bfloat16 inside the step (the gradient flows back to float32).

The same loop runs as one process of several (`jax.distributed`, `start_distributed`): the mesh then spans
every process's devices, each process feeds only the rows of the batch that its own devices hold, and only
process 0 prints and writes the run's files (checkpoints are written by all, each its own shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from lm import data
from lm.checkpoint import Checkpoints, committed_steps
from lm.common import LanguageModel, Params
from lm.config import Config, ConfigError, from_json, parse_mesh, resume_conflicts, to_json
from lm.distributed import Preemption, agree, check_shared_out, is_primary, same_config, start_distributed, sync
from lm.sampling import generate

# What a run writes into its out folder; a folder holding any of them is a used one.
RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "samples.txt", "checkpoints")
# Dense bfloat16 peak FLOP/s (SXM parts) by device kind; --peak-tflops covers the rest.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def build_model(config: Config, key: jax.Array) -> LanguageModel:
    """The network of `config.framework`, its model file imported only when asked for."""
    return importlib.import_module(f"lm.model_{config.framework}").build(config, key)


def compute_params(params: Params, config: Config) -> Params:
    """The params in the compute dtype (a no-op for float32)."""
    dtype = jnp.dtype(config.dtype)
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def make_optimizer(config: Config) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.min_lr_ratio,
    )
    adamw = optax.adamw(
        schedule, config.beta1, config.beta2, weight_decay=config.weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),  # matrices decay, norm scales do not
    )
    return adamw if config.grad_clip is None else optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)


def flops_per_token(config: Config, num_params: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's scores and
    weighted sum, 12 * layers * heads * head_dim * seq_len, halved because causal attention skips half."""
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * config.seq_len / 2
    return 6 * num_params + attention


def peak_flops(config: Config, num_devices: int) -> float | None:
    """The peak FLOP/s of `num_devices` devices together, or None where unknown (CPU: MFU is n/a)."""
    if config.peak_tflops is not None:
        return config.peak_tflops * 1e12 * num_devices
    kind = jax.devices()[0].device_kind
    return next((peak * num_devices for name, peak in _PEAK_FLOPS.items() if name in kind), None)


def make_mesh(config: Config) -> jax.sharding.Mesh | None:
    """The mesh of `config.mesh` (axes "data", "seq", "model", outermost first as `parse_mesh` orders them), or
    None to run on the default device."""
    if config.mesh is None:
        if jax.process_count() > 1:  # each process would train a model of its own on its own devices
            raise ConfigError(
                "mesh", f"a run of {jax.process_count()} processes needs --mesh over their {len(jax.devices())} "
                f"devices (for example --mesh data={len(jax.devices())}).",
            )
        return None
    axes = parse_mesh(config.mesh)
    size = axes["data"] * axes["seq"] * axes["model"]
    if size > len(jax.devices()):
        where = "this machine has" if jax.process_count() == 1 else f"the {jax.process_count()} processes have"
        raise ConfigError("mesh", f"mesh={config.mesh!r} needs {size} devices, {where} {len(jax.devices())}.")
    if jax.process_count() > 1 and size != len(jax.devices()):
        # A smaller mesh would leave out the devices of the last processes, which then have nothing to run.
        raise ConfigError(
            "mesh", f"mesh={config.mesh!r} has {size} devices; a run of {jax.process_count()} processes needs all "
            f"{len(jax.devices())} of theirs (for example --mesh data={len(jax.devices())}).",
        )
    if config.batch_size % axes["data"]:
        message = f"batch_size={config.batch_size} must be a multiple of the data axis, {axes['data']}."
        raise ConfigError("batch_size", message)
    if config.seq_len % axes["seq"]:
        raise ConfigError("seq_len", f"seq_len={config.seq_len} must be a multiple of the seq axis, {axes['seq']}.")
    for name in ("num_heads", "kv_heads", "hidden_dim"):
        if getattr(config, name) % axes["model"]:
            message = f"{name}={getattr(config, name)} must be a multiple of the model axis, {axes['model']}."
            raise ConfigError("mesh", message)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * 3)


def spanning_axes(mesh: jax.sharding.Mesh) -> list[str]:
    """The mesh axes along which devices of different processes (hosts) meet: their collectives leave the host."""
    processes = np.vectorize(lambda device: device.process_index)(mesh.devices)
    return [name for axis, name in enumerate(mesh.axis_names) if np.any(np.diff(processes, axis=axis))]


def loss_fn(model: LanguageModel, config: Config, params: Params, batch: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of `batch` `[B, T + 1]`."""
    logits = model.apply(compute_params(params, config), batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


class Metrics:
    """`out/metrics.jsonl`, one JSON row per log step; a resumed run keeps the rows up to its step. Only
    process 0 of a multi-process run writes the file (the others keep the rows in memory)."""

    def __init__(self, path: Path, rows: list[dict], start_step: int, write: bool = True):
        self.path, self.write = path, write
        self.rows = [row for row in rows if row["step"] <= start_step]
        if write:
            path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))

    @staticmethod
    def read(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @staticmethod
    def read_for_resume(path: Path) -> tuple[list[dict], str | None]:
        """The rows of a run to resume, and a note when a last row cut short by a kill was dropped (rows past
        the checkpoint are dropped anyway; a row is written before its step's checkpoint). Raises ConfigError
        for a file that is damaged elsewhere."""
        if not path.exists():
            return [], None
        text = path.read_text(errors="replace")
        lines = text.splitlines()
        rows, note = [], None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
                continue
            except json.JSONDecodeError:
                if number == len(lines) and not text.endswith("\n"):
                    note = f"dropped the last line of {path}, cut short: {line[:60]!r}"
                    continue
            message = f"{path} line {number} is not a metrics row ({line[:60]!r}): repair it, or --overwrite."
            raise ConfigError("resume", message)
        return rows, note

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if self.write:
            with self.path.open("a") as file:
                file.write(json.dumps(row, allow_nan=False) + "\n")  # NaN is not JSON; run() stops before one


def plot_losses(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], label="train")
    validation = [r for r in rows if r["val_loss"] is not None]
    axes.plot([r["step"] for r in validation], [r["val_loss"] for r in validation], "o-", label="validation")
    axes.set(xlabel="step", ylabel="loss (nats per byte)", title=title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@dataclasses.dataclass(frozen=True)
class Shardings:
    """Where params, optimiser state and batches live on a mesh; all None without one."""

    params: Any = None
    opt_state: Any = None
    batch: NamedSharding | None = None

    @classmethod
    def on(cls, mesh: jax.sharding.Mesh | None, model: LanguageModel, optimizer: optax.GradientTransformation):
        if mesh is None:
            return cls()
        params = jax.tree.map(lambda _, spec: NamedSharding(mesh, spec), model.params, model.partition(model.params))
        # Adam's moments follow their parameters; the step count is replicated.
        opt_state = optax.tree_utils.tree_map_params(
            optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, model.params), params,
            transform_non_params=lambda _: NamedSharding(mesh, P()),
        )
        return cls(params, opt_state, NamedSharding(mesh, P("data", None)))

    def place(self, batch: np.ndarray) -> jax.Array:
        """A whole batch held by this process, on the mesh (single-process runs and tests)."""
        return jnp.asarray(batch) if self.batch is None else jax.device_put(batch, self.batch)

    def feed(self, tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> jax.Array:
        """The batch of windows at `starts` (`data.windows`), each device's rows read by the process that owns
        the device: no process reads the rows of another's devices or holds the global batch."""
        if self.batch is None:
            return jnp.asarray(data.windows(tokens, starts, seq_len))
        return jax.make_array_from_callback(
            (len(starts), seq_len + 1), self.batch, lambda index: data.windows(tokens, starts[index[0]], seq_len)
        )


def make_steps(model: LanguageModel, optimizer: optax.GradientTransformation, config: Config, shardings: Shardings):
    """The jit-compiled `train_step(params, opt_state, batch) -> (params, opt_state, loss)` and
    `eval_step(params, batch) -> loss`."""
    loss = functools.partial(loss_fn, model, config)

    @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=(shardings.params, shardings.opt_state, None))
    def train_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return train_step, jax.jit(loss)


class NonFiniteLoss(RuntimeError):
    """The loss turned NaN or infinite: the run stopped, keeping the rows and checkpoints from before it."""


def check_out(config: Config) -> Path:
    """The run's out folder, once it is clear that this run may write there (it writes nothing).

    A folder that holds any of `RUN_FILES` is a used one: only `resume` (with the architecture it was trained
    with) or `overwrite` may write into it. An empty or new folder is fine.
    """
    out = Path(config.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"{out} is a file, not a folder.")
    _check_writable(out)
    used = [name for name in RUN_FILES if (out / name).exists()]
    if used and not (config.resume or config.overwrite):
        raise ConfigError(
            "out", f"{out} holds a run ({', '.join(used)}): pass --resume to continue it or --overwrite to start "
            "it afresh.",
        )
    if config.resume and (out / "config.json").exists():
        try:
            saved = from_json(out / "config.json")
        except (OSError, ValueError, TypeError) as error:
            raise ConfigError("resume", f"cannot read {out / 'config.json'}: {error}") from None
        conflicts = resume_conflicts(saved, config)
        if conflicts:
            raise ConfigError(
                "resume", f"the run in {out} has another architecture ({', '.join(conflicts)}): resume it with its "
                "own values, or start afresh with --overwrite.",
            )
    if config.resume and not committed_steps(out / "checkpoints"):
        unfinished = sorted((out / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
        there = [*used, *(f"an unfinished checkpoint {path.name}" for path in unfinished)]
        holds = "does not exist" if not out.exists() else f"holds {', '.join(there)}" if there else "is empty"
        raise ConfigError(
            "resume", f"{out} holds no checkpoint to resume ({out} {holds}): run without --resume to start "
            f"afresh{' with --overwrite' if used else ''}.",
        )
    return out


def _check_writable(out: Path) -> None:
    """Raises ConfigError unless `out` can be created and written (its nearest existing folder takes a file;
    the probe is an unnamed temporary file, so nothing is left behind)."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("out", f"cannot create {out}: {existing} is a file.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError("out", f"cannot write to {out}: {error.strerror or error} ({existing}).") from None


def check_backend(config: Config) -> None:
    """Raises ConfigError for an attention impl that this machine's devices cannot run."""
    if config.attention == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(
            "attention", f"attention='cudnn' needs an NVIDIA GPU; this run's devices are {jax.default_backend()} "
            "(use auto, pallas, flex or xla).",
        )


def load_data(config: Config) -> tuple[np.ndarray, np.ndarray]:
    """`data.load_tokens`, its failures as the ConfigError of the field to change."""
    try:
        train_tokens, val_tokens = data.load_tokens(config)
    except FileNotFoundError as error:
        raise ConfigError("data", str(error)) from None
    for split, tokens in (("train", train_tokens), ("validation", val_tokens)):
        if len(tokens) <= config.seq_len + 1:
            message = f"the {split} split has {len(tokens)} tokens, too few for seq_len={config.seq_len}."
            raise ConfigError("seq_len", message)
    return train_tokens, val_tokens


def _restore_rows(rows: list[dict], saved: list[dict] | None, start: int) -> tuple[list[dict], str | None]:
    """The metrics rows up to step `start` of a resumed run: those of metrics.jsonl (`rows`), with the rows that
    the checkpoint of `start` saved (`saved`; None for a checkpoint without them) where metrics.jsonl lost
    them, and a line naming the steps restored."""
    if saved is None:
        return rows, None
    have = {row["step"] for row in rows if row["step"] <= start}
    missing = [row for row in saved if row["step"] not in have]
    if not missing:
        return rows, None
    merged = sorted([row for row in rows if row["step"] <= start] + missing, key=lambda row: row["step"])
    steps = ", ".join(str(row["step"]) for row in missing)
    return merged, f"metrics.jsonl lacked the rows of steps {steps}: restored them from the checkpoint of step {start}"


def _first_non_finite(losses: list, last_step: int) -> tuple[int, float] | None:
    """(step, loss) of the first non-finite one of `losses`, the losses of the steps up to `last_step`."""
    values = np.asarray(jax.device_get(losses), np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    return None if bad.size == 0 else (last_step - len(values) + 1 + int(bad[0]), float(values[bad[0]]))


def run(config: Config, *, stop_after: int | None = None) -> list[dict]:
    """Trains as `config` says and returns the metrics rows (also in `config.out`/metrics.jsonl).

    Everything that can be checked is checked before anything is written (the out folder, the data, the
    mesh, the architecture of a run to resume, its metrics and which checkpoint restores): those failures
    raise `ConfigError` and leave the folder as it was. A loss that turns NaN or infinite stops the run with
    `NonFiniteLoss`; its row is not written, and the checkpoints of the weights that gave it are deleted.
    `stop_after` ends the run after that step as a kill would (no final checkpoint, plot or samples), for
    testing `resume`. In a multi-process run every process calls this with the same config (checked: a
    ConfigError names the flag that differs); a check that fails on any process raises on every process,
    and the out folder must be one that all of them share. A TERM or INT signal stops the run after a step
    that every process agrees on, with a checkpoint of that step (`Preemption`; more of them during the save
    are ignored); it then returns the rows so far.
    """
    # Every process checks, then all agree: one that fails alone would leave the others waiting for it.
    same_config(config)
    failure = None
    try:
        out = check_out(config)
        rows, note = Metrics.read_for_resume(out / "metrics.jsonl") if config.resume else ([], None)
        train_tokens, val_tokens = load_data(config)
        mesh = make_mesh(config)
        check_backend(config)
    except ConfigError as error:
        failure = error
    agree(failure)
    check_shared_out(out)
    val_starts = data.validation_starts(val_tokens, config)
    model = build_model(config, jax.random.key(config.seed))
    optimizer = make_optimizer(config)
    num_params = sum(x.size for x in jax.tree.leaves(model.params))
    primary = is_primary()
    say = print if primary else lambda *args, **kwargs: None
    sync("checked")  # every process has read the folder before process 0 changes it
    if primary:
        if config.overwrite:
            for name in RUN_FILES:
                path = out / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        out.mkdir(parents=True, exist_ok=True)
    sync("cleared")
    processes = ""
    if jax.process_count() > 1:
        spanning = ",".join(spanning_axes(mesh)) if mesh is not None else "none"
        processes = f" in {jax.process_count()} processes (mesh axes across processes: {spanning})"
    say(
        f"{config.framework} model, {num_params / 1e6:.2f}M params, attention={config.attention}, "
        f"{config.num_layers} layers x {config.num_heads} heads x head_dim {config.head_dim}, "
        f"batch {config.batch_size} x seq {config.seq_len}, {config.dtype}, devices: {jax.devices()[0].device_kind}"
        f" x {1 if mesh is None else mesh.size}{processes}; {len(train_tokens) / 1e6:.1f}M train / "
        f"{len(val_tokens) / 1e6:.1f}M validation bytes"
    )

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        shardings = Shardings.on(mesh, model, optimizer)
        params = model.params if mesh is None else jax.device_put(model.params, shardings.params)
        opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
        checkpoints = Checkpoints(out / "checkpoints")
        start, pending_losses = 0, []
        if config.resume:
            skipped: list[str] = []
            restored = checkpoints.restore_newest(params, opt_state, skipped=skipped)
            for line in skipped:
                say(f"cannot restore the checkpoint of {line}")
            if restored is None:
                checkpoints.close()
                raise ConfigError(
                    "resume", f"no checkpoint in {out / 'checkpoints'} restores ({'; '.join(skipped)}): start afresh "
                    "with --overwrite.",
                )
            start, params, opt_state = restored
            if start > config.steps:  # nothing to train; the run (config.json, its checkpoints) stays as it is
                checkpoints.close()
                say(f"the run in {out} is already at step {start}, past --steps {config.steps}: nothing to do, left "
                    f"as it was (resume with --steps above {start} to train on)")
                return rows
            pending_losses, saved_rows = checkpoints.progress(start)
            rows, restored_note = _restore_rows(rows, saved_rows, start)
            if skipped:  # orbax saves no step at or below its latest: the broken ones must go
                checkpoints.drop_from(start + 1)
                say(f"resumed from step {start}, the newest checkpoint that restores; deleted the newer ones")
            else:
                say(f"resumed from step {start}")
            for line in (note, restored_note):
                if line is not None:
                    say(line)
        # resume and overwrite are what this command did, not part of the run: a later --config of this file
        # must not delete the folder.
        if primary:
            (out / "config.json").write_text(to_json(dataclasses.replace(config, resume=False, overwrite=False)))
        metrics = Metrics(out / "metrics.jsonl", rows, start, write=primary)
        train_step, eval_step = make_steps(model, optimizer, config, shardings)

        def evaluate(params) -> float:
            losses = [eval_step(params, shardings.feed(val_tokens, starts, config.seq_len)) for starts in val_starts]
            return float(np.mean(losses))

        def stop(step: int, kind: str, value: float, bad_weights: int) -> NonFiniteLoss:
            """Deletes the checkpoints of step `bad_weights` and later (the weights that gave `value`)."""
            checkpoints.drop_from(bad_weights)
            kept = checkpoints.latest_step()
            kept = "no checkpoint is left" if kept is None else f"the checkpoint of step {kept} is the latest"
            return NonFiniteLoss(
                f"step {step}: the {kind} loss is {value}; stopped. metrics.jsonl ends before it and {kept} "
                f"(lower --learning-rate and --resume, or start afresh with --overwrite)."
            )

        flops, peak = flops_per_token(config, num_params), peak_flops(config, 1 if mesh is None else mesh.size)
        last = config.steps if stop_after is None else min(stop_after, config.steps)
        bar = tqdm(
            total=config.steps, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0, disable=not primary
        )
        # Since the last metrics row; a resumed run starts with the losses its checkpoint kept of them.
        losses, timer, timed_steps = list(pending_losses), None, 0
        stopped = None  # the step after which a TERM stopped the run
        preemption = Preemption().install()
        try:
            for step in range(start + 1, last + 1):
                batch = shardings.feed(train_tokens, data.train_starts(train_tokens, config, step), config.seq_len)
                params, opt_state, loss = train_step(params, opt_state, batch)
                losses.append(loss)
                if timer is None:  # the first step compiles: time from its end
                    loss.block_until_ready()
                    timer = time.perf_counter()
                else:
                    timed_steps += 1
                bar.update()
                is_eval = step % config.eval_every == 0 or step == config.steps
                every = config.checkpoint_every
                is_checkpoint = every is not None and (step % every == 0 or step == config.steps)
                if step % config.log_every == 0 or is_eval or is_checkpoint:
                    # The loss of step s is that of the weights after step s - 1.
                    bad = _first_non_finite(losses, step)  # waits for the steps to finish
                    if bad is not None:
                        raise stop(bad[0], "train", bad[1], bad_weights=bad[0] - 1)
                if step % config.log_every == 0 or is_eval:
                    train_loss = float(np.mean(jax.device_get(losses)))
                    tokens_per_s = timed_steps * config.batch_size * config.seq_len / (time.perf_counter() - timer)
                    tokens_per_s = tokens_per_s if timed_steps else None
                    mfu = None if peak is None or tokens_per_s is None else flops * tokens_per_s / peak
                    val_loss = evaluate(params) if is_eval else None
                    if val_loss is not None and not math.isfinite(val_loss):
                        raise stop(step, "validation", val_loss, bad_weights=step)
                    metrics.append(dict(
                        step=step, train_loss=train_loss, val_loss=val_loss, tokens_per_s=tokens_per_s, mfu=mfu,
                    ))
                    bar.set_postfix(
                        loss=f"{train_loss:.3f}", tok_s="n/a" if tokens_per_s is None else f"{tokens_per_s:,.0f}",
                        mfu="n/a" if mfu is None else f"{mfu:.1%}",
                    )
                    if val_loss is not None and primary:
                        bar.write(f"step {step}: train loss {train_loss:.4f}, validation loss {val_loss:.4f}")
                    losses, timer, timed_steps = [], time.perf_counter(), 0
                if is_checkpoint:
                    checkpoints.save(step, params, opt_state, jax.device_get(losses), list(metrics.rows))
                if preemption.reached(step):  # every process gets True at the same step
                    if not is_checkpoint:
                        bad = _first_non_finite(losses, step)
                        if bad is not None:
                            raise stop(bad[0], "train", bad[1], bad_weights=bad[0] - 1)
                        checkpoints.save(step, params, opt_state, jax.device_get(losses), list(metrics.rows))
                    stopped = step
                    break
        finally:
            if stopped is None:  # a TERM from here on ends the process: there is no stop to save
                preemption.restore()
            bar.close()
            try:
                checkpoints.close()  # waits for the saves in flight; further TERMs and INTs are ignored meanwhile
            finally:
                preemption.restore()
        if stopped is not None:
            kind = preemption.signalled or "TERM"  # None: jax's service caught the TERM (several processes)
            say(f"stopped by {'an' if kind == 'INT' else 'a'} {kind} signal after step {stopped}, saved in "
                f"{out / 'checkpoints' / str(stopped)}: run the same command with --resume to continue")
            return metrics.rows


    samples = None
    if last == config.steps and config.num_samples:
        # Every process takes part, on the params as they are sharded (none gathers the model); every one
        # gets the sampled bytes, and process 0 writes them. Outside the mesh context: the decode step's
        # attention is not split by shard_heads (the samples need not divide the data axis).
        samples = generate(
            model, compute_params(params, config), config.sample_prompt.encode(),
            config.sample_tokens, num_samples=config.num_samples, temperature=config.temperature,
            key=jax.random.key(config.seed), sharding=None if mesh is None else NamedSharding(mesh, P()),
        )

    if last < config.steps or not primary:
        return metrics.rows
    plot_losses(metrics.rows, out / "loss.png", f"{config.framework}, attention={config.attention}")
    print(f"wrote {out / 'metrics.jsonl'}, {out / 'loss.png'} and {out / 'checkpoints'}")
    if samples is not None:
        text = "".join(f"--- sample {i} ---\n{s.decode('utf-8', errors='replace')}\n" for i, s in enumerate(samples))
        (out / "samples.txt").write_text(text)
        print(text, end="")
    return metrics.rows
