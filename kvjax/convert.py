"""Change a checkpoint's number of kv heads: MHA / GQA / MQA from one trained model.

Ainslie et al. (EMNLP 2023, "GQA") convert a multi-head checkpoint to fewer kv heads by
mean-pooling the key and value projections of each group, then uptrain briefly. Query head h
reads kv head h // G (kvjax.attention views the query heads as [K, G]), so:

* more kv heads (K -> K' = K · r): repeat each kv head r times in place. Every query head then
  reads a copy of the head it read before, so the logits are unchanged (exactly: the same
  numbers enter the same dot products) and the cache holds r times the bytes.
* fewer kv heads (K = K' · r -> K'): each new head replaces r consecutive old heads (the query
  heads of its new group), built by `method`: "mean" (the paper), "first" (keep the first
  head of the group), or "random" (fresh N(0, s²) weights, s = the std of that layer's old
  projection, so the scale matches and nothing of the old heads survives).

Only wk and wv change; wq and wo keep their H query heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.model import split_layers, stack_layers

METHODS = ("mean", "first", "random")


def convert_kv_heads(params, cfg: ModelConfig, n_kv_heads: int, method: str = "mean", key=None):
    """(params, cfg) with `n_kv_heads` kv heads; a pure function (the inputs are unchanged).

    n_kv_heads must divide cfg.n_heads and be a multiple or a divisor of cfg.n_kv_heads;
    `method` (among METHODS) applies when reducing; "random" needs a PRNG `key`. Params come
    back in the layout they came in (stacked or `split_layers`)."""
    K, H = cfg.n_kv_heads, cfg.n_heads
    if method not in METHODS:
        raise ValueError(f"method={method!r}; valid choices: {', '.join(METHODS)}")
    if not isinstance(n_kv_heads, int) or n_kv_heads <= 0 or H % n_kv_heads:
        divisors = [d for d in range(1, H + 1) if H % d == 0]
        raise ValueError(f"n_kv_heads={n_kv_heads!r} must divide n_heads={H}; valid choices: "
                         f"{', '.join(map(str, divisors))}")
    if n_kv_heads % K and K % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} is neither a multiple nor a divisor of the "
                         f"model's {K} kv heads (each new head must map to whole old heads)")
    if method == "random" and n_kv_heads < K and key is None:
        raise ValueError("method='random' needs a PRNG key")
    split = any(isinstance(a, tuple) for a in params["layers"].values())
    layers = dict(stack_layers(params, cfg)["layers"])
    for i, name in enumerate(("wk", "wv")):
        w = layers[name]  # [L, D, K, E]
        if n_kv_heads >= K:
            layers[name] = jnp.repeat(w, n_kv_heads // K, axis=2)  # [L, D, K', E]
            continue
        L, D, _, E = w.shape
        grouped = w.reshape(L, D, n_kv_heads, K // n_kv_heads, E)  # [L, D, K', R, E]
        if method == "mean":
            layers[name] = grouped.mean(axis=3)
        elif method == "first":
            layers[name] = grouped[:, :, :, 0]
        else:
            std = jnp.std(w, axis=(1, 2, 3), keepdims=True)  # [L, 1, 1, 1]
            noise = jax.random.normal(jax.random.fold_in(key, i), (L, D, n_kv_heads, E), w.dtype)
            layers[name] = std * noise  # [L, D, K', E]
    out = {**params, "layers": layers}
    return split_layers(out) if split else out, dataclasses.replace(cfg, n_kv_heads=n_kv_heads)
