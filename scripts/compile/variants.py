"""The registry of the compile report (scripts/compile/report.py): every kernel variant it compiles, each
with the targets it applies to and the Pallas kernels its compile must hold. It is the report's expected set:
a (target, variant) pair missing from a report, or a required kernel missing from a row, fails the check.

The grid (`_grid_variants`): backend x dtype x head dim x mode x feature, the kernels each call must hold
restated from the API contract (`required_kernels`). Beside it the rows of the dispatch's own plans
(`planned_rows`, plan_space.py): each call one argument away from a grid call (dtype, head dim, lengths, GQA,
batch, Dv, window, bias / mask shape) that `_dispatch.plan` plans, on a target, onto kernels, tiles, a dK/dV
grid or splits no row compiles there; so a new rule of a backend's plan adds its rows by itself, and a row
that disappears fails (`check.retired_problems`). Registers can move a little with the length (loop bounds
are constants): seq 8192 is compiled beside 1024 (`_control_variants`, `plan_space.FORCED`). Decode and peers follow.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable
from serving_step import CONTEXT, HEAD_DIM, TOKENS, serving_step

# jax is imported inside the functions: the worker sets its environment (JAX_PLATFORMS, XLA_FLAGS, Mosaic GPU's
# dump options) before jax is imported, and lists the registry first.

B, N = 4, 8
# scripts/compile/gpu_targets/NAME.txtpb. The first three take the whole registry; the later ones
# (`SUBSET_TARGETS`: Blackwell sm_100a, Ada sm_89, consumer Blackwell sm_120) the subset of `_on_subset_targets`,
# one variant per family whose tiles or code differ, to keep a fresh compile of each under ~150 rows.
FULL_TARGETS = ("sm90a_h100", "sm80_a100", "sm86_rtx3090")
SUBSET_TARGETS = ("sm100a_b200", "sm89_rtx4090", "sm120_rtx5090")
# Subset targets that compile every Triton, decode and control row all the same (`_whole_row`): on sm_100a the
# same Triton plan as sm_90a's compiles to other code (tcgen05), and one spilled there and not on sm_90a
# (docs/perf-notes.md, Version 25), so a plan equal to the reference target's proves nothing there.
WHOLE_TARGETS = ("sm100a_b200",)
GPU_TARGETS = FULL_TARGETS + SUBSET_TARGETS + ("sm90a_h200",)  # the last: the LM example's programs alone
# (`lm_programs.registry_variants`, which sm100a_b200 compiles too)
HOPPER = ("sm90a_h100",)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compile: `build()` returns (function, argument ShapeDtypeStructs without sharding)."""

    name: str
    group: str  # "triton" | "mosaic" | "control" | "decode" | "peer": a worker shard
    build: Callable[[], tuple[Callable, list]]
    head_dim: int
    dtype: str
    mode: str  # "fwd" | "fwd+bwd" | "jvp"
    backend: str = "triton"
    q_len: int = 1024
    kv_len: int = 1024
    value_dim: int | None = None
    tiles: dict | None = None  # FlashConfig fields set explicitly (exploration); None: default_config's
    # The kernels the compile must hold (exactly these of ours; peers: none checked), and the targets it runs on.
    requires: tuple[str, ...] = ()
    targets: tuple[str, ...] = FULL_TARGETS
    requires_on: tuple = ()  # (target, kernels) pairs where a target's kernels differ (`requires_for`)
    # Decode variants: query rows per program (new tokens x query heads per KV head), which decide whether a
    # tile is large enough for wgmma / tcgen05 (rules.small_decode_tiles); None elsewhere.
    query_rows: int | None = None


def _spec(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype)


def dtype_of(name: str):
    """The jnp dtype of a variant's dtype name ("bf16", "f16", "f32")."""
    import jax.numpy as jnp

    return {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}[name]


def _wrap(mode: str, attend: Callable, n_args: int, grad_args: tuple[int, ...]):
    """The compiled function of a mode: the forward, the gradient of a sum in the `grad_args` (forward +
    backward kernels), or a jvp in the same arguments (the tangent kernel)."""
    import jax
    import jax.numpy as jnp

    if mode == "fwd":
        return attend
    if mode == "fwd+bwd":
        def loss(*args):
            return jnp.sum(attend(*args).astype(jnp.float32))
        return jax.grad(loss, grad_args)
    if mode == "jvp":
        def jvp(*args):
            def moved(*primals):
                args_now = list(args)
                for i, value in zip(grad_args, primals):
                    args_now[i] = value
                return attend(*args_now)
            primals = tuple(args[i] for i in grad_args)
            return jax.jvp(moved, primals, primals)[1]
        return jvp
    raise ValueError(mode)


def flash(name: str, *, head_dim=128, value_dim=None, dtype="bf16", mode="fwd", causal=False, q_len=1024,
          kv_len=None, kv_heads=N, backend="triton", group=None, tiles=None, requires=(), targets=FULL_TARGETS,
          **options) -> Variant:
    """A `flash_attention` call; `options` go to it (dropout_rate, window, ...). Segment ids and lengths are
    arguments when options has segments=True / lengths=True; a dense `[B, N, T, S]` bias that gets a gradient
    (and a tangent) with bias="same" (the inputs' dtype) or bias="f32", a dense `[B, 1, T, S]` bool mask with
    mask=True.
    `tiles`: FlashConfig fields to set rather than leave to `default_config` (for exploring candidates:
    `--explore`)."""
    kv_len = kv_len or q_len
    value_dim = value_dim or head_dim
    segments, lengths = options.pop("segments", False), options.pop("lengths", False)
    bias, mask = options.pop("bias", False), options.pop("mask", False)

    def build():  # imports the kernels here: the registry is listed without them (the driver's process)
        import jax.numpy as jnp
        from probjax_kernels import FlashConfig, flash_attention

        dt = dtype_of(dtype)

        config = FlashConfig(backend=backend, **(tiles or {}))
        specs = [_spec((B, q_len, N, head_dim), dt), _spec((B, kv_len, kv_heads, head_dim), dt),
                 _spec((B, kv_len, kv_heads, value_dim), dt)]
        if segments:
            specs += [_spec((B, q_len), jnp.int32), _spec((B, kv_len), jnp.int32)]
        if lengths:
            specs += [_spec((B,), jnp.int32), _spec((B,), jnp.int32)]
        grad_args = (0, 1, 2)
        if bias:
            grad_args += (len(specs),)
            specs += [_spec((B, N, q_len, kv_len), dt if bias == "same" else dtype_of(bias))]
        if mask:
            specs += [_spec((B, 1, q_len, kv_len), jnp.bool_)]

        def attend(q, k, v, *rest):
            extra = dict(options)
            rest = list(rest)
            if segments:
                extra.update(q_segment_ids=rest.pop(0), kv_segment_ids=rest.pop(0))
            if lengths:
                extra.update(q_lengths=rest.pop(0), kv_lengths=rest.pop(0))
            if bias:
                extra.update(bias=rest.pop(0))
            if mask:
                extra.update(mask=rest.pop(0))
            return flash_attention(q, k, v, causal=causal, config=config, **extra)

        return _wrap(mode, attend, len(specs), grad_args), specs

    return Variant(name, group or backend, build, head_dim, dtype, mode, backend, q_len, kv_len,
                   value_dim if value_dim != head_dim else None, tiles, tuple(requires), tuple(targets))


def flex(name: str, hook: str, *, head_dim=128, dtype="bf16", mode="fwd+bwd", q_len=1024, backend="triton",
         block=128, group=None, tiles=None, requires=(), targets=FULL_TARGETS) -> Variant:
    """A `flex_attention` call with one representative hook: softcap, ALiBi (captured slopes, read one element at
    a time), a document mask, a sliding window (as a BlockMask), a soft cap on a sliding-window BlockMask (a
    score_mod and block tables in one kernel), or a relative-bias table (a gather); ALiBi's slopes and the table
    get a gradient (and a tangent). `tiles` as in `flash`."""

    def build():
        import jax.numpy as jnp
        from probjax_kernels import (
            FlashConfig, alibi, and_masks, causal_mask, create_block_mask, document_mask,
            flex_attention, relative_bias, sliding_window, softcap,
        )

        dt = dtype_of(dtype)

        config = FlashConfig(backend=backend, **(tiles or {}))
        specs = [_spec((B, q_len, N, head_dim), dt)] * 3
        grad_args = (0, 1, 2)
        if hook in ("relative_bias", "alibi"):
            specs = specs + [_spec((N, 2 * q_len - 1) if hook == "relative_bias" else (N,), jnp.float32)]
            grad_args = (0, 1, 2, 3)

        def attend(q, k, v, *rest):
            score_mod, block_mask = None, None
            if hook in ("alibi", "relative_bias"):  # each reads its array, the last argument
                score_mod = (alibi if hook == "alibi" else relative_bias)(rest[0])
            elif hook == "softcap":
                score_mod = softcap(30.0)
            elif hook == "document_mask":
                ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), q_len // 4)[None].repeat(B, 0)
                block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), B, N, q_len, q_len,
                                               block_size=(block, block))
            elif hook in ("sliding_window", "softcap_sliding_window"):
                block_mask = create_block_mask(and_masks(causal_mask, sliding_window(256)), None, None, q_len,
                                               q_len, block_size=(block, block))
                score_mod = softcap(30.0) if hook == "softcap_sliding_window" else None
            else:
                raise ValueError(hook)
            return flex_attention(q, k, v, score_mod, block_mask, config=config)

        return _wrap(mode, attend, len(specs), grad_args), specs

    return Variant(name, group or backend, build, head_dim, dtype, mode, backend, q_len, q_len, tiles=tiles,
                   requires=tuple(requires), targets=tuple(targets))


# ------------------------------------------------------------------------------ the dispatch rules, restated

# Which kernels a call compiles to is decided by the backends' plans (`probjax_kernels.mosaic.plan`:
# `_mosaic_takes`, `_fits_mosaic`, `_mosaic_backward_tiles`; `_dispatch.ORDER` and `default_backend`). The rules are restated here on purpose, from the
# API contract rather than from those functions: a change in the dispatch that drops a kernel (a Mosaic call
# running on Triton, a backward kernel gone) then shows up as a missing kernel in the report and fails it,
# instead of moving the expectation along with it.
FORWARD, DQ, DKV = "probjax_flash_forward", "probjax_flash_backward_dq", "probjax_flash_backward_dkv"
TANGENT, DECODE = "probjax_flash_tangent", "probjax_decode_attention"
RAGGED = "probjax_ragged_paged_attention"
MOSAIC_FORWARD, MOSAIC_DQ, MOSAIC_DKV = ("probjax_mosaic_forward", "probjax_mosaic_backward_dq",
                                         "probjax_mosaic_backward_dkv")
MOSAIC_TANGENT = "probjax_mosaic_tangent"  # Hopper's Mosaic tangent kernel
MOSAIC_DK, MOSAIC_DV = MOSAIC_DKV + "_dk", MOSAIC_DKV + "_dv"  # its dK/dV as two programs, at head dim 256


def piece_names(kernel: str, count: int) -> tuple[str, ...]:
    """The programs of `kernel` that compute `count` pieces of its output's columns each (itself when one)."""
    return tuple(f"{kernel}_piece{p}" for p in range(count)) if count > 1 else (kernel,)


# At q / k's head dim 256 dQ and dK run as a program per 128-column piece of their columns (`mosaic.common.PIECE`).
MOSAIC_DQ_PIECES, MOSAIC_DK_PIECES = piece_names(MOSAIC_DQ, 2), piece_names(MOSAIC_DK, 2)
MOSAIC_FORWARD_TCGEN05 = "probjax_mosaic_forward_tcgen05"  # Blackwell's (sm_100a) Mosaic forward
MOSAIC_DQ_TCGEN05, MOSAIC_DKV_TCGEN05 = ("probjax_mosaic_backward_dq_tcgen05",  # and backward
                                         "probjax_mosaic_backward_dkv_tcgen05")
BLACKWELL = ("sm100a_b200",)  # where backend "mosaic" runs the Blackwell kernels
# The calls the Blackwell forward and backward take (16-bit, head dims 64 / 128): no feature beyond a window
# (causal), lengths, GQA, v's own head dim, k / v of batch 1, hooks that read their arrays one element at a time
# (a soft cap; ALiBi's slopes[h]) or along q_idx / kv_idx as vectors (a document mask's ids), BlockMasks of
# 128 x 128 blocks, dropout, segment ids, a key padding mask (which reaches them as segment ids) and a mask over
# queries and keys; the rest of backend "mosaic" runs Triton there (a relative-bias table's gather). A dense bias
# (`TCGEN05_FORWARD_ONLY`) runs the tcgen05 forward and Triton's backward (its gradient there).
TCGEN05_FAMILIES = frozenset({"full", "causal", "window", "gqa8to2_causal", "dv64", "kv_batch1", "softcap", "alibi",
                              "sliding_window", "softcap_sliding_window", "dropout", "segments_lengths",
                              "dense_mask_keys", "document_mask", "dense_mask"})
TCGEN05_FORWARD_ONLY = frozenset({"dense_bias", "dense_bias_f32", "dense_bias_keys", "dense_bias_rows",
                                  "dense_mask_head_keys"})
TCGEN05_HEAD_DIMS = (64, 128)
MOSAIC_HEAD_DIMS = (64, 128, 256)  # the Mosaic GPU forward's
MOSAIC_BACKWARD_HEAD_DIMS = (64, 128, 256)  # the Mosaic dQ / dK/dV kernels' (at 256: dK and dV split)
MOSAIC_TANGENT_HEAD_DIMS = (64, 128, 256)  # the Mosaic tangent kernel's (at 256: in pieces, or split)
# Features the Mosaic GPU forward lacks (Triton runs them; float32 inputs too): hooks gathering a captured array other
# than at q_idx / kv_idx (a relative-bias table). It takes segment ids, dense masks, dropout, a dense bias with its
# gradient (not float32 tiles of it beside head dim 256: over the shared memory), v's own head dim, k / v of batch 1.
MOSAIC_LACKS = frozenset({"relative_bias"})
# The Mosaic tangent takes the tangents of a score_mod's arrays read one element at a time (ALiBi's slopes), and a
# bias's read as the bias is at every head dim (`mosaic_tangent_kernels`: at 256 d out's pieces of 64 beside tiles).
FLEX_HOOKS = ("softcap", "alibi", "document_mask", "sliding_window", "softcap_sliding_window", "relative_bias")
SCORE_MOD_HOOKS = frozenset({"softcap", "alibi", "softcap_sliding_window", "relative_bias"})  # FLEX_HOOKS' score_mods
# At head dim 256 the Mosaic backward takes hooks and block tables (with a score_mod, dK in pieces of 64 columns) but
# not bias tiles (their ring and float32 dS staging overflow the one-slot kernels): Triton's.
MOSAIC_WIDE_BACKWARD_LACKS = frozenset({"dense_bias", "dense_bias_f32"})


def required_kernels(backend: str, dtype: str, head_dim: int, mode: str, feature: str,
                     value_dim: int | None = None, target: str | None = None) -> tuple[str, ...]:
    """The Pallas kernels a call compiles to on `target` (None: a Hopper or pre-Hopper one), by the dispatch rules:
    backend "triton" (what `auto` and a default FlashConfig pick on every GPU) runs Triton's; "mosaic" on Hopper
    runs the Mosaic GPU forward on 16-bit inputs where q / k's and v's head dims (`value_dim`; "dv64": 64; padded
    to a power of 2, and those under 64 to 64) are 64 / 128 / 256 without a feature of `MOSAIC_LACKS` (nor a
    float32 bias at 256), its dQ / dK/dV (at 256 dQ, dK and dV, dQ and dK in pieces where q / k's head dim is 256,
    dK's of 64 columns with a score_mod; without a feature of `MOSAIC_WIDE_BACKWARD_LACKS`), its tangent
    (`mosaic_tangent_kernels`: at 256 with every feature, d out in 64-column pieces with a score_mod, dropout or
    bias tiles, a score_mod's moving arrays in q's programs); on Blackwell the
    tcgen05 forward and backward for the families of `TCGEN05_FAMILIES` at head dims 64 / 128, the tcgen05 forward
    alone for those of `TCGEN05_FORWARD_ONLY`; tangent Triton."""
    def padded(d):  # to a power of 2, and to 64 at least for the Mosaic kernels (`mosaic.glue.kernel_head_dims`)
        return max(64, 1 << (d - 1).bit_length())

    padded_dims = padded(head_dim), padded(value_dim or {"dv64": 64}.get(feature, head_dim))
    dims = set(padded_dims)
    if backend == "mosaic" and target in BLACKWELL:
        takes = dtype != "f32" and dims <= set(TCGEN05_HEAD_DIMS)
        forward = MOSAIC_FORWARD_TCGEN05 if takes and feature in TCGEN05_FAMILIES | TCGEN05_FORWARD_ONLY else FORWARD
        backward = (MOSAIC_DQ_TCGEN05, MOSAIC_DKV_TCGEN05) if takes and feature in TCGEN05_FAMILIES else (DQ, DKV)
        return (forward,) if mode == "fwd" else (forward, TANGENT) if mode == "jvp" else (forward, *backward)
    mosaic = (backend == "mosaic" and dtype != "f32" and dims <= set(MOSAIC_HEAD_DIMS) and feature not in MOSAIC_LACKS
              and not (feature == "dense_bias_f32" and max(dims) > 128))  # over the shared memory
    forward = MOSAIC_FORWARD if mosaic else FORWARD
    wide = max(dims) > 128
    mosaic_backward = (mosaic and dims <= set(MOSAIC_BACKWARD_HEAD_DIMS)  # a dense bias's gradient too
                       and not (wide and feature in MOSAIC_WIDE_BACKWARD_LACKS))
    narrow = SCORE_MOD_HOOKS | {"dense_bias", "dense_bias_f32"} | ({"dropout"} if mode == "jvp" else set())
    width = 64 if wide and feature in narrow else 128  # of the pieces of d out and dK
    if mode in ("fwd", "jvp"):
        bias = feature.startswith("dense_bias")
        mosaic_tangent = mosaic and dims <= set(MOSAIC_TANGENT_HEAD_DIMS)  # at 256 hooks, dropout, bias tiles too
        tiles = feature in ("dense_bias", "dense_bias_f32")
        return (forward,) if mode == "fwd" else (forward, *(mosaic_tangent_kernels(*padded_dims, bias, tiles, width)
                                                           if mosaic_tangent else (TANGENT,)))
    if not mosaic_backward:
        return (forward, DQ, DKV)
    dq = MOSAIC_DQ_PIECES if padded(head_dim) > 128 else (MOSAIC_DQ,)  # q / k's head dim 256: dQ and dK in pieces
    dk = piece_names(MOSAIC_DK, max(1, padded_dims[0] // width))
    return (forward, *dq, *((*dk, MOSAIC_DV) if wide else (MOSAIC_DKV,)))


def mosaic_tangent_kernels(head_dim: int, value_dim: int, bias: bool = False, tiles: bool = False,
                           width: int = 128) -> tuple[str, ...]:
    """The Mosaic tangent's programs at (padded) head dims: d out's pieces of `width` columns where v's head dim is
    wider (64 with a score_mod, dropout or bias tiles at head dim 256), the tangents of q, k, v and a `bias` apart
    where q / k's is 256 or a bias's `tiles` sit beside v's 128 or more; else one."""
    split = head_dim > 128 or (tiles and value_dim >= 128)
    groups = ("_dq", "_dk", "_dv", *(("_dbias",) if bias else ())) if split else ("",)
    pieces = piece_names(MOSAIC_TANGENT, max(1, value_dim // width))
    return tuple(piece.replace(MOSAIC_TANGENT, MOSAIC_TANGENT + group) for group in groups for piece in pieces)


def requires_for(variant: Variant, target: str) -> tuple[str, ...]:
    """The kernels the compile of `variant` on `target` must hold (backend "mosaic" runs Blackwell's kernels on
    `BLACKWELL`: `Variant.requires_on`)."""
    return dict(variant.requires_on).get(target, variant.requires)


def _flash_options(feature: str) -> dict:
    """`flash` keyword arguments of a feature of the grid."""
    return {
        "full": {}, "causal": dict(causal=True), "window": dict(window=(256, 0)),
        "gqa8to2_causal": dict(kv_heads=2, causal=True), "dv64": dict(value_dim=64),
        "dropout": dict(dropout_rate=0.1, dropout_seed=7), "segments_lengths": dict(segments=True, lengths=True),
        "dense_bias": dict(bias="same"), "dense_bias_f32": dict(bias="f32"), "dense_mask": dict(mask=True),
    }[feature]


def _call(backend: str, dtype: str, head_dim: int, mode: str, feature: str, **extra) -> Variant:
    """One variant of the grid, named `{flash|flex|mosaic|mosaic_flex}_{grad|jvp|fwd}_d{D}_{dtype}_{feature}`
    (plus `extra`'s suffix), its required kernels from `required_kernels`."""
    hook = feature in FLEX_HOOKS
    prefix = ("mosaic_" if backend == "mosaic" else "") + ("flex" if hook else "flash")
    prefix = "mosaic" if prefix == "mosaic_flash" else prefix
    name = f"{prefix}_{'grad' if mode == 'fwd+bwd' else mode}_d{head_dim}_{dtype}_{feature}" + extra.pop("suffix", "")
    requires = required_kernels(backend, dtype, head_dim, mode, feature)
    targets = HOPPER if backend == "mosaic" else FULL_TARGETS
    if hook:
        return flex(name, feature, head_dim=head_dim, dtype=dtype, mode=mode, backend=backend, requires=requires,
                    targets=targets, **extra)
    return flash(name, head_dim=head_dim, dtype=dtype, mode=mode, backend=backend, requires=requires,
                 targets=targets, **_flash_options(feature), **extra)


# The calls of the grid that still spill (or, one, exceed sm_86's shared memory) on `default_config`'s tiles
# and have no per-call rule yet (`triton.retile`): left out of the registry until they do, each with the
# kernels and figures of its last compile (ptxas 12.9.86, spill store bytes), so that the gap is one list here
# and not a silent one. docs/perf-notes.md (Version 7c) has the candidates tried. tests/test_compile_report.py
# checks that the registry holds every other call of the product.
NOT_YET_CLEAN: dict[str, str] = {}


def _grid_variants() -> list[Variant]:
    """Every call a user reaches through `auto` / a default config (backend "triton" on a GPU) and through
    backend "mosaic" (Hopper), as the product of what changes the compiled kernels:

    - dtype: bfloat16 and float32 (which has tiles of its own: FMA dots at Precision.HIGHEST); float16
      shares bfloat16's tiles and kernels and is compiled once per backend;
    - head dim 64 / 128 / 256 (the tiles change with it), in fwd+bwd (the forward kernel of a forward-only
      call is the fwd+bwd one: it always writes the lse) and in jvp (the forward and the tangent kernel);
    - full and causal, and each feature that changes a kernel's code: a window, GQA, Dv != D, dropout, segment
      ids with lengths, a dense bias with a gradient and a tangent (of the inputs' dtype, and float32 with
      16-bit inputs: a bias keeps its dtype in the kernels), a dense mask, the flex hooks (a soft cap, ALiBi, a
      document mask and a sliding window as BlockMasks, a soft cap on that BlockMask, a relative-bias table
      with a gradient and a tangent), at every head dim and in both modes (the per-call rules of
      `triton.retile` and `triton.tangent.tangent_tiles` depend on the head dim and the features), but for
      the calls of `NOT_YET_CLEAN`;
    - on backend "mosaic" the same grid for 16-bit inputs: what the Mosaic GPU kernels lack (`MOSAIC_LACKS`)
      falls back to Triton there, at the tiles `default_config` picks for that backend (the Mosaic forward's
      128 x 128), and the tangent kernel's tiles derive from those, so each is compiled as such. float32 on
      backend "mosaic" falls back as a whole, at the float32 Triton tiles of backend "triton"
      (tests/test_compile_report.py checks that they are the same): it is compiled at the base shapes (every
      head dim, full and causal, jvp at 128) rather than the whole float32 feature grid again.
    """
    out = []
    for backend in ("triton", "mosaic"):
        for dtype in ("bf16", "f32"):
            if backend == "mosaic" and dtype == "f32":
                out += [_call(backend, dtype, d, "fwd+bwd", feature) for d in (64, 128, 256)
                        for feature in ("full", "causal")]
                out.append(_call(backend, dtype, 128, "jvp", "causal"))
                continue
            biases = ("dense_bias",) if dtype == "f32" else ("dense_bias", "dense_bias_f32")
            features = ("full", "causal", "window", "gqa8to2_causal", "dv64", "dropout", "segments_lengths",
                        *biases, "dense_mask", *FLEX_HOOKS)
            for d in (64, 128, 256):
                for mode in ("fwd+bwd", "jvp"):
                    for feature in features:
                        variant = _call(backend, dtype, d, mode, feature)
                        # Dv 64 at head dim 64 is the plain call.
                        if not (feature == "dv64" and d == 64) and variant.name not in NOT_YET_CLEAN:
                            out.append(variant)
    for feature in ("dense_bias_f32", "dense_mask"):
        out.append(_call("triton", "bf16", 128, "fwd+bwd", feature, kv_heads=2, causal=True,
                         suffix="_gqa8to2_causal"))
    out.append(_call("triton", "f16", 64, "fwd+bwd", "causal"))
    out.append(_call("mosaic", "f16", 128, "fwd+bwd", "causal"))
    # Ragged tails (the padded tail changes the kernel) and the short 77, whose tiles shrink to the sequence.
    out.append(_call("triton", "bf16", 128, "fwd", "causal", q_len=600, suffix="_T600"))
    out.append(_call("triton", "bf16", 64, "fwd", "full", q_len=1500, suffix="_T1500"))
    out.append(_call("triton", "bf16", 128, "fwd+bwd", "causal", q_len=3000, suffix="_T3000"))
    out.append(_call("triton", "bf16", 64, "fwd+bwd", "causal", q_len=77, suffix="_T77"))
    return out


def _control_variants() -> list[Variant]:
    """seq 8192, the seed benchmark's longest, beside the peers at the same shape (hd 64 / 128, full and
    causal): the tiles are seq 1024's, the register figures may differ a little (ptxas schedules the longer
    loop differently)."""
    return [_call("triton", "bf16", d, "fwd+bwd", feature, q_len=8192, suffix="_T8192", group="control")
            for d in (64, 128) for feature in ("full", "causal")]


def _decode_variants() -> list[Variant]:
    """The decode kernel's seed calls (`decode_space.SEEDS`: a dense cache, GQA 8 -> 2, hd 64 / 128 / 256; paged
    caches at the serving shapes of the decode benchmark; a dense cache with a masked tail and lanes, S = 1000,
    head dim 80), at its own default tiles; plan_space.py adds the calls around them whose decode plans differ
    (`decode_space.derive`). The kernels are imported when a variant is built: an import that fails is a
    failing row of the report, never a shorter registry."""
    import decode_space

    return [probe.variant() for probe in decode_space.SEEDS]


def _ragged_variants() -> list[Variant]:
    """`ragged_paged_attention` through its public front-end with `RaggedConfig(backend="triton")` at a serving
    step's packed batch (serving_step.py: 256 new tokens over 16 sequences of up to 2048 keys, GQA 32:8, head
    dim 128): the seed calls of `ragged_space.SEEDS` (bf16 pages of 16 and 64 keys, a sliding window with a soft
    cap and sinks, int8 pages with the append of the step's keys and values, float8_e4m3fn pages, an ALiBi
    score_mod with a window mask_mod; default block_q, 16 tokens x 4 heads), where plan_space.py adds the calls
    around them whose plans differ (`ragged_space.derive`); and the LM example's serving step."""
    import ragged_space

    # Triton casts float8 from sm_89 on; before, the dispatch takes the XLA path with a warning.
    out = [probe.variant(HOPPER if probe.pages == "fp8" else FULL_TARGETS) for probe in ragged_space.SEEDS]
    # The LM example's continuous-batching step (scripts/compile/serving_step.py): 8 layers, 8 ragged calls.
    return out + [Variant("lm_serving_step_bench_hd128_int8_t256", "decode", lambda: serving_step("triton"),
                          HEAD_DIM, "bf16", "fwd", "triton", TOKENS, CONTEXT, requires=(RAGGED,))]


def _peer_variants() -> list[Variant]:
    """Peers compiled the same way at the seed's shapes (B=4, N=8, seq 1024 and 8192, head dim 64 / 128, full
    and causal, forward + backward): JAX's own Pallas Triton attention (`jax.experimental.pallas.ops.gpu.
    attention.mha`, bf16, its default block sizes) on every target, and JAX's Pallas Mosaic GPU attention
    (`attention_mgpu`, Hopper only, f16: its backward stages float16 scratch, bf16 inputs fail to compile)
    with block_q 64 and block_kv 128 (one point of the sweep its own benchmark runs), 64 x 64 backward tiles,
    2 stages. Its causal variant refuses CUDA 12.8.0-12.9.1 (a ptxas miscompilation), which the pinned ptxas
    12.9.86 is: the report shows that refusal. Peers are compiled and shown, not held to our checks."""
    out = []
    for seq in (1024, 8192):
        suffix = "" if seq == 1024 else f"_T{seq}"
        for d in (64, 128):
            for causal in (False, True):
                tag = f"d{d}_{{}}_{'causal' if causal else 'full'}{suffix}"

                def mha(d=d, causal=causal, seq=seq):
                    import warnings

                    import jax.numpy as jnp

                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", DeprecationWarning)
                        from jax.experimental.pallas.ops.gpu import attention

                    def attend(q, k, v):
                        return attention.mha(q, k, v, None, sm_scale=d ** -0.5, causal=causal)

                    return _wrap("fwd+bwd", attend, 3, (0, 1, 2)), [_spec((B, seq, N, d), jnp.bfloat16)] * 3

                def mgpu(d=d, causal=causal, seq=seq):
                    import jax.numpy as jnp
                    from jax.experimental.pallas.ops.gpu import attention_mgpu

                    config = attention_mgpu.TuningConfig(
                        block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal, block_q_dkv=64,
                        block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

                    def attend(q, k, v):
                        return attention_mgpu.attention(q, k, v, config)

                    return _wrap("fwd+bwd", attend, 3, (0, 1, 2)), [_spec((B, seq, N, d), jnp.float16)] * 3

                out.append(Variant(f"jax_pallas_mha_grad_{tag.format('bf16')}", "peer", mha, d, "bf16", "fwd+bwd",
                                   "triton", seq, seq))
                out.append(Variant(f"jax_mosaic_attention_grad_{tag.format('f16')}", "peer", mgpu, d, "f16",
                                   "fwd+bwd", "mosaic", seq, seq, targets=HOPPER))
    return out


def _tokamax_peer_variants() -> list[Variant]:
    """tokamax (`tokamax.dot_product_attention`, installed in the toolchain's peers/ where it installs) at
    its default configs, with implementation "triton" (the full targets and sm_100a) and "mosaic" (its Mosaic
    GPU kernels, on `SIDE_TARGETS`), bf16, causal, fwd+bwd, at the seed's shapes (seq 1024 / 8192, hd 64 / 128).
    Its benchmarking module imports xprof's command-line tools, which import a module the PyPI build of xprof
    does not ship; the compile never benchmarks, so that one import is stubbed."""
    out = []
    for implementation, targets in (("triton", FULL_TARGETS + ("sm100a_b200",)), ("mosaic", SIDE_TARGETS)):
        for seq in (1024, 8192):
            for d in (64, 128):
                def build(d=d, seq=seq, implementation=implementation):
                    import sys
                    import types

                    import jax.numpy as jnp

                    stub = types.ModuleType("xprof.cli.tools")
                    stub.get_kernel_stats_tool = None
                    sys.modules.setdefault("xprof.cli.tools", stub)
                    import tokamax

                    def attend(q, k, v):
                        return tokamax.dot_product_attention(q, k, v, is_causal=True,
                                                             implementation=implementation)

                    return _wrap("fwd+bwd", attend, 3, (0, 1, 2)), [_spec((B, seq, N, d), jnp.bfloat16)] * 3

                suffix = "" if seq == 1024 else f"_T{seq}"
                out.append(Variant(f"tokamax_{implementation}_grad_d{d}_bf16_causal{suffix}", "peer", build, d,
                                   "bf16", "fwd+bwd", implementation, seq, seq, targets=targets))
    return out


SIDE_TARGETS = ("sm90a_h100", "sm100a_b200")  # where our programs and tokamax's are compared whole


def _side_by_side_variants() -> list[Variant]:
    """Our calls at the shapes of the tokamax peers (bf16, causal, fwd+bwd, seq 1024 / 8192, head dim 64 / 128),
    each compiled alone as tokamax's are (the grid compiles a call beside its jvp, as one program), so that the
    whole program's HBM and XLA-side bytes compare (`worker._program_figures`, the page's side-by-side table):
    backend "triton" on `SIDE_TARGETS`, backend "mosaic" on Hopper and Blackwell (its tcgen05 kernels there)."""
    out = []
    for backend, targets in (("triton", SIDE_TARGETS), ("mosaic", HOPPER + BLACKWELL)):
        for seq in (1024, 8192):
            for d in (64, 128):
                call = _call(backend, "bf16", d, "fwd+bwd", "causal", q_len=seq, suffix="" if seq == 1024 else f"_T{seq}",
                             group=backend)
                own = tuple((t, required_kernels(backend, "bf16", d, "fwd+bwd", "causal", target=t))
                            for t in targets if backend == "mosaic" and t in BLACKWELL)
                out.append(dataclasses.replace(call, name=f"side_{call.name}", targets=targets, requires_on=own))
    return out


# The subset compiled for `SUBSET_TARGETS`: every family whose tiles or code differ, once. bfloat16: each feature
# of the grid in fwd+bwd at head dim 64 / 128 / 256, and the jvp (the tangent kernel's tiles) of the plain causal
# call and of those whose tangent has rules of its own (a dense bias, a relative-bias table, a BlockMask with a
# soft cap, dropout); float32 (FMA dots, tiles of their own): full and causal, the features its retile rules
# name (a window, GQA, a dense mask, a BlockMask) and the causal jvp, at each head dim; float16 once; the ragged
# tails and short sequence; the seq 8192 causal controls; every decode and ragged variant. No Mosaic variant:
# its kernels target Hopper alone (backend "mosaic" refuses these GPUs). No peer.
SUBSET_BF16_JVP = ("causal", "dense_bias", "relative_bias", "softcap_sliding_window", "dropout")
SUBSET_F32 = ("full", "causal", "window", "gqa8to2_causal", "dense_mask", "document_mask")


def _whole_row(v: Variant) -> bool:
    """Whether variant `v` is compiled on `WHOLE_TARGETS` beside the full targets: the Triton grid, decode and
    control rows (not backend "mosaic", whose Blackwell rows come from its plans, nor a peer or the LM's)."""
    return v.backend != "mosaic" and v.group in ("triton", "decode", "control")


def _subset_targets(v: Variant) -> tuple[str, ...]:
    """The subset targets variant `v` is compiled on beside its own."""
    return tuple(t for t in SUBSET_TARGETS if t not in v.targets
                 and (_on_subset_targets(v) or (t in WHOLE_TARGETS and _whole_row(v))))


def _on_subset_targets(v: Variant) -> bool:
    """Whether variant `v` is compiled for `SUBSET_TARGETS` too (see above)."""
    if v.group == "peer" or v.backend == "mosaic":
        return False
    if v.group == "decode":
        return True
    if v.group == "control":
        return v.name.endswith("_causal_T8192")
    match = re.fullmatch(r"(?:flash|flex)_(grad|jvp)_d(\d+)_(bf16|f16|f32)_(\w+?)(_T\d+|_gqa8to2_causal)?", v.name)
    if match is None:
        return False
    mode, _, dtype, feature, suffix = match.groups()
    if suffix or dtype == "f16":
        return True
    if dtype == "bf16":
        return mode == "grad" or feature in SUBSET_BF16_JVP
    return feature in SUBSET_F32 and (mode == "grad" or feature == "causal")


def variants() -> list[Variant]:
    """Every variant of the registry; names are unique: the grid and the families above, then the rows the
    dispatch's plans add (`plan_space.planned_rows`)."""
    import lm_programs

    out = (_grid_variants() + _control_variants() + _decode_variants() + _ragged_variants() + _peer_variants()
           + _tokamax_peer_variants() + _side_by_side_variants() + lm_programs.registry_variants())
    out = [dataclasses.replace(v, targets=v.targets + _subset_targets(v)) for v in out]
    import plan_space

    out = plan_space.planned_rows(out)
    names = [v.name for v in out]
    assert len(names) == len(set(names)), "variant names must be unique"
    return out
