"""The compile report's check (`report.py check`), fail-closed: the registry (variants.py) is the expected set, and
a missing (target, variant) pair, a row the registry lacks, a missing or unexpected kernel, a compile error, a
missing figure, a spill outside `SPILLS`, shared memory over the target's limit or a kernel without the
instructions its target should use each fail; and the verdicts a report carries beside its figures
(`_with_verdicts`). Every tolerance is one entry of rules.py (`rules.tolerances()`, listed on the page).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import variants as registry  # the expected set: scripts/compile/variants.py
from figures import TARGETS_DIR, target_limits
from kernel_tiles import _fallback_tiles
import rules  # the figures the check holds kernels to, and each tolerance with why: read when it runs

TARGETS = registry.GPU_TARGETS


def spill_cap(kernel: str, target: str, variant: str) -> tuple | None:
    return rules.SPILLS.get((kernel, target, variant))


def expected(targets=None, only: str | None = None) -> list[tuple[str, registry.Variant]]:
    """The (target, variant) pairs a report must hold: every variant of the registry on each target it applies
    to, among `targets` (all the registry's by default) and the variants whose name matches `only`."""
    targets = targets or TARGETS
    return [(t, v) for v in registry.variants() for t in targets
            if t in v.targets and not (only and not re.search(only, v.name))]


def row_problems(row: dict, limits: dict, variant: registry.Variant | None) -> list[str]:
    """Every reason one compile fails CI, one line each (`limits`: its target's, from `target_limits`;
    `variant`: the registry's entry of the row, None when the registry has none)."""
    where = f"{row['target']} {row['variant']}"
    if variant is None:
        return [f"{where}: not in the registry (scripts/compile/variants.py): a stale report"]
    if row["group"] == "peer":
        return []  # peers (JAX's own kernels) are shown side by side, not held to our checks
    if row["status"] != "ok":
        return [f"{where}: compile error: {row.get('error')}"]
    found = [k["kernel"] for k in row["kernels"]]
    out = kernel_set_problems(where, found, registry.requires_for(variant, row["target"]))
    for kernel in row["kernels"]:
        out += gpu_kernel_problems(row, kernel, limits)
    if row["group"] == "lm":
        out += lm_problems(row)
    if row["variant"].startswith("side_") and (row.get("hbm") or {}).get("xla_bytes") is None:
        out.append(f"{where}: figure hbm / xla_bytes missing (null or absent): the side-by-side table cannot read it")
    return out


def device_memory(target: str) -> int:
    """The device memory of a target (its description's `device_memory_size`), in bytes."""
    text = (TARGETS_DIR / f"{target}.txtpb").read_text()
    return int(re.search(r"^\s*device_memory_size:\s*(\d+)", text, re.M).group(1))


def lm_problems(row: dict) -> list[str]:
    """A whole program of the LM example (group "lm"): its planned HBM per device (`hbm`, the worker's) present
    and within the target's device memory; on a mesh, the collective of its split axis (`MESH_COLLECTIVES`)."""
    where = f"{row['target']} {row['variant']}"
    hbm, capacity = row.get("hbm") or {}, device_memory(row["target"])
    if hbm.get("total") is None:
        return [f"{where}: figure hbm missing (null or absent): the check cannot read it"]
    if hbm["total"] > capacity:
        return [f"{where}: {hbm['total']:,} B of HBM planned, over the device's {capacity:,}"]
    mesh = re.search(r"_(data|seq)\d+$", row["variant"])
    if mesh:  # a program on a mesh of GPUs (lm_programs.MESHES): the collective its axis stands for
        wanted = MESH_COLLECTIVES[mesh.group(1)]
        if not (row.get("collectives") or {}).get(wanted):
            return [f"{where}: no {wanted} in the program: its {mesh.group(1)} axis is not split as it should be"]
    return []


# The collective a mesh axis of the LM example's training step must show: the gradients' all-reduce over "data",
# the ring's collective-permutes over "seq" (without them the sequence was gathered, not passed round a ring).
MESH_COLLECTIVES = {"data": "all-reduce", "seq": "collective-permute"}


def kernel_set_problems(where: str, found: list[str], requires: tuple[str, ...]) -> list[str]:
    """A compile must hold exactly the kernels the registry requires of it (`Variant.requires`): one missing
    (a backward kernel gone, a Mosaic call that ran on Triton) or one it does not expect fails."""
    # XLA names a second kernel of one entry point (other tiles, or a ring's diagonal and full blocks) `NAME__1`.
    ours = {re.sub(r"__\d+$", "", name) for name in found if name.startswith("probjax_")}
    out = []
    if not requires:
        out.append(f"{where}: the registry requires no kernel of it (it would prove nothing)")
    missing = sorted(set(requires) - ours)
    if missing:
        out.append(f"{where}: missing kernel(s) {', '.join(missing)} (found: {', '.join(sorted(ours)) or 'none'})")
    extra = sorted(ours - set(requires))
    if extra:
        out.append(f"{where}: kernel(s) the registry does not expect: {', '.join(extra)}")
    return out


# The figures every kernel row must carry, and those the instruction checks of its arch read (`figures_needed`).
KERNEL_FIGURES = ("registers", "threads", "smem", "spill_stores", "spill_loads")


def figures_needed(arch: str) -> tuple[str, ...]:
    """The figures the check reads of a kernel compiled for `arch`: a missing one (absent or null) fails rather
    than skipping the check that reads it."""
    if arch in rules.WIDE_MMA:
        return tuple(dict.fromkeys(KERNEL_FIGURES + ("HGMMA", "HMMA", "UTMALDG", rules.WIDE_MMA[arch][0])))
    return KERNEL_FIGURES + ("HMMA", "LDGSTS")


def gpu_kernel_problems(row: dict, kernel: dict, limits: dict) -> list[str]:
    """An NVIDIA kernel's figures against the rules: every figure its checks read present (`figures_needed`), no
    spill (outside `SPILLS`' capped entries), shared memory within the target's limit; on Hopper and Blackwell,
    Mosaic kernels with TMA and the arch's wide MMA (wgmma, tcgen05); on sm_90a / sm_100a, 16-bit kernels whose
    matmuls are all the arch's wide instruction
    (`WIDE_MMA`: wgmma, tcgen05; `MIN_WIDE_SHARE`, with the entries of `LOW_WIDE_SHARE` and the decode and
    ragged kernels of `rules.small_decode_tiles`); elsewhere (sm_80, sm_86, sm_89, sm_120), 16-bit kernels with
    mma.sync (HMMA) and cp.async (LDGSTS) where the kernel pipelines (its own config's num_stages >= 2, and
    decode)."""
    name = f"{row['target']} {row['variant']} {kernel['kernel']}"
    arch = limits["arch"]
    missing = [f for f in figures_needed(arch) if kernel.get(f) is None]
    if missing:
        return [f"{name}: figure(s) {', '.join(missing)} missing (null or absent): the check cannot read them"]
    out = []
    cap = spill_cap(kernel["kernel"], row["target"], row["variant"])
    if (kernel["spill_stores"] or kernel["spill_loads"]) and not (
            cap and kernel["spill_stores"] <= cap[0] and kernel["spill_loads"] <= cap[1]):
        out.append(f"{name}: spills {kernel['spill_stores']} B stores / {kernel['spill_loads']} B loads")
    if kernel["smem"] > limits["smem_per_block"]:
        out.append(f"{name}: {kernel['smem']} B shared memory over the target's {limits['smem_per_block']}")
    sixteen_bit = row["dtype"] != "f32"  # float32 dots run at Precision.HIGHEST: FMA, no tensor cores
    if arch in rules.WIDE_MMA and kernel["lowering"] == "mosaic":
        op, instruction = rules.WIDE_MMA[arch]
        if not (kernel["UTMALDG"] and kernel[op]):
            out.append(f"{name}: a Mosaic kernel without TMA (UTMALDG {kernel['UTMALDG']}) or {instruction} "
                       f"({op} {kernel[op]})")
    if not sixteen_bit:
        return out
    if arch in rules.WIDE_MMA:
        op, instruction = rules.WIDE_MMA[arch]
        if row["variant"] in _small_decode_tiles() and kernel["kernel"] in (registry.DECODE, registry.RAGGED):
            return out
        share = wide_share(kernel, op)
        least, _ = rules.LOW_WIDE_SHARE.get((kernel["kernel"], arch, max(row["head_dim"], row["value_dim"] or 0)),
                                            (rules.MIN_WIDE_SHARE, ""))
        if share is None or share < least:
            counts = ", ".join(f"{o} {kernel[o]}" for o in dict.fromkeys((op, "HGMMA", "HMMA")))
            out.append(f"{name}: {instruction} share {share if share is None else round(share, 2)} ({counts}) "
                       f"under {least}")
        return out
    if not kernel["HMMA"]:
        out.append(f"{name}: 16-bit matmuls without mma.sync (HMMA 0)")
    if _pipelined(row, kernel["kernel"]) and not kernel["LDGSTS"]:
        out.append(f"{name}: a pipelined kernel without cp.async (LDGSTS 0)")
    return out


def _pipelined(row: dict, kernel: str) -> bool:
    """Whether a kernel pipelines its loads: decode and ragged kernels always; a flash kernel when the config it
    ran (`kernel_configs`, the tangent's own, else the row's) has 2 stages or more."""
    if row["group"] == "decode":
        return True
    config = (row.get("kernel_configs") or {}).get(kernel) or (
        row.get("tangent_config") if kernel.endswith("_tangent") else None) or row.get("config") or {}
    return config.get("num_stages", 1) >= 2


def wide_share(kernel: dict, op: str = "HGMMA") -> float | None:
    """op / (HGMMA + HMMA (+ op)) of a kernel's SASS, op the arch's wide MMA (`WIDE_MMA`); None when it has no
    tensor-core matmul."""
    total = sum(kernel.get(o) or 0 for o in dict.fromkeys((op, "HGMMA", "HMMA")))
    return kernel[op] / total if total else None


@functools.cache
def _small_decode_tiles() -> frozenset:
    return frozenset(rules.small_decode_tiles(registry.variants()))


def rule_problems() -> list[str]:
    """The rules against the registry: every decode variant states its query rows (`Variant.query_rows`, which
    `rules.small_decode_tiles` reads: one without them would be held to the full share by accident)."""
    return [f"{v.name}: a decode variant without its query rows (Variant.query_rows)" for v in registry.variants()
            if registry.DECODE in v.requires and v.query_rows is None]


def problems(report: dict, targets=None, only: str | None = None) -> list[str]:
    """Every reason the report fails CI, one line each: the registry's expected (target, variant) pairs
    (`expected(targets, only)`) each present exactly once and passing `row_problems`, and nothing else. An
    empty expected set fails: a check of nothing proves nothing."""
    pairs = expected(targets, only)
    whole = not only and set(targets or TARGETS) == set(TARGETS)  # then a row the registry lacks is stale
    if not pairs:
        return [f"no variant of the registry matches (targets {targets or 'all'}, only {only!r}): nothing checked"]
    out = rule_problems()
    want = {(t, v.name): v for t, v in pairs}
    limits = {t: target_limits(t) for t in {t for t, _ in pairs}}
    seen = set()
    for row in report.get("rows", []):
        key = (row["target"], row["variant"])
        if key in seen:
            out.append(f"{key[0]} {key[1]}: compiled twice in the report")
            continue
        seen.add(key)
        if key in want:
            out += row_problems(row, limits[row["target"]], want[key])
        elif whole:
            out += row_problems(row, {}, None)
    out += [f"{t} {name}: missing from the report (the registry expects it on {t})"
            for (t, name) in want if (t, name) not in seen]
    return out


def retired_problems(earlier: dict, targets=None, only: str | None = None) -> list[str]:
    """The rows of an earlier report (the committed record that `run --reuse` takes) the registry no longer
    expects, among `targets` and `only`: its flash rows come from the dispatch's plans (plan_space.py), so a
    row gone is a path gone, which fails unless rules.RETIRED names it with why. A name of rules.RETIRED the
    registry still has fails too (a stale entry)."""
    targets = set(targets or TARGETS)
    now = {(t, v.name) for t, v in expected(list(targets), only)}
    names = {name for _, name in now}
    out = [f"rules.RETIRED names {name}: still a variant of the registry" for name in rules.RETIRED if name in names]
    for row in earlier.get("rows", []):
        key = (row["target"], row["variant"])
        if (row["target"] in targets and not (only and not re.search(only, row["variant"])) and key not in now
                and row["variant"] not in rules.RETIRED):
            out.append(f"{key[0]} {key[1]}: in the earlier report but no longer in the registry (the call's path "
                       "is gone from the dispatch, or a row was dropped); name it in rules.RETIRED with why if "
                       "that is meant")
    return out


def check(path: Path, targets=None, only: str | None = None, earlier: Path | None = None) -> int:
    """Prints every problem of the report at `path` (`problems`), and with `earlier` (a report it was made from,
    `--reuse`) the rows it lost (`retired_problems`); 1 if there are any."""
    report = json.loads(path.read_text())
    found = problems(report, targets, only)
    if earlier is not None:
        found += retired_problems(json.loads(Path(earlier).read_text()), targets, only)
    for line in found:
        print(f"compile_report: FAIL {line}")
    kernels = sum(len(r["kernels"]) for r in report.get("rows", []))
    print(f"compile_report: {len(report.get('rows', []))} compiles, {kernels} kernels, "
          f"{len(expected(targets, only))} expected, {len(found)} problems")
    return 1 if found else 0


def _with_verdicts(report: dict) -> dict:
    """The report with this script's verdicts (each row's problems, the rules' lists), recomputed from the
    figures: `markdown` refreshes a committed report after a rule changes, without compiling."""
    by_name = {v.name: v for v in registry.variants()}
    for row in report["rows"]:  # the verdict travels with the row (tests/test_compile_report.py reads it)
        row["problems"] = row_problems(row, target_limits(row["target"]), by_name.get(row["variant"]))
        if row.get("backend") == "mosaic" and row.get("config") and "fallback_config" not in row:
            row["fallback_config"] = _fallback_tiles(row)
    for key in ("min_wgmma_share", "low_wgmma_share", "no_wgmma_variants"):  # the rules before `tolerances`
        report.pop(key, None)
    report.update(
        min_wide_share=rules.MIN_WIDE_SHARE,
        wide_mma={arch: dict(sass=op, name=name) for arch, (op, name) in rules.WIDE_MMA.items()},
        tolerances=rules.tolerances(registry.variants()),
        spills=[dict(kernel=k, target=t, variant=v, max_stores=c[0], max_loads=c[1], why=c[2])
                for (k, t, v), c in rules.SPILLS.items()],
    )
    return report

