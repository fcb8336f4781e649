"""`python -m probjax_nn.benchmark cpu`: `probjax_nn.attention(impl="auto")` beside
`jax.nn.dot_product_attention(implementation="xla")` in one process, on the CPU, with their ratios.

One row per seq x causal x mode x impl: the median wall time and process CPU time per call over samples that
alternate the two impls (so that a machine shared with other work slows both alike), XLA's memory analysis of
each compiled step (temp bytes: the scores and what the backward pass keeps), and the largest difference from
jax.nn's result. Then one ratio per seq x causal x mode (probjax / jax.nn: below 1 is better). Writes the JSON
and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import shlex
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import probjax_nn
from probjax_nn.benchmark._cli import _output_problem, _positive
from probjax_nn.benchmark._impls import SEED_MODES, Case, jax_step, step_args

IMPLS = ("probjax_auto", "jax_xla")
_MB = 1 / 2**20


def _attention(impl: str, causal: bool):
    if impl == "probjax_auto":
        return lambda q, k, v: probjax_nn.attention(q, k, v, is_causal=causal)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m probjax_nn.benchmark cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="docs/benchmarks/cpu_attention.json", help="the JSON file to write")
    parser.add_argument("--machine", default=platform.machine(), help="the machine's name in the report")
    parser.add_argument("--batch", type=_positive, default=1)
    parser.add_argument("--heads", type=_positive, default=8)
    parser.add_argument("--head-dim", type=_positive, default=64)
    parser.add_argument("--seq-lens", type=_positive, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[1, 0])
    parser.add_argument("--modes", nargs="+", choices=SEED_MODES, default=list(SEED_MODES))
    parser.add_argument("--samples", type=_positive, default=5, help="timed calls per impl and row")
    args = parser.parse_args(argv)
    problem = _output_problem(pathlib.Path(args.output), append=False)
    if problem is not None:
        parser.error(problem)
    return args


class _Step:
    """One impl's jitted step for one case, compiled once."""

    def __init__(self, impl: str, case: Case):
        self.args = step_args(case)
        start = time.perf_counter()
        self.compiled = jax.jit(jax_step(_attention(impl, case.causal), case.mode)).lower(*self.args).compile()
        self.compile_s = time.perf_counter() - start
        self.temp_mb = self.compiled.memory_analysis().temp_size_in_bytes * _MB
        self.result = jax.block_until_ready(self.compiled(*self.args))  # the warm-up, kept for the comparison
        self.wall_ms: list[float] = []
        self.cpu_ms: list[float] = []

    def time_once(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(self.compiled(*self.args))
        self.cpu_ms.append((time.process_time() - cpu) * 1e3)
        self.wall_ms.append((time.perf_counter() - wall) * 1e3)


def measure(case: Case, samples: int) -> dict[str, dict]:
    """Both impls' rows for `case`, their samples interleaved."""
    steps = {impl: _Step(impl, case) for impl in IMPLS}
    for _ in range(samples):
        for step in steps.values():
            step.time_once()
    expected = jax.tree.leaves(steps["jax_xla"].result)
    rows = {}
    for impl, step in steps.items():
        difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(e))))
                         for a, e in zip(jax.tree.leaves(step.result), expected, strict=True))
        rows[impl] = {
            "wall_ms": float(np.median(step.wall_ms)), "cpu_ms": float(np.median(step.cpu_ms)),
            "temp_mb": step.temp_mb, "compile_s": step.compile_s, "max_abs_diff_vs_jax": difference,
        }
    return rows


def _inputs(batch: int, heads: int, seq: int, head_dim: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(seq), 4)
    return tuple(jax.random.normal(key, (batch, seq, heads, head_dim), jnp.float32) for key in keys)


def command_line(args: argparse.Namespace) -> str:
    """A shell command that measures the same grid."""
    words = ["python", "-m", "probjax_nn.benchmark", "cpu", "--output", args.output, "--machine", args.machine]
    for flag in ("batch", "heads", "head_dim", "seq_lens", "causal", "modes", "samples"):
        value = getattr(args, flag)
        words += ["--" + flag.replace("_", "-"), *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(words)


def markdown(report: dict) -> str:
    """The ratios as a Markdown table, with the machine and the command."""
    device, config = report["device"], report["config"]
    lines = [
        "# probjax_nn.attention(impl=\"auto\") against jax.nn.dot_product_attention on the CPU", "",
        f"Machine: {device['machine']} ({device['cpu_count']} CPUs seen by the process), jax {device['jax']}, "
        f"jaxlib {device['jaxlib']}, Python {device['python']}. float32, B={config['batch']}, "
        f"N={config['heads']}, D={config['head_dim']}, S = T; median of {config['samples']} calls per impl, "
        "the two impls alternating.", "",
        f"Command: `{report['command']}`", "",
        "Ratios are probjax / jax.nn (below 1: probjax is faster or lighter). temp: XLA's memory analysis of the "
        "compiled step (`temp_size_in_bytes`).", "",
        "| T | causal | mode | wall ms (probjax / jax.nn) | wall ratio | CPU time ratio | temp MiB (probjax / jax.nn) "
        "| temp ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ratio in report["ratios"]:
        rows = {row["impl"]: row for row in report["results"]
                if (row["seq"], row["causal"], row["mode"]) == (ratio["seq"], ratio["causal"], ratio["mode"])}
        ours, theirs = rows["probjax_auto"], rows["jax_xla"]
        lines.append(
            f"| {ratio['seq']} | {ratio['causal']} | {ratio['mode']} | {ours['wall_ms']:.0f} / "
            f"{theirs['wall_ms']:.0f} | {ratio['wall']:.2f} | {ratio['cpu']:.2f} | {ours['temp_mb']:.0f} / "
            f"{theirs['temp_mb']:.0f} | {ratio['temp']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict:
    report = {
        "device": {
            "machine": args.machine, "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"),
            "python": platform.python_version(), "backend": jax.default_backend(),
        },
        "config": {key: getattr(args, key) for key in ("batch", "heads", "head_dim", "seq_lens", "causal", "modes",
                                                        "samples")},
        "command": command_line(args),
        "results": [],
        "ratios": [],
    }
    path = pathlib.Path(args.output)
    for seq in args.seq_lens:
        q, k, v, cotangent = _inputs(args.batch, args.heads, seq, args.head_dim)
        for causal in map(bool, args.causal):
            for mode in args.modes:
                rows = measure(Case(q, k, v, cotangent, causal, mode), args.samples)
                for impl, row in rows.items():
                    report["results"].append({"impl": impl, "seq": seq, "causal": causal, "mode": mode, **row})
                ours, theirs = rows["probjax_auto"], rows["jax_xla"]
                ratio = {"seq": seq, "causal": causal, "mode": mode, "wall": ours["wall_ms"] / theirs["wall_ms"],
                         "cpu": ours["cpu_ms"] / theirs["cpu_ms"], "temp": ours["temp_mb"] / theirs["temp_mb"]}
                report["ratios"].append(ratio)
                print(f"T={seq:<6} {'causal' if causal else 'full':<6} {mode:<8} wall {ours['wall_ms']:9.1f} / "
                      f"{theirs['wall_ms']:9.1f} ms = {ratio['wall']:.2f}   cpu {ratio['cpu']:.2f}   temp "
                      f"{ours['temp_mb']:7.1f} / {theirs['temp_mb']:7.1f} MiB = {ratio['temp']:.2f}", flush=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(report, indent=2))
    path.with_suffix(".md").write_text(markdown(report))
    return report


def cpu_main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run(args)
    print(f"wrote {args.output} and {pathlib.Path(args.output).with_suffix('.md')}")
    return 0
