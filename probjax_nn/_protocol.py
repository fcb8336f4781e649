"""The attention-function protocol that the NNX, Linen and Equinox modules share.

`attention_function(attention_impl)` is the one place where a module's `attention_impl` (a string or an
`AttentionConfig`) becomes the function that computes attention. Every module of `probjax_nn.nnx`,
`probjax_nn.linen` and `probjax_nn.equinox` calls the `AttentionFunction` it returns with its projected
heads; the framework files only map their own conventions (flax's `dropout_rng` / `deterministic`, Equinox's
`key` / `inference`, float masks, decode caches) onto its keyword arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.tree_util import Partial

from probjax_kernels import and_masks
from probjax_kernels.layer_api import check_dropout_rate, check_logits_soft_cap, soft_capped
from probjax_nn._attention import IMPLS, AttentionConfig, Impl, attention
from probjax_nn._decode import decode_runs_kernel, one_query_step

ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def resolve_config(attention_impl: Impl | AttentionConfig) -> AttentionConfig:
    """`attention_impl` as an `AttentionConfig`; a `ValueError` lists the valid values for anything else."""
    if isinstance(attention_impl, AttentionConfig):
        return attention_impl
    if isinstance(attention_impl, str) and attention_impl in IMPLS:
        return AttentionConfig(impl=attention_impl)
    raise ValueError(
        f"attention_impl={attention_impl!r} is not valid: use one of {', '.join(map(repr, IMPLS))} "
        "or a probjax_nn.AttentionConfig."
    )


def attention_function(
    attention_impl: Impl | AttentionConfig, logits_soft_cap: float | None = None
) -> AttentionFunction:
    """The `AttentionFunction` that computes attention the way `attention_impl` says, with a module's
    `logits_soft_cap` (checked: a `ValueError` names it)."""
    return AttentionFunction(resolve_config(attention_impl), check_logits_soft_cap(logits_soft_cap))


def _merge_batch(x: jax.Array | None, batch_shape: tuple[int, ...], event_ndim: int) -> jax.Array | None:
    """`[*batch, *event]` as `[prod(batch), *event]`; batch axes of size 1 or missing in front broadcast.

    An array without batch axes (ndim <= event_ndim) is returned unchanged: it broadcasts as it is.
    """
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim <= event_ndim:
        return x
    leading = x.shape[: x.ndim - event_ndim]
    if len(leading) > len(batch_shape):
        raise ValueError(
            f"an array of shape {x.shape} has more batch axes than the inputs' batch shape {batch_shape}."
        )
    event = x.shape[x.ndim - event_ndim :]
    if all(size == 1 for size in leading):
        return x.reshape((1, *event))
    return jnp.broadcast_to(x, (*batch_shape, *event)).reshape((math.prod(batch_shape), *event))


def _pad_head_dim(x: jax.Array, head_dim: int) -> jax.Array:
    padding = [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])]
    return jnp.pad(x, padding)


@dataclasses.dataclass(frozen=True)
class AttentionFunction:
    """What every module calls with its projected heads: `probjax_nn.attention` with one `AttentionConfig`.

    Hashable, so that it can be a static attribute of a Flax module.
    """

    config: AttentionConfig
    logits_soft_cap: float | None = None  # `probjax_nn.attention`'s, after any score_mod

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        *,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        is_causal: bool = False,
        key_value_seq_lengths: jax.Array | None = None,
        scale: float | None = None,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
        dropout_rate: float = 0.0,
        dropout_key: jax.Array | None = None,
        query_at_end: bool = False,
        sinks: jax.Array | None = None,
    ) -> jax.Array:
        """**Arguments:**

        - `query`: `[*batch, T, N, D]`; `key`, `value`: `[*batch, S, K, D]` and `[*batch, S, K, Dv]`, N a
          multiple of K. `batch` may be empty (Equinox's unbatched call) or have several axes (flax's
          `batch...`).
        - `mask`: broadcastable to `[*batch, N, T, S]`; True (or, as in flax's float masks, non-zero) =
          attend.
        - `bias`: float, broadcastable like `mask`; added to the scaled scores.
        - `is_causal`: query i sees keys j <= i (top-left alignment).
        - `key_value_seq_lengths`: `[*batch]` ints; keys at or past the length are masked (a decode cache).
        - `scale`: None means `D ** -0.5`.
        - `score_mod`, `mask_mod`: FlexAttention hooks (`probjax_kernels.flex_attention`).
        - `dropout_rate`, `dropout_key`: attention dropout, applied when `dropout_key` (a PRNG key) is given.
        - `query_at_end`: a decode step: one query per sequence (T = 1), the cache's last written entry, at
          position `key_value_seq_lengths - 1`; the hooks see that position as `q_idx`.
        - `sinks`: None or `[N]` float, a module's learned attention-sink logits (`probjax_nn.attention`'s).

        `logits_soft_cap` (the function's own) soft-caps the scores after `score_mod`, on every path.

        One query row per sequence (a decode step, or any call with T = 1) without bias, causal flag or
        dropout runs `probjax_kernels.decode_attention` where `decode_runs_kernel` says the impl picks a
        kernel, with the same result: the mask becomes a mask_mod and the keys past the last attended one
        are not read.

        **Returns:** `[*batch, T, N, Dv]` in the dtype of `query`. A query row with every key masked gives 0.
        """
        dropout_rate = check_dropout_rate(dropout_rate)
        batch_shape = query.shape[:-3]
        if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
            raise ValueError(
                f"query, key and value must share their batch axes, got shapes {query.shape}, {key.shape} "
                f"and {value.shape}."
            )
        qk_dim, value_dim = query.shape[-1], value.shape[-1]
        if key.shape[-1] != qk_dim:
            # Only the value's head dim may differ: q.k needs one D (flax raises here too).
            raise ValueError(
                f"query and key must have the same head dim, got query head dim {qk_dim} and key head dim "
                f"{key.shape[-1]} (shapes {query.shape} and {key.shape})."
            )
        if scale is None:
            scale = qk_dim**-0.5
        if qk_dim != value_dim and self.config.impl == "cudnn":
            # jax's cuDNN path takes one head dim for q, k and v (the other impls take Dv != D). Zero columns
            # change neither q.k nor the first Dv columns of the output, so the smaller is padded to the larger.
            head_dim = max(qk_dim, value_dim)
            query, key, value = (_pad_head_dim(x, head_dim) for x in (query, key, value))
        size = math.prod(batch_shape)
        query, key, value = (x.reshape((size, *x.shape[-3:])) for x in (query, key, value))
        if key_value_seq_lengths is not None:
            key_value_seq_lengths = jnp.broadcast_to(_merge_batch(key_value_seq_lengths, batch_shape, 0), (size,))
        if mask is not None:
            mask = jnp.asarray(mask).astype(jnp.bool_)
        hooks = score_mod is not None or mask_mod is not None
        if query_at_end and (query.shape[1] != 1 or key_value_seq_lengths is None):
            raise ValueError(
                f"query_at_end needs one query per sequence and key_value_seq_lengths, got query {query.shape}."
            )
        one_row = query.shape[1] == 1 and bias is None and not is_causal and (query_at_end or not hooks)
        if one_row and (dropout_key is None or dropout_rate == 0.0) and isinstance(scale, float) and (
            decode_runs_kernel(self.config, query.dtype, max(qk_dim, value_dim), hooks=hooks)
        ):
            out = one_query_step(
                query, key, value, kv_lengths=key_value_seq_lengths, mask=_merge_batch(mask, batch_shape, 3),
                scale=scale, score_mod=soft_capped(score_mod, self.logits_soft_cap), mask_mod=mask_mod,
                sinks=sinks,
            )
            return out.reshape((*batch_shape, *out.shape[1:]))
        if query_at_end:
            score_mod, mask_mod = shift_queries(score_mod, mask_mod, key_value_seq_lengths - 1)
        arguments = dict(
            bias=_merge_batch(bias, batch_shape, 3),
            mask=_merge_batch(mask, batch_shape, 3),
            is_causal=is_causal,
            key_value_seq_lengths=key_value_seq_lengths,
            scale=scale,
            score_mod=score_mod,
            mask_mod=mask_mod,
        )
        if dropout_key is not None and dropout_rate > 0.0:
            arguments.update(dropout_rate=dropout_rate, dropout_seed=jax.random.bits(dropout_key, (), jnp.uint32))
        out = attention(query, key, value, impl=self.config, logits_soft_cap=self.logits_soft_cap, sinks=sinks,
                        **arguments)
        return out[..., :value_dim].reshape((*batch_shape, *out.shape[1:-1], value_dim))


def _chained_score_mods(first: ScoreMod, second: ScoreMod, score, b, h, q_idx, kv_idx):
    return second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)


def combine_hooks(
    score_mods: tuple[ScoreMod | None, ...], mask_mods: tuple[MaskMod | None, ...]
) -> tuple[ScoreMod | None, MaskMod | None]:
    """One score_mod that applies `score_mods` in order, one mask_mod that attends where all `mask_mods` do
    (None entries are skipped; None when nothing is left)."""
    score_mod = None
    for mod in score_mods:
        if mod is not None:
            score_mod = mod if score_mod is None else Partial(_chained_score_mods, score_mod, mod)
    mask_mods = tuple(mod for mod in mask_mods if mod is not None)
    if len(mask_mods) > 1:
        return score_mod, and_masks(*mask_mods)
    return score_mod, (mask_mods[0] if mask_mods else None)


def _shifted_score_mod(score_mod: ScoreMod, offset, score, b, h, q_idx, kv_idx):
    return score_mod(score, b, h, q_idx + offset[b], kv_idx)


def _shifted_mask_mod(mask_mod: MaskMod, offset, b, h, q_idx, kv_idx):
    return mask_mod(b, h, q_idx + offset[b], kv_idx)


def shift_queries(
    score_mod: ScoreMod | None, mask_mod: MaskMod | None, offset: jax.Array
) -> tuple[ScoreMod | None, MaskMod | None]:
    """The hooks as seen by queries that start at position `offset[b]` (`[B]` int32), e.g. a decode step whose
    one query sits at the cache index: hooks receive `q_idx + offset[b]`, keys keep their cache positions."""
    return (
        None if score_mod is None else Partial(_shifted_score_mod, score_mod, offset),
        None if mask_mod is None else Partial(_shifted_mask_mod, mask_mod, offset),
    )


def key_value_inputs(
    inputs_q: jax.Array, inputs_k: jax.Array | None, inputs_v: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """The key and value inputs of a flax module's call, with flax's defaults: `inputs_k` is `inputs_q`,
    `inputs_v` is `inputs_k`; `inputs_v` without `inputs_k` is a `ValueError`."""
    if inputs_k is None:
        if inputs_v is not None:
            raise ValueError("inputs_k cannot be None if inputs_v is given.")
        inputs_k = inputs_q
    return inputs_k, inputs_k if inputs_v is None else inputs_v


def check_cache_room(position: jax.Array, max_length: int) -> None:
    """Raises a `ValueError` when a decode step finds its cache full (checked only where `position`, the
    cache index, is concrete: under `jit` the step would overwrite the last entry, as flax's modules do)."""
    if isinstance(position, jax.core.Tracer):
        return
    if int(position) >= max_length:
        raise ValueError(
            f"the decode cache is full: cache_index={int(position)} and the cache holds {max_length} tokens; "
            "size it with init_cache (or the decode=True init) for the longest sequence to decode."
        )


def runs_stock_for_complex(attend: AttentionFunction, *arrays: jax.Array) -> bool:
    """Whether a framework's stock attention function must run: complex inputs under impl "auto" (no
    implementation here computes in complex numbers). Under another impl they raise `NotImplementedError`."""
    dtype = next((jnp.dtype(x.dtype) for x in arrays if jnp.iscomplexobj(x)), None)
    if dtype is None:
        return False
    if attend.logits_soft_cap is not None:
        raise NotImplementedError(
            f"logits_soft_cap does not support dtype {dtype.name}: complex inputs run the stock attention "
            "function, which has no soft cap."
        )
    if attend.config.impl != "auto":
        raise NotImplementedError(
            f"impl={attend.config.impl!r} does not support dtype {dtype.name}; attention_impl='auto' falls back "
            "to the stock attention function for complex inputs."
        )
    return True


class _StockSignature:
    """`__signature__` of a `FlaxAttentionFunction` instance: its `stock` function's (the class keeps its own)."""

    def __get__(self, instance, owner) -> inspect.Signature:
        if instance is None:
            raise AttributeError("__signature__")
        return inspect.signature(owner.stock)


@dataclasses.dataclass(frozen=True)
class FlaxAttentionFunction:
    """The base of the NNX and Linen drop-ins for flax's `dot_product_attention`.

    A subclass names the framework's function as `stock` and implements `compute`, which receives each of
    `stock`'s arguments by name, defaults filled in. A call takes `stock`'s arguments (positionally or by
    name), and `inspect.signature` of an instance is `stock`'s: Linen's modules pass an attention_fn only the
    arguments that its signature names. Hashable, so that it can be a static attribute of a Flax module.
    """

    attend: AttentionFunction
    stock: ClassVar[Callable[..., jax.Array]]
    __signature__: ClassVar = _StockSignature()

    def __call__(self, *args, **kwargs) -> jax.Array:
        arguments = self.__signature__.bind(*args, **kwargs)
        arguments.apply_defaults()
        return self.compute(**arguments.arguments)

    def compute(self, **arguments) -> jax.Array:
        raise NotImplementedError


def flax_style_attention(
    attend: AttentionFunction,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: jax.Array | None,
    mask: jax.Array | None,
    dropout_rng: jax.Array | None,
    dropout_rate: float,
    deterministic: bool,
    is_causal: bool = False,
) -> jax.Array:
    """Maps the arguments of flax's `dot_product_attention` (NNX and Linen) onto an `AttentionFunction`.

    Dropout runs when `deterministic` is False and `dropout_rate > 0`, and then needs `dropout_rng`.
    """
    dropout_rate = check_dropout_rate(dropout_rate)
    dropout_key = None
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError("dropout_rng is required when dropout_rate > 0 and deterministic=False.")
        dropout_key = dropout_rng
    return attend(
        query, key, value, mask=mask, bias=bias, is_causal=is_causal, dropout_rate=dropout_rate,
        dropout_key=dropout_key, sinks=_BOUND_SINKS.get(),
    )


# flax's MultiHeadAttention calls its attention_fn with flax's arguments only; a drop-in with learned sinks
# binds their value for the length of its call (`bound_sinks`), and `flax_style_attention` reads it here.
_BOUND_SINKS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("probjax_sinks", default=None)


@contextlib.contextmanager
def bound_sinks(sinks: jax.Array | None):
    """Within the block, the flax-style attention functions add `sinks` `[N]` (None: none) to every call."""
    token = _BOUND_SINKS.set(sinks)
    try:
        yield
    finally:
        _BOUND_SINKS.reset(token)
