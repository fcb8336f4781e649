"""The compile report's check (scripts/compile/check.py, run as `report.py check`) fails closed, proved by feeding
it broken reports."""

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "compile"))
import page as compile_page  # noqa: E402
import report as compile_report  # noqa: E402 - scripts/compile/report.py: the check and its registry
import rules  # noqa: E402
import variants as registry  # noqa: E402
from figures import ARCH_SASS_OPS, target_limits  # noqa: E402
from rules import WIDE_MMA, small_decode_tiles  # noqa: E402



def _kernel(name: str, target: str, dtype: str, small_decode: bool = False) -> dict:
    """A kernel row that passes every check: no spill, small shared memory, wgmma on Hopper, tcgen05 on sm_100a,
    mma.sync and cp.async elsewhere (and in the small decode tiles), TMA in Mosaic kernels; float32 kernels use
    no tensor cores."""
    arch = target_limits(target)["arch"]
    mma = 0 if dtype == "f32" else 24
    wide = None if small_decode else WIDE_MMA.get(arch, (None,))[0]
    out = dict(kernel=name, lowering="mosaic" if name.startswith("probjax_mosaic") else "triton", registers=128,
               threads=256, smem=49_152, spill_stores=0, spill_loads=0, stack=0, HGMMA=mma if wide == "HGMMA" else 0,
               HMMA=0 if wide else mma, UTMALDG=8 if name.startswith("probjax_mosaic") else 0, LDGSTS=16)
    if arch in ARCH_SASS_OPS:
        out["UTCHMMA"] = mma if wide == "UTCHMMA" else 0
    return out


def _clean_report() -> dict:
    """A report of every (target, variant) pair of the registry, each with exactly its required kernels."""
    rows, small = [], set(small_decode_tiles(registry.variants()))
    for target, v in compile_report.expected():
        rows.append(dict(variant=v.name, group=v.group, target=target, head_dim=v.head_dim, value_dim=v.value_dim,
                         dtype=v.dtype, mode=v.mode, backend=v.backend, q_len=v.q_len, kv_len=v.kv_len,
                         status="ok", config={"num_stages": 2}, compile_s=1.0,
                         kernels=[_kernel(k, target, v.dtype, v.name in small and k == registry.DECODE)
                                  for k in registry.requires_for(v, target)],
                         **({"hbm": dict(arguments=2**30, outputs=2**30, temp=2**31, alias=0, generated_code=0,
                                         total=2**32, xla_bytes=2**28),
                             "collectives": {"all-reduce": 8, "collective-permute": 16}}
                            if v.group == "lm" or v.name.startswith("side_") else {})))
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


def _only(found: list[str], *words: str) -> list[str]:
    return [p for p in found if all(w in p for w in words)]


def test_hopper_kernels_must_be_all_wgmma(clean):
    """A 16-bit sm_90a kernel with one mma.sync among 96 wgmma fails (the share is 1.0, not the 0.5 it was); a
    Mosaic kernel without TMA fails."""
    broken = copy.deepcopy(clean)
    dkv = next(k for k in _row(broken, "sm90a_h100", "flash_grad_d64_bf16_full")["kernels"]
               if k["kernel"] == registry.DKV)
    dkv.update(HGMMA=12, HMMA=96)
    assert _only(compile_report.problems(broken), "flash_grad_d64_bf16_full", "wgmma share 0.11")
    dkv.update(HGMMA=96, HMMA=1)
    found = compile_report.problems(broken)
    assert len(found) == 1 and _only(found, "sm90a_h100 flash_grad_d64_bf16_full", "wgmma share 0.99", "under 1.0")
    dkv.update(HGMMA=0, HMMA=0)  # no tensor-core matmul at all in a 16-bit kernel
    assert _only(compile_report.problems(broken), "wgmma share None")
    dkv.update(HGMMA=96, HMMA=0)
    mosaic = _row(broken, "sm90a_h100", "mosaic_grad_d64_bf16_full")["kernels"][0]
    mosaic["UTMALDG"] = 0
    assert _only(compile_report.problems(broken), "without TMA")


def test_blackwell_kernels_must_be_all_tcgen05(clean):
    """sm_100a: a 16-bit Triton kernel whose dK/dV steps ran on mma.sync (the A100's 32-row tiles: 96 HMMA, 12
    UTCHMMA) fails, so does one with a single HMMA or a wgmma; float32 is not held to it."""
    broken = copy.deepcopy(clean)
    dkv = next(k for k in _row(broken, "sm100a_b200", "flash_grad_d128_bf16_causal")["kernels"]
               if k["kernel"] == registry.DKV)
    for counts, share in ((dict(UTCHMMA=12, HMMA=96), "0.11"), (dict(UTCHMMA=191, HMMA=1), "0.99"),
                          (dict(UTCHMMA=96, HGMMA=32, HMMA=0), "0.75")):
        dkv.update({"HGMMA": 0, **counts})
        found = compile_report.problems(broken)
        assert len(found) == 1 and _only(found, "sm100a_b200 flash_grad_d128_bf16_causal", f"tcgen05 share {share}")
    dkv.update(UTCHMMA=192, HGMMA=0, HMMA=0)
    f32 = _row(broken, "sm100a_b200", "flash_grad_d128_f32_causal")["kernels"][0]
    f32.update(UTCHMMA=0, HMMA=0)
    assert compile_report.problems(broken) == []


def test_small_decode_tiles_are_those_under_64_query_rows(clean):
    """The decode variants under 64 query rows may run mma.sync on sm_90a / sm_100a, their decode kernel only:
    the seeds and LM programs the earlier hand list named, and the rows decode_space.py derives; the T = 16,
    GQA 32:8 ones (64 rows, which an earlier regex exempted too) may not. A decode variant that does not state
    its query rows fails."""
    names = {v.name: v for v in registry.variants()}
    small = set(small_decode_tiles(names.values()))
    assert small == {n for n, v in names.items() if v.query_rows is not None and v.query_rows < 64
                     and v.dtype != "f32"}
    assert {"decode_d64_bf16_cache8192_gqa8to2", "decode_paged64_d128_bf16_gqa32to8_t4",
            "lm_generate_bench_hd128_T8192", "decode_paged64_d128_bf16_gqa8to1_t4"} <= small
    broken = copy.deepcopy(clean)
    for target in ("sm90a_h100", "sm100a_b200"):
        for name in ("decode_paged16_d128_bf16_gqa32to8_t16_alibi_window",
                     "decode_paged64_d128_f16_gqa32to8_t16_alibi_window", "decode_cache8192_d128_bf16_gqa8to2_t16"):
            assert names[name].query_rows == 64
            kernel = _row(broken, target, name)["kernels"][0]
            kernel.update(HGMMA=0, HMMA=24, UTCHMMA=0)
            assert _only(compile_report.problems(broken), target, name, "share 0.0")
            kernel.update(_kernel(registry.DECODE, target, "bf16"))
    assert compile_report.problems(broken) == []
    unstated = dataclasses.replace(names["decode_d64_bf16_cache8192_gqa8to2"], query_rows=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "variants", lambda: [*names.values(), dataclasses.replace(unstated, name="x")])
        assert compile_report.rule_problems() == ["x: a decode variant without its query rows (Variant.query_rows)"]


@pytest.mark.parametrize("target, figure", [("sm90a_h100", "smem"), ("sm90a_h100", "HGMMA"),
                                            ("sm80_a100", "registers"), ("sm86_rtx3090", "spill_stores"),
                                            ("sm100a_b200", "UTCHMMA"), ("sm120_rtx5090", "LDGSTS"),
                                            ("sm89_rtx4090", "HMMA"), ("sm90a_h100", "threads")])
def test_a_missing_figure_fails(clean, target, figure):
    """A figure the check reads, null (a `smem: null` used to skip the shared-memory check) or absent, fails,
    naming it, whatever the row's dtype."""
    for variant in ("flash_grad_d128_bf16_causal", "flash_grad_d128_f32_causal"):
        for how in ("null", "absent"):
            broken = copy.deepcopy(clean)
            kernel = _row(broken, target, variant)["kernels"][1]
            if how == "null":
                kernel[figure] = None
            else:
                del kernel[figure]
            found = compile_report.problems(broken)
            assert len(found) == 1 and _only(found, target, variant, f"figure(s) {figure} missing"), found


def test_cp_async_is_read_from_the_kernels_own_config(clean):
    """A kernel retiled to 2 stages (`kernel_configs`) on a row whose config has 1 must hold cp.async."""
    broken = copy.deepcopy(clean)
    row = _row(broken, "sm89_rtx4090", "flash_grad_d256_bf16_causal")
    row["config"] = {"num_stages": 1}
    for kernel in row["kernels"]:
        kernel["LDGSTS"] = 0
    assert compile_report.problems(broken) == []
    row["kernel_configs"] = {registry.DQ: {"num_stages": 2}}
    found = compile_report.problems(broken)
    assert len(found) == 1 and _only(found, registry.DQ, "without cp.async")


def test_every_tolerance_is_one_entry_with_why_on_the_page(clean, monkeypatch):
    """The report carries every tolerance of rules.py with its reason, and the page prints each; a spill entry
    is one more."""
    monkeypatch.setitem(rules.SPILLS, (registry.DKV, "sm89_rtx4090", "flash_grad_d64_bf16_window"), (8, 8, "a why"))
    report = copy.deepcopy(clean)
    for row in report["rows"]:
        row["fallback_config"] = None  # (the fake rows have no tiles to derive the Triton fallback's from)
    report = compile_report._with_verdicts(report)
    # Four rules, one entry per retired variant, and the spill entry set above.
    assert len(report["tolerances"]) == 4 + len(rules.RETIRED) + 1 and report["min_wide_share"] == 1.0
    assert all(t["rule"] and t["covers"] and t["why"] for t in report["tolerances"])
    assert "no_wgmma_variants" not in report
    report["limits"] = {t: target_limits(t) for t in report["targets"]}
    for row in report["rows"]:
        row["config"] = None  # (no tiles to print)
    report.update(toolchain={"ptxas": "x"}, wall_s=1.0, jobs=1)
    page = compile_page.markdown(report, [])
    for tolerance in report["tolerances"]:
        assert tolerance["covers"] in page and tolerance["why"] in page


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


def test_the_lm_programs_hbm_is_held_to_the_device(clean):
    """The LM example's whole programs (group "lm", one H200): their planned HBM must be present and within the
    device's 141 GB; the generation's prefill forward is held to the wgmma share, its decode steps (1 query row)
    are not."""
    assert compile_report.device_memory("sm90a_h200") == 151_397_597_184
    assert {t for t, v in compile_report.expected() if v.group == "lm"} == {"sm90a_h200", "sm100a_b200"}
    for variant in ("lm_train_step_bench_hd128_T2048", "lm_generate_bench_hd64_T2048"):
        broken = copy.deepcopy(clean)
        row = _row(broken, "sm90a_h200", variant)
        row["hbm"]["total"] = 151_397_597_185
        found = compile_report.problems(broken)
        assert len(found) == 1 and _only(found, variant, "151,397,597,185 B of HBM planned, over the device's")
        del row["hbm"]
        assert _only(compile_report.problems(broken), variant, "figure hbm missing")
    broken = copy.deepcopy(clean)
    kernels = {k["kernel"]: k for k in _row(broken, "sm90a_h200", "lm_generate_bench_hd128_T2048")["kernels"]}
    kernels[registry.DECODE].update(HGMMA=0, HMMA=48)
    assert compile_report.problems(broken) == []
    kernels[registry.FORWARD].update(HGMMA=0, HMMA=48)
    assert _only(compile_report.problems(broken), "lm_generate_bench_hd128_T2048", registry.FORWARD, "wgmma share 0.0")


def test_the_lm_training_step_on_two_gpus_shows_the_collective_of_its_axis(clean):
    """The training step on a mesh of 2 GPUs (`lm_programs.MESHES`) on each LM target: "data=2" must all-reduce
    its gradients, "seq=2" must pass K / V round a ring (collective-permutes; without them the sequence was
    gathered); each is one problem of its own row. A ring's second specialization of a kernel (XLA's
    `NAME__1`: the diagonal and the full blocks) is the kernel the row requires; a kernel not required fails."""
    names = {v.name for t, v in compile_report.expected() if t == "sm100a_b200"}
    assert {f"lm_train_step_bench_hd{d}_T{t}_{axis}2" for d in (64, 128) for t in (2048, 8192)
            for axis in ("data", "seq")} <= names
    for variant, wanted in (("lm_train_step_bench_hd128_T2048_data2", "all-reduce"),
                            ("lm_train_step_bench_hd64_T2048_seq2", "collective-permute")):
        broken = copy.deepcopy(clean)
        _row(broken, "sm100a_b200", variant)["collectives"][wanted] = 0
        found = compile_report.problems(broken)
        assert len(found) == 1 and _only(found, variant, f"no {wanted} in the program")
    broken = copy.deepcopy(clean)
    kernels = _row(broken, "sm90a_h200", "lm_train_step_bench_hd64_T2048_seq2")["kernels"]
    kernels.append(dict(kernels[0], kernel=kernels[0]["kernel"] + "__1"))
    assert compile_report.problems(broken) == []
    kernels.append(dict(kernels[0], kernel="probjax_flash_tangent"))
    found = compile_report.problems(broken)
    assert len(found) == 1 and _only(found, "seq2", "kernel(s) the registry does not expect: probjax_flash_tangent")


def test_our_programs_beside_tokamax_need_their_figures_and_show_the_ratios(clean):
    """The `side_` rows (our fwd+bwd programs compiled alone at the tokamax peers' shapes) fail without their
    program figures; the page prints ours beside tokamax's with the ratios of HBM temp and XLA-side bytes."""
    assert {t for t, v in compile_report.expected() if v.name == "side_flash_grad_d128_bf16_causal_T8192"} == {
        "sm90a_h100", "sm100a_b200"}
    assert {t for t, v in compile_report.expected() if v.name.startswith("side_mosaic")} == {"sm90a_h100",
                                                                                            "sm100a_b200"}
    broken = copy.deepcopy(clean)
    del _row(broken, "sm100a_b200", "side_flash_grad_d64_bf16_causal")["hbm"]
    found = compile_report.problems(broken)
    assert len(found) == 1 and _only(found, "side_flash_grad_d64_bf16_causal", "xla_bytes missing")
    report = copy.deepcopy(clean)
    theirs = dict(_row(report, "sm90a_h100", "side_mosaic_grad_d128_bf16_causal_T8192"),
                  variant="tokamax_mosaic_grad_d128_bf16_causal_T8192", group="peer",
                  hbm=dict(temp=2**32, xla_bytes=2**30))
    report["rows"].append(theirs)
    lines = [line for line in compile_page.side_by_side_section(report["rows"])
             if line.startswith("| sm90a_h100 | 8192 | 128 | mosaic |")]
    assert len(lines) == 2, lines
    assert lines[0].split(" | ")[-2:] == ["0.50", "0.25 |"], lines[0]  # 2 GiB / 4 GiB, 256 MiB / 1 GiB
    assert lines[1].split(" | ")[4] == "tokamax"

