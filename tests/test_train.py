"""kv-head conversion (kvjax.convert) and training through `forward` (kvjax.train): expansion
keeps the logits at K'/K times the measured KV bytes, reductions build what they say, jax.grad
of the LM loss agrees with finite differences, optax steps lower the loss, orbax round-trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import init_cache
from kvjax.config import tiny_config
from kvjax.convert import convert_kv_heads
from kvjax.formats import get_format
from kvjax.model import forward_jit, init_params, split_layers
from kvjax.policies import get_policy
from kvjax.train import TrainConfig, lm_loss, restore_params, save_params, train

CFG = tiny_config(n_heads=6, n_kv_heads=2)  # G = 3, like SmolLM2's 9 / 3


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.2)


def _logits_and_cache(params, cfg, toks):
    cache = init_cache(cfg, toks.shape[0], get_policy("full"), get_format("f32"), toks.shape[1])
    return forward_jit(params, toks, cache, cfg)


def test_expanding_to_mha_keeps_the_logits_at_k_fold_kv_bytes(params):
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 24), 0, CFG.vocab_size)
    mha, mcfg = convert_kv_heads(params, CFG, CFG.n_heads)
    assert mcfg.n_kv_heads == 6 and mha["layers"]["wk"].shape[2] == 6
    want, c_gqa = _logits_and_cache(params, CFG, toks)
    got, c_mha = _logits_and_cache(mha, mcfg, toks)
    # the same products, grouped differently in the attention einsums: equal to rounding
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert c_mha.kv_nbytes() == 3 * c_gqa.kv_nbytes()
    # every per-kv-head buffer triples (k, v, pos); only per-row counters stay
    assert 2.9 < c_mha.nbytes() / c_gqa.nbytes() <= 3
    # kv head j of the MHA model is kv head j // 3 of the original
    np.testing.assert_array_equal(mha["layers"]["wv"][:, :, 4], params["layers"]["wv"][:, :, 1])
    split, _ = convert_kv_heads(split_layers(params), CFG, CFG.n_heads)  # the layout it was given
    assert isinstance(split["layers"]["wk"], tuple)
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(split_layers(mha))):
        np.testing.assert_array_equal(a, b)


def test_reducing_builds_mean_first_and_scaled_random_heads(params):
    wk = np.asarray(params["layers"]["wk"])  # [L, D, 2, E]
    mean, cfg1 = convert_kv_heads(params, CFG, 1, "mean")
    first, _ = convert_kv_heads(params, CFG, 1, "first")
    rand, _ = convert_kv_heads(params, CFG, 1, "random", key=jax.random.PRNGKey(3))
    assert cfg1.n_kv_heads == 1 and cfg1.n_heads == 6
    np.testing.assert_allclose(mean["layers"]["wk"][:, :, 0], wk.mean(axis=2), rtol=1e-6)
    np.testing.assert_array_equal(first["layers"]["wk"][:, :, 0], wk[:, :, 0])
    r = np.asarray(rand["layers"]["wk"])
    assert r.shape == (CFG.n_layers, CFG.d_model, 1, CFG.head_dim)
    np.testing.assert_allclose(r.std(axis=(1, 2, 3)), wk.std(axis=(1, 2, 3)), rtol=0.2)
    assert not np.allclose(r[:, :, 0], wk[:, :, 0], atol=1e-3)
    # pure: the input is unchanged, and everything but wk / wv is shared as is
    assert params["layers"]["wk"].shape[2] == 2
    assert mean["layers"]["wq"] is params["layers"]["wq"] and mean["embed"] is params["embed"]
    logits, cache = _logits_and_cache(mean, cfg1, jnp.zeros((1, 8), jnp.int32))
    assert logits.shape == (1, 8, CFG.vocab_size) and cache.pos.shape[2] == 1


@pytest.mark.parametrize("n_kv, method, match", [
    (4, "mean", "must divide n_heads=6; valid choices: 1, 2, 3, 6"),
    (3, "mean", "neither a multiple nor a divisor"),
    (1, "median", "method='median'; valid choices: mean, first, random"),
    (1, "random", "needs a PRNG key"),
])
def test_bad_conversions_name_the_value(params, n_kv, method, match):
    with pytest.raises(ValueError, match=match):
        convert_kv_heads(params, CFG, n_kv, method)


def test_grad_of_the_loss_through_forward_matches_finite_differences(params):
    """<∇L, u> from jax.grad against (L(p + εu) - L(p - εu)) / 2ε along unit directions u in
    single parameters (wq, wk, wv, embed, w_down) and in all of them at once; f32, ε = 1e-2.
    Each u is half random, half the (normalized) gradient, so the derivative is far from 0
    and a wrong gradient moves it (a purely random u in 10⁴ dimensions is nearly orthogonal
    to the gradient).
    Tolerance: 0.2 % relative + 1e-4 absolute (measured agreement: ~2e-4 relative; f32
    rounding of a loss of ~4 nats is ~4e-7, divided by 2ε: ~2e-5)."""
    toks = jax.random.randint(jax.random.PRNGKey(5), (2, 17), 0, CFG.vocab_size)
    loss = jax.jit(lambda p: lm_loss(p, toks, CFG))
    grad = jax.grad(lambda p: lm_loss(p, toks, CFG))(params)
    eps = 1e-2

    def unit(key, only):
        leaves, tree = jax.tree.flatten_with_path(params)
        keys = jax.random.split(key, len(leaves))
        mask = [only is None or only in jax.tree_util.keystr(path) for path, _ in leaves]
        r = [m * jax.random.normal(k, x.shape) for m, k, (_, x) in zip(mask, keys, leaves)]
        g = [m * x for m, x in zip(mask, jax.tree.leaves(grad))]
        norm = lambda xs: jnp.sqrt(sum(jnp.sum(x * x) for x in xs))
        u = [a / norm(r) + b / norm(g) for a, b in zip(r, g)]
        return jax.tree.unflatten(tree, [x / norm(u) for x in u])

    for i, only in enumerate(("'wq'", "'wk'", "'wv'", "'embed'", "'w_down'", None)):
        u = unit(jax.random.PRNGKey(10 + i), only)
        analytic = sum(jnp.sum(g * d) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(u)))
        shift = lambda s: jax.tree.map(lambda p, d: p + s * d, params, u)  # noqa: B023
        numeric = (loss(shift(eps)) - loss(shift(-eps))) / (2 * eps)
        assert abs(float(analytic)) > 1e-3, only  # a direction the loss depends on
        assert float(numeric) == pytest.approx(float(analytic), rel=2e-3, abs=1e-4), only


def test_uptraining_lowers_the_loss_and_orbax_round_trips_exactly(params, tmp_path):
    text = np.random.default_rng(0).integers(0, 8, 4000)  # a tiny vocabulary: learnable
    mqa, cfg1 = convert_kv_heads(params, CFG, 1, "mean")
    tc = TrainConfig(steps=15, batch=4, seq_len=16, lr=1e-2, warmup=2)
    trained, curve = train(mqa, cfg1, text, tc)
    assert np.mean(curve["loss"][-3:]) < curve["loss"][0] - 0.5
    assert len(curve["grad_norm"]) == 15 and tc.tokens == 15 * 4 * 16
    path = save_params(tmp_path / "ckpt", trained)
    back = restore_params(path, trained)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(back)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(back) == jax.tree.structure(trained)
    # the input params were copied, not donated
    again = convert_kv_heads(params, CFG, 1)[0]
    np.testing.assert_array_equal(mqa["layers"]["wk"], again["layers"]["wk"])


def test_train_config_and_text_errors():
    with pytest.raises(ValueError, match="warmup=5 must be in"):
        TrainConfig(steps=5, warmup=5)
    with pytest.raises(ValueError, match="seq_len=16 needs more than 17"):
        train(None, CFG, np.zeros(10, np.int32), TrainConfig(steps=2, seq_len=16, warmup=0))


@pytest.mark.slow
def test_smollm_expanded_to_mha9_has_the_same_logits(smollm_dev, smollm):
    cfg, params = smollm_dev
    toks = jnp.asarray([smollm[2].encode("def fibonacci(n):\n    return n if n < 2 else")])
    mha, mcfg = convert_kv_heads(params, cfg, 9)
    assert (cfg.n_kv_heads, mcfg.n_kv_heads) == (3, 9)
    want, c3 = _logits_and_cache(params, cfg, toks)
    got, c9 = _logits_and_cache(mha, mcfg, toks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert c9.kv_nbytes() == 3 * c3.kv_nbytes()
