"""`flash_attention`: the jax.nn-style front-end of the kernel core (bias, mask, causal, lengths, segments)."""

from __future__ import annotations

import jax

from probjax_kernels import _autodiff
from probjax_kernels._backend import config_backend
from probjax_kernels._config import FlashConfig
from probjax_kernels._hooks import affine_score_mod, soft_capped, trace_score_mod
from probjax_kernels._inputs import (
    check_config, check_dropout, check_flag, check_inputs, check_logits_soft_cap, check_sinks, sharded_dropout,
)
from probjax_kernels._problem import Features
from probjax_kernels._reference import attention_from_inputs, compute_dtype
from probjax_kernels._sinks import attach_sinks


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | int | None = None,
    return_lse: bool = False,
    config: FlashConfig | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    _dropout_positions=None, _dropout_shard=None,
    _cotangents=None,
):
    """Memory-efficient exact attention, `softmax(scale * q k^T + bias, masked) v`, as Pallas kernels.

    Always runs the Pallas kernels (`FlashConfig.backend`). Differentiable in q, k, v, bias and sinks, in
    reverse and forward mode; composes with jit, vmap, grad, jvp, jacfwd and remat (docs/forward_mode.md).

    **Arguments:**

    - `q`: `[B, T, N, D]` queries; `k`: `[B, S, K, D]` keys and `v`: `[B, S, K, Dv]` values with N a multiple
      of K (grouped-query / multi-query attention without repeating K and V). The value head dim Dv may differ
      from D (e.g. 192 / 128 as in multi-head latent attention); k and v may have batch 1, shared by every
      example of q without being repeated (their gradients are summed over the batch). One dtype for all
      three: bfloat16, float16 or float32; any T, S >= 1; D, Dv <= 256. Accumulation is float32.
    - `bias`: float, broadcastable to `[B, N, T, S]`, added to the scaled scores; differentiable.
    - `mask`: bool, broadcastable to `[B, N, T, S]`; True = attend.
    - `causal`: a bool; query i sees keys j <= i (top-left alignment, as `jax.nn.dot_product_attention`).
    - `scale`: multiplies q k^T; default `D ** -0.5`. A traced 0-d array (a jit argument, a learnable
      temperature) scales the float32 scores in the kernels, differentiable (by an XLA pass over query chunks).
    - `q_lengths`, `kv_lengths`: `[B]` ints; query rows >= q_lengths[b] and keys >= kv_lengths[b] are masked.
    - `q_segment_ids` `[B, T]`, `kv_segment_ids` `[B, S]`: ints; a query attends only keys with its id.
    - `dropout_rate`, `dropout_seed`: attention dropout, the rate a Python float in [0, 1) (compiled into the
      kernels); the keep mask, a stateless hash of (seed, b, h, q_idx, kv_idx), is `dropout_keep_mask`'s.
    - `return_lse`: also return lse `[B, N, T]` float32, the natural-log sum-exp of the masked scores.
    - `config`: a `FlashConfig` of block sizes, warps, stages and backend; None picks device defaults.
    - `window`: local attention, an int w or a pair (left, right): query i sees keys in [i - left, i + right]
      (a None side is unbounded). Combined with `causal`, right is 0.
    - `logits_soft_cap`: None (off) or a positive float `cap`: each score becomes `cap * tanh(score / cap)`
      (Gemma 2's soft-capping, the `softcap(cap)` score_mod) after scale and bias, before masking; in every
      kernel, forward, backward and tangent.
    - `sinks`: None or `[N]` float, attention sinks (gpt-oss): a logit per head of a virtual key with value 0;
      `exp(sinks[h])` joins each row's softmax denominator (`_sinks.py`: applied to out and lse, exactly).

    **Returns:** out `[B, T, N, Dv]` in q's dtype, or `(out, lse)` with `return_lse` (with sinks, the sink in
    it). A query row with no key to attend gives out 0, lse -inf (the sink with sinks) and zero gradients.
    """
    inputs = check_inputs(
        q, k, v, bias=bias, mask=mask, scale=scale, q_lengths=q_lengths, kv_lengths=kv_lengths,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, window=window, dropout_rate=dropout_rate,
    )
    dropout_seed, sinks = check_dropout(dropout_rate, dropout_seed), check_sinks(sinks, inputs.q.shape[2])
    logits_soft_cap = check_logits_soft_cap(logits_soft_cap)
    check_config(config)
    causal = check_flag("causal", causal)
    left, right = inputs.window
    if causal:
        right = 0 if right is None else min(right, 0)
    scale, bias, score_hook, score_consts = inputs.scale, inputs.bias, None, ()
    if inputs.traced_scale:
        score_hook, score_consts = trace_score_mod(affine_score_mod(scale, bias, soft_capped(None, logits_soft_cap)))
        scale, bias = 1.0, None
    elif logits_soft_cap is not None:  # after the kernels' own scale and bias
        score_hook, score_consts = trace_score_mod(soft_capped(None, logits_soft_cap))
    dropout_fields, kernel_seed = sharded_dropout(dropout_seed, _dropout_positions, _dropout_shard, dropout_rate,
                                                  inputs.q, inputs.k)
    if _cotangents is None and runs_reference(config, inputs):
        out, lse = attention_from_inputs(
            inputs, causal, compute_dtype(inputs), score_mod=soft_capped(None, logits_soft_cap),
            dropout_rate=float(dropout_rate), dropout_seed=dropout_seed, dropout_positions=_dropout_positions,
            dropout_shard=_dropout_shard,
        )
        return _results(out, lse, sinks, return_lse)
    features = Features(
        scale=scale, window_left=left, window_right=right, score_mod=score_hook, dropout_rate=float(dropout_rate),
        **dropout_fields,
    )
    result = _autodiff.attention(
        inputs.q, inputs.k, inputs.v, features, config, bias=bias, mask=inputs.mask,
        q_lengths=inputs.q_lengths, kv_lengths=inputs.kv_lengths, q_segment_ids=inputs.q_segment_ids,
        kv_segment_ids=inputs.kv_segment_ids, dropout_seed=kernel_seed, score_consts=tuple(score_consts),
        cotangents=_cotangents,
    )
    if _cotangents is not None:  # private to probjax_kernels: (dq, dk, dv), see `_autodiff.attention`
        return result
    return _results(*result, sinks, return_lse)


def _results(out, lse, sinks, return_lse: bool):
    out, lse = attach_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def runs_reference(config: FlashConfig | None, inputs) -> bool:
    """Whether a call runs the plain-jnp reference (`attention_from_inputs`, the same numbers) instead of the
    kernels: inside a `jax.shard_map` that checks varying manual axes (check_vma=True, its default), when its
    inputs vary over a manual axis and the kernels would run in a CPU interpreter of the GPU kernels. jax
    0.11.2's interpreters replay the kernel body on varying types, whose loops start from unvarying
    constants, and fail ("Scan carry input and output got mismatched varying manual axes" in the backward,
    a while_loop carry TypeError in a partly-manual shard_map); `ring_attention` takes its plain-jnp path
    there too. On a GPU or TPU, and with check_vma=False, the kernels run."""
    backend = config_backend(config)
    arrays = (inputs.q, inputs.k, inputs.v)
    return backend in ("interpret", "mosaic_interpret") and any(
        jax.typeof(x).manual_axis_type.varying for x in arrays)
