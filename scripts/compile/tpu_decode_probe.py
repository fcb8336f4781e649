"""Compiles `decode_attention`'s Mosaic TPU kernel, and JAX's own TPU paged attention and ragged paged
attention as peers at the same shapes, for TPU generations without a TPU (deviceless ahead-of-time compilation
through libtpu), and prints per generation and variant: the Pallas kernels (tpu_custom_call) in the
compiled program, the scoped VMEM of each, and the compile time.

Run it with a `jax[tpu]` environment (libtpu) on any machine, from the repository root:

    python -m venv tpuvenv && tpuvenv/bin/pip install "jax[tpu]==0.11.2" numpy
    JAX_PLATFORMS=cpu PYTHONPATH=.shim:. tpuvenv/bin/python scripts/compile/tpu_decode_probe.py [--json F]

(`.shim/probjax_kernels` links to kernels/, as in docs/contributing.md; another libtpu process on the machine
needs ALLOW_MULTIPLE_LIBTPU_LOAD=1.) `variants()` is the list the compile report imports: (name, function,
argument specs) tuples. What it proves: each kernel lowers through Mosaic TPU and compiles for the chip
within its VMEM. What it does not: that it runs correctly on a chip (TPU interpret mode on the CPU checks the
numbers, tests/test_tpu_decode.py) or how fast.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from probjax_kernels import alibi, decode_attention, sliding_window

GENERATIONS = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
_CALL = re.compile(r"%(\S+) = .*custom_call_target=\"tpu_custom_call\"")
_SCOPED = re.compile(r'"used_scoped_memory_configs":\[\{[^]]*"size":"(\d+)"')

# A serving-sized decode: 8 sequences of up to 2048 keys in 16-key pages, GQA 32:8, head dim 128.
B, N, K, D, PAGE, CONTEXT = 8, 32, 8, 128, 16, 2048
PAGES_PER_SEQ = CONTEXT // PAGE


def _ours(new_tokens: int, paged: bool = True, dtype=jnp.bfloat16, head_dim: int = D, value_dim: int = D,
          hooks: bool = False, splits: int | None = None, num_kv_heads: int = K):
    """(fn, specs) of decode_attention with the default config: backend "tpu" on the topology's device (a
    call routed to interpret mode instead would show no tpu_custom_call)."""
    i32 = jnp.int32
    q = jax.ShapeDtypeStruct((B, new_tokens, N, head_dim), dtype)
    if paged:
        cache = (B * PAGES_PER_SEQ, PAGE, num_kv_heads)
        tables = [jax.ShapeDtypeStruct((B, PAGES_PER_SEQ), i32)]
    else:
        cache, tables = (B, CONTEXT, num_kv_heads), []
    k, v = jax.ShapeDtypeStruct((*cache, head_dim), dtype), jax.ShapeDtypeStruct((*cache, value_dim), dtype)
    def fn(q, k, v, lengths, *tables):
        # Built inside the trace: an eager jnp op on a deviceless TPU device fails. The slopes are a captured
        # array, read per head (SMEM scalars).
        slopes = jnp.linspace(0.05, 0.5, N)
        options = dict(score_mod=alibi(slopes), mask_mod=sliding_window(1024)) if hooks else {}
        return decode_attention(q, k, v, kv_lengths=lengths, block_tables=tables[0] if tables else None,
                                num_splits=splits, return_lse=True, **options)

    return fn, (q, k, v, jax.ShapeDtypeStruct((B,), i32), *tables)


def _peer_paged(dtype=jnp.bfloat16, pages_per_block: int = 8, num_kv_heads: int = K):
    """JAX's paged_attention (one new token per sequence; head-major pages [K, P, page, D])."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # noqa: PLC0415

    def fn(q, k_pages, v_pages, lengths, tables):
        return paged_attention(q, k_pages, v_pages, lengths, tables, pages_per_compute_block=pages_per_block)

    pages = jax.ShapeDtypeStruct((num_kv_heads, B * PAGES_PER_SEQ, PAGE, D), dtype)
    return fn, (jax.ShapeDtypeStruct((B, N, D), dtype), pages, pages, jax.ShapeDtypeStruct((B,), jnp.int32),
                jax.ShapeDtypeStruct((B, PAGES_PER_SEQ), jnp.int32))


def _peer_paged_dense(dtype=jnp.bfloat16, pages_per_block: int = 8):
    """JAX's paged_attention on a dense cache `[B, S, K, D]` (ours): the cache transposed to head-major pages
    `[K, B * S / page, page, D]` by XLA first (a copy of the whole cache per call), each sequence's pages in
    order."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # noqa: PLC0415

    def fn(q, k, v, lengths):
        def pages(x):
            return jnp.transpose(x.reshape(B * PAGES_PER_SEQ, PAGE, K, D), (2, 0, 1, 3))
        tables = jnp.arange(B * PAGES_PER_SEQ, dtype=jnp.int32).reshape(B, PAGES_PER_SEQ)
        return paged_attention(q[:, 0], pages(k), pages(v), lengths, tables, pages_per_compute_block=pages_per_block)

    cache = jax.ShapeDtypeStruct((B, CONTEXT, K, D), dtype)
    return fn, (jax.ShapeDtypeStruct((B, 1, N, D), dtype), cache, cache, jax.ShapeDtypeStruct((B,), jnp.int32))


def _peer_ragged(new_tokens: int, dtype=jnp.bfloat16, pages_per_block: int = 8):
    """JAX's ragged_paged_attention (mixed prefill / decode; k and v heads interleaved in one page array
    [P, page, 2K, D]): every sequence with `new_tokens` queries. Its blocks are given (8 pages, as ours: 128
    keys; up to 32 queries): its default looks the chip up in `jax.devices()`, which is the CPU here."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention  # noqa: PLC0415

    def fn(q, kv_pages, lengths, tables, cu_q_lens, num_seqs):
        return ragged_paged_attention(q, kv_pages, lengths, tables, cu_q_lens, num_seqs, sm_scale=D ** -0.5,
                                      num_kv_pages_per_block=pages_per_block,
                                      num_queries_per_block=min(32, B * new_tokens))

    i32 = jnp.int32
    return fn, (jax.ShapeDtypeStruct((B * new_tokens, N, D), dtype),
                jax.ShapeDtypeStruct((B * PAGES_PER_SEQ, PAGE, 2 * K, D), dtype),
                jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B, PAGES_PER_SEQ), i32),
                jax.ShapeDtypeStruct((B + 1,), i32), jax.ShapeDtypeStruct((1,), i32))


def variants() -> list[tuple[str, object, tuple]]:
    """(name, function, argument specs) of every probe: ours ("probjax ...") and the peers ("jax ...") at
    B=8, N=32, K=8, D=128, 16-key pages, 2048 keys per sequence, bfloat16 unless named."""
    return [
        ("probjax decode paged T=1", *_ours(1)),
        ("jax paged_attention T=1", *_peer_paged()),
        ("jax ragged_paged_attention T=1", *_peer_ragged(1)),
        ("probjax decode paged T=4", *_ours(4)),
        ("jax ragged_paged_attention T=4", *_peer_ragged(4)),
        ("probjax decode paged T=16 alibi+window", *_ours(16, hooks=True)),
        ("probjax decode dense T=1", *_ours(1, paged=False)),
        ("probjax decode paged T=1 2 splits", *_ours(1, splits=2)),
        ("probjax decode paged T=1 f32", *_ours(1, dtype=jnp.float32)),
        ("probjax decode paged T=1 f16", *_ours(1, dtype=jnp.float16)),
        ("probjax decode paged T=2 D=192 Dv=128", *_ours(2, head_dim=192, value_dim=128)),
        ("probjax decode paged T=1 MQA 32:1", *_ours(1, num_kv_heads=1)),
        ("probjax decode paged T=8 GQA 32:2", *_ours(8, num_kv_heads=2)),
    ]


def edge_variants() -> list[tuple[str, object, tuple]]:
    """Shapes off the serving path (--edge): a dense cache shorter than a block and one whose last block is
    partial, a page larger than a step, K = 3 with head dim 64 and a group of 2 (bfloat16 and float32)."""
    i32 = jnp.int32

    def dense(length, dtype=jnp.bfloat16):
        def fn(q, k, v, lengths):
            return decode_attention(q, k, v, kv_lengths=lengths)
        cache = jax.ShapeDtypeStruct((2, length, 2, 128), dtype)
        return fn, (jax.ShapeDtypeStruct((2, 1, 8, 128), dtype), cache, cache, jax.ShapeDtypeStruct((2,), i32))

    def paged(page, dtype=jnp.bfloat16):
        def fn(q, k, v, lengths, tables):
            return decode_attention(q, k, v, kv_lengths=lengths, block_tables=tables)
        pages = jax.ShapeDtypeStruct((9, page, 3, 64), dtype)
        return fn, (jax.ShapeDtypeStruct((2, 3, 6, 64), dtype), pages, pages, jax.ShapeDtypeStruct((2,), i32),
                    jax.ShapeDtypeStruct((2, 4), i32))

    return [
        ("probjax decode dense S=37", *dense(37)), ("probjax decode dense S=37 f32", *dense(37, jnp.float32)),
        ("probjax decode dense S=1000", *dense(1000)), ("probjax decode paged page=256 K=3 D=64", *paged(256)),
        ("probjax decode paged K=3 D=64", *paged(16)), ("probjax decode paged K=3 D=64 f32", *paged(16, jnp.float32)),
    ]


def compile_one(fn, specs, device) -> dict:
    """Compiles fn at specs for `device`: compile seconds, and each tpu_custom_call with its scoped VMEM."""
    sharding = SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    with jax.default_device(device), warnings.catch_warnings():
        warnings.simplefilter("error")
        start = time.perf_counter()
        compiled = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).compile()
        seconds = time.perf_counter() - start
    kernels = []
    for line in compiled.as_text().splitlines():
        call, scoped = _CALL.search(line), _SCOPED.search(line)
        if call:
            kernels.append(dict(kernel=call.group(1), scoped_vmem=int(scoped.group(1)) if scoped else None))
    return dict(compile_s=round(seconds, 2), kernels=kernels)


def probe(generation: str, verbose: bool = True, edge: bool = False) -> list[dict]:
    topology = topologies.get_topology_desc(topology_name=GENERATIONS[generation], platform="tpu",
                                            chips_per_host_bounds=[1, 1, 1])
    device = topology.devices[0]
    rows = []
    for name, fn, specs in variants() + (edge_variants() if edge else []):
        try:
            row = dict(generation=generation, variant=name, **compile_one(fn, specs, device))
        except Exception as error:  # noqa: BLE001 - every failure is a row of the report
            row = dict(generation=generation, variant=name, error=str(error)[:500])
        rows.append(row)
        if verbose:
            if "error" in row:
                print(f"{generation} | {name} | FAILED: {row['error'][:300]}")
            else:
                vmem = ", ".join(f"{x['kernel']} {(x['scoped_vmem'] or 0) / 2**20:.2f} MiB" for x in row["kernels"])
                print(f"{generation} | {name} | {len(row['kernels'])} kernel(s) | {row['compile_s']:.1f} s | {vmem}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", nargs="*", default=list(GENERATIONS))
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--edge", action="store_true", help="also compile `edge_variants()`")
    args = parser.parse_args()
    rows = []
    for generation in args.generations:
        rows += probe(generation, edge=args.edge)
    failures = [row for row in rows if "error" in row]
    print(f"{len(rows) - len(failures)} compiled, {len(failures)} failed")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
