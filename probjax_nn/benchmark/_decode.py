"""`python -m probjax_nn.benchmark decode`: one decode step (T new tokens against a long KV cache) per row.

The grid: batch x cache length x (N, K) heads x page size (0 = a dense cache) x dtype, at one head dim and T.
Each row follows the seed's schema (impl, dtype, head_dim, seq = the cache length, causal, mode "decode",
batch, heads, tag, errors, memory, timing, tflops) plus decode's own keys: kv_heads, new_tokens, page_size and
gbps (the K / V bytes read per second). Errors are against a float32 reference on the first sequence.
Impls: probjax_decode (dense and paged), jax_xla (`jax.nn.dot_product_attention`, dense, T = 1), torch_sdpa
(dense, T = 1), torch_flex (FlexAttention compiled, dense) and flash_attn_kvcache (`flash_attn_with_kvcache`,
dense and paged); a peer that cannot take a row's cache records why in the row.
On a CPU the kernel runs in Pallas interpret mode: rows record the schema and the errors, without timing.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from probjax_kernels import decode_attention, decode_attention_reference
from probjax_nn.benchmark._cli import (
    Report, _error_text, _errors, _output_problem, _positive, _Progress, _release_memory,
)
from probjax_nn.benchmark._impls import FLOATS, TORCH_DEVICE, _MB, _torch_available
from probjax_nn.benchmark._timing import time_steps

DECODE_CONFIG_KEYS = ("kv_heads", "new_tokens", "page_sizes")
# What `probjax_kernels.decode_attention` takes (its docstring): T = 1..16 new tokens, pages of a power of two
# >= 16 keys. Checked with the flags, before the first row: otherwise every row would record a reshape or
# kernel error.
MAX_NEW_TOKENS, MIN_PAGE = 16, 16


def _heads(text: str) -> tuple[int, int]:
    try:
        num_heads, num_kv_heads = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N:K (query heads : key/value heads)") from None
    if min(num_heads, num_kv_heads) < 1 or num_heads % num_kv_heads:
        raise argparse.ArgumentTypeError(f"{text}: N must be a positive multiple of K")
    return num_heads, num_kv_heads


def _page_size(text: str) -> int:
    value = int(text)
    if value != 0 and (value < MIN_PAGE or value & (value - 1)):
        raise argparse.ArgumentTypeError(f"{value} is not 0 (a dense cache) or a power of two >= {MIN_PAGE}")
    return value


def _new_tokens(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_NEW_TOKENS:
        raise argparse.ArgumentTypeError(f"{value} is not in 1..{MAX_NEW_TOKENS} (the decode kernel's T)")
    return value


def _grid_problem(args: argparse.Namespace) -> str | None:
    """Why the flags' grid has a case no row could measure, as a usage error's message; None when it has none."""
    for cache_len in args.cache_lens:
        if cache_len < args.new_tokens:
            return (f"argument --cache-lens: {cache_len} is shorter than --new-tokens {args.new_tokens} (the cache "
                    "holds the new tokens)")
        for page_size in args.page_sizes:
            if page_size and cache_len % page_size:
                return (f"argument --page-sizes: {page_size} does not divide --cache-lens {cache_len} (whole "
                        "pages only)")
    return None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m probjax_nn.benchmark decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="docs/benchmarks/gpu_decode.json")
    parser.add_argument("--batch", type=_positive, nargs="+", default=[1, 8, 64])
    parser.add_argument("--cache-lens", type=_positive, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--heads", type=_heads, nargs="+", default=[(8, 1), (32, 8)], help="N:K pairs")
    parser.add_argument("--head-dim", type=_positive, default=128)
    parser.add_argument("--new-tokens", type=_new_tokens, default=1, help=f"T, 1..{MAX_NEW_TOKENS}")
    parser.add_argument("--page-sizes", type=_page_size, nargs="+", default=[0, 16, 64],
                        help=f"0: a dense cache; else a power of two >= {MIN_PAGE} that divides every cache length")
    parser.add_argument("--dtypes", nargs="+", choices=FLOATS, default=["bfloat16"])
    parser.add_argument("--impls", nargs="+", choices=tuple(DECODE_IMPLS), default=list(DECODE_IMPLS))
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    problem = _grid_problem(args) or _output_problem(pathlib.Path(args.output), False)
    if problem is not None:
        parser.error(problem)
    # The seed's config keys, which `Report` reads.
    args.head_dims, args.seq_lens, args.ragged_seq_lens = [args.head_dim], args.cache_lens, []
    args.modes, args.causal, args.append = ["decode"], [0], False
    return args


class DecodeCase:
    """q `[B, T, N, D]`, a dense cache `[B, S, K, D]`, the same keys as shuffled pages (page_size > 0), full
    lengths."""

    def __init__(self, dtype: str, batch: int, cache_len: int, heads: tuple[int, int], head_dim: int,
                 new_tokens: int, page_size: int):
        num_heads, num_kv_heads = heads
        keys = jax.random.split(jax.random.key(cache_len + 7 * batch + num_heads), 3)
        self.q = jax.random.normal(keys[0], (batch, new_tokens, num_heads, head_dim), jnp.float32).astype(dtype)
        shape = (batch, cache_len, num_kv_heads, head_dim)
        self.k, self.v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys[1:])
        self.lengths = jnp.full((batch,), cache_len, jnp.int32)
        self.page_size, self.tables = page_size, None
        if page_size:
            pages = cache_len // page_size
            order = jax.random.permutation(jax.random.key(3), batch * pages).astype(jnp.int32)
            self.tables = order.reshape(batch, pages)
            inverse = jnp.argsort(order)  # page order[i] holds flat page i
            as_pages = lambda x: x.reshape(batch * pages, page_size, *x.shape[2:])[inverse]  # noqa: E731
            self.k_pages, self.v_pages = as_pages(self.k), as_pages(self.v)

    def expected(self) -> list[np.ndarray]:
        """The float32 reference output of the first sequence."""
        out = jax.jit(lambda q, k, v, n: decode_attention_reference(q, k, v, kv_lengths=n))(
            self.q[:1].astype(jnp.float32), self.k[:1].astype(jnp.float32), self.v[:1].astype(jnp.float32),
            self.lengths[:1])
        return [np.asarray(out)]


class _JaxDecode:
    def __init__(self, fn: Callable, args: tuple):
        self._args = args
        start = time.perf_counter()
        self._compiled = jax.jit(fn).lower(*args).compile()
        self.compile_s = time.perf_counter() - start
        memory = self._compiled.memory_analysis()
        self.memory = {"xla_temp_mb": None if memory is None else memory.temp_size_in_bytes * _MB,
                       "xla_arg_mb": None if memory is None else memory.argument_size_in_bytes * _MB,
                       "xla_out_mb": None if memory is None else memory.output_size_in_bytes * _MB}

    def run(self):
        return self._compiled(*self._args)

    def wait(self, result) -> None:
        jax.block_until_ready(result)

    def first(self, result) -> np.ndarray:
        return np.asarray(result[:1]).astype(np.float32)


def _probjax(case: DecodeCase):
    if case.page_size:
        return _JaxDecode(lambda q, k, v, n, t: decode_attention(q, k, v, kv_lengths=n, block_tables=t),
                          (case.q, case.k_pages, case.v_pages, case.lengths, case.tables))
    return _JaxDecode(lambda q, k, v, n: decode_attention(q, k, v, kv_lengths=n),
                      (case.q, case.k, case.v, case.lengths))


def _jax_xla(case: DecodeCase):
    if case.q.shape[1] != 1:
        raise NotImplementedError("jax.nn.dot_product_attention is measured at T = 1 only")
    if case.page_size:
        raise NotImplementedError("jax.nn.dot_product_attention takes a dense cache only")
    return _JaxDecode(lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n),
                      (case.q, case.k, case.v, case.lengths))


class _TorchDecode:
    """A torch peer's step on the case's tensors (moved to TORCH_DEVICE once); compile_s is the first call's
    time, memory the peak of the second."""

    def __init__(self, step: Callable, layout: str):
        import torch

        self._torch, self._step, self._layout = torch, step, layout
        start = time.perf_counter()
        self.wait(step())
        self.compile_s = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        self.wait(step())
        self.memory = {"peak_mb": torch.cuda.max_memory_allocated() * _MB}

    def run(self):
        return self._step()

    def wait(self, result) -> None:
        self._torch.cuda.synchronize()

    def first(self, result) -> np.ndarray:
        first = result[:1].float()
        return (first.permute(0, 2, 1, 3) if self._layout == "bntd" else first).cpu().numpy()


def _torch(x: jax.Array, heads_first: bool = False):
    import torch

    tensor = torch.from_dlpack(x).to(TORCH_DEVICE)
    return tensor.permute(0, 2, 1, 3).contiguous() if heads_first else tensor


def _dense_only(case: DecodeCase, name: str, needs_t1: bool) -> None:
    if case.page_size:
        raise NotImplementedError(f"{name} takes a dense cache only")
    if needs_t1 and case.q.shape[1] != 1:
        raise NotImplementedError(f"{name} is measured at T = 1 only (no decode mask)")


def _torch_sdpa(case: DecodeCase) -> _TorchDecode:
    """torch's scaled_dot_product_attention on the dense cache (enable_gqa), T = 1 (no mask needed)."""
    import torch.nn.functional as F

    _dense_only(case, "torch SDPA", needs_t1=True)
    q, k, v = (_torch(x, heads_first=True) for x in (case.q, case.k, case.v))
    return _TorchDecode(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), "bntd")


def _torch_flex(case: DecodeCase) -> _TorchDecode:
    """torch FlexAttention (compiled; its decoding path for short queries) on the dense cache, the new tokens
    causal among themselves at the end of the cache."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _dense_only(case, "torch FlexAttention", needs_t1=False)
    torch.compiler.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = (_torch(x, heads_first=True) for x in (case.q, case.k, case.v))
    new_tokens, cache_len = q.shape[2], k.shape[2]
    block_mask = None
    if new_tokens > 1:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + cache_len - new_tokens >= kv_idx,
                                       None, None, new_tokens, cache_len, device=TORCH_DEVICE)
    return _TorchDecode(lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=True), "bntd")


def _flash_attn_kvcache(case: DecodeCase) -> _TorchDecode:
    """flash-attn's `flash_attn_with_kvcache` (our `[B, T, N, D]` layout, and our page layout with its
    `block_table`), causal: the new tokens end each cache."""
    from flash_attn import flash_attn_with_kvcache

    q = _torch(case.q)
    lengths = _torch(case.lengths)
    if case.page_size:
        k, v, tables = _torch(case.k_pages), _torch(case.v_pages), _torch(case.tables)
        return _TorchDecode(lambda: flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lengths, block_table=tables, causal=True), "btnd")
    k, v = _torch(case.k), _torch(case.v)
    return _TorchDecode(lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True), "btnd")


def _anywhere() -> None:
    return None


DECODE_IMPLS: dict[str, tuple[Callable[[], str | None], Callable]] = {
    "probjax_decode": (_anywhere, _probjax),
    "jax_xla": (_anywhere, _jax_xla),
    "torch_sdpa": (_torch_available(), _torch_sdpa),
    "torch_flex": (_torch_available("triton"), _torch_flex),
    "flash_attn_kvcache": (_torch_available("flash_attn"), _flash_attn_kvcache),
}


def _row(args, impl: str, dtype: str, batch: int, cache_len: int, heads, page_size: int) -> dict:
    return {
        "impl": impl, "dtype": dtype, "head_dim": args.head_dim, "seq": cache_len, "causal": False,
        "mode": "decode", "batch": batch, "heads": heads[0], "tag": args.tag, "kv_heads": heads[1],
        "new_tokens": args.new_tokens, "page_size": page_size,
    }


def measure(runner, case: DecodeCase, expected: list[np.ndarray] | None, timed: bool) -> dict:
    result = runner.run()
    runner.wait(result)
    max_abs_err = rel_err = None
    if expected is not None:
        max_abs_err, rel_err = _errors([runner.first(result)], expected)
    del result
    row = {"max_abs_err": max_abs_err, "rel_err": rel_err, **runner.memory, "compile_s": runner.compile_s}
    timing = time_steps(runner.run, runner.wait) if timed else dict.fromkeys(("inner", "median_ms", "q1_ms", "q3_ms"))
    row.update(timing)
    batch, new_tokens, num_heads, head_dim = case.q.shape
    seconds = None if timing["median_ms"] is None else timing["median_ms"] * 1e-3
    flops = 4.0 * batch * num_heads * new_tokens * case.k.shape[1] * head_dim
    kv_bytes = 2 * case.k.size * case.k.dtype.itemsize
    row["tflops"] = None if seconds is None else flops / seconds / 1e12
    row["gbps"] = None if seconds is None else kv_bytes / seconds / 1e9
    return row


def run(args: argparse.Namespace) -> pathlib.Path:
    report = Report(args)
    report.config = {
        "output": args.output, "batch": args.batch, "heads": [f"{n}:{k}" for n, k in args.heads],
        "head_dims": [args.head_dim], "seq_lens": args.cache_lens, "ragged_seq_lens": [], "dtypes": args.dtypes,
        "modes": ["decode"], "causal": [0], "impls": args.impls, "append": False, "tag": args.tag,
        "kv_heads": [k for _, k in args.heads], "new_tokens": args.new_tokens, "page_sizes": args.page_sizes,
    }
    timed = jax.default_backend() == "gpu"
    missing = {name: DECODE_IMPLS[name][0]() for name in args.impls}
    grid = list(itertools.product(args.dtypes, args.heads, args.cache_lens, args.batch, args.page_sizes))
    progress = _Progress(len(grid) * len(args.impls))
    for dtype, heads, cache_len, batch, page_size in grid:
        name = f"{dtype} B={batch} S={cache_len} {heads[0]}:{heads[1]} page={page_size or 'dense'}"
        try:
            case = DecodeCase(dtype, batch, cache_len, heads, args.head_dim, args.new_tokens, page_size)
            expected = case.expected()
        except Exception as error:  # noqa: BLE001 - out of memory at the largest shapes: every impl's row says so
            case, expected, failure = None, None, _error_text(error)
        for impl in args.impls:
            row = _row(args, impl, dtype, batch, cache_len, heads, page_size)
            if missing[impl] is not None:
                row["error"] = f"missing: {missing[impl]}"
            elif case is None:
                row["error"] = failure
            else:
                try:
                    row.update(measure(DECODE_IMPLS[impl][1](case), case, expected, timed))
                except Exception as error:  # noqa: BLE001 - recorded in the row; the run goes on
                    row["error"] = _error_text(error)
                finally:
                    _release_memory()
            report.add(row)
            summary = row.get("error") or (f"{row['median_ms']:.4f} ms {row['gbps']:.0f} GB/s" if timed else "")
            progress.row(f"{impl:<15} {name:<40} rel_err {row.get('rel_err')} {summary}"[:200])
        del case
        _release_memory()
    progress.close()
    return report.path


def decode_main(argv: Sequence[str]) -> int:
    path = run(parse_args(argv))
    print(f"wrote {path}; draw it with: python -m probjax_nn.benchmark plot {path}")
    return 0

