"""`adakv`: adaptive per-head budgets (Ada-KV, Feng et al., 2024) with real memory.

Ada-KV's point: heads differ in how concentrated their attention is, so a fixed budget per
head wastes slots on flat heads and starves peaked ones. It ranks the scores of every kv head
of a layer together and keeps the top K · budget (head, token) entries, so each head's share
follows its scores. kvpress implements this by masking evicted keys in a full-size cache; here
the K heads of a layer share one pool of K · budget slots (`kvjax.cache.HeadPool`) and the
bytes are those of `budget` slots per head.

At decode time the pool evicts jointly: the cached entries and the chunk's new (head, token)
entries compete, and the K · T lowest-scored go (ties to the oldest position). Scores:
`score_by="acc"` is H2O's accumulated attention (summed over the kv group's query heads; a head's
softmax rows sum to its G query heads, so scores compare across heads); `score_by="current"` is
the current query's attention (TOVA per head). Each head's `n_sink` first and `window` most
recent tokens are protected, and so are its own best int(floor · (budget - window - n_sink))
candidates, cached or new (Ada-KV's safeguard, alpha = 0.2): no head's share drops below that.
floor=1 guards each head's whole share, which is the per-head policy with the same scores.

Compress mode (Ada-KV's own setting, with these scores): the prompt is read into a per-head
cache of the full length while each slot's score is recorded per head (`score`), then the
K · kept(n) best (head, token) entries of each layer, after every head's sinks, window and
floor, form the pool.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import pool_entries
from kvjax.policies.base import (
    SCORE,
    Evicting,
    check_choice,
    check_share,
    evict,
    keep_best_pool,
    protect,
    register,
    scatter_slots,
)
from kvjax.policies.tova import last_query

SCORES = ("acc", "current")


@register
@dataclasses.dataclass(frozen=True)
class AdaKV(Evicting):
    name = "adakv"
    head_pool = True
    budget: int | None = 256  # mean slots per kv head: the pool holds K · budget per layer
    window: int = 32  # per head
    score_by: str = "acc"  # what ranks entries: "acc" (H2O) or "current" (TOVA per head)
    floor: float = 0.2  # share of each head's heavy budget kept by its own ranking

    def __post_init__(self):
        super().__post_init__()
        check_choice(self, "score_by", self.score_by, SCORES)
        check_share(self, "floor", self.floor)

    def floor_slots(self) -> int:
        """Cached entries each head keeps by its own ranking, beside its sinks and window."""
        heavy = 0 if self.budget is None else self.budget - self.window - self.n_sink
        return int(self.floor * max(0, heavy))

    def init_stats(self, B, K, C):
        return {"acc": jnp.zeros((B, K, C), jnp.float32)} if self.score_by == "acc" else {}

    def score(self, view, k_new, pos_new, probs):
        """Per kv head (compress mode reads the prompt into a per-head cache)."""
        C = view.pos.shape[-1]
        if self.score_by == "acc":
            acc = view.stats["acc"] + jnp.sum(probs[..., :C], axis=2)  # [B, K, C]
            acc_new = jnp.sum(probs[..., C:], axis=2)  # [B, K, T]
            return acc, acc_new, {"acc": (acc, acc_new)}
        row = last_query(probs, pos_new)  # [B, K, C + T]
        return row[..., :C], row[..., C:], {}

    def select(self, view, n_keep):
        protected, _ = self.protected(view)
        floor = (self.floor * jnp.maximum(n_keep - self.window - self.n_sink, 0)).astype(jnp.int32)
        return keep_best_pool(view.pos, view.stats[SCORE], protected, n_keep,
                              floor if self.floor > 0 else None)

    def place(self, view, k_new, v_new, pos_new, probs):
        B, _, P = view.pos.shape  # the pool: [B, 1, P]
        K, T = probs.shape[1], probs.shape[2]  # probs [B, K, T, P + T], 0 off a head's slots
        if self.score_by == "acc":
            cached = view.stats["acc"] + jnp.sum(probs[..., :P], axis=(1, 2))[:, None]  # [B,1,P]
            new = jnp.sum(probs[..., P:], axis=2)  # [B, K, T]
        else:
            last = jnp.maximum(jnp.sum(pos_new >= 0, axis=-1) - 1, 0)  # [B] last real query
            row = jnp.take_along_axis(probs, last[:, None, None, None], axis=2)[:, :, 0]
            cached = jnp.sum(row[..., :P], axis=1)[:, None]  # [B, 1, P]
            new = row[..., P:]  # [B, K, T]
        pos_flat, heads = pool_entries(pos_new, K, view.owner.dtype)  # [B, K·T], [K·T]
        new = new.reshape(B, 1, K * T)  # [B, 1, K·T], head-major like pos_flat
        protected, protected_new = protect(view, pos_flat, self.n_sink, self.window)
        if self.floor_slots() > 0:  # each head's own best entries, cached or new, stay
            best = own_best(jnp.concatenate([view.pos, pos_flat[:, None]], -1),
                            jnp.concatenate([view.owner, jnp.broadcast_to(heads, new.shape)], -1),
                            jnp.concatenate([cached, new], -1),
                            jnp.concatenate([protected, protected_new], -1), K,
                            self.floor_slots())  # [B, 1, P + K·T]
            protected, protected_new = protected | best[..., :P], protected_new | best[..., P:]
        slots = evict(view, pos_flat, cached, new, protected, protected_new)  # [B, 1, K·T]
        stats = {"acc": scatter_slots(cached, slots, new)} if self.score_by == "acc" else {}
        return slots.reshape(B, K, T), stats



def own_best(pos, owner, score, protected, K: int, n: int):
    """[B, 1, N] mask of each head's n best-scored unprotected candidates (ties: the newer).

    pos, owner, score, protected: [B, 1, N] over the candidates (cached slots and new
    entries), owner the kv head of each."""
    B, _, N = pos.shape
    ok = (pos >= 0) & ~protected
    group = jnp.where(ok, owner.astype(jnp.int32), K)[:, 0]  # [B, N]; K = not ranked
    idx = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    g, _, _, order = jax.lax.sort((group, -score[:, 0], -pos[:, 0], idx), dimension=-1,
                                  num_keys=3)  # by head, best first
    start = jnp.sum(group[:, :, None] < jnp.arange(K + 1), axis=1)  # [B, K + 1] block starts
    rank = idx - jnp.take_along_axis(start, g, axis=-1)  # rank within its head (sorted order)
    best = jnp.zeros((B, N), bool).at[jnp.arange(B)[:, None], order].set((rank < n) & (g < K))
    return best[:, None]
