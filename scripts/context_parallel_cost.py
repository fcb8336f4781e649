"""What context parallelism costs per device and per attention layer, read from the compiled program.

For n = 2, 4, 8 host devices, it compiles one attention layer's forward and backward (`jax.grad` of
`ring_attention` inside `jax.shard_map`) and sums the bytes that each device receives by collective-permute,
all-gather and reduce-scatter in the compiled HLO (collectives inside a loop count once per iteration, from
the loop's known trip count). The work per device is read from the schedule the program runs
(`_Ring.kind` / `_Ring.blocks` for every device pair): the kernel calls that are not skipped and the
(query, key) pairs they compute. Writes a JSON table and a plot, and prints the table in Markdown.

Usage: python scripts/context_parallel_cost.py [--out docs]   (sets 8 CPU devices itself; no GPU needed)
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from probjax_kernels import ring_attention  # noqa: E402
from probjax_kernels.parallel.ring import _Ring  # noqa: E402

# One layer of a long-context model: a 32k-token sequence, 32 query heads, 8 KV heads, head dim 128. float32:
# XLA's CPU backend widens bf16 collectives to f32, which would double the bytes a GPU moves in bf16.
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM, DTYPE = 1, 32768, 32, 8, 128, jnp.float32
ITEM = 4  # bytes per K / V element; the gradients travel in float32 whatever the dtype
DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1}
COLLECTIVES = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def _shape_bytes(text: str) -> int:
    """Bytes of an HLO shape, `bf16[1,4096,8,128]{...}` or a tuple of them."""
    total = 0
    for dtype, dims in re.findall(r"\b(bf16|f16|f32|s32|u32|pred|s8)\[([0-9,]*)\]", text):
        total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def received_bytes(hlo: str, num_devices: int) -> dict[str, int]:
    """Bytes each device receives per collective kind, loops unrolled by their known trip counts."""
    computations, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(1)
            computations[current] = []
        elif current is not None:
            computations[current].append(line)
    multiplier = {name: 0 for name in computations}
    entry = re.search(r"^ENTRY %?([\w.\-]+) ", hlo, re.M).group(1)
    multiplier[entry] = 1
    for _ in range(len(computations)):  # callers before callees, whatever the text order
        for name, lines in computations.items():
            for line in lines:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                for key, callee in re.findall(r"\b(body|condition|to_apply|calls)=%?([\w.\-]+)", line):
                    factor = int(trips.group(1)) if key == "body" and trips else 1
                    multiplier[callee] = max(multiplier.get(callee, 0), multiplier[name] * factor)
                for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                    for callee in re.findall(r"%?([\w.\-]+)", group):
                        multiplier[callee] = max(multiplier.get(callee, 0), multiplier[name])
    moved = {kind: 0 for kind in COLLECTIVES}
    for name, lines in computations.items():
        for line in lines:
            for kind in COLLECTIVES:
                match = re.search(rf"= (.*?) {kind}(?:-start)?\((.*?)\)", line)
                if match is None:
                    continue
                result, count = _shape_bytes(match.group(1)), multiplier.get(name, 0)
                if kind == "all-gather":
                    result = result * (num_devices - 1) // num_devices
                elif kind == "reduce-scatter":
                    result = result * (num_devices - 1)
                moved[kind] += result * count
    return moved


def schedule_work(num_devices: int, layout: str, causal: bool) -> dict:
    """Kernel calls and computed (query, key) pairs per device, from the schedule itself."""
    shard = LENGTH // num_devices
    problem = _Ring(axis_name="sp", layout=layout, strategy="ring", causal=causal, scale=1.0, window=(None, None),
                    has_segments=False, score_mod=None, mask_mod=None, config=None, backend="reference")
    kinds = problem.blocks(shard, shard)
    calls, pairs = [], []
    for i in range(num_devices):
        device_calls = device_pairs = 0
        for j in range(num_devices):
            kind = int(problem.kind(jnp.int32(i), jnp.int32(j)))
            if kind:
                q_part, kv_part, diagonal = kinds[kind - 1]
                rows, cols = q_part.hi - q_part.lo, kv_part.hi - kv_part.lo
                device_calls += 1
                device_pairs += rows * (rows + 1) // 2 if diagonal else rows * cols
        calls.append(device_calls)
        pairs.append(device_pairs)
    return {"calls_max": max(calls), "calls_mean": float(np.mean(calls)), "pairs_max": max(pairs),
            "pairs_mean": float(np.mean(pairs))}


def measure(num_devices: int, layout: str, strategy: str) -> dict:
    mesh = jax.make_mesh((num_devices,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:num_devices])
    seq = P(None, "sp")

    def layer(q, k, v):
        attend = lambda q, k, v: ring_attention(q, k, v, axis_name="sp", layout=layout, strategy=strategy,  # noqa: E731
                                                causal=True, _backend="reference")
        out = jax.shard_map(attend, mesh=mesh, in_specs=seq, out_specs=seq, check_vma=False)(q, k, v)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((BATCH, LENGTH, HEADS, HEAD_DIM), DTYPE)
    kv = jax.ShapeDtypeStruct((BATCH, LENGTH, KV_HEADS, HEAD_DIM), DTYPE)
    hlo_forward = jax.jit(layer).lower(q, kv, kv).compile().as_text()
    hlo_both = jax.jit(jax.grad(layer, (0, 1, 2))).lower(q, kv, kv).compile().as_text()
    forward = received_bytes(hlo_forward, num_devices)
    both = received_bytes(hlo_both, num_devices)
    return {"n": num_devices, "layout": layout, "strategy": strategy,
            "forward_bytes": sum(forward.values()), "forward_backward_bytes": sum(both.values()),
            "by_kind": {kind: value for kind, value in both.items() if value},
            **schedule_work(num_devices, layout, causal=True)}


def predicted_bytes(num_devices: int, strategy: str) -> tuple[int, int]:
    """(forward, forward + backward) bytes received per device by the arithmetic of docs/context_parallel.md."""
    block = BATCH * (LENGTH // num_devices) * KV_HEADS * HEAD_DIM  # elements of one device's K (or V)
    n = num_devices
    if strategy == "ring":  # n sends of K and V; backward: K and V again plus float32 dK and dV
        return 2 * n * block * ITEM, 2 * n * block * ITEM + (2 * n * block * ITEM + 2 * n * block * 4)
    gathered = 2 * (n - 1) * block * ITEM  # K and V from the n - 1 others
    # With forward and backward in one program, XLA keeps the gathered K/V for the backward (one all-gather);
    # dK and dV (float32) are reduce-scattered home.
    return gathered, gathered + 2 * (n - 1) * block * 4


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy, marker in (("ring", "o"), ("allgather", "s")):
        sel = [r for r in rows if r["strategy"] == strategy and r["layout"] == "zigzag"]
        left.plot([r["n"] for r in sel], [r["forward_backward_bytes"] / 2**20 for r in sel], marker=marker,
                  label=f"{strategy}: forward + backward")
        left.plot([r["n"] for r in sel], [r["forward_bytes"] / 2**20 for r in sel], marker=marker, ls="--",
                  label=f"{strategy}: forward")
    left.set(xlabel="devices n", ylabel="MiB received per device per layer", xticks=[2, 4, 8],
             title=f"bytes moved (L={LENGTH}, K={KV_HEADS}, D={HEAD_DIM}, f32)")
    left.legend(fontsize=8)
    for layout, marker in (("contiguous", "o"), ("zigzag", "s")):
        sel = [r for r in rows if r["strategy"] == "ring" and r["layout"] == layout]
        ideal = [LENGTH * (LENGTH + 1) / 2 / r["n"] for r in sel]
        right.plot([r["n"] for r in sel], [r["pairs_max"] / i for r, i in zip(sel, ideal)], marker=marker,
                   label=f"{layout}: busiest device")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xlabel="devices n", ylabel="pairs computed / (causal pairs / n)", xticks=[2, 4, 8],
              title="causal work on the busiest device")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs", help="folder for context_parallel.json / .png")
    args = parser.parse_args()
    out = Path(args.out)
    rows = [measure(n, layout, strategy) for n in (2, 4, 8) for layout in ("contiguous", "zigzag")
            for strategy in ("ring", "allgather")]
    for row in rows:
        row["predicted_forward_bytes"], row["predicted_forward_backward_bytes"] = predicted_bytes(row["n"], row["strategy"])
    (out / "context_parallel.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, out / "context_parallel.png")
    print("| n | layout | strategy | MiB fwd (predicted) | MiB fwd+bwd (predicted) | kernel calls max / mean "
          "| pairs busiest / ideal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ideal = LENGTH * (LENGTH + 1) / 2 / r["n"]
        print(f"| {r['n']} | {r['layout']} | {r['strategy']} | {r['forward_bytes'] / 2**20:.1f} "
              f"({r['predicted_forward_bytes'] / 2**20:.1f}) | {r['forward_backward_bytes'] / 2**20:.1f} "
              f"({r['predicted_forward_backward_bytes'] / 2**20:.1f}) | {r['calls_max']} / {r['calls_mean']:.2f} "
              f"| {r['pairs_max'] / ideal:.2f} |")


if __name__ == "__main__":
    main()
