"""Compiles the Mosaic TPU ragged paged attention kernel (kernels/tpu/ragged.py) for TPU generations without
a TPU (deviceless ahead-of-time compilation through libtpu) at a serving shape, and prints per generation
and variant whether it compiled, its scoped VMEM and the compile time.

Run it with the toolchain of scripts/compile/tpu_toolchain.sh, from the repository root:

    JAX_PLATFORMS=cpu PYTHONPATH=.shim:. TOOLCHAIN/venv/bin/python scripts/compile/tpu_ragged_probe.py

(`.shim/probjax_kernels` links to kernels/, as for tpu_decode_probe.py.) It calls the kernel through its
contract (no front-end): 256 packed tokens (decode rows, chunks and prompts alike: the shapes are static)
over 16 sequences of up to 2048 keys, GQA 32:8, head dim 128, bfloat16 unless named. What it proves: the
kernel lowers through Mosaic TPU and fits the chip's scoped VMEM; not that it is right (the interpret-mode
tests) or fast.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from probjax_kernels import alibi, sliding_window
from probjax_kernels.decode.attention import trace_decode_hook
from probjax_kernels.tpu.ragged import ragged_paged_attention_kernel
from tpu_decode_probe import GENERATIONS, compile_one

TOKENS, SEQS, N, K, D, CONTEXT = 256, 16, 32, 8, 128, 2048


def _variant(page: int = 16, block_q: int = 32, dtype=jnp.bfloat16, page_dtype=None, window=None,
             soft_cap=None, sinks: bool = False, hooks: bool = False):
    """(fn, specs) of the kernel at the serving shape with these options."""
    i32, f32 = jnp.int32, jnp.float32
    pages_per_seq = CONTEXT // page
    page_dtype = page_dtype or dtype
    quantized = page_dtype != dtype

    def fn(q, k_pages, v_pages, kv_lens, tables, cu_q_lens, num_seqs, *extra):
        extra = list(extra)
        sink = extra.pop(0) if sinks else None
        k_scale, v_scale = (extra.pop(0), extra.pop(0)) if quantized else (None, None)
        # Built inside the trace: an eager jnp op on a deviceless TPU device fails.
        score, score_consts = trace_decode_hook("score_mod", alibi(jnp.linspace(0.05, 0.5, N)) if hooks else None)
        mask, mask_consts = trace_decode_hook("mask_mod", sliding_window(1023) if hooks else None)
        return ragged_paged_attention_kernel(
            q, k_pages, v_pages, kv_lens, tables, cu_q_lens, num_seqs, sink, k_scale, v_scale,
            [*score_consts, *mask_consts], scale=D**-0.5, sliding_window=window, soft_cap=soft_cap,
            score_hook=score, mask_hook=mask, num_score_consts=len(score_consts), block_q=block_q, interpret=False)

    pages = jax.ShapeDtypeStruct((SEQS * pages_per_seq, page, K, D), page_dtype)
    specs = [jax.ShapeDtypeStruct((TOKENS, N, D), dtype), pages, pages, jax.ShapeDtypeStruct((SEQS,), i32),
             jax.ShapeDtypeStruct((SEQS, pages_per_seq), i32), jax.ShapeDtypeStruct((SEQS + 1,), i32),
             jax.ShapeDtypeStruct((), i32)]
    specs += [jax.ShapeDtypeStruct((N,), f32)] if sinks else []
    specs += [jax.ShapeDtypeStruct((K,), f32)] * 2 if quantized else []
    return fn, tuple(specs)


def _peer(page: int = 16, block_q: int = 32):
    """JAX's ragged_paged_attention at the same shape (k and v heads interleaved: pages [P, page, 2K, D]),
    128 keys (8 pages of 16, 2 of 64) and `block_q` tokens a block, as ours."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention  # noqa: PLC0415

    pages_per_seq = CONTEXT // page

    def fn(q, kv_pages, kv_lens, tables, cu_q_lens, num_seqs):
        return ragged_paged_attention(q, kv_pages, kv_lens, tables, cu_q_lens, num_seqs, sm_scale=D**-0.5,
                                      num_kv_pages_per_block=128 // page, num_queries_per_block=block_q)

    i32 = jnp.int32
    return fn, (jax.ShapeDtypeStruct((TOKENS, N, D), jnp.bfloat16),
                jax.ShapeDtypeStruct((SEQS * pages_per_seq, page, 2 * K, D), jnp.bfloat16),
                jax.ShapeDtypeStruct((SEQS,), i32), jax.ShapeDtypeStruct((SEQS, pages_per_seq), i32),
                jax.ShapeDtypeStruct((SEQS + 1,), i32), jax.ShapeDtypeStruct((1,), i32))


def variants() -> list[tuple[str, object, tuple]]:
    return [
        ("jax ragged_paged_attention page=16 block_q=32 (peer)", *_peer()),
        ("jax ragged_paged_attention page=64 block_q=32 (peer)", *_peer(page=64)),
        ("ragged page=16 block_q=32", *_variant()),
        ("ragged page=64 block_q=32", *_variant(page=64)),
        ("ragged page=16 block_q=16", *_variant(block_q=16)),
        ("ragged page=16 window=1024 soft_cap sinks", *_variant(window=1024, soft_cap=30.0, sinks=True)),
        ("ragged page=16 alibi + sliding_window mask_mod", *_variant(hooks=True)),
        ("ragged page=16 int8 pages", *_variant(page_dtype=jnp.int8)),
        ("ragged page=16 float8_e4m3fn pages", *_variant(page_dtype=jnp.float8_e4m3fn)),
        ("ragged page=16 f32", *_variant(dtype=jnp.float32)),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", nargs="*", default=["v5e", "v6e"])
    parser.add_argument("--only", default="", help="variants whose name holds this text")
    args = parser.parse_args()
    failures = 0
    for generation in args.generations:
        device = topologies.get_topology_desc(topology_name=GENERATIONS[generation], platform="tpu",
                                              chips_per_host_bounds=[1, 1, 1]).devices[0]
        for name, fn, specs in variants():
            if args.only not in name:
                continue
            try:
                row = compile_one(fn, specs, device)
            except Exception as error:  # noqa: BLE001 - every failure is a line of the report
                failures += 1
                print(f"{generation} | {name} | FAILED: {str(error)[:600]}", flush=True)
                continue
            vmem = ", ".join(f"{x['kernel']} {(x['scoped_vmem'] or 0) / 2**20:.2f} MiB" for x in row["kernels"])
            print(f"{generation} | {name} | {len(row['kernels'])} kernel(s) | {row['compile_s']:.1f} s | {vmem}",
                  flush=True)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
