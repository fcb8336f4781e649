"""The Pallas Triton backend, for every CUDA GPU: the forward, dQ and dK/dV, forward-mode tangent and decode
kernels, the tile walks and BlockSpecs they share, and the one module that touches the deprecated lowering.
Only `_dispatch` imports it."""
