"""Plain-jnp attention with `flex_attention`'s signature and semantics: the tests' reference for the flex
front-end, built on the core's `attention_from_inputs` (`_reference.py`)."""

from __future__ import annotations

from probjax_kernels._inputs import check_dropout, check_inputs, check_sinks
from probjax_kernels._reference import REFERENCE_DTYPES, attention_from_inputs, compute_dtype
from probjax_kernels._sinks import attach_sinks
from probjax_kernels.flex.options import AuxRequest, check_aux, check_heads, results


def flex_attention_reference(
    q,
    k,
    v,
    score_mod=None,
    block_mask=None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options=None,
    *,
    return_aux: AuxRequest | None = None,
    config=None,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    sinks=None,
):
    """Plain-jnp attention with the semantics and signature of `probjax_kernels.flex_attention`: the hooks
    are evaluated on the whole `[B, N, T, S]` score array; the block mask contributes its `mask_mod` (not its
    tables). `config` and `kernel_options` are accepted for signature compatibility and ignored."""
    del config, kernel_options
    aux = check_aux(return_lse, return_aux)
    inputs = check_inputs(
        q, k, v, scale=scale, dropout_rate=dropout_rate, allowed_dtypes=REFERENCE_DTYPES, max_head_dim=None,
    )
    check_heads(inputs.shape[3], inputs.shape[4], enable_gqa)
    dropout_seed, sinks = check_dropout(dropout_rate, dropout_seed), check_sinks(sinks, inputs.shape[3])
    mask_mod = None if block_mask is None else block_mask.mask_mod
    out, lse, max_scores = attention_from_inputs(
        inputs, False, compute_dtype(inputs), score_mod=score_mod, mask_mod=mask_mod,
        dropout_rate=dropout_rate, dropout_seed=dropout_seed, return_max=True,
    )
    return results(*attach_sinks(out, lse, sinks), max_scores, return_lse, aux)
