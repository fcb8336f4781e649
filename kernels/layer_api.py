"""The seam between the kernels and a layer library: what `probjax_nn` builds on besides the attention
functions of `probjax_kernels`, so that the kernels can change inside without breaking the layers.

- `check_inputs(q, k, v, *, bias, mask, scale, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, window,
  dropout_rate, allowed_dtypes, max_head_dim) -> AttentionInputs`: every check that `flash_attention` makes
  (a `ValueError` / `TypeError` naming the argument, the value it got and what it needs), returning the
  inputs normalised: bias and mask 4-D with 1 on broadcast axes, the scale a float, the window a
  `(left, right)` pair. `allowed_dtypes` and `max_head_dim` state what the caller's implementation computes.
- `check_dropout(dropout_rate, dropout_seed)`: the dropout seed as a uint32 scalar (None without dropout);
  a rate without a seed is a `ValueError`. `check_dropout_rate(dropout_rate)`: the rate as a Python float in
  [0, 1) (a traced rate is a `TypeError`: the kernels compile it). `check_flag(name, value)`: a Python bool
  such as `causal`, else a `TypeError` naming `name`.
- `check_logits_soft_cap(logits_soft_cap)`: None, or the cap as a positive, finite Python float (else a
  `ValueError` naming `logits_soft_cap`; a traced cap is a `TypeError`). `soft_capped(score_mod, cap)`: the
  score_mod that applies `score_mod` and then `softcap(cap)` (`score_mod` itself when cap is None), the soft
  cap of `flash_attention(logits_soft_cap=...)` as a hook for the paths that take hooks.
- `runs_reference(config, inputs)`: whether `flash_attention` / `flex_attention` with `config` on these
  checked inputs run their plain-jnp path instead of the kernels (inside a `jax.shard_map` that checks varying
  manual axes, where the CPU's interpreters of the GPU kernels cannot run); a layer then needs no per-shard
  `shard_map` of its own.
- `AttentionInputs`: the checked inputs, with `.shape = (B, T, S, N, K, D)`.
- `attention_from_inputs(inputs, causal, compute_dtype=float32, *, score_mod, mask_mod, dropout_rate,
  dropout_seed) -> (out, lse)`: dense softmax attention in plain jnp on checked inputs (out `[B, T, N, D]` in
  q's dtype, lse `[B, N, T]`), with the kernels' masking conventions and dropout keep mask, so that it agrees
  with them exactly; `probjax_nn.attention`'s XLA implementation.
- `chunked_attention(inputs, causal, compute_dtype=float32, *, score_mod, mask_mod, dropout_rate, dropout_seed,
  return_lse, chunk_bytes) -> (out, lse or None)`: the same attention as XLA ops over query bands and chunks,
  each band reading only the keys that causal and the window let it see; memory linear in T (a step's
  scores fit `chunk_bytes`). `probjax_nn.attention`'s path for impl "auto" off the GPU. `compute_dtype(inputs)`:
  the dtype both compute in (float64 for float64 inputs, as jax.nn does; else float32).
- `affine_score_mod(scale, bias, score_mod)`: the score_mod `score_mod(scale * score + bias[b, h, q_idx,
  kv_idx])`, how a traced scale or a dense bias reaches `flex_attention`; `broadcast_lookup(array, b, h,
  q_idx, kv_idx)`: `array[b, h, q_idx, kv_idx]` of a `[B|1, N|1, T|1, S|1]` array (a dense mask as a
  mask_mod).
- `target_device()`, `target_platform()`: the device a call compiles for (`jax.default_device`'s when set, as
  in a deviceless compile; else the default backend's first): the kernels' choice of backend and
  `impl="auto"` both read it.
- `MAX_HEAD_DIM`: the largest head dim the Pallas kernels take. `LAYOUTS`, `STRATEGIES`: the sequence
  layouts ("contiguous", "zigzag") and schedules ("ring", "allgather") that `ring_attention` takes.
"""

from probjax_kernels import _backend
from probjax_kernels._chunked import chunked_attention as chunked_attention
from probjax_kernels._hooks import affine_score_mod as affine_score_mod
from probjax_kernels._hooks import broadcast_lookup as broadcast_lookup
from probjax_kernels._flash_attention import runs_reference as runs_reference
from probjax_kernels._hooks import soft_capped as soft_capped
from probjax_kernels._inputs import MAX_HEAD_DIM as MAX_HEAD_DIM
from probjax_kernels._inputs import AttentionInputs as AttentionInputs
from probjax_kernels._inputs import check_dropout as check_dropout
from probjax_kernels._inputs import check_dropout_rate as check_dropout_rate
from probjax_kernels._inputs import check_flag as check_flag
from probjax_kernels._inputs import check_inputs as check_inputs
from probjax_kernels._inputs import check_logits_soft_cap as check_logits_soft_cap
from probjax_kernels._inputs import check_sinks as check_sinks
from probjax_kernels._reference import attention_from_inputs as attention_from_inputs
from probjax_kernels._reference import compute_dtype as compute_dtype
from probjax_kernels._sinks import attach_sinks as attach_sinks
from probjax_kernels.parallel.ring import LAYOUTS as LAYOUTS
from probjax_kernels.parallel.ring import STRATEGIES as STRATEGIES

__all__ = [
    "LAYOUTS", "MAX_HEAD_DIM", "STRATEGIES", "AttentionInputs", "affine_score_mod", "attention_from_inputs",
    "broadcast_lookup", "check_dropout", "check_dropout_rate", "check_flag", "check_inputs", "check_logits_soft_cap",
    "chunked_attention", "compute_dtype", "runs_reference", "soft_capped", "target_device", "target_platform",
]


def target_device():
    """The device a call compiles for, as the kernels see it (`_backend.target_device`)."""
    return _backend.target_device()


def target_platform() -> str:
    """The platform of that device ("gpu", "tpu", "cpu"), as the kernels' choice of backend reads it."""
    return _backend.target_platform()
