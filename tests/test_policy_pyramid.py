"""`pyramid`: per-layer budgets with real memory (one stacked cache per group of layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache, LayerGroups
from kvjax.config import tiny_config
from kvjax.formats import get_format
from kvjax.generate import decode_step, prefill
from kvjax.model import forward_jit, init_params
from kvjax.policies import get_policy

F32 = get_format("f32")
CFG = tiny_config(n_layers=4, max_seq_len=128)
PARAMS = init_params(CFG, jax.random.PRNGKey(0))


def test_budgets_shrink_with_depth_and_hold_exactly_the_budget():
    """Whole-slot group budgets near the linear profile (410, 307, 205, 102 for 256 and
    taper 4) whose layers hold exactly L · budget slots: the bytes of a uniform cache."""
    for budget, L in [(256, 30), (768, 30), (100, 7), (33, 5)]:
        pol = get_policy("pyramid", budget=budget, taper=4.0, n_groups=4, window=8)
        groups = pol.layer_groups(L, 4096)
        b = [p.budget for _, _, p in groups]
        assert sum(p.budget * (hi - lo) for lo, hi, p in groups) == L * budget
        assert b == sorted(b, reverse=True)
        assert max(abs(x - t) for x, t in zip(b, pol.targets(L))) < 3  # the search window
    groups = get_policy("pyramid", budget=256, taper=4.0, n_groups=4).layer_groups(30, 2048)
    assert [(lo, hi) for lo, hi, _ in groups] == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_memory_is_real_bytes_of_smaller_caches():
    pol = get_policy("pyramid", budget=40, taper=3.0, n_groups=2, window=8)  # groups: 60, 20
    cache = KVCache.init(CFG, 2, pol, F32, 128)
    assert isinstance(cache, LayerGroups)
    per_slot = 2 * CFG.n_kv_heads * CFG.head_dim * 4 * 2  # k+v, f32, batch 2
    assert cache.kv_nbytes() == per_slot * (2 * 60 + 2 * 20)
    uniform_max = KVCache.init(CFG, 2, get_policy("h2o", budget=60, window=8), F32, 128)
    uniform_mean = KVCache.init(CFG, 2, get_policy("h2o", budget=40, window=8), F32, 128)
    assert cache.kv_nbytes() == uniform_mean.kv_nbytes() < uniform_max.kv_nbytes()
    assert cache.capacity == 40.0
    assert KVCache.abstract(CFG, 2, pol, F32, 128).kv_nbytes() == cache.kv_nbytes()


def _decode(pol, ids, steps):
    last, cache = prefill(PARAMS, [ids], KVCache.init(CFG, 1, pol, F32, 128), CFG, chunk=8)
    outs = [last]
    for _ in range(steps):
        tok = jnp.argmax(outs[-1], -1).astype(jnp.int32)
        lg, cache = decode_step(PARAMS, tok, cache, CFG)
        outs.append(lg)
    return jnp.stack(outs), cache


def test_each_group_evicts_exactly_like_its_inner_policy():
    """Layers of the first group see the same inputs as a uniform cache of that group's budget,
    so they must hold the same positions; the last group never exceeds its smaller capacity."""
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (48,), 0, CFG.vocab_size)).tolist()
    pol = get_policy("pyramid", budget=24, taper=2.0, n_groups=2, window=4)  # 32, 16
    _, cache = _decode(pol, ids, 6)
    _, uniform = _decode(get_policy("h2o", budget=32, window=4), ids, 6)
    np.testing.assert_array_equal(cache.groups[0].pos, uniform.pos[:2])
    held = (np.asarray(cache.groups[1].pos) >= 0).sum(-1)
    assert held.max() == 16 and cache.groups[1].capacity == 16
    for g in cache.groups:  # positions unique per (layer, row, head)
        for row in np.asarray(g.pos).reshape(-1, g.capacity):
            kept = row[row >= 0]
            assert len(set(kept.tolist())) == len(kept)


def test_budget_above_length_equals_full_cache():
    ids = jax.random.randint(jax.random.PRNGKey(4), (1, 30), 0, CFG.vocab_size, jnp.int32)
    full, _ = forward_jit(PARAMS, ids, KVCache.init(CFG, 1, get_policy("full"), F32, 128), CFG)
    pol = get_policy("pyramid", budget=48, taper=2.0, n_groups=2, window=4)  # 64, 32 >= 30
    cache, outs = KVCache.init(CFG, 1, pol, F32, 128), []
    for s in range(0, 30, 6):
        lg, cache = forward_jit(PARAMS, ids[:, s:s + 6], cache, CFG)
        outs.append(lg)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5)


def test_decode_compiles_once_and_names_bad_layers_globally():
    pol = get_policy("pyramid", budget=12, taper=2.0, n_groups=2, window=2)  # 16, 8
    before = decode_step._cache_size()
    _decode(pol, list(range(1, 20)), 12)
    assert decode_step._cache_size() == before + 1
    p = jax.tree.map(lambda a: a, PARAMS)
    p["layers"] = dict(p["layers"], wv=p["layers"]["wv"].at[2].set(jnp.inf))
    _, bad = forward_jit(p, jnp.ones((1, 3), jnp.int32), KVCache.init(CFG, 1, pol, F32, 128), CFG)
    with pytest.raises(FloatingPointError, match=r"layer\(s\) \[2, 3\]"):
        bad.check_finite()


@pytest.mark.parametrize("options, match", [
    ({"budget": 40, "taper": 3.0, "n_groups": 2}, r"group budgets \[60, 20\]; each must lie in \[32, 128\]"),
    ({"budget": 64, "taper": 0.5}, "taper .* must be >= 1, got 0.5"),
    ({"budget": 64, "inner": "nope"},
     r"inner='nope' is not a policy to run per layer group; use one of \["),
    ({"budget": 64, "inner": "snapkv"},
     r"inner='snapkv' cannot run mode='evict'; inner policies for it: \['adakv', 'h2o'"),
    ({"budget": 0}, "budget must be a positive integer, got 0"),
])
def test_bad_input_is_a_clear_error(options, match):
    with pytest.raises(ValueError, match=match):
        KVCache.init(CFG, 1, get_policy("pyramid", **options), F32, 128)


def test_bytes_equal_a_uniform_cache_at_equal_budget():
    """At budget B the groups hold L · B slots in all: k+v bytes and stats bytes of a uniform
    B-slot h2o cache, for every float/int8 format (int4/int2 below, with group-sized budgets)."""
    cfg = tiny_config(n_layers=6, max_seq_len=512)
    for name, opts, budget in [("f32", {}, 40), ("bf16", {}, 40), ("int8", {}, 40),
                               ("fp8", {}, 40), ("int4", {"group": 8}, 64),
                               ("int2", {"group": 8}, 64)]:
        fmt = get_format(name, **opts)
        pol = get_policy("pyramid", budget=budget, taper=3.0, n_groups=3, window=4)
        if name in ("int4", "int2"):  # per-channel keys need whole slot groups: budgets 88, 64, 40
            pol = get_policy("pyramid", budget=budget, taper=2.2, n_groups=3, window=4)
        pyr = KVCache.abstract(cfg, 2, pol, fmt, 512)
        uni = KVCache.abstract(cfg, 2, get_policy("h2o", budget=budget, window=4), fmt, 512)
        assert pyr.kv_nbytes() == uni.kv_nbytes(), name
        groups_length = (3 - 1) * 2 * 4  # each extra group keeps its own length [B] int32
        assert pyr.nbytes() == uni.nbytes() + groups_length, name  # positions, stats, flags


def test_more_groups_than_layers_is_an_error():
    with pytest.raises(ValueError, match="n_groups=8 exceeds the 4 layers"):
        KVCache.init(CFG, 1, get_policy("pyramid", budget=64, n_groups=8, window=4), F32, 128)


def test_a_format_limit_on_a_group_budget_names_every_groups_budget():
    """int4's channel keys need each capacity to be a multiple of its group; with pyramid the
    capacities are the groups' budgets, which the user never set: the error lists them."""
    pol = get_policy("pyramid", budget=40, taper=3.0, n_groups=2, window=8)
    with pytest.raises(ValueError, match=r"group=8 must divide the capacity C=60.*\[policy "
                                         r"'pyramid' gives its layer groups the budgets layers "
                                         r"0-1: 60, layers 2-3: 20\]"):
        KVCache.init(CFG, 1, pol, get_format("int4", group=8), 128)
