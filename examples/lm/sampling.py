"""Sampling bytes. `generate`: the dense KV-cache decode path, one token per step, the prompt fed through the
same steps. `generate_batch`: prompts of different lengths at once, a prefill then decode steps on a paged cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from probjax_nn import pages_from_dense

from lm.common import LanguageModel, Params


def generate(
    model: LanguageModel, params: Params, prompt: bytes, num_tokens: int, *, num_samples: int, temperature: float,
    key: jax.Array, sharding: jax.sharding.NamedSharding | None = None,
) -> list[bytes]:
    """`num_samples` continuations of `prompt`, `num_tokens` bytes each (prompt included in the result).

    Every step feeds one token to `model.decoder`'s step: while the prompt lasts the next token is the
    prompt's, afterwards it is drawn from softmax(logits / temperature) (the arg max at temperature 0).
    `sharding`, a replicated sharding over the mesh that `params` are sharded on: decode with the params where
    they are (in a multi-process run every process calls this, and none gathers the model), the cache, the
    key and the result replicated.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one byte.")
    total = len(prompt) + num_tokens
    step, cache = model.decoder(params, num_samples, total)
    prompt_tokens = np.zeros(total, np.int32)
    prompt_tokens[: len(prompt)] = np.frombuffer(prompt, np.uint8)
    prompt_tokens = jnp.asarray(prompt_tokens)

    impl, key = jax.random.key_impl(key), jax.random.key_data(key)
    if sharding is not None:  # the same values on every process, as arrays over the mesh

        def replicate(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        cache, key = jax.tree.map(replicate, (cache, key))

    @functools.partial(jax.jit, **({} if sharding is None else {"out_shardings": sharding}))
    def run(params, cache, key):
        key = jax.random.wrap_key_data(key, impl=impl)
        def body(carry, position):
            cache, tokens, key = carry
            logits, cache = step(params, cache, tokens, position)
            key, subkey = jax.random.split(key)
            if temperature > 0:
                drawn = jax.random.categorical(subkey, logits / temperature).astype(jnp.int32)
            else:
                drawn = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            tokens = jnp.where(position + 1 < len(prompt), prompt_tokens[position + 1], drawn)
            return (cache, tokens, key), tokens

        first = jnp.full((num_samples,), prompt_tokens[0])
        _, tokens = jax.lax.scan(body, (cache, first, key), jnp.arange(total - 1, dtype=jnp.int32))
        return jnp.concatenate([first[None], tokens]).T

    tokens = np.asarray(run(params, cache, key)).astype(np.uint8)
    return [row.tobytes() for row in tokens]


def generate_batch(
    model: LanguageModel, params: Params, prompts: list[bytes], num_tokens: int, *, temperature: float,
    key: jax.Array, page_size: int = 16,
) -> list[bytes]:
    """One continuation of each prompt, `num_tokens` bytes (prompt included in the result), all prompts at once.

    The prompts, of any lengths, are padded to the longest and run through `model.prefill` in one call (flash
    attention, causal: a prompt's tokens never see the padding after it); its keys and values become pages
    (`probjax_nn.pages_from_dense`) with room for `num_tokens` more per prompt, and every step then feeds
    each sequence's newest token at its own position through `model.paged_step` (`probjax_nn.decode_attention`
    on the paged cache). Tokens are drawn as in `generate`; at temperature 0 they are `generate`'s.
    """
    if not prompts or not all(prompts):
        raise ValueError("every prompt must hold at least one byte.")
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for row, prompt in zip(tokens, prompts):
        row[: len(prompt)] = np.frombuffer(prompt, np.uint8)
    max_length = int(lengths.max()) + num_tokens

    @jax.jit
    def run(params, tokens, lengths, key):
        logits, kv = model.prefill(params, tokens)
        block_tables = pages_from_dense(jax.tree.leaves(kv)[0], page_size, max_length=max_length)[1]
        pages = jax.tree.map(lambda x: pages_from_dense(x, page_size, max_length=max_length)[0], kv)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]

        def draw(logits, key):
            if temperature > 0:
                return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def body(carry, step):
            pages, logits, key = carry
            key, subkey = jax.random.split(key)
            drawn = draw(logits, subkey)
            logits, pages = model.paged_step(params, pages, block_tables, drawn, lengths + step)
            return (pages, logits, key), drawn

        _, drawn = jax.lax.scan(body, (pages, last, key), jnp.arange(num_tokens, dtype=jnp.int32))
        return drawn.T

    drawn = np.asarray(run(params, jnp.asarray(tokens), jnp.asarray(lengths), key)).astype(np.uint8)
    return [prompt + row.tobytes() for prompt, row in zip(prompts, drawn)]
