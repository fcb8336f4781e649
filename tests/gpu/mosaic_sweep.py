"""Times the Mosaic GPU forward (and dQ) kernels over their tile configs on a Hopper GPU; one JSON line per
config, so that a run cut short keeps what it measured. Run by tests/gpu/run_gpu_checks.sh:

    python tests/gpu/mosaic_sweep.py OUT.jsonl

Each line: kernel, head_dim, seq, causal, block_q, block_kv, num_stages, p_in_smem, median_ms and tflops (4 B N
T S D per forward, half when causal; the dQ kernel's 3 matmuls count 1.5x that, dK/dV's 4 count 2x), or an
error. B = 4, N = K = 8,
bfloat16; each shape also records cuDNN's forward (jax.nn.dot_product_attention) for comparison.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp

from probjax_kernels.mosaic.backward import mosaic_backward_dq
from probjax_kernels.mosaic.backward_dkv import mosaic_backward_dkv
from probjax_kernels.mosaic.forward import mosaic_forward
from probjax_nn.benchmark._timing import time_steps

# The target first: hd 128 at seq 8192 (issue 7: >= 600 TFLOP/s forward).
FORWARD_CONFIGS = {
    128: [(128, 128, 2, False), (128, 64, 3, False), (128, 64, 4, False), (128, 128, 3, False), (128, 128, 2, True)],
    64: [(128, 128, 2, False), (128, 128, 3, False), (256, 128, 2, False), (128, 128, 2, True)],
}
DQ_CONFIGS = [(128, 64, 2), (128, 128, 2)]
DKV_CONFIGS = [(64, 128, 2, False), (64, 128, 3, False), (64, 128, 4, False), (128, 128, 2, False), (64, 128, 2, True)]
BATCH, HEADS = 4, 8


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * jnp.tanh(score / 30.0)


def _window_flops(seq: int, head_dim: int, window: int, causal: bool) -> float:
    """Forward flops of the attended pairs only: row r sees keys [r - window, r] (causal) or
    [r - window, r + window]."""
    rows = jnp.arange(seq)
    lo = jnp.maximum(rows - window, 0)
    hi = rows if causal else jnp.minimum(rows + window, seq - 1)
    return 4.0 * BATCH * HEADS * head_dim * float(jnp.sum(hi - lo + 1))


def timed(fn, *args) -> float:
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return time_steps(lambda: compiled(*args), jax.block_until_ready)["median_ms"]


def main(path: str) -> None:
    with open(path, "a") as out:
        def write(**row):
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(row, flush=True)

        for seq in (8192, 4096, 2048):
            for head_dim, configs in FORWARD_CONFIGS.items():
                keys = jax.random.split(jax.random.key(seq + head_dim), 4)
                q, k, v, d_out = (jax.random.normal(key, (BATCH, seq, HEADS, head_dim), jnp.bfloat16) for key in keys)
                lengths = jnp.full((BATCH,), seq, jnp.int32)
                for causal in (False, True):
                    flops = 4.0 * BATCH * HEADS * seq * seq * head_dim * (0.5 if causal else 1.0)
                    shape = dict(head_dim=head_dim, seq=seq, causal=causal)
                    try:
                        ms = timed(lambda q, k, v: jax.nn.dot_product_attention(
                            q, k, v, is_causal=causal, implementation="cudnn"), q, k, v)
                        write(kernel="jax_cudnn_forward", **shape, median_ms=ms, tflops=flops / ms / 1e9)
                    except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
                        write(kernel="jax_cudnn_forward", **shape, error=f"{type(error).__name__}: {error}"[:300])
                    for block_q, block_kv, stages, p_in_smem in configs:
                        config = dict(block_q=block_q, block_kv=block_kv, num_stages=stages, p_in_smem=p_in_smem)
                        start = time.perf_counter()
                        try:
                            ms = timed(lambda q, k, v: mosaic_forward(
                                q, k, v, lengths, lengths, scale=head_dim**-0.5, causal=causal, **config), q, k, v)
                            write(kernel="mosaic_forward", **shape, **config, median_ms=ms, tflops=flops / ms / 1e9,
                                  wall_s=time.perf_counter() - start)
                        except Exception as error:  # noqa: BLE001
                            write(kernel="mosaic_forward", **shape, **config,
                                  error=f"{type(error).__name__}: {error}"[:300])
                    if head_dim != 128:
                        continue
                    if seq == 8192:  # the cost of a score_fn (one tanh per score) and the gain of a window
                        extras = {
                            "mosaic_forward_softcap": (dict(score_fn=_softcap), flops),
                            "mosaic_forward_window_1024": (dict(window=(1024, None if causal else 1024)),
                                                           _window_flops(seq, head_dim, 1024, causal)),
                        }
                        for kernel, (options, kernel_flops) in extras.items():
                            try:
                                ms = timed(lambda q, k, v: mosaic_forward(
                                    q, k, v, lengths, lengths, scale=head_dim**-0.5, causal=causal, **options), q, k, v)
                                write(kernel=kernel, **shape, median_ms=ms, tflops=kernel_flops / ms / 1e9)
                            except Exception as error:  # noqa: BLE001
                                write(kernel=kernel, **shape, error=f"{type(error).__name__}: {error}"[:300])
                    out, lse = mosaic_forward(q, k, v, lengths, lengths, scale=head_dim**-0.5, causal=causal)
                    for block_q, block_kv, stages in DQ_CONFIGS:
                        config = dict(block_q=block_q, block_kv=block_kv, num_stages=stages)
                        try:
                            ms = timed(lambda q, k, v, out, lse, d_out: mosaic_backward_dq(
                                q, k, v, out, lse, d_out, lengths, lengths, scale=head_dim**-0.5, causal=causal,
                                **config), q, k, v, out, lse, d_out)
                            write(kernel="mosaic_dq", **shape, **config, median_ms=ms, tflops=1.5 * flops / ms / 1e9)
                        except Exception as error:  # noqa: BLE001
                            write(kernel="mosaic_dq", **shape, **config, error=f"{type(error).__name__}: {error}"[:300])
                    for block_q, block_kv, stages, p_in_smem in DKV_CONFIGS:
                        config = dict(block_q=block_q, block_kv=block_kv, num_stages=stages, p_in_smem=p_in_smem)
                        try:
                            ms = timed(lambda q, k, v, out, lse, d_out: mosaic_backward_dkv(
                                q, k, v, out, lse, d_out, lengths, lengths, scale=head_dim**-0.5, causal=causal,
                                **config), q, k, v, out, lse, d_out)
                            write(kernel="mosaic_dkv", **shape, **config, median_ms=ms, tflops=2 * flops / ms / 1e9)
                        except Exception as error:  # noqa: BLE001
                            write(kernel="mosaic_dkv", **shape, **config,
                                  error=f"{type(error).__name__}: {error}"[:300])


if __name__ == "__main__":
    main(sys.argv[1])
