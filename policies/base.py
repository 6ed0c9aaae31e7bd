"""The policy protocol and the shared eviction mechanism.

A policy is a frozen, hashable dataclass of hyperparameters (a static jit argument) with pure
functions. Per layer, the model calls `update(view, k_new, v_new, pos_new, probs)`; the policy
answers which slot each new token goes to (capacity C means "not stored") and the layer's new
stats. The cache does the writing, so a decode step touches only the written slots.

Eviction never branches on data: scores are masked (empty slots first, protected slots never)
and the victims come from `argmax`/`top_k`, so shapes are fixed and decode never recompiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

POLICIES: dict[str, type["Policy"]] = {}

NEVER = jnp.inf  # score of a protected slot: never a victim
FIRST = -jnp.inf  # score of an empty slot: filled before anything is evicted


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


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base policy: hyperparameters plus `init_stats` and `update`.

    `budget` is the cache capacity C in slots (None: the whole max length, no eviction).
    `min_budget` is what the policy's protected slots need; smaller budgets are rejected.
    """

    name: ClassVar[str] = "base"
    budget: int | None = None

    def capacity(self, max_len: int) -> int:
        return max_len if self.budget is None else self.budget

    def min_budget(self) -> int:
        return 1

    def validate(self, max_len: int) -> None:
        """Raise a clear error for budgets that cannot work, before any model work."""
        if self.budget is None:
            return
        if self.budget <= 0:
            raise ValueError(f"policy {self.name!r}: budget must be positive, got {self.budget}")
        if self.budget < self.min_budget():
            raise ValueError(
                f"policy {self.name!r}: budget={self.budget} is below what its protected slots "
                f"need ({self.min_budget()}); use budget >= {self.min_budget()}"
            )
        if self.budget > max_len:
            raise ValueError(
                f"policy {self.name!r}: budget={self.budget} exceeds the maximum length {max_len}"
            )

    def max_chunk(self, max_len: int) -> int:
        """Largest chunk one `update` can place (new tokens must fit beside protected slots)."""
        return max(1, self.capacity(max_len) - self.min_budget() + 1)

    def rope_positions(self, view: LayerView, pos_new):
        """Positions RoPE uses: (chunk [B, T], cached keys [B, K, C] or None).

        None (the default) means keys are stored already rotated at their absolute positions;
        an array means keys are stored unrotated and rotated at these positions when read
        (StreamingLLM's positions-within-the-cache)."""
        return pos_new, None

    def init_stats(self, B: int, K: int, C: int) -> Any:
        return {}

    def update(self, view: LayerView, k_new, v_new, pos_new, probs):
        """Return (slots [B, K, T] int32, new stats). Override in each policy."""
        raise NotImplementedError


def broadcast_new(pos_new, K: int):
    """[B, T] chunk positions -> [B, K, T] (the same tokens arrive in every kv head)."""
    return jnp.broadcast_to(pos_new[:, None, :], (pos_new.shape[0], K, pos_new.shape[1]))


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
