"""`full`: keep every token (capacity = the maximum length); slot = position."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import PageRule, Policy, broadcast_new, register


@register
@dataclasses.dataclass(frozen=True)
class Full(Policy):
    name = "full"

    def validate(self, max_len: int) -> None:
        if self.budget is not None and self.budget != max_len:
            raise ValueError(
                f"policy 'full' keeps every token: its budget is the maximum length ({max_len}), "
                f"got budget={self.budget}; use an eviction policy for smaller budgets"
            )

    def capacity(self, max_len: int) -> int:
        return max_len

    def max_chunk(self, max_len: int) -> int:
        return max_len

    def update(self, view, k_new, v_new, pos_new, probs):
        C = view.pos.shape[-1]
        ok = (pos_new >= 0) & (pos_new < C)
        return broadcast_new(jnp.where(ok, pos_new, C), view.pos.shape[1]), view.stats

    def page_rule(self) -> PageRule:
        """On pages: every page is kept."""
        return PageRule()
