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


def test_nonfinite_keys_raise_naming_the_layer():
    cfg = tiny_config(n_layers=3)
    p = init_params(cfg, jax.random.PRNGKey(0))
    p["layers"]["wk"] = p["layers"]["wk"].at[1].set(jnp.nan)
    _, cache = forward(p, jnp.ones((1, 4), jnp.int32), KVCache.init(
        cfg, 1, get_policy("full"), get_format("f32"), 16), cfg)
    with pytest.raises(FloatingPointError, match=r"layer\(s\) \[1, 2\]"):
        cache.check_finite()
