"""The decode rows of the compile registry: the seed calls (`SEEDS`, the serving shapes of the decode benchmark)
and the calls one argument away from them whose plan no row before them compiles. Every call is planned by
the decode kernel's own planner (`probjax_kernels.triton.decode.plan_for`, reached through
`_dispatch.decode_plan` as every `decode_attention` call reaches it) on each GPU target, so a new rule there
(another key tile, warp count, stage count or row tile for some head dim, dtype, group or page size) gives
the calls it reaches a plan no row has, and the registry grows by a row that compiles it, without a line here.

What a plan compiles (`outcome`): the row tile, the key tile and tiles per step, warps and stages, and what
shapes the kernel's code (head dims padded to powers of two, the dtype's width, a paged or a dense cache,
causal, a window, the hooks). The moves (`deviations`): float16 and float32 for bfloat16, head dims 64 / 80 /
128 / 256, Dv 64 beside D, 1 / 4 / 16 new tokens (the most decode takes), GQA 8:1 / 8:8 / 32:8, pages of 16 /
64 / 256 keys (dense: a cache of 1,000 keys), and the hooks on or off. plan_space.py derives these rows beside
the flash ones and keeps them in the same cache.
"""

from __future__ import annotations

import dataclasses
import json

CACHE_LEN = 8192


@dataclasses.dataclass(frozen=True)
class DecodeProbe:
    """One `decode_attention` call at batch `variants.B`: q [B, T, N, D], a dense cache [B, S, K, D] (page_size
    0) or pages of `page_size` keys with block tables; `hooks`: ALiBi with a 1,024-key sliding window."""

    name: str
    head_dim: int = 128
    dtype: str = "bf16"
    heads: tuple[int, int] = (8, 2)
    new_tokens: int = 1
    cache_len: int = CACHE_LEN
    page_size: int = 0
    value_dim: int | None = None
    hooks: bool = False

    @property
    def query_rows(self) -> int:
        """New tokens x query heads per KV head: the rows one program's tile packs."""
        return self.new_tokens * self.heads[0] // self.heads[1]

    def variant(self, targets: tuple = ()):
        import variants as registry

        return registry.Variant(self.name, "decode", self._build, self.head_dim, self.dtype, "fwd", "triton",
                                self.new_tokens, self.cache_len, self.value_dim, requires=(registry.DECODE,),
                                targets=tuple(targets) or registry.FULL_TARGETS, query_rows=self.query_rows)

    def _build(self):
        import jax.numpy as jnp
        from probjax_kernels import DecodeConfig, alibi, decode_attention, sliding_window
        from variants import B, _spec, dtype_of

        dt, (q_heads, kv_heads) = dtype_of(self.dtype), self.heads
        value_dim = self.value_dim or self.head_dim
        specs = [_spec((B, self.new_tokens, q_heads, self.head_dim), dt)]
        if self.page_size:
            max_pages = self.cache_len // self.page_size
            cache = [(B * max_pages, self.page_size, kv_heads, d) for d in (self.head_dim, value_dim)]
            tables = [_spec((B, max_pages), jnp.int32)]
        else:
            cache = [(B, self.cache_len, kv_heads, d) for d in (self.head_dim, value_dim)]
            tables = []
        specs += [_spec(shape, dt) for shape in cache] + [_spec((B,), jnp.int32)] + tables
        specs.append(_spec((q_heads,), jnp.float32))
        config, paged, hooks = DecodeConfig(backend="triton"), bool(self.page_size), self.hooks

        def attend(q, k, v, lengths, *rest):
            tables = dict(block_tables=rest[0]) if paged else {}
            mods = dict(score_mod=alibi(rest[-1]), mask_mod=sliding_window(1024)) if hooks else {}
            return decode_attention(q, k, v, kv_lengths=lengths, config=config, **tables, **mods)

        return attend, specs


# The serving shapes of the decode benchmark and a dense cache read in place with a masked tail and lanes.
SEEDS = (
    DecodeProbe("decode_d64_bf16_cache8192_gqa8to2", 64),
    DecodeProbe("decode_d128_bf16_cache8192_gqa8to2", 128),
    DecodeProbe("decode_d256_bf16_cache8192_gqa8to2", 256),
    DecodeProbe("decode_paged16_d128_bf16_gqa32to8_t1", heads=(32, 8), page_size=16),
    DecodeProbe("decode_paged64_d128_bf16_gqa32to8_t4", heads=(32, 8), new_tokens=4, page_size=64),
    DecodeProbe("decode_paged16_d128_bf16_gqa32to8_t16_alibi_window", heads=(32, 8), new_tokens=16, page_size=16,
                hooks=True),
    DecodeProbe("decode_paged64_d128_f16_gqa32to8_t16_alibi_window", dtype="f16", heads=(32, 8), new_tokens=16,
                page_size=64, hooks=True),
    DecodeProbe("decode_paged16_d128_dv64_gqa32to8_t4_float32", dtype="f32", heads=(32, 8), new_tokens=4,
                page_size=16, value_dim=64),
    DecodeProbe("decode_d80_bf16_cache1000_gqa8to2", 80, cache_len=1000),
)


def _named(probe: DecodeProbe, **changes) -> DecodeProbe:
    """The probe with `changes`, named from its fields."""
    p = dataclasses.replace(probe, **changes)
    cache = f"paged{p.page_size}" if p.page_size else f"cache{p.cache_len}"
    dv = f"_dv{p.value_dim}" if p.value_dim else ""
    hooks = "_alibi_window" if p.hooks else ""
    return dataclasses.replace(p, name=f"decode_{cache}_d{p.head_dim}{dv}_{p.dtype}_gqa{p.heads[0]}to{p.heads[1]}"
                                       f"_t{p.new_tokens}{hooks}")


def deviations(probe: DecodeProbe) -> list[DecodeProbe]:
    """The calls one argument away from a seed (see the module docstring)."""
    out = [_named(probe, dtype=dtype) for dtype in ("bf16", "f16", "f32") if dtype != probe.dtype]
    out += [_named(probe, head_dim=d) for d in (64, 80, 128, 256) if d != probe.head_dim]
    if probe.value_dim is None and probe.head_dim >= 128:
        out.append(_named(probe, value_dim=64))
    out += [_named(probe, new_tokens=t) for t in (1, 4, 16) if t != probe.new_tokens]
    out += [_named(probe, heads=h) for h in ((8, 1), (8, 8), (32, 8)) if h != probe.heads]
    if probe.page_size:
        out += [_named(probe, page_size=p) for p in (16, 64, 256) if p != probe.page_size]
    else:
        out.append(_named(probe, cache_len=1000 if probe.cache_len != 1000 else CACHE_LEN))
    out.append(_named(probe, hooks=not probe.hooks))
    return out


def probes() -> list[DecodeProbe]:
    """The seeds, then the calls one argument away from them (`plan_space.with_deviations`)."""
    from plan_space import with_deviations

    return with_deviations(list(SEEDS), deviations, lambda probe: probe.name)


def plans_of(probe: DecodeProbe, devices: dict) -> dict:
    """The decode kernel's plan of the probe's call on each of `devices` (stand-ins with the targets' compute
    capabilities: `plan_space._device`), its call traced until the plan is made (`plan_space.first_results`)."""
    from plan_trace import first_results
    from probjax_kernels.triton import decode as triton_decode

    made = first_results(*probe._build(), triton_decode, "plan_for", devices)
    if any(plan is None for plan in made.values()):
        raise RuntimeError(f"{probe.name}: the call never reached the decode kernel's plan_for")
    return made


def plan_of(probe: DecodeProbe, device):
    """The decode kernel's plan of the probe's call on `device`."""
    return plans_of(probe, {None: device})[None]


def outcome(probe: DecodeProbe, plan) -> tuple:
    """What the plan compiles: its tiles, warps and stages, and what shapes the kernel's code."""
    from plan_space import pow2

    dims = (pow2(probe.head_dim), pow2(probe.value_dim or probe.head_dim))
    return (plan.rows, plan.tile, plan.tiles_per_step, plan.num_warps, plan.num_stages, dims,
            "f32" if probe.dtype == "f32" else "16-bit", bool(probe.page_size), plan.causal,
            plan.lookback is not None, plan.score_mod is not None, plan.mask_mod is not None)


def derive(targets: tuple[str, ...], device_of) -> list[dict]:
    """The decode rows beside the seeds (variants.py compiles those): each probe whose outcome on some target
    no probe before it has there, a row on every target (decode rows compile on all of them)."""
    covered, rows = set(), []
    for probe in probes():
        plans = plans_of(probe, {target: device_of(target) for target in targets})
        keys = {json.dumps([target, outcome(probe, plan)]) for target, plan in plans.items()}
        if probe not in SEEDS and keys - covered:
            rows.append(dict(decode=dataclasses.asdict(probe), targets=list(targets)))
        covered |= keys
    return rows


def probe_of(row: dict) -> DecodeProbe:
    """The probe of a derived row (its JSON form: lists where the probe holds tuples)."""
    return DecodeProbe(**dict(row["decode"], heads=tuple(row["decode"]["heads"])))
