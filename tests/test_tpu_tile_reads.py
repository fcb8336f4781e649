"""FlashConfig(backend="tpu_interpret"): hook arrays read along q_idx / kv_idx (`doc[b, q_idx]`, a per-token
bias `bias[b, kv_idx]`, a per-query bias `bias[h // group, q_idx]`) run inside the Mosaic TPU kernels as VMEM
tiles (`probjax_kernels.tpu.vet.const_layouts`) instead of sending the call to the XLA path, against float64
NumPy; a real gather (`table[q_idx - kv_idx]`) is still refused by name. Tiny shapes: each kernel config
costs an interpret-mode compile."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, normal, numpy_allowed, numpy_attention, random_qkv

from probjax_kernels import (
    FlashConfig, and_masks, causal_mask, create_block_mask, document_mask, flex_attention, relative_bias,
)
from probjax_kernels import _autodiff, _dispatch, _hooks
from probjax_kernels.tpu import plan as tpu_plan
from probjax_kernels.tpu import vet

TPU = FlashConfig(backend="tpu_interpret")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of the Mosaic TPU kernels by kind, and turns any XLA-path warning, or an XLA pass for the
    gradient of a hook array, into an error."""
    calls = {"forward": 0, "backward": 0, "tangent": 0}

    def no_xla_pass(*args):
        raise AssertionError("a hook array's gradient took the XLA pass over query chunks")

    monkeypatch.setattr(_autodiff, "_score_const_gradients", no_xla_pass)
    for name in calls:
        original = getattr(tpu_plan, f"run_{name}")

        def counted(*args, _original=original, _name=name):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(tpu_plan, f"run_{name}", counted)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*XLA path.*")
        yield calls


def numpy_derivatives(q, k, v, allowed, bias=0.0, cotangents=None, tangents=None):
    """Float64 derivatives of attention with a dense additive `bias` `[B, N, T, S]`: for cotangents
    (d_out, d_lse), the gradients (dq, dk, dv, d score) of sum(out * d_out) + sum(lse * d_lse), with
    dS = P (dO V^T - rowsum(dO * O) + d_lse); for tangents (dq, dk, dv, d bias), (d out, d lse), with
    dP = P (dS - c), c = rowsum(P dS) = d lse."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    group, scale = q.shape[2] // k.shape[2], q.shape[3] ** -0.5
    repeat = lambda x: np.repeat(np.asarray(x, np.float64), group, axis=2)  # noqa: E731
    k, v = repeat(k), repeat(v)
    scores = np.where(allowed, np.einsum("btnd,bsnd->bnts", q, k) * scale + bias, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    p = np.where(allowed, np.exp(scores - np.where(np.isfinite(m), m, 0.0)), 0.0)
    p = p / np.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1.0)
    out = np.einsum("bnts,bsnd->btnd", p, v)
    if cotangents is not None:
        d_out, d_lse = (np.asarray(x, np.float64) for x in cotangents)
        dp = np.einsum("btnd,bsnd->bnts", d_out, v)
        ds = p * (dp - np.einsum("btnd,btnd->bnt", d_out, out)[..., None] + d_lse[..., None])
        fold = lambda x: x.reshape(*x.shape[:2], -1, group, x.shape[3]).sum(axis=3)  # noqa: E731
        return (np.einsum("bnts,bsnd->btnd", ds, k) * scale, fold(np.einsum("bnts,btnd->bsnd", ds, q) * scale),
                fold(np.einsum("bnts,btnd->bsnd", p, d_out)), ds)
    dq, dk, dv, d_bias = tangents
    ds = (np.einsum("btnd,bsnd->bnts", np.asarray(dq, np.float64), k)
          + np.einsum("btnd,bsnd->bnts", q, repeat(dk))) * scale + d_bias
    c = np.sum(np.where(allowed, p * ds, 0.0), axis=-1, keepdims=True)
    dp = np.where(allowed, p * (ds - c), 0.0)
    return np.einsum("bnts,bsnd->btnd", dp, v) + np.einsum("bnts,bsnd->btnd", p, repeat(dv)), c[..., 0]


def test_document_ids_and_per_token_biases_in_the_kernels(kernel_calls):
    """A document mask `q_doc[b, q_idx] == kv_doc[b, kv_idx]` (int ids: a query column and a key row) under a
    causal BlockMask, and the score_mod `score + kv_bias[b, kv_idx] + q_bias[h // 2, q_idx]` (a per-key bias
    selected by the BlockSpec at b, a per-query bias per kv head held whole and indexed in the kernel);
    T = 150, S = 300 (ragged, padded differently), GQA 4:2; rows whose document has no earlier key attend
    nothing. Out, lse, the gradients of q, k, v and of both biases (accumulated per tile by the dQ and dK/dV
    kernels), and the jvp in all five (the tangent kernel reads the biases' tangents as tiles too), against
    float64, from one forward (`jax.linearize`); every pass in the kernels."""
    batch, t, s, heads = 2, 150, 300, 4
    q, k, v = random_qkv(42, batch, t, s, heads, 2, 32)
    kv_bias = normal(43, (batch, s))
    q_bias = normal(44, (2, t))
    q_doc = jnp.stack([jnp.repeat(jnp.arange(3), 50), jnp.repeat(jnp.arange(2), 75)])
    kv_doc = jnp.stack([jnp.repeat(jnp.arange(3), 100), jnp.repeat(jnp.arange(2), 150)])

    def same_document(b, h, q_idx, kv_idx):
        return q_doc[b, q_idx] == kv_doc[b, kv_idx]

    block_mask = create_block_mask(and_masks(causal_mask, same_document), batch, None, t, s)

    def call(q, k, v, kv_bias, q_bias):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + kv_bias[b, kv_idx] + q_bias[h // 2, q_idx]

        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                              return_lse=True, config=TPU)

    args = (q, k, v, kv_bias, q_bias)
    tangents = tuple(normal(50 + i, x.shape) for i, x in enumerate(args))

    @jax.jit  # eagerly, every op around the kernels is an XLA compile of its own
    def run(args, out_cotangent, tangents):
        (out, lse), linear = jax.linearize(call, *args)
        cotangents = (out_cotangent, jnp.isfinite(lse).astype(jnp.float32))
        return (out, lse), cotangents, jax.linear_transpose(linear, *args)(cotangents), linear(*tangents)

    (out, lse), cotangents, grads, (d_out, d_lse) = run(args, normal(45, q.shape), tangents)

    allowed = numpy_allowed(batch, t, s, causal=True) & (
        np.asarray(q_doc)[:, None, :, None] == np.asarray(kv_doc)[:, None, None, :])
    per_head = lambda x: np.repeat(np.asarray(x, np.float64), 2, axis=0)[None, :, :, None]  # noqa: E731
    bias = np.asarray(kv_bias, np.float64)[:, None, None, :] + per_head(q_bias)
    expected, expected_lse = numpy_attention(q, k, v, allowed=allowed, bias=bias)
    assert_close(out, expected, jnp.float32, "out")
    assert np.array_equal(np.isfinite(lse), np.isfinite(expected_lse)) and not np.isfinite(expected_lse).all()
    finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)  # noqa: E731 - rows with no key in their document
    assert_close(finite(lse), finite(jnp.asarray(expected_lse, jnp.float32)), jnp.float32, "lse")
    *expected_grads, d_score = numpy_derivatives(q, k, v, allowed, bias, cotangents=cotangents)
    expected_grads += [d_score.sum(axis=(1, 2)), d_score.sum(axis=(0, 3)).reshape(2, 2, t).sum(axis=1)]
    for name, got, want in zip(("q", "k", "v", "kv_bias", "q_bias"), grads, expected_grads):
        assert_close(got, want, jnp.float32, f"d {name}")
    d_bias = np.asarray(tangents[3], np.float64)[:, None, None, :] + per_head(tangents[4])
    want_out, want_lse = numpy_derivatives(q, k, v, allowed, bias, tangents=(*tangents[:3], d_bias))
    assert_close(d_out, want_out, jnp.float32, "jvp out")
    assert_close(d_lse, want_lse, jnp.float32, "jvp lse")
    # Each pass ran in the kernels (the tangent map is traced once more: custom_linear finds its effects).
    assert all(kernel_calls.values()), kernel_calls


TILES = FlashConfig(backend="tpu_interpret", block_q=128, block_k=128, block_q_dq=128, block_k_dq=128,
                    block_q_dkv=128, block_k_dkv=128)


@pytest.mark.parametrize("score_mod, refused, smem", [
    (lambda table: lambda s, b, h, q_idx, kv_idx: s + table[0, kv_idx], None, False),
    (lambda table: lambda s, b, h, q_idx, kv_idx: s * table[h, q_idx] + table[b, 3], None, True),  # and a scalar
    (lambda table: lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx + 1], "op `gather`", None),
    (lambda table: lambda s, b, h, q_idx, kv_idx: s + table[h, kv_idx - q_idx], "op `gather`", None),
    (relative_bias, "op `gather`", None),
])
def test_tile_reads_are_taken_and_real_gathers_refused(score_mod, refused, smem):
    """Only a read whose last index is exactly q_idx / kv_idx (leading ones scalars) is a tile: an offset index
    or a relative position is a vector gather, which the kernels refuse naming the op (the call warns). An
    array also read at scalar indices keeps its SMEM copy beside the tiles."""
    table = jnp.ones((2, 255), jnp.float32)
    hook, _ = _hooks.trace_score_mod(score_mod(table))
    for transposed in (False, True):
        hook.prepare(*vet._specs(_hooks.tile_hook_shapes(128, 128, transposed), True))
    reasons = [vet.hook_problem(hook, _hooks.tile_hook_shapes(128, 128, transposed), True, derivative=True)
               for transposed in (False, True)]
    if refused is None:
        assert reasons == [None, None]
        (layout,) = vet.const_layouts(hook, TILES, True)
        assert layout.tiles and layout.smem == smem
    else:
        assert all(refused in reason for reason in reasons)


def test_document_mask_reads_one_array_as_two_tiles():
    """`document_mask(ids)` reads ids[b, q_idx] and ids[b, kv_idx]: one array, tiles along both axes, selected
    at b by the BlockSpec, no SMEM copy."""
    ids = jnp.zeros((2, 300), jnp.int32)
    hook, _, _ = _hooks.trace_hook("mask_mod", document_mask(ids), _hooks.example_indices())
    for transposed in (False, True):
        hook.prepare(*vet._specs(_hooks.tile_hook_shapes(128, 128, transposed), False))
        assert vet.hook_problem(hook, _hooks.tile_hook_shapes(128, 128, transposed), False, derivative=False) is None
    assert vet.const_layouts(hook, TILES, False) == (
        vet.ConstLayout(smem=False, tiles=(("kv", ("b",), None), ("q", ("b",), None))),)
