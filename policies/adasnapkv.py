"""`adasnapkv`: Ada-SnapKV (Feng et al., 2024) — SnapKV's prompt selection with Ada-KV's
adaptive per-head budgets, in a slot pool (real memory).

Prefill is SnapKV's: a cache of the full max length records the attention rows of the last
`window` prompt queries. `compress(cache)` scores every prompt token before the observation
window in every kv head exactly as `snapkv` does (summed over the window's queries and the
group's query heads, pooled along positions), then ranks the (head, token) entries of all
heads of a layer together: each head keeps its observation window, and the best
K · (budget - window) prefix entries over all heads fill the rest of a pool of K · budget
slots (`kvjax.cache.HeadPool`). Ada-KV's safeguard `floor` first gives every head its own best
floor · (budget - window) prefix entries (the paper's alpha, 0.2), so no head is starved.
Ties keep the later position, then the lower head.

Decode after compress: the selected prompt entries are pinned; every head's window and the
generated tokens slide (the oldest unpinned position goes, in every head).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import check_share, keep_best_pool, register
from kvjax.policies.snapkv import SnapKV


@register
@dataclasses.dataclass(frozen=True)
class AdaSnapKV(SnapKV):
    name = "adasnapkv"
    head_pool = True  # the selection is a pool
    floor: float = 0.2  # share of each head's prefix budget it keeps whatever the others score

    def __post_init__(self):
        super().__post_init__()
        check_share(self, "floor", self.floor)

    def select(self, view, n_keep):
        """Every head's window and own best floor · (kept - window) prefix entries, then the
        best prefix entries of the layer: at most K · n_keep [B] per row, [B, K, C0] bool."""
        prefix, recent, score = self.prompt_scores(view)
        floor = (self.floor * jnp.maximum(n_keep - self.window, 0)).astype(jnp.int32)
        return keep_best_pool(view.pos, jnp.where(prefix, score, -jnp.inf), recent, n_keep,
                              floor if self.floor > 0 else None)
