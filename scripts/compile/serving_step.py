"""The LM example's continuous-batching engine step (examples/lm/serving.py) as a compile-report variant.

One engine step of the `bench-hd128` model (8 layers, 8 heads of 128, d_model 1024, bfloat16) over a token
bucket of 256 packed tokens from up to 16 sequences of up to 2048 keys, with int8 KV pages of 16 keys: every
layer's attention is one `ragged_paged_attention` call that appends the step's keys and values, on the
backend given. The GPU report (variants.py) compiles it with the Triton kernel, the TPU report
(tpu_variants.py) with the Mosaic TPU one; both need examples/lm's packages in the toolchain
(examples_packages.sh).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # probjax_nn's folder is here; examples/lm's one level down
TOKENS, SEQS, CONTEXT, PAGE = 256, 16, 2048, 16


def serving_step(backend: str):
    """(function of the step's flattened arguments, their ShapeDtypeStructs) for `RaggedConfig(backend)`."""
    import jax

    for folder in (ROOT, ROOT / "examples"):
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
    from lm.config import make_config
    from lm.scheduler import ServingConfig
    from lm.serving import engine_step, step_inputs
    from probjax_kernels import RaggedConfig

    config = make_config("bench-hd128")
    serving = ServingConfig(page_size=PAGE, num_pages=SEQS * CONTEXT // PAGE, max_seqs=SEQS,
                            pages_per_seq=CONTEXT // PAGE, chunk_size=TOKENS, token_buckets=(TOKENS,),
                            kv_dtype="int8")
    step = engine_step(config, serving, RaggedConfig(backend=backend))
    leaves, tree = jax.tree.flatten(step_inputs(config, serving, TOKENS))

    def fn(*flat):
        return step(*jax.tree.unflatten(tree, flat))

    return fn, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
