"""The LM example's layers on packed tokens: the tokens of many sequences in one row `[T]`, each at its own
position, so that one call per layer serves a batch of sequences of any lengths (examples/lm/serving.py).

`packed_layers(config)` gives, for the model file of `config.framework`, a function of the params that returns
a `PackedLayers`: the model's own embedding, per-layer projections (RoPE at each token's position), output
projection and MLP, and final norm and unembedding, reached through its modules (NNX, Equinox) or its
parameter tree (Linen, whose compact modules have no handle outside their call). Attention itself is left to
the caller, which is what changes between serving (paged, ragged) and a dense reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from lm.common import Params, rope
from lm.config import Config

# (layer, query [T, N, D], key [T, K, D], value [T, K, D], carry) -> (attended [T, N, D], carry)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


class PackedLayers(Protocol):
    """One model's layers, its params bound, on packed tokens `[T]` (no batch axis)."""

    num_layers: int

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens `[T]` int32 -> the residual stream `[T, d_model]` in the compute dtype."""

    def attention_inputs(self, layer: int, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        """The stream `[T, d_model]` entering block `layer` -> q `[T, N, D]`, k and v `[T, K, D]` of its
        normed input, q and k rotated to `positions` `[T]` int32 (one position per token)."""

    def attention_output(self, layer: int, x: jax.Array, attended: jax.Array) -> jax.Array:
        """Block `layer`'s rest: `x + out(attended)`, `attended` `[T, N, D]`, then the MLP; `[T, d_model]`."""

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and unembedding of `x` `[R, d_model]` -> `[R, V]` float32."""


def packed_layers(config: Config) -> Callable[[Params], PackedLayers]:
    """`params -> PackedLayers` for `config.framework`'s model (its params as `LanguageModel.params`, after
    `train.compute_params`). Builds nothing but abstract shapes; the result traces under `jit`."""
    builders = {"nnx": _nnx_layers, "linen": _linen_layers, "equinox": _equinox_layers}
    return builders[config.framework](config)


def run_layers(layers: PackedLayers, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any):
    """Every block on packed `tokens` `[T]` at `positions` `[T]`, attention by `attend` (which threads
    `carry`, a paged cache for instance). Returns the final stream `[T, d_model]` (before the final norm) and
    the carry."""
    x = layers.embed(tokens)
    for layer in range(layers.num_layers):
        query, key, value = layers.attention_inputs(layer, x, positions)
        attended, carry = attend(layer, query, key, value, carry)
        x = layers.attention_output(layer, x, attended)
    return x, carry


def _nnx_layers(config: Config) -> Callable[[Params], PackedLayers]:
    from flax import nnx

    from lm.model_nnx import Transformer

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0))))

    class Layers:
        num_layers = config.num_layers

        def __init__(self, params: Params):
            self.model = nnx.merge(graphdef, params)

        def embed(self, tokens):
            return self.model.embed(tokens)

        def attention_inputs(self, layer, x, positions):
            # Block._heads is batched: a batch of one packed row.
            heads = self.model.blocks[layer]._heads(x[None], positions[None], config.rope_theta)
            return tuple(y[0] for y in heads)

        def attention_output(self, layer, x, attended):
            block = self.model.blocks[layer]
            return block._mlp(x + block.attention.out(attended))

        def logits(self, x):
            return self.model._logits(x)

    return Layers


def _equinox_layers(config: Config) -> Callable[[Params], PackedLayers]:
    import equinox as eqx

    from lm.model_equinox import Transformer

    # The parameter leaves are ShapeDtypeStructs here; `combine(params, static)` takes the params' arrays.
    static = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))

    class Layers:
        num_layers = config.num_layers

        def __init__(self, params: Params):
            self.model = eqx.combine(params, static)

        def embed(self, tokens):
            return jax.vmap(self.model.embed)(tokens)

        def attention_inputs(self, layer, x, positions):
            block = self.model.blocks[layer]
            return block.attention._heads(jax.vmap(block.attention_norm)(x), positions)

        def attention_output(self, layer, x, attended):
            block = self.model.blocks[layer]
            x = x + jax.vmap(block.attention.output_proj)(attended.reshape(x.shape[0], -1))
            return x + block.mlp(x)

        def logits(self, x):
            return self.model._logits(x)

    return Layers


def _linen_layers(config: Config) -> Callable[[Params], PackedLayers]:
    import flax.linen as nn

    # model_linen.py's modules, applied to their own subtrees of the params: the same layers, names and dtypes.
    embed = nn.Embed(config.vocab_size, config.d_model)
    norm = nn.RMSNorm(epsilon=1e-6)
    dense = functools.partial(nn.DenseGeneral, use_bias=False)
    query = dense((config.num_heads, config.head_dim))
    key_value = dense((config.kv_heads, config.head_dim))
    out = nn.DenseGeneral(config.d_model, axis=(-2, -1), use_bias=False)
    up, down = nn.Dense(config.hidden_dim, use_bias=False), nn.Dense(config.d_model, use_bias=False)
    unembed = nn.Dense(config.vocab_size, use_bias=False)

    def apply(module, params, *args, **kwargs):
        return module.apply({"params": params}, *args, **kwargs)

    class Layers:
        num_layers = config.num_layers

        def __init__(self, params: Params):
            self.params = params

        def embed(self, tokens):
            return apply(embed, self.params["embed"], tokens)

        def attention_inputs(self, layer, x, positions):
            block = self.params[f"blocks_{layer}"]
            attention, x = block["attention"], apply(norm, block["attention_norm"], x)
            q = rope(apply(query, attention["query"], x), positions, config.rope_theta)
            k = rope(apply(key_value, attention["key"], x), positions, config.rope_theta)
            return q, k, apply(key_value, attention["value"], x)

        def attention_output(self, layer, x, attended):
            block = self.params[f"blocks_{layer}"]
            x = x + apply(out, block["attention"]["out"], attended)
            hidden = apply(up, block["up"], apply(norm, block["mlp_norm"], x))
            return x + apply(down, block["down"], jax.nn.gelu(hidden))

        def logits(self, x):
            x = apply(norm, self.params["final_norm"], x)
            if config.tie_embeddings:
                logits = apply(embed, self.params["embed"], x, method="attend")
            else:
                logits = apply(unembed, self.params["unembed"], x)
            return logits.astype(jnp.float32)

    return Layers
