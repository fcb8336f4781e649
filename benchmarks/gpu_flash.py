"""Attention speed on one device: probjax's flash kernel against jax.nn.dot_product_attention (XLA, cuDNN).

    python benchmarks/gpu_flash.py --output docs/benchmarks/gpu_flash_h200.json
    python benchmarks/gpu_flash.py --seq-lens 128 --head-dims 64 --impls probjax,jax_xla   # CPU smoke test

Writes one row per impl x head_dim x seq x causal x mode (bfloat16, q/k/v [B, T, N, D], S = T) in the JSON
schema of ../shared/seed/gpu_attention_rtx3090.json, and prints a table. Each row: errors against a float32
XLA reference (precision highest, computed once per shape; fwd compares the output, fwd_bwd dq, dk and dv;
rel_err = max |error| / max |reference|), XLA's memory analysis of the compiled step, compile time, and the
median and quartiles of 7 repetitions of an inner loop of calls sized to about 0.2 s. TFLOP/s count
4 * B * N * T * S * D per forward, half of it when causal, 3.5 times it for fwd_bwd. A failing case (out of
memory, unsupported) gets a row with "error" and the run goes on. The JSON is rewritten after every row, so a
run cut short keeps what it measured. On the CPU, probjax runs in Pallas interpret mode (slow).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from probjax_kernels import flash_attention

DTYPE = jnp.bfloat16
REPEATS = 7
TARGET_S = 0.2  # seconds per repetition of the inner loop
MAX_INNER = 1000

IMPLS: dict[str, Callable[[jax.Array, jax.Array, jax.Array, bool], jax.Array]] = {
    "probjax": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal),
    "jax_xla": lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla"
    ),
    "jax_cudnn": lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"
    ),
}
MODES = ("fwd", "fwd_bwd")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    def names(choices: Sequence[str]) -> Callable[[str], list[str]]:
        def parse(text: str) -> list[str]:
            chosen = text.split(",")
            if unknown := [x for x in chosen if x not in choices]:
                raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(choices)}")
            return chosen

        return parse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="docs/benchmarks/gpu_flash.json")
    parser.add_argument("--head-dims", type=ints, default=[64, 128])
    parser.add_argument("--seq-lens", type=ints, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--causal", type=ints, default=[0, 1], help="0 (no), 1 (yes) or 0,1")
    parser.add_argument("--modes", type=names(MODES), default=list(MODES))
    parser.add_argument("--impls", type=names(tuple(IMPLS)), default=list(IMPLS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tag", default=None, help="free text stored in every row")
    return parser.parse_args(argv)


def device_info() -> dict:
    info = {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "device_kind": jax.devices()[0].device_kind,
    }
    try:
        query = "--query-gpu=name,driver_version,memory.total"
        line = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[0]
        name, driver, memory_mib = (x.strip() for x in line.split(","))
        info.update(gpu=name, driver=driver, gpu_memory_gb=round(float(memory_mib) / 1024, 1))
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        info.update(gpu=None, driver=None, gpu_memory_gb=None)
    return info


def step_fn(attention: Callable, causal: bool, mode: str) -> Callable:
    """fwd: (q, k, v) -> out. fwd_bwd: (q, k, v, cotangent) -> gradients of sum(out * cotangent)."""
    if mode == "fwd":
        return lambda q, k, v: attention(q, k, v, causal)

    def loss(q, k, v, cotangent):
        return jnp.sum(attention(q, k, v, causal).astype(jnp.float32) * cotangent)

    return jax.grad(loss, argnums=(0, 1, 2))


def reference(args: tuple[jax.Array, ...], causal: bool, mode: str) -> list[jax.Array]:
    """What `mode` returns, from float32 XLA attention at precision highest: [out] or [dq, dk, dv]."""
    args = tuple(x.astype(jnp.float32) for x in args)
    with jax.default_matmul_precision("highest"):
        return jax.tree.leaves(jax.jit(step_fn(IMPLS["jax_xla"], causal, mode))(*args))


def errors(actual: Sequence[jax.Array], expected: Sequence[jax.Array]) -> tuple[float, float]:
    """(max |actual - expected|, the largest of max |actual - expected| / max |expected| per output)."""
    max_abs = rel = 0.0
    for a, e in zip(actual, expected):
        error = float(jnp.max(jnp.abs(a.astype(jnp.float32) - e)))
        max_abs, rel = max(max_abs, error), max(rel, error / max(float(jnp.max(jnp.abs(e))), 1e-30))
    return max_abs, rel


def timed(compiled: Callable, args: tuple) -> dict:
    """Median and quartiles (ms per call) of REPEATS repetitions of an inner loop sized to about TARGET_S."""
    jax.block_until_ready(compiled(*args))  # warm-up
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    inner = int(min(MAX_INNER, max(1, TARGET_S / (time.perf_counter() - start))))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(inner):
            result = compiled(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / inner * 1e3)
    q1, median, q3 = np.percentile(times, [25, 50, 75])
    return {"inner": inner, "median_ms": median, "q1_ms": q1, "q3_ms": q3}


def measure(impl: str, mode: str, causal: bool, args: tuple, expected: Sequence[jax.Array] | None) -> dict:
    """One row's measurements: errors, memory analysis, compile time, timings, TFLOP/s."""
    start = time.perf_counter()
    compiled = jax.jit(step_fn(IMPLS[impl], causal, mode)).lower(*args).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    row = {"max_abs_err": None, "rel_err": None}
    if expected is not None:
        row["max_abs_err"], row["rel_err"] = errors(jax.tree.leaves(compiled(*args)), expected)
    mb = 1 / 2**20
    row.update(
        xla_temp_mb=None if memory is None else memory.temp_size_in_bytes * mb,
        xla_arg_mb=None if memory is None else memory.argument_size_in_bytes * mb,
        xla_out_mb=None if memory is None else memory.output_size_in_bytes * mb,
        compile_s=compile_s,
    )
    row.update(timed(compiled, args))
    batch, seq, heads, head_dim = args[0].shape
    flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    flops *= 3.5 if mode == "fwd_bwd" else 1.0
    row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = {**vars(args), "dtypes": [jnp.dtype(DTYPE).name], "command": " ".join([sys.executable, *sys.argv])}
    report = {"device": device_info(), "config": config, "results": []}
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    print(f"{'impl':<10} {'D':>4} {'seq':>6} {'causal':>6} {'mode':<8} {'ms':>9} {'TFLOP/s':>8} {'rel_err':>8}")
    for head_dim, seq in itertools.product(args.head_dims, args.seq_lens):
        shape = (args.batch, seq, args.heads, head_dim)
        keys = jax.random.split(jax.random.key(seq * 1000 + head_dim), 4)
        q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(DTYPE) for key in keys[:3])
        cotangent = jax.random.normal(keys[3], shape, jnp.float32)
        for causal, mode in itertools.product(map(bool, args.causal), args.modes):
            step_args = (q, k, v) if mode == "fwd" else (q, k, v, cotangent)
            try:
                expected = reference(step_args, causal, mode)
            except Exception as error:  # noqa: BLE001 - the impls are still worth timing, without errors
                print(f"reference failed for D={head_dim} seq={seq} causal={causal} {mode}: {error!r:.300}")
                expected = None
            for impl in args.impls:
                row = {
                    "impl": impl, "dtype": jnp.dtype(DTYPE).name, "head_dim": head_dim, "seq": seq,
                    "causal": causal, "mode": mode, "batch": args.batch, "heads": args.heads, "tag": args.tag,
                }
                try:
                    row.update(measure(impl, mode, causal, step_args, expected))
                    summary = f"{row['median_ms']:9.3f} {row['tflops']:8.1f} {row['rel_err'] or 0:8.2g}"
                except Exception as error:  # noqa: BLE001 - recorded in the row; the run goes on
                    row["error"] = f"{type(error).__name__}: {error}"[:400]
                    summary = f"error: {row['error'][:90]}"
                report["results"].append(row)
                print(f"{impl:<10} {head_dim:>4} {seq:>6} {causal!s:>6} {mode:<8} {summary}", flush=True)
                output.write_text(json.dumps(report, indent=2))
            del expected
    return 0


if __name__ == "__main__":
    sys.exit(main())
