"""The compile registry's ragged (serving) rows derived from the Triton ragged kernel's planner
(scripts/compile/ragged_space.py): a new rule in its `_plan` becomes a row without anyone adding one, a call the
kernel cannot take on a target has no row there, and every derived row is a ragged variant of the registry."""

import sys
from pathlib import Path

from probjax_kernels.triton import ragged as triton_ragged

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "compile"))
import plan_space  # noqa: E402 - scripts/compile/plan_space.py
import ragged_space  # noqa: E402
import variants as registry  # noqa: E402

TARGETS = ("sm90a_h100",)


def _names(rows) -> set[str]:
    return {ragged_space.probe_of(row).name for row in rows}


def test_a_new_ragged_rule_becomes_a_row(monkeypatch):
    """Three stages for pages of 256 keys (a rule nobody listed) gives those calls a plan no other call has: they
    become rows, and only they."""
    before = _names(ragged_space.derive(TARGETS, plan_space._device))
    assert "ragged_page256_d128_bf16_gqa32to8" not in before
    real = triton_ragged._plan

    def three_stages(q, k_pages, *args, **kwargs):
        if k_pages.shape[1] == 256:
            kwargs["num_stages"] = 3
        return real(q, k_pages, *args, **kwargs)

    monkeypatch.setattr(triton_ragged, "_plan", three_stages)
    added = _names(ragged_space.derive(TARGETS, plan_space._device)) - before
    assert "ragged_page256_d128_bf16_gqa32to8" in added
    assert all("_page256_" in name for name in added), added


def test_derived_ragged_rows_are_registry_rows_where_the_kernel_plans_them():
    """Each derived ragged row is a ragged variant of the registry (not a seed), compiled on its targets with
    the ragged kernel required; float8 pages only from sm_89 on (before, the dispatch takes the XLA path)."""
    rows = plan_space.derived_ragged_rows()
    seeds = {probe.name for probe in ragged_space.SEEDS}
    names = _names(rows)
    assert rows and len(names) == len(rows) and not names & seeds
    by_name = {v.name: v for v in registry.variants()}
    everywhere = set(registry.FULL_TARGETS + registry.SUBSET_TARGETS)
    for row in rows:
        v = by_name[ragged_space.probe_of(row).name]
        assert v.group == "decode" and v.requires == (registry.RAGGED,)
        fp8 = ragged_space.probe_of(row).pages == "fp8"
        assert set(v.targets) == (everywhere - {"sm80_a100", "sm86_rtx3090"} if fp8 else everywhere), v.name


def test_query_rows_are_the_planners_rows():
    """`RaggedProbe.query_rows` (what the small-tile rule reads: rows under 64 run mma.sync on sm_90a / sm_100a)
    is the row tile the planner gives every probe."""
    for probe in ragged_space.probes():
        plan = ragged_space.plan_of(probe, plan_space._device("sm90a_h100"))
        assert probe.query_rows == plan.rows, probe.name

