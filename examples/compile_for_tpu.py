"""Compile train_lm.py's training step and its batched generation for TPU pod slices, without a TPU.

    JAX_PLATFORMS=cpu python examples/compile_for_tpu.py                      # the three slices below
    JAX_PLATFORMS=cpu python examples/compile_for_tpu.py --slices v5e:2x2=data=2,seq=2 --head-dims 128 \\
        --seq-lens 2048 --json slices.json

Needs `jax[tpu]` (libtpu) beside the examples' packages; no chip: XLA compiles the whole multi-chip program
for the slice's topology (`jax.experimental.topologies`, deviceless ahead-of-time compilation). The shapes
are the benchmark presets' (`--preset bench-hd64` / `bench-hd128`: 8 layers, 8 heads, head dim 64 / 128,
bfloat16) with batch 4 per data shard and `--attention pallas` (the Mosaic TPU kernels, which "auto" picks
too on a TPU, deviceless compiles included). For each (slice, mesh, head dim, sequence length) it compiles

- the training step of train.py (`make_steps`: loss, gradient and AdamW update, donated params and optimiser
  state) on the slice's mesh, params and optimiser state sharded as a run shards them, the batch split over
  "data"; with a "seq" axis attention runs as a ring (`AttentionConfig.context_axis`) whose blocks are the
  TPU kernels;
- the batched generation of sampling.py (`batch_generator`: a prefill of 4 prompts of the whole sequence
  length, then 64 paged decode steps) on one chip, as a run samples after training (decoding runs
  unsharded), with the bfloat16 params;

and records per chip the HBM that XLA plans (arguments, outputs, temporaries) against the chip's capacity,
the collectives of the step, the Mosaic TPU kernels (`tpu_custom_call`) and the compile time (wall seconds
of tracing, lowering and XLA's compile, and the CPU seconds of the three). `--shard I/N` compiles every N-th
case only, so that N processes share them. `--reuse FILE` (an earlier `--json`) skips XLA's compile of a
program whose lowered module is the one FILE's row compiled (the same fingerprint: the module with its
kernels, jax, jaxlib and libtpu) and takes that row's figures; `--verify K` compiles K of those programs all
the same and fails one whose figures differ.
`scripts/compile/tpu_slices.py` runs it for the compile check and checks the figures; docs/tpu.md ("Pod
slices") shows them. What it proves: the programs compile for the slice and fit its chips' HBM as XLA plans
them. What it does not: that they run, or how fast.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import inspect
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402

from lm.config import make_config, parse_mesh  # noqa: E402
from lm.sampling import batch_generator  # noqa: E402
from lm.train import Shardings, build_model, make_optimizer, make_steps  # noqa: E402

# (topology, mesh) of the slices the compile check covers: the ring over ICI on v5e, tensor parallelism on
# v5p, data parallelism on v6e.
SLICES = (("v5e:2x2", "data=2,seq=2"), ("v5p:2x2x1", "data=2,model=2"), ("v6e:2x2", "data=4"))
HEAD_DIMS = (64, 128)
SEQ_LENS = (2048, 8192)
# HBM per chip, GiB (Cloud TPU system architecture pages): what the plan of one chip must fit in.
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
BATCH_PER_DATA_SHARD = 4
GENERATE_BATCH, GENERATE_TOKENS = 4, 64
COLLECTIVES = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")
_COLLECTIVE = re.compile(r" (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_KERNEL = re.compile(r'custom_call_target="tpu_custom_call"')
_SHAPE = re.compile(r"[a-z]+[0-9]*\[[0-9,]*\]")  # an HLO array type, bf16[4,1024,8,128]


def generation(topology: str) -> str:
    return topology.split(":")[0]


def abstract_model(config):
    """The model of `config` with its params as ShapeDtypeStructs: traced abstractly, nothing allocated."""
    built = {}

    def params(key):
        built["model"] = build_model(config, key)
        return built["model"].params

    shapes = jax.eval_shape(params, jax.random.key(config.seed))
    return dataclasses.replace(built["model"], params=shapes)


def slice_mesh(topology: str, mesh_flag: str) -> Mesh:
    """`mesh_flag`'s mesh (train.make_mesh's axes and order) over the devices of the slice `topology`."""
    axes = parse_mesh(mesh_flag)
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    size = axes["data"] * axes["seq"] * axes["model"]
    if size != len(topo.devices):
        raise ValueError(f"mesh {mesh_flag!r} has {size} devices, the slice {topology} {len(topo.devices)}.")
    devices = topologies.make_mesh(topo, tuple(axes.values()), tuple(axes)).devices
    return Mesh(devices, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def _specs(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _compile(function, args, capacity: int, earlier: dict | None = None) -> dict:
    """The figures (`_figures`) of `function` (a jitted function) traced, lowered for TPU and compiled by XLA
    for `args`' shardings, with the wall seconds of each stage and the CPU seconds of the whole (all threads):
    where the check's time goes, and how much of it a busy machine stretches. When `earlier` (the same
    program's figures from an earlier run) has the lowered module's fingerprint, those figures, uncompiled."""
    times, cpu = [time.perf_counter()], time.process_time()
    traced = function.trace(*args)
    times.append(time.perf_counter())
    lowered = traced.lower(lowering_platforms=("tpu",))
    times.append(time.perf_counter())
    fingerprint = _fingerprint(lowered.as_text())
    if earlier and earlier.get("fingerprint") == fingerprint and "error" not in earlier:
        return dict(earlier, reused=True)
    compiled = lowered.compile()
    times.append(time.perf_counter())
    stages = dict(zip(("trace", "lower", "compile"), (round(b - a, 1) for a, b in zip(times, times[1:]))))
    return dict(_figures(compiled, dict(stages, cpu=round(time.process_time() - cpu, 1)), capacity),
                fingerprint=fingerprint)


def _fingerprint(module: str) -> str:
    """The identity of a compile: the lowered StableHLO text (the Mosaic TPU kernels' IR inside it, in base64,
    with their source locations) under jax's, jaxlib's and libtpu's versions and the code that reads the
    figures; the checkout's and the Python environment's folders (they differ between machines) left out."""
    from importlib import metadata

    roots = {str(Path(__file__).resolve().parents[1]), sys.prefix, str(Path(sys.prefix).resolve())}

    def without_roots(text: str) -> str:
        for root in roots:
            text = text.replace(root, "<root>")
        return text

    def kernel(match) -> str:  # a tpu_custom_call's body: the Mosaic module, base64-encoded
        body = without_roots(base64.b64decode(match.group(1)).decode("latin-1"))
        return f"body {hashlib.sha256(body.encode('latin-1')).hexdigest()}"

    module = without_roots(re.sub(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", kernel, module))
    versions = [metadata.version(name) for name in ("jax", "jaxlib", "libtpu")]
    return hashlib.sha256("\n".join([*versions, inspect.getsource(_figures), module]).encode()).hexdigest()[:32]


def _figures(compiled, stages: dict, capacity: int) -> dict:
    """Per-chip HBM, collectives and kernels of one compiled program; `stages`: the wall seconds of tracing,
    lowering and XLA's compile (compile_s is their sum) and the CPU seconds of the three ("cpu")."""
    seconds = sum(value for name, value in stages.items() if name != "cpu")
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    collectives = {name: 0 for name in COLLECTIVES}
    shapes: dict[str, set] = {name: set() for name in COLLECTIVES}
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            collectives[match.group(1)] += 1
            result = _SHAPE.search(line[: match.start()])
            shapes[match.group(1)].add(result.group(0) if result else "?")
    hbm = dict(
        arguments=memory.argument_size_in_bytes, outputs=memory.output_size_in_bytes,
        temp=memory.temp_size_in_bytes, alias=memory.alias_size_in_bytes,
        generated_code=memory.generated_code_size_in_bytes,
    )
    # Donated arguments alias their outputs: count those bytes once.
    hbm["total"] = hbm["arguments"] + hbm["outputs"] - hbm["alias"] + hbm["temp"] + hbm["generated_code"]
    return dict(compile_s=round(seconds, 1), stages_s=stages, hbm=hbm, capacity=capacity, collectives=collectives,
                collective_shapes={name: sorted(found) for name, found in shapes.items() if found},
                tpu_kernels=len(_KERNEL.findall(text)))


def compile_case(topology: str, mesh_flag: str, head_dim: int, seq_len: int,
                 programs=("train", "generate"), earlier: dict | None = None) -> dict:
    """One row of the report: the training step and the batched generation (`programs`) of one slice and shape;
    `earlier`: this case's row of an earlier run, whose programs' figures stand where their fingerprint does."""
    earlier = earlier or {}
    start = time.perf_counter()
    axes = parse_mesh(mesh_flag)
    config = make_config(f"bench-hd{head_dim}", dict(
        seq_len=seq_len, batch_size=BATCH_PER_DATA_SHARD * axes["data"], attention="pallas", mesh=mesh_flag,
    ))
    capacity = HBM_GIB[generation(topology)] * 2**30
    row = dict(topology=topology, mesh=mesh_flag, head_dim=head_dim, seq_len=seq_len, batch=config.batch_size,
               layers=config.num_layers, heads=config.num_heads, dtype=config.dtype)
    mesh = slice_mesh(topology, mesh_flag)
    row["device_kind"] = mesh.devices.flat[0].device_kind
    model = abstract_model(config)
    row["params"] = sum(x.size for x in jax.tree.leaves(model.params))
    optimizer = make_optimizer(config)
    row["setup_s"] = round(time.perf_counter() - start, 1)  # the config, the slice's mesh, the abstract model
    if "train" in programs:
        row["train"] = _compile_train(config, mesh, model, optimizer, capacity, earlier.get("train"))
    if "generate" in programs:
        row["generate"] = _compile_generation(config, mesh.devices.flat[0], model, capacity,
                                              earlier.get("generate"))
    return row


def _compile_train(config, mesh: Mesh, model, optimizer, capacity: int, earlier: dict | None = None) -> dict:
    """train.make_steps' step on the slice's mesh, params and optimiser state sharded as train.run shards them."""
    seq_len = config.seq_len
    try:
        # optax builds the optimiser state's shardings with eager ops (jnp.zeros): these run on the host's
        # device, outside the slice's mesh and device (which cannot execute anything).
        shardings = Shardings.on(mesh, model, optimizer)
        params = _specs(model.params, shardings.params)
        opt_state = _specs(jax.eval_shape(optimizer.init, model.params), shardings.opt_state)
        batch = jax.ShapeDtypeStruct((config.batch_size, seq_len + 1), jnp.int32, sharding=shardings.batch)
        # The slice's device as the default: the kernels' dispatch then picks the Mosaic TPU backend.
        with jax.default_device(mesh.devices.flat[0]), jax.set_mesh(mesh):
            train_step, _ = make_steps(model, optimizer, config, shardings)
            return _compile(train_step, (params, opt_state, batch), capacity, earlier)
    except Exception as error:  # noqa: BLE001 - a failed compile is a row of the report
        return dict(error=f"{type(error).__name__}: {str(error)[:800]}")


def _compile_generation(config, device, model, capacity: int, earlier: dict | None = None) -> dict:
    """sampling.batch_generator's program on one chip, its params in the compute dtype as train.run samples."""
    try:
        sharding = SingleDeviceSharding(device)
        dtype = jnp.dtype(config.dtype)
        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
                                           sharding=sharding), model.params,
        )
        tokens = jax.ShapeDtypeStruct((GENERATE_BATCH, config.seq_len), jnp.int32, sharding=sharding)
        lengths = jax.ShapeDtypeStruct((GENERATE_BATCH,), jnp.int32, sharding=sharding)
        key = jax.eval_shape(jax.random.key, 0)
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding)
        with jax.default_device(device):
            run = batch_generator(model, config.seq_len + GENERATE_TOKENS, GENERATE_TOKENS,
                                  temperature=config.temperature)
            figures = _compile(run, (params, tokens, lengths, key), capacity, earlier)
        figures.update(batch=GENERATE_BATCH, prompt=config.seq_len, new_tokens=GENERATE_TOKENS)
        return figures
    except Exception as error:  # noqa: BLE001
        return dict(error=f"{type(error).__name__}: {str(error)[:800]}")


def _check_reproduced(figures: dict, earlier: dict) -> None:
    """A program compiled again although `earlier` had its fingerprint: the same figures, or an error in it."""
    if "error" in figures or figures.get("fingerprint") != earlier.get("fingerprint"):
        return
    same = ("hbm", "collectives", "collective_shapes", "tpu_kernels")
    if all(figures.get(name) == earlier.get(name) for name in same):
        figures["reproduced"] = True
    else:
        figures["error"] = (f"the lowered module of the earlier run's figures compiled to others: "
                            f"{ {n: figures.get(n) for n in same} } vs { {n: earlier.get(n) for n in same} }")[:800]


def _slice(text: str) -> tuple[str, str]:
    topology, _, mesh = text.partition("=")
    if not mesh:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOPOLOGY=MESH, e.g. v5e:2x2=data=2,seq=2")
    return topology, mesh


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N with 0 <= I < N, e.g. 0/2")
    return int(index), int(count)


def _describe(row: dict) -> str:
    def part(name):
        figures = row.get(name)
        if figures is None:
            return ""
        if "error" in figures:
            return f" | {name} FAILED: {figures['error'][:200]}"
        hbm = figures["hbm"]
        used = ", ".join(f"{k} {v}" for k, v in figures["collectives"].items() if v)
        return (f" | {name}: {figures['compile_s']} s, HBM args {hbm['arguments'] / 2**30:.2f} GiB temp "
                f"{hbm['temp'] / 2**30:.2f} GiB total {hbm['total'] / 2**30:.2f} / {figures['capacity'] / 2**30:.0f} "
                f"GiB, {figures['tpu_kernels']} TPU kernels, collectives: {used or 'none'}")

    return f"{row['topology']} {row['mesh']} hd{row['head_dim']} T={row['seq_len']}" + part("train") + part("generate")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slices", nargs="*", type=_slice, default=list(SLICES), metavar="TOPOLOGY=MESH")
    parser.add_argument("--head-dims", nargs="*", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--seq-lens", nargs="*", type=int, default=list(SEQ_LENS))
    parser.add_argument("--programs", nargs="*", choices=("train", "generate"), default=["train", "generate"])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N",
                        help="compile only every N-th (slice, head dim, seq) case from the I-th (0-based): N "
                        "processes with I = 0..N-1 share the cases")
    parser.add_argument("--reuse", type=Path, help="an earlier --json report: a program whose lowered module has "
                        "the fingerprint of its row there takes that row's figures, uncompiled")
    parser.add_argument("--verify", type=int, default=0, help="with --reuse: compile this many of the programs "
                        "it could reuse (all shards together, picked by --seed) and fail one whose figures differ")
    parser.add_argument("--seed", default="", help="picks the --verify programs")
    args = parser.parse_args(argv)
    cases = [(topology, mesh, head_dim, seq_len) for topology, mesh in args.slices for head_dim in args.head_dims
             for seq_len in args.seq_lens]
    earlier = {(r["topology"], r["mesh"], r["head_dim"], r["seq_len"]): r
               for r in json.loads(args.reuse.read_text())["rows"]} if args.reuse else {}
    verified = sorted(((case, program) for case in cases for program in args.programs
                       if "fingerprint" in earlier.get(case, {}).get(program, {})),
                      key=lambda item: hashlib.sha256(f"{args.seed}:{item}".encode()).hexdigest())[:args.verify]
    index, count = args.shard
    rows = []
    for case in cases[index::count]:
        old = {program: figures for program, figures in earlier.get(case, {}).items()
               if (case, program) not in verified}
        rows.append(compile_case(*case, programs=args.programs, earlier=old))
        for program in (p for c, p in verified if c == case):
            _check_reproduced(rows[-1].get(program, {}), earlier[case][program])
        print(_describe(rows[-1]), flush=True)
        if args.json:  # after every row: a long run that is stopped keeps what it compiled
            Path(args.json).write_text(json.dumps(dict(jax=jax.__version__, rows=rows), indent=1) + "\n")
    failed = [row for row in rows if any("error" in row.get(name, {}) for name in ("train", "generate"))]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
