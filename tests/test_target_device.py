"""One answer to "which device": the kernels' choice of backend and probjax_nn's impl="auto" read the same
target (`probjax_kernels.layer_api.target_platform`), so a deviceless compile for a TPU or a GPU gets the
kernels from both (docs/contributing.md)."""

import jax
import pytest

import probjax_nn
from probjax_kernels import _backend, _dispatch
from probjax_kernels.layer_api import target_platform
from probjax_nn import _attention


def _request(**changes):
    fields = dict(dtype="bfloat16", head_dim=128, value_dim=False, kv_broadcast=False, score_mod=False,
                  mask_mod=False, dropout=False, right_window=False, gpu=_attention._on_gpu())
    return _attention._Request(**{**fields, **changes})


def test_the_default_device_wins_over_the_default_backend(monkeypatch):
    """A default device (what a deviceless compile sets: a topology device) is the target, whatever
    `jax.default_backend()` says; without one the default backend's platform is."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert target_platform() == "gpu"
    with jax.default_device(jax.devices("cpu")[0]):
        assert target_platform() == "cpu"
        assert _dispatch.default_backend() == "interpret"
        assert _attention._choose("auto", _request(gpu=_attention._on_gpu())) == "xla"


@pytest.mark.parametrize("platform, backend, auto", [("tpu", "tpu", "pallas"), ("gpu", "triton", "pallas"),
                                                     ("cpu", "interpret", "xla")])
def test_auto_and_the_kernels_agree_on_the_target(monkeypatch, platform, backend, auto):
    monkeypatch.setattr(_backend, "target_platform", lambda: platform)
    monkeypatch.setattr(_backend, "target_device", lambda: jax.devices("cpu")[0])  # not a Hopper
    assert _dispatch.default_backend() == backend
    assert _attention._choose("auto", _request(gpu=_attention._on_gpu())) == auto
    assert probjax_nn.AttentionConfig().impl == "auto"
