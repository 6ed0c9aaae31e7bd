"""`full`: keep every token (capacity = the maximum length); slot = position."""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import PageRule, Policy, at_positions, register


@register
@dataclasses.dataclass(frozen=True)
class Full(Policy):
    name = "full"
    modes = ("evict",)
    mode_note = "it keeps every token; the full cache is the baseline of both modes"

    def validate(self, max_len: int) -> None:
        if self.budget is not None and self.budget != max_len:
            raise ValueError(
                f"policy 'full' keeps every token: its budget is the maximum length ({max_len}), "
                f"got budget={self.budget}; use an eviction policy for smaller budgets"
            )
        super().validate(max_len)

    def capacity(self, max_len: int) -> int:
        return max_len

    def place(self, view, k_new, v_new, pos_new, probs):
        return at_positions(view, pos_new), view.stats

    def page_rule(self) -> PageRule:
        """On pages: every page is kept."""
        return PageRule()
