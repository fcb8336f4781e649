import os

# Eight CPU devices for the context-parallel tests (tests/test_ring.py); must be set before jax starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

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
