"""The per-element score math shared by the Triton kernels and the XLA passes over query chunks: which pairs
attend, the (base-2) scores with bias and score_mod, their forward-mode tangents, dropout's factor, and the
backward preprocess (delta, lse in base 2) that the Mosaic backward uses too.

Notation (FlashAttention-2, Alg. 1 and 2): per query row, m_i is the running max of the scores and l_i the
running sum of exp(s - m_i); lse = m + log l. Scores are kept in the base-2 domain inside the kernels
(s2 = s * log2(e)) so that every exponential is an exp2; without hooks, log2(e) is folded into the scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from probjax_kernels._dropout import keep_mask, positions_of
from probjax_kernels._problem import _Problem

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class _ScoreContext:
    """Everything the per-element score and mask need, shaped to broadcast against the score tile: (bq, bk)
    in a kernel, [B, N, C, S] on the XLA side. `score_mod` / `mask_mod` are bound to their constants."""

    b: Any
    h: Any
    q_idx: Any
    kv_idx: Any
    kv_len: Any
    bias: Any = None
    mask: Any = None
    q_seg: Any = None
    kv_seg: Any = None
    dropout_seed: Any = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    d_bias: Any = None
    score_mod_jvp: Callable | None = None  # (score, d_score) -> (score_mod(score), its tangent)


def _allowed(ctx: _ScoreContext, problem: _Problem):
    """Where (query, key) pairs attend: key length, window, segments, dense mask and mask_mod."""
    f = problem.features
    allowed = ctx.kv_idx < ctx.kv_len
    if f.window_right is not None:
        allowed &= ctx.kv_idx <= ctx.q_idx + f.window_right
    if f.window_left is not None:
        allowed &= ctx.kv_idx >= ctx.q_idx - f.window_left
    if ctx.q_seg is not None:
        allowed &= ctx.q_seg == ctx.kv_seg
    if ctx.mask is not None:
        allowed &= ctx.mask != 0
    if ctx.mask_mod is not None:
        allowed &= ctx.mask_mod(ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx)
    return allowed


def _scores(dot, ctx: _ScoreContext, problem: _Problem, masked: bool, with_derivative: bool = False):
    """Base-2 scores s2 = log2(e) * score_mod(scale * q k^T + bias), -inf where masked, from `dot` = q k^T.

    With `with_derivative`, also returns d score_mod / d score (None without a score_mod).
    """
    f = problem.features
    derivative = None
    if ctx.score_mod is None and ctx.bias is None:
        s2 = dot * (f.scale * LOG2E)
    else:
        s = dot * f.scale
        if ctx.bias is not None:
            s = s + ctx.bias.astype(jnp.float32)
        if ctx.score_mod is not None:
            modded = lambda x: ctx.score_mod(x, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx)  # noqa: E731
            if with_derivative:
                # The hook is elementwise in the score, so a tangent of ones gives its derivative.
                s, derivative = jax.jvp(modded, (s,), (jnp.ones_like(s),))
            else:
                s = modded(s)
        s2 = s * LOG2E
    if masked:
        s2 = jnp.where(_allowed(ctx, problem), s2, -jnp.inf)
    return s2, derivative


def _score_tangents(dot, d_dot, ctx: _ScoreContext, problem: _Problem, masked: bool):
    """Base-2 scores s2 as in `_scores`, and the tangent of the natural-log score (None when the scores do
    not move), from `dot` = q k^T and its tangent `d_dot` = dq k^T + q dk^T (None when q and k are fixed).
    Masked entries of the tangent are left as they are: callers multiply it by p, which is 0 there."""
    f = problem.features
    s = dot * f.scale
    ds = None if d_dot is None else d_dot * f.scale
    if ctx.bias is not None:
        s = s + ctx.bias.astype(jnp.float32)
    if ctx.d_bias is not None:
        d_bias = ctx.d_bias.astype(jnp.float32)
        ds = d_bias if ds is None else ds + d_bias
    if ctx.score_mod_jvp is not None:
        ds = jnp.zeros_like(s) if ds is None else jnp.broadcast_to(ds, s.shape)
        s, ds = ctx.score_mod_jvp(s, ds, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx)
    elif ctx.score_mod is not None:
        s = ctx.score_mod(s, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx)
    s2 = s * LOG2E
    if masked:
        s2 = jnp.where(_allowed(ctx, problem), s2, -jnp.inf)
    return s2, ds


def base2_lse(lse):
    """lse `[B, N, T]` as the backward and tangent kernels read it: in base 2, and +inf for rows without any
    attended key (lse -inf), so that p = exp2(s2 - lse2) is exactly 0 there."""
    return jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)


def backward_delta(out, lse, d_out, d_lse=None):
    """delta = rowsum(dO * O) `[B, N, T]` float32 (FlashAttention-2's preprocess), minus an lse cotangent if
    given: d lse / d s = p, so d_lse enters dS = p (dP - delta) as -d_lse."""
    delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    return delta if d_lse is None else delta - jnp.where(jnp.isfinite(lse), d_lse, 0.0)


def _dropout_scale(ctx: _ScoreContext, problem: _Problem):
    """keep / (1 - rate) for the tile: the factor on dropped-out probabilities."""
    f = problem.features
    seed, b, h, q_idx, kv_idx = ctx.dropout_seed, ctx.b, ctx.h, ctx.q_idx, ctx.kv_idx
    if f.dropout_positions is not None:
        seed, b, h, q_idx, kv_idx = positions_of(seed, f.dropout_positions, b, h, q_idx, kv_idx)
    keep = keep_mask(seed, b, h, q_idx, kv_idx, f.dropout_rate, f.dropout_heads or problem.num_heads)
    rate = f.dropout_rate
    return jnp.where(keep, 1.0 / (1.0 - rate), 0.0)
