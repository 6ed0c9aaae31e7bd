"""The policy protocol and the shared eviction mechanism.

A policy is a frozen, hashable dataclass of hyperparameters (a static jit argument) with pure
functions. Per layer, the model calls `update(view, k_new, v_new, pos_new, probs)`; the policy
answers which slot each new token goes to (capacity C means "not stored") and the layer's new
stats. The cache does the writing, so a decode step touches only the written slots.

Eviction never branches on data: scores are masked (empty slots first, protected slots never)
and the victims come from `argmax`/`top_k` (or a sort for chunks), so shapes are fixed and
decode never recompiles.

Score policies build on `Evicting` and `evict`: the chunk's own tokens compete with the cached
slots, the lowest (score, position) lose, and ties go to the oldest position. A policy may also
define `compress(cache) -> cache`, run once after prefill (SnapKV); `compress_cache` is the hook.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

POLICIES: dict[str, type[Policy]] = {}

NEVER = jnp.inf  # score of a protected slot: never a victim
FIRST = -jnp.inf  # score of an empty slot: filled before anything is evicted
LAST_POS = jnp.iinfo(jnp.int32).max  # position key of a slot that is not among the lowest scores


def register(cls):
    """Class decorator: makes a policy selectable by its `name`."""
    POLICIES[cls.name] = cls
    return cls


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerView:
    """What a policy sees of one layer's cache (before this chunk is written)."""

    k: jax.Array  # [B, K, C, E] dequantized keys
    v: jax.Array  # [B, K, C, E] dequantized values
    pos: jax.Array  # [B, K, C] position held by each slot, -1 = empty
    stats: Any  # this policy's per-layer stats pytree, leaves [B, K, C, ...]
    length: jax.Array  # [B] tokens seen before this chunk
    owner: Any = None  # head pool only ([B, 1, P] kv head of each pool slot); else None


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base policy: hyperparameters plus `init_stats` and `update`.

    `budget` is the cache capacity C in slots (None: the whole max length, no eviction).
    `min_budget` is what the policy's protected slots need; smaller budgets are rejected.
    """

    name: ClassVar[str] = "base"
    prefill_only: ClassVar[bool] = False  # selects its cache once after a prompt (needs one)
    head_pool: ClassVar[bool] = False  # kv heads share one slot pool per layer (HeadPool)
    compress = None  # optional `compress(cache) -> cache`, run once after prefill
    budget: int | None = None

    def capacity(self, max_len: int) -> int:
        return max_len if self.budget is None else self.budget

    def min_budget(self) -> int:
        return 1

    def validate(self, max_len: int) -> None:
        """Raise a clear error for budgets that cannot work, before any model work."""
        if self.budget is None:
            return
        lo = self.min_budget()
        valid = f"valid range: {lo} <= budget <= {max_len}"
        if not isinstance(self.budget, numbers.Integral) or self.budget <= 0:
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

    def protected_desc(self) -> str:
        """How `min_budget` comes about, for error messages."""
        return "at least one slot"

    def max_chunk(self, max_len: int) -> int:
        """Largest chunk one `update` can place (new tokens must fit beside protected slots)."""
        return max(1, self.capacity(max_len) - self.min_budget() + 1)

    def layer_groups(self, n_layers: int, max_len: int) -> tuple[tuple[int, int, Policy], ...]:
        """Consecutive layer ranges (lo, hi) and the policy each runs; one group by default.

        Several groups give layers different budgets with real memory: the cache holds one
        stacked cache per group, each of its own capacity (`kvjax.cache.LayerGroups`)."""
        return ((0, n_layers, self),)

    def rope_positions(self, view: LayerView, pos_new):
        """Positions RoPE uses: (chunk [B, T], cached keys [B, K, C] or None).

        None (the default) means keys are stored already rotated at their absolute positions;
        an array means keys are stored unrotated and rotated at these positions, each below
        the capacity C, when read (StreamingLLM's positions-within-the-cache)."""
        return pos_new, None

    def init_stats(self, B: int, K: int, C: int) -> Any:
        return {}

    def update(self, view: LayerView, k_new, v_new, pos_new, probs):
        """Return (slots [B, K, T] int32, new stats). Override in each policy."""
        raise NotImplementedError

    def page_rule(self) -> PageRule | None:
        """What the paged layout can serve of this policy (`PageRule`), or None (the default):
        pages hold every kv head, so only position-based, page-granular eviction maps onto them."""
        return None


def broadcast_new(pos_new, K: int):
    """[B, T] chunk positions -> [B, K, T] (the same tokens arrive in every kv head)."""
    return jnp.broadcast_to(pos_new[:, None, :], (pos_new.shape[0], K, pos_new.shape[1]))


def pool_entries(pos_new, K: int, dtype=jnp.int32):
    """A chunk as a head pool (`kvjax.cache.HeadPool`) takes it: every kv head's copy of each
    token, head-major. Returns (positions [B, K·T], the kv head of each entry [K·T])."""
    T = pos_new.shape[-1]
    return jnp.tile(pos_new, (1, K)), jnp.repeat(jnp.arange(K, dtype=dtype), T)


def drop_invalid(slots, pos_new, C: int):
    """Padding tokens (position -1) are never stored: slot C is dropped by the scatter."""
    return jnp.where(broadcast_new(pos_new, slots.shape[1]) >= 0, slots, C).astype(jnp.int32)


def lowest_slots(score, T: int):
    """The T lowest-score slots per (row, head): [B, K, C] -> [B, K, T], lowest first.

    Ties go to the lowest slot index (argmax/top_k return the first maximum)."""
    if T == 1:
        return jnp.argmax(-score, axis=-1)[..., None].astype(jnp.int32)
    return jax.lax.top_k(-score, T)[1].astype(jnp.int32)


def evict_by_score(view: LayerView, score, protected, pos_new):
    """Slots for the chunk: empty slots first, then the lowest `score` among unprotected ones.

    score: [B, K, C] higher = keep; protected: [B, K, C] bool.
    """
    C = view.pos.shape[-1]
    T = pos_new.shape[-1]
    s = jnp.where(protected, NEVER, score)
    s = jnp.where(view.pos < 0, FIRST, s)
    return drop_invalid(lowest_slots(s, T), pos_new, C)


def recent(view: LayerView, pos_new, window: int):
    """Slots holding one of the `window` most recent tokens once this chunk is in: [B, K, C]."""
    newest = jnp.max(pos_new, axis=-1)  # [B] (-1 when the whole row is padding)
    last = jnp.maximum(newest, view.length - 1)[:, None, None]  # [B, 1, 1]
    return (view.pos >= 0) & (view.pos > last - window)


def scatter_slots(stat, slots, values):
    """stat[b, k, slots[b, k, t]] = values[b, k, t]; slot C is dropped.  stat: [B, K, C]."""
    B, K, _ = slots.shape
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(K)[None, :, None]
    return stat.at[b, h, slots].set(values.astype(stat.dtype), mode="drop")


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
    """A score-based eviction policy: `n_sink` first tokens and a recent `window` (counting the
    chunk being placed) are protected; any chunk size works because chunk tokens compete too."""

    n_sink: int = 0
    window: int = 0

    def __post_init__(self):
        check_counts(self, n_sink=(self.n_sink, 0), window=(self.window, 0))

    def min_budget(self) -> int:
        return max(1, self.n_sink + self.window)

    def protected_desc(self) -> str:
        return f"n_sink={self.n_sink} + window={self.window}"

    def max_chunk(self, max_len: int) -> int:
        return max_len

    def protected(self, view: LayerView, pos_new):
        """(cached slots [B, K, C], chunk tokens [B, K, T]) that must not be evicted."""
        return protect(view, pos_new, self.n_sink, self.window)


def protect(view: LayerView, pos_new, n_sink: int, window: int):
    """Sinks (position < n_sink) and the `window` most recent tokens once the chunk is in.

    Returns (cached slots [B, K, C], chunk tokens [B, K, T]) as bool masks."""
    newest = jnp.max(pos_new, axis=-1)  # [B]
    last = jnp.maximum(newest, view.length - 1)[:, None, None]  # [B, 1, 1]

    def rule(p):
        return (p >= 0) & ((p < n_sink) | (p > last - window))

    return rule(view.pos), rule(broadcast_new(pos_new, view.pos.shape[1]))


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


def compress_cache(cache):
    """The after-prefill hook: `cache.policy.compress(cache)` when the policy has one."""
    compress = getattr(cache.policy, "compress", None)
    return cache if compress is None else compress(cache)


@functools.partial(jax.jit, static_argnames=("policy", "capacity"))
def rebuild(cache, policy, capacity: int):
    """A cache of `capacity` slots holding, per layer, the slots `policy.select(view)` keeps.

    `select(view) -> (keep [B, K, capacity] old slot indices (old C = empty), layer stats)`.
    Keys and values go through the format's read and write, so any storage format works."""
    L, B, K, C0 = cache.pos.shape
    fmt = cache.fmt
    view0 = jax.eval_shape(lambda c: c.layer_view(0), cache)
    E = view0.k.shape[-1]
    stats0 = jax.eval_shape(lambda v: policy.select(v)[1], view0)
    slots = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (B, K, capacity))

    def body(carry, layer):
        k, v, pos, stats = carry
        view = cache.layer_view(layer)
        keep, st = policy.select(view)  # [B, K, capacity]
        ok = keep < C0
        idx = jnp.minimum(keep, C0 - 1)

        def take(x):  # [B, K, C0, E] -> [B, K, capacity, E]
            return jnp.where(ok[..., None], jnp.take_along_axis(x, idx[..., None], axis=2), 0.0)

        k = fmt.write(k, layer, slots, take(view.k), "k")
        v = fmt.write(v, layer, slots, take(view.v), "v")
        pos = pos.at[layer].set(jnp.where(ok, jnp.take_along_axis(view.pos, idx, -1), -1))
        stats = jax.tree.map(lambda s, n: s.at[layer].set(n), stats, st)
        return (k, v, pos, stats), None

    init = (fmt.init((L, B, K, capacity, E), "k"), fmt.init((L, B, K, capacity, E), "v"),
            jnp.full((L, B, K, capacity), -1, jnp.int32),
            jax.tree.map(lambda s: jnp.zeros((L,) + s.shape, s.dtype), stats0))
    (k, v, pos, stats), _ = jax.lax.scan(body, init, jnp.arange(L, dtype=jnp.int32))
    return cache.replace(k=k, v=v, pos=pos, stats=stats, policy=policy)


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
