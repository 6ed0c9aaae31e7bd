"""Unit criteria for kv_keep (kvjax.sensitivity) on the tiny model: exact formats score zero,
the batched "kl" score of a unit equals an independent run with only that unit quantized
(through the real format and `keep_units`), and `top_units` picks the highest scores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import init_cache
from kvjax.config import tiny_config
from kvjax.formats import get_format
from kvjax.model import forward_jit, init_params
from kvjax.policies import get_policy
from kvjax.sensitivity import top_units, unit_scores

CFG = tiny_config(n_layers=2, n_kv_heads=2, head_dim=16, d_model=32)
PREFIX = 32
INT2 = {"group": 8, "residual": 8}


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.3)
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (PREFIX + 8,), 0, CFG.vocab_size))
    return params, ids


def test_exact_storage_scores_zero(setup):
    params, ids = setup
    for crit in ("kl", "kv_error"):
        s = unit_scores(params, CFG, ids, get_format("f32"), crit, prefix=PREFIX, batch=3)
        assert s.shape == (2, 2)
        np.testing.assert_allclose(s, 0.0, atol=1e-6)


def test_kl_of_a_unit_is_the_model_with_only_that_unit_quantized(setup):
    """Reference: a keep_units cache holding every other unit in f32 and this one in int2,
    prefilled and scored by the model itself; batch 3 over 4 units runs a padded batch."""
    params, ids = setup
    scores = unit_scores(params, CFG, ids, get_format("int2", **INT2), "kl", prefix=PREFIX,
                         batch=3)
    units = [(layer, h) for layer in range(2) for h in range(2)]

    def logp(fmt):
        cache = init_cache(CFG, 1, get_policy("full"), fmt, len(ids))
        _, cache = forward_jit(params, jnp.asarray(ids[None, :PREFIX]), cache, CFG)
        logits, _ = forward_jit(params, jnp.asarray(ids[None, PREFIX:]), cache, CFG)
        return np.asarray(jax.nn.log_softmax(logits[0]))  # [S, V]

    ref = logp(get_format("f32"))
    for u in ((1, 0),):  # each reference compiles its own format: one unit (the last batch's)
        fmt = get_format("int2", **INT2, keep_units=[w for w in units if w != u],
                         keep_dtype="f32")
        want = np.mean(np.sum(np.exp(ref) * (ref - logp(fmt)), axis=-1))
        assert scores[u] == pytest.approx(want, rel=1e-3, abs=1e-7), u
    assert scores.max() > 1e-5  # int2 does change the distributions


def test_kv_error_and_random(setup):
    params, ids = setup
    err = unit_scores(params, CFG, ids, get_format("int2", **INT2), "kv_error", prefix=PREFIX)
    assert (err > 0).all() and (err < 2).all()  # relative errors of k plus v
    a = unit_scores(params, CFG, ids, get_format("int2"), "random", prefix=PREFIX, seed=3)
    assert np.array_equal(a, unit_scores(params, CFG, ids, get_format("int2"), "random",
                                         prefix=PREFIX, seed=3))
    assert not np.array_equal(a, unit_scores(params, CFG, ids, get_format("int2"), "random",
                                             prefix=PREFIX, seed=4))


def test_top_units_and_bad_input():
    s = np.array([[0.1, 0.9], [0.5, 0.2], [0.7, 0.0]])
    assert top_units(s, 2) == ((0, 1), (2, 0))
    assert top_units(s, 0) == ()
    with pytest.raises(ValueError, match="n=7 must be in 0..6"):
        top_units(s, 7)
    with pytest.raises(ValueError, match="criterion='entropy' is not one of"):
        unit_scores(None, CFG, np.arange(40), get_format("int2"), "entropy", prefix=PREFIX)
    with pytest.raises(TypeError, match="plain base format"):
        unit_scores(None, CFG, np.arange(40), get_format("int2", keep_units=[(0, 0)]), "kl",
                    prefix=PREFIX)
