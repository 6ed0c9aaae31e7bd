"""`pyramid`: per-layer budgets that shrink with depth (PyramidKV, Cai et al., 2024).

Lower layers spread attention widely and get more slots; upper layers concentrate it and get
fewer. Layers are cut into `n_groups` consecutive groups; budgets fall linearly from the first
group to the last with first/last = `ratio` and a mean of `budget` slots per layer (rounded to
whole slots). Inside each group the `inner` policy evicts (default `h2o`, with its own default
window `window` and default sinks). The memory saving is real: each group is a stacked cache of its own capacity
(`kvjax.cache.LayerGroups`), so bytes = 2 · Hkv · D · bytes · Σ_groups layers · budget.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.policies.base import POLICIES, Policy, register


@register
@dataclasses.dataclass(frozen=True)
class Pyramid(Policy):
    name = "pyramid"
    budget: int | None = 256  # mean slots per layer
    ratio: float = 4.0  # first-group budget / last-group budget
    n_groups: int = 4
    inner: str = "h2o"
    window: int = 32  # recent window of the inner policy (where it has one)

    def budgets(self) -> tuple[int, ...]:
        """Slots per group, first (shallowest) to last."""
        lo = 2.0 * self.budget / (1.0 + self.ratio)
        return tuple(round(b) for b in np.linspace(self.ratio * lo, lo, self.n_groups))

    def _inner(self, budget: int) -> Policy:
        cls = POLICIES[self.inner]
        has_window = "window" in {f.name for f in dataclasses.fields(cls)}
        return cls(budget=budget, **({"window": self.window} if has_window else {}))

    def validate(self, max_len: int) -> None:
        if self.inner not in POLICIES or self.inner in ("pyramid", "full"):
            valid = sorted(set(POLICIES) - {"pyramid", "full"})
            raise ValueError(f"pyramid: inner={self.inner!r} is not an eviction policy; use one of {valid}")
        if POLICIES[self.inner].prefill_only:
            raise ValueError(
                f"pyramid: inner={self.inner!r} selects its cache after prefill, which the layer "
                "groups do not run yet; use a decode-time policy (h2o, lru, tova, knorm, ...)"
            )
        if self.n_groups < 1:
            raise ValueError(f"pyramid: n_groups must be >= 1, got {self.n_groups}")
        if not self.ratio >= 1.0:
            raise ValueError(f"pyramid: ratio (first/last group budget) must be >= 1, got {self.ratio}")
        if self.budget is None or self.budget <= 0:
            raise ValueError(f"pyramid: budget (mean slots per layer) must be positive, got {self.budget}")
        for b in self.budgets():
            inner = self._inner(b)
            if b < inner.min_budget() or b > max_len:
                raise ValueError(
                    f"pyramid: budget={self.budget}, ratio={self.ratio} give group budgets "
                    f"{list(self.budgets())}; each must lie in [{inner.min_budget()}, {max_len}] "
                    f"({self.inner!r} protects {inner.min_budget()} slots); raise the budget or "
                    "lower the ratio"
                )

    def layer_groups(self, n_layers: int, max_len: int):
        if self.n_groups > n_layers:
            raise ValueError(f"pyramid: n_groups={self.n_groups} exceeds the {n_layers} layers")
        cuts = np.array_split(np.arange(n_layers), self.n_groups)
        return tuple((int(c[0]), int(c[-1]) + 1, self._inner(b)) for c, b in zip(cuts, self.budgets()))

    def max_chunk(self, max_len: int) -> int:
        return min(self._inner(b).max_chunk(max_len) for b in self.budgets())

    def update(self, view, k_new, v_new, pos_new, probs):
        raise TypeError("pyramid runs through the inner policy of each layer group, never directly")
