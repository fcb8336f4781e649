"""The compile registry's rows derived from the dispatch (scripts/compile/plan_space.py): a new rule in a backend's
plan becomes a row without anyone adding one, a row that disappears fails the check, and each derived row
requires the kernels its call's plan runs."""

import re
import sys
from pathlib import Path

from probjax_kernels.triton import plan as triton_plan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "compile"))
import check  # noqa: E402 - scripts/compile/check.py
import plan_space  # noqa: E402
import rules  # noqa: E402
import variants as registry  # noqa: E402

TRITON_KERNELS = {"forward": (registry.FORWARD,), "backward": (registry.DQ, registry.DKV),
                  "run_tangent": (registry.TANGENT,)}


def _names(rows) -> set[str]:
    return {plan_space.probe_of(r).name(r["mode"]) for r in rows}


def test_a_new_tile_rule_in_the_plan_becomes_a_row(monkeypatch):
    """A rule nobody listed (head dim 32 and under on 512 x 512 forward tiles, the example the issue gives) makes
    the calls at those head dims plan differently from head dim 64's, so the registry grows rows that compile it.
    (On one target, over the probes under head dim 64 and the grid's calls at 64, which cover them until the
    rule: the calls the rule reaches and those it must leave as they were.)"""
    space = [p for p in plan_space.probes() if p.head_dim < 64 or (p.head_dim == 64 and p.seed)]
    monkeypatch.setattr(plan_space, "probes", lambda: space)
    before = _names(plan_space.derive(targets=("sm86_rtx3090",)))
    assert "flash_grad_d16_bf16_window" not in before
    tiles = triton_plan._triton_tiles

    def new_rule(head_dim, large_smem, hopper=False):
        return (512, 512, *tiles(head_dim, large_smem, hopper)[2:]) if head_dim <= 32 else tiles(
            head_dim, large_smem, hopper)

    monkeypatch.setattr(triton_plan, "_triton_tiles", new_rule)
    after = _names(plan_space.derive(targets=("sm86_rtx3090",)))
    new = after - before
    print(sorted(new))
    assert {"flash_grad_d16_bf16_window", "flash_grad_d16_bf16_dropout", "flex_grad_d16_bf16_softcap"} <= new
    assert all("_d32_" in name or "_d16_" in name for name in new), sorted(new)


def test_every_forced_call_is_a_row_on_the_full_targets():
    by_name = {v.name: v for v in registry.variants()}
    for name in plan_space.FORCED:
        assert name in by_name, name
        assert set(registry.FULL_TARGETS if not name.startswith("mosaic") else registry.HOPPER) <= set(
            by_name[name].targets), name


def _mosaic_kernels(kernel_pass, by_run: dict) -> set:
    """The Mosaic kernels a pass runs: by its glue function, and for the Hopper backward at head dim 256 by its
    tiles' options (dK / dV as two programs: `split`; dQ and dK a program per 128 columns, dK's per 64
    with a score_mod: `pieces`)."""
    if kernel_pass.run.__name__ == "tangent":  # at head dim 256: d out's pieces; the tangents of q, k, v, bias apart
        options = dict(dict(kernel_pass.options).get("options", ()))
        pieces = [f"_piece{p}" for p in range(options["pieces"])] if options.get("pieces", 1) > 1 else [""]
        bias = kernel_pass.problem.bias_shape is not None  # its tangent: programs of its own too
        groups = ["_dq", "_dk", "_dv", *(["_dbias"] if bias else [])] if options.get("split") else [""]
        return {registry.MOSAIC_TANGENT + group + piece for group in groups for piece in pieces}
    if kernel_pass.run.__name__ != "backward":
        return by_run[kernel_pass.run.__name__]
    dq_options, dkv_options = (dict(tiles) for tiles in dict(kernel_pass.options)["tiles"])
    dq = registry.MOSAIC_DQ_PIECES if dq_options.get("pieces", 1) > 1 else (registry.MOSAIC_DQ,)
    if not dkv_options.get("split"):
        return {*dq, registry.MOSAIC_DKV}
    dk = registry.piece_names(registry.MOSAIC_DK, dkv_options.get("pieces", 1))
    return {*dq, *dk, registry.MOSAIC_DV}


def test_each_derived_row_requires_the_kernels_its_plan_runs():
    """The kernels a derived row must hold (`required_kernels`, the API contract restated) are the ones
    `_dispatch.plan` runs for its call on its first target and on Blackwell: Mosaic GPU's where the plan picks
    them (the tcgen05 forward and backward on sm_100a)."""
    by_name = {v.name: v for v in registry.variants()}
    rows = plan_space.derived_rows()
    assert len(rows) > 100
    mosaic = {"forward": {registry.MOSAIC_FORWARD}, "forward_tcgen05": {registry.MOSAIC_FORWARD_TCGEN05},
              "backward": {registry.MOSAIC_DQ, registry.MOSAIC_DKV}, "tangent": {registry.MOSAIC_TANGENT},
              "backward_tcgen05": {registry.MOSAIC_DQ_TCGEN05, registry.MOSAIC_DKV_TCGEN05}}
    blackwell = blackwell_backward = 0
    for row in rows:
        probe = plan_space.probe_of(row)
        name = probe.name(row["mode"])
        for target in {row["targets"][0], *(set(row["targets"]) & set(registry.BLACKWELL))}:
            plan = plan_space.plan_of(probe, target)
            passes = (plan.forward, plan.backward if row["mode"] == "fwd+bwd" else plan.tangent)
            ran = set()
            for kernel_pass in passes:
                if kernel_pass.run.__module__.endswith("mosaic.glue"):
                    ran |= _mosaic_kernels(kernel_pass, mosaic)
                else:
                    ran |= set(TRITON_KERNELS[kernel_pass.run.__name__])
            assert ran == set(registry.requires_for(by_name[name], target)), (name, target, sorted(ran))
            blackwell += registry.MOSAIC_FORWARD_TCGEN05 in ran
            blackwell_backward += registry.MOSAIC_DKV_TCGEN05 in ran
    # The tcgen05 kernels' rows: each family they take at head dims 64 / 128 in both modes; GQA only in its causal
    # family's row (the tcgen05 dK/dV sums the group in the kernel, so GQA changes no other plan there).
    assert blackwell >= 18 and blackwell_backward >= 9, (blackwell, blackwell_backward)


def test_a_row_the_registry_lost_fails_unless_retired(monkeypatch):
    earlier = {"rows": [{"target": "sm90a_h100", "variant": "flash_grad_d64_bf16_causal"},
                        {"target": "sm90a_h100", "variant": "decode_f32_that_was_dropped"}]}
    found = check.retired_problems(earlier)
    assert len(found) == 1 and "decode_f32_that_was_dropped" in found[0]
    monkeypatch.setattr(rules, "RETIRED", {"decode_f32_that_was_dropped": "a test"})
    assert check.retired_problems(earlier) == []
    # a retired name the registry still has is a stale entry
    monkeypatch.setattr(rules, "RETIRED", {"flash_grad_d64_bf16_causal": "a test"})
    assert any("still a variant" in line for line in check.retired_problems(earlier))


def test_a_generation_rule_is_a_row_on_that_generation_only():
    """On sm_89 / sm_120 a row appears where its plan differs from sm_86's (their own rules), and only there."""
    rows = [(t, r) for r in plan_space.derived_rows() for t in ("sm89_rtx4090", "sm120_rtx5090") if t in r["targets"]]
    assert rows
    for target, row in rows:
        probe = plan_space.probe_of(row)
        if probe.forced:
            continue
        on_target = plan_space.outcome(plan_space.plan_of(probe, target), row["mode"])
        on_sm86 = plan_space.outcome(plan_space.plan_of(probe, "sm86_rtx3090"), row["mode"])
        assert on_target != on_sm86, (target, probe.name(row["mode"]))


def test_sm100a_compiles_every_triton_plan():
    """sm_100a (`WHOLE_TARGETS`) compiles every Triton grid row, and a derived Triton row whose plan there equals
    its plan on sm_90a too (the old subset rule skipped those: the same plan compiles to tcgen05 code of its own,
    and one spilled only there)."""
    by_name = {v.name: v for v in registry.variants()}
    grid = [v for v in registry._grid_variants() if registry._whole_row(v)]
    assert grid and all("sm100a_b200" in by_name[v.name].targets for v in grid)
    same = []
    for row in plan_space.derived_rows():
        if "sm100a_b200" not in row["targets"] or row["probe"]["backend"] == "mosaic":
            continue
        probe = plan_space.probe_of(row)
        plans = [plan_space.outcome(plan_space.plan_of(probe, t), row["mode"]) for t in ("sm100a_b200", "sm90a_h100")]
        same += [probe.name(row["mode"])] if plans[0] == plans[1] else []
    assert "flash_grad_d64_bf16_full_gqa8to2" in same


def test_probes_are_unique_and_the_grid_comes_first():
    """The probe space starts with the grid's calls; the grid rows that are not probes are its explicit extras
    (ragged tails, float16, GQA with a dense bias or mask), and the grid's probes the grid does not compile
    (float32 on backend "mosaic" in jvp but at head dim 128, causal) are rows where their plans are new."""
    space = plan_space.probes()
    assert len({p.stem for p in space}) == len(space)
    grid = [p for p in space if p.seed]
    assert space[:len(grid)] == grid
    grid_names = {v.name for v in registry._grid_variants()}
    probe_names = {p.name(m) for p in grid for m in plan_space.MODES}
    assert {n for n in probe_names - grid_names if not n.startswith("mosaic_jvp_d")} == set()
    extras = grid_names - probe_names
    assert extras and all(re.search(r"_T\d+$|_f16_|_dense_(bias_f32|mask)_gqa8to2_causal$", n) for n in extras), extras
