"""`pyramid`: per-layer budgets that shrink with depth (PyramidKV, Cai et al., 2024).

Lower layers spread attention widely and get more slots; upper layers concentrate it and get
fewer. Layers are cut into `n_groups` consecutive groups; budgets fall linearly from the first
group to the last with first/last = `taper`, and are whole slots chosen so that the layers hold
exactly `budget` slots on average (L · budget in all, the bytes of a uniform cache of that
budget). Inside each group the `inner` policy runs (default `h2o`, with `window` where it has
one). The memory saving is real: each group is a stacked cache of its own capacity
(`kvjax.cache.LayerGroups`), so bytes = 2 · Hkv · D · bytes · Σ_groups layers · budget.

Compress mode: each group's inner policy selects its own share of the prompt (group budgets
as above; with `ratio`, group g keeps the fraction (1 - ratio) · b_g / budget of the prompt).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.policies.base import POLICIES, Policy, register


def exact_budgets(targets, sizes, total: int, lo: int, hi: int) -> tuple[int, ...]:
    """Whole budgets near `targets` (one per group of `sizes` layers) with Σ sizes · b = total,
    each in [lo, hi]: the closest (least layer-weighted distance) by a small dynamic program
    over b in floor(t) - 2 .. ceil(t) + 2."""
    best = {0: (0.0, ())}  # partial sum -> (cost, budgets)
    for t, n in zip(targets, sizes):
        nxt = {}
        for b in range(max(lo, int(np.floor(t)) - 2), min(hi, int(np.ceil(t)) + 2) + 1):
            for s, (cost, bs) in best.items():
                key, c = s + n * b, cost + n * abs(b - t)
                if key not in nxt or c < nxt[key][0] - 1e-9:
                    nxt[key] = (c, bs + (b,))
        best = nxt
    if total not in best:
        raise ValueError(f"no whole budgets in [{lo}, {hi}] near {list(np.round(targets, 1))} "
                         f"hold {total} slots over layer groups of {list(sizes)}")
    return best[total][1]


@register
@dataclasses.dataclass(frozen=True)
class Pyramid(Policy):
    name = "pyramid"
    budget: int | None = 256  # mean slots per layer
    taper: float = 4.0  # first-group budget / last-group budget
    n_groups: int = 4
    inner: str = "h2o"
    window: int = 32  # recent window of the inner policy (where it has one)

    def profile(self) -> np.ndarray:
        """Each group's budget over the mean (first to last, linear, mean 1)."""
        lo = 2.0 / (1.0 + self.taper)
        return np.linspace(self.taper * lo, lo, self.n_groups)

    def sizes(self, n_layers: int) -> list[np.ndarray]:
        if self.n_groups > n_layers:
            raise ValueError(f"pyramid: n_groups={self.n_groups} exceeds the {n_layers} layers")
        return np.array_split(np.arange(n_layers), self.n_groups)

    def budgets(self, n_layers: int, max_len: int | None = None) -> tuple[int, ...]:
        """Slots per group, first (shallowest) to last, holding n_layers · budget in all."""
        sizes = [len(c) for c in self.sizes(n_layers)]
        lo = self._inner(1).min_budget()
        hi = max_len or max(2 * self.budget * self.taper, 1)
        return exact_budgets(self.targets(n_layers), sizes, n_layers * self.budget, lo, int(hi))

    def targets(self, n_layers: int) -> np.ndarray:
        """The linear profile scaled so that its layer-weighted mean is `budget` (groups of
        unequal size: np.array_split)."""
        sizes = np.array([len(c) for c in self.sizes(n_layers)])
        return self.budget * self.profile() * n_layers / np.sum(sizes * self.profile())

    def _inner(self, budget: int | None, ratio: float | None = None) -> Policy:
        cls = POLICIES[self.inner]
        has_window = "window" in {f.name for f in dataclasses.fields(cls)}
        return cls(budget=budget, mode=self.mode, ratio=ratio,
                   **({"window": self.window} if has_window else {}))

    def validate(self, max_len: int) -> None:
        super().validate(max_len)
        if self.inner not in POLICIES or self.inner in ("pyramid", "full"):
            valid = sorted(n for n, c in POLICIES.items()
                           if n not in ("pyramid", "full") and self.mode in c.modes)
            raise ValueError(f"pyramid: inner={self.inner!r} is not a policy to run per layer "
                             f"group; use one of {valid}")
        if self.mode not in POLICIES[self.inner].modes:
            valid = sorted(n for n, c in POLICIES.items()
                           if n not in ("pyramid", "full") and self.mode in c.modes)
            raise ValueError(f"pyramid: inner={self.inner!r} cannot run mode={self.mode!r}; "
                             f"inner policies for it: {valid}")
        if self.n_groups < 1:
            raise ValueError(f"pyramid: n_groups must be >= 1, got {self.n_groups}")
        if not self.taper >= 1.0:
            raise ValueError(f"pyramid: taper (first/last group budget) must be >= 1, got "
                             f"{self.taper}")
        if self.budget is None or self.budget <= 0:
            raise ValueError(f"pyramid: budget (mean slots per layer) must be positive, got "
                             f"{self.budget}")
        if self.ratio is not None:
            return
        targets = self.budget * self.profile()
        lo = self._inner(max(1, int(targets[-1]))).min_budget()
        if targets[-1] < lo or targets[0] > max_len:
            raise ValueError(
                f"pyramid: budget={self.budget}, taper={self.taper} give group budgets "
                f"{[round(t) for t in targets]}; each must lie in [{lo}, {max_len}] "
                f"({self.inner!r} protects {lo} slots); raise the budget or lower the taper"
            )

    def layer_groups(self, n_layers: int, max_len: int):
        cuts = self.sizes(n_layers)
        if self.ratio is not None:  # compress mode: each group keeps its share of the prompt
            inner = [self._inner(None, max(0.0, 1.0 - (1.0 - self.ratio) * f))
                     for f in self.profile()]
        else:
            inner = [self._inner(b) for b in self.budgets(n_layers, max_len)]
        return tuple((int(c[0]), int(c[-1]) + 1, p) for c, p in zip(cuts, inner))

    def update(self, view, k_new, v_new, pos_new, probs):
        raise TypeError("pyramid runs through the inner policy of each layer group, never directly")
