"""XLA passes over query chunks, beside the kernels: the gradients of the arrays a score_mod closes over,
the dense attention that second-order derivatives differentiate (and that the TPU backend falls back to:
`dense_forward` / `dense_backward` / `dense_tangent`), and the tracing of hooks at every shape they will
see. Each step's working set is one [B, N, chunk, S] block."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from probjax_kernels._problem import Features, _Problem
from probjax_kernels._scores import LN2, LOG2E, _dropout_scale, _ScoreContext, _scores

_XLA_CHUNK_BYTES = 256 * 2**20  # working set of one query chunk


def _xla_chunk(batch: int, num_heads: int, t_pad: int, s_pad: int) -> int:
    """Query rows per step of the XLA gradient pass: a power-of-two divisor of t_pad within the budget."""
    chunk = t_pad
    while chunk > 16 and chunk % 2 == 0 and batch * num_heads * chunk * s_pad * 16 > _XLA_CHUNK_BYTES:
        chunk //= 2
    return chunk


def _prepare_hooks(features: Features, kernel_shapes: list[tuple], batch: int, num_heads: int, t_pad: int,
                   s_pad: int):
    """Traces the hooks for every shape they will see: the chosen backend's kernel tiles (`kernel_shapes`, as
    (b, h, q_idx, kv_idx, score) shapes: `_dispatch.hook_shapes`) and the XLA gradient pass."""
    spec = jax.ShapeDtypeStruct
    i32, f32 = jnp.int32, jnp.float32
    chunk = _xla_chunk(batch, num_heads, t_pad, s_pad)
    xla_shapes = ((batch, 1, 1, 1), (1, num_heads, 1, 1), (1, 1, chunk, 1), (1, 1, 1, s_pad),
                  (batch, num_heads, chunk, s_pad))
    for b, h, q_idx, kv_idx, score in [*kernel_shapes, xla_shapes]:
        indices = (spec(b, i32), spec(h, i32), spec(q_idx, i32), spec(kv_idx, i32))
        if features.score_mod is not None:
            features.score_mod.prepare(spec(score, f32), *indices)
        if features.mask_mod is not None:
            features.mask_mod.prepare(*indices)


def _chunk_context(problem: _Problem, shape: tuple[int, int, int, int], start, chunk: int, kv_len, optional: dict,
                   score_consts) -> _ScoreContext:
    """The score context of query rows [start, start + chunk) against all keys, as [B, N, chunk, S] grids.

    `shape` is (B, N, T, S) padded; bias / mask keep their broadcast axes of size 1."""
    batch, num_heads, _, s_pad = shape
    f = problem.features

    def rows(x):
        """The chunk's query rows of a [B|1, N|1, T|1, S|1] bias or mask (all of a broadcast axis)."""
        if x is None or x.shape[2] == 1:
            return x
        return lax.dynamic_slice_in_dim(x, start, chunk, axis=2)

    seg = optional.get("q_segment_ids")
    mask_consts = optional["mask_consts"]
    return _ScoreContext(
        b=jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1),
        h=jnp.arange(num_heads, dtype=jnp.int32).reshape(1, num_heads, 1, 1),
        q_idx=(start + jnp.arange(chunk, dtype=jnp.int32)).reshape(1, 1, chunk, 1),
        kv_idx=jnp.arange(s_pad, dtype=jnp.int32).reshape(1, 1, 1, s_pad),
        kv_len=kv_len.reshape(batch, 1, 1, 1),
        bias=rows(optional.get("bias")),
        mask=rows(optional.get("mask")),
        q_seg=None if seg is None else lax.dynamic_slice_in_dim(seg, start, chunk, axis=1).reshape(
            batch, 1, chunk, 1),
        kv_seg=None if seg is None else optional["kv_segment_ids"].reshape(batch, 1, 1, s_pad),
        dropout_seed=optional.get("dropout_seed"),
        score_mod=None if f.score_mod is None else functools.partial(f.score_mod.on_values, score_consts),
        mask_mod=None if f.mask_mod is None else functools.partial(f.mask_mod.on_values, mask_consts),
    )


def _kv_operand(y, batch: int) -> tuple[str, jax.Array]:
    """The einsum spelling of k / v [B|1, S, K, D]: one of batch 1 is shared by the batch, not repeated."""
    return ("skd", y[0]) if y.shape[0] == 1 < batch else ("bskd", y)


def _chunk_dot(x, y, start, chunk: int, group: int, precision):
    """Rows [start, start + chunk) of x [B, T, N, D] against y [B|1, S, K, D], as [B, N, chunk, S] float32."""
    batch, _, num_heads, d_pad = x.shape
    x = lax.dynamic_slice_in_dim(x, start, chunk, axis=1).reshape(batch, chunk, num_heads // group, group, d_pad)
    spelling, y_operand = _kv_operand(y, batch)
    return jnp.einsum(f"bckgd,{spelling}->bkgcs", x, y_operand, preferred_element_type=jnp.float32,
                      precision=precision).reshape(batch, num_heads, chunk, y.shape[1])


def _with_moving(consts: tuple, moving: tuple[bool, ...], values) -> tuple:
    """`consts` with the entries flagged in `moving` replaced by `values`, in order."""
    values = iter(values)
    return tuple(next(values) if m else c for c, m in zip(consts, moving))


def _score_const_gradients(problem: _Problem, q, k, v, kv_len, do, lse2, delta, optional: dict, consts: tuple,
                           moving: tuple[bool, ...]) -> tuple:
    """d loss / d (the arrays score_mod closes over that are flagged in `moving`), by recomputing dS in XLA
    over query chunks.

    Deterministic (no atomics) and general in the hook; it costs about one more dense forward pass, with a
    working set of one query chunk: [B, N, chunk, S] floats.
    """
    batch, t_pad, num_heads, _ = q.shape
    shape = (batch, num_heads, t_pad, k.shape[1])
    chunk = _xla_chunk(*shape)

    def chunk_gradient(start):
        dot = _chunk_dot(q, k, start, chunk, problem.group, problem.precision)
        dp = _chunk_dot(do, v, start, chunk, problem.group, problem.precision)
        lse2_c = lax.dynamic_slice_in_dim(lse2, start, chunk, axis=2)[..., None]
        delta_c = lax.dynamic_slice_in_dim(delta, start, chunk, axis=2)[..., None]
        context = functools.partial(_chunk_context, problem, shape, start, chunk, kv_len, optional)
        scores = lambda m: _scores(dot, context(_with_moving(consts, moving, m)), problem, masked=True)[0]  # noqa: E731
        s2, vjp = jax.vjp(scores, moved)
        p = jnp.exp2(s2 - lse2_c)
        if problem.features.dropout_rate > 0:
            dp = dp * _dropout_scale(context(consts), problem)
        ds = p * (dp - delta_c)
        (grads,) = vjp(ds / LOG2E)  # s2 = log2(e) * score
        return grads

    def accumulate(i, total):
        return jax.tree.map(jnp.add, total, chunk_gradient(i * chunk))

    moved = tuple(c for c, m in zip(consts, moving) if m)
    zeros = tuple(jnp.zeros(c.shape, jnp.float32) for c in moved)
    total = lax.fori_loop(0, t_pad // chunk, accumulate, zeros)
    return tuple(g.astype(c.dtype) for g, c in zip(total, moved))


def _dense_attention(problem: _Problem, q, k, v, bias, score_consts, q_len, kv_len, others: dict):
    """(out, lse) like the kernels, as XLA ops over query chunks: differentiable to any order, with a working
    set of one [B, N, chunk, S] chunk (rematerialised under reverse mode). Only second-order derivatives
    (a derivative of the forward-mode tangent) run it."""
    batch, t_pad, num_heads, _ = q.shape
    dv_pad = v.shape[3]
    shape = (batch, num_heads, t_pad, k.shape[1])
    chunk = _xla_chunk(*shape)
    optional = dict(others, bias=bias)
    v_spelling, v32 = _kv_operand(v.astype(jnp.float32), batch)

    @jax.checkpoint
    def one_chunk(start):
        context = _chunk_context(problem, shape, start, chunk, kv_len, optional, score_consts)
        s2, _ = _scores(_chunk_dot(q, k, start, chunk, problem.group, problem.precision), context, problem, True)
        m = lax.stop_gradient(jnp.max(s2, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp2(s2 - m)
        l = jnp.sum(p, axis=-1, keepdims=True)
        valid = (context.q_idx < q_len.reshape(batch, 1, 1, 1)) & (l != 0)  # as in the forward kernel
        safe_l = jnp.where(valid, l, 1.0)
        weights = jnp.where(valid, p / safe_l, 0.0)
        if problem.features.dropout_rate > 0:
            weights = weights * _dropout_scale(context, problem)
        weights = weights.reshape(batch, num_heads // problem.group, problem.group, chunk, -1)
        out = jnp.einsum(f"bkgcs,{v_spelling}->bckgd", weights, v32, precision=lax.Precision.HIGHEST)
        lse = jnp.where(valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)[..., 0]
        return out.reshape(batch, chunk, num_heads, dv_pad), lse

    outs, lses = lax.map(one_chunk, jnp.arange(0, t_pad, chunk, dtype=jnp.int32))
    out = jnp.moveaxis(outs, 0, 1).reshape(batch, t_pad, num_heads, dv_pad).astype(q.dtype)
    lse = jnp.moveaxis(lses, 0, 2).reshape(batch, num_heads, t_pad)
    return out, lse


# ------------------------------------------------------------------- the XLA path of a backend's kernels


def _dense_others(optional: dict) -> dict:
    return {name: x for name, x in optional.items() if name not in ("bias", "score_consts", "d_bias",
                                                                   "d_score_consts", "kv_tables", "q_tables")}


def dense_forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    """(out, lse) of the kernels' forward by `_dense_attention`, for calls the TPU kernels cannot take (the
    XLA path of `_dispatch`); a BlockMask's mask_mod is evaluated per element here, so its tables go unused."""
    if problem.features.return_max:
        raise NotImplementedError("the XLA path of the TPU backend has no max_scores output")
    return _dense_attention(problem, q, k, v, optional.get("bias"), optional["score_consts"], q_len, kv_len,
                            _dense_others(optional))


def dense_backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse) -> dict:
    """The gradients the backward kernels return (`_dispatch.backward`), by reverse mode through
    `_dense_attention`."""
    names = [name for name in ("q", "k", "v", "bias") if getattr(tangents, name)]
    others = _dense_others(res["others"])

    def dense(moving):
        args = dict(res, **moving)
        return _dense_attention(problem, args["q"], args["k"], args["v"], args["bias"], res["score_consts"],
                                res["q_len"], res["kv_len"], others)

    _, vjp = jax.vjp(dense, {name: res[name] for name in names})
    (grads,) = vjp((d_out.astype(res["out"].dtype), d_lse))
    return grads


def dense_tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, linear: dict, optional: dict):
    """(d out, d lse) of the tangent kernel (`_dispatch.tangent`), by forward mode through `_dense_attention`."""
    primals = dict(q=q, k=k, v=v, bias=optional.get("bias"), score_consts=tuple(optional["score_consts"]))
    moving = [name for name in ("q", "k", "v") if getattr(tangents, name)]
    if tangents.bias:
        moving.append("bias")
    tangent_of = dict(linear, bias=optional.get("d_bias"))
    consts_moving = tangents.score_consts

    def dense(moved, moved_consts):
        args = dict(primals, **moved)
        consts = _with_moving(primals["score_consts"], consts_moving, moved_consts)
        return _dense_attention(problem, args["q"], args["k"], args["v"], args["bias"], consts, q_len, kv_len,
                                _dense_others(optional))

    moved_consts = [c for c, m in zip(primals["score_consts"], consts_moving) if m]
    _, (d_out, d_lse) = jax.jvp(dense, ({name: primals[name] for name in moving}, moved_consts),
                                ({name: tangent_of[name] for name in moving}, list(optional["d_score_consts"])))
    return d_out, d_lse
