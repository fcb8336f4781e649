"""Input checks of `ragged_paged_attention` and its reference, and the ragged kernels' config.

The new tokens of every sequence are packed in `q [num_tokens, N, D]`: sequence i owns rows
`cu_q_lens[i]:cu_q_lens[i + 1]` (n_i of them), and its new token j sits at position `kv_lens[i] - n_i + j`
of its paged cache (`page_indices [S, pages_per_seq]` into `[P, page_size, K, D]` pages). Sequences from
`num_seqs` on are padding. Every check names the caller's argument, what it got and what it needs.

Values (`num_seqs`, `cu_q_lens`, `kv_lens`, `page_indices`) are range-checked when they are concrete. Under
`jit` they cannot be, so the checked inputs carry them clamped into range (no read or write ever leaves the
arrays: `num_seqs` to [0, S], `cu_q_lens` made non-decreasing within [0, num_tokens], `kv_lens` to
[0, capacity], page indices to [0, P)) and `bad_rows` marks the packed rows whose sequence breaks the
contract (every row when `num_seqs` / `cu_q_lens` do): their output is NaN and nothing of theirs is written.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from probjax_kernels._inputs import KERNEL_DTYPES, MAX_HEAD_DIM, _is_int, _is_real

QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)  # pages read with per-KV-head scales
_MIN_PAGE = 16  # Triton's dot needs every dimension >= 16: a page is one key tile
_TARGET_ROWS = 64  # default kernel rows per program: block_q packed tokens x the G query heads of a KV head
RaggedBackend = Literal["xla", "triton", "interpret", "tpu", "tpu_interpret"]


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Launch choices of the ragged paged attention kernels; `None` fields get per-device defaults.

    - `block_q`: packed query tokens per kernel program (a power of two); the program's rows are block_q
      times the N / K query heads of one KV head. None: about 64 rows, fewer for a call with fewer tokens.
    - `num_warps`, `num_stages`: Triton launch parameters (ignored by the other backends).
    - `backend`: `"xla"` (the plain-jnp reference), `"triton"` (Pallas Triton, NVIDIA GPUs), `"interpret"`
      (the Triton kernel in Pallas interpret mode, any device), `"tpu"` (Pallas Mosaic TPU) or
      `"tpu_interpret"` (the TPU kernel in TPU interpret mode, any device); None: Triton on a GPU, `"tpu"` on
      a TPU, `"xla"` elsewhere.
    """

    block_q: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    backend: RaggedBackend | None = None

    def __post_init__(self):
        if self.block_q is not None and (not _is_int(self.block_q) or self.block_q < 1
                                         or self.block_q & (self.block_q - 1)):
            raise ValueError(f"RaggedConfig.block_q={self.block_q!r} must be a power of two >= 1.")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"RaggedConfig.{name}={value!r} must be a positive int.")
        if self.backend not in (None, "xla", "triton", "interpret", "tpu", "tpu_interpret"):
            raise ValueError(f"RaggedConfig.backend={self.backend!r} must be 'xla', 'triton', 'interpret', 'tpu', "
                             "'tpu_interpret' or None.")


def default_block_q(num_tokens: int, group: int) -> int:
    """block_q for `RaggedConfig.block_q=None`: the power of two that packs about 64 rows (tokens x the G
    query heads of a KV head), at least 1, and no more than the call's tokens need."""
    block_q = max(1, _TARGET_ROWS // group)
    block_q = 1 << (block_q.bit_length() - 1)
    return min(block_q, max(1, 1 << (max(num_tokens, 1) - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class RaggedInputs:
    """Checked inputs of a ragged paged attention call; the int arrays are int32 and clamped into range
    (see the module docstring), the scales and sinks float32."""

    q: jax.Array  # [num_tokens, N, D]
    k_pages: jax.Array  # [P, page_size, K, D]
    v_pages: jax.Array  # [P, page_size, K, Dv]
    kv_lens: jax.Array  # [S] int32, in [0, capacity]
    page_indices: jax.Array  # [S, pages_per_seq] int32, in [0, P)
    cu_q_lens: jax.Array  # [S + 1] int32, non-decreasing, in [0, num_tokens]
    num_seqs: jax.Array  # [] int32, in [0, S]
    scale: float
    # The effective window: `sliding_window`, narrowed to what a mask_mod is known to reach back
    # (`flex.mods.mask_lookback` + 1); a token at position p sees keys p - w < j <= p. None: unbounded.
    sliding_window: int | None
    soft_cap: float | None
    sinks: jax.Array | None  # [N] float32
    k_scale: jax.Array | None  # [K] float32, exactly when the pages are int8 / float8_e4m3fn
    v_scale: jax.Array | None
    new_k: jax.Array | None  # [num_tokens, K, D] in q's dtype
    new_v: jax.Array | None  # [num_tokens, K, Dv]
    # [num_tokens] bool, rows whose traced values break the contract (NaN out, nothing written); None when
    # every value was concrete, and so checked.
    bad_rows: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_pages.dtype in QUANTIZED_DTYPES

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(num_tokens, N, K, D, Dv)."""
        num_tokens, num_heads, head_dim = self.q.shape
        return num_tokens, num_heads, self.k_pages.shape[2], head_dim, self.v_pages.shape[3]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def capacity(self) -> int:
        """Keys one sequence can hold: pages_per_seq * page_size."""
        return self.page_indices.shape[1] * self.page_size


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Where each packed row belongs: `[num_tokens]` arrays."""

    seq: jax.Array  # int32, the row's sequence (clamped to [0, S): meaningless for a padding row)
    position: jax.Array  # int32, its position kv_lens[seq] - n_seq + j
    live: jax.Array  # bool, a row of a sequence below num_seqs (False: a padding row)


def token_layout(cu_q_lens: jax.Array, num_seqs: jax.Array, kv_lens: jax.Array, num_tokens: int) -> TokenLayout:
    """The layout of the packed rows for clamped int32 `cu_q_lens [S + 1]` (non-decreasing), `num_seqs []`
    and `kv_lens [S]`: row t is in sequence i when cu_q_lens[i] <= t < cu_q_lens[i + 1], i < num_seqs."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seqs = kv_lens.shape[0]
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    live = (seq < num_seqs) & (rows >= cu_q_lens[0])
    seq = jnp.clip(seq, 0, seqs - 1)
    position = kv_lens[seq] - cu_q_lens[seq + 1] + rows  # kv_lens - n + j with j = row - cu_q_lens[seq]
    return TokenLayout(seq=seq, position=position, live=live)


def _concrete(x) -> np.ndarray | None:
    """The values of x when they are known at trace time (not a tracer)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _int_array(name: str, x, what: str) -> jax.Array:
    """x as an int array, else a TypeError / ValueError naming `name` and saying `what` it is."""
    if x is None:
        raise ValueError(f"{name} is required: {what}.")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int array ({what}), got dtype {x.dtype}.")
    return x


def _check_tables(kv_lens, page_indices, cu_q_lens) -> tuple[jax.Array, jax.Array, jax.Array]:
    """kv_lens `[S]`, page_indices `[S, pages_per_seq]` and cu_q_lens `[S + 1]` int arrays, S >= 1."""
    kv_lens = _int_array("kv_lens", kv_lens, "[S]: each sequence's keys, its new tokens included")
    if kv_lens.ndim != 1 or kv_lens.shape[0] < 1:
        raise ValueError(f"kv_lens must have shape [S] with S >= 1 (each sequence's keys, its new tokens "
                         f"included), got {list(kv_lens.shape)}.")
    seqs = kv_lens.shape[0]
    page_indices = _int_array("page_indices", page_indices, "[S, pages_per_seq]: each sequence's pages in order")
    if page_indices.ndim != 2 or page_indices.shape[0] != seqs or page_indices.shape[1] < 1:
        raise ValueError(f"page_indices must have shape [S, pages_per_seq] = [{seqs}, >= 1] (each sequence's pages "
                         f"in order; S = kv_lens.shape[0]), got {list(page_indices.shape)}.")
    cu_q_lens = _int_array("cu_q_lens", cu_q_lens, "[S + 1]: the packed rows of sequence i are "
                           "cu_q_lens[i]:cu_q_lens[i + 1]")
    if cu_q_lens.shape != (seqs + 1,):
        raise ValueError(f"cu_q_lens must have shape [S + 1] = [{seqs + 1}] (S = kv_lens.shape[0]; the packed rows "
                         f"of sequence i are cu_q_lens[i]:cu_q_lens[i + 1]), got {list(cu_q_lens.shape)}.")
    return kv_lens, page_indices, cu_q_lens


def _float_vector(name: str, x, size: int, what: str, allow_scalar: bool) -> jax.Array | None:
    """None, or a float array of shape [size] (or a scalar, broadcast, with `allow_scalar`) as float32."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not _is_real(x) or not (
            isinstance(x, (int, float)) or jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)):
        raise TypeError(f"{name} must be a float array ({what}), got {getattr(x, 'dtype', type(x).__name__)}.")
    x = jnp.asarray(x, jnp.float32) if isinstance(x, (int, float)) else jnp.asarray(x)
    if x.shape != (size,) and not (allow_scalar and x.ndim == 0):
        shapes = f"be a scalar or have shape [{size}]" if allow_scalar else f"have shape [{size}]"
        raise ValueError(f"{name} must {shapes} ({what}), got shape {list(x.shape)}.")
    return jnp.broadcast_to(x.astype(jnp.float32), (size,))


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, jax.core.Tracer) or np.ndim(scale) != 0 or not _is_real(scale):
        raise TypeError(f"scale must be a Python float (the kernels compile it), got {scale!r}; a learned scale "
                        "can enter through score_mod.")
    if not np.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}.")
    return float(scale)


def _check_window(sliding_window, lookback: int | None) -> int | None:
    """The effective window (see `RaggedInputs.sliding_window`)."""
    if sliding_window is not None and (not _is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int (the number of most recent keys a "
                         f"token sees, itself included), got {sliding_window!r}.")
    windows = [int(w) for w in (sliding_window, None if lookback is None else lookback + 1) if w is not None]
    return min(windows) if windows else None


def _check_soft_cap(soft_cap) -> float | None:
    if soft_cap is None:
        return None
    if isinstance(soft_cap, jax.core.Tracer) or np.ndim(soft_cap) != 0 or not _is_real(soft_cap):
        raise TypeError(f"soft_cap must be a Python float (the kernels compile it), got {soft_cap!r}.")
    if not (np.isfinite(float(soft_cap)) and float(soft_cap) > 0):
        raise ValueError(f"soft_cap must be a positive, finite float or None, got {soft_cap!r}.")
    return float(soft_cap)


def _check_caches(q, k_pages, v_pages, allowed_dtypes: tuple, max_head_dim: int | None) -> None:
    """Ranks, dtypes and the shared dims of q `[num_tokens, N, D]` and the pages `[P, page_size, K, D|Dv]`."""
    if q.ndim != 3:
        raise ValueError(f"q must have rank 3 ([num_tokens, N, D], the packed new tokens), got shape {q.shape}.")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 ([P, page_size, K, D]), got shape {x.shape}.")
    if q.dtype not in allowed_dtypes:
        names = ", ".join(jnp.dtype(d).name for d in allowed_dtypes)
        raise TypeError(f"q must have dtype {names}; got {q.dtype}.")
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"k_pages and v_pages must share one dtype, got {k_pages.dtype} and {v_pages.dtype}.")
    if k_pages.dtype != q.dtype and k_pages.dtype not in QUANTIZED_DTYPES:
        raise TypeError(f"k_pages and v_pages must have q's dtype {q.dtype}, or int8 / float8_e4m3fn (a quantized "
                        f"cache, with k_scale and v_scale), got {k_pages.dtype}.")
    num_heads, head_dim = q.shape[1:]
    if min(num_heads, head_dim) < 1:
        raise ValueError(f"q's heads N and head dim D must be >= 1, got q {q.shape}.")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"k_pages and v_pages must share P, page_size and K ([P, page_size, K, D] / "
                         f"[P, page_size, K, Dv]), got {k_pages.shape} and {v_pages.shape}.")
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"k_pages must have q's head dim D={head_dim}, got k_pages {k_pages.shape}.")
    if min(k_pages.shape) < 1 or v_pages.shape[3] < 1:
        raise ValueError(f"every dimension of the pages must be >= 1, got k_pages {k_pages.shape} and v_pages "
                         f"{v_pages.shape}.")
    page_size, num_kv_heads = k_pages.shape[1:3]
    if page_size < _MIN_PAGE or page_size & (page_size - 1):
        raise ValueError(f"page_size (k_pages.shape[1] of [P, page_size, K, D]) must be a power of two >= "
                         f"{_MIN_PAGE}, got {page_size}.")
    if num_heads % num_kv_heads:
        raise ValueError(f"the query heads N={num_heads} (q.shape[1]) must be a multiple of the key/value heads "
                         f"K={num_kv_heads} (k_pages.shape[2]).")
    for name, dim in (("D", head_dim), ("Dv", v_pages.shape[3])):
        if max_head_dim is not None and dim > max_head_dim:
            raise ValueError(f"head dim {name}={dim} is not supported: it must be <= {max_head_dim}.")


def _check_new_kv(new_k, new_v, q, k_pages, v_pages) -> tuple[jax.Array | None, jax.Array | None]:
    if (new_k is None) != (new_v is None):
        raise ValueError("new_k and new_v must be given together (the keys and values of the new tokens), or "
                         "neither.")
    if new_k is None:
        return None, None
    new_k, new_v = jnp.asarray(new_k), jnp.asarray(new_v)
    for name, x, pages in (("new_k", new_k, k_pages), ("new_v", new_v, v_pages)):
        want = (q.shape[0], pages.shape[2], pages.shape[3])
        if x.shape != want:
            raise ValueError(f"{name} must have shape [num_tokens, K, {'D' if name == 'new_k' else 'Dv'}] = "
                             f"{list(want)}, got {list(x.shape)}.")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype} (it is quantized on append for an int8 / "
                            f"float8 cache), got {x.dtype}.")
    return new_k, new_v


def _check_num_seqs(num_seqs, seqs: int) -> jax.Array:
    if num_seqs is None:
        return jnp.asarray(seqs, jnp.int32)
    if isinstance(num_seqs, (bool, np.bool_)) or not jnp.issubdtype(jnp.asarray(num_seqs).dtype, jnp.integer):
        raise TypeError(f"num_seqs must be None or an int (a traced int32 scalar under jit), got {num_seqs!r}.")
    num_seqs = jnp.asarray(num_seqs)
    if num_seqs.ndim != 0:
        raise ValueError(f"num_seqs must be a scalar, got shape {list(num_seqs.shape)}.")
    value = _concrete(num_seqs)
    if value is not None and not 0 <= int(value) <= seqs:
        raise ValueError(f"num_seqs must lie in [0, S] = [0, {seqs}] (S = kv_lens.shape[0]), got {int(value)}.")
    return num_seqs


def _sequence_faults(xp, cu, kv_lens, pages, *, num_pages: int, page_size: int, window: int | None):
    """([S] bool lengths out of [n_i, capacity], [S, pages_per_seq] bool pages read that do not exist) for
    numpy (`xp=np`, concrete values) or jnp (traced): the pages a sequence reads run from its first new
    token's window (page 0 without a window) to its last key's page; a sequence without new tokens reads none."""
    new = cu[1:] - cu[:-1]
    capacity = pages.shape[1] * page_size
    bad_lengths = (kv_lens < new) | (kv_lens > capacity)
    first = (xp.maximum(kv_lens - new - window + 1, 0) // page_size if window is not None
             else xp.zeros_like(kv_lens))
    slots = xp.arange(pages.shape[1])[None, :]
    read = (slots >= first[:, None]) & (slots <= ((kv_lens - 1) // page_size)[:, None]) & (new > 0)[:, None]
    return bad_lengths, read & ((pages < 0) | (pages >= num_pages))


def _check_values(cu, num_seqs, kv_lens, pages, *, num_tokens: int, num_pages: int, page_size: int,
                  window: int | None) -> None:
    """Concrete values in their own dtype (under x64 a length 2**32 + j would wrap to j in int32): ValueError
    for what breaks the contract. Checked when `cu_q_lens` and `num_seqs` are concrete, the lengths and pages
    when they are too."""
    cu, live = _concrete(cu), _concrete(num_seqs)
    if cu is None or live is None:
        return
    live = int(live)
    used = cu[: live + 1]
    if used[0] != 0 or np.any(np.diff(used) < 0) or used[-1] > num_tokens:
        raise ValueError(
            f"cu_q_lens must start at 0, be non-decreasing over its first num_seqs + 1 = {live + 1} entries and "
            f"end them at most at num_tokens = {num_tokens} (q.shape[0]), got {cu.tolist()}."
        )
    lengths, table = _concrete(kv_lens), _concrete(pages)
    if lengths is None or table is None:
        return
    bad_lengths, bad_pages = _sequence_faults(np, used, lengths[:live], table[:live], num_pages=num_pages,
                                              page_size=page_size, window=window)
    if bad_lengths.any():
        i = int(np.argmax(bad_lengths))
        n = int(used[i + 1] - used[i])
        raise ValueError(
            f"kv_lens[{i}] = {int(lengths[i])} must lie in [n_{i}, pages_per_seq * page_size] = [{n}, "
            f"{table.shape[1] * page_size}]: it counts sequence {i}'s keys including its n_{i} = {n} new tokens."
        )
    if bad_pages.any():
        i, p = map(int, np.argwhere(bad_pages)[0])
        raise ValueError(
            f"page_indices[{i}, {p}] = {int(table[i, p])} is not a page (k_pages has P={num_pages} pages: "
            f"0..{num_pages - 1}), and sequence {i} reads it (kv_lens[{i}] = {int(lengths[i])})."
        )


def _traced_bad_rows(cu, num_seqs, kv_lens, pages, layout: TokenLayout, *, num_pages: int, page_size: int,
                     window: int | None) -> jax.Array:
    """`[num_tokens]` bool: the rows of sequences whose (raw) values break the contract, or every row when
    `num_seqs` / `cu_q_lens` do. `layout` is that of the clamped values."""
    wide = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    cu, num_seqs, kv_lens, pages = (jnp.asarray(x).astype(wide) for x in (cu, num_seqs, kv_lens, pages))
    seqs = kv_lens.shape[0]
    clamped = jnp.clip(num_seqs, 0, seqs)
    live = jnp.arange(seqs) < clamped
    broken = (num_seqs < 0) | (num_seqs > seqs) | (cu[0] != 0) | jnp.any(live & (cu[1:] < cu[:-1]))
    broken = broken | (cu[clamped] > layout.seq.shape[0])
    bad_lengths, bad_pages = _sequence_faults(jnp, cu, kv_lens, pages, num_pages=num_pages, page_size=page_size,
                                              window=window)
    bad = live & (bad_lengths | jnp.any(bad_pages, axis=1))
    return broken | (layout.live & bad[layout.seq])


def check_ragged_inputs(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs=None, *, scale=None, sliding_window=None,
    soft_cap=None, sinks=None, k_scale=None, v_scale=None, score_mod=None, mask_mod=None, new_k=None, new_v=None,
    lookback: int | None = None, allowed_dtypes: tuple = KERNEL_DTYPES, max_head_dim: int | None = MAX_HEAD_DIM,
) -> RaggedInputs:
    """Checks a `ragged_paged_attention` call (see its docstring). `lookback`: the most keys before a token
    its mask_mod can attend (`flex.mods.mask_lookback`), narrowing the window the reads cover."""
    q, k_pages, v_pages = (jnp.asarray(x) for x in (q, k_pages, v_pages))
    _check_caches(q, k_pages, v_pages, allowed_dtypes, max_head_dim)
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads = k_pages.shape[:3]
    kv_lens, page_indices, cu_q_lens = _check_tables(kv_lens, page_indices, cu_q_lens)
    seqs = kv_lens.shape[0]
    num_seqs = _check_num_seqs(num_seqs, seqs)
    for name, hook in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be callable or None, got {type(hook).__name__}.")
    window = _check_window(sliding_window, lookback)
    _check_values(cu_q_lens, num_seqs, kv_lens, page_indices, num_tokens=num_tokens, num_pages=num_pages,
                  page_size=page_size, window=window)
    quantized = k_pages.dtype in QUANTIZED_DTYPES
    scales = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if quantized and x is None:
            raise ValueError(f"{name} is required for a quantized ({k_pages.dtype}) cache: a float32 scalar or [K] = "
                             f"[{num_kv_heads}] (the cache holds values / scale).")
        if not quantized and x is not None:
            raise ValueError(f"{name} is only for an int8 / float8_e4m3fn cache; the pages are {k_pages.dtype}.")
        scales.append(_float_vector(name, x, num_kv_heads, "one per KV head", allow_scalar=True))
        values = None if x is None else _concrete(scales[-1])
        if values is not None and not np.all(np.isfinite(values) & (values > 0)):
            raise ValueError(f"{name} must be positive and finite (the cache holds values / scale), got "
                             f"{values.tolist()}.")
    sinks = _float_vector("sinks", sinks, num_heads, "one logit per query head", allow_scalar=False)
    new_k, new_v = _check_new_kv(new_k, new_v, q, k_pages, v_pages)
    raw = (cu_q_lens, num_seqs, kv_lens, page_indices)
    seqs_32 = jnp.clip(num_seqs, 0, seqs).astype(jnp.int32)
    cu_32 = jnp.clip(lax.cummax(cu_q_lens, axis=0), 0, num_tokens).astype(jnp.int32)
    lens_32 = jnp.clip(kv_lens, 0, page_indices.shape[1] * page_size).astype(jnp.int32)
    bad_rows = None
    if any(_concrete(x) is None for x in raw):
        layout = token_layout(cu_32, seqs_32, lens_32, num_tokens)
        bad_rows = _traced_bad_rows(*raw, layout, num_pages=num_pages, page_size=page_size, window=window)
    return RaggedInputs(
        q=q, k_pages=k_pages, v_pages=v_pages, kv_lens=lens_32,
        page_indices=jnp.clip(page_indices, 0, num_pages - 1).astype(jnp.int32), cu_q_lens=cu_32,
        num_seqs=seqs_32, scale=_check_scale(scale, head_dim), sliding_window=window,
        soft_cap=_check_soft_cap(soft_cap), sinks=sinks, k_scale=scales[0], v_scale=scales[1], new_k=new_k,
        new_v=new_v, bad_rows=bad_rows,
    )


def poison_bad_rows(out: jax.Array, inputs: RaggedInputs) -> jax.Array:
    """out `[num_tokens, N, Dv]` with NaN in the rows `inputs.bad_rows` marks: loud, as no check can raise
    under jit. The kernels' path and the reference both end with it."""
    if inputs.bad_rows is None:
        return out
    return jnp.where(inputs.bad_rows[:, None, None], jnp.asarray(jnp.nan, out.dtype), out)


def check_ragged_config(config) -> None:
    if config is not None and not isinstance(config, RaggedConfig):
        raise TypeError(f"config must be a RaggedConfig or None, got {type(config).__name__}.")
