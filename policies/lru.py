"""`lru`: least recently used. A slot is "used" at a step when its attention passes a threshold
(`used_by="threshold"`) or is among the step's `top_k` largest (`used_by="topk"`); the slot
whose last use is oldest is evicted, `n_sink` sinks and a recent `window` protected.

The clock is the absolute position of the using query; a token counts as used when it arrives.
Attention is taken as a share of the query's row (the mean over the kv group's query heads),
so `threshold` is in [0, 1] whatever the group size. "topk" counts every slot whose share is at
least the k-th largest of the row (ties all count). Equal last use: the oldest token goes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import Evicting, broadcast_new, check_choice, check_counts, register

USED_BY = ("threshold", "topk")


@register
@dataclasses.dataclass(frozen=True)
class LRU(Evicting):
    name = "lru"
    budget: int | None = 256
    n_sink: int = 4
    window: int = 16
    used_by: str = "threshold"
    threshold: float = 0.01
    top_k: int = 8

    def __post_init__(self):
        super().__post_init__()
        check_choice(self, "used_by", self.used_by, USED_BY)
        check_counts(self, top_k=(self.top_k, 1))
        if not 0.0 <= float(self.threshold) < 1.0:
            raise ValueError(f"policy 'lru': threshold must be in [0, 1), got {self.threshold!r}")

    def init_stats(self, B, K, C):
        return {"last": jnp.zeros((B, K, C), jnp.int32)}

    def used(self, probs):
        """[B, K, T, C + T] attention -> bool: which keys each query uses."""
        total = jnp.sum(probs, axis=-1, keepdims=True)  # [B, K, T, 1]
        share = probs / jnp.where(total > 0, total, 1.0)
        if self.used_by == "threshold":
            return share > self.threshold
        kth = jax.lax.top_k(share, min(self.top_k, share.shape[-1]))[0][..., -1:]  # [B, K, T, 1]
        return share >= kth

    def score(self, view, k_new, pos_new, probs):
        C = view.pos.shape[-1]
        pn = broadcast_new(pos_new, view.pos.shape[1])  # [B, K, T]
        used = self.used(probs) & (pn >= 0)[..., None]  # [B, K, T, C + T]
        clock = jnp.max(jnp.where(used, pn[..., None], -1), axis=2)  # [B, K, C + T]
        last = jnp.maximum(view.stats["last"], clock[..., :C])  # [B, K, C]
        last_new = jnp.maximum(pn, clock[..., C:])  # [B, K, T]
        now = view.length[:, None, None]  # scores relative to now: exact in float32
        return last - now, last_new - now, {"last": (last, last_new)}
