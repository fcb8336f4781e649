"""The command line: the grid from flags named after the seed's config keys, one row per measured case.

Rows go in the seed's order (dtype, head_dim, seq, causal, mode, impl) and the JSON is rewritten after every
row, so a run that is cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import os
import pathlib
import platform
import subprocess
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from probjax_nn.benchmark._report import CONFIG_KEYS, load_report
from probjax_nn.benchmark._impls import FLOATS, IMPLS, MODES, SEED_IMPLS, SEED_MODES, Case, Impl, reference_outputs
from probjax_nn.benchmark._timing import attention_flops, time_steps

USAGE = """\
python -m probjax_nn.benchmark [--output FILE] [--batch B] [--heads N] [--head-dims D ...] [--seq-lens T ...]
                               [--ragged-seq-lens T ...] [--dtypes DTYPE ...] [--modes MODE ...]
                               [--causal {0,1} ...] [--impls IMPL ...] [--append] [--tag TEXT]
python -m probjax_nn.benchmark plot FILE [--out-dir DIR]
python -m probjax_nn.benchmark decode [--batch B ...] [--cache-lens S ...] [--heads N:K ...] [--page-sizes P ...]
python -m probjax_nn.benchmark cpu [--output FILE] [--machine NAME] [--seq-lens T ...] [--samples N]"""

DESCRIPTION = """\
Attention speed, memory and error of probjax against every peer a user could pick instead, one JSON row per
impl x dtype x head_dim x seq x causal x mode (q, k, v [B, T, N, D], S = T). Each row: max_abs_err and
rel_err against a float32 reference (fwd: the output; fwd_bwd: dq, dk, dv of sum(out * cotangent); jvp:
the output and its tangent), XLA's memory analysis (JAX) or peak memory (torch), compile_s, the median and
quartiles of 7 samples of an inner loop (after a warm-up), and TFLOP/s (4 B N T S D per forward, half when
causal, 3.5x for fwd_bwd, 3x for jvp).
A failing case (out of memory, unsupported, impl missing) gets an "error" instead and the run goes on; a
dtype an impl never computes in is left out. `plot FILE` draws the PNGs and a Markdown summary."""

SEQ_LENS = (128, 512, 1024, 2048, 4096, 8192)
RAGGED_SEQ_LENS = (600, 1500, 3000)  # not a multiple of any block size
ERROR_CHARS = 300  # of the message, after the exception's type, as the seed keeps them


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags named after the seed's config keys; the defaults are the seed's grid with every impl."""
    parser = argparse.ArgumentParser(
        prog="python -m probjax_nn.benchmark", usage=USAGE, description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output", default="docs/benchmarks/gpu_attention.json", help="the JSON file to write")
    parser.add_argument("--batch", type=_positive, default=4)
    parser.add_argument("--heads", type=_positive, default=8)
    parser.add_argument("--head-dims", type=_positive, nargs="+", default=[64, 128])
    parser.add_argument("--seq-lens", type=_positive, nargs="+", default=None,
                        help=f"default: {' '.join(map(str, SEQ_LENS))}")
    parser.add_argument(
        "--ragged-seq-lens", type=_positive, nargs="*", default=None,
        help="lengths that are not a multiple of the block size; measured together with --seq-lens (default: "
        f"{' '.join(map(str, RAGGED_SEQ_LENS))} when --seq-lens is not given, none when it is)",
    )
    parser.add_argument("--dtypes", nargs="+", choices=FLOATS, default=["bfloat16", "float32"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(SEED_MODES),
                        help="fwd, fwd_bwd (the default, the seed's) and jvp (forward-mode AD)")
    parser.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[0, 1])
    parser.add_argument(
        "--impls", nargs="+", choices=tuple(IMPLS), metavar="IMPL",
        default=[*SEED_IMPLS, *(name for name in IMPLS if name not in SEED_IMPLS)],
        help=f"any of {', '.join(IMPLS)} (default: all)",
    )
    parser.add_argument("--append", action="store_true", help="keep the rows already in --output")
    parser.add_argument("--tag", default=None, help="free text stored in every row")
    args = parser.parse_args(argv)
    # A short --seq-lens asks for a quick run: the long default ragged lengths would not be one.
    if args.ragged_seq_lens is None:
        args.ragged_seq_lens = list(RAGGED_SEQ_LENS) if args.seq_lens is None else []
    if args.seq_lens is None:
        args.seq_lens = list(SEQ_LENS)
    problem = _output_problem(pathlib.Path(args.output), args.append)
    if problem is not None:
        parser.error(problem)
    return args


def _output_problem(path: pathlib.Path, append: bool) -> str | None:
    """Why --output (with --append) cannot take the rows, as a usage error's message; None when it can.
    Checked before the first row is measured, which may take minutes."""
    if path.is_dir():
        return f"argument --output: {path} is a folder; name a file in it, e.g. {path / 'results.json'}"
    folder = next(parent for parent in path.parents if parent.exists())  # "." or "/" at the latest
    if not folder.is_dir():
        return f"argument --output: {folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"argument --output: cannot write in {folder}"
    if append and path.exists():
        try:
            load_report(path)
        except (OSError, ValueError) as error:
            return f"argument --append: {error}; --append adds rows to a file that this benchmark wrote"
    return None


def config_of(args: argparse.Namespace) -> dict:
    """The seed's config keys, in its order."""
    return {key: getattr(args, key) for key in CONFIG_KEYS}


def device_info() -> dict:
    """The seed's device keys: versions, JAX's devices, and the GPU as nvidia-smi names it (None without)."""
    info = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "device_kind": jax.devices()[0].device_kind,
        "gpu": None,
        "driver": None,
        "gpu_memory_gb": None,
        "torch": None,
        "torch_cuda": None,
    }
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        ).stdout.splitlines()[0]
        name, driver, memory_mib = (x.strip() for x in line.split(","))
        info.update(gpu=name, driver=driver, gpu_memory_gb=round(float(memory_mib) / 1024, 1))
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        pass
    if importlib.util.find_spec("torch") is not None:
        import torch

        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    return info


class Report:
    """The JSON file: device, config and results, written whole (atomically) after every row."""

    def __init__(self, args: argparse.Namespace):
        self.path = pathlib.Path(args.output)
        self.device = device_info()
        self.config = config_of(args)
        self.results: list[dict] = []
        if args.append and self.path.exists():
            self._keep_old_rows(load_report(self.path))

    def _keep_old_rows(self, old: dict) -> None:
        """Keeps old's rows; list-valued config keys become the union, so the config covers every row."""
        for key in ("device_kind", "gpu"):
            if old["device"].get(key) != self.device[key]:
                raise SystemExit(
                    f"{self.path} holds rows measured on {key}={old['device'].get(key)!r}, and this machine is "
                    f"{self.device[key]!r}; --append adds only to a file of the same device."
                )
        self.results = old["results"]
        for key, value in self.config.items():
            if isinstance(value, list):
                merged = list(dict.fromkeys([*old["config"].get(key, []), *value]))
                self.config[key] = sorted(merged) if key in ("head_dims", "seq_lens", "ragged_seq_lens") else merged

    def add(self, row: dict) -> None:
        self.results.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        report = {"device": self.device, "config": self.config, "results": self.results}
        partial.write_text(json.dumps(report, indent=2))
        os.replace(partial, self.path)


def make_inputs(dtype: str, batch: int, heads: int, seq: int, head_dim: int) -> tuple[jax.Array, ...]:
    """q, k, v in `dtype` and a float32 cotangent; the same numbers (before rounding) for every dtype."""
    keys = jax.random.split(jax.random.key(1009 * seq + head_dim), 4)
    shape = (batch, seq, heads, head_dim)
    q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), cotangent


def _errors(actual: list[np.ndarray], expected: list[np.ndarray]) -> tuple[float, float]:
    """(max |actual - expected| over the outputs, the largest max |actual - expected| / max |expected|)."""
    max_abs = rel = 0.0
    for a, e in zip(actual, expected, strict=True):
        error = float(np.max(np.abs(a - e)))
        max_abs, rel = max(max_abs, error), max(rel, error / max(float(np.max(np.abs(e))), 1e-30))
    return max_abs, rel


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:ERROR_CHARS]}"


def _release_memory() -> None:
    """Drops this row's buffers, and torch's cached blocks, so that the next impl finds the GPU memory free."""
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()


def measure(impl: Impl, case: Case, expected: list[np.ndarray] | None) -> dict:
    """One row's measurements after the key columns, in the seed's order."""
    runner = impl.build(case)
    result = runner.run()
    runner.wait(result)  # also the warm-up
    max_abs_err = rel_err = None
    if expected is not None:
        max_abs_err, rel_err = _errors(runner.outputs(result), expected)
    del result
    timing = time_steps(runner.run, runner.wait)
    batch, seq, heads, head_dim = case.q.shape
    flops = attention_flops(batch, heads, seq, head_dim, case.causal, case.mode)
    return {
        "max_abs_err": max_abs_err, "rel_err": rel_err, **runner.memory, "compile_s": runner.compile_s, **timing,
        "tflops": flops / (timing["median_ms"] * 1e-3) / 1e12,
    }


class _Progress:
    """A tqdm bar on a terminal (when tqdm is installed) and one line per row in any case."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, unit="row", disable=None, dynamic_ncols=True)

    def line(self, text: str) -> None:
        if self._bar is None:
            print(text, flush=True)
        else:
            self._bar.write(text)

    def row(self, text: str) -> None:
        self.done += 1
        self.line(f"[{self.done}/{self.total}] {text}")
        if self._bar is not None:
            self._bar.update()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run(args: argparse.Namespace) -> pathlib.Path:
    """Measures the grid of `args` into `args.output` and returns its path."""
    report = Report(args)
    impls = [IMPLS[name] for name in args.impls]
    missing = {impl.name: impl.available() for impl in impls}
    for name, reason in missing.items():
        if reason is not None:
            print(f"missing impl {name}: {reason}; its rows record this as their error", flush=True)
    seqs = sorted(set(args.seq_lens) | set(args.ragged_seq_lens))
    shapes = list(itertools.product(args.dtypes, args.head_dims, seqs))
    cases = list(itertools.product(map(bool, args.causal), args.modes))
    progress = _Progress(sum(dtype in impl.dtypes for impl in impls for dtype, *_ in shapes) * len(cases))
    for dtype, head_dim, seq in shapes:
        runnable = [impl for impl in impls if dtype in impl.dtypes]
        if not runnable:
            continue
        q, k, v, cotangent = make_inputs(dtype, args.batch, args.heads, seq, head_dim)
        for causal, mode in cases:
            case = Case(q, k, v, cotangent, causal, mode)
            name = f"{dtype} hd={head_dim} seq={seq} {'causal' if causal else 'full'} {mode}"
            expected = None
            if any(missing[impl.name] is None for impl in runnable):
                try:
                    expected = reference_outputs(case)
                except Exception as error:  # noqa: BLE001 - the impls are still worth timing
                    progress.line(f"reference failed for {name}, rows go without errors: {_error_text(error)}")
            for impl in runnable:
                row = {
                    "impl": impl.name, "dtype": dtype, "head_dim": head_dim, "seq": seq, "causal": causal,
                    "mode": mode, "batch": args.batch, "heads": args.heads, "tag": args.tag,
                }
                if missing[impl.name] is not None:
                    row["error"] = f"missing: {missing[impl.name]}"
                    summary = row["error"]
                else:
                    try:
                        row.update(measure(impl, case, expected))
                        rel_err = "-" if row["rel_err"] is None else f"{row['rel_err']:.1e}"
                        summary = f"{row['median_ms']:10.4f} ms {row['tflops']:8.3g} TFLOP/s  rel_err {rel_err}"
                    except Exception as error:  # noqa: BLE001 - recorded in the row; the run goes on
                        row["error"] = _error_text(error)
                        summary = f"error: {row['error'][:120]}"
                    finally:
                        _release_memory()
                report.add(row)
                progress.row(f"{impl.name:<17} {name:<40} {summary}")
    progress.close()
    return report.path


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plot"]:
        from probjax_nn.benchmark._plot import plot_main

        return plot_main(argv[1:])
    path = run(parse_args(argv))
    print(f"wrote {path}; draw it with: python -m probjax_nn.benchmark plot {path}")
    return 0
