"""`random`: the baseline — each step evicts uniformly random unprotected candidates.

Reproducible without any PRNG state: a candidate's score is a hash of (seed, kv head, step,
position), where the step is the newest position of the chunk. Rows holding the same tokens
make the same choices (results do not depend on batching); the layer index is not part of
the protocol, so every layer draws the same numbers.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import Evicting, broadcast_new, check_counts, register


def _mix(x):
    """murmur3's 32-bit finalizer: a bijective avalanche on uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_hash(seed: int, head, step, pos):
    """A float in [0, 1) per element, a pure function of its (seed, head, step, pos)."""
    x = _mix(jnp.uint32(seed & 0xFFFFFFFF) + jnp.uint32(0x9E3779B9))
    for part in (head, step, pos):
        x = _mix(x ^ (part.astype(jnp.uint32) + jnp.uint32(0x7F4A7C15)))
    return (x >> 8).astype(jnp.float32) * (2.0**-24)


@register
@dataclasses.dataclass(frozen=True)
class Random(Evicting):
    name = "random"
    budget: int | None = 256
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_counts(self, seed=(self.seed, 0))

    def score(self, view, k_new, pos_new, probs):
        K = view.pos.shape[1]
        step = jnp.maximum(jnp.max(pos_new, axis=-1), view.length - 1)[:, None, None]  # [B, 1, 1]
        head = jnp.arange(K)[None, :, None]
        score = uniform_hash(self.seed, head, step, view.pos)  # [B, K, C]
        score_new = uniform_hash(self.seed, head, step, broadcast_new(pos_new, K))  # [B, K, T]
        return score, score_new, {}
