"""Context parallelism: `ring_attention` (the entry point and its autodiff) and its schedule over a mesh axis,
built on the flash and flex front-ends."""
