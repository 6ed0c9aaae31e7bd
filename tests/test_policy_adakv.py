"""`adakv`: per-head budgets in a shared slot pool (kvjax.cache.HeadPool).

Checked here: the joint eviction against a NumPy implementation of Ada-KV's rule (keep the top
K · budget (head, token) entries of the layer, every head's sinks and window protected, ties to
the oldest position); the pool invariants through the tiny model (property-tested); full-cache
logits while nothing is evicted; one compile for many decode steps; that shares really adapt
(a peaked head gives slots to a flat one); and the bytes: those of `budget` slots per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_policy_scoring import chunk_probs, layer_cache, policy_step, pool_sets

from kvjax.cache import HeadPool, KVCache, closed_form_bytes, get_layout
from kvjax.config import tiny_config
from kvjax.formats import get_format
from kvjax.generate import decode_step
from kvjax.model import forward, init_params
from kvjax.policies import get_policy

FMT = get_format("f32")
FAST = {"xla_backend_optimization_level": 0}
MAX_LEN = 64
CFG = tiny_config(max_seq_len=MAX_LEN)  # 2 kv heads, 4 query heads, 2 layers


# ----------------------------------------------------------------------------- the reference


def adakv_reference(A, chunks, C, n_sink=0, window=0, score_by="acc", floor=0.2):
    """Kept positions per kv head after each chunk, for one row, from Ada-KV's definition.

    A: [K, N, N] attention rows (query, key) summed over each kv group's query heads. All
    (head, position) entries of the layer compete for K · C slots: after each chunk the lowest
    scored unprotected entries go, ties to the oldest position, then the lowest head. Each
    head's sinks, window and its own best int(floor · (C - window - n_sink)) other entries
    (the safeguard; ties keep the newer) are protected."""
    K = A.shape[0]
    kept: dict[tuple[int, int], float] = {}  # (head, position) -> accumulated attention
    out = []
    for chunk in chunks:
        if chunk:
            t_last = chunk[-1]
            for k in range(K):
                old = [j for (h, j) in kept if h == k]
                for j in chunk:
                    kept[(k, j)] = 0.0
                for i in chunk:  # the chunk's queries see the cache and the chunk causally
                    for j in old + [j for j in chunk if j <= i]:
                        kept[(k, j)] += float(A[k, i, j])

            def key(e, t_last=t_last):
                k, j = e
                s = kept[e] if score_by == "acc" else float(A[k, t_last, j])
                return (s, j, k)

            def protected(e, t_last=t_last):
                return e[1] < n_sink or e[1] > t_last - window

            n_floor = int(floor * max(0, C - window - n_sink))
            guard = set()
            for k in range(K):
                mine = [e for e in kept if e[0] == k and not protected(e)]
                guard |= set(sorted(mine, key=lambda e: (-key(e)[0], -e[1]))[:n_floor])
            while len(kept) > K * C:
                cands = [e for e in kept if not protected(e) and e not in guard]
                del kept[min(cands, key=key)]
        out.append([sorted(j for (h, j) in kept if h == k) for k in range(K)])
    return out


# ----------------------------------------------------------------------------- the driver


def drive(cache, A, plan):
    """Feed (T, n_valid) steps through `policy_step`; kept sets per step and chunks per row."""
    B, K = A.shape[:2]
    chunks = [[] for _ in range(B)]
    seen = []
    length = np.zeros(B, np.int64)
    for T, n_valid in plan:
        pos_new = np.full((B, T), -1, np.int32)
        for b in range(B):
            pos_new[b, :n_valid[b]] = length[b] + np.arange(n_valid[b])
            chunks[b].append([int(p) for p in pos_new[b, :n_valid[b]]])
        probs = chunk_probs(A, np.asarray(cache.pos[0]), pos_new, np.asarray(cache.owner[0]))
        k_new = jnp.zeros((B, T, K, 4), jnp.float32)
        cache = policy_step(cache, k_new, jnp.asarray(pos_new), jnp.asarray(probs))
        length += n_valid
        seen.append(pool_sets(cache))
    return seen, chunks, cache


@pytest.mark.parametrize("sizes", [(1,), (1, 3, 7)], ids=["token", "chunks"])
@pytest.mark.parametrize("opts", [
    {"score_by": "acc", "window": 1, "floor": 0.0},
    {"score_by": "acc", "n_sink": 1, "window": 2},
    {"score_by": "current", "window": 1, "floor": 0.0},
    {"score_by": "acc", "window": 1, "floor": 0.7},  # 2 of each head's 3 heavy slots guarded
    {"score_by": "current", "window": 0, "floor": 0.5},
], ids=["acc", "acc-sinks", "current", "acc-floor", "current-floor"])
def test_joint_eviction_matches_reference(opts, sizes):
    """2 rows x 3 heads, budget 4 per head (a pool of 12), 40 steps with padding; chunks of up
    to 7 tokens (21 entries) overflow the pool, so new entries lose too."""
    B, K, C = 2, 3, 4
    policy = get_policy("adakv", budget=C, **opts)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        plan = []
        for _ in range(40):
            T = int(rng.choice(sizes))
            plan.append((T, rng.integers(0, T + 1, size=B) if T > 1 else np.ones(B, np.int64)))
        N = sum(T for T, _ in plan)
        A = np.tril(rng.integers(1, 1000, size=(B, K, N, N))).astype(np.float32)
        seen, chunks, cache = drive(layer_cache(policy, B, K, 4, N), A, plan)
        for b in range(B):
            want = adakv_reference(A[b], chunks[b], C, **opts)
            for step, (got, ref) in enumerate(zip((s[b] for s in seen), want)):
                assert got == ref, f"{opts} seed {seed} row {b} step {step}"
        shares = np.asarray(cache.head_slots())[0]  # [B, K]
        assert (shares.sum(-1) == K * C).all()


def test_shares_follow_the_attention():
    """A head that attends to one token gives its slots to a head whose attention is flat,
    and a fixed per-head budget (h2o) would not: Ada-KV's motivation."""
    B, K, C, N = 1, 2, 6, 40
    A = np.zeros((B, K, N, N), np.float32)
    for i in range(N):
        A[0, 0, i, 0] = 1.0  # head 0: everything on the first token
        A[0, 1, i, :i + 1] = 1.0 / (i + 1)  # head 1: flat
    policy = get_policy("adakv", budget=C, window=1)
    _, _, cache = drive(layer_cache(policy, B, K, 4, N), A, [(1, np.ones(1, np.int64))] * N)
    shares = np.asarray(cache.head_slots())[0, 0]
    assert shares.sum() == K * C and shares[1] > shares[0] + 4, shares
    assert pool_sets(cache)[0][0] == [0, N - 1]  # head 0 keeps its sink-like token and the window


# ----------------------------------------------------------------------------- the model


@functools.cache
def params():
    return jax.jit(init_params, static_argnums=0, compiler_options=FAST)(CFG,
                                                                        jax.random.PRNGKey(0))


@functools.partial(jax.jit, static_argnames=("cfg",), compiler_options=FAST)
def model_step(params, tokens, cache, cfg, n_valid):
    return forward(params, tokens, cache, cfg, n_valid)


def check_pool(policy, cache, lengths):
    """Every pool invariant of layer l, row b: filled up to K · budget, positions unique per
    head and already seen, each head's sinks and window present, owners valid."""
    K, C = CFG.n_kv_heads, policy.budget
    owner = np.asarray(cache.owner)
    assert owner.min() >= 0 and owner.max() < K
    for layer in range(CFG.n_layers):
        for b, n in enumerate(lengths):
            heads = pool_sets(cache, layer)[b]
            assert sum(len(h) for h in heads) == min(K * C, K * n)
            for h in heads:
                assert len(set(h)) == len(h) and (not h or max(h) < n)
                must = set(range(min(policy.n_sink, n))) | set(range(max(0, n - policy.window), n))
                assert must <= set(h), f"protected {sorted(must - set(h))} evicted"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=2, max_size=14),
       score=st.sampled_from(["acc", "current"]), seed=st.integers(0, 2**16))
def test_invariants_through_the_model(plan, score, seed):
    """Rows of different lengths (padding), chunks of 3; against the full cache while no row
    has evicted anything (an entry only goes once the pool holds K · budget)."""
    policy = get_policy("adakv", budget=5, window=2, n_sink=1, score_by=score)
    rng = np.random.default_rng(seed)
    cache = KVCache.init(CFG, 2, policy, FMT, MAX_LEN)
    ref = KVCache.init(CFG, 2, get_policy("full"), FMT, MAX_LEN)
    lengths = np.zeros(2, np.int64)
    for n_valid in plan:
        toks = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 3)), jnp.int32)
        nv = jnp.asarray(n_valid, jnp.int32)
        logits, cache = model_step(params(), toks, cache, CFG, nv)
        ref_logits, ref = model_step(params(), toks, ref, CFG, nv)
        lengths += np.asarray(n_valid)
        check_pool(policy, cache, lengths)
        for b in range(2):
            if lengths[b] <= policy.budget:
                np.testing.assert_allclose(logits[b, :n_valid[b]], ref_logits[b, :n_valid[b]],
                                           atol=1e-5, rtol=0)


@pytest.mark.parametrize("score,per_head", [("acc", ("h2o", {})),
                                             ("current", ("tova", {"per_head": True}))])
def test_floor_one_is_the_per_head_policy(score, per_head):
    """floor=1 guards each head's whole share: the pool then evicts exactly as the per-head
    policy with the same scores (h2o, TOVA per head), token by token through the model (peaked
    attention: scale-0.5 weights); floor=0 (joint allocation only) does not."""
    weights = init_params(CFG, jax.random.PRNGKey(1), scale=0.5)
    opts = {"budget": 5, "window": 2, "n_sink": 1}
    name, extra = per_head
    for floor in (1.0, 0.0):
        pool = KVCache.init(CFG, 2, get_policy("adakv", score_by=score, floor=floor, **opts), FMT,
                            MAX_LEN)
        fixed = KVCache.init(CFG, 2, get_policy(name, **opts, **extra), FMT, MAX_LEN)
        rng = np.random.default_rng(3)
        same = []
        for _ in range(16):
            toks = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 1)), jnp.int32)
            nv = jnp.ones((2,), jnp.int32)
            lp, pool = model_step(weights, toks, pool, CFG, nv)
            lf, fixed = model_step(weights, toks, fixed, CFG, nv)
            pos = np.asarray(fixed.pos)
            for layer in range(CFG.n_layers):
                want = [[sorted(int(p) for p in pos[layer, b, k] if p >= 0) for k in range(2)]
                        for b in range(2)]
                same.append(pool_sets(pool, layer) == want)
            if floor == 1.0:
                np.testing.assert_allclose(lp, lf, atol=1e-4, rtol=0)
        assert all(same) if floor == 1.0 else not all(same)


def test_decode_compiles_once_and_keeps_the_pool_full():
    cache = KVCache.init(CFG, 2, get_policy("adakv", budget=6, window=2), FMT, MAX_LEN)
    tok = jnp.zeros((2,), jnp.int32)
    logits, cache = decode_step(params(), tok, cache, CFG)
    size = decode_step._cache_size()
    for _ in range(20):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits, cache = decode_step(params(), tok, cache, CFG)
    assert decode_step._cache_size() == size
    assert np.isfinite(np.asarray(logits)).all()
    assert (np.asarray(cache.head_slots()).sum(-1) == CFG.n_kv_heads * 6).all()


# ----------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("fmt_name", ["f32", "bf16", "int8", "int4", "int2"])
def test_bytes_are_those_of_budget_slots_per_head(fmt_name):
    """The pool's k/v bytes equal a fixed per-head cache of the same budget (h2o) and the
    closed form; the owner array adds one byte per slot; a masked full-length cache (what
    kvpress keeps) is about max_len / budget times larger."""
    cfg = tiny_config(n_layers=3, n_heads=6, n_kv_heads=3, head_dim=64, max_seq_len=1024)
    fmt = get_format(fmt_name)
    pool = KVCache.abstract(cfg, 2, get_policy("adakv", budget=128), fmt, 1024)
    fixed = KVCache.abstract(cfg, 2, get_policy("h2o", budget=128), fmt, 1024)
    masked = KVCache.abstract(cfg, 2, get_policy("full"), fmt, 1024)
    assert isinstance(pool, HeadPool) and pool.capacity == 128
    assert pool.kv_nbytes() == fixed.kv_nbytes()
    assert masked.kv_nbytes() > 3 * pool.kv_nbytes()  # 8x, less the fixed int4/int2 residual
    if fmt_name in ("f32", "bf16"):
        bpv = {"f32": 4, "bf16": 2}[fmt_name]
        assert pool.kv_nbytes() == closed_form_bytes(cfg, 128, bpv, batch=2)
    owner = 3 * 2 * 3 * 128  # [L, B, 1, K·budget] int8
    assert pool.nbytes() - pool.kv_nbytes() == fixed.nbytes() - fixed.kv_nbytes() + owner


def test_pyramid_over_adakv_gives_per_layer_and_per_head_budgets():
    """pyramid(inner=adakv): each layer group is a pool of its own size."""
    policy = get_policy("pyramid", budget=8, taper=3.0, n_groups=2, inner="adakv", window=2)
    cache = KVCache.init(CFG, 1, policy, FMT, MAX_LEN)
    assert all(isinstance(g, HeadPool) for g in cache.groups)
    budgets = policy.budgets(CFG.n_layers, MAX_LEN)
    assert [g.pos.shape[-1] for g in cache.groups] == [2 * b for b in budgets]
    for _ in range(8):
        logits, cache = model_step(params(), jnp.ones((1, 3), jnp.int32), cache, CFG,
                                   jnp.asarray([3], jnp.int32))
    assert np.isfinite(np.asarray(logits)).all()
    per_layer = np.asarray(cache.head_slots()).sum(-1)[:, 0]  # [L] over all groups
    assert per_layer.tolist() == [2 * b for b in budgets]


# ----------------------------------------------------------------------------- bad input


def test_bad_input():
    with pytest.raises(ValueError, match=r"score_by=.max. is not one of \('acc', 'current'\)"):
        get_policy("adakv", score_by="max")
    with pytest.raises(ValueError, match=r"budget=3 is below.*n_sink=0 \+ window=32"):
        KVCache.init(CFG, 1, get_policy("adakv", budget=3), FMT, MAX_LEN)
    with pytest.raises(ValueError, match=r"keep_heads=\(0,\) cannot apply to policy 'adakv'.*"
                                         r"keep_layers"):
        KVCache.init(CFG, 1, get_policy("adakv", budget=8, window=2),
                     get_format("int4", key_mode="token", keep_heads=(0,)), MAX_LEN)
    with pytest.raises(ValueError, match=r"keep_heads=\(0,\) cannot apply to policy 'adasnapkv'"):
        KVCache.init(CFG, 1, get_policy("adasnapkv", budget=8, window=2),
                     get_format("int4", key_mode="token", keep_heads=(0,)), MAX_LEN)
    int4 = get_format("int4", group=8)  # per-channel keys: slot groups of 8 along the pool
    for name in ("adakv", "adasnapkv"):  # adasnapkv: before its prefill, not at compress
        with pytest.raises(ValueError, match=rf"policy '{name}': budget=5 gives a pool of "
                                             r"Hkv · budget = 2 · 5 = 10 slots.*'int4'.*"
                                             r"budgets that fit near it: \[8, 12, 16\]"):
            KVCache.init(CFG, 1, get_policy(name, budget=5, window=2), int4, MAX_LEN)
    with pytest.raises(ValueError, match=r"HeadPool.init: policy 'h2o' does not evict from a "
                                         r"head pool"):
        HeadPool.init(CFG, 1, get_policy("h2o", budget=8, window=2), FMT, MAX_LEN)
    with pytest.raises(ValueError, match=r"policy 'adakv' is not supported on the paged layout"):
        get_layout("paged").init(CFG, 1, get_policy("adakv", budget=16, window=2), FMT, MAX_LEN)
