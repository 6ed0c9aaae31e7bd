"""Which (layer, kv head) units of a quantized KV cache matter: measured criteria for kv_keep.

`unit_scores(params, cfg, ids, fmt, criterion)` scores every unit [L, K] on a calibration text
`ids` (a prefix of `prefix` tokens written into the cache, then the rest scored); a higher
score means quantizing that unit hurts more, so `top_units(scores, n)` gives the units to keep
in full precision (`get_format(name, keep_units=...)`). Criteria:

* "kl": the end-to-end damage of quantizing *only* that unit: the prefix's keys and values of
  the unit are replaced by what `fmt` stores for them (every other unit exact), and the mean
  KL(full ‖ quantized) of the next-token distributions over the continuation is the score. All
  units run through one compiled forward, batched.
* "kv_error": no model call past the prefill: the unit's relative squared error of the stored
  keys plus that of its values, ‖x̂ − x‖² / ‖x‖².
* "random": seeded uniform scores, the baseline a criterion must beat.

Formats quantize each (layer, head) on its own, so a unit's stored keys and values do not
depend on which other units are kept: one round trip of the whole prefix through `fmt` serves
every unit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import init_cache
from kvjax.formats import Mixed, MixedUnits, get_format
from kvjax.model import forward, kl_divergence, log_probs
from kvjax.policies import get_policy

CRITERIA = ("kl", "kv_error", "random")


def roundtrip(fmt, x, kind: str):
    """What `fmt` stores for x [L, K, P, E] written at slots 0..P-1 in one chunk, read back
    (per-channel keys: the newest residual groups exact, the rest sealed), [L, K, P, E]."""
    L, K, P, E = x.shape
    store = fmt.init((1, 1, L * K, fmt.fit(P), E), kind)
    slots = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (1, L * K, P))
    store = fmt.write(store, 0, slots, x.reshape(1, L * K, P, E), kind)
    return fmt.read(store, 0, kind)[0, :, :P].reshape(L, K, P, E)


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "capacity"))
def _prefill(params, ids, cfg, batch: int, capacity: int):
    cache = init_cache(cfg, batch, get_policy("full"), get_format("f32"), capacity)
    tokens = jnp.broadcast_to(ids, (batch, ids.shape[0]))  # [B, P]
    _, cache = forward(params, tokens, cache, cfg, logits_at=jnp.zeros((batch,), jnp.int32))
    return cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def _continuation_logp(params, cache, cont, cfg):
    """log p of each continuation position [B, S, V] after the cache."""
    tokens = jnp.broadcast_to(cont, (cache.length.shape[0], cont.shape[0]))  # [B, S]
    logits, _ = forward(params, tokens, cache, cfg)
    return log_probs(logits)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _kl_of_units(params, cache, cont, ref_logp, kq, vq, onehot, cfg):
    """Mean KL(ref ‖ quantized) over the continuation, one batch row per unit: row b holds
    the quantized keys/values of the unit `onehot[:, b]` [L, K] and exact ones elsewhere."""
    sel = onehot[:, :, :, None, None]  # [L, B, K, 1, 1]
    f = cache.fmt  # f32: the values themselves
    k = jnp.where(sel, kq[:, None], f.values(cache.k, "k"))  # [L, B, K, C, E]
    v = jnp.where(sel, vq[:, None], f.values(cache.v, "v"))
    logp = _continuation_logp(
        params, cache.replace(k=f.holding(k, "k"), v=f.holding(v, "v")), cont, cfg)
    return jnp.mean(kl_divergence(ref_logp, logp), axis=-1)  # [1, S, V] vs [B, S, V] -> [B]


def unit_scores(params, cfg, ids, fmt, criterion: str, *, prefix: int, seed: int = 0,
                batch: int = 15) -> np.ndarray:
    """Scores [L, K] of quantizing each (layer, kv head) unit with `fmt` (higher: keep it);
    ids: calibration token ids, the first `prefix` written into the cache, the rest scored
    ("kl"). See the module docstring for the criteria."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion={criterion!r} is not one of {CRITERIA}")
    if isinstance(fmt, (Mixed, MixedUnits)):
        raise TypeError(f"unit_scores needs a plain base format, got kv_keep {fmt.options()}")
    ids = np.asarray(ids, np.int32)
    if not 0 < prefix < len(ids) or (criterion == "kl" and len(ids) - prefix < 1):
        raise ValueError(f"prefix={prefix} must leave tokens of the {len(ids)} ids to score "
                         "(0 < prefix < len(ids))")
    L, K = cfg.n_layers, cfg.n_kv_heads
    if criterion == "random":
        return np.random.default_rng(seed).random((L, K))
    capacity = len(ids)
    one = _prefill(params, jnp.asarray(ids[:prefix]), cfg, 1, capacity)
    k = one.fmt.values(one.k, "k")[:, 0]  # [L, K, C, E]; slots >= prefix are empty
    v = one.fmt.values(one.v, "v")[:, 0]
    pad = [(0, 0), (0, 0), (0, capacity - prefix), (0, 0)]
    kq = jnp.pad(roundtrip(fmt, k[:, :, :prefix], "k"), pad)  # [L, K, C, E]
    vq = jnp.pad(roundtrip(fmt, v[:, :, :prefix], "v"), pad)
    if criterion == "kv_error":
        def rel(a, b):
            return jnp.sum((a - b) ** 2, axis=(-2, -1)) / jnp.sum(b**2, axis=(-2, -1))

        return np.asarray(rel(kq, k) + rel(vq, v), np.float64)  # [L, K]
    cont = jnp.asarray(ids[prefix:])
    ref = _continuation_logp(params, one, cont, cfg)  # [1, S, V]
    cache = _prefill(params, jnp.asarray(ids[:prefix]), cfg, batch, capacity)
    units = np.arange(L * K)
    scores = np.zeros(L * K)
    for lo in range(0, L * K, batch):
        chunk = units[lo:lo + batch]
        onehot = np.zeros((L * K, batch), bool)
        onehot[chunk, np.arange(len(chunk))] = True  # padding rows quantize nothing
        kl = _kl_of_units(params, cache, cont, ref, kq, vq,
                          jnp.asarray(onehot.reshape(L, K, batch).transpose(0, 2, 1)), cfg)
        scores[chunk] = np.asarray(kl)[:len(chunk)]
    return scores.reshape(L, K)


def top_units(scores, n: int) -> tuple[tuple[int, int], ...]:
    """The n units with the highest scores [L, K], as (layer, head) pairs (ties: lower index
    first), for `keep_units`."""
    s = np.asarray(scores)
    if not 0 <= n <= s.size:
        raise ValueError(f"n={n} must be in 0..{s.size} (the model's units)")
    order = np.argsort(-s.reshape(-1), kind="stable")[:n]
    return tuple(sorted((int(u // s.shape[1]), int(u % s.shape[1])) for u in order))
