"""Prefill, a jitted decode step with the cache donated, sampling, and the one generation loop
(`start` -> `decode`) that `generate`, the tasks and the speed probe share."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache, LayerView, init_cache
from kvjax.config import ModelConfig
from kvjax.mesh import to_numpy
from kvjax.model import forward
from kvjax.policies.base import Observers, Policy
from kvjax.programs import stored_jit


@stored_jit(static_argnames=("cfg", "fresh"), donate_argnames=("cache",))
def prefill_chunk(params, tokens, cache: KVCache, cfg: ModelConfig, n_valid, last_idx,
                  fresh: bool = False):
    """One prompt chunk: tokens [B, T] (right-padded, n_valid [B] real), returns the logits at
    index last_idx [B] of each row ([B, V]) and the new cache. fresh: the cache is known to be
    empty (`forward`)."""
    at = jnp.clip(last_idx, 0, tokens.shape[1] - 1).astype(jnp.int32)
    logits, cache = forward(params, tokens, cache, cfg, n_valid, logits_at=at, fresh=fresh)
    return logits[:, 0], cache


@stored_jit(static_argnames=("cfg",), donate_argnames=("cache",))
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


def is_empty(cache) -> bool:
    """No row of `cache` holds a token yet (read on the host; False when this process cannot
    see every row's length, e.g. a cache sharded over several hosts)."""
    length = cache.length
    if isinstance(length, jax.Array) and not length.is_fully_addressable:
        return False
    return not np.asarray(length).any()


def prefill(params, prompts: Sequence[Sequence[int]], cache: KVCache, cfg: ModelConfig,
            chunk: int | None = None):
    """Feed prompts of different lengths (right-padded) in chunks of `chunk` tokens; returns
    the last logits [B, V] and the new cache. `cache` is donated (use `kvjax.cache.copy` to
    keep it).

    chunk=None feeds each prompt in one forward: every policy sees the whole prompt's attention
    before it evicts (docs/policies.md); a smaller chunk evicts at every chunk boundary. Every
    chunk has the same shape, so the step compiles once. A prompt read in one chunk into an
    empty cache skips scoring the cache's empty slots (`forward(fresh=True)`).
    """
    fresh = _fresh(prompts, chunk, cache)
    last = None
    for toks, n_valid, last_idx, ends_here in _chunks(prompts, chunk):
        lg, cache = prefill_chunk(params, toks, cache, cfg, n_valid, last_idx, fresh)
        last = lg if last is None else jnp.where(ends_here[:, None], lg, last)
    return last, cache


def _fresh(prompts, chunk: int | None, cache) -> bool:
    """`prefill_chunk(fresh=True)`: the prompts fit one chunk (several would compile a second
    program for the first one) and `cache` holds no token yet."""
    return (chunk is None or max(len(p) for p in prompts) <= int(chunk)) and is_empty(cache)


def _chunks(prompts, chunk: int | None):
    """The prompts right-padded and cut into chunks of `chunk` tokens (None: the longest
    prompt): per chunk, tokens [B, chunk], n_valid [B], each row's last index relative to the
    chunk [B] and whether it lies in this chunk [B] (device arrays)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    chunk = int(lens.max()) if chunk is None else int(chunk)
    if chunk < 1:
        raise ValueError(f"prefill: chunk={chunk} must be >= 1 (or None: the whole prompt)")
    n_chunks = -(-int(lens.max()) // chunk)
    toks = np.zeros((len(prompts), n_chunks * chunk), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    for c in range(n_chunks):
        start = c * chunk
        yield (jnp.asarray(toks[:, start:start + chunk]),
               jnp.asarray(np.clip(lens - start, 0, chunk).astype(np.int32)),
               jnp.asarray((lens - 1 - start).astype(np.int32)),
               jnp.asarray((lens - 1 >= start) & (lens - 1 < start + chunk)))


def start(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], policy, fmt, *,
          max_len: int | None = None, extra: int = 0, chunk: int | None = None, layout=None):
    """The one way a prompt enters a cache: init -> prefill -> (compress mode) the policy's
    selection, with room for `extra` more tokens per row. Returns (last logits [B, V], cache).

    Evict mode: a cache of `budget` slots from the start, evicting at every chunk. Compress
    mode: the prompt is read into a cache with room for all of it, then `cache.compress(extra)`
    keeps the selected slots and the cache grows by the tokens that follow (kvpress)."""
    max_len = cfg.max_seq_len if max_len is None else max_len
    cache = init_cache(cfg, len(prompts), policy, fmt, max_len, layout)
    logits, cache = prefill(params, prompts, cache, cfg, chunk)
    if policy.mode == "compress":
        cache = cache.compress(extra)
    return logits, cache


def compile_start(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], policy, fmt, *,
                  max_len: int | None = None, chunk: int | None = None, layout=None,
                  decode_too: bool = False) -> dict[str, float] | None:
    """Compile what `start` runs for prompts of these lengths without running the model: the
    empty cache and the prefill chunk's program (ahead of time, `StoredJit.compile`),
    so that a timed `start` runs compiled code only; with `decode_too`, also what `decode`
    runs greedily on the cache `start` returns (the step and the sampler). Returns the seconds
    each took ({"prefill": s, "decode": s}), or None, having compiled nothing but the empty
    cache, in compress mode: its selection's programs are sized by the prompt lengths on the
    host after the prefill (run `start` once to compile them)."""
    max_len = cfg.max_seq_len if max_len is None else max_len
    t = time.perf_counter()
    cache = init_cache(cfg, len(prompts), policy, fmt, max_len, layout)
    if policy.mode == "compress":
        return None
    toks, n_valid, last_idx, _ = next(_chunks(prompts, chunk))
    prefill_chunk.compile(params, toks, cache, cfg, n_valid, last_idx,
                          _fresh(prompts, chunk, cache))
    seconds = {"prefill": time.perf_counter() - t}
    if decode_too:  # evict mode: the cache keeps its shapes through the prefill
        t = time.perf_counter()
        token = jnp.zeros((len(prompts),), jnp.int32)
        decode_step.compile(params, token, cache, cfg)
        sample.compile(jnp.zeros((len(prompts), cfg.vocab_size), jnp.float32), None, 0.0, 1.0)
        seconds["decode"] = time.perf_counter() - t
    return seconds


def decode(params, cfg: ModelConfig, logits, cache, n: int, *, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0):
    """Sample n tokens per row from `logits` [B, V] on, feeding each back (`cache` donated).
    Returns (tokens [B, n] numpy, gathered from every process when rows are split over hosts,
    cache); the cache is checked for NaN/inf."""
    # greedy: no key to split (two small programs less to compile)
    key = None if temperature == 0.0 else jax.random.PRNGKey(seed)
    sub, out = None, []
    for _ in range(n):
        if key is not None:
            key, sub = jax.random.split(key)
        tok = sample(logits, sub, temperature, top_p)
        out.append(tok)
        logits, cache = decode_step(params, tok, cache, cfg)
    cache.check_finite()
    tokens = to_numpy(jnp.stack(out, axis=1)) if out else np.zeros((len(logits), 0), np.int32)
    return tokens, cache


@stored_jit(static_argnames=("temperature", "top_p"))
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


def feed(params, cfg: ModelConfig, logits, cache, suffixes: Sequence[Sequence[int]] | None):
    """Feed each row's `suffixes` (e.g. a question after a compressed context, kvpress's
    pipeline) into the grown cache as more prompt; (logits [B, V], cache). None: unchanged."""
    if suffixes is None:
        return logits, cache
    return prefill(params, suffixes, cache, cfg)


def suffix_room(suffixes: Sequence[Sequence[int]] | None) -> int:
    """The most tokens `feed` adds to a row (0 without suffixes)."""
    if suffixes is None:
        return 0
    if min(len(s) for s in suffixes) < 1:
        raise ValueError("every suffix needs at least one token (or pass suffixes=None)")
    return max(len(s) for s in suffixes)


def generate(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             policy, fmt, *, max_len: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, chunk: int | None = None, layout=None,
             suffixes: Sequence[Sequence[int]] | None = None):
    """Generate `max_new_tokens` per prompt under `policy` and `fmt` (`start`, `feed`, then
    `decode`). Returns (tokens [B, N] numpy, final cache).

    chunk: prefill chunk size (None: the whole prompt at once); layout: a cache layout
    (`kvjax.cache.get_layout(...)`) or its name, default dense; suffixes: tokens per row fed
    after the prompt has been read (and, in compress mode, selected), before decoding."""
    max_len = cfg.max_seq_len if max_len is None else max_len
    room = suffix_room(suffixes)
    check_fits([len(p) for p in prompts], max_new_tokens + room, max_len)
    logits, cache = start(params, cfg, prompts, policy, fmt, max_len=max_len,
                          extra=max_new_tokens + room, chunk=chunk, layout=layout)
    logits, cache = feed(params, cfg, logits, cache, suffixes)
    return decode(params, cfg, logits, cache, max_new_tokens, temperature=temperature,
                  top_p=top_p, seed=seed)


def shares_prefill(policy) -> bool:
    """A compress-mode policy whose prompt cache any other such policy could read with it:
    keys stored rotated at their absolute positions, one per-head cache (no layer groups)."""
    if policy.mode != "compress" or type(policy).layer_groups is not Policy.layer_groups:
        return False  # layer groups (pyramid) read the prompt into a cache per group
    view = LayerView(k=None, v=None, pos=jnp.zeros((1, 1, 1), jnp.int32), stats={},
                     length=jnp.zeros((1,), jnp.int32))
    return policy.rope_positions(view, jnp.zeros((1, 1), jnp.int32))[1] is None


def generate_many(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int, policies: Sequence, fmt, *, max_len: int | None = None,
                  chunk: int | None = None, layout=None,
                  suffixes: Sequence[Sequence[int]] | None = None):
    """Score once, select many: one prefill records what every compress-mode policy needs
    (`Observers`), then each selects from it, is fed the `suffixes` and decodes greedily.
    Equal to calling `generate` once per policy (tested), at one prefill's cost. Returns
    [(tokens, cache)]."""
    max_len = cfg.max_seq_len if max_len is None else max_len
    room = suffix_room(suffixes)
    check_fits([len(p) for p in prompts], max_new_tokens + room, max_len)
    bad = [p.name for p in policies if not shares_prefill(p)]
    if bad:
        raise ValueError(f"policies {bad} cannot share a prefill (they need mode='compress', "
                         "keys at absolute positions and one cache per head); use generate")
    shared = Observers(policies=tuple(policies))
    cache = init_cache(cfg, len(prompts), shared, fmt, max_len, layout)
    logits, cache = prefill(params, prompts, cache, cfg, chunk)
    out = []
    for i in range(len(policies)):
        mine = shared.part(cache, i).compress(max_new_tokens + room)  # new: `cache` stays
        mine_logits, mine = feed(params, cfg, logits, mine, suffixes)
        out.append(decode(params, cfg, mine_logits, mine, max_new_tokens))
    return out
