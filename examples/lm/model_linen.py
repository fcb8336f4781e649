"""The decoder-only transformer in Flax Linen: the network of model_nnx.py, attention by `probjax_nn.attention`.

Pre-norm blocks: `x + attention(rms_norm(x))`, then `x + down(gelu(up(rms_norm(x))))`; RoPE on queries and
keys; grouped-query attention when `num_kv_heads < num_heads`; the output layer tied to the embedding
unless `tie_embeddings` is off.

Why not `probjax_nn.linen.MultiHeadDotProductAttention`: it keeps the stock Linen module's call, which has
no `is_causal` (causality would be a materialised `[T, T]` mask, which the Pallas kernel reads tile by tile
instead of skipping the upper triangle), no `num_kv_heads`, and no positions for its `attention_fn`, so RoPE
could not place the query while decoding. `Attention` below therefore makes its own q/k/v/out projections
(`DenseGeneral`, the stock module's layout and names) and calls `probjax_nn.attention` with
`impl=config.attention`; its decode cache follows the stock module's `cache` collection.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from lm.common import LanguageModel, cache_attention, causal_attention, partition_specs, rope
from lm.config import Config
from lm.paged import paged_attention, rope_rows


class Attention(nn.Module):
    config: Config

    @nn.compact
    def __call__(
        self, x: jax.Array, positions: jax.Array, decode: bool, block_tables: jax.Array | None = None
    ) -> jax.Array:
        """x `[B, T, d_model]` at `positions` `[T]`; with `block_tables`, one token per sequence at `positions`
        `[B]` against the paged cache in the "kv" collection. A prefill (the "kv" collection mutable, no
        `block_tables`) stores the rotated keys and values there."""
        config = self.config
        dense = functools.partial(nn.DenseGeneral, use_bias=False)
        query = dense((config.num_heads, config.head_dim), name="query")(x)
        key = dense((config.kv_heads, config.head_dim), name="key")(x)
        value = dense((config.kv_heads, config.head_dim), name="value")(x)
        if block_tables is not None:
            query, key = (rope_rows(y, positions[:, None], config.rope_theta) for y in (query, key))
            pages = (self.get_variable("kv", "key"), self.get_variable("kv", "value"))
            out, (key_pages, value_pages) = paged_attention(
                query, key, value, pages, block_tables, positions, config.attention
            )
            self.put_variable("kv", "key", key_pages)
            self.put_variable("kv", "value", value_pages)
            return nn.DenseGeneral(config.d_model, axis=(-2, -1), use_bias=False, name="out")(out)
        query, key = rope(query, positions, config.rope_theta), rope(key, positions, config.rope_theta)
        if decode and not self.is_initializing():
            out = self._decode(query, key, value, positions[0])
        else:
            if decode:  # model.init with a full-length input sizes the cache
                self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
                self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
            elif self.is_mutable_collection("kv") and not self.is_initializing():
                self.put_variable("kv", "key", key)
                self.put_variable("kv", "value", value)
            out = causal_attention(query, key, value, config.attention)
        return nn.DenseGeneral(config.d_model, axis=(-2, -1), use_bias=False, name="out")(out)

    def _decode(self, query, key, value, position) -> jax.Array:
        """Writes this step's (rotated) key and value at `position` and attends to the cache up to it."""
        cached_key = self.variable("cache", "cached_key")
        cached_value = self.variable("cache", "cached_value")
        index = (0, position, 0, 0)
        cached_key.value = lax.dynamic_update_slice(cached_key.value, key, index)
        cached_value.value = lax.dynamic_update_slice(cached_value.value, value, index)
        return cache_attention(query, cached_key.value, cached_value.value, position + 1, self.config.attention)


class Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(
        self, x: jax.Array, positions: jax.Array, decode: bool, block_tables: jax.Array | None = None
    ) -> jax.Array:
        x = x + Attention(self.config, name="attention")(
            nn.RMSNorm(epsilon=1e-6, name="attention_norm")(x), positions, decode, block_tables
        )
        h = nn.Dense(self.config.hidden_dim, use_bias=False, name="up")(nn.RMSNorm(epsilon=1e-6, name="mlp_norm")(x))
        return x + nn.Dense(self.config.d_model, use_bias=False, name="down")(jax.nn.gelu(h))


class Transformer(nn.Module):
    config: Config

    @nn.compact
    def __call__(
        self, tokens: jax.Array, positions: jax.Array, decode: bool = False, block_tables: jax.Array | None = None
    ) -> jax.Array:
        """tokens `[B, T]` int32 at `positions` `[T]` -> logits `[B, T, V]` float32 (with `block_tables`: T = 1,
        positions `[B]`, the cache paged; see `Attention`)."""
        config = self.config
        embed = nn.Embed(config.vocab_size, config.d_model, embedding_init=nn.initializers.normal(0.02), name="embed")
        x = embed(tokens)
        for i in range(config.num_layers):
            x = Block(config, name=f"blocks_{i}")(x, positions, decode, block_tables)
        x = nn.RMSNorm(epsilon=1e-6, name="final_norm")(x)
        if config.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(config.vocab_size, use_bias=False, name="unembed")(x)
        return logits.astype(jnp.float32)


def build(config: Config, key: jax.Array) -> LanguageModel:
    model = Transformer(config)
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    params = jax.jit(model.init)(key, tokens, jnp.arange(config.seq_len))["params"]

    def apply(params, tokens):
        return model.apply({"params": params}, tokens, jnp.arange(tokens.shape[1]))

    def decoder(params, batch, max_len):
        shapes = jax.eval_shape(
            functools.partial(model.init, decode=True), jax.random.key(0), jnp.zeros((batch, max_len), jnp.int32),
            jnp.arange(max_len),
        )
        dtype = jax.tree.leaves(params)[0].dtype
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, dtype), shapes["cache"])

        def step(params, cache, tokens, position):
            logits, variables = model.apply(
                {"params": params, "cache": cache}, tokens[:, None], position[None], decode=True, mutable=["cache"]
            )
            return logits[:, 0], variables["cache"]

        return step, cache

    def prefill(params, tokens):
        logits, variables = model.apply(
            {"params": params}, tokens, jnp.arange(tokens.shape[1]), mutable=["kv"]
        )
        return logits, variables["kv"]

    def paged_step(params, pages, block_tables, tokens, positions):
        logits, variables = model.apply(
            {"params": params, "kv": pages}, tokens[:, None], positions, block_tables=block_tables, mutable=["kv"]
        )
        return logits[:, 0], variables["kv"]

    return LanguageModel(
        params, apply, decoder, functools.partial(partition_specs, column_axis=1, row_axis=0), prefill, paged_step
    )
