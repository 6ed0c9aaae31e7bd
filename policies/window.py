"""`window`: a sliding window of the most recent `budget` tokens (a ring buffer).

Compress mode keeps the most recent `kept(n)` prompt tokens (equal scores: the oldest go)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import PageRule, Policy, broadcast_new, equal_scores, register


@register
@dataclasses.dataclass(frozen=True)
class Window(Policy):
    name = "window"
    budget: int | None = 256

    def place(self, view, k_new, v_new, pos_new, probs):
        C = view.pos.shape[-1]
        newest = jnp.max(pos_new, axis=-1, keepdims=True)  # [B, 1]
        keep = (pos_new >= 0) & (pos_new > newest - C)  # tokens of a long chunk that survive it
        return broadcast_new(jnp.where(keep, pos_new % C, C), view.pos.shape[1]), view.stats

    def score(self, view, k_new, pos_new, probs):
        return equal_scores(view, pos_new)

    def page_rule(self) -> PageRule | None:
        """On pages (evict mode): the pages holding the last `budget` tokens."""
        return PageRule(window=self.budget) if self.mode == "evict" else None
