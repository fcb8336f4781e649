"""Ready-made mask_mods and score_mods with PyTorch FlexAttention's semantics.

A mask_mod is `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = attend) and a score_mod is
`score_mod(score, b, h, q_idx, kv_idx) -> score`, applied to the scaled score. Unlike PyTorch, which calls
them on scalars, probjax calls them on int32 arrays that broadcast against each other (a (bq, 1) column of
query indices and a (1, bk) row of key indices inside a kernel tile; 4-D grids elsewhere), so write them
with elementwise jnp operations. The factories return `jax.tree_util.Partial`s, whose arrays are pytree
leaves: a BlockMask built from one passes through `jit` and changes with the data without a retrace.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable

import jax
import jax.numpy as jnp
from jax.tree_util import Partial

from probjax_kernels._inputs import _is_int

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _per_batch(value, b):
    """A scalar, or the entry of a `[B]` array for batch index b."""
    value = jnp.asarray(value)
    return value[b] if value.ndim else value


def causal_mask(b, h, q_idx, kv_idx):
    """Query i attends keys j <= i (top-left alignment)."""
    del b, h
    return q_idx >= kv_idx


def _sliding_window(window, b, h, q_idx, kv_idx):
    del b, h
    return jnp.abs(q_idx - kv_idx) <= window


def sliding_window(window: int) -> MaskMod:
    """`|q_idx - kv_idx| <= window`, window >= 0: the convention of `flash_attention(window=w)`, jax.nn's
    `local_window_size` and attention-gym. `and_masks(causal_mask, sliding_window(w))` keeps the current key
    and the w before it. It used to keep `|q_idx - kv_idx| < window`: that is now `sliding_window(window - 1)`."""
    if not _is_int(window) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}.")
    return Partial(_sliding_window, int(window))


def _prefix_lm(prefix_len, b, h, q_idx, kv_idx):
    del h
    return (kv_idx < _per_batch(prefix_len, b)) | (q_idx >= kv_idx)


def prefix_lm(prefix_len) -> MaskMod:
    """Bidirectional over the first `prefix_len` keys, causal after (an int, or a `[B]` int array)."""
    return Partial(_prefix_lm, prefix_len)


def _document_mask(segment_ids, b, h, q_idx, kv_idx):
    del h
    return segment_ids[b, q_idx] == segment_ids[b, kv_idx]


def document_mask(segment_ids: jax.Array) -> MaskMod:
    """Packed documents: attend only within one id, `segment_ids[b, q_idx] == segment_ids[b, kv_idx]`.

    `segment_ids` is `[B, T]` int (queries and keys share the sequence, T = S).
    """
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.ndim != 2 or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be a [B, T] int array, got {segment_ids.dtype}{list(segment_ids.shape)}.")
    return Partial(_document_mask, segment_ids)


def _padding_mask(kv_lengths, b, h, q_idx, kv_idx):
    del h, q_idx
    return kv_idx < _per_batch(kv_lengths, b)


def padding_mask(kv_lengths: jax.Array) -> MaskMod:
    """Keys at or past `kv_lengths[b]` are padding (`[B]` int array)."""
    kv_lengths = jnp.asarray(kv_lengths)
    if kv_lengths.ndim != 1 or not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
        raise ValueError(f"kv_lengths must be a [B] int array, got {kv_lengths.dtype}{list(kv_lengths.shape)}.")
    return Partial(_padding_mask, kv_lengths)


def _and_masks(*args):
    *mods, b, h, q_idx, kv_idx = args
    return functools.reduce(operator.and_, (mod(b, h, q_idx, kv_idx) for mod in mods))


def _or_masks(*args):
    *mods, b, h, q_idx, kv_idx = args
    return functools.reduce(operator.or_, (mod(b, h, q_idx, kv_idx) for mod in mods))


def and_masks(*mods: MaskMod) -> MaskMod:
    """Attend where every mod attends; with no mod, everywhere (`noop_mask`), as in PyTorch."""
    if not mods:
        return noop_mask
    return Partial(_and_masks, *mods)


def or_masks(*mods: MaskMod) -> MaskMod:
    """Attend where any mod attends; with no mod, nowhere (`_attend_nowhere`), as in PyTorch."""
    if not mods:
        return _attend_nowhere
    return Partial(_or_masks, *mods)


def mask_lookback(mask_mod) -> int | None:
    """The most keys before a query that `mask_mod` can attend (`q_idx - kv_idx <= lookback` wherever it
    attends), when it is known without evaluating the mask: `sliding_window(w)` gives w, `and_masks` the
    least of its parts' known ones, `or_masks` the most when every part has one. None: not known (any other
    mask_mod, or a window traced under jit). Lets decode_attention skip the keys before a window."""
    if not isinstance(mask_mod, Partial):
        return None
    if mask_mod.func is _sliding_window:
        (window,) = mask_mod.args
        return window if _is_int(window) else None
    parts = [mask_lookback(mod) for mod in mask_mod.args]
    if mask_mod.func is _and_masks and any(p is not None for p in parts):
        return min(p for p in parts if p is not None)
    if mask_mod.func is _or_masks and parts and all(p is not None for p in parts):
        return max(parts)
    return None


def noop_mask(b, h, q_idx, kv_idx):
    """The mask_mod that attends everywhere (PyTorch's `noop_mask`)."""
    del b, h
    return (q_idx >= 0) | (kv_idx >= 0)  # True, broadcast to the tile


def _alibi(slopes, score, b, h, q_idx, kv_idx):
    del b
    return score - slopes[h] * jnp.abs(q_idx - kv_idx).astype(score.dtype)


def alibi(slopes: jax.Array) -> ScoreMod:
    """ALiBi: `score - slopes[h] * |q_idx - kv_idx|`, slopes `[N]` float (differentiable)."""
    slopes = jnp.asarray(slopes)
    if slopes.ndim != 1 or not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise ValueError(f"slopes must be a [N] float array, got {slopes.dtype}{list(slopes.shape)}.")
    return Partial(_alibi, slopes)


def alibi_slopes(num_heads: int) -> jax.Array:
    """The geometric slopes of the ALiBi paper, 2^(-8 i / N) for i = 1..N."""
    return 2.0 ** (-8.0 * jnp.arange(1, num_heads + 1, dtype=jnp.float32) / num_heads)


def _softcap(cap, score, b, h, q_idx, kv_idx):
    del b, h, q_idx, kv_idx
    return cap * jnp.tanh(score / cap)


def softcap(cap: float) -> ScoreMod:
    """Soft-capping (Gemma 2): `cap * tanh(score / cap)`."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}.")
    return Partial(_softcap, float(cap))


def _relative_bias(table, score, b, h, q_idx, kv_idx):
    del b
    max_len = (table.shape[1] + 1) // 2
    # Clip, because jnp indexing would wrap a negative offset around to the other end of the table.
    offset = jnp.clip(kv_idx - q_idx + max_len - 1, 0, table.shape[1] - 1)
    return score + table[h, offset].astype(score.dtype)


def relative_bias(table: jax.Array) -> ScoreMod:
    """A learned relative-position bias: `score + table[h, kv_idx - q_idx + max_len - 1]`.

    `table` is `[N, 2 * max_len - 1]` float (differentiable); offsets beyond max_len read the end entries.
    """
    table = jnp.asarray(table)
    if table.ndim != 2 or table.shape[1] % 2 != 1 or not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"table must be a [N, 2 * max_len - 1] float array, got {table.dtype}{list(table.shape)}.")
    return Partial(_relative_bias, table)


def _attend_nowhere(b, h, q_idx, kv_idx):
    """`or_masks()`'s mask_mod: False, broadcast to the tile."""
    del b, h
    return (q_idx < 0) & (kv_idx < 0)
