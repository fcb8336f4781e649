"""The exceptions the compile report's check (scripts/compile/check.py) allows, each with its figure and why:
the spills that remain (one entry per kernel, target and variant, capped within 10 % of its figure) and the
Hopper kernels whose matmuls are allowed a wgmma share under `MIN_WGMMA_SHARE`. Everything not listed here is
held to no spill and the full share. docs/perf-notes.md has the tiles tried."""


# Spills that remain, one entry per (kernel, target, variant), each capped within 10 % of its figure (a larger
# spill, or one anywhere else, fails), with why it is not zero; docs/perf-notes.md has the tiles tried. None
# remain: where a feature spilled on the default tiles, the dispatch retiles that kernel for it
# (`triton.plan.forward_config`, `backward_configs`, `tangent_config`; Versions 7, 7b-7e) or splits
# its work across programs (the tangent's value head dim, Version 7u; dV and dK at head dim 256 with a score
# tile on sm_90a, Version 7f). The Mosaic kernels have none (dK/dV with a score_mod: Version 7y).
SPILLS: dict[tuple[str, str, str], tuple[int, int, str]] = {
    # (kernel, target, variant): (max spill store bytes, max spill load bytes, why)
}

# Hopper: the share of a kernel's matmul instructions that are wgmma, HGMMA / (HGMMA + HMMA), counted in the
# SASS, must be at least MIN_WGMMA_SHARE for 16-bit inputs. The kernels below fall short by design or for now,
# each with the least share it must keep (so a further drop fails) and why; docs/perf-notes.md has figures.
MIN_WGMMA_SHARE = 0.5
LOW_WGMMA_SHARE = {
    # (kernel, head dim): (least share, why)
}
# A decode tile holds T x (N / K) query rows, padded to 16: under 64 rows wgmma (M = 64 per warpgroup) does not
# apply and Triton emits mma.sync. Decoding reads the whole cache for a few rows, so memory, not the matmuls,
# bounds it. The T = 16, GQA 32:8 variants (64 rows) must use wgmma.
NO_WGMMA_VARIANTS = {r"^decode_.*(_t1|_t4|_gqa8to2)": "decode tiles of under 64 query rows: mma.sync"}
