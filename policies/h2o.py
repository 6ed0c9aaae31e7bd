"""`h2o`: Heavy-Hitter Oracle (Zhang et al., 2023) — keep the tokens with the largest
accumulated attention (heavy hitters) plus a recent window.

Each cached token's score is the attention it has received, summed over every query since it
arrived (and over the query heads of its kv group); a new token starts with the attention the
chunk's queries gave it. The recent budget is `window` (it counts the chunk being placed), the
heavy budget is budget - window - n_sink. Eviction is per kv head and per row.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import Evicting, register


@register
@dataclasses.dataclass(frozen=True)
class H2O(Evicting):
    name = "h2o"
    budget: int | None = 256
    window: int = 32

    def init_stats(self, B, K, C):
        return {"acc": jnp.zeros((B, K, C), jnp.float32)}

    def score(self, view, k_new, pos_new, probs):
        C = view.pos.shape[-1]
        acc = view.stats["acc"] + jnp.sum(probs[..., :C], axis=2)  # [B, K, C]
        acc_new = jnp.sum(probs[..., C:], axis=2)  # [B, K, T]
        return acc, acc_new, {"acc": (acc, acc_new)}
