"""`knorm`: keep the keys with the lowest L2 norm (Devoto et al., 2024: a low key norm goes
with high attention). The norm is computed once, when a token is inserted, and kept in stats;
RoPE is a rotation, so the rotated key has the same norm. A new token can be the one dropped.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import Evicting, evict, register, scatter_slots


@register
@dataclasses.dataclass(frozen=True)
class KNorm(Evicting):
    name = "knorm"
    budget: int | None = 256

    def init_stats(self, B, K, C):
        return {"norm": jnp.zeros((B, K, C), jnp.float32)}

    def update(self, view, k_new, v_new, pos_new, probs):
        k32 = k_new.astype(jnp.float32)
        norm_new = jnp.sqrt(jnp.einsum("BTKE,BTKE->BKT", k32, k32))  # [B, K, T]
        protected, protected_new = self.protected(view, pos_new)
        slots = evict(view, pos_new, -view.stats["norm"], -norm_new, protected, protected_new)
        return slots, {"norm": scatter_slots(view.stats["norm"], slots, norm_new)}
