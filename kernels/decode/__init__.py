"""`decode_attention` (flash-decoding over a dense or paged KV cache) and its plain-jnp reference; the kernel
is chosen by `_dispatch` (the split-KV kernel lives with its backend, `triton/decode.py`)."""
