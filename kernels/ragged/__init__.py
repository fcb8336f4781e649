"""`ragged_paged_attention` (serving: the new tokens of many sequences packed in one call against a paged KV
cache), its plain-jnp reference and the append of new keys / values into the pages; the kernel is chosen by
`_dispatch` (each backend's `ragged.py`)."""
