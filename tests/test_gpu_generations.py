"""The Triton tile rules per GPU generation, on fake devices of each compute capability (what the dispatch reads
of `_backend.target_device()`): Blackwell datacenter parts (10.x, tcgen05) take Hopper's wide-MMA tiles, whose
every dot has at least 64 rows, not the A100's 32-row dK/dV steps; consumer Blackwell (12.x) and Ada (8.9), with
99 KB of shared memory per block and mma.sync alone, take the RTX 3090's. And backend "mosaic", whose kernels
target Hopper and Blackwell (10.x), refuses every other GPU by name and compute capability before building a
kernel. The
compiled figures of each rule: docs/compile/index.md (sm100a_b200, sm89_rtx4090, sm120_rtx5090)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeGPU

from probjax_kernels import FlashConfig, _backend, default_config, flash_attention
from probjax_kernels.triton import plan as triton_plan


H100, A100, RTX3090 = FakeGPU("9.0", "NVIDIA H100"), FakeGPU("8.0", "NVIDIA A100"), FakeGPU("8.6", "RTX 3090")
B200, B300 = FakeGPU("10.0", "NVIDIA B200"), FakeGPU("10.3", "NVIDIA B300")
RTX4090, RTX5090 = FakeGPU("8.9", "NVIDIA GeForce RTX 4090"), FakeGPU("12.0", "NVIDIA GeForce RTX 5090")


def _tiles(device, head_dim: int, dtype=jnp.bfloat16, backend="triton") -> dict:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_backend, "target_device", lambda: device)
        config = default_config(FlashConfig(backend=backend), q_len=4096, kv_len=4096, head_dim=head_dim,
                                dtype=dtype)
    return {k: v for k, v in vars(config).items() if k != "backend"}


@pytest.mark.parametrize("device, want", [(H100, "wgmma"), (B200, "tcgen05"), (B300, "tcgen05"), (A100, None),
                                          (RTX3090, None), (RTX4090, None), (RTX5090, None)])
def test_wide_mma_by_compute_capability(device, want):
    assert _backend.wide_mma(device) == want
    assert _backend.wide_mma(jax.devices("cpu")[0]) is None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_blackwell_takes_the_wide_mma_tiles(head_dim):
    """A B200 gets Hopper's 16-bit tiles at every head dim, whose backward steps hold 64 rows (or run on
    transposed scores at head dim 256, where the 64-key tile is M), not the A100's 32-query dK/dV steps at
    head dim 128 (96 of its 108 dK/dV matmuls were mma.sync on sm_100a); float32 keeps its FMA tiles."""
    blackwell, hopper, ampere = (_tiles(d, head_dim) for d in (B200, H100, A100))
    assert blackwell == hopper == _tiles(B300, head_dim)
    if head_dim == 128:
        assert (blackwell["block_q_dkv"], ampere["block_q_dkv"]) == (64, 32)
    rows = [blackwell[k] for k in ("block_q", "block_q_dq")]
    assert min(rows) >= 64
    assert _tiles(B200, head_dim, jnp.float32) == _tiles(A100, head_dim, jnp.float32)


def test_blackwell_transposes_dkv_scores_at_head_dim_256_only():
    """K Q^T (every dot's M the 64-key tile) where the query step is under 64: head dim 256 on sm_90a and
    sm_100a; at 128 Hopper transposes too (GQA spilled on Q K^T there) and Blackwell keeps Q K^T (K Q^T
    spilled 4 B at 128 registers on sm_100a)."""
    for head_dim, hopper, blackwell in ((64, False, False), (128, True, False), (256, True, True)):
        config = FlashConfig(**_tiles(H100, head_dim), backend="triton")
        assert triton_plan.dkv_transposed(config, jnp.bfloat16, head_dim, device=H100) is hopper
        config = FlashConfig(**_tiles(B200, head_dim), backend="triton")
        assert triton_plan.dkv_transposed(config, jnp.bfloat16, head_dim, device=B200) is blackwell
        assert not triton_plan.dkv_transposed(config, jnp.float32, head_dim, device=B200)
        assert not triton_plan.dkv_transposed(config, jnp.bfloat16, head_dim, device=RTX5090)


def test_blackwell_tangent_takes_the_forwards_key_tile_at_head_dim_64():
    """The 16-bit tangent at head dim 64 on sm_100a: the forward's 128 x 64 (128 x 32 spilled 4 B there, at 80
    registers); Hopper keeps 128 x 32, float32 its own."""
    config = FlashConfig(**_tiles(B200, 64), backend="triton")
    blackwell = triton_plan.tangent_config(config, 64, dtype=jnp.bfloat16, device=B200)
    hopper = triton_plan.tangent_config(config, 64, dtype=jnp.bfloat16, device=H100)
    assert (blackwell.block_q, blackwell.block_k, hopper.block_k) == (128, 64, 32)
    assert triton_plan.tangent_config(config, 64, dtype=None, device=B200).block_k == 64
    assert triton_plan.tangent_config(config, 64, dtype=jnp.float32, device=B200).block_k == 32
    at_128 = FlashConfig(**_tiles(B200, 128), backend="triton")
    assert triton_plan.tangent_config(at_128, 128, dtype=jnp.bfloat16, device=B200) == \
        triton_plan.tangent_config(at_128, 128, dtype=jnp.bfloat16, device=H100)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_99_kb_gpus_take_the_rtx_3090_tiles(head_dim):
    """Ada (8.9) and consumer Blackwell (12.0): 101,376 B of shared memory per block and mma.sync, the RTX 3090's
    tiles (32-query backward steps at head dim 128: 64 x 64 needs 107,008 B), not the B200's; on 12.0 the
    16-bit head dim 64 kernels step over 32 keys (64 spilled 4-48 B in dK/dV there, 224 B in a relative-bias
    forward)."""
    for device in (RTX4090, RTX5090):
        assert triton_plan.smem_per_block(device) == 101_376
        assert _tiles(device, head_dim, jnp.float32) == _tiles(RTX3090, head_dim, jnp.float32)
    assert _tiles(RTX4090, head_dim) == _tiles(RTX3090, head_dim)
    want = _tiles(RTX3090, head_dim)
    if head_dim == 64:
        want.update(block_k=32, block_k_dkv=32, block_k_dq=32)
    assert _tiles(RTX5090, head_dim) == want
    if head_dim == 128:
        assert _tiles(RTX5090, 128)["block_q_dkv"] == 32 < _tiles(B200, 128)["block_q_dkv"]


def test_consumer_blackwell_backward_rules():
    """sm_120: ptxas held 8-warp kernels to 128 registers and spilled; dQ and dK/dV run on 4 warps in float32,
    dQ at head dim 256 (16-bit), dK/dV on 16-query steps at 128 (16-bit), the float32 forward with a mask at
    head dim 128 on 3 stages, and the 16-bit dropout tangent at head dim 256 on 4 warps; sm_86 / sm_89 keep
    theirs."""
    from probjax_kernels._problem import Features, _Problem

    for head_dim, dtype in ((128, jnp.bfloat16), (256, jnp.bfloat16), (128, jnp.float32), (256, jnp.float32)):
        ampere = _backward(RTX3090, head_dim, dtype=dtype)
        assert max(ampere[1].num_warps, ampere[2].num_warps) == 8
        assert _backward(RTX4090, head_dim, dtype=dtype) == ampere
        config, dq, dkv = _backward(RTX5090, head_dim, dtype=dtype)
        if dtype == jnp.bfloat16 and head_dim == 128:  # 16-query dK/dV steps on 8 warps instead
            assert dq == ampere[1] and dkv == dataclasses.replace(ampere[2], block_q_dkv=16)
            assert (ampere[2].block_q_dkv, dkv.num_warps) == (32, 8)
        elif dtype == jnp.bfloat16:  # head dim 256: dQ on 4 warps, dK/dV as sm_86
            assert dq == dataclasses.replace(ampere[1], num_warps=4) and dkv == ampere[2]
        else:
            assert dq == dataclasses.replace(ampere[1], num_warps=4)
            assert dkv == dataclasses.replace(ampere[2], num_warps=4)
        for mask, device in itertools.product((None, (1, 1, 1024, 1024)), (RTX5090, RTX4090)):
            problem = _Problem(Features(scale=1.0), 1, 8, None, mask, None, False, 0, 0, config,
                               jax.lax.Precision.DEFAULT)
            forward = triton_plan.forward_config(problem, config, dtype, head_dim, device=device)
            three = device is RTX5090 and mask and dtype == jnp.float32 and head_dim == 128
            assert forward == (dataclasses.replace(config, num_stages=3) if three else
                               triton_plan.forward_config(problem, config, dtype, head_dim, device=RTX3090))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_backend, "target_device", lambda: RTX5090)
        from probjax_kernels import _dispatch
        from probjax_kernels._problem import Features

        def tangent_warps(dropout, head_dim=256):
            plan = _dispatch.plan(Features(scale=1.0, dropout_rate=dropout), FlashConfig(backend="triton"),
                                  q_shape=(1, 1024, 8, head_dim), k_shape=(1, 1024, 8, head_dim), value_dim=head_dim,
                                  dtype=jnp.bfloat16, bias_shape=None, mask_shape=None, table_shape=None,
                                  has_segments=False, num_score_consts=0, num_mask_consts=0)
            return plan.tangent.problem.config.num_warps

        assert (tangent_warps(0.1), tangent_warps(0.0), tangent_warps(0.1, 128)) == (4, 8, 8)


@pytest.mark.parametrize("device", [RTX5090, RTX4090, A100])
def test_backend_mosaic_refuses_a_gpu_other_than_hopper_and_blackwell(device, monkeypatch):
    """FlashConfig(backend="mosaic") on a GPU its kernels cannot target fails before any kernel is built, naming
    the device and its compute capability (ptxas would refuse its wgmma fences and tcgen05 MMAs on consumer
    Blackwell, its TMA copies before Hopper), through `default_config` and through a call."""
    monkeypatch.setattr(_backend, "target_device", lambda: device)
    with pytest.raises(NotImplementedError, match=rf"{device.device_kind}.*compute capability "
                                                  rf"{device.compute_capability}.*backend='triton'"):
        default_config(FlashConfig(backend="mosaic"), q_len=1024, kv_len=1024, head_dim=128)
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=device.device_kind):
        flash_attention(q, q, q, config=FlashConfig(backend="mosaic"))
    # backend "triton" takes the call's tiles there, and the Mosaic GPU interpreter any device.
    assert default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=128).backend == "triton"
    assert default_config(FlashConfig(backend="mosaic_interpret"), q_len=1024, kv_len=1024,
                          head_dim=128).backend == "mosaic_interpret"


def test_backend_mosaic_keeps_hopper(monkeypatch):
    monkeypatch.setattr(_backend, "target_device", lambda: H100)
    config = default_config(FlashConfig(backend="mosaic"), q_len=1024, kv_len=1024, head_dim=128,
                            dtype=jnp.bfloat16)
    assert (config.backend, config.block_q, config.block_k) == ("mosaic", 128, 128)


@pytest.mark.parametrize("device", [B200, B300])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backend_mosaic_on_blackwell_takes_the_triton_tiles(device, head_dim, monkeypatch):
    """On Blackwell backend "mosaic" keeps Triton's tiles (128 rows on 64-key steps at head dims 64 / 128, which
    the tcgen05 forward takes), so a call it leaves to Triton runs exactly backend "triton"'s kernels."""
    monkeypatch.setattr(_backend, "target_device", lambda: device)
    mosaic, triton = (default_config(FlashConfig(backend=backend), q_len=1024, kv_len=1024, head_dim=head_dim,
                                     dtype=jnp.bfloat16) for backend in ("mosaic", "triton"))
    assert mosaic.backend == "mosaic" and dataclasses.replace(mosaic, backend="triton") == triton
    if head_dim <= 128:
        assert (mosaic.block_q, mosaic.block_k, mosaic.num_stages) == (128, 64, 2)


def test_blackwell_tiles_run_exactly_in_interpret_mode():
    """The tiles a B200 gets (Hopper's at head dim 128, Q K^T dK/dV) compute the attention and its gradient
    exactly: interpret mode on those tiles against a float64 softmax reference (tiny: 2 tiles per axis)."""
    tiles = _tiles(B200, 128)
    tiles.update(block_q=min(tiles["block_q"], 64))
    config = FlashConfig(backend="interpret", **tiles)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 128, 2, 128)).astype(np.float32) for _ in range(3))

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, config=config) ** 2)

    def reference(q, k, v):
        s = np.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(q.shape[-1])
        s = np.where(np.tril(np.ones((128, 128), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bnts,bsnd->btnd", p / p.sum(-1, keepdims=True), v)

    out = flash_attention(q, k, v, causal=True, config=config)
    np.testing.assert_allclose(np.asarray(out), reference(*(x.astype(np.float64) for x in (q, k, v))), atol=2e-5)
    grads = jax.grad(loss, (0, 1, 2))(q, k, v)
    eps, e = 1e-3, np.zeros_like(q)
    e[0, 70, 1, 5] = 1.0  # a central difference in float64 through the reference for one entry of dq
    ref = reference(*(x.astype(np.float64) for x in (q + eps * e, k, v)))
    ref_minus = reference(*(x.astype(np.float64) for x in (q - eps * e, k, v)))
    numeric = (np.sum(ref ** 2) - np.sum(ref_minus ** 2)) / (2 * eps)
    np.testing.assert_allclose(float(grads[0][0, 70, 1, 5]), numeric, rtol=2e-3, atol=2e-4)


def _backward(device, head_dim: int, tables=False, score_mod=None, bias=None, dtype=jnp.bfloat16):
    """(default config, dQ config, dK/dV config) of a call on `device` (the pattern of test_compile_report.py)."""
    from probjax_kernels._hooks import trace_score_mod
    from probjax_kernels._problem import Features, _Problem

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_backend, "target_device", lambda: device)
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        transposed = triton_plan.dkv_transposed(config, dtype, head_dim, bias is not None)
        hook, consts = (None, ()) if score_mod is None else trace_score_mod(score_mod)
        if hook is not None:
            for _, _, rows, cols, score in triton_plan.hook_shapes(config, transposed):
                hook.prepare(*(jax.ShapeDtypeStruct(s, t) for s, t in (
                    (score, jnp.float32), ((), jnp.int32), ((), jnp.int32), (rows, jnp.int32), (cols, jnp.int32))))
        features = Features(scale=1.0, score_mod=hook, block_sizes=(128, 128) if tables else None)
        problem = _Problem(features, 1, 8, bias, None, None, False, len(consts), 0, config,
                           jax.lax.Precision.DEFAULT, dkv_transposed=transposed)
        return (config, *triton_plan.backward_configs(problem, dtype, head_dim))


def test_blackwell_backward_with_a_block_mask_or_a_gathered_table_runs_one_stage():
    """sm_100a, 16-bit (retile.tcgen05_backward_configs): with a BlockMask, dQ on 1 stage at head dim 256 (2
    spilled 44-68 B) and at 64 with a score_mod too (2 spilled 4 B; a BlockMask alone spilled on 1, holds on
    2), dK/dV too at 256 (2 spilled 756-792 B); a relative-bias table's split dK/dV at 256 on 1 stage (2
    spilled 8 B). Hopper, head dim 128, float32, plain calls and a dense bias keep their stages."""
    from probjax_kernels import relative_bias, softcap

    table = relative_bias(jnp.zeros((8, 2047), jnp.float32))
    assert _backward(B200, 64, tables=True, score_mod=softcap(30.0))[1].num_stages == 1
    for head_dim, dq_stages, dkv_stages in ((64, 2, 2), (128, 2, 2), (256, 1, 1)):
        config, dq, dkv = _backward(B200, head_dim, tables=True)
        assert (dq.num_stages, dkv.num_stages) == (dq_stages, dkv_stages), head_dim
        assert dq == dataclasses.replace(_backward(H100, head_dim, tables=True)[1], num_stages=dq_stages)
        assert _backward(H100, head_dim, tables=True)[1].num_stages == config.num_stages == 2
    config, dq, dkv = _backward(B200, 256, score_mod=table)
    assert (dq.num_stages, dkv.num_stages, dkv.block_q_dkv) == (2, 1, 32)
    assert _backward(H100, 256, score_mod=table)[2].num_stages == 2
    for kwargs in (dict(), dict(bias=(4, 8, 1024, 1024)), dict(tables=True, dtype=jnp.float32)):
        config, dq, dkv = _backward(B200, 256, **kwargs)
        assert (dq.num_stages, dkv.num_stages) == (config.num_stages, config.num_stages), kwargs


def test_consumer_blackwell_decode_steps_over_32_keys():
    """The decode kernel on sm_120 reads 32 keys per step up to head dim 128 in 16 bits (64 spilled 16 B there);
    sm_86 and sm_100a keep 64 on pages of 64, every target takes 32 on pages of 16 (four pages a step spilled on
    sm_86 / sm_89 / sm_100a), float32 and head dim 256 their own 16, and an explicit block_k stands."""
    from probjax_kernels import DecodeConfig, _dispatch
    from probjax_kernels._decode_inputs import DecodeInputs

    def keys_per_step(device, head_dim=128, dtype=jnp.bfloat16, config=None, page=64):
        q = jnp.zeros((2, 1, 8, head_dim), dtype)
        pages = jnp.zeros((16, page, 2, head_dim), dtype)
        inputs = DecodeInputs(q=q, k=pages, v=pages, kv_lengths=jnp.array([40, 100], jnp.int32),
                              block_tables=jnp.zeros((2, 8), jnp.int32), scale=head_dim ** -0.5, num_splits=1,
                              return_lse=False)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_backend, "target_device", lambda: device)
            plan = _dispatch.decode_plan(inputs, config or DecodeConfig(backend="triton"), None, None, 0).plan
        return plan.tile * plan.tiles_per_step

    assert (keys_per_step(RTX5090), keys_per_step(RTX3090), keys_per_step(B200)) == (32, 64, 64)
    assert {keys_per_step(device, page=16) for device in (RTX5090, RTX3090, B200)} == {32}
    assert keys_per_step(RTX5090, dtype=jnp.float32) == keys_per_step(RTX3090, dtype=jnp.float32) == 16
    assert keys_per_step(RTX5090, head_dim=256) == keys_per_step(RTX3090, head_dim=256) == 16
    assert keys_per_step(RTX5090, config=DecodeConfig(backend="triton", block_k=64)) == 64


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_backend_mosaic_on_blackwell_runs_what_triton_runs_where_the_tcgen05_forward_stops(head_dim, bias,
                                                                                          monkeypatch):
    """Triton's passes of a call on backend "mosaic" on a B200 (its tangent; with a dense bias, whose backward the
    tcgen05 kernels leave to Triton, its backward too) take the tiles, dK/dV orientation and tangent tiles backend
    "triton" takes there: its tcgen05 rules (Q K^T dK/dV at head dim 128, the tangent's 64-key steps at 64), not
    Hopper's."""
    from probjax_kernels import _dispatch
    from probjax_kernels._problem import Features, _Problem

    monkeypatch.setattr(_backend, "target_device", lambda: B200)

    def as_triton(problem):  # the problem with its config's backend named "triton"
        return dataclasses.replace(problem, config=dataclasses.replace(problem.config, backend="triton"))

    def passes(backend):
        plan = _dispatch.plan(Features(scale=1.0, window_right=0), FlashConfig(backend=backend),
                              q_shape=(4, 1024, 8, head_dim), k_shape=(4, 1024, 8, head_dim), value_dim=head_dim,
                              dtype=jnp.bfloat16, bias_shape=(4, 1, 1024, 1024) if bias else None,
                              mask_shape=None, table_shape=None, has_segments=False, num_score_consts=0,
                              num_mask_consts=0)
        return {name: (kernel_pass.run, as_triton(kernel_pass.problem),
                       tuple((k, as_triton(v) if isinstance(v, _Problem) else v) for k, v in kernel_pass.options))
                for name in ("forward", "backward", "tangent")
                if (kernel_pass := getattr(plan, name)).run.__module__.startswith("probjax_kernels.triton")}

    mosaic, triton = passes("mosaic"), passes("triton")
    assert set(mosaic) == ({"backward", "tangent"} if bias else {"tangent"})
    assert mosaic == {name: triton[name] for name in mosaic}
