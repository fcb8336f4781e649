"""Input checks of `decode_attention` and its reference, and the decode kernel's config.

The cache is dense `[B, S, K, D]` or paged `[P, page_size, K, D]` with `block_tables` `[B, max_pages]`; the
T new tokens of sequence b sit at positions `kv_lengths[b] - T + t`. Every check names the caller's
argument, what it got and what it needs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from probjax_kernels._inputs import (
    KERNEL_DTYPES, MAX_HEAD_DIM, _is_int, _is_real, check_dtypes, check_flag, check_sinks,
)

MAX_NEW_TOKENS = 16  # q rows per sequence: T new tokens times the GQA group share one tile
_MIN_PAGE = 16  # Triton's dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch choices of the decode kernel; `None` fields get per-device defaults.

    - `block_k`: keys per step over a dense cache (a power of two >= 16; a paged cache steps one page).
    - `num_warps`, `num_stages`: Triton launch parameters (ignored in interpret mode and on a TPU).
    - `backend`: `"triton"` (Pallas Triton, NVIDIA GPUs), `"interpret"` (Pallas interpret mode, any device),
      `"tpu"` (Pallas Mosaic TPU) or `"tpu_interpret"` (the TPU kernel in TPU interpret mode, any device);
      None: Triton on a GPU, `"tpu"` on a TPU, interpret mode elsewhere.
    """

    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    backend: Literal["triton", "interpret", "tpu", "tpu_interpret"] | None = None

    def __post_init__(self):
        if self.block_k is not None and (not _is_int(self.block_k) or self.block_k < _MIN_PAGE
                                         or self.block_k & (self.block_k - 1)):
            raise ValueError(f"DecodeConfig.block_k={self.block_k!r} must be a power of two >= {_MIN_PAGE}.")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"DecodeConfig.{name}={value!r} must be a positive int.")
        if self.backend not in (None, "triton", "interpret", "tpu", "tpu_interpret"):
            raise ValueError(f"DecodeConfig.backend={self.backend!r} must be 'triton', 'interpret', 'tpu', "
                             "'tpu_interpret' or None.")


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """Checked decode inputs. `paged` tells the cache layout; `capacity` is the keys one sequence can hold
    (S, or max_pages * page_size)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    kv_lengths: jax.Array  # [B] int32
    block_tables: jax.Array | None  # [B, max_pages] int32
    scale: float
    num_splits: int | None
    return_lse: bool
    # [B] bool, rows whose kv_lengths / block_tables break the contract, known only under jit (concrete
    # values raise instead); their lengths are 0 above, and `poison_rows` makes their outputs NaN.
    out_of_contract: jax.Array | None = None
    causal: bool = True  # the new tokens see each other causally; False: every key below the length
    # The most keys before a new token its mask_mod can attend (`flex.mods.mask_lookback`), or None: the
    # kernel starts each sequence's splits at the first step that holds a key of the earliest token's window.
    lookback: int | None = None
    sinks: jax.Array | None = None  # [N] float32 attention-sink logits (`_sinks.py`)

    @property
    def paged(self) -> bool:
        return self.block_tables is not None

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(B, T, N, K, D, Dv)."""
        batch, new_tokens, num_heads, head_dim = self.q.shape
        return batch, new_tokens, num_heads, self.k.shape[2], head_dim, self.v.shape[3]

    @property
    def page_size(self) -> int | None:
        return self.k.shape[1] if self.paged else None

    @property
    def capacity(self) -> int:
        return self.block_tables.shape[1] * self.k.shape[1] if self.paged else self.k.shape[1]


def _concrete(x) -> np.ndarray | None:
    """The values of x when they are known at trace time (not a tracer)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def check_decode_inputs(
    q, k, v, *, kv_lengths, block_tables, score_mod, mask_mod, num_splits, scale, return_lse, causal=True,
    sinks=None, allowed_dtypes: tuple = KERNEL_DTYPES, max_head_dim: int | None = MAX_HEAD_DIM,
) -> DecodeInputs:
    """Checks a `decode_attention` call (see its docstring); values of `kv_lengths` and `block_tables` are
    range-checked when they are concrete."""
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    paged = block_tables is not None
    cache = "[P, page_size, K, D]" if paged else "[B, S, K, D]"
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 ([B, T, N, D]), got shape {q.shape}.")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 ({cache}), got shape {x.shape}.")
    check_dtypes(q, k, v, allowed_dtypes)
    batch, new_tokens, num_heads, head_dim = q.shape
    if not 1 <= new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(
            f"q must hold 1 to {MAX_NEW_TOKENS} new tokens per sequence (q [B, T, N, D] with T <= "
            f"{MAX_NEW_TOKENS}), got T={new_tokens}; use flash_attention for a prefill."
        )
    if min(q.shape[1:]) < 1:  # B = 0 is an empty batch (empty outputs, as jax.nn.dot_product_attention)
        raise ValueError(f"every dimension of q but B must be >= 1, got {q.shape}.")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must share their first three dims ({cache}; Dv may differ), got {k.shape} and {v.shape}.")
    if k.shape[3] != head_dim:
        raise ValueError(f"k must have q's head dim D={head_dim}, got k {k.shape}.")
    if min(k.shape[1:]) < 1 or v.shape[3] < 1 or (paged and k.shape[0] < 1):
        raise ValueError(f"every dimension of k and v must be >= 1 (but B of a dense cache), got k {k.shape} and v "
                         f"{v.shape}.")
    num_kv_heads = k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"the query heads N={num_heads} must be a multiple of the key/value heads K={num_kv_heads}.")
    for name, dim in (("D", head_dim), ("Dv", v.shape[3])):
        if max_head_dim is not None and dim > max_head_dim:
            raise ValueError(f"head dim {name}={dim} is not supported: it must be <= {max_head_dim}.")
    if paged:
        block_tables = jnp.asarray(block_tables)
        page_size = k.shape[1]
        if page_size < _MIN_PAGE or page_size & (page_size - 1):
            raise ValueError(
                f"page_size (k.shape[1] of a paged cache [P, page_size, K, D]) must be a power of two >= "
                f"{_MIN_PAGE}, got {page_size}."
            )
        if not jnp.issubdtype(block_tables.dtype, jnp.integer):
            raise TypeError(f"block_tables must be an int array, got dtype {block_tables.dtype}.")
        if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
            raise ValueError(f"block_tables must be [B, max_pages] with B={batch}, got shape {block_tables.shape}.")
        capacity = block_tables.shape[1] * page_size
    else:
        if k.shape[0] != batch:
            raise ValueError(
                f"a dense cache k must be [B, S, K, D] with q's B={batch}, got {k.shape} (pass block_tables "
                "for a paged cache)."
            )
        capacity = k.shape[1]
    # Both are checked in their own dtype, before the int32 cast (under x64 a length or page 2**32 + j would
    # wrap to j).
    if new_tokens > capacity:
        raise ValueError(
            f"the cache holds capacity={capacity} keys per sequence ({'max_pages * page_size' if paged else 'S'}), "
            f"fewer than the T={new_tokens} new tokens it must hold (q [B, T, N, D] has T={new_tokens})."
        )
    kv_lengths, out_of_contract = _check_lengths(kv_lengths, batch, new_tokens, capacity)
    if paged:
        bad_tables = _check_tables(block_tables, kv_lengths, k.shape[0], k.shape[1], capacity)
        if bad_tables is not None:
            out_of_contract = bad_tables if out_of_contract is None else out_of_contract | bad_tables
        block_tables = block_tables.astype(jnp.int32)
    if out_of_contract is not None:
        kv_lengths = jnp.where(out_of_contract, 0, kv_lengths)  # nothing read: the row is NaN anyway
    kv_lengths = kv_lengths.astype(jnp.int32)
    for name, hook in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be callable or None, got {type(hook).__name__}.")
    if num_splits is not None and (not _is_int(num_splits) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}.")
    if scale is None:
        scale = head_dim**-0.5
    elif isinstance(scale, jax.core.Tracer) or np.ndim(scale) != 0 or not _is_real(scale):
        raise TypeError(
            f"scale must be a Python float (decode_attention compiles it), got {scale!r}; a learned scale can "
            "enter through score_mod."
        )
    elif not np.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}.")
    return DecodeInputs(
        q=q, k=k, v=v, kv_lengths=kv_lengths, block_tables=block_tables if paged else None,
        scale=float(scale), num_splits=None if num_splits is None else int(num_splits),
        return_lse=check_flag("return_lse", return_lse), out_of_contract=out_of_contract,
        causal=check_flag("causal", causal), sinks=check_sinks(sinks, num_heads),
    )


def empty_outputs(inputs: DecodeInputs):
    """The outputs of an empty batch (B = 0): out `[0, T, N, Dv]` in q's dtype (and lse `[0, N, T]` float32
    with `return_lse`), as `jax.nn.dot_product_attention` gives for one."""
    _, new_tokens, num_heads, _, _, value_dim = inputs.shape
    out = jnp.zeros((0, new_tokens, num_heads, value_dim), inputs.q.dtype)
    return (out, jnp.zeros((0, num_heads, new_tokens), jnp.float32)) if inputs.return_lse else out


def poison_rows(out: jax.Array, lse: jax.Array, out_of_contract: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(out `[B, T, N, Dv]`, lse `[B, N, T]`) with NaN in the rows of sequences whose traced `kv_lengths` /
    `block_tables` break the contract (see `DecodeInputs.out_of_contract`): loud, as no check can raise
    under jit. The kernel and the reference both end with it."""
    if out_of_contract is None:
        return out, lse
    out = jnp.where(out_of_contract[:, None, None, None], jnp.asarray(jnp.nan, out.dtype), out)
    return out, jnp.where(out_of_contract[:, None, None], jnp.nan, lse)


def _check_lengths(kv_lengths, batch: int, new_tokens: int, capacity: int) -> tuple[jax.Array, jax.Array | None]:
    """kv_lengths in its own dtype, and under jit the [B] bool of lengths outside {0} and [T, capacity]."""
    if kv_lengths is None:
        raise ValueError("kv_lengths is required: the cache length of each sequence, new tokens included.")
    kv_lengths = jnp.asarray(kv_lengths)
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
        raise TypeError(f"kv_lengths must be an int array, got dtype {kv_lengths.dtype}.")
    if kv_lengths.shape != (batch,):
        raise ValueError(f"kv_lengths must have shape [B] = [{batch}], got {kv_lengths.shape}.")
    values = _concrete(kv_lengths)
    if values is None:
        return kv_lengths, (kv_lengths != 0) & ((kv_lengths < new_tokens) | (kv_lengths > capacity))
    bad = (values != 0) & ((values < new_tokens) | (values > capacity))
    if bad.any():
        raise ValueError(
            f"kv_lengths must be 0 (an empty slot) or lie in [T, capacity] = [{new_tokens}, {capacity}] "
            f"(the cache holds the T new tokens), got {values.tolist()}."
        )
    return kv_lengths, None


def _check_tables(block_tables: jax.Array, kv_lengths: jax.Array, num_pages: int, page_size: int,
                  capacity: int) -> jax.Array | None:
    """The pages each sequence uses (the first cdiv(kv_lengths[b], page_size) entries) must exist; entries
    past them are never read and may hold anything. Under jit, the [B] bool of sequences that use one."""
    tables, lengths = _concrete(block_tables), _concrete(kv_lengths)
    if tables is None or lengths is None:
        pages = -(-jnp.clip(kv_lengths, 0, capacity) // page_size)
        used = jnp.arange(block_tables.shape[1], dtype=pages.dtype)[None, :] < pages[:, None]
        return jnp.any(used & ((block_tables < 0) | (block_tables >= num_pages)), axis=1)
    used = np.arange(tables.shape[1])[None, :] < -(-np.clip(lengths, 0, capacity)[:, None] // page_size)
    bad = used & ((tables < 0) | (tables >= num_pages))
    if bad.any():
        b, p = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables[{b}, {p}] = {int(tables[b, p])} is not a page of the cache (it has P={num_pages} "
            f"pages: 0..{num_pages - 1}), and sequence {b} reads it (kv_lengths[{b}] = {int(lengths[b])})."
        )
    return None


def decode_hook_args(score: bool, rows: int, cols: int) -> list[jax.ShapeDtypeStruct]:
    """(score, b, h, q_idx, kv_idx) as the decode kernels pass them to a hook: a float32 (rows, cols) tile, b a
    scalar, h and q_idx (rows, 1) columns (a tile's rows pack several query heads), kv_idx a (1, cols) row;
    without `score` for a mask_mod. (The TPU kernel passes h as a scalar to a hook that reads a captured array
    at h: `tpu/decode.py`.)"""
    i32 = jnp.int32
    args = [
        jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((rows, 1), i32),
        jax.ShapeDtypeStruct((rows, 1), i32), jax.ShapeDtypeStruct((1, cols), i32),
    ]
    return [jax.ShapeDtypeStruct((rows, cols), jnp.float32), *args] if score else args
