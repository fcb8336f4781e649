"""The LM example's command line and config (examples/train_lm.py, examples/lm/config.py): flags, presets and
config files, the checks that refuse a run before it writes anything, and the data split."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("flax")
pytest.importorskip("equinox")

from lm_micro import (  # noqa: E402, F401 - puts examples/ on sys.path; standard_promotion: autouse
    _fake_run, _load_script, _snapshot, _usage_error, micro, micro_flags, standard_promotion,
)
from lm import data, train  # noqa: E402
from lm.config import make_config, parse_args, to_json  # noqa: E402


def test_a_used_out_folder_needs_resume_or_overwrite(data_cache, tmp_path, capsys):
    """Training into an old run's folder kept its checkpoints (orbax skips steps at or below its latest) next to
    new metrics; sample.py and --resume then loaded the old weights."""
    train_lm = _load_script("train_lm")
    _fake_run(tmp_path, micro(data_cache, tmp_path))
    before = _snapshot(tmp_path)
    line = _usage_error(capsys, lambda: train_lm.main(micro_flags(data_cache, tmp_path, steps=1, num_samples=0)))
    assert "argument --out: " in line and "--resume" in line and "--overwrite" in line
    assert _snapshot(tmp_path) == before

    # --overwrite starts the folder afresh: only the run's own files go.
    train_lm.main([*micro_flags(data_cache, tmp_path, steps=1, num_samples=0, checkpoint_every=1), "--overwrite"])
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [1]
    assert [row["step"] for row in train.Metrics.read(tmp_path / "metrics.jsonl")] == [1]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["steps"] == 1 and saved["overwrite"] is False  # a --config of it must not delete the folder
    assert (tmp_path / "notes.txt").read_text() == "the user's own file"


def test_failed_checks_write_nothing(data_cache, tmp_path, capsys):
    """A missing --data, or --resume with another architecture, rewrote config.json before failing."""
    train_lm = _load_script("train_lm")
    fresh = tmp_path / "fresh"
    line = _usage_error(capsys, lambda: train_lm.main(micro_flags(data_cache, fresh, data=str(tmp_path / "none"))))
    assert "argument --data: " in line and "none" in line
    assert not fresh.exists()

    _fake_run(tmp_path, micro(data_cache, tmp_path))
    before = _snapshot(tmp_path)
    line = _usage_error(capsys, lambda: train_lm.main(
        [*micro_flags(data_cache, tmp_path, data=str(tmp_path / "none")), "--resume"]))
    assert "argument --data: " in line
    changed = micro_flags(data_cache, tmp_path, num_layers=3, d_model=64, framework="linen", steps=99)
    line = _usage_error(capsys, lambda: train_lm.main([*changed, "--resume"]))
    assert "argument --resume: " in line and "--overwrite" in line
    assert "num_layers 2 -> 3" in line and "d_model 32 -> 64" in line and "framework 'nnx' -> 'linen'" in line
    assert "steps" not in line  # a longer schedule is a fine thing to resume with
    assert _snapshot(tmp_path) == before


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_data_loads(data_cache, tmp_path, capsys):
    """A missing --data is reported later than --out: the --out error shows the data was not loaded first."""
    train_lm = _load_script("train_lm")
    (tmp_path / "file").write_text("not a folder")
    outs = [tmp_path / "file" / "run"] + ([Path("/proc/probjax_nn_run")] if sys.platform == "linux" else [])
    for out in outs:
        line = _usage_error(capsys, lambda: train_lm.main(micro_flags(data_cache, out, data=str(tmp_path / "none"))))
        assert "error: argument --out: cannot " in line and str(out) in line, line
    assert not Path("/proc/probjax_nn_run").exists()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cudnn runs on a GPU")
def test_cudnn_without_a_gpu_is_refused_before_anything_is_written(data_cache, tmp_path, capsys):
    """Was a traceback after config.json and metrics.jsonl were written."""
    train_lm = _load_script("train_lm")
    line = _usage_error(capsys, lambda: train_lm.main(micro_flags(data_cache, tmp_path / "run", attention="cudnn")))
    assert "argument --attention: attention='cudnn' needs an NVIDIA GPU; this run's devices are cpu" in line, line
    assert not (tmp_path / "run").exists()


def test_resume_needs_a_checkpoint_and_says_what_is_there(data_cache, tmp_path, capsys):
    """--resume into a folder without a checkpoint started from step 0 and overwrote metrics.jsonl."""
    train_lm = _load_script("train_lm")
    line = _usage_error(capsys, lambda: train_lm.main([*micro_flags(data_cache, tmp_path / "new"), "--resume"]))
    assert "argument --resume: " in line and "holds no checkpoint" in line and "does not exist" in line, line
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    line = _usage_error(capsys, lambda: train_lm.main([*micro_flags(data_cache, tmp_path / "empty"), "--resume"]))
    assert "is empty" in line, line
    # A run killed before its first checkpoint, with orbax's unfinished folder of step 10.
    used = tmp_path / "used"
    (used / "checkpoints" / "10.orbax-checkpoint-tmp-1733").mkdir(parents=True)
    (used / "config.json").write_text(to_json(micro(data_cache, used)))
    (used / "metrics.jsonl").write_text('{"step": 5, "train_loss": 5.0}\n')
    before = _snapshot(used)
    line = _usage_error(capsys, lambda: train_lm.main([*micro_flags(data_cache, used), "--resume"]))
    assert "holds config.json, metrics.jsonl, checkpoints, an unfinished checkpoint 10.orbax-checkpoint-tmp" in line
    assert "--overwrite" in line, line
    assert _snapshot(used) == before


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
        (["--steps", "abc"], "argument --steps: steps='abc' must be of type int"),
        (["--learning-rate", "fast"], "argument --learning-rate: learning_rate='fast' must be of type float"),
        # NaN passed every bound (nan < 0 is False) and reached metrics.jsonl as invalid JSON.
        (["--learning-rate", "nan"], "argument --learning-rate: learning_rate=nan must be a finite number"),
        (["--learning-rate", "inf"], "argument --learning-rate: learning_rate=inf must be a finite number"),
        (["--temperature", "nan"], "argument --temperature: temperature=nan must be a finite number"),
        (["--grad-clip=-inf"], "argument --grad-clip: grad_clip=-inf must be a finite number"),
        (["--sample-prompt", ""], "argument --sample-prompt: sample_prompt='' must hold at least one character"),
        (["--framework", "torch"], "argument --framework: invalid choice: 'torch'"),
        (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
        (["--mesh", "foo"], "argument --mesh: mesh='foo'"),
        (["--num-kv-heads", "3"], "argument --num-kv-heads: num_heads=4 must be a multiple of num_kv_heads=3"),
        # Was a ZeroDivisionError at step 1, and a NaN validation loss.
        (["--checkpoint-every", "0"], "argument --checkpoint-every: checkpoint_every=0 must be at least 1"),
        (["--eval-batches", "0"], "argument --eval-batches: eval_batches=0 must be at least 1"),
        (["--num-heads", "0"], "argument --num-heads: num_heads=0 must be at least 1"),  # was a ZeroDivisionError
        (["--num-kv-heads", "0"], "argument --num-kv-heads: num_kv_heads=0 must be at least 1"),
        (["--temperature", "-1"], "argument --temperature: temperature=-1.0 must be at least 0"),
        (["--warmup-steps", "-5"], "argument --warmup-steps: warmup_steps=-5 must be at least 0"),
        # Bytes past the table read garbage.
        (["--vocab-size", "100"], "argument --vocab-size: vocab_size=100 must be at least 256"),
        (["--resume", "--overwrite"], "argument --overwrite: "),
        (["--config", "missing.yaml"], "argument --config: can't read 'missing.yaml'"),
        # numpy's generator raised a ValueError for -1 and jax an OverflowError past 2**32, after the data loaded.
        (["--seed", "-1"], "argument --seed: seed=-1 must be in [0, 2**32)"),
        (["--seed", str(2**32)], "argument --seed: seed=4294967296 must be in [0, 2**32)"),
        # Adam divides by 1 - beta**t = 0: NaN from the first step.
        (["--beta1", "1.0"], "argument --beta1: beta1=1.0 must be in [0, 1)"),
        (["--beta2", "1"], "argument --beta2: beta2=1.0 must be in [0, 1)"),
        (["--grad-clip", "0"], "argument --grad-clip: grad_clip=0.0 must be positive"),  # froze the weights
        (["--mesh", "data=2,data=4"], "argument --mesh: mesh='data=2,data=4' names the data axis twice"),
        (["--sample-prompt", "caf\udce9"], "argument --sample-prompt: sample_prompt='caf\\udce9' cannot be encoded"),
        (["--num-processes", "2"], "argument --coordinator-address: give all of --coordinator-address"),
        (["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"],
         "argument --process-id: process_id=2 must be in [0, num_processes=2)"),
        (["--coordinator-address", "h", "--num-processes", "2", "--process-id", "0"],
         "argument --coordinator-address: coordinator_address='h' must be HOST:PORT"),
        # A ZeroDivisionError after the first metrics row (the folder then held a run), and a negative MFU.
        (["--peak-tflops", "0"], "argument --peak-tflops: peak_tflops=0.0 must be positive"),
        (["--peak-tflops", "-1"], "argument --peak-tflops: peak_tflops=-1.0 must be positive"),
        # Infinite RoPE frequencies: NaN at step 1, reported as a learning rate too high.
        (["--rope-theta", "0"], "argument --rope-theta: rope_theta=0.0 must be greater than 1"),
        (["--rope-theta", "1"], "argument --rope-theta: rope_theta=1.0 must be greater than 1"),
    ],
)
def test_invalid_flags_are_usage_errors_that_name_the_flag(flags, message, capsys):
    """argparse's way: exit 2, a short usage line and one error line; no traceback (all were tracebacks)."""
    with pytest.raises(SystemExit) as exit:
        parse_args(flags)
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage:"), lines
    assert ": error: " + message in lines[1], lines


def test_config_file_errors_name_the_file(tmp_path, capsys):
    files = {"bad.yaml": "steps: [1,\n", "bad.json": "{", "list.json": "[1]", "field.json": '{"sequence_length": 3}',
             "type.yaml": "steps: many\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as exit:
            parse_args(["--config", str(tmp_path / name)])
        lines = capsys.readouterr().err.splitlines()
        assert exit.value.code == 2 and len(lines) == 2 and "error: argument --config: " in lines[1], (name, lines)
        assert name in lines[1] or "sequence_length" in lines[1] or "steps='many'" in lines[1], lines


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
