"""Decoding: a few new tokens per sequence against a KV cache, over a choice of implementations.

`decode_attention` is `probjax_kernels.decode_attention` (flash-decoding over a dense or paged cache) behind
`impl`, as `attention` is the flash kernel behind it: the Pallas kernel where the impl picks one, the
plain-jnp `decode_attention_reference` (XLA) elsewhere. `decode_runs_kernel` is the one rule the modules'
decode steps follow. `pages_from_dense` turns a module's dense cache into pages and block tables.
`ragged_paged_attention` (serving: many sequences' new tokens packed in one call) is the kernels' own,
re-exported: its `RaggedConfig` (`probjax_kernels`) already chooses the backend per device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jax.tree_util import Partial

import probjax_kernels
from probjax_kernels import and_masks
from probjax_kernels import ragged_paged_attention as ragged_paged_attention
from probjax_kernels.layer_api import MAX_HEAD_DIM, broadcast_lookup, target_platform
from probjax_nn._attention import AttentionConfig, Impl, as_config, check_impl

_KERNEL_DTYPES = ("bfloat16", "float16", "float32")


def decode_runs_kernel(impl: Impl | AttentionConfig, dtype, head_dim: int, *, hooks: bool = False) -> bool:
    """Whether a decode step under `impl` runs the Pallas `probjax_kernels.decode_attention`: impl "flex",
    "pallas" (without hooks: "pallas" takes none, as in `attention`), and "auto" on a GPU, each for the dtypes
    and head dims the kernel takes (otherwise `attention` raises the impl's `NotImplementedError`, or "auto"
    picks XLA). Off the GPU "auto" keeps XLA, as `attention` does. `head_dim`: the larger of D and Dv."""
    config = as_config(impl)
    if config.context_axis is not None:
        return False
    wanted = config.impl == "flex" or (config.impl == "pallas" and not hooks) or (
        config.impl == "auto" and target_platform() == "gpu")
    return wanted and jnp.dtype(dtype).name in _KERNEL_DTYPES and head_dim <= MAX_HEAD_DIM


def decode_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    kv_lengths: ArrayLike,
    block_tables: ArrayLike | None = None,
    scale: float | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    causal: bool = True,
    impl: Impl | AttentionConfig = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of T new tokens per sequence (T = 1..16) to a dense or paged KV cache that already holds them.

    The semantics of `probjax_kernels.decode_attention`: token t of sequence b sits at position
    `kv_lengths[b] - T + t` and attends the keys at or before it (with `causal=False`, every key below
    `kv_lengths[b]`); hooks see those global positions.

    **Arguments:**

    - `query`: `[B, T, N, D]`; `key`, `value`: a dense cache `[B, S, K, D]` / `[B, S, K, Dv]`, or, with
      `block_tables`, pages `[P, page_size, K, D]` / `[P, page_size, K, Dv]` (page_size a power of two >=
      16); one dtype; N a multiple of K.
    - `kv_lengths`: `[B]` int, keys of each sequence, the new tokens included (0 = an empty slot: output 0).
    - `block_tables`: `[B, max_pages]` int32; key position j of sequence b is in page
      `block_tables[b, j // page_size]`, slot `j % page_size` (see `pages_from_dense`).
    - `scale`: a Python float; None means `D ** -0.5`.
    - `score_mod(score, b, h, q_idx, kv_idx)`, `mask_mod(b, h, q_idx, kv_idx)` (True = attend): FlexAttention
      hooks, written with broadcasting jnp operations.
    - `num_splits`: programs per (sequence, key/value head) over the cache in the kernel; None picks one from
      B, K, the cache length and the device. XLA checks it and computes in one pass.
    - `return_lse`: also return the log-sum-exp of the scaled, masked scores.
    - `causal`: True (default) masks the later new tokens from the earlier ones, as a causal training mask
      does. False lets every new token see all `kv_lengths[b]` keys, the later new tokens included, so a
      `mask_mod` that is not causal among them (`prefix_lm` with new tokens inside the prefix, bidirectional
      blocks) decides alone and gives flex_attention's rows. With T = 1 both are the same. A bool (TypeError
      otherwise), for every impl.
    - `impl`: `"auto"` (the Pallas decode kernel on a GPU, XLA elsewhere), `"pallas"` (the kernel; no hooks),
      `"flex"` (the kernel with hooks), `"xla"` (`probjax_kernels.decode_attention_reference`: the pages
      gathered, the scores materialised); `"cudnn"` has no decode path and raises `NotImplementedError`, as
      does a context-parallel `AttentionConfig`. The kernels run in interpret mode off the GPU.

    **Returns:** `[B, T, N, Dv]` in the dtype of `query`; with `return_lse`, `(out, lse)`, lse `[B, N, T]`
    float32 (the kernel's layout; -inf for a row that attends nothing). Forward only under the kernel.
    """
    config = as_config(impl)
    if config.context_axis is not None:
        raise NotImplementedError(
            f"decode_attention does not run context parallel (context_axis={config.context_axis!r}); decode "
            "outside the mesh's sequence axis."
        )
    if config.impl == "cudnn":
        raise NotImplementedError("impl='cudnn' has no decode path; use impl='auto', 'pallas', 'flex' or 'xla'.")
    hooks = score_mod is not None or mask_mod is not None
    query = jnp.asarray(query)
    head_dim = max(query.shape[-1], jnp.shape(value)[-1])
    if config.impl in ("pallas", "flex"):
        # An explicit kernel impl refuses what it refuses in `attention` (hooks for "pallas", float64).
        check_impl(config.impl, query.dtype, head_dim, score_mod=score_mod is not None,
                   mask_mod=mask_mod is not None)
    run = (
        probjax_kernels.decode_attention
        if decode_runs_kernel(config, query.dtype, head_dim, hooks=hooks)
        else probjax_kernels.decode_attention_reference
    )
    return run(
        query, key, value, kv_lengths=kv_lengths, block_tables=block_tables, score_mod=score_mod,
        mask_mod=mask_mod, scale=scale, num_splits=num_splits, return_lse=return_lse, causal=causal,
    )


def pages_from_dense(
    cache: ArrayLike, page_size: int, *, max_length: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """A dense cache `[B, S, K, D]` (a module's `cached_key` / `cached_value`, a prefill's keys) as pages
    and block tables for `decode_attention`.

    Sequence b gets the `max_pages = cdiv(max_length, page_size)` pages `b * max_pages ... (b + 1) *
    max_pages - 1`, in order: its first S positions are the cache's, the rest zeros, room to decode up to
    `max_length` tokens in place. Converting keys and values with the same arguments gives the same
    block tables. Pages of a finished sequence can be handed to another by editing `block_tables`.

    **Arguments:**

    - `cache`: `[B, S, K, D]`, any dtype.
    - `page_size`: keys per page, a power of two >= 16 (the decode kernel's pages).
    - `max_length`: the most positions a sequence will hold, >= S; None means S.

    **Returns:** `(pages, block_tables)`: pages `[B * max_pages, page_size, K, D]` in the cache's dtype,
    block_tables `[B, max_pages]` int32.
    """
    cache = jnp.asarray(cache)
    if cache.ndim != 4:
        raise ValueError(f"cache must have rank 4 ([B, S, K, D]), got shape {cache.shape}.")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 16 or page_size & page_size - 1:
        raise ValueError(f"page_size must be a power of two >= 16 (the decode kernel's pages), got {page_size!r}.")
    batch, length, *rest = cache.shape
    if max_length is None:
        max_length = length
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < length:
        raise ValueError(f"max_length must be an int >= the cache length S={length}, got {max_length!r}.")
    max_pages = max(math.ceil(max_length / page_size), 1)
    padded = jnp.pad(cache, ((0, 0), (0, max_pages * page_size - length), (0, 0), (0, 0)))
    pages = padded.reshape(batch * max_pages, page_size, *rest)
    block_tables = jnp.arange(batch * max_pages, dtype=jnp.int32).reshape(batch, max_pages)
    return pages, block_tables


def _last_attended(mask: jax.Array, size: int, length: int) -> jax.Array:
    """`[size]` int32: one past the last of the `length` key positions that some head attends, for a bool
    mask `[size|1, N|1, 1, S|1]` of one query row (0 when it attends nothing). A key axis of size 1 (S > 1)
    broadcasts over every key: attending it attends the last."""
    attended = jnp.any(mask, axis=(1, 2))
    if attended.shape[-1] == length:
        positions = jnp.arange(1, length + 1, dtype=jnp.int32)
    else:
        positions = jnp.full((1,), length, jnp.int32)
    last = jnp.max(jnp.where(attended, positions, 0), axis=-1)
    return jnp.broadcast_to(last, (size,))


def _mask_lookup(mask: jax.Array, b, h, q_idx, kv_idx) -> jax.Array:
    """`mask[b, h, 0, kv_idx]` as a mask_mod, broadcast to the full index shape even where the mask has size-1
    axes (the decode kernel wants a hook's result on its whole tile)."""
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in (b, h, q_idx, kv_idx)))
    return jnp.broadcast_to(broadcast_lookup(mask, b, h, q_idx, kv_idx), shape)


def one_query_step(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    kv_lengths: jax.Array | None,
    mask: jax.Array | None,
    scale: float,
    score_mod: Callable | None,
    mask_mod: Callable | None,
) -> jax.Array:
    """One query row per sequence through `probjax_kernels.decode_attention`, exactly the attention of that row.

    `query` `[B, 1, N, D]`, `key` / `value` `[B, S, K, D|Dv]`, `kv_lengths` `[B]` or None, `mask` bool
    `[B|1, N|1, 1, S|1]` (or without its leading size-1 axes) or None (True = attend). The row sits at position `kv_lengths - 1` (the keys' length
    cut to the last attended key): hooks see that position, so this is a module's decode step, where the
    row is the cache's last written entry. A row that attends nothing gives 0.
    """
    size, length = query.shape[0], key.shape[1]
    lengths = jnp.full((size,), length, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # unbatched calls give [T, S] or [N, T, S]
        lengths = jnp.minimum(lengths, _last_attended(mask, size, length))
        lookup = Partial(_mask_lookup, mask)
        mask_mod = lookup if mask_mod is None else and_masks(mask_mod, lookup)
    return probjax_kernels.decode_attention(
        query, key, value, kv_lengths=lengths, score_mod=score_mod, mask_mod=mask_mod, scale=scale
    )
