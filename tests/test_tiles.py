"""`_tiles`: the tiles a block of query rows (or keys) visits, against brute force over every pair: exactly the
tiles holding an attended pair (no more, so nothing is loaded for nothing), and "full" tiles only where every
pair is attended. The Triton kernels' use of them (with masks everywhere) is checked in test_flash_hypothesis."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from probjax_kernels._tiles import kv_tile_range, q_tile_range


@settings(max_examples=300, deadline=None)
@given(
    row0=st.integers(0, 600), q_len=st.integers(0, 700), kv_len=st.integers(0, 700),
    rows=st.sampled_from([64, 128]), block_kv=st.sampled_from([64, 128]),
    left=st.none() | st.integers(0, 300), right=st.none() | st.integers(0, 300),
)
def test_kv_tile_range_visits_exactly_the_tiles_a_window_reaches(row0, q_len, kv_len, rows, block_kv, left, right):
    """[lo, hi) spans the tiles holding an attended pair of a row < q_len, from the first to the last; the
    tiles in [full_lo, full_hi) hold attended pairs only, for every row of the CTA (rows >= q_len included)."""
    lo, full_lo, full_hi, hi = (int(x) for x in kv_tile_range(
        jnp.int32(row0), rows, jnp.int32(q_len), jnp.int32(kv_len), block_kv, (left, right)))
    num_tiles = -(-kv_len // block_kv) + 1
    r = np.arange(row0, row0 + rows)[:, None]
    c = np.arange(num_tiles * block_kv)[None, :]
    allowed = (c < kv_len) & (c >= r - (np.inf if left is None else left)) & (c <= r + (np.inf if right is None else right))
    reached = (allowed & (r < q_len)).reshape(rows, num_tiles, block_kv).any(axis=(0, 2))
    if reached.any():
        assert (lo, hi) == (np.argmax(reached), num_tiles - np.argmax(reached[::-1]))
    else:
        assert lo == hi
    assert lo <= full_lo <= full_hi <= hi
    assert allowed.reshape(rows, num_tiles, block_kv)[:, full_lo:full_hi].all()


@settings(max_examples=300, deadline=None)
@given(
    key0=st.integers(0, 600), q_len=st.integers(0, 700), kv_len=st.integers(0, 700),
    keys=st.sampled_from([64, 128]), block_q=st.sampled_from([64, 128]),
    left=st.none() | st.integers(0, 300), right=st.none() | st.integers(0, 300),
)
def test_q_tile_range_visits_exactly_the_tiles_a_window_reaches(key0, q_len, kv_len, keys, block_q, left, right):
    """[lo, hi) spans the query tiles holding a row < q_len that sees one of the keys [key0, key0 + keys) below
    kv_len; the tiles in [full_lo, full_hi) see all those keys from every row (rows >= q_len included)."""
    lo, full_lo, full_hi, hi = (int(x) for x in q_tile_range(
        jnp.int32(key0), keys, jnp.int32(q_len), jnp.int32(kv_len), block_q, (left, right)))
    num_tiles = -(-max(q_len, 1) // block_q) + 1
    r = np.arange(num_tiles * block_q)[:, None]
    c = np.arange(key0, key0 + keys)[None, :]
    allowed = (c < kv_len) & (c >= r - (np.inf if left is None else left)) & (c <= r + (np.inf if right is None else right))
    reached = (allowed & (r < q_len)).reshape(num_tiles, block_q, keys).any(axis=(1, 2))
    if reached.any():
        assert (lo, hi) == (np.argmax(reached), num_tiles - np.argmax(reached[::-1]))
    else:
        assert lo == hi
    assert lo <= full_lo <= full_hi <= hi
    assert allowed.reshape(num_tiles, block_q, keys)[full_lo:full_hi].all()
