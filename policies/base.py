"""The policy protocol: two modes, one template, and the shared eviction and selection rules.

A policy is a frozen, hashable dataclass of hyperparameters (a static jit argument). It only
scores and chooses; the cache (`kvjax.cache`) builds, writes, compacts and grows caches.

Two protocols, one switch (`mode`):

* `evict` (streaming): the cache has `budget` slots from the start and every chunk, prefill
  and decode, may evict. Per layer the model calls `update`, which runs `place`: for a score
  policy (`Evicting`) the template protect -> `score` -> `evict` -> stats.
* `compress` (kvpress's protocol): the prompt is prefilled into a cache with room for all of
  it while `update` runs `observe` (slot = position, and the policy's scores are recorded);
  `cache.compress(extra)` then asks `select` (per head) which `kept(n)` slots of each head stay,
  builds a cache of that size plus `extra` slots, and the cache grows during decode and scoring
  (`Grown`: new tokens fill empty slots, nothing is evicted). `ratio` (kvpress's
  `compression_ratio`) keeps int(n · (1 - ratio)) of an n-token prompt instead of `budget`.

A score policy is `score` (+ `init_stats` when it keeps state): the base class evicts and
selects (kvpress's `ScorerPress`). Eviction never branches on data: scores are masked (empty
slots first, protected slots never) and victims come from reductions or one sort, so shapes are
fixed and decode never recompiles. Ties always go to the oldest position.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache import LayerView, pool_entries

POLICIES: dict[str, type[Policy]] = {}
MODES = ("evict", "compress")
SCORE = "score"  # the stats entry holding each slot's score while a prompt is observed

NEVER = jnp.inf  # score of a protected slot: never a victim
FIRST = -jnp.inf  # score of an empty slot: filled before anything is evicted
LAST_POS = jnp.iinfo(jnp.int32).max  # position key of a slot that is not among the lowest scores


def register(cls):
    """Class decorator: makes a policy selectable by its `name`."""
    POLICIES[cls.name] = cls
    return cls


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base policy: hyperparameters, the mode switch, and the protocol the cache calls.

    `budget` is the cache capacity C in slots in `evict` mode and the slots kept per kv head
    after the prompt in `compress` mode (None: the whole max length, nothing evicted). `ratio`
    (compress only) keeps int(n · (1 - ratio)) of an n-token prompt instead. `min_budget` is
    what the policy's protected slots need; smaller budgets are rejected.
    """

    name: ClassVar[str] = "base"
    head_pool: ClassVar[bool] = False  # kv heads share one slot pool per layer (HeadPool)
    modes: ClassVar[tuple[str, ...]] = MODES  # the protocols this policy runs
    mode_note: ClassVar[str] = ""  # why a mode is missing, for the error
    budget: int | None = None
    mode: str = "evict"
    ratio: float | None = None

    # ---- sizes and checks

    def capacity(self, max_len: int) -> int:
        """Slots per kv head of a fresh cache (compress: the whole prompt fits)."""
        if self.mode == "compress" or self.budget is None:
            return max_len
        return self.budget

    def kept(self, n: int) -> int:
        """Compress mode: slots per kv head kept after an n-token prompt."""
        if self.ratio is not None:
            k = int(n * (1.0 - self.ratio))
        else:
            k = n if self.budget is None else self.budget
        return max(0, min(n, max(k, self.min_budget())))

    def min_budget(self) -> int:
        return 1

    def protected_desc(self) -> str:
        """How `min_budget` comes about, for error messages."""
        return "at least one slot"

    def validate(self, max_len: int) -> None:
        """Raise a clear error for settings that cannot work, before any model work."""
        if self.mode not in MODES:
            raise ValueError(f"policy {self.name!r}: mode={self.mode!r} is not one of {MODES}")
        if self.mode not in self.modes:
            note = f" ({self.mode_note})" if self.mode_note else ""
            raise ValueError(f"policy {self.name!r} cannot run mode={self.mode!r}{note}; "
                             f"its modes: {', '.join(self.modes)}")
        if self.ratio is not None:
            if self.mode != "compress":
                raise ValueError(
                    f"policy {self.name!r}: ratio={self.ratio!r} needs mode='compress' (a ratio "
                    "of the prompt); in mode='evict' give budget= (the harness turns ratio= "
                    "into a budget from the task's length)")
            if (isinstance(self.ratio, bool) or not isinstance(self.ratio, numbers.Real)
                    or not 0 <= self.ratio < 1):
                raise ValueError(f"policy {self.name!r}: ratio must be in [0, 1) (the fraction "
                                 f"of the prompt removed), got {self.ratio!r}")
        if self.budget is None:
            return
        lo = self.min_budget()
        valid = f"valid range: {lo} <= budget <= {max_len}"
        if (isinstance(self.budget, bool) or not isinstance(self.budget, numbers.Integral)
                or self.budget <= 0):
            raise ValueError(
                f"policy {self.name!r}: budget must be a positive integer, got {self.budget!r} "
                f"({valid})"
            )
        if self.budget < lo:
            raise ValueError(
                f"policy {self.name!r}: budget={self.budget} is below what its protected slots "
                f"need ({self.protected_desc()} = {lo}); use budget >= {lo} ({valid})"
            )
        if self.budget > max_len:
            raise ValueError(
                f"policy {self.name!r}: budget={self.budget} exceeds the maximum length "
                f"{max_len} ({valid})"
            )

    def layer_groups(self, n_layers: int, max_len: int) -> tuple[tuple[int, int, Policy], ...]:
        """Consecutive layer ranges (lo, hi) and the policy each runs; one group by default.

        Several groups give layers different budgets with real memory: the cache holds one
        stacked cache per group, each of its own capacity (`kvjax.cache.LayerGroups`)."""
        return ((0, n_layers, self),)

    # ---- what the cache calls

    def cache_stats(self, B: int, K: int, C: int) -> Any:
        """The stats pytree of a fresh cache (leaves [B, K, C, ...]) in this policy's mode."""
        return self.observe_stats(B, K, C) if self.mode == "compress" else self.init_stats(B, K, C)

    def init_stats(self, B: int, K: int, C: int) -> Any:
        """The state a policy keeps per slot while it runs (e.g. H2O's accumulated attention)."""
        return {}

    def observe_stats(self, B: int, K: int, C: int) -> Any:
        """Compress mode, while the prompt is read: the running state and each slot's score."""
        return {**self.init_stats(B, K, C), SCORE: jnp.zeros((B, K, C), jnp.float32)}

    def observes_as(self) -> Any:
        """What `observe` records depends on this alone (hashable): policies that agree on it
        record the same stats from a prompt, so a shared prefill (`Observers`) keeps one copy
        for all of them. Default: the policy itself (only equal policies share)."""
        return self

    def rope_positions(self, view: LayerView, pos_new):
        """Positions RoPE uses: (chunk [B, T], cached keys [B, K, C] or None).

        None (the default) means keys are stored already rotated at their absolute positions;
        an array means keys are stored unrotated and rotated at these positions, each below
        the capacity C, when read (StreamingLLM's positions-within-the-cache)."""
        return pos_new, None

    def update(self, view: LayerView, k_new, v_new, pos_new, probs):
        """Where a chunk goes: (slots [B, K, T] int32, slot C = not stored; new layer stats).

        view: the layer before the chunk; k_new, v_new [B, T, K, E] (keys as stored);
        pos_new [B, T] (-1 = padding); probs [B, K, T, C + T] this chunk's attention summed
        over each kv group's query heads, cached slots first."""
        if self.mode == "compress":
            return self.observe(view, k_new, pos_new, probs)
        return self.place(view, k_new, v_new, pos_new, probs)

    def place(self, view: LayerView, k_new, v_new, pos_new, probs):
        """Evict mode: (slots, stats) for a chunk in a cache of `budget` slots."""
        raise NotImplementedError(f"policy {self.name!r} has no evict-mode placement")

    def score(self, view: LayerView, k_new, pos_new, probs):
        """Higher = keep: (cached slots [B, K, C], chunk tokens [B, K, T], tracked) where
        tracked maps each stats entry to its (cached, new) values, scattered with the chunk."""
        raise NotImplementedError(f"policy {self.name!r} does not score tokens")

    def protected(self, view: LayerView, pos_new=None):
        """(cached slots [B, K, C], chunk tokens [B, K, T] or None) that must stay."""
        return protect(view, pos_new, 0, 0)

    def observe(self, view: LayerView, k_new, pos_new, probs):
        """Compress mode, the prompt: slot = position (nothing evicted); scores recorded."""
        cached, new, tracked = self.score(view, k_new, pos_new, probs)
        real = jnp.any(pos_new >= 0, axis=-1)[:, None, None]  # [B, 1, 1] rows with tokens
        cached = jnp.where(real, cached, view.stats[SCORE])  # a padding chunk scores nothing
        slots = at_positions(view, pos_new)
        return slots, scatter_tracked({**tracked, SCORE: (cached, new)}, slots)

    def select(self, view: LayerView, n_keep):
        """Compress mode: which slots stay, [B, K, C] bool, at most n_keep [B] per kv head
        (head_pool policies: at most K · n_keep per row over all heads). Default: the
        protected slots, then the best recorded scores (ties keep the later position)."""
        protected, _ = self.protected(view)
        return keep_best(view.pos, view.stats[SCORE], protected, n_keep)

    def grown(self) -> Policy:
        """The policy of a compressed cache: it grows, new tokens fill empty slots."""
        return Grown(inner=self)

    def page_rule(self) -> PageRule | None:
        """What the paged layout can serve of this policy (`PageRule`), or None (the default):
        pages hold every kv head, so only position-based, page-granular eviction maps onto them."""
        return None


@dataclasses.dataclass(frozen=True)
class Grown(Policy):
    """A compressed cache while it grows (kvpress): every new token gets an empty slot (the
    cache was built with room for them); if none is left the oldest token goes. RoPE positions
    stay the selecting policy's."""

    name: ClassVar[str] = "grown"
    inner: Policy | None = None

    def rope_positions(self, view, pos_new):
        return self.inner.rope_positions(view, pos_new)

    def update(self, view, k_new, v_new, pos_new, probs):
        B, K, T = probs.shape[:3]
        entries = pos_new if view.owner is None else pool_entries(pos_new, K)[0]
        return fill(view, entries).reshape(B, K, T), view.stats

    def grown(self) -> Policy:
        return self


@dataclasses.dataclass(frozen=True)
class Observers(Policy):
    """Score once, select many: reads a prompt for several compress-mode `policies` at once
    (slot = position for all; the stats of each distinct `observes_as` side by side), so one
    prefill serves every selection (`kvjax.generate.generate_many`). The policies must store
    keys the same way (rotated at absolute positions) and keep a per-head cache while they
    read (no layer groups)."""

    name: ClassVar[str] = "observers"
    modes: ClassVar[tuple[str, ...]] = ("compress",)
    policies: tuple = ()
    mode: str = "compress"

    def validate(self, max_len: int) -> None:
        for p in self.policies:
            p.validate(max_len)
            if p.mode != "compress" or type(p).layer_groups is not Policy.layer_groups:
                raise ValueError(f"policy {p.name!r} cannot share a prefill: one compress-mode "
                                 "cache per head is needed (no layer groups, mode='compress')")

    def readers(self) -> tuple[tuple[Policy, ...], tuple[int, ...]]:
        """(one policy per distinct `observes_as`, which of them each policy's stats are):
        policies that record alike share one copy of the stats (e.g. SnapKV's ring for every
        kernel, pool and budget at one window)."""
        keys = list(dict.fromkeys(p.observes_as() for p in self.policies))
        first = tuple(next(p for p in self.policies if p.observes_as() == k) for k in keys)
        return first, tuple(keys.index(p.observes_as()) for p in self.policies)

    def cache_stats(self, B, K, C):
        return tuple(p.cache_stats(B, K, C) for p in self.readers()[0])

    def update(self, view, k_new, v_new, pos_new, probs):
        stats = []
        for i, p in enumerate(self.readers()[0]):
            _, st = p.update(dataclasses.replace(view, stats=view.stats[i]), k_new, v_new,
                             pos_new, probs)
            stats.append(st)
        return at_positions(view, pos_new), tuple(stats)

    def part(self, cache, i: int):
        """The prefilled cache as policy i read it (ready for `compress`)."""
        return cache.replace(policy=self.policies[i], stats=cache.stats[self.readers()[1][i]])


def broadcast_new(pos_new, K: int):
    """[B, T] chunk positions -> [B, K, T] (the same tokens arrive in every kv head)."""
    return jnp.broadcast_to(pos_new[:, None, :], (pos_new.shape[0], K, pos_new.shape[1]))


def drop_invalid(slots, pos_new, C: int):
    """Padding tokens (position -1) are never stored: slot C is dropped by the scatter."""
    return jnp.where(broadcast_new(pos_new, slots.shape[1]) >= 0, slots, C).astype(jnp.int32)


def at_positions(view: LayerView, pos_new):
    """Slot = position ([B, K, T]); positions past the capacity are not stored."""
    C = view.pos.shape[-1]
    ok = (pos_new >= 0) & (pos_new < C)
    return broadcast_new(jnp.where(ok, pos_new, C), view.pos.shape[1]).astype(jnp.int32)


def fill(view: LayerView, pos_new):
    """Empty slots first, then the oldest token: slots [B, K', N] for entries pos_new [B, N]
    arriving in each of the view's K' heads (nothing protected, equal scores)."""
    zeros = jnp.zeros(view.pos.shape, jnp.float32)
    none = jnp.zeros(broadcast_new(pos_new, view.pos.shape[1]).shape, bool)
    return evict(view, pos_new, zeros, none.astype(jnp.float32), zeros.astype(bool), none)


def equal_scores(view: LayerView, pos_new):
    """`score` of a policy that only protects: all candidates equal, so the oldest goes."""
    B, K, _ = view.pos.shape
    return jnp.zeros(view.pos.shape), jnp.zeros((B, K, pos_new.shape[-1])), {}


def scatter_slots(stat, slots, values):
    """stat[b, k, slots[b, k, t]] = values[b, k, t]; slot C is dropped.  stat: [B, K, C]."""
    B, K, _ = slots.shape
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(K)[None, :, None]
    return stat.at[b, h, slots].set(values.astype(stat.dtype), mode="drop")


def scatter_tracked(tracked: dict, slots) -> dict:
    """{name: (cached [B, K, C], new [B, K, T])} -> {name: cached with the chunk's values}."""
    return {n: scatter_slots(c, slots, new) for n, (c, new) in tracked.items()}


def check_counts(policy, **values) -> None:
    """Hyperparameters that count slots or tokens must be integers >= their minimum."""
    for key, (value, lo) in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
            raise ValueError(f"policy {policy.name!r}: {key} must be an integer >= {lo}, "
                             f"got {value!r}")


def check_share(policy, key: str, value) -> None:
    """A share of a budget: a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:
        raise ValueError(f"policy {policy.name!r}: {key} must be in [0, 1], got {value!r}")


def check_choice(policy, key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"policy {policy.name!r}: {key}={value!r} is not one of {choices}")


@dataclasses.dataclass(frozen=True)
class Evicting(Policy):
    """A score policy: `n_sink` first tokens and a recent `window` (counting the chunk being
    placed) are protected; any chunk size works because chunk tokens compete too. A subclass
    defines `score` (and `init_stats` for the state it tracks); `place` is the template."""

    n_sink: int = 0
    window: int = 0

    def __post_init__(self):
        check_counts(self, n_sink=(self.n_sink, 0), window=(self.window, 0))

    def min_budget(self) -> int:
        return max(1, self.n_sink + self.window)

    def protected_desc(self) -> str:
        return f"n_sink={self.n_sink} + window={self.window}"

    def protected(self, view: LayerView, pos_new=None):
        return protect(view, pos_new, self.n_sink, self.window)

    def place(self, view, k_new, v_new, pos_new, probs):
        """protect -> score -> evict -> stats."""
        cached, new, tracked = self.score(view, k_new, pos_new, probs)
        protected, protected_new = self.protected(view, pos_new)
        slots = evict(view, pos_new, cached, new, protected, protected_new)
        return slots, scatter_tracked(tracked, slots)


def protect(view: LayerView, pos_new, n_sink: int, window: int):
    """Sinks (position < n_sink) and the `window` most recent tokens once the chunk is in.

    Returns (cached slots [B, K, C], chunk tokens [B, K, T] or None without a chunk)."""
    last = view.length - 1  # [B]
    if pos_new is not None:
        last = jnp.maximum(jnp.max(pos_new, axis=-1), last)
    last = last[:, None, None]  # [B, 1, 1]

    def rule(p):
        return (p >= 0) & ((p < n_sink) | (p > last - window))

    new = None if pos_new is None else rule(broadcast_new(pos_new, view.pos.shape[1]))
    return rule(view.pos), new


def evict(view: LayerView, pos_new, score, score_new, protected, protected_new):
    """Slots for a chunk whose tokens compete with the cached slots.

    score [B, K, C] / score_new [B, K, T]: higher = keep; protected / protected_new: bool.
    Of the C + T candidates the T lowest by (score, position, index) are the victims: empty
    slots and padding first, protected never, ties to the OLDEST position. A victim slot
    receives a surviving chunk token (chunk order -> victim slots in slot order); a victim chunk
    token is not stored (slot C). Returns slots [B, K, T] int32.
    """
    B, K, C = view.pos.shape
    T = pos_new.shape[-1]
    p = jnp.concatenate([view.pos, broadcast_new(pos_new, K)], axis=-1)  # [B, K, C + T]
    s = jnp.concatenate([jnp.where(protected, NEVER, score.astype(jnp.float32)),
                         jnp.where(protected_new, NEVER, score_new.astype(jnp.float32))], -1)
    s = jnp.where(p < 0, FIRST, s)  # [B, K, C + T]
    if T == 1:  # decode: two reductions, no sort
        low = s == jnp.min(s, axis=-1, keepdims=True)
        victim = jnp.argmin(jnp.where(low, p, LAST_POS), axis=-1)  # [B, K], C = the new token
        return drop_invalid(victim[..., None], pos_new, C)
    idx = jnp.broadcast_to(jnp.arange(C + T, dtype=jnp.int32), s.shape)
    victims = jax.lax.sort((s, p, idx), dimension=-1, num_keys=3)[2][..., :T]  # [B, K, T]
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(K)[None, :, None]
    hit = jnp.zeros(s.shape, bool).at[b, h, victims].set(True)  # [B, K, C + T]
    cache_hit = hit[..., :C]  # [B, K, C]
    rank = jnp.cumsum(cache_hit, axis=-1) - 1  # compact the victim slots, lowest first
    free = jnp.full((B, K, T), C, jnp.int32).at[b, h, jnp.where(cache_hit, rank, T)].set(
        jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C)), mode="drop")  # [B, K, T]
    kept = ~hit[..., C:]  # [B, K, T]
    nth = jnp.clip(jnp.cumsum(kept, axis=-1) - 1, 0, T - 1)
    slots = jnp.where(kept, jnp.take_along_axis(free, nth, axis=-1), C)
    return drop_invalid(slots, pos_new, C)


def rank_keep(pos, score, first, limit):
    """Keep mask over the last axis: the `first` entries, then the best `score` (ties keep the
    later position), at most `limit` (shape pos.shape[:-1], broadcast) of the valid entries
    (pos >= 0)."""
    key = jnp.where(first, -jnp.inf, -score.astype(jnp.float32))  # lower = keep
    key = jnp.where(pos >= 0, key, jnp.inf)
    idx = jnp.broadcast_to(jnp.arange(pos.shape[-1], dtype=jnp.int32), pos.shape)
    order = jax.lax.sort((key, -pos, idx), dimension=-1, num_keys=2)[2]
    rank = jnp.argsort(order, axis=-1)  # each entry's place in that order
    return (rank < jnp.asarray(limit)[..., None]) & (pos >= 0)


def keep_best(pos, score, protected, n_keep):
    """Per kv head: the protected slots, then the best scores, at most n_keep [B] per head.
    pos, score, protected: [B, K, C] -> [B, K, C] bool."""
    return rank_keep(pos, score, protected, n_keep[:, None])


def keep_best_pool(pos, score, protected, n_keep, floor=None):
    """Over all kv heads of a layer (a head pool's selection, Ada-KV): each head's protected
    slots and its own best floor [B] others first (None: no floor), then the best scores of
    the layer, at most K · n_keep [B] per row. pos, score, protected: [B, K, C] -> bool."""
    B, K, C = pos.shape
    first = protected
    if floor is not None:  # Ada-KV's safeguard: no head falls below its own best `floor`
        first = rank_keep(pos, score, protected, jnp.sum(protected, axis=-1) + floor[:, None])
    flat = rank_keep(pos.reshape(B, K * C), score.reshape(B, K * C), first.reshape(B, K * C),
                     K * n_keep)
    return flat.reshape(B, K, C)


@dataclasses.dataclass(frozen=True)
class PageRule:
    """A policy's eviction as the paged layout (kvjax/paged.py) runs it, page by page.

    After each forward call a row keeps the pages holding its first `sinks` tokens and every
    page holding one of its last `window` tokens (window None: every page, no eviction).
    `rope_in_cache`: queries and keys are rotated at their positions within the cache
    (StreamingLLM's rope="cache"); the layout keeps keys rotated at absolute positions, which
    leaves the recent keys' position differences unchanged, and re-rotates the kept sink pages
    by the evicted count when it reads them."""

    window: int | None = None
    sinks: int = 0
    rope_in_cache: bool = False
