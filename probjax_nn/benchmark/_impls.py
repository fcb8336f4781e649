"""One small adapter per impl: the dtypes it computes in, whether it can run here, and how to build its step.

Every adapter gets the same `Case`: q, k, v `[B, T, N, D]` in the benchmark dtype and a float32 cotangent,
made once per shape. `Impl.build(case)` returns a `Runner`, the step ready to time: "fwd" computes the
attention output, "fwd_bwd" the gradients of `sum(out * cotangent)` w.r.t. q, k and v, "jvp" the output and
its forward-mode tangent (`jax.jvp`) for tangents of q, k and v made from the cotangent. JAX steps are
jitted and compiled in `build` (compile_s, XLA's memory analysis); torch steps run twice there (the first
call's time is compile_s; the second measures peak memory). torch, tokamax and JAX's Pallas Triton op are
imported only by the adapters that need them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

import probjax_nn
from probjax_kernels import causal_mask, create_block_mask, flash_attention_reference, flex_attention

MODES = ("fwd", "fwd_bwd", "jvp")
SEED_MODES = ("fwd", "fwd_bwd")  # the seed's grid; "jvp" is asked for by name
FLOATS = ("bfloat16", "float16", "float32")
HALF = ("bfloat16", "float16")
_MB = 1 / 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape's inputs, the same for every impl."""

    q: jax.Array  # [B, T, N, D]
    k: jax.Array  # [B, T, N, D]
    v: jax.Array  # [B, T, N, D]
    cotangent: jax.Array  # float32, [B, T, N, D]: the output's cotangent in fwd_bwd, the tangents' source in jvp
    causal: bool
    mode: str  # "fwd" | "fwd_bwd" | "jvp"


class Runner(Protocol):
    """A built step: `wait(run())` computes it once; `outputs` gives [out] or [dq, dk, dv]."""

    compile_s: float
    memory: dict[str, float | None]  # the row's memory keys: xla_{temp,arg,out}_mb for JAX, peak_mb for torch

    def run(self) -> Any: ...

    def wait(self, result: Any) -> None: ...

    def outputs(self, result: Any) -> list[np.ndarray]:
        """float32 NumPy arrays in the `[B, T, N, D]` layout of the inputs."""
        ...


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    dtypes: tuple[str, ...]  # the dtypes it ever computes in; the benchmark leaves the others out
    available: Callable[[], str | None]  # None, or why it cannot run on this machine
    build: Callable[[Case], Runner]


# ---- JAX ----------------------------------------------------------------------------------------------------

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (q, k, v) -> out, for one Case


def jvp_tangents(q: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tangents of q, k and v in mode "jvp": the cotangent rolled by 0, 1 and 2 rows, in q's dtype."""
    return tuple(jnp.roll(cotangent, shift, axis=1).astype(q.dtype) for shift in range(3))


def jax_step(attention: Attention, mode: str) -> Callable:
    """fwd: (q, k, v) -> out; fwd_bwd: (q, k, v, cotangent) -> (dq, dk, dv) of sum(out * cotangent);
    jvp: (q, k, v, dq, dk, dv) -> (out, d_out)."""
    if mode == "fwd":
        return attention
    if mode == "jvp":
        return lambda q, k, v, dq, dk, dv: jax.jvp(attention, (q, k, v), (dq, dk, dv))

    def loss(q, k, v, cotangent):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) * cotangent)

    return jax.grad(loss, argnums=(0, 1, 2))


def step_args(case: Case, dtype=None) -> tuple[jax.Array, ...]:
    """The step's arguments; jvp's tangents are made here, once per case, not inside the timed step."""
    extra = {"fwd": (), "fwd_bwd": (case.cotangent,), "jvp": jvp_tangents(case.q, case.cotangent)}[case.mode]
    args = (case.q, case.k, case.v, *extra)
    return args if dtype is None else tuple(x.astype(dtype) for x in args)


class _JaxRunner:
    def __init__(self, attention: Attention, case: Case):
        self._args = step_args(case)
        start = time.perf_counter()
        self._compiled = jax.jit(jax_step(attention, case.mode)).lower(*self._args).compile()
        self.compile_s = time.perf_counter() - start
        memory = self._compiled.memory_analysis()
        sizes = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
        self.memory = {
            key: None if memory is None else getattr(memory, size) * _MB
            for key, size in zip(("xla_temp_mb", "xla_arg_mb", "xla_out_mb"), sizes)
        }

    def run(self):
        return self._compiled(*self._args)

    def wait(self, result) -> None:
        jax.block_until_ready(result)

    def outputs(self, result) -> list[np.ndarray]:
        return [np.asarray(x).astype(np.float32) for x in jax.tree.leaves(result)]


def reference_outputs(case: Case) -> list[np.ndarray]:
    """What the step returns, from the plain-jnp reference in float32 at matmul precision "highest".

    One batch element at a time (`lax.map`), so that the `[N, T, T]` scores of one element bound its memory.
    """
    step = jax_step(lambda q, k, v: flash_attention_reference(q, k, v, causal=case.causal), case.mode)
    args = tuple(x[:, None] for x in step_args(case, jnp.float32))  # [B, 1, T, N, D]: map over B
    with jax.default_matmul_precision("highest"):
        result = jax.jit(lambda *xs: jax.lax.map(lambda element: step(*element), xs))(*args)
    return [np.asarray(x[:, 0]) for x in jax.tree.leaves(result)]


def _on_gpu() -> str | None:
    backend = jax.default_backend()
    return None if backend == "gpu" else f"needs an NVIDIA GPU; JAX's default backend is {backend!r}"


def _anywhere() -> None:
    return None


def _jax(name: str, dtypes: tuple[str, ...], available: Callable[[], str | None], attention_for: Callable):
    """An impl whose step is a JAX function; `attention_for(case)` gives its `(q, k, v) -> out`."""
    return Impl(name, dtypes, available, lambda case: _JaxRunner(attention_for(case), case))


def _probjax_mha(case: Case) -> Attention:
    """The attention inside probjax's MultiHeadAttention modules: the Pallas flash core through
    `probjax_nn.attention(..., impl="pallas")` on the projected `[B, T, N, D]` tensors, without the
    projections (and so without flax)."""
    return lambda q, k, v: probjax_nn.attention(q, k, v, is_causal=case.causal, impl="pallas")


def _probjax_flex(case: Case, config=None) -> Attention:
    """flex_attention; causal through a block mask built once per shape, outside the step, as a model
    builds it once per sequence length."""
    seq = case.q.shape[1]
    block_mask = create_block_mask(causal_mask, None, None, seq, seq) if case.causal else None
    return lambda q, k, v: flex_attention(q, k, v, None, block_mask, enable_gqa=True, config=config)


def _probjax_flex_mosaic(case: Case) -> Attention:
    """probjax_flex with FlashConfig(backend="mosaic"): on Hopper the Mosaic GPU forward over the block tables
    and the Triton backward; on Blackwell the Triton kernels (its tcgen05 forward takes no BlockMask)."""
    from probjax_kernels import FlashConfig

    return _probjax_flex(case, FlashConfig(backend="mosaic"))


def _probjax_default(case: Case) -> Attention:
    return lambda q, k, v: probjax_nn.attention(q, k, v, is_causal=case.causal)


def _probjax_mosaic(case: Case) -> Attention:
    """flash_attention with FlashConfig(backend="mosaic"): the Mosaic GPU kernels: on Hopper forward, dQ and
    dK/dV; on Blackwell the tcgen05 forward and Triton's backward."""
    from probjax_kernels import FlashConfig, flash_attention

    config = FlashConfig(backend="mosaic")
    return lambda q, k, v: flash_attention(q, k, v, causal=case.causal, config=config)


def _jax_nn(implementation: str) -> Callable[[Case], Attention]:
    def attention_for(case: Case) -> Attention:
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=case.causal, implementation=implementation
        )

    return attention_for


def _jax_pallas_triton(case: Case) -> Attention:
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    scale = case.q.shape[-1] ** -0.5  # mha's sm_scale defaults to 1
    return lambda q, k, v: pallas_attention.mha(q, k, v, None, sm_scale=scale, causal=case.causal)


def _tokamax_available(needs_gpu: bool) -> Callable[[], str | None]:
    def available() -> str | None:
        if importlib.util.find_spec("tokamax") is None:
            return "tokamax is not installed (pip install tokamax)"
        return _on_gpu() if needs_gpu else None

    return available


def _tokamax(implementation: str | None) -> Callable[[Case], Attention]:
    def attention_for(case: Case) -> Attention:
        import tokamax

        return lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=case.causal, implementation=implementation
        )

    return attention_for


# ---- torch --------------------------------------------------------------------------------------------------

TORCH_DEVICE = "cuda"


def _torch_available(*modules: str) -> Callable[[], str | None]:
    def available() -> str | None:
        for module in ("torch", *modules):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed (pip install {module})"
        import torch

        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device"
        return None

    return available


def _to_torch(x: jax.Array):
    """The same numbers as a torch tensor on TORCH_DEVICE in torch's `[B, N, T, D]` layout (contiguous)."""
    import torch

    return torch.from_dlpack(x).to(TORCH_DEVICE).permute(0, 2, 1, 3).contiguous()


class _TorchRunner:
    def __init__(self, attention: Callable, case: Case):
        import torch

        self._torch = torch
        q, k, v = (_to_torch(x).requires_grad_(case.mode == "fwd_bwd") for x in (case.q, case.k, case.v))
        self._cuda = q.is_cuda
        if case.mode == "fwd":
            self._step = lambda: attention(q, k, v)
        elif case.mode == "jvp":  # forward-mode AD; torch's fused SDPA and flex kernels refuse it
            tangents = tuple(_to_torch(t) for t in jvp_tangents(case.q, case.cotangent))
            self._step = lambda: torch.func.jvp(attention, (q, k, v), tangents)
        else:
            cotangent = _to_torch(case.cotangent).to(q.dtype)  # what jax's astype(float32) passes back
            self._step = lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), cotangent)
        start = time.perf_counter()
        self.wait(self.run())
        self.compile_s = time.perf_counter() - start
        self.memory = {"peak_mb": None}
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
            self.wait(self.run())
            self.memory["peak_mb"] = torch.cuda.max_memory_allocated() * _MB

    def run(self):
        return self._step()

    def wait(self, result) -> None:
        if self._cuda:
            self._torch.cuda.synchronize()

    def outputs(self, result) -> list[np.ndarray]:
        results = [result] if self._torch.is_tensor(result) else list(result)
        return [x.detach().permute(0, 2, 1, 3).float().cpu().numpy() for x in results]


def _sdpa(backend: str) -> Callable[[Case], _TorchRunner]:
    """torch's scaled_dot_product_attention restricted to one SDPBackend."""

    def build(case: Case) -> _TorchRunner:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attention(q, k, v):
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

        return _TorchRunner(attention, case)

    return build


def _torch_flex(case: Case) -> _TorchRunner:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    # A fresh compile per shape: dynamo's cache holds 8 recompiles of one function, then it runs eagerly.
    torch.compiler.reset()
    compiled = torch.compile(torch_flex_attention, dynamic=False)
    seq = case.q.shape[1]
    block_mask = (
        torch_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq, device=TORCH_DEVICE)
        if case.causal
        else None
    )
    return _TorchRunner(lambda q, k, v: compiled(q, k, v, block_mask=block_mask), case)


IMPLS: dict[str, Impl] = {
    impl.name: impl
    for impl in (
        _jax("probjax_mha", FLOATS, _anywhere, _probjax_mha),
        _jax("probjax_flex", FLOATS, _anywhere, _probjax_flex),
        _jax("probjax_default", FLOATS, _anywhere, _probjax_default),
        _jax("probjax_mosaic", HALF, _on_gpu, _probjax_mosaic),
        _jax("probjax_flex_mosaic", HALF, _on_gpu, _probjax_flex_mosaic),
        _jax("jax_xla", FLOATS, _anywhere, _jax_nn("xla")),
        _jax("jax_cudnn", HALF, _on_gpu, _jax_nn("cudnn")),
        _jax("jax_pallas_triton", FLOATS, _on_gpu, _jax_pallas_triton),
        _jax("tokamax", FLOATS, _tokamax_available(needs_gpu=False), _tokamax(None)),
        _jax("tokamax_mosaic", FLOATS, _tokamax_available(needs_gpu=True), _tokamax("mosaic")),
        _jax("tokamax_triton", FLOATS, _tokamax_available(needs_gpu=True), _tokamax("triton")),
        Impl("torch_flash", HALF, _torch_available(), _sdpa("FLASH_ATTENTION")),
        Impl("torch_efficient", FLOATS, _torch_available(), _sdpa("EFFICIENT_ATTENTION")),
        Impl("torch_math", FLOATS, _torch_available(), _sdpa("MATH")),
        Impl("torch_cudnn", HALF, _torch_available(), _sdpa("CUDNN_ATTENTION")),
        Impl("torch_flex", FLOATS, _torch_available("triton"), _torch_flex),
    )
}
# The seed's impls, in its order: the default of --impls begins with them.
SEED_IMPLS = (
    "probjax_mha", "probjax_flex", "probjax_default", "jax_xla", "jax_cudnn", "torch_flash", "torch_efficient",
    "torch_math",
)
