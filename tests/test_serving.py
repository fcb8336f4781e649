"""Continuous batching in the LM example (examples/lm/serving.py, scheduler.py, packed.py, serve_lm.py).

The engine's greedy tokens are checked against each request generated alone by the dense KV-cache path
(`lm.sampling.generate`, one token per step, no pages), for the NNX, Linen and Equinox models, with requests
arriving at different steps, prompts longer than a prefill chunk, and more requests than the page pool holds
at once; the page allocator is watched through the whole run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("optax")

from lm_micro import FRAMEWORKS, MICRO, _load_script, standard_promotion  # noqa: E402, F401 (autouse fixture)

import probjax_kernels  # noqa: E402
from lm import train  # noqa: E402
from lm.config import make_config  # noqa: E402
from lm.packed import packed_layers, run_layers  # noqa: E402
from lm.scheduler import PageAllocator, Request, Scheduler, ServingConfig  # noqa: E402
from lm.serving import Engine, calibrate_kv_scales, engine_step, step_inputs  # noqa: E402

# 2 pages of 16 per slot at most, 5 in the pool: the longest requests (up to 40 + 10 - 1 positions) need 4, so
# at most two run together and later ones wait for pages that finished ones gave back.
SERVING = ServingConfig(page_size=16, num_pages=5, max_seqs=3, pages_per_seq=4, chunk_size=8, token_buckets=(8, 16))
# The stable margin: a greedy choice whose top two logits are closer than this could flip with rounding.
MARGIN = 1e-4


def micro_model(framework: str):
    config = make_config("tiny", {**MICRO, "framework": framework, "num_kv_heads": 1})
    model = train.build_model(config, jax.random.key(3))
    return config, model


def random_requests(count: int, seed: int) -> list[Request]:
    """Prompts of 1..40 tokens (some over the chunk of 8, some over a page), budgets of 1..10 new tokens,
    arrivals in steps 0..7."""
    rng = np.random.default_rng(seed)
    lengths = [1, 40, *rng.integers(1, 41, count - 2)]
    return [
        Request(i, rng.integers(0, 256, int(n)).astype(np.int32), int(rng.integers(1, 11)), int(rng.integers(0, 8)))
        for i, n in enumerate(lengths)
    ]


class WatchedAllocator(PageAllocator):
    """Keeps its own account of the pages out: a page handed out while held, or freed while not, fails."""

    def __init__(self, num_pages: int):
        super().__init__(num_pages)
        self.out: set[int] = set()
        self.handed_out = 0

    def allocate(self) -> int:
        page = super().allocate()
        assert 0 <= page < self.num_pages and page not in self.out, f"page {page} handed out twice"
        self.out.add(page)
        self.handed_out += 1
        return page

    def free(self, pages: list[int]) -> None:
        assert set(pages) <= self.out and len(set(pages)) == len(pages), f"pages {pages} were not out"
        self.out -= set(pages)
        super().free(pages)


def dense_generator(model, params, max_length: int):
    """`request -> its new tokens`: the request alone through the dense KV-cache decode step that
    `lm.sampling.generate` scans (`model.decoder`, one token a step, no pages), greedy, compiled once; checks
    that each choice has a margin."""
    step, empty = model.decoder(params, 1, max_length)
    step = jax.jit(step)

    def tokens_of(request: Request) -> np.ndarray:
        cache, fed, new = empty, list(request.prompt), []
        for position in range(len(request.prompt) + request.max_new_tokens - 1):
            logits, cache = step(params, cache, jnp.asarray(fed[position : position + 1]), jnp.int32(position))
            if position >= len(request.prompt) - 1:
                logits = np.asarray(logits[0])
                top = np.sort(logits)
                assert top[-1] - top[-2] > MARGIN, "an unstable greedy choice: pick another seed"
                new.append(int(np.argmax(logits)))
                fed.append(new[-1])
        return np.asarray(new, np.int32)

    return tokens_of


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_engine_gives_each_request_the_tokens_it_gets_alone(framework):
    """8 requests (GQA 2:1, 2 layers; the attention calls on the CPU default, the plain-jnp reference)."""
    config, model = micro_model(framework)
    requests = random_requests(8, seed=1)
    allocator = WatchedAllocator(SERVING.num_pages)
    engine = Engine(config, model.params, SERVING, allocator=allocator)
    results = engine.run(requests)
    dense = dense_generator(model, model.params, SERVING.max_length)
    for request in requests:
        np.testing.assert_array_equal(results[request.id], dense(request), err_msg=f"request {request.id}")
    assert not allocator.out and allocator.num_free == SERVING.num_pages  # every page came back
    assert allocator.handed_out > SERVING.num_pages  # pages were recycled
    assert engine.stats["new_tokens"] == sum(r.max_new_tokens for r in requests)
    assert engine.stats["prompt_tokens"] == sum(len(r.prompt) for r in requests)


@pytest.mark.parametrize("backend, module", [("interpret", "triton"), ("tpu_interpret", "tpu")])
def test_the_kernels_in_interpret_mode_give_the_same_tokens(backend, module):
    """The engine of the test above, NNX only and fewer requests, with the attention calls on a Pallas kernel
    in interpret mode (the Triton one, the TPU one) instead of the reference."""
    pytest.importorskip(f"probjax_kernels.{module}.ragged", reason=f"the {module} ragged kernel is not in this tree")
    config, model = micro_model("nnx")
    requests = random_requests(4, seed=2)
    engine = Engine(config, model.params, SERVING, kernel_config=probjax_kernels.RaggedConfig(backend=backend))
    results = engine.run(requests)
    dense = dense_generator(model, model.params, SERVING.max_length)
    for request in requests:
        np.testing.assert_array_equal(results[request.id], dense(request), err_msg=f"request {request.id}")


def int8_reference(config, params, scales, max_length: int):
    """`request -> its new tokens`: the request alone, greedy, each token recomputed from the whole sequence
    (padded to `max_length`; causal, so the padding after it changes nothing): the model's layers with dense
    plain-jnp attention (causal, GQA by repeated heads) over keys and values rounded to the int8 grid,
    round(x / scale) clipped to [-127, 127] times scale. Checks that each choice has a margin."""
    layers_of = packed_layers(config)
    group = config.num_heads // config.kv_heads

    def quantized(x, scale):
        return jnp.clip(jnp.round(x / scale[None, :, None]), -127, 127) * scale[None, :, None]

    @jax.jit
    def logits(params, tokens):
        layers = layers_of(params)

        def attend(layer, query, key, value, carry):
            k = jnp.repeat(quantized(key, scales[0][layer]), group, axis=1)
            v = jnp.repeat(quantized(value, scales[1][layer]), group, axis=1)
            scores = jnp.einsum("tnd,snd->nts", query, k, precision="highest") * config.head_dim**-0.5
            causal = jnp.tril(jnp.ones(scores.shape[1:], bool))
            weights = jax.nn.softmax(jnp.where(causal[None], scores, -jnp.inf), axis=-1)
            return jnp.einsum("nts,snd->tnd", weights, v, precision="highest"), carry

        x, _ = run_layers(layers, tokens, jnp.arange(max_length), attend, None)
        return layers.logits(x)

    def tokens_of(request: Request) -> np.ndarray:
        tokens, start, new = np.zeros(max_length, np.int32), len(request.prompt), []
        tokens[:start] = request.prompt
        for i in range(request.max_new_tokens):
            row = np.asarray(logits(params, jnp.asarray(tokens)))[start + i - 1]
            top = np.sort(row)
            assert top[-1] - top[-2] > MARGIN, "an unstable greedy choice: pick another seed"
            new.append(int(np.argmax(row)))
            if start + i < max_length:  # the last new token is never fed back
                tokens[start + i] = new[-1]
        return np.asarray(new, np.int32)

    return tokens_of


def test_int8_pages_give_the_tokens_of_a_dense_dequantised_reference():
    """int8 pages with per-(layer, head) scales: each request's tokens equal those of a dense reference that
    rounds every key and value to the same int8 grid (its own dequantised expectation, plain jnp), every
    greedy choice there with a margin > MARGIN. The scales are 8x those calibrated on half the prompts (the
    others clip some values), a grid coarse enough that rounding changes some requests' tokens: at least one
    differs from the float cache's, so the match is the int8 path's own. NNX; attention on the CPU default."""
    config, model = micro_model("nnx")
    requests = random_requests(6, seed=4)
    calibration = jnp.asarray(np.concatenate([r.prompt for r in requests[::2]]))
    scales = tuple(8 * scale for scale in calibrate_kv_scales(config, model.params, calibration))
    engine = Engine(config, model.params, dataclasses.replace(SERVING, kv_dtype="int8"), scales)
    results = engine.run(requests)
    assert engine.cache.keys[0].dtype == jnp.int8 and engine.cache.values[-1].dtype == jnp.int8
    reference = int8_reference(config, model.params, scales, SERVING.max_length)
    for request in requests:
        np.testing.assert_array_equal(results[request.id], reference(request), err_msg=f"request {request.id}")
    dense = dense_generator(model, model.params, SERVING.max_length)
    assert any(not np.array_equal(results[r.id], dense(r)) for r in requests)


def test_scheduler_packs_decodes_first_then_prompt_chunks_into_a_bucket():
    """Hand-worked steps: request 0 (prompt 20) alone, then request 1 (prompt 3) joins while 0 still prefills."""
    scheduler = Scheduler(SERVING)
    scheduler.add(Request(0, np.arange(20, dtype=np.int32), 2, arrival=0))
    scheduler.add(Request(1, np.arange(100, 103, dtype=np.int32), 3, arrival=1))
    plan = scheduler.plan(0)
    assert plan.counts == (8,) and len(plan.schedule.tokens) == 8
    np.testing.assert_array_equal(plan.schedule.tokens, np.arange(8))
    np.testing.assert_array_equal(plan.schedule.cu_q_lens, [0, 8, 8, 8])
    np.testing.assert_array_equal(plan.schedule.kv_lens, [8, 0, 0])
    assert int(plan.schedule.num_seqs) == 1 and scheduler.commit(plan, np.array([7, 0, 0])) == []
    plan = scheduler.plan(1)  # request 0's second chunk, request 1's whole prompt: 11 tokens, bucket 16
    assert plan.counts == (8, 3) and len(plan.schedule.tokens) == 16
    np.testing.assert_array_equal(plan.schedule.tokens[:11], [*range(8, 16), 100, 101, 102])
    np.testing.assert_array_equal(plan.schedule.kv_lens, [16, 3, 0])
    np.testing.assert_array_equal(plan.schedule.page_indices[:2, :2], [[0, 0], [1, 0]])
    scheduler.commit(plan, np.array([5, 42, 0]))  # 5 is dropped (0's prompt goes on), 42 is 1's first token
    plan = scheduler.plan(2)  # request 1 decodes first, then 0's last 4 prompt tokens (crossing into page 2)
    assert [s.request.id for s in plan.sequences] == [1, 0] and plan.counts == (1, 4)
    np.testing.assert_array_equal(plan.schedule.tokens[:5], [42, 16, 17, 18, 19])
    np.testing.assert_array_equal(plan.schedule.kv_lens, [4, 20, 0])
    np.testing.assert_array_equal(plan.schedule.page_indices[1, :2], [0, 2])


def test_allocator_refuses_an_empty_pool_and_pages_it_did_not_hand_out():
    allocator = PageAllocator(2)
    pages = [allocator.allocate(), allocator.allocate()]
    assert sorted(pages) == [0, 1] and allocator.num_free == 0
    with pytest.raises(ValueError, match="no free page"):
        allocator.allocate()
    allocator.free(pages[:1])
    with pytest.raises(ValueError, match="page 0 is not held"):
        allocator.free([0])
    assert allocator.allocate() == 0


def test_requests_that_cannot_fit_are_refused_when_added():
    scheduler = Scheduler(SERVING)
    with pytest.raises(ValueError, match="request 7: 74 positions need 5 pages; a request holds at most 4 pages of 16"):
        scheduler.add(Request(7, np.zeros(70, np.int32), 5))
    with pytest.raises(ValueError, match="max_new_tokens 0"):
        scheduler.add(Request(8, np.zeros(3, np.int32), 0))
    with pytest.raises(ValueError, match="max_seqs=20 must be at most the largest token bucket, 16"):
        dataclasses.replace(SERVING, max_seqs=20)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_engine_step_is_one_jittable_function_with_one_attention_call_per_layer(framework, monkeypatch):
    """`engine_step` traces on `step_inputs`' abstract arguments (what a deviceless compile takes) for each
    bucket, calling `ragged_paged_attention` once per layer with the keys and values to append."""
    config = make_config("tiny", {**MICRO, "framework": framework, "num_layers": 3})
    calls = []
    attention = probjax_kernels.ragged_paged_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["new_k"].shape)
        return attention(*args, **kwargs)

    monkeypatch.setattr(probjax_kernels, "ragged_paged_attention", spy)
    serving = dataclasses.replace(SERVING, kv_dtype="int8")
    for num_tokens in serving.token_buckets:
        calls.clear()
        params, cache, schedule = step_inputs(config, serving, num_tokens)
        next_tokens, new_cache = jax.eval_shape(engine_step(config, serving), params, cache, schedule)
        assert next_tokens.shape == (serving.max_seqs,) and next_tokens.dtype == jnp.int32
        assert jax.tree.map(lambda x: (x.shape, x.dtype), new_cache) == jax.tree.map(
            lambda x: (x.shape, x.dtype), cache)
        assert calls == [(num_tokens, config.kv_heads, config.head_dim)] * config.num_layers


def test_serve_lm_prints_its_progress_and_throughput(capsys):
    serve_lm = _load_script("serve_lm")
    stats = serve_lm.main(["--requests", "5", "--prompt-lens", "2:20", "--new-tokens", "2:6", "--arrivals", "4",
                           "--max-seqs", "2", "--chunk-size", "8", "--token-buckets", "8,16", "--print", "1"])
    captured = capsys.readouterr()
    assert "new tokens/s" in captured.out and "--- request 0" in captured.out
    assert "tok/s" in captured.err  # tqdm's line
    assert stats["new_tokens"] >= 5 * 2 and stats["steps"] > 0
