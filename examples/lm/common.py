"""What the three model files share: the interface train.py sees, RoPE, attention per shard, and the
tensor-parallel layout of the parameters."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import probjax_nn

Params = Any  # a pytree of float32 arrays
Cache = Any  # a pytree of decode-cache arrays
# (params, cache, tokens [B] int32, position int32 scalar) -> (logits [B, V] float32, cache)
DecodeStep = Callable[[Params, Cache, jax.Array, jax.Array], tuple[jax.Array, Cache]]
# (params, tokens [B, T] int32) -> (logits [B, T, V] float32, each layer's rotated keys and values [B, T, K, D])
Prefill = Callable[[Params, jax.Array], tuple[jax.Array, Any]]
# (params, pages, block_tables [B, max_pages], tokens [B], positions [B]) -> (logits [B, V], pages): `pages` is
# the prefill's key / value pytree with each leaf as pages [P, page_size, K, D] (probjax_nn.pages_from_dense)
PagedStep = Callable[[Params, Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class LanguageModel:
    """One framework's network as train.py and sample.py use it: pure functions over a params pytree."""

    params: Params  # float32; what the optimiser updates and the checkpoints hold
    apply: Callable[[Params, jax.Array], jax.Array]  # (params, tokens [B, T] int32) -> logits [B, T, V] float32
    decoder: Callable[[Params, int, int], tuple[DecodeStep, Cache]]  # (params, batch, max_len) -> (step, empty cache)
    partition: Callable[[Params], Any]  # a PartitionSpec per parameter, for --mesh
    prefill: Prefill  # batched generation: whole prompts at once ...
    paged_step: PagedStep  # ... then one token per sequence against a paged cache


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), rotate-half form, computed in float32.

    **Arguments:** `x` `[..., T, heads, head_dim]`; `positions` `[T]` int, shared by the leading axes.
    **Returns:** `x` rotated by `positions * theta ** (-2i / head_dim)` in the pairs (i, i + head_dim / 2).
    """
    half = x.shape[-1] // 2
    inverse_frequency = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None, None] * inverse_frequency[None, None, :]  # [T, 1, half]
    angles = angles.reshape((1,) * (x.ndim - 3) + angles.shape)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def context_parallel(impl: str) -> str | probjax_nn.AttentionConfig:
    """`impl`, made context parallel over the "seq" mesh axis when the current mesh splits it (`--mesh
    ...,seq=N`): the sequence is then split over N devices and attention runs as a ring (probjax_nn's
    `AttentionConfig.context_axis`). Decoding runs outside the mesh and gets `impl` as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("seq", 1) == 1:
        return impl
    return probjax_nn.AttentionConfig(impl=impl, context_axis="seq")


def shard_heads(attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]):
    """`attend(query, key, value)`, run on each device's shard when a mesh is set (`jax.set_mesh`).

    GSPMD cannot split a Pallas kernel, so without this it would gather q, k and v onto every device.
    Attention is independent per sequence and per head, so `shard_map` hands each device its slice of the
    batch ("data" axis) and of the heads ("model" axis); the sequence is split over "seq", where `attend`
    runs context parallel (`context_parallel`). Unbatched `[T, N, D]` calls (Equinox, under
    `vmap(spmd_axis_name="data")`) split the sequence and the heads only. With GQA the kv heads split the
    same way, so each device keeps whole groups (num_kv_heads must be a multiple of the "model" size).
    """

    def run(query, key, value):
        if jax.sharding.get_abstract_mesh().empty:
            return attend(query, key, value)
        spec = P(*(("data",) if query.ndim == 4 else ()), "seq", "model", None)
        # check_vma=False: jax's check asks pallas_call outputs for a varying-axes type they do not carry.
        return jax.shard_map(attend, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(query, key, value)

    return run


def causal_attention(query: jax.Array, key: jax.Array, value: jax.Array, impl: str) -> jax.Array:
    """Causal self-attention over a whole sequence: q `[..., T, N, D]`, k and v `[..., T, K, D]`."""
    attend = functools.partial(probjax_nn.attention, is_causal=True, impl=context_parallel(impl))
    return shard_heads(attend)(query, key, value)


def cache_attention(query: jax.Array, key: jax.Array, value: jax.Array, length: jax.Array, impl: str) -> jax.Array:
    """One decode step: q `[..., 1, N, D]` against a cache k, v `[..., L, K, D]` whose first `length`
    entries are filled (the query's own key included). Decoding runs unsharded."""
    lengths = jnp.full(query.shape[:-3] or (1,), length, jnp.int32)
    return probjax_nn.attention(query, key, value, key_value_seq_lengths=lengths, impl=impl)


# Layer names in the three model files (flax's query/key/value/out, Equinox's query_proj/...).
_COLUMN_PARALLEL = {"query", "key", "value", "query_proj", "key_proj", "value_proj", "up"}  # outputs split
_ROW_PARALLEL = {"out", "output_proj", "down"}  # inputs split; XLA adds the all-reduce after them


def partition_specs(params: Params, column_axis: int, row_axis: int) -> Any:
    """Megatron-style tensor parallelism on the "model" mesh axis, by layer name: the q/k/v and MLP-up
    matrices split their output axis (`column_axis`), the attention-out and MLP-down matrices their input
    axis (`row_axis`), so heads and hidden units stay on one device from projection to reduction.
    Embeddings and norms are replicated."""

    def spec(path, leaf):
        # NNX's Variables add a trailing `.value`, which is not a layer name.
        if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
            path = path[:-1]
        names = {getattr(entry, "key", getattr(entry, "name", None)) for entry in path}
        axis = column_axis if names & _COLUMN_PARALLEL else row_axis if names & _ROW_PARALLEL else None
        if axis is None:
            return P()
        return P(*("model" if i == axis else None for i in range(leaf.ndim)))

    return jax.tree_util.tree_map_with_path(spec, params)
