"""Policy invariants on a tiny random model (property-tested), compile-once decode, bad input.

Invariants after every chunk, in both modes: positions unique per (layer, row, head) and
already seen. Evict mode: capacity never exceeded and every slot that can be filled is;
protected tokens (sinks, the recent window) never evicted; while a row has seen no more tokens
than the budget its logits equal the full cache's. Compress mode: the prompt is held whole
(full-cache logits), the selection keeps kept(n) slots per head with the protected ones among
them, and afterwards the cache grows: the selection stays and every new token is added. Chunks
are 3 tokens with per-row padding, so rows advance at different speeds and evict independently.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax.cache import KVCache, LayerView
from kvjax.config import tiny_config
from kvjax.formats import get_format
from kvjax.generate import decode_step, generate, generate_many
from kvjax.model import forward, init_params
from kvjax.policies import POLICIES, get_policy
from kvjax.policies.base import Evicting, Observers

FMT = get_format("f32")
FAST = {"xla_backend_optimization_level": 0}  # these tests compile one program per policy
MAX_LEN = 64
CFG = tiny_config(max_seq_len=MAX_LEN)
C = 10  # the budget of every evicting case
T = 3  # chunk size of the property test

CASES = [
    ("window", {}),
    ("streaming", {"n_sink": 2}),
    ("streaming", {"n_sink": 1, "rope": "original"}),
    ("h2o", {"n_sink": 1, "window": 3}),
    ("tova", {"window": 1}),
    ("tova", {"per_head": True}),
    ("lru", {"n_sink": 2, "window": 3}),
    ("lru", {"n_sink": 1, "window": 2, "used_by": "topk", "top_k": 3}),
    ("knorm", {"n_sink": 1, "window": 2}),
    ("random", {"seed": 3, "n_sink": 1, "window": 2}),
    ("snapkv", {"window": 3, "kernel": 3}),  # compress mode only
    ("h2o", {"n_sink": 1, "window": 3, "mode": "compress"}),  # compress: other policies' own
]  # selections are checked against references in test_policy_scoring.py
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CASES)]


@functools.cache
def params():
    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST)
    return init(CFG, jax.random.PRNGKey(0))


@functools.partial(jax.jit, static_argnames=("cfg",), compiler_options=FAST)
def model_step(params, tokens, cache, cfg, n_valid):
    return forward(params, tokens, cache, cfg, n_valid)


def must_keep(policy, n: int, capacity: int) -> set[int]:
    """Positions a row that has seen n tokens must still hold (compress: in the selection)."""
    if policy.name == "window":
        return set(range(max(0, n - capacity), n))
    if policy.name == "streaming":
        return set(range(min(policy.n_sink, n))) | set(
            range(max(0, n - (capacity - policy.n_sink)), n))
    if policy.name == "snapkv":
        return set(range(max(0, n - policy.window), n))
    assert isinstance(policy, Evicting)
    return set(range(min(policy.n_sink, n))) | set(range(max(0, n - policy.window), n))


def held_sets(cache):
    """[B][L][K] sets of the positions held."""
    pos = np.asarray(cache.pos)  # [L, B, K, C]
    L, B, K, _ = pos.shape
    return [[[set(pos[layer, b, k][pos[layer, b, k] >= 0].tolist()) for k in range(K)]
             for layer in range(L)] for b in range(B)]


def check_invariants(policy, cache, lengths, selected, at):
    """selected: per [b][layer][k] the compress-mode selection (None before it); at: the row
    lengths when it was made."""
    pos = np.asarray(cache.pos)  # [L, B, K, C]
    L, B, K, cap = pos.shape
    for b in range(B):
        sets = []
        for layer in range(L):
            for k in range(K):
                held = pos[layer, b, k][pos[layer, b, k] >= 0]
                assert len(set(held.tolist())) == len(held), "duplicate positions"
                assert held.max(initial=-1) < lengths[b], "a position not seen yet"
                if policy.mode == "evict":
                    assert cap == policy.budget
                    assert len(held) == min(lengths[b], cap), "a slot left empty or overfilled"
                    missing = must_keep(policy, lengths[b], cap) - set(held.tolist())
                    assert not missing, f"protected positions evicted: {sorted(missing)}"
                elif selected is None:  # the prompt: nothing evicted
                    assert cap == MAX_LEN and set(held.tolist()) == set(range(lengths[b]))
                else:  # grown: the selection and every token since
                    want = selected[b][layer][k] | set(range(at[b], lengths[b]))
                    assert set(held.tolist()) == want, "the grown cache lost or gained tokens"
                sets.append(set(held.tolist()))
            if policy.name == "tova" and not policy.per_head:
                assert all(s == sets[-1] for s in sets[-K:]), "layer-wise TOVA heads differ"


def check_selection(policy, selected, at):
    """kept(n) slots per head, the protected ones among them."""
    for b, layers in enumerate(selected):
        n = int(at[b])
        for heads in layers:
            for sel in heads:
                assert len(sel) == policy.kept(n), "selection size"
                missing = must_keep(policy, n, policy.kept(n)) - sel
                assert not missing, f"protected positions not selected: {sorted(missing)}"


def run_episode(policy, plan, n_prefill, seed):
    """Run the plan (n_valid per row per chunk) side by side with the full cache, checking the
    invariants after every chunk; in compress mode the first `n_prefill` chunks are the prompt,
    then `cache.compress` leaves room for the rest."""
    rng = np.random.default_rng(seed)
    cache = KVCache.init(CFG, 2, policy, FMT, MAX_LEN)
    ref = KVCache.init(CFG, 2, get_policy("full"), FMT, MAX_LEN)
    lengths = np.zeros(2, np.int64)
    selected, at = None, None
    compiled = None
    for s, n_valid in enumerate(plan):
        if s == n_prefill and policy.mode == "compress":  # room for the rest, same capacity
            cache = cache.compress(MAX_LEN - max(policy.kept(int(n)) for n in lengths))
            selected, at = held_sets(cache), lengths.copy()
            check_selection(policy, selected, at)
        toks = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, T)), jnp.int32)
        nv = jnp.asarray(n_valid, jnp.int32)
        logits, cache = model_step(params(), toks, cache, CFG, nv)
        ref_logits, ref = model_step(params(), toks, ref, CFG, nv)
        lengths += np.asarray(n_valid)
        check_invariants(policy, cache, lengths, selected, at)
        for b in range(2):
            if policy.mode == "evict":
                whole = lengths[b] <= policy.budget
            else:  # the prompt, or a selection that dropped nothing
                whole = at is None or policy.kept(int(at[b])) == at[b]
            if whole:
                np.testing.assert_allclose(logits[b, :n_valid[b]], ref_logits[b, :n_valid[b]],
                                           atol=1e-5, rtol=0)
        if compiled is None or s == n_prefill:
            compiled = model_step._cache_size()
        assert model_step._cache_size() == compiled, "a step recompiled"
    return cache


plans = st.lists(st.tuples(st.integers(0, T), st.integers(0, T)), min_size=2, max_size=16)


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans, split=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_invariants(name, opts, plan, split, seed):
    run_episode(get_policy(name, budget=C, **opts), plan, min(split, len(plan) - 1), seed)


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_budget_covering_the_sequence_gives_full_logits(name, opts):
    """Budget >= sequence length: every policy is exactly the full cache (prompt + decode)."""
    plan = [(3, 3), (3, 2), (1, 1), (1, 1), (1, 1)]  # rows of 9 and 8 tokens, C = 10
    run_episode(get_policy(name, budget=C, **opts), plan, 2, seed=1)


def test_rows_evict_independently():
    """Swapping the rows of a batch swaps the results: each row evicts by its own attention."""
    for name, opts in [("h2o", {"n_sink": 1, "window": 3}), ("lru", {"n_sink": 2, "window": 3})]:
        policy = get_policy(name, budget=C, **opts)
        rng = np.random.default_rng(0)
        toks = rng.integers(0, CFG.vocab_size, size=(8, 2, T))
        out = []
        for order in ([0, 1], [1, 0]):
            cache = KVCache.init(CFG, 2, policy, FMT, MAX_LEN)
            for t in toks:
                logits, cache = model_step(params(), jnp.asarray(t[order], jnp.int32), cache, CFG,
                                           jnp.asarray([3, 3], jnp.int32))
            out.append((np.asarray(cache.pos), np.asarray(logits)))
        np.testing.assert_array_equal(out[0][0][:, ::-1], out[1][0])
        np.testing.assert_allclose(out[0][1][::-1], out[1][1], atol=1e-5)


def test_random_is_reproducible_by_seed():
    plan = [(3, 3)] * 8

    def final_pos(seed):
        cache = run_episode(get_policy("random", budget=C, seed=seed, n_sink=1, window=2), plan,
                            1, seed=5)
        return np.asarray(cache.pos)

    a, b, c = final_pos(3), final_pos(3), final_pos(4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_streaming_rope_positions_stay_within_the_cache():
    """rope=cache: keys at 0..C-1 and queries right after them, however long the text."""
    policy = get_policy("streaming", budget=C, n_sink=2)
    cache = run_episode(policy, [(3, 3)] * 30, 1, seed=2)  # 90 tokens > MAX_LEN = 64
    view = cache.layer_view(0)
    pos_new = cache.length[:, None] + jnp.arange(T)[None]
    q, k = policy.rope_positions(view, pos_new)
    np.testing.assert_array_equal(np.sort(np.asarray(k), axis=-1),
                                  np.broadcast_to(np.arange(C), k.shape))
    np.testing.assert_array_equal(np.asarray(q), np.broadcast_to(C + np.arange(T), q.shape))
    assert get_policy("streaming", budget=C, rope="original").rope_positions(view, pos_new)[1] \
        is None


def test_streaming_rope_positions_by_hand():
    policy = get_policy("streaming", budget=6, n_sink=2)
    pos = jnp.asarray([[[0, 1, 17, 14, 15, 16]]], jnp.int32)  # 18 tokens seen
    view = LayerView(k=None, v=None, pos=pos, stats={}, length=jnp.asarray([18]))
    q, k = policy.rope_positions(view, jnp.asarray([[18, -1]]))
    assert k.tolist() == [[[0, 1, 5, 2, 3, 4]]]
    assert q.tolist() == [[6, -1]]


@pytest.mark.parametrize("name,opts", [
    ("streaming", {"n_sink": 2}), ("h2o", {"window": 3}), ("snapkv", {"window": 3}),
])
def test_decode_step_compiles_once(name, opts):
    """generate.decode_step over many evicting (or growing) steps: one compile (two for SnapKV:
    the prompt's cache, then the compressed one)."""
    cache = KVCache.init(CFG, 2, get_policy(name, budget=C, **opts), FMT, MAX_LEN)
    tok = jnp.zeros((2,), jnp.int32)
    for _ in range(6):
        logits, cache = decode_step(params(), tok, cache, CFG)
    cache = cache.compress(1 + 3 * C)
    logits, cache = decode_step(params(), tok, cache, CFG)
    size = decode_step._cache_size()
    for _ in range(3 * C):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits, cache = decode_step(params(), tok, cache, CFG)
    assert decode_step._cache_size() == size
    assert int(cache.length[0]) == 6 + 1 + 3 * C > C
    assert np.all(np.asarray(cache.pos) >= 0)


def test_snapkv_compress_keeps_the_format():
    """compress re-encodes through the format: int8 stores stay int8 and hold the kept rows."""
    fmt = get_format("int8")
    policy = get_policy("snapkv", budget=6, window=2, kernel=1)
    cfg = tiny_config(n_layers=1, max_seq_len=16)
    cache = KVCache.init(cfg, 1, policy, fmt, 16)
    rng = np.random.default_rng(0)
    k = rng.normal(size=(1, 12, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    probs = np.zeros((1, cfg.n_kv_heads, 12, 16 + 12), np.float32)  # [B, K, T, C + T]
    probs[..., 10:, 16 + 3] = 1.0  # the window's queries look at position 3 only
    pos_new = jnp.arange(12)[None]
    slots, stats = policy.update(cache.layer_view(0), k, k, pos_new, jnp.asarray(probs))
    cache = cache.write(0, slots, k, k, pos_new, stats).replace(length=jnp.asarray([12]))
    small = cache.compress()
    assert small.capacity == 6 and jax.tree.map(lambda x: x.dtype, small.k) == jax.tree.map(
        lambda x: x.dtype, cache.k)
    held = np.asarray(small.pos[0, 0, 0])
    assert 3 in held and {10, 11} <= set(held.tolist())
    j = int(np.flatnonzero(held == 3)[0])
    np.testing.assert_allclose(small.layer_view(0).k[0, 0, j], cache.layer_view(0).k[0, 0, 3],
                               atol=0.05)
    assert small.compress() is small


# ----------------------------------------------------------------------------- bad input


def test_unknown_policy_lists_the_policies():
    with pytest.raises(ValueError) as e:
        get_policy("lfu")
    for name in ("full", "window", "streaming", "lru", "h2o", "tova", "snapkv", "knorm",
                 "random"):
        assert name in str(e.value) and name in POLICIES


def test_unknown_option_lists_the_options():
    with pytest.raises(ValueError, match=r"no option\(s\) \['widow'\].*window"):
        get_policy("h2o", widow=3)


@pytest.mark.parametrize("budget", [0, -4])
def test_nonpositive_budget(budget):
    with pytest.raises(ValueError, match=rf"budget must be a positive integer, got {budget} "
                                         r"\(valid range: 32 <= budget <= 64\)"):
        get_policy("h2o", budget=budget).validate(64)


def test_budget_below_sinks_plus_window():
    with pytest.raises(ValueError, match=r"budget=10 is below.*n_sink=4 \+ window=16 = 20.*"
                                         r"valid range: 20 <= budget <= 64"):
        get_policy("lru", budget=10).validate(64)
    with pytest.raises(ValueError, match=r"n_sink=4 \+ 1 recent slot\(s\) = 5.*5 <= budget"):
        get_policy("streaming", budget=4).validate(64)


def test_budget_above_max_length_fails_before_allocating():
    with pytest.raises(ValueError, match=r"budget=100 exceeds the maximum length 64 "
                                         r"\(valid range: 32 <= budget <= 64\)"):
        KVCache.init(CFG, 1, get_policy("h2o", budget=100), FMT, 64)


@pytest.mark.parametrize("name,opts,match", [
    ("streaming", {"rope": "yarn"}, r"rope='yarn' is not one of \('cache', 'original'\)"),
    ("snapkv", {"pool": "median"}, r"pool='median' is not one of"),
    ("snapkv", {"kernel": 4}, r"kernel must be odd"),
    ("snapkv", {"window": 0}, r"window must be an integer >= 1, got 0"),
    ("lru", {"used_by": "recency"}, r"used_by='recency' is not one of"),
    ("lru", {"threshold": 1.5}, r"threshold must be in \[0, 1\), got 1.5"),
    ("lru", {"top_k": 0}, r"top_k must be an integer >= 1"),
    ("h2o", {"window": -1}, r"window must be an integer >= 0, got -1"),
    ("random", {"seed": -1}, r"seed must be an integer >= 0"),
    ("adakv", {"floor": 1.5}, r"policy 'adakv': floor must be in \[0, 1\], got 1.5"),
    ("adasnapkv", {"floor": "all"}, r"policy 'adasnapkv': floor must be in \[0, 1\], got 'all'"),
    ("adakv", {"score_by": "max"}, r"score_by='max' is not one of \('acc', 'current'\)"),
])
def test_bad_hyperparameters(name, opts, match):
    with pytest.raises(ValueError, match=match):
        get_policy(name, **opts)


def test_every_scoring_policy_runs_both_modes():
    """Both protocols for every policy that scores; the prompt-window ones only compress, and
    asking them to evict (or anyone for an unknown mode) is one clear error."""
    for name, cls in POLICIES.items():
        want = {"full": ("evict",), "snapkv": ("compress",), "adasnapkv": ("compress",)}
        assert cls.modes == want.get(name, ("evict", "compress")), name
    with pytest.raises(ValueError, match=r"policy 'snapkv' cannot run mode='evict' \(it selects "
                                         r"once .*\); its modes: compress"):
        get_policy("snapkv", mode="evict").validate(64)
    with pytest.raises(ValueError, match=r"mode='stream' is not one of \('evict', 'compress'\)"):
        get_policy("h2o", mode="stream").validate(64)
    with pytest.raises(ValueError, match=r"ratio=0.5 needs mode='compress'"):
        get_policy("h2o", ratio=0.5).validate(64)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\).*got 1.0"):
        get_policy("h2o", ratio=1.0, mode="compress").validate(64)


def test_kept_follows_budget_or_ratio():
    h2o = get_policy("h2o", budget=40, window=8, mode="compress")
    assert [h2o.kept(n) for n in (5, 40, 100)] == [5, 40, 40]
    r = get_policy("h2o", budget=None, ratio=0.75, window=8, mode="compress")
    assert [r.kept(n) for n in (5, 40, 100)] == [5, 10, 25]  # int(n/4), at least the window
    assert get_policy("snapkv", ratio=0.5, budget=None, window=16).kept(20) == 16


GEN_CFG = tiny_config(n_layers=1, max_seq_len=MAX_LEN)


@pytest.mark.parametrize("name,mode", [(n, m) for n in sorted(POLICIES) for m in POLICIES[n].modes])
def test_generate_keeps_at_most_the_budget(name, mode):
    """`kvjax.generate.generate` (the one loop the tasks and the speed probe share) runs every
    policy in each of its modes: evict holds at most `budget` slots per head throughout, compress
    selects at most kept(n) after the prompt and then grows by exactly the new tokens."""
    opts = {} if name == "full" else {"budget": 12, "mode": mode}
    if name in ("h2o", "lru", "adakv", "pyramid", "snapkv", "adasnapkv"):
        opts["window"] = 4
    if name == "pyramid":
        opts["n_groups"] = 1
    policy = get_policy(name, **opts)
    params1 = init_params(GEN_CFG, jax.random.PRNGKey(1))
    prompts = [list(range(1, 31)), list(range(5, 25))]
    new = 5
    out, cache = generate(params1, GEN_CFG, prompts, new, policy, FMT, max_len=MAX_LEN)
    assert out.shape == (2, new)
    held = np.asarray(cache.head_slots())  # [L, B, K]
    lengths = [len(p) + new for p in prompts]
    for b, n in enumerate(lengths):
        if name == "full":
            assert (held[:, b] == n).all()
        elif mode == "evict":
            assert held[:, b].max() <= 12 and held[:, b].sum(-1).max() <= 12 * GEN_CFG.n_kv_heads
        else:
            kept = policy.kept(len(prompts[b]))
            if policy.head_pool:  # shares move between heads; the layer's total is fixed
                assert (held[:, b].sum(-1) == GEN_CFG.n_kv_heads * (kept + new)).all()
            else:
                assert (held[:, b] == kept + new).all()


def test_generate_many_equals_one_generate_per_policy():
    """Score once, select many: one prefill read for several compress-mode policies gives each
    exactly what its own generate gives (tokens and kept positions)."""
    policies = [get_policy("snapkv", budget=12, window=4),
                get_policy("tova", budget=12, mode="compress"),
                get_policy("h2o", budget=None, ratio=0.5, window=4, mode="compress"),
                get_policy("snapkv", budget=10, window=4, kernel=1, pool="avg", per_head=False),
                get_policy("snapkv", budget=12, window=6)]
    params1 = init_params(GEN_CFG, jax.random.PRNGKey(1))
    prompts = [list(range(1, 31)), list(range(5, 25))]
    readers, which = Observers(policies=tuple(policies)).readers()
    assert len(readers) == 4 and which[0] == which[3] != which[4]  # one ring per window
    many = generate_many(params1, GEN_CFG, prompts, 4, policies, FMT, max_len=MAX_LEN)
    for policy, (tokens, cache) in zip(policies, many):
        want, ref = generate(params1, GEN_CFG, prompts, 4, policy, FMT, max_len=MAX_LEN)
        np.testing.assert_array_equal(tokens, want)
        np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(ref.pos))
    with pytest.raises(ValueError, match=r"\['h2o'\] cannot share a prefill"):
        generate_many(params1, GEN_CFG, prompts, 4, [get_policy("h2o", budget=12)], FMT,
                      max_len=MAX_LEN)
