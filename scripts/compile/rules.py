"""The rules of the compile report's check (scripts/compile/check.py) that carry figures, and every tolerance it
allows, each one entry with why (`tolerances()`, listed on the report page): the spills that remain (one entry
per kernel, target and variant, capped within 10 % of its figure), the tensor-core instruction every 16-bit
kernel's matmuls must be on each target, the kernels allowed a lower share of it, and the decode variants whose
tiles are too small for it. Everything not listed here is held to no spill, every figure present, and the full
share. docs/perf-notes.md has the tiles tried."""

from __future__ import annotations


# Spills that remain, one entry per (kernel, target, variant), each capped within 10 % of its figure (a larger
# spill, or one anywhere else, fails), with why it is not zero; docs/perf-notes.md has the tiles tried. None
# remain: where a feature spilled on the default tiles, the dispatch retiles that kernel for it
# (`triton.plan.forward_config`, `backward_configs`, `tangent_config`; Versions 7, 7b-7e) or splits
# its work across programs (the tangent's value head dim, Version 7u; dV and dK at head dim 256 with a score
# tile on sm_90a, Version 7f). The Mosaic kernels have none (dK/dV with a score_mod: Version 7y).
SPILLS: dict[tuple[str, str, str], tuple[int, int, str]] = {
    # (kernel, target, variant): (max spill store bytes, max spill load bytes, why)
}

# The wide tensor-core instruction of an arch, as counted in the SASS (figures.SASS_OPS / ARCH_SASS_OPS), with
# its name: wgmma on sm_90a (HGMMA), tcgen05 with tensor memory on sm_100a (UTCHMMA: 16-bit inputs). There a
# 16-bit kernel's matmul instructions must all be that one: its share of the kernel's HGMMA + HMMA (+ UTCHMMA)
# is at least MIN_WIDE_SHARE. Other arches (sm_80, sm_86, sm_89, sm_120) have mma.sync (HMMA) alone.
WIDE_MMA = {"sm_90a": ("HGMMA", "wgmma"), "sm_100a": ("UTCHMMA", "tcgen05")}
MIN_WIDE_SHARE = 1.0
# Kernels allowed a share under MIN_WIDE_SHARE, each with the least share it must keep (so a further drop
# fails) and why: (kernel, arch, head dim): (least share, why). None remain.
LOW_WIDE_SHARE: dict[tuple[str, str, int], tuple[float, str]] = {}

# The decode and ragged variants whose program holds fewer than 64 query rows (decode: new tokens x query heads
# per KV head; ragged: its tokens a program x query heads per KV head; `Variant.query_rows`): wgmma (M = 64 per
# warpgroup) and tcgen05 (M = 64 or 128) do not apply and Triton emits mma.sync. Decoding reads the whole cache
# for a few rows, so memory, not the matmuls, bounds it. The names are computed from the registry
# (`small_decode_tiles`: the seeds, the rows decode_space.py and ragged_space.py derive and the LM example's
# generation), and only their decode or ragged kernel is exempt: such a kernel of any other variant (the T =
# 16, GQA 32:8 decode ones hold 64 rows) is held to the full share, and check.py fails a decode variant that
# does not state its query rows.
SMALL_DECODE_ROWS = 64


def small_decode_tiles(variants) -> tuple[str, ...]:
    """The 16-bit variants among `variants` whose decode or ragged program holds fewer than `SMALL_DECODE_ROWS`
    query rows."""
    return tuple(v.name for v in variants
                 if v.query_rows is not None and v.query_rows < SMALL_DECODE_ROWS and v.dtype != "f32")


SMALL_DECODE_WHY = ("a decode or ragged tile of under 64 query rows: wgmma / tcgen05 need 64, Triton emits "
                    "mma.sync")

# Variants of an earlier report (the committed record) that the registry no longer has, on purpose, each with
# why: any other row that disappears fails the check (`check.retired_problems`).
_MOSAIC_TOOK_IT = ("backend 'mosaic' ran this call on the Triton kernels until the Mosaic kernels took its feature "
                   "(docs/perf-notes.md, Version 13); its plan is now its family's grid row's (the same Mosaic "
                   "kernels and tiles), so the dispatch's plans no longer make it a row of its own")
RETIRED: dict[str, str] = dict.fromkeys((
    "mosaic_grad_d64_bf16_dense_mask_gqa8to2", "mosaic_grad_d128_bf16_dense_mask_gqa8to2",
    "mosaic_grad_d64_bf16_dropout_gqa8to2", "mosaic_grad_d128_bf16_dropout_gqa8to2",
    "mosaic_grad_d64_bf16_segments_lengths_gqa8to2", "mosaic_grad_d128_bf16_segments_lengths_gqa8to2",
    "mosaic_grad_d128_bf16_full_kvbatch1", "mosaic_jvp_d128_bf16_full_kvbatch1",
    "mosaic_jvp_d128_bf16_causal_kvbatch1", "mosaic_grad_d256_bf16_full_kvbatch1",
    "mosaic_grad_d256_bf16_causal_kvbatch1", "mosaic_jvp_d256_bf16_full_kvbatch1",
    "mosaic_jvp_d256_bf16_causal_kvbatch1", "mosaic_grad_d256_bf16_dropout_gqa8to2",
), _MOSAIC_TOOK_IT) | dict.fromkeys((
    "mosaic_grad_d64_bf16_full_gqa8to2", "mosaic_grad_d128_bf16_full_gqa8to2",
    "mosaic_grad_d64_bf16_causal_gqa8to2", "mosaic_grad_d128_bf16_causal_gqa8to2",
    "mosaic_grad_d64_bf16_window_gqa8to2", "mosaic_grad_d128_bf16_window_gqa8to2",
    "mosaic_grad_d128_bf16_dv64_gqa8to2",
), "rows of sm_100a alone while backend 'mosaic' ran Triton's backward there, whose dK/dV grid changes with GQA; "
   "the tcgen05 dK/dV kernel sums the group in the kernel (docs/perf-notes.md, Version 20), so the plan of a "
   "GQA call is its family's and mosaic_grad_d64 / d128_bf16_gqa8to2_causal hold GQA on sm_100a")


def tolerances(variants=()) -> list[dict]:
    """Every tolerance of the check, one entry each: `rule` (what it is), `covers` (exactly what it exempts,
    the small decode tiles among the registry's `variants`) and `why`. The report carries this list and its page
    prints it."""
    out = [
        dict(rule="float32 inputs: no tensor-core check",
             covers="kernels of rows with dtype f32 (the MMA share, mma.sync and cp.async checks; spills, shared "
                    "memory and every figure still checked)",
             why="float32 dots run at Precision.HIGHEST, which Pallas Triton lowers to FMA loops: no tensor-core "
                 "instruction to count"),
        dict(rule="peers: shown, not checked",
             covers="rows of group peer (JAX's own Pallas attention kernels, tokamax's)",
             why="other projects' kernels, compiled beside ours for comparison; a failure of theirs is shown in "
                 "its row"),
        dict(rule="cp.async only where a kernel pipelines",
             covers="Triton kernels on mma.sync GPUs whose own config has num_stages 1",
             why="a one-stage loop issues no asynchronous copy; decode and ragged kernels always pipeline"),
        dict(rule="small decode tiles on mma.sync",
             covers="the decode or ragged kernel of " + ", ".join(small_decode_tiles(variants))
             + " on sm_90a and sm_100a",
             why=SMALL_DECODE_WHY),
    ]
    out += [dict(rule="retired variant", covers=name, why=why) for name, why in RETIRED.items()]
    out += [dict(rule=f"spill of at most {c[0]} B stored / {c[1]} B loaded", covers=f"{k} on {t} in {v}", why=c[2])
            for (k, t, v), c in SPILLS.items()]
    out += [dict(rule=f"{WIDE_MMA[a][1]} share at least {c[0]}", covers=f"{k} at head dim {d} on {a}", why=c[1])
            for (k, a, d), c in LOW_WIDE_SHARE.items()]
    return out
