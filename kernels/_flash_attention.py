"""Flash attention in Pallas: forward, dQ and dK/dV kernels (FlashAttention-2) under one `jax.custom_vjp`.

Notation (FlashAttention-2, Alg. 1 and 2): per query row, m_i is the running max of the scores and l_i the
running sum of exp(s - m_i); lse = m + log l. Scores are kept in the base-2 domain inside the kernels
(s2 = s * log2(e)) so that every exponential is an exp2, with log2(e) folded into the softmax scale.

The wrapper pads T, S to a multiple of the tiles and D to a power of two (Triton needs power-of-two tiles),
and masks the padding through the key/query lengths, so callers never pad. Masking is index-based: key
lengths, causal / local windows, segment ids and an optional dense bool mask. Tiles that no (query, key)
pair of the mask reaches are skipped in all three kernels; tiles that every pair reaches skip the per-element
mask. Query rows past `q_lengths` (and fully masked rows) give output 0 and lse -inf; the backward pass sees
them as lse = +inf, hence p = 0 and exactly zero gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from probjax_kernels import _triton
from probjax_kernels._config import FlashConfig, default_config
from probjax_kernels._inputs import AttentionInputs, check_inputs

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_MASKED = -jnp.inf
_M_INIT = float(jnp.finfo(jnp.float32).min)  # finite, so exp2(m_old - m_new) is never (-inf) - (-inf)


@dataclasses.dataclass(frozen=True)
class _Problem:
    """The static (hashable) part of one attention call; the arrays travel separately."""

    scale: float
    window_left: int | None  # a query at row r sees keys in [r - left, r + right]; None = unbounded
    window_right: int | None
    group: int  # query heads per key/value head
    bias_shape: tuple[int, int, int, int] | None  # padded, with 1 on broadcast dims
    mask_shape: tuple[int, int, int, int] | None
    has_segments: bool
    config: FlashConfig  # every field filled
    precision: lax.Precision

    @property
    def per_element_mask_everywhere(self) -> bool:
        """Segments and dense masks can cut any tile, so no tile may skip the per-element mask."""
        return self.has_segments or self.mask_shape is not None


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """Refs of one program's optional mask / bias inputs (None when absent)."""

    q_segment_ids: object = None
    kv_segment_ids: object = None
    bias: object = None
    mask: object = None


# ----------------------------------------------------------------------------------------------- tile ranges


def _cdiv(a, b: int):
    return (a + b - 1) // b


def _kv_tile_range(q_tile, q_len, kv_len, block_q: int, block_k: int, problem: _Problem, num_tiles: int):
    """KV tiles that query tile `q_tile` needs: masked [lo, full_lo), unmasked [full_lo, full_hi), masked
    [full_hi, hi), all within [0, num_tiles). Traced int32 scalars in, traced int32 scalars out."""
    left, right = problem.window_left, problem.window_right
    row0 = q_tile * block_q
    row_last = jnp.minimum(row0 + block_q, q_len) - 1
    lo = jnp.int32(0) if left is None else jnp.maximum(row0 - left, 0) // block_k
    key_end = kv_len if right is None else jnp.minimum(kv_len, row_last + right + 1)
    hi = jnp.where(row_last >= row0, jnp.maximum(_cdiv(key_end, block_k), lo), lo)
    lo, hi = jnp.minimum(lo, num_tiles), jnp.minimum(hi, num_tiles)
    if problem.per_element_mask_everywhere:
        return lo, hi, hi, hi
    full_lo = lo if left is None else _cdiv(jnp.maximum(row0 + block_q - 1 - left, 0), block_k)
    full_hi = kv_len // block_k
    if right is not None:
        full_hi = jnp.minimum(full_hi, (row0 + right + 1) // block_k)
    full_lo = jnp.clip(full_lo, lo, hi)
    return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def _q_tile_range(kv_tile, q_len, kv_len, block_q: int, block_k: int, problem: _Problem, num_tiles: int):
    """Query tiles that KV tile `kv_tile` is seen by, split like `_kv_tile_range`."""
    left, right = problem.window_left, problem.window_right
    key0 = kv_tile * block_k
    key_last = jnp.minimum(key0 + block_k, kv_len) - 1
    lo = jnp.int32(0) if right is None else jnp.maximum(key0 - right, 0) // block_q
    row_end = q_len if left is None else jnp.minimum(q_len, key_last + left + 1)
    hi = jnp.where(key_last >= key0, jnp.maximum(_cdiv(row_end, block_q), lo), lo)
    lo, hi = jnp.minimum(lo, num_tiles), jnp.minimum(hi, num_tiles)
    if problem.per_element_mask_everywhere:
        return lo, hi, hi, hi
    full_lo = lo if right is None else _cdiv(jnp.maximum(key0 + block_k - 1 - right, 0), block_q)
    full_hi = hi if left is None else (key0 + left + 1) // block_q
    # A KV tile that straddles kv_len needs the per-element mask against every query tile.
    full_hi = jnp.where(key0 + block_k <= kv_len, full_hi, 0)
    full_lo = jnp.clip(full_lo, lo, hi)
    return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def _run_tiles(tile_range, body, carry):
    """Runs body(tile, carry, masked) over the three ranges of `_kv_tile_range` / `_q_tile_range`."""
    lo, full_lo, full_hi, hi = tile_range
    carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


# ------------------------------------------------------------------------------------------- shared tile math


def _scores(q, k, q_idx, kv_idx, kv_len, bias, mask, q_seg, kv_seg, problem: _Problem, masked: bool):
    """Base-2 scores s2 = log2(e) * (scale * q k^T + bias) of one (bq, bk) tile, -inf where masked."""
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=problem.precision
    )
    s = s * (problem.scale * LOG2E)
    if bias is not None:
        s = s + bias.astype(jnp.float32) * LOG2E
    if not masked:
        return s
    allowed = kv_idx < kv_len
    if problem.window_right is not None:
        allowed &= kv_idx <= q_idx + problem.window_right
    if problem.window_left is not None:
        allowed &= kv_idx >= q_idx - problem.window_left
    if q_seg is not None:
        allowed &= q_seg[:, None] == kv_seg[None, :]
    if mask is not None:
        allowed &= mask != 0
    return jnp.where(allowed, s, _MASKED)


def _dot(a, b, contract: tuple[int, int], precision):
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32,
        precision=precision,
    )


def _load_2d(ref, row_start, rows, col_start, cols, head=None):
    """A (rows|1, cols|1) tile of a bias / mask block, honouring broadcast axes of size 1.

    A 3-D block carries the query heads of one KV head (dK/dV kernel); `head` picks one. The index is built
    as one tuple because the Triton lowering takes a single indexer per load.
    """
    head_index = (head,) if len(ref.shape) == 3 else ()
    row_axis, col_axis = ref.shape[-2], ref.shape[-1]
    row_slice = pl.ds(row_start, rows) if row_axis > 1 else slice(None)
    col_slice = pl.ds(col_start, cols) if col_axis > 1 else slice(None)
    return ref[(*head_index, row_slice, col_slice)]


# ---------------------------------------------------------------------------------------------- forward kernel


def _forward_kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, *refs, problem: _Problem, tiles_fn):
    *input_refs, out_ref, lse_ref = refs
    tiles: _Tiles = tiles_fn(input_refs)
    cfg = problem.config
    block_q, block_k = cfg.block_q, cfg.block_k
    q_tile = pl.program_id(0)
    q_len, kv_len = q_len_ref[...], kv_len_ref[...]
    q = q_ref[...]
    head_dim = q.shape[-1]
    q_idx = q_tile * block_q + jnp.arange(block_q)[:, None]
    q_seg = None if tiles.q_segment_ids is None else tiles.q_segment_ids[...]

    def body(kv_tile, carry, masked: bool):
        acc, m, l = carry
        start = kv_tile * block_k
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        kv_idx = start + jnp.arange(block_k)[None, :]
        bias = None if tiles.bias is None else _load_2d(tiles.bias, 0, block_q, start, block_k)
        mask = None if tiles.mask is None else _load_2d(tiles.mask, 0, block_q, start, block_k)
        kv_seg = None if tiles.kv_segment_ids is None else tiles.kv_segment_ids[pl.ds(start, block_k)]
        s = _scores(q, k, q_idx, kv_idx, kv_len, bias, mask, q_seg, kv_seg, problem, masked)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, (1, 0), problem.precision)
        return acc, m_new, l

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), _M_INIT, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    tile_range = _kv_tile_range(q_tile, q_len, kv_len, block_q, block_k, problem, k_ref.shape[0] // block_k)
    acc, m, l = _run_tiles(tile_range, body, carry)
    row_valid = (q_idx[:, 0] < q_len) & (l > 0)
    safe_l = jnp.where(row_valid, l, 1.0)
    out_ref[...] = jnp.where(row_valid[:, None], acc / safe_l[:, None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(row_valid, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)


# --------------------------------------------------------------------------------------------- backward: dQ


def _dq_kernel(
    q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, do_ref, lse2_ref, delta_ref, *refs, problem: _Problem,
    tiles_fn, emit_ds: bool,
):
    if emit_ds:
        *input_refs, dq_ref, ds_ref = refs
    else:
        *input_refs, dq_ref = refs
    tiles: _Tiles = tiles_fn(input_refs)
    cfg = problem.config
    block_q, block_k = cfg.block_q_dq, cfg.block_k_dq
    q_tile = pl.program_id(0)
    q_len, kv_len = q_len_ref[...], kv_len_ref[...]
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse2_ref[...], delta_ref[...]
    q_idx = q_tile * block_q + jnp.arange(block_q)[:, None]
    q_seg = None if tiles.q_segment_ids is None else tiles.q_segment_ids[...]

    def body(kv_tile, dq, masked: bool):
        start = kv_tile * block_k
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        kv_idx = start + jnp.arange(block_k)[None, :]
        bias = None if tiles.bias is None else _load_2d(tiles.bias, 0, block_q, start, block_k)
        mask = None if tiles.mask is None else _load_2d(tiles.mask, 0, block_q, start, block_k)
        kv_seg = None if tiles.kv_segment_ids is None else tiles.kv_segment_ids[pl.ds(start, block_k)]
        s = _scores(q, k, q_idx, kv_idx, kv_len, bias, mask, q_seg, kv_seg, problem, masked)
        p = jnp.exp2(s - lse2[:, None])
        dp = _dot(do, v, (1, 1), problem.precision)
        ds = p * (dp - delta[:, None])
        if emit_ds:
            ds_ref[:, pl.ds(start, block_k)] = ds
        return dq + _dot(ds.astype(k.dtype), k, (1, 0), problem.precision)

    tile_range = _kv_tile_range(q_tile, q_len, kv_len, block_q, block_k, problem, k_ref.shape[0] // block_k)
    dq = _run_tiles(tile_range, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * problem.scale).astype(dq_ref.dtype)
    if emit_ds:
        # Skipped tiles still need their zeros: Pallas outputs start uninitialised.
        def zero_tile(kv_tile, _):
            ds_ref[:, pl.ds(kv_tile * block_k, block_k)] = jnp.zeros((block_q, block_k), jnp.float32)

        lo, hi = tile_range[0], tile_range[3]
        lax.fori_loop(0, lo, zero_tile, None)
        lax.fori_loop(hi, k_ref.shape[0] // block_k, zero_tile, None)


# ------------------------------------------------------------------------------------------ backward: dK, dV


def _dkv_kernel(
    q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, do_ref, lse2_ref, delta_ref, *refs, problem: _Problem,
    tiles_fn,
):
    *input_refs, dk_ref, dv_ref = refs
    tiles: _Tiles = tiles_fn(input_refs)
    cfg = problem.config
    block_q, block_k = cfg.block_q_dkv, cfg.block_k_dkv
    kv_tile = pl.program_id(0)
    q_len, kv_len = q_len_ref[...], kv_len_ref[...]
    k, v = k_ref[...], v_ref[...]
    kv_idx = kv_tile * block_k + jnp.arange(block_k)[None, :]
    kv_seg = None if tiles.kv_segment_ids is None else tiles.kv_segment_ids[...]
    tile_range = _q_tile_range(kv_tile, q_len, kv_len, block_q, block_k, problem, q_ref.shape[0] // block_q)

    def head_body(head, carry):
        # K/V stay resident while the loop walks the query tiles of every query head of this KV head (GQA).
        def body(q_tile, carry, masked: bool):
            dk, dv = carry
            start = q_tile * block_q
            q = q_ref[pl.ds(start, block_q), head, :]
            do = do_ref[pl.ds(start, block_q), head, :]
            lse2 = lse2_ref[head, pl.ds(start, block_q)]
            delta = delta_ref[head, pl.ds(start, block_q)]
            q_idx = start + jnp.arange(block_q)[:, None]
            bias = None if tiles.bias is None else _load_2d(tiles.bias, start, block_q, 0, block_k, head)
            mask = None if tiles.mask is None else _load_2d(tiles.mask, start, block_q, 0, block_k, head)
            q_seg = None if tiles.q_segment_ids is None else tiles.q_segment_ids[pl.ds(start, block_q)]
            s = _scores(q, k, q_idx, kv_idx, kv_len, bias, mask, q_seg, kv_seg, problem, masked)
            p = jnp.exp2(s - lse2[:, None])
            dv = dv + _dot(p.astype(do.dtype), do, (0, 0), problem.precision)
            dp = _dot(do, v, (1, 1), problem.precision)
            ds = p * (dp - delta[:, None])
            dk = dk + _dot(ds.astype(q.dtype), q, (0, 0), problem.precision)
            return dk, dv

        return _run_tiles(tile_range, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, problem.group, head_body, (zeros, zeros))
    dk_ref[...] = (dk * problem.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------- block specs


def _tiles_fn(problem: _Problem):
    """Maps the trailing optional input refs of a kernel to a `_Tiles` in the order `_optional_inputs` uses."""

    def tiles(refs):
        refs = list(refs)
        q_seg = kv_seg = bias = mask = None
        if problem.has_segments:
            q_seg, kv_seg = refs.pop(0), refs.pop(0)
        if problem.bias_shape is not None:
            bias = refs.pop(0)
        if problem.mask_shape is not None:
            mask = refs.pop(0)
        return _Tiles(q_seg, kv_seg, bias, mask)

    return tiles


def _optional_inputs(arrays: dict, problem: _Problem, kind: str, block_q: int, block_k: int):
    """Arrays and BlockSpecs of the optional inputs (segments, bias, mask) for a "q" or "kv" kernel grid.

    "q" grids are (q_tile, b, h) and see one query tile against the whole key axis; "kv" grids are
    (kv_tile, b, kv_head) and see one key tile against the whole query axis of the group's query heads.
    """
    group = problem.group
    inputs, specs = [], []
    if problem.has_segments:
        t_pad, s_pad = arrays["q_segment_ids"].shape[1], arrays["kv_segment_ids"].shape[1]
        inputs += [arrays["q_segment_ids"], arrays["kv_segment_ids"]]
        if kind == "q":
            specs += [
                pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
                pl.BlockSpec((None, s_pad), lambda i, b, h: (b, 0)),
            ]
        else:
            specs += [
                pl.BlockSpec((None, t_pad), lambda j, b, h: (b, 0)),
                pl.BlockSpec((None, block_k), lambda j, b, h: (b, j)),
            ]
    for name in ("bias", "mask"):
        x = arrays.get(name)
        if x is None:
            continue
        nb, nh, nt, ns = x.shape
        if kind == "q":
            block = (None, None, block_q if nt > 1 else 1, ns)

            def index_map(i, b, h, nb=nb, nh=nh, nt=nt):
                return (b if nb > 1 else 0, h if nh > 1 else 0, i if nt > 1 else 0, 0)
        else:
            block = (None, group if nh > 1 else None, nt, block_k if ns > 1 else 1)

            def index_map(j, b, h, nb=nb, nh=nh, ns=ns):
                return (b if nb > 1 else 0, h if nh > 1 else 0, 0, j if ns > 1 else 0)

        inputs.append(x)
        specs.append(pl.BlockSpec(block, index_map))
    return inputs, specs


def _compiler_params(problem: _Problem):
    cfg = problem.config
    if cfg.backend == "interpret":
        return dict(interpret=True)
    return dict(compiler_params=_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def _length_spec():
    return pl.BlockSpec((None,), lambda i, b, h: (b,))


# ------------------------------------------------------------------------------------------- pallas_call glue


def _forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    batch, t_pad, num_heads, d_pad = q.shape
    s_pad = k.shape[1]
    block_q = problem.config.block_q
    group = problem.group
    extra, extra_specs = _optional_inputs(optional, problem, "q", block_q, problem.config.block_k)
    q_spec = pl.BlockSpec((None, block_q, None, d_pad), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda i, b, h: (b, 0, h // group, 0))
    kernel = functools.partial(_forward_kernel, problem=problem, tiles_fn=_tiles_fn(problem))
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, batch, num_heads),
        in_specs=[q_spec, kv_spec, kv_spec, _length_spec(), _length_spec(), *extra_specs],
        out_specs=[q_spec, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, t_pad), jnp.float32),
        ],
        name="probjax_flash_forward",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, *extra)


def _backward_dq(problem: _Problem, q, k, v, q_len, kv_len, do, lse2, delta, optional: dict, emit_ds: bool):
    batch, t_pad, num_heads, d_pad = q.shape
    s_pad = k.shape[1]
    block_q = problem.config.block_q_dq
    group = problem.group
    extra, extra_specs = _optional_inputs(optional, problem, "q", block_q, problem.config.block_k_dq)
    q_spec = pl.BlockSpec((None, block_q, None, d_pad), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda i, b, h: (b, 0, h // group, 0))
    row_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
    out_specs = [q_spec]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if emit_ds:
        out_specs.append(pl.BlockSpec((None, None, block_q, s_pad), lambda i, b, h: (b, h, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, num_heads, t_pad, s_pad), jnp.float32))
    kernel = functools.partial(_dq_kernel, problem=problem, tiles_fn=_tiles_fn(problem), emit_ds=emit_ds)
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, batch, num_heads),
        in_specs=[
            q_spec, kv_spec, kv_spec, _length_spec(), _length_spec(), q_spec, row_spec, row_spec, *extra_specs
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        name="probjax_flash_backward_dq",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, do, lse2, delta, *extra)


def _backward_dkv(problem: _Problem, q, k, v, q_len, kv_len, do, lse2, delta, optional: dict):
    batch, t_pad, num_heads, d_pad = q.shape
    s_pad, num_kv_heads = k.shape[1], k.shape[2]
    block_k = problem.config.block_k_dkv
    group = problem.group
    extra, extra_specs = _optional_inputs(optional, problem, "kv", problem.config.block_q_dkv, block_k)
    q_spec = pl.BlockSpec((None, t_pad, group, d_pad), lambda j, b, h: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, block_k, None, d_pad), lambda j, b, h: (b, j, h, 0))
    row_spec = pl.BlockSpec((None, group, t_pad), lambda j, b, h: (b, h, 0))
    kernel = functools.partial(_dkv_kernel, problem=problem, tiles_fn=_tiles_fn(problem))
    return pl.pallas_call(
        kernel,
        grid=(s_pad // block_k, batch, num_kv_heads),
        in_specs=[
            q_spec, kv_spec, kv_spec, _length_spec(), _length_spec(), q_spec, row_spec, row_spec, *extra_specs
        ],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="probjax_flash_backward_dkv",
        **_compiler_params(problem),
    )(q, k, v, q_len, kv_len, do, lse2, delta, *extra)


# -------------------------------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(problem: _Problem, q, k, v, bias, q_len, kv_len, others: dict):
    """Padded inputs in, (out, lse) padded out. `others` holds the integer inputs (segments, int8 mask)."""
    return _forward(problem, q, k, v, q_len, kv_len, dict(others, bias=bias))


def _flash_fwd(problem: _Problem, q, k, v, bias, q_len, kv_len, others):
    out, lse = _forward(problem, q.value, k.value, v.value, q_len.value, kv_len.value, _optional(bias, others))
    # The bias gradient costs a [B, N, T, S] buffer: build it only when the bias is being differentiated.
    wants_dbias = () if bias is not None and bias.perturbed else None
    residuals = (q.value, k.value, v.value, _value(bias), q_len.value, kv_len.value, _value(others), out, lse)
    return (out, lse), (residuals, wants_dbias)


def _flash_bwd(problem: _Problem, saved, cotangents):
    (q, k, v, bias, q_len, kv_len, others, out, lse), wants_dbias = saved
    d_out, d_lse = cotangents
    d_out = jnp.zeros_like(out) if isinstance(d_out, jax.custom_derivatives.SymbolicZero) else d_out
    # delta_i = rowsum(dO * O) (FlashAttention-2 preprocess); an lse cotangent enters as -d_lse because
    # d lse / d s = p, which makes dS = p * (dP - delta + d_lse).
    delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if not isinstance(d_lse, jax.custom_derivatives.SymbolicZero):
        delta = delta - jnp.where(jnp.isfinite(lse), d_lse, 0.0)
    # Rows without any attended key carry lse = -inf; +inf makes p = exp2(s - lse) exactly 0 there.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    optional = dict(others, bias=bias)
    emit_ds = bias is not None and wants_dbias is not None
    dq, *ds = _backward_dq(problem, q, k, v, q_len, kv_len, d_out, lse2, delta, optional, emit_ds)
    dk, dv = _backward_dkv(problem, q, k, v, q_len, kv_len, d_out, lse2, delta, optional)
    dbias = None
    if emit_ds:
        broadcast_axes = tuple(axis for axis, size in enumerate(bias.shape) if size == 1)
        dbias = jnp.sum(ds[0], axis=broadcast_axes, keepdims=True).astype(bias.dtype)
    return dq, dk, dv, dbias, None, None, jax.tree.map(lambda _: None, others)


def _value(x):
    return jax.tree.map(lambda leaf: leaf.value, x, is_leaf=lambda leaf: hasattr(leaf, "perturbed"))


def _optional(bias, others) -> dict:
    return dict(_value(others), bias=_value(bias))


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


# ---------------------------------------------------------------------------------------------- public entry


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pads one axis of x up to `size` (no-op when it already has that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | None = None,
    return_lse: bool = False,
    config: FlashConfig | None = None,
    window: int | tuple[int | None, int | None] | None = None,
):
    """Memory-efficient exact attention, `softmax(scale * q k^T + bias, masked) v`, as Pallas kernels.

    Always runs the Pallas kernels: the Triton lowering on NVIDIA GPUs, interpret mode elsewhere (see
    `FlashConfig.backend`). Differentiable in q, k, v and bias; composes with jit, vmap, grad and remat.

    **Arguments:**

    - `q`: `[B, T, N, D]` queries; `k`, `v`: `[B, S, K, D]` keys and values with N a multiple of K
      (grouped-query / multi-query attention without repeating K and V). One dtype for all three: bfloat16,
      float16 or float32; any T, S >= 1; D <= 256. Accumulation is float32.
    - `bias`: float, broadcastable to `[B, N, T, S]`, added to the scaled scores; differentiable.
    - `mask`: bool, broadcastable to `[B, N, T, S]`; True = attend.
    - `causal`: query i sees keys j <= i (top-left alignment, as `jax.nn.dot_product_attention`).
    - `scale`: multiplies q k^T; default `D ** -0.5`.
    - `q_lengths`, `kv_lengths`: `[B]` ints; query rows >= q_lengths[b] and keys >= kv_lengths[b] are masked.
    - `q_segment_ids` `[B, T]`, `kv_segment_ids` `[B, S]`: ints; a query attends only keys with its id.
    - `dropout_rate`, `dropout_seed`: attention dropout (not implemented yet: a non-zero rate raises).
    - `return_lse`: also return lse `[B, N, T]` float32, the natural-log sum-exp of the masked scores.
    - `config`: a `FlashConfig` of block sizes, warps, stages and backend; None picks device defaults.
    - `window`: local attention, an int w or a pair (left, right): query i sees keys in [i - left, i + right]
      (a None side is unbounded). Combined with `causal`, right is 0.

    **Returns:** out `[B, T, N, D]` in q's dtype, or `(out, lse)` with `return_lse`. A query row with no key
    to attend gives out 0, lse -inf and zero gradients.
    """
    inputs = check_inputs(
        q, k, v, bias=bias, mask=mask, scale=scale, q_lengths=q_lengths, kv_lengths=kv_lengths,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, window=window, dropout_rate=dropout_rate,
    )
    if dropout_rate:
        raise NotImplementedError("flash_attention: dropout_rate > 0 is not implemented yet (issue 3).")
    del dropout_seed
    if config is not None and not isinstance(config, FlashConfig):
        raise TypeError(f"config must be a FlashConfig or None, got {type(config).__name__}.")
    out, lse = _flash_attention(inputs, bool(causal), config)
    return (out, lse) if return_lse else out


def _flash_attention(inputs: AttentionInputs, causal: bool, config: FlashConfig | None):
    batch, q_len, kv_len, num_heads, num_kv_heads, head_dim = inputs.shape
    d_pad = _padded_head_dim(head_dim)
    config = default_config(config, q_len=q_len, kv_len=kv_len, head_dim=d_pad)
    t_pad = _round_up(q_len, max(config.block_q, config.block_q_dq, config.block_q_dkv))
    s_pad = _round_up(kv_len, max(config.block_k, config.block_k_dq, config.block_k_dkv))
    left, right = inputs.window
    if causal:
        right = 0 if right is None else min(right, 0)

    def pad_4d(x, seq_axis_size):
        return _pad_axis(_pad_axis(x, 1, seq_axis_size), 3, d_pad)

    q = pad_4d(inputs.q, t_pad)
    k = pad_4d(inputs.k, s_pad)
    v = pad_4d(inputs.v, s_pad)
    q_lengths = inputs.q_lengths if inputs.q_lengths is not None else jnp.full((batch,), q_len, jnp.int32)
    kv_lengths = inputs.kv_lengths if inputs.kv_lengths is not None else jnp.full((batch,), kv_len, jnp.int32)

    def pad_broadcastable(x):
        # Only the sequence axes that are not broadcast get padded; padded bias is 0 and padded mask False.
        if x.shape[2] > 1:
            x = _pad_axis(x, 2, t_pad)
        if x.shape[3] > 1:
            x = _pad_axis(x, 3, s_pad)
        return x

    bias = None if inputs.bias is None else pad_broadcastable(inputs.bias)
    others = {}
    if inputs.mask is not None:
        # Triton loads of i1 are awkward; int8 costs one byte per element of the mask as given.
        others["mask"] = pad_broadcastable(inputs.mask.astype(jnp.int8))
    if inputs.q_segment_ids is not None:
        others["q_segment_ids"] = _pad_axis(inputs.q_segment_ids, 1, t_pad)
        others["kv_segment_ids"] = _pad_axis(inputs.kv_segment_ids, 1, s_pad)
    problem = _Problem(
        scale=inputs.scale,
        window_left=left,
        window_right=right,
        group=num_heads // num_kv_heads,
        bias_shape=None if bias is None else bias.shape,
        mask_shape=None if "mask" not in others else others["mask"].shape,
        has_segments=inputs.q_segment_ids is not None,
        config=config,
        precision=lax.Precision.HIGHEST if inputs.q.dtype == jnp.float32 else lax.Precision.DEFAULT,
    )
    out, lse = _flash(problem, q, k, v, bias, q_lengths, kv_lengths, others)
    return out[:, :q_len, :, :head_dim], lse[:, :, :q_len]
