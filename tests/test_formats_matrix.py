"""Every registered policy x every storage format on the tiny model: prefill with eviction,
the after-prefill hook, then decode steps. Logits stay finite, the capacity holds,
and with f32 and a budget the sequence fits in, every policy gives the full cache's logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache
from kvjax.config import tiny_config
from kvjax.formats import FORMATS as REGISTERED
from kvjax.formats import get_format
from kvjax.model import forward, init_params
from kvjax.policies import POLICIES, get_policy

CFG = tiny_config(max_seq_len=64)  # head_dim 8: int groups of 8, capacities multiples of 8
PROMPT, CHUNK, STEPS = 24, 8, 5
SEQ = PROMPT + STEPS
MAX_LEN = 32  # the full policy's capacity (a multiple of the group)
SMALL, LARGE = 16, 32  # an eviction budget; a budget the whole sequence fits in
INT_OPTS = {"group": 8, "value_group": 8, "residual": 8}  # tiny groups, channel keys
FORMATS = {name: INT_OPTS if name in ("int4", "int2") else {} for name in sorted(REGISTERED)}
FORMATS["int4-token"] = dict(INT_OPTS, key_mode="token")
FORMATS["int4-keep"] = dict(INT_OPTS, keep_layers=(1,), keep_heads=(0,))  # kv_keep


def make_format(label: str):
    return get_format(label.split("-")[0], **FORMATS[label])


SHRINK = {"window": 4, "n_sink": 2, "n_groups": 2, "taper": 3.0}  # what the tiny model has room for


def small_policy(name: str, budget: int):
    """The policy with `budget` slots (per layer on average): its defaults where they fit the
    tiny model, else its protected windows, layer groups and budget ratio shrunk to fit."""
    opts = {} if name == "full" else {"budget": budget}
    cls = POLICIES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    shrunk = {k: v for k, v in SHRINK.items() if k in fields}
    for extra in ({}, shrunk, dict(shrunk, taper=1.0)):
        try:
            policy = get_policy(name, **opts, **extra)
            policy.validate(MAX_LEN)
            if hasattr(policy, "layer_groups"):
                policy.layer_groups(CFG.n_layers, MAX_LEN)
        except ValueError:
            continue
        if policy.min_budget() <= budget // 2:
            return policy
    raise AssertionError(f"no small configuration of policy {name!r} fits the tiny model")


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.3)
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, SEQ).astype(np.int32)
    return params, ids


FAST_COMPILE = {"xla_backend_optimization_level": 0}  # tiny shapes: compile time dominates


def _forward(params, tokens, cache):
    return forward(params, tokens, cache, CFG)


def _decode(params, ids, cache):
    """One decode step per id (a scan): logits [T, V], cache."""
    def step(c, tok):
        logits, c = forward(params, tok.reshape(1, 1), c, CFG)
        return c, logits[0, 0]

    cache, logits = jax.lax.scan(step, cache, ids)
    return logits, cache


def shapes(tree):
    return jax.tree.map(lambda a: (a.shape, a.dtype), tree)


def run(params, ids, policy, fmt):
    """Prefill PROMPT tokens one at a time (evict mode: evicting once the budget is full),
    the compress-mode selection with room for STEPS tokens, then STEPS decode steps: one
    compiled T = 1 step per (policy, format), plus one decode scan after a compress-mode
    selection, so the ~65 combinations stay fast. (Chunked writes under eviction are tested per
    format in test_formats.py.)

    Returns (logits [STEPS + 1, V] at the last prompt token and each decoded one, the shapes
    decode must keep, the final cache)."""
    cache = KVCache.init(CFG, 1, policy, fmt, MAX_LEN)
    step = jax.jit(_forward).lower(params, jnp.zeros((1, 1), jnp.int32), cache).compile(
        compiler_options=FAST_COMPILE)
    compress = policy.mode == "compress"
    out = []
    for t in range(PROMPT if compress else SEQ):
        logits, cache = step(params, jnp.asarray(ids[None, t:t + 1]), cache)
        if t >= PROMPT - 1:
            out.append(logits[0, 0])
    if compress:
        cache = cache.compress(STEPS)
    kept = shapes(cache)
    if compress:
        rest = jnp.asarray(ids[PROMPT:])
        tail = jax.jit(_decode).lower(params, rest, cache).compile(compiler_options=FAST_COMPILE)
        logits, cache = tail(params, rest, cache)
        out.extend(logits)
    return np.asarray(jnp.stack(out)), kept, cache


SAMPLED = ("h2o", "snapkv")  # variants that route like their base format: a sample
MATRIX = [(p, f) for p in sorted(POLICIES) for f in FORMATS
          if (f in REGISTERED and f != "f32") or (f not in REGISTERED and p in SAMPLED)]


@pytest.mark.parametrize("name,fmt_label", MATRIX, ids=[f"{p}-{f}" for p, f in MATRIX])
def test_policy_format_matrix_with_eviction(setup, name, fmt_label):
    """Every format under every policy with eviction (f32 under eviction: test_policies.py)."""
    params, ids = setup
    policy, fmt = small_policy(name, SMALL), make_format(fmt_label)
    logits, hooked, cache = run(params, ids, policy, fmt)
    assert np.isfinite(logits).all()
    cache.check_finite()
    assert shapes(cache) == hooked  # decode keeps every buffer's shape
    for _, _, seg in cache.segments():  # one stacked cache per layer group
        held = np.asarray(seg.head_slots()).sum(-1)  # [L, B] slots held by all kv heads
        if policy.mode == "compress":  # the selection, grown by every decoded token
            want = policy.kept(PROMPT) + STEPS
        else:
            want = min(seg.capacity, SEQ)
        assert (held == CFG.n_kv_heads * want).all()
    if name != "full":
        assert cache.kv_nbytes() < KVCache.init(CFG, 1, get_policy("full"), fmt,
                                                MAX_LEN).kv_nbytes()
    assert int(cache.length[0]) == SEQ


@pytest.fixture(scope="module")
def full_logits(setup):
    params, ids = setup
    return run(params, ids, get_policy("full"), get_format("f32"))[0]


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"full"}))
def test_f32_with_room_for_everything_matches_the_full_cache(setup, full_logits, name):
    params, ids = setup
    logits, _, _ = run(params, ids, small_policy(name, LARGE), get_format("f32"))
    np.testing.assert_allclose(logits, full_logits, rtol=1e-5, atol=1e-5)
