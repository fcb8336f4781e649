"""`ragged_paged_attention`: serving attention for the new tokens of many sequences packed in one call (decode
steps, prompt chunks and whole prompts mixed) against a paged KV cache, optionally writing their keys and
values into the pages first.

Entry point: checks, append, hook tracing and the forward-only call of the kernel `_dispatch.ragged_plan`
picks (`ragged/reference.py` is the XLA path). Each backend's `ragged.py` implements the kernel contract:

    ragged_paged_attention_kernel(
        q,                 # [num_tokens, N, D]   bf16 / f16 / f32
        k_pages, v_pages,  # [P, page_size, K, D] / [P, page_size, K, Dv]; q's dtype, or int8 / float8_e4m3fn
        kv_lens,           # [S] int32, in [0, pages_per_seq * page_size]
        page_indices,      # [S, pages_per_seq] int32, in [0, P)
        cu_q_lens,         # [S + 1] int32, non-decreasing, in [0, num_tokens]
        num_seqs,          # [] int32, traced, in [0, S]
        sinks,             # [N] float32 or None
        k_scale, v_scale,  # [K] float32 each, or None (given exactly when the pages are int8 / float8)
        hook_consts,       # list of arrays the score / mask hooks close over (score's first)
        *, scale: float, sliding_window: int | None, soft_cap: float | None,
        score_hook: Hook | None, mask_hook: Hook | None, num_score_consts: int,
        block_q: int, interpret: bool, **backend_launch_options,
    ) -> out  # [num_tokens, N, Dv] in q's dtype; padding token rows are exactly zero

Inputs arrive checked and clamped into range (`_ragged_inputs`); `sliding_window` is the effective window (the
argument narrowed by what a recognised mask_mod reaches back), so a kernel reads only the pages it covers.
Hooks are traced with `trace_decode_hook` (decode's tile convention: a float32 tile whose rows pack query
tokens x heads of one KV-head group, h and q_idx int32 columns, kv_idx an int32 row, b the sequence index).
Work items: `_ragged_schedule.ragged_work_items`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from probjax_kernels._dispatch import ragged_plan
from probjax_kernels._ragged_inputs import (
    RaggedConfig, check_ragged_config, check_ragged_inputs, default_block_q, poison_bad_rows,
)
from probjax_kernels.decode.attention import forward_only, trace_decode_hook
from probjax_kernels.flex.mods import mask_lookback
from probjax_kernels.ragged.append import append_new_kv
from probjax_kernels.ragged.reference import prepare_reference_hooks, ragged_reference_kernel


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    new_k: jax.Array | None = None,
    new_v: jax.Array | None = None,
    config: RaggedConfig | None = None,
):
    """Attention of the new tokens of many sequences, packed in one array, to their paged KV caches.

    Sequence i owns the packed rows `q[cu_q_lens[i]:cu_q_lens[i + 1]]`, its n_i new tokens (one for a decode
    step, a chunk of a prompt, a whole prompt, or none); `kv_lens[i]` counts its keys including them, so new
    token j sits at position `kv_lens[i] - n_i + j` and attends the keys at positions <= its own (causal
    among the new tokens). Key position p of sequence i is `k_pages[page_indices[i, p // page_size],
    p % page_size]`. GQA: query head h reads key/value head `h // (N // K)`; K/V are never repeated.

    The score of a token at position p, head h, against key position j is `s = scale * q . k`, then
    `score_mod(s, b=i, h, q_idx=p, kv_idx=j)`, then the soft cap `soft_cap * tanh(s / soft_cap)`. It is
    masked unless `j <= p`, `p - j < sliding_window` (with a window) and `mask_mod(i, h, p, j)`.

    **Arguments:**

    - `q`: `[num_tokens, N, D]`, bfloat16, float16 or float32; D <= 256.
    - `k_pages`, `v_pages`: `[P, page_size, K, D]` / `[P, page_size, K, Dv]` (page_size a power of two
      >= 16; Dv may differ from D; N a multiple of K): q's dtype, or int8 / float8_e4m3fn with scales.
    - `kv_lens`: `[S]` int, each sequence's keys including its new tokens: n_i <= kv_lens[i] <=
      pages_per_seq * page_size.
    - `page_indices`: `[S, pages_per_seq]` int, each sequence's pages in order. Pages may be shared (a common
      prefix) and in any order; only the entries a sequence reads (from its first new token's window, or 0,
      to the page of its last key) must be pages, the others may hold anything.
    - `cu_q_lens`: `[S + 1]` int, starting at 0 and non-decreasing over its first num_seqs + 1 entries, with
      `cu_q_lens[num_seqs] <= num_tokens`.
    - `num_seqs`: the live sequences, an int or a traced int32 scalar in [0, S] (default S). Sequences from
      it on are padding, and so is every row from `cu_q_lens[num_seqs]` on: their output is 0 (bucketed
      shapes: pad S and num_tokens to fixed sizes and pass the live count).
    - `scale`: a Python float, default `D ** -0.5`.
    - `sliding_window`: a positive int w: a token sees its w most recent keys, itself included; None: all.
    - `soft_cap`: a positive float: scores become `soft_cap * tanh(score / soft_cap)` (after score_mod).
    - `sinks`: `[N]` float (used as float32), a per-head logit of a virtual key whose value is zero: it adds
      `exp(sinks[h])` to each row's softmax denominator and nothing to the numerator.
    - `k_scale`, `v_scale`: for an int8 / float8_e4m3fn cache (required there, refused otherwise), a float
      or float array, a scalar or `[K]` (one per KV head): the keys are `k_pages * k_scale[kv_head]`, the
      values likewise. The kernels dequantize tile by tile.
    - `score_mod(score, b, h, q_idx, kv_idx) -> score`, `mask_mod(b, h, q_idx, kv_idx) -> bool` (True =
      attend): FlexAttention's hooks with b the sequence index and q_idx / kv_idx the positions above. Called
      on a float32 tile whose rows pack several tokens and heads (h and q_idx int32 columns, kv_idx a row, b
      a scalar) by the kernels and on `[num_tokens, N, capacity]` grids by the XLA path: write them with
      broadcasting jnp operations. A mask_mod whose reach back is known (`sliding_window(w)`, alone or
      inside `and_masks`) narrows the window, so pages before it are never read.
    - `new_k`, `new_v`: `[num_tokens, K, D]` / `[num_tokens, K, Dv]` in q's dtype, given together: the new
      tokens' keys and values, written into the pages at their positions before attending (quantized with
      the scales for an int8 cache: rounded, clipped to [-127, 127]; float8: clipped to its finite range).
      Padding rows are never written. Under jit, donate the pages (`donate_argnums`) to update in place.
    - `config`: a `RaggedConfig` (block_q, warps, stages, backend); None picks defaults for the device:
      the Triton kernel on a GPU, the TPU kernel on a TPU, the XLA reference elsewhere.

    **Returns:** out `[num_tokens, N, Dv]` in q's dtype (0 for padding rows and rows that attend nothing);
    with `new_k` / `new_v`, `(out, k_pages, v_pages)`, the pages after the append.

    **Errors:** a ValueError / TypeError naming the argument for a bad shape, dtype or option, and for
    values that break the contract when they are concrete (`num_seqs`, `cu_q_lens`, `kv_lens`, the pages a
    sequence reads, two new tokens writing one slot). Under jit nothing can raise: the values are clamped
    into range (no read or write leaves the arrays), the rows of a sequence that breaks the contract are NaN
    and none of its keys are written (every row, and no write, when `num_seqs` / `cu_q_lens` do).

    Forward only: `jax.grad` / `jax.jvp` raise `NotImplementedError` (differentiate
    `ragged_paged_attention_reference`). Composes with `jit`.
    """
    check_ragged_config(config)
    inputs = check_ragged_inputs(
        q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, scale=scale, sliding_window=sliding_window,
        soft_cap=soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale, score_mod=score_mod, mask_mod=mask_mod,
        new_k=new_k, new_v=new_v, lookback=mask_lookback(mask_mod),
    )
    appended = inputs.new_k is not None
    if appended:
        inputs = append_new_kv(inputs)
    num_tokens, num_heads, num_kv_heads, _, value_dim = inputs.shape
    if num_tokens == 0:
        out = jnp.zeros((0, num_heads, value_dim), inputs.q.dtype)
        return (out, inputs.k_pages, inputs.v_pages) if appended else out
    score_hook, score_consts = trace_decode_hook("score_mod", score_mod)
    mask_hook, mask_consts = trace_decode_hook("mask_mod", mask_mod)
    config = config or RaggedConfig()
    block_q = config.block_q or default_block_q(num_tokens, num_heads // num_kv_heads)
    kernel = ragged_plan(config, inputs, score_hook, mask_hook, block_q)
    if kernel is None:
        prepare_reference_hooks(inputs, score_hook, mask_hook)
        kernel = ragged_reference_kernel
    run = functools.partial(
        kernel, scale=inputs.scale, sliding_window=inputs.sliding_window, soft_cap=inputs.soft_cap,
        score_hook=score_hook, mask_hook=mask_hook, num_score_consts=len(score_consts), block_q=block_q,
    )
    out = forward_only(
        "ragged_paged_attention", run, inputs.q, inputs.k_pages, inputs.v_pages, inputs.kv_lens,
        inputs.page_indices, inputs.cu_q_lens, inputs.num_seqs, inputs.sinks, inputs.k_scale, inputs.v_scale,
        [*score_consts, *mask_consts],
    )
    out = poison_bad_rows(out, inputs)
    return (out, inputs.k_pages, inputs.v_pages) if appended else out
