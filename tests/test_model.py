"""The decoder on tiny random models: an independent NumPy decoder, cached decode == full
recompute (MHA, MQA, GQA), chunked == one-shot, ragged batches, one compile, sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache
from kvjax.config import tiny_config
from kvjax.formats import get_format
from kvjax.generate import check_fits, decode_step, generate, prefill, sample
from kvjax.model import forward_jit as forward
from kvjax.model import init_params
from kvjax.policies import get_policy

F32 = get_format("f32")
FULL = get_policy("full")
HEADS = {"mha": (4, 4), "mqa": (4, 1), "gqa": (6, 2)}


def np_norm(h, w, eps):
    """RMSNorm in NumPy."""
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * w


def np_rope(h, pos, theta):
    """Rotary embedding in NumPy, HF rotate_half pairs: h [N, E] at positions pos [N]."""
    E = h.shape[-1]
    ang = np.asarray(pos, np.float64)[:, None] / theta ** (np.arange(0, E, 2) / E)  # [N, E/2]
    a, b = h[:, : E // 2], h[:, E // 2:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)


def np_layer_out(x, out, lp, cfg):
    """A layer's attention heads out [T, H, E] through the output projection, then the SwiGLU
    block, both residual: the next residual stream [T, D]."""
    x = x + np.einsum("THE,HED->TD", out, lp["wo"])
    h = np_norm(x, lp["mlp_norm"], cfg.norm_eps)
    g = h @ lp["w_gate"]
    return x + (g / (1 + np.exp(-g)) * (h @ lp["w_up"])) @ lp["w_down"]


def np_logits(x, p, cfg):
    x = np_norm(x, p["final_norm"], cfg.norm_eps)
    return x @ (p["embed"].T if cfg.tie_embeddings else p["lm_head"])


def numpy_decoder(p, cfg, ids):
    """A plain NumPy Llama forward over one sequence, written from the architecture's definition
    (no cache, explicit per-head loops): logits [T, V]."""
    p = jax.tree.map(np.asarray, p)
    T, E = len(ids), cfg.head_dim
    x = p["embed"][ids].astype(np.float64)
    pos = np.arange(T)
    for layer in range(cfg.n_layers):
        lp = {k: v[layer] for k, v in p["layers"].items()}
        h = np_norm(x, lp["attn_norm"], cfg.norm_eps)
        out = np.zeros((T, cfg.n_heads, E))
        for head in range(cfg.n_heads):
            kv = head // (cfg.n_heads // cfg.n_kv_heads)
            q = np_rope(h @ lp["wq"][:, head], pos, cfg.rope_theta)
            k = np_rope(h @ lp["wk"][:, kv], pos, cfg.rope_theta)
            v = h @ lp["wv"][:, kv]
            s = q @ k.T / np.sqrt(E) + np.triu(np.full((T, T), -np.inf), 1)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (w / w.sum(-1, keepdims=True)) @ v
        x = np_layer_out(x, out, lp, cfg)
    return np_logits(x, p, cfg)


def _model(kind, **kw):
    H, K = HEADS[kind]
    cfg = tiny_config(n_heads=H, n_kv_heads=K, **kw)
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _ids(cfg, B, T, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (B, T), 0, cfg.vocab_size, jnp.int32)


@pytest.mark.parametrize("kind", sorted(HEADS))
@pytest.mark.parametrize("tied", [False, True])
def test_forward_matches_numpy_decoder(kind, tied):
    cfg, p = _model(kind, tie_embeddings=tied)
    ids = _ids(cfg, 1, 12)
    logits, _ = forward(p, ids, KVCache.init(cfg, 1, FULL, F32, 32), cfg)
    np.testing.assert_allclose(logits[0], numpy_decoder(p, cfg, np.asarray(ids[0])), atol=1e-5)


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_cached_decode_equals_full_recompute(kind):
    cfg, p = _model(kind)
    ids = _ids(cfg, 2, 16)
    logits, cache = prefill(p, [ids[0, :4].tolist(), ids[1, :4].tolist()],
                            KVCache.init(cfg, 2, FULL, F32, 32), cfg)
    for t in range(4, 16):  # recompute from scratch: the prefix ids[:, :t], padded to one shape
        recompute, _ = forward(p, ids, KVCache.init(cfg, 2, FULL, F32, 32), cfg,
                               jnp.full((2,), t, jnp.int32))
        np.testing.assert_allclose(logits, recompute[:, t - 1], atol=1e-5, rtol=0)
        logits, cache = decode_step(p, ids[:, t], cache, cfg)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_forward_equals_one_shot(chunk):
    cfg, p = _model("gqa")
    ids = _ids(cfg, 2, 20)
    full, _ = forward(p, ids, KVCache.init(cfg, 2, FULL, F32, 32), cfg)
    cache, outs = KVCache.init(cfg, 2, FULL, F32, 32), []
    for s in range(0, 20, chunk):
        lg, cache = forward(p, ids[:, s:s + chunk], cache, cfg)
        outs.append(lg)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5)
    assert cache.length.tolist() == [20, 20]


def test_ragged_batch_rows_equal_each_prompt_alone():
    cfg, p = _model("gqa")
    ids = np.asarray(_ids(cfg, 1, 12)[0])
    prompts = [ids[:3].tolist(), ids[:11].tolist(), ids[2:8].tolist()]
    batch, _ = generate(p, cfg, prompts, 6, FULL, F32, max_len=32, chunk=4)
    last, _ = prefill(p, prompts, KVCache.init(cfg, 3, FULL, F32, 32), cfg, chunk=4)
    for i, pr in enumerate(prompts):
        alone, _ = generate(p, cfg, [pr], 6, FULL, F32, max_len=32, chunk=4)
        np.testing.assert_array_equal(batch[i], alone[0])
        ref, _ = forward(p, jnp.asarray([pr]), KVCache.init(cfg, 1, FULL, F32, 32), cfg)
        np.testing.assert_allclose(last[i], ref[0, -1], atol=1e-5)


def test_decode_step_compiles_once_over_20_steps():
    cfg, p = _model("gqa", n_layers=3)  # a shape no other test uses: a fresh compile cache entry
    cache = KVCache.init(cfg, 1, FULL, F32, 40)
    before = decode_step._cache_size()
    tok = jnp.zeros((1,), jnp.int32)
    for _ in range(20):
        logits, cache = decode_step(p, tok, cache, cfg)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    assert decode_step._cache_size() == before + 1
    assert int(cache.length[0]) == 20


def test_sampling_greedy_topp_and_seed():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000))
    assert sample(logits, jax.random.PRNGKey(0)).tolist() == [0] * 2000
    a = sample(logits, jax.random.PRNGKey(1), temperature=1.0, top_p=0.7)
    b = sample(logits, jax.random.PRNGKey(1), temperature=1.0, top_p=0.7)
    assert (a == b).all()
    assert set(np.asarray(a).tolist()) == {0, 1}  # 0.5 + 0.3 covers p = 0.7; 2 and 3 are cut
    freq = np.bincount(np.asarray(sample(logits, jax.random.PRNGKey(2), temperature=1.0)), minlength=4)
    np.testing.assert_allclose(freq / 2000, [0.5, 0.3, 0.15, 0.05], atol=0.04)


def test_prompt_longer_than_cache_is_a_clear_error():
    with pytest.raises(ValueError, match=r"30 tokens \+ 5 new tokens exceeds the maximum length 32"):
        check_fits([30, 3], 5, 32)
    cfg, p = _model("mqa")
    with pytest.raises(ValueError, match="exceeds the maximum length"):
        generate(p, cfg, [[1] * 40], 1, FULL, F32, max_len=32)


def test_rope_by_table_equals_rope():
    """The folded cos/sin table (streaming rope=cache keys) rotates exactly like cos/sin."""
    from kvjax.attention import rope, rope_table

    x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 40, 64))
    pos = jax.random.randint(jax.random.PRNGKey(2), (2, 3, 40), 0, 40)
    np.testing.assert_allclose(rope(x, pos, 1e4, rope_table(40, 64, 1e4)), rope(x, pos, 1e4),
                               atol=1e-6, rtol=0)
    edge = jnp.asarray([-1, 0, 39, 40])  # padding, both ends, one past the table
    out = np.asarray(rope(x[0, 0, :4], edge, 1e4, rope_table(40, 64, 1e4)))
    np.testing.assert_allclose(out[:3], rope(x[0, 0, :3], edge[:3], 1e4)[:3].at[0].set(
        x[0, 0, 0]), atol=1e-6, rtol=0)  # -1 reads position 0 (the identity rotation)
    assert np.isnan(out[3]).all()  # past the table: NaN, never a wrong rotation


def np_attention(q, k_new, v_new, pos_new, k_cache, v_cache, pos_cache):
    """`kvjax.attention.attention` in NumPy with explicit loops: out [B, T, H, E] and probs
    [B, K, T, C + T] summed over each kv group's query heads (zero for padding queries)."""
    q, k_new, v_new, k_cache, v_cache = (np.asarray(a, np.float64)
                                         for a in (q, k_new, v_new, k_cache, v_cache))
    pos_new, pos_cache = np.asarray(pos_new), np.asarray(pos_cache)
    B, T, H, E = q.shape
    K, C = k_cache.shape[1], k_cache.shape[2]
    out, probs = np.zeros_like(q), np.zeros((B, K, T, C + T))
    for b in range(B):
        for h in range(H):
            kv = h // (H // K)
            keys = np.concatenate([k_cache[b, kv], k_new[b, :, kv]])  # [C + T, E]
            vals = np.concatenate([v_cache[b, kv], v_new[b, :, kv]])
            for t in range(T):
                if pos_new[b, t] < 0:
                    continue
                ok = np.concatenate([pos_cache[b, kv] >= 0,
                                     (pos_new[b] >= 0) & (pos_new[b] <= pos_new[b, t])])
                s = np.where(ok, keys @ q[b, t, h] / np.sqrt(E), -np.inf)
                w = np.exp(s - s.max())
                w /= w.sum()
                out[b, t, h] = w @ vals
                probs[b, kv, t] += w
    return out, probs


@pytest.mark.parametrize("empty", [False, True])
def test_attention_blocks_and_empty_cache_equal_numpy(monkeypatch, empty):
    """The chunk's self attention split into query blocks (3 blocks of 4, the last partial),
    ragged padding, a cache with empty slots, GQA: out and probs equal a NumPy loop. With every
    slot empty, `cache_empty=True` (the first prompt chunk) gives the same out and probs."""
    import kvjax.attention as attn

    monkeypatch.setattr(attn, "SELF_BLOCK", 4)
    B, T, H, K, C, E = 2, 10, 6, 2, 5, 8
    r = np.random.default_rng(0)
    q, kn, vn = (r.normal(size=s).astype(np.float32) for s in ((B, T, H, E), (B, T, K, E),
                                                                (B, T, K, E)))
    kc, vc = r.normal(size=(2, B, K, C, E)).astype(np.float32)
    pos_cache = np.where(r.random((B, K, C)) < 0.6, r.integers(0, 7, (B, K, C)), -1)
    if empty:
        pos_cache[:] = -1
    start = np.asarray([7, 0])[:, None]
    pos_new = np.where(np.arange(T)[None] < np.asarray([10, 6])[:, None], start + np.arange(T), -1)
    want_out, want_p = np_attention(q, kn, vn, pos_new, kc, vc, pos_cache)
    for skip in [False, True] if empty else [False]:
        out, p = jax.jit(attn.attention, static_argnums=7)(q, kn, vn, jnp.asarray(pos_new), kc, vc,
                                                            jnp.asarray(pos_cache), skip)
        np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
        np.testing.assert_allclose(p, want_p, atol=1e-6, rtol=0)


@pytest.mark.parametrize("queries_lead", [False, True])
def test_decode_attention_either_score_order_equals_numpy(queries_lead):
    """Few query rows (decode, G * T <= FEW_QUERIES): the cached keys lead the score product,
    or with `queries_lead` (a channel-major key store, `KVFormat.keys_by_channel`) the queries
    do; both equal a NumPy loop, a padding row and empty slots included."""
    import kvjax.attention as attn

    B, T, H, K, C, E = 2, 2, 6, 2, 7, 8
    assert (H // K) * T <= attn.FEW_QUERIES
    r = np.random.default_rng(1)
    q, kn, vn = (r.normal(size=s).astype(np.float32) for s in ((B, T, H, E), (B, T, K, E),
                                                                (B, T, K, E)))
    kc, vc = r.normal(size=(2, B, K, C, E)).astype(np.float32)
    pos_cache = np.where(r.random((B, K, C)) < 0.7, r.integers(0, 9, (B, K, C)), -1)
    pos_new = np.asarray([[9, 10], [4, -1]])
    want_out, want_p = np_attention(q, kn, vn, pos_new, kc, vc, pos_cache)
    run = jax.jit(attn.attention, static_argnames=("cache_empty", "queries_lead"))
    out, p = run(q, kn, vn, jnp.asarray(pos_new), kc, vc, jnp.asarray(pos_cache),
                 queries_lead=queries_lead)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(p, want_p, atol=1e-6, rtol=0)


def test_fresh_prefill_equals_scoring_the_empty_cache():
    """`forward(fresh=True)` (no scoring of an empty cache's slots) gives the logits and the
    cache of the ordinary forward, also under a policy that evicts by the prompt's attention."""
    cfg, p = _model("gqa")
    ids = _ids(cfg, 2, 20)
    n_valid = jnp.asarray([20, 13], jnp.int32)
    for policy in (FULL, get_policy("h2o", budget=12, window=4)):
        outs = [forward(p, ids, KVCache.init(cfg, 2, policy, F32, 32), cfg, n_valid, fresh=f)
                for f in (False, True)]
        np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-6, rtol=0)
        for a, b in zip(jax.tree.leaves(outs[0][1]), jax.tree.leaves(outs[1][1])):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout, policy, chunk, budget", [
    ("dense", "lru", None, 16), ("dense", "lru", 8, 15), ("paged", "streaming", None, 16)])
def test_compile_start_leaves_nothing_to_compile(layout, policy, chunk, budget):
    """After `compile_start`, `start` traces and compiles no prefill program (the speed probe
    times compiled code only) and gives what it gives without; with `decode_too`, greedy
    `decode` on its cache compiles nothing either; compress mode reports that it cannot
    compile ahead (its selection is sized at run time)."""
    from jax import monitoring

    from kvjax.cache import get_layout
    from kvjax.generate import compile_start, decode, start

    cfg, p = _model("gqa", n_layers=3, d_model=48)  # shapes no other test compiles
    lay = get_layout(layout, page_size=8) if layout == "paged" else get_layout(layout)
    prompts = [list(range(1, 20)), list(range(3, 12))]
    policy = get_policy(policy, budget=budget, **({"window": 4} if policy == "lru" else {}))
    args = (p, cfg, prompts, policy, F32)
    names, listening = [], [True]  # JAX keeps the listener: it stops recording at the end
    monitoring.register_event_duration_secs_listener(
        lambda e, d, fun_name="", **_: listening[0] and names.append((e, fun_name)))
    seconds = compile_start(*args, max_len=40, chunk=chunk, layout=lay, decode_too=True)
    assert set(seconds) == {"prefill", "decode"} and min(seconds.values()) > 0
    ours = ("prefill_chunk", "decode_step", "sample")
    for name in ours[:2]:  # each case's own cache shapes (the sampler's may be compiled already)
        assert [n for n in names if name in n[1]], f"compile_start compiled no {name} program"
    names.clear()
    logits, cache = start(*args, max_len=40, chunk=chunk, layout=lay)
    decode(p, cfg, logits, cache, 3)
    assert not [n for n in names if any(name in n[1] for name in ours)], names
    np.testing.assert_array_equal(logits, start(*args, max_len=40, chunk=chunk, layout=lay)[0])
    listening[0] = False
    if layout == "dense":  # the paged layout evicts by position only (no compress mode)
        h2o = get_policy("h2o", budget=16, window=4, mode="compress")
        assert not compile_start(p, cfg, prompts, h2o, F32, max_len=40, chunk=chunk, layout=lay)


@pytest.mark.parametrize("layout, policy", [
    ("dense", "full"), ("dense", "h2o"), ("dense", "pyramid"), ("paged", "streaming")])
def test_split_layers_give_what_stacked_layers_give(layout, policy):
    """`split_layers` (one buffer per layer, picked by `lax.switch`) runs the same matmuls as
    the stacked layout: the same logits and cache through a chunked prefill and decode steps,
    for a uniform cache, an evicting policy, layer groups and pages; `stack_layers` undoes it."""
    from kvjax.cache import get_layout
    from kvjax.model import split_layers, stack_layers

    cfg, p = _model("gqa", n_layers=4)
    sp = split_layers(p)
    assert isinstance(sp["layers"]["wq"], tuple) and len(sp["layers"]["wq"]) == 4
    D, H, E = cfg.d_model, cfg.n_heads, cfg.head_dim
    assert sp["layers"]["wq"][2].shape == (D, H * E) and sp["layers"]["wo"][0].shape == (H * E, D)
    assert sp["layers"]["attn_norm"] is p["layers"]["attn_norm"]  # norms stay stacked
    for a, b in zip(jax.tree.leaves(stack_layers(sp, cfg)), jax.tree.leaves(p)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(split_layers(sp)) == jax.tree.structure(sp)
    kw = {"full": {}, "h2o": {"budget": 12, "window": 4},
          "pyramid": {"budget": 12, "window": 4, "n_groups": 2, "taper": 3.0},
          "streaming": {"budget": 16, "n_sink": 4}}[policy]
    pol = get_policy(policy, **kw)
    lay = get_layout(layout, page_size=8) if layout == "paged" else get_layout(layout)
    ids = _ids(cfg, 2, 24)
    outs = []
    for params in (p, sp):
        cache = lay.init(cfg, 2, pol, F32, 32)
        logits, cache = prefill(params, [ids[0, :17].tolist(), ids[1, :9].tolist()], cache, cfg,
                                chunk=8)
        steps = [logits]
        for t in range(17, 22):
            logits, cache = decode_step(params, ids[:, t], cache, cfg)
            steps.append(logits)
        outs.append((steps, cache))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_compiled_programs_are_dropped_near_the_map_limit():
    """`release_compiled_near_map_limit` clears JAX's compiled programs once the process holds
    more than its fraction of vm.max_map_count (XLA crashes at the limit), and only then."""
    from kvjax.experiment import release_compiled_near_map_limit

    f = jax.jit(lambda x: x * 3 + 1)
    f(jnp.ones(5))
    assert not release_compiled_near_map_limit(1.0) and f._cache_size() == 1
    assert release_compiled_near_map_limit(0.0) and f._cache_size() == 0


@pytest.mark.parametrize("V", [7, 4096])
def test_scores_over_the_vocabulary_equal_log_softmax_and_a_float64_kl(V):
    """token_nll / log_probs are log_softmax's own steps (bit-equal, also jitted with the head
    matmul that made XLA:CPU slow); kl_divergence agrees with a float64 KL and is 0 for equal
    distributions."""
    from kvjax.model import kl_divergence, log_probs, token_nll

    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(k1, (2, 5, 16))
    w = jax.random.normal(k2, (V, 16)) * 2
    lg = jnp.einsum("BTD,VD->BTV", x, w)
    ref = lg + 0.3 * jax.random.normal(k3, lg.shape)
    tg = jax.random.randint(k4, (2, 5), 0, V)

    def old_nll(x, w, tg):
        lp = jax.nn.log_softmax(jnp.einsum("BTD,VD->BTV", x, w), axis=-1)
        return -jnp.take_along_axis(lp, tg[..., None], axis=-1)[..., 0]

    new_nll = jax.jit(lambda x, w, tg: token_nll(jnp.einsum("BTD,VD->BTV", x, w), tg))
    np.testing.assert_array_equal(new_nll(x, w, tg), jax.jit(old_nll)(x, w, tg))
    np.testing.assert_array_equal(jax.jit(log_probs)(lg), jax.jit(jax.nn.log_softmax)(lg))

    def f64_kl(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        la = a - a.max(-1, keepdims=True)
        la -= np.log(np.exp(la).sum(-1, keepdims=True))
        lb = b - b.max(-1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
        return (np.exp(la) * (la - lb)).sum(-1)

    kl = jax.jit(kl_divergence)(log_probs(ref), log_probs(lg))
    np.testing.assert_allclose(kl, f64_kl(ref, lg), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(kl_divergence(log_probs(lg), log_probs(lg))).max()) == 0.0
    one = kl_divergence(log_probs(ref[:1]), log_probs(lg))  # [1, T, V] against [B, T, V]
    np.testing.assert_allclose(one, f64_kl(np.broadcast_to(ref[:1], lg.shape), lg), rtol=1e-4,
                               atol=1e-6)
