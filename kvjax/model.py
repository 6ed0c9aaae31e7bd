"""The functional decoder: params pytree + `forward(params, tokens, cache, cfg)`.

Prefill, decode (T = 1) and streaming perplexity are the same call on chunks of T >= 1 tokens.
Layers run under `jax.lax.scan`, so compile time does not grow with depth, over params whose
layer matrices are stacked [L, ...] (training, conversion) or split into one buffer per layer
(`split_layers`, what inference loads: the matmuls read them in place); then every layer's new
slots are stored in place at once. The model talks to the cache only through its protocol
(`begin`, `layer_view`, `attend`, `update`, `store_layers`, `finish`; see kvjax/cache.py),
so the dense `KVCache` and the paged `kvjax.paged.PagedCache` run the same code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import rms_norm
from kvjax.cache import KVCache
from kvjax.config import ModelConfig


def init_params(cfg: ModelConfig, key, scale: float = 0.02):
    """Random params (for tests and tiny models), same layout as the loaders produce."""
    L, D, H, K, E, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads,
                           cfg.head_dim, cfg.d_ff, cfg.vocab_size)
    shapes = {
        "wq": (L, D, H, E), "wk": (L, D, K, E), "wv": (L, D, K, E), "wo": (L, H, E, D),
        "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D),
    }
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {n: scale * jax.random.normal(k, s, jnp.float32) for (n, s), k in zip(shapes.items(), keys)}
    layers["attn_norm"] = 1.0 + 0.1 * jax.random.normal(keys[-1], (L, D))
    layers["mlp_norm"] = jnp.ones((L, D), jnp.float32)
    params = {"embed": jax.random.normal(keys[-2], (V, D)), "layers": layers,
              "final_norm": jnp.ones((D,), jnp.float32)}
    if not cfg.tie_embeddings:
        params["lm_head"] = scale * jax.random.normal(jax.random.fold_in(key, 7), (D, V))
    return params


def to_device(params, dtype=jnp.float32):
    """numpy params -> jax arrays of `dtype` (f32 on CPU: bf16 matmuls are slow there), the
    layers split into one buffer per layer (`split_layers`, on the host: views, no device op)."""
    host = split_layers(jax.tree.map(np.asarray, params))
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), host)


MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def split_layers(params):
    """Each layer matrix stacked as [L, ...] -> a tuple of L matrices [in, out] (wq [D, H·E],
    wo [H·E, D], ...), one buffer per layer (numpy in: views; arrays in: copies). Norm
    weights stay stacked. `forward` takes either layout.

    Why: inside the layer scan a stacked matrix's layer is a dynamic slice, and XLA:CPU copies
    it out before every matmul (a buffer has no views at a traced offset); a batch-1 decode step
    then moves each weight three times instead of reading it once. With one buffer per layer
    the scan picks the layer's matrix with `lax.switch`, and the matmul reads it in place
    (`python -m experiments.bench_decode_floor` measures both). Two-dimensional, so the switch's
    branches hold the matmuls alone (no reshapes, which XLA turns into a copy kernel per
    branch). Training and conversion work on the stacked layout (`stack_layers` undoes this).
    """
    def split(n, a):
        if n not in MATRICES or isinstance(a, tuple):
            return a
        rows = int(np.prod(a.shape[1:3 if n == "wo" else 2]))  # wo [H, E, D]: input H·E
        return tuple(a[i].reshape(rows, -1) for i in range(a.shape[0]))

    return {**params, "layers": {n: split(n, a) for n, a in params["layers"].items()}}


def stack_layers(params, cfg: ModelConfig):
    """The inverse of `split_layers` (a no-op on stacked params)."""
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    shape = {"wq": (-1, H, E), "wk": (-1, K, E), "wv": (-1, K, E), "wo": (H, E, -1)}

    def stack(n, a):
        if not isinstance(a, tuple):
            return a
        xp = np if isinstance(a[0], np.ndarray) else jnp
        return xp.stack([m.reshape(shape.get(n, m.shape)) for m in a])

    return {**params, "layers": {n: stack(n, a) for n, a in params["layers"].items()}}


def _dots(layers, layer, lo, hi, x, *names):
    """x [B, T, I] times the matrices `names` of layer `layer` (traced; in lo..hi-1, the group
    the scan runs), each [I, O] once flattened: a [B, T, O] per name. Stacked matrices are
    sliced; split ones are picked by a `lax.switch` whose branches hold only the matmuls."""
    B, T, I = x.shape
    x = x.reshape(B * T, I)
    ws = [layers[n] for n in names]
    if isinstance(ws[0], tuple):
        def branch(i, x):
            return tuple(jnp.dot(x, w[i]) for w in ws)  # [B·T, O]

        outs = jax.lax.switch(layer - lo, [functools.partial(branch, i) for i in range(lo, hi)], x)
    else:
        outs = tuple(jnp.dot(x, w[layer].reshape(I, -1)) for w in ws)
    return tuple(o.reshape(B, T, -1) for o in outs)


def _layer(cfg: ModelConfig, layers, lo, hi, x, pos_new, cache: KVCache, layer, fresh: bool):
    """One decoder layer (`layer` of the group lo..hi-1 that `cache` holds) over a chunk: the
    new residual stream and what to store where."""
    B, T, _ = x.shape
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = rms_norm(x, layers["attn_norm"][layer], cfg.norm_eps)  # [B, T, D]
    q, k, v = _dots(layers, layer, lo, hi, h, "wq", "wk", "wv")
    q = q.reshape(B, T, H, E)
    k, v = k.reshape(B, T, K, E), v.reshape(B, T, K, E)
    view = cache.layer_view(layer - lo, fresh)
    with jax.named_scope("attention"):  # RoPE at the cache's positions, then attention
        out, probs = cache.attend(view, q, k, v, pos_new, cfg.rope_theta)  # [B, T, H, E]
    with jax.named_scope("policy"):
        write = cache.update(view, k, v, pos_new, probs, cfg.rope_theta)
    x = x + _dots(layers, layer, lo, hi, out.reshape(B, T, H * E), "wo")[0]  # [B, T, D]
    h = rms_norm(x, layers["mlp_norm"][layer], cfg.norm_eps)
    gate, up = _dots(layers, layer, lo, hi, h, "w_gate", "w_up")  # [B, T, F]
    return x + _dots(layers, layer, lo, hi, jax.nn.silu(gate) * up, "w_down")[0], write


def forward(params, tokens, cache: KVCache, cfg: ModelConfig, n_valid=None, logits_at=None,
            fresh: bool = False):
    """Run a chunk through the model, attending over the cache, and store it through the policy.

    tokens: [B, T] int32; n_valid: [B] real tokens per row (the rest is right padding, never
    stored; default all T). Returns logits [B, T, V] (f32) and the new cache; with logits_at
    [B] (an index into T per row), only those logits, [B, 1, V]: prefill needs one position,
    and the [T, D] x [D, V] head is most of a chunk's work with a large vocabulary.
    fresh (static): the caller knows the cache holds no token yet (`prefill` checks lengths),
    so attention does not score its empty slots (the same result, without work that grows
    with the capacity).
    """
    B, T = tokens.shape
    t = jnp.arange(T, dtype=jnp.int32)
    n_valid = jnp.full((B,), T, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    cache = cache.begin(n_valid)
    pos_new = jnp.where(t[None] < n_valid[:, None], cache.length[:, None] + t[None], -1)  # [B, T]
    x = params["embed"][tokens]  # [B, T, D]

    # Per group of layers (one group unless the policy gives layers different budgets): a scan
    # that only reads the cache, then every layer's writes at once. Writing inside the scan
    # (reads and writes of one buffer with no data dependency between them) makes XLA copy the
    # whole stacked cache every layer; after it, every write is an in-place scatter, batched
    # over the layers where the layout and format allow (`store_layers`).
    done = []
    for lo, hi, seg in cache.segments():
        def body(x, layer, seg=seg, lo=lo, hi=hi):
            return _layer(cfg, params["layers"], lo, hi, x, pos_new, seg, layer, fresh)

        x, writes = jax.lax.scan(body, x, jnp.arange(lo, hi, dtype=jnp.int32))
        done.append(seg.store_layers(writes, pos_new))
    cache = cache.join(done)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # [B, 1, D]
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    if cfg.tie_embeddings:  # rows of the embedding: no transposed copy of [V, D] per call
        logits = jnp.einsum("BTD,VD->BTV", x, params["embed"])
    else:
        logits = jnp.einsum("BTD,DV->BTV", x, params["lm_head"])
    logits = logits.astype(jnp.float32)  # [B, T, V]
    return logits, cache.finish(n_valid)


forward_jit = jax.jit(forward, static_argnames=("cfg", "fresh"))
forward_jit.__doc__ = "`forward` compiled once per (cfg, shapes); the cache is not donated."


# Scores of next-token distributions over the vocabulary V. XLA:CPU (jax 0.10) fuses the head's
# matmul with log_softmax's max and subtraction into one YNNPACK fusion, and runs a sum over V
# with elementwise work around it as a slow YNNPACK reduction: for a 128-token chunk, the head
# alone 41 ms, with log_softmax + the target's entry 109 ms, the agreement task's two heads +
# KL 239 ms against 107 ms for the heads (experiments/bench_vocab_scores.py, docs/benchmarks.md
# "Session 22"). So: no [.., V] log-probabilities where one entry is needed (46 ms), and the
# KL's sum is a dot product (173 ms). Values as `jax.nn.log_softmax` computes them.


def log_normalizer(logits):
    """(max, log sum exp(logits - max)) over the last axis, each [..., 1]:
    log p = (logits - max) - log_sum, as `jax.nn.log_softmax` computes it."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    return m, jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True))


def log_probs(logits):
    """log-probabilities over the last axis (bit-equal to `jax.nn.log_softmax`)."""
    m, c = log_normalizer(logits)
    return (logits - m) - c


def token_nll(logits, targets):
    """-log p(target): logits [..., V], targets [...] int -> [...], without building the
    [..., V] log-probabilities (bit-equal to `log_softmax` then taking the target's entry)."""
    m, c = log_normalizer(logits)
    t = jnp.take_along_axis(logits, targets[..., None], axis=-1) - m
    return -(t - c)[..., 0]


def kl_divergence(ref_lp, lp):
    """KL(p_ref || p) over the last axis from log-probabilities [..., V] (broadcast against
    each other): sum p_ref (log p_ref - log p), summed as a dot product over V."""
    ref_lp, lp = jnp.broadcast_arrays(ref_lp, lp)
    return jnp.einsum("...V,...V->...", jnp.exp(ref_lp), ref_lp - lp)
