"""Flash-attention backward for Hopper (sm_90) in Pallas Mosaic GPU: the dQ kernel (FlashAttention-2, Alg. 2,
split by query tile, so no atomics).

Same CTA layout as `_mosaic_forward`: one CTA per (query tile of `block_q` rows, batch, query head), two
consumer warpgroups owning `block_q // 2` rows each and a producer warpgroup feeding a ring of K / V slots
by TMA. Per KV tile a consumer recomputes S = Q K^T and dP = dO V^T (both wgmma from SMEM), then
p = exp2(s * scale * log2(e) - lse2), dS = p * (dP - delta) and dQ += dS K (wgmma, dS from registers; staged
in SMEM in interpret mode). `lse2` is the forward's lse in base 2, +inf for rows with no key so that p = 0
and their gradient is exactly zero; `delta` = rowsum(dO * O) comes from XLA.

Causal tile skipping, lengths masking and the caller's padding contract are those of `_mosaic_forward`.
The dK / dV kernel is not written yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from probjax_kernels._mosaic_forward import (
    _CONSUMERS,
    _SWIZZLE,
    LOG2E,
    SMEM_BYTES,
    _accumulate_pv,
    _check,
    _kv_steps,
)


def dq_smem_bytes(head_dim: int, block_q: int, block_kv: int, num_stages: int, ds_in_smem: bool = False,
                  itemsize: int = 2) -> int:
    """Shared memory of one dQ CTA: Q (reused for dQ) and dO tiles, the K / V rings, lse2 / delta rows and,
    with `ds_in_smem`, the dS tiles."""
    ds_tiles = block_q * block_kv if ds_in_smem else 0
    return itemsize * (head_dim * (2 * block_q + 2 * num_stages * block_kv) + ds_tiles) + 8 * block_q


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_len_ref, kv_len_ref, dq_ref, smem, row_ready, ready,
    free, *, scale: float, causal: bool, block_q: int, block_kv: int, num_stages: int, group: int,
    interpret: bool,
):
    q_smem, do_smem, lse2_smem, delta_smem, k_smem, v_smem, ds_smem = smem
    k_ready, v_ready = ready
    k_free, v_free = free
    rows = block_q // _CONSUMERS
    head_dim = q_ref.shape[-1]
    num_q_tiles = q_ref.shape[1] // block_q
    q_tile = lax.axis_index("q")
    if causal:
        q_tile = num_q_tiles - 1 - q_tile
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    tile_row0 = q_tile * block_q
    scale_log2 = scale * LOG2E
    cta_steps = jnp.int32(0)
    for c in range(_CONSUMERS):
        cta_steps = jnp.maximum(cta_steps, _kv_steps(tile_row0 + c * rows, q_len, kv_len, rows, block_kv, causal)[1])

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        row0 = tile_row0 + wg * rows
        full_hi, hi = _kv_steps(row0, q_len, kv_len, rows, block_kv, causal)
        row_tile = (batch, pl.ds(row0, rows), head)
        row_vector = (batch, head, pl.ds(row0, rows))
        own = [x.at[wg] for x in (q_smem, do_smem, lse2_smem, delta_smem)]
        for src, dst, barrier in zip(
            (q_ref.at[row_tile], do_ref.at[row_tile], lse2_ref.at[row_vector], delta_ref.at[row_vector]),
            own, row_ready,
        ):
            plgpu.copy_gmem_to_smem(src, dst, barrier.at[wg])
        for barrier in row_ready:
            plgpu.barrier_wait(barrier.at[wg])
        q_own, do_own, lse2_own, delta_own = own
        lse2 = plgpu.load(lse2_own, layout=plgpu.Layout.WGMMA.reduce(1))
        delta = plgpu.load(delta_own, layout=plgpu.Layout.WGMMA.reduce(1))

        def matmul_t(a_smem, b_smem):
            def body(acc_ref):
                plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
                return acc_ref[...]

            return pl.run_scoped(body, plgpu.ACC((rows, block_kv), jnp.float32))

        def step(kv_step, dq, masked: bool):
            slot = lax.rem(kv_step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            s = matmul_t(q_own, k_smem.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            dp = matmul_t(do_own, v_smem.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            if masked:
                q_idx = row0 + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                kv_idx = kv_step * block_kv + plgpu.broadcasted_iota(
                    jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA
                )
                allowed = kv_idx < kv_len
                if causal:
                    allowed &= kv_idx <= q_idx
                s = jnp.where(allowed, s, -jnp.inf)
            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(lse2, s.shape, [0]))
            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
            dq = _accumulate_pv(
                dq, ds.astype(k_smem.dtype), k_smem.at[slot], None if ds_smem is None else ds_smem.at[wg],
                not interpret, lambda: None,
            )
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        def skip(kv_step, _):
            slot = lax.rem(kv_step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])

        dq = plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        dq = lax.fori_loop(0, full_hi, functools.partial(step, masked=False), dq)
        dq = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), dq)
        lax.fori_loop(hi, cta_steps, skip, None)
        q_own[...] = (dq * scale).astype(q_own.dtype)  # Q is no longer read: its tile carries dQ out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_own, dq_ref.at[row_tile])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        @pl.loop(0, cta_steps)
        def _(kv_step):
            slot = lax.rem(kv_step, num_stages)

            @pl.when(kv_step >= num_stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            tile = (batch, pl.ds(kv_step * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[tile], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[tile], v_smem.at[slot], v_ready.at[slot])

        @pl.loop(jnp.maximum(cta_steps - num_stages, 0), cta_steps)
        def _(kv_step):
            slot = lax.rem(kv_step, num_stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "block_q", "block_kv", "num_stages", "ds_in_smem", "interpret")
)
def mosaic_backward_dq(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    q_lengths: jax.Array,
    kv_lengths: jax.Array,
    *,
    scale: float,
    causal: bool,
    block_q: int = 128,
    block_kv: int = 64,
    num_stages: int = 2,
    ds_in_smem: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """dQ of `mosaic_forward` on Hopper through Pallas Mosaic GPU.

    **Arguments:** q, k, v, q_lengths, kv_lengths, scale, causal and the tiles as in `mosaic_forward` (same
    padding contract); `out` `[B, T, N, D]` and `lse` `[B, N, T]` (natural log, -inf for empty rows) from the
    forward pass; `d_out` `[B, T, N, D]`, the cotangent of `out`. `ds_in_smem` stages dS in shared memory
    for the dS K matmul (always on in interpret mode).

    **Returns:** dQ `[B, T, N, D]` in q's dtype.
    """
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    ds_in_smem = ds_in_smem or interpret
    _check(q, k, v, q_lengths, kv_lengths, scale, block_q, block_kv, num_stages, False)
    batch, q_len, num_heads, head_dim = q.shape
    if out.shape != q.shape or d_out.shape != q.shape or lse.shape != (batch, num_heads, q_len):
        raise ValueError(f"out / d_out must be q's shape and lse [B, N, T]; got {out.shape=}, {d_out.shape=},"
                         f" {lse.shape=}")
    if (need := dq_smem_bytes(head_dim, block_q, block_kv, num_stages, ds_in_smem)) > SMEM_BYTES:
        raise ValueError(f"{block_q=}, {block_kv=}, {num_stages=} at {head_dim=} need {need} bytes of SMEM")
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    num_stages = min(num_stages, kv_len // block_kv)
    rows = block_q // _CONSUMERS
    # FlashAttention-2 preprocess in XLA: delta = rowsum(dO * O); lse to base 2, +inf where no key attends.
    delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)
    transforms = (plgpu.TilingTransform((8, _SWIZZLE // q.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    kernel = functools.partial(
        _dq_kernel, scale=scale, causal=causal, block_q=block_q, block_kv=block_kv, num_stages=num_stages,
        group=num_heads // num_kv_heads, interpret=interpret,
    )
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=(
            (
                plgpu.SMEM((_CONSUMERS, rows, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((_CONSUMERS, rows, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((_CONSUMERS, rows), jnp.float32),
                plgpu.SMEM((_CONSUMERS, rows), jnp.float32),
                plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((_CONSUMERS, rows, block_kv), q.dtype, transforms=transforms) if ds_in_smem else None,
            ),
            tuple(plgpu.Barrier(num_barriers=_CONSUMERS) for _ in range(4)),
            (plgpu.Barrier(num_barriers=num_stages), plgpu.Barrier(num_barriers=num_stages)),
            (
                plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
            ),
        ),
        grid=(q_len // block_q, num_heads, batch),
        grid_names=("q", "heads", "batch"),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(q, k, v, d_out, lse2, delta, q_lengths, kv_lengths)
