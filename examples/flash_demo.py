"""Flash attention on this machine: forward and gradient of the Pallas kernel against the float32 reference.

    .venv/bin/python examples/flash_demo.py [--seq 600 --batch 2 --heads 8 --kv-heads 2 --head-dim 64]

On CPU the kernel runs in Pallas interpret mode: exact, but slow, so its timings say nothing about a GPU.
Exits 1 when an error exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from probjax_kernels import flash_attention, flash_attention_reference


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    batch: int = 2  # B
    seq: int = 600  # T = S; not a multiple of any block size, so the ragged tail is exercised
    heads: int = 8  # N, query heads
    kv_heads: int = 2  # K, key/value heads; N % K == 0 (grouped-query attention)
    head_dim: int = 64  # D
    causal: bool = True  # top-left alignment: query i sees keys j <= i
    steady_calls: int = 5  # timed calls after the first, compiling one


def parse_args(argv: Sequence[str] | None = None) -> DemoConfig:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--seq", type=int, default=defaults.seq)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=defaults.causal)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    return DemoConfig(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, args.causal)


def output_and_grads(attention: Callable[..., jax.Array], causal: bool) -> Callable[..., tuple[jax.Array, ...]]:
    """Jitted (q, k, v, cotangent) -> (out, dq, dk, dv), with cotangent the gradient of the loss w.r.t. out."""

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = attention(q, k, v, causal=causal)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    def step(q: jax.Array, k: jax.Array, v: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, ...]:
        (_, out), grads = grad(q, k, v, cotangent)
        return (out, *grads)

    return jax.jit(step)


def timed(fn: Callable[..., tuple[jax.Array, ...]], args: tuple[jax.Array, ...], calls: int) -> tuple[float, float]:
    """Seconds of the first call (trace + compile + run) and the median of `calls` further calls."""
    times = []
    for _ in range(calls + 1):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    # Max abs error over max abs of the reference. On GPU, float32 dots may run in TF32 (about 1e-3).
    tolerance = {"float32": 1e-4 if interpret else 2e-3, "bfloat16": 5e-2}
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"Pallas interpret mode: {interpret}")
    print(f"{config}\n")

    key_q, key_k, key_v, key_ct = jax.random.split(jax.random.key(0), 4)
    b, t, n, k, d = config.batch, config.seq, config.heads, config.kv_heads, config.head_dim
    inputs32 = (jax.random.normal(key_q, (b, t, n, d)), jax.random.normal(key_k, (b, t, k, d)),
                jax.random.normal(key_v, (b, t, k, d)))
    cotangent = jax.random.normal(key_ct, (b, t, n, d))
    flash = output_and_grads(flash_attention, config.causal)
    reference = output_and_grads(flash_attention_reference, config.causal)

    names = ("out", "dq", "dk", "dv")
    print(f"{'dtype':<10}" + "".join(f"{name + ' err':>11}" for name in names) + f"{'first s':>10}{'steady ms':>11}")
    failed = []
    for dtype, tol in tolerance.items():
        args = (*(x.astype(dtype) for x in inputs32), cotangent)
        first, steady = timed(flash, args, config.steady_calls)
        errors = []
        for name, got, want in zip(names, flash(*args), reference(*args), strict=True):
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
            if not err <= tol * scale:  # `not <=` also catches NaN
                failed.append(f"{dtype} {name}: max abs error {err:.3g} > {tol:g} * max abs {scale:.3g}")
            errors.append(err)
        print(f"{dtype:<10}" + "".join(f"{err:>11.2e}" for err in errors) + f"{first:>10.2f}{steady * 1e3:>11.1f}")

    for line in failed:
        print(f"FAIL {line}", file=sys.stderr)
    if not failed:
        print("\nall errors within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
