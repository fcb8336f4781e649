"""`decode_attention`: a few new tokens per sequence against a long dense or paged KV cache (flash-decoding).

Entry point: checks, hook tracing, and the forward-only wrapper around the Pallas kernel
(`triton/decode.py`). The plain-jnp reference with the same signature is in `decode/reference.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from probjax_kernels._decode_inputs import (
    DecodeConfig, check_decode_inputs, decode_hook_args, empty_outputs, poison_rows,
)
from probjax_kernels._dispatch import decode_plan
from probjax_kernels._hooks import EXAMPLE_TILE, Hook, hook_hint, trace_hook
from probjax_kernels.decode.reference import decode_attention_reference
from probjax_kernels.flex.mods import mask_lookback


def trace_decode_hook(name: str, fn: Callable | None) -> tuple[Hook | None, list[jax.Array]]:
    """Traces a score_mod / mask_mod on a decode tile; returns the Hook and the arrays it closes over."""
    if fn is None:
        return None, []
    is_score = name == "score_mod"
    example = [jnp.zeros(a.shape, a.dtype) for a in decode_hook_args(is_score, EXAMPLE_TILE, EXAMPLE_TILE)]
    with hook_hint(name):
        hook, consts, out = trace_hook(name, fn, example)
    want = (jnp.float32 if is_score else jnp.bool_), (EXAMPLE_TILE, EXAMPLE_TILE)
    # A mask_mod may return anything that broadcasts to the tile (a row when it reads only kv_idx).
    shape = want[1] if is_score or len(out.shape) != 2 else jnp.broadcast_shapes(out.shape, want[1])
    if (out.dtype, shape) != want or (is_score and out.shape != want[1]):
        raise TypeError(
            f"{name} must return {jnp.dtype(want[0]).name}{list(want[1])} on a {list(want[1])} tile "
            f"(score float32 tile, b scalar, h and q_idx columns, kv_idx a row); it returned "
            f"{out.dtype}{list(out.shape)}."
        )
    return hook, consts


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def forward_only(op: str, run, *arrays):
    """`run(*arrays)` for the inference op named `op`, whose JVP (and so gradient) raises."""
    return run(*arrays)


@forward_only.defjvp
def _no_derivative(op, run, primals, tangents):
    del run, primals, tangents
    raise NotImplementedError(
        f"{op} is forward only (inference): it has no gradient or JVP. Differentiate flash_attention / "
        f"flex_attention, or {op}_reference, instead."
    )


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kv_lengths: jax.Array,
    block_tables: jax.Array | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    num_splits: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    config: DecodeConfig | None = None,
    causal: bool = True,
):
    """Attention of T new tokens per sequence (T = 1..16) to a dense or paged KV cache (flash-decoding).

    The cache already holds the new tokens: sequence b has `kv_lengths[b]` keys, and its new token t sits at
    position `kv_lengths[b] - T + t`; it attends the keys at or before that position (causal among the new
    tokens; with `causal=False` every key below the length, the mask_mod deciding the rest). The cache is
    split over `num_splits` programs per (sequence, key/value head), whose partial results are merged by
    their log-sum-exp; the N / K query heads of a group share one pass over the cache.

    **Arguments:**

    - `q`: `[B, T, N, D]`, bfloat16, float16 or float32; D <= 256.
    - `k`, `v`: a dense cache `[B, S, K, D]` / `[B, S, K, Dv]`, or, with `block_tables`, a paged one
      `[P, page_size, K, D]` / `[P, page_size, K, Dv]` (page_size a power of two >= 16); q's dtype; N a
      multiple of K; Dv may differ from D.
    - `kv_lengths`: `[B]` int, keys of each sequence (new tokens included): 0 (an empty slot: output 0, lse
      -inf) or T..capacity (S, or max_pages * page_size).
    - `block_tables`: `[B, max_pages]` int32, the pages of each sequence in order: key position j of sequence
      b is `k[block_tables[b, j // page_size], j % page_size]`. Pages may be shared (a common prefix) and
      in any order; entries past `cdiv(kv_lengths[b], page_size)` are never used. Lengths and the used
      entries are checked when concrete (ValueError); under `jit` a sequence that breaks the contract gets
      NaN rows (out and lse), here and in the reference alike (docs/decoding.md).
    - `score_mod(score, b, h, q_idx, kv_idx) -> score` and `mask_mod(b, h, q_idx, kv_idx) -> bool` (True =
      attend), FlexAttention's hooks: q_idx is the global position above. Called on a float32 tile whose
      rows pack several heads, so h and q_idx are int32 columns, kv_idx a row, b a scalar: write them with
      broadcasting jnp operations (`alibi`, `softcap`, `relative_bias`, the mask_mods of this package do).
      They may close over arrays (kernel inputs). A mask_mod whose reach back is known (`sliding_window(w)`,
      alone or inside `and_masks`) makes the splits cover only the steps from the earliest new token's
      window on: a window of 4096 over a 128k cache reads about 4096 keys.
    - `num_splits`: programs per (sequence, key/value head) over the cache; None picks one from B, K, the
      cache length and the device.
    - `scale`: a Python float, default `D ** -0.5`.
    - `return_lse`: also return lse `[B, N, T]` float32 (natural log; -inf for a row that attends nothing).
    - `config`: a `DecodeConfig` (tile, warps, stages, backend); None picks defaults for the device.
    - `causal`: True (default) masks the later new tokens from the earlier ones, as a causal training mask
      does. False lets every new token see all `kv_lengths[b]` keys, so a mask_mod that is not causal among
      them (`prefix_lm` with new tokens inside the prefix, bidirectional blocks) gives flex_attention's
      rows; the mask_mod then decides alone.

    **Returns:** out `[B, T, N, Dv]` in q's dtype, or `(out, lse)` with `return_lse`.

    Forward only: `jax.grad` / `jax.jvp` through it raise `NotImplementedError`. Composes with `jit`.
    """
    inputs = check_decode_inputs(
        q, k, v, kv_lengths=kv_lengths, block_tables=block_tables, score_mod=score_mod, mask_mod=mask_mod,
        num_splits=num_splits, scale=scale, return_lse=return_lse, causal=causal,
    )
    if config is not None and not isinstance(config, DecodeConfig):
        raise TypeError(f"config must be a DecodeConfig or None, got {type(config).__name__}.")
    if inputs.q.shape[0] == 0:
        return empty_outputs(inputs)
    inputs = dataclasses.replace(inputs, lookback=mask_lookback(mask_mod))
    score_hook, score_consts = trace_decode_hook("score_mod", score_mod)
    mask_hook, mask_consts = trace_decode_hook("mask_mod", mask_mod)
    kernel = decode_plan(inputs, config, score_hook, mask_hook, len(score_consts))
    if kernel is None:  # a hook the TPU decode kernel cannot run (warned): the XLA path
        return decode_attention_reference(
            q, k, v, kv_lengths=kv_lengths, block_tables=block_tables, score_mod=score_mod, mask_mod=mask_mod,
            num_splits=num_splits, scale=scale, return_lse=return_lse, causal=causal,
        )
    run = functools.partial(kernel.run, kernel.plan)
    out, lse = forward_only(
        "decode_attention", run, inputs.q, inputs.k, inputs.v, inputs.kv_lengths, inputs.block_tables,
        [*score_consts, *mask_consts],
    )
    out, lse = poison_rows(out, lse, inputs.out_of_contract)
    return (out, lse) if inputs.return_lse else out
