"""docs/compile/index.md from the compile report's JSON (scripts/compile/report.py writes both)."""

from __future__ import annotations

_INTRO = """# Compile report: every kernel, compiled for each GPU without one

`bash scripts/compile_check.sh` installs a pinned toolchain ({toolchain}) outside the repo (cached under
`~/.cache/probjax-gpu-toolchain`), compiles every kernel variant that `auto` or a default `FlashConfig` picks
for each target below through XLA, Pallas (Triton and Mosaic GPU) and ptxas, with no GPU (deviceless
ahead-of-time compilation: `jax.experimental.topologies` with an XLA target config), writes this page and
`docs/compile/report.json` (the Mosaic TPU kernels have a page of their own: [tpu.md](tpu.md)), and fails on a compile error, a spill, shared memory over the target's limit, a
Hopper Triton kernel without wgmma where the report expects one, or a Mosaic kernel without TMA or wgmma.
Every kernel here, Triton and Mosaic GPU alike, went through that pinned ptxas (Mosaic GPU runs the first
ptxas on PATH, so the driver puts the toolchain's first). CI (`.ci/run`) runs it after the test suite. Last run: {rows} compiles, {kernels} kernels, {wall} s wall
with {jobs} worker processes.

**What it proves:** each kernel compiles for the target at the tiles `default_config` picks there (the tiles
below); ptxas's register count and spill bytes, the kernel's dynamic shared memory, the CTAs per SM those
allow, and which tensor-core / copy instructions the SASS holds. **What it does not prove:** speed (no
kernel ran; occupancy is an upper bound, not a measurement), correctness on a device (the test suite checks
the kernels' numbers in Pallas interpret mode on the CPU), or anything about GPUs, ptxas versions or jax
versions other than those named here. Register and shared-memory figures do not depend on the batch, the
heads or the sequence length beyond its padded tail, so the grid is deduplicated: B=4, N=8, seq 1024 per
static configuration, plus the ragged lengths that change the kernel and one seq 8192 control
(`scripts/compile/variants.py`, where adding a kernel is a few lines).

Columns: **regs** registers per thread; **spill** bytes stored / loaded to local memory; **smem** dynamic
shared memory per CTA (XLA's launch for Triton, Mosaic GPU's scratch); **CTA/SM r / s** resident CTAs per SM
that the registers / shared memory allow; **HGMMA** wgmma, **HMMA** mma.sync, **UTMALDG** TMA loads,
**LDGSTS** cp.async copies, counted in the SASS; **tiles** the FlashConfig the variant compiled
(fwd q x k, dK/dV q x k, dQ q x k, warps, stages); **s** the whole variant's compile time.

Peers, side by side, shown but not checked (group `peer`): JAX's own Pallas Triton attention
(`jax.experimental.pallas.ops.gpu.attention.mha`) at its default block sizes (forward 128 x 128, backward
32 x 32), compiled by the same toolchain at the same shapes. JAX's Mosaic GPU attention and tokamax are not
in the report yet.

Hopper Triton kernels expected to use no wgmma: {no_wgmma}. float32 inputs use no tensor cores at all (the
kernels' float32 dots run at Precision.HIGHEST, which Triton lowers to FMA), so they are not held to wgmma.
"""


def _tiles(config: dict | None) -> str:
    if not config:
        return ""
    c = config
    return (f"{c['block_q']}x{c['block_k']} / {c['block_q_dkv']}x{c['block_k_dkv']} / "
            f"{c['block_q_dq']}x{c['block_k_dq']} w{c['num_warps']} s{c['num_stages']}")


def markdown(report: dict, problems: list[str], open_problems: list[str] = ()) -> str:
    rows = report["rows"]
    kernels = sum(len(r["kernels"]) for r in rows)
    toolchain = ", ".join(f"{k} {v}" for k, v in report["toolchain"].items())
    no_wgmma = "; ".join([f"`{x['kernel']}` at head dim {x['head_dim']} ({x['why']})" for x in report["no_wgmma_ok"]]
                         + [f"variants matching `{x['variants']}` ({x['why']})"
                            for x in report.get("no_wgmma_variants", [])])
    out = [_INTRO.format(toolchain=toolchain, rows=len(rows), kernels=kernels, wall=report["wall_s"],
                         jobs=report["jobs"], no_wgmma=no_wgmma or "none")]
    out.append("## Targets\n")
    out.append("| target | arch | device | SMs | smem / block | smem / SM | threads / SM |")
    out.append("|---|---|---|---|---|---|---|")
    for name in report["targets"]:
        t = report["limits"][name]
        out.append(f"| {name} | {t['arch']} | {t['device']} | {t['sms']} | {t['smem_per_block']:,} | "
                   f"{t['smem_per_sm']:,} | {t['threads_per_sm']} |")
    out.append("\n## Result\n")
    if problems:
        out.append(f"**{len(problems)} problems** (CI fails):\n")
        out += [f"- {p}" for p in problems]
    else:
        out.append("CI passes: outside the open variants and the capped known spills listed below, no compile "
                   "error, no spill, shared memory within every target's limit, wgmma and TMA where expected.")
    if open_problems:
        out.append("\n**Open** (compiled and shown, reported by CI without failing it; "
                   + "; ".join(f"`{x['variants']}`: {x['why']}" for x in report.get("open", [])) + "):\n")
        out += [f"- {p}" for p in open_problems]
    if report.get("known_spills"):
        out.append("\n**Known spills CI tolerates up to a cap** (the opt-in Mosaic GPU backend only; a larger "
                   "spill, or one anywhere else, fails):\n")
        out += [f"- `{x['kernel']}` in variants matching `{x['variants']}`: at most {x['max_stores']} B stored / "
                f"{x['max_loads']} B loaded; {x['why']}" for x in report["known_spills"]]
    out.append("\n## Headline per target (worst case over our variants that are not open; peers excluded)\n")
    out.append("| target | compiles | errors | kernels | max regs | spilling kernels | max smem | "
               "min CTA/SM (regs) | open variants |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for name in report["targets"]:
        mine = [r for r in rows if r["target"] == name and not r.get("open") and r["group"] != "peer"]
        opened = sum(1 for r in rows if r["target"] == name and r.get("open"))
        ks = [k for r in mine for k in r["kernels"]]
        out.append(
            f"| {name} | {len(mine)} | {sum(r['status'] != 'ok' for r in mine)} | {len(ks)} | "
            f"{max((k['registers'] or 0 for k in ks), default=0)} | "
            f"{sum(bool(k['spill_stores'] or k['spill_loads']) for k in ks)} | "
            f"{max((k['smem'] or 0 for k in ks), default=0):,} | "
            f"{min((k.get('ctas_by_registers', 99) for k in ks), default=0)} | {opened} |")
    for name in report["targets"]:
        out.append(f"\n## {name} ({report['limits'][name]['device']}, {report['limits'][name]['arch']})\n")
        out.append("| variant | tiles | kernel | regs | spill | smem | threads | CTA/SM r / s | HGMMA | HMMA | "
                   "UTMALDG | LDGSTS | s |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r["target"] == name):
            if r["status"] != "ok":
                out.append(f"| {r['variant']} | {_tiles(r.get('config'))} | **compile error**: "
                           f"{r.get('error', '')[:120]} |  |  |  |  |  |  |  |  |  | {r['compile_s']} |")
            for k in r["kernels"]:
                spill = f"{k['spill_stores']} / {k['spill_loads']}"
                spill = f"**{spill}**" if k["spill_stores"] or k["spill_loads"] else spill
                occ = f"{k.get('ctas_by_registers', '?')} / {k.get('ctas_by_smem', '?')}"
                tiles = "Mosaic" if k["lowering"] == "mosaic" else _tiles(r.get("config"))
                out.append(
                    f"| {r['variant']} | {tiles} | {k['kernel'].removeprefix('probjax_')} | {k['registers']} | "
                    f"{spill} | {k['smem'] if k['smem'] is not None else '?'} | {k['threads']} | {occ} | "
                    f"{k['HGMMA']} | {k['HMMA']} | {k['UTMALDG']} | {k['LDGSTS']} | {r['compile_s']} |")
    return "\n".join(out) + "\n"
