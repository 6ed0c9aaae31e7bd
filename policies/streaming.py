"""`streaming`: StreamingLLM (Xiao et al., 2023) — `n_sink` attention sinks plus the most recent
tokens; the oldest non-sink token is evicted.

`rope="cache"` (the paper's choice) stores keys unrotated and rotates queries and keys at their
positions within the cache (sinks 0..n_sink-1, then the recent tokens in order), so positions
never exceed the capacity plus one chunk and text longer than the model's context works.
`rope="original"` keeps the absolute positions (kvpress's setting). Compress mode keeps the
sinks and the most recent `kept(n) - n_sink` prompt tokens.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import Evicting, PageRule, check_choice, equal_scores, register

ROPE_MODES = ("cache", "original")


@register
@dataclasses.dataclass(frozen=True)
class Streaming(Evicting):
    name = "streaming"
    budget: int | None = 256
    n_sink: int = 4
    rope: str = "cache"

    def __post_init__(self):
        super().__post_init__()
        check_choice(self, "rope", self.rope, ROPE_MODES)

    def min_budget(self) -> int:
        return self.n_sink + max(1, self.window)

    def protected_desc(self) -> str:
        return f"n_sink={self.n_sink} + {max(1, self.window)} recent slot(s)"

    def rope_positions(self, view, pos_new):
        """Positions within the cache: what is cached is the sinks plus a contiguous run of the
        most recent tokens, so a non-sink position moves down by (tokens seen - tokens cached)."""
        if self.rope == "original":
            return pos_new, None
        shift = view.length[:, None] - jnp.sum(view.pos >= 0, axis=-1)  # [B, K]
        keys = jnp.where(view.pos < self.n_sink, view.pos, view.pos - shift[..., None])  # [B, K, C]
        queries = jnp.where(pos_new >= 0, pos_new - shift[:, :1], pos_new)  # [B, T]
        return queries, keys

    def score(self, view, k_new, pos_new, probs):
        return equal_scores(view, pos_new)

    def page_rule(self) -> PageRule | None:
        """On pages (evict mode): the sink pages and the pages holding the last budget - n_sink
        tokens."""
        if self.mode != "evict":
            return None
        if self.budget is None:
            return PageRule()
        return PageRule(window=self.budget - self.n_sink, sinks=self.n_sink,
                        rope_in_cache=self.rope == "cache")
