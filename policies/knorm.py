"""`knorm`: keep the keys with the lowest L2 norm (Devoto et al., 2024: a low key norm goes
with high attention). The norm is computed once, when a token is inserted, and kept in stats;
RoPE is a rotation, so the rotated key has the same norm. A new token can be the one dropped.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import Evicting, register


@register
@dataclasses.dataclass(frozen=True)
class KNorm(Evicting):
    name = "knorm"
    budget: int | None = 256

    def init_stats(self, B, K, C):
        return {"norm": jnp.zeros((B, K, C), jnp.float32)}

    def score(self, view, k_new, pos_new, probs):
        k32 = k_new.astype(jnp.float32)
        norm_new = jnp.sqrt(jnp.einsum("BTKE,BTKE->BKT", k32, k32))  # [B, K, T]
        norm = view.stats["norm"]  # [B, K, C]
        return -norm, -norm_new, {"norm": (norm, norm_new)}
