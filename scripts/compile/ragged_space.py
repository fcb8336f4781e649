"""The ragged (serving) rows of the compile registry: the seed calls (`SEEDS`, a serving step's packed batch,
serving_step.py) and the calls one argument away from them whose plan no row before them compiles. Every call
is planned by the Triton ragged kernel's own planner (`probjax_kernels.triton.ragged._plan`, reached through
`ragged_paged_attention` as every call reaches it) on each GPU target, so a new rule there (another key tile,
warp count, stage count or row tile for some head dim, page size, group or block of tokens) gives the calls
it reaches a plan no row has, and the registry grows by a row that compiles it, without a line here.

What a plan compiles (`outcome`): the row tile, the key tile and tiles per step, warps and stages, and what
shapes the kernel's code (head dims padded to powers of two, quantized pages, a window, a soft cap, the hooks,
sinks). A call whose pages the kernel cannot read on a target (float8 before compute capability 8.9) runs the
XLA path there: it has no plan on that target, and its row compiles only where it has one. The moves
(`deviations`): head dims 64 / 128 / 256, GQA 8:1 / 8:8 / 32:8, pages of 16 / 64 / 256 keys, bf16 / int8 /
float8 pages, blocks of 8 / 16 / 32 tokens, and each feature (window + soft cap + sinks, the hooks, the
append) on or off. plan_space.py derives these rows beside the flash and decode ones and keeps them in the same
cache.
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class RaggedProbe:
    """One `ragged_paged_attention` call at the packed batch of serving_step.py (`ragged_call`)."""

    name: str
    page: int = 16
    pages: str = "bf16"  # "bf16", "int8" or "fp8"
    head_dim: int = 128
    heads: tuple[int, int] = (32, 8)
    block_q: int | None = None  # RaggedConfig.block_q; None: the default (about 64 rows)
    window_softcap_sinks: bool = False
    hooks: bool = False
    append: bool = False

    @property
    def query_rows(self) -> int:
        """Query rows of a program: its tokens (`block_q`; by default 16 tokens x 4 heads at the packed batch,
        about 64 rows: `RaggedConfig`) x the query heads of a KV head, padded to a power of two (the planner's
        `rows`; tests/test_ragged_space.py checks they agree)."""
        from plan_space import pow2

        group = self.heads[0] // self.heads[1]
        tokens = self.block_q or 1 << (max(1, 64 // group).bit_length() - 1)  # `_ragged_inputs.default_block_q`
        return pow2(tokens * group)

    def build(self):
        from serving_step import ragged_call

        extra = dict(sliding_window=1024, soft_cap=30.0) if self.window_softcap_sinks else {}
        return ragged_call("triton", page=self.page, pages=self.pages, append=self.append, hooks=self.hooks,
                           sinks=self.window_softcap_sinks, heads=self.heads, head_dim=self.head_dim,
                           block_q=self.block_q, **extra)

    def variant(self, targets: tuple):
        import variants as registry
        from serving_step import CONTEXT, TOKENS

        return registry.Variant(self.name, "decode", self.build, self.head_dim, "bf16", "fwd", "triton", TOKENS,
                                CONTEXT, requires=(registry.RAGGED,), targets=tuple(targets),
                                query_rows=self.query_rows)


# The serving step's calls: bf16 pages of 16 and 64 keys, a sliding window with a soft cap and sinks, int8 pages
# with the append of the step's keys and values, float8_e4m3fn pages, an ALiBi score_mod with a window mask_mod.
SEEDS = (
    RaggedProbe("ragged_page16_d128_bf16_gqa32to8"),
    RaggedProbe("ragged_page64_d128_bf16_gqa32to8", page=64),
    RaggedProbe("ragged_page16_d128_bf16_gqa32to8_window_softcap_sinks", window_softcap_sinks=True),
    RaggedProbe("ragged_page16_d128_int8_gqa32to8_append", pages="int8", append=True),
    RaggedProbe("ragged_page16_d128_fp8_gqa32to8", pages="fp8"),
    RaggedProbe("ragged_page16_d128_bf16_gqa32to8_alibi_window", hooks=True),
)


def _named(probe: RaggedProbe, **changes) -> RaggedProbe:
    """The probe with `changes`, named from its fields."""
    p = dataclasses.replace(probe, **changes)
    features = "".join(suffix for on, suffix in ((p.window_softcap_sinks, "_window_softcap_sinks"),
                                                 (p.hooks, "_alibi_window"), (p.append, "_append")) if on)
    block = f"_bq{p.block_q}" if p.block_q else ""
    return dataclasses.replace(p, name=f"ragged_page{p.page}_d{p.head_dim}_{p.pages}_gqa{p.heads[0]}to{p.heads[1]}"
                                       f"{block}{features}")


def deviations(probe: RaggedProbe) -> list[RaggedProbe]:
    """The calls one argument away from a seed (see the module docstring)."""
    out = [_named(probe, head_dim=d) for d in (64, 128, 256) if d != probe.head_dim]
    out += [_named(probe, heads=h) for h in ((8, 1), (8, 8), (32, 8)) if h != probe.heads]
    out += [_named(probe, page=p) for p in (16, 64, 256) if p != probe.page]
    out += [_named(probe, pages=p) for p in ("bf16", "int8", "fp8") if p != probe.pages]
    out += [_named(probe, block_q=b) for b in (8, 16, 32) if b != probe.block_q]
    out += [_named(probe, window_softcap_sinks=not probe.window_softcap_sinks), _named(probe, hooks=not probe.hooks),
            _named(probe, append=not probe.append)]
    return out


def probes() -> list[RaggedProbe]:
    """The seeds, then the calls one argument away from them (`plan_space.with_deviations`)."""
    from plan_space import with_deviations

    return with_deviations(list(SEEDS), deviations, lambda probe: probe.name)


def plans_of(probe: RaggedProbe, devices: dict) -> dict:
    """The Triton ragged kernel's plan of the probe's call on each of `devices` (stand-ins with the targets'
    compute capabilities: `plan_space._device`), its call traced until the plan is made
    (`plan_space.first_results`); None where the dispatch takes the XLA path (pages the kernel cannot read
    there)."""
    import warnings

    from plan_trace import first_results
    from probjax_kernels.triton import ragged as triton_ragged

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the XLA path's warning: that call has no plan here
        return first_results(*probe.build(), triton_ragged, "_plan", devices)


def plan_of(probe: RaggedProbe, device):
    """The Triton ragged kernel's plan of the probe's call on `device`, or None (`plans_of`)."""
    return plans_of(probe, {None: device})[None]


def outcome(probe: RaggedProbe, plan) -> tuple:
    """What the plan compiles: its tiles, warps and stages, and what shapes the kernel's code."""
    from plan_space import pow2

    return (plan.rows, plan.tile, plan.tiles_per_step, plan.num_warps, plan.num_stages, pow2(probe.head_dim),
            plan.quantized, probe.pages, plan.sliding_window is not None, plan.soft_cap is not None,
            plan.score_mod is not None, plan.mask_mod is not None, plan.has_sinks)


def derive(targets: tuple[str, ...], device_of) -> list[dict]:
    """The ragged rows beside the seeds (variants.py compiles those): each probe whose outcome on some target no
    probe before it has there, a row on the targets where the kernel plans it."""
    covered, rows = set(), []
    for probe in probes():
        plans = plans_of(probe, {target: device_of(target) for target in targets})
        planned = [target for target, plan in plans.items() if plan is not None]
        keys = {json.dumps([target, outcome(probe, plans[target])]) for target in planned}
        if probe not in SEEDS and keys - covered:
            rows.append(dict(ragged=dataclasses.asdict(probe), targets=planned))
        covered |= keys
    return rows


def probe_of(row: dict) -> RaggedProbe:
    fields = dict(row["ragged"])
    fields["heads"] = tuple(fields["heads"])
    return RaggedProbe(**fields)
