"""The decode kernel on pages of 16 keys: 32-key steps (the planner's default there since Version 22 of
docs/perf-notes.md, two pages a step) against 64-key steps (the default before, four pages a step, which spilled
8 B at 128 registers on sm_86 / sm_89 / sm_100a). For each (batch, heads, new tokens, cache length) and key
step it checks `decode_attention` against `decode_attention_reference`, then times it; one JSON line per
case, so that a run cut short keeps what it measured:

    python tests/gpu/decode_key_steps_ab.py OUT.jsonl

With `--interpret` it runs on the CPU in Pallas interpret mode at a tiny shape (a smoke test of the script:
no timing worth reading).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp

from dkv_split_ab import error  # the normalised max error (this folder's scripts run from it)
from probjax_kernels import DecodeConfig, decode_attention, decode_attention_reference
from probjax_nn.benchmark._timing import time_steps

HEAD_DIM, PAGE = 128, 16
TOLERANCE = 2e-2  # normalised max error of a bfloat16 output (tests/gpu/test_gpu_decode.py's)


def inputs(batch: int, heads: tuple[int, int], new_tokens: int, cache_len: int):
    """q [B, T, N, D], pages [B * S / 16, 16, K, D] in a shuffled block table, lengths of 3/4 to all of S."""
    num_heads, kv_heads = heads
    pages_per_seq = cache_len // PAGE
    keys = jax.random.split(jax.random.key(cache_len + batch), 4)
    q = jax.random.normal(keys[0], (batch, new_tokens, num_heads, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch * pages_per_seq, PAGE, kv_heads, HEAD_DIM), jnp.bfloat16)
            for key in keys[1:3])
    tables = jax.random.permutation(keys[3], batch * pages_per_seq).reshape(batch, pages_per_seq).astype(jnp.int32)
    lengths = jnp.linspace(cache_len * 3 // 4, cache_len, batch).astype(jnp.int32)
    return q, k, v, lengths, tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON lines, appended")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--cache-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--interpret", action="store_true", help="CPU smoke test at a tiny shape")
    args = parser.parse_args(argv)
    backend = "interpret" if args.interpret else "triton"
    if args.interpret:
        args.batch, args.cache_lens = [2], [128]
    with open(args.out, "a") as out:
        for batch, heads, new_tokens, cache_len in itertools.product(
                args.batch, [(8, 1), (32, 8)], [1, 16], args.cache_lens):
            q, k, v, lengths, tables = inputs(batch, heads, new_tokens, cache_len)
            want = decode_attention_reference(q, k, v, kv_lengths=lengths, block_tables=tables)
            for block_k in (32, 64):
                row = dict(batch=batch, heads=f"{heads[0]}:{heads[1]}", new_tokens=new_tokens, cache_len=cache_len,
                           page_size=PAGE, head_dim=HEAD_DIM, block_k=block_k, device=jax.devices()[0].device_kind)
                config = DecodeConfig(block_k=block_k, backend=backend)
                try:
                    step = jax.jit(lambda q, k, v, lengths, tables, config=config: decode_attention(
                        q, k, v, kv_lengths=lengths, block_tables=tables, config=config))
                    start = time.perf_counter()
                    got = jax.block_until_ready(step(q, k, v, lengths, tables))
                    row.update(compile_s=round(time.perf_counter() - start, 1), error=error(got, want))
                    row["exact"] = row["error"] <= TOLERANCE
                    row.update(time_steps(lambda: step(q, k, v, lengths, tables), jax.block_until_ready))
                except Exception as failure:  # noqa: BLE001 - recorded, the next case goes on
                    row["failure"] = f"{type(failure).__name__}: {failure}"[:300]
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(row, flush=True)


if __name__ == "__main__":
    main()
