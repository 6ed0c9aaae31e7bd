"""The cache pytree: exact byte accounting, shape-only sizing, NaN detection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache, closed_form_bytes
from kvjax.config import ModelConfig, tiny_config
from kvjax.formats import get_format
from kvjax.model import forward_jit as forward
from kvjax.model import init_params
from kvjax.policies import get_policy

GiB, MiB = 2**30, 2**20


def _llama7b_like(n_kv_heads):
    return ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                       n_kv_heads=n_kv_heads, head_dim=128, d_ff=11008, max_seq_len=2048)


@pytest.mark.parametrize("n_kv, expect", [(32, 1 * GiB), (8, 256 * MiB)])
def test_worked_examples_closed_form_and_abstract(n_kv, expect):
    """MHA 32x32x128 at 2048 tokens in fp16 = 1 GiB; with 8 kv heads (GQA) = 256 MiB."""
    cfg = _llama7b_like(n_kv)
    assert closed_form_bytes(cfg, 2048, 2) == expect
    cache = KVCache.abstract(cfg, 1, get_policy("full"), get_format("bf16"), 2048)
    assert isinstance(cache.k["x"] if "x" in cache.k else jax.tree.leaves(cache.k)[0],
                      jax.ShapeDtypeStruct)  # sized without allocating
    assert cache.kv_nbytes() == expect
    # positions are the only other per-slot buffer: int32 per (layer, kv head, slot)
    assert cache.nbytes() == expect + 32 * n_kv * 2048 * 4 + 4 + 32


def test_nbytes_is_the_sum_of_real_buffers():
    cfg = tiny_config()
    for fmt in (get_format("f32"), get_format("int4", group=4, value_group=4),
                get_format("int2", group=8)):
        cache = KVCache.init(cfg, 2, get_policy("window", budget=16), fmt, 64)
        real = sum(np.asarray(x).nbytes for x in jax.tree.leaves(cache))
        assert cache.nbytes() == real
        assert KVCache.abstract(cfg, 2, get_policy("window", budget=16), fmt, 64).nbytes() == real


BYTE_FORMATS = [("f32", {}), ("bf16", {}), ("fp8", {}), ("int8", {}), ("int4", {}), ("int2", {}),
                ("int4", {"key_mode": "token"}), ("int4", {"keep_layers": (0,)}),
                ("int8", {"keep_heads": (0,)})]
BYTE_POLICIES = [("full", {}), ("window", {"budget": 128}), ("h2o", {"budget": 128}),
                 ("lru", {"budget": 128}), ("streaming", {"budget": 128}),
                 ("snapkv", {"budget": 128}), ("adakv", {"budget": 128}),
                 ("pyramid", {"budget": 160})]  # groups of 256, 192, 128, 64 slots


@pytest.mark.parametrize("name, opts", BYTE_FORMATS, ids=lambda x: str(x))
def test_formula_bytes_equal_nbytes_for_every_format_and_policy(name, opts):
    """The closed form the harness prints (format formula + positions + policy stats) is the
    bytes of the real buffers, for per-head caches, a head pool (adakv) and layer groups
    (pyramid)."""
    cfg = tiny_config(head_dim=64, n_layers=4, max_seq_len=256)
    fmt = get_format(name, **opts)
    kinds = set()
    for pname, popts in BYTE_POLICIES:
        policy = get_policy(pname, **popts)
        if policy.head_pool and "keep_heads" in opts:
            with pytest.raises(ValueError, match="keep_heads"):
                KVCache.init(cfg, 2, policy, fmt, 256)
            continue
        cache = KVCache.init(cfg, 2, policy, fmt, 256)
        parts = getattr(cache, "groups", (cache,))
        kinds |= {type(p).__name__ for p in parts} | {f"groups{len(parts)}"}
        assert sum(p.formula_bytes(cfg.head_dim) for p in parts) == cache.nbytes(), pname
    pool = set() if "keep_heads" in opts else {"HeadPool"}
    assert kinds == {"KVCache", "groups1", "groups4"} | pool  # pyramid: 4 layer groups


@pytest.mark.parametrize("name", ["f32", "int4"])
def test_formula_bytes_of_a_compressed_head_pool(name):
    """adasnapkv's compress-mode selection builds a head pool (`kvjax.cache.rebuild`): still
    exact, with room for 16 more tokens per head."""
    cfg = tiny_config(head_dim=64, n_layers=2, max_seq_len=256)
    cache = KVCache.init(cfg, 1, get_policy("adasnapkv", budget=64), get_format(name), 256)
    pool = cache.replace(length=jnp.asarray([200], jnp.int32)).compress(16)
    assert type(pool).__name__ == "HeadPool"
    assert pool.formula_bytes(cfg.head_dim) == pool.nbytes()


def test_nonfinite_keys_raise_naming_the_layer():
    cfg = tiny_config(n_layers=3)
    p = init_params(cfg, jax.random.PRNGKey(0))
    p["layers"]["wk"] = p["layers"]["wk"].at[1].set(jnp.nan)
    _, cache = forward(p, jnp.ones((1, 4), jnp.int32), KVCache.init(
        cfg, 1, get_policy("full"), get_format("f32"), 16), cfg)
    with pytest.raises(FloatingPointError, match=r"layer\(s\) \[1, 2\]"):
        cache.check_finite()


def test_the_cache_does_not_import_the_policies():
    """The cache builds caches and policies only choose: kvjax.cache imports no policy code
    (policies import the cache's LayerView), so there is no import cycle between them."""
    import subprocess
    import sys

    code = ("import sys, kvjax.cache, kvjax.formats; "
            "assert not [m for m in sys.modules if m.startswith('kvjax.policies')], "
            "[m for m in sys.modules if m.startswith('kvjax.policies')]")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("policy,fmt,kw", [
    ("h2o", "int4", {"window": 4}), ("streaming", "bf16", {}), ("full", "int8", {}),
    ("lru", "f32", {"window": 4}), ("tova", "int2", {})])
def test_store_layers_in_blocks_equals_a_store_per_layer(policy, fmt, kw, monkeypatch):
    """`forward` writes a chunk's layers in blocks (`KVCache.store_layers`): every layer at once,
    in blocks of 2 (a small WRITE_BLOCK_BYTES, as a long prompt gets) and one at a time
    (`store_by_layer`) give the same logits and caches through a prompt and evicting decode
    steps. To float rounding: the three are different programs, and XLA may fuse the layer
    scan's float ops differently in each (a block write stores bit-identically what a write
    per layer stores from the same input: test_formats'
    test_a_block_of_layers_is_written_bit_identically_to_each_layer_alone)."""
    from kvjax import formats
    from kvjax.cache import store_by_layer
    from kvjax.model import forward as fwd

    cfg = tiny_config(n_layers=4)
    params = init_params(cfg, jax.random.PRNGKey(0))
    opts = {"group": 8} if fmt in ("int4", "int2") else {}
    pol = get_policy(policy, **kw) if policy == "full" else get_policy(policy, budget=16, **kw)
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)

    def run():
        step = jax.jit(lambda p, t, c: fwd(p, t, c, cfg))  # traced anew under each setting
        cache = KVCache.init(cfg, 2, pol, get_format(fmt, **opts), 64)
        outs = []
        for lo, hi in [(0, 24), *((t, t + 1) for t in range(24, 40))]:
            logits, cache = step(params, toks[:, lo:hi], cache)
            outs.append(logits)
        return outs, cache

    every = run()
    monkeypatch.setattr(formats, "WRITE_BLOCK_BYTES", 2 * 2 * 2 * (24 + 8) * 8 * 4)
    assert get_format(fmt, **opts).layers_per_write(4, 2, 2, 24, 8) == 2
    in_twos = run()
    monkeypatch.setattr(KVCache, "store_layers", store_by_layer)
    alone = run()
    for other in (in_twos, alone):
        for a, b in zip(jax.tree.leaves(every), jax.tree.leaves(other), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(every[1].pos, other[1].pos)  # the same slots kept
    assert int(every[1].pos.max()) == 39  # the cache holds the last token


PREFIX_FORMATS = [("f32", {}), ("bf16", {}), ("fp8", {}), ("int8", {}), ("int4", {"group": 8}),
                  ("int4", {"group": 8, "key_mode": "token"}), ("int2", {"group": 8, "residual": 16}),
                  ("int4", {"group": 8, "keep_layers": (1,)}),
                  ("int4", {"group": 8, "keep_units": ((0, 1),)})]


@pytest.mark.parametrize("name,opts", PREFIX_FORMATS)
def test_a_prefix_read_is_the_full_read_cut(name, opts):
    """`fmt.read(..., n)` (what attention bounded by the occupied slots reads) equals the full
    read's first n slots bit for bit, for every format, after writes in a scattered slot order
    that seal, flush and keep key groups in an int4/int2 residual."""
    fmt = get_format(name, **opts)
    L, B, K, C, E = 2, 2, 2, 32, 8
    rng = np.random.default_rng(0)
    order = np.stack([np.stack([rng.permutation(C) for _ in range(K)]) for _ in range(B)])
    for kind in ("k", "v"):
        store = fmt.init((L, B, K, C, E), kind)
        for t0 in range(0, 27, 3):  # 27 of the 32 slots, 3 at a time
            slots = jnp.asarray(order[:, :, t0:t0 + 3], jnp.int32)  # [B, K, 3]
            for layer in range(L):
                x = jnp.asarray(rng.normal(size=(B, K, 3, E)) * 3, jnp.float32)
                store = fmt.write(store, jnp.int32(layer), slots, x, kind)
        sizes = [n for n in (8, 16, 24) if fmt.fit(n) == n]
        assert sizes
        for layer in range(L):
            full = np.asarray(fmt.read(store, jnp.int32(layer), kind))  # [B, K, C, E]
            for n in sizes:
                part = fmt.read(store, jnp.int32(layer), kind, n)
                np.testing.assert_array_equal(np.asarray(part), full[:, :, :n])


def test_prefixes_a_read_may_be_bounded_to():
    """About C/8, C/4 and C/2, rounded up to what the format reads (whole key groups, at least
    the residual), of at least MIN_PREFIX slots, then C."""
    from kvjax import cache as cache_mod

    cfg = tiny_config(head_dim=64)

    def sizes(fmt, C, policy="full"):
        pol = get_policy(policy) if policy == "full" else get_policy(policy, budget=C)
        return KVCache.abstract(cfg, 1, pol, fmt, C).prefixes()

    assert cache_mod.MIN_PREFIX == 128
    assert sizes(get_format("f32"), 512) == (128, 256, 512)
    assert sizes(get_format("f32"), 1032) == (129, 258, 516, 1032)
    assert sizes(get_format("f32"), 1000) == (250, 500, 1000)  # f32 reads any prefix; 125 < 128
    assert sizes(get_format("f32"), 136) == (136,)  # a tight cache: no bound, no switch
    assert sizes(get_format("int4"), 512, "h2o") == (128, 256, 512)
    assert sizes(get_format("int4", residual=256), 1024) == (256, 512, 1024)  # >= residual
    assert sizes(get_format("int4"), 576) == (128, 192, 320, 576)  # whole key groups of 64


def _conds(jaxpr, n_branches: int) -> int:
    """Conditionals with n_branches branches anywhere in a (closed) jaxpr."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond" and len(eqn.params["branches"]) == n_branches:
            count += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    count += _conds(getattr(inner, "jaxpr", inner), n_branches)
    return count


@pytest.mark.parametrize("policy,fmt,kw", [
    ("h2o", "int4", {"budget": 64, "window": 4}), ("streaming", "f32", {"budget": 64}),
    ("full", "int8", {}), ("tova", "bf16", {"budget": 64}), ("adakv", "fp8", {"budget": 32}),
    ("pyramid", "f32", {"budget": 64, "taper": 2.0}), ("snapkv", "int4", {"budget": 40})])
def test_attention_bounded_by_the_occupied_slots_equals_attention_over_all(policy, fmt, kw,
                                                                           monkeypatch):
    """`KVCache.attend` reads and scores a layer only up to the smallest of `prefixes()` that
    covers its occupied slots. Through a prompt, decode steps that fill the cache and evicting
    ones, the logits and caches equal those of attention over every slot (`bounded_reads`
    off) to float rounding; the bounded program picks its prefix with a switch over the
    prefixes (a small MIN_PREFIX so this tiny cache has them). A head pool (adakv) bounds its
    whole pool, layer groups (pyramid) each group's cache."""
    from kvjax import cache as cache_mod
    from kvjax.generate import prefill
    from kvjax.model import forward as fwd

    monkeypatch.setattr(cache_mod, "MIN_PREFIX", 8)
    cfg = tiny_config(n_layers=4)
    params = init_params(cfg, jax.random.PRNGKey(0))
    opts = {"group": 8} if fmt == "int4" else {}
    pol = get_policy(policy, **kw)
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 90), 0, cfg.vocab_size)

    def run():
        step = jax.jit(lambda p, t, c: fwd(p, t, c, cfg))  # traced anew under each setting
        cache = KVCache.init(cfg, 2, pol, get_format(fmt, **opts), 128)
        logits, cache = prefill(params, [toks[0, :12].tolist(), toks[1, :7].tolist()], cache,
                                cfg)
        outs = [logits]
        cache = cache.compress(extra=64)  # compress mode: then it grows; else the same cache
        for t0, t1 in [(12, 17), *((t, t + 1) for t in range(17, 90))]:  # a chunk, then steps
            logits, cache = step(params, toks[:, t0:t1], cache)
            outs.append(logits)
        prog = jax.make_jaxpr(lambda p, t, c: fwd(p, t, c, cfg))(params, toks[:, :1], cache)
        return outs, cache, prog

    bounded, cache, prog = run()
    n_sizes = max(len(seg.prefixes()) for _, _, seg in cache.segments())
    assert n_sizes >= 2 and _conds(prog.jaxpr, n_sizes) >= 1
    monkeypatch.setattr(KVCache, "bounded_reads", False)
    over_all, cache_all, prog = run()
    assert _conds(prog.jaxpr, n_sizes) == 0
    for a, b in zip(jax.tree.leaves((bounded, cache)), jax.tree.leaves((over_all, cache_all)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.length), np.asarray(cache_all.length))
