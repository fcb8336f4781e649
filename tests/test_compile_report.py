"""`default_config` never picks a configuration the committed compile report (docs/compile/report.json, written by
`bash scripts/compile_check.sh`) marks failing, on any of its targets: the GPU is faked by its compute
capability, the way `default_config` reads it from `jax.default_device`. The report's own check and how it reads
a compile: tests/test_compile_report_check.py, tests/test_compile_report_figures.py."""

import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from probjax_kernels import _backend, FlashConfig, _dispatch, default_config
from probjax_kernels.triton import plan as triton_plan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "compile"))
import variants as registry  # noqa: E402 - scripts/compile/variants.py: the report's registry

REPORT = json.loads((ROOT / "docs" / "compile" / "report.json").read_text())
TARGETS = REPORT["targets"]
# The targets that compile the flash grid (not sm90a_h200, which holds the LM example's programs alone).
GRID_TARGETS = [t for t in TARGETS if any(r["target"] == t and r["group"] == "triton" for r in REPORT["rows"])]
# The targets whose rules the tests below spell out (sm_90a / sm_80 / sm_86); sm_100a / sm_89 / sm_120's rules:
# tests/test_gpu_generations.py.
RULE_TARGETS = ("sm90a_h100", "sm80_a100", "sm86_rtx3090")
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class FakeGPU:
    """What `default_config` reads of a device: its platform and compute capability."""

    compute_capability: str
    platform: str = "gpu"


def _gpu(target: str) -> FakeGPU:
    major, minor = re.fullmatch(r"sm_(\d+)(\d)a?", REPORT["limits"][target]["arch"]).groups()
    return FakeGPU(f"{major}.{minor}")


def _tiles(config: FlashConfig) -> dict:
    """The fields a GPU row records: not the backend, nor the TPU-only `fused_backward`."""
    return {k: v for k, v in vars(config).items() if k not in ("backend", "fused_backward")}


def _failures(row: dict) -> list[str]:
    """What the report's own check (scripts/compile/report.py) found wrong with this compile."""
    return row["problems"]


@pytest.mark.parametrize("target", GRID_TARGETS)
def test_every_reported_variant_is_the_default_and_passes(target, monkeypatch):
    """Each compiled variant's tiles are what default_config picks for that target, and none failed."""
    monkeypatch.setattr(_backend, "target_device", lambda: _gpu(target))
    rows = [r for r in REPORT["rows"] if r["target"] == target and r["group"] in ("triton", "mosaic", "control")]
    assert rows
    for row in rows:
        head_dim = max(row["head_dim"], row["value_dim"] or 0)
        picked = default_config(FlashConfig(backend=row["backend"]), q_len=row["q_len"], kv_len=row["kv_len"],
                                head_dim=head_dim, dtype=DTYPES[row["dtype"]])
        assert _tiles(picked) == row["config"], row["variant"]
        assert not _failures(row), (row["variant"], _failures(row))


@pytest.mark.parametrize("target", GRID_TARGETS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiles_on_the_seed_grid_are_reported_passing(target, head_dim, monkeypatch):
    """At every seed sequence length, default_config picks Triton tiles the report compiled without failing
    at that head dim (tiles do not depend on the length beyond shrinking to short sequences)."""
    monkeypatch.setattr(_backend, "target_device", lambda: _gpu(target))
    passing = [r["config"] for r in REPORT["rows"] if r["target"] == target and r["head_dim"] == head_dim
               and r["group"] in ("triton", "control") and r["value_dim"] is None and not _failures(r)]
    assert passing
    for seq in (600, 1024, 1500, 2048, 3000, 4096, 8192):
        picked = _tiles(default_config(FlashConfig(backend="triton"), q_len=seq, kv_len=seq, head_dim=head_dim))
        assert picked in passing, (target, head_dim, seq, picked)


def test_target_device_follows_jax_default_device():
    """On the CPU the default device is the CPU, and default_config picks interpret mode's tiles."""
    with jax.default_device(jax.devices("cpu")[0]):
        assert _backend.target_device().platform == "cpu"
        assert default_config(None, q_len=1024, kv_len=1024, head_dim=128).backend == "interpret"


def test_tangent_tiles_shrink_the_key_tile_only_on_a_gpu(monkeypatch):
    monkeypatch.setattr(_backend, "target_device", lambda: _gpu("sm86_rtx3090"))
    config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=256)
    tangent = triton_plan.tangent_config(config, 256)
    assert (tangent.block_q, tangent.block_k, tangent.num_warps) == (32, 16, 8)
    assert triton_plan.tangent_config(config, 256, tables=True).block_q == config.block_q
    # The dtype as default_config takes it: float32 (FMA dots) shrinks the query tile at head dim 128 too.
    config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=128)
    assert triton_plan.tangent_config(config, 128, dtype=jnp.float32).block_q == 16
    # with block tables too: the float32 flex tangent with a sliding window spilled 228 B at 32 x 16 on sm_90a
    f32 = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=128, dtype=jnp.float32)
    assert triton_plan.tangent_config(f32, 128, tables=True, dtype=jnp.float32).block_q == 16 < f32.block_q
    # 16-bit: at most 64 on this 99 KB GPU (test_tangent_query_tile_fits_a_99_kb_gpu_at_head_dim_128).
    assert triton_plan.tangent_config(config, 128, dtype=jnp.bfloat16).block_q == min(config.block_q, 64)
    interpret = default_config(FlashConfig(backend="interpret"), q_len=1024, kv_len=1024, head_dim=256)
    assert triton_plan.tangent_config(interpret, 256) == interpret



def test_the_registry_covers_the_dispatch_grid():
    """Each backend x dtype x head dim x mode, and each feature at every head dim, is a variant but for
    `NOT_YET_CLEAN`; a Mosaic call requires the Mosaic kernels exactly where the dispatch rules
    send it to them."""
    names = {v.name: v for v in registry.variants()}
    for prefix, backend in (("flash", "triton"), ("mosaic", "mosaic")):
        for dtype in ("bf16", "f32"):
            for d in (64, 128, 256):
                for mode, feature in (("grad", "full"), ("grad", "causal"), ("jvp", "causal")):
                    # backend "mosaic": jvp at head dim 128 (the tangent kernel's tiles are backend "triton"'s)
                    if backend == "triton" or mode == "grad" or d == 128:
                        assert f"{prefix}_{mode}_d{d}_{dtype}_{feature}" in names
            if backend == "mosaic" and dtype == "f32":
                continue  # falls back as a whole at backend "triton"'s float32 tiles (the test below)
            for hook in registry.FLEX_HOOKS:
                assert f"{prefix.replace('flash', '')}{'_' if backend == 'mosaic' else ''}flex_grad_d128_{dtype}_{hook}" \
                    in names
    # Every feature at every head dim in fwd+bwd and in jvp on both backends (16-bit on "mosaic"), but for the
    # calls still listed as not clean.
    features = ("full", "causal", "window", "gqa8to2_causal", "dv64", "dropout", "segments_lengths", "dense_bias",
                "dense_mask", *registry.FLEX_HOOKS)
    grid = {f"{prefix}{'flex' if feature in registry.FLEX_HOOKS else 'flash'}_{mode}_d{d}_{dtype}_{feature}"
            .replace("mosaic_flash", "mosaic")
            for prefix, dtypes in (("", ("bf16", "f32")), ("mosaic_", ("bf16",))) for dtype in dtypes
            for mode in ("grad", "jvp") for d in (64, 128, 256) for feature in features
            if not (feature == "dv64" and d == 64)}
    assert {"mosaic_jvp_d64_bf16_dropout", "mosaic_flex_jvp_d256_bf16_alibi", "flash_jvp_d64_f32_window"} <= grid
    assert grid - set(registry.NOT_YET_CLEAN) <= set(names)
    assert set(registry.NOT_YET_CLEAN) <= grid and not set(registry.NOT_YET_CLEAN) & set(names)
    assert len(registry.NOT_YET_CLEAN) < len(grid) // 4
    assert set(names["mosaic_grad_d128_bf16_causal"].requires) == {
        registry.MOSAIC_FORWARD, registry.MOSAIC_DQ, registry.MOSAIC_DKV}
    assert set(names["mosaic_grad_d256_bf16_causal"].requires) == {
        registry.MOSAIC_FORWARD, *registry.MOSAIC_DQ_PIECES, *registry.MOSAIC_DK_PIECES, registry.MOSAIC_DV}
    assert set(names["mosaic_grad_d128_bf16_dv256"].requires) == {
        registry.MOSAIC_FORWARD, registry.MOSAIC_DQ, registry.MOSAIC_DK, registry.MOSAIC_DV}
    assert set(names["mosaic_flex_grad_d256_bf16_softcap"].requires) == {  # dK in 64-column pieces
        registry.MOSAIC_FORWARD, *registry.MOSAIC_DQ_PIECES, *registry.piece_names(registry.MOSAIC_DK, 4),
        registry.MOSAIC_DV}
    assert set(names["mosaic_flex_grad_d256_bf16_document_mask"].requires) == {
        registry.MOSAIC_FORWARD, *registry.MOSAIC_DQ_PIECES, *registry.MOSAIC_DK_PIECES, registry.MOSAIC_DV}
    assert set(names["mosaic_grad_d128_f32_causal"].requires) == {registry.FORWARD, registry.DQ, registry.DKV}
    assert set(names["mosaic_flex_grad_d128_bf16_relative_bias"].requires) == {
        registry.FORWARD, registry.DQ, registry.DKV}
    # The Mosaic tangent beside the Mosaic backward (at head dim 256, and beside bias tiles at 128: the tangents of
    # q, k, v and a bias apart, d out in 128-column pieces at 256, 64-column ones with a score_mod; ALiBi's slopes
    # moving, in q's programs at 256).
    assert set(names["mosaic_jvp_d128_bf16_dropout"].requires) == {registry.MOSAIC_FORWARD, registry.MOSAIC_TANGENT}
    assert set(names["mosaic_jvp_d256_bf16_causal"].requires) == {
        registry.MOSAIC_FORWARD, *(registry.MOSAIC_TANGENT + group + piece for group in ("_dq", "_dk", "_dv")
                                   for piece in ("_piece0", "_piece1"))}
    assert set(names["mosaic_jvp_d128_bf16_dv256"].requires) == {
        registry.MOSAIC_FORWARD, *registry.piece_names(registry.MOSAIC_TANGENT, 2)}
    assert set(names["mosaic_flex_jvp_d256_bf16_softcap"].requires) == {
        registry.MOSAIC_FORWARD, *(f"{registry.MOSAIC_TANGENT}{group}_piece{p}" for group in ("_dq", "_dk", "_dv")
                                   for p in range(4))}
    assert set(names["mosaic_jvp_d256_bf16_dense_bias_keys"].requires) == {
        registry.MOSAIC_FORWARD, *(registry.MOSAIC_TANGENT + group + piece for group in ("_dq", "_dk", "_dv", "_dbias")
                                   for piece in ("_piece0", "_piece1"))}
    for name in ("mosaic_jvp_d64_bf16_dense_bias", "mosaic_jvp_d64_bf16_dense_bias_f32",
                 "mosaic_flex_jvp_d128_bf16_alibi"):
        assert set(names[name].requires) == {registry.MOSAIC_FORWARD, registry.MOSAIC_TANGENT}, name
    for name in ("mosaic_jvp_d128_bf16_dense_bias", "mosaic_jvp_d128_bf16_dense_bias_f32"):
        assert set(names[name].requires) == {registry.MOSAIC_FORWARD, *(registry.MOSAIC_TANGENT + group for group in
                                                                        ("_dq", "_dk", "_dv", "_dbias"))}, name
    assert set(names["mosaic_jvp_d256_bf16_dense_bias"].requires) == {  # d out's pieces of 64: q's program fits
        registry.MOSAIC_FORWARD, *(f"{registry.MOSAIC_TANGENT}{group}_piece{p}"
                                   for group in ("_dq", "_dk", "_dv", "_dbias") for p in range(4))}
    assert set(names["mosaic_jvp_d256_bf16_dropout"].requires) == {  # d out's pieces of 64: the hash fits
        registry.MOSAIC_FORWARD, *(f"{registry.MOSAIC_TANGENT}{group}_piece{p}"
                                   for group in ("_dq", "_dk", "_dv") for p in range(4))}
    assert set(names["mosaic_flex_jvp_d256_bf16_alibi"].requires) == {  # the slopes' tangents in q's programs
        registry.MOSAIC_FORWARD, *(f"{registry.MOSAIC_TANGENT}{group}_piece{p}"
                                   for group in ("_dq", "_dk", "_dv") for p in range(4))}
    # Blackwell: the tcgen05 forward and backward, for the families they take (the plans add the rows).
    assert names["mosaic_grad_d128_bf16_causal"].targets == registry.HOPPER + registry.BLACKWELL
    assert set(registry.requires_for(names["mosaic_grad_d128_bf16_causal"], "sm100a_b200")) == {
        registry.MOSAIC_FORWARD_TCGEN05, registry.MOSAIC_DQ_TCGEN05, registry.MOSAIC_DKV_TCGEN05}
    assert set(registry.requires_for(names["mosaic_grad_d128_bf16_dropout"], "sm100a_b200")) == {
        registry.MOSAIC_FORWARD_TCGEN05, registry.MOSAIC_DQ_TCGEN05, registry.MOSAIC_DKV_TCGEN05}
    assert set(registry.requires_for(names["mosaic_grad_d128_bf16_segments_lengths"], "sm100a_b200")) == {
        registry.MOSAIC_FORWARD_TCGEN05, registry.MOSAIC_DQ_TCGEN05, registry.MOSAIC_DKV_TCGEN05}
    assert set(registry.requires_for(names["mosaic_grad_d128_bf16_dense_bias"], "sm100a_b200")) == {
        registry.MOSAIC_FORWARD_TCGEN05, registry.DQ, registry.DKV}  # a bias's backward: Triton's
    assert names["mosaic_flex_grad_d128_bf16_relative_bias"].targets == registry.HOPPER  # Triton's plan there
    assert any(name.startswith("decode_") for name in names)


def test_float32_on_the_mosaic_backend_keeps_the_float32_triton_tiles(monkeypatch):
    """float32 runs on the Triton kernels on backend "mosaic" too: it gets the float32 Triton tiles, not the
    Mosaic forward's 128 x 128 (which needed 262,144 B of shared memory on sm_90a's 232,448)."""
    monkeypatch.setattr(_backend, "target_device", lambda: _gpu("sm90a_h100"))
    for head_dim in (64, 128, 256):
        mosaic, triton = (default_config(FlashConfig(backend=backend), q_len=1024, kv_len=1024, head_dim=head_dim,
                                         dtype=jnp.float32) for backend in ("mosaic", "triton"))
        assert _tiles(mosaic) == _tiles(triton)
    bf16 = default_config(FlashConfig(backend="mosaic"), q_len=1024, kv_len=1024, head_dim=128, dtype=jnp.bfloat16)
    assert (bf16.block_q, bf16.block_k) == (128, 128)


def test_tangent_splits_the_value_head_dim_where_256_spilled(monkeypatch):
    """Version 7d: at head dim 256 the 16-bit tangent on sm_90a splits the value head dim across two programs
    with block tables too (64 x 16, 4 warps); on sm_86 a bias tile or a gathered score tile (`score_tile`)
    splits it on the usual tiles, 16-bit and float32 (the unsplit float32 one needed 102,400 B); sm_80 and
    calls without them keep one program."""
    def tangent(target, dtype, **kwargs):
        monkeypatch.setattr(_backend, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=256, dtype=dtype)
        tiles = triton_plan.tangent_config(config, 256, dtype=dtype, **kwargs)
        return config, tiles, triton_plan.tangent_value_splits(config, 256, dtype=dtype, **kwargs)

    _, tiles, splits = tangent("sm90a_h100", jnp.bfloat16, tables=True)
    assert (tiles.block_q, tiles.block_k, tiles.num_warps, splits) == (64, 16, 4, 2)
    assert tangent("sm90a_h100", jnp.float32, tables=True)[2] == 1
    for dtype in (jnp.bfloat16, jnp.float32):
        plain = tangent("sm86_rtx3090", dtype)
        config, tiles, splits = tangent("sm86_rtx3090", dtype, score_tile=True)
        assert (tiles, splits, plain[2]) == (plain[1], 2, 1)
        assert tangent("sm80_a100", dtype, score_tile=True)[2] == 1


def test_tangent_takes_two_stages_at_head_dim_256_on_a_99_kb_gpu(monkeypatch):
    """Version 7e: the 16-bit tangent at head dim 256 on sm_86 (32 x 16 on 1 stage by default there) spilled
    8-12 B with a window or ALiBi; it takes 2 stages without block tables (whose 64 x 16 tile would not fit
    twice), sm_80 keeps `default_config`'s stage."""
    for target, tables, stages in (("sm86_rtx3090", False, 2), ("sm86_rtx3090", True, 1), ("sm80_a100", False, 1)):
        monkeypatch.setattr(_backend, "target_device", lambda target=target: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=256)
        assert config.num_stages == 1
        tiles = triton_plan.tangent_config(config, 256, tables, dtype=jnp.bfloat16)
        assert (tiles.block_k, tiles.num_stages) == (16, stages)


def test_tangent_query_tile_fits_a_99_kb_gpu_at_head_dim_128(monkeypatch):
    """sm_86: the tangent's 128 x 32 tile with a relative-bias table needed 114,688 B of shared memory (101,376
    available): the query tile is 64 there without block tables; sm_90a keeps 128."""
    for target, block_q in (("sm86_rtx3090", 64), ("sm90a_h100", 128)):
        monkeypatch.setattr(_backend, "target_device", lambda target=target: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=128)
        tangent = triton_plan.tangent_config(config, 128)
        assert (tangent.block_q, tangent.block_k) == (block_q, 32)
        assert triton_plan.tangent_config(config, 128, tables=True).block_q == config.block_q


def test_a_gathered_score_tile_narrows_the_forward_key_tile_without_wgmma(monkeypatch):
    """A score_mod that gathers a value per score from a captured table (relative bias) spilled 40-56 B in the
    16-bit Triton forward at 128 x 64 on sm_80 / sm_86: the forward takes 128 x 32 there. sm_90a (wgmma,
    no spill), a per-head scalar read (ALiBi), float32 and head dim 64 keep their tiles."""
    from probjax_kernels import alibi, alibi_slopes, relative_bias
    from probjax_kernels._hooks import trace_score_mod
    from probjax_kernels._problem import Features, _Problem

    def forward_tiles(target, score_mod, dtype=jnp.bfloat16, head_dim=128):
        monkeypatch.setattr(_backend, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        hook, consts = trace_score_mod(score_mod)
        for _, _, rows, cols, score in triton_plan.hook_shapes(config):
            hook.prepare(*(jax.ShapeDtypeStruct(s, t) for s, t in (
                (score, jnp.float32), ((), jnp.int32), ((), jnp.int32), (rows, jnp.int32), (cols, jnp.int32))))
        problem = _Problem(Features(scale=1.0, score_mod=hook), 1, 8, None, None, None, False, len(consts), 0,
                           config, jax.lax.Precision.DEFAULT)
        picked = triton_plan.forward_config(problem, config, dtype, head_dim)
        return (config.block_q, config.block_k), (picked.block_q, picked.block_k)

    table = relative_bias(jnp.zeros((8, 2047), jnp.float32))
    for target in ("sm80_a100", "sm86_rtx3090"):
        assert forward_tiles(target, table) == ((128, 64), (128, 32))
        assert forward_tiles(target, alibi(alibi_slopes(8))) == ((128, 64), (128, 64))
        default, picked = forward_tiles(target, table, dtype=jnp.float32)
        assert default == picked
        default, picked = forward_tiles(target, table, head_dim=64)
        assert default == picked
    assert forward_tiles("sm90a_h100", table) == ((128, 64), (128, 64))


def test_float32_kernels_are_retiled_where_features_spilled(monkeypatch):
    """float32 at head dim 128 (FMA dots) on sm_80 / sm_86: the forward with a window or dropout takes 3
    stages (12 B), dQ 4 warps (the default tiles spilled 4-20 B with a window, dropout, ALiBi or a BlockMask);
    on sm_90a dQ takes 3 stages (4-32 B with a dense mask or a BlockMask; 4 warps spilled 676 B with a soft
    cap on a BlockMask). dK/dV keeps its tiles (with GQA it runs per query head). 16-bit inputs keep their
    tiles. At head dim 64 and 256 (Versions 7c, 7d) the float32 rules of `triton.retile._float32_local`."""
    from probjax_kernels._problem import Features, _Problem

    def configs(target, group, dtype=jnp.float32, head_dim=128, tables=False, window=None):
        monkeypatch.setattr(_backend, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        features = Features(scale=1.0, window_left=window, block_sizes=(128, 128) if tables else None)
        problem = _Problem(features, group, 8, None, None, None, False, 0, 0, config, jax.lax.Precision.HIGHEST)
        forward = triton_plan.forward_config(problem, config, dtype, head_dim)
        return config, forward, *triton_plan.backward_configs(problem, dtype, head_dim)

    for target in RULE_TARGETS:
        hopper = target == "sm90a_h100"
        config, forward, dq, dkv = configs(target, group=4)
        assert forward == config
        windowed = configs(target, 4, window=256)[1]
        assert windowed == (config if hopper else dataclasses.replace(config, num_stages=3))
        assert dq == dataclasses.replace(config, **({"num_stages": 3} if hopper else {"num_warps": 4}))
        assert dkv == config
        assert configs(target, group=1)[3] == config
        assert configs(target, 1, tables=True)[2] == dq
        kept = configs(target, 1, dtype=jnp.bfloat16, window=256)
        assert all(c == kept[0] for c in kept[1:])
        # Version 7c: float32 at head dim 64 with a window or a BlockMask, forward and dK/dV on 3 stages; at 256
        # with a window, 4 warps in every kernel. Version 7d: a BlockMask's dQ on 16-key steps at 64 on sm_80 /
        # sm_86; at 256 a BlockMask's forward and dK/dV on 4 warps, its dQ on 2.
        config, forward, dq, dkv = configs(target, 1, head_dim=64, window=256)
        assert forward == dkv == dataclasses.replace(config, num_stages=3) and dq == config
        config, forward, dq, dkv = configs(target, 1, head_dim=64, tables=True)
        assert forward == dkv == dataclasses.replace(config, num_stages=3)
        assert config.block_k_dq == 32 and dq == (config if hopper else dataclasses.replace(config, block_k_dq=16))
        config, *kernels = configs(target, 1, head_dim=256, window=256)
        assert kernels == [dataclasses.replace(config, num_warps=4)] * 3
        config, forward, dq, dkv = configs(target, 1, head_dim=256, tables=True)
        assert forward == dkv == dataclasses.replace(config, num_warps=4)
        assert dq == dataclasses.replace(config, num_warps=2)


def test_dk_and_dv_run_in_two_programs_at_head_dim_256_with_a_score_tile(monkeypatch):
    """Version 7f: on sm_90a at head dim 256 (16-bit, K Q^T), a dense bias or a score_mod gathering a score tile
    (a relative-bias table) runs dV and dK in two programs per key tile, on 32-query steps (the one-program
    kernel spilled 8 B with a float32 tile on 16); without one, at head dim 128, in float32 (Q K^T) and on
    sm_80 / sm_86, one program on the usual tiles."""
    from probjax_kernels import alibi, alibi_slopes, relative_bias
    from probjax_kernels._hooks import trace_score_mod
    from probjax_kernels._problem import Features, _Problem

    def dkv(target, head_dim=256, dtype=jnp.bfloat16, bias=None, score_mod=None):
        monkeypatch.setattr(_backend, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        transposed = triton_plan.dkv_transposed(config, dtype, head_dim, bias is not None)
        hook = num_consts = None
        if score_mod is not None:
            hook, consts = trace_score_mod(score_mod)
            num_consts = len(consts)
            for _, _, rows, cols, score in triton_plan.hook_shapes(config, transposed):
                hook.prepare(*(jax.ShapeDtypeStruct(s, t) for s, t in (
                    (score, jnp.float32), ((), jnp.int32), ((), jnp.int32), (rows, jnp.int32), (cols, jnp.int32))))
        problem = _Problem(Features(scale=1.0, score_mod=hook), 1, 8, bias, None, None, False, num_consts or 0, 0,
                           config, jax.lax.Precision.DEFAULT, dkv_transposed=transposed)
        dkv_config = triton_plan.backward_configs(problem, dtype, head_dim)[1]
        return config, dkv_config, triton_plan.retile.dkv_split(problem, head_dim)

    bias, table = (4, 8, 1024, 1024), relative_bias(jnp.zeros((8, 2047), jnp.float32))
    for kwargs in (dict(bias=bias), dict(bias=(1, 8, 1, 1024)), dict(score_mod=table)):
        config, dkv_config, split = dkv("sm90a_h100", **kwargs)
        assert split and (config.block_q_dkv, config.block_k_dkv) == (16, 64)
        assert dkv_config == dataclasses.replace(config, block_q_dkv=32)
    for target, kwargs in (("sm90a_h100", {}), ("sm90a_h100", dict(score_mod=alibi(alibi_slopes(8)))),
                           ("sm90a_h100", dict(head_dim=128, score_mod=table)),
                           ("sm90a_h100", dict(dtype=jnp.float32, bias=bias)),
                           ("sm80_a100", dict(bias=bias)), ("sm86_rtx3090", dict(score_mod=table))):
        config, dkv_config, split = dkv(target, **kwargs)
        assert not split and dkv_config.block_q_dkv <= config.block_q_dkv, (target, kwargs)  # never wider


def test_a_dense_bias_or_mask_retiles_the_kernels_that_spilled_with_it(monkeypatch):
    """A bias or mask tile (Version 7b): at head dim 64 the 16-bit forward takes 8 warps on every GPU and, with
    a bias, dK/dV 32-query steps on sm_80 / sm_86; at head dim 256 a bias takes 16-query dK/dV steps on sm_86
    (shared memory) and K Q^T on sm_90a (Q K^T at 128); float32 at 256 with a mask, dK/dV on 4 warps on sm_80
    / sm_86. With GQA, dK/dV runs per query head whatever the call, on the bias's dK/dV steps on sm_80 / sm_86
    (16-bit) and on 4 warps at head dim 64 / 256 on sm_90a (float32). Dropout and a window at head dim 64 as
    a bias there (Version 7c). A BlockMask at 64 on sm_80 / sm_86: 32-key dK/dV tiles (Version 7d). Calls
    without them keep `default_config`'s tiles."""
    from probjax_kernels._problem import Features, _Problem

    def configs(target, head_dim, dtype=jnp.bfloat16, bias=None, mask=None, group=1, **features):
        monkeypatch.setattr(_backend, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        problem = _Problem(Features(scale=1.0, **features), group, 8, bias, mask, None, False, 0, 0, config,
                           jax.lax.Precision.DEFAULT)
        forward = triton_plan.forward_config(problem, config, dtype, head_dim)
        transposed = triton_plan.dkv_transposed(config, dtype, head_dim, bias is not None)
        return (config, forward, *triton_plan.backward_configs(problem, dtype, head_dim), transposed,
                triton_plan.retile.dkv_per_query_head(problem))

    tile, keys = (4, 8, 1024, 1024), (4, 1, 1, 1024)
    for target in RULE_TARGETS:
        hopper, small = target == "sm90a_h100", target == "sm86_rtx3090"
        for head_dim in (64, 128, 256):
            config, forward, dq, dkv, transposed, per_head = configs(target, head_dim)
            assert forward == dq == dkv == config and not per_head
            assert transposed == (hopper and head_dim > 64)
        config, forward, dq, dkv, _, _ = configs(target, 64, bias=tile)
        assert forward == dataclasses.replace(config, num_warps=8) and dq == config
        assert dkv == (config if hopper else dataclasses.replace(config, block_q_dkv=32))
        assert configs(target, 64, mask=(4, 1, 1024, 1024))[1].num_warps == 8
        assert configs(target, 128, bias=tile)[4] is False
        config, _, _, dkv, transposed, _ = configs(target, 256, bias=tile)
        assert transposed == hopper
        assert dkv == (dataclasses.replace(config, block_q_dkv=16) if small else config)
        config, _, _, dkv, _, _ = configs(target, 256, jnp.float32, mask=tile)
        assert dkv == (config if hopper else dataclasses.replace(config, num_warps=4))
        assert configs(target, 128, group=4)[5] and configs(target, 128, mask=keys, group=4)[5]
        assert not configs(target, 128, bias=tile)[5]
        # GQA (its dK / dV per query head, written in float32): the bias's dK/dV steps on sm_80 / sm_86, float32
        # dK/dV on 4 warps at head dim 64 / 256 on sm_90a.
        config, _, _, dkv, _, _ = configs(target, 64, group=4)
        assert dkv == (config if hopper else dataclasses.replace(config, block_q_dkv=32))
        config, _, _, dkv, _, _ = configs(target, 256, group=4)
        assert dkv == (dataclasses.replace(config, block_q_dkv=16) if small else config)
        for head_dim in (64, 256):
            config, _, _, dkv, _, _ = configs(target, head_dim, jnp.float32, group=4)
            assert dkv == (dataclasses.replace(config, num_warps=4) if hopper else config)
        assert configs(target, 128, jnp.float32, group=4)[3].num_warps == 8
        # Version 7c, 16-bit at head dim 64: dropout's forward on 8 warps too, a window's dK/dV on the bias's
        # 32-query steps on sm_80 / sm_86.
        config, forward, dq, dkv, _, _ = configs(target, 64, dropout_rate=0.1)
        assert forward == dataclasses.replace(config, num_warps=8) and dq == dkv == config
        config, forward, dq, dkv, _, _ = configs(target, 64, window_left=256, window_right=0)
        assert forward == dq == config
        assert dkv == (config if hopper else dataclasses.replace(config, block_q_dkv=32))
        assert configs(target, 128, window_left=256, window_right=0)[3] == configs(target, 128)[0]
        # Version 7d, 16-bit at head dim 64 with a BlockMask: dK/dV on 32-key tiles on sm_80 / sm_86.
        config, forward, dq, dkv, _, _ = configs(target, 64, block_sizes=(128, 128))
        assert forward == dq == config
        assert dkv == (config if hopper else dataclasses.replace(config, block_k_dkv=32))
        assert configs(target, 128, block_sizes=(128, 128))[3] == configs(target, 128)[0]
