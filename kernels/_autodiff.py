"""The autodiff structure and the entry point of the kernel core.

`_attention` is a custom_jvp whose tangent is `custom_linear`: applied, it is the tangent kernel (jax.jvp);
transposed, it is the backward kernels (jax.grad, through jax.linearize); differentiated in its residuals
(second order: grad of jvp, hessian), it is `_dense_attention` under jax.jvp. `attention` asks `_dispatch` for
the call's frozen `Plan` once, pads the inputs to its sizes and calls it; the rules below run the plan's
passes and ask nothing more.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from probjax_kernels import _dispatch
from probjax_kernels._backend import Plan
from probjax_kernels._chunked import _dense_attention, _score_const_gradients, _with_moving
from probjax_kernels._config import CALLBACK_INTERPRETERS, FlashConfig
from probjax_kernels._dropout import SEED_PARTS
from probjax_kernels._linear import custom_linear
from probjax_kernels._problem import Features, _Tangents
from probjax_kernels._scores import backward_delta, base2_lse


def _backward(plan: Plan, tangents: _Tangents, res: dict, d_out, d_lse) -> dict:
    """The transpose of the tangent map: gradients of the inputs flagged in `tangents`, by the plan's backward
    kernels, and those of a score_mod's arrays by an XLA pass (the same on every backend), except the arrays
    the TPU kernels read as tiles, whose gradients those kernels accumulate."""
    kernels = plan.backward
    grads = kernels.run(kernels.problem, tangents, res, d_out, d_lse, **dict(kernels.options))
    problem = plan.problem
    # The TPU kernels accumulate the gradients of arrays read as tiles (`tpu/hook_grads.py`), by position.
    from_kernels = grads.pop("score_consts_by_index", {})
    rest = tuple(m and i not in from_kernels for i, m in enumerate(tangents.score_consts))
    if any(rest):
        q, k, v, out, lse = res["q"], res["k"], res["v"], res["out"], res["lse"]
        delta, lse2 = backward_delta(out, lse, d_out, d_lse), base2_lse(lse)
        optional = dict(res["others"], bias=res["bias"], score_consts=res["score_consts"])
        from_xla = iter(_score_const_gradients(
            problem, q, k, v, res["kv_len"], d_out, lse2, delta, optional, res["score_consts"], rest,
        ))
        from_kernels.update({i: next(from_xla) for i, m in enumerate(rest) if m})
    if any(tangents.score_consts):
        grads["score_consts"] = tuple(from_kernels[i] for i, m in enumerate(tangents.score_consts) if m)
    return grads


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _attention(plan: Plan, q, k, v, bias, score_consts, q_len, kv_len, others: dict):
    """Padded inputs in, (out, lse) padded out, and the row max with `features.return_max` (no derivative).
    `others` holds the inputs without derivatives."""
    kernels, optional = plan.forward, dict(others, bias=bias, score_consts=score_consts)
    return tuple(kernels.run(kernels.problem, q, k, v, q_len, kv_len, optional, **dict(kernels.options)))


def _is_zero(t) -> bool:
    return t is None or isinstance(t, jax.custom_derivatives.SymbolicZero)


@functools.partial(_attention.defjvp, symbolic_zeros=True)
def _attention_jvp(plan: Plan, primals, tangents_in):
    q, k, v, bias, score_consts, q_len, kv_len, others = primals
    dq, dk, dv, d_bias, d_consts = tangents_in[:5]
    # The primal through `_attention` itself, so that an outer derivative of this rule (second order) finds it.
    primal_out = _attention(plan, q, k, v, bias, score_consts, q_len, kv_len, others)
    out, lse = primal_out[:2]
    no_max = tuple(jnp.zeros_like(x) for x in primal_out[2:])  # max_scores is not differentiated
    linear = {name: t for name, t in (("q", dq), ("k", dk), ("v", dv), ("bias", d_bias)) if not _is_zero(t)}
    moving_consts = tuple(not _is_zero(t) for t in d_consts)
    if any(moving_consts):
        linear["score_consts"] = tuple(t for t in d_consts if not _is_zero(t))
    tangents = _Tangents(q="q" in linear, k="k" in linear, v="v" in linear, bias="bias" in linear,
                         score_consts=moving_consts)
    if not linear:
        return primal_out, (jnp.zeros_like(out), jnp.zeros_like(lse), *no_max)
    residuals = dict(q=q, k=k, v=v, out=out, lse=lse, bias=bias, score_consts=score_consts, q_len=q_len,
                     kv_len=kv_len, others=others)
    res_flat, res_tree = jax.tree.flatten(residuals)
    lin_flat, lin_tree = jax.tree.flatten(linear)
    unflatten_res = functools.partial(jax.tree.unflatten, res_tree)
    unflatten_lin = functools.partial(jax.tree.unflatten, lin_tree)

    def apply(res_flat, lin_flat):
        res, lin = unflatten_res(res_flat), unflatten_lin(lin_flat)
        optional = dict(res["others"], bias=res["bias"], score_consts=res["score_consts"],
                        d_bias=lin.get("bias"), d_score_consts=lin.get("score_consts", ()))
        kernels = plan.tangent
        return kernels.run(kernels.problem, tangents, res["q"], res["k"], res["v"], res["q_len"], res["kv_len"],
                           res["out"], base2_lse(res["lse"]), lin, optional, **dict(kernels.options))

    def transpose(res_flat, cts):
        grads = _backward(plan, tangents, unflatten_res(res_flat), *cts)
        return jax.tree.leaves({name: grads[name] for name in linear})

    def reference(res_flat, lin_flat):
        res, lin = unflatten_res(res_flat), unflatten_lin(lin_flat)
        moving = [c for c, m in zip(res["score_consts"], tangents.score_consts) if m]

        def dense(q, k, v, bias, moving):
            consts = _with_moving(res["score_consts"], tangents.score_consts, moving)
            return _dense_attention(plan.problem, q, k, v, bias, consts, res["q_len"], res["kv_len"],
                                    res["others"])

        zero = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731
        primal = (res["q"], res["k"], res["v"], res["bias"], moving)
        tangent = tuple(lin.get(name, zero(x)) for name, x in zip(("q", "k", "v", "bias"), primal[:4]))
        _, d = jax.jvp(dense, primal, (*tangent, list(lin.get("score_consts", ()))))
        return list(d)

    out_specs = [jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(lse.shape, lse.dtype)]
    d_out, d_lse = custom_linear(apply, transpose, reference, res_flat, lin_flat, out_specs,
                                 interpreted=plan.problem.config.backend in CALLBACK_INTERPRETERS)
    return primal_out, (d_out, d_lse, *no_max)


# ---------------------------------------------------------------------------------------------- entry point


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pads one axis of x up to `size` (no-op when it already has that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    features: Features,
    config: FlashConfig | None,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    dropout_seed: jax.Array | None = None,
    score_consts: tuple = (),
    mask_consts: tuple = (),
    kv_tables: tuple | None = None,
    q_tables: tuple | None = None,
    cotangents: tuple | None = None,
) -> tuple[jax.Array, ...]:
    """Runs the kernels on checked inputs (see `_inputs.check_inputs`); returns (out, lse) unpadded, and the row
    max `[B, N, T]` with `features.return_max`. v may have its own head dim Dv, and k / v batch 1 against q's B.

    `bias` / `mask` are 4-D with 1 on broadcast axes; `kv_tables` / `q_tables` are the block tables of a
    `BlockMask` (num_partial, partial_indices, num_full, full_indices), for the query-tile kernels and the
    key-tile kernel respectively; their tile is `features.block_sizes`.

    With `cotangents` = (out, lse, d_out, d_lse) it runs only the backward kernels and returns (dq, dk, dv):
    the gradients of these keys' part of an attention whose output and lse over all keys are `out`, `lse`
    (`ring_attention`'s blocks: the probabilities exp(s - lse) are the whole sequence's). No bias or hooks.
    """
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, value_dim = k.shape[1], v.shape[3]
    if bias is not None and kv_tables is not None:
        # The dQ kernel zero-fills the bias gradient outside its index ranges; block tables have none.
        raise NotImplementedError("a dense bias with block tables: pass the bias through a score_mod instead.")
    plan = _dispatch.plan(
        features, config, q_shape=q.shape, k_shape=k.shape, value_dim=value_dim, dtype=q.dtype,
        bias_shape=None if bias is None else bias.shape, mask_shape=None if mask is None else mask.shape,
        table_shape=None if kv_tables is None else kv_tables[0].shape[:2], has_segments=q_segment_ids is not None,
        num_score_consts=len(score_consts), num_mask_consts=len(mask_consts),
        bias_dtype=None if bias is None else jnp.dtype(bias.dtype).name,
    )
    t_pad, s_pad, d_pad, dv_pad = plan.t_pad, plan.s_pad, plan.d_pad, plan.dv_pad

    def pad_4d(x, seq_size, dim_size=d_pad):
        return _pad_axis(_pad_axis(x, 1, seq_size), 3, dim_size)

    def pad_broadcastable(x):
        # Only the sequence axes that are not broadcast get padded; padded bias is 0 and padded mask False.
        if x.shape[2] > 1:
            x = _pad_axis(x, 2, t_pad)
        if x.shape[3] > 1:
            x = _pad_axis(x, 3, s_pad)
        return x

    others = {"mask_consts": tuple(mask_consts)}
    if mask is not None:
        # Triton loads of i1 are awkward; int8 costs one byte per element of the mask as given.
        others["mask"] = pad_broadcastable(mask.astype(jnp.int8))
    if q_segment_ids is not None:
        others["q_segment_ids"] = _pad_axis(q_segment_ids, 1, t_pad)
        others["kv_segment_ids"] = _pad_axis(kv_segment_ids, 1, s_pad)
    if features.dropout_rate > 0:
        seed_shape = () if features.dropout_positions is None else (SEED_PARTS,)  # positional_seed's
        others["dropout_seed"] = jnp.asarray(dropout_seed).astype(jnp.uint32).reshape(seed_shape)
    if kv_tables is not None:
        others["kv_tables"], others["q_tables"] = tuple(kv_tables), tuple(q_tables)
    bias = None if bias is None else pad_broadcastable(bias)
    if q_lengths is None:
        q_lengths = jnp.full((batch,), q_len, jnp.int32)
    if kv_lengths is None:
        kv_lengths = jnp.full((batch,), kv_len, jnp.int32)
    if cotangents is not None:
        out, lse, d_out, d_lse = cotangents
        res = dict(q=pad_4d(q, t_pad), k=pad_4d(k, s_pad), v=pad_4d(v, s_pad, dv_pad),
                   out=pad_4d(out, t_pad, dv_pad),
                   lse=jnp.pad(lse, ((0, 0), (0, 0), (0, t_pad - q_len)), constant_values=-jnp.inf), bias=None,
                   score_consts=(), q_len=q_lengths, kv_len=kv_lengths, others=others)
        tangents = _Tangents(q=True, k=True, v=True, bias=False, score_consts=())
        grads = _backward(plan, tangents, res, pad_4d(d_out, t_pad, dv_pad), _pad_axis(d_lse, 2, t_pad))
        return (grads["q"][:, :q_len, :, :head_dim], grads["k"][:, :kv_len, :, :head_dim],
                grads["v"][:, :kv_len, :, :value_dim])
    out, *rows = _attention(
        plan, pad_4d(q, t_pad), pad_4d(k, s_pad), pad_4d(v, s_pad, dv_pad), bias, tuple(score_consts),
        q_lengths, kv_lengths, others,
    )
    return (out[:, :q_len, :, :value_dim], *(row[:, :, :q_len] for row in rows))
