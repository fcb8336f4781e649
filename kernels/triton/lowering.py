"""The one place that touches the Pallas Triton backend.

jax 0.11.2 marks the Pallas Triton lowering deprecated in favour of Mosaic GPU, with a DeprecationWarning at
every lowering. It is still the only Pallas path for every CUDA GPU (Ampere included), so that one warning is
expected here and silenced by its message. It is raised when a caller's `jit` lowers, outside our frames,
hence a process-wide filter rather than a `catch_warnings` block.
"""

import warnings

from jax.experimental.pallas import triton as pltr

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

CompilerParams = pltr.CompilerParams
load = pltr.load  # a masked load: (ref, *, mask, other)
