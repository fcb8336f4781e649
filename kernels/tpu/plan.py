"""The Mosaic TPU backend as one object (`BACKEND`): its tiles per TPU generation, which calls its kernels take
(`vet.unsupported`; what they cannot take runs the XLA path, with a warning), and its plan: the forward, dQ +
dK/dV and tangent kernels, each walking a BlockMask's tables on its own tile (refined onto it, or coarsened
where its tile covers several blocks: `_table_tiles.tables_on_tiles`). It serves
`FlashConfig.backend` "tpu" (a TPU device) and "tpu_interpret" (Pallas' TPU interpret mode, any machine)."""

from __future__ import annotations

from probjax_kernels._backend import KernelPass, Passes
from probjax_kernels._config import FlashConfig, fit_block
from probjax_kernels._hooks import flash_hook_shapes
from probjax_kernels._problem import _Problem, _Tangents
from probjax_kernels._table_tiles import tables_on_tiles
from probjax_kernels.tpu import backward, forward, fused_backward, hook_grads, tangent, tile_model, vet
from probjax_kernels.tpu.chips import CHIPS, tpu_generation  # noqa: F401  (re-exported: _dispatch)

# The TPU kernels' (forward q, forward k, dQ q, dQ k, dK/dV q, dK/dV k) tiles by TPU generation (the
# `device_kind` of the target device), picked by the tile model (`tile_model.chosen_tiles`; docs/perf-notes.md
# shows the model and the compile figures of the alternatives). Interpret mode takes the v5e tiles.
TILES = tile_model.chosen_tiles()


def default_fused_backward(generation: str, head_dim: int) -> bool:
    """The fused backward where the tile model says it pays on the generation (`tile_model.
    fused_backward_pays`) and the head dim is a multiple of 128: its float32 dQ buffer is laid out in
    (8, 128) tiles, so a head dim of 64 doubles it (128 MiB at B=4, N=8, T=8192), past splash's HBM temp."""
    return head_dim % 128 == 0 and tile_model.fused_backward_pays(CHIPS[generation], TILES[generation])


def _tables(problem: _Problem, arrays: dict, t_pad: int, s_pad: int, is_backward: bool = False) -> dict:
    """`arrays` with a BlockMask's tables on the tiles of the TPU kernels that walk them, over the padded
    sequences (T, S) = (`t_pad`, `s_pad`) (`_table_tiles.tables_on_tiles`: refined where a tile divides the
    blocks, coarsened where it covers several, which `vet.unsupported` allows for an exact mask_mod):
    "kv_tables" on the forward's tile (forward, tangent) or, in the backward pass (`is_backward`), dQ's;
    "q_tables" on dK/dV's."""
    block_sizes, cfg = problem.features.block_sizes, problem.config
    if block_sizes is None:
        return arrays
    tq, tk = (cfg.block_q_dq, cfg.block_k_dq) if is_backward else (cfg.block_q, cfg.block_k)
    kv_tables = tables_on_tiles(arrays["kv_tables"], block_sizes, (tq, tk), (t_pad // tq, s_pad // tk))
    tk, tq = cfg.block_k_dkv, cfg.block_q_dkv
    q_tables = tables_on_tiles(arrays["q_tables"], block_sizes[::-1], (tk, tq), (s_pad // tk, t_pad // tq))
    return dict(arrays, kv_tables=kv_tables, q_tables=q_tables)


def run_forward(problem: _Problem, q, k, v, q_len, kv_len, optional: dict):
    """The forward pass: `forward.forward` on the call's tables on its tile."""
    return forward.forward(problem, q, k, v, q_len, kv_len, _tables(problem, optional, q.shape[1], k.shape[1]))


def run_backward(problem: _Problem, tangents: _Tangents, res: dict, d_out, d_lse) -> dict:
    """The backward pass on the tables on their tiles: `fused_backward.backward` (one kernel) when the config
    asks for it and the call is `fused_backward.fusable`, else `backward.backward` (dQ, dK/dV)."""
    others = _tables(problem, res["others"], res["q"].shape[1], res["k"].shape[1], is_backward=True)
    fused = problem.config.fused_backward and fused_backward.fusable(
        tangents, hook_grads.tile_grads(problem, tangents))
    return (fused_backward.backward if fused else backward.backward)(problem, tangents, dict(res, others=others),
                                                                     d_out, d_lse)


def run_tangent(problem: _Problem, tangents: _Tangents, q, k, v, q_len, kv_len, out, lse2, linear: dict,
                optional: dict):
    """The forward-mode pass: `tangent.tangent` on the tables on the forward's tile."""
    return tangent.tangent(problem, tangents, q, k, v, q_len, kv_len, out, lse2, linear,
                           _tables(problem, optional, q.shape[1], k.shape[1]))


class _MosaicTpu:
    """The Pallas Mosaic TPU kernels (`kernels/tpu/`): forward, dQ, dK/dV and tangent."""

    name = "Mosaic TPU"
    configs = ("tpu", "tpu_interpret")
    warns_when_declining = True
    coarsens_block_masks = True  # `_tables`: kernel tiles may cover several blocks of an exact mask_mod

    def defaults(self, config: FlashConfig, filled: FlashConfig | None, *, q_len: int, kv_len: int, head_dim: int,
                 dtype, device) -> FlashConfig:
        """The generation's tiles (`TILES`), shrunk to the sequence but never below 128 (lse rows are lane
        vectors); explicit fields are kept (`vet.unsupported` sends tiles that are not multiples of 128 to the
        XLA path)."""
        generation = "v5e" if config.backend == "tpu_interpret" else tpu_generation(device)
        tiles = dict(zip(("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv"),
                         TILES[generation]))
        fields = {}
        for name, default in tiles.items():
            seq_len = q_len if name.startswith("block_q") else kv_len
            value = getattr(config, name)
            fields[name] = value if value is not None else max(128, fit_block(default, seq_len))
        fused = config.fused_backward
        if fused is None:
            fused = default_fused_backward(generation, head_dim)
        return FlashConfig(**fields, num_warps=config.num_warps or 4, num_stages=config.num_stages or 2,
                           backend=config.backend, fused_backward=fused)

    def hook_shapes(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> list[tuple]:
        """The three kernels' tiles and dK/dV's transposed (keys, queries) one."""
        return flash_hook_shapes(problem.config, transposed=True)

    def unsupported(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> str | None:
        return vet.unsupported(problem)

    def plan(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> Passes:
        """Every pass in its kernels, on the call's tiles."""
        return Passes(forward=KernelPass(run_forward, problem), backward=KernelPass(run_backward, problem),
                      tangent=KernelPass(run_tangent, problem))


BACKEND = _MosaicTpu()
