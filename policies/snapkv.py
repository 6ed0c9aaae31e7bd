"""`snapkv`: SnapKV (Li et al., 2024) — select the prompt's cache once, after prefill.

Prefill runs on a cache of the full max length (slot = position) while `update` records, per
kv head, the attention rows of the last `window` queries (a ring of `window` rows per slot).
`compress(cache)` then scores every prompt token before the observation window by the
attention those `window` queries gave it (summed over them and over the kv group's query
heads), pools the scores along positions with a 1-D `pool` ("max" or "avg", size `kernel`,
stride 1, same length; avg counts the padding as zeros, max ignores it, as torch does), keeps
the budget - window best per kv head plus the whole window, and returns a cache of capacity
`budget`. Ties in the pooled score keep the later position (the older token goes first, as in
every kvjax policy).

Decode after compress: the selected prompt tokens are pinned; the observation window and the
generated tokens form a sliding window over the remaining slots (the oldest unpinned token is
evicted). Callers: init the cache with this policy, prefill, `compress_cache(cache)`, decode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import (
    Policy,
    broadcast_new,
    check_choice,
    check_counts,
    evict,
    rebuild,
    register,
    scatter_slots,
)

POOLS = ("max", "avg")


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(Policy):
    name = "snapkv"
    prefill_only = True
    budget: int | None = 256
    window: int = 32
    kernel: int = 7
    pool: str = "max"

    def __post_init__(self):
        check_counts(self, window=(self.window, 1), kernel=(self.kernel, 1))
        if self.kernel % 2 == 0:
            raise ValueError(f"policy 'snapkv': kernel must be odd (same-length pooling), "
                             f"got {self.kernel}")
        check_choice(self, "pool", self.pool, POOLS)

    def capacity(self, max_len: int) -> int:
        """Prefill holds the whole prompt; `compress` shrinks the cache to `budget`."""
        return max_len

    def min_budget(self) -> int:
        return self.window

    def protected_desc(self) -> str:
        return f"window={self.window}"

    def max_chunk(self, max_len: int) -> int:
        return max_len

    def init_stats(self, B, K, C):
        return {"obs": jnp.zeros((B, K, C, self.window), jnp.float32)}

    def update(self, view, k_new, v_new, pos_new, probs):
        if "obs" in view.stats:
            return self._observe(view, pos_new, probs)
        return slide_unpinned(view, pos_new)

    def _observe(self, view, pos_new, probs):
        """Prefill: slot = position, and the last `window` query rows go into the ring."""
        B, K, C = view.pos.shape
        T = pos_new.shape[-1]
        W = self.window
        Q = min(T, W)
        slot_new = jnp.where((pos_new >= 0) & (pos_new < C), pos_new, C)  # [B, T]
        n = jnp.sum(pos_new >= 0, axis=-1)  # [B] real tokens in the chunk
        t = n[:, None] - Q + jnp.arange(Q)  # [B, Q] the chunk's last Q real queries
        rows = jnp.take_along_axis(probs, jnp.clip(t, 0, T - 1)[:, None, :, None], axis=2)
        b = jnp.arange(B)[:, None, None, None]
        h = jnp.arange(K)[None, :, None, None]
        q = jnp.arange(Q)[None, None, :, None]
        by_slot = rows[..., :C].at[b, h, q, slot_new[:, None, None, :]].add(
            rows[..., C:], mode="drop")  # [B, K, Q, C]: attention over slots
        q_pos = jnp.take_along_axis(pos_new, jnp.clip(t, 0, T - 1), axis=-1)  # [B, Q]
        ring = jnp.where(t >= 0, q_pos % W, W)[:, None, None, :]  # [B, 1, 1, Q], W = skip
        c = jnp.arange(C)[None, None, :, None]
        obs = view.stats["obs"].at[b, h, c, ring].set(
            jnp.swapaxes(by_slot, 2, 3), mode="drop")  # [B, K, C, W]
        return jnp.broadcast_to(slot_new[:, None, :], (B, K, T)).astype(jnp.int32), {"obs": obs}

    def compress(self, cache):
        """Prefill cache (capacity max length) -> a cache of capacity `budget`."""
        if "obs" not in cache.stats:
            return cache
        C0 = cache.pos.shape[-1]
        return rebuild(cache, self, C0 if self.budget is None else self.budget)

    def prompt_scores(self, view):
        """(prefix, window) masks [B, K, C0] of the prompt, and the prefix's pooled scores."""
        start = (view.length - self.window)[:, None, None]  # [B, 1, 1] first observed position
        prefix = (view.pos >= 0) & (view.pos < start)  # [B, K, C0]
        recent = (view.pos >= 0) & ~prefix
        score = pool_1d(jnp.sum(view.stats["obs"], axis=-1), prefix, self.kernel, self.pool)
        return prefix, recent, score

    def prefix_rank(self, view, prefix, score):
        """Rank of each prefix slot within its head, best pooled score first, ties to the later
        position: [B, K, C0] (0 = best; slots outside the prefix rank after every prefix slot)."""
        B, K, C0 = view.pos.shape
        key = jnp.where(prefix, -score, jnp.inf)  # lower = better
        idx = jnp.broadcast_to(jnp.arange(C0, dtype=jnp.int32), view.pos.shape)
        order = jax.lax.sort((key, -view.pos, idx), dimension=-1, num_keys=3)[2]  # [B, K, C0]
        return jnp.zeros_like(idx).at[
            jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], order].set(idx)

    def select(self, view):
        """One layer: (kept slot indices [B, K, budget] in position order, decode stats)."""
        B, K, C0 = view.pos.shape
        Cb = C0 if self.budget is None else self.budget
        W = self.window
        prefix, recent, score = self.prompt_scores(view)
        idx = jnp.broadcast_to(jnp.arange(C0, dtype=jnp.int32), view.pos.shape)
        chosen = prefix & (self.prefix_rank(view, prefix, score) < Cb - W)
        kept = chosen | recent  # [B, K, C0], at most Cb per head
        nth = jnp.where(kept, jnp.cumsum(kept, axis=-1) - 1, Cb)
        keep = jnp.full((B, K, Cb), C0, jnp.int32).at[
            jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], nth].set(idx, mode="drop")
        pinned = jnp.take_along_axis(chosen, jnp.minimum(keep, C0 - 1), axis=-1) & (keep < C0)
        return keep, {"pinned": pinned}


def slide_unpinned(view, pos_new):
    """Decode after compress: pinned slots stay, the oldest unpinned token goes (equal scores).

    view: [B, K', C] slots with stats["pinned"]; pos_new [B, N] the entries arriving in every
    one of the K' heads. Returns (slots [B, K', N], stats with the reused slots unpinned)."""
    pinned = view.stats["pinned"] & (view.pos >= 0)  # [B, K', C]
    zeros = jnp.zeros(view.pos.shape, jnp.float32)
    no = jnp.zeros(broadcast_new(pos_new, view.pos.shape[1]).shape, bool)  # [B, K', N]
    slots = evict(view, pos_new, zeros, no.astype(jnp.float32), pinned, no)
    return slots, {"pinned": scatter_slots(view.stats["pinned"], slots, no)}


def pool_1d(x, valid, kernel: int, pool: str):
    """Same-length 1-D pooling along the last axis over the `valid` entries only.

    max: entries outside `valid` (and the padding) are ignored; avg: they count as zeros and
    the sum is divided by `kernel` (torch's avg_pool1d with count_include_pad=True)."""
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel // 2, kernel // 2)]
    dims = (1,) * (x.ndim - 1) + (kernel,)
    ones = (1,) * x.ndim
    if pool == "max":
        return jax.lax.reduce_window(jnp.where(valid, x, -jnp.inf), -jnp.inf, jax.lax.max, dims,
                                     ones, pad)
    return jax.lax.reduce_window(jnp.where(valid, x, 0.0), 0.0, jax.lax.add, dims, ones,
                                 pad) / kernel
