"""The paged layout inside the model: paged == dense (full policy, MHA/MQA/GQA, reference and
Pallas), page-granular window/streaming against a NumPy decoder of the documented rule,
quantized pages, the kernel's log-sum-exp merge and mass, bytes, errors, the compiled HLO, and
the real model (paged + Pallas interpret vs the dense reference).

The kernel runs with interpret=True on CPU (the layout's default off a GPU).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import np_layer_out, np_logits, np_norm, np_rope

from kvjax import pages
from kvjax.cache import KVCache, get_layout, init_cache
from kvjax.config import tiny_config
from kvjax.formats import F32 as F32Format
from kvjax.formats import FORMATS, FP8, FloatPages, Int8Pages, get_format
from kvjax.generate import decode_step, generate, prefill
from kvjax.model import forward_jit as forward
from kvjax.model import init_params
from kvjax.paged import PagedCache
from kvjax.policies import POLICIES, get_policy
from kvjax.policies.base import PageRule, Policy
from kvjax.policies.window import Window

F32 = get_format("f32")
FULL = get_policy("full")
HEADS = {"mha": (4, 4), "mqa": (4, 1), "gqa": (6, 2)}
PAGE = 8


def _model(kind="gqa", **kw):
    """A tiny model whose head dim (16) the compiled kernel takes: on a GPU these tests run it."""
    H, K = HEADS[kind]
    cfg = tiny_config(n_heads=H, n_kv_heads=K, **{"head_dim": 16, **kw})
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _ids(cfg, B, T, seed=1):
    return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (B, T), 0, cfg.vocab_size))


def _run(p, cfg, cache, prompts, chunk, steps, ids):
    """Prefill ragged prompts in chunks, then decode `steps` tokens of ids (teacher forced).
    Returns the logits [B, V] after the prompt and after each step, and the cache."""
    last, cache = prefill(p, prompts, cache, cfg, chunk)
    out = [np.asarray(last)]
    for s in range(steps):
        lg, cache = decode_step(p, jnp.asarray(ids[:, s]), cache, cfg)
        out.append(np.asarray(lg))
    return np.stack(out), cache


# --------------------------------------------------------------------------- full: paged == dense


@pytest.mark.parametrize(
    "kind, impl", [("mha", "pallas"), ("mqa", "pallas"), ("gqa", "pallas"), ("gqa", "reference")]
)
def test_paged_full_equals_dense(kind, impl):
    """Ragged prompts prefilled in chunks of 5 (T > 1: gathered pages), then 4 decode steps
    (T = 1: the kernel for impl=pallas); f32 logits agree to 1e-5."""
    cfg, p = _model(kind)
    ids = _ids(cfg, 2, 24)
    prompts = [ids[0, :13].tolist(), ids[1, :6].tolist()]
    cont = ids[:, 13:17]
    dense, _ = _run(p, cfg, KVCache.init(cfg, 2, FULL, F32, 32), prompts, 5, 4, cont)
    layout = get_layout("paged", page_size=PAGE, impl=impl)
    got, cache = _run(p, cfg, layout.init(cfg, 2, FULL, F32, 32), prompts, 5, 4, cont)
    np.testing.assert_allclose(got, dense, atol=1e-5, rtol=0)
    cache.check_finite()
    assert cache.length.tolist() == [17, 10]
    assert pages.invariant_errors(cache.pages) == []


# --------------------------------------------------------------------------- the page-granular rule


def numpy_rule_decoder(p, cfg, ids, chunks, window, sinks, page, rope_cache):
    """A NumPy decoder of the documented paged rule: logits [T, V].

    A query at position q of the chunk [s, e) attends every earlier token of its chunk and the
    tokens t < s whose page j = t // page is kept at length s: (j + 1) * page > s - window or
    j * page < sinks. With rope_cache (streaming rope="cache"), positions are positions within
    the cache: a token of a sink page keeps t, every other token (queries included) moves
    down by shift = s - (tokens held)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    E = cfg.head_dim

    def rot(h, pos):  # h [N, E], pos [N]
        return np_rope(h, pos, cfg.rope_theta)

    T = len(ids)
    n_sink_tok = -(-sinks // page) * page
    plan = []  # per query: (attended key positions, query rope position, key rope positions)
    for s, e in chunks:
        kept = [t for t in range(s) if (t // page + 1) * page > s - window or
                (t // page) * page < sinks]
        shift = (s - len(kept)) if rope_cache else 0
        for q in range(s, e):
            keys = np.array(kept + list(range(s, q + 1)))
            kpos = np.where(keys < n_sink_tok, keys, keys - shift)
            plan.append((keys, q - shift, kpos))
    x = p["embed"][ids]
    G = cfg.n_heads // cfg.n_kv_heads
    for layer in range(cfg.n_layers):
        lp = {k: v[layer] for k, v in p["layers"].items()}
        h = np_norm(x, lp["attn_norm"], cfg.norm_eps)
        out = np.zeros((T, cfg.n_heads, E))
        for head in range(cfg.n_heads):
            kv = head // G
            qr, kr, vr = h @ lp["wq"][:, head], h @ lp["wk"][:, kv], h @ lp["wv"][:, kv]
            for q, (keys, qpos, kpos) in enumerate(plan):
                sc = rot(kr[keys], kpos) @ rot(qr[q][None], [qpos])[0] / np.sqrt(E)
                w = np.exp(sc - sc.max())
                out[q, head] = (w / w.sum()) @ vr[keys]
        x = np_layer_out(x, out, lp, cfg)
    return np_logits(x, p, cfg)


@dataclasses.dataclass(frozen=True)
class ToySinkWindow(Window):
    """A policy no file of policies/ defines (and no registry holds): a window of `budget`
    tokens plus `n_sink` sinks, rotated at positions within the cache. It only declares its
    page rule; the paged layout serves it without knowing it."""

    name = "toy_sink_window"
    n_sink: int = 5

    def page_rule(self) -> PageRule:
        return PageRule(window=self.budget, sinks=self.n_sink, rope_in_cache=True)


@dataclasses.dataclass(frozen=True)
class ToyNoPages(Policy):
    """A policy that declares no page rule (the protocol's default)."""

    name = "toy_no_pages"


@dataclasses.dataclass(frozen=True)
class ToyInt8Keys(F32Format):
    """A format no file of kvjax defines: pages hold int8 keys and f32 values (two codecs)."""

    name = "toy_int8_keys"

    def page_codec(self, kind):
        return Int8Pages() if kind == "k" else FloatPages()


@dataclasses.dataclass(frozen=True)
class ToyNoCodec(FP8):
    """A format that declares no page codec (the protocol's default)."""

    name = "toy_no_codec"


RULE_CASES = [  # (policy, window, sinks, rope_cache)
    (get_policy("window", budget=12), 12, 0, False),
    (get_policy("streaming", budget=13, n_sink=3, rope="cache"), 10, 3, True),
    (get_policy("streaming", budget=13, n_sink=3, rope="original"), 10, 3, False),
    (ToySinkWindow(budget=9), 9, 5, True),
]


@pytest.mark.parametrize("policy, window, sinks, rope_cache", RULE_CASES,
                         ids=["window", "streaming-rope-cache", "streaming-rope-original",
                              "toy-policy"])
def test_page_granular_eviction_matches_numpy_rule(policy, window, sinks, rope_cache):
    """Prompt of 30 tokens in chunks of 12 (the third chunk overflows the window: its oldest
    tokens are never stored), then 10 decode steps through the kernel; every logit agrees
    with the NumPy decoder of the rule to 1e-5, and the pool holds only the rule's pages."""
    cfg, p = _model("gqa")
    ids = _ids(cfg, 1, 40, seed=3)[0]
    layout = get_layout("paged", page_size=PAGE, impl="pallas")
    cache = layout.init(cfg, 1, policy, F32, 48)
    chunks = [(0, 12), (12, 24), (24, 30)] + [(t, t + 1) for t in range(30, 40)]
    got = []
    for s, e in chunks:
        lg, cache = forward(p, jnp.asarray(ids[None, s:e]), cache, cfg)
        got.append(np.asarray(lg[0]))
        held = {t for t in range(e) if (t // PAGE + 1) * PAGE > e - window or
                (t // PAGE) * PAGE < sinks}
        pages_held = {t // PAGE for t in held}
        assert int(np.sum(np.asarray(cache.pages.refcount) > 0)) == len(pages_held)
    cache.check_finite()
    want = numpy_rule_decoder(p, cfg, ids, chunks, window, sinks, PAGE, rope_cache)
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-5, rtol=0)
    assert cache.pages.num_pages == layout.pages_per_row(policy, 48)


@pytest.mark.parametrize("policy", [FULL, get_policy("window", budget=12)], ids=["full", "window"])
def test_shared_prompt_pages_copy_on_write_in_the_model(policy):
    """Row 1 shares row 0's 13-token prompt (its partial last page too) instead of prefilling
    it; both rows then decode different tokens (copy-on-write happens in the write scan) and
    give the logits of two rows that each prefilled the prompt, with fewer pages."""
    cfg, p = _model("gqa")
    ids = _ids(cfg, 2, 19, seed=9)
    prompt = jnp.asarray(np.stack([ids[0, :13], ids[0, :13]]))
    layout = get_layout("paged", page_size=PAGE, impl="pallas")

    _, alone = forward(p, prompt, layout.init(cfg, 2, policy, F32, 32), cfg)
    _, shared = forward(p, prompt, layout.init(cfg, 2, policy, F32, 32), cfg,
                        jnp.asarray([13, 0], jnp.int32))
    shared = shared.share_prefix(0, jnp.asarray([False, True]))
    used = [int(np.sum(np.asarray(c.pages.refcount) > 0)) for c in (alone, shared)]
    assert used == [4, 2], used
    for t in range(13, 19):
        a, alone = forward(p, jnp.asarray(ids[:, t:t + 1]), alone, cfg)
        b, shared = forward(p, jnp.asarray(ids[:, t:t + 1]), shared, cfg)
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    shared.check_finite()
    assert pages.invariant_errors(shared.pages) == []


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", [get_format("bf16"), get_format("int8"),
                                 get_format("int4", group=4, value_group=8, key_mode="token")],
                         ids=["bf16", "int8", "int4-token"])
def test_quantized_pages_match_the_dense_format(fmt):
    """Pages store kvjax.formats' per-token layouts: paged (kernel) == dense of the same format
    to 1e-4; int8 stays within 0.05 of the f32 logits (random tiny model, logits of O(1))."""
    cfg, p = _model("gqa")
    ids = _ids(cfg, 2, 20, seed=5)
    prompts = [ids[0, :11].tolist(), ids[1, :7].tolist()]
    cont = ids[:, 11:14]
    dense, _ = _run(p, cfg, KVCache.init(cfg, 2, FULL, fmt, 32), prompts, 11, 3, cont)
    layout = get_layout("paged", page_size=PAGE, impl="pallas")
    got, cache = _run(p, cfg, layout.init(cfg, 2, FULL, fmt, 32), prompts, 11, 3, cont)
    np.testing.assert_allclose(got, dense, atol=1e-4, rtol=0)
    if fmt.name == "int8":
        f32, _ = _run(p, cfg, layout.init(cfg, 2, FULL, F32, 32), prompts, 11, 3, cont)
        assert np.abs(got - f32).max() < 0.05, np.abs(got - f32).max()
    assert cache.kv_nbytes() == sum(x.nbytes for x in jax.tree.leaves((cache.pages.k,
                                                                         cache.pages.v)))


# --------------------------------------------------------------------------- kernel merge + mass


def test_kernel_path_equals_gathered_path_with_mass():
    """One layer's decode attention: the kernel merged with the token itself (and the
    re-rotated sink pages) through its log-sum-exp equals the gathered reference, outputs and
    attention mass (probs) alike."""
    cfg, p = _model("gqa")
    pol = get_policy("streaming", budget=13, n_sink=3)
    lay = get_layout("paged", page_size=PAGE, impl="pallas", probs=True)
    cache = lay.init(cfg, 2, pol, F32, 48)
    ids = _ids(cfg, 2, 29, seed=6)
    for s, e in [(0, 12), (12, 24), (24, 29)]:
        _, cache = forward(p, jnp.asarray(ids[:, s:e]), cache, cfg)
    assert int(cache._shift()[0]) > 0  # pages were evicted: the sinks are re-rotated
    rng = np.random.default_rng(0)
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = jnp.asarray(rng.normal(size=(2, 1, H, E)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 1, K, E)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 1, K, E)), jnp.float32)
    pos = cache.length[:, None]
    ref = cache.replace(layout=get_layout("paged", page_size=PAGE, impl="reference"))
    for layer in range(cfg.n_layers):
        view = cache.layer_view(jnp.int32(layer))
        o1, p1 = jax.jit(cache.attend, static_argnums=5)(view, q, k, v, pos, cfg.rope_theta)
        o2, p2 = ref.attend(view, q, k, v, pos, cfg.rope_theta)
        np.testing.assert_allclose(o1, o2, atol=1e-5)
        np.testing.assert_allclose(p1, p2, atol=1e-6)
        np.testing.assert_allclose(p1.sum(-1), 3.0, atol=1e-5)  # G = 3 heads per kv head


# --------------------------------------------------------------------------- bytes, errors, HLO


def test_nbytes_abstract_and_pool_size():
    cfg, _ = _model("gqa")
    pol = get_policy("streaming", budget=20, n_sink=4)
    for fmt in (F32, get_format("int8"), get_format("int4", group=4, value_group=8, key_mode="token")):
        lay = get_layout("paged", page_size=PAGE)
        cache = lay.init(cfg, 3, pol, fmt, 64)
        real = sum(np.asarray(x).nbytes for x in jax.tree.leaves(cache))
        assert cache.nbytes() == real == lay.abstract(cfg, 3, pol, fmt, 64).nbytes()
        # the sink page + the pages 16 consecutive tokens can span, whatever the chunk size
        assert lay.pages_per_row(pol, 64) == 1 + 3
        assert cache.pages.num_pages == 3 * lay.pages_per_row(pol, 64)
    full = get_layout("paged", page_size=PAGE).init(cfg, 2, FULL, F32, 60)
    L, K, E = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    assert full.kv_nbytes() == 2 * L * K * (2 * 8) * PAGE * E * 4  # 2 rows x cdiv(60, 8) pages
    assert init_cache(cfg, 2, FULL, F32, 60, "paged").nbytes() == get_layout(
        "paged").init(cfg, 2, FULL, F32, 60).nbytes()
    assert isinstance(init_cache(cfg, 2, FULL, F32, 60), KVCache)


def test_unsupported_choices_are_clear_errors():
    cfg, _ = _model("gqa")
    lay = get_layout("paged", page_size=PAGE)
    with pytest.raises(ValueError, match=r"policy 'h2o' is not supported.*full, streaming, window"):
        lay.init(cfg, 1, get_policy("h2o", budget=16), F32, 32)
    with pytest.raises(ValueError, match=r"'int2' is not supported.*f32, bf16, int8, int4"):
        lay.init(cfg, 1, FULL, get_format("int2"), 32)
    with pytest.raises(ValueError, match="key_mode='token'"):
        lay.init(cfg, 1, FULL, get_format("int4", group=4, key_mode="channel"), 32)
    with pytest.raises(ValueError, match="valid page sizes: 8, 16, 32"):
        get_layout("paged", page_size=12)
    with pytest.raises(ValueError, match=r"impl 'pallas' needs layout='paged'"):
        get_layout("dense", impl="pallas")
    with pytest.raises(ValueError, match=r"'triton' is not one of \('reference', 'pallas'\)"):
        get_layout("paged", impl="triton")
    with pytest.raises(ValueError, match="valid layouts: dense, paged"):
        get_layout("blocked")
    with pytest.raises(ValueError, match=r"no option\(s\) \['page'\]"):
        get_layout("paged", page=16)


def test_paged_support_is_asked_of_the_registered_classes(monkeypatch):
    """The errors name the policy or format and list what the registered classes declare
    through the protocol (page rule, page codec), not a table of names: a class registered
    with one joins the list, a class without one is refused."""
    cfg, _ = _model("gqa")
    lay = get_layout("paged", page_size=PAGE)
    for name, cls in (("toy_sink_window", ToySinkWindow), ("toy_no_pages", ToyNoPages)):
        monkeypatch.setitem(POLICIES, name, cls)
    for name, cls in (("toy_int8_keys", ToyInt8Keys), ("toy_no_codec", ToyNoCodec)):
        monkeypatch.setitem(FORMATS, name, cls)
    with pytest.raises(ValueError, match=r"policy 'toy_no_pages' is not supported on the paged "
                       r"layout .*supported on paged: full, streaming, toy_sink_window, window;"):
        lay.init(cfg, 1, ToyNoPages(), F32, 32)
    with pytest.raises(ValueError, match=r"kv format 'toy_no_codec' is not supported on the "
                       r"paged layout .*supported: f32, bf16, int8, int4, toy_int8_keys;"):
        lay.init(cfg, 1, FULL, ToyNoCodec(), 32)


def test_a_new_format_runs_on_pages_through_its_codec():
    """ToyInt8Keys (int8 key pages, f32 value pages): the kernel path equals the gathered
    reference on the same pages, and the logits stay within 0.05 of f32 pages."""
    cfg, p = _model("gqa")
    ids = _ids(cfg, 2, 20, seed=5)
    prompts = [ids[0, :11].tolist(), ids[1, :7].tolist()]
    cont = ids[:, 11:14]
    fmt = ToyInt8Keys()
    runs = {}
    for impl in ("pallas", "reference"):
        layout = get_layout("paged", page_size=PAGE, impl=impl)
        runs[impl], cache = _run(p, cfg, layout.init(cfg, 2, FULL, fmt, 32), prompts, 11, 3, cont)
    assert cache.pages.k.q.dtype == jnp.int8 and cache.pages.v.dtype == jnp.float32
    np.testing.assert_allclose(runs["pallas"], runs["reference"], atol=1e-5, rtol=0)
    layout = get_layout("paged", page_size=PAGE, impl="pallas")
    f32, _ = _run(p, cfg, layout.init(cfg, 2, FULL, F32, 32), prompts, 11, 3, cont)
    err = np.abs(runs["pallas"] - f32).max()
    assert 0 < err < 0.05, err


def test_pool_too_small_is_reported_not_silently_wrong():
    """A pool smaller than the rows need preempts under jit; check_finite raises on the host."""
    cfg, p = _model("gqa")
    cache = get_layout("paged", page_size=PAGE, num_pages=3).init(cfg, 2, FULL, F32, 32)
    _, cache = forward(p, jnp.asarray(_ids(cfg, 2, 16)), cache, cfg)
    with pytest.raises(pages.PagedCacheError, match=r"rows \[1\] were preempted"):
        cache.check_finite()


def _pool_copies(hlo: str, pool_shape: str) -> list[str]:
    """HLO `copy` instructions producing a whole pool."""
    return [ln.strip() for ln in hlo.splitlines()
            if re.search(rf"= {re.escape(pool_shape)}(\{{[^}}]*\}})? copy\(", ln)]


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_decode_step_compiles_once_and_never_copies_the_pool(impl):
    """The compiled decode step (window policy: reserve, read scan, write scan, eviction) has no
    copy of a whole page pool, and 12 steps compile once."""
    cfg, p = _model("gqa", n_layers=3)
    pol = get_policy("window", budget=12)
    cache = get_layout("paged", page_size=PAGE, impl=impl).init(cfg, 2, pol, F32, 64)
    pool = cache.pages.k
    shape = f"f32[{','.join(map(str, pool.shape))}]"
    tok = jnp.zeros((2,), jnp.int32)
    hlo = decode_step.lower(p, tok, cache, cfg).compile().as_text()
    assert shape in hlo
    assert _pool_copies(hlo, shape) == []
    before = decode_step._cache_size()
    for _ in range(12):
        logits, cache = decode_step(p, tok, cache, cfg)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    assert decode_step._cache_size() == before + 1
    cache.check_finite()


def test_generate_runs_on_the_paged_layout():
    """`generate(..., layout=...)`: greedy tokens on pages (kernel decode) equal the dense ones."""
    cfg, p = _model("gqa")
    prompts = [_ids(cfg, 1, 9, seed=7)[0].tolist(), _ids(cfg, 1, 4, seed=8)[0].tolist()]
    want, _ = generate(p, cfg, prompts, 5, FULL, F32, max_len=32)
    layout = get_layout("paged", page_size=PAGE, impl="pallas")
    got, cache = generate(p, cfg, prompts, 5, FULL, F32, max_len=32, layout=layout)
    np.testing.assert_array_equal(got, want)
    assert isinstance(cache, PagedCache) and cache.length.tolist() == [14, 9]


# --------------------------------------------------------------------------- the real model


def test_smollm2_paged_pallas_equals_dense_reference(smollm_dev, ref):
    """SmolLM2-135M: a 40-token prompt and 4 greedy decode steps give the same tokens with
    paged pages (page 16) + the Pallas kernel (interpret) as with the dense reference, and
    logits within 1e-4 (f32)."""
    cfg, params = smollm_dev
    prompt = [ref["text_ids"][:40].tolist()]

    def run(cache):
        logits, cache = prefill(params, prompt, cache, cfg)
        toks, lgs = [], [np.asarray(logits)]
        for _ in range(4):
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            toks.append(int(tok[0]))
            logits, cache = decode_step(params, tok, cache, cfg)
            lgs.append(np.asarray(logits))
        cache.check_finite()
        return toks, np.stack(lgs)

    toks_d, lg_d = run(KVCache.init(cfg, 1, FULL, F32, 48))
    layout = get_layout("paged", page_size=16, impl="pallas")
    toks_p, lg_p = run(layout.init(cfg, 1, FULL, F32, 48))
    assert toks_p == toks_d
    np.testing.assert_allclose(lg_p, lg_d, atol=1e-4, rtol=0)
