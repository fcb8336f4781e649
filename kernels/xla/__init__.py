"""The XLA path as a backend: the attention over query chunks (`_chunked`: memory linear in T, exact), which
runs what no kernel of the device can (on a TPU, a hook Mosaic TPU cannot lower). Only `_dispatch` imports it."""
