"""What the checkout's kernels/ choose, read by running them: the repo's kernels/ imported as `probjax_kernels`
(the toolchain venv does not install the project), and the tiles the dispatch gives each Triton kernel of a
compile (as traced, the jvp's tangent kernel, backend "mosaic"'s Triton fallback).
"""

from __future__ import annotations

import contextlib
import sys

import variants as registry
from sources import REPO


@contextlib.contextmanager
def _traced_tiles(into: dict):
    """Records, by kernel name, the tiles each Triton kernel is traced at: the Triton backend's plan may retile a
    kernel for a call's features (`triton.plan.forward_config`, `backward_configs`, `tangent_config`)."""
    from probjax_kernels.triton import backward, forward, tangent

    saved = forward.forward, backward.backward, tangent.tangent

    def tiles(problem):
        return {k: v for k, v in vars(problem.config).items() if k != "backend"}

    def fwd(problem, *args):
        into["probjax_flash_forward"] = tiles(problem)
        return saved[0](problem, *args)

    def bwd(problem, tangents, res, d_out, d_lse, dkv_problem=None):
        into["probjax_flash_backward_dq"] = tiles(problem)
        split = dkv_problem is not None and dkv_problem.dkv_split  # dV's and dK's programs (`triton.plan`)
        into["probjax_flash_backward_dkv"] = dict(tiles(dkv_problem or problem), **({"splits": 2} if split else {}))
        return saved[1](problem, tangents, res, d_out, d_lse, dkv_problem)

    def tan(problem, *args, **kwargs):  # kwargs: value_splits (`triton.plan.tangent_value_splits`)
        splits = kwargs.get("value_splits", 1)
        into["probjax_flash_tangent"] = dict(tiles(problem), **({"splits": splits} if splits > 1 else {}))
        return saved[2](problem, *args, **kwargs)

    forward.forward, backward.backward, tangent.tangent = fwd, bwd, tan
    try:
        yield
    finally:
        forward.forward, backward.backward, tangent.tangent = saved


def _tangent_tiles(config, variant) -> dict:
    """The tangent kernel's tiles for a jvp variant (`triton.plan.tangent_config`, told whether the call has a
    BlockMask's tables)."""
    from probjax_kernels.triton import plan as triton_plan

    tables = variant.name.endswith(("_sliding_window", "_document_mask"))
    tangent = triton_plan.tangent_config(config, max(variant.head_dim, variant.value_dim or 0), tables,
                                         dtype=registry.dtype_of(variant.dtype))
    return {k: v for k, v in vars(tangent).items() if k != "backend"}


def _fallback_tiles(row: dict) -> dict:
    """The tiles the Triton forward runs at when backend "mosaic" falls back to it
    (`triton.plan.fallback_config`), for the page's tiles column."""
    if "probjax_kernels" not in sys.modules:
        _import_kernels()
    from probjax_kernels import FlashConfig
    from probjax_kernels.triton import plan as triton_plan

    config = FlashConfig(**row["config"], backend="mosaic")
    head_dim = max(row["head_dim"], row["value_dim"] or 0)
    return {k: v for k, v in vars(triton_plan.fallback_config(config, head_dim)).items() if k != "backend"}


def _import_kernels():
    """Import the repo's kernels/ as `probjax_kernels` (the toolchain venv does not install the project)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "probjax_kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["probjax_kernels"] = module
    spec.loader.exec_module(module)

