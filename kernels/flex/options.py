"""PyTorch FlexAttention's call options for `flex_attention` and its reference: `enable_gqa`,
`kernel_options`, and the auxiliary outputs `return_lse` / `return_aux=AuxRequest(...)`."""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple, TypedDict

import jax

from probjax_kernels._config import FlashConfig


class AuxRequest(NamedTuple):
    """Which auxiliary outputs `flex_attention(..., return_aux=AuxRequest(...))` computes (PyTorch's).

    - `lse`: the natural-log sum-exp of the scaled, score_mod-modified, masked scores, `[B, N, T]` float32;
      differentiable.
    - `max_scores`: the row max of those scores, `[B, N, T]` float32, -inf for a fully masked row; not
      differentiable (its gradient is zero), as in PyTorch.
    """

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """The auxiliary outputs of `flex_attention(..., return_aux=...)`: each field an array when requested in
    the `AuxRequest`, else None."""

    lse: jax.Array | None = None
    max_scores: jax.Array | None = None


class FlexKernelOptions(TypedDict, total=False):
    """The keys of PyTorch's `kernel_options` that probjax maps onto `FlashConfig` (every other key is
    ignored with a warning that names it).

    - `BLOCK_M`, `BLOCK_N` (or `fwd_BLOCK_M`, `fwd_BLOCK_N`): the forward's query / key tile, `block_q`,
      `block_k` (the forward-mode tangent kernel uses them too).
    - `BLOCK_M1`, `BLOCK_N1` (or `bwd_...`): the dK/dV kernel's query / key tile, `block_q_dkv`, `block_k_dkv`.
    - `BLOCK_M2`, `BLOCK_N2` (or `bwd_...`): the dQ kernel's query / key tile, `block_q_dq`, `block_k_dq`.
    - `num_warps`, `num_stages`: the Triton launch parameters of every kernel.
    """

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_M1: int
    BLOCK_N1: int
    BLOCK_M2: int
    BLOCK_N2: int
    num_warps: int
    num_stages: int


_FIELDS = {
    "BLOCK_M": "block_q", "BLOCK_N": "block_k", "BLOCK_M1": "block_q_dkv", "BLOCK_N1": "block_k_dkv",
    "BLOCK_M2": "block_q_dq", "BLOCK_N2": "block_k_dq", "num_warps": "num_warps", "num_stages": "num_stages",
}
# PyTorch's prefixes pick the pass an option applies to; these are the passes whose tiles probjax has.
_PREFIXED = {
    **{f"fwd_{key}": field for key, field in _FIELDS.items() if key in ("BLOCK_M", "BLOCK_N")},
    **{f"bwd_{key}": field for key, field in _FIELDS.items() if key[-1] in "12"},
}


def config_from_kernel_options(kernel_options, config: FlashConfig | None) -> FlashConfig | None:
    """`config` with PyTorch's `kernel_options` applied (see `FlexKernelOptions`).

    A key probjax has no use for (`PRESCALE_QK`, `BACKEND`, `fwd_num_warps`, ...) is ignored with a
    `UserWarning` naming it; a key that sets a `config` field to another value than `config` does is an error.
    """
    if kernel_options is None:
        return config
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}.")
    fields = {}
    for key, value in kernel_options.items():
        field = _FIELDS.get(key) or _PREFIXED.get(key)
        if field is None:
            warnings.warn(
                f"kernel_options[{key!r}] has no effect in probjax and is ignored; the keys that map onto "
                f"FlashConfig are {', '.join(sorted(_FIELDS))} (fwd_ / bwd_ prefixed where the pass has that tile).",
                UserWarning,
                stacklevel=3,
            )
            continue
        if fields.get(field, value) != value:
            raise ValueError(
                f"kernel_options sets FlashConfig.{field} twice, to {fields[field]} and {value} ({key!r}).")
        fields[field] = value
        configured = None if config is None else getattr(config, field)
        if configured is not None and configured != value:
            raise ValueError(
                f"kernel_options[{key!r}]={value!r} disagrees with config.{field}={configured!r}; pass only one."
            )
    try:
        return dataclasses.replace(config or FlashConfig(), **fields)
    except ValueError as error:
        raise ValueError(f"kernel_options: {error}") from None


def check_heads(num_heads: int, num_kv_heads: int, enable_gqa: bool) -> None:
    """PyTorch's rule: query and key/value head counts must match unless `enable_gqa=True`."""
    if not enable_gqa and num_heads != num_kv_heads:
        raise ValueError(
            f"q has N={num_heads} heads and k / v have K={num_kv_heads}; pass enable_gqa=True for grouped-query "
            "attention (N a multiple of K), as in PyTorch."
        )


def check_aux(return_lse: bool, return_aux) -> AuxRequest | None:
    if return_aux is None:
        return None
    if return_lse:
        raise ValueError("pass return_lse=True or return_aux=AuxRequest(lse=True), not both (as in PyTorch).")
    if not isinstance(return_aux, AuxRequest):
        raise TypeError(f"return_aux must be an AuxRequest or None, got {type(return_aux).__name__}.")
    return return_aux


def results(out, lse, max_scores, return_lse: bool, aux: AuxRequest | None):
    """flex_attention's return value: out, (out, lse) or (out, AuxOutput(...))."""
    if aux is not None:
        return out, AuxOutput(lse if aux.lse else None, max_scores if aux.max_scores else None)
    return (out, lse) if return_lse else out
