"""The Mosaic GPU kernels as the autodiff core calls them: a `_Problem` and its padded arrays turned into the
arguments of `mosaic_forward`, `mosaic_backward_dq` and `mosaic_backward_dkv` (Hopper's), `tcgen05_forward`,
`tcgen05_backward_dq` and `tcgen05_backward_dkv` (Blackwell's), with the hooks called from their
jaxprs prepared at the kernels' shapes. Which calls come here is `mosaic.plan`'s choice.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp

from probjax_kernels._hooks import Hook
from probjax_kernels._problem import _interpreted, _Problem, _Tangents
from probjax_kernels._tiles import refined_tables
from probjax_kernels.mosaic.backward import DQ_TILES, mosaic_backward_dq
from probjax_kernels.mosaic.backward_dkv import DKV_TILES, mosaic_backward_dkv
from probjax_kernels.mosaic.backward_tcgen05 import BLOCK_KV as TCGEN05_DKV_KEYS
from probjax_kernels.mosaic.backward_tcgen05 import DQ_BLOCK_KV as TCGEN05_DQ_KEYS
from probjax_kernels.mosaic.backward_tcgen05 import tcgen05_backward_dkv, tcgen05_backward_dq
from probjax_kernels.mosaic.common import after, allowed_in_window
from probjax_kernels.mosaic.forward import mosaic_forward
from probjax_kernels.mosaic.forward_tcgen05 import BLOCK_Q as TCGEN05_BLOCK_Q
from probjax_kernels.mosaic.forward_tcgen05 import hook_shapes as tcgen05_hook_shapes
from probjax_kernels.mosaic.forward_tcgen05 import tcgen05_forward
from probjax_kernels.mosaic.hook_vectors import hook_arrays
from probjax_kernels.mosaic.tangent import TANGENT_TILES, mosaic_tangent


MIN_HEAD_DIM = 64  # the kernels' narrowest head dim: a row of 128-byte swizzled 16-bit columns


def kernel_head_dims(head_dims: tuple[int, ...]) -> tuple[int, ...]:
    """The head dims the kernels run a call at: the padded ones, those under `MIN_HEAD_DIM` widened to it with
    zero columns (`_widened`), which change no score and add zero columns to out (as FlashAttention-3 rounds
    head dims up)."""
    return tuple(max(MIN_HEAD_DIM, d) for d in head_dims)


def _widened(*arrays):
    """`arrays` (None kept) with the last axis zero-padded to `MIN_HEAD_DIM` where it is narrower."""
    return tuple(x if x is None or x.shape[-1] >= MIN_HEAD_DIM else
                 jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, MIN_HEAD_DIM - x.shape[-1]),)) for x in arrays)


def _narrowed(results: tuple, head_dim: int) -> tuple:
    """`results` with the first (out, or its tangent) cut back to `head_dim` columns."""
    return (results[0][..., :head_dim], *results[1:])


def _mosaic_score_jvp_fn(hook: Hook | None) -> Callable | None:
    """`(score, b, h, q_idx, kv_idx, *array_refs) -> (score_mod(score), d score_mod / d score)` for the
    Mosaic backward kernels, from the hook's jvp jaxpr."""
    return None if hook is None else functools.partial(_call_score_jvp_in_mosaic, hook)


def _call_score_jvp_in_mosaic(hook: Hook, score, *indices_and_refs):
    num_indices = len(indices_and_refs) - len(hook.const_avals)
    indices, refs = indices_and_refs[:num_indices], indices_and_refs[num_indices:]
    moved = (False,) * len(hook.const_avals)
    return hook.jvp_in_kernel(refs, (), moved, score, jnp.ones_like(score), *indices)


def _mosaic_const_jvp_fn(hook: Hook, moved: tuple[bool, ...]) -> Callable:
    """`(score, b, h, q_idx, kv_idx, *array_refs, *tangent_refs) -> d score_mod` in the tangents of the hook's
    arrays flagged in `moved` (the score held), for the Mosaic tangent kernel, from the hook's jvp jaxpr."""
    return functools.partial(_call_const_jvp_in_mosaic, hook, moved)


def _call_const_jvp_in_mosaic(hook: Hook, moved: tuple[bool, ...], score, *indices_and_refs):
    indices, refs = indices_and_refs[:4], indices_and_refs[4:]
    arrays, tangents = refs[:len(hook.const_avals)], refs[len(hook.const_avals):]
    return hook.jvp_in_kernel(arrays, tangents, moved, score, jnp.zeros_like(score), *indices)[1]


def _mosaic_hook_fn(hook: Hook | None) -> Callable | None:
    """A hook as the Mosaic forward calls it, `fn(*args, *array_refs)`, from its jaxpr prepared at the
    kernel's shapes (never the user's Python again); hashable (a static argument) by the hook's identity."""
    return None if hook is None else functools.partial(_call_hook_in_mosaic, hook)


def _call_hook_in_mosaic(hook: Hook, *args_and_refs):
    num_args = len(args_and_refs) - len(hook.const_avals)
    return hook.in_kernel(args_and_refs[num_args:], *args_and_refs[:num_args])


def forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict, *, interpret: bool, block_kv: int):
    """(out, lse), and max_scores with `return_max`, of the padded inputs by the Mosaic GPU forward (calls that
    `mosaic.plan` takes; `interpret`: in the Mosaic GPU interpreter) on steps of `block_kv` keys
    (`plan.forward_block_kv`); a BlockMask's tables coarser than the kernel's tiles are refined to them
    (`refined_tables`); head dims under 64 widened (`kernel_head_dims`)."""
    f, cfg = problem.features, problem.config
    mask_fn, score_fn = _mosaic_hook_fn(f.mask_mod), _mosaic_hook_fn(f.score_mod)
    kv_tables = None
    if f.block_sizes is not None:
        kv_tables = refined_tables(optional["kv_tables"], f.block_sizes, (cfg.block_q, cfg.block_k))
    value_dim = v.shape[-1]
    q, k, v = _widened(q, k, v)
    return _narrowed(mosaic_forward(
        q, k, v, q_len, kv_len, scale=f.scale, causal=False, window=(f.window_left, f.window_right),
        block_q=cfg.block_q, block_kv=block_kv, num_stages=cfg.num_stages, interpret=interpret,
        kv_tables=kv_tables, mask_fn=mask_fn, score_fn=score_fn,
        **_hook_arrays(problem, optional["score_consts"], optional["mask_consts"], q.shape, k.shape[1]),
        **_segments(problem, optional, q.shape[0], q.shape[1], k.shape[1]), **_dropout(f, optional),
        return_max=f.return_max, bias=_bias(problem, optional["bias"], optional),
    ), value_dim)


def _hook_arrays(problem: _Problem, score_consts, mask_consts, q_shape: tuple, kv_len: int,
                 shapes: tuple | None = None) -> dict:
    """The kernels' `score_arrays` / `mask_arrays` and `score_vectors` / `mask_vectors`: the hooks' captured
    arrays, those read along q_idx / kv_idx as vectors (`hook_vectors.hook_arrays`; `shapes`: where the kernels
    call the hooks, else the Hopper forward's tiles)."""
    f, cfg = problem.features, problem.config
    batch, q_len, heads = q_shape[:3]
    lengths = {"q": q_len, "kv": kv_len}
    score_arrays, score_vectors = hook_arrays(f.score_mod, score_consts, cfg, True, batch, heads, lengths, shapes)
    mask_arrays, mask_vectors = hook_arrays(f.mask_mod, mask_consts, cfg, False, batch, heads, lengths, shapes)
    return dict(score_arrays=score_arrays, score_vectors=score_vectors, mask_arrays=mask_arrays,
                mask_vectors=mask_vectors)


def vector_mask(problem: _Problem) -> bool:
    """Whether the call's dense mask is a row or column vector the kernels take as segment ids (`_segments`):
    `[B|1, 1, T|1, S|1]` with T or S of 1 (a key padding mask, a query mask), in a call without segment ids."""
    shape = problem.mask_shape
    return shape is not None and shape[1] == 1 and 1 in shape[2:] and not problem.has_segments


def mask_as_bias(problem: _Problem) -> bool:
    """Whether the call's mask reaches the kernels as a float32 bias of 0 / -inf (`_bias`): a mask over keys or
    queries alone (`[B|1, N|1, 1, S]`, `[B|1, N|1, T, 1]`) that is not a `vector_mask` (one per head, or one
    beside segment ids), in a call without a bias or a score_mod (a bias acts before the score_mod, a mask
    after it)."""
    shape = problem.mask_shape
    return (shape is not None and 1 in shape[2:] and not vector_mask(problem) and problem.bias_shape is None
            and problem.features.score_mod is None)


def _bias(problem: _Problem, bias, optional: dict):
    """The kernels' bias: the call's `bias`, or its mask as 0 where kept and -inf where not (`mask_as_bias`)."""
    if not mask_as_bias(problem):
        return bias
    return jnp.where(optional["mask"] != 0, 0.0, -jnp.inf).astype(jnp.float32)


def _segments(problem: _Problem, optional: dict, batch: int, q_len: int, kv_len: int) -> dict:
    """The kernels' segment ids and dense mask: the call's, where a `vector_mask` becomes segment ids that
    attend exactly where it is True: a query's id is 0 where its row is kept and 1 where not, a key's 0 or 2,
    so ids match only when both are kept. A mask over queries and keys goes to the kernels as it is."""
    mask = optional.get("mask")
    if not vector_mask(problem):
        return dict(q_segment_ids=optional.get("q_segment_ids"), kv_segment_ids=optional.get("kv_segment_ids"),
                    mask=None if mask_as_bias(problem) else mask)
    mask = mask != 0
    rows = mask[:, 0, :, 0] if mask.shape[3] == 1 else jnp.ones((1, 1), bool)  # [B|1, T|1]
    keys = mask[:, 0, 0, :] if mask.shape[2] == 1 and mask.shape[3] > 1 else jnp.ones((1, 1), bool)  # [B|1, S|1]
    return dict(q_segment_ids=jnp.broadcast_to(jnp.where(rows, 0, 1), (batch, q_len)).astype(jnp.int32),
                kv_segment_ids=jnp.broadcast_to(jnp.where(keys, 0, 2), (batch, kv_len)).astype(jnp.int32))


def _dropout(f, optional: dict) -> dict:
    """The kernels' dropout arguments of a call (none without dropout): every backend's keep mask."""
    if not f.dropout_rate:
        return {}
    return dict(dropout_rate=f.dropout_rate, dropout_seed=optional["dropout_seed"],
                dropout_positions=f.dropout_positions, dropout_heads=f.dropout_heads)


def backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse, tiles: tuple[dict, dict]) -> dict:
    """Gradients of q, k, v and the bias (those flagged in `tangents`) by the Mosaic GPU dQ and dK/dV kernels
    (calls that `mosaic.plan._fits_mosaic`) on the tiles (dQ's, dK/dV's) of `mosaic.plan._mosaic_backward_tiles`.
    The bias gradient (`_bias_gradient`) comes from the dQ kernel (dS tiles, or row sums) or, for a bias whose
    T is 1, from dK/dV (key sums). The gradients of a score_mod's arrays come from `_chunked`, as on Triton."""
    q, k, v, out, lse, q_len, kv_len = (res[name] for name in ("q", "k", "v", "out", "lse", "q_len", "kv_len"))
    f, others, bias = problem.features, res["others"], res["bias"]
    dims = {"q": q.shape[-1], "k": k.shape[-1], "v": v.shape[-1]}  # head dims under 64 run widened
    q, k, v, out, d_out = _widened(q, k, v, out, d_out)
    options = dict(scale=f.scale, causal=False, window=(f.window_left, f.window_right),
                   interpret=_interpreted(problem), d_lse=d_lse, **_segments(problem, others, *q.shape[:2], k.shape[1]),
                   **_dropout(f, others), bias=_bias(problem, bias, others))
    key_bias = bias is not None and bias.shape[2] == 1  # its gradient: dS summed over queries, by dK/dV
    dq_options, dkv_options = (dict(t) for t in tiles)
    if f.score_mod is not None or f.mask_mod is not None:
        options.update(
            mask_fn=_mosaic_hook_fn(f.mask_mod), score_fn=_mosaic_hook_fn(f.score_mod),
            score_jvp=_mosaic_score_jvp_fn(f.score_mod),
            **_hook_arrays(problem, res["score_consts"], others["mask_consts"], q.shape, k.shape[1]),
        )
    if f.block_sizes is not None:  # each kernel reads the tables on its tile: (queries, keys), (keys, queries)
        dq_tile = (dq_options.get("block_q", DQ_TILES[0]), dq_options.get("block_kv", DQ_TILES[1]))
        dkv_tile = (dkv_options.get("block_kv", DKV_TILES[1]),
                    dkv_options.get("tables_block_q", dkv_options.get("block_q", DKV_TILES[0])))
        dq_options["kv_tables"] = refined_tables(others["kv_tables"], f.block_sizes, dq_tile)
        dkv_options["q_tables"] = refined_tables(others["q_tables"], f.block_sizes[::-1], dkv_tile)
    args = (q, k, v, out, lse, d_out, q_len, kv_len)
    grads, bias_parts = {}, None
    if tangents.q or (tangents.bias and not key_bias):
        dq = mosaic_backward_dq(*args, **options, **dq_options, bias_grad=tangents.bias and not key_bias)
        if tangents.bias and not key_bias:
            dq, bias_parts = dq
        grads["q"] = dq
    if tangents.k or tangents.v or (tangents.bias and key_bias):
        kv_len_padded = k.shape[1]
        args = (after(q, grads.get("q"), options["interpret"]), *_keys_up_to(DKV_TILES[1], k, v), *args[3:])
        dk, dv, *key_sums = mosaic_backward_dkv(*args, **_key_inputs_up_to(DKV_TILES[1], options), **dkv_options,
                                                bias_grad=tangents.bias and key_bias)
        grads.update({"k": dk[:, :kv_len_padded], "v": dv[:, :kv_len_padded]})
        bias_parts = key_sums[0][..., :kv_len_padded] if key_sums else bias_parts
    grads = {name: g[..., :dims[name]] for name, g in grads.items() if getattr(tangents, name)}
    if tangents.bias:
        grads["bias"] = _bias_gradient(problem, bias, bias_parts, q_len, kv_len)
    return grads


def _keys_up_to(multiple: int, *arrays) -> tuple:
    """k, v (`[B, S, K, D]`) with zero keys up to a multiple of `multiple`: the dK/dV kernel's 128-key CTA, where
    the forward's 64-key steps at head dim 256 padded S to 64 only (the new keys lie past kv_len)."""
    return tuple(jnp.pad(x, ((0, 0), (0, -x.shape[1] % multiple), (0, 0), (0, 0))) for x in arrays)


def _key_inputs_up_to(multiple: int, options: dict) -> dict:
    """The kernels' `options` with their arrays along keys (segment ids, a dense mask, a bias over keys) padded
    as `_keys_up_to` pads k and v."""
    options = dict(options)
    for name, axis in (("kv_segment_ids", 1), ("mask", 3), ("bias", 3)):
        x = options.get(name)
        if x is not None and x.shape[axis] > 1:
            options[name] = jnp.pad(x, [(0, -x.shape[axis] % multiple if i == axis else 0) for i in range(x.ndim)])
    return options


def tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, out, lse2, linear: dict, optional: dict,
            *, interpret: bool, options: tuple = ()):
    """(d out, d lse) for the tangents of q, k, v, the bias and a score_mod's arrays in `linear` (flagged in
    `tangents`) by the Mosaic GPU tangent kernel (calls that `mosaic.plan._mosaic_tangent_options`) on
    (block_q, 64) tiles with that plan's `options` (at head dim 256: ring slots, pieces, split); a BlockMask's
    tables refined to them; head dims under 64 widened."""
    f = problem.features
    value_dim = v.shape[-1]
    q, k, v, out = _widened(q, k, v, out)
    dq, dk, dv = _widened(linear.get("q"), linear.get("k"), linear.get("v"))
    options = dict(scale=f.scale, causal=False, window=(f.window_left, f.window_right), interpret=interpret,
                   block_q=TANGENT_TILES[0], block_kv=TANGENT_TILES[1],
                   **_segments(problem, optional, *q.shape[:2], k.shape[1]), **_dropout(f, optional),
                   bias=_bias(problem, optional["bias"], optional), d_bias=linear.get("bias"), **dict(options))
    if f.score_mod is not None or f.mask_mod is not None:
        options.update(
            mask_fn=_mosaic_hook_fn(f.mask_mod), score_fn=_mosaic_hook_fn(f.score_mod),
            score_jvp=_mosaic_score_jvp_fn(f.score_mod),
            **_hook_arrays(problem, optional["score_consts"], optional["mask_consts"], q.shape, k.shape[1]),
        )
    if any(tangents.score_consts):  # read one element at a time, as the arrays are (`plan`)
        options.update(score_tangents=tuple(linear["score_consts"]),
                       score_const_jvp=_mosaic_const_jvp_fn(f.score_mod, tuple(tangents.score_consts)))
    if f.block_sizes is not None:
        options["kv_tables"] = refined_tables(optional["kv_tables"], f.block_sizes, TANGENT_TILES)
    return _narrowed(mosaic_tangent(q, k, v, out, lse2, q_len, kv_len, dq=dq, dk=dk, dv=dv, **options), value_dim)


def _bias_gradient(problem: _Problem, bias, parts, q_len, kv_len):
    """The bias gradient from the kernels' `parts`: dS `[B, N, T, S]` (bias tiles; zero where the window and
    lengths let no pair attend, tiles the dQ kernel never visits), dS summed over keys `[B, N, T]` (S of 1) or
    over queries `[B, N, S]` (T of 1), then summed over the bias's broadcast axes, in its dtype."""
    f = problem.features
    if bias.shape[2] > 1 and bias.shape[3] > 1:
        rows = jnp.arange(parts.shape[2]).reshape(1, 1, -1, 1)
        cols = jnp.arange(parts.shape[3]).reshape(1, 1, 1, -1)
        attends = allowed_in_window(rows, cols, kv_len.reshape(-1, 1, 1, 1), f.window_left, f.window_right)
        parts = jnp.where(attends & (rows < q_len.reshape(-1, 1, 1, 1)), parts, 0.0)
    elif bias.shape[2] > 1:
        parts = parts[..., None]
    else:
        parts = parts[:, :, None, :]
    broadcast = tuple(axis for axis, size in enumerate(bias.shape) if size == 1)
    return jnp.sum(parts, axis=broadcast, keepdims=True).astype(bias.dtype)


def _tcgen05_hooks(problem: _Problem, score_consts, mask_consts, q_shape: tuple, kv_len: int) -> dict:
    """The tcgen05 kernels' hooks and their arrays, read one element at a time or as vectors along q_idx /
    kv_idx at the padded lengths (`_hook_arrays`; `plan._tcgen05_takes`)."""
    f = problem.features
    return dict(score_fn=_mosaic_hook_fn(f.score_mod), mask_fn=_mosaic_hook_fn(f.mask_mod),
                **_hook_arrays(problem, score_consts or (), mask_consts or (), q_shape, kv_len,
                               tcgen05_hook_shapes(problem.config.block_k)))


def forward_tcgen05(problem: _Problem, q, k, v, q_len, kv_len, optional: dict, *, interpret: bool):
    """(out, lse), and max_scores with `return_max`, of the padded inputs by the Blackwell forward
    (`forward_tcgen05`; calls that `mosaic.plan._tcgen05_takes`), on the config's key steps and stages;
    `interpret`: in the Mosaic GPU interpreter; head dims under 64 widened."""
    f, cfg = problem.features, problem.config
    kv_tables = None
    if f.block_sizes is not None:
        kv_tables = refined_tables(optional["kv_tables"], f.block_sizes, (TCGEN05_BLOCK_Q, cfg.block_k))
    value_dim = v.shape[-1]
    q, k, v = _widened(q, k, v)
    return _narrowed(tcgen05_forward(
        q, k, v, q_len, kv_len, scale=f.scale, causal=False, window=(f.window_left, f.window_right),
        block_kv=cfg.block_k, num_stages=cfg.num_stages, interpret=interpret, return_max=f.return_max,
        kv_tables=kv_tables, **_dropout(f, optional), bias=_bias(problem, optional["bias"], optional),
        **_segments(problem, optional, q.shape[0], q.shape[1], k.shape[1]),
        **_tcgen05_hooks(problem, optional["score_consts"], optional["mask_consts"], q.shape, k.shape[1]),
    ), value_dim)


def backward_tcgen05(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse, *, interpret: bool) -> dict:
    """Gradients of q, k, v (those flagged in `tangents`) by the Blackwell dQ and dK/dV kernels (the calls of
    `forward_tcgen05` whose score_mod's derivative lowers too); `interpret`: in the Mosaic GPU interpreter.
    dK/dV works on 128-key tiles: where the padded S is not a multiple of 128, k and v (and the keys' segment ids,
    hook vectors and mask columns) get keys up to one (masked: past kv_len) and their gradients are cut back.
    The gradients of a score_mod's arrays come from `_chunked`, as on Triton. Head dims under 64 run widened."""
    q, k, v, out, lse, q_len, kv_len = (res[name] for name in ("q", "k", "v", "out", "lse", "q_len", "kv_len"))
    f, others = problem.features, res["others"]
    dims = {"q": q.shape[-1], "k": k.shape[-1], "v": v.shape[-1]}
    q, k, v, out, d_out = _widened(q, k, v, out, d_out)
    options = dict(scale=f.scale, causal=False, window=(f.window_left, f.window_right), interpret=interpret,
                   d_lse=d_lse, score_jvp=_mosaic_score_jvp_fn(f.score_mod), **_dropout(f, others))
    masks = _segments(problem, others, *q.shape[:2], k.shape[1])
    hooks = functools.partial(_tcgen05_hooks, problem, res["score_consts"], others["mask_consts"], q.shape)
    dq_options, dkv_options = {}, {}
    if f.block_sizes is not None:  # dQ's tiles are (128, DQ_BLOCK_KV), dK/dV's (128 keys, 128 queries)
        dq_options["kv_tables"] = refined_tables(others["kv_tables"], f.block_sizes, (TCGEN05_BLOCK_Q, TCGEN05_DQ_KEYS))
        dkv_options["q_tables"] = refined_tables(others["q_tables"], f.block_sizes[::-1],
                                                 (TCGEN05_DKV_KEYS, TCGEN05_BLOCK_Q))
    grads = {}
    if tangents.q:
        grads["q"] = tcgen05_backward_dq(q, k, v, out, lse, d_out, q_len, kv_len, **options, **dq_options,
                                         **masks, **hooks(k.shape[1]))
    if tangents.k or tangents.v:
        kv_len_padded = k.shape[1]
        extra = ((0, 0), (0, -kv_len_padded % TCGEN05_DKV_KEYS), (0, 0), (0, 0))
        if masks.get("kv_segment_ids") is not None:
            masks["kv_segment_ids"] = jnp.pad(masks["kv_segment_ids"], extra[:2])
        if masks.get("mask") is not None:  # its padded keys are masked: past kv_len
            masks["mask"] = jnp.pad(masks["mask"], extra[:3] + ((0, extra[1][1]),))
        dk, dv = tcgen05_backward_dkv(after(q, grads.get("q"), interpret), jnp.pad(k, extra), jnp.pad(v, extra),
                                      out, lse, d_out, q_len, kv_len, **options, **dkv_options, **masks,
                                      **hooks(kv_len_padded + extra[1][1]))
        grads.update(k=dk[:, :kv_len_padded], v=dv[:, :kv_len_padded])
    return {name: g[..., :dims[name]] for name, g in grads.items() if getattr(tangents, name)}
