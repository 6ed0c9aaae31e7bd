"""Importance policies against small NumPy implementations written from each paper's definition.

Each reference keeps, per kv head, a list of cached positions and replays the decode rule token
by token (or chunk by chunk: the chunk's queries score first, then the lowest candidates go).
Ties go to the OLDEST position, the rule kvjax documents. The kvjax policy is driven through
`update` on a one-layer KVCache with synthetic attention rows (small integers: exact arithmetic,
many ties) and integer keys, and end to end through the tiny model with the attention rows
recorded by a callback; the kept position sets must match at every step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache
from kvjax.config import tiny_config
from kvjax.formats import get_format
from kvjax.model import forward, init_params
from kvjax.policies import Policy, get_policy

FMT = get_format("f32")
FAST = {"xla_backend_optimization_level": 0}  # these tests compile many small programs


# ----------------------------------------------------------------------------- references


def _protected(j, t_last, n_sink, window):
    return j < n_sink or j > t_last - window


# knorm's norms: the policy sums 64 float32 squares in XLA's order, which varies with the CPU's
# vector width and XLA's optimization level; a few float32 ulps apart, either key may go
NORM_RTOL = 1e-6


def reference(kind, A, keys, chunks, C, n_sink=0, window=0, got=None, **opts):
    """Kept positions per kv head after each chunk, for one row.

    A: [K, N, N] attention rows (query position, key position), summed over the kv group's
    query heads; keys: [N, K, E]; chunks: a list of position lists (one per step).
    got: the policy's kept positions per step, as this returns them: where scores tie within
    float32 rounding (knorm's norms, `NORM_RTOL`), the victim the policy chose among the tied
    ones is followed, so one rounding does not fail every later step; elsewhere ignored."""
    K = A.shape[0]
    kept = [[] for _ in range(K)]
    state = [{} for _ in range(K)]
    out = []
    for step, chunk in enumerate(chunks):
        if not chunk:
            out.append([sorted(h) for h in kept])
            continue
        t_last = chunk[-1]
        for k in range(K):
            for j in chunk:
                if kind == "lru":
                    state[k][j] = j  # a token counts as used when it arrives
                elif kind == "h2o":
                    state[k][j] = np.float32(0.0)
            for i in chunk:
                visible = kept[k] + [j for j in chunk if j <= i]
                row = {j: np.float32(A[k, i, j]) for j in visible}
                if kind == "h2o":  # accumulated attention
                    for j, a in row.items():
                        state[k][j] = np.float32(state[k][j] + a)
                elif kind == "lru":  # last query that used the key
                    for j in _lru_used(row, **opts):
                        state[k][j] = max(state[k][j], i)
            kept[k] = kept[k] + list(chunk)

        for k in range(K):
            while len(kept[k]) > C:
                cands = [j for j in kept[k] if not _protected(j, t_last, n_sink, window)]
                scores = {j: _score(kind, A, keys, state, k, j, t_last, **opts) for j in cands}
                victim = min(cands, key=lambda j: (scores[j], j))
                if kind == "knorm" and got is not None and step < len(got):
                    low = scores[victim]
                    tied = [j for j in cands if scores[j] - low <= NORM_RTOL * abs(low)]
                    victim = next((j for j in tied if j not in got[step][k]), victim)
                kept[k].remove(victim)
                state[k].pop(victim, None)
        out.append([sorted(h) for h in kept])
    return out


def _score(kind, A, keys, state, k, j, t_last, per_head=False, **_):
    """The reference's keep score of position j in head k (higher = keep)."""
    if kind in ("h2o", "lru"):
        return state[k][j]
    if kind == "knorm":  # higher norm = lower score; float32 as the policy keeps it, so two
        # keys whose norms round to one float32 tie, and the older one goes, as in the policy
        return -float(np.float32(np.sqrt(np.sum(keys[j, k].astype(np.float64) ** 2))))
    if kind == "tova":  # the current (last) query's attention
        if per_head:
            return np.float32(A[k, t_last, j])
        total = np.float32(0.0)
        for h in range(A.shape[0]):
            total = np.float32(total + np.float32(A[h, t_last, j]))
        return np.float32(total / np.float32(A.shape[0]))
    raise ValueError(kind)


def _lru_used(row, used_by="threshold", threshold=0.0, top_k=1, **_):
    """Keys a query uses: share of its row above the threshold, or among its top_k."""
    if used_by == "threshold":
        total = sum(float(a) for a in row.values())
        return [j for j, a in row.items() if total > 0 and float(a) / total > threshold]
    vals = sorted(row.values(), reverse=True)
    kth = vals[top_k - 1] if len(vals) >= top_k else -np.inf
    return [j for j, a in row.items() if a >= kth]


def compress_reference(kind, A, keys, n, kept, n_sink=0, window=0, **opts):
    """Compress mode for one row: after a prompt of n tokens (nothing evicted while it is
    read), each head keeps its protected positions and then the best scores (ties keep the
    later position), `kept` in all."""
    K = A.shape[0]
    state = [{} for _ in range(K)]
    for k in range(K):
        for j in range(n):
            if kind == "h2o":
                total = np.float32(0.0)
                for i in range(j, n):
                    total = np.float32(total + np.float32(A[k, i, j]))
                state[k][j] = total
            elif kind == "lru":
                state[k][j] = j
        if kind == "lru":
            for i in range(n):
                for j in _lru_used({j: np.float32(A[k, i, j]) for j in range(i + 1)}, **opts):
                    state[k][j] = max(state[k][j], i)
    out = []
    for k in range(K):
        prot = [j for j in range(n) if _protected(j, n - 1, n_sink, window)]
        rest = sorted((j for j in range(n) if j not in prot),
                      key=lambda j: (-_score(kind, A, keys, state, k, j, n - 1, **opts), -j))
        out.append(sorted(prot + rest[:max(0, kept - len(prot))]))
    return out


def snapkv_pooled(A, k, n, window, kernel, pool):
    """SnapKV's score of each prefix position of head k (prompt length n), pooled."""
    start = max(0, n - window)
    obs = [sum(float(A[k, q, j]) for q in range(start, n)) for j in range(start)]
    r = kernel // 2
    if pool == "max":
        return [max(obs[max(0, j - r):j + r + 1]) for j in range(start)]
    return [sum(obs[max(0, j - r):j + r + 1]) / kernel for j in range(start)]


def snapkv_reference(A, n, budget, window, kernel, pool):
    """SnapKV's selection for one row of prompt length n: kept positions per kv head."""
    K = A.shape[0]
    start = max(0, n - window)
    out = []
    for k in range(K):
        pooled = snapkv_pooled(A, k, n, window, kernel, pool)
        chosen = sorted(range(start), key=lambda j: (-pooled[j], -j))[:max(0, budget - window)]
        out.append(sorted(chosen + list(range(start, n))))
    return out


def adasnapkv_reference(A, n, budget, window, kernel, pool, floor):
    """Ada-SnapKV: the same pooled scores, ranked over all heads together; every head keeps
    its window and its own best int(floor · (budget - window)) prefix entries (the
    safeguard), then the best of the rest of the layer fill K · (budget - window) prefix
    slots. Ties keep the later position, then the lower head."""
    K = A.shape[0]
    start = max(0, n - window)
    per_head = [sorted((-p, -j, k) for j, p in
                       enumerate(snapkv_pooled(A, k, n, window, kernel, pool)))
                for k in range(K)]
    guaranteed = [e for h in per_head for e in h[:int(floor * (budget - window))]]
    rest = sorted(e for h in per_head for e in h if e not in guaranteed)
    chosen = guaranteed + rest[:max(0, K * (budget - window) - len(guaranteed))]
    return [sorted([-j for _, j, h in chosen if h == k] + list(range(start, n)))
            for k in range(K)]


# ----------------------------------------------------------------------------- the driver


def layer_cache(policy, B, K, E, max_len):
    cfg = tiny_config(n_heads=K, n_kv_heads=K, n_layers=1, head_dim=E, max_seq_len=max_len)
    return KVCache.init(cfg, B, policy, FMT, max_len)


@functools.partial(jax.jit, compiler_options=FAST)
def policy_step(cache, k_new, pos_new, probs):
    """One update + write of layer 0, then the length moves on."""
    view = cache.layer_view(0)
    slots, stats = cache.policy.update(view, k_new, k_new, pos_new, probs)
    new = cache.write(0, slots, k_new, k_new, pos_new, stats)
    return new.replace(length=cache.length + jnp.sum(pos_new >= 0, axis=-1).astype(jnp.int32))


def chunk_probs(A, pos, pos_new, owner=None):
    """probs [B, K, T, C + T] of a chunk from attention rows A [B, K, N, N] over positions.

    pos: [B, K, C] per head, or a head pool's [B, 1, C] with `owner` [B, 1, C] (each head
    then sees only its own slots)."""
    B, K = A.shape[:2]
    C = pos.shape[-1]
    T = pos_new.shape[1]
    probs = np.zeros((B, K, T, C + T), np.float32)
    for b in range(B):
        for i in range(T):
            q = pos_new[b, i]
            if q < 0:
                continue
            for k in range(K):
                held = pos[b, k if owner is None else 0]  # [C]
                ok = (held >= 0) & (True if owner is None else owner[b, 0] == k)
                probs[b, k, i, :C][ok] = A[b, k, q, held[ok]]
                for j in range(T):
                    if 0 <= pos_new[b, j] <= q:
                        probs[b, k, i, C + j] = A[b, k, q, pos_new[b, j]]
    return probs


def kept_sets(cache):
    """Sorted valid positions per (row, head) of layer 0."""
    pos = np.asarray(cache.pos[0])
    return [[sorted(int(p) for p in pos[b, k] if p >= 0) for k in range(pos.shape[1])]
            for b in range(pos.shape[0])]


def schedule(rng, B, steps, sizes):
    """(T, n_valid [B]) per step; rows get different lengths, some steps are all padding."""
    out = []
    for _ in range(steps):
        T = int(rng.choice(sizes))
        out.append((T, rng.integers(0, T + 1, size=B) if T > 1 else rng.integers(0, 2, size=B)))
    return out


def drive(cache, A, keys, plan):
    """Feed the plan through `policy_step`; returns (kvjax kept sets per step, chunks per row)."""
    B = A.shape[0]
    chunks = [[] for _ in range(B)]
    seen = []
    length = np.asarray(cache.length).astype(np.int64)
    for T, n_valid in plan:
        pos_new = np.full((B, T), -1, np.int32)
        for b in range(B):
            pos_new[b, :n_valid[b]] = length[b] + np.arange(n_valid[b])
            chunks[b].append([int(p) for p in pos_new[b, :n_valid[b]]])
        k_new = np.zeros((B, T, A.shape[1], keys.shape[-1]), np.float32)
        for b in range(B):
            k_new[b, :n_valid[b]] = keys[b, pos_new[b, :n_valid[b]]]
        probs = chunk_probs(A, np.asarray(cache.pos[0]), pos_new)
        cache = policy_step(cache, jnp.asarray(k_new), jnp.asarray(pos_new), jnp.asarray(probs))
        length += n_valid
        seen.append(kept_sets(cache))
    return seen, chunks, cache


def synthetic(rng, B, K, N, E):
    """Integer attention rows (lower triangular incl. the diagonal) and integer keys."""
    A = np.tril(rng.integers(0, 5, size=(B, K, N, N))).astype(np.float32)
    keys = rng.integers(-2, 3, size=(B, N, K, E)).astype(np.float32)
    return A, keys


CASES = [
    ("h2o", {"n_sink": 0, "window": 2}),
    ("h2o", {"n_sink": 1, "window": 3}),
    ("tova", {}),
    ("tova", {"window": 1, "per_head": True}),
    ("lru", {"n_sink": 1, "window": 2, "used_by": "threshold", "threshold": 0.123}),
    ("lru", {"n_sink": 1, "window": 1, "used_by": "topk", "top_k": 3}),
    ("knorm", {}),
    ("knorm", {"n_sink": 1, "window": 1}),
]


@pytest.mark.parametrize("sizes", [(1,), (1, 3, 7)], ids=["token", "chunks"])
@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_update_matches_reference(name, opts, sizes):
    """Synthetic rows, 2 rows x 2 heads, capacity 6, 45 steps (chunks of up to 7 > C, whose own
    tokens then lose too): kept sets equal at every step."""
    B, K, E, C = 2, 2, 4, 6
    policy = get_policy(name, budget=C, **opts)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        plan = schedule(rng, B, 45, sizes)
        N = int(sum(T for T, _ in plan))
        A, keys = synthetic(rng, B, K, N, E)
        seen, chunks, _ = drive(layer_cache(policy, B, K, E, N), A, keys, plan)
        for b in range(B):
            ref = reference(name, A[b], keys[b], chunks[b], C, **opts)
            for step, (got, want) in enumerate(zip((s[b] for s in seen), ref)):
                assert got == want, f"{name} {opts} seed {seed} row {b} step {step}"


def test_tova_layerwise_heads_agree():
    """Paper default: all kv heads of a layer evict the same position."""
    B, K, E, C = 2, 3, 4, 5
    policy = get_policy("tova", budget=C)
    rng = np.random.default_rng(7)
    plan = schedule(rng, B, 30, (1, 3))
    A, keys = synthetic(rng, B, K, int(sum(T for T, _ in plan)), E)
    seen, _, _ = drive(layer_cache(policy, B, K, E, A.shape[-1]), A, keys, plan)
    assert all(all(h == row[0] for h in row) for step in seen for row in step)


def check_grown(seen, after, lengths, seed):
    """After a compress-mode selection every decoded token is added and nothing is dropped."""
    for step, got in enumerate(seen, start=1):
        for b, held in enumerate(after):
            grown = [sorted(h + list(range(lengths[b], lengths[b] + step))) for h in held]
            assert got[b] == grown, f"seed {seed} row {b} decode {step}"


def prefill_compress(policy, B, K, E, N, seed, steps, extra=0):
    """A seeded chunked prefill with padding through `policy`, then `compress(extra)`:
    (attention rows, keys, compressed cache, prompt length per row)."""
    rng = np.random.default_rng(seed)
    plan = schedule(rng, B, steps, (1, 4))
    A, keys = synthetic(rng, B, K, N, E)
    _, chunks, cache = drive(layer_cache(policy, B, K, E, N), A, keys, plan)
    return A, keys, cache.compress(extra), [sum(len(c) for c in chunks[b]) for b in range(B)]


COMPRESS_CASES = [
    ("h2o", {"n_sink": 1, "window": 2}),
    ("tova", {}),
    ("tova", {"window": 1, "per_head": True}),
    ("lru", {"n_sink": 1, "window": 2, "used_by": "threshold", "threshold": 0.123}),
    ("knorm", {"n_sink": 1, "window": 1}),
]


@pytest.mark.parametrize("name,opts", COMPRESS_CASES,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(COMPRESS_CASES)])
def test_compress_selection_matches_reference(name, opts):
    """Compress mode: a chunked prompt with padding, then one selection per head from the
    scores after the whole prompt (kvpress's ScorerPress), kept = budget; then the cache grows
    by every decoded token."""
    B, K, E, budget, N = 2, 2, 4, 7, 40
    policy = get_policy(name, budget=budget, mode="compress", **opts)
    for seed in range(2):
        A, keys, cache, lengths = prefill_compress(policy, B, K, E, N, seed, 9, extra=4)
        assert cache.capacity == max(policy.kept(n) for n in lengths) + 4
        after = kept_sets(cache)
        for b in range(B):
            want = compress_reference(name, A[b], keys[b], lengths[b], policy.kept(lengths[b]),
                                      **opts)
            assert after[b] == want, f"seed {seed} row {b} (prompt {lengths[b]})"
        seen, _, _ = drive(cache, A, keys, [(1, np.ones(B, np.int64)) for _ in range(4)])
        check_grown(seen, after, lengths, seed)


@pytest.mark.parametrize("pool,kernel,window", [("max", 3, 3), ("avg", 5, 2)])
def test_snapkv_compress_matches_reference(pool, kernel, window):
    """Chunked prefill with padding (observe), compress, then decode grows the cache."""
    B, K, E, budget, N = 2, 2, 4, 8, 40
    policy = get_policy("snapkv", budget=budget, window=window, kernel=kernel, pool=pool)
    for seed in range(2):
        A, keys, cache, lengths = prefill_compress(policy, B, K, E, N, seed, 9, extra=6)
        assert cache.capacity == budget + 6
        after = kept_sets(cache)
        for b in range(B):
            want = snapkv_reference(A[b], lengths[b], budget, window, kernel, pool)
            assert after[b] == want, f"seed {seed} row {b} (prompt {lengths[b]})"
        seen, _, _ = drive(cache, A, keys, [(1, np.ones(B, np.int64)) for _ in range(6)])
        check_grown(seen, after, lengths, seed)


def test_snapkv_head_averaged_selection():
    """per_head=False: every kv head keeps the positions SnapKV picks from the attention
    averaged over the kv heads."""
    B, K, E, budget, N, window = 2, 3, 4, 8, 40, 3
    policy = get_policy("snapkv", budget=budget, window=window, kernel=3, per_head=False)
    A, _, cache, lengths = prefill_compress(policy, B, K, E, N, 0, 9)
    after = kept_sets(cache)
    for b in range(B):
        total = A[b].sum(axis=0, keepdims=True)  # over the heads (exact), then pooled
        want = snapkv_reference(total, lengths[b], budget, window, 3, "max")[0]
        assert after[b] == [want] * K, f"row {b}"
        assert len({tuple(h) for h in kept_sets(prefill_compress(
            get_policy("snapkv", budget=budget, window=window, kernel=3), B, K, E, N, 0,
            9)[2])[b]}) > 1  # per head they differ on this data


@pytest.mark.parametrize("pool,kernel,window,floor", [("max", 3, 3, 0.0), ("avg", 5, 2, 0.0),
                                                     ("max", 3, 2, 0.5)])
def test_adasnapkv_compress_matches_reference(pool, kernel, window, floor):
    """Chunked prefill with padding, compress into the head pool: each head's entries are the
    reference's; then decode grows every head by its new token."""
    B, K, E, budget, N, extra = 2, 3, 4, 6, 40, 6
    policy = get_policy("adasnapkv", budget=budget, window=window, kernel=kernel, pool=pool,
                        floor=floor)
    for seed in range(2):
        A, _, cache, lengths = prefill_compress(policy, B, K, E, N, seed, 12, extra=extra)
        assert cache.pos.shape[-1] == K * (budget + extra)
        assert max(lengths) > budget  # the selection drops entries
        after = pool_sets(cache)
        for b in range(B):
            want = adasnapkv_reference(A[b], lengths[b], budget, window, kernel, pool, floor)
            assert after[b] == want, f"seed {seed} row {b} (prompt {lengths[b]})"
        P = cache.pos.shape[-1]
        for step in range(1, extra + 1):
            pos_new = jnp.asarray([[n + step - 1] for n in lengths], jnp.int32)  # [B, 1]
            cache = policy_step(cache, jnp.zeros((B, 1, K, E)), pos_new,
                                jnp.zeros((B, K, 1, P + 1)))
            got = pool_sets(cache)
            for b in range(B):
                assert got[b] == [sorted(h + list(range(lengths[b], lengths[b] + step)))
                                  for h in after[b]], f"seed {seed} row {b} decode {step}"


def pool_sets(cache, layer=0):
    """Sorted positions per (row, head) of a layer of a HeadPool."""
    pos, owner = np.asarray(cache.pos[layer, :, 0]), np.asarray(cache.owner[layer, :, 0])
    return [[sorted(int(p) for p in pos[b][(owner[b] == k) & (pos[b] >= 0)])
             for k in range(cache.n_heads)] for b in range(pos.shape[0])]


# ----------------------------------------------------------------------------- end to end

RECORDS: list = []


@dataclasses.dataclass(frozen=True)
class Recorded(Policy):
    """Runs `inner` and records what each update saw (test only, not registered)."""

    name = "recorded"
    inner: Any = None

    def capacity(self, max_len):
        return self.inner.capacity(max_len)

    def validate(self, max_len):
        self.inner.validate(max_len)

    def cache_stats(self, B, K, C):
        return self.inner.cache_stats(B, K, C)

    def rope_positions(self, view, pos_new):
        return self.inner.rope_positions(view, pos_new)

    def update(self, view, k_new, v_new, pos_new, probs):
        jax.debug.callback(lambda *a: RECORDS.append([np.asarray(x) for x in a]),
                           view.pos, probs, pos_new, k_new, ordered=True)
        return self.inner.update(view, k_new, v_new, pos_new, probs)


@functools.partial(jax.jit, static_argnames=("cfg",), compiler_options=FAST)
def model_step(params, tokens, cache, cfg, n_valid):
    return forward(params, tokens, cache, cfg, n_valid)


def run_recorded(policy, n_tokens, lengths=None, seed=0):
    """Token by token through the tiny model (B = 2); rows stop at `lengths`."""
    cfg = tiny_config(max_seq_len=64)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.PRNGKey(seed))
    RECORDS.clear()
    cache = KVCache.init(cfg, 2, Recorded(inner=policy), FMT, 64)
    lengths = lengths or [n_tokens, n_tokens]
    toks = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(2, n_tokens))
    for t in range(n_tokens):
        n_valid = jnp.asarray([int(t < n) for n in lengths], jnp.int32)
        _, cache = model_step(params, jnp.asarray(toks[:, t:t + 1], jnp.int32), cache, cfg,
                              n_valid)
    jax.effects_barrier()
    assert len(RECORDS) == n_tokens * cfg.n_layers
    return cfg, cache, RECORDS[:]


def replay(records, L, layer, b):
    """Attention rows A [K, N, N] (NaN where never observed) and keys [N, K, E] of one row."""
    steps = records[layer::L]
    pos0, _probs0, _, k0 = steps[0]
    K, C = pos0.shape[1], pos0.shape[2]
    N = len(steps)
    A = np.full((K, N, N), np.nan, np.float32)
    keys = np.zeros((N, K, k0.shape[-1]), np.float32)
    chunks, kept = [], []
    for pos, probs, pos_new, k_new in steps:
        q = int(pos_new[b, 0])
        chunks.append([q] if q >= 0 else [])
        kept.append([sorted(int(p) for p in pos[b, k] if p >= 0) for k in range(K)])
        if q < 0:
            continue
        keys[q] = k_new[b, 0]
        for k in range(K):
            ok = pos[b, k] >= 0
            A[k, q, pos[b, k][ok]] = probs[b, k, 0, :C][ok]
            A[k, q, q] = probs[b, k, 0, C]
    return A, keys, chunks, kept[1:]


@pytest.mark.parametrize("name,opts", [
    ("h2o", {"window": 2}),
    ("tova", {}),
    ("lru", {"n_sink": 1, "window": 2, "used_by": "topk", "top_k": 3}),
    ("knorm", {"window": 1}),
])
def test_end_to_end_through_the_model(name, opts):
    """The model's own attention rows (recorded) replayed through the reference, per layer."""
    C = 7
    cfg, cache, records = run_recorded(get_policy(name, budget=C, **opts), 26, lengths=[26, 19])
    L = cfg.n_layers
    final = np.asarray(cache.pos)
    for layer in range(L):
        for b in range(2):
            A, keys, chunks, kept = replay(records, L, layer, b)
            kept.append([sorted(int(p) for p in final[layer, b, k] if p >= 0)
                         for k in range(final.shape[2])])
            ref = reference(name, A, keys, chunks, C, got=kept, **opts)
            for step, (got, want) in enumerate(zip(kept, ref)):
                assert got == want, f"layer {layer} row {b} step {step}"


def test_snapkv_end_to_end_through_the_model():
    """Prefill (collect) through the model, compress, compare with the recorded rows."""
    budget, window = 8, 3
    policy = get_policy("snapkv", budget=budget, window=window, kernel=3, pool="max")
    lengths = [22, 15]
    cfg, cache, records = run_recorded(policy, 22, lengths=lengths)
    cache = cache.replace(policy=policy).compress()
    assert cache.capacity == budget
    got = np.asarray(cache.pos)
    for layer in range(cfg.n_layers):
        for b in range(2):
            A, _, _, _ = replay(records, cfg.n_layers, layer, b)
            want = snapkv_reference(np.nan_to_num(A), lengths[b], budget, window, 3, "max")
            have = [sorted(int(p) for p in got[layer, b, k] if p >= 0) for k in range(2)]
            assert have == want, f"layer {layer} row {b}"
