"""The choice of backend, and nothing else: the backends in order for each `FlashConfig.backend`, and the frozen
`Plan` of one call assembled from them (`plan`): each pass (forward, backward, tangent) runs on the first
backend in order that plans it. A backend is one object of its folder (`_backend.Backend`); adding one is a
line in `ORDER`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import jax.numpy as jnp
from jax import lax

from probjax_kernels import _backend, _chunked
from probjax_kernels._backend import KernelPass, Plan, is_consumer_blackwell, is_hopper
from probjax_kernels._config import Backend, FlashConfig
from probjax_kernels._decode_inputs import DecodeConfig, DecodeInputs
from probjax_kernels._hooks import Hook
from probjax_kernels._ragged_inputs import RaggedConfig, RaggedInputs
from probjax_kernels._problem import Features, _Problem
from probjax_kernels.mosaic import plan as mosaic
from probjax_kernels.tpu import decode as tpu_decode
from probjax_kernels.tpu import plan as tpu
from probjax_kernels.triton import decode as triton_decode
from probjax_kernels.triton import plan as triton
from probjax_kernels.xla import plan as xla

MOSAIC_ENV = "PROBJAX_MOSAIC"  # "1": `backend=None` picks Mosaic GPU on Hopper

# The backends that run a call, in order, by `FlashConfig.backend`: a pass goes to the first that plans it.
ORDER = {
    "triton": (triton.BACKEND,), "interpret": (triton.BACKEND,),
    "mosaic": (mosaic.BACKEND, triton.BACKEND), "mosaic_interpret": (mosaic.BACKEND, triton.BACKEND),
    "tpu": (tpu.BACKEND, xla.BACKEND), "tpu_interpret": (tpu.BACKEND, xla.BACKEND),
}


def default_backend() -> Backend:
    """What `FlashConfig.backend=None` means on the target device: "tpu" on a TPU, the Pallas Triton lowering on
    NVIDIA GPUs (Mosaic GPU on Hopper when the environment sets PROBJAX_MOSAIC=1: it is opt-in until it has
    run on a GPU, docs/perf-notes.md), interpret mode everywhere else."""
    backend = _backend.config_backend(None)
    if backend != "gpu":
        return backend  # "tpu", or "interpret" off the accelerators
    return "mosaic" if os.environ.get(MOSAIC_ENV, "0") == "1" and is_hopper(_backend.target_device()) else "triton"


def default_config(config: FlashConfig | None, *, q_len: int, kv_len: int, head_dim: int,
                   dtype=None) -> FlashConfig:
    """`config` with its `None` fields filled for the backend, sequence lengths and padded head dim on
    the target device: each backend of the order fills what the one before it left open (from the last)."""
    config = config or FlashConfig()
    config = dataclasses.replace(config, backend=config.backend or default_backend())
    device, filled = _backend.target_device(), None
    for backend in reversed(ORDER[config.backend]):
        filled = backend.defaults(config, filled, q_len=q_len, kv_len=kv_len, head_dim=head_dim, dtype=dtype,
                                  device=device)
    return filled


def _within_tables(config: FlashConfig, filled: FlashConfig, block_sizes: tuple[int, int]) -> FlashConfig:
    """Kernel tiles must divide a BlockMask's tiles: default ones shrink to them, explicit ones must fit."""
    fields = {}
    for name in ("block_q", "block_q_dq", "block_q_dkv", "block_k", "block_k_dq", "block_k_dkv"):
        value, limit = getattr(filled, name), block_sizes[0 if name.startswith("block_q") else 1]
        if value > limit:
            if getattr(config, name) is not None:
                raise ValueError(f"config.{name}={value} is larger than the block mask's tile {block_sizes}.")
            value = limit
        fields[name] = value
    return dataclasses.replace(filled, **fields)


def _coarsens(backend: Backend, features: Features) -> bool:
    """Whether `backend`'s first backend keeps its tiles under an exact mask_mod's BlockMask (coarsens them)."""
    return features.exact_mask_mod and getattr(ORDER[backend][0], "coarsens_block_masks", False)


def plan(features: Features, config: FlashConfig | None, *, q_shape: tuple, k_shape: tuple, value_dim: int, dtype,
         bias_shape: tuple | None, mask_shape: tuple | None, table_shape: tuple | None, has_segments: bool,
         num_score_consts: int, num_mask_consts: int, bias_dtype: str | None = None) -> Plan:
    """The frozen plan of one call on checked inputs (q `[B, T, N, D]`, k `[B|1, S, K, D]`, bias / mask 4-D
    with 1 on broadcast axes, `bias_dtype` its dtype's name): the tiles, the padded sizes, the `_Problem`, and
    each pass's kernels; the hooks are traced at every shape the planned kernels and the XLA passes call them with."""
    batch, q_len, num_heads, head_dim = q_shape
    kv_batch, kv_len, num_kv_heads = k_shape[:3]
    d_pad, dv_pad = (max(16, 1 << (dim - 1).bit_length()) for dim in (head_dim, value_dim))
    config = config or FlashConfig()
    # A BlockMask call's defaults take q's head dim alone (flex_attention's choice since it fitted its tiles).
    defaults_dim = d_pad if features.block_sizes is not None else max(d_pad, dv_pad)
    filled = default_config(config, q_len=q_len, kv_len=kv_len, head_dim=defaults_dim, dtype=dtype)
    if features.block_sizes is not None and not _coarsens(filled.backend, features):
        filled = _within_tables(config, filled, features.block_sizes)
    table_q, table_k = features.block_sizes or (1, 1)  # a BlockMask's tables cover whole tiles
    q_multiple = max(filled.block_q, filled.block_q_dq, filled.block_q_dkv, table_q)
    kv_multiple = max(filled.block_k, filled.block_k_dq, filled.block_k_dkv, table_k)
    t_pad, s_pad = -(-q_len // q_multiple) * q_multiple, -(-kv_len // kv_multiple) * kv_multiple

    def padded(shape):  # only the sequence axes that are not broadcast get padded
        return None if shape is None else (*shape[:2], t_pad if shape[2] > 1 else 1, s_pad if shape[3] > 1 else 1)

    problem = _Problem(
        features=features, group=num_heads // num_kv_heads, num_heads=num_heads, bias_shape=padded(bias_shape),
        mask_shape=padded(mask_shape), table_shape=table_shape, has_segments=has_segments,
        num_score_consts=num_score_consts, num_mask_consts=num_mask_consts, config=filled,
        precision=lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT,
        kv_broadcast=kv_batch == 1 < batch, same_value_dim=dv_pad == d_pad, bias_dtype=bias_dtype,
    )
    passes: dict[str, KernelPass] = {}
    device, head_dims = _backend.target_device(), (d_pad, dv_pad)
    for backend in ORDER[filled.backend]:
        shapes = backend.hook_shapes(problem, dtype=dtype, head_dims=head_dims, device=device)
        _chunked._prepare_hooks(features, shapes, batch, num_heads, t_pad, s_pad)
        reason = backend.unsupported(problem, dtype=dtype, head_dims=head_dims, device=device)
        if reason is not None:
            if backend.warns_when_declining:
                warnings.warn(f"FlashConfig(backend={filled.backend!r}): the {backend.name} kernels cannot run "
                              f"{reason}; this call runs the XLA path (query chunks, not a Pallas kernel).",
                              stacklevel=4)
            continue
        planned = backend.plan(problem, dtype=dtype, head_dims=head_dims, device=device)
        _chunked._prepare_hooks(features, planned.hook_shapes, batch, num_heads, t_pad, s_pad)
        for name in ("forward", "backward", "tangent"):
            if name not in passes and getattr(planned, name) is not None:
                passes[name] = getattr(planned, name)
        if len(passes) == 3:
            break
    return Plan(problem=problem, t_pad=t_pad, s_pad=s_pad, d_pad=d_pad, dv_pad=dv_pad, **passes)


@dataclasses.dataclass(frozen=True)
class DecodePass:
    """A decode call's kernel: `run(plan, q, k, v, kv_lengths, block_tables, consts)` -> (out, lse)."""

    run: object
    plan: object


def decode_plan(inputs: DecodeInputs, config: DecodeConfig | None, score_mod: Hook | None, mask_mod: Hook | None,
                num_score_consts: int) -> DecodePass | None:
    """The decode kernel's static plan. `config.backend=None` is the Triton decode kernel on every GPU
    (Mosaic included: the GPU decode kernel is Triton's alone), the Mosaic TPU one on a TPU and interpret
    mode elsewhere. None, with a warning naming the op, for a hook the Mosaic TPU decode kernel cannot run
    (a gather such as `table[q_idx - kv_idx]`): the caller runs the XLA path, as flash calls do."""
    config = config or DecodeConfig()
    if config.backend is None:
        backend = {"triton": "triton", "mosaic": "triton", "tpu": "tpu"}.get(default_backend(), "interpret")
        config = dataclasses.replace(config, backend=backend)
    if config.backend in tpu.BACKEND.configs:
        device = _backend.target_device()
        generation = "interpret" if config.backend == "tpu_interpret" else tpu.tpu_generation(device)
        try:
            return DecodePass(tpu_decode.decode, tpu_decode.plan_for(inputs, config, score_mod, mask_mod,
                                                                     num_score_consts, generation))
        except tpu_decode.HookNotInKernel as reason:
            warnings.warn(f"DecodeConfig(backend={config.backend!r}): {reason}; this call runs the XLA path "
                          "(decode_attention_reference, not a Pallas kernel).", stacklevel=3)
            return None
    if config.backend == "triton" and config.block_k is None and is_consumer_blackwell(_backend.target_device()):
        # sm_120: 32 keys a step to head dim 128 in 16 bits (64 spilled 16 B at 128 registers; 32 holds 94).
        if max(inputs.shape[-2:]) <= 128 and inputs.q.dtype.itemsize <= 2:
            config = dataclasses.replace(config, block_k=32)
    return DecodePass(triton_decode.decode, triton_decode.plan_for(inputs, config, score_mod, mask_mod,
                                                                   num_score_consts))


def ragged_plan(config: RaggedConfig | None, inputs: RaggedInputs, score_mod: Hook | None, mask_mod: Hook | None,
                block_q: int):
    """The `ragged_paged_attention_kernel` of `config.backend` (the kernel contract: ragged/attention.py), with
    its launch options bound; None for "xla" (the caller runs its plain-jnp reference). `backend=None`: the
    Triton kernel on every GPU (Mosaic included), the Mosaic TPU one on a TPU, "xla" elsewhere. None too,
    with a warning naming the op, for a hook the Mosaic TPU kernel cannot lower (a gather such as
    `table[q_idx - kv_idx]`), as decode calls do."""
    config = config or RaggedConfig()
    backend = config.backend or {"triton": "triton", "mosaic": "triton", "tpu": "tpu"}.get(default_backend(), "xla")
    if backend == "xla":
        return None
    # Each backend's ragged kernel file is imported when chosen, so the XLA path needs none of them.
    if backend in ("tpu", "tpu_interpret"):
        from probjax_kernels.tpu import ragged as tpu_ragged
        num_tokens, num_heads, num_kv_heads, _, _ = inputs.shape
        reason = tpu_ragged.hooks_refused(
            score_mod, mask_mod, dtype=inputs.q.dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
            page_size=inputs.page_size, pages_per_seq=inputs.page_indices.shape[1], block_q=block_q)
        if reason is not None:
            warnings.warn(f"RaggedConfig(backend={backend!r}): {reason}; this call runs the XLA path "
                          "(ragged_paged_attention_reference, not a Pallas kernel).", stacklevel=3)
            return None
        return functools.partial(tpu_ragged.ragged_paged_attention_kernel, interpret=backend == "tpu_interpret")
    from probjax_kernels.triton import ragged as triton_ragged
    reason = triton_ragged.pages_refused(inputs.k_pages.dtype, interpret=backend == "interpret")
    if reason is not None:
        warnings.warn(f"RaggedConfig(backend={backend!r}): the Triton kernel cannot read {reason}; this call runs "
                      "the XLA path (ragged_paged_attention_reference, not a Pallas kernel).", stacklevel=3)
        return None
    launch = {name: getattr(config, name) for name in ("num_warps", "num_stages") if getattr(config, name)}
    return functools.partial(triton_ragged.ragged_paged_attention_kernel, interpret=backend == "interpret", **launch)
