"""The Pallas Mosaic GPU backend, for Hopper (wgmma, TMA, warp specialisation): the forward, dQ and dK/dV
kernels, what they share, and the glue from a `_Problem` to their arguments. Only `_dispatch` imports it."""
