"""docs/compile/index.md from the compile report's JSON (scripts/compile/report.py writes both). Every figure
and list on the page is read from the report, so the page cannot drift from it."""

from __future__ import annotations

import re

import variants as registry
from figures import ARCH_SASS_OPS

_INTRO = """# Compile report: every kernel, compiled for each GPU without one

`bash scripts/compile_check.sh` installs a pinned toolchain ({toolchain}) outside the repo (cached under
`~/.cache/probjax-gpu-toolchain`), compiles every kernel variant of the registry (`scripts/compile/variants.py`)
for each target below through XLA, Pallas (Triton and Mosaic GPU) and ptxas, with no GPU (deviceless
ahead-of-time compilation: `jax.experimental.topologies` with an XLA target config), writes this page and
`docs/compile/report.json` (the Mosaic TPU kernels have a page of their own: [tpu.md](tpu.md)), and checks them. Every kernel here, Triton and Mosaic GPU alike, went through that
pinned ptxas (Mosaic GPU runs the first ptxas on PATH, so the driver puts the toolchain's first). CI
(`.ci/run`) runs it after the test suite with `--reuse docs/compile/report.json`: it lowers every variant and
compiles those whose fingerprint (the lowered module with its kernels' Triton / Mosaic GPU IR and their
source lines, the toolchain's versions and ptxas wrapper, the target, the code that reads the figures) is not
this report's, takes this report's figures for the others, and compiles one of those per (target, group)
again, picked by the commit, whose figures must equal them. A change to a kernel, a moved source line
included, recompiles every variant that traces through it: run this with `--reuse` after such a change to
keep CI's compile short. Last run: {rows} compiles ({expected} expected), {kernels} kernels,
{wall}.

**The registry is the expected set.** Its grid restates the dispatch rules from the API contract
(`required_kernels`): every call a user reaches through `auto` or a default `FlashConfig` (the Triton kernels on every GPU) and through
`FlashConfig(backend="mosaic")` / `PROBJAX_MOSAIC=1` (Hopper: the Mosaic GPU kernels where they take the
call, the Triton ones where they do not), as dtype (bfloat16, float32; float16 once per backend) x head dim
(64 / 128 / 256) x mode (fwd+bwd, jvp) x feature (causal, a window, GQA, Dv != D, dropout, segment ids with
lengths, a dense bias (of the inputs' dtype, and float32) and a dense mask, also with GQA, the flex hooks: soft
cap, ALiBi, a document mask and a sliding window as BlockMasks, a soft cap on that BlockMask, a relative-bias
table; each at every head dim on both backends), ragged lengths, seq 8192 beside the peers, and the decode
kernel. Each variant names the kernels its compile must hold (forward, dQ, dK/dV, tangent, decode;
`probjax_mosaic_*` where the Mosaic kernels take the call). Left out until a per-call rule makes them clean
(`NOT_YET_CLEAN`, with the figures of their last compile; docs/perf-notes.md, Version 7c): {pending}.
sm_90a, sm_80 and sm_86 compile the whole registry, and sm_100a B200 every Triton, decode and control row of it
(`WHOLE_TARGETS`: the same plan as sm_90a's compiles to tcgen05 code of its own) beside the backend "mosaic"
rows whose plan there differs from backend "triton"'s; sm_89 and sm_120 (`SUBSET_TARGETS`) a subset of it
(`_on_subset_targets`) that holds each family whose tiles or code differ once: every feature in fwd+bwd at
head dim 64 / 128 / 256 in bfloat16, the jvp of the calls whose tangent has rules of its own, float32's base
calls and the features its rules name, float16, the ragged tails, the seq 8192 causal controls, and every
decode and ragged variant, and the calls whose plan differs from sm_86's; no Mosaic variant (backend "mosaic"
refuses these GPUs) and no peer. sm90a_h200 (the H100's SM with 141 GB) holds the LM example's whole
programs alone (`scripts/compile/lm_programs.py`, `registry_variants`: the `bench-hd64` / `bench-hd128` training
step and batched generation on one GPU, the training step on a 2-GPU mesh, "data=2" and "seq=2"), which
sm100a_b200 compiles too, their planned HBM held to the device's memory and each mesh axis to its collective
(`check.MESH_COLLECTIVES`). Target descriptions and their sources:
`scripts/compile/gpu_targets/`. Beside the grid, the rows of the dispatch's own plans: every call one argument
away from a grid call that `_dispatch.plan` plans onto kernels, tiles, a dK/dV grid or splits no row compiles
on that target, on every target (on sm_100a / sm_89 / sm_120 where the plan differs from sm_90a's / sm_86's),
and the calls of `plan_space.FORCED` (see "Rows from the dispatch's plans" below).

**The check fails closed** on: a row of the earlier report (`--reuse`, the committed record) the registry no
longer has, unless `rules.RETIRED` names it with why; a (target, variant) pair of the registry missing from the report, or a row the
registry lacks; a variant that raised while being built or failed to compile; a required kernel missing or an
unexpected one; an empty expected set (`--only` matching nothing); a spill, except the entries listed under
Result (one per kernel, target and variant, capped within 10 % of its figure); shared memory over the
target's limit; a figure those checks read missing (null or absent: registers, threads, shared memory, spills,
and the instruction counts of the target's checks). On Hopper: a Mosaic kernel without TMA or wgmma. On sm_90a
and sm_100a: a 16-bit kernel whose matmul instructions are less than {min_share:.0%} the arch's wide MMA (wgmma:
HGMMA / (HGMMA + HMMA); tcgen05: UTCHMMA / (UTCHMMA + HGMMA + HMMA)). On sm_80 / sm_86 / sm_89 / sm_120: a
16-bit kernel without mma.sync (HMMA), or a pipelined one (its own config's 2 stages or more, and decode)
without cp.async (LDGSTS). Every tolerance of these rules is one entry of `scripts/compile/rules.py`, listed
under **Tolerances** below with its reason.

**What it proves:** each kernel compiles for the target at the tiles `default_config` picks there (the tiles
below); ptxas's register count and spill bytes, the kernel's dynamic shared memory, the CTAs per SM those
allow, and which tensor-core / copy instructions the SASS holds. **What it does not prove:** speed (no
kernel ran; occupancy is an upper bound, not a measurement), correctness on a device (the test suite checks
the kernels' numbers in Pallas interpret mode on the CPU), or anything about GPUs, ptxas versions or jax
versions other than those named here. Tiles do not depend on the batch, the heads or the sequence length
(beyond shrinking to a sequence shorter than a tile), but registers can: {seq_note}

Columns: **regs** registers per thread; **spill** bytes stored / loaded to local memory; **smem** dynamic
shared memory per CTA (XLA's launch for Triton, Mosaic GPU's scratch); **CTA/SM r / s** resident CTAs per SM
that the registers / shared memory allow; **HGMMA** wgmma, **HMMA** mma.sync, **UTMALDG** TMA loads,
**LDGSTS** cp.async copies, **UTCHMMA** tcgen05 MMAs (sm_100a's table only), counted in the SASS; **tiles** the kernel's own tile (q x k, warps, stages: the
forward's, dQ's, dK/dV's or the tangent's; `/2`: its work split across two programs per tile, dV's and dK's,
or the two halves of the tangent's value head dim); **s** the whole variant's compile time.

Peers, side by side, compiled by the same toolchain and shown but not checked (group `peer`): {peers}.

"""


def _tile(config: dict | None, kernel: str) -> str:
    """The tile a kernel ran on, from the row's config (`tangent` for the tangent kernel)."""
    if not config:
        return ""
    q, k = {"backward_dq": ("block_q_dq", "block_k_dq"), "backward_dkv": ("block_q_dkv", "block_k_dkv")}.get(
        kernel.removeprefix("probjax_flash_"), ("block_q", "block_k"))
    split = f" /{config['splits']}" if config.get("splits", 1) > 1 else ""
    return f"{config[q]}x{config[k]} w{config['num_warps']} s{config['num_stages']}{split}"


def _config_of(row: dict, kernel: str) -> dict | None:
    """The config a kernel of the row ran: as traced (`kernel_configs`, where the dispatch retiles a kernel
    for the call's features), else the tangent's own (`tangent_config`), the Triton forward's on backend
    "mosaic" (`triton_fallback_config`), else the row's."""
    if kernel in row.get("kernel_configs", {}):
        return row["kernel_configs"][kernel]
    if kernel.endswith("_tangent"):
        return row.get("tangent_config")
    if kernel == "probjax_flash_forward" and row.get("fallback_config"):
        return row["fallback_config"]
    return row.get("config")


def seq_note(rows: list[dict]) -> str:
    """How the registers of the seq 8192 controls differ from the same variant at seq 1024, per target."""
    by_key = {(r["target"], r["variant"]): r for r in rows}
    diffs = []
    for row in rows:
        if not row["variant"].endswith("_T8192") or row["group"] == "peer":
            continue
        short = by_key.get((row["target"], row["variant"].removesuffix("_T8192")))
        if not short:
            continue
        regs = {k["kernel"]: k["registers"] for k in short["kernels"]}
        for k in row["kernels"]:
            if regs.get(k["kernel"]) not in (None, k["registers"]):
                diffs.append(f"{row['target']} {short['variant']} {k['kernel'].removeprefix('probjax_')}: "
                             f"{regs[k['kernel']]} registers at seq 1024, {k['registers']} at 8192")
    if not diffs:
        return "in this report no kernel's registers differ between seq 1024 and 8192."
    return ("the seq 8192 controls (`*_T8192`) differ from seq 1024 in " + "; ".join(diffs)
            + " (ptxas schedules the longer loop differently; the tiles are the same).")


def _peers(rows: list[dict]) -> str:
    families = {}
    for r in (r for r in rows if r["group"] == "peer"):
        family = re.sub(r"_grad_.*", "", r["variant"])
        entry = families.setdefault(family, dict(seqs=set(), dims=set(), targets=set(), errors=0))
        entry["seqs"].add(r["q_len"])
        entry["dims"].add(r["head_dim"])
        entry["targets"].add(r["target"])
        entry["errors"] += r["status"] != "ok"
    names = {"jax_pallas_mha": "JAX's Pallas Triton attention (`jax.experimental.pallas.ops.gpu.attention.mha`, "
                               "bf16, its default blocks: forward 128 x 128, backward 32 x 32)",
             "jax_mosaic_attention": "JAX's Pallas Mosaic GPU attention (`attention_mgpu`, f16, block_q 64, "
                                     "block_kv 128, 64 x 64 backward; its causal build refuses ptxas 12.8.0-12.9.1)"}
    if not families:
        return "none"
    return "; ".join(
        f"{names.get(f, f)} at seq {' / '.join(map(str, sorted(e['seqs'])))}, head dim "
        f"{' / '.join(map(str, sorted(e['dims'])))}, fwd+bwd, on {', '.join(sorted(e['targets']))}"
        + (f" ({e['errors']} compiles refused or failed, shown below)" if e["errors"] else "")
        for f, e in sorted(families.items()))


def markdown(report: dict, problems: list[str]) -> str:
    rows = report["rows"]
    kernels = sum(len(r["kernels"]) for r in rows)
    toolchain = ", ".join(f"{k} {v}" for k, v in report["toolchain"].items())
    wall = (f"{report['wall_s']} s wall with {report['jobs']} worker processes" if not report.get("assembled") else
            f"assembled from the journal of resumed runs (`--journal`, `--assemble`): {report['wall_s']} s of "
            f"compile time per worker over {report['jobs']} workers, on a loaded machine")
    carried = sorted({r["carried_from"] for r in rows if r.get("carried_from")})
    if carried:
        wall += (f". {sum(bool(r.get('carried_from')) for r in rows)} rows (marked \u2020) are carried over from "
                 f"earlier compiles (at {' and '.join(carried)}), whose kernels and tiles for them are unchanged since; "
                 "the others were compiled for this report")
    reused = sum(bool(r.get("reused")) for r in rows)
    if report.get("reused_from"):
        wall += (f". {reused} rows took their figures from `{report['reused_from']}`, whose rows have the same "
                 "fingerprint (the lowered module with its kernels' IR, the toolchain, the target and the code that "
                 f"reads the figures); {sum('reproduced' in r for r in rows)} more that could have, picked by the "
                 "commit, were compiled again and had to equal them; the others were compiled for this report")
    joint = sum(bool(r.get("compiled_with")) for r in rows)
    if joint:
        wall += (f". {joint} rows are a call's fwd+bwd and its jvp compiled as one program (the forward kernel both "
                 "run is compiled once; each row lists the kernels its own function lowers to); their seconds "
                 "(marked *) are that program's")
    pending = ", ".join(f"`{name}` ({why})" for name, why in registry.NOT_YET_CLEAN.items()) or "none"
    out = [_INTRO.format(toolchain=toolchain, pending=pending, rows=len(rows),
                         expected=report.get("expected", len(rows)), kernels=kernels, wall=wall,
                         min_share=report["min_wide_share"],
                         seq_note=seq_note(rows), peers=_peers(rows))]
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
        out.append("CI passes: every expected variant compiled with its kernels; no compile error, no spill "
                   "outside the entries below, shared memory within every target's limit, wgmma / TMA / mma / "
                   "cp.async where required.")
    spills = report.get("spills", [])
    if spills:
        out.append(f"\n**Spills that remain** ({len(spills)}: each one kernel on one target in one variant, "
                   "capped within 10 % of its figure; a larger spill, or one anywhere else, fails):\n")
        out += [f"- {x['target']} `{x['variant']}` `{x['kernel']}`: at most {x['max_stores']} B stored / "
                f"{x['max_loads']} B loaded; {x['why']}" for x in spills]
    else:
        out.append("\nNo spill anywhere: the check tolerates none.")
    out.append("\n## Tolerances\n")
    out.append("Everything the check lets pass that its rules would otherwise fail, one entry each "
               "(`scripts/compile/rules.py`, `tolerances`):\n")
    out.append("| tolerance | covers | why |")
    out.append("|---|---|---|")
    out += [f"| {t['rule']} | {t['covers']} | {t['why']} |" for t in report["tolerances"]]
    out += planned_section(rows)
    lm = [r for r in rows if r["group"] == "lm"]
    if lm:
        out.append("\n## The LM example's programs (`--preset bench-hd64` / `bench-hd128`, "
                   "`scripts/compile/lm_programs.py`)\n")
        out.append("Whole programs on one GPU: the training step (4 sequences of T = 2048 or 8192 tokens; donation "
                   "is not modelled, so params and optimiser state count as arguments and outputs) and the batched "
                   "generation (4 prompts of T, 64 decode steps); and the training step on 2 GPUs of one host (`_data2`: "
                   "4 sequences per GPU, the gradients all-reduced; `_seq2`: 4 sequences split along the sequence, "
                   "attention as a ring of the flash kernels, K / V passed by collective-permutes). HBM per device "
                   "as XLA plans it, against the device's memory; the collectives of the compiled program.\n")
        out.append("| target | program | arguments | outputs | temp | total | device | share | collectives | "
                   "Pallas kernels |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in lm:
            hbm = r.get("hbm") or {}
            capacity = report["limits"][r["target"]].get("device_memory")
            gib = (lambda b: f"{b / 2**30:.2f} GiB" if b is not None else "?")
            share = f"{hbm['total'] / capacity:.1%}" if hbm.get("total") is not None and capacity else "?"
            out.append(f"| {r['target']} | {r['variant']} | {gib(hbm.get('arguments'))} | {gib(hbm.get('outputs'))} | "
                       f"{gib(hbm.get('temp'))} | {gib(hbm.get('total'))} | {gib(capacity)} | {share} | "
                       f"{', '.join(f'{n} {c}' for n, c in (r.get('collectives') or {}).items() if c) or '-'} | "
                       f"{', '.join(sorted(k['kernel'].removeprefix('probjax_') for k in r['kernels']))} |")
    out += side_by_side_section(rows)
    out.append("\n## Headline per target (worst case over our variants; peers excluded)\n")
    out.append("| target | compiles | errors | kernels | max regs | spilling kernels | max smem | "
               "min CTA/SM (regs) |")
    out.append("|---|---|---|---|---|---|---|---|")
    for name in report["targets"]:
        mine = [r for r in rows if r["target"] == name and r["group"] != "peer"]
        ks = [k for r in mine for k in r["kernels"]]
        out.append(
            f"| {name} | {len(mine)} | {sum(r['status'] != 'ok' for r in mine)} | {len(ks)} | "
            f"{max((k['registers'] or 0 for k in ks), default=0)} | "
            f"{sum(bool(k['spill_stores'] or k['spill_loads']) for k in ks)} | "
            f"{max((k['smem'] or 0 for k in ks), default=0):,} | "
            f"{min((k.get('ctas_by_registers', 99) for k in ks), default=0)} |")
    for name in report["targets"]:
        out.append(f"\n## {name} ({report['limits'][name]['device']}, {report['limits'][name]['arch']})\n")
        extra = ARCH_SASS_OPS.get(report["limits"][name]["arch"], ())
        out.append("| variant | tiles | kernel | regs | spill | smem | threads | CTA/SM r / s | HGMMA | HMMA | "
                   f"UTMALDG | LDGSTS | {''.join(f'{op} | ' for op in extra)}s |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra) + "---|")
        for r in (r for r in rows if r["target"] == name):
            if r["status"] != "ok":
                out.append(f"| {r['variant']} |  | **compile error**: "
                           f"{r.get('error', '')[:120]} |  |  |  |  |  |  |  |  |  | {'  |' * len(extra)}"
                           f"{r['compile_s']} |")
            for k in r["kernels"]:
                spill = f"{k['spill_stores']} / {k['spill_loads']}"
                spill = f"**{spill}**" if k["spill_stores"] or k["spill_loads"] else spill
                occ = f"{k.get('ctas_by_registers', '?')} / {k.get('ctas_by_smem', '?')}"
                config = _config_of(r, k["kernel"])
                tiles = "Mosaic" if k["lowering"] == "mosaic" else _tile(config, k["kernel"])
                out.append(
                    f"| {r['variant']}{' \u2020' if r.get('carried_from') else ''} | {tiles} | {k['kernel'].removeprefix('probjax_')} | {k['registers']} | "
                    f"{spill} | {k['smem'] if k['smem'] is not None else '?'} | {k['threads']} | {occ} | "
                    f"{k['HGMMA']} | {k['HMMA']} | {k['UTMALDG']} | {k['LDGSTS']} | "
                    f"{''.join(f'{k.get(op)} | ' for op in extra)}{r['compile_s']}"
                    f"{' *' if r.get('compiled_with') else ''} |")
    return "\n".join(out) + "\n"


PERF_BEGIN = "<!-- compile-report figures: generated by scripts/compile/report.py from docs/compile/report.json -->"
PERF_END = "<!-- end of the generated compile-report figures -->"


def side_by_side_section(rows: list[dict]) -> list[str]:
    """Our fwd+bwd programs (`side_` variants) beside tokamax's at the same shapes, per target: the kernels'
    figures and the whole program's HBM temp and XLA-side bytes, with the ratios ours / theirs."""
    by_key = {(r["target"], r["variant"]): r for r in rows}
    out = ["\n## Side by side with tokamax (bf16, causal, fwd+bwd, B = 4, N = 8)\n",
           "Each program compiled alone by the same toolchain (`variants._side_by_side_variants`, the tokamax peers "
           "at their default configs). Kernels: the largest registers per thread and shared memory, spilled bytes "
           "(stores + loads), and the static count of matrix instructions summed over the kernels: wgmma (HGMMA) "
           "on sm_90a, tcgen05 (UTCHMMA) on sm_100a, mma.sync (HMMA). Program: the HBM temp XLA plans and the "
           "bytes the instructions outside the Pallas kernels move (`xla_bytes`). Ratios: ours / tokamax's "
           "(under 1.0: ours is smaller).\n",
           "| target | T | D | kernels of | program | kernels | max regs | max smem | spill B | wide MMA | HMMA | "
           "temp | XLA bytes | temp ratio | XLA bytes ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    mib = (lambda b: f"{b / 2**20:,.0f} MiB" if b is not None else "?")
    ratio = (lambda a, b: f"{a / b:.2f}" if a is not None and b else "?")
    for target in registry.SIDE_TARGETS:
        for seq, d, backend in [(s, d, b) for b in ("triton", "mosaic") for s in (1024, 8192) for d in (64, 128)]:
            suffix = "" if seq == 1024 else f"_T{seq}"
            ours = by_key.get((target, f"side_{'flash' if backend == 'triton' else 'mosaic'}_grad_d{d}_bf16_causal{suffix}"))
            theirs = by_key.get((target, f"tokamax_{backend}_grad_d{d}_bf16_causal{suffix}"))
            for who, row in (("probjax", ours), ("tokamax", theirs)):
                if row is None:
                    continue
                hbm, other = row.get("hbm") or {}, (theirs or {}).get("hbm") or {}
                ratios = ([ratio(hbm.get(key), other.get(key)) for key in ("temp", "xla_bytes")]
                          if row is ours and theirs is not None and theirs["status"] == "ok" else ["", ""])
                out.append(f"| {target} | {seq} | {d} | {backend} | {who} | "
                           + " | ".join(_kernel_cells(row, "UTCHMMA" if "sm100" in target else "HGMMA"))
                           + f" | {mib(hbm.get('temp'))} | {mib(hbm.get('xla_bytes'))} | {' | '.join(ratios)} |")
    return out


def _kernel_cells(row: dict, wide: str) -> list[str]:
    """A compile's kernels in the side-by-side table: how many, the largest registers and shared memory, the
    spilled bytes, the `wide` matrix instructions and the mma.sync ones summed over them; "error" where the
    compile failed."""
    ks = row["kernels"]
    if row["status"] != "ok" or not ks:
        return ["error"] + ["-"] * 5
    return [str(len(ks)), str(max(k["registers"] or 0 for k in ks)), f"{max(k['smem'] or 0 for k in ks):,}",
            str(sum((k["spill_stores"] or 0) + (k["spill_loads"] or 0) for k in ks)),
            str(sum(k.get(wide) or 0 for k in ks)), str(sum(k.get("HMMA") or 0 for k in ks))]


def planned_section(rows: list[dict]) -> list[str]:
    """The rows that come from the dispatch's plans (`plan_space.py`) and from the decode and ragged kernels'
    planners (`decode_space.py`, `ragged_space.py`): how many per target, and the calls that are rows whatever
    their plans (`plan_space.FORCED`) with why."""
    import decode_space
    import plan_space
    import ragged_space

    planned = {plan_space.probe_of(r).name(r["mode"]) for r in plan_space.derived_rows()}
    decode = {decode_space.probe_of(r).name for r in plan_space.derived_decode_rows()}
    ragged = {ragged_space.probe_of(r).name for r in plan_space.derived_ragged_rows()}
    out = ["\n## Rows from the dispatch's plans\n",
           "Beside the grid, the registry holds the calls one argument away from a grid call (float16, head dim "
           "16 / 32, ragged and long sequences, keys longer or shorter than queries, other GQA ratios, key / value "
           "batch 1, other value head dims and windows, broadcast bias and mask shapes) whose plan, made by "
           "`_dispatch.plan` for the target, runs kernels, tiles, a dK/dV grid or splits that no row before it "
           "compiles there (`scripts/compile/plan_space.py`). A new rule in a backend's plan thus adds its rows "
           "by itself, and a row that disappears fails the check unless `rules.RETIRED` names it. The decode "
           "kernel's rows come the same way from its own planner (`triton.decode.plan_for`, "
           "`scripts/compile/decode_space.py`): the calls one argument away from its seed calls (dtype, head "
           "dims, Dv, new tokens, GQA, page size or cache length, hooks) whose row tile, key tile, tiles a step, "
           "warps, stages or kernel code no call before them has on some target, each a row on every target. "
           "So do the ragged (serving) kernel's (`triton.ragged._plan`, `scripts/compile/ragged_space.py`: head "
           "dim, GQA, page size, page dtype, tokens a program, window + soft cap + sinks, hooks, the append), "
           "each a row on the targets where the kernel takes it.\n",
           "| target | rows | from the plans | decode, from its planner | ragged, from its planner |",
           "|---|---|---|---|---|"]
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == target]
        out.append(f"| {target} | {len(mine)} | {sum(r['variant'] in planned for r in mine)} | "
                   f"{sum(r['variant'] in decode for r in mine)} | {sum(r['variant'] in ragged for r in mine)} |")
    out.append("\nRows whatever their plans (their code, not their tiles, differs from every grid call's):\n")
    out += [f"- `{name}`: {why}" for name, why in plan_space.FORCED.items()]
    return out


def perf_figures(report: dict) -> str:
    """The block of docs/perf-notes.md between `PERF_BEGIN` and `PERF_END`: the current figures of the
    default kernels (causal, seq 1024: fwd+bwd and the jvp's tangent) per target, head dim and dtype, and of
    the Mosaic kernels, read from the report."""
    rows = {(r["target"], r["variant"]): r for r in report["rows"]}
    out = [PERF_BEGIN, "",
           "| target | variant | kernel | tiles | regs | spill | smem | HGMMA | HMMA | UTCHMMA |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    picks = [f"flash_{m}_d{d}_{t}_causal" for t in ("bf16", "f32") for d in (64, 128, 256) for m in ("grad", "jvp")]
    picks += ["mosaic_grad_d64_bf16_causal", "mosaic_grad_d128_bf16_causal", "mosaic_grad_d128_bf16_gqa8to2_causal",
              "mosaic_flex_grad_d128_bf16_softcap", "mosaic_grad_d128_f32_causal"]
    for target in report["targets"]:
        for name in picks:
            row = rows.get((target, name))
            if row is None:
                continue
            for k in row["kernels"]:
                if name.startswith("flash_jvp") and not k["kernel"].endswith("_tangent"):
                    continue  # the forward is the fwd+bwd row's
                config = _config_of(row, k["kernel"])
                tiles = "Mosaic" if k["lowering"] == "mosaic" else _tile(config, k["kernel"])
                out.append(f"| {target} | {name} | {k['kernel'].removeprefix('probjax_')} | {tiles} | "
                           f"{k['registers']} | {k['spill_stores']} / {k['spill_loads']} | {k['smem'] or 0:,} | "
                           f"{k['HGMMA']} | {k['HMMA']} | {k.get('UTCHMMA', '-')} |")
            if row["status"] != "ok":
                out.append(f"| {target} | {name} | **compile error** | | | | | | | |")
    spills = report.get("spills", [])
    out.append("")
    out.append(f"Spills that remain: {len(spills)}" + (": " + "; ".join(
        f"{x['target']} `{x['variant']}` {x['kernel'].removeprefix('probjax_')} {x['max_stores']} / "
        f"{x['max_loads']} B at most ({x['why']})" for x in spills) if spills else "") + ".")
    out += ["", PERF_END]
    return "\n".join(out)


def with_perf_figures(text: str, report: dict) -> str:
    """`text` (docs/perf-notes.md) with its generated block replaced by `perf_figures(report)`."""
    start, end = text.index(PERF_BEGIN), text.index(PERF_END) + len(PERF_END)
    return text[:start] + perf_figures(report) + text[end:]
