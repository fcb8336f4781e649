"""The LM training example (examples/train_lm.py, examples/lm/, examples/sample.py) on a micro config."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("flax")
pytest.importorskip("equinox")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import data, train  # noqa: E402
from lm.config import Config, make_config, parse_args  # noqa: E402

FRAMEWORKS = ("nnx", "linen", "equinox")
# Small enough for two CPU cores; "xla" keeps Pallas interpret mode out of all but one test.
MICRO = dict(
    num_layers=2, d_model=32, num_heads=2, seq_len=32, batch_size=4, attention="xla", learning_rate=1e-2,
    warmup_steps=2, log_every=5, eval_every=10, eval_batches=2, checkpoint_every=10, num_samples=1, sample_tokens=8,
)


@pytest.fixture(autouse=True)
def standard_promotion():
    """conftest.py makes dtype promotion strict; optax's Adam is not written for it (`b1 ** count` with an
    int32 count), so the example runs under jax's standard promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lm_data"))


def micro(data_cache: str, out: Path, **overrides) -> Config:
    return make_config("tiny", {**MICRO, "data_cache": data_cache, "out": str(out), **overrides})


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_one_step(framework, data_cache, tmp_path):
    rows = train.run(micro(data_cache, tmp_path, framework=framework, steps=1, num_samples=0))
    assert [row["step"] for row in rows] == [1]
    # An untrained model is close to uniform over 256 bytes.
    assert abs(rows[0]["train_loss"] - math.log(256)) < 0.3
    assert abs(rows[0]["val_loss"] - math.log(256)) < 0.3


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_thirty_steps_loss_falls_and_samples(framework, data_cache, tmp_path, capsys):
    rows = train.run(micro(data_cache, tmp_path, framework=framework, steps=30))
    assert [row["step"] for row in rows] == [5, 10, 15, 20, 25, 30]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 1.0
    validation = [row["val_loss"] for row in rows if row["val_loss"] is not None]
    assert len(validation) == 3 and validation[-1] < validation[0]
    assert all(row["tokens_per_s"] > 0 and row["mfu"] is None for row in rows)  # MFU: n/a on the CPU
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert (tmp_path / "samples.txt").read_text().startswith("--- sample 0 ---\ndef ")

    sample = _load_script("sample")
    capsys.readouterr()
    sample.main(["--out", str(tmp_path), "--prompt", "import", "--tokens", "5", "--temperature", "0",
                 "--num-samples", "2"])
    printed = capsys.readouterr().out
    assert f"{framework} model, step 30" in printed and "--- sample 1 ---\nimport" in printed


def test_sample_takes_explicit_zeros_and_names_bad_flags(data_cache, tmp_path, capsys):
    train.run(micro(data_cache, tmp_path, steps=1, num_samples=0, sample_tokens=8))  # checkpoint of step 1
    sample = _load_script("sample")
    capsys.readouterr()
    # --tokens 0 is the prompt alone (it was the run's sample_tokens); the run's num_samples=0 means one.
    sample.main(["--out", str(tmp_path), "--prompt", "abc", "--tokens", "0", "--temperature", "0"])
    assert capsys.readouterr().out.endswith("--- sample 0 ---\nabc\n")
    with pytest.raises(SystemExit, match=r"--step 5: no checkpoint of that step .* it has steps \[1\]"):
        sample.main(["--out", str(tmp_path), "--step", "5"])
    for flags in (["--num-samples", "0"], ["--temperature", "-1"], ["--tokens", "-2"], ["--prompt", ""]):
        with pytest.raises(SystemExit):
            sample.main(["--out", str(tmp_path), *flags])
        assert flags[0] in capsys.readouterr().err


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_resume_after_interruption_matches_an_unbroken_run(framework, data_cache, tmp_path):
    config = dict(framework=framework, steps=20, num_samples=0)
    unbroken = train.run(micro(data_cache, tmp_path / "unbroken", **config))
    interrupted = micro(data_cache, tmp_path / "interrupted", **config)
    first = train.run(interrupted, stop_after=13)  # "killed" after step 13; the last checkpoint is step 10
    assert [row["step"] for row in first] == [5, 10]
    resumed = train.run(micro(data_cache, tmp_path / "interrupted", resume=True, **config))
    assert [row["step"] for row in resumed] == [5, 10, 15, 20]
    for got, want in zip(resumed, unbroken):
        assert got["step"] == want["step"]
        np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-6)
        if want["val_loss"] is not None:
            np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-6)


def test_resume_from_a_checkpoint_between_metrics_rows(data_cache, tmp_path):
    """A checkpoint at step 7 with a metrics row every 5 steps: the resumed row of step 10 averages the losses
    of steps 6..10, as the unbroken run's does (steps 6 and 7 come from the checkpoint)."""
    config = dict(framework="linen", steps=12, checkpoint_every=7, num_samples=0)
    unbroken = train.run(micro(data_cache, tmp_path / "unbroken", **config))
    train.run(micro(data_cache, tmp_path / "interrupted", **config), stop_after=9)
    resumed = train.run(micro(data_cache, tmp_path / "interrupted", resume=True, **config))
    assert [row["step"] for row in resumed] == [row["step"] for row in unbroken] == [5, 10, 12]
    for got, want in zip(resumed, unbroken):
        np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-6)
    # Steps 1..7 of the interrupted run are the unbroken run's: the row's mean includes them exactly.
    assert resumed[1]["train_loss"] == unbroken[1]["train_loss"]


def test_pallas_and_xla_give_the_same_losses(data_cache, tmp_path):
    losses = {}
    for impl in ("pallas", "xla"):
        config = micro(data_cache, tmp_path / impl, steps=2, log_every=1, eval_every=2, eval_batches=1, num_samples=0)
        losses[impl] = [row["train_loss"] for row in train.run(config)]
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=2e-5)


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


_SHARDED_SCRIPT = """
    import os, re, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before jax is imported
    sys.path.insert(0, {examples!r})
    import functools, json
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from lm import train
    from lm.config import make_config

    base = json.loads({config!r})
    for framework in ("nnx", "linen", "equinox"):
        losses = {{}}
        for mesh in (None, "data=2,model=2"):
            out = os.path.join({out!r}, framework, str(mesh))
            config = make_config("tiny", dict(base, framework=framework, mesh=mesh, out=out))
            losses[mesh] = [row["train_loss"] for row in train.run(config)]
        np.testing.assert_allclose(losses["data=2,model=2"], losses[None], rtol=1e-5)

        # The sharded gradient step, with the Pallas kernel: attention runs per shard, nothing is gathered.
        config = make_config("tiny", dict(base, framework=framework, attention="pallas", mesh="data=2,model=2"))
        mesh = train.make_mesh(config)
        model = train.build_model(config, jax.random.key(0))
        with jax.set_mesh(mesh):
            shardings = train.Shardings.on(mesh, model, train.make_optimizer(config))
            params = jax.device_put(model.params, shardings.params)
            step = jax.jit(jax.value_and_grad(functools.partial(train.loss_fn, model, config)))
            hlo = step.lower(params, shardings.place(np.zeros((4, 33), np.int32))).compile().as_text()
        gathers = re.findall(r" (all-gather|all-to-all)\\(", hlo)
        assert not gathers, (framework, gathers)
        assert sum(leaf.sharding.spec != P() for leaf in jax.tree.leaves(params)) == 6 * config.num_layers
        print(framework, "sharded == unsharded:", losses[None])
"""


def test_sharded_run_matches_the_unsharded_one(data_cache, tmp_path):
    config = json.dumps({**MICRO, "data_cache": data_cache, "steps": 3, "log_every": 1, "eval_every": 3,
                         "eval_batches": 1, "num_samples": 0})
    script = textwrap.dedent(_SHARDED_SCRIPT).format(examples=str(EXAMPLES), config=config, out=str(tmp_path))
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stdout.count("sharded == unsharded") == 3


def test_config_precedence_preset_file_cli(tmp_path):
    (tmp_path / "a.yaml").write_text("steps: 7\nseq_len: 2048\nnum_kv_heads: 2\n")
    (tmp_path / "b.json").write_text(json.dumps({"steps": 9, "grad_clip": None}))
    config = parse_args(["--preset", "bench-hd128", "--config", str(tmp_path / "a.yaml"), "--seq-len", "8192"])
    assert (config.head_dim, config.batch_size, config.num_heads) == (128, 4, 8)
    assert (config.steps, config.seq_len, config.kv_heads) == (7, 8192, 2)
    config = parse_args(["--config", str(tmp_path / "b.json"), "--no-tie-embeddings", "--mesh", "data=2"])
    assert (config.steps, config.grad_clip, config.tie_embeddings, config.mesh) == (9, None, False, "data=2")
    assert parse_args(["--preset", "bench-hd64"]).head_dim == 64
    with pytest.raises(ValueError, match="attention='flash'"):
        make_config("tiny", {"attention": "flash"})
    with pytest.raises(ValueError, match="unknown config field"):
        make_config("tiny", {"sequence_length": 3})
    with pytest.raises(ValueError, match="mesh"):
        make_config("tiny", {"mesh": "data=two"})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "abc"], "steps='abc' must be of type int"),
        (["--learning-rate", "fast"], "learning_rate='fast' must be of type float"),
        (["--checkpoint-every", "0"], "checkpoint_every=0 must be at least 1"),  # was a ZeroDivisionError at step 1
        (["--eval-batches", "0"], "eval_batches=0 must be at least 1"),  # was a NaN validation loss
        (["--num-heads", "0"], "num_heads=0 must be at least 1"),  # was a ZeroDivisionError
        (["--num-kv-heads", "0"], "num_kv_heads=0 must be at least 1"),
        (["--temperature", "-1"], "temperature=-1.0 must be at least 0"),
        (["--warmup-steps", "-5"], "warmup_steps=-5 must be at least 0"),
        (["--vocab-size", "100"], "vocab_size=100 must be at least 256"),  # bytes past the table read garbage
    ],
)
def test_invalid_flags_name_the_field(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(flags)


def test_valid_edge_values_are_accepted():
    config = parse_args(["--checkpoint-every", "none", "--grad-clip", "none", "--temperature", "0", "--warmup-steps",
                         "0", "--num-samples", "0", "--num-kv-heads", "1"])
    assert (config.checkpoint_every, config.grad_clip, config.temperature, config.kv_heads) == (None, None, 0.0, 1)


def test_data_split_is_deterministic_and_cached(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"file{i:02d}.py").write_text(f"x = {i}\n" * 50)
    config = make_config("tiny", dict(data=str(corpus), data_cache=str(tmp_path / "cache"), seq_len=16, batch_size=3))
    train_tokens, val_tokens = data.load_tokens(config)
    assert len(train_tokens) + len(val_tokens) == sum(f.stat().st_size for f in corpus.iterdir())
    assert 0 < len(val_tokens) < len(train_tokens)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    again = data.load_tokens(config)  # from the cache
    np.testing.assert_array_equal(again[1], val_tokens)
    batch = data.train_batch(train_tokens, config, step=5)
    assert batch.shape == (3, 17) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, data.train_batch(train_tokens, config, step=5))
    assert not np.array_equal(batch, data.train_batch(train_tokens, config, step=6))
    # One file: the last val_fraction of its bytes is the validation split.
    single = make_config("tiny", dict(data=str(corpus / "file00.py"), data_cache=str(tmp_path / "cache")))
    train_tokens, val_tokens = data.load_tokens(single)
    assert len(val_tokens) == 300 - int(300 * 0.95)


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
        config = make_config("tiny", {**MICRO, "framework": framework, "num_layers": 1, "mesh": mesh_flag})
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
