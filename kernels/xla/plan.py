"""The XLA path as one backend object (`BACKEND`): it takes every call, and runs forward, backward and tangent
as XLA passes over query chunks (`_chunked.dense_forward` / `dense_backward` / `dense_tangent`), no kernel."""

from __future__ import annotations

from probjax_kernels import _chunked
from probjax_kernels._backend import KernelPass, Passes
from probjax_kernels._config import FlashConfig
from probjax_kernels._problem import _Problem, _Tangents


def run_tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, out, lse2, linear: dict,
                optional: dict):
    """(d out, d lse) by forward mode through the chunked attention (it needs neither out nor lse)."""
    return _chunked.dense_tangent(problem, tangents, q, k, v, q_len, kv_len, linear, optional)


class _Xla:
    """Attention in XLA over query chunks: the backend of last resort, after a device's kernels."""

    name = "XLA"
    configs = ()
    warns_when_declining = False

    def defaults(self, config: FlashConfig, filled: FlashConfig | None, *, q_len: int, kv_len: int, head_dim: int,
                 dtype, device) -> FlashConfig | None:
        """The tiles of the kernels before it in the order: the XLA passes chunk by their own rule."""
        return filled

    def hook_shapes(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> list[tuple]:
        return []  # the XLA passes' own shapes are traced for every call (`_chunked._prepare_hooks`)

    def unsupported(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> str | None:
        return None

    def plan(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> Passes:
        return Passes(forward=KernelPass(_chunked.dense_forward, problem),
                      backward=KernelPass(_chunked.dense_backward, problem),
                      tangent=KernelPass(run_tangent, problem))


BACKEND = _Xla()
