"""The static description of one attention call, read by every backend's kernels and by the XLA passes:
`Features` (what the call computes, built by `flash_attention` / `flex_attention`), `_Problem` (features plus
the static facts of the padded arrays: the nondiff argument of the custom_jvp in `_autodiff`) and `_Tangents`
(which inputs move in a forward-mode pass).

The conventions every backend keeps: `_autodiff.attention` pads T, S to a multiple of the tiles and D to a
power of two (Triton needs power-of-two tiles) and masks the padding through the key/query lengths, so
callers never pad. Which (query, key) pairs attend is decided per element by: key lengths, a causal / local
window, segment ids, a dense bool mask, and a user `mask_mod`. Which tiles are visited is decided either by
index ranges (windows and lengths, `_tiles.py`) or by the block tables of a `BlockMask`; tiles that every pair
reaches skip the per-element mask. Query rows past `q_lengths` (and fully masked rows) give output 0 and lse
-inf; the backward pass sees them as lse = +inf, hence p = 0 and exactly zero gradients. A `score_mod`
rewrites the scaled score per element before masking; its derivative in the score comes from `jax.jvp` inside
the backward kernels, and the gradients of the arrays it closes over from an XLA pass over query chunks
(`_chunked.py`; deterministic, no atomics).
"""

from __future__ import annotations

import dataclasses

from jax import lax

from probjax_kernels._config import FlashConfig
from probjax_kernels._hooks import Hook


@dataclasses.dataclass(frozen=True)
class Features:
    """What one attention call computes, apart from the arrays (static and hashable).

    - `window_left`, `window_right`: a query at row r sees keys in [r - left, r + right]; None = unbounded
      (causal is `window_right=0`).
    - `score_mod`, `mask_mod`: traced user hooks (see `_hooks.Hook`).
    - `block_sizes`: the (q, kv) tile of the block tables, when tile visits come from a `BlockMask`.
    - `exact_mask_mod`: the mask_mod alone gives the mask the block tables describe (`BlockMask.exact_mask_mod`),
      so a kernel may walk the tables on tiles coarser than their blocks (`_table_tiles.tables_on_tiles`).
    - `dropout_rate`: probability of dropping an attention weight (0 = off).
    - `dropout_positions`: (q_split, kv_split) when the dropout seed input is `_dropout.positional_seed`'s
      vector, so that the keep mask hashes global positions (a shard of a longer sequence); None: indices.
    - `dropout_heads`: the number of heads the keep mask hashes with (the whole attention's, when this call
      holds a shard of the heads); None: this call's.
    - `return_max`: also output the row max of the scaled, modified, masked scores (AuxRequest.max_scores).
    """

    scale: float
    window_left: int | None = None
    window_right: int | None = None
    score_mod: Hook | None = None
    mask_mod: Hook | None = None
    block_sizes: tuple[int, int] | None = None
    exact_mask_mod: bool = False
    dropout_rate: float = 0.0
    dropout_positions: tuple[int, int] | None = None
    dropout_heads: int | None = None
    return_max: bool = False  # the forward also writes the row max of the masked scores (natural units)


@dataclasses.dataclass(frozen=True)
class _Problem:
    """Features plus the static facts of the padded arrays; the nondiff argument of the custom_jvp."""

    features: Features
    group: int  # query heads per key/value head
    num_heads: int
    bias_shape: tuple[int, int, int, int] | None  # padded, with 1 on broadcast dims
    mask_shape: tuple[int, int, int, int] | None
    table_shape: tuple[int, int] | None  # (batch, heads) of the block tables: 1 = broadcast
    has_segments: bool
    num_score_consts: int
    num_mask_consts: int
    config: FlashConfig  # every field filled
    precision: lax.Precision
    kv_broadcast: bool = False  # k / v have batch 1, shared by every query batch (not repeated)
    same_value_dim: bool = True  # v's (padded) head dim is q / k's
    dkv_transposed: bool = False  # the Triton dK/dV kernel computes K Q^T (`_dispatch.triton_dkv_transposed`)
    # The Triton dK/dV kernel runs one program per query head, not per KV head, and XLA sums dK / dV over the
    # group (`_dispatch.triton_dkv_per_query_head`).
    dkv_per_query_head: bool = False
    # The Triton dK/dV kernel runs two programs per key tile, one for dV and one for dK, each recomputing the
    # scores (`_dispatch.triton_dkv_split`).
    dkv_split: bool = False
    bias_dtype: str | None = None  # the bias's dtype by name ("bfloat16", "float32", ...), None without one

    @property
    def per_element_mask_everywhere(self) -> bool:
        """Segments and dense masks can cut any tile, so no tile may skip the per-element mask."""
        return self.has_segments or self.mask_shape is not None


@dataclasses.dataclass(frozen=True)
class _Tangents:
    """Which inputs have a (nonzero) tangent in a forward-mode pass; static, like `_Problem`."""

    q: bool
    k: bool
    v: bool
    bias: bool
    score_consts: tuple[bool, ...]


def _interpreted(problem: _Problem) -> bool:
    """Whether the call runs in a CPU interpreter (Pallas interpret mode or the Mosaic GPU interpreter)."""
    return problem.config.backend in ("interpret", "mosaic_interpret")
