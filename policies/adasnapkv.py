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

import jax
import jax.numpy as jnp

from kvjax.policies.base import check_share, pool_entries, register
from kvjax.policies.snapkv import SnapKV, slide_unpinned


@register
@dataclasses.dataclass(frozen=True)
class AdaSnapKV(SnapKV):
    name = "adasnapkv"
    head_pool = True  # after compress
    floor: float = 0.2  # share of each head's prefix budget it keeps whatever the others score

    def __post_init__(self):
        super().__post_init__()
        check_share(self, "floor", self.floor)

    def compress(self, cache):
        """Prefill cache (capacity max length, per head) -> a pool of K · budget slots."""
        from kvjax.cache import pool_from  # kvjax.cache imports the policies package

        if "obs" not in cache.stats:
            return cache
        return pool_from(cache, self, cache.capacity if self.budget is None else self.budget)

    def select_pool(self, view):
        """One layer: (kept entries [B, P] of the flattened (head, slot) axis, K·C0 = empty;
        decode stats), P = K · budget."""
        B, K, C0 = view.pos.shape
        N = K * C0
        P = K * (C0 if self.budget is None else self.budget)
        prefix, recent, score = self.prompt_scores(view)
        key = jnp.where(prefix, -score, jnp.inf)  # [B, K, C0] lower = keep
        floor = int(self.floor * (P // K - self.window))
        if floor > 0:  # each head's own best `floor` prefix entries are kept first
            own = prefix & (self.prefix_rank(view, prefix, score) < floor)
            key = jnp.where(own, -jnp.inf, key)
        key = jnp.where(recent, -jnp.inf, key)
        idx = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
        skey, _, order = jax.lax.sort((key.reshape(B, N), -view.pos.reshape(B, N), idx),
                                      dimension=-1, num_keys=3)
        ok = skey[:, :P] < jnp.inf  # [B, P]: the windows, then the best prefix entries
        keep = jnp.where(ok, order[:, :P], N)
        pinned = jnp.take_along_axis(prefix.reshape(B, N), order[:, :P], axis=-1) & ok
        return keep, {"pinned": pinned[:, None]}

    def update(self, view, k_new, v_new, pos_new, probs):
        if "obs" in view.stats:
            return self._observe(view, pos_new, probs)
        B = view.pos.shape[0]  # the pool: [B, 1, P]
        K, T = probs.shape[1], probs.shape[2]
        slots, stats = slide_unpinned(view, pool_entries(pos_new, K)[0])  # [B, 1, K·T]
        return slots.reshape(B, K, T), stats
