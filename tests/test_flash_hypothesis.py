"""Property tests: the tile ranges against brute force, and the kernel on randomly drawn shapes."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close, normal, numpy_allowed, numpy_attention, output_and_grads, random_qkv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

from probjax_kernels import FlashConfig, default_config, flash_attention, flash_attention_reference
from probjax_kernels._problem import Features, _Problem
from probjax_kernels.triton.tiles import _kv_tile_range, _q_tile_range

blocks = st.sampled_from([16, 32, 64])
window_sides = st.one_of(st.none(), st.integers(0, 80))


def make_problem(left, right, masked_everywhere=False) -> _Problem:
    return _Problem(
        features=Features(scale=1.0, window_left=left, window_right=right), group=1, num_heads=1,
        bias_shape=None, mask_shape=(1, 1, 1, 1) if masked_everywhere else None, table_shape=None,
        has_segments=False, num_score_consts=0, num_mask_consts=0,
        config=default_config(None, q_len=1, kv_len=1, head_dim=16), precision=lax.Precision.DEFAULT,
    )


def pairs_allowed(rows, cols, left, right, q_len, kv_len):
    """allowed[r, c] for the given row / column index vectors (rows past q_len are "don't care": None)."""
    r, c = rows[:, None], cols[None, :]
    ok = np.broadcast_to(c < kv_len, (len(rows), len(cols))).copy()
    if right is not None:
        ok &= c <= r + right
    if left is not None:
        ok &= c >= r - left
    return ok, r < q_len


@settings(max_examples=300, deadline=None)
@given(
    q_len=st.integers(1, 200), kv_len=st.integers(1, 200), block_q=blocks, block_k=blocks,
    left=window_sides, right=window_sides, masked_everywhere=st.booleans(), data=st.data(),
)
def test_tile_ranges_cover_every_pair_and_unmasked_tiles_need_no_mask(
    q_len, kv_len, block_q, block_k, left, right, masked_everywhere, data
):
    problem = make_problem(left, right, masked_everywhere)
    t_pad, s_pad = -(-q_len // block_q) * block_q, -(-kv_len // block_k) * block_k
    q_len_valid = data.draw(st.integers(0, q_len))
    kv_len_valid = data.draw(st.integers(0, kv_len))
    for kind in ("kv", "q"):
        num_tiles = (t_pad // block_q) if kind == "kv" else (s_pad // block_k)
        for tile in range(num_tiles):
            range_fn = _kv_tile_range if kind == "kv" else _q_tile_range
            other_count = (s_pad // block_k) if kind == "kv" else (t_pad // block_q)
            lo, full_lo, full_hi, hi = (int(x) for x in range_fn(
                jnp.int32(tile), jnp.int32(q_len_valid), jnp.int32(kv_len_valid), block_q, block_k, problem,
                other_count))
            assert lo <= full_lo <= full_hi <= hi
            if kind == "kv":
                rows = tile * block_q + np.arange(block_q)
                other_tiles, other_block = s_pad // block_k, block_k
            else:
                cols = tile * block_k + np.arange(block_k)
                other_tiles, other_block = t_pad // block_q, block_q
            assert hi <= other_tiles
            for other in range(other_tiles):
                span = other * other_block + np.arange(other_block)
                if kind == "kv":
                    ok, row_matters = pairs_allowed(rows, span, left, right, q_len_valid, kv_len_valid)
                else:
                    ok, row_matters = pairs_allowed(span, cols, left, right, q_len_valid, kv_len_valid)
                needed = (ok & row_matters).any()
                if needed:
                    assert lo <= other < hi, (kind, tile, other, (lo, full_lo, full_hi, hi))
                if full_lo <= other < full_hi:
                    assert (ok | ~row_matters).all(), (kind, tile, other, (lo, full_lo, full_hi, hi))
                    assert not masked_everywhere


# Three examples: each compiles a forward, two backward kernels and a tangent kernel in interpret mode; the
# parametrized tests of test_flash_*.py cover the named shapes.
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 2), q_len=st.integers(1, 130), kv_len=st.integers(1, 130),
    num_kv_heads=st.integers(1, 2), group=st.integers(1, 3), head_dim=st.sampled_from([16, 32, 48, 80]),
    causal=st.booleans(), use_lengths=st.booleans(), block_q=blocks, block_k=blocks, seed=st.integers(0, 99),
)
def test_random_shapes_forward_gradients_and_jvp(
    batch, q_len, kv_len, num_kv_heads, group, head_dim, causal, use_lengths, block_q, block_k, seed
):
    num_heads = num_kv_heads * group
    q, k, v = random_qkv(seed, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim)
    kwargs = dict(causal=causal)
    if use_lengths:
        rng = np.random.default_rng(seed)
        kwargs["q_lengths"] = jnp.asarray(rng.integers(0, q_len + 1, batch), jnp.int32)
        kwargs["kv_lengths"] = jnp.asarray(rng.integers(0, kv_len + 1, batch), jnp.int32)
    config = FlashConfig(block_q=block_q, block_k=block_k, block_q_dq=block_q, block_k_dq=block_k,
                         block_q_dkv=block_k, block_k_dkv=block_q)
    cotangent = normal((seed, 1), q.shape[:-1] + v.shape[-1:])
    out, grads = output_and_grads(lambda *a: flash_attention(*a, config=config, **kwargs), (q, k, v), cotangent)
    allowed = numpy_allowed(batch, q_len, kv_len, **kwargs)
    expected, _ = numpy_attention(q, k, v, allowed=allowed)
    assert_close(out, expected, jnp.float32, "out")

    _, expected_grads = output_and_grads(lambda *a: flash_attention_reference(*a, **kwargs), (q, k, v), cotangent)
    for name, a, e in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_close(a, e, jnp.float32, name)

    tangents = tuple(normal((seed, 2 + i), x.shape) for i, x in enumerate((q, k, v)))
    _, d_out = jax.jvp(lambda *a: flash_attention(*a, config=config, **kwargs), (q, k, v), tangents)
    _, expected_d_out = jax.jvp(lambda *a: flash_attention_reference(*a, **kwargs), (q, k, v), tangents)
    assert_close(d_out, expected_d_out, jnp.float32, "d_out")
