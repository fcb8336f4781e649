import os

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

import jax

# Strict promotion catches silent rank broadcasting and dtype upcasts in kernels, wrappers and tests alike.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
# The Mosaic GPU interpreter runs each simulated warpgroup as a Python thread that executes its own XLA
# computation and blocks on barriers inside callbacks. With async dispatch, those computations (and the
# small ones that build each thread's arguments) queue on the CPU client's worker pool, which the blocked
# warpgroups can fill: a deadlock seen about one run in ten on 2 cores (faulthandler showed the last thread
# never started). Inline execution gives every thread its own. Must be set before the CPU client exists.
jax.config.update("jax_cpu_enable_async_dispatch", False)

