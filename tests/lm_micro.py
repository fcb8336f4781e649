"""What the LM example's tests (tests/test_examples.py, test_examples_cli.py, test_examples_models.py) share:
MICRO, the micro config they train, its flags for train_lm.py, the example's scripts loaded as modules, and the
checks of a usage error and of a folder left as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest
from lm_helpers import SMALL_CORPUS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm.config import Config, make_config, to_json  # noqa: E402

FRAMEWORKS = ("nnx", "linen", "equinox")
# Small enough for two CPU cores; "xla" keeps Pallas interpret mode out of all but one test.
MICRO = dict(
    num_layers=2, d_model=32, num_heads=2, seq_len=32, batch_size=4, attention="xla", learning_rate=1e-2,
    warmup_steps=2, log_every=5, eval_every=10, eval_batches=2, checkpoint_every=10, num_samples=1, sample_tokens=8,
    data=SMALL_CORPUS,
)


@pytest.fixture(autouse=True)
def standard_promotion():
    """conftest.py makes dtype promotion strict; optax's Adam is not written for it (`b1 ** count` with an
    int32 count), so the example runs under jax's standard promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def micro(data_cache: str, out: Path, **overrides) -> Config:
    return make_config("tiny", {**MICRO, "data_cache": data_cache, "out": str(out), **overrides})


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def micro_flags(data_cache: str, out: Path, **overrides) -> list[str]:
    """`micro`'s config as train_lm.py flags."""
    values = {**MICRO, "data_cache": data_cache, "out": str(out), **overrides}
    return [word for name, value in values.items() for word in ("--" + name.replace("_", "-"), str(value))]


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder`: its bytes and modification time."""
    files = [f for f in folder.rglob("*") if f.is_file()]
    return {str(f.relative_to(folder)): (f.read_bytes(), f.stat().st_mtime_ns) for f in files}


def _fake_run(out: Path, config: Config) -> None:
    """A finished run's files (checkpoints of a later step than any new run here would reach)."""
    (out / "checkpoints" / "50").mkdir(parents=True)
    (out / "checkpoints" / "50" / "params").write_text("old weights")
    (out / "config.json").write_text(to_json(config))
    (out / "metrics.jsonl").write_text('{"step": 50, "train_loss": 1.0}\n')
    (out / "notes.txt").write_text("the user's own file")


def _usage_error(capsys, run) -> str:
    """The one error line of a usage error (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exit:
        run()
    lines = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(lines) == 2 and lines[0].startswith("usage:"), lines
    return lines[1]
