"""The flash rows of the compile registry that come from the dispatch itself (variants.py's `variants()` adds them
to the grid): every call of the probe space is planned by `probjax_kernels._dispatch.plan`, the function every
`flash_attention` / `flex_attention` call runs, on each GPU target, and a probe becomes a row where its plan
compiles something no row before it compiles on that target.

What a plan compiles, for one mode (`outcome`): each pass the mode runs (the forward; the backward's dQ and dK/dV
in fwd+bwd; the tangent in jvp), as the kernel entry that runs it, its tiles, warps and stages, the dK/dV
kernel's orientation and program grid (per query head, split in dV and dK) and the tangent's value splits, and
for the Mosaic GPU kernels how they read the call's bias and mask (float32 key or row vectors, tiles, segment
ids: code, not tiles, that differs between calls of one family). A row covers (target, backend, 16-bit or
float32, mode, family, head dim, Dv equal to D or not, outcome); the family is the grid's feature (a window,
GQA, a dense bias, a flex hook, ...), and head dims under 64 count as 64 (they take its tiles: a rule of their
own makes their plan differ, and then they get a row).

The probe space is the grid (variants.py `_grid_variants`) and, from each of its calls, one argument moved at a
time to another value a user may pass (`_deviations`): float16 for bfloat16, head dim 16 and 32 for 64,
sequence lengths 77 / 600 / 3000 / 8192 (ragged tails, tiles that shrink, the seed's longest), keys longer and
shorter than queries, GQA 8:2 for a call without it and 8:1 / 8:4 for one with it, key / value batch 1, Dv
128 / 256 beside D, other windows, broadcast bias and mask shapes. A new rule in a backend's plan that any of
these reaches gives its calls a plan no row has, so the registry grows by a row that compiles it, without a
line here; a rule that goes away drops the rows only it made, and the compile check then fails on the
committed record's rows the registry lost (`check.retired_problems`) until the record is made again.

On `SUBSET_TARGETS` (sm_100a, sm_89, sm_120) only the registry's subset is compiled: there a probe becomes a
row where its plan differs from its plan on the reference target of that class (sm_90a for sm_100a, sm_86 for
the others): the generation's own rules. sm_100a (`WHOLE_TARGETS`) compiles every Triton plan all the same, as
a full target does; its backend "mosaic" rows are those whose plan differs from backend "triton"'s there.

Deriving plans every call costs about a minute; `derived_rows()` keeps them in a cache folder keyed by the
source of the kernels and of the registry, and derives in a subprocess on the CPU (a worker lists the
registry before it imports jax). `python plan_space.py derive` prints the rows and what each one covers. The
decode kernel's rows are derived beside these, from its own planner (`decode_space.py`), into the same cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from plan_trace import _device, first_results  # this folder's (tests read plan_space._device)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REFERENCE_TARGET = {"sm100a_b200": "sm90a_h100", "sm89_rtx4090": "sm86_rtx3090", "sm120_rtx5090": "sm86_rtx3090"}
MODES = ("fwd+bwd", "jvp")


@dataclasses.dataclass(frozen=True)
class Probe:
    """One call of the probe space, without its mode (a plan holds every pass). `builder` is "flash" or "flex"
    (variants.py's builders, the grid's) or "shaped" (`shaped_flash`: arguments those builders lack);
    `options` their keyword arguments, sorted (key, value) pairs of JSON values."""

    family: str
    stem: str  # the name without its mode: "{prefix}_{mode}_d{D}_{dtype}_{feature}{suffix}" takes the mode
    builder: str
    options: tuple
    backend: str
    dtype: str
    head_dim: int
    value_dim: int
    seed: bool = False  # a call of the grid (in the modes the grid compiles it: a row whatever its plan)
    forced: bool = False  # a row on the full targets whatever its plan (`FORCED`)

    def name(self, mode: str) -> str:
        return self.stem.replace("{mode}", "grad" if mode == "fwd+bwd" else mode)

    def variant(self, mode: str, targets: tuple, requires: tuple):
        import variants as registry

        options = dict(self.options)
        name = self.name(mode)
        if self.builder == "flash":
            return registry.flash(name, mode=mode, requires=requires, targets=targets, **options)
        if self.builder == "flex":
            return registry.flex(name, options.pop("hook"), mode=mode, requires=requires, targets=targets,
                                 **options)
        return shaped_flash(name, mode=mode, requires=requires, targets=targets, **options)


def shaped_flash(name: str, *, head_dim=128, dtype="bf16", mode="fwd+bwd", backend="triton", q_len=1024,
                 kv_heads=8, kv_batch=4, bias=None, mask=None, causal=True, requires=(), targets=()):
    """A `flash_attention` call with the arguments variants.py's `flash` does not take: key / value batch
    `kv_batch` (1: shared by every query batch), a bias of a broadcast shape ("keys": [B, 1, 1, S], a key
    padding bias; "heads": [1, N, T, S]; "rows": [1, N, T, 1]; "same" / "f32": [B, N, T, S] in the inputs' dtype /
    float32) with its gradient, a mask of a broadcast shape ("keys": [B, 1, 1, S]; "head_keys": [B, N, 1, S];
    True: [B, 1, T, S])."""
    import variants as registry

    batch, heads = registry.B, registry.N
    full = (batch, heads, q_len, q_len)
    bias_shapes = {"same": full, "f32": full, "keys": (batch, 1, 1, q_len), "heads": (1, heads, q_len, q_len),
                   "rows": (1, heads, q_len, 1)}
    mask_shapes = {True: (batch, 1, q_len, q_len), "keys": (batch, 1, 1, q_len), "head_keys": (batch, heads, 1, q_len)}

    def build():
        import jax.numpy as jnp
        from probjax_kernels import FlashConfig, flash_attention

        dt = registry.dtype_of(dtype)
        specs = [registry._spec((batch, q_len, heads, head_dim), dt)]
        specs += [registry._spec((kv_batch, q_len, kv_heads, head_dim), dt)] * 2
        grad_args = (0, 1, 2)
        if bias:
            grad_args += (len(specs),)
            specs.append(registry._spec(bias_shapes[bias], jnp.float32 if bias == "f32" else dt))
        if mask:
            specs.append(registry._spec(mask_shapes[mask], jnp.bool_))

        def attend(q, k, v, *rest):
            rest = list(rest)
            extra = dict(bias=rest.pop(0) if bias else None, mask=rest.pop(0) if mask else None)
            return flash_attention(q, k, v, causal=causal, config=FlashConfig(backend=backend), **extra)

        return registry._wrap(mode, attend, len(specs), grad_args), specs

    return registry.Variant(name, backend, build, head_dim, dtype, mode, backend, q_len, q_len,
                            requires=tuple(requires), targets=tuple(targets))


# ------------------------------------------------------------------------------------------- the probe space

def _options(**kwargs) -> tuple:
    return tuple(sorted(kwargs.items()))


def grid_probes() -> list[Probe]:
    """The grid's calls (variants.py `_grid_variants`, `_call`) as probes, one per mode pair."""
    import variants as registry

    out = []
    for backend in ("triton", "mosaic"):
        for dtype in ("bf16", "f32"):
            features = ["full", "causal", "window", "gqa8to2_causal", "dv64", "dropout", "segments_lengths",
                        "dense_bias", *(("dense_bias_f32",) if dtype != "f32" else ()), "dense_mask",
                        *registry.FLEX_HOOKS]
            if backend == "mosaic" and dtype == "f32":
                features = ["full", "causal"]
            for d in (64, 128, 256):
                for feature in features:
                    if not (feature == "dv64" and d == 64):
                        out.append(_probe(backend, dtype, d, feature, seed=True))
    return out


def _probe(backend, dtype, d, feature, seed=False, suffix="", changes=None, label=None) -> Probe:
    """The probe of the grid call (backend, dtype, head dim d, feature), with `changes` to its builder's
    options and `suffix` to its name."""
    import variants as registry

    hook = feature in registry.FLEX_HOOKS
    prefix = ("mosaic_" if backend == "mosaic" else "") + ("flex" if hook else "flash")
    prefix = "mosaic" if prefix == "mosaic_flash" else prefix
    if hook:
        options = dict(hook=feature, head_dim=d, dtype=dtype, backend=backend)
        builder = "flex"
    else:
        options = dict(head_dim=d, dtype=dtype, backend=backend, **registry._flash_options(feature))
        builder = "flash"
    options.update(changes or {})
    shaped = options.get("bias") in ("keys", "heads", "rows") or options.get("mask") in ("keys", "head_keys")
    if "kv_batch" in options or shaped:
        builder = "shaped"
    dim = options.get("head_dim", d)
    stem = f"{prefix}_{{mode}}_d{dim}_{options['dtype']}_{label or feature}{suffix}"
    return Probe(feature, stem, builder, _options(**options), backend, options["dtype"], dim,
                 options.get("value_dim") or dim, seed, stem.replace("{mode}", "grad") in FORCED)


def _deviations(probe: Probe) -> list[Probe]:
    """The calls one argument away from a grid call (see the module docstring)."""
    options = dict(probe.options)
    backend, dtype, d, family = probe.backend, probe.dtype, probe.head_dim, probe.family
    flash = probe.builder == "flash"

    def moved(suffix, label=None, **changes):
        return _probe(backend, dtype, d, family, suffix=suffix, changes=changes, label=label)

    out = []
    if dtype == "bf16":
        out.append(moved("", dtype="f16"))
    if d == 64:
        out += [moved("", head_dim=16), moved("", head_dim=32)]
    for seq in ((77, 600, 3000, 8192) if flash else (600, 3000, 8192)):
        out.append(moved(f"_T{seq}", q_len=seq))
    if flash:
        out += [moved("_S2048", kv_len=2048), moved("_S512", kv_len=512)]
        if family == "causal":
            out.append(moved("_softcap", logits_soft_cap=30.0))
        if options.get("kv_heads", 8) == 8:
            out.append(moved("_gqa8to2", kv_heads=2))
        else:
            out += [moved("_gqa8to1", kv_heads=1), moved("_gqa8to4", kv_heads=4)]
        if family == "dv64" and d == 128:
            out.append(moved("", label="dv256", value_dim=256))
        if family == "dv64" and d == 256:  # D 192 pads to 256: MLA's query / key head dim, Dv 128
            out += [moved("", label="dv128", value_dim=128), moved("", label="dv128", head_dim=192, value_dim=128)]
        if family == "window":
            out += [moved("_w128r128", window=(128, 128)), moved("_w1024", window=(1024, 0)),
                    moved("_w0r256", window=(0, 256))]
    if family in ("full", "causal", "dense_bias", "dense_mask") and flash:
        causal = family != "full"
        out.append(moved("_kvbatch1", kv_batch=1, causal=causal))
    if family == "dense_bias" and dtype != "f32":
        out += [moved("_keys", bias="keys", causal=False), moved("_heads", bias="heads", causal=False),
                moved("_rows", bias="rows", causal=False)]
    if family == "dense_mask":
        out += [moved("_keys", mask="keys", causal=False), moved("_headkeys", mask="head_keys", causal=False)]
    return out


# Calls that are rows whatever their plans (on the full targets; on the others where their plan is the
# generation's own): the paths a user reaches whose kernels' code, not tiles, differ from every grid call's (the
# plan of each equals a grid call's today), and the seed's longest sequence for the families the grid compiles
# at 1024 alone. Each is a call of the probe space (`_deviations`), named as it names them.
FORCED = {
    "flash_grad_d32_bf16_causal": "head dim 32 (the LM example's tiny preset)",
    "flash_jvp_d32_bf16_causal": "head dim 32, the tangent",
    "flash_grad_d192_bf16_dv128": "MLA's head dims: D 192 (padded to 256), Dv 128",
    "flash_grad_d128_bf16_causal_S2048": "keys longer than queries",
    "flash_grad_d128_bf16_causal_softcap": "logits_soft_cap (a score_mod of flash_attention)",
    "flash_grad_d128_bf16_causal_kvbatch1": "key / value batch 1 against 4 query batches",
    "flash_grad_d128_bf16_dense_bias_keys": "a key padding bias [B, 1, 1, S] with its gradient",
    "flash_grad_d128_bf16_dense_bias_heads": "a bias [1, N, T, S] with its gradient",
    "flash_grad_d128_bf16_dense_mask_keys": "a key mask [B, 1, 1, S]",
    "flash_grad_d128_bf16_gqa8to2_causal_gqa8to1": "MQA (GQA 8:1)",
    "flash_grad_d128_bf16_window_w128r128": "a two-sided window",
    "flash_grad_d128_f16_causal": "float16 at head dim 128",
    "flash_grad_d256_bf16_causal_T8192": "head dim 256 at the seed's longest sequence",
    "flash_grad_d64_f32_causal_T8192": "float32 at the seed's longest sequence",
    "flash_grad_d128_f32_causal_T8192": "float32 at the seed's longest sequence",
    "flash_grad_d256_f32_causal_T8192": "float32 at the seed's longest sequence",
    "flex_grad_d128_bf16_softcap_T8192": "a score_mod at the seed's longest sequence",
    "flex_grad_d128_bf16_document_mask_T8192": "a BlockMask at the seed's longest sequence",
    "mosaic_grad_d64_bf16_causal_T8192": "Mosaic GPU at the seed's longest sequence",
    "mosaic_grad_d128_bf16_causal_T8192": "Mosaic GPU at the seed's longest sequence",
    "mosaic_grad_d256_bf16_causal_T8192": "Mosaic GPU at the seed's longest sequence",
    "mosaic_grad_d128_bf16_causal_kvbatch1": "Mosaic GPU with key / value batch 1 (dK / dV summed over the batch)",
}


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): head dims and row tiles as the planners pad them."""
    return 1 << max(n - 1, 0).bit_length()


def with_deviations(seeds: list, deviations, key) -> list:
    """`seeds`, then the `deviations(seed)` of each, every `key` once, in a fixed order (the first probe of a new
    plan names its row)."""
    out, seen = list(seeds), {key(p) for p in seeds}
    for seed in seeds:
        for moved in deviations(seed):
            if key(moved) not in seen:
                seen.add(key(moved))
                out.append(moved)
    return out


def probes() -> list[Probe]:
    """The whole probe space: the grid's calls, then the calls one argument away from them."""
    return with_deviations(grid_probes(), _deviations, lambda probe: probe.stem)


# ------------------------------------------------------------------------------------------------ the plans

def plans_of(probe: Probe, targets) -> dict:
    """The `_dispatch.plan` of the probe's call on each of the targets (its forward traced until the plan is
    made, once for all of them: `first_results`)."""
    from probjax_kernels import _dispatch

    fn, specs = probe.variant("fwd", (), ()).build()
    made = first_results(fn, specs, _dispatch, "plan", {target: _device(target) for target in targets})
    if any(plan is None for plan in made.values()):
        raise RuntimeError(f"{probe.stem}: the call never reached _dispatch.plan")
    return made


def plan_of(probe: Probe, target: str):
    """The `_dispatch.plan` of the probe's call on the target."""
    return plans_of(probe, (target,))[target]


def outcome(plan, mode: str) -> tuple:
    """What the plan compiles in `mode`: each pass's kernel entry, tiles, warps, stages, dK/dV orientation and
    grid, its options (a second kernel's tiles, the tangent's value splits) and, for a Mosaic GPU pass, how its
    kernels read the bias and the mask."""
    from probjax_kernels._problem import _Problem

    def tiles(problem):
        c = problem.config
        return (c.block_q, c.block_k, c.block_q_dkv, c.block_k_dkv, c.block_q_dq, c.block_k_dq, c.num_warps,
                c.num_stages, problem.dkv_transposed, problem.dkv_per_query_head, problem.dkv_split)

    def inputs(kernel_pass) -> tuple:
        """How the Mosaic GPU kernels read the call's bias and mask (their code, not their tiles, differs)."""
        problem = kernel_pass.problem
        if not kernel_pass.run.__module__.endswith("mosaic.glue"):
            return ()
        from probjax_kernels.mosaic import glue
        from probjax_kernels.mosaic.common import bias_kind

        bias = problem.mask_shape if glue.mask_as_bias(problem) else problem.bias_shape
        mask = "vector" if glue.vector_mask(problem) else None if glue.mask_as_bias(problem) else problem.mask_shape
        return (None if bias is None else bias_kind(bias), mask is not None and (mask == "vector" or "dense"))

    passes = (plan.forward, plan.backward if mode == "fwd+bwd" else plan.tangent)
    return tuple((f"{p.run.__module__}.{p.run.__qualname__}", tiles(p.problem),
                  tuple((k, tiles(v) if isinstance(v, _Problem) else v) for k, v in p.options), *inputs(p))
                 for p in passes)


def _mosaic_targets(targets: tuple[str, ...]) -> tuple[str, ...]:
    """The targets whose GPU backend "mosaic" plans for (`mosaic.plan.refuse_target` refuses the others)."""
    from probjax_kernels import FlashConfig
    from probjax_kernels.mosaic.plan import refuse_target

    out = []
    for target in targets:
        try:
            refuse_target(FlashConfig(backend="mosaic"), _device(target))
        except NotImplementedError:
            continue
        out.append(target)
    return tuple(out)


def _triton_twin(probe: Probe) -> Probe:
    """The probe's call on backend "triton" (its plan, not its name, is what is read of it)."""
    options = _options(**{**dict(probe.options), "backend": "triton"})
    return dataclasses.replace(probe, backend="triton", options=options)


def _key(probe: Probe, target: str, mode: str, what: tuple) -> str:
    sixteen = "f32" if probe.dtype == "f32" else "16-bit"
    same_value_dim = probe.value_dim == probe.head_dim
    return json.dumps([target, probe.backend, sixteen, mode, probe.family, max(probe.head_dim, 64),
                       same_value_dim, what])


def derive(targets: tuple[str, ...] | None = None) -> list[dict]:
    """The rows the plans add: each probe whose plan compiles, in some mode on some target, what no row before it
    compiles there (see the module docstring), with the targets it is a row for, its mode and the keys it
    covers. A grid call (`seed`) is a row on the full targets already: it appears here only for a subset target
    its plan needs."""
    import variants as registry

    targets = targets or registry.FULL_TARGETS + registry.SUBSET_TARGETS
    space, grid = probes(), {v.name for v in registry._grid_variants()}
    covered, rows = set(), {}

    def add(probe, target, mode, key):
        covered.add(key)
        row = rows.setdefault(probe.name(mode), dict(probe=dataclasses.asdict(probe), mode=mode, targets=[],
                                                     covers=[]))
        row["targets"].append(target)
        row["covers"].append(key)

    planned = tuple(dict.fromkeys(targets + tuple(REFERENCE_TARGET[t] for t in targets if t in REFERENCE_TARGET)))
    mosaic_targets = _mosaic_targets(planned)
    # Every probe's plan on every target and reference target it is planned on, made once.
    plans_on = {probe: plans_of(probe, [t for t in planned if probe.backend != "mosaic" or t in mosaic_targets])
                for probe in space}

    def plans(target: str) -> dict:  # every probe's plan on the target, in the probe space's order
        return {probe: made[target] for probe, made in plans_on.items() if target in made}

    def base_plan(probe, target, reference):
        """What the probe's plan on `target` is compared with: its plan on the reference target (the
        generation's own rules make a row); for backend "mosaic" on a generation whose Mosaic kernels are its
        own, the plan of the same call on backend "triton" there (a call they leave wholly to Triton adds no
        row)."""
        if probe.backend == "mosaic":
            return plan_of(_triton_twin(probe), target)
        return plans(reference)[probe]

    for target in targets:
        reference = REFERENCE_TARGET.get(target)
        for probe, plan in plans(target).items():
            for mode in MODES:  # the rows compiled on this target whatever the plans: they cover first
                variant = probe.variant(mode, (), ())
                on_target = (reference is None or registry._on_subset_targets(variant)
                             or (target in registry.WHOLE_TARGETS and registry._whole_row(variant)))
                if probe.name(mode) in grid and on_target:
                    covered.add(_key(probe, target, mode, outcome(plan, mode)))
        for probe, plan in plans(target).items():
            # On a whole target every Triton plan no row covers there is a row (`variants.WHOLE_TARGETS`).
            whole = target in registry.WHOLE_TARGETS and probe.backend != "mosaic"
            base = base_plan(probe, target, reference) if reference and not whole else None
            for mode in MODES:
                what = outcome(plan, mode)
                key = _key(probe, target, mode, what)
                forced = probe.name(mode) in FORCED and base is None
                if not forced and (key in covered or (base is not None and what == outcome(base, mode))):
                    continue
                add(probe, target, mode, key)
    return list(rows.values())


# ------------------------------------------------------------------------------------------------ the cache

def _source_key() -> str:
    """A hash of what the plans depend on: the kernels' source, the registry and this file, the targets."""
    files = sorted((REPO / "kernels").rglob("*.py")) + [HERE / "variants.py", Path(__file__).resolve(),
                                                         HERE / "figures.py", HERE / "serving_step.py",
                                                         HERE / "decode_space.py", HERE / "ragged_space.py",
                                                         HERE / "plan_trace.py"]
    files += sorted((HERE / "gpu_targets").glob("*.txtpb"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_folder() -> Path:
    """Where derived rows are kept: $PROBJAX_PLAN_SPACE_CACHE, else the user's cache folder."""
    folder = os.environ.get("PROBJAX_PLAN_SPACE_CACHE")
    if folder:
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "probjax-plan-space"


def derived_rows() -> list[dict]:
    """`derive()`'s rows for this checkout (`_cached_rows`)."""
    return [row for row in _cached_rows() if "decode" not in row and "ragged" not in row]


def derived_decode_rows() -> list[dict]:
    """`decode_space.derive()`'s rows for this checkout (`_cached_rows`)."""
    return [row for row in _cached_rows() if "decode" in row]


def derived_ragged_rows() -> list[dict]:
    """`ragged_space.derive()`'s rows for this checkout (`_cached_rows`)."""
    return [row for row in _cached_rows() if "ragged" in row]


def _cached_rows() -> list[dict]:
    """The flash, decode and ragged rows for this checkout, from the cache or derived in a subprocess on the CPU (one
    process at a time: concurrent callers wait for the first)."""
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_source_key()}.json"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as out:
                pass
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            env.pop("XLA_FLAGS", None)
            result = subprocess.run([sys.executable, __file__, "derive", "--out", out.name], env=env,
                                    capture_output=True, text=True)
            if result.returncode:
                Path(out.name).unlink(missing_ok=True)
                raise RuntimeError(f"plan_space.py derive failed:\n{result.stderr[-4000:]}")
            os.replace(out.name, path)
    return json.loads(path.read_text())


def probe_of(row: dict) -> Probe:
    """The probe of a derived row (its JSON form: lists where the probe holds tuples)."""
    options = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in row["probe"]["options"])
    return Probe(**dict(row["probe"], options=options))


def planned_rows(out: list) -> list:
    """`out` with the rows of plan_space.py: calls whose plan (kernels, tiles, dK/dV grid, splits) on a target
    is one no row compiles there, and the calls of `plan_space.FORCED`; and decode and ragged calls whose plan by
    their kernel's planner no row before them has (`decode_space`, `ragged_space`). A row of `out` of the same
    name takes the targets; a new one requires the kernels `required_kernels` names for its family, on each
    target (backend "mosaic" runs Blackwell's kernels there: `Variant.requires_on`)."""
    import variants as registry

    import decode_space
    import ragged_space

    out, index = list(out), {v.name: i for i, v in enumerate(out)}
    own_space = [(decode_space, row) for row in derived_decode_rows()]
    own_space += [(ragged_space, row) for row in derived_ragged_rows()]
    for space, row in own_space:
        variant = space.probe_of(row).variant(tuple(row["targets"]))
        assert variant.name not in index, f"{variant.name}: a row named twice"
        index[variant.name] = len(out)
        out.append(variant)
    for row in derived_rows():
        probe, mode = probe_of(row), row["mode"]
        name = probe.name(mode)
        options = dict(probe.options)
        feature = "kv_batch1" if options.get("kv_batch") == 1 else probe.family
        if options.get("mask") == "keys":  # a key padding mask: a vector the Mosaic kernels take, unlike [B, 1, T, S]
            feature = "dense_mask_keys"
        if options.get("mask") == "head_keys":  # a key mask per head: a 0 / -inf bias in the Mosaic kernels
            feature = "dense_mask_head_keys"
        if options.get("bias") in ("keys", "rows"):  # float32 vectors in the Mosaic kernels, unlike bias tiles
            feature = f"dense_bias_{options['bias']}"
        if options.get("logits_soft_cap"):  # a score_mod, as flex's softcap (the Mosaic backward's hooks)
            feature = "softcap"

        def requires(target=None):
            return registry.required_kernels(probe.backend, probe.dtype, probe.head_dim, mode, feature,
                                             probe.value_dim, target)

        if name in index:
            v = out[index[name]]
            targets = tuple(t for t in row["targets"] if t not in v.targets)
        else:
            v = probe.variant(mode, (), requires())
            index[name] = len(out)
            out.append(v)
            targets = tuple(row["targets"])
        own = tuple((t, requires(t)) for t in targets if probe.backend == "mosaic" and t in registry.BLACKWELL)
        out[index[name]] = dataclasses.replace(v, targets=v.targets + targets, requires_on=v.requires_on + own)
    return out


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["derive"])
    parser.add_argument("--out", help="write the rows here as JSON (default: print a summary)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from kernel_tiles import _import_kernels

    with contextlib.suppress(ImportError):
        import probjax_kernels  # noqa: F401 - installed (the project's venv)
    if "probjax_kernels" not in sys.modules:
        _import_kernels()  # a toolchain venv: the checkout's kernels/
    import warnings

    warnings.filterwarnings("ignore")
    import decode_space
    import ragged_space
    import variants as registry

    targets = registry.FULL_TARGETS + registry.SUBSET_TARGETS
    rows = derive() + decode_space.derive(targets, _device) + ragged_space.derive(targets, _device)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    else:
        for row in rows:
            name = (decode_space.probe_of(row).name if "decode" in row else ragged_space.probe_of(row).name
                    if "ragged" in row else probe_of(row).name(row["mode"]))
            print(name, ",".join(row["targets"]))
        print(f"{len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
