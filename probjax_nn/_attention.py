"""`attention`: `jax.nn.dot_product_attention`'s signature over a choice of implementations.

Each implementation states what it can do in `_IMPLEMENTATIONS`; `attention` checks a request against that
table before anything runs. An explicit `impl` that cannot do the request raises `NotImplementedError`
naming the impl and the feature; `impl="auto"` tries the implementations of `_AUTO_ORDER` in turn.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jax.tree_util import Partial

from probjax_kernels import FlashConfig, and_masks, create_block_mask, flash_attention, flex_attention, padding_mask
from probjax_kernels.layer_api import (
    LAYOUTS, MAX_HEAD_DIM, STRATEGIES, AttentionInputs, affine_score_mod, attention_from_inputs, broadcast_lookup,
    attach_sinks, check_dropout, check_dropout_rate, check_flag, check_inputs, check_logits_soft_cap, check_sinks,
    chunked_attention, compute_dtype, soft_capped, target_platform,
)
from probjax_nn._sharding import context_parallel, per_shard

Impl = Literal["auto", "pallas", "flex", "xla", "cudnn"]


@dataclasses.dataclass(frozen=True)
class _Call:
    """One checked request, as every runner receives it."""

    inputs: AttentionInputs
    causal: bool
    local_window_size: int | tuple[int, int] | None  # as the caller spelled it (cuDNN takes jax's form)
    return_residual: bool
    flash: FlashConfig | None
    score_mod: Callable | None
    mask_mod: Callable | None
    dropout_rate: float
    dropout_seed: jax.Array | int | None
    # (batch offset, head offset, the whole head count) when this call holds a shard of the batch / heads:
    # dropout then hashes the whole attention's indices (`_sharding`).
    dropout_shard: tuple | None = None
    logits_soft_cap: float | None = None  # applied after score_mod (`soft_capped`)


def _with_residual(call: _Call, result):
    """probjax_kernels give lse `[B, N, T]`; jax's residual is `[B, T, N]`."""
    if not call.return_residual:
        return result
    out, lse = result
    return out, jnp.swapaxes(lse, 1, 2)


# Runners look the kernels up when called, so that tests can watch which one runs.
def _pallas(call: _Call):
    i = call.inputs
    return _with_residual(call, flash_attention(
        i.q, i.k, i.v, bias=i.bias, mask=i.mask, causal=call.causal, scale=i.scale, q_lengths=i.q_lengths,
        kv_lengths=i.kv_lengths, window=i.window, return_lse=call.return_residual, config=call.flash,
        dropout_rate=call.dropout_rate, dropout_seed=call.dropout_seed, _dropout_shard=call.dropout_shard,
        logits_soft_cap=call.logits_soft_cap,
    ))


def _xla(call: _Call):
    # float64 inputs compute in float64, as in jax.nn.dot_product_attention; the rest in float32.
    out, lse = attention_from_inputs(
        call.inputs, call.causal, compute_dtype(call.inputs),
        score_mod=soft_capped(call.score_mod, call.logits_soft_cap), mask_mod=call.mask_mod,
        dropout_rate=call.dropout_rate, dropout_seed=call.dropout_seed,
    )
    return _with_residual(call, (out, lse) if call.return_residual else out)


def _xla_chunked(call: _Call):
    """impl "auto" where it would run "xla" off the GPU: the same attention by `chunked_attention`, over query
    bands that skip the keys causal and the window hide, in chunks whose memory is linear in T (at least as fast
    as jax.nn.dot_product_attention's "xla" path on the CPU: docs/benchmarks/cpu_attention.md)."""
    out, lse = chunked_attention(
        call.inputs, call.causal, compute_dtype(call.inputs),
        score_mod=soft_capped(call.score_mod, call.logits_soft_cap), mask_mod=call.mask_mod,
        dropout_rate=call.dropout_rate, dropout_seed=call.dropout_seed, return_lse=call.return_residual,
    )
    return _with_residual(call, (out, lse) if call.return_residual else out)


def _runner(config: AttentionConfig, name: str, request: _Request) -> Callable[[_Call], jax.Array | tuple]:
    """How `name` (chosen for `request`) runs: "auto" off the GPU takes `_xla_chunked` for "xla"."""
    if config.impl == "auto" and name == "xla" and not request.gpu:
        return _xla_chunked
    return _IMPLEMENTATIONS[name].run


def _flex(call: _Call):
    """Every jax.nn argument becomes a mask_mod or score_mod of one flex_attention call."""
    i = call.inputs
    batch, q_len, kv_len, num_heads, _, _ = i.shape
    mods = [] if call.mask_mod is None else [call.mask_mod]
    left, right = i.window
    if call.causal:
        right = 0 if right is None else min(right, 0)
    if left is not None or right is not None:
        mods.append(Partial(_window_mask, left, right))
    if i.q_lengths is not None:
        mods.append(Partial(_query_length_mask, i.q_lengths))
    if i.kv_lengths is not None:
        mods.append(padding_mask(i.kv_lengths))
    if i.mask is not None:
        mods.append(Partial(broadcast_lookup, i.mask))
    block_mask = create_block_mask(and_masks(*mods), batch, num_heads, q_len, kv_len) if mods else None
    score_mod = soft_capped(call.score_mod, call.logits_soft_cap)
    if i.bias is not None:
        score_mod = affine_score_mod(bias=i.bias, score_mod=score_mod)
    return _with_residual(call, flex_attention(
        i.q, i.k, i.v, score_mod, block_mask, scale=i.scale, enable_gqa=True, return_lse=call.return_residual,
        config=call.flash, dropout_rate=call.dropout_rate, dropout_seed=call.dropout_seed,
        _dropout_shard=call.dropout_shard,
    ))


def _window_mask(left, right, b, h, q_idx, kv_idx):
    """Query i sees keys in [i - left, i + right] (a None side is unbounded; at least one side is set)."""
    sides = []
    if left is not None:
        sides.append(kv_idx >= q_idx - left)
    if right is not None:
        sides.append(kv_idx <= q_idx + right)
    return sides[0] if len(sides) == 1 else sides[0] & sides[1]


def _query_length_mask(q_lengths, b, h, q_idx, kv_idx):
    return (q_idx < q_lengths[b]) & (kv_idx >= 0)


def _cudnn(call: _Call):
    i = call.inputs
    q, scale = i.q, i.scale
    if i.traced_scale:
        # jax's cuDNN path compiles a static scale: fold the traced one into the query (rounded to its dtype).
        q, scale = (q.astype(jnp.float32) * scale).astype(q.dtype), 1.0
    local_window_size = call.local_window_size
    if call.causal and local_window_size is not None:
        # Causal cuts the right side anyway, but jax's cuDNN path rejects one when lengths are given too.
        local_window_size = (i.window[0], 0)
    result = jax.nn.dot_product_attention(
        q, i.k, i.v, i.bias, i.mask, scale=scale, is_causal=call.causal, query_seq_lengths=i.q_lengths,
        key_value_seq_lengths=i.kv_lengths, local_window_size=local_window_size, implementation="cudnn",
        return_residual=call.return_residual,
    )
    if not call.return_residual:
        return result
    out, lse = result  # jax gives [B, T, N] in the input dtype
    return out, lse.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Implementation:
    """What one implementation can do, and how to run it."""

    run: Callable[[_Call], jax.Array | tuple[jax.Array, jax.Array]]
    dtypes: tuple[str, ...]  # input dtypes it computes in
    needs_gpu: bool = False  # runs only on an NVIDIA GPU
    hooks: bool = False  # takes score_mod / mask_mod
    right_window: bool = True  # a local window reaching right of the query without is_causal
    max_head_dim: int | None = None  # None: any
    value_dim: bool = False  # a value head dim Dv other than the query / key head dim D
    kv_broadcast: bool = False  # key / value of batch 1 shared by a query batch B > 1
    dropout: bool = True  # attention dropout from the kernels' stateless keep mask
    soft_cap: bool = True  # logits_soft_cap
    sinks: bool = True  # attention sinks, applied to (out, lse): needs a differentiable lse


_FLOATS = ("bfloat16", "float16", "float32")
_IMPLEMENTATIONS: dict[str, _Implementation] = {
    "pallas": _Implementation(_pallas, dtypes=_FLOATS, max_head_dim=MAX_HEAD_DIM, value_dim=True, kv_broadcast=True),
    "flex": _Implementation(
        _flex, dtypes=_FLOATS, hooks=True, max_head_dim=MAX_HEAD_DIM, value_dim=True, kv_broadcast=True
    ),
    "xla": _Implementation(_xla, dtypes=(*_FLOATS, "float64"), hooks=True, value_dim=True, kv_broadcast=True),
    # jax.nn.dot_product_attention's cuDNN path: half precision only, and a sliding window only to the left.
    "cudnn": _Implementation(
        _cudnn, dtypes=("bfloat16", "float16"), needs_gpu=True, right_window=False, max_head_dim=MAX_HEAD_DIM,
        dropout=False, soft_cap=False, sinks=False,
    ),
}
# "auto" never picks interpret mode: off the GPU the plain-jnp reference is much faster than the interpreter.
# On a TPU the Pallas kernels are the Mosaic TPU ones (probjax_kernels' default backend there).
_AUTO_ORDER = {"gpu": ("pallas", "flex", "xla"), "tpu": ("pallas", "flex", "xla"), "other": ("xla",)}
IMPLS: tuple[str, ...] = ("auto", *_IMPLEMENTATIONS)
_ALL_DTYPES = tuple(dict.fromkeys(d for spec in _IMPLEMENTATIONS.values() for d in spec.dtypes))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How `attention` computes: the one value a model config carries to swap the implementation.

    **Arguments:**

    - `impl`: `"auto"` (on a GPU the Pallas flash kernel, or the flex kernel for score_mod / mask_mod, and
      XLA for what neither kernel can do; off the GPU XLA over query chunks, memory linear in T:
      `probjax_kernels.layer_api.chunked_attention`), `"pallas"` (the Pallas flash kernel; interpret mode
      off the GPU), `"flex"` (the Pallas kernel with score_mod / mask_mod inside; interpret mode off the GPU),
      `"xla"` (plain jnp, materialises the `[B, N, T, S]` scores) or `"cudnn"` (the cuDNN path of
      `jax.nn.dot_product_attention`; NVIDIA GPUs only).
    - `flash`: block sizes and launch parameters for the Pallas kernel; `None` picks device defaults.
    - `context_axis`: a mesh axis name to run context parallel over (`probjax_kernels.ring_attention`): under
      `jax.set_mesh(mesh)` (or inside a `shard_map` where that axis is manual), the sequence axis of query,
      key and value is split over it; other mesh axes keep their sharding (hooks and dropout see the whole
      batch's and heads' indices). None = off. Without it, "pallas" and "flex" run per shard of the batch
      and heads of inputs sharded over the context mesh (docs/context_parallel.md).
    - `context_layout`: `"contiguous"` or `"zigzag"`: how the sequence axis as given maps to positions (for
      zigzag, tokens laid out with `probjax_kernels.zigzag_permutation`; hooks see the original positions).
    - `context_strategy`: `"ring"` (K/V travel by ppermute) or `"allgather"` (K/V gathered once).
    """

    impl: Impl = "auto"
    flash: FlashConfig | None = None
    context_axis: str | None = None
    context_layout: Literal["contiguous", "zigzag"] = "contiguous"
    context_strategy: Literal["ring", "allgather"] = "ring"

    def __post_init__(self):
        if self.context_axis is not None and not isinstance(self.context_axis, str):
            raise TypeError(f"context_axis must be a mesh axis name (str) or None, got {self.context_axis!r}.")
        if self.context_layout not in LAYOUTS:
            raise ValueError(f"context_layout={self.context_layout!r} is not one of {LAYOUTS}.")
        if self.context_strategy not in STRATEGIES:
            raise ValueError(f"context_strategy={self.context_strategy!r} is not one of {STRATEGIES}.")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is not one of {', '.join(map(repr, IMPLS))}.")
        if self.flash is not None and not isinstance(self.flash, FlashConfig):
            raise TypeError(
                f"flash must be a probjax_kernels.FlashConfig or None, got {type(self.flash).__name__}."
            )


@dataclasses.dataclass(frozen=True)
class _Request:
    """The parts of one call that decide which implementation can run it."""

    dtype: str
    head_dim: int  # the larger of D and Dv
    value_dim: bool  # Dv != D
    kv_broadcast: bool
    score_mod: bool
    mask_mod: bool
    dropout: bool
    right_window: bool  # some query sees a key to its right through a local window (is_causal off)
    gpu: bool
    soft_cap: bool = False
    sinks: bool = False


def _platform() -> str:
    """The platform of the device a call compiles for, as the kernels see it ("gpu", "tpu", "cpu")."""
    return target_platform()


def _on_gpu() -> bool:
    return _platform() == "gpu"


def _check(name: str, request: _Request) -> None:
    """Raises `NotImplementedError` naming `name` and the first feature of `request` it cannot do."""
    spec = _IMPLEMENTATIONS[name]
    if request.soft_cap and not spec.soft_cap:  # never on any device: said before what this one lacks
        raise NotImplementedError(
            f"impl={name!r} does not support logits_soft_cap (jax.nn.dot_product_attention's cuDNN path has no "
            "soft cap); use impl='pallas', 'flex' or 'xla'."
        )
    if request.sinks and not spec.sinks:
        raise NotImplementedError(
            f"impl={name!r} does not support sinks (jax.nn.dot_product_attention's cuDNN path gives no "
            "differentiable log-sum-exp to merge them with); use impl='pallas', 'flex' or 'xla'."
        )
    if spec.needs_gpu and not request.gpu:
        raise NotImplementedError(
            f"impl={name!r} needs an NVIDIA GPU; the target device's platform is {_platform()!r}. "
            "Use impl='auto', 'pallas' or 'xla'."
        )
    for feature, wanted in (("score_mod", request.score_mod), ("mask_mod", request.mask_mod)):
        if wanted and not spec.hooks:
            raise NotImplementedError(
                f"impl={name!r} does not support {feature}; use impl='flex', 'xla' or 'auto'."
            )
    if request.dropout and not spec.dropout:
        raise NotImplementedError(f"impl={name!r} does not support dropout; use impl='pallas', 'flex' or 'xla'.")
    # Other dtypes are bad input, not a missing feature: check_inputs rejects them with a TypeError.
    if request.dtype in _ALL_DTYPES and request.dtype not in spec.dtypes:
        raise NotImplementedError(
            f"impl={name!r} does not support dtype {request.dtype}; it takes {', '.join(spec.dtypes)}."
        )
    for feature, wanted, supported in (
        ("a value head dim other than the query / key head dim", request.value_dim, spec.value_dim),
        ("key / value of batch 1 shared by a larger query batch", request.kv_broadcast, spec.kv_broadcast),
    ):
        if wanted and not supported:
            raise NotImplementedError(f"impl={name!r} does not support {feature}; use impl='xla' or 'auto'.")
    if spec.max_head_dim is not None and request.head_dim > spec.max_head_dim:
        raise NotImplementedError(
            f"impl={name!r} does not support head dim {request.head_dim}; it takes up to {spec.max_head_dim}."
        )
    if request.right_window and not spec.right_window:
        raise NotImplementedError(
            f"impl={name!r} does not support a local window that reaches right of the query "
            "(local_window_size with right > 0) without is_causal."
        )


def _choose(impl: str, request: _Request) -> str:
    """The implementation that runs `request`: `impl` itself, or for "auto" the first in order that can."""
    if impl != "auto":
        _check(impl, request)
        return impl
    reasons = []
    for name in _AUTO_ORDER["gpu" if request.gpu else "tpu" if _platform() == "tpu" else "other"]:
        try:
            _check(name, request)
        except NotImplementedError as error:
            reasons.append(str(error))
            continue
        return name
    raise NotImplementedError("impl='auto' found no implementation for this request: " + " ".join(reasons))


def check_impl(name: str, dtype, head_dim: int, *, score_mod: bool = False, mask_mod: bool = False) -> None:
    """Raises `NotImplementedError` naming impl `name` (not "auto") when it cannot compute in `dtype`, at
    head dim `head_dim`, or with hooks: `attention`'s own message, for calls that take another kernel (a
    decode step) but must refuse what `attention` refuses."""
    _check(name, _Request(
        dtype=jnp.dtype(dtype).name, head_dim=head_dim, value_dim=False, kv_broadcast=False, score_mod=score_mod,
        mask_mod=mask_mod, dropout=False, right_window=False, gpu=_on_gpu(),
    ))


def as_config(impl: Impl | AttentionConfig) -> AttentionConfig:
    """`impl` (a name, checked by `AttentionConfig`, or an `AttentionConfig`) as an `AttentionConfig`."""
    return impl if isinstance(impl, AttentionConfig) else AttentionConfig(impl=impl)


def _resolve_config(impl: Impl | AttentionConfig, implementation: str | None) -> AttentionConfig:
    """Merges jax's `implementation` spelling into `impl`; they may not name two different impls."""
    config = as_config(impl)
    if implementation is None or implementation == config.impl:
        return config
    if implementation not in IMPLS:
        raise ValueError(f"implementation={implementation!r} is not one of {', '.join(map(repr, IMPLS))} or None.")
    if config.impl != "auto":
        raise ValueError(
            f"implementation={implementation!r} and impl={config.impl!r} disagree; pass only one of them."
        )
    return dataclasses.replace(config, impl=implementation)


# probjax_kernels' input checks name the kernels' arguments; `attention` names jax's instead.
_PUBLIC_NAMES = {
    r"^q, k and v\b": "query, key and value", r"^k and v\b": "key and value", r"^q_lengths\b": "query_seq_lengths",
    r"^kv_lengths\b": "key_value_seq_lengths", r"^window\b": "local_window_size",
}


def _checked(query: jax.Array, key: jax.Array, value: jax.Array, **kwargs) -> AttentionInputs:
    """`check_inputs`, its errors naming `attention`'s arguments (key_value_seq_lengths, not kv_lengths)."""
    try:
        return check_inputs(query, key, value, **kwargs)
    except (TypeError, ValueError) as error:
        message = str(error)
        for kernel_name, public_name in _PUBLIC_NAMES.items():
            message = re.sub(kernel_name, public_name, message)
        if message == str(error):
            raise
        raise type(error)(message) from None


def _batched(name: str, x: ArrayLike) -> jax.Array:
    """jax's rank-3 spelling (no batch axis) made rank 4 with a batch of one."""
    x = jnp.asarray(x)
    if x.ndim not in (3, 4):
        raise ValueError(f"{name} must have rank 3 ([T, N, D]) or 4 ([B, T, N, D]), got shape {x.shape}.")
    return x[None] if x.ndim == 3 else x


def _check_complex(impl: str, dtype, score_mod, mask_mod, dropout_rate, logits_soft_cap=None) -> None:
    """Complex inputs run only under "auto", as `jax.nn.dot_product_attention`, which has no hooks or dropout."""
    if impl != "auto":
        raise NotImplementedError(
            f"impl={impl!r} does not support dtype {dtype.name}; impl='auto' runs jax.nn.dot_product_attention "
            "for complex inputs."
        )
    for feature, wanted in (("score_mod", score_mod is not None), ("mask_mod", mask_mod is not None),
                            ("dropout", check_dropout_rate(dropout_rate) > 0),
                            ("logits_soft_cap", logits_soft_cap is not None)):
        if wanted:
            raise NotImplementedError(
                f"impl='auto' does not support {feature} with dtype {dtype.name}: complex inputs run "
                f"jax.nn.dot_product_attention, which has no {feature}."
            )


def attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: bool = False,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | int | None = None,
    impl: Impl | AttentionConfig = "auto",
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, `softmax(scale * query key^T + bias, masked) value`, per head.

    A drop-in for `jax.nn.dot_product_attention`: the same arguments with the same meaning, plus `impl`.
    Differentiable in query, key, value and bias.

    **Arguments:**

    - `query`: `[B, T, N, D]` (or `[T, N, D]`); `key` `[B, S, K, D]` and `value` `[B, S, K, Dv]` (or without
      B) with N a multiple of K (grouped-query / multi-query attention); the value head dim Dv may differ from D
      (as in multi-head latent attention), and key / value may have batch 1, shared by every query example
      without being repeated (every impl but "cudnn"). One dtype for all three.
    - `bias`: float, broadcastable to `[B, N, T, S]` (`[N, T, S]` for rank-3 inputs); added to the scaled
      scores.
    - `mask`: bool, broadcastable like `bias`; True = attend, False = masked out.
    - `scale`: multiplies `query key^T`; None means `D ** -0.5`. May be traced (a 0-d array, applied to the
      float32 scores as a static scale is; impl "cudnn" folds it into the query).
    - `is_causal`: a bool; query i sees keys j <= i (top-left alignment).
    - `query_seq_lengths`, `key_value_seq_lengths`: `[B]` ints; positions at or past the length are padding.
    - `local_window_size`: an int w or a pair (left, right): query i sees keys in [i - left, i + right].
    - `implementation`: jax's spelling of `impl` ("xla", "cudnn", None); it may not contradict `impl`.
    - `return_residual`: also return the log-sum-exp of the scaled, masked scores.
    - `score_mod(score, b, h, q_idx, kv_idx) -> score`, `mask_mod(b, h, q_idx, kv_idx) -> bool`:
      FlexAttention hooks (see `probjax_kernels.flex_attention`), applied after `bias` and combined with
      every other mask; run by impl "flex" and "xla" ("pallas" and "cudnn" raise).
    - `dropout_rate`, `dropout_seed`: attention dropout (the rate a Python float: the kernels compile it), the
      keep mask a stateless hash of (seed, b, h, q_idx, kv_idx), so every impl that has it ("pallas", "flex",
      "xla") drops the same weights.
    - `impl`: `"auto" | "pallas" | "flex" | "xla" | "cudnn"` or an `AttentionConfig`; see `AttentionConfig`.
    - `logits_soft_cap`: None (off) or a positive float `cap`: each score becomes `cap * tanh(score / cap)`
      (Gemma 2's soft-capping), applied to the scaled score after `bias` and after `score_mod`, before any
      mask; every impl but "cudnn" (which raises) runs it, "pallas" included.
    - `sinks`: None or `[N]` float, attention sinks (gpt-oss; splash attention's `sinks`): a logit per head of
      a virtual key with value 0, so `exp(sinks[h])` joins every row's softmax denominator; differentiable.
      Applied to the implementation's (output, lse), exactly (`probjax_kernels.flash_attention`'s `sinks`);
      every impl but "cudnn" (which raises). With `return_residual` the lse includes the sink.

    **Returns:** the output, shaped like `query` with head dim Dv, typed like `query`; with `return_residual`,
    `(output, lse)`, lse `[B, T, N]` (`[T, N]` for rank-3 inputs) in float32 (jax casts it to the input dtype).
    Complex inputs run `jax.nn.dot_product_attention` itself under impl "auto" (no implementation here computes
    in complex numbers; jax 0.11.2 casts their scores to float32 with a DeprecationWarning); any other impl
    raises `NotImplementedError`. A query row with nothing to attend gives output 0 and lse -inf, where jax's
    "xla" path averages `value`; impl "cudnn" is jax's cuDNN path and keeps its behaviour there.
    """
    config = _resolve_config(impl, implementation)
    is_causal = check_flag("is_causal", is_causal)
    query = jnp.asarray(query)
    complex_dtype = next((jnp.dtype(x.dtype) for x in (query, key, value) if jnp.iscomplexobj(x)), None)
    if complex_dtype is not None:
        _check_complex(config.impl, complex_dtype, score_mod, mask_mod, dropout_rate, logits_soft_cap)
        # No implementation here computes in complex numbers: "auto" runs the stock function.
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
            return_residual=return_residual,
        )
    inputs = _checked(
        _batched("query", query), _batched("key", key), _batched("value", value), bias=bias, mask=mask,
        scale=scale, q_lengths=query_seq_lengths, kv_lengths=key_value_seq_lengths, window=local_window_size,
        dropout_rate=dropout_rate, allowed_dtypes=tuple(map(jnp.dtype, _ALL_DTYPES)), max_head_dim=None,
    )
    dropout_seed = check_dropout(dropout_rate, dropout_seed)
    logits_soft_cap = check_logits_soft_cap(logits_soft_cap)
    sinks = check_sinks(sinks, inputs.q.shape[2])
    request = _Request(
        dtype=inputs.q.dtype.name,
        head_dim=max(inputs.q.shape[-1], inputs.value_dim),
        value_dim=inputs.value_dim != inputs.q.shape[-1],
        kv_broadcast=inputs.kv_broadcast,
        score_mod=score_mod is not None,
        mask_mod=mask_mod is not None,
        dropout=dropout_rate > 0,
        right_window=not is_causal and inputs.window != (None, None) and inputs.window[1] != 0,
        gpu=_on_gpu(),
        soft_cap=logits_soft_cap is not None,
        sinks=sinks is not None,
    )
    name = _choose(config.impl, request)
    call = _Call(
        inputs, is_causal, local_window_size, return_residual or sinks is not None, config.flash, score_mod,
        mask_mod, float(dropout_rate), dropout_seed, logits_soft_cap=logits_soft_cap,
    )
    if config.context_axis is not None:
        result = context_parallel(config, name, call)
    elif name in ("pallas", "flex"):  # one custom call each: the SPMD partitioner cannot split them
        result = per_shard(call, _IMPLEMENTATIONS[name].run)
    else:
        result = _runner(config, name, request)(call)
    if sinks is not None:  # on the whole (out, lse) [B, T, N]: elementwise, so any sharding carries over
        out, lse = attach_sinks(result[0], jnp.swapaxes(result[1], 1, 2), sinks)
        result = (out, jnp.swapaxes(lse, 1, 2)) if return_residual else out
    out_shape = (*query.shape[:-1], inputs.value_dim)
    if not return_residual:
        return result.reshape(out_shape)
    out, lse = result
    return out.reshape(out_shape), lse.reshape(query.shape[:-1])
