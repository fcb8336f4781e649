"""A serving step's attention as compile-report variants, for the GPU report (variants.py, Triton kernel) and
the TPU report (tpu_variants.py, Mosaic TPU kernel): `ragged_call`, one `ragged_paged_attention` call at a
step's packed batch, and `serving_step`, the LM example's continuous-batching engine step
(examples/lm/serving.py).

`serving_step`:
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
# The packed batch: 256 new tokens over 16 sequences of up to 2048 keys (decode rows, prompt chunks and whole
# prompts alike: only the shapes are static), GQA 32:8, head dim 128, pages of 16 keys unless named.
TOKENS, SEQS, HEADS, KV_HEADS, HEAD_DIM, CONTEXT, PAGE = 256, 16, 32, 8, 128, 2048, 16


def ragged_specs(page: int, dtype, page_dtype, kv_heads: int = KV_HEADS, heads: int = HEADS,
                 head_dim: int = HEAD_DIM) -> list:
    """ShapeDtypeStructs of (q, pages, kv_lens, page_indices, cu_q_lens, num_seqs) at the packed batch."""
    import jax
    import jax.numpy as jnp

    pages_per_seq, i32 = CONTEXT // page, jnp.int32
    return [jax.ShapeDtypeStruct((TOKENS, heads, head_dim), dtype),
            jax.ShapeDtypeStruct((SEQS * pages_per_seq, page, kv_heads, head_dim), page_dtype),
            jax.ShapeDtypeStruct((SEQS,), i32), jax.ShapeDtypeStruct((SEQS, pages_per_seq), i32),
            jax.ShapeDtypeStruct((SEQS + 1,), i32), jax.ShapeDtypeStruct((), i32)]


def ragged_call(backend: str, page: int = PAGE, pages: str = "bf16", append: bool = False, hooks: bool = False,
                sinks: bool = False, heads: tuple[int, int] = (HEADS, KV_HEADS), head_dim: int = HEAD_DIM,
                block_q: int | None = None, **options):
    """(function, argument ShapeDtypeStructs) of `ragged_paged_attention` with `RaggedConfig(backend, block_q)`
    at the packed batch: bf16 queries of `heads` (query, kv) heads of `head_dim`; `pages` "bf16", "int8" or
    "fp8" (float8_e4m3fn, with per-head scales); `append`: the step's keys and values written in the call;
    `hooks`: an ALiBi score_mod and a `sliding_window(1024)` mask_mod; `sinks`: a sink per head; `options` go to
    the call (sliding_window, soft_cap)."""
    import jax
    import jax.numpy as jnp
    from probjax_kernels import RaggedConfig, alibi, ragged_paged_attention, sliding_window

    num_heads, kv_heads = heads
    page_dtype = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[pages]
    q, cache, *tables = ragged_specs(page, jnp.bfloat16, page_dtype, kv_heads, num_heads, head_dim)
    specs = [q, cache, cache, *tables]
    if append:
        specs += [jax.ShapeDtypeStruct((TOKENS, kv_heads, head_dim), jnp.bfloat16)] * 2

    def attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *new):
        extra = dict(options)
        if pages != "bf16":
            extra.update(k_scale=jnp.full((kv_heads,), 0.05, jnp.float32), v_scale=0.05)
        if hooks:
            extra.update(score_mod=alibi(jnp.linspace(0.05, 0.5, num_heads)), mask_mod=sliding_window(1024))
        if sinks:
            extra["sinks"] = jnp.linspace(-1.0, 1.0, num_heads, dtype=jnp.float32)
        if new:
            extra.update(new_k=new[0], new_v=new[1])
        return ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      config=RaggedConfig(block_q=block_q, backend=backend), **extra)

    return attend, specs


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
