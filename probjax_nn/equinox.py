"""Equinox attention modules over the probjax kernels: a drop-in `MultiheadAttention`, `FlexAttention`, hooks.

`MultiheadAttention` has the fields of `equinox.nn.MultiheadAttention`, in the same order, plus two static
fields (`attention_impl`, `logits_soft_cap`), so a stock module's leaves (`eqx.tree_serialise_leaves`) load
into it unchanged. Calls are unbatched, as in Equinox: `jax.vmap` the module over a batch, and the kernels'
batching rules batch the kernel.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from probjax_kernels import alibi, alibi_slopes, relative_bias
from probjax_nn._attention import AttentionConfig, Impl
from probjax_nn._protocol import (
    MaskMod, ScoreMod, attention_function, combine_hooks, runs_stock_for_complex,
)

__all__ = ["ALiBi", "FlexAttention", "MultiheadAttention", "RelativePositionBias"]

Mask = Bool[Array, "q_seq kv_seq"] | Bool[Array, "num_heads q_seq kv_seq"]
_QKHeads = Float[Array, "seq num_heads qk_size"]
_VOHeads = Float[Array, "seq num_heads vo_size"]
ProcessHeads = Callable[[_QKHeads, _QKHeads, _VOHeads], tuple[_QKHeads, _QKHeads, _VOHeads]]


class MultiheadAttention(eqx.Module):
    """`equinox.nn.MultiheadAttention` with attention on the probjax kernels; same leaves, same call.

    **Arguments:** those of `equinox.nn.MultiheadAttention` (`num_heads`, `query_size`, `key_size`,
    `value_size`, `output_size`, `qk_size`, `vo_size`, `use_*_bias`, `dropout_p`, `inference`, `dtype`), with
    the same initialisation for the same `key`, plus

    - `attention_impl`: `"auto" | "pallas" | "flex" | "xla" | "cudnn"` or a `probjax_nn.AttentionConfig`
      (keyword only); a bad value raises a `ValueError` that lists the valid ones.
    - `logits_soft_cap`: None (the default: off, as the stock module) or a positive float `cap` (keyword
      only): scores become `cap * tanh(score / cap)` (Gemma 2), under every impl but "cudnn"; a static
      field, so the leaves stay the stock module's.
    - `attention_sinks`: False (the default: no sinks, the stock module's leaves) or True (keyword only): a
      learned attention-sink logit per head, the field `sinks` `[num_heads]` float32 (initialised to 0; a
      leaf after the stock ones), joins every row's softmax denominator (gpt-oss; `probjax_nn.attention`'s
      `sinks`), under every impl but "cudnn".

    Where results differ from equinox's: float64 runs only under impl "xla" and "auto" (which picks XLA
    for it); "pallas", "flex" and "cudnn" raise `NotImplementedError` for it.
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    attention_impl: AttentionConfig = eqx.field(static=True)
    logits_soft_cap: float | None = eqx.field(static=True)
    sinks: Float[Array, " num_heads"] | None

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        dropout_p: float = 0.0,
        inference: bool = False,
        dtype=None,
        *,
        attention_impl: Impl | AttentionConfig = "auto",
        logits_soft_cap: float | None = None,
        attention_sinks: bool = False,
        key: PRNGKeyArray,
    ):
        attend = attention_function(attention_impl, logits_soft_cap)
        self.attention_impl, self.logits_soft_cap = attend.config, attend.logits_soft_cap
        if not isinstance(attention_sinks, bool):
            raise TypeError(f"attention_sinks must be a bool, got {attention_sinks!r}.")
        self.sinks = jnp.zeros((num_heads,), jnp.float32) if attention_sinks else None
        # Built by the stock module itself, so that one key gives the same weights.
        stock = eqx.nn.MultiheadAttention(
            num_heads, query_size, key_size, value_size, output_size, qk_size, vo_size, use_query_bias,
            use_key_bias, use_value_bias, use_output_bias, dropout_p, inference, dtype, key=key,
        )
        for field in dataclasses.fields(stock):
            setattr(self, field.name, getattr(stock, field.name))

    def __call__(
        self,
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"],
        value: Float[Array, "kv_seq v_size"],
        mask: Mask | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: ProcessHeads | None = None,
    ) -> Float[Array, "q_seq o_size"]:
        """**Arguments:**

        - `query`: `[q_seq, query_size]`; `key_`: `[kv_seq, key_size]`; `value`: `[kv_seq, value_size]`.
        - `mask`: bool `[q_seq, kv_seq]` or, per head, `[num_heads, q_seq, kv_seq]`; False = ignore that key.
          A query row with every key masked gives 0 (Equinox averages the values there).
        - `key`: PRNG key for dropout; unused when `dropout_p == 0` or in inference.
        - `inference`: True = no dropout; None uses the module's `dropout.inference`. `deterministic` is
          its deprecated alias.
        - `process_heads`: maps the `[seq, num_heads, size]` query, key and value heads to new ones of the
          same shapes (e.g. rotary embeddings); heads it returns in different dtypes are promoted to one
          (`jnp.result_type`), as in Equinox.

        Complex heads run the stock `equinox.nn.MultiheadAttention` call under `attention_impl="auto"`
        (another impl raises `NotImplementedError`).

        **Returns:** `[q_seq, output_size]`. Dropout draws the kernels' stateless mask from `key` (not
        Equinox's Bernoulli draw), so it matches Equinox in distribution, not bit for bit; `dropout_p=1`
        drops every weight (the attention output is 0), as in Equinox.
        """
        return self._attend(query, key_, value, mask, key, inference, deterministic, process_heads, None, None)

    def _attend(
        self, query, key_, value, mask, key, inference, deterministic, process_heads, score_mod, mask_mod,
    ) -> Float[Array, "q_seq o_size"]:
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "MultiheadAttention()(deterministic=...) is deprecated in favour of MultiheadAttention()(inference=...)"
            )
        query_seq_length, _ = query.shape
        kv_seq_length, _ = key_.shape
        if value.shape[0] != kv_seq_length:
            raise ValueError("key and value must both be sequences of equal length.")
        query_heads = self._project(self.query_proj, query)
        key_heads = self._project(self.key_proj, key_)
        value_heads = self._project(self.value_proj, value)
        if process_heads is not None:
            shapes = (query_heads.shape, key_heads.shape, value_heads.shape)
            query_heads, key_heads, value_heads = process_heads(query_heads, key_heads, value_heads)
            if (query_heads.shape, key_heads.shape, value_heads.shape) != shapes:
                raise ValueError("process_heads must not change the shape of the heads.")
            # Heads of mixed dtypes compute in their promoted dtype, as the stock module's einsums do.
            dtype = jnp.result_type(query_heads, key_heads, value_heads)
            query_heads, key_heads, value_heads = (x.astype(dtype) for x in (query_heads, key_heads, value_heads))
        if score_mod is None and mask_mod is None and runs_stock_for_complex(
            attention_function(self.attention_impl, self.logits_soft_cap), query_heads, key_heads, value_heads
        ):
            # Complex heads under "auto": the stock module's call, on the same fields (it projects again).
            return eqx.nn.MultiheadAttention.__call__(
                self, query, key_, value, mask, key=key, inference=inference, process_heads=process_heads
            )
        if mask is not None:
            expected = (query_seq_length, kv_seq_length)
            if mask.shape not in (expected, (self.num_heads, *expected)):
                raise ValueError(
                    f"mask must have shape (q_seq, kv_seq) = {expected} or (num_heads, q_seq, kv_seq), "
                    f"got {mask.shape}."
                )
        dropout_key = self._dropout_key(key, inference)
        if dropout_key is not None and self.dropout.p == 1:
            # Stock Equinox drops every weight at p = 1; the kernels take rates in [0, 1).
            attn = jnp.zeros((*query_heads.shape[:-1], value_heads.shape[-1]), query_heads.dtype)
        else:
            attn = attention_function(self.attention_impl, self.logits_soft_cap)(
                query_heads, key_heads, value_heads, mask=mask, score_mod=score_mod, mask_mod=mask_mod,
                dropout_rate=0.0 if dropout_key is None else float(self.dropout.p), dropout_key=dropout_key,
                sinks=self.sinks,
            )
        return jax.vmap(self.output_proj)(attn.reshape(query_seq_length, -1))

    def _project(self, projection: eqx.nn.Linear, x: Array) -> Array:
        return jax.vmap(projection)(x).reshape(x.shape[0], self.num_heads, -1)

    def _dropout_key(self, key: PRNGKeyArray | None, inference: bool | None) -> PRNGKeyArray | None:
        """`eqx.nn.Dropout`'s rules: the call's `inference` beats the module's; dropout needs a key."""
        if inference is None:
            inference = self.dropout.inference
        if inference or self.dropout.p == 0:
            return None
        if key is None:
            raise RuntimeError("Dropout requires a key when running in non-deterministic mode.")
        return key


class FlexAttention(MultiheadAttention):
    """Multi-head attention with FlexAttention hooks: the projections of `MultiheadAttention` (same
    leaves, then the hooks') around `probjax_nn.attention(..., score_mod, mask_mod)`.

    **Arguments:** those of `MultiheadAttention` (`attention_impl`, `key`, ...), plus (keyword only)

    - `score_mod`: `score_mod(score, b, h, q_idx, kv_idx) -> score`, applied to the scaled scores inside the
      kernel; may be an `eqx.Module` with array fields (`ALiBi`, `RelativePositionBias`), which train
      through the kernel.
    - `mask_mod`: `mask_mod(b, h, q_idx, kv_idx) -> bool`, True = attend (e.g. `probjax_kernels.causal_mask`).

    Hooks are called with int32 index arrays that broadcast against each other (`b` is 0: calls are
    unbatched). `attention_impl="auto"` runs the flex kernel on a GPU and XLA elsewhere.
    """

    score_mod: ScoreMod | None
    mask_mod: MaskMod | None

    def __init__(self, *args, score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.score_mod = score_mod
        self.mask_mod = mask_mod

    def __call__(
        self,
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"],
        value: Float[Array, "kv_seq v_size"],
        mask: Mask | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: ProcessHeads | None = None,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
    ) -> Float[Array, "q_seq o_size"]:
        """As `MultiheadAttention.__call__`, plus `score_mod` / `mask_mod` for this call (per-sequence data
        such as document ids), applied after the module's own. **Returns:** `[q_seq, output_size]`."""
        score_mod, mask_mod = combine_hooks((self.score_mod, score_mod), (self.mask_mod, mask_mod))
        return self._attend(query, key_, value, mask, key, inference, deterministic, process_heads, score_mod, mask_mod)


class ALiBi(eqx.Module):
    """Learnable ALiBi (Press et al. 2022) as a score_mod: `score - slopes[h] * |q_idx - kv_idx|`.

    **Arguments:**

    - `num_heads`: N; `slopes` `[N]` float32 starts at the paper's geometric slopes `2^(-8 i / N)`, i = 1..N.
    """

    slopes: Float[Array, " num_heads"]

    def __init__(self, num_heads: int):
        self.slopes = alibi_slopes(num_heads)

    def __call__(self, score: Array, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        return alibi(self.slopes)(score, b, h, q_idx, kv_idx)


class RelativePositionBias(eqx.Module):
    """A learned relative-position bias as a score_mod: `score + table[h, kv_idx - q_idx + max_len - 1]`.

    **Arguments:**

    - `num_heads`: N; `max_len`: offsets beyond `max_len - 1` either way read the end entries. `table`
      `[N, 2 * max_len - 1]` float32 starts at zeros (plain attention).
    """

    table: Float[Array, "num_heads offsets"]

    def __init__(self, num_heads: int, max_len: int):
        self.table = jnp.zeros((num_heads, 2 * max_len - 1), jnp.float32)

    def __call__(self, score: Array, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        return relative_bias(self.table)(score, b, h, q_idx, kv_idx)
