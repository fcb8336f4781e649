"""Flash-attention forward for Blackwell (sm_100a) in Pallas Mosaic GPU: tcgen05 MMAs into tensor memory, TMA
and a producer warpgroup.

One CTA owns a query tile of 128 rows of one (batch, query head): tcgen05's M, and one row per thread of the
softmax warpgroup, whose tensor-memory loads (`Layout.TCGEN05`) give each thread its row of a tile, so the row
max and sum never leave the thread. Two warpgroups:

- the softmax warpgroup issues the MMAs (one elected thread each): S = Q K^T into one of two (128, block_kv)
  float32 tensor-memory tiles, then, once it has turned S into P (16-bit, in shared memory), O += P V into a
  (128, Dv) float32 tensor-memory accumulator. The next tile's Q K^T is issued as soon as this tile's S is
  loaded, so the tensor core runs it during this tile's softmax. Before P V, once the previous P V has
  completed (`o_done`), it writes P and rescales O in tensor memory by exp2(m_old - m_new), in 64-column
  chunks. Scores live in the base-2 domain (s2 = scale * log2(e) * q k^T, one multiply) so every exponential
  is an exp2.
- a producer warpgroup that fills a ring of `num_stages` K / V slots with TMA copies. A slot is ready when
  both copies land (`k_ready`, `v_ready`) and free once the P V that read it has completed: the softmax
  warpgroup commits each step's MMAs to that slot's `kv_free` barrier (`tcgen05_commit_arrive`).

KV tiles visited: [lo, full_lo) and [full_hi, hi) with the per-element mask (keys >= kv_lengths[b], the
window / causal edge), [full_lo, full_hi) without it (`kv_tile_range`); tiles outside every row's window are
never loaded. Rows >= q_lengths[b] and rows that attend no key give output 0 and lse -inf (the convention of
every backend, `_problem.py`).

The caller pads: T to a multiple of 128, S to a multiple of `block_kv`, with finite values (zeros); keys past
`kv_lengths` are masked, but their V rows still meet p = 0 in the P V matmul, so they must not be NaN / inf.

This kernel takes the plain call (scale, causal / window, lengths, GQA, Dv != D); the Hopper kernel's other
features run on the Triton kernels on Blackwell (`mosaic.plan`). It runs in the Mosaic GPU interpreter as it
is compiled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_kernels._tiles import kv_tile_range
from probjax_kernels.mosaic.common import (
    _M_INIT,
    _SWIZZLE,
    LN2,
    LOG2E,
    ScoreRule,
    allocated_smem,
    check_layout,
    drain_ring,
    fill_ring_slot,
    window_options,
)

BLOCK_Q = 128  # tcgen05's M, and one row per thread of the softmax warpgroup
HEAD_DIMS = (64, 128)
_RESCALE_COLUMNS = 64  # O is rescaled in tensor memory in chunks of this many columns (registers)
# No reduction scratch (Mosaic GPU reserves 2 KiB by default): a thread holds its whole row of a tile.
_COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


def smem_bytes(head_dim: int, value_dim: int, block_kv: int, num_stages: int, itemsize: int = 2) -> int:
    """Shared memory of one CTA as Mosaic GPU allocates it: the Q tile (which carries O out when Dv = D, else
    an O tile of its own), the K and V rings, the P tile, the lse staging row and the barriers."""
    buffers = [
        itemsize * BLOCK_Q * head_dim, itemsize * num_stages * block_kv * head_dim,
        itemsize * num_stages * block_kv * value_dim, itemsize * BLOCK_Q * block_kv, 4 * BLOCK_Q,
        itemsize * BLOCK_Q * value_dim if value_dim != head_dim else 0,
    ]
    return allocated_smem(buffers, barriers=1 + 3 * num_stages + 2)


def masked_scores(s, rule: ScoreRule, row0, key0, kv_len):
    """s (a tensor-memory-layout tile: rows are queries from row0, columns keys from key0) with -inf where a
    key is at or past kv_len or outside the row's window. The bounds are per-row columns, compared with the
    column index: a thread's columns are constants, where (q_idx, kv_idx) tiles took a register each."""
    rows = row0 + plgpu.broadcasted_iota(jnp.int32, s.shape[:1], 0, layout=plgpu.Layout.TCGEN05.reduce(1))
    end = jnp.full_like(rows, kv_len - key0)  # the row's first key column it does not see
    if rule.window_right is not None:
        end = jnp.minimum(end, rows + (rule.window_right + 1) - key0)
    column = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.TCGEN05)
    allowed = column < lax.broadcast_in_dim(end, s.shape, [0])
    if rule.window_left is not None:
        allowed &= column >= lax.broadcast_in_dim(rows - rule.window_left - key0, s.shape, [0])
    return jnp.where(allowed, s, -jnp.inf)


def _forward_kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, out_ref, lse_ref, smem, tmem, barriers, *,
                    rule: ScoreRule, block_kv: int, num_stages: int, group: int):
    q_smem, k_smem, v_smem, p_smem, lse_smem, own_o_smem = smem
    s_tmem, o_tmem = tmem
    q_ready, k_ready, v_ready, kv_free, s_done, o_done = barriers
    o_smem = q_smem if own_o_smem is None else own_o_smem
    value_dim = v_ref.shape[-1]
    q_tile, head, batch = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    if rule.causal_only:  # heaviest tiles first, so the short ones fill the tail of the grid
        q_tile = q_ref.shape[1] // BLOCK_Q - 1 - q_tile
    wg = lax.axis_index("wg")
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    row0 = q_tile * BLOCK_Q
    lo, full_lo, full_hi, hi = kv_tile_range(row0, BLOCK_Q, q_len, kv_len, block_kv, rule.window)

    @pl.when(wg == 0)
    def _softmax():
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, BLOCK_Q), head], q_smem, q_ready)
        plgpu.barrier_wait(q_ready)

        def issue_qk(n):
            """S(n) = Q K(n)^T into tensor-memory tile n % 2, once K(n) has landed."""
            slot = lax.rem(n, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.tcgen05_mma(s_tmem.at[lax.rem(n, 2)], q_smem, k_smem.at[slot].transpose((1, 0)),
                              s_done.at[lax.rem(n, 2)], accumulate=False)

        @pl.when(hi > lo)
        def _():
            issue_qk(0)

        def step(block, carry, masked: bool):
            """KV tile `block` (pipeline step block - lo, ring slot (block - lo) % num_stages)."""
            m_i, l_i = carry
            n = block - lo
            slot = lax.rem(n, num_stages)
            plgpu.barrier_wait(s_done.at[lax.rem(n, 2)])
            s = plgpu.async_load_tmem(s_tmem.at[lax.rem(n, 2)], layout=plgpu.Layout.TCGEN05)
            plgpu.wait_load_tmem()  # S(n) is read before S(n + 2) overwrites its tensor memory

            @pl.when(block + 1 < hi)
            def _():  # the next tile's Q K^T runs while this one's softmax does
                issue_qk(n + 1)

            if masked:
                s = masked_scores(s, rule, row0, block * block_kv, kv_len)
            s_scale = rule.scale * LOG2E
            m_new = jnp.maximum(m_i, s.max(axis=1) * s_scale)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s * s_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)

            @pl.when(n > 0)
            def _():  # the previous P V is done: the P tile and O are free
                plgpu.barrier_wait(o_done)

            p_smem[...] = p.astype(p_smem.dtype)  # P first: its registers are free before O's chunks load
            plgpu.commit_smem()

            @pl.when(n > 0)
            def _rescale():
                for c in range(0, value_dim, _RESCALE_COLUMNS):
                    chunk = o_tmem.at[:, pl.ds(c, _RESCALE_COLUMNS)]
                    o = plgpu.async_load_tmem(chunk, layout=plgpu.Layout.TCGEN05)
                    plgpu.async_store_tmem(chunk, o * lax.broadcast_in_dim(alpha, o.shape, [0]))
                plgpu.commit_tmem()

            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.tcgen05_mma(o_tmem, p_smem, v_smem.at[slot], o_done, accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(kv_free.at[slot])  # the slot is free once these MMAs complete
            return m_new, l_i

        carry = (
            plgpu.layout_cast(jnp.full((BLOCK_Q,), _M_INIT, jnp.float32), plgpu.Layout.TCGEN05.reduce(1)),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), plgpu.Layout.TCGEN05.reduce(1)),
        )
        carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
        m_i, l_i = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)

        q_idx = row0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q,), 0, layout=plgpu.Layout.TCGEN05.reduce(1))
        valid = (q_idx < q_len) & (l_i != 0)  # l_i = 0: no key attended; a NaN l_i (NaN / inf inputs) stays NaN
        inv_l = jnp.where(valid, 1.0 / jnp.where(valid, l_i, 1.0), 0.0)

        @pl.when(hi > lo)
        def _():
            plgpu.barrier_wait(o_done)  # the last P V

        for c in range(0, value_dim, _RESCALE_COLUMNS):
            o = plgpu.async_load_tmem(o_tmem.at[:, pl.ds(c, _RESCALE_COLUMNS)], layout=plgpu.Layout.TCGEN05)
            # where, not a product: a tile without steps leaves O's tensor memory unwritten
            o = jnp.where(lax.broadcast_in_dim(valid, o.shape, [0]), o * lax.broadcast_in_dim(inv_l, o.shape, [0]),
                          0.0)
            o_smem[:, pl.ds(c, _RESCALE_COLUMNS)] = o.astype(o_smem.dtype)
        plgpu.wait_load_tmem()
        lse_smem[...] = jnp.where(valid, m_i * LN2 + jnp.log(jnp.where(valid, l_i, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[batch, pl.ds(row0, BLOCK_Q), head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(row0, BLOCK_Q)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        fill_kv_ring(k_ref, v_ref, (k_smem, v_smem), (k_ready, v_ready, kv_free), batch=batch,
                     kv_head=lax.div(head, jnp.int32(group)), tiles=(lo, hi), block_kv=block_kv, num_stages=num_stages)


def fill_kv_ring(k_ref, v_ref, rings: tuple, barriers: tuple, *, batch, kv_head, tiles: tuple, block_kv: int,
                 num_stages: int) -> None:
    """The producer warpgroup of the tcgen05 kernels that stream K / V: KV tiles [lo, hi) (`tiles`) of (batch,
    kv_head) by TMA into the `rings` (K's, V's), batch 0 where k / v have batch 1; step n's slot once the MMAs
    that read it have completed (`kv_free`); then waits the last slots out. `barriers`: (k_ready, v_ready,
    kv_free)."""
    (k_smem, v_smem), (k_ready, v_ready, kv_free), (lo, hi) = rings, barriers, tiles
    steps = hi - lo

    @pl.loop(0, steps)
    def _(n):
        tile = (batch if k_ref.shape[0] > 1 else 0, pl.ds((lo + n) * block_kv, block_kv), kv_head)
        fill_ring_slot(n, num_stages, (kv_free,), [(k_ref.at[tile], k_smem, k_ready),
                                                    (v_ref.at[tile], v_smem, v_ready)])

    drain_ring(steps, num_stages, kv_free)


def launch(kernel, name: str, inputs: tuple, *, out_type, scratch_types, grid: tuple, grid_names: tuple,
           interpret: bool):
    """`kernel` over `grid` as the tcgen05 kernels run: two warpgroups ("wg": the MMA-issuing one and a TMA
    producer), no reduction scratch; in the Mosaic GPU interpreter with `interpret`."""
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch_types, grid=grid, grid_names=grid_names, num_threads=2,
        thread_name="wg", kernel_name=name, compiler_params=_COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(*inputs)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "block_kv", "num_stages", "interpret"))
def tcgen05_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_lengths: jax.Array,
    kv_lengths: jax.Array,
    *,
    scale: float,
    causal: bool,
    window: tuple[int | None, int | None] = (None, None),
    block_kv: int = 128,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Flash-attention forward on Blackwell (sm_100a) through Pallas Mosaic GPU's tcgen05 MMAs.

    **Arguments:**

    - `q`: `[B, T, N, D]`, bfloat16 or float16, D in {64, 128}; T a multiple of 128.
    - `k`, `v`: `[B, S, K, D]` and `[B, S, K, Dv]` (Dv in {64, 128}; batch 1: shared by every query batch),
      q's dtype, N a multiple of K (GQA / MQA); S a multiple of `block_kv`. Padding rows must be finite (zeros).
    - `q_lengths`, `kv_lengths`: int32 `[B]`; query rows >= q_lengths[b] give output 0 and lse -inf, keys
      >= kv_lengths[b] are masked.
    - `scale`: multiplies q k^T, > 0. `causal`: query i sees keys j <= i (top-left alignment).
    - `window`: `(left, right)`, ints >= 0 or None (unbounded): query i sees keys in [i - left, i + right]
      (with `causal`, right is at most 0). Tiles outside every row's window are never loaded.
    - `block_kv`: keys per pipeline step, 64 or 128. `num_stages`: K / V slots in the shared-memory ring, >= 2.
    - `interpret`: run in the Mosaic GPU CPU interpreter instead of compiling for the GPU.

    **Returns:** `(out, lse)`: out `[B, T, N, Dv]` in q's dtype, lse `[B, N, T]` float32, the natural-log
    sum-exp of the scaled, masked scores.
    """
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    if block_kv not in (64, 128):
        raise ValueError(f"block_kv must be 64 or 128 (a tensor-memory tile of S), got {block_kv}")
    check_layout(
        q, k, v, q_lengths, kv_lengths, scale, block_q=BLOCK_Q, q_multiple=BLOCK_Q, block_kv=block_kv,
        kv_multiple=64, num_stages=num_stages, min_stages=2, head_dims=HEAD_DIMS,
        smem_need=smem_bytes(q.shape[-1], v.shape[-1], block_kv, num_stages, q.dtype.itemsize),
    )
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    num_stages = min(num_stages, kv_len // block_kv)
    transforms = (plgpu.TilingTransform((8, _SWIZZLE // q.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    kernel = functools.partial(
        _forward_kernel, rule=ScoreRule(scale, **window_options(causal, window)), block_kv=block_kv,
        num_stages=num_stages, group=num_heads // num_kv_heads,
    )
    tensor_core = dict(orders_tensor_core=True)
    return launch(
        kernel, "probjax_mosaic_forward_tcgen05", (q, k, v, q_lengths, kv_lengths),
        out_type=(
            jax.ShapeDtypeStruct((batch, q_len, num_heads, value_dim), q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32),
        ),
        scratch_types=(
            (
                plgpu.SMEM((BLOCK_Q, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, value_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q, block_kv), q.dtype, transforms=transforms),
                plgpu.SMEM((BLOCK_Q,), jnp.float32),
                plgpu.SMEM((BLOCK_Q, value_dim), q.dtype, transforms=transforms) if value_dim != head_dim else None,
            ),
            (
                plgpu.TMEM((2, BLOCK_Q, block_kv), jnp.float32),
                plgpu.TMEM((BLOCK_Q, value_dim), jnp.float32),
            ),
            (
                plgpu.Barrier(),
                plgpu.Barrier(num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages, **tensor_core),
                plgpu.Barrier(num_barriers=2, **tensor_core),
                plgpu.Barrier(**tensor_core),
            ),
        ),
        grid=(q_len // BLOCK_Q, num_heads, batch),
        grid_names=("q", "heads", "batch"),
        interpret=interpret,
    )
