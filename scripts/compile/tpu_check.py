"""The TPU compile report's gate (the `tpu` section of docs/compile/report.json, written by tpu_report.py). It
fails closed: the expected rows come from the registry (tpu_variants.py), not from the report, so a missing
(target, variant) pair, a missing kernel, a variant whose dispatch changed path, a compile error or VMEM over a
generation's limit each fail. It reads only the JSON and the registry: no libtpu, no compile.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import tpu_variants  # noqa: E402

# Generations every expected variant must compile for; the others in the report (v4) are shown with their
# problems reported as open, not failing.
GATED_TARGETS = ("tpu_v5e", "tpu_v5p", "tpu_v6e", "tpu_7x")
# fwd+bwd HBM temp at 2T may be at most this many times that at T (plus the slack below): linear growth
# doubles it; a [B, N, T, S] buffer (8 GiB in float32 at T = 8192, B = 4, N = 8) would quadruple its part.
HBM_GROWTH_MAX = 2.2
HBM_SLACK = 4 << 20  # bytes: XLA's placement of small buffers (VMEM or HBM) moves a few MiB either way
# Ours against JAX's splash attention at the same shape in the same run (`tpu_variants.side_variants`): HBM
# temp at most this ratio of splash's.
SIDE_MAX_RATIO = 1.0


def _import_kernels() -> None:
    try:
        import probjax_kernels  # noqa: F401
    except ImportError:  # the toolchain venv does not install the project: load the repo's kernels/
        import report as gpu_report

        gpu_report._import_kernels()


def _registry() -> dict:
    """name -> TpuVariant of the gated (non-peer) variants; the registry imports probjax_kernels to build."""
    _import_kernels()
    return {v.name: v for v in tpu_variants.gated_variants()}


def vmem_limits(target: str) -> tuple[int, int]:
    """(the VMEM a kernel may use, the VMEM of a TensorCore) in bytes on `target`: the chip figures the kernels
    plan with (`probjax_kernels.tpu.chips`). The limit is `Chip.vmem_limit`, the `vmem_limit_bytes` the in-place
    kernels ask for: twice the default scoped limit libtpu enforces (16 MiB on v4 / v5e / v5p, 32 MiB on v6e /
    TPU7x: "Scoped allocation with size 20.00M and limit 16.00M"), at most 3/4 of the core's VMEM (jax's
    `tpu_info`). A kernel that asks for nothing is held to the default by the compiler itself."""
    _import_kernels()
    from probjax_kernels.tpu import chips

    chip = chips.CHIPS[tpu_variants.CHIP_OF[target]]
    return chip.vmem_limit, chip.vmem


def row_problems(row: dict, variant) -> list[str]:
    """Every reason one gated compile fails CI; `variant` is the registry's entry for the row."""
    where = f"{row['target']} {row['variant']}"
    if row.get("status") != "ok":
        return [f"{where}: compile error: {row.get('error')}"]
    out = []
    kernels = row.get("kernels") or []
    names = [k.get("kernel") for k in kernels]
    if row.get("dispatch") != variant.path:
        said = row.get("fallback_warning") or row.get("dispatch")
        out.append(f"{where}: expected the {variant.path} path, the dispatch took the {row.get('dispatch')} "
                   f"path ({said})")
    if variant.path == "fallback" and kernels:
        out.append(f"{where}: a fallback variant compiled a tpu_custom_call ({', '.join(map(str, names))})")
    for name in variant.required_kernels(row["target"]):
        if name not in names:
            out.append(f"{where}: no tpu_custom_call of {name} (the dispatch runs it on the Mosaic TPU kernels; "
                       f"found {names or 'none'})")
    limit = vmem_limits(row["target"])[0] if row["target"] in tpu_variants.CHIP_OF else None
    for kernel in kernels:
        vmem = kernel.get("scoped_vmem")
        if vmem is None:
            out.append(f"{where} {kernel.get('kernel')}: no scoped VMEM figure in the compiled module")
        elif limit is None or vmem > limit:
            out.append(f"{where} {kernel.get('kernel')}: {vmem:,} B scoped VMEM over the {row['target']} limit "
                       f"{limit}")
    return out


def hbm_problems(rows: list[dict], target: str) -> list[str]:
    """The HBM growth check of one target: fwd+bwd temp at each 2T of each `hbm` chain against T."""
    chains = {}
    for r in rows:
        if r["target"] == target and r.get("group") == "hbm":
            chains.setdefault(tpu_variants.hbm_chain(r["variant"]), {})[r["q_len"]] = r
    out = []
    for name, chain in sorted(chains.items()):
        for t1, t2 in zip(tpu_variants.HBM_LENGTHS, tpu_variants.HBM_LENGTHS[1:]):
            if t1 not in chain or t2 not in chain:
                continue  # the missing rows are reported as missing
            small, large = chain[t1], chain[t2]
            if small.get("status") != "ok" or large.get("status") != "ok":
                continue  # reported as compile errors
            a, b = (r.get("hbm", {}).get("temp") for r in (small, large))
            if a is None or b is None:
                out.append(f"{target} {name}: no HBM temp figure for the T = {t1} / {t2} pair")
            elif b > HBM_GROWTH_MAX * a + HBM_SLACK:
                out.append(f"{target} {name}: fwd+bwd HBM temp grows faster than linearly: {a:,} B at T = {t1}, "
                           f"{b:,} B at T = {t2} (over {HBM_GROWTH_MAX} x + {HBM_SLACK >> 20} MiB)")
    return out


def side_pairs(rows: list[dict], target: str) -> list[tuple[dict | None, dict | None, str]]:
    """(ours, splash, name) of each side-by-side shape of one target (`tpu_variants.side_variants`)."""
    by_name = {r["variant"]: r for r in rows if r["target"] == target}
    out = []
    for variant in tpu_variants.side_variants():
        if variant.group == "side":
            peer = variant.name.replace("tpu_side_", "jax_splash_side_", 1)
            out.append((by_name.get(variant.name), by_name.get(peer), variant.name))
    return out


def side_problems(rows: list[dict], target: str) -> list[str]:
    """Ours above splash's HBM temp (or a missing figure) at a side-by-side shape of one target."""
    out = []
    for ours, splash, name in side_pairs(rows, target):
        if ours is None or ours.get("status") != "ok":
            continue  # reported as missing or as a compile error
        if splash is None or splash.get("status") != "ok":
            out.append(f"{target} {name}: no compiled splash row to compare with")
            continue
        a, b = ((r.get("hbm") or {}).get("temp") for r in (ours, splash))
        if a is None or b is None:
            out.append(f"{target} {name}: no HBM temp figure for ours or splash")
        elif a > SIDE_MAX_RATIO * b:
            out.append(f"{target} {name}: HBM temp {a:,} B above splash's {b:,} B at the same shape")
    return out


def problems(section: dict | None, open_ones: bool = False) -> list[str]:
    """Every reason the TPU section fails CI, one line each; with `open_ones`, the problems of the targets
    shown but not gated instead (reported, not failing)."""
    if section is None:
        return [] if open_ones else ["the report has no tpu section (scripts/compile/tpu_report.py run)"]
    registry = _registry()
    rows = section.get("rows") or []
    gated = [t for t in section.get("targets", []) if t in GATED_TARGETS]
    out, shown = [], []
    if not open_ones:
        for target in GATED_TARGETS:
            if target not in section.get("targets", []):
                out.append(f"{target}: not compiled (a gated generation)")
        if not (section.get("toolchain") or {}).get("libtpu"):
            out.append("the report does not name its libtpu version")
    seen = set()
    for row in rows:
        target, name = row.get("target"), row.get("variant")
        if row.get("group") == "peer":
            continue  # peers are shown side by side, not held to our checks
        key = (target, name)
        lines = []
        if key in seen:
            lines.append(f"{target} {name}: compiled twice in one report")
        seen.add(key)
        if target not in tpu_variants.TOPOLOGIES:
            lines.append(f"{target} {name}: an unknown target")
        elif name not in registry:
            lines.append(f"{target} {name}: a variant the registry (tpu_variants.py) does not list")
        else:
            lines += row_problems(row, registry[name])
        (out if target in GATED_TARGETS else shown).extend(lines)
    for target in section.get("targets", []):
        (out if target in GATED_TARGETS else shown).extend(hbm_problems(rows, target))
        if target in GATED_TARGETS:
            out.extend(side_problems(rows, target))
    for target in GATED_TARGETS:
        if target in gated:
            out += [f"{target} {name}: missing from the report" for name in registry if (target, name) not in seen]
    return shown if open_ones else out


def with_verdicts(section: dict) -> dict:
    """The section with the gate's verdicts (each row's problems) and the figures it checks against."""
    registry = _registry()
    for row in section.get("rows", []):
        variant = registry.get(row.get("variant"))
        row["problems"] = row_problems(row, variant) if variant is not None and row.get("group") != "peer" else []
    section.update(
        gated_targets=list(GATED_TARGETS),
        limits={t: dict(topology=tpu_variants.TOPOLOGIES[t], scoped_vmem_limit=vmem_limits(t)[0],
                        vmem_capacity=vmem_limits(t)[1]) for t in section.get("targets", [])
                if t in tpu_variants.TOPOLOGIES},
        hbm_rule=dict(lengths=list(tpu_variants.HBM_LENGTHS), max_growth=HBM_GROWTH_MAX, slack=HBM_SLACK),
        side_rule=dict(max_ratio=SIDE_MAX_RATIO, lengths=list(tpu_variants.SIDE_LENGTHS)),
    )
    return section


def check(report: dict) -> int:
    """Print the TPU gate's verdict on a whole report (GPU rows and `tpu` section); 1 when it fails."""
    section = report.get("tpu")
    found = problems(section)
    for line in problems(section, open_ones=True):
        print(f"tpu_compile_report: OPEN {line}")
    for line in found:
        print(f"tpu_compile_report: FAIL {line}")
    rows = (section or {}).get("rows", [])
    kernels = sum(len(r.get("kernels") or []) for r in rows)
    print(f"tpu_compile_report: {len(rows)} compiles, {kernels} tpu_custom_calls, {len(found)} problems")
    return 1 if found else 0
