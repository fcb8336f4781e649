"""The decoder-only transformer in Equinox: the network of model_nnx.py, attention by `probjax_nn.attention`.

Pre-norm blocks: `x + attention(rms_norm(x))`, then `x + down(gelu(up(rms_norm(x))))`; RoPE on queries and
keys; grouped-query attention when `num_kv_heads < num_heads`; the output layer tied to the embedding
unless `tie_embeddings` is off. As usual in Equinox the modules are unbatched (`[T, ...]`) and the model
is `vmap`ped over the batch.

Why not `probjax_nn.equinox.MultiheadAttention`: it keeps the stock Equinox call, whose `process_heads`
hook could apply RoPE while training, but which has no causal flag (causality would be a materialised
`[T, T]` mask, which the Pallas kernel reads tile by tile instead of skipping the upper triangle), no
key/value head count and no KV cache. `Attention` below therefore holds its own projections (named as in
the stock module) and calls `probjax_nn.attention` with `impl=config.attention`; decoding passes an
explicit cache.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from lm.common import LanguageModel, cache_attention, causal_attention, partition_specs, rope
from lm.config import Config
from lm.paged import KVPages, paged_attention

KVCache = tuple[jax.Array, jax.Array]  # key and value, `[max_len, num_kv_heads, head_dim]` each


class Attention(eqx.Module):
    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    config: Config = eqx.field(static=True)

    def __init__(self, config: Config, *, key: jax.Array):
        q_key, k_key, v_key, o_key = jax.random.split(key, 4)
        d_model, q_size, kv_size = config.d_model, config.num_heads * config.head_dim, config.kv_heads * config.head_dim
        self.query_proj = eqx.nn.Linear(d_model, q_size, use_bias=False, key=q_key)
        self.key_proj = eqx.nn.Linear(d_model, kv_size, use_bias=False, key=k_key)
        self.value_proj = eqx.nn.Linear(d_model, kv_size, use_bias=False, key=v_key)
        self.output_proj = eqx.nn.Linear(q_size, d_model, use_bias=False, key=o_key)
        self.config = config

    def _heads(self, x: jax.Array, positions: jax.Array):
        """x `[T, d_model]` -> rotated q `[T, N, D]`, rotated k and v `[T, K, D]`."""
        config = self.config

        def project(linear, heads):
            return jax.vmap(linear)(x).reshape(x.shape[0], heads, config.head_dim)

        query = rope(project(self.query_proj, config.num_heads), positions, config.rope_theta)
        key = rope(project(self.key_proj, config.kv_heads), positions, config.rope_theta)
        return query, key, project(self.value_proj, config.kv_heads)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.prefill(x, positions)[0]

    def prefill(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, KVCache]:
        """Causal attention over x `[T, d_model]`; also returns the rotated keys and values `[T, K, D]`."""
        query, key, value = self._heads(x, positions)
        out = causal_attention(query, key, value, self.config.attention)
        return jax.vmap(self.output_proj)(out.reshape(x.shape[0], -1)), (key, value)

    def paged_step(
        self, x: jax.Array, positions: jax.Array, pages: KVPages, block_tables: jax.Array
    ) -> tuple[jax.Array, KVPages]:
        """Batched (the pages are shared by the batch): x `[B, 1, d_model]`, one token per sequence at
        `positions` `[B]`, against the paged cache; returns `[B, 1, d_model]` and the pages."""
        query, key, value = jax.vmap(self._heads)(x, positions[:, None])
        out, pages = paged_attention(query, key, value, pages, block_tables, positions, self.config.attention)
        return jax.vmap(jax.vmap(self.output_proj))(out.reshape(*x.shape[:2], -1)), pages

    def decode(self, x: jax.Array, position: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """One token, x `[1, d_model]` at `position`, against the cache; returns `[1, d_model]` and the cache."""
        query, key, value = self._heads(x, position[None])
        cached_key = lax.dynamic_update_slice(cache[0], key, (position, 0, 0))
        cached_value = lax.dynamic_update_slice(cache[1], value, (position, 0, 0))
        out = cache_attention(query, cached_key, cached_value, position + 1, self.config.attention)
        return jax.vmap(self.output_proj)(out.reshape(1, -1)), (cached_key, cached_value)


class Block(eqx.Module):
    attention_norm: eqx.nn.RMSNorm
    attention: Attention
    mlp_norm: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, config: Config, *, key: jax.Array):
        attention_key, up_key, down_key = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.RMSNorm(config.d_model, eps=1e-6, use_bias=False)
        self.attention = Attention(config, key=attention_key)
        self.mlp_norm = eqx.nn.RMSNorm(config.d_model, eps=1e-6, use_bias=False)
        self.up = eqx.nn.Linear(config.d_model, config.hidden_dim, use_bias=False, key=up_key)
        self.down = eqx.nn.Linear(config.hidden_dim, config.d_model, use_bias=False, key=down_key)

    def mlp(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.mlp_norm)(x))))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.prefill(x, positions)[0]

    def prefill(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, KVCache]:
        attended, kv = self.attention.prefill(jax.vmap(self.attention_norm)(x), positions)
        x = x + attended
        return x + self.mlp(x), kv

    def paged_step(
        self, x: jax.Array, positions: jax.Array, pages: KVPages, block_tables: jax.Array
    ) -> tuple[jax.Array, KVPages]:
        """Batched: x `[B, 1, d_model]` at `positions` `[B]`."""
        normed = jax.vmap(jax.vmap(self.attention_norm))(x)
        attended, pages = self.attention.paged_step(normed, positions, pages, block_tables)
        x = x + attended
        return x + jax.vmap(self.mlp)(x), pages

    def decode(self, x: jax.Array, position: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        attended, cache = self.attention.decode(jax.vmap(self.attention_norm)(x), position, cache)
        x = x + attended
        return x + self.mlp(x), cache


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    final_norm: eqx.nn.RMSNorm
    unembed: eqx.nn.Linear | None

    def __init__(self, config: Config, *, key: jax.Array):
        embed_key, unembed_key, *block_keys = jax.random.split(key, config.num_layers + 2)
        self.embed = eqx.nn.Embedding(weight=0.02 * jax.random.normal(embed_key, (config.vocab_size, config.d_model)))
        self.blocks = [Block(config, key=k) for k in block_keys]
        self.final_norm = eqx.nn.RMSNorm(config.d_model, eps=1e-6, use_bias=False)
        self.unembed = (
            None if config.tie_embeddings
            else eqx.nn.Linear(config.d_model, config.vocab_size, use_bias=False, key=unembed_key)
        )

    def _logits(self, x: jax.Array) -> jax.Array:
        x = jax.vmap(self.final_norm)(x)
        logits = x @ self.embed.weight.T if self.unembed is None else jax.vmap(self.unembed)(x)
        return logits.astype(jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """tokens `[T]` int32 at `positions` `[T]` -> logits `[T, V]` float32."""
        return self.prefill(tokens, positions)[0]

    def prefill(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, list[KVCache]]:
        """tokens `[T]` -> logits `[T, V]` and each layer's rotated keys and values `[T, K, D]`."""
        x, kv = jax.vmap(self.embed)(tokens), []
        for block in self.blocks:
            x, layer_kv = block.prefill(x, positions)
            kv.append(layer_kv)
        return self._logits(x), kv

    def paged_step(
        self, tokens: jax.Array, positions: jax.Array, pages: list[KVPages], block_tables: jax.Array
    ) -> tuple[jax.Array, list[KVPages]]:
        """Batched: tokens `[B]` at `positions` `[B]` -> logits `[B, V]` and the updated pages of each layer."""
        x, new_pages = jax.vmap(self.embed)(tokens)[:, None], []
        for block, layer_pages in zip(self.blocks, pages):
            x, layer_pages = block.paged_step(x, positions, layer_pages, block_tables)
            new_pages.append(layer_pages)
        return jax.vmap(self._logits)(x)[:, 0], new_pages

    def decode(self, token: jax.Array, position: jax.Array, cache: list[KVCache]) -> tuple[jax.Array, list[KVCache]]:
        """One token (int32 scalar) at `position` -> logits `[V]` and the updated per-layer caches."""
        x = self.embed(token)[None]
        new_cache = []
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block.decode(x, position, layer_cache)
            new_cache.append(layer_cache)
        return self._logits(x)[0], new_cache


def build(config: Config, key: jax.Array) -> LanguageModel:
    params, static = eqx.partition(Transformer(config, key=key), eqx.is_inexact_array)

    def apply(params, tokens):
        model = eqx.combine(params, static)
        # Under a mesh the batch axis is split over "data"; vmap must know, for shard_heads' shard_map inside.
        data_axis = None if jax.sharding.get_abstract_mesh().empty else "data"
        return jax.vmap(model, in_axes=(0, None), spmd_axis_name=data_axis)(tokens, jnp.arange(tokens.shape[1]))

    def decoder(params, batch, max_len):
        dtype = jax.tree.leaves(params)[0].dtype
        shape = (batch, max_len, config.kv_heads, config.head_dim)
        cache = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers)]

        def step(params, cache, tokens, position):
            model = eqx.combine(params, static)
            return jax.vmap(model.decode, in_axes=(0, None, 0))(tokens, position, cache)

        return step, cache

    def prefill(params, tokens):
        model = eqx.combine(params, static)
        return jax.vmap(model.prefill, in_axes=(0, None))(tokens, jnp.arange(tokens.shape[1]))

    def paged_step(params, pages, block_tables, tokens, positions):
        return eqx.combine(params, static).paged_step(tokens, positions, pages, block_tables)

    return LanguageModel(
        params, apply, decoder, functools.partial(partition_specs, column_axis=0, row_axis=1), prefill, paged_step
    )
