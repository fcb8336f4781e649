"""The TPU variants the compile report compiles (scripts/compile/tpu_report.py): every Mosaic TPU kernel build
that `auto` (a TPU device's default backend, "tpu") or a default `FlashConfig` can pick, each with the path
the TPU dispatch (`probjax_kernels.tpu.vet.unsupported`, through `_dispatch.plan`) takes for it:
"kernel" (the Mosaic TPU kernels: one `tpu_custom_call` per kernel) or "fallback" (the XLA path, with a
warning; no `tpu_custom_call`). The gate holds every generation's compile to that expectation.

Like the GPU report (scripts/compile/variants.py), VMEM depends on the static configuration (tiles, head dim,
dtype, features), not on the batch, heads or length beyond the tiles, so B=4, N=8 (K=2 for GQA), seq 1024 per
configuration; `hbm` variants compile fwd+bwd at T and 2T for the HBM growth check; `peer` variants compile
JAX's own TPU attention kernels (and tokamax's, when it is installed) at the same shapes, shown, not gated.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import variants as gpu_variants
from serving_step import CONTEXT, HEAD_DIM, KV_HEADS as RAGGED_KV_HEADS, ragged_call, ragged_specs, serving_step

B, N, KV_HEADS = 4, 8, 2
# target -> the topology whose first chip the report compiles for (`jax.experimental.topologies`)
TOPOLOGIES = {"tpu_v5e": "v5e:2x2", "tpu_v5p": "v5p:2x2x1", "tpu_v6e": "v6e:2x2", "tpu_7x": "tpu7x:2x2x1",
              "tpu_v4": "v4:2x2x1"}
TARGETS = ("tpu_v5e", "tpu_v5p", "tpu_v6e", "tpu_7x", "tpu_v4")
# target -> its generation in `probjax_kernels.tpu.chips.CHIPS`, whose figures the gate checks VMEM against
# (`tpu_check.vmem_limits`): the limit the kernels plan with and ask for is the one they are held to.
CHIP_OF = {"tpu_v5e": "v5e", "tpu_v5p": "v5p", "tpu_v6e": "v6e", "tpu_7x": "tpu7x", "tpu_v4": "v4"}
VMEM_CAPACITY = {"tpu_v5e": 128 << 20, "tpu_v5p": 64 << 20, "tpu_v6e": 128 << 20, "tpu_7x": 64 << 20,
                 "tpu_v4": 16 << 20}

FORWARD, DQ, DKV, TANGENT = ("probjax_tpu_forward", "probjax_tpu_backward_dq", "probjax_tpu_backward_dkv",
                             "probjax_tpu_tangent")
FUSED = "probjax_tpu_backward_fused"
DECODE = "probjax_tpu_decode_attention"
RAGGED = "probjax_tpu_ragged_paged_attention"
# The kernels each mode runs when the dispatch takes the call (a jvp runs the forward for the primal output).
KERNELS_OF_MODE = {"fwd": (FORWARD,), "fwd+bwd": (FORWARD, DQ, DKV), "jvp": (FORWARD, TANGENT),
                   "decode": (DECODE,), "ragged": (RAGGED,)}


@dataclasses.dataclass(frozen=True)
class TpuVariant:
    """One compile: `build()` returns (function, argument ShapeDtypeStructs without sharding).

    `path`: "kernel" or "fallback" (what the dispatch must pick; None for peers); `why`: for a fallback,
    what the kernels lack; `features`: for a peer, what it takes."""

    name: str
    group: str  # "tpu" | "flex" | "hbm" | "peer"
    build: Callable[[], tuple[Callable, list]]
    head_dim: int
    dtype: str
    mode: str
    q_len: int = 1024
    path: str | None = "kernel"
    why: str = ""
    features: str = ""
    compiler_options: tuple[tuple[str, bool], ...] = ()  # XLA:TPU options of the compile (`HBM_ONLY`)
    tiles: dict | None = None  # FlashConfig fields set explicitly (the alternatives); None: default_config's
    fusable: bool = True  # a backward the fused kernel takes (`fused_backward.fusable`): no bias gradient

    def required_kernels(self, target: str) -> tuple[str, ...]:
        """The kernels the dispatch runs for this variant on `target`: the mode's, with the fused backward
        for the dQ and dK/dV kernels where the config (the variant's, else the tile model's default for the
        generation, `probjax_kernels.tpu.plan`) asks for it and the call is fusable."""
        if self.path != "kernel":
            return ()
        kernels = KERNELS_OF_MODE[self.mode]
        if self.mode == "fwd+bwd" and self.fusable and fused_backward(self, target):
            kernels = (FORWARD, FUSED)
        return kernels


def fused_backward(variant: TpuVariant, target: str) -> bool:
    """Whether a fwd+bwd variant's config asks for the fused backward on `target`."""
    explicit = (variant.tiles or {}).get("fused_backward")
    if explicit is not None:
        return explicit
    from probjax_kernels.tpu import plan

    return plan.default_fused_backward(CHIP_OF[target], variant.head_dim)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _from_gpu(variant, group: str, path: str = "kernel", why: str = "") -> TpuVariant:
    """A `variants.flash` / `variants.flex` build (backend "tpu") as a TPU variant."""
    return TpuVariant(variant.name, group, variant.build, variant.head_dim, variant.dtype, variant.mode,
                      variant.q_len, path, why, tiles=variant.tiles)


def flash(name, group="tpu", **options) -> TpuVariant:
    return _from_gpu(gpu_variants.flash(name, backend="tpu", **options), group)


def flash_bias(name, *, head_dim=128, dtype="bf16", q_len=1024, shape="heads", group="tpu",
               causal=False) -> TpuVariant:
    """fwd+bwd with a dense additive bias that gets a gradient (an argument, not a constant), of `shape`
    "heads" `[1, N, T, S]`, "keys" `[B, 1, 1, S]` (key padding: its gradient summed by the dK/dV kernel) or
    "queries" `[1, N, T, 1]` (summed by the dQ kernel)."""
    from probjax_kernels import FlashConfig, flash_attention

    dt = gpu_variants.dtype_of(dtype)
    bias_shape = {"heads": (1, N, q_len, q_len), "keys": (B, 1, 1, q_len), "queries": (1, N, q_len, 1)}[shape]

    def build():
        specs = [_spec((B, q_len, N, head_dim), dt)] * 3 + [_spec(bias_shape, jnp.float32)]

        def attend(q, k, v, bias):
            return flash_attention(q, k, v, bias=bias, causal=causal, config=FlashConfig(backend="tpu"))

        return gpu_variants._wrap("fwd+bwd", attend, 4, (0, 1, 2, 3)), specs

    return TpuVariant(name, group, build, head_dim, dtype, "fwd+bwd", q_len, fusable=False)


def flex_chunk(name, *, head_dim=128, dtype="bf16", q_len=1024, kv_len=2048) -> TpuVariant:
    """fwd+bwd of chunked prefill over packed documents: the second half of the query blocks of a causal
    document mask over `kv_len` tokens (`block_mask[:, :, i:j]`), q `[B, q_len, N, D]` against all keys."""

    def build():
        from probjax_kernels import FlashConfig, and_masks, causal_mask, create_block_mask, document_mask, \
            flex_attention

        dt = gpu_variants.dtype_of(dtype)
        specs = [_spec((B, q_len, N, head_dim), dt)] + [_spec((B, kv_len, N, head_dim), dt)] * 2

        def attend(q, k, v):
            ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), kv_len // 4)[None].repeat(B, 0)
            whole = create_block_mask(and_masks(causal_mask, document_mask(ids)), B, N, kv_len, kv_len)
            first = (kv_len - q_len) // whole.block_size[0]
            chunk = whole[:, :, first:first + q_len // whole.block_size[0]]
            return flex_attention(q, k, v, block_mask=chunk, config=FlashConfig(backend="tpu"))

        return gpu_variants._wrap("fwd+bwd", attend, 3, (0, 1, 2)), specs

    return TpuVariant(name, "flex", build, head_dim, dtype, "fwd+bwd", q_len)


# The flex hooks whose captured arrays the kernels read as vectors (a gather, which Mosaic TPU cannot lower):
# the dispatch sends those calls to the XLA path (`probjax_kernels.tpu.vet`). The document mask's
# `doc[b, q_idx] == doc[b, kv_idx]` reads its ids along q_idx / kv_idx exactly: VMEM tiles, in the kernels.
FLEX_FALLBACK = {
    "relative_bias": "`table[h, q_idx - kv_idx]` reads the captured table along the indices (a vector gather)",
}


def tpu_variants() -> list[TpuVariant]:
    """The gated variants: dtype bf16 / f32 x head dim 64 / 128 / 256 x causal / full, a jvp per dtype,
    then window, GQA 8:2, ragged lengths with segments, a dense bias, dropout, float16 (run as float32), the
    five flex hooks, a BlockMask coarser than the tiles, one finer than them, a sliced one (chunked prefill),
    the tile alternatives, the fused and two-kernel backward, and the HBM chains."""
    out = []
    for dtype in ("bf16", "f32"):
        for d in (64, 128, 256):
            for causal in (False, True):
                if dtype == "f32" and causal and d != 128:
                    continue  # float32 causal at head dim 128 only: its tiles do not change with the mask
                tag = f"d{d}_{dtype}_{'causal' if causal else 'full'}"
                out.append(flash(f"tpu_grad_{tag}", head_dim=d, dtype=dtype, causal=causal, mode="fwd+bwd"))
        out.append(flash(f"tpu_jvp_d128_{dtype}_causal", dtype=dtype, causal=True, mode="jvp"))
    out.append(flash("tpu_fwd_d128_bf16_causal", causal=True))
    out.append(flash("tpu_grad_d128_bf16_window", window=(256, 0), mode="fwd+bwd"))
    out.append(flash("tpu_grad_d128_gqa8to2_bf16_causal", kv_heads=KV_HEADS, causal=True, mode="fwd+bwd"))
    out.append(flash("tpu_grad_d128_bf16_segments_lengths_T600", q_len=600, segments=True, lengths=True,
                     mode="fwd+bwd"))
    out.append(flash_bias("tpu_grad_d128_bf16_bias"))
    out.append(flash_bias("tpu_grad_d128_bf16_bias_keys", shape="keys"))
    out.append(flash_bias("tpu_grad_d128_bf16_bias_queries", shape="queries"))
    out.append(flash("tpu_grad_d128_bf16_dropout", dropout_rate=0.1, dropout_seed=7, mode="fwd+bwd"))
    out.append(flash("tpu_grad_d128_f16_causal", dtype="f16", causal=True, mode="fwd+bwd"))
    for hook in ("softcap", "alibi", "document_mask", "sliding_window", "relative_bias"):
        # The XLA fallback's compile of seq 1024 takes 0.5-2 min per generation (the relative-bias gather):
        # the fallbacks compile at seq 256, which shows the same path (no tpu_custom_call) in seconds.
        fallback = hook in FLEX_FALLBACK
        base = gpu_variants.flex(f"tpu_flex_grad_d128_bf16_{hook}" + ("_T256" if fallback else ""), hook,
                                 backend="tpu", q_len=256 if fallback else 1024)
        out.append(_from_gpu(base, "flex", "fallback" if fallback else "kernel",
                             FLEX_FALLBACK.get(hook, "")))
    # A BlockMask of 512 x 512 blocks: coarser than every generation's dQ or dK/dV tile, so each kernel walks
    # the mask's tables refined onto its own tile (`tpu.plan._tables`).
    out.append(_from_gpu(gpu_variants.flex("tpu_flex_grad_d128_bf16_sliding_window_block512", "sliding_window",
                                           backend="tpu", block=512), "flex"))
    # Blocks finer than every tile (64 x 64): the generation's tiles stay, each kernel walking the tables
    # coarsened onto its tile (`_table_tiles.tables_on_tiles`); and a document mask sliced by query block
    # (chunked prefill), whose mask_mod reads the ids shifted to the chunk as tiles (`flex.shifted_queries`).
    out.append(_from_gpu(gpu_variants.flex("tpu_flex_grad_d128_bf16_document_mask_block64", "document_mask",
                                           backend="tpu", block=64), "flex"))
    out.append(flex_chunk("tpu_flex_grad_d128_bf16_document_mask_chunk_T1024_S2048"))
    out += tile_variants() + backward_variants()
    for t in HBM_LENGTHS:
        out.append(dataclasses.replace(
            flash(f"tpu_hbm_grad_d128_bf16_causal_T{t}", group="hbm", causal=True, q_len=t, mode="fwd+bwd"),
            compiler_options=HBM_ONLY))
        out.append(dataclasses.replace(  # a key padding bias with its gradient
            flash_bias(f"tpu_hbm_grad_d128_bf16_causal_bias_keys_T{t}", group="hbm", causal=True, q_len=t,
                       shape="keys"), compiler_options=HBM_ONLY))
    return out


# The tiles before the tile model picked them (kernels/tpu/plan.py until 2026-12-05): 128-wide MXUs took
# 256-row steps, 256-wide ones 512; compiled beside the model's picks as an alternative.
HAND_TILES = {"v5e": (256, 512, 256, 256, 256, 256), "v6e": (512, 512, 512, 256, 256, 512)}
TILE_FIELDS = ("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv")
TILES_LEN = 8192


def tile_sets() -> dict[str, tuple[int, ...]]:
    """name -> (forward q, forward k, dQ q, dQ k, dK/dV q, dK/dV k) of the tile alternatives: every
    generation's pick of the tile model (`probjax_kernels.tpu.tile_model`) and the hand tables before it."""
    from probjax_kernels.tpu import tile_model

    out = {}
    for label, tiles in [*(("model_" + n, t) for n, t in tile_model.chosen_tiles().items()),
                         *(("hand_" + n, t) for n, t in HAND_TILES.items())]:
        if tiles not in out.values():
            out[label] = tiles
    return out


def tile_variants() -> list[TpuVariant]:
    """fwd+bwd of the seed program (bf16, head dim 128, causal, T = 8192) on every tile alternative, on every
    generation: the compile figures beside the tile model's time (docs/compile/tpu.md, "Tile alternatives").
    XLA's placement of whole buffers in VMEM is off (`HBM_ONLY`), so a kernel's scoped VMEM is its own (with
    it on, v5e counted XLA's buffers beside the v6e tiles' kernels: 69-84 MiB)."""
    return [dataclasses.replace(flash(f"tpu_tiles_{label}_T{TILES_LEN}", causal=True, q_len=TILES_LEN,
                                      mode="fwd+bwd", tiles=dict(zip(TILE_FIELDS, tiles))),
                                compiler_options=HBM_ONLY) for label, tiles in tile_sets().items()]


def backward_variants() -> list[TpuVariant]:
    """fwd+bwd of the seed program (bf16, head dim 128, causal, T = 8192; MHA and GQA 8:2) with the backward
    fused into one kernel and as the dQ and dK/dV kernels, on every generation, whichever the tile model makes
    the default there (docs/compile/tpu.md, "Backward: fused or two kernels")."""
    return [flash(f"tpu_backward_{'fused' if fused else 'two'}_d128{'_gqa8to2' if kv_heads != N else ''}_bf16_"
                  f"causal_T{TILES_LEN}", kv_heads=kv_heads, causal=True, q_len=TILES_LEN, mode="fwd+bwd",
                  tiles=dict(fused_backward=fused)) for fused in (True, False) for kv_heads in (N, KV_HEADS)]


# fwd+bwd HBM temp must grow at most linearly (no T x S buffer) along these chains of doublings (`hbm_chain`):
# causal attention, and the same with a key padding bias `[B, 1, 1, S]` and its gradient.
HBM_LENGTHS = (2048, 4096, 8192, 16384)
# The chain compiles with XLA:TPU's memory-space assignment into VMEM off, so its HBM temp counts every
# buffer the program holds: with it on, XLA moves whole buffers of up to 64 MiB (our residual `out`, the
# materialised cotangent) into a v5e's 128 MiB of VMEM when they fit and not at 2T, which reads 0 MiB at
# T = 4096 and 4x from 8192 to 16384 for a program whose buffers all double. The flags are per generation
# family ("vf": v5e / v5p, "gf": v6e / TPU7x; each changes no figure of the other family's chips; v4 places
# nothing there).
HBM_ONLY = (("xla_vf_vmem_memory_space_assignment", False), ("xla_gf_vmem_memory_space_assignment", False))


def hbm_chain(name: str) -> str:
    """The chain an `hbm` variant belongs to: its name without the `_T{length}` suffix."""
    return name.rsplit("_T", 1)[0]


# ------------------------------------------------------------------------------------------------ peers


def _bnsd(x):
    return jnp.swapaxes(x, 1, 2)  # [B, T, N, D] -> [B, N, T, D]


def _peer(name, build_attend, features, *, head_dim=128, kv_heads=N, q_len=1024) -> TpuVariant:
    """fwd+bwd of a peer's attend(q, k, v) on our [B, T, N, D] inputs, bf16."""
    def build():
        specs = [_spec((B, q_len, N, head_dim), jnp.bfloat16)] + [
            _spec((B, q_len, kv_heads, head_dim), jnp.bfloat16)] * 2
        return gpu_variants._wrap("fwd+bwd", build_attend(q_len, head_dim), 3, (0, 1, 2)), specs

    return TpuVariant(name, "peer", build, head_dim, "bf16", "fwd+bwd", q_len, None, features=features)


def _splash(mask_kind: str, gqa: bool, transpose: bool = True):
    """JAX's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) at its default block sizes
    (128 everywhere, separate dQ and dK/dV kernels), vmapped over the batch; GQA through its MQA kernel,
    vmapped over the kv heads. `transpose`: on our [B, T, N, D] inputs (transposed for it); else on its own
    [B, N, T, D] layout (the side-by-side rows: `side_variants`)."""
    def build_attend(t, d):
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

        one = {"causal": lambda: masks.CausalMask((t, t)), "full": lambda: masks.FullMask((t, t)),
               "local": lambda: masks.LocalMask((t, t), (256, 0), 0)}[mask_kind]()
        heads = N // KV_HEADS if gqa else N
        # The mask's block tables are made here, at trace time, as arrays: on the CPU (the topology's TPU
        # device of the compile cannot hold data); they enter the compile as constants.
        with jax.default_device(jax.devices("cpu")[0]):
            kernel = (splash.make_splash_mqa if gqa else splash.make_splash_mha)(
                masks.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1,
                block_sizes=splash.BlockSizes.get_default())

        def attend(q, k, v):
            q, k, v = (_bnsd(q) * d ** -0.5, _bnsd(k), _bnsd(v)) if transpose else (q * d ** -0.5, k, v)
            if gqa:  # q [B, K, N/K, T, D], k / v [B, K, T, D]
                q = q.reshape(B, KV_HEADS, N // KV_HEADS, t, d)
                out = jax.vmap(jax.vmap(kernel))(q, k, v).reshape(B, N, t, d)
            else:
                out = jax.vmap(kernel)(q, k, v)
            return _bnsd(out) if transpose else out

        return attend
    return build_attend


def _jax_flash(causal: bool):
    """JAX's Pallas TPU flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`) at its default
    block sizes."""
    def build_attend(t, d):
        from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

        def attend(q, k, v):
            out = jax_flash.flash_attention(_bnsd(q), _bnsd(k), _bnsd(v), causal=causal, sm_scale=d ** -0.5)
            return _bnsd(out)

        return attend
    return build_attend


def _tokamax(causal: bool):
    """tokamax's attention (`tokamax.dot_product_attention`, implementation "mosaic": its Pallas Mosaic TPU
    kernel), when tokamax is installed."""
    def build_attend(t, d):
        import tokamax

        def attend(q, k, v):
            return tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")

        return attend
    return build_attend


def peer_variants() -> list[TpuVariant]:
    """The peers at seq 1024, and the causal ones at the HBM pair's T as well (at seq 1024 XLA keeps most
    intermediates of every kernel in VMEM, so HBM temp only compares at longer sequences)."""
    splash = "block-sparse masks (tables at trace time), soft cap, segment ids, MQA / GQA, fused dK/dV"
    jax_flash = "causal, dense bias `ab`, segment ids; no GQA, no window, no soft cap, Dv = D"
    tokamax = "tokamax.dot_product_attention (its Mosaic TPU kernel: splash); masks, bias, GQA, soft cap, window"
    return [
        _peer("jax_splash_grad_d128_bf16_causal", _splash("causal", False), splash),
        _peer("jax_splash_grad_d128_bf16_local256", _splash("local", False), splash),
        _peer("jax_splash_grad_d128_gqa8to2_bf16_causal", _splash("causal", True), splash, kv_heads=KV_HEADS),
        _peer("jax_flash_grad_d128_bf16_causal", _jax_flash(True), jax_flash),
        _peer("jax_flash_grad_d128_bf16_full", _jax_flash(False), jax_flash),
        _peer("tokamax_grad_d128_bf16_causal", _tokamax(True), tokamax),
        *(v for v in side_variants() if v.group == "peer"),
    ]


# ------------------------------------------------------------------------------------------ side by side

SIDE_LENGTHS = (2048, 8192)


def side_name(who: str, head_dim: int, kv_heads: int, mask: str, t: int) -> str:
    heads = "mha" if kv_heads == N else f"gqa{N}to{kv_heads}"
    return f"{who}_side_grad_d{head_dim}_{heads}_bf16_{mask}_T{t}"


def side_variants() -> list[TpuVariant]:
    """fwd+bwd, bf16, B=4, N=8, at T = 2048 / 8192, head dim 64 / 128, causal / full, MHA / GQA 8:2: ours on
    the [B, T, N, D] layout the modules use ("side", gated: HBM temp at most splash's) beside JAX's splash
    attention on its own [B, N, T, D] layout (no transposes) and, at T = 8192 head dim 128 causal, JAX's Pallas
    flash attention (GQA through K / V repeated to N heads: it has no GQA)."""
    splash = "block-sparse masks, soft cap, segment ids, MQA / GQA; on its own [B, N, T, D] layout"
    jax_flash = "causal, dense bias `ab`, segment ids; K / V repeated for GQA"
    out = []
    for t in SIDE_LENGTHS:
        for d in (64, 128):
            for mask in ("causal", "full"):
                for kv_heads in (N, KV_HEADS):
                    ours = gpu_variants.flash(side_name("tpu", d, kv_heads, mask, t), backend="tpu", head_dim=d,
                                              causal=mask == "causal", q_len=t, kv_heads=kv_heads, mode="fwd+bwd")
                    out.append(_from_gpu(ours, "side"))
                    out.append(_native_peer(side_name("jax_splash", d, kv_heads, mask, t),
                                            _splash(mask, kv_heads != N, transpose=False), splash, d, kv_heads, t))
                    if t == SIDE_LENGTHS[-1] and d == 128 and mask == "causal":
                        out.append(_peer(side_name("jax_flash", d, kv_heads, mask, t),
                                         _jax_flash_repeated(kv_heads), jax_flash, kv_heads=kv_heads, q_len=t))
    return out


def _native_peer(name, build_attend, features, head_dim: int, kv_heads: int, q_len: int) -> TpuVariant:
    """fwd+bwd of a peer's attend(q, k, v) on [B, N, T, D] inputs, bf16."""
    def build():
        specs = [_spec((B, N, q_len, head_dim), jnp.bfloat16)] + [
            _spec((B, kv_heads, q_len, head_dim), jnp.bfloat16)] * 2
        return gpu_variants._wrap("fwd+bwd", build_attend(q_len, head_dim), 3, (0, 1, 2)), specs

    return TpuVariant(name, "peer", build, head_dim, "bf16", "fwd+bwd", q_len, None, features=features)


def _jax_flash_repeated(kv_heads: int):
    """JAX's Pallas TPU flash attention, causal, with K / V repeated to the N query heads."""
    def build_attend(t, d):
        from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

        def attend(q, k, v):
            k, v = (jnp.repeat(x, N // kv_heads, axis=2) for x in (k, v))
            out = jax_flash.flash_attention(_bnsd(q), _bnsd(k), _bnsd(v), causal=True, sm_scale=d ** -0.5)
            return _bnsd(out)

        return attend
    return build_attend


def decode_variants() -> list[TpuVariant]:
    """`decode_attention` with its default config (backend "tpu" on a TPU device) at the serving shapes of
    `tpu_decode_probe.py` (B=8, N=32, K=8, D=128, 16-key pages, 2048 keys per sequence), and JAX's paged /
    ragged paged attention beside it (peers, shown, not gated)."""
    import tpu_decode_probe as probe

    def ours(name, dtype="bf16", **options):
        def build():
            fn, specs = probe._ours(dtype=gpu_variants.dtype_of(dtype), **options)
            return fn, list(specs)
        return TpuVariant(name, "decode", build, probe.D, dtype, "decode", probe.CONTEXT)

    def peer(name, probe_build, features):
        def build():
            fn, specs = probe_build()
            return fn, list(specs)
        return TpuVariant(name, "peer", build, probe.D, "bf16", "decode", probe.CONTEXT, path=None,
                          features=features)

    def edge(name):
        def build():
            fn, specs = {n: (f, s) for n, f, s in probe.edge_variants()}[name]
            return fn, list(specs)
        return build

    paged = "paged KV cache (head-major pages), one new token, MQA / GQA; no hooks, no dense cache"
    dense = ("paged KV cache (head-major pages) only: our dense [B, S, K, D] cache transposed to its pages by XLA "
             "on every call")
    ragged = "ragged paged attention: mixed prefill / decode tokens, paged KV; sliding window, soft cap"
    return [
        ours("tpu_decode_paged_d128_bf16_gqa32to8_t1", new_tokens=1),
        ours("tpu_decode_paged_d128_bf16_gqa32to2_t1", new_tokens=1, num_kv_heads=2),
        ours("tpu_decode_paged_d128_bf16_mqa32to1_t1", new_tokens=1, num_kv_heads=1),
        ours("tpu_decode_dense_d128_bf16_mqa32to1_t1", new_tokens=1, paged=False, num_kv_heads=1),
        ours("tpu_decode_paged_d256_bf16_gqa32to8_t1", new_tokens=1, head_dim=256, value_dim=256),
        # A dense cache shorter than a block: one block of 37 keys, too odd for Mosaic's strided bfloat16 load
        # (the heads view); interpret mode cannot see that, only this compile.
        TpuVariant("tpu_decode_dense_s37_d128_bf16_gqa8to2_t1", "decode", edge("probjax decode dense S=37"), 128,
                   "bf16", "decode", 37),
        ours("tpu_decode_paged_d128_bf16_gqa32to8_t16_alibi_window", new_tokens=16, hooks=True),
        ours("tpu_decode_dense_d128_bf16_gqa32to8_t1", new_tokens=1, paged=False),
        ours("tpu_decode_paged_d128_f32_gqa32to8_t4", "f32", new_tokens=4),
        ours("tpu_decode_paged_d192_dv128_bf16_gqa32to2_t8", new_tokens=8, head_dim=192, value_dim=128,
             num_kv_heads=2),
        peer("jax_paged_attention_decode_d128_bf16_t1", probe._peer_paged, paged),
        peer("jax_paged_attention_decode_d128_bf16_gqa32to2_t1", lambda: probe._peer_paged(num_kv_heads=2), paged),
        peer("jax_paged_attention_decode_d128_bf16_mqa32to1_t1", lambda: probe._peer_paged(num_kv_heads=1), paged),
        peer("jax_paged_attention_dense_cache_decode_d128_bf16_t1", probe._peer_paged_dense, dense),
        peer("jax_ragged_paged_attention_decode_d128_bf16_t4", lambda: probe._peer_ragged(4), ragged),
    ]


def ragged_variants() -> list[TpuVariant]:
    """`ragged_paged_attention` through its public front-end with `RaggedConfig(backend="tpu")` at a serving
    step's packed batch (serving_step.py: 256 new tokens over 16 sequences of up to 2048 keys, GQA 32:8, head
    dim 128): bf16 pages of 16 and 64 keys, a sliding window with a soft cap and sinks, int8 and
    float8_e4m3fn pages with per-head scales, an ALiBi score_mod with a window mask_mod, and the append of
    the step's keys and values; JAX's ragged paged attention at the same batch beside it; and the LM
    example's serving step."""
    ragged = "ragged paged attention: mixed prefill / decode tokens, paged KV; sliding window, soft cap"

    def ours(name, **options):
        return TpuVariant(name, "decode", lambda: ragged_call("tpu", **options), HEAD_DIM, "bf16", "ragged",
                          CONTEXT)

    def jax_ragged(page):
        def build():
            from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

            q, kv_pages, *tables = ragged_specs(page, jnp.bfloat16, jnp.bfloat16, 2 * RAGGED_KV_HEADS)

            def attend(q, kv_pages, kv_lens, tables, cu_q_lens, num_seqs):
                return ragged_paged_attention(q, kv_pages, kv_lens, tables, cu_q_lens, num_seqs.reshape(1),
                                              sm_scale=HEAD_DIM ** -0.5, num_kv_pages_per_block=128 // page,
                                              num_queries_per_block=32)

            return attend, [q, kv_pages, *tables]
        return TpuVariant(f"jax_ragged_paged_attention_mixed_page{page}_d128_bf16", "peer", build, HEAD_DIM, "bf16",
                          "ragged", CONTEXT, path=None, features=ragged)

    return [
        ours("tpu_ragged_page16_d128_bf16_gqa32to8"),
        ours("tpu_ragged_page64_d128_bf16_gqa32to8", page=64),
        ours("tpu_ragged_page16_d128_bf16_gqa32to8_window_softcap_sinks", sliding_window=1024, soft_cap=30.0,
             sinks=True),
        ours("tpu_ragged_page16_d128_int8_gqa32to8_append", pages="int8", append=True),
        ours("tpu_ragged_page16_d128_fp8_gqa32to8", pages="fp8"),
        ours("tpu_ragged_page16_d128_bf16_gqa32to8_alibi_window", hooks=True),
        jax_ragged(16),
        jax_ragged(64),
        # The LM example's continuous-batching step (scripts/compile/serving_step.py): 8 layers, 8 ragged calls.
        TpuVariant("lm_serving_step_bench_hd128_int8_t256", "decode", lambda: serving_step("tpu"), HEAD_DIM,
                   "bf16", "ragged", CONTEXT),
    ]


def gated_variants() -> list[TpuVariant]:
    """The variants the gate checks: ours (flash, flex, HBM pair, decode); the peers are shown only."""
    return [*tpu_variants(), *(v for v in side_variants() if v.group != "peer"),
            *(v for v in decode_variants() + ragged_variants() if v.group != "peer")]


def variants() -> list[TpuVariant]:
    """Every TPU variant, ours first; names are unique."""
    out = tpu_variants() + [v for v in side_variants() if v.group != "peer"] + peer_variants() + decode_variants() + \
        ragged_variants()
    names = [v.name for v in out]
    assert len(names) == len(set(names)), "variant names must be unique"
    return out
