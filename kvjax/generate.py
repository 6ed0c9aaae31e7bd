"""Prefill, a jitted decode step with the cache donated, sampling, and the generation loop."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache, init_cache
from kvjax.config import ModelConfig
from kvjax.model import forward


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_chunk(params, tokens, cache: KVCache, cfg: ModelConfig, n_valid, last_idx):
    """One prompt chunk: tokens [B, T] (right-padded, n_valid [B] real), returns the logits at
    index last_idx [B] of each row ([B, V]) and the new cache."""
    at = jnp.clip(last_idx, 0, tokens.shape[1] - 1).astype(jnp.int32)
    logits, cache = forward(params, tokens, cache, cfg, n_valid, logits_at=at)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params, token, cache: KVCache, cfg: ModelConfig):
    """One token per row: token [B] -> logits [B, V] and the new cache. Compiles once."""
    logits, cache = forward(params, token[:, None], cache, cfg)
    return logits[:, 0], cache


def check_fits(prompt_lens: Sequence[int], max_new_tokens: int, max_len: int) -> None:
    """A prompt (plus what will be generated) longer than the cache's maximum is an error."""
    longest = max(prompt_lens)
    if longest + max_new_tokens > max_len:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the maximum "
            f"length {max_len}; shorten the prompt or raise max_len (model.max_seq_len)"
        )
    if min(prompt_lens) < 1:
        raise ValueError("every prompt needs at least one token")


def prefill(params, prompts: Sequence[Sequence[int]], cache: KVCache, cfg: ModelConfig,
            chunk: int | None = None):
    """Feed prompts of different lengths (right-padded) in chunks; returns last logits [B, V].

    The chunk size defaults to what the policy can place in one update (the whole prompt for
    `full`), and every chunk has the same shape so the step compiles once.
    """
    lens = np.array([len(p) for p in prompts], np.int32)
    chunk = chunk or min(int(lens.max()), cache.policy.max_chunk(cache.capacity))
    n_chunks = -(-int(lens.max()) // chunk)
    toks = np.zeros((len(prompts), n_chunks * chunk), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    last = None
    for c in range(n_chunks):
        start = c * chunk
        n_valid = np.clip(lens - start, 0, chunk)
        lg, cache = prefill_chunk(params, jnp.asarray(toks[:, start:start + chunk]), cache, cfg,
                                  jnp.asarray(n_valid), jnp.asarray(lens - 1 - start))
        ends_here = jnp.asarray((lens - 1 >= start) & (lens - 1 < start + chunk))[:, None]
        last = lg if last is None else jnp.where(ends_here, lg, last)
    return last, cache


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample(logits, key, temperature: float = 0.0, top_p: float = 1.0):
    """Greedy when temperature == 0, else temperature + nucleus (top-p) sampling. [B, V] -> [B]."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_p = jax.nn.softmax(jnp.take_along_axis(logits, order, -1), axis=-1)
        drop_sorted = jnp.cumsum(sorted_p, axis=-1) - sorted_p > top_p  # keeps the top token
        drop = jnp.zeros_like(drop_sorted).at[
            jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             policy, fmt, *, max_len: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, prefill_chunk_size: int | None = None,
             layout=None):
    """Generate `max_new_tokens` per prompt. Returns (tokens [B, N] numpy, final cache).

    layout: a cache layout (`kvjax.cache.get_layout(...)`) or its name; default dense."""
    max_len = cfg.max_seq_len if max_len is None else max_len
    check_fits([len(p) for p in prompts], max_new_tokens, max_len)
    cache = init_cache(cfg, len(prompts), policy, fmt, max_len, layout)
    logits, cache = prefill(params, prompts, cache, cfg, prefill_chunk_size)
    key = jax.random.PRNGKey(seed)
    out = []
    for _ in range(max_new_tokens):
        key, sub = jax.random.split(key)
        tok = sample(logits, sub, temperature, top_p)
        out.append(tok)
        logits, cache = decode_step(params, tok, cache, cfg)
    cache.check_finite()
    return np.asarray(jnp.stack(out, axis=1)), cache
