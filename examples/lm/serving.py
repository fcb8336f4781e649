"""Continuous batching for the LM example: an engine that serves requests arriving and finishing at different
steps, each step one packed batch of prefill chunks and decode tokens through the model's layers, with one
`probjax_kernels.ragged_paged_attention` call per layer that appends the step's keys and values to the pages.

    engine = Engine(config, params, ServingConfig(chunk_size=32, token_buckets=(16, 64)))
    tokens = engine.run([Request(0, prompt, max_new_tokens=20, arrival=0), ...])   # {request id: [20] int32}

The host side (requests, page allocator, scheduler) is examples/lm/scheduler.py; the layers on packed tokens,
for NNX, Linen and Equinox alike, are examples/lm/packed.py. `engine_step(config, serving)` is one step as a
pure function of (params, cache, schedule), jittable and compilable ahead of time for any device
(`step_inputs` gives its abstract arguments). Sampling is greedy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import probjax_kernels
from lm.common import Params
from lm.config import Config
from lm.packed import packed_layers, run_layers
from lm.scheduler import PageAllocator, Request, Schedule, Scheduler, ServingConfig

# int8 pages hold round(x / scale) in [-127, 127]; the scale is a per-(layer, kv head) float32.
INT8_MAX = 127.0


class PagedCache(NamedTuple):
    """Every layer's key and value pages, `[P, page_size, K, D]` each (the compute dtype, or int8 with
    `key_scales` / `value_scales` `[L, K]` float32: page value times the scale of its layer and head)."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    key_scales: jax.Array | None = None
    value_scales: jax.Array | None = None


Step = Callable[[Params, PagedCache, Schedule], tuple[jax.Array, PagedCache]]


def init_cache(
    config: Config, serving: ServingConfig, scales: tuple[jax.Array, jax.Array] | None = None
) -> PagedCache:
    """Zero pages for `serving` (`scales`, `[L, K]` float32 each, needed exactly when `kv_dtype="int8"`)."""
    if (serving.kv_dtype == "int8") != (scales is not None):
        raise ValueError(f"kv_dtype={serving.kv_dtype!r} needs key and value scales exactly when it is 'int8'; "
                         f"got scales={'none' if scales is None else 'given'}.")
    dtype = jnp.int8 if serving.kv_dtype == "int8" else jnp.dtype(config.dtype)
    shape = (serving.num_pages, serving.page_size, config.kv_heads, config.head_dim)
    keys, values = (tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)) for _ in range(2))
    if scales is None:
        return PagedCache(keys, values)
    for name, scale in zip(("key scales", "value scales"), scales):
        if scale.shape != (config.num_layers, config.kv_heads) or scale.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 [num_layers, num_kv_heads] = "
                             f"[{config.num_layers}, {config.kv_heads}], got {scale.dtype} {list(scale.shape)}.")
    # Copies: the engine donates its cache to each step, which would delete the caller's arrays.
    return PagedCache(keys, values, *(jnp.array(scale, copy=True) for scale in scales))


def calibrate_kv_scales(config: Config, params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-(layer, kv head) int8 scales from one calibration text, tokens `[T]` int32: the largest |key| and
    |value| each head writes there, over 127 (larger values met later are clipped to +-127). `[L, K]` each."""
    layers = packed_layers(config)(params)

    def attend(layer, query, key, value, carry):  # one sequence, causal, plain XLA
        amax = [jnp.abs(x.astype(jnp.float32)).max(axis=(0, 2)) for x in (key, value)]
        out = jax.nn.dot_product_attention(query[None], key[None], value[None], is_causal=True)[0]
        return out, carry + [amax]

    _, amax = jax.jit(lambda tokens: run_layers(layers, tokens, jnp.arange(tokens.shape[0]), attend, []))(tokens)
    key_max, value_max = (jnp.stack([layer[i] for layer in amax]) for i in (0, 1))
    return tuple(jnp.maximum(m, 1e-6) / INT8_MAX for m in (key_max, value_max))


def token_positions(schedule: Schedule) -> jax.Array:
    """The position of each packed token `[T]` int32: new token j of sequence i (of n_i) sits at
    `kv_lens[i] - n_i + j`; padding tokens at 0."""
    index = jnp.arange(schedule.tokens.shape[0], dtype=jnp.int32)
    cu_q_lens = schedule.cu_q_lens
    sequence = jnp.searchsorted(cu_q_lens[1:], index, side="right")  # how many sequences end at or before it
    sequence = jnp.minimum(sequence, cu_q_lens.shape[0] - 2)
    positions = schedule.kv_lens[sequence] - cu_q_lens[sequence + 1] + index
    return jnp.where(index < cu_q_lens[schedule.num_seqs], positions, 0)


def engine_step(config: Config, serving: ServingConfig, kernel_config=None) -> Step:
    """One engine step, `step(params, cache, schedule) -> (next_tokens [S] int32, cache)`, for any bucket.

    `params`: the model's params in the compute dtype (`train.compute_params`); `cache`: a `PagedCache` of
    `serving`'s shapes; `schedule`: a `Schedule` with `T` = one of `serving.token_buckets` tokens (T is the
    only shape that varies: one compilation per bucket). Embeds the packed tokens, runs every block with one
    `ragged_paged_attention` call per layer that writes the tokens' keys and values into the pages at their
    positions and attends each sequence's pages up to them, and returns the greedy token after each
    sequence's last packed token (garbage for padding sequences) and the updated pages. Pure and jittable;
    donate `cache` (`jax.jit(step, donate_argnums=1)`) to update the pages in place. `kernel_config`: the
    `config` of every attention call (a `probjax_kernels.RaggedConfig`; None: the device's default).
    """
    layers_of = packed_layers(config)

    def step(params: Params, cache: PagedCache, schedule: Schedule) -> tuple[jax.Array, PagedCache]:
        layers = layers_of(params)

        def attend(layer, query, key, value, pages):
            keys, values = pages
            scales = {} if cache.key_scales is None else dict(
                k_scale=cache.key_scales[layer], v_scale=cache.value_scales[layer]
            )
            out, keys[layer], values[layer] = probjax_kernels.ragged_paged_attention(
                query, keys[layer], values[layer], schedule.kv_lens, schedule.page_indices, schedule.cu_q_lens,
                schedule.num_seqs, new_k=key, new_v=value, config=kernel_config, **scales,
            )
            return out, (keys, values)

        pages = (list(cache.keys), list(cache.values))
        x, (keys, values) = run_layers(layers, schedule.tokens, token_positions(schedule), attend, pages)
        last = jnp.maximum(schedule.cu_q_lens[1:] - 1, 0)  # each sequence's last packed token
        next_tokens = jnp.argmax(layers.logits(x[last]), axis=-1).astype(jnp.int32)
        return next_tokens, cache._replace(keys=tuple(keys), values=tuple(values))

    return step


def step_inputs(config: Config, serving: ServingConfig, num_tokens: int) -> tuple[Params, PagedCache, Schedule]:
    """Abstract arguments (ShapeDtypeStructs) of `engine_step(config, serving)` at the bucket `num_tokens`:
    the params of `config`'s model in its compute dtype, the cache, the schedule. Allocates nothing, so
    `jax.jit(step).trace(*step_inputs(...)).lower(lowering_platforms=(...,))` compiles a step deviceless."""
    from lm.train import build_model, compute_params

    params = jax.eval_shape(lambda: compute_params(build_model(config, jax.random.key(0)).params, config))
    def cache():  # built under eval_shape: no array is made (an eager op fails in a deviceless compile)
        scales = (jnp.ones((config.num_layers, config.kv_heads), jnp.float32),) * 2
        return init_cache(config, serving, scales if serving.kv_dtype == "int8" else None)

    cache = jax.eval_shape(cache)
    seqs, int32 = serving.max_seqs, jnp.int32
    schedule = Schedule(
        jax.ShapeDtypeStruct((num_tokens,), int32), jax.ShapeDtypeStruct((seqs,), int32),
        jax.ShapeDtypeStruct((seqs, serving.pages_per_seq), int32), jax.ShapeDtypeStruct((seqs + 1,), int32),
        jax.ShapeDtypeStruct((), int32),
    )
    return params, cache, schedule


class Engine:
    """Serves requests with continuous batching: `run` feeds them to a `Scheduler` and runs its steps.

    `params` in the compute dtype; `kv_scales` (`calibrate_kv_scales`) exactly when `serving.kv_dtype` is
    "int8". The step is compiled once per token bucket, the first time a bucket is used (`compile` does it
    ahead). `stats` holds the last run's figures: steps, prompt and new tokens, wall and compile seconds.
    `kernel_config` as in `engine_step`.
    """

    def __init__(
        self, config: Config, params: Params, serving: ServingConfig,
        kv_scales: tuple[jax.Array, jax.Array] | None = None, allocator: PageAllocator | None = None,
        kernel_config=None,
    ):
        self.config, self.params, self.serving = config, params, serving
        self.cache = init_cache(config, serving, kv_scales)
        self.allocator = PageAllocator(serving.num_pages) if allocator is None else allocator
        self._step = jax.jit(engine_step(config, serving, kernel_config), donate_argnums=1)
        self._compiled: dict[int, Callable] = {}
        self.stats: dict[str, float] = {}

    def compile(self, num_tokens: int) -> Callable:
        """The step compiled for the bucket `num_tokens` (cached)."""
        if num_tokens not in self._compiled:
            _, _, schedule = step_inputs(self.config, self.serving, num_tokens)
            self._compiled[num_tokens] = self._step.lower(self.params, self.cache, schedule).compile()
        return self._compiled[num_tokens]

    def run(self, requests: Iterable[Request], progress: bool = False) -> dict[int, np.ndarray]:
        """Every request's new tokens `[max_new_tokens]` int32 (greedy), by request id. Requests enter the
        scheduler in arrival order; a step runs whatever has arrived, and the clock jumps over idle steps.
        With `progress`, a tqdm bar of new tokens and their rate (on stderr)."""
        requests = sorted(requests, key=lambda r: r.arrival)
        scheduler = Scheduler(self.serving, self.allocator)
        for request in requests:
            scheduler.add(request)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(r.max_new_tokens for r in requests), unit="tok", desc="serving", smoothing=0.1)
        results: dict[int, np.ndarray] = {}
        compile_seconds, prompt_tokens, step, start = 0.0, 0, 0, time.perf_counter()
        while len(results) < len(requests):
            plan = scheduler.plan(step)
            if plan is None:  # nothing running: wait for the next arrival
                step = max(step + 1, scheduler.waiting[0].arrival)
                continue
            compile_start = time.perf_counter()
            compiled = self.compile(len(plan.schedule.tokens))
            compile_seconds += time.perf_counter() - compile_start
            next_tokens, self.cache = compiled(self.params, self.cache, plan.schedule)
            prefill = sum(count for s, count in zip(plan.sequences, plan.counts) if s.prefilling)
            finished = scheduler.commit(plan, np.asarray(next_tokens))
            prompt_tokens += prefill
            results.update((request.id, tokens) for request, tokens in finished)
            if bar is not None:
                bar.update(sum(not s.prefilling for s in plan.sequences))
                bar.set_postfix(step=step, running=len(scheduler.running), waiting=len(scheduler.waiting),
                                tokens=plan.num_tokens, refresh=False)
            step += 1
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - start
        new_tokens = sum(len(tokens) for tokens in results.values())
        self.stats = dict(steps=step, prompt_tokens=prompt_tokens, new_tokens=new_tokens, wall_seconds=wall,
                          compile_seconds=compile_seconds,
                          new_tokens_per_second=new_tokens / max(wall - compile_seconds, 1e-9))
        return results
