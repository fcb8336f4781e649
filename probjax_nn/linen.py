"""Flax Linen attention modules over the probjax kernels: a drop-in `MultiHeadDotProductAttention`,
`FlexAttention` and learnable hooks.

`MultiHeadDotProductAttention` is `flax.linen.MultiHeadDotProductAttention` with its `attention_fn` set from
`attention_impl`, so the parameter tree, the decode cache and dropout RNG handling are the stock module's.
`attention_fn(attention_impl)` is the same function for the stock module's `attention_fn=` attribute.

Linen parameters can be read only in their module's own trace, not inside a kernel's, so a Linen hook with
parameters (`ALiBi`, `RelativePositionBias`) is a module that `FlexAttention` calls with no arguments; it
returns the score_mod, a closure over its parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import dtypes
from jax import lax

from probjax_kernels import alibi, alibi_slopes, relative_bias
from probjax_nn._attention import AttentionConfig, Impl
from probjax_nn._protocol import (
    FlaxAttentionFunction, MaskMod, ScoreMod, attention_function, bound_sinks, check_cache_room, combine_hooks,
    flax_style_attention, key_value_inputs, runs_stock_for_complex,
)

__all__ = [
    "ALiBi", "DotProductAttention", "FlexAttention", "MultiHeadAttention", "MultiHeadDotProductAttention",
    "RelativePositionBias", "SelfAttention", "attention_fn", "dot_product_attention",
]


def _check_shapes_like_flax(query: jax.Array, key: jax.Array, value: jax.Array) -> None:
    """`flax.linen.dot_product_attention`'s shape checks, with its exception type (AssertionError) and messages,
    which code written against flax matches on; it also takes N a multiple of K (GQA), which flax refuses."""
    if not key.ndim == query.ndim == value.ndim:
        raise AssertionError("q, k, v must have same rank.")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise AssertionError("q, k, v batch dims must match.")
    if query.shape[-2] % key.shape[-2] or key.shape[-2] != value.shape[-2]:
        raise AssertionError("q, k, v num_heads must match.")
    if key.shape[-3] != value.shape[-3]:
        raise AssertionError("k, v lengths must match.")
    if query.shape[-1] != key.shape[-1]:
        raise AssertionError("q, k depths must match.")


def _check_einsums_like_flax(precision, einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum):
    """`flax.linen.dot_product_attention`'s ValueErrors for a bad combination of custom einsums and
    precision, before any impl's NotImplementedError for custom einsums (code written against flax expects
    its errors first)."""
    if (qk_attn_weights_einsum is None) != (attn_weights_value_einsum is None):
        raise ValueError("qk_attn_weights_einsum and attn_weights_value_einsum must be specified together.")
    if (precision or einsum_dot_general) and (qk_attn_weights_einsum or attn_weights_value_einsum):
        raise ValueError(
            "precision/einsum_dot_general and qk_attn_weights_einsum/attn_weights_value_einsum are mutually "
            "exclusive. Please specify only one of them."
        )


@dataclasses.dataclass(frozen=True)
class DotProductAttention(FlaxAttentionFunction):
    """`flax.linen.dot_product_attention`'s signature over the probjax kernels; see `attention_fn`."""

    stock = staticmethod(nn.dot_product_attention)

    def compute(self, query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
                dtype, precision, module, force_fp32_for_softmax, einsum_dot_general, qk_attn_weights_einsum,
                attn_weights_value_einsum) -> jax.Array:
        _check_einsums_like_flax(precision, einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum)
        # The kernels form neither the weights (to sow) nor the einsums (to replace, e.g. AQT's).
        custom_einsums = any(
            f is not None for f in (einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum)
        )
        if (module is not None or custom_einsums) and self.attend.logits_soft_cap is not None:
            raise NotImplementedError(
                "sow_weights and custom einsums do not support logits_soft_cap: they run flax's function, which "
                "has no soft cap."
            )
        if (module is not None or custom_einsums) and self.attend.config.impl != "auto":
            raise NotImplementedError(
                f"impl={self.attend.config.impl!r} does not support sow_weights or custom einsums; use "
                "attention_impl='auto', which sows flax's weights and falls back to flax's function for einsums."
            )
        if custom_einsums or runs_stock_for_complex(self.attend, query, key, value):
            return nn.dot_product_attention(
                query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype,
                precision, module, force_fp32_for_softmax, einsum_dot_general=einsum_dot_general,
                qk_attn_weights_einsum=qk_attn_weights_einsum, attn_weights_value_einsum=attn_weights_value_einsum,
            )
        if module is not None:
            # Flax sows its (undropped) weights; the output below is the one without sow_weights, so a fully
            # masked row still gives 0 (flax's output would average the values there).
            nn.dot_product_attention_weights(
                query, key, bias, mask, broadcast_dropout, None, 0.0, True, dtype, precision, module,
                force_fp32_for_softmax,
            )
        query, key, value = dtypes.promote_dtype(query, key, value, dtype=dtype)
        _check_shapes_like_flax(query, key, value)
        return flax_style_attention(
            self.attend, query, key, value, bias=bias, mask=mask, dropout_rng=dropout_rng,
            dropout_rate=dropout_rate, deterministic=deterministic,
        )


def attention_fn(
    attention_impl: Impl | AttentionConfig = "auto", logits_soft_cap: float | None = None
) -> DotProductAttention:
    """A drop-in for `flax.linen.dot_product_attention`, usable as `attention_fn=` of the stock Linen modules.

    **Arguments:**

    - `attention_impl`: `"auto" | "pallas" | "flex" | "xla" | "cudnn"` or a `probjax_nn.AttentionConfig`.
    - `logits_soft_cap`: None (off) or a positive float: `probjax_nn.attention`'s soft cap.

    **Returns:** a hashable function with `flax.linen.dot_product_attention`'s arguments: query, key and
    value `[batch..., T|S, N, D]`, `mask` broadcastable to `[batch..., N, T, S]` (non-zero = attend),
    dropout from `dropout_rng` when `deterministic` is False; it returns `[batch..., T, N, D]`. Unlike flax:
    a query row whose keys are all masked gives 0 (flax averages the values); dropout draws one mask per
    batch entry and head (`broadcast_dropout` is ignored); softmax is always float32 and `precision` is
    ignored. With `module` (sow_weights) impl "auto" sows flax's `dot_product_attention_weights` and returns
    the same output as without it; with custom einsums or complex inputs it runs flax's own function; any
    other impl raises `NotImplementedError` for these. float64 runs only under impl "xla" and "auto" (which
    picks XLA for it); "pallas", "flex" and "cudnn" raise `NotImplementedError` for it. Invalid shapes raise
    flax's `AssertionError`s with flax's messages.
    """
    return DotProductAttention(attention_function(attention_impl, logits_soft_cap))


# `flax.linen.dot_product_attention` under its own name: the same signature (`DotProductAttention.__call__`),
# computed as `attention_fn("auto")`.
dot_product_attention = DotProductAttention(attention_function("auto"))


@dataclasses.dataclass(frozen=True)
class _ImplAttention(DotProductAttention):
    """The attention_fn that `MultiHeadDotProductAttention` builds from its `attention_impl` (a user's
    attention_fn is never one), so that `clone(attention_impl=...)` can tell it apart and rebuild it."""


def _with_sinks(stock_call: Callable) -> Callable:
    """A stock module's `__call__` (same signature, same variables) that binds the module's `sinks`, when it
    has them, for flax's attention_fn calls (`bound_sinks`)."""

    def __call__(self, *args, **kwargs):
        with bound_sinks(self._sinks()):
            return stock_call(self, *args, **kwargs)

    # Not functools.wraps: it would copy flax's marker of an already wrapped method, and flax would then not
    # make this one compact.
    __call__.__signature__ = inspect.signature(stock_call)
    __call__.__doc__ = stock_call.__doc__
    return nn.compact(__call__)


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
    """`flax.linen.MultiHeadDotProductAttention` with attention on the probjax kernels; same variables.

    **Attributes:** those of `flax.linen.MultiHeadDotProductAttention` (`num_heads`, `qkv_features`,
    `dropout_rate`, `deterministic`, `decode`, `normalize_qk`, `dtype`, `param_dtype`, `precision`, ...), plus

    - `attention_impl`: `"auto" | "pallas" | "flex" | "xla" | "cudnn"` or a `probjax_nn.AttentionConfig`;
      a bad value raises a `ValueError` that lists the valid ones. It sets `attention_fn` unless that was
      given too.
    - `logits_soft_cap`: None (the default: off, as the stock module) or a positive float `cap`: scores become
      `cap * tanh(score / cap)` (Gemma 2), under every impl but "cudnn"; it adds no variable, so stock
      checkpoints load unchanged.
    - `attention_sinks`: False (the default: no sinks, the stock module's variables) or True: a learned
      attention-sink logit per head, the parameter `sinks` `[num_heads]` float32 (initialised to 0), joins
      every row's softmax denominator (gpt-oss; `probjax_nn.attention`'s `sinks`), under every impl but
      "cudnn".

    The call is the stock one: `module.apply(variables, inputs_q, inputs_k=None, inputs_v=None, *,
    mask=None, deterministic=None, dropout_rng=None)`, `mask` broadcastable to `[batch..., N, T, S]`
    (True = attend); with `decode=True` one token per call against the `cache` collection. See
    `attention_fn` for where the results differ from flax's.
    """

    attention_impl: Impl | AttentionConfig = "auto"
    logits_soft_cap: float | None = None
    attention_sinks: bool = False

    def __post_init__(self):
        attend = attention_function(self.attention_impl, self.logits_soft_cap)
        if not isinstance(self.attention_sinks, bool):
            raise TypeError(f"attention_sinks must be a bool, got {self.attention_sinks!r}.")
        # Clones arrive with the attention_fn built from the original's attention_impl: rebuilt from theirs.
        if self.attention_fn is nn.dot_product_attention or isinstance(self.attention_fn, _ImplAttention):
            # Linen modules are frozen dataclasses; fields are settable only while they are built.
            object.__setattr__(self, "attention_fn", _ImplAttention(attend))
        elif attend.config != AttentionConfig() or attend.logits_soft_cap is not None or self.attention_sinks:
            given = ("attention_sinks" if self.attention_sinks else
                     "logits_soft_cap" if attend.logits_soft_cap is not None else "attention_impl")
            raise ValueError(f"pass {given} or attention_fn, not both.")
        super().__post_init__()

    __call__ = _with_sinks(nn.MultiHeadDotProductAttention.__call__)

    def _sinks(self) -> jax.Array | None:
        if not self.attention_sinks:
            return None
        return self.param("sinks", nn.initializers.zeros_init(), (self.num_heads,), jnp.float32)


class MultiHeadAttention(MultiHeadDotProductAttention, nn.MultiHeadAttention):
    """`flax.linen.MultiHeadAttention` (flax's alias of `MultiHeadDotProductAttention`, named
    `MultiHeadAttention_{i}` in a parent) with attention on the probjax kernels: the attributes, variables
    and call of `MultiHeadDotProductAttention`, plus `attention_impl`. An instance of the stock class too."""

    __call__ = _with_sinks(nn.MultiHeadAttention.__call__)


class SelfAttention(MultiHeadDotProductAttention, nn.SelfAttention):
    """`flax.linen.SelfAttention` with attention on the probjax kernels: the stock call `module.apply(variables,
    inputs_q, mask=None, deterministic=None, dropout_rng=None, sow_weights=False)` (flax's, with its
    deprecation warning) over the attributes and variables of `MultiHeadDotProductAttention`, plus
    `attention_impl`. An instance of the stock class too."""

    __call__ = _with_sinks(nn.SelfAttention.__call__)


def _bound_hook(hook):
    """A Linen module hook called (inside its parent's trace) to get its closure; other hooks as they are."""
    return hook() if isinstance(hook, nn.Module) else hook


class FlexAttention(MultiHeadDotProductAttention):
    """Multi-head attention with FlexAttention hooks: the projections of `MultiHeadDotProductAttention`
    (same variable names, plus the hooks' parameters under `score_mod` / `mask_mod`) around
    `probjax_nn.attention(..., score_mod, mask_mod)`.

    **Attributes:** those of `MultiHeadDotProductAttention`, plus

    - `score_mod`: `score_mod(score, b, h, q_idx, kv_idx) -> score`, applied to the scaled scores inside the
      kernel; or a Linen module that returns one when called with no arguments (`ALiBi`,
      `RelativePositionBias`), whose parameters train through the kernel.
    - `mask_mod`: `mask_mod(b, h, q_idx, kv_idx) -> bool`, True = attend; or a Linen module returning one.

    Hooks are called with int32 index arrays that broadcast against each other (see `probjax_kernels`).
    `attention_impl="auto"` runs the flex kernel on a GPU and XLA elsewhere.
    """

    score_mod: ScoreMod | nn.Module | None = None
    mask_mod: MaskMod | nn.Module | None = None

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        dropout_rng: jax.Array | None = None,
        is_causal: bool = False,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
    ) -> jax.Array:
        """**Arguments:**

        - `inputs_q`: `[batch..., T, features]`; `inputs_k`, `inputs_v`: `[batch..., S, features]` (default:
          `inputs_q`, then `inputs_k`).
        - `mask`: broadcastable to `[batch..., N, T, S]`; True (non-zero) = attend.
        - `deterministic`, `dropout_rng`: dropout as in flax (`make_rng("dropout")` without `dropout_rng`).
        - `is_causal`: query i sees keys j <= i (ignored when decoding: the cache length masks instead).
        - `score_mod`, `mask_mod`: hooks for this call (per-batch data such as document ids), applied after
          the module's own.

        With `decode=True` one token per call against the `cache` collection; the hooks then see the token's
        position as `q_idx`. **Returns:** `[batch..., T, out_features or features]`.
        """
        inputs_k, inputs_v = key_value_inputs(inputs_q, inputs_k, inputs_v)
        features = self.out_features or inputs_q.shape[-1]
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        if qkv_features % self.num_heads:
            raise ValueError(f"qkv_features={qkv_features} must be divisible by num_heads={self.num_heads}.")
        dense = functools.partial(
            nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
            features=(self.num_heads, qkv_features // self.num_heads), kernel_init=self.kernel_init,
            bias_init=self.bias_init, use_bias=self.use_bias, precision=self.precision,
        )
        query = dense(name="query")(inputs_q)
        key = dense(name="key")(inputs_k)
        value = dense(name="value")(inputs_v)
        if self.normalize_qk:
            norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
            query = norm(name="query_ln")(query)
            key = norm(name="key_ln")(key)
        score_mod, mask_mod = combine_hooks(
            (_bound_hook(self.score_mod), score_mod), (_bound_hook(self.mask_mod), mask_mod)
        )
        key_value_seq_lengths = None
        if self.decode and self.has_variable("cache", "cached_key"):
            key, value, position = self._append_to_cache(key, value)
            key_value_seq_lengths = jnp.broadcast_to(position + 1, key.shape[:-3])
            is_causal = False
        elif self.decode:
            # Initialisation: the cache takes the shape of the input, which is the full sequence.
            self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
            self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
            self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
        dropout_key = None
        if self.dropout_rate > 0.0 and not nn.merge_param("deterministic", self.deterministic, deterministic):
            dropout_key = self.make_rng("dropout") if dropout_rng is None else dropout_rng
        query, key, value = dtypes.promote_dtype(query, key, value, dtype=self.dtype)
        x = attention_function(self.attention_impl, self.logits_soft_cap)(
            query, key, value, mask=mask,
            is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths, score_mod=score_mod,
            mask_mod=mask_mod, query_at_end=key_value_seq_lengths is not None, dropout_rate=self.dropout_rate,
            dropout_key=dropout_key, sinks=self._sinks(),
        )
        return nn.DenseGeneral(
            features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
            bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
            param_dtype=self.param_dtype, precision=self.precision, name="out",
        )(x)

    def _append_to_cache(self, key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Writes one step's key and value at the cache index; returns the caches and that index."""
        cached_key = self.get_variable("cache", "cached_key")
        *batch_dims, _, num_heads, head_dim = cached_key.shape
        expected = (*batch_dims, 1, num_heads, head_dim)
        if key.shape != expected:
            raise ValueError(f"decode takes one token per call: expected key shape {expected}, got {key.shape}.")
        position = self.get_variable("cache", "cache_index")
        check_cache_room(position, cached_key.shape[-3])
        zero = jnp.zeros((), position.dtype)
        indices = (zero,) * len(batch_dims) + (position, zero, zero)
        key = lax.dynamic_update_slice(cached_key, key, indices)
        value = lax.dynamic_update_slice(self.get_variable("cache", "cached_value"), value, indices)
        self.put_variable("cache", "cached_key", key)
        self.put_variable("cache", "cached_value", value)
        self.put_variable("cache", "cache_index", position + 1)
        return key, value, position


class ALiBi(nn.Module):
    """Learnable ALiBi (Press et al. 2022): called with no arguments, returns the score_mod
    `score - slopes[h] * |q_idx - kv_idx|` over its parameter `slopes` `[num_heads]` float32, initialised
    to the paper's geometric slopes `2^(-8 i / N)`, i = 1..N."""

    num_heads: int

    @nn.compact
    def __call__(self) -> ScoreMod:
        return alibi(self.param("slopes", lambda rng: alibi_slopes(self.num_heads)))


class RelativePositionBias(nn.Module):
    """A learned relative-position bias: called with no arguments, returns the score_mod
    `score + table[h, kv_idx - q_idx + max_len - 1]` over its parameter `table` `[num_heads, 2 * max_len - 1]`
    float32, initialised to zeros (plain attention); offsets beyond `max_len - 1` read the end entries."""

    num_heads: int
    max_len: int

    @nn.compact
    def __call__(self) -> ScoreMod:
        shape = (self.num_heads, 2 * self.max_len - 1)
        return relative_bias(self.param("table", nn.initializers.zeros_init(), shape, jnp.float32))
