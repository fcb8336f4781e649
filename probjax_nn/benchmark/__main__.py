"""`python -m probjax_nn.benchmark`: see `probjax_nn.benchmark._cli`."""

import os
import sys

# torch shares the GPU with JAX in this process: JAX must not take 75% of its memory up front. Set before the
# first JAX computation initialises the backend.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from probjax_nn.benchmark._main import main  # noqa: E402

sys.exit(main())
