"""Paged KV cache: allocator invariants (hypothesis), copy-on-write, prefix sharing, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import pages
from kvjax.formats import get_format

INTERPRET = jax.devices()[0].platform != "gpu"
B, P, PAGE, MAX_LEN, T = 4, 10, 8, 32, 4  # pool of 10 pages < 4 rows x 4 pages: pressure


def _empty(fmt="f32", **kw):
    base = {
        "n_layers": 1,
        "n_kv_heads": 1,
        "head_dim": 2,
        "batch": B,
        "num_pages": P,
        "page_size": PAGE,
        "max_len": MAX_LEN,
        "fmt": get_format(fmt) if isinstance(fmt, str) else fmt,
    }
    base.update(kw)
    return pages.PagedKVCache.init(**base)


@jax.jit
def _append(cache, k, n):
    """k [B, T, K, E]; values -k; returns (cache, granted)."""
    cache, g = pages.reserve(cache, n)
    cache = pages.write(cache, 0, k, -k, g)
    return pages.advance(cache, g), g


_free = jax.jit(pages.free)
_share = jax.jit(pages.share_prefix)
_evict = jax.jit(pages.window_evict, static_argnums=(1, 2))
_gather = jax.jit(pages.gather, static_argnums=1)


class Shadow:
    """What each row should hold: token values by position, None where evicted."""

    def __init__(self):
        self.rows = [[] for _ in range(B)]
        self.counter = 0

    def tokens(self, n_new):
        k = np.zeros((B, T, 1, 2), np.float32)
        for b in range(B):
            for t in range(T):
                self.counter += 1
                k[b, t] = self.counter
        return k


def _audit(cache, shadow):
    assert pages.invariant_errors(cache) == []
    bt, rc = np.asarray(cache.block_tables), np.asarray(cache.refcount)
    owners = {}
    for b in range(B):
        row = bt[b][bt[b] >= 0]
        assert len(set(row.tolist())) == len(row), "a row references a page twice"
        for p in row.tolist():
            owners.setdefault(p, []).append(b)
    for p, rows in owners.items():
        assert rc[p] == len(rows) and (len(rows) == 1 or rc[p] > 1)
    assert int(cache.free_count()) == P - len(owners)
    np.testing.assert_array_equal(cache.lengths, [len(r) for r in shadow.rows])
    k, v, valid = _gather(cache, 0)
    k, v, valid = np.asarray(k), np.asarray(v), np.asarray(valid)
    for b, row in enumerate(shadow.rows):
        for t, val in enumerate(row):
            if valid[b, t]:
                assert val is not None, f"row {b} token {t} evicted but still attended"
                assert k[b, 0, t, 0] == val and v[b, 0, t, 1] == -val, (b, t)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(st.integers(0, T), min_size=B, max_size=B)),
        st.tuples(st.just("free"), st.integers(0, B - 1)),
        st.tuples(st.just("share"), st.integers(0, B - 1), st.integers(0, 15), st.integers(0, 40)),
        st.tuples(st.just("evict"), st.integers(0, B - 1), st.sampled_from([(9, 0), (12, 3)])),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_allocator_invariants(program):
    """After any sequence of appends, frees, prefix shares and evictions: refcounts equal table
    references, no page is owned twice unless shared, every row reads back exactly its tokens
    (copy-on-write kept sharers apart), and once every row is freed all pages are reusable."""
    cache, shadow = _empty(), Shadow()
    for op in program:
        if op[0] == "append":
            n = np.asarray(op[1], np.int32)
            k = shadow.tokens(n)
            cache, g = _append(cache, jnp.asarray(k), jnp.asarray(n))
            for b in range(B):
                assert int(g[b]) in (0, n[b])
                shadow.rows[b] += [float(k[b, t, 0, 0]) for t in range(int(g[b]))]
        elif op[0] == "free":
            cache = _free(cache, jnp.arange(B) == op[1])
            shadow.rows[op[1]] = []
        elif op[0] == "share":
            src, mask, n = op[1], op[2], op[3]
            n = min(n, len(shadow.rows[src]))
            if any(v is None for v in shadow.rows[src][:n]):
                continue  # sharing an evicted prefix is allowed but not modelled here
            dst = np.array([(mask >> b) & 1 and b != src for b in range(B)], bool)
            cache = _share(cache, src, jnp.asarray(dst), n)
            for b in np.flatnonzero(dst):
                shadow.rows[b] = list(shadow.rows[src][:n])
        else:
            b, (window, sinks) = op[1], op[2]
            cache = _evict(cache, window, sinks, jnp.arange(B) == b)
            bt = np.asarray(cache.block_tables)[b]
            for t in range(len(shadow.rows[b])):
                if bt[t // PAGE] < 0:
                    shadow.rows[b][t] = None
        _audit(cache, shadow)
    cache = _free(cache, jnp.ones(B, bool))
    assert int(cache.free_count()) == P and not np.asarray(cache.refcount).any()
    cache, g = _append(cache, jnp.ones((B, T, 1, 2)), jnp.full((B,), T, jnp.int32))
    assert np.asarray(g).tolist() == [T] * B


def test_window_evict_frees_pages_and_bounds_the_pool():
    cache = _empty(num_pages=24, max_len=64, batch=4)
    k = jnp.ones((4, 40, 1, 2))
    cache, _ = pages.append(cache, k[None], -k[None])
    cache = pages.window_evict(cache, window=10, sinks=2)
    # per row: the sink page 0 and the pages holding tokens 30..39 (pages 3, 4)
    np.testing.assert_array_equal(np.asarray(cache.block_tables)[:, [1, 2]], pages.NO_PAGE)
    assert (np.asarray(cache.block_tables)[:, [0, 3, 4]] >= 0).all()
    assert pages.invariant_errors(cache) == []
    assert int(cache.free_count()) == 24 - 4 * 3


def test_copy_on_write_refcounts():
    """3 rows share a 5-token prompt (half a page); row 1 writes: it gets a private copy."""
    cache = _empty()
    prompt = jnp.arange(1, 6, dtype=jnp.float32)[None, :, None, None] * jnp.ones((B, 5, 1, 2))
    cache, _ = pages.append(cache, prompt[None], -prompt[None], jnp.array([5, 0, 0, 0]))
    p0 = int(cache.block_tables[0, 0])
    cache = pages.share_prefix(cache, 0, jnp.array([False, True, True, False]))
    assert int(cache.refcount[p0]) == 3
    assert (np.asarray(cache.block_tables)[:3, 0] == p0).all()
    new = jnp.full((B, 1, 1, 2), 99.0)
    cache, _ = pages.append(cache, new[None], -new[None], jnp.array([0, 1, 0, 0]))
    p1 = int(cache.block_tables[1, 0])
    assert p1 != p0 and int(cache.refcount[p0]) == 2 and int(cache.refcount[p1]) == 1
    k, _, valid = pages.gather(cache, 0)
    np.testing.assert_array_equal(k[1, 0, :6, 0], [1, 2, 3, 4, 5, 99])
    np.testing.assert_array_equal(k[0, 0, :5, 0], [1, 2, 3, 4, 5])
    assert int(valid[0].sum()) == 5 and int(valid[2].sum()) == 5
    assert pages.invariant_errors(cache) == []


def test_out_of_pages_eager_raises_before_work():
    cache = _empty()
    k = jnp.ones((1, B, 24, 1, 2))
    before = cache
    with pytest.raises(pages.OutOfPagesError, match=r"needs 12 fresh pages .* 10 of 10 are free"):
        pages.append(cache, k, k)
    assert cache is before and int(cache.free_count()) == P
    with pytest.raises(pages.OutOfPagesError, match="past max_len=32"):
        pages.append(cache, jnp.ones((1, B, 33, 1, 2)), jnp.ones((1, B, 33, 1, 2)))


def test_out_of_pages_under_jit_preempts_later_rows():
    cache = _empty()
    k = jnp.ones((B, T, 1, 2))
    for _ in range(5):  # 4 rows x 20 tokens need 12 pages; the pool has 10
        cache, _ = _append(cache, k, jnp.full((B,), T, jnp.int32))
    pre = np.asarray(cache.preempted)
    assert pre.any() and not pre[0]
    assert pages.invariant_errors(cache) == []
    ln = np.asarray(cache.lengths)
    assert (ln[pre] < 20).all() and (ln[~pre] == 20).all()
    with pytest.raises(pages.PagedCacheError, match="preempted"):
        pages.check(cache)
    cache = pages.free(cache, jnp.asarray(pre))
    pages.check(cache)


def test_bad_page_size_and_format():
    with pytest.raises(ValueError, match=r"page size 12 .*valid page sizes: 8, 16, 32, 64, 128"):
        _empty(page_size=12)
    with pytest.raises(ValueError, match=r"'fp8' is not supported on the paged layout.*f32, bf16"):
        _empty("fp8")


def test_memory_accounting():
    cache = _empty(get_format("int4", group=16, key_mode="token"), head_dim=32, n_kv_heads=2,
                   n_layers=3)
    # per page: L * K * page * (E/2 codes + 2 * E/g * 2 bytes scale/zero) * (k, v)
    assert cache.page_nbytes() == 3 * 2 * PAGE * (16 + 2 * 2 * 2) * 2
    k = jnp.ones((3, B, 9, 2, 32))
    cache, _ = pages.append(cache, k, k, jnp.array([9, 1, 0, 0]))
    s = pages.memory_stats(cache)
    assert s["pages_used"] == 3 and s["stored_tokens"] == 10
    assert s["waste"] == pytest.approx(1 - 10 / 24)


# --------------------------------------------------------------------------- prefix sharing


def _prefix_batch(share: bool, kind="f32"):
    """4 rows: the same 13-token system prompt, then suffixes of 3, 8, 0, 11 tokens, then one
    decode token each. Shared: row 0 prefills, rows 1-3 share its pages."""
    rng = np.random.default_rng(0)
    K, E, L = 2, 16, 2
    prompt = rng.normal(size=(L, 1, 13, K, E)).astype(np.float32)
    suffix = rng.normal(size=(L, B, 11, K, E)).astype(np.float32)
    step = rng.normal(size=(L, B, 1, K, E)).astype(np.float32)
    n_suffix = jnp.array([3, 8, 0, 11], jnp.int32)
    cache = pages.PagedKVCache.init(
        L, K, E, batch=B, num_pages=24, page_size=8, max_len=32, fmt=get_format(kind)
    )
    pk = jnp.asarray(np.broadcast_to(prompt, (L, B, 13, K, E)))
    if share:
        cache, _ = pages.append(cache, pk, -pk, jnp.array([13, 0, 0, 0]))
        cache = pages.share_prefix(cache, 0, jnp.arange(B) > 0)
    else:
        cache, _ = pages.append(cache, pk, -pk)
    cache, _ = pages.append(cache, jnp.asarray(suffix), -jnp.asarray(suffix), n_suffix)
    cache, _ = pages.append(cache, jnp.asarray(step), -jnp.asarray(step))
    return cache


@pytest.mark.parametrize("kind", ["f32", "int8"])
def test_prefix_sharing_attends_to_the_same_kv(kind):
    shared, alone = _prefix_batch(True, kind), _prefix_batch(False, kind)
    assert pages.invariant_errors(shared) == [] and pages.invariant_errors(alone) == []
    np.testing.assert_array_equal(shared.lengths, alone.lengths)
    for layer in range(2):
        ks, vs, ms = pages.gather(shared, layer)
        ka, va, ma = pages.gather(alone, layer)
        np.testing.assert_array_equal(ms, ma)
        m = np.asarray(ms)[:, None, :, None]
        np.testing.assert_array_equal(np.where(m, ks, 0), np.where(m, ka, 0))
        np.testing.assert_array_equal(np.where(m, vs, 0), np.where(m, va, 0))
    q = jnp.asarray(np.random.default_rng(1).normal(size=(B, 6, 16)), jnp.float32)
    np.testing.assert_array_equal(
        pages.attend(shared, 1, q, impl="reference"), pages.attend(alone, 1, q, impl="reference")
    )
    if kind == "int8":
        np.testing.assert_allclose(
            pages.attend(shared, 1, q, interpret=INTERPRET),
            pages.attend(alone, 1, q, interpret=INTERPRET),
            atol=1e-6,
        )
    s_used, a_used = int(np.sum(shared.refcount > 0)), int(np.sum(alone.refcount > 0))
    # the prompt's first full page is stored once instead of 4 times
    assert s_used == a_used - 3, (s_used, a_used)


# --------------------------------------------------------------------------- the model's pattern


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_decode_step_in_layer_scan(impl):
    """The model's decode loop: reserve once, then per layer (lax.scan) write the new token's
    k/v and attend; equals dense attention over the same tokens."""
    rng = np.random.default_rng(2)
    L, K, G, E, Bn = 2, 2, 3, 16, 3
    cache = pages.PagedKVCache.init(
        L, K, E, batch=Bn, num_pages=12, page_size=8, max_len=32, fmt=get_format("bf16")
    )
    hist = jnp.asarray(rng.normal(size=(L, Bn, 15, K, E)), jnp.float32)
    cache, _ = pages.append(cache, hist, -hist, jnp.array([15, 8, 1]))
    k_new = jnp.asarray(rng.normal(size=(L, Bn, K, E)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(L, Bn, K * G, E)), jnp.float32)

    @jax.jit
    def decode(cache, q, k_new):
        cache, granted = pages.reserve(cache, jnp.ones((Bn,), jnp.int32))

        def layer_fn(cache, xs):
            layer, q_l, k_l = xs
            cache = pages.write(cache, layer, k_l, -k_l, granted)
            out = pages.attend(cache, layer, q_l, granted, impl=impl, interpret=INTERPRET)
            return cache, out

        cache, outs = jax.lax.scan(layer_fn, cache, (jnp.arange(L), q, k_new))
        return pages.advance(cache, granted), outs

    cache, outs = decode(cache, q, k_new)  # [L, B, H, E]
    ln = np.array([16, 9, 2])
    np.testing.assert_array_equal(cache.lengths, ln)
    for layer in range(L):
        for b in range(Bn):
            keys = np.concatenate(
                [np.asarray(hist[layer, b, : ln[b] - 1]), np.asarray(k_new[layer, b])[None]]
            )  # [S, K, E]
            keys = np.asarray(jnp.asarray(keys).astype(jnp.bfloat16).astype(jnp.float32))
            qg = np.asarray(q[layer, b]).reshape(K, G, E)
            s = np.einsum("KGE,SKE->KGS", qg, keys) / np.sqrt(E)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            want = np.einsum("KGS,SKE->KGE", p, -keys).reshape(K * G, E)
            np.testing.assert_allclose(outs[layer, b], want, atol=2e-5, rtol=2e-5)
