"""Reference attention over (cached slots ∪ the new chunk), RoPE, RMSNorm.

One code path serves MHA (K == H), MQA (K == 1) and GQA: query heads are viewed as [K, G].
Cached keys and the chunk's own keys are scored separately and joined only as scores, so the
chunk is never concatenated onto a copy of the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN
SELF_BLOCK = 256  # queries per block of a chunk's attention over itself (longer chunks split)
FEW_QUERIES = 16  # up to this many query rows per kv head (G·T), cached keys lead the score matmul


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


def _sum_groups(x):
    """[B, K, G, T, S] -> [B, K, T, S], summed over the G query heads as G - 1 elementwise adds:
    XLA:CPU runs a reduce over that middle axis dozens of times slower than the adds
    (`python -m experiments.bench_attention_blocks --group-sum` measures both)."""
    out = x[:, :, 0]
    for g in range(1, x.shape[2]):
        out = out + x[:, :, g]
    return out


def attention(q, k_new, v_new, pos_new, k_cache, v_cache, pos_cache, cache_empty=False,
              queries_lead=False):
    """Causal GQA attention of a chunk over the cache plus the chunk itself.

    q:        [B, T, H, E]   queries of the chunk (RoPE applied)
    k_new:    [B, T, K, E]   the chunk's keys (RoPE applied), v_new likewise
    pos_new:  [B, T]         absolute positions of the chunk, -1 = padding (real tokens in
                             increasing order, padding after them, as `forward` builds them)
    k_cache:  [B, K, C, E]   dequantized cached keys of this layer, v_cache likewise; or
              [B, 1, C, E]   one slot pool shared by the K kv heads (per-head budgets), each
                             head seeing only the slots `pos_cache` gives it
    pos_cache:[B, K, C]      position held by each slot for each kv head, -1 = empty/not its own
    cache_empty: (static) the caller knows every slot is empty (a prompt's first chunk): the
                 cache is not scored at all. Exact: empty slots get weight exp(-1e30) = 0.
    queries_lead: (static) the cached keys are a transposed view of a channel-major store
                 (`KVFormat.keys_by_channel`): the queries lead the score product even for a
                 few query rows, so it reads the stored keys in place along the slots.

    Returns out [B, T, H, E] and probs [B, K, T, C + T]: attention probabilities summed over
    the G query heads of each kv group (cache slots first, then the chunk), zero for padding
    queries, which is what importance policies consume.

    Layout (measured on XLA:CPU, docs/benchmarks.md): every product is a batched matmul over
    leading [B, K] axes with the contraction last ([B, K, G·T, E] x [B, K, S, E]); the cache
    and chunk scores are never concatenated (one softmax over both parts, normalized after the
    value product); the chunk's own scores are computed per block of queries against the keys
    up to that block only (keys after a query are always masked), which halves the self
    attention of a long chunk.
    """
    B, T, H, E = q.shape
    K = k_new.shape[2]
    G = H // K
    if k_cache.shape[1] not in (1, K):
        raise ValueError(f"cached keys have {k_cache.shape[1]} heads; expected {K} (per head) "
                         "or 1 (a slot pool shared by the kv heads)")
    pooled = k_cache.shape[1] != K  # a shared slot pool: no copy per kv head
    qk = jnp.transpose(q.reshape(B, T, K, G, E), (0, 2, 3, 1, 4)).astype(jnp.float32)
    qk = qk * (E**-0.5)  # [B, K, G, T, E]
    kn = jnp.swapaxes(k_new, 1, 2).astype(jnp.float32)  # [B, K, T, E]
    vn = jnp.swapaxes(v_new, 1, 2).astype(jnp.float32)  # [B, K, T, E]
    kc = k_cache.astype(jnp.float32)
    vc = v_cache.astype(jnp.float32)
    if cache_empty:  # score no slot: C = 0 below, zero probs for the slots at the end
        kc, vc, pos_cache = kc[:, :, :0], vc[:, :, :0], pos_cache[:, :, :0]
    if pooled:
        s_cache = jnp.einsum("BKGTE,BSE->BKGTS", qk, kc[:, 0])  # [B, K, G, T, C]
    elif G * T <= FEW_QUERIES and not queries_lead:  # decode: keys as the row-major lhs
        s_cache = jnp.swapaxes(jnp.einsum("BKSE,BKME->BKSM", kc, qk.reshape(B, K, G * T, E)),
                               2, 3).reshape(B, K, G, T, -1)  # [B, K, G, T, C]
    else:
        s_cache = jnp.einsum("BKGTE,BKSE->BKGTS", qk, kc)  # [B, K, G, T, C]
    cache_ok = (pos_cache >= 0)[:, :, None, None, :]  # [B, K, 1, 1, C]
    s_cache = jnp.where(cache_ok, s_cache, MASKED)
    q_valid = (pos_new >= 0)[:, None, None, :]  # [B, 1, 1, T]

    # (t0, t1): queries t0..t1-1 see the chunk's keys 0..t1-1 only
    blocks = [(t0, min(T, t0 + SELF_BLOCK)) for t0 in range(0, T, SELF_BLOCK)]
    m_cache = jnp.max(s_cache, axis=-1, initial=MASKED)  # [B, K, G, T]
    s_new = []
    for t0, t1 in blocks:
        s = jnp.einsum("BKGTE,BKSE->BKGTS", qk[:, :, :, t0:t1], kn[:, :, :t1])  # [B,K,G,t,t1]
        pq, pk = pos_new[:, t0:t1], pos_new[:, :t1]
        ok = (pk[:, None, :] <= pq[:, :, None]) & (pk[:, None, :] >= 0)  # [B, t, t1]
        s_new.append(jnp.where(ok[:, None, None], s, MASKED))
    m = jnp.concatenate([jnp.maximum(m_cache[..., t0:t1], jnp.max(s, axis=-1))
                         for (t0, t1), s in zip(blocks, s_new)], axis=-1)  # [B, K, G, T]
    e_cache = jnp.exp(s_cache - m[..., None])  # [B, K, G, T, C]
    e_new = [jnp.exp(s - m[..., t0:t1, None]) for (t0, t1), s in zip(blocks, s_new)]
    denom = jnp.sum(e_cache, axis=-1) + jnp.concatenate(
        [jnp.sum(e, axis=-1) for e in e_new], axis=-1)  # [B, K, G, T]
    inv = jnp.where(q_valid, 1.0 / denom, 0.0)  # [B, K, G, T] zero for padding queries
    if pooled:
        out = jnp.einsum("BKGTS,BSE->BKGTE", e_cache, vc[:, 0])  # [B, K, G, T, E]
    else:
        out = jnp.einsum("BKGTS,BKSE->BKGTE", e_cache, vc)  # [B, K, G, T, E]
    out = out + jnp.concatenate(
        [jnp.einsum("BKGTS,BKSE->BKGTE", e, vn[:, :, :t1]) for (t0, t1), e in zip(blocks, e_new)],
        axis=3)
    out = out * inv[..., None]
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, H, E)  # [B, T, H, E]
    if cache_empty:  # no slot was scored: zero weight on every one
        p_cache = jnp.zeros((B, K, T, k_cache.shape[2]), jnp.float32)
    else:
        p_cache = _sum_groups(e_cache * inv[..., None])  # [B, K, T, C]
    p_new = jnp.concatenate(
        [jnp.pad(_sum_groups(e * inv[..., t0:t1, None]), ((0, 0), (0, 0), (0, 0), (0, T - t1)))
         for (t0, t1), e in zip(blocks, e_new)], axis=2)  # [B, K, T, T]
    return out.astype(q.dtype), jnp.concatenate([p_cache, p_new], axis=-1)  # [B, K, T, C + T]
