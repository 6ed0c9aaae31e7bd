"""Reference attention over (cached slots ∪ the new chunk), RoPE, RMSNorm.

One code path serves MHA (K == H), MQA (K == 1) and GQA: query heads are viewed as [K, G].
Cached keys and the chunk's own keys are scored separately and joined only as scores, so the
chunk is never concatenated onto a copy of the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


def rms_norm(x, w, eps: float):
    """RMSNorm in f32: x / rms(x) * w."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * w).astype(x.dtype)


def rope_table(n: int, E: int, theta: float):
    """cos, sin [n, E/2] of positions 0..n-1. n, E and theta are static, so XLA folds the table
    into a constant: rotating by table lookup costs no cos/sin at run time."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))  # [E/2]
    ang = jnp.arange(n, dtype=jnp.float32)[:, None] * inv_freq  # [n, E/2]
    return jnp.cos(ang), jnp.sin(ang)


def rope(x, positions, theta: float, table=None):
    """Rotary embedding, HF `rotate_half` convention (pairs are the two halves of E).

    x: [..., E]; positions: x.shape[:-1] (int; -1 padding is harmless). table: `rope_table`
    (cos, sin) looked up instead of computed; a position past its end gives NaN (the scores
    and logits turn NaN), never a silently wrong rotation.
    """
    E = x.shape[-1]
    if table is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))  # [E/2]
        ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., E/2]
        cos, sin = jnp.cos(ang), jnp.sin(ang)
    else:
        idx = jnp.maximum(positions, 0)  # -1 (padding, empty slots) reads row 0

        def look(t):
            return t.at[idx].get(mode="fill", fill_value=jnp.nan)  # [..., E/2]

        cos, sin = look(table[0]), look(table[1])
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [..., E/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention(q, k_new, v_new, pos_new, k_cache, v_cache, pos_cache):
    """Causal GQA attention of a chunk over the cache plus the chunk itself.

    q:        [B, T, H, E]   queries of the chunk (RoPE applied)
    k_new:    [B, T, K, E]   the chunk's keys (RoPE applied), v_new likewise
    pos_new:  [B, T]         absolute positions of the chunk, -1 = padding
    k_cache:  [B, K, C, E]   dequantized cached keys of this layer, v_cache likewise; or
              [B, 1, C, E]   one slot pool shared by the K kv heads (per-head budgets), each
                             head seeing only the slots `pos_cache` gives it
    pos_cache:[B, K, C]      position held by each slot for each kv head, -1 = empty/not its own

    Returns out [B, T, H, E] and probs [B, K, T, C + T]: attention probabilities summed over
    the G query heads of each kv group (cache slots first, then the chunk), zero for padding
    queries, which is what importance policies consume.
    """
    B, T, H, E = q.shape
    K = k_new.shape[2]
    G = H // K
    qg = q.reshape(B, T, K, G, E).astype(jnp.float32) * (E**-0.5)  # [B, T, K, G, E]
    if k_cache.shape[1] not in (1, K):
        raise ValueError(f"cached keys have {k_cache.shape[1]} heads; expected {K} (per head) "
                         "or 1 (a slot pool shared by the kv heads)")
    pooled = k_cache.shape[1] != K  # a shared slot pool: no copy per kv head
    kc = k_cache.astype(jnp.float32)
    if pooled:
        s_cache = jnp.einsum("BTKGE,BSE->BKGTS", qg, kc[:, 0])  # [B, K, G, T, C]
    else:
        s_cache = jnp.einsum("BTKGE,BKSE->BKGTS", qg, kc)  # [B, K, G, T, C]
    s_new = jnp.einsum("BTKGE,BSKE->BKGTS", qg, k_new.astype(jnp.float32))  # [B, K, G, T, T]

    q_valid = pos_new >= 0  # [B, T]
    cache_ok = (pos_cache >= 0)[:, :, None, None, :]  # [B, K, 1, 1, C]
    causal = (pos_new[:, None, :] <= pos_new[:, :, None]) & (pos_new[:, None, :] >= 0)  # [B, T, T]
    new_ok = causal[:, None, None, :, :]  # [B, 1, 1, T, T]
    s_cache = jnp.where(cache_ok, s_cache, MASKED)
    s_new = jnp.where(new_ok, s_new, MASKED)

    s = jnp.concatenate([s_cache, s_new], axis=-1)  # [B, K, G, T, C + T]
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(q_valid[:, None, None, :, None], p, 0.0)
    C = k_cache.shape[2]
    vc = v_cache.astype(jnp.float32)
    if pooled:
        out = jnp.einsum("BKGTS,BSE->BTKGE", p[..., :C], vc[:, 0])  # [B, T, K, G, E]
    else:
        out = jnp.einsum("BKGTS,BKSE->BTKGE", p[..., :C], vc)  # [B, T, K, G, E]
    out = out + jnp.einsum("BKGTS,BSKE->BTKGE", p[..., C:], v_new.astype(jnp.float32))
    return out.reshape(B, T, H, E).astype(q.dtype), p.sum(axis=2)  # [B, T, H, E], [B, K, T, C+T]
