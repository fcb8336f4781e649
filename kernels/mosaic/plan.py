"""The Mosaic GPU backend as one object (`BACKEND`): which calls its kernels take (dtype, head dim, tiles,
features, shared memory, and hooks vetted against the Mosaic GPU lowering rules), its forward tiles, and its
plan. On Hopper (compute capability 9.x): the Mosaic forward, and the Mosaic dQ and dK/dV kernels where a
score_mod's derivative lowers too (at head dim 256 without a score_mod), and there the Mosaic tangent kernel
(`_mosaic_tangent_options`: with the tangents of a bias and of a score_mod's arrays read one element at a time).
On Blackwell (10.x, tcgen05): the tcgen05 forward and backward (`forward_tcgen05`, `backward_tcgen05`) at head
dims 64 / 128 for calls with a window or causal mask, lengths, GQA, the row max, hooks that read their arrays one
element at a time (a soft cap, ALiBi, a per-head window mask_mod) or along q_idx / kv_idx (document masks,
per-token biases), BlockMasks of 128 x 128 blocks or coarser, dropout and segment ids (a key padding mask as
them); their tangent stays Triton's. It serves
`FlashConfig.backend` "mosaic" and "mosaic_interpret" (the Mosaic GPU interpreter, which runs the kernels of the
target device's generation: Blackwell's on a 10.x device, Hopper's on any other); what it leaves of a call
runs on the next backend of the chooser's order (Triton).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu import core as mosaic_gpu_core  # the Mosaic GPU lowering rules, to vet hooks
from jax._src.pallas.mosaic_gpu import lowering as mosaic_lowering
from jax.extend import core as jex_core

from probjax_kernels._backend import KernelPass, Passes, compute_capability, wide_mma
from probjax_kernels._config import FlashConfig, fit_block
from probjax_kernels._hooks import KERNEL_BINDS, Hook, live_equations
from probjax_kernels._problem import _interpreted, _Problem
from probjax_kernels.mosaic import glue
from probjax_kernels.mosaic.backward import DQ_TILES, dq_smem_bytes
from probjax_kernels.mosaic.backward_dkv import DKV_TILES, dkv_smem_bytes
from probjax_kernels.mosaic.backward_tcgen05 import CHUNK as TCGEN05_CHUNK
from probjax_kernels.mosaic.common import PART as MOSAIC_PART
from probjax_kernels.mosaic.common import PIECE as MOSAIC_PIECE
from probjax_kernels.mosaic.common import SMEM_BYTES as MOSAIC_SMEM_BYTES
from probjax_kernels.mosaic.common import bias_kind
from probjax_kernels.mosaic.common import mosaic_backward_hook_shapes, mosaic_hook_shapes
from probjax_kernels.mosaic.forward import smem_bytes as mosaic_smem_bytes
from probjax_kernels.mosaic.forward_tcgen05 import BLOCK_Q as TCGEN05_BLOCK_Q
from probjax_kernels.mosaic.forward_tcgen05 import HEAD_DIMS as TCGEN05_HEAD_DIMS
from probjax_kernels.mosaic.forward_tcgen05 import hook_shapes as tcgen05_hook_shapes
from probjax_kernels.mosaic.forward_tcgen05 import smem_bytes as tcgen05_smem_bytes
from probjax_kernels.mosaic.hook_vectors import hook_specs, specs_at, vector_counts, vector_reads
from probjax_kernels.mosaic.tangent import TANGENT_TILES, tangent_smem_bytes

TANGENT_HOOK_SHAPES = ((), (), (TANGENT_TILES[0] // 2, MOSAIC_PART), (TANGENT_TILES[0] // 2, MOSAIC_PART),
                      (TANGENT_TILES[0] // 2, MOSAIC_PART))  # where the tangent kernel calls the hooks
MOSAIC_BACKWARD_HEAD_DIMS = (64, 128, 256)  # the Mosaic dQ and dK/dV kernels', for q / k and v
MOSAIC_TANGENT_HEAD_DIMS = (64, 128, 256)  # the Mosaic tangent kernel's (at 256: in pieces, or split)
# At head dim 256 (q / k's or v's), for calls without a score_mod, the dQ and dK/dV kernels hold one K / V
# (Q / dO) slot, as Q, dO (K, V) and two 64-key (-query) slots would need 256 KiB of shared memory (32-key steps do
# not lower: wgmma's K over a 128-byte swizzled operand is a multiple of 64), and dK/dV runs dK and dV as programs
# of their own (`mosaic_backward_dkv`'s `split`: both float32 accumulators would take 256 registers a thread). At
# q / k's head dim 256 dQ and dK come from a program per 128 of their columns (`pieces`: a 64 x 256 float32
# accumulator beside S and dP spilled 460-796 B on sm_90a, docs/perf-notes.md, Version 26).
WIDE_STAGES = 1


def _mosaic_takes(problem: _Problem, dtype, head_dims: tuple[int, int]) -> bool:
    """Whether backend "mosaic" is asked for and the Mosaic GPU forward takes this call's dtype, head dims (q /
    k's and v's, `head_dims`, each 64, 128 or 256), tiles and hooks, and none of what it lacks (hooks that read
    captured arrays other than as scalars or vectors along q_idx / kv_idx or use an op Mosaic GPU cannot lower).
    Segment ids (and vector masks as such) are read as vectors beside the tiles, masks over queries and keys as
    int8 tiles, a bias as tiles of its dtype or float32 vectors (`check_bias`), other masks over keys or queries
    alone as a 0 / -inf bias (`glue.mask_as_bias`); dropout hashes every backend's keep mask in the kernels (by
    halves of the tile beside v's head dim 256)."""
    f, cfg = problem.features, problem.config
    head_dim, value_dim = head_dims
    return (
        cfg.backend in ("mosaic", "mosaic_interpret")
        and problem.bias_dtype in (None, "bfloat16", "float16", "float32")
        and f.scale > 0  # the Mosaic kernels take the row max before scaling
        and (problem.mask_shape is None or glue.vector_mask(problem) or _dense_mask(problem)
             or glue.mask_as_bias(problem))
        and (f.score_mod is None or _is_mosaic_hook(f.score_mod, cfg, with_score=True))
        and (f.mask_mod is None or _is_mosaic_hook(f.mask_mod, cfg, with_score=False))
        # A BlockMask's tables on the kernel's tiles or coarser ones (`_tiles.refined_tables`).
        and (f.block_sizes is None or (f.block_sizes[0] % cfg.block_q == 0 and f.block_sizes[1] % cfg.block_k == 0))
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim in (64, 128, 256)
        and value_dim in (64, 128, 256)
        and cfg.block_q % 128 == 0 and cfg.block_k % 64 == 0 and cfg.num_stages >= 2
        and forward_block_kv(problem, head_dims) is not None
    )


def _tcgen05_takes(problem: _Problem, dtype, head_dims: tuple[int, int]) -> bool:
    """Whether backend "mosaic" is asked for and the Blackwell forward (`forward_tcgen05`) takes the call: 16-bit
    inputs, q / k's and v's head dims 64 or 128, a positive scale, 128-row query tiles on 64- or 128-key steps
    with two stages or more (within shared memory), and nothing beyond a window (causal), lengths, GQA, a key /
    value batch of 1, the row max, hooks that run in Mosaic GPU reading their arrays one element at a time or as
    vectors along q_idx / kv_idx (`_is_tcgen05_hook`), BlockMasks on 128 x 128 blocks or coarser ones (their
    tables refined to every tcgen05 kernel's tiles), dropout (every backend's keep mask), segment ids, a mask
    over keys or queries alone that is one vector for all heads (`glue.vector_mask`: it reaches the kernels as
    segment ids), a mask over queries and keys (`[B|1, N|1, T, S]`: int8 tiles beside K), and a dense bias of
    every broadcast shape or another mask over keys or queries alone as one (`glue.mask_as_bias`), whose
    backward runs on Triton (`_tcgen05_backward_takes`)."""
    f, cfg = problem.features, problem.config
    return (
        cfg.backend in ("mosaic", "mosaic_interpret")
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and set(head_dims) <= set(TCGEN05_HEAD_DIMS)
        and f.scale > 0 and problem.bias_dtype in (None, "bfloat16", "float16", "float32")
        and (problem.mask_shape is None or glue.vector_mask(problem) or _dense_mask(problem)
             or glue.mask_as_bias(problem))
        and (f.block_sizes is None or all(size % TCGEN05_BLOCK_Q == 0 for size in f.block_sizes))
        and cfg.block_q == TCGEN05_BLOCK_Q and cfg.block_k in (64, 128) and cfg.num_stages >= 2
        and (f.score_mod is None or _is_tcgen05_hook(f.score_mod, tcgen05_hook_shapes(cfg.block_k), True))
        and (f.mask_mod is None or _is_tcgen05_hook(f.mask_mod, tcgen05_hook_shapes(cfg.block_k), False))
        and tcgen05_smem_bytes(*head_dims, cfg.block_k, cfg.num_stages, jnp.dtype(dtype).itemsize,
                               f.return_max, _has_vectors(problem),
                               _vector_counts(problem, tcgen05_hook_shapes(cfg.block_k)),
                               _dense_mask(problem), _bias_kind(problem), _bias_itemsize(problem)) <= MOSAIC_SMEM_BYTES
    )


def _tcgen05_backward_takes(problem: _Problem) -> bool:
    """Whether the Blackwell dQ and dK/dV kernels take a call the tcgen05 forward takes: it has no bias (nor a
    mask read as one: the Triton backward takes those, a bias's gradient included), and its hooks run in Mosaic
    GPU on their (128, `TCGEN05_CHUNK`) parts too, and a score_mod's derivative with them."""
    f, shapes = problem.features, tcgen05_hook_shapes(TCGEN05_CHUNK)
    if _bias_kind(problem) is not None:
        return False
    if f.mask_mod is not None and not _is_tcgen05_hook(f.mask_mod, shapes, False):
        return False
    return f.score_mod is None or (_is_tcgen05_hook(f.score_mod, shapes, True)
                                   and _is_mosaic_score_derivative(f.score_mod, specs_at(shapes, True)))


def _is_tcgen05_hook(hook: Hook, shapes: tuple, with_score: bool) -> bool:
    """Whether a hook runs inside the tcgen05 kernels at `shapes` (`tcgen05_hook_shapes`): as in the Hopper
    ones (`_runs_in_mosaic`), its arrays read one element at a time or along q_idx / kv_idx as vectors."""
    jaxpr = hook._jaxpr(specs_at(shapes, with_score))
    return _runs_in_mosaic(jaxpr, set(jaxpr.constvars))


def _forward_smem(problem: _Problem, head_dims: tuple[int, int], block_kv: int) -> int:
    """Shared memory of the Mosaic forward's CTA for this call on `block_kv`-key steps."""
    cfg, bias = problem.config, _bias_kind(problem)
    return mosaic_smem_bytes(
        head_dims[0], cfg.block_q, block_kv, cfg.num_stages, segments=_has_vectors(problem), value_dim=head_dims[1],
        return_max=problem.features.return_max, dense_mask=_dense_mask(problem), bias=bias,
        bias_itemsize=_bias_itemsize(problem), vectors=_vector_counts(problem),
    )


def forward_block_kv(problem: _Problem, head_dims: tuple[int, int]) -> int | None:
    """The keys per step of the Mosaic forward: the config's, or half of them (64 at least) where a bias's
    tiles (float32 ones at head dim 128) would not fit in shared memory beside them, in a call whose hooks and
    tables are not traced on the config's tiles; None where neither fits."""
    f, block_kv = problem.features, problem.config.block_k
    if _forward_smem(problem, head_dims, block_kv) <= MOSAIC_SMEM_BYTES:
        return block_kv
    halved = block_kv // 2
    plain = f.score_mod is None and f.mask_mod is None and f.block_sizes is None
    if (plain and _bias_kind(problem) == "tiles" and halved >= 64 and halved % 64 == 0
            and _forward_smem(problem, head_dims, halved) <= MOSAIC_SMEM_BYTES):
        return halved
    return None


def _bias_kind(problem: _Problem) -> str | None:
    """How the Mosaic kernels read the call's bias, or its mask as one (`glue.mask_as_bias`; `check_bias`):
    "tiles", "keys", "rows" or None."""
    shape = problem.mask_shape if glue.mask_as_bias(problem) else problem.bias_shape
    return None if shape is None else bias_kind(shape)


def _vector_counts(problem: _Problem, shapes: tuple | None = None) -> tuple[int, int]:
    """How many vectors of the hooks' arrays the kernels hold along queries and along keys (`hook_vectors`;
    `shapes`: where the kernels call the hooks, else the Hopper forward's tiles)."""
    f = problem.features
    return vector_counts(((f.score_mod, True), (f.mask_mod, False)), problem.config, shapes)


def _bias_itemsize(problem: _Problem) -> int:
    """Bytes of an element of the bias's tiles (a mask as a bias is float32)."""
    return jnp.dtype(problem.bias_dtype or jnp.float32).itemsize


def _dense_mask(problem: _Problem) -> bool:
    """Whether the call's dense mask spans queries and keys (`[B|1, N|1, T, S]`): int8 tiles beside K / Q."""
    shape = problem.mask_shape
    return shape is not None and shape[2] > 1 and shape[3] > 1


def _has_vectors(problem: _Problem) -> bool:
    """Whether the kernels read segment ids: the call's, or its vector mask's."""
    return problem.has_segments or glue.vector_mask(problem)


def _fits_mosaic(problem: _Problem, dtype, head_dims: tuple[int, int]) -> bool:
    """Whether the Mosaic GPU kernels run the backward of this call too (at head dims 64 / 128): when they run
    its forward and a score_mod's derivative also runs in Mosaic GPU."""
    f = problem.features
    return _mosaic_takes(problem, dtype, head_dims) and (
        f.score_mod is None or _is_mosaic_score_derivative(f.score_mod, hook_specs(problem.config, with_score=True))
    )


def _is_mosaic_hook(hook: Hook, config: FlashConfig, with_score: bool) -> bool:
    """Whether a hook can run inside the Mosaic GPU kernels (see `_runs_in_mosaic`), at their tile shapes."""
    jaxpr = hook._jaxpr(hook_specs(config, with_score))
    return _runs_in_mosaic(jaxpr, set(jaxpr.constvars))


def _is_mosaic_score_derivative(hook: Hook, specs: list) -> bool:
    """Whether a score_mod's value and derivative (its jvp, for the backward kernels) run in Mosaic GPU, at the
    argument `specs` (score, b, h, q_idx, kv_idx) of the backward kernels' calls."""
    closed = hook.jvp_jaxpr((False,) * len(hook.const_avals), *specs)
    captured = closed.jaxpr.invars[: len(hook.const_avals)]  # the refs of the hook's arrays
    return not closed.consts and _runs_in_mosaic(closed.jaxpr, set(captured))


def _runs_in_mosaic(jaxpr, consts: set) -> bool:
    """Whether every primitive of `jaxpr` has a Mosaic GPU lowering rule, and it reads the arrays `consts`
    only one element at a time (`slopes[h]`: a `dynamic_slice` of size 1 then squeezed, a scalar load from
    global memory) or along q_idx / kv_idx (`hook_vectors.vector_reads`: the kernels hold
    those as vectors, and the index arithmetic of those reads is dead), never as arrays; 0-d arrays (a
    learnable soft cap) are scalar loads wherever used."""
    elements = set()  # the size-1 slices of constants, which may only be squeezed to scalars
    consts = {var for var in consts if var.aval.shape}
    reads = vector_reads(jaxpr, list(consts))
    if reads is None:
        return False
    live = live_equations(jaxpr, reads) if reads else [True] * len(jaxpr.eqns)
    vectors = {read.const for read in reads.values()}  # read only as vectors: no other use of them
    for n, eqn in enumerate(jaxpr.eqns):
        if not live[n] or n in reads:  # a vector read gives a plain tile
            continue
        reads_element = (
            eqn.primitive.name == "dynamic_slice" and eqn.invars[0] in consts
            and all(size == 1 for size in eqn.params["slice_sizes"])
        )
        if reads_element:  # a scalar load in the kernel (`_hooks._Element`), not a lowered dynamic_slice
            elements.add(eqn.outvars[0])
        elif not _lowers_in_mosaic(eqn):
            return False
        for position, var in enumerate(eqn.invars):
            if isinstance(var, jex_core.Literal):
                continue
            if var in consts and (var in vectors or not (reads_element and position == 0)):
                return False
            if var in elements and not (eqn.primitive.name == "squeeze" and not eqn.outvars[0].aval.shape):
                return False
    outputs = {var for var in jaxpr.outvars if not isinstance(var, jex_core.Literal)}
    return not outputs & (consts | elements)


def _lowers_in_mosaic(eqn) -> bool:
    """Whether Mosaic GPU lowers the equation as the kernels bind it (`_hooks.KERNEL_BINDS`: add_any as an add, a
    power under -1 as 1 / x ** n) and its sub-jaxprs: a rule for its primitive, whose integer_pow takes no power of
    0 or 1."""
    if eqn.primitive.name == "integer_pow" and eqn.params["y"] in (0, 1):
        return False
    rules = mosaic_lowering.mosaic_lowering_rules[mosaic_gpu_core.LANExWG_SEMANTICS]
    return (eqn.primitive in rules or eqn.primitive in KERNEL_BINDS) and all(
        _lowers_in_mosaic(inner) for sub in jex_core.jaxprs_in_params(eqn.params) for inner in sub.eqns
    )


def _mosaic_backward_tiles(problem: _Problem, dtype, head_dims: tuple[int, int]) -> tuple[dict, dict] | None:
    """The tile options of the Mosaic dQ and dK/dV kernels for this call, or None when it runs on Triton.

    Plain calls take the kernels' defaults. Calls with hooks or block tables run both kernels on the forward's
    tiles (the tables' tile), which must be square: dQ's (block_q / 2, block_k) tile and dK/dV's transposed
    (block_k / 2, block_q) one then run in parts of `mosaic_backward_hook_shapes`' shape, where the hooks
    were traced. dK/dV steps over `PART` queries (one part; a table tile in block_q // PART steps): its
    128-query steps with a score_mod spilled at head dim 128 (docs/perf-notes.md, Version 7y). Either way both
    kernels' shared memory must fit, a bias's tiles and its gradient's staging included (whether the bias gets
    a gradient is known only when the backward runs). At head dim 256: `WIDE_STAGES`, dK/dV split, dQ and dK in
    pieces, each kernel on its default tiles, a mask_mod and block tables too (`_wide_backward_takes_hooks`)."""
    head_dim, value_dim = head_dims
    if not _fits_mosaic(problem, dtype, head_dims) or not {head_dim, value_dim} <= set(MOSAIC_BACKWARD_HEAD_DIMS):
        return None
    f, cfg = problem.features, problem.config
    hooked = not (f.score_mod is None and f.mask_mod is None and f.block_sizes is None)
    wide = max(head_dims) > 128
    tile = cfg.block_q
    if hooked and not wide and cfg.block_k != tile:
        return None
    if hooked and wide and not _wide_backward_takes_hooks(problem):
        return None
    dq_tiles, dkv_tiles = ((tile, tile), (MOSAIC_PART, tile)) if hooked and not wide else (DQ_TILES, DKV_TILES)
    bias = _bias_kind(problem)
    needs = dict(segments=_has_vectors(problem), value_dim=value_dim, dense_mask=_dense_mask(problem), bias=bias,
                 bias_itemsize=_bias_itemsize(problem), bias_grad=problem.bias_shape is not None,
                 vectors=_vector_counts(problem))
    staged = _interpreted(problem)  # the interpreters stage dS / P in shared memory
    stages = WIDE_STAGES if wide else 2
    pieces = max(1, head_dim // MOSAIC_PIECE)
    if max(dq_smem_bytes(head_dim, *dq_tiles, stages, staged, **needs, pieces=pieces),
           dkv_smem_bytes(head_dim, *dkv_tiles, stages, staged, **needs)) > MOSAIC_SMEM_BYTES:
        return None
    if wide:  # dQ and dK in pieces of MOSAIC_PIECE columns where q / k's head dim is 256
        dq = {"num_stages": WIDE_STAGES, "pieces": pieces}
        tables = {} if f.block_sizes is None else {"tables_block_q": DQ_TILES[0]}
        # A score_mod's derivative beside S^T, P^T and dP^T spilled the dK pieces of 128 columns 24-48 B: with
        # one, dK comes in pieces of 64 (a 64 x 64 float32 accumulator; docs/perf-notes.md, Version 35).
        dk_pieces = max(1, head_dim // (MOSAIC_PIECE // 2)) if f.score_mod is not None else pieces
        return dq, {"num_stages": WIDE_STAGES, "pieces": dk_pieces, "split": True, **tables}
    if not hooked:
        return {}, {}
    dkv = {"block_q": MOSAIC_PART, "block_kv": tile}
    return {"block_q": tile, "block_kv": tile}, dkv if f.block_sizes is None else {**dkv, "tables_block_q": tile}


def _wide_backward_takes_hooks(problem: _Problem) -> bool:
    """Whether the head dim 256 backward (`DQ_TILES`, `DKV_TILES`) takes the call's hooks and block tables: the
    hooks were traced on the parts of those tiles (`mosaic_backward_hook_shapes` of 128-query tiles), and S is
    padded to dK/dV's 128-key CTAs wherever the hooks read vectors along keys, which must span them: by a
    BlockMask whose blocks are multiples of both kernels' tiles (dQ's 128 x 64, dK/dV's 128 keys x 128 queries).
    Without a BlockMask, `glue.backward` pads k and v alone, so hooks that read vectors along keys keep Triton's
    backward there. A score_mod takes dK in 64-column pieces (`_mosaic_backward_tiles`)."""
    f = problem.features
    parts = (DQ_TILES[0] // 2, MOSAIC_PART)
    if mosaic_backward_hook_shapes(problem.config)[2] != parts:
        return False
    if f.block_sizes is None:
        return _vector_counts(problem)[1] == 0
    return f.block_sizes[0] % DQ_TILES[0] == 0 and f.block_sizes[1] % DKV_TILES[1] == 0


def _mosaic_tangent_options(problem: _Problem, dtype, head_dims: tuple[int, int]) -> dict | None:
    """The options of the Mosaic tangent kernel (`mosaic.tangent`, Hopper) for this call's forward-mode pass, or
    None where Triton's tangent runs it: calls the Mosaic kernels fit (`_fits_mosaic`) whose score_mod's arrays
    it reads one element at a time with their tangents (`_score_tangents_run_in_mosaic`; with a split, in q's
    programs), on `TANGENT_TILES` with every tangent moving within shared
    memory (a bias's too, read as the bias is: which tangents move is known only when the jvp runs; a mask sent as
    a bias holds still).
    At v's head dim 256 d out comes in `pieces` of 128 columns (a 64 x 256 float32 accumulator beside S and S'
    spills, as dQ's did); at q / k's, the tangents of q, k and v `split` into programs of their own on one ring
    slot (Q, dQ, K and dK whole with V, dV and out overflow shared memory; k's and v's in one program spilled
    8-148 B, docs/perf-notes.md, Version 28), and so they do with a bias's tiles beside v's head dim 128 or more
    (one program spilled). Where two ring slots overflow shared memory, one (float32 bias tiles: Version 33).
    At a head dim 256, pieces of 64 columns with a score_mod or dropout, and where 128-column ones overflow (bias
    tiles)."""
    head_dim, value_dim = head_dims
    if (not _fits_mosaic(problem, dtype, head_dims) or not {head_dim, value_dim} <= set(MOSAIC_TANGENT_HEAD_DIMS)
            or (problem.num_score_consts and not _score_tangents_run_in_mosaic(problem))):
        return None
    f = problem.features
    wide = max(head_dims) > MOSAIC_PIECE
    if f.block_sizes is not None and (f.block_sizes[0] % TANGENT_TILES[0] or f.block_sizes[1] % TANGENT_TILES[1]):
        return None
    # A score_mod's derivative beside S' spilled k's program 4-16 B with d out's 64 x 128 float32 accumulator
    # (Version 28), dropout's hash 4 B (Version 32): with either, d out comes in pieces of 64 columns (Versions 35,
    # 36), as it does where pieces of 128 overflow shared memory (bias tiles at 256: q's program, Version 36).
    narrow = wide and (f.score_mod is not None or f.dropout_rate > 0)
    widths = [MOSAIC_PIECE // 2] if narrow else [MOSAIC_PIECE, MOSAIC_PIECE // 2][:1 + wide]
    for width in widths:
        options = _tangent_options_at(problem, head_dims, value_dim // width if value_dim > width else 1)
        if options is not None:
            return options
    return None


def _tangent_options_at(problem: _Problem, head_dims: tuple[int, int], pieces: int) -> dict | None:
    """`_mosaic_tangent_options` with d out in `pieces`: None where every ring slot count overflows."""
    head_dim, value_dim = head_dims
    wide = max(head_dims) > MOSAIC_PIECE
    # A bias's tiles and their tangent's beside a 64 x 128 accumulator spilled one program 12-24 B (Version 33).
    split = head_dim > MOSAIC_PIECE or (_bias_kind(problem) == "tiles" and value_dim >= MOSAIC_PIECE)
    moves_bias = problem.bias_shape is not None
    groups = ([(True, False, False, False), (False, True, False, False), (False, False, True, False),
               (False, False, False, moves_bias)] if split else [(True, True, True, moves_bias)])

    def overflows(stages: int) -> bool:
        return any(tangent_smem_bytes(
            head_dim, *TANGENT_TILES, stages, segments=_has_vectors(problem),
            value_dim=value_dim // pieces, dense_mask=_dense_mask(problem), bias=_bias_kind(problem),
            bias_itemsize=_bias_itemsize(problem), vectors=_vector_counts(problem), moving=group[:3],
            indices=wide or split, d_bias=group[3]) > MOSAIC_SMEM_BYTES
            for group in groups if any(group))

    stages = WIDE_STAGES if head_dim > MOSAIC_PIECE else 2
    if overflows(stages):  # one ring slot where two overflow (float32 bias tiles and their tangent's)
        if stages == WIDE_STAGES or overflows(WIDE_STAGES):
            return None
        stages = WIDE_STAGES
    if split:
        return {"num_stages": stages, "pieces": pieces, "split": True}
    return {**({"num_stages": stages} if stages != 2 else {}), **({"pieces": pieces} if pieces > 1 else {})}


def _score_tangents_run_in_mosaic(problem: _Problem) -> bool:
    """Whether the tangent kernel takes the tangents of the score_mod's arrays: it reads none as vectors along
    q_idx / kv_idx (their tangents would need vectors of their own), and its jvp in all of them runs in Mosaic GPU
    reading arrays and tangents one element at a time (`_runs_in_mosaic`: ALiBi's slopes[h], a learnable soft cap's
    cap, whose jvp adds two tangents with `add_any`, bound as an add)."""
    hook = problem.features.score_mod
    if vector_counts(((hook, True),), problem.config, TANGENT_HOOK_SHAPES) != (0, 0):
        return False
    arrays = len(hook.const_avals)
    closed = hook.jvp_jaxpr((True,) * arrays, *specs_at(TANGENT_HOOK_SHAPES, True))
    return not closed.consts and _runs_in_mosaic(closed.jaxpr, set(closed.jaxpr.invars[:2 * arrays]))


def on_blackwell(device) -> bool:
    """Whether the device is a tcgen05 GPU (compute capability 10.x: B200 / GB200 / B300), where the Mosaic
    backend runs its Blackwell kernels."""
    return wide_mma(device) == "tcgen05"


def refuse_target(config: FlashConfig, device) -> None:
    """Raises NotImplementedError, naming the device and its compute capability, where `backend="mosaic"` meets a
    CUDA GPU its kernels cannot target: they are written for Hopper (compute capability 9.x: wgmma, TMA,
    warpgroup barriers) and Blackwell (10.x: tcgen05 and tensor memory). On consumer Blackwell (12.x: mma.sync)
    ptxas refuses their wgmma fences and tcgen05 MMAs, and before Hopper (8.x) their TMA copies; backend "triton"
    runs every call there. "mosaic_interpret" (the Mosaic GPU interpreter) runs on any device, and a device that
    is not a CUDA GPU is left to the compile."""
    capability = compute_capability(device)
    if config.backend != "mosaic" or capability is None or capability[0] in (9, 10):
        return
    kind = getattr(device, "device_kind", None) or "this GPU"
    raise NotImplementedError(
        f"FlashConfig(backend='mosaic'): the Mosaic GPU kernels target Hopper (compute capability 9.x) and "
        f"Blackwell (10.x), and the target device {kind!r} has compute capability {capability[0]}.{capability[1]}; "
        f"use backend='triton' (or leave backend unset) there.")


class _MosaicGpu:
    """The Pallas Mosaic GPU kernels (`kernels/mosaic/`): forward, dQ and dK/dV on Hopper and on Blackwell."""

    name = "Mosaic GPU"
    configs = ("mosaic", "mosaic_interpret")
    warns_when_declining = False

    def defaults(self, config: FlashConfig, filled: FlashConfig, *, q_len: int, kv_len: int, head_dim: int,
                 dtype, device) -> FlashConfig:
        """`filled` (the Triton tiles, which its fallbacks and the backward keep) with the Mosaic forward's CTA
        where `config` leaves it open: 128 query rows over two consumer warpgroups, 128-key steps (64 where q /
        k's or v's head dim is 256: `head_dim` is the larger, for shared memory), a 2-slot K/V ring. float32
        inputs run on the Triton kernels (the Mosaic ones take 16-bit), so on a GPU they keep the float32 Triton
        tiles: the Mosaic forward's 128 x 128
        needed 262,144 B of shared memory there (sm_90a has 232,448). On Blackwell it keeps Triton's tiles
        (see the comment below). A CUDA GPU other than Hopper and Blackwell refuses backend "mosaic" here
        (`refuse_target`), before any kernel is built."""
        refuse_target(config, device)
        if on_blackwell(device):
            # Triton's tiles there (128 query rows on 64-key steps at head dims 64 / 128), which the tcgen05 forward
            # takes: a call it leaves to Triton runs exactly backend "triton"'s kernels.
            return filled
        float32 = dtype is not None and jnp.dtype(dtype) == jnp.float32
        if config.backend != "mosaic_interpret" and float32:
            return filled
        block_k = 128 if head_dim <= 128 else 64
        return dataclasses.replace(
            filled,
            block_q=config.block_q if config.block_q is not None else fit_block(128, q_len),
            block_k=config.block_k if config.block_k is not None else fit_block(block_k, kv_len),
            num_stages=config.num_stages if config.num_stages is not None else 2,
        )

    def hook_shapes(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> list[tuple]:
        """The forward's consumer tiles and the backward's parts, where its kernels call the hooks (on Blackwell
        the tcgen05 kernels': the forward's (128, block_k) tiles, the backward's (128, `TCGEN05_CHUNK`) parts)."""
        if on_blackwell(device):
            return [tcgen05_hook_shapes(problem.config.block_k), tcgen05_hook_shapes(TCGEN05_CHUNK)]
        return [mosaic_hook_shapes(problem.config), mosaic_backward_hook_shapes(problem.config)]

    def unsupported(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> str | None:
        head_dims = glue.kernel_head_dims(head_dims)
        if on_blackwell(device):
            if not _tcgen05_takes(problem, dtype, head_dims):
                return "a feature, dtype, head dim or tile the Mosaic GPU forward for Blackwell lacks"
            return None
        if not _mosaic_takes(problem, dtype, head_dims):
            return "a feature, dtype, head dim or tile the Mosaic GPU forward lacks"
        return None

    def plan(self, problem: _Problem, *, dtype, head_dims: tuple[int, int], device) -> Passes:
        """Its forward on the call's tiles, and its backward where `_mosaic_backward_tiles` finds tiles; on
        Blackwell the tcgen05 forward and backward (dQ, dK/dV) of the calls `_tcgen05_takes`. Head dims under 64
        run at 64 (`glue.kernel_head_dims`)."""
        head_dims = glue.kernel_head_dims(head_dims)
        if on_blackwell(device):
            interpret = (("interpret", _interpreted(problem)),)
            backward = None
            if _tcgen05_backward_takes(problem):
                backward = KernelPass(glue.backward_tcgen05, problem, interpret)
            return Passes(forward=KernelPass(glue.forward_tcgen05, problem, interpret), backward=backward)
        tiles = _mosaic_backward_tiles(problem, dtype, head_dims)
        forward = (("interpret", _interpreted(problem)), ("block_kv", forward_block_kv(problem, head_dims)))
        backward = tangent = None
        if tiles is not None:
            backward = KernelPass(glue.backward, problem, (("tiles", tuple(tuple(t.items()) for t in tiles)),))
        tangent_options = _mosaic_tangent_options(problem, dtype, head_dims)
        if tangent_options is not None:
            tangent = KernelPass(glue.tangent, problem, (("interpret", _interpreted(problem)),
                                                         ("options", tuple(tangent_options.items()))))
        return Passes(forward=KernelPass(glue.forward, problem, forward), backward=backward, tangent=tangent,
                      hook_shapes=(TANGENT_HOOK_SHAPES,) if tangent is not None else ())


BACKEND = _MosaicGpu()
