"""The LM example's models (examples/lm/) on a micro config: Pallas against XLA attention, bfloat16, decoding
with the cache, a sharded run, context parallelism, and the FLOPs behind MFU."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("flax")
pytest.importorskip("equinox")

from lm_micro import (  # noqa: E402, F401 - puts examples/ on sys.path; standard_promotion: autouse
    FRAMEWORKS, MICRO, micro, standard_promotion,
)
from lm import data, train  # noqa: E402
from lm.config import make_config  # noqa: E402
from lm.sampling import generate  # noqa: E402


def test_pallas_and_xla_give_the_same_losses(data_cache, tmp_path):
    losses = {}
    for impl in ("pallas", "xla"):
        config = micro(data_cache, tmp_path / impl, steps=2, log_every=1, eval_every=2, eval_batches=1, num_samples=0)
        losses[impl] = [row["train_loss"] for row in train.run(config)]
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=2e-5)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bfloat16_models_hand_attention_bfloat16(framework, monkeypatch):
    """dtype="bfloat16" keeps float32 params and computes in bfloat16: q, k and v reach attention as bfloat16 in
    training and in the prefill (NNX's Embed once cast its output back to its float32 param_dtype, so the NNX
    model ran float32 attention kernels)."""
    import lm.common
    import lm.model_nnx

    seen = []
    shard_heads = lm.common.shard_heads

    def spy(attend):
        def run(query, key, value):
            seen.append((query.dtype, key.dtype, value.dtype))
            return shard_heads(attend)(query, key, value)
        return run

    # Every model's attention passes through shard_heads (NNX's RotaryAttention imports it by name).
    monkeypatch.setattr(lm.common, "shard_heads", spy)
    monkeypatch.setattr(lm.model_nnx, "shard_heads", spy)
    config = make_config("tiny", {**MICRO, "framework": framework, "dtype": "bfloat16"})
    model = train.build_model(config, jax.random.key(0))
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.float32)}
    params = train.compute_params(model.params, config)
    tokens = jnp.zeros((2, 8), jnp.int32)
    seen.clear()  # Linen's init ran the float32 model
    assert jax.eval_shape(model.apply, params, tokens).dtype == jnp.float32  # the logits
    jax.eval_shape(model.prefill, params, tokens)
    assert len(seen) == 2 * config.num_layers
    assert set(seen) == {(jnp.dtype(jnp.bfloat16),) * 3}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_decode_with_the_cache_matches_the_full_forward(framework):
    config = make_config("tiny", {**MICRO, "framework": framework, "num_kv_heads": 1, "tie_embeddings": False})
    model = train.build_model(config, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 256, jnp.int32)
    full = jax.jit(model.apply)(model.params, tokens)
    step, cache = model.decoder(model.params, 2, 12)
    step = jax.jit(step)
    for position in range(tokens.shape[1]):
        logits, cache = step(model.params, cache, tokens[:, position], jnp.int32(position))
        np.testing.assert_allclose(logits, full[:, position], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sharded_run_matches_the_unsharded_one(framework, data_cache, tmp_path):
    """`--mesh data=2,model=2` over 4 of conftest's 8 CPU devices (this ran in a subprocess, to get 4)."""
    base = {**MICRO, "data_cache": data_cache, "num_layers": 1, "steps": 2, "log_every": 1, "eval_every": 2,
            "eval_batches": 1, "checkpoint_every": 2, "num_samples": 0}
    # The run samples at the end, on the params as they are sharded (the decode is not split by shard_heads).
    config = make_config("tiny", dict(base, framework=framework, mesh="data=2,model=2", out=str(tmp_path),
                                      num_samples=1, sample_tokens=6, temperature=0))
    sharded = [row["train_loss"] for row in train.run(config)]
    # The same steps on one device, without the run's evaluation, checkpoints and plot.
    config = dataclasses.replace(config, mesh=None)
    model, optimizer = train.build_model(config, jax.random.key(config.seed)), train.make_optimizer(config)
    train_step, _ = train.make_steps(model, optimizer, config, train.Shardings())
    params, opt_state, unsharded = model.params, optimizer.init(model.params), []
    tokens, _ = data.load_tokens(config)
    for step in range(1, config.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(data.train_batch(tokens, config, step)))
        unsharded.append(float(loss))
    np.testing.assert_allclose(sharded, unsharded, rtol=1e-5)
    samples = generate(model, params, b"def ", 6, num_samples=1, temperature=0.0, key=jax.random.key(config.seed))
    assert (tmp_path / "samples.txt").read_text() == f"--- sample 0 ---\n{samples[0].decode(errors='replace')}\n"

    # The sharded gradient step, with the Pallas kernel: attention runs per shard, nothing is gathered.
    config = make_config("tiny", dict(base, framework=framework, attention="pallas", mesh="data=2,model=2"))
    mesh = train.make_mesh(config)
    model = train.build_model(config, jax.random.key(0))
    with jax.set_mesh(mesh):
        shardings = train.Shardings.on(mesh, model, train.make_optimizer(config))
        params = jax.device_put(model.params, shardings.params)
        step = jax.jit(jax.value_and_grad(functools.partial(train.loss_fn, model, config)))
        hlo = step.lower(params, shardings.place(np.zeros((4, 33), np.int32))).compile().as_text()
    gathers = re.findall(r" (all-gather|all-to-all)\(", hlo)
    assert not gathers, gathers
    assert sum(leaf.sharding.spec != P() for leaf in jax.tree.leaves(params)) == 6 * config.num_layers


def test_mfu_counts_six_flops_per_parameter_and_half_of_attention():
    config = make_config("bench-hd64", {"peak_tflops": 100.0})
    assert train.flops_per_token(config, 1000) == 6 * 1000 + 12 * 8 * 8 * 64 * 4096 / 2
    assert train.peak_flops(config, num_devices=2) == 2e14


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_context_parallel_steps_match_the_unsharded_ones(framework):
    """`--mesh data=2,seq=2` (conftest gives this process 8 CPU devices): the sequence split over two devices,
    attention as a ring, trains to the unsharded losses; the compiled step moves the K/V blocks
    `[B / data, T / seq, K, D]` by collective-permute and all-gathers nothing."""
    batches = np.random.default_rng(0).integers(0, 256, (3, 4, 33), dtype=np.int32)
    losses = {}
    for mesh_flag in (None, "data=2,seq=2"):
        # Unsharded, test_sharded_run_matches_the_unsharded_one's step, compiled once for both (steps=2 as there:
        # the three losses see the warmup's rates alone, which every schedule shares).
        config = make_config("tiny", {**MICRO, "framework": framework, "num_layers": 1, "steps": 2,
                                      "mesh": mesh_flag})
        mesh, model = train.make_mesh(config), train.build_model(config, jax.random.key(0))
        optimizer = train.make_optimizer(config)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            shardings = train.Shardings.on(mesh, model, optimizer)
            params = model.params if mesh is None else jax.device_put(model.params, shardings.params)
            opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
            train_step, _ = train.make_steps(model, optimizer, config, shardings)
            compiled = train_step.lower(params, opt_state, shardings.place(batches[0])).compile()
            losses[mesh_flag] = []
            for batch in batches:
                params, opt_state, loss = compiled(params, opt_state, shardings.place(batch))
                losses[mesh_flag].append(float(loss))
    hlo = compiled.as_text()
    np.testing.assert_allclose(losses["data=2,seq=2"], losses[None], rtol=1e-5)
    assert " all-gather(" not in hlo
    kv_block = ",16,%d,%d]" % (config.kv_heads, config.head_dim)
    permutes = [line for line in hlo.splitlines() if " collective-permute(" in line and kv_block in line]
    assert len(permutes) >= 4, permutes
