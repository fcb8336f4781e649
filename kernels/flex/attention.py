"""`flex_attention`: PyTorch FlexAttention's front-end over the kernel core (score_mod, BlockMask, dropout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from probjax_kernels import _autodiff
from probjax_kernels._config import FlashConfig
from probjax_kernels._flash_attention import runs_reference
from probjax_kernels._hooks import (
    affine_score_mod, example_indices, hook_hint, reads_argument, trace_hook, trace_score_mod,
)
from probjax_kernels._inputs import check_config, check_dropout, check_inputs, check_sinks, sharded_dropout
from probjax_kernels._problem import Features
from probjax_kernels._reference import attention_from_inputs, compute_dtype
from probjax_kernels._sinks import attach_sinks
from probjax_kernels.flex.block_mask import BlockMask
from probjax_kernels.flex.mods import ScoreMod
from probjax_kernels.flex.options import (
    AuxRequest,
    FlexKernelOptions,
    check_aux,
    check_heads,
    config_from_kernel_options,
    results,
)


def _check_block_mask(block_mask: BlockMask, batch: int, num_heads: int, q_len: int, kv_len: int, mask_hook) -> None:
    mask_b, mask_h = block_mask.kv_num_blocks.shape[:2]
    mask_q, mask_kv = block_mask.seq_lengths
    if (mask_q, mask_kv) != (q_len, kv_len):
        shorter = q_len <= mask_q and kv_len <= mask_kv
        raise ValueError(
            f"block_mask was built for q_len={mask_q}, kv_len={mask_kv}, but q and k have T={q_len}, S={kv_len}"
            + (f"; crop it with block_mask.adjust({q_len}, {kv_len}) or build a new one." if shorter else
               "; build a new one for these lengths.")
        )
    if mask_b not in (1, batch) or mask_h not in (1, num_heads):
        raise ValueError(
            f"block_mask was built for B={mask_b}, H={mask_h}; q has B={batch} and N={num_heads} heads "
            "(use B=None / H=None to broadcast)."
        )
    # The tables of a broadcast axis were classified at b = 0 / h = 0, while the kernels evaluate mask_mod at
    # the real b / h: a mask_mod that reads them would give neither mask.
    for position, name, size, mask_size, what in ((0, "B", batch, mask_b, "b"), (1, "H", num_heads, mask_h, "h")):
        if mask_size == 1 < size and reads_argument(mask_hook.jaxprs[next(iter(mask_hook.jaxprs))], position):
            raise ValueError(
                f"block_mask was built for {name}={mask_size} (or None) but its mask_mod reads {what}, and q has "
                f"{name}={size}: pass {name}={size} to create_block_mask so that every {what} gets its own tables."
            )


def flex_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: FlexKernelOptions | None = None,
    *,
    return_aux: AuxRequest | None = None,
    config: FlashConfig | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | int | None = None,
    sinks: jax.Array | None = None,
    _dropout_positions=None, _dropout_shard=None,
):
    """Attention with user hooks inside the Pallas kernels, with PyTorch FlexAttention's semantics and
    signature (`torch.nn.attention.flex_attention.flex_attention`); the layout is JAX's `[B, T, N, D]`
    where PyTorch's is `[B, H, T, D]` (docs/from_pytorch.md).

    **Arguments:**

    - `q`: `[B, T, N, D]`; `k`: `[B, S, K, D]`; `v`: `[B, S, K, Dv]`, Dv may differ from D (PyTorch's Ev);
      k and v may have batch 1, shared by the batch; bfloat16, float16 or float32; D, Dv <= 256.
    - `score_mod`: `score_mod(score, b, h, q_idx, kv_idx) -> score`, applied to each scaled score
      (`scale * q.k`) before masking. Called on a float32 tile with broadcasting int32 indices; it must keep
      the shape and dtype. Arrays it closes over (ALiBi slopes, bias tables, per-token tensors, the
      parameters of an Equinox / NNX module) are kernel inputs and receive gradients.
    - `block_mask`: from `create_block_mask(mask_mod, ...)` for these (T, S); positions where its mask_mod
      is False are masked (-inf after score_mod), empty tiles are skipped. None = attend everywhere. Any
      tile size works: other tiles than powers of two >= 16 are mapped onto ones that are (`for_kernel`).
    - `scale`: default `D ** -0.5`; a traced 0-d array as in `flash_attention`.
    - `enable_gqa`: allow K < N key/value heads (grouped-query attention, N a multiple of K); without it
      N != K is an error, as in PyTorch.
    - `return_lse`: also return lse `[B, N, T]` float32 (natural log); PyTorch's older spelling of
      `return_aux=AuxRequest(lse=True)` (giving both is an error).
    - `kernel_options`: PyTorch's tile / launch options (`FlexKernelOptions`: `BLOCK_M`, `BLOCK_N`,
      `num_warps`, `num_stages`, ...), applied to `config`; other keys are ignored with a warning.
    - `return_aux`: an `AuxRequest(lse=..., max_scores=...)`; the call then returns `(out, AuxOutput)`.

    probjax's own options, keyword-only:

    - `config`: a `FlashConfig`; its tiles must not exceed the block mask's (the TPU kernels' may, for a mask
      from `create_block_mask`: they walk its tables coarsened onto their tiles).
    - `dropout_rate`, `dropout_seed`: attention dropout from a stateless hash, as in `flash_attention`.
    - `sinks`: None or `[N]` float, attention-sink logits (gpt-oss), one per head, as in `flash_attention`.

    **Returns:** out `[B, T, N, Dv]` in q's dtype; `(out, lse)` with `return_lse`; `(out, AuxOutput(lse,
    max_scores))` with `return_aux`. Fully masked rows give 0, lse -inf and zero gradients. Differentiable in
    q, k, v, sinks and the arrays score_mod closes over, in reverse and forward mode (docs/forward_mode.md).
    """
    aux = check_aux(return_lse, return_aux)
    config = config_from_kernel_options(kernel_options, config)
    inputs = check_inputs(q, k, v, scale=scale, dropout_rate=dropout_rate)
    dropout_seed, sinks = check_dropout(dropout_rate, dropout_seed), check_sinks(sinks, inputs.shape[3])
    check_config(config)
    batch, q_len, kv_len, num_heads, num_kv_heads, head_dim = inputs.shape
    check_heads(num_heads, num_kv_heads, enable_gqa)
    indices = example_indices()
    scale, score_hook, score_consts = inputs.scale, None, []
    if score_mod is not None:
        with hook_hint("score_mod"):
            score_hook, score_consts = trace_score_mod(score_mod)
    if inputs.traced_scale:  # after the user's score_mod was checked on its own, so its errors name it
        score_hook, score_consts = trace_score_mod(affine_score_mod(scale, score_mod=score_mod))
        scale = 1.0
    mask_hook, mask_consts, tables = None, [], {}
    block_sizes, exact_mask_mod = None, False
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask from create_block_mask, got {type(block_mask).__name__}.")
        with hook_hint("mask_mod"):
            mask_hook, mask_consts, out = trace_hook("mask_mod", block_mask.mask_mod, indices)
        if out.dtype != jnp.bool_:
            raise TypeError(f"mask_mod must return bool (True = attend), got {out.dtype}.")
        _check_block_mask(block_mask, batch, num_heads, q_len, kv_len, mask_hook)
        fitted = block_mask.for_kernel()
        if fitted.mask_mod is not block_mask.mask_mod:
            mask_hook, mask_consts, _ = trace_hook("mask_mod", fitted.mask_mod, indices)
        block_mask = fitted
        block_sizes, exact_mask_mod = block_mask.block_size, block_mask.exact_mask_mod
        tables = dict(kv_tables=block_mask.kv_tables, q_tables=block_mask.q_tables)
    if runs_reference(config, inputs):  # as flex_attention_reference: the block mask's mask_mod
        out, lse, max_scores = attention_from_inputs(
            inputs, False, compute_dtype(inputs), score_mod=score_mod,
            mask_mod=None if block_mask is None else block_mask.mask_mod, dropout_rate=float(dropout_rate),
            dropout_seed=dropout_seed, dropout_positions=_dropout_positions, dropout_shard=_dropout_shard,
            return_max=True,
        )
        return results(*attach_sinks(out, lse, sinks), max_scores, return_lse, aux)
    dropout_fields, dropout_seed = sharded_dropout(dropout_seed, _dropout_positions, _dropout_shard, dropout_rate,
                                                   inputs.q, inputs.k)
    features = Features(
        scale=scale, score_mod=score_hook, mask_mod=mask_hook, block_sizes=block_sizes, exact_mask_mod=exact_mask_mod,
        dropout_rate=float(dropout_rate), return_max=aux is not None and aux.max_scores,
        **dropout_fields,
    )
    out, lse, *max_scores = _autodiff.attention(
        inputs.q, inputs.k, inputs.v, features, config, dropout_seed=dropout_seed,
        score_consts=tuple(score_consts), mask_consts=tuple(mask_consts), **tables,
    )
    return results(*attach_sinks(out, lse, sinks), max_scores[0] if max_scores else None, return_lse, aux)
