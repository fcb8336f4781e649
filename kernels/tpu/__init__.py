"""The Pallas Mosaic TPU backend: forward, backward (dQ and dK/dV) and forward-mode tangent kernels with the
contract of every backend (`_dispatch` calls `forward`, `backward`, `tangent` on the padded arrays and the
static `_Problem`), and `unsupported`, which names what they cannot run (`_dispatch` then takes the XLA path
with a warning). It imports only the core modules of probjax_kernels, never another backend."""

from probjax_kernels.tpu.backward import backward as backward
from probjax_kernels.tpu.common import TPU_BACKENDS as TPU_BACKENDS
from probjax_kernels.tpu.forward import forward as forward
from probjax_kernels.tpu.tangent import tangent as tangent
from probjax_kernels.tpu.vet import unsupported as unsupported
