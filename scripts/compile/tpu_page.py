"""docs/compile/tpu.md from the `tpu` section of the compile report's JSON (scripts/compile/tpu_report.py)."""

from __future__ import annotations

import tpu_check
import tpu_variants

_INTRO = """# Compile report: the Mosaic TPU kernels, compiled for each TPU generation without one

`bash scripts/compile_check.sh` installs a pinned TPU toolchain ({toolchain}) outside the repo (cached under
`~/.cache/probjax-tpu-toolchain`, `scripts/compile/tpu_toolchain.sh`), compiles every TPU kernel variant that
`auto` or a default `FlashConfig` picks on a TPU (`FlashConfig(backend="tpu")`, routed by
`kernels/_dispatch.py`) for each generation below through Pallas, Mosaic TPU and XLA:TPU with no TPU
(deviceless ahead-of-time compilation: one chip of a `jax.experimental.topologies` TPU topology, with
`JAX_PLATFORMS=cpu`), writes this page and the `tpu` section of `docs/compile/report.json`, and fails on a
compile error, a kernel over its generation's scoped VMEM limit, a variant that should run on the Mosaic TPU
kernels without its `tpu_custom_call`s, a variant that should fall back to the XLA path compiling a kernel (or
the reverse), fwd+bwd HBM temp growing more than {growth}x per doubling of T along T = {chain} (a T x S buffer would), HBM temp above splash attention's at the same shape (the side-by-side table), or an expected (generation,
variant) pair missing from the report (`scripts/compile/tpu_check.py`). CI (`.ci/run`) runs it after the GPU
part for v5e, v5p, v6e and TPU7x with `--reuse docs/compile/report.json`: a variant whose lowered module (with its
kernels' Mosaic TPU IR) has this report's fingerprint under the same jax, jaxlib and libtpu takes these
figures, the others compile, and one reusable variant per (generation, group), picked by the commit, is
compiled again and must give the same figures. Last run: {rows} compiles, {kernels} tpu_custom_calls, {wall} s wall with {jobs} worker processes (on a
2-core machine shared with other jobs; the compile times below are wall times under that load).

**What it proves:** each kernel lowers through Mosaic TPU and compiles for the generation at the tiles the
TPU dispatch picks there; the scoped VMEM the compiler allotted it (its double-buffered blocks and scratch),
its grid and blocks, the HBM temp memory XLA plans for the whole compile, which flex hooks run inside the
kernels and which fall back. **What it does not prove:** speed (no TPU ran anything: no speed has been
measured on a chip), correctness on a chip (the test suite checks the kernels' numbers in Pallas TPU
interpret mode on the CPU), or anything about libtpu or jax versions other than those named here. Shapes:
B=4, N=8 (K=2 for GQA), seq 1024, except the ragged T=600 variant, the side-by-side shapes and the HBM chain at
T = {chain}.

Columns: **tiles** the FlashConfig tiles `default_config` picks for the generation (fwd q x k / dQ q x k /
dK/dV q x k); **grid** the kernel's Pallas grid (B, N, tiles, steps); **blocks** its q / k / v blocks (rows x
head dim); **VMEM** the scoped VMEM the compiler allotted the kernel, and its share of the limit; **HBM temp**
XLA's temp buffers of the whole compile (`memory_analysis()`; XLA:TPU keeps small intermediates in VMEM, so
short sequences can show 0); **s** the variant's compile time.
"""


def _mib(x) -> str:
    return "?" if x is None else f"{x / 2**20:.2f} MiB"


def _tiles(config: dict | None) -> str:
    if not config:
        return ""
    c = config
    return (f"{c.get('block_q')}x{c.get('block_k')} / {c.get('block_q_dq')}x{c.get('block_k_dq')} / "
            f"{c.get('block_q_dkv')}x{c.get('block_k_dkv')}")


def _blocks(kernel: dict) -> str:
    return ", ".join("x".join(map(str, b)) for b in (kernel.get("blocks") or [])[:3])


def markdown(section: dict) -> str:
    rows = section["rows"]
    limits = section.get("limits", {})
    failing, shown = tpu_check.problems(section), tpu_check.problems(section, open_ones=True)
    chain = " / ".join(str(t) for t in section.get("hbm_rule", {}).get("lengths", ()))
    out = [_INTRO.format(toolchain=", ".join(f"{k} {v}" for k, v in section["toolchain"].items()), rows=len(rows),
                         kernels=sum(len(r.get("kernels") or []) for r in rows), wall=section["wall_s"],
                         jobs=section["jobs"], chain=chain, growth=section.get("hbm_rule", {}).get("max_growth"))]
    if section.get("reran"):
        r = section["reran"]
        out.append(f"The variants matching `{r['only']}` were compiled again after a kernel change "
                   f"(`tpu_report.py run --keep-others`, {r['wall_s']} s); the other rows are from the last run.\n")
    out.append("## Targets\n")
    out.append("| target | topology (chip 0) | device kind | scoped VMEM limit | VMEM | gated |")
    out.append("|---|---|---|---|---|---|")
    for name in section["targets"]:
        kind = next((r.get("device_kind") for r in rows if r["target"] == name), "?")
        lim = limits.get(name, {})
        out.append(f"| {name} | {lim.get('topology')} | {kind} | {_mib(lim.get('scoped_vmem_limit'))} | "
                   f"{_mib(lim.get('vmem_capacity'))} | {'yes' if name in section.get('gated_targets', []) else 'shown'} |")
    out.append("\n## Result\n")
    if failing:
        out.append(f"**{len(failing)} problems** (CI fails):\n")
        out += [f"- {p}" for p in failing]
    else:
        out.append("CI passes: every expected variant compiled for every gated generation, each kernel within the "
                   "scoped VMEM limit, a `tpu_custom_call` for every kernel the dispatch runs, the fallbacks "
                   "where expected, and HBM temp growing linearly (within the rule above) from T to 2T.")
    if shown:
        out.append("\n**Open** (generations shown but not gated; reported, not failing):\n")
        out += [f"- {p}" for p in shown]
    out.append("\n## Headline per target (our variants; peers excluded)\n")
    out.append("| target | compiles | errors | tpu_custom_calls | XLA fallbacks | max scoped VMEM | of limit | "
               "max HBM temp | total compile s |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for name in section["targets"]:
        mine = [r for r in rows if r["target"] == name and r["group"] != "peer"]
        ks = [k for r in mine for k in r.get("kernels") or []]
        vmem = max((k.get("scoped_vmem") or 0 for k in ks), default=0)
        limit = limits.get(name, {}).get("scoped_vmem_limit") or 1
        temp = max(((r.get("hbm") or {}).get("temp") or 0 for r in mine), default=0)
        out.append(f"| {name} | {len(mine)} | {sum(r['status'] != 'ok' for r in mine)} | {len(ks)} | "
                   f"{sum(r.get('dispatch') == 'fallback' for r in mine)} | {_mib(vmem)} | {100 * vmem / limit:.0f}% | "
                   f"{_mib(temp)} | {sum(r['compile_s'] for r in mine):.0f} |")
    out += _flex_table(section)
    out += _side_table(section)
    out += _hbm_table(section)
    out += _tiles_table(section)
    out += _backward_table(section)
    out += _peer_table(section)
    for name in section["targets"]:
        limit = limits.get(name, {}).get("scoped_vmem_limit") or 1
        out.append(f"\n## {name} ({limits.get(name, {}).get('topology')})\n")
        out.append("| variant | path | tiles | kernel | grid | blocks | VMEM | of limit | HBM temp | s |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r["target"] == name and r["group"] != "peer"):
            path = r.get("dispatch", "")
            if r["status"] != "ok":
                out.append(f"| {r['variant']} | | {_tiles(r.get('config'))} | **compile error**: "
                           f"{r.get('error', '')[:160]} | | | | | | {r['compile_s']} |")
                continue
            temp = _mib((r.get("hbm") or {}).get("temp"))
            if not r.get("kernels"):
                out.append(f"| {r['variant']} | {path} | {_tiles(r.get('config'))} | (XLA, no tpu_custom_call) | | | "
                           f"| | {temp} | {r['compile_s']} |")
            for k in r.get("kernels") or []:
                vmem = k.get("scoped_vmem")
                out.append(f"| {r['variant']} | {path} | {_tiles(r.get('config'))} | "
                           f"{k['kernel'].removeprefix('probjax_tpu_')} | {'x'.join(map(str, k.get('grid') or []))} | "
                           f"{_blocks(k)} | {_mib(vmem)} | {100 * (vmem or 0) / limit:.1f}% | {temp} | {r['compile_s']} |")
    return "\n".join(out) + "\n"


def _flex_table(section: dict) -> list[str]:
    rows = [r for r in section["rows"] if r["group"] == "flex"]
    names = sorted({r["variant"] for r in rows})
    out = ["\n## Flex hooks: in the kernel or the XLA fallback\n",
           "Each hook's path as the TPU dispatch took it per generation (`kernel`: the Mosaic TPU kernels; "
           "`fallback`: the XLA path, with a warning naming what the kernels lack).\n",
           "| variant | " + " | ".join(section["targets"]) + " | why it falls back |",
           "|---|" + "---|" * len(section["targets"]) + "---|"]
    for name in names:
        cells = []
        for target in section["targets"]:
            row = next((r for r in rows if r["variant"] == name and r["target"] == target), None)
            cells.append("missing" if row is None else row.get("dispatch") or row["status"])
        why = next((r.get("fallback_warning", "") for r in rows if r["variant"] == name and
                    r.get("fallback_warning")), "")
        out.append(f"| {name} | " + " | ".join(cells) + f" | {why.split('cannot run ')[-1][:200]} |")
    return out


def _side_table(section: dict) -> list[str]:
    rule = section.get("side_rule", {})
    out = ["\n## Side by side with splash attention (gated: HBM temp at most splash's)\n",
           "fwd+bwd, bf16, B=4, N=8 (GQA: K=2), compiled in the same run: ours on the [B, T, N, D] layout the "
           "modules use, JAX's splash attention (default blocks) on its own [B, N, T, D] layout, no transposes "
           f"around it. The gate fails when ours is above {rule.get('max_ratio')} x splash's HBM temp or a figure "
           "is missing. **XLA bytes**: HBM bytes the program moves outside the Mosaic kernels (every other "
           "instruction's result and operands, from the optimized HLO: `tpu_report.xla_side_bytes`). Up to "
           "T = 4096 XLA:TPU can keep the whole working set in VMEM and report 0 MiB of HBM temp.\n",
           "| target | shape | HBM temp: ours | splash | ratio | XLA bytes: ours | splash |",
           "|---|---|---|---|---|---|---|"]
    for target in section["targets"]:
        if target not in tpu_check.GATED_TARGETS:
            continue
        for ours, splash, name in tpu_check.side_pairs(section["rows"], target):
            a, b = ((r or {}).get("hbm") or {} for r in (ours, splash))
            ratio = f"{a['temp'] / b['temp']:.2f}" if a.get("temp") is not None and b.get("temp") else "-"
            xa, xb = (f"{x['xla_bytes'] / 1e9:.2f} GB" if x.get("xla_bytes") is not None else "?" for x in (a, b))
            out.append(f"| {target} | {name.removeprefix('tpu_side_grad_')} | {_mib(a.get('temp'))} | "
                       f"{_mib(b.get('temp'))} | {ratio} | {xa} | {xb} |")
    return out


def _hbm_table(section: dict) -> list[str]:
    rule = section.get("hbm_rule", {})
    lengths = rule.get("lengths", [])
    out = [f"\n## HBM temp of fwd+bwd along T = {' / '.join(map(str, lengths))} (bf16, hd128, causal, B=4, N=8)\n",
           f"Linear growth doubles the temp at each step (the gate allows {rule.get('max_growth')}x + "
           f"{(rule.get('slack') or 0) >> 20} MiB); a [B, N, T, S] float32 buffer would add 0.5 GiB at T = 2048 "
           "and 8 GiB at 8192. These compiles keep XLA from placing buffers in VMEM (`tpu_variants.HBM_ONLY`), so "
           "the temp counts every buffer of the program wherever XLA would put it.\n",
           "| target | chain | " + " | ".join(f"T = {t}" for t in lengths) + " | growth per doubling |",
           "|---|---|" + "---|" * (len(lengths) + 1)]
    for target in section["targets"]:
        chains = {}
        for r in section["rows"]:
            if r["target"] == target and r["group"] == "hbm":
                chains.setdefault(tpu_variants.hbm_chain(r["variant"]), {})[r["q_len"]] = r
        for name, chain in sorted(chains.items()):
            temps = [((chain.get(t) or {}).get("hbm") or {}).get("temp") for t in lengths]
            growth = ", ".join(f"{b / a:.2f}" if a and b is not None else "-" for a, b in zip(temps, temps[1:]))
            out.append(f"| {target} | {name.removeprefix('tpu_hbm_grad_')} | " + " | ".join(_mib(t) for t in temps)
                       + f" | {growth} |")
    return out


def _tiles_table(section: dict) -> list[str]:
    """The tile alternatives (`tpu_variants.tile_variants`): each generation's compile figures beside the tile
    model's time on that generation (`probjax_kernels.tpu.tile_model`)."""
    from probjax_kernels.tpu import chips, plan, tile_model

    sets = tpu_variants.tile_sets()
    out = [f"\n## Tile alternatives (fwd+bwd, bf16, hd128, causal, B=4, N=8, T = {tpu_variants.TILES_LEN})\n",
           "Every generation's pick of the tile model (`kernels/tpu/tile_model.py`) and the hand tables before it, "
           "compiled for every generation. **model**: the modelled time of one 8-head program's forward / dQ / "
           "dK/dV over the causal grid (the steps the flattened grid visits) on this generation, and its sum; "
           "**picked**: this generation's default. A tile set whose 8-head blocks exceed the in-place budget "
           "runs transposed (one head a program), which the VMEM column shows.\n",
           "| target | alternative | tiles | model: fwd / dQ / dK/dV | sum | VMEM: fwd / dQ / dK/dV | HBM temp | "
           "picked |", "|---|---|---|---|---|---|---|---|"]
    for target in section["targets"]:
        chip = chips.CHIPS[tpu_variants.CHIP_OF[target]]
        by_name = {r["variant"]: r for r in section["rows"] if r["target"] == target}
        for label, tiles in sets.items():
            row = by_name.get(f"tpu_tiles_{label}_T{tpu_variants.TILES_LEN}") or {}
            times = [tile_model.grid_time(chip, kernel, tiles[2 * n:2 * n + 2], True)
                     for n, kernel in enumerate(tile_model.KERNELS)]
            vmem = " / ".join(_mib(k.get("scoped_vmem")).removesuffix(" MiB") for k in row.get("kernels") or [])
            config = dict(zip(tpu_variants.TILE_FIELDS, tiles))
            picked = "yes" if plan.TILES[chip.name] == tiles else ""
            out.append(f"| {target} | {label} | {_tiles(config)} | "
                       + " / ".join(f"{t * 1e3:.2f}" for t in times) + f" ms | {sum(times) * 1e3:.2f} ms | "
                       f"{vmem or row.get('status', 'missing')} MiB | {_mib((row.get('hbm') or {}).get('temp'))} | "
                       f"{picked} |")
    return out


def _backward_table(section: dict) -> list[str]:
    """The fused and the two-kernel backward (`tpu_variants.backward_variants`) with the tile model's times."""
    from probjax_kernels.tpu import chips, plan, tile_model

    out = [f"\n## Backward: fused or two kernels (fwd+bwd, bf16, hd128, causal, B=4, N=8, T = "
           f"{tpu_variants.TILES_LEN})\n",
           "**fused**: one kernel (`kernels/tpu/fused_backward.py`) adding dS^T K to float32 dQ rows in HBM on "
           "the dK/dV walk, 5 tile matmuls a tile pair; **two**: the dQ and dK/dV kernels, 7. **model**: one "
           "8-head program's backward over a causal plus a full grid (`tile_model.backward_times`); the default "
           "is the fused kernel where it wins by more than the model's tolerance. **XLA bytes**: HBM bytes the "
           "program moves outside the Mosaic kernels.\n",
           "| target | backward | heads | model | default | kernels: VMEM | HBM temp | XLA bytes |",
           "|---|---|---|---|---|---|---|---|"]
    for target in section["targets"]:
        generation = tpu_variants.CHIP_OF[target]
        fused_s, two_s = tile_model.backward_times(chips.CHIPS[generation], plan.TILES[generation])
        default = "fused" if tile_model.fused_backward_pays(chips.CHIPS[generation], plan.TILES[generation]) else "two"
        by_name = {r["variant"]: r for r in section["rows"] if r["target"] == target}
        for variant in tpu_variants.backward_variants():
            row = by_name.get(variant.name) or {}
            kind = "fused" if variant.tiles["fused_backward"] else "two"
            hbm = row.get("hbm") or {}
            kernels = ", ".join(f"{k['kernel'].removeprefix('probjax_tpu_')} {_mib(k.get('scoped_vmem'))}"
                                for k in row.get("kernels") or []) or row.get("status", "missing")
            xla = f"{hbm['xla_bytes'] / 1e9:.2f} GB" if hbm.get("xla_bytes") is not None else "?"
            out.append(f"| {target} | {kind} | {'8:2' if 'gqa' in variant.name else '8'} | "
                       f"{(fused_s if kind == 'fused' else two_s) * 1e3:.2f} ms | {'yes' if kind == default else ''} | "
                       f"{kernels} | {_mib(hbm.get('temp'))} | {xla} |")
    return out


# Our variants set beside each peer: the same problem (bf16, hd128, B=4, N=8, seq 1024, fwd+bwd).
_OURS_FOR_PEERS = ("tpu_grad_d128_bf16_causal", "tpu_grad_d128_bf16_full", "tpu_grad_d128_bf16_window",
                   "tpu_grad_d128_gqa8to2_bf16_causal")


def _peer_table(section: dict) -> list[str]:
    out = ["\n## Peers side by side (shown, not gated)\n",
           "JAX's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`: causal, a local window "
           "of 256 (ours: `window=(256, 0)`), GQA 8:2 through its MQA kernel vmapped over the kv heads; default "
           "128 blocks) and JAX's Pallas TPU flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`, "
           "default blocks), fwd+bwd, bf16, hd128, B=4, N=8, seq 1024, compiled the same way; tokamax's "
           f"attention when it installs (toolchain: tokamax {section['toolchain'].get('tokamax')}).\n",
           "| target | variant | kernels | max scoped VMEM | HBM temp | compile s | takes |",
           "|---|---|---|---|---|---|---|"]
    for target in section["targets"]:
        if not any(r["target"] == target and r["group"] == "peer" for r in section["rows"]):
            continue  # peers compile for the gated generations only
        rows = [r for r in section["rows"] if r["target"] == target and
                (r["group"] == "peer" or r["variant"] in _OURS_FOR_PEERS)]
        for r in sorted(rows, key=lambda r: (r["group"] == "peer", r["variant"])):
            if r["status"] != "ok":
                out.append(f"| {target} | {r['variant']} | **error**: {r.get('error', '')[:160]} | | | "
                           f"{r['compile_s']} | {r.get('features', '')} |")
                continue
            ks = r.get("kernels") or []
            vmem = max((k.get("scoped_vmem") or 0 for k in ks), default=None)
            takes = r.get("features") or "ours: causal, window, GQA, lengths, segments, bias, dropout, flex hooks, jvp"
            out.append(f"| {target} | {r['variant']} | {len(ks)} | {_mib(vmem)} | "
                       f"{_mib((r.get('hbm') or {}).get('temp'))} | {r['compile_s']} | {takes} |")
    return out
