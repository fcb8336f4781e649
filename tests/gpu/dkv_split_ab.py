"""The Triton dK/dV kernel's split grid against one program per key tile (docs/perf-notes.md, Version 7f; item 12
of "The next GPU run") on a Hopper GPU: head dim 256, bfloat16, with a bfloat16 bias, a float32 bias and a
relative-bias table. For each call and grid it checks the gradients against the float32 reference at seq 1024,
then times the forward + backward at the longer seqs; one JSON line per (call, grid, seq), so that a run cut
short keeps what it measured:

    python tests/gpu/dkv_split_ab.py OUT.jsonl

"split" is the dispatch's default there (dV's and dK's programs on 32-query steps); "one_program" forces
`triton.retile.dkv_split` off (the dK/dV kernel on 16-query steps, where the float32 tile spilled 8 B). With
`--interpret` it runs on the CPU in Pallas interpret mode at a tiny shape (a smoke test of the script: both
grids on the transposed kernel, no timing worth reading).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from probjax_kernels import (
    FlashConfig, _dispatch, flash_attention, flash_attention_reference, flex_attention, flex_attention_reference,
    relative_bias,
)
from probjax_kernels.triton import retile
from probjax_kernels.triton import plan as triton_plan
from probjax_nn.benchmark._timing import time_steps

HEAD_DIM, HEADS = 256, 8
TOLERANCE = 4e-2  # normalised max error of a bfloat16 gradient (tests/gpu/test_gpu_flash.py: 2 x 2e-2)


@contextlib.contextmanager
def grid(split: bool, interpret: bool):
    """The dK/dV grid for the calls inside: the dispatch's (`split`) or one program per key tile. Interpret
    mode also forces the transposed kernel, which the dispatch picks on Hopper only."""
    saved = retile.dkv_split, triton_plan.retile.dkv_split, triton_plan.dkv_transposed
    if not split:
        retile.dkv_split = triton_plan.retile.dkv_split = lambda *args, **kwargs: False
    elif interpret:
        triton_plan.retile.dkv_split = lambda *args, **kwargs: True
    if interpret:
        triton_plan.dkv_transposed = lambda *args, **kwargs: True
    try:
        yield
    finally:
        retile.dkv_split, triton_plan.retile.dkv_split, triton_plan.dkv_transposed = saved


def calls(config: FlashConfig | None):
    """name -> (attention(q, k, v, extra), reference(q, k, v, extra), extra(batch, seq)) of the three calls."""
    def biased(dtype):
        return (lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, causal=True, config=config),
                lambda q, k, v, bias: flash_attention_reference(q, k, v, bias=bias, causal=True),
                lambda batch, seq: jax.random.normal(jax.random.key(3), (batch, HEADS, seq, seq), dtype))

    def table(batch, seq):
        return 0.3 * jax.random.normal(jax.random.key(4), (HEADS, 2 * seq - 1), jnp.float32)

    return {
        "bias_bf16": biased(jnp.bfloat16),
        "bias_f32": biased(jnp.float32),
        "relative_bias": (
            lambda q, k, v, t: flex_attention(q, k, v, relative_bias(t), config=config),
            lambda q, k, v, t: flex_attention_reference(q, k, v, relative_bias(t)),
            table),
    }


def grads_fn(attention):
    """Jitted gradients of sum(out * cotangent) in q, k, v and the extra argument (bias / table)."""
    def loss(q, k, v, extra, cotangent):
        return jnp.sum(attention(q, k, v, extra).astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def inputs(batch: int, seq: int, make_extra):
    keys = jax.random.split(jax.random.key(seq), 4)
    q, k, v = (jax.random.normal(key, (batch, seq, HEADS, HEAD_DIM), jnp.bfloat16) for key in keys[:3])
    cotangent = jax.random.normal(keys[3], (batch, seq, HEADS, HEAD_DIM), jnp.float32)
    return q, k, v, make_extra(batch, seq), cotangent


def error(actual, expected) -> float:
    actual, expected = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (actual, expected))
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-6))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON lines, appended")
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--check-seq", type=int, default=1024)
    parser.add_argument("--interpret", action="store_true", help="CPU smoke test at a tiny shape")
    args = parser.parse_args(argv)
    config = None
    if args.interpret:
        config = FlashConfig(block_q=16, block_k=32, block_q_dq=16, block_k_dq=32, block_q_dkv=16, block_k_dkv=32,
                             backend="interpret")
        args.seqs, args.check_seq, args.batch = [64], 64, 1
    with open(args.out, "a") as out:
        def write(**row):
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(row, flush=True)

        for name, (attention, reference, make_extra) in calls(config).items():
            for split in (True, False):
                row = dict(call=name, grid="split" if split else "one_program", head_dim=HEAD_DIM, heads=HEADS,
                           batch=args.batch, device=jax.devices()[0].device_kind)
                with grid(split, args.interpret):
                    try:
                        args_check = inputs(args.batch, args.check_seq, make_extra)
                        got = grads_fn(attention)(*args_check)
                        want = grads_fn(reference)(*args_check)
                        errors = {g: error(a, e) for g, a, e in zip(("dq", "dk", "dv", "dextra"), got, want)}
                        write(**row, seq=args.check_seq, errors=errors, exact=max(errors.values()) <= TOLERANCE)
                        for seq in args.seqs:
                            timed_args = inputs(args.batch, seq, make_extra)
                            start = time.perf_counter()
                            step = grads_fn(attention).lower(*timed_args).compile()
                            jax.block_until_ready(step(*timed_args))
                            timing = time_steps(lambda: step(*timed_args), jax.block_until_ready)
                            write(**row, seq=seq, **timing, compile_s=round(time.perf_counter() - start, 1))
                    except Exception as failure:  # noqa: BLE001 - recorded, the next call goes on
                        write(**row, error=f"{type(failure).__name__}: {failure}"[:300])


if __name__ == "__main__":
    main()
