"""Keys the ragged paged attention kernels read against the live keys, for a few serving batches: a model of
their page walk (`probjax_kernels._ragged_schedule.keys_read`, the rule both kernels follow), not a
measurement. Prints a markdown table (docs/decoding.md quotes it).

    .venv/bin/python scripts/ragged_reads.py
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from probjax_kernels._ragged_inputs import default_block_q
from probjax_kernels._ragged_schedule import keys_read

TOKENS, GROUP = 256, 4  # the compile rows' bucket, GQA 32:8
BATCHES = {
    "16 decodes at 2048 keys": ([1] * 16, [2048] * 16),
    "12 decodes at 2048, 3 chunks of 64 over 1024, a 52-token prompt": (
        [1] * 12 + [64] * 3 + [52], [2048] * 12 + [1088] * 3 + [52]),
    "2 chunks of 128 over 4096-key prefixes": ([128] * 2, [4224] * 2),
    "a 256-token prompt": ([256], [256]),
}
# (kernel, keys per step): Triton on Hopper / before Hopper (64-row tiles), Mosaic TPU (8 pages of 16).
KERNELS = (("Triton sm_90a", 64), ("Triton sm_80 / sm_86", 32), ("Mosaic TPU", 128))


def main() -> None:
    block_q = default_block_q(TOKENS, GROUP)
    print(f"block_q = {block_q} (the default for {TOKENS} tokens, GQA group {GROUP}); keys read / live keys:\n")
    print("| batch | " + " | ".join(name for name, _ in KERNELS) + " |")
    print("|---|" + "---:|" * len(KERNELS))
    for name, (new, lens) in BATCHES.items():
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
        cells = []
        for _, step in KERNELS:
            read, live = keys_read(cu, jnp.asarray(lens, jnp.int32), jnp.int32(len(new)), TOKENS, block_q, step)
            cells.append(f"{int(read) / int(live):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
