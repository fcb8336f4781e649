"""Input checking and normalisation shared by the flash-attention kernel and its plain-jnp reference.

Every public entry point calls `check_inputs` first, so a bad argument fails the same way on every path,
with a message that names the argument, what it got and what it needs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from probjax_kernels._config import FlashConfig
from probjax_kernels._dropout import positional_seed

MAX_HEAD_DIM = 256
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Checked attention inputs. `bias` and `mask` are 4-D (`[B|1, N|1, T|1, S|1]`), `mask` stays bool."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    q_lengths: jax.Array | None
    kv_lengths: jax.Array | None
    q_segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None
    scale: float | jax.Array  # a float, or a traced 0-d float32 (float64 for float64 q) array
    window: tuple[int | None, int | None]

    @property
    def traced_scale(self) -> bool:
        """Whether `scale` is a traced array, which the kernels apply through a score_mod (`affine_score_mod`)."""
        return not isinstance(self.scale, float)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(B, T, S, N, K, D): batch, query length, key length, query heads, key/value heads, q / k head dim."""
        batch, q_len, num_heads, head_dim = self.q.shape
        return batch, q_len, self.k.shape[1], num_heads, self.k.shape[2], head_dim

    @property
    def value_dim(self) -> int:
        """Dv, the head dim of v and of the output (may differ from D)."""
        return self.v.shape[3]

    @property
    def kv_broadcast(self) -> bool:
        """Whether k and v have batch 1 against q's batch B > 1 (shared by every example, not repeated)."""
        return self.k.shape[0] == 1 < self.q.shape[0]


def _to_4d(name: str, x, dtype_kind: str, full: tuple[int, int, int, int]) -> jax.Array:
    x = jnp.asarray(x)
    if dtype_kind == "bool" and x.dtype != jnp.bool_:
        raise TypeError(f"{name} must be a bool array (True = attend), got dtype {x.dtype}.")
    if dtype_kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}.")
    if x.ndim > 4:
        raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = {list(full)}, got shape {x.shape}.")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if any(d not in (1, f) for d, f in zip(x.shape, full)):
        raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = {list(full)}, got shape {x.shape}.")
    return x


def _check_ids(name: str, x, shape: tuple[int, ...], upper: int | None) -> jax.Array | None:
    """Checks an integer lengths / segment-ids argument; values are range-checked when they are concrete."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}.")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {x.shape}.")
    if upper is not None and not isinstance(x, jax.core.Tracer):
        values = np.asarray(x)
        if values.size and (values.min() < 0 or values.max() > upper):
            raise ValueError(
                f"{name} must lie in [0, {upper}], got values in [{values.min()}, {values.max()}]."
            )
    return x.astype(jnp.int32)


def _is_int(x) -> bool:
    """A Python or NumPy int, not a bool (True is an int to Python, but never a size)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    """An int or a float (Python, NumPy or an array), not a bool, a complex number or a string."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, float)):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))


def _check_window(window) -> tuple[int | None, int | None]:
    """`None`, an int w (left and right w) or a (left, right) pair; None on a side means unbounded."""
    if window is None:
        return (None, None)
    message = f"window must be None, an int >= 0 or a (left, right) pair of them, got {window!r}."
    if _is_int(window):
        pair = (window, window)
    elif isinstance(window, (tuple, list)):
        pair = tuple(window)
    else:
        raise ValueError(message)
    if len(pair) != 2 or any(side is not None and (not _is_int(side) or side < 0) for side in pair):
        raise ValueError(message)
    return tuple(None if side is None else int(side) for side in pair)


def check_inputs(
    q,
    k,
    v,
    *,
    bias=None,
    mask=None,
    scale=None,
    q_lengths=None,
    kv_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    window=None,
    dropout_rate: float = 0.0,
    allowed_dtypes: tuple = KERNEL_DTYPES,
    max_head_dim: int | None = MAX_HEAD_DIM,
) -> AttentionInputs:
    """Checks shapes and dtypes of an attention call and returns them normalised (see `AttentionInputs`).

    `allowed_dtypes` and `max_head_dim` (None = any) state what the caller's implementation can compute.
    """
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 ([B, T, N, D] / [B, S, K, D]), got shape {x.shape}.")
    check_dtypes(q, k, v, allowed_dtypes)
    batch, q_len, num_heads, head_dim = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same shape [B, S, K] (their head dims D, Dv may differ), got {k.shape} and "
            f"{v.shape}."
        )
    if k.shape[0] not in (1, batch) or k.shape[3] != head_dim:
        raise ValueError(
            f"k and v must be [B, S, K, D] with B={batch} (or 1, shared by the batch) and D={head_dim} as in q "
            f"{q.shape}, got {k.shape}."
        )
    kv_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    if min(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, value_dim) < 1:
        raise ValueError(f"every dimension must be >= 1, got q {q.shape}, k {k.shape} and v {v.shape}.")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"the query heads N={num_heads} must be a multiple of the key/value heads K={num_kv_heads}."
        )
    for name, dim in (("D", head_dim), ("Dv", value_dim)):
        if max_head_dim is not None and dim > max_head_dim:
            raise ValueError(f"head dim {name}={dim} is not supported: it must be <= {max_head_dim}.")
    full = (batch, num_heads, q_len, kv_len)
    if bias is not None:
        bias = _to_4d("bias", bias, "float", full)
    if mask is not None:
        mask = _to_4d("mask", mask, "bool", full)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together (or neither).")
    if scale is None:
        scale = head_dim**-0.5
    elif isinstance(scale, jax.core.Tracer):
        # A traced scale (a learnable temperature, a jit argument) stays an array, applied to the float32
        # scores: folded into q it would be rounded to q's dtype (and overflow float16).
        if scale.ndim != 0 or not _is_real(scale):
            raise TypeError(f"scale must be a real scalar, got {scale.dtype}{list(scale.shape)}.")
        scale = scale.astype(jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
    elif np.ndim(scale) != 0 or not _is_real(scale):
        raise TypeError(f"scale must be a real scalar (a Python float or a traced 0-d array), got {scale!r}.")
    elif not np.isfinite(float(scale)):
        # A NaN or infinite scale would make every score NaN, which the kernels treat as masked: output 0.
        raise ValueError(f"scale must be finite, got {scale!r}.")
    check_dropout_rate(dropout_rate)
    return AttentionInputs(
        q=q,
        k=k,
        v=v,
        bias=bias,
        mask=mask,
        q_lengths=_check_ids("q_lengths", q_lengths, (batch,), q_len),
        kv_lengths=_check_ids("kv_lengths", kv_lengths, (batch,), kv_len),
        q_segment_ids=_check_ids("q_segment_ids", q_segment_ids, (batch, q_len), None),
        kv_segment_ids=_check_ids("kv_segment_ids", kv_segment_ids, (batch, kv_len), None),
        scale=scale if isinstance(scale, jax.core.Tracer) else float(scale),
        window=_check_window(window),
    )


def check_dtypes(q, k, v, allowed_dtypes: tuple) -> None:
    """q, k and v share one dtype, one of `allowed_dtypes`; else a TypeError."""
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}.")
    if q.dtype not in allowed_dtypes:
        names = ", ".join(jnp.dtype(d).name for d in allowed_dtypes)
        raise TypeError(f"q, k and v must have dtype {names}; got {q.dtype}.")


def check_flag(name: str, value) -> bool:
    """A Python (or NumPy) bool such as `causal`; a string, a number or a traced value is a TypeError."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}.")
    return bool(value)


def check_dropout_rate(dropout_rate) -> float:
    """A Python float in [0, 1): the kernels compile the rate, so it cannot be traced."""
    if isinstance(dropout_rate, jax.core.Tracer):
        raise TypeError(
            "dropout_rate must be a Python float, got a traced value (a jit argument?): the kernels compile the "
            "rate. Pass it as a static argument (jax.jit's static_argnames) or close over it."
        )
    if np.ndim(dropout_rate) != 0 or not _is_real(dropout_rate):
        raise TypeError(f"dropout_rate must be a real number in [0, 1), got {dropout_rate!r}.")
    if not 0.0 <= float(dropout_rate) < 1.0:
        raise ValueError(f"dropout_rate must be in the range [0, 1), got {dropout_rate!r}.")
    return float(dropout_rate)


def check_logits_soft_cap(logits_soft_cap) -> float | None:
    """None (off) or a positive, finite real number, returned as a Python float: the kernels compile the cap
    (`cap * tanh(score / cap)`), so it cannot be traced."""
    if logits_soft_cap is None:
        return None
    if isinstance(logits_soft_cap, jax.core.Tracer):
        raise TypeError(
            "logits_soft_cap must be a Python float, got a traced value (a jit argument?): the kernels compile "
            "the cap. Pass it as a static argument (jax.jit's static_argnames) or close over it."
        )
    if np.ndim(logits_soft_cap) != 0 or not _is_real(logits_soft_cap) or not (
            np.isfinite(float(logits_soft_cap)) and float(logits_soft_cap) > 0):
        raise ValueError(f"logits_soft_cap must be a positive, finite float or None, got {logits_soft_cap!r}.")
    return float(logits_soft_cap)


def check_dropout(dropout_rate: float, dropout_seed) -> jax.Array | None:
    """A non-zero rate needs a seed: the keep mask is a function of (seed, b, h, q_idx, kv_idx).

    Returns the seed as a uint32 scalar array (None without one). A Python int may be anything in
    [-2**31, 2**32) (negative ones wrap, as an int32 array's do); an array must be an integer scalar.
    """
    if dropout_rate and dropout_seed is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_seed (an int or a uint32 scalar array).")
    if dropout_seed is None:
        return None
    if _is_int(dropout_seed):
        if not -(2**31) <= int(dropout_seed) < 2**32:
            raise ValueError(f"dropout_seed must lie in [-2**31, 2**32) (a 32-bit seed), got {dropout_seed}.")
        return jnp.asarray(np.uint32(int(dropout_seed) % 2**32))
    seed = jnp.asarray(dropout_seed)
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        raise TypeError(
            "dropout_seed must be an int or an integer scalar array, got a PRNG key; pass "
            "jax.random.bits(key, (), jnp.uint32) instead."
        )
    if not jnp.issubdtype(seed.dtype, jnp.integer):
        raise TypeError(f"dropout_seed must be an int or an integer scalar array, got dtype {seed.dtype}.")
    if seed.ndim != 0:
        raise ValueError(f"dropout_seed must be a scalar, got shape {seed.shape}.")
    return seed.astype(jnp.uint32)


def check_config(config) -> None:
    if config is not None and not isinstance(config, FlashConfig):
        raise TypeError(f"config must be a FlashConfig or None, got {type(config).__name__}.")


def sharded_dropout(seed, positions, shard, dropout_rate, q, k) -> tuple[dict, jax.Array | None]:
    """(`Features` fields, the dropout seed input) of a call, for a keep mask on the whole attention's indices
    when this call holds a shard of it (`_dropout.positional_seed`): `positions` as there (`ring_attention`'s
    sequence shards), `shard` = (batch offset, head offset, the whole attention's head count) for a shard of
    the batch / heads. Both are private to probjax_kernels; without them the seed is returned as it is."""
    if (positions is None and shard is None) or not dropout_rate:
        return {}, seed
    heads = None if shard is None else shard[2]
    if positions is None:  # the whole sequence: local indices are positions
        fields = {"dropout_positions": (2**30, 2**30), "dropout_heads": heads}
        positions = ((q.shape[1], 0, 0), (k.shape[1], 0, 0))
    else:
        fields = {"dropout_positions": (positions[0][0], positions[1][0]), "dropout_heads": heads}
    return fields, positional_seed(seed, positions, (0, 0) if shard is None else shard[:2])


def check_sinks(sinks, num_heads: int, *, name: str = "sinks") -> jax.Array | None:
    """None, or `sinks` as a float32 `[N]` array for N = `num_heads` query heads. Raises TypeError for a
    non-float and ValueError for another shape or, when concrete, a value that is not finite."""
    if sinks is None:
        return None
    if not hasattr(sinks, "dtype"):
        sinks = np.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array of shape [N] = [{num_heads}] (one logit per query head), "
                        f"got dtype {sinks.dtype}.")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"{name} must have shape [N] = [{num_heads}] (one logit per query head of q), got "
                         f"{list(sinks.shape)}.")
    if not isinstance(sinks, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(sinks, np.float64))):
        raise ValueError(f"{name} must be finite (a sink of -inf is no sink: pass None), got {np.asarray(sinks)}.")
    return jnp.asarray(sinks, jnp.float32)
