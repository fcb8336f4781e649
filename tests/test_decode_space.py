"""The compile registry's decode rows derived from the decode kernel's planner (scripts/compile/decode_space.py):
a new rule in `plan_for` becomes a row without anyone adding one, a rule that goes away takes its rows with it,
and every derived row is a decode variant of the registry, on every target, stating its query rows."""

import sys
from pathlib import Path

from probjax_kernels.triton import decode as triton_decode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "compile"))
import decode_space  # noqa: E402 - scripts/compile/decode_space.py
import plan_space  # noqa: E402
import variants as registry  # noqa: E402

TARGETS = ("sm90a_h100", "sm120_rtx5090")


def _names(rows) -> set[str]:
    return {decode_space.probe_of(row).name for row in rows}


def test_a_new_decode_rule_becomes_a_row_and_goes_with_it(monkeypatch):
    """Three stages for head dim 80 (a rule nobody listed) gives the head dim 80 calls a plan no other call has:
    the first of them beside the seed becomes a row; without the rule it is not one."""
    before = _names(decode_space.derive(TARGETS, plan_space._device))
    real = triton_decode._default_stages
    monkeypatch.setattr(triton_decode, "_default_stages",
                        lambda keys, dims, itemsize: 3 if dims[0] == 80 else real(keys, dims, itemsize))
    after = _names(decode_space.derive(TARGETS, plan_space._device))
    added = after - before
    assert added and all("_d80_" in name for name in added), added
    assert before <= after


def test_derived_decode_rows_are_registry_rows_on_every_target():
    """Each derived decode row is a decode variant of the registry (not a seed), named once, compiled on every
    target with the decode kernel required, and states its query rows for the small-tile rule."""
    rows = plan_space.derived_decode_rows()
    seeds = {probe.name for probe in decode_space.SEEDS}
    names = _names(rows)
    assert rows and len(names) == len(rows) and not names & seeds
    by_name = {v.name: v for v in registry.variants()}
    for name in names | seeds:
        v = by_name[name]
        assert v.group == "decode" and v.requires == (registry.DECODE,) and v.query_rows is not None
        assert set(v.targets) == set(registry.FULL_TARGETS + registry.SUBSET_TARGETS), name
