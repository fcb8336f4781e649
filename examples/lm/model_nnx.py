"""The decoder-only transformer in Flax NNX, with attention by `probjax_nn.nnx.MultiHeadAttention`.

Pre-norm blocks: `x + attention(rms_norm(x))`, then `x + down(gelu(up(rms_norm(x))))`; RoPE on queries and
keys; grouped-query attention when `num_kv_heads < num_heads`; the output layer tied to the embedding
unless `tie_embeddings` is off. model_linen.py and model_equinox.py build the same network.

How RoPE reaches the drop-in module: `MultiHeadAttention` projects q, k and v inside, so rotary embeddings
enter where flax itself puts them (`flax.nnx.dot_product_attention_with_rope`): in the module's
`attention_fn`, which receives the projected heads and the call's `input_positions`. `RotaryAttention`
rotates q and k there and hands them to `probjax_nn.nnx.attention_fn(config.attention)`. Everything else
is the stock module: the `num_kv_heads` projections, `is_causal`, and its KV cache for decoding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import probjax_nn.nnx
from lm.common import LanguageModel, causal_attention, context_parallel, partition_specs, rope, shard_heads
from lm.config import Config
from lm.paged import KVPages, paged_attention, rope_rows


@dataclasses.dataclass(frozen=True)
class RotaryAttention:
    """An `attention_fn`: RoPE on q and k, then `attention` (per shard under a mesh).

    Queries sit at `input_positions` (default 0..T-1) and keys at 0..S-1. In training S = T; in decoding
    the keys are the module's whole cache, which holds them unrotated, so one rule covers both.
    """

    impl: str  # config.attention; probjax_nn.nnx.attention_fn of it computes attention
    theta: float

    def __call__(self, query, key, value, *, input_positions=None, **kwargs) -> jax.Array:
        if input_positions is None:
            input_positions = jnp.arange(query.shape[-3])
        query = rope(query, input_positions, self.theta)
        key = rope(key, jnp.arange(key.shape[-3]), self.theta)
        attention = probjax_nn.nnx.attention_fn(context_parallel(self.impl))
        return shard_heads(functools.partial(attention, **kwargs))(query, key, value)


class Block(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        d_model = config.d_model
        self.attention_norm = nnx.RMSNorm(d_model, epsilon=1e-6, rngs=rngs)
        self.attention = probjax_nn.nnx.MultiHeadAttention(
            config.num_heads, d_model, num_kv_heads=config.kv_heads, use_bias=False, decode=False,
            attention_fn=RotaryAttention(config.attention, config.rope_theta),
            rngs=rngs,
        )
        self.mlp_norm = nnx.RMSNorm(d_model, epsilon=1e-6, rngs=rngs)
        self.up = nnx.Linear(d_model, config.hidden_dim, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(config.hidden_dim, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, decode: bool) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), is_causal=True, decode=decode, input_positions=positions)
        return self._mlp(x)

    def _mlp(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))

    def _heads(self, x: jax.Array, positions: jax.Array, theta: float):
        """The attention module's q, k, v of `attention_norm(x)` `[B, T, d_model]`, q and k rotated to
        `positions` `[B, T]`: what `RotaryAttention` gives the attention function, outside the module's call."""
        attention, x = self.attention, self.attention_norm(x)
        query, key, value = attention.query(x), attention.key(x), attention.value(x)
        return rope_rows(query, positions, theta), rope_rows(key, positions, theta), value

    def prefill(self, x: jax.Array, config: Config) -> tuple[jax.Array, KVPages]:
        """The block over whole prompts `[B, T, d_model]` (flash attention, causal); also returns the rotated
        keys and values `[B, T, K, D]`."""
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        query, key, value = self._heads(x, positions, config.rope_theta)
        x = x + self.attention.out(causal_attention(query, key, value, config.attention))
        return self._mlp(x), (key, value)

    def paged_step(
        self, x: jax.Array, positions: jax.Array, pages: KVPages, block_tables: jax.Array, config: Config
    ) -> tuple[jax.Array, KVPages]:
        """One new token per sequence, x `[B, 1, d_model]` at `positions` `[B]`, against the paged cache."""
        query, key, value = self._heads(x, positions[:, None], config.rope_theta)
        out, pages = paged_attention(query, key, value, pages, block_tables, positions, config.attention)
        return self._mlp(x + self.attention.out(out)), pages


class Transformer(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        # The compute dtype, said explicitly: nnx.Embed fixes its output dtype when built (default: its
        # param_dtype, float32), so the bfloat16 params of a step would be cast back to float32 and every layer
        # after it, attention included, would compute in float32. The params stay float32 (param_dtype).
        self.embed = nnx.Embed(
            config.vocab_size, config.d_model, embedding_init=nnx.initializers.normal(0.02),
            dtype=jnp.dtype(config.dtype), param_dtype=jnp.float32, rngs=rngs,
        )
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.d_model, epsilon=1e-6, rngs=rngs)
        self.unembed = (
            None if config.tie_embeddings else nnx.Linear(config.d_model, config.vocab_size, use_bias=False, rngs=rngs)
        )

    def __call__(self, tokens: jax.Array, positions: jax.Array, decode: bool = False) -> jax.Array:
        """tokens `[B, T]` int32 at `positions` `[T]` -> logits `[B, T, V]` float32."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, decode)
        return self._logits(x)

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.unembed is None else self.unembed(x)
        return logits.astype(jnp.float32)

    def prefill(self, tokens: jax.Array, config: Config) -> tuple[jax.Array, list[KVPages]]:
        """tokens `[B, T]` -> logits `[B, T, V]` and each layer's rotated keys and values `[B, T, K, D]`."""
        x, kv = self.embed(tokens), []
        for block in self.blocks:
            x, layer_kv = block.prefill(x, config)
            kv.append(layer_kv)
        return self._logits(x), kv

    def paged_step(
        self, tokens: jax.Array, positions: jax.Array, pages: list[KVPages], block_tables: jax.Array, config: Config
    ) -> tuple[jax.Array, list[KVPages]]:
        """tokens `[B]` at `positions` `[B]` -> logits `[B, V]` and the updated pages of each layer."""
        x, new_pages = self.embed(tokens[:, None]), []
        for block, layer_pages in zip(self.blocks, pages):
            x, layer_pages = block.paged_step(x, positions, layer_pages, block_tables, config)
            new_pages.append(layer_pages)
        return self._logits(x)[:, 0], new_pages


def build(config: Config, key: jax.Array) -> LanguageModel:
    graphdef, params = nnx.split(Transformer(config, nnx.Rngs(key)), nnx.Param)

    def apply(params, tokens):
        return nnx.merge(graphdef, params)(tokens, jnp.arange(tokens.shape[1]))

    def decoder(params, batch, max_len):
        model = nnx.merge(graphdef, params)
        dtype = jax.tree.leaves(params)[0].dtype
        for block in model.blocks:
            block.attention.init_cache((batch, max_len, config.d_model), dtype)
        decode_graphdef, _, cache = nnx.split(model, nnx.Param, nnx.Cache)

        def step(params, cache, tokens, position):
            model = nnx.merge(decode_graphdef, params, cache)
            logits = model(tokens[:, None], position[None], decode=True)
            return logits[:, 0], nnx.state(model, nnx.Cache)

        return step, cache

    def prefill(params, tokens):
        return nnx.merge(graphdef, params).prefill(tokens, config)

    def paged_step(params, pages, block_tables, tokens, positions):
        return nnx.merge(graphdef, params).paged_step(tokens, positions, pages, block_tables, config)

    return LanguageModel(
        params, apply, decoder, functools.partial(partition_specs, column_axis=1, row_axis=0), prefill, paged_step
    )
