"""The LM example's whole programs at the benchmark shapes as GPU compile-report variants (variants.py, group "lm"),
as examples/compile_for_tpu.py compiles them for TPU slices: the training step of train.py (`make_steps`: loss,
gradient and AdamW update) and the batched generation of sampling.py (`batch_generator`: a prefill of 4
prompts of the whole sequence length, then 64 paged decode steps), of `--preset bench-hd64` / `bench-hd128` (8
layers, 8 heads of 64 / 128, bfloat16) with `--attention pallas` (the Triton kernels) on one GPU, and the
training step on 2 GPUs (`train_step_on_mesh`). The worker records the HBM XLA plans for each (arguments,
outputs, temporaries) and the check holds it to the target's memory (check.py `lm_problems`). All need
examples/lm's packages in the toolchain (examples_packages.sh).

The worker jits the program again around these functions, so the training step's donated params and
optimiser state are not aliased to its outputs: its HBM counts them twice, an upper bound of a run's.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # probjax_nn's folder is here; examples/lm's one level down
PRESETS = ("bench-hd64", "bench-hd128")  # 8 layers, 8 heads of 64 / 128, bfloat16
TRAIN_BATCH = 4  # sequences per step on the one GPU (compile_for_tpu.py's batch per data shard)
GENERATE_BATCH, GENERATE_TOKENS = 4, 64  # compile_for_tpu.py's


def _paths() -> None:
    """examples/lm importable (as `lm`), with probjax_nn beside it."""
    for folder in (ROOT, ROOT / "examples"):
        if str(folder) not in sys.path:
            sys.path.append(str(folder))


def _config(preset: str, seq_len: int, batch: int):
    from lm.config import make_config

    return make_config(preset, dict(seq_len=seq_len, batch_size=batch, attention="pallas"))


def _abstract_model(config):
    """The model of `config` with its params as ShapeDtypeStructs: traced abstractly, nothing allocated."""
    import jax
    from lm.train import build_model

    built = {}

    def params(key):
        built["model"] = build_model(config, key)
        return built["model"].params

    shapes = jax.eval_shape(lambda: params(jax.random.key(config.seed)))
    return dataclasses.replace(built["model"], params=shapes)


def _flat(program, trees):
    """(function of the flattened leaves of `trees`, their ShapeDtypeStructs) calling `program(*trees)`."""
    import jax

    leaves, tree = jax.tree.flatten(trees)

    def fn(*flat):
        return program(*jax.tree.unflatten(tree, flat))

    return fn, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]


def train_step(preset: str, seq_len: int):
    """(function, argument ShapeDtypeStructs) of `preset`'s training step on `TRAIN_BATCH` sequences of
    `seq_len`."""
    import jax
    import jax.numpy as jnp

    _paths()
    from lm.train import Shardings, make_optimizer, make_steps

    config = _config(preset, seq_len, TRAIN_BATCH)
    model = _abstract_model(config)
    with jax.default_device(jax.devices("cpu")[0]):  # optax builds its state's shapes with eager ops
        optimizer = make_optimizer(config)
        opt_state = jax.eval_shape(optimizer.init, model.params)
    step, _ = make_steps(model, optimizer, config, Shardings.on(None, model, optimizer))
    batch = jax.ShapeDtypeStruct((config.batch_size, seq_len + 1), jnp.int32)
    return _flat(step, (model.params, opt_state, batch))


def generation(preset: str, seq_len: int):
    """(function, argument ShapeDtypeStructs) of `preset`'s batched generation: `GENERATE_BATCH` prompts of
    `seq_len` tokens, then `GENERATE_TOKENS` decode steps, params in the compute dtype (as train.run samples)."""
    import jax
    import jax.numpy as jnp

    _paths()
    from lm.sampling import batch_generator

    config = _config(preset, seq_len, GENERATE_BATCH)
    model = _abstract_model(config)
    dtype = jnp.dtype(config.dtype)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype), model.params)
    run = batch_generator(model, seq_len + GENERATE_TOKENS, GENERATE_TOKENS, temperature=config.temperature)
    key = jax.eval_shape(jax.random.key, 0)
    tokens = jax.ShapeDtypeStruct((GENERATE_BATCH, seq_len), jnp.int32)
    lengths = jax.ShapeDtypeStruct((GENERATE_BATCH,), jnp.int32)
    return _flat(run, (params, tokens, lengths, key))


MESH_GPUS = 2  # the data x seq mesh's GPUs (one host): "data=2" splits the batch, "seq=2" runs attention as a ring


def _mesh_of(mesh_flag: str):
    """`mesh_flag`'s mesh (train.make_mesh's axes and order) over `MESH_GPUS` GPUs of the kind the worker
    compiles for: its default device's, whose target description (gpu_targets/, matched by the device
    description) XLA's deviceless topology then holds `MESH_GPUS` times on one host."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    from lm.config import parse_mesh

    kind = jax.config.jax_default_device.device_kind
    texts = [path for path in (Path(__file__).parent / "gpu_targets").glob("*.txtpb")
             if f'device_description_str: "{kind}"' in path.read_text()]
    if len(texts) != 1:
        raise ValueError(f"the default device {kind!r} matches {len(texts)} target descriptions, not 1")
    topology = topologies.get_topology_desc(platform="cuda", topology_name=texts[0].stem,
                                            target_config=texts[0].read_text(), topology=f"1x1x{MESH_GPUS}")
    axes = parse_mesh(mesh_flag)
    if axes["data"] * axes["seq"] * axes["model"] != len(topology.devices):
        raise ValueError(f"mesh {mesh_flag!r} is not over {len(topology.devices)} GPUs")
    devices = topologies.make_mesh(topology, tuple(axes.values()), tuple(axes)).devices
    return Mesh(devices, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def train_step_on_mesh(preset: str, seq_len: int, mesh_flag: str):
    """(function, argument ShapeDtypeStructs with their shardings) of `preset`'s training step on `mesh_flag`'s
    mesh of `MESH_GPUS` GPUs, as train.run shards it: params and optimiser state by the model's partition, the
    batch (`TRAIN_BATCH` sequences per data shard) over "data"; with a "seq" axis attention runs as a ring
    (`AttentionConfig.context_axis`) whose blocks are the flash kernels. The function traces under the mesh."""
    import jax
    import jax.numpy as jnp

    _paths()
    from lm.config import parse_mesh
    from lm.train import Shardings, make_optimizer, make_steps

    mesh = _mesh_of(mesh_flag)
    config = _config(preset, seq_len, TRAIN_BATCH * parse_mesh(mesh_flag)["data"])
    config = dataclasses.replace(config, mesh=mesh_flag)
    model = _abstract_model(config)
    with jax.default_device(jax.devices("cpu")[0]):  # optax builds its state's shardings with eager ops
        optimizer = make_optimizer(config)
        shardings = Shardings.on(mesh, model, optimizer)
        opt_state = jax.eval_shape(optimizer.init, model.params)
    step, _ = make_steps(model, optimizer, config, shardings)

    def on_mesh(*flat):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*flat)

    fn, specs = _flat(step, (model.params, opt_state, jax.ShapeDtypeStruct((config.batch_size, seq_len + 1),
                                                                           jnp.int32)))
    shardings_flat = jax.tree.leaves((shardings.params, shardings.opt_state, shardings.batch))
    return on_mesh, [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
                     for s, sharding in zip(specs, shardings_flat, strict=True)]


# ------------------------------------------------------------------------------------- as rows of the registry

TARGETS = ("sm90a_h200", "sm100a_b200")  # one H200 (the H100's SM, 141 GB) and one B200
LENGTHS = (2048, 8192)  # examples/compile_for_tpu.py's
MESHES = ("data=2", "seq=2")  # on `MESH_GPUS` GPUs of one host: the batch split, or attention as a ring


def registry_variants() -> list:
    """These programs as variants of the compile registry (variants.py, group "lm"), at `--preset bench-hd64` /
    `bench-hd128` and each of `LENGTHS`: on one GPU the training step on 4 sequences (the flash forward, dQ and
    dK/dV kernels) and the batched generation (the flash forward and the decode kernel, 1 query row per KV
    head: MHA, one new token); on each of `MESHES` the training step. The worker records each one's HBM per
    GPU and its collectives; the check holds them to the target's memory and each mesh axis to its
    collective (check.py `lm_problems`)."""
    from variants import DECODE, DKV, DQ, FORWARD, Variant

    def build(name, *args):
        return lambda: globals()[name](*args)

    out = []
    for d, seq_len in [(d, seq_len) for d in (64, 128) for seq_len in LENGTHS]:
        preset, name = f"bench-hd{d}", f"bench_hd{d}_T{seq_len}"
        train = dict(requires=(FORWARD, DQ, DKV), targets=TARGETS)
        out += [
            Variant(f"lm_train_step_{name}", "lm", build("train_step", preset, seq_len), d, "bf16", "fwd+bwd",
                    "triton", seq_len, seq_len, **train),
            Variant(f"lm_generate_{name}", "lm", build("generation", preset, seq_len), d, "bf16", "fwd", "triton",
                    seq_len, seq_len + 64, requires=(FORWARD, DECODE), targets=TARGETS, query_rows=1),
            *(Variant(f"lm_train_step_{name}_{mesh.replace('=', '')}", "lm",
                      build("train_step_on_mesh", preset, seq_len, mesh), d, "bf16", "fwd+bwd", "triton", seq_len,
                      seq_len, **train) for mesh in MESHES),
        ]
    return out
