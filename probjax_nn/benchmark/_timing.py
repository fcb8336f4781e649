"""Timing protocol and the FLOP count that turns a time into TFLOP/s."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

SAMPLES = 7
# All SAMPLES samples together take about this long: the seed's and the peers' `inner` values follow it.
TOTAL_S = 0.25
MAX_INNER = 200  # the seed's largest `inner`


def time_steps(run: Callable[[], Any], wait: Callable[[Any], None]) -> dict[str, float | int]:
    """Times `run` after a warm-up by the caller: `inner` back-to-back calls per sample, then one `wait`.

    **Returns:** `inner` and the median and quartiles over SAMPLES samples of the time per call, in ms.
    """
    start = time.perf_counter()
    wait(run())
    once = time.perf_counter() - start
    inner = int(np.clip(TOTAL_S / SAMPLES / max(once, 1e-9), 1, MAX_INNER))
    per_call_ms = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(inner):
            result = run()
        wait(result)
        per_call_ms.append((time.perf_counter() - start) / inner * 1e3)
    q1, median, q3 = np.percentile(per_call_ms, [25, 50, 75])
    return {"inner": inner, "median_ms": float(median), "q1_ms": float(q1), "q3_ms": float(q3)}


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool, mode: str) -> float:
    """4 B N T S D for the two matmuls of a forward (T = S = seq); causal counts half; fwd_bwd 3.5 times (the
    forward's 2 matmuls and the backward's 5); jvp 3 times (2 for the output, 4 for its tangent:
    dq k^T, q dk^T, dp v and p dv)."""
    flops = 4.0 * batch * heads * seq * seq * head_dim
    return flops * (0.5 if causal else 1.0) * {"fwd": 1.0, "fwd_bwd": 3.5, "jvp": 3.0}[mode]
