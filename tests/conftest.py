import os
import shutil
import tempfile

# Must be set before jax starts, and reach the processes tests start (examples, launchers):
# - eight CPU devices for the context-parallel tests (tests/test_ring.py);
# - LLVM's optimizations off for the CPU backend: the tests' shapes are tiny, so their time goes into
#   compiling interpret-mode kernels, not running them; this cuts about a third of the suite's CPU time and
#   changes no result (XLA's HLO passes, fusion included, still run).
TEST_XLA_FLAGS = {
    "--xla_force_host_platform_device_count": "8",
    "--xla_backend_optimization_level": "0",
}
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags += [f"{name}={value}" for name, value in TEST_XLA_FLAGS.items()
           if not any(flag.startswith(name + "=") for flag in _flags)]
os.environ["XLA_FLAGS"] = " ".join(_flags)

# One compilation cache for the run, shared by pytest-xdist's workers and the processes tests start: a
# computation compiled by one (the same reference or kernel at the same shapes) is read back by the others
# instead of compiled again. A fresh folder per run (this process makes it; workers and children inherit the
# variable), removed at the end, so no run reads another's entries.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="probjax-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
else:
    _OWN_CACHE = None

import jax
import pytest

# Strict promotion catches silent rank broadcasting and dtype upcasts in kernels, wrappers and tests alike.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
# The Mosaic GPU interpreter runs each simulated warpgroup as a Python thread that executes its own XLA
# computation and blocks on barriers inside callbacks. With async dispatch, those computations (and the
# small ones that build each thread's arguments) queue on the CPU client's worker pool, which the blocked
# warpgroups can fill: a deadlock seen about one run in ten on 2 cores (faulthandler showed the last thread
# never started). Inline execution gives every thread its own. Must be set before the CPU client exists.
jax.config.update("jax_cpu_enable_async_dispatch", False)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """The LM example's token cache folder (`--data-cache`), shared by the tests that train it in this process
    or in processes they start (tests/test_examples*.py, tests/test_multiprocess.py): each corpus is read and
    split once per worker. A cache is keyed by its corpus and written whole before use (examples/lm/data.py)."""
    return str(tmp_path_factory.mktemp("lm_data"))


@pytest.fixture
def tangent_calls(monkeypatch) -> list:
    """A list that gets the keyword arguments of each call that builds the Mosaic GPU tangent kernel (jax.jvp's
    tangent map is a primitive: a jaxpr does not show its kernel)."""
    return _calls_of(monkeypatch, "mosaic_tangent")


@pytest.fixture
def dkv_calls(monkeypatch) -> list:
    """A list that gets the keyword arguments of each call of the Mosaic GPU dK/dV kernels the glue makes."""
    return _calls_of(monkeypatch, "mosaic_backward_dkv")


def _calls_of(monkeypatch, name: str) -> list:
    from probjax_kernels.mosaic import glue

    calls, kernel = [], getattr(glue, name)
    monkeypatch.setattr(glue, name, lambda *a, **k: calls.append(k) or kernel(*a, **k))
    return calls


def pytest_unconfigure(config):
    if _OWN_CACHE is not None and not hasattr(config, "workerinput"):  # the run's own process, not a worker
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
