"""Would an online-softmax (flash-style) attention speed up a long prefill on XLA:CPU?

    python -m experiments.bench_attention_blocks [--tokens 2048] [--reps 7] [--prefill 512 2048]

One layer's attention of a fresh prompt (SmolLM2-135M's shape: 3 kv heads x 3 query heads,
head dim 64, causal, no cache), interleaved, medians:

* `kvjax.attention.attention` as the prefill runs it: per block of 256 queries, one softmax
  over the keys up to the block ([K, G, 256, <= T] score blocks); its probabilities, which only
  scoring policies read, unused (XLA drops them);
* an online softmax over key blocks (flash attention's recurrence in XLA ops: per query block a
  running max, denominator and output, rescaled per key block), for several query x key block
  sizes: it never holds more than one [K, G, bq, bk] score block;
* the two matmuls alone (scores and the value product over kvjax's causal blocks, no softmax).

`--prefill N ...` then times the real model's whole prefill of N tokens of the default text
into an empty `full` f32 cache (one chunk, as `generate.prefill` runs a prompt): kvjax's
attention against the online softmax (`--prefill-blocks`, 256x256) swapped in, logits checked
equal.
Outputs of every attention variant are checked against kvjax's before timing.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_formats import emit, header
from kvjax.attention import MASKED, _sum_groups, attention

K, G, E, LAYERS = 3, 3, 64, 30  # SmolLM2-135M
GROUP_SUM_SHAPES = ("128x384", "256x512", "512x1536")  # --group-sum's default TxS


def online_softmax(bq: int, bk: int, q, k, v, pos):
    """Causal attention of q [B, T, H, E] over k, v [B, T, K, E] at positions pos [B, T]
    (increasing, -1 = padding after the tokens) by an online softmax over key blocks of `bk`,
    per query block of `bq`: out [B, T, H, E] (zero for padding queries)."""
    B, T, H, _ = q.shape
    Kv = k.shape[2]
    qk = jnp.transpose(q.reshape(B, T, Kv, H // Kv, E), (0, 2, 3, 1, 4)) * E**-0.5  # [B,K,G,T,E]
    kn, vn = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, E]
    outs = []
    for t0 in range(0, T, bq):
        t1 = min(T, t0 + bq)
        qb, pq = qk[:, :, :, t0:t1], pos[:, t0:t1]  # [B, K, G, t, E], [B, t]
        m = jnp.full(qb.shape[:-1], MASKED)  # [B, K, G, t] running max
        den = jnp.zeros(qb.shape[:-1])  # running denominator
        acc = jnp.zeros(qb.shape)  # [B, K, G, t, E] running output
        for s0 in range(0, t1, bk):
            s1 = min(t1, s0 + bk)
            s = jnp.einsum("BKGTE,BKSE->BKGTS", qb, kn[:, :, s0:s1])  # [B, K, G, t, s]
            if s1 > t0 + 1:  # keys after a query (or padding) only from the block's first one
                pk = pos[:, s0:s1]
                ok = (pk[:, None, :] <= pq[:, :, None]) & (pk[:, None, :] >= 0)  # [B, t, s]
                s = jnp.where(ok[:, None, None], s, MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            scale = jnp.exp(m - m_new)
            e = jnp.exp(s - m_new[..., None])
            den = den * scale + jnp.sum(e, axis=-1)
            acc = acc * scale[..., None] + jnp.einsum("BKGTS,BKSE->BKGTE", e, vn[:, :, s0:s1])
            m = m_new
        outs.append(acc * jnp.where(pq >= 0, 1.0, 0.0)[:, None, None, :, None] / den[..., None])
    out = jnp.concatenate(outs, axis=3)  # [B, K, G, T, E]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, H, E)


def online_attention(bq: int, bk: int):
    """`kvjax.attention.attention` for a prompt's first chunk (an empty cache) by the online
    softmax with bq x bk blocks. Its probabilities are zeros: only for policies that read none
    (`full`), swapped in by `prefill_ab`."""
    return functools.partial(_online_attention, bq, bk)


def _online_attention(bq, bk, q, k_new, v_new, pos_new, k_cache, v_cache, pos_cache,
                      cache_empty=False):
    if not cache_empty:
        raise ValueError("online_attention serves a fresh prefill only (cache_empty=True)")
    B, T, _, _ = q.shape
    probs = jnp.zeros((B, k_new.shape[2], T, k_cache.shape[2] + T), jnp.float32)
    return online_softmax(bq, bk, q, k_new, v_new, pos_new).astype(q.dtype), probs


def matmuls_only(block: int):
    """The two attention matmuls over the causal query blocks of `attention` (no softmax)."""

    @jax.jit
    def run(q, k, v):
        B, T = q.shape[:2]
        qk = jnp.transpose(q.reshape(B, T, K, G, E), (0, 2, 3, 1, 4))  # [B, K, G, T, E]
        kn, vn = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, E]
        outs = []
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            s = jnp.einsum("BKGTE,BKSE->BKGTS", qk[:, :, :, t0:t1], kn[:, :, :t1])
            outs.append(jnp.einsum("BKGTS,BKSE->BKGTE", s, vn[:, :, :t1]))
        return jnp.concatenate(outs, axis=3)

    return run


def interleaved(fns: dict, args, reps: int) -> dict[str, float]:
    """Median seconds of each function, called in turns (the order flips every round)."""
    times: dict[str, list[float]] = {n: [] for n in fns}
    for r in range(reps):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(fns[name](*args))
            times[name].append(time.perf_counter() - t)
    return {n: float(np.median(ts)) for n, ts in times.items()}


def prefill_ab(tokens: list[int], reps: int, blocks: tuple[int, int]) -> list[str]:
    """The real model's prefill of `tokens` into an empty `full` f32 cache with kvjax's
    attention and with `online_attention` (`blocks`: (queries, keys)) in its place,
    interleaved (logits checked first)."""
    import kvjax.cache as cache_mod
    from experiments.bench_formats import load_real
    from kvjax.formats import get_format
    from kvjax.model import forward
    from kvjax.policies import get_policy

    cfg, params = load_real()
    T = len(tokens)
    toks = jnp.asarray([tokens], jnp.int32)
    cache = cache_mod.init_cache(cfg, 1, get_policy("full"), get_format("f32"), T)
    last = jnp.asarray([T - 1], jnp.int32)
    kvjax_attn, fns, logits = cache_mod.attention, {}, {}
    bq, bk = blocks
    online = f"online softmax, {bq} x {bk} blocks"
    for name, attn in [("kvjax.attention", kvjax_attn), (online, online_attention(bq, bk))]:
        fn = jax.jit(lambda p, t, c: forward(p, t, c, cfg, logits_at=last, fresh=True)[0])
        cache_mod.attention = attn  # read while the program is traced, on this first call
        try:
            logits[name] = fn(params, toks, cache)
        finally:
            cache_mod.attention = kvjax_attn
        fns[name] = fn
    err = float(jnp.max(jnp.abs(logits["kvjax.attention"] - logits[online])))
    if err > 1e-3:
        raise SystemExit(f"prefill logits differ by {err:.2e}")
    med = interleaved(fns, (params, toks, cache), reps)
    base = med["kvjax.attention"]
    lines = ["", (f"### SmolLM2-135M prefill of {T} tokens, f32, `full` cache, one chunk "
                  f"({reps} interleaved repetitions, median; logits max |diff| {err:.1e})"), "",
             "| attention | s | speed vs kvjax |", "|---|---:|---:|"]
    lines += [f"| {n} | {t:.2f} | {base / t:.2f}x |" for n, t in med.items()]
    return lines


def group_sum(shapes: list[tuple[int, int]], reps: int) -> list[str]:
    """The probabilities scoring policies read, summed over the G query heads of each kv group
    ([B, K, G, T, S] -> [B, K, T, S]), as one reduce over that middle axis and as
    `kvjax.attention._sum_groups`'s G - 1 adds (results checked equal first)."""
    lines = ["", (f"### Attention probabilities summed over the {G} query heads of a kv group "
                  f"({reps} interleaved repetitions, median, ms per layer)"), "",
             "| [B, K, G, T, S] | reduce over G | adds (kvjax) | speed-up |", "|---|---:|---:|---:|"]
    rng = np.random.default_rng(0)
    for T, S in shapes:
        x = jnp.asarray(rng.random((1, K, G, T, S)), jnp.float32)
        fns = {"reduce": jax.jit(lambda x: jnp.sum(x * 0.5, axis=2)),
               "adds": jax.jit(lambda x: _sum_groups(x * 0.5))}
        err = float(jnp.max(jnp.abs(fns["reduce"](x) - fns["adds"](x))))
        if err > 1e-5:
            raise SystemExit(f"group sums differ by {err:.2e}")
        med = interleaved(fns, (x,), reps)
        lines.append(f"| [1, {K}, {G}, {T}, {S}] | {1e3 * med['reduce']:.2f} | "
                     f"{1e3 * med['adds']:.2f} | {med['reduce'] / med['adds']:.2f}x |")
    return lines


def pair(flag: str, form: str, text: str) -> tuple[int, int]:
    """"256x512" -> (256, 512); anything but two positive integers joined by x is a ValueError
    naming `flag` and its `form` ("QxK")."""
    try:
        a, b = (int(v) for v in text.split("x"))
    except ValueError:
        a = b = 0
    if a < 1 or b < 1:
        raise ValueError(f"{flag} takes {form}, two positive integers joined by x (e.g. "
                         f"256x512), got {text!r}")
    return a, b


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--blocks", nargs="+", default=["256x256", "512x512", "128x256"], metavar="QxK",
                    help="online-softmax query x key block sizes")
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="also time the real model's prefill of these many tokens")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--prefill-blocks", default="256x256", metavar="QxK",
                    help="query x key blocks of the online softmax in --prefill")
    ap.add_argument("--group-sum", nargs="*", metavar="TxS", default=None,
                    help="only time the group sum of T queries' probabilities over S keys "
                         "(default shapes: a 128-token chunk over a 256-slot cache, a 256-token "
                         "prompt, a 512-token chunk over 1024 slots)")
    ap.add_argument("--out", help="also write the Markdown to this file")
    args = ap.parse_args(argv)
    for flag, values in (("--tokens", [args.tokens]), ("--reps", [args.reps]),
                         ("--prefill", args.prefill), ("--prefill-reps", [args.prefill_reps])):
        bad = [v for v in values if v < 1]
        if bad:
            ap.error(f"{flag} must be >= 1, got {bad[0]}")
    try:  # every size before any timing
        blocks = [pair("--blocks", "QxK", b) for b in args.blocks]
        prefill_blocks = pair("--prefill-blocks", "QxK", args.prefill_blocks)
        shapes = None if args.group_sum is None else [pair("--group-sum", "TxS", s) for s in
                                                      args.group_sum or GROUP_SUM_SHAPES]
    except ValueError as e:
        ap.error(str(e))
    if shapes is not None:
        emit([header("bench_attention_blocks", argv), *group_sum(shapes, args.reps)], args.out)
        return
    T = args.tokens
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, T, K * G, E)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, T, K, E)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, T, K, E)), jnp.float32)
    empty_k = jnp.zeros((1, K, 1, E), jnp.float32)
    empty_pos = jnp.full((1, K, 1), -1, jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    ours = "kvjax.attention (probabilities unused)"
    variants = {ours: jax.jit(
        lambda q, k, v: attention(q, k, v, pos, empty_k, empty_k, empty_pos, True)[0])}
    for bq, bk in blocks:
        variants[f"online softmax, blocks {bq} queries x {bk} keys"] = jax.jit(
            lambda q, k, v, bq=bq, bk=bk: online_softmax(bq, bk, q, k, v, pos))
    ref = variants[ours](q, k, v)
    for name, f in variants.items():
        err = float(jnp.max(jnp.abs(f(q, k, v) - ref)))
        if err > 1e-4:
            raise SystemExit(f"{name}: max |diff| {err:.2e} from kvjax.attention")
    floor = "the two matmuls alone (blocks of 256 queries)"
    variants[floor] = matmuls_only(256)
    jax.block_until_ready(variants[floor](q, k, v))
    med = interleaved(variants, (q, k, v), args.reps)
    lines = [header("bench_attention_blocks", argv),
             (f"### One layer's attention of a {T}-token prompt ({K} kv heads x {G}, head dim "
              f"{E}, causal; {args.reps} interleaved repetitions, median)"), "",
             f"| variant | ms per layer | x {LAYERS} layers | speed vs kvjax |",
             "|---|---:|---:|---:|"]
    lines += [f"| {n} | {1e3 * t:.1f} | {LAYERS * t:.2f} s | {med[ours] / t:.2f}x |"
              for n, t in med.items()]
    if args.prefill:
        from kvjax.loading import load_tokenizer
        from kvjax.tasks.text import default_text, encode_prefix

        tok = load_tokenizer("smollm2-135m")
        for n in args.prefill:
            lines += prefill_ab(encode_prefix(tok, default_text(), n), args.prefill_reps,
                                prefill_blocks)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
