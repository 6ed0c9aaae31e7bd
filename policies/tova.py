"""`tova`: Token Omission Via Attention (Oren et al., 2024) — evict the token the current query
attends to least.

The score is the attention of the current query (the last real token of the chunk) over the
cache and the chunk, the chunk's own tokens included, so a new token can be the one dropped.
As in the paper the score is averaged over all heads of the layer (every kv head evicts the
same position); `per_head=True` scores each kv head by its own group's attention instead.
No stats: the decision uses this step's attention only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import Evicting, evict, register


@register
@dataclasses.dataclass(frozen=True)
class TOVA(Evicting):
    name = "tova"
    budget: int | None = 256
    per_head: bool = False

    def update(self, view, k_new, v_new, pos_new, probs):
        C = view.pos.shape[-1]
        if probs.shape[2] == 1:
            row = probs[:, :, 0]  # [B, K, C + 1]
        else:
            last = jnp.maximum(jnp.sum(pos_new >= 0, axis=-1) - 1, 0)  # [B] last real query
            row = jnp.take_along_axis(probs, last[:, None, None, None], axis=2)[:, :, 0]
        if not self.per_head:
            row = jnp.broadcast_to(jnp.mean(row, axis=1, keepdims=True), row.shape)
        protected, protected_new = self.protected(view, pos_new)
        return evict(view, pos_new, row[..., :C], row[..., C:], protected, protected_new), view.stats
