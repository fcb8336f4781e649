"""`default_config` never picks a configuration the committed compile report (docs/compile/report.json,
written by `bash scripts/compile_check.sh`) marks failing, on any of its targets: the GPU is faked by its compute
capability, the way `default_config` reads it from `jax.default_device`."""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from probjax_kernels import FlashConfig, _dispatch, default_config

REPORT = json.loads((Path(__file__).resolve().parent.parent / "docs" / "compile" / "report.json").read_text())
TARGETS = REPORT["targets"]
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class FakeGPU:
    """What `default_config` reads of a device: its platform and compute capability."""

    compute_capability: str
    platform: str = "gpu"


def _gpu(target: str) -> FakeGPU:
    major, minor = re.fullmatch(r"sm_(\d)(\d)a?", REPORT["limits"][target]["arch"]).groups()
    return FakeGPU(f"{major}.{minor}")


def _tiles(config: FlashConfig) -> dict:
    return {k: v for k, v in vars(config).items() if k != "backend"}


def _failures(row: dict) -> list[str]:
    """What the report's own check (scripts/compile/report.py) found wrong with this compile."""
    return row["problems"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_reported_variant_is_the_default_and_passes(target, monkeypatch):
    """Each compiled variant's tiles are what default_config picks for that target, and none failed."""
    monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
    rows = [r for r in REPORT["rows"] if r["target"] == target and r["group"] in ("triton", "mosaic", "control")]
    assert rows
    # The report's one OPEN variant (flex with a relative-bias table at head dim 128) fails and is listed as
    # open on its page; everything else must pass.
    assert {r["variant"] for r in rows if r["open"]} <= {"flex_grad_d128_bf16_relative_bias"}
    rows = [r for r in rows if not r["open"]]
    for row in rows:
        head_dim = max(row["head_dim"], row["value_dim"] or 0)
        picked = default_config(FlashConfig(backend=row["backend"]), q_len=row["q_len"], kv_len=row["kv_len"],
                                head_dim=head_dim, dtype=DTYPES[row["dtype"]])
        assert _tiles(picked) == row["config"], row["variant"]
        assert not _failures(row), (row["variant"], _failures(row))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiles_on_the_seed_grid_are_reported_passing(target, head_dim, monkeypatch):
    """At every seed sequence length, default_config picks Triton tiles the report compiled without failing
    at that head dim (tiles do not depend on the length beyond shrinking to short sequences)."""
    monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
    passing = [r["config"] for r in REPORT["rows"] if r["target"] == target and r["head_dim"] == head_dim
               and r["group"] in ("triton", "control") and r["value_dim"] is None and not _failures(r)
               and not r["open"]]
    assert passing
    for seq in (600, 1024, 1500, 2048, 3000, 4096, 8192):
        picked = _tiles(default_config(FlashConfig(backend="triton"), q_len=seq, kv_len=seq, head_dim=head_dim))
        assert picked in passing, (target, head_dim, seq, picked)


def test_target_device_follows_jax_default_device():
    """On the CPU the default device is the CPU, and default_config picks interpret mode's tiles."""
    with jax.default_device(jax.devices("cpu")[0]):
        assert _dispatch.target_device().platform == "cpu"
        assert default_config(None, q_len=1024, kv_len=1024, head_dim=128).backend == "interpret"


def test_tangent_tiles_shrink_the_key_tile_only_on_a_gpu(monkeypatch):
    monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu("sm86_rtx3090"))
    config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=256)
    tangent = _dispatch.tangent_config(config, 256)
    assert (tangent.block_q, tangent.block_k, tangent.num_warps) == (32, 16, 8)
    assert _dispatch.tangent_config(config, 256, tables=True).block_q == config.block_q
    # The dtype as default_config takes it: float32 (FMA dots) shrinks the query tile at head dim 128 too.
    config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=128)
    assert _dispatch.tangent_config(config, 128, dtype=jnp.float32).block_q == 16
    assert _dispatch.tangent_config(config, 128, dtype=jnp.bfloat16).block_q == config.block_q
    interpret = default_config(FlashConfig(backend="interpret"), q_len=1024, kv_len=1024, head_dim=256)
    assert _dispatch.tangent_config(interpret, 256) == interpret
