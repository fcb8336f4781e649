"""The Pallas Mosaic TPU backend: forward, backward (dQ and dK/dV), forward-mode tangent and decode kernels, and
the backend object (`plan.BACKEND`) that says which calls they take (`vet.unsupported`; `_dispatch` then takes
the XLA path with a warning) and runs them. It imports only the core modules of probjax_kernels, never another
backend; only `_dispatch` imports it."""
