"""The TPU compile report's gate (scripts/compile/tpu_check.py) fails closed: fed reports with one thing broken
(a missing pair, a compile error, a missing tpu_custom_call, a changed dispatch path, VMEM over the limit,
quadratic HBM growth, ...) it fails each, and it passes a complete one. None of this needs libtpu: the gate
reads JSON. The committed report's TPU section passes it, at the tiles `default_config` picks per generation."""

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from probjax_kernels import _backend, FlashConfig, _dispatch, default_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "compile"))

import tpu_check  # noqa: E402
import tpu_report  # noqa: E402
import tpu_variants  # noqa: E402

MIB = 1 << 20
REGISTRY = {v.name: v for v in tpu_variants.gated_variants()}
TARGETS = list(tpu_variants.TARGETS)


def _row(target: str, variant, vmem: int = MIB) -> dict:
    """A passing row for `variant` on `target`, as tpu_report.worker writes it."""
    kernels = [dict(kernel=name, scoped_vmem=vmem, grid=[4, 8, 4, 2], blocks=[[256, 128]])
               for name in variant.required_kernels(target)]
    chain = {t: 256 * MIB << i for i, t in enumerate(tpu_variants.HBM_LENGTHS)}
    temp = chain[variant.q_len] if variant.group == "hbm" else 256 * MIB * (variant.q_len >= 8192)
    return dict(target=target, variant=variant.name, group=variant.group, mode=variant.mode, q_len=variant.q_len,
                path=variant.path, dispatch=variant.path, kernels=kernels, status="ok", compile_s=1.0,
                hbm=dict(temp=temp, argument=0, output=0))


SIDE_PEERS = [v for v in tpu_variants.side_variants() if v.group == "peer" and v.name.startswith("jax_splash")]


def _good() -> dict:
    rows = [_row(t, v) for t in TARGETS for v in REGISTRY.values()]
    for target in tpu_check.GATED_TARGETS:  # splash at each side-by-side shape, above ours (256 MiB at most)
        rows += [dict(_row(target, v), hbm=dict(temp=300 * MIB, argument=0, output=0)) for v in SIDE_PEERS]
    rows.append(dict(target="tpu_v5e", variant="jax_splash_grad_d128_bf16_causal", group="peer", status="error",
                     error="peers are not gated", kernels=[], compile_s=1.0))
    return dict(targets=TARGETS, toolchain=dict(jax="0.11.2", libtpu="0.0.48.1"), wall_s=1.0, jobs=2, rows=rows)


def _find(section: dict, target: str, name: str) -> dict:
    return next(r for r in section["rows"] if r["target"] == target and r["variant"] == name)


KERNEL_VARIANT = "tpu_grad_d128_bf16_causal"
FALLBACK_VARIANT = next(name for name, v in REGISTRY.items() if v.path == "fallback")


def test_a_complete_report_passes():
    assert tpu_check.problems(_good()) == []
    assert tpu_check.problems(_good(), open_ones=True) == []


def test_the_registry_expects_kernels_and_fallbacks():
    """Not vacuous: the registry holds kernel variants of every mode and flex fallbacks."""
    paths = {v.path for v in REGISTRY.values()}
    assert paths == {"kernel", "fallback"}
    assert {v.mode for v in REGISTRY.values() if v.path == "kernel"} == {"fwd", "fwd+bwd", "jvp", "decode", "ragged"}
    assert {"probjax_tpu_backward_dkv", "probjax_tpu_backward_fused", "probjax_tpu_tangent",
            "probjax_tpu_ragged_paged_attention"} <= {k for v in REGISTRY.values() for t in TARGETS
                                                      for k in v.required_kernels(t)}


def _broken(edit) -> list[str]:
    section = _good()
    edit(section)
    return tpu_check.problems(section)


def _drop(section, target, name):
    section["rows"].remove(_find(section, target, name))


@pytest.mark.parametrize("case, edit, expected", [
    ("missing pair", lambda s: _drop(s, "tpu_v5p", KERNEL_VARIANT), "tpu_v5p tpu_grad_d128_bf16_causal: missing"),
    ("compile error", lambda s: _find(s, "tpu_v6e", KERNEL_VARIANT).update(status="error", error="E1001"),
     "compile error: E1001"),
    ("missing kernel", lambda s: _find(s, "tpu_v6e", KERNEL_VARIANT)["kernels"].pop(),  # two kernels on v6e
     "no tpu_custom_call of probjax_tpu_backward_dkv"),
    ("missing fused kernel", lambda s: _find(s, "tpu_v5e", KERNEL_VARIANT)["kernels"].pop(),
     "no tpu_custom_call of probjax_tpu_backward_fused"),
    ("no kernels at all", lambda s: _find(s, "tpu_v5e", "tpu_jvp_d128_bf16_causal").update(kernels=[]),
     "no tpu_custom_call of probjax_tpu_tangent"),
    ("kernel variant fell back", lambda s: _find(s, "tpu_v5e", KERNEL_VARIANT).update(dispatch="fallback"),
     "expected the kernel path"),
    ("fallback became a kernel", lambda s: _find(s, "tpu_v5e", FALLBACK_VARIANT).update(
        dispatch="kernel", kernels=[dict(kernel="probjax_tpu_forward", scoped_vmem=MIB)]),
     "a fallback variant compiled a tpu_custom_call"),
    ("VMEM over v5e's 32 MiB", lambda s: _find(s, "tpu_v5e", KERNEL_VARIANT)["kernels"][0].update(
        scoped_vmem=33 * MIB), "scoped VMEM over the tpu_v5e limit"),
    ("no VMEM figure", lambda s: _find(s, "tpu_v5p", KERNEL_VARIANT)["kernels"][0].update(scoped_vmem=None),
     "no scoped VMEM figure"),
    ("quadratic HBM at the first doubling", lambda s: _find(
        s, "tpu_v6e", f"tpu_hbm_grad_d128_bf16_causal_T{tpu_variants.HBM_LENGTHS[1]}")["hbm"].update(temp=1024 * MIB),
     "grows faster than linearly"),
    ("quadratic HBM at the last doubling", lambda s: _find(
        s, "tpu_7x", f"tpu_hbm_grad_d128_bf16_causal_T{tpu_variants.HBM_LENGTHS[-1]}")["hbm"].update(
        temp=(256 * MIB << len(tpu_variants.HBM_LENGTHS)) + 8 * MIB), "grows faster than linearly"),
    ("above splash", lambda s: _find(s, "tpu_7x", "tpu_side_grad_d128_mha_bf16_causal_T8192")["hbm"].update(
        temp=301 * MIB), "above splash's"),
    ("no splash row", lambda s: _drop(s, "tpu_v5p", "jax_splash_side_grad_d64_gqa8to2_bf16_full_T2048"),
     "no compiled splash row"),
    ("no splash figure", lambda s: _find(s, "tpu_v6e", "jax_splash_side_grad_d128_mha_bf16_full_T2048")["hbm"].update(
        temp=None), "no HBM temp figure"),
    ("unknown variant", lambda s: s["rows"].append(dict(_find(s, "tpu_v5e", KERNEL_VARIANT), variant="made_up")),
     "does not list"),
    ("duplicate row", lambda s: s["rows"].append(copy.deepcopy(_find(s, "tpu_v5e", KERNEL_VARIANT))),
     "compiled twice"),
    ("gated target not compiled", lambda s: s.update(
        targets=[t for t in TARGETS if t != "tpu_v6e"], rows=[r for r in s["rows"] if r["target"] != "tpu_v6e"]),
     "tpu_v6e: not compiled"),
    ("no libtpu version", lambda s: s["toolchain"].pop("libtpu"), "libtpu"),
])
def test_a_broken_report_fails(case, edit, expected):
    found = _broken(edit)
    assert any(expected in line for line in found), (case, found)


def test_no_tpu_section_fails():
    assert tpu_check.check({"rows": []}) == 1
    assert tpu_check.problems(None) == ["the report has no tpu section (scripts/compile/tpu_report.py run)"]


def test_v6e_takes_64_mib_and_v4_is_shown_not_gated():
    """33 MiB passes v6e's 64 MiB limit (the in-place kernels' raised one); a v4 compile error is open
    (reported), not a failure."""
    section = _good()
    _find(section, "tpu_v6e", KERNEL_VARIANT)["kernels"][0]["scoped_vmem"] = 33 * MIB
    _find(section, "tpu_v4", KERNEL_VARIANT).update(status="error", error="v4 E1001")
    assert tpu_check.problems(section) == []
    assert any("v4 E1001" in line for line in tpu_check.problems(section, open_ones=True))
    # CI compiles the gated generations only (.ci/run: --tpu-targets): a report without v4 passes.
    section.update(targets=[t for t in section["targets"] if t != "tpu_v4"],
                   rows=[r for r in section["rows"] if r["target"] != "tpu_v4"])
    assert tpu_check.problems(section) == []


def test_custom_calls_reads_each_kernel_and_its_scoped_vmem():
    hlo = ('  %probjax_tpu_forward.1 = (bf16[4,8,1024,128]) custom-call(%a), custom_call_target="tpu_custom_call", '
           'backend_config={"scoped_memory_configs":[],"custom_call_config":{"body":"TUzv"},'
           '"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"925696"}]}\n'
           '  %fusion.3 = f32[8] fusion(%b), kind=kLoop\n'
           '  %probjax_tpu_backward_dkv = (bf16[4]) custom-call(%c), custom_call_target="tpu_custom_call", '
           'backend_config={}\n')
    assert tpu_report.custom_calls(hlo) == [dict(kernel="probjax_tpu_forward", scoped_vmem=925696),
                                            dict(kernel="probjax_tpu_backward_dkv", scoped_vmem=None)]


# -------------------------------------------------------------------------------- the committed report

SECTION = json.loads((ROOT / "docs" / "compile" / "report.json").read_text()).get("tpu")
KINDS = {"tpu_v5e": "TPU v5 lite", "tpu_v5p": "TPU v5", "tpu_v6e": "TPU v6 lite", "tpu_v4": "TPU v4",
         "tpu_7x": "TPU7x"}


@dataclasses.dataclass(frozen=True)
class FakeTPU:
    """What `default_config` reads of a device: its platform and kind."""

    device_kind: str
    platform: str = "tpu"


def test_the_committed_tpu_section_passes_the_gate():
    assert SECTION is not None, "docs/compile/report.json has no tpu section: run bash scripts/compile_check.sh"
    assert tpu_check.problems(SECTION) == []


@pytest.mark.parametrize("target", tpu_check.GATED_TARGETS)
def test_committed_tiles_are_what_default_config_picks(target, monkeypatch):
    """The tiles each variant compiled with are default_config's for that generation, with the fields the
    variant sets itself (the tile and backward alternatives)."""
    monkeypatch.setattr(_backend, "target_device", lambda: FakeTPU(KINDS[target]))
    rows = [r for r in SECTION["rows"] if r["target"] == target and r["group"] in ("tpu", "hbm")]
    assert rows
    for row in rows:
        picked = default_config(FlashConfig(backend="tpu"), q_len=row["q_len"], kv_len=row["q_len"],
                                head_dim=row["head_dim"])
        expected = {k: v for k, v in vars(picked).items() if k.startswith("block_")}
        assert expected | (REGISTRY[row["variant"]].tiles or {}) == row["config"], row["variant"]


def test_a_decode_variant_without_its_kernel_fails():
    """The decode kernel is gated like the flash kernels: its row must hold `probjax_tpu_decode_attention`."""
    name = next(n for n, v in REGISTRY.items() if v.mode == "decode")
    section = _good()
    _find(section, "tpu_v5e", name)["kernels"] = []
    assert any(name in line for line in tpu_check.problems(section))


def test_the_tpu_compile_key_follows_generation_versions_and_figure_code(monkeypatch):
    versions = dict(jax="0.11.2", jaxlib="0.11.2", libtpu="0.0.48.1")
    monkeypatch.setattr(tpu_report, "_versions", lambda toolchain: dict(versions))
    key = tpu_report._compile_key("tpu_v5e")
    assert tpu_report._compile_key("tpu_v5e") == key != tpu_report._compile_key("tpu_v6e")
    versions["libtpu"] = "0.0.49"
    assert tpu_report._compile_key("tpu_v5e") != key
    versions["libtpu"] = "0.0.48.1"
    monkeypatch.setattr(tpu_report, "custom_calls", lambda hlo: [])
    assert tpu_report._compile_key("tpu_v5e") != key


def test_a_reused_tpu_row_that_does_not_reproduce_fails():
    """A variant compiled again under `--reuse --verify` whose scoped VMEM or HBM differs from the earlier row of
    the same fingerprint becomes an error, which the gate fails."""
    import report as gpu_report

    section = _good()
    row = _find(section, "tpu_v5e", KERNEL_VARIANT)
    row["fingerprint"] = "f"
    earlier = copy.deepcopy(row)
    assert gpu_report._reproduces(row, earlier, ("kernels", "hbm")) == dict(reproduced=True)
    earlier["hbm"]["temp"] += 1
    row.update(gpu_report._reproduces(row, earlier, ("kernels", "hbm")))
    assert row["status"] == "error"
    assert any(f"{KERNEL_VARIANT}: compile error: the same lowered module" in p for p in tpu_check.problems(section))


def test_ci_reuses_the_committed_tpu_compiles():
    """CI's TPU part takes the committed TPU rows and pod-slice programs whose fingerprint is unchanged (each
    gated one has one) and compiles the rest, and a sample of the reused ones again."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "--reuse docs/compile/report.json" in ci and "--reuse docs/compile/tpu_slices.json" in ci
    committed = json.loads((ROOT / "docs" / "compile" / "report.json").read_text())["tpu"]
    assert all(r.get("fingerprint") for r in committed["rows"] if r["target"] in tpu_check.GATED_TARGETS)
    slices = json.loads((ROOT / "docs" / "compile" / "tpu_slices.json").read_text())
    assert all(row[p].get("fingerprint") for row in slices["rows"] for p in ("train", "generate"))
