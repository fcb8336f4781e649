"""Flax NNX attention modules over the probjax kernels: a drop-in `MultiHeadAttention`, `FlexAttention`, hooks.

`MultiHeadAttention` is `flax.nnx.MultiHeadAttention` with its `attention_fn` set from `attention_impl`, so
the parameter tree, the decode cache, dropout RNG handling and `normalize_qk` are the stock module's.
`attention_fn(attention_impl)` is the same function for the stock module's `attention_fn=` argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.module import first_from
from flax.nnx.nn import attention, dtypes
from jax import lax

from probjax_kernels import alibi, alibi_slopes, relative_bias
from probjax_nn._attention import AttentionConfig, Impl
from probjax_nn._protocol import (
    FlaxAttentionFunction, MaskMod, ScoreMod, attention_function, bound_sinks, check_cache_room, combine_hooks,
    flax_style_attention, key_value_inputs, resolve_config, runs_stock_for_complex,
)

__all__ = [
    "ALiBi", "DotProductAttention", "FlexAttention", "MultiHeadAttention", "RelativePositionBias", "attention_fn",
]


@dataclasses.dataclass(frozen=True)
class DotProductAttention(FlaxAttentionFunction):
    """`flax.nnx.dot_product_attention`'s signature over the probjax kernels; see `attention_fn`."""

    stock = staticmethod(nnx.dot_product_attention)

    def compute(self, query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
                dtype, precision, module, promote_dtype, is_causal) -> jax.Array:
        if runs_stock_for_complex(self.attend, query, key, value):
            return nnx.dot_product_attention(
                query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype,
                precision, module, promote_dtype, is_causal,
            )
        if module is not None:
            if self.attend.logits_soft_cap is not None:
                raise NotImplementedError(
                    "sow_weights does not support logits_soft_cap: flax's sown weights would be the uncapped ones."
                )
            # Sowing needs the `[.., N, T, S]` weights, which the kernels never form.
            if self.attend.config.impl != "auto":
                raise NotImplementedError(
                    f"impl={self.attend.config.impl!r} does not support sow_weights (the attention weights are "
                    "never formed); use attention_impl='auto', which sows flax's dot_product_attention_weights."
                )
            # Flax sows its (undropped) weights; the output below is the one without sow_weights, so a fully
            # masked row still gives 0 (flax's output would average the values there).
            attention.dot_product_attention_weights(
                query, key, bias, mask, broadcast_dropout, None, 0.0, True, dtype, precision, module, promote_dtype,
                is_causal,
            )
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
        _check_shapes_like_flax(query, key, value, fast_path=dropout_rate == 0.0)
        return flax_style_attention(
            self.attend, query, key, value, bias=bias, mask=mask, dropout_rng=dropout_rng,
            dropout_rate=dropout_rate, deterministic=deterministic, is_causal=is_causal,
        )


def _check_shapes_like_flax(query: jax.Array, key: jax.Array, value: jax.Array, fast_path: bool) -> None:
    """`flax.nnx.dot_product_attention`'s shape checks, in its order and with its messages (code written against
    flax matches on them): without dropout flax hands the call to `jax.nn.dot_product_attention`, whose
    messages then apply. A value head dim other than the key's (which flax's fast path refuses) is taken."""
    arrays = (query, key, value)
    if any(a.ndim != query.ndim for a in arrays):
        raise ValueError(f"q, k, v must have same rank, but got {', '.join(str(a.ndim) for a in arrays)}.")
    if any(a.shape[:-3] != query.shape[:-3] for a in arrays):
        raise ValueError(f"q, k, v batch dims must match, but got shapes {', '.join(str(a.shape) for a in arrays)}.")
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"k, v lengths must match, but got {key.shape[-3]} and {value.shape[-3]}.")
    if fast_path:
        query, key, value = (a.reshape(-1, *a.shape[-3:]) for a in arrays)  # as flax reshapes them for jax.nn
        batch, length, heads, depth = key.shape
        if value.shape[2] != heads:
            raise ValueError(f"value shape should be {[batch, length, heads, value.shape[3]]}: but got {value.shape}")
        if query.shape[3] != depth:
            raise ValueError(f"query shape should be {[batch, -1, -1, depth]}: but got {query.shape}")
        if query.shape[2] % heads:
            raise ValueError("The number of query heads must be a multiple of key/value heads, but got "
                             f"{query.shape[2]} vs {heads}")
        return
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"q, k depths must match, but got {query.shape[-1]} and {key.shape[-1]}.")
    if query.shape[-2] % key.shape[-2]:
        raise ValueError(f"Query heads ({query.shape[-2]}) must be multiple of Key heads ({key.shape[-2]}) for "
                         "Grouped Query Attention.")
    if query.shape[-2] % value.shape[-2]:
        raise ValueError(f"Query heads ({query.shape[-2]}) must be multiple of Value heads ({value.shape[-2]})")


def attention_fn(
    attention_impl: Impl | AttentionConfig = "auto", logits_soft_cap: float | None = None
) -> DotProductAttention:
    """A drop-in for `flax.nnx.dot_product_attention`, usable as `attention_fn=` of `nnx.MultiHeadAttention`.

    **Arguments:**

    - `attention_impl`: `"auto" | "pallas" | "flex" | "xla" | "cudnn"` or a `probjax_nn.AttentionConfig`.
    - `logits_soft_cap`: None (off) or a positive float: `probjax_nn.attention`'s soft cap.

    **Returns:** a hashable function with `flax.nnx.dot_product_attention`'s arguments: query `[batch..., T,
    N, D]`, key and value `[batch..., S, K, D]` (N a multiple of K), `mask` broadcastable to `[batch..., N, T,
    S]` (non-zero = attend), `is_causal`, dropout from `dropout_rng` when `deterministic` is False. It
    returns `[batch..., T, N, D]`. Unlike flax: a query row whose keys are all masked gives 0 (flax averages
    the values); dropout draws one mask per batch entry and head (`broadcast_dropout` is ignored);
    `precision` is ignored (the kernels accumulate in float32). With `module` (sow_weights) impl "auto" sows
    flax's `dot_product_attention_weights` and returns the same output as without it; complex inputs run
    flax's `dot_product_attention` under "auto". Any other impl raises `NotImplementedError` for both.
    float64 runs only under impl "xla" and "auto" (which picks XLA for it); "pallas", "flex" and "cudnn"
    raise `NotImplementedError` for it. Invalid shapes raise flax's `ValueError`s with flax's messages.
    """
    return DotProductAttention(attention_function(attention_impl, logits_soft_cap))


class MultiHeadAttention(nnx.MultiHeadAttention):
    """`flax.nnx.MultiHeadAttention` with attention on the probjax kernels; change the import, keep the state.

    **Arguments:** those of `flax.nnx.MultiHeadAttention` (`num_kv_heads` for grouped-query attention,
    `dropout_rate`, `deterministic`, `decode`, `normalize_qk`, `dtype`, `param_dtype`, `precision`, `rngs`, ...),
    plus

    - `attention_impl`: `"auto" | "pallas" | "flex" | "xla" | "cudnn"` or a `probjax_nn.AttentionConfig`;
      a bad value raises a `ValueError` that lists the valid ones.
    - `attention_fn`: as in flax; None (the default) means `attention_fn(attention_impl, logits_soft_cap)`.
    - `logits_soft_cap`: None (the default: off, as the stock module) or a positive float `cap`: scores become
      `cap * tanh(score / cap)` (Gemma 2), under every impl but "cudnn"; it adds no parameter, so stock
      checkpoints load unchanged.
    - `attention_sinks`: False (the default: no sinks, the stock module's state) or True: a learned
      attention-sink logit per head, `sinks` (an `nnx.Param` `[num_heads]` float32, initialised to 0), joins
      every row's softmax denominator (gpt-oss; `probjax_nn.attention`'s `sinks`), under every impl but
      "cudnn".

    The call is the stock one: `module(inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
    deterministic=None, rngs=None, decode=None, is_causal=False, ...)`, with `mask` broadcastable to
    `[batch..., N, T, S]` (True = attend), and `init_cache(input_shape)` before decoding with `decode=True`.
    See `attention_fn` for where the results differ from flax's.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        attention_impl: Impl | AttentionConfig = "auto",
        attention_fn: Callable[..., jax.Array] | None = None,
        logits_soft_cap: float | None = None,
        attention_sinks: bool = False,
        rngs: nnx.Rngs,
        **kwargs,
    ):
        config = resolve_config(attention_impl)
        attend = attention_function(config, logits_soft_cap)
        if not isinstance(attention_sinks, bool):
            raise TypeError(f"attention_sinks must be a bool, got {attention_sinks!r}.")
        if attention_fn is None:
            attention_fn = DotProductAttention(attend)
        elif config != AttentionConfig() or logits_soft_cap is not None or attention_sinks:
            given = ("attention_sinks" if attention_sinks else
                     "logits_soft_cap" if logits_soft_cap is not None else "attention_impl")
            raise ValueError(f"pass {given} or attention_fn, not both.")
        super().__init__(
            num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features,
            attention_fn=attention_fn, rngs=rngs, **kwargs,
        )
        self.attention_impl = config
        self.logits_soft_cap = attend.logits_soft_cap
        self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32)) if attention_sinks else None

    def __call__(self, *args, **kwargs) -> jax.Array:
        """The stock call (see the class docstring), with the module's `sinks` when it has them."""
        with bound_sinks(self._sink_values()):
            return super().__call__(*args, **kwargs)

    def _sink_values(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...]


def _hook_attribute(hook):
    """Hooks that hold arrays (modules with parameters, Partials) are nnx data; plain functions are static."""
    holds_arrays = any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(hook))
    return nnx.data(hook) if isinstance(hook, nnx.Module) or holds_arrays else hook


class FlexAttention(MultiHeadAttention):
    """Multi-head attention with FlexAttention hooks: the projections of `MultiHeadAttention` (same
    parameter tree, plus the hooks' parameters) around `probjax_nn.attention(..., score_mod, mask_mod)`.

    **Arguments:** those of `MultiHeadAttention` (`attention_impl`, `rngs`, ...), plus (keyword only)

    - `score_mod`: `score_mod(score, b, h, q_idx, kv_idx) -> score`, applied to the scaled scores inside the
      kernel; may be an `nnx.Module` with parameters (`ALiBi`, `RelativePositionBias`), which train through
      the kernel.
    - `mask_mod`: `mask_mod(b, h, q_idx, kv_idx) -> bool`, True = attend (e.g. `probjax_kernels.causal_mask`).

    Hooks are called with int32 index arrays that broadcast against each other (see `probjax_kernels`).
    `attention_impl="auto"` runs the flex kernel on a GPU and XLA elsewhere.
    """

    def __init__(self, *args, score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.score_mod = _hook_attribute(score_mod)
        self.mask_mod = _hook_attribute(mask_mod)

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        decode: bool | None = None,
        is_causal: bool = False,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
        qkv_sharding: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """**Arguments:** as `flax.nnx.MultiHeadAttention.__call__`:

        - `inputs_q`: `[batch..., T, in_features]`; `inputs_k`, `inputs_v`: `[batch..., S, in_kv_features]`
          (default: `inputs_q`, then `inputs_k`).
        - `mask`: broadcastable to `[batch..., N, T, S]`; True (non-zero) = attend.
        - `deterministic`, `rngs`: dropout as in flax; `decode`: one token per call against the cache of
          `init_cache`, the hooks then see the token's position as `q_idx`.
        - `is_causal`: query i sees keys j <= i (ignored when decoding: the cache length masks instead).
        - `score_mod`, `mask_mod`: hooks for this call (per-batch data such as document ids), applied after
          the module's own.

        **Returns:** `[batch..., T, out_features]`.
        """
        inputs_k, inputs_v = key_value_inputs(inputs_q, inputs_k, inputs_v)
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"inputs_q has {inputs_q.shape[-1]} features, the module expects {self.in_features}.")
        query = self.query(inputs_q, out_sharding=qkv_sharding)
        key = self.key(inputs_k, out_sharding=qkv_sharding)
        value = self.value(inputs_v, out_sharding=qkv_sharding)
        if self.normalize_qk:
            query = self.query_ln(query)
            key = self.key_ln(key)
        score_mod, mask_mod = combine_hooks((self.score_mod, score_mod), (self.mask_mod, mask_mod))
        decode = first_from(
            decode, self.decode, error_msg="FlexAttention needs decode as a call argument or attribute."
        )
        key_value_seq_lengths = None
        if decode:
            key, value, position = self._append_to_cache(key, value)
            key_value_seq_lengths = jnp.broadcast_to(position + 1, key.shape[:-3])
            is_causal = False
        query, key, value = dtypes.promote_dtype((query, key, value), dtype=self.dtype)
        x = attention_function(self.attention_impl, self.logits_soft_cap)(
            query, key, value, mask=mask,
            is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths, score_mod=score_mod,
            mask_mod=mask_mod, query_at_end=decode, dropout_rate=self.dropout_rate,
            dropout_key=self._dropout_key(deterministic, rngs), sinks=self._sink_values(),
        )
        return self.out(x, out_sharding=out_sharding)

    def _append_to_cache(self, key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Writes one step's key and value at the cache index; returns the caches and that index."""
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise ValueError("Autoregressive cache not initialized, call init_cache first.")
        *batch_dims, _, num_kv_heads, head_dim = self.cached_key.shape
        expected = (*batch_dims, 1, num_kv_heads, head_dim)
        if key.shape != expected:
            raise ValueError(f"decode takes one token per call: expected key shape {expected}, got {key.shape}.")
        position = self.cache_index[...]
        check_cache_room(position, self.cached_key.shape[-3])
        zero = jnp.zeros((), position.dtype)
        indices = (zero,) * len(batch_dims) + (position, zero, zero)
        key = lax.dynamic_update_slice(self.cached_key[...], key, indices)
        value = lax.dynamic_update_slice(self.cached_value[...], value, indices)
        self.cached_key[...] = key
        self.cached_value[...] = value
        self.cache_index[...] = position + 1
        return key, value, position

    def _dropout_key(self, deterministic: bool | None, rngs: nnx.Rngs | nnx.RngStream | None) -> jax.Array | None:
        """The stock module's rules: a call's `rngs` beat the stored ones; dropout needs `deterministic`."""
        if self.dropout_rate == 0.0:
            return None
        deterministic = first_from(
            deterministic, self.deterministic,
            error_msg="FlexAttention needs deterministic as a call argument or attribute when dropout_rate > 0.",
        )
        if deterministic:
            return None
        stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs if rngs is not None else self.rngs
        if stream is None:
            raise ValueError("rngs must be given to __call__ when the module was built with keep_rngs=False.")
        return stream()


class ALiBi(nnx.Module):
    """Learnable ALiBi (Press et al. 2022) as a score_mod: `score - slopes[h] * |q_idx - kv_idx|`.

    **Arguments:**

    - `num_heads`: N; `slopes` is an `nnx.Param` `[N]` float32, initialised to the paper's geometric slopes
      `2^(-8 i / N)`, i = 1..N.
    """

    def __init__(self, num_heads: int):
        self.slopes = nnx.Param(alibi_slopes(num_heads))

    def __call__(self, score: jax.Array, b: jax.Array, h: jax.Array, q_idx: jax.Array, kv_idx: jax.Array) -> jax.Array:
        return alibi(self.slopes[...])(score, b, h, q_idx, kv_idx)


class RelativePositionBias(nnx.Module):
    """A learned relative-position bias as a score_mod: `score + table[h, kv_idx - q_idx + max_len - 1]`.

    **Arguments:**

    - `num_heads`: N; `max_len`: offsets beyond `max_len - 1` either way read the end entries. `table` is an
      `nnx.Param` `[N, 2 * max_len - 1]` float32, initialised to zeros (plain attention).
    """

    def __init__(self, num_heads: int, max_len: int):
        self.table = nnx.Param(jnp.zeros((num_heads, 2 * max_len - 1), jnp.float32))

    def __call__(self, score: jax.Array, b: jax.Array, h: jax.Array, q_idx: jax.Array, kv_idx: jax.Array) -> jax.Array:
        return relative_bias(self.table[...])(score, b, h, q_idx, kv_idx)
