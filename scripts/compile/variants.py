"""The kernel variants the compile report compiles (scripts/compile/report.py): one `Variant` per distinct
kernel build. To add a kernel to the report, append a `Variant` (or a few) to `variants()`.

Register, spill and shared-memory figures depend on the static configuration of a kernel (tiles, warps,
stages, head dims, dtype, causal / ragged / feature flags), not on the batch, the number of heads or the
sequence length beyond the padded tail, so the grid is deduplicated: B=4, N=8, seq 1024 for each static
configuration, plus the seq lengths that change the kernel (ragged tails 600 / 1500 / 3000 / 77, which also
shrink the tiles at 77) and one seq 8192 build per target as a control.

Each variant builds a function and its argument specs; `backend` is the `FlashConfig.backend` it asks for
("triton" is what `auto` / a default FlashConfig picks on a GPU; "mosaic" what FlashConfig(backend="mosaic")
and PROBJAX_MOSAIC=1 pick on Hopper). Everything else (tiles, warps, stages) is `default_config`'s choice for
the target device, which is what the report checks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

B, N = 4, 8


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compile: `build()` returns (function, argument ShapeDtypeStructs without sharding)."""

    name: str
    group: str  # "triton" | "mosaic" | "decode": what it exercises; Mosaic variants compile on Hopper only
    build: Callable[[], tuple[Callable, list]]
    head_dim: int
    dtype: str
    mode: str  # "fwd" | "fwd+bwd" | "jvp"
    backend: str = "triton"
    q_len: int = 1024
    kv_len: int = 1024
    value_dim: int | None = None
    tiles: dict | None = None  # FlashConfig fields set explicitly (exploration); None: default_config's


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def _wrap(mode: str, attend: Callable, n_args: int, grad_args: tuple[int, ...]):
    """The compiled function of a mode: the forward, the gradient of a sum (forward + backward kernels), or
    a jvp (the tangent kernel)."""
    if mode == "fwd":
        return attend
    if mode == "fwd+bwd":
        def loss(*args):
            return jnp.sum(attend(*args).astype(jnp.float32))
        return jax.grad(loss, grad_args)
    if mode == "jvp":
        def jvp(*args):
            return jax.jvp(lambda *a: attend(*a, *args[len(a):]), args[:3], args[:3])[1]
        return jvp
    raise ValueError(mode)


def flash(name: str, *, head_dim=128, value_dim=None, dtype="bf16", mode="fwd", causal=False, q_len=1024,
          kv_len=None, kv_heads=N, backend="triton", group=None, tiles=None, **options) -> Variant:
    """A `flash_attention` call; `options` go to it (dropout_rate, window, ...). Segment ids and lengths are
    arguments when options has segments=True / lengths=True. `tiles`: FlashConfig fields to set rather than
    leave to `default_config` (for exploring candidates: `--explore`)."""
    from probjax_kernels import FlashConfig, flash_attention

    kv_len = kv_len or q_len
    value_dim = value_dim or head_dim
    segments, lengths = options.pop("segments", False), options.pop("lengths", False)
    dt = _DTYPES[dtype]

    def build():
        config = FlashConfig(backend=backend, **(tiles or {}))
        specs = [_spec((B, q_len, N, head_dim), dt), _spec((B, kv_len, kv_heads, head_dim), dt),
                 _spec((B, kv_len, kv_heads, value_dim), dt)]
        if segments:
            specs += [_spec((B, q_len), jnp.int32), _spec((B, kv_len), jnp.int32)]
        if lengths:
            specs += [_spec((B,), jnp.int32), _spec((B,), jnp.int32)]

        def attend(q, k, v, *rest):
            extra = dict(options)
            rest = list(rest)
            if segments:
                extra.update(q_segment_ids=rest.pop(0), kv_segment_ids=rest.pop(0))
            if lengths:
                extra.update(q_lengths=rest.pop(0), kv_lengths=rest.pop(0))
            return flash_attention(q, k, v, causal=causal, config=config, **extra)

        return _wrap(mode, attend, len(specs), (0, 1, 2)), specs

    return Variant(name, group or backend, build, head_dim, dtype, mode, backend, q_len, kv_len,
                   value_dim if value_dim != head_dim else None, tiles)


def flex(name: str, hook: str, *, head_dim=128, dtype="bf16", mode="fwd+bwd", q_len=1024, backend="triton",
         block=128) -> Variant:
    """A `flex_attention` call with one representative hook: softcap, ALiBi (captured slopes), a document
    mask, a sliding window (as a BlockMask), or a relative-bias table that gets a gradient."""
    from probjax_kernels import (
        FlashConfig, alibi, alibi_slopes, and_masks, causal_mask, create_block_mask, document_mask,
        flex_attention, relative_bias, sliding_window, softcap,
    )

    dt = _DTYPES[dtype]

    def build():
        config = FlashConfig(backend=backend)
        specs = [_spec((B, q_len, N, head_dim), dt)] * 3
        grad_args = (0, 1, 2)
        if hook == "relative_bias":
            specs = specs + [_spec((N, 2 * q_len - 1), jnp.float32)]
            grad_args = (0, 1, 2, 3)

        def attend(q, k, v, *rest):
            score_mod, block_mask = None, None
            if hook == "softcap":
                score_mod = softcap(30.0)
            elif hook == "alibi":
                score_mod = alibi(alibi_slopes(N))
            elif hook == "relative_bias":
                score_mod = relative_bias(rest[0])
            elif hook == "document_mask":
                ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), q_len // 4)[None].repeat(B, 0)
                block_mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), B, N, q_len, q_len,
                                               block_size=(block, block))
            elif hook == "sliding_window":
                block_mask = create_block_mask(and_masks(causal_mask, sliding_window(256)), None, None, q_len,
                                               q_len, block_size=(block, block))
            else:
                raise ValueError(hook)
            return flex_attention(q, k, v, score_mod, block_mask, config=config)

        return _wrap(mode, attend, len(specs), grad_args), specs

    return Variant(name, backend, build, head_dim, dtype, mode, backend, q_len, q_len)


def _triton_variants() -> list[Variant]:
    """The forward kernel is the same in a forward-only call and in fwd+bwd (it always writes the lse), so
    the seed grid's fwd cells compile inside the fwd+bwd ones; forward-only builds remain for the ragged
    lengths that only run forward in the seed's benchmark."""
    out = []
    for d in (64, 128):
        for dtype, causal in (("bf16", False), ("bf16", True), ("f16", d == 64)):
            tag = f"d{d}_{dtype}_{'causal' if causal else 'full'}"
            out.append(flash(f"flash_grad_{tag}", head_dim=d, dtype=dtype, causal=causal, mode="fwd+bwd"))
        out.append(flash(f"flash_jvp_d{d}_bf16_causal", head_dim=d, causal=True, mode="jvp"))
    # float32 has tiles of its own (FMA dots at Precision.HIGHEST).
    for d in (64, 128, 256):
        out.append(flash(f"flash_grad_d{d}_f32_full", head_dim=d, dtype="f32", mode="fwd+bwd"))
    out.append(flash("flash_grad_d128_f32_causal", dtype="f32", causal=True, mode="fwd+bwd"))
    out.append(flash("flash_jvp_d128_f32_causal", dtype="f32", causal=True, mode="jvp"))
    for causal in (False, True):
        out.append(flash(f"flash_grad_d256_bf16_{'causal' if causal else 'full'}", head_dim=256, causal=causal,
                         mode="fwd+bwd"))
    out.append(flash("flash_jvp_d256_bf16_full", head_dim=256, mode="jvp"))
    # Ragged tails (and the short 77, whose tiles shrink to the sequence).
    out.append(flash("flash_fwd_d128_bf16_causal_T600", causal=True, q_len=600))
    out.append(flash("flash_fwd_d64_bf16_full_T1500", head_dim=64, q_len=1500))
    out.append(flash("flash_grad_d128_bf16_causal_T3000", causal=True, q_len=3000, mode="fwd+bwd"))
    out.append(flash("flash_grad_d64_bf16_causal_T77", head_dim=64, causal=True, q_len=77, mode="fwd+bwd"))
    # Features.
    out.append(flash("flash_grad_d128_dv64_bf16", value_dim=64, mode="fwd+bwd"))
    out.append(flash("flash_grad_d128_gqa8to2_bf16_causal", kv_heads=2, causal=True, mode="fwd+bwd"))
    out.append(flash("flash_grad_d128_bf16_dropout", dropout_rate=0.1, dropout_seed=7, mode="fwd+bwd"))
    out.append(flash("flash_grad_d128_bf16_segments_lengths", segments=True, lengths=True, mode="fwd+bwd"))
    out.append(flash("flash_grad_d128_bf16_window", window=(256, 0), mode="fwd+bwd"))
    for hook in ("softcap", "alibi", "document_mask", "sliding_window", "relative_bias"):
        out.append(flex(f"flex_grad_d128_bf16_{hook}", hook))
    return out


def _control_variants() -> list[Variant]:
    """seq 8192 (the seed benchmark's longest): the same kernels as seq 1024, compiled once on one target to
    show it."""
    return [flash("flash_grad_d128_bf16_causal_T8192", causal=True, q_len=8192, mode="fwd+bwd",
                  group="control")]


def _mosaic_variants() -> list[Variant]:
    out = []
    for d in (64, 128, 256):
        for causal in (False, True):
            tag = f"d{d}_bf16_{'causal' if causal else 'full'}"
            out.append(flash(f"mosaic_grad_{tag}", head_dim=d, causal=causal, mode="fwd+bwd", backend="mosaic"))
    out.append(flash("mosaic_grad_d128_f16_causal", dtype="f16", causal=True, mode="fwd+bwd", backend="mosaic"))
    out.append(flash("mosaic_grad_d128_bf16_window", window=(256, 0), mode="fwd+bwd", backend="mosaic"))
    out.append(flash("mosaic_grad_d128_gqa8to2_bf16_causal", kv_heads=2, causal=True, mode="fwd+bwd",
                     backend="mosaic"))
    for hook in ("softcap", "alibi", "sliding_window"):
        out.append(flex(f"mosaic_flex_grad_d128_bf16_{hook}", hook, backend="mosaic"))
    return out


def _decode_variants() -> list[Variant]:
    """The decode kernel (`probjax_kernels.decode_attention`), where this checkout has it, at its own default
    tiles (`DecodeConfig`): a dense cache (GQA 8 -> 2, hd 64 / 128 / 256), and paged caches with the serving
    shapes of the decode benchmark (pages of 16 and 64, GQA 32:8, T = 1 / 4 / 16, ALiBi with a sliding
    window, float32 with Dv != D); and a dense cache read in place with a masked tail and lanes (S = 1000,
    head dim 80)."""
    try:
        from probjax_kernels import DecodeConfig, alibi, alibi_slopes, decode_attention, sliding_window
    except ImportError:
        return []
    config = DecodeConfig(backend="triton")
    cache_len = 8192

    def dense(name, d, dtype="bf16", heads=(N, 2), new_tokens=1, cache_len=cache_len):
        def build():
            q_heads, kv_heads = heads
            specs = [_spec((B, new_tokens, q_heads, d), _DTYPES[dtype]),
                     _spec((B, cache_len, kv_heads, d), _DTYPES[dtype]),
                     _spec((B, cache_len, kv_heads, d), _DTYPES[dtype]), _spec((B,), jnp.int32)]

            def attend(q, k, v, lengths):
                return decode_attention(q, k, v, kv_lengths=lengths, config=config)

            return attend, specs
        return Variant(name, "decode", build, d, dtype, "fwd", "triton", new_tokens, cache_len)

    def paged(name, page_size, new_tokens, dtype="bf16", d=128, value_dim=None, heads=(32, 8), hooks=False):
        def build():
            q_heads, kv_heads = heads
            max_pages = cache_len // page_size
            pages = B * max_pages
            specs = [_spec((B, new_tokens, q_heads, d), _DTYPES[dtype]),
                     _spec((pages, page_size, kv_heads, d), _DTYPES[dtype]),
                     _spec((pages, page_size, kv_heads, value_dim or d), _DTYPES[dtype]),
                     _spec((B,), jnp.int32), _spec((B, max_pages), jnp.int32), _spec((q_heads,), jnp.float32)]

            def attend(q, k, v, lengths, tables, slopes):
                mods = dict(score_mod=alibi(slopes), mask_mod=sliding_window(1024)) if hooks else {}
                return decode_attention(q, k, v, kv_lengths=lengths, block_tables=tables, config=config, **mods)

            return attend, specs
        return Variant(name, "decode", build, d, dtype, "fwd", "triton", new_tokens, cache_len, value_dim)

    return [
        dense("decode_d64_bf16_cache8192_gqa8to2", 64),
        dense("decode_d128_bf16_cache8192_gqa8to2", 128),
        dense("decode_d256_bf16_cache8192_gqa8to2", 256),
        paged("decode_paged16_d128_bf16_gqa32to8_t1", 16, 1),
        paged("decode_paged64_d128_bf16_gqa32to8_t4", 64, 4),
        paged("decode_paged16_d128_bf16_gqa32to8_t16_alibi_window", 16, 16, hooks=True),
        paged("decode_paged64_d128_f16_gqa32to8_t16_alibi_window", 64, 16, dtype="f16", hooks=True),
        paged("decode_paged16_d128_dv64_gqa32to8_t4_float32", 16, 4, dtype="f32", value_dim=64),
        dense("decode_d80_bf16_cache1000_gqa8to2", 80, cache_len=1000),
    ]


def _peer_variants() -> list[Variant]:
    """Peers compiled the same way: JAX's own Pallas Triton attention (`jax.experimental.pallas.ops.gpu.
    attention.mha`) at its default block sizes, forward + backward, bf16, B=4, N=8, seq 1024."""
    out = []
    for d in (64, 128):
        for causal in (False, True):
            def build(d=d, causal=causal):
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    from jax.experimental.pallas.ops.gpu import attention

                def attend(q, k, v):
                    return attention.mha(q, k, v, None, sm_scale=d ** -0.5, causal=causal)

                return _wrap("fwd+bwd", attend, 3, (0, 1, 2)), [_spec((B, 1024, N, d), jnp.bfloat16)] * 3
            out.append(Variant(f"jax_pallas_mha_grad_d{d}_bf16_{'causal' if causal else 'full'}", "peer", build, d,
                               "bf16", "fwd+bwd", "triton"))
    return out


def _mosaic_peer_variants() -> list[Variant]:
    """JAX's own Pallas Mosaic GPU attention (`jax.experimental.pallas.ops.gpu.attention_mgpu`, Hopper
    only), forward + backward, f16 (its backward stages float16 scratch: bf16 inputs fail to compile), B=4,
    N=8, seq 1024: block_q 64 and block_kv 128 (one point of the sweep its own benchmark runs), 64 x 64
    backward tiles, 2 stages. Its causal variant refuses CUDA 12.8.0-12.9.1 (a ptxas miscompilation), which
    the pinned ptxas 12.9.86 is: the report shows that refusal."""
    out = []
    for d in (64, 128):
        for causal in (False, True):
            def build(d=d, causal=causal):
                from jax.experimental.pallas.ops.gpu import attention_mgpu

                config = attention_mgpu.TuningConfig(
                    block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal, block_q_dkv=64,
                    block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

                def attend(q, k, v):
                    return attention_mgpu.attention(q, k, v, config)

                return _wrap("fwd+bwd", attend, 3, (0, 1, 2)), [_spec((B, 1024, N, d), jnp.float16)] * 3
            out.append(Variant(f"jax_mosaic_attention_grad_d{d}_f16_{'causal' if causal else 'full'}", "peer",
                               build, d, "f16", "fwd+bwd", "mosaic"))
    return out


def variants() -> list[Variant]:
    """Every variant, Triton first; names are unique."""
    out = (_triton_variants() + _control_variants() + _mosaic_variants() + _decode_variants()
           + _peer_variants() + _mosaic_peer_variants())
    names = [v.name for v in out]
    assert len(names) == len(set(names)), "variant names must be unique"
    return out
