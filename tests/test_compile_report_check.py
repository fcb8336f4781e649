"""The compile report's check (scripts/compile/check.py, run as `report.py check`) fails closed, proved by feeding
it broken reports."""

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "compile"))
import report as compile_report  # noqa: E402 - scripts/compile/report.py: the check and its registry
import variants as registry  # noqa: E402



def _kernel(name: str, target: str, dtype: str) -> dict:
    """A kernel row that passes every check: no spill, small shared memory, wgmma on Hopper, mma.sync and
    cp.async elsewhere, TMA in Mosaic kernels; float32 kernels use no tensor cores."""
    hopper = target == "sm90a_h100"
    mma = 0 if dtype == "f32" else 24
    return dict(kernel=name, lowering="mosaic" if name.startswith("probjax_mosaic") else "triton", registers=128,
                threads=256, smem=49_152, spill_stores=0, spill_loads=0, stack=0, HGMMA=mma if hopper else 0,
                HMMA=0 if hopper else mma, UTMALDG=8 if name.startswith("probjax_mosaic") else 0, LDGSTS=16)


def _clean_report() -> dict:
    """A report of every (target, variant) pair of the registry, each with exactly its required kernels."""
    rows = []
    for target, v in compile_report.expected():
        rows.append(dict(variant=v.name, group=v.group, target=target, head_dim=v.head_dim, value_dim=v.value_dim,
                         dtype=v.dtype, mode=v.mode, backend=v.backend, q_len=v.q_len, kv_len=v.kv_len,
                         status="ok", config={"num_stages": 2}, compile_s=1.0,
                         kernels=[_kernel(k, target, v.dtype) for k in v.requires]))
    return dict(targets=list(compile_report.TARGETS), rows=rows)


@pytest.fixture(scope="module")
def clean():
    return _clean_report()


def _row(report: dict, target: str, variant: str) -> dict:
    return next(r for r in report["rows"] if r["target"] == target and r["variant"] == variant)


def test_a_complete_clean_report_passes(clean):
    assert compile_report.problems(clean) == []


@pytest.mark.parametrize("drop", ["everything", "sm86_rtx3090", "decode", "mosaic"])
def test_missing_rows_fail(clean, drop):
    """An empty report, one without a target's rows or without a group's (decode, Mosaic) fails, naming each
    missing pair."""
    broken = dict(clean, rows=[r for r in clean["rows"] if drop != "everything" and drop not in (r["target"], r["group"])])
    found = compile_report.problems(broken)
    missing = {(r["target"], r["variant"]) for r in clean["rows"]} - {(r["target"], r["variant"]) for r in broken["rows"]}
    assert missing and len([p for p in found if "missing from the report" in p]) == len(missing)


def test_an_empty_expected_set_fails(clean):
    """--only matching nothing checks nothing: that fails instead of passing."""
    assert compile_report.problems(clean, only="^NOTHING$")
    assert compile_report.problems(clean, only="^flash_grad_d128_bf16_causal$") == []
    assert compile_report.problems(dict(clean, rows=[]), only="^flash_grad_d128_bf16_causal$")


@pytest.mark.parametrize("kernel", [registry.DKV, registry.DQ, registry.FORWARD])
def test_a_missing_kernel_fails(clean, kernel):
    broken = copy.deepcopy(clean)
    row = _row(broken, "sm86_rtx3090", "flash_grad_d128_bf16_causal")
    row["kernels"] = [k for k in row["kernels"] if k["kernel"] != kernel]
    assert any("missing kernel" in p and kernel in p for p in compile_report.problems(broken))


def test_tangent_and_decode_kernels_are_required(clean):
    for target, variant, kernel in (("sm80_a100", "flash_jvp_d128_bf16_causal", registry.TANGENT),
                                    ("sm90a_h100", "decode_d128_bf16_cache8192_gqa8to2", registry.DECODE)):
        broken = copy.deepcopy(clean)
        row = _row(broken, target, variant)
        row["kernels"] = [k for k in row["kernels"] if k["kernel"] != kernel]
        assert any("missing kernel" in p and kernel in p for p in compile_report.problems(broken))


def test_a_variant_that_raised_while_built_fails(clean):
    broken = copy.deepcopy(clean)
    row = _row(broken, "sm90a_h100", "decode_d64_bf16_cache8192_gqa8to2")
    row.update(status="error", error="ImportError: cannot import name 'DecodeConfig'", kernels=[])
    assert any("compile error" in p and "DecodeConfig" in p for p in compile_report.problems(broken))


def test_a_mosaic_variant_on_triton_kernels_fails(clean):
    """`_mosaic_takes` returning False puts a Mosaic call on the Triton kernels: the required probjax_mosaic_*
    kernels are missing and the Triton ones unexpected."""
    broken = copy.deepcopy(clean)
    row = _row(broken, "sm90a_h100", "mosaic_grad_d128_bf16_causal")
    row["kernels"] = [_kernel(k, "sm90a_h100", "bf16") for k in (registry.FORWARD, registry.DQ, registry.DKV)]
    found = " ".join(compile_report.problems(broken))
    assert registry.MOSAIC_FORWARD in found and "does not expect" in found


def test_a_row_the_registry_lacks_and_a_duplicate_fail(clean):
    broken = copy.deepcopy(clean)
    broken["rows"].append(dict(broken["rows"][0], variant="flash_grad_d96_bf16_full"))
    broken["rows"].append(copy.deepcopy(broken["rows"][1]))
    found = compile_report.problems(broken)
    assert any("not in the registry" in p for p in found) and any("twice" in p for p in found)


def test_spills_fail_outside_their_capped_entries(clean, monkeypatch):
    broken = copy.deepcopy(clean)
    kernel = _row(broken, "sm90a_h100", "flash_grad_d128_bf16_window")["kernels"][0]
    kernel.update(spill_stores=40, spill_loads=40)
    assert any("spills 40 B" in p for p in compile_report.problems(broken))
    # An entry is one kernel, on one target, in one variant: it covers nothing else, and caps its bytes.
    monkeypatch.setitem(compile_report.SPILLS, (kernel["kernel"], "sm90a_h100", "flash_grad_d128_bf16_window"),
                        (44, 44, "why"))
    assert compile_report.problems(broken) == []
    kernel.update(spill_stores=48)
    assert any("spills 48 B" in p for p in compile_report.problems(broken))
    kernel.update(spill_stores=40)
    _row(broken, "sm80_a100", "flash_grad_d128_bf16_window")["kernels"][0].update(spill_stores=8)
    assert any("sm80_a100" in p and "spills 8 B" in p for p in compile_report.problems(broken))


def test_shared_memory_over_the_target_fails(clean):
    broken = copy.deepcopy(clean)
    _row(broken, "sm86_rtx3090", "flash_grad_d128_bf16_full")["kernels"][2]["smem"] = 200_000
    assert any("shared memory over" in p for p in compile_report.problems(broken))


def test_hopper_kernels_must_be_mostly_wgmma(clean):
    """The sm_90a dK/dV at head dim 64 with most of its matmuls on mma.sync fails; a Mosaic kernel without
    TMA fails."""
    broken = copy.deepcopy(clean)
    dkv = next(k for k in _row(broken, "sm90a_h100", "flash_grad_d64_bf16_full")["kernels"]
               if k["kernel"] == registry.DKV)
    dkv.update(HGMMA=12, HMMA=96)
    assert any("wgmma share 0.11" in p for p in compile_report.problems(broken))
    dkv.update(HGMMA=96, HMMA=12)
    mosaic = _row(broken, "sm90a_h100", "mosaic_grad_d64_bf16_full")["kernels"][0]
    mosaic["UTMALDG"] = 0
    assert any("without TMA" in p for p in compile_report.problems(broken))


def test_ampere_kernels_use_mma_and_cp_async(clean):
    broken = copy.deepcopy(clean)
    kernel = _row(broken, "sm86_rtx3090", "flash_grad_d64_bf16_full")["kernels"][0]
    kernel.update(HMMA=0)
    assert any("without mma.sync" in p for p in compile_report.problems(broken))
    kernel.update(HMMA=24, LDGSTS=0)
    assert any("without cp.async" in p for p in compile_report.problems(broken))



def test_a_reused_figure_that_does_not_reproduce_fails(clean):
    """A unit compiled again whose module has the earlier row's fingerprint must give its figures: equal, it is
    marked reproduced; different, the row is an error the check fails; a changed module is a plain compile."""
    report = copy.deepcopy(clean)
    row = _row(report, "sm90a_h100", "flash_grad_d128_bf16_causal")
    row["fingerprint"] = "f"
    earlier = copy.deepcopy(row)
    assert compile_report._reproduces(row, earlier) == dict(reproduced=True)
    assert compile_report._reproduces(row, dict(earlier, fingerprint="g")) == {}
    assert compile_report._reproduces(row, None) == {}
    earlier["kernels"][0]["registers"] += 8
    row.update(compile_report._reproduces(row, earlier))
    assert row["status"] == "error" and not row["reproduced"]
    assert any("compile error: the same lowered module" in p for p in compile_report.problems(report))



def test_check_cli_exit_status(clean, tmp_path):
    """`report.py check FILE` exits 1 on an empty report and 0 on a clean one."""
    path = tmp_path / "report.json"
    path.write_text(json.dumps(dict(clean, rows=[])))
    assert compile_report.check(path) == 1
    path.write_text(json.dumps(clean))
    assert compile_report.check(path) == 0
