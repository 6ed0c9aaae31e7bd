"""`snapkv`: SnapKV (Li et al., 2024) — select the prompt's cache once, after prefill.

A compress-mode policy only. While the prompt is read (a cache of the full max length, slot =
position), `observe` records, per kv head, the attention rows of the last `window` queries (a
ring of `window` rows per slot). `select` then scores every prompt token before the
observation window by the attention those `window` queries gave it (summed over them and over
the kv group's query heads), pools the scores along positions with a 1-D `pool` ("max" or
"avg", size `kernel`, stride 1, same length; avg counts the padding as zeros, max ignores it,
as torch does), and keeps the `kept(n) - window` best per kv head plus the whole window.
`per_head=False` averages the window's attention over the kv heads before pooling, so every
head keeps the same positions. Ties in the pooled score keep the later position (the older token goes first, as in
every kvjax policy). kvpress's settings: window 64, kernel 5, avg pool
(`policy=snapkv_kvpress`). After the selection the cache grows (compress mode).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import Policy, check_choice, check_counts, keep_best, register

POOLS = ("max", "avg")


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(Policy):
    name = "snapkv"
    modes = ("compress",)
    mode_note = "it selects once from the prompt's observation window; use h2o or tova to evict"
    budget: int | None = 256
    mode: str = "compress"
    window: int = 32
    kernel: int = 7
    pool: str = "max"
    per_head: bool = True

    def __post_init__(self):
        check_counts(self, window=(self.window, 1), kernel=(self.kernel, 1))
        if self.kernel % 2 == 0:
            raise ValueError(f"policy 'snapkv': kernel must be odd (same-length pooling), "
                             f"got {self.kernel}")
        check_choice(self, "pool", self.pool, POOLS)

    def min_budget(self) -> int:
        return self.window

    def protected_desc(self) -> str:
        return f"window={self.window}"

    def observes_as(self):
        """The ring depends on the window alone (kernel, pool, per_head and budget act at
        `select`), so a shared prefill keeps one ring per window."""
        return (type(self), self.window)

    def observe_stats(self, B, K, C):
        return {"obs": jnp.zeros((B, K, C, self.window), jnp.float32)}

    def observe(self, view, k_new, pos_new, probs):
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

    def prompt_scores(self, view):
        """(prefix, window) masks [B, K, C0] of the prompt, and the prefix's pooled scores."""
        start = (view.length - self.window)[:, None, None]  # [B, 1, 1] first observed position
        prefix = (view.pos >= 0) & (view.pos < start)  # [B, K, C0]
        recent = (view.pos >= 0) & ~prefix
        obs = jnp.sum(view.stats["obs"], axis=-1)  # [B, K, C0]
        if not self.per_head:  # one score per position over the kv heads (sum: mean's order)
            obs = jnp.broadcast_to(jnp.sum(obs, axis=1, keepdims=True), obs.shape)
        return prefix, recent, pool_1d(obs, prefix, self.kernel, self.pool)

    def select(self, view, n_keep):
        """The observation window, then the best pooled prefix scores: [B, K, C0] bool."""
        prefix, recent, score = self.prompt_scores(view)
        return keep_best(view.pos, jnp.where(prefix, score, -jnp.inf), recent, n_keep)


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
