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

from kvjax.policies.base import Evicting, register


@register
@dataclasses.dataclass(frozen=True)
class TOVA(Evicting):
    name = "tova"
    budget: int | None = 256
    per_head: bool = False

    def score(self, view, k_new, pos_new, probs):
        C = view.pos.shape[-1]
        row = last_query(probs, pos_new)  # [B, K, C + T]
        if not self.per_head:
            row = jnp.broadcast_to(jnp.mean(row, axis=1, keepdims=True), row.shape)
        return row[..., :C], row[..., C:], {}


def last_query(probs, pos_new):
    """The attention row of each row's last real query: [B, K, T, C + T] -> [B, K, C + T]."""
    if probs.shape[2] == 1:
        return probs[:, :, 0]
    last = jnp.maximum(jnp.sum(pos_new >= 0, axis=-1) - 1, 0)  # [B]
    return jnp.take_along_axis(probs, last[:, None, None, None], axis=2)[:, :, 0]
