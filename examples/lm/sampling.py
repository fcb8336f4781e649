"""Sampling bytes with the KV-cache decode path: one token per step, the prompt fed through the same steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lm.common import LanguageModel, Params


def generate(
    model: LanguageModel, params: Params, prompt: bytes, num_tokens: int, *, num_samples: int, temperature: float,
    key: jax.Array,
) -> list[bytes]:
    """`num_samples` continuations of `prompt`, `num_tokens` bytes each (prompt included in the result).

    Every step feeds one token to `model.decoder`'s step: while the prompt lasts the next token is the
    prompt's, afterwards it is drawn from softmax(logits / temperature) (the arg max at temperature 0).
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one byte.")
    total = len(prompt) + num_tokens
    step, cache = model.decoder(params, num_samples, total)
    prompt_tokens = np.zeros(total, np.int32)
    prompt_tokens[: len(prompt)] = np.frombuffer(prompt, np.uint8)
    prompt_tokens = jnp.asarray(prompt_tokens)

    @jax.jit
    def run(params, cache, key):
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
