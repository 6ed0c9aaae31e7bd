"""Decode benchmark on the default model: prefill time, decode tokens/s, compile time, and the
speed-up of cached decode over recomputing the whole context for every new token.

    python -m experiments.bench_decode [--prompt 512] [--new 128] [--context 1024] [--reps 3]

Every ratio is measured side by side in one run (timings alternate between the variants), since
these machines are noisy. Prints a Markdown table; `--out FILE` also writes it.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache
from kvjax.formats import get_format
from kvjax.generate import decode_step, prefill, sample
from kvjax.loading import load_model
from kvjax.model import forward_jit, to_device
from kvjax.policies import get_policy
from kvjax.tasks.text import default_text, encode_prefix


def _time(fn, reps):
    """Best-of-reps wall time of fn() (fn must block)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registered model name or path "
                    "(default %(default)s)")
    ap.add_argument("--prompt", type=int, default=512,
                    help="tokens prefilled before the timed decode (default %(default)s)")
    ap.add_argument("--new", type=int, default=128,
                    help="decode steps after the prompt, the first one compiling; at least 2 "
                    "(default %(default)s)")
    ap.add_argument("--context", type=int, default=1024,
                    help="cached tokens of the cached-vs-recompute comparison "
                    "(default %(default)s)")
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions of each timing, best (or interleaved) taken "
                    "(default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    a = ap.parse_args(argv)
    for flag, value, least in (("--prompt", a.prompt, 1), ("--new", a.new, 2),
                               ("--context", a.context, 1), ("--reps", a.reps, 1)):
        if value < least:  # --new: the timed steps are new - 1
            ap.error(f"{flag} must be >= {least}, got {value}")

    cfg, params, tokenizer = load_model(a.model)
    params = to_device(params)
    ids = np.asarray(encode_prefix(tokenizer, default_text(),
                                   max(a.prompt, a.context) + a.new + 1))
    fmt, full = get_format("f32"), get_policy("full")
    max_len = a.prompt + a.new

    # prefill: first call = compile + run, then best of reps
    t = time.perf_counter()
    logits, cache = prefill(params, [ids[: a.prompt].tolist()], KVCache.init(cfg, 1, full, fmt, max_len), cfg)
    logits.block_until_ready()
    prefill_first = time.perf_counter() - t

    def run_prefill():
        lg, _ = prefill(params, [ids[: a.prompt].tolist()], KVCache.init(cfg, 1, full, fmt, max_len), cfg)
        lg.block_until_ready()

    prefill_s = _time(run_prefill, a.reps)

    # decode: the first step compiles; then a.new steps timed (greedy, as `generate` runs it)
    key = jax.random.PRNGKey(0)
    tok = sample(logits, key)
    t = time.perf_counter()
    logits, cache = decode_step(params, tok, cache, cfg)
    logits.block_until_ready()
    first_step = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(a.new - 1):
        tok = sample(logits, key)
        logits, cache = decode_step(params, tok, cache, cfg)
    logits.block_until_ready()
    step_s = (time.perf_counter() - t) / (a.new - 1)
    compile_s = first_step - step_s

    # cached decode vs recompute without a cache at `context` tokens, alternating
    ctx = a.context
    _, ctx_cache = prefill(params, [ids[:ctx].tolist()], KVCache.init(cfg, 1, full, fmt, ctx + 8), cfg)
    ctx_tok = jnp.asarray(ids[ctx: ctx + 1])
    recompute_ids = jnp.asarray(ids[None, : ctx + 1])

    def cached():
        nonlocal ctx_cache
        lg, ctx_cache = decode_step(params, ctx_tok, ctx_cache, cfg)
        ctx_cache = ctx_cache.replace(length=ctx_cache.length - 1)  # stay at `ctx` tokens
        lg.block_until_ready()

    one_slot = get_policy("window", budget=1)  # attention covers only the chunk itself

    def recompute():
        lg, _ = forward_jit(params, recompute_ids, KVCache.init(cfg, 1, one_slot, fmt, ctx + 1), cfg)
        lg[:, -1].block_until_ready()

    cached(), recompute()  # compile both
    t_cached, t_recompute = [], []
    for _ in range(a.reps):
        t_cached.append(_time(cached, 3))
        t_recompute.append(_time(recompute, 1))
    speedup = min(t_recompute) / min(t_cached)

    rows = [
        ("machine", (f"{platform.processor() or platform.machine()}, {jax.device_count()} "
                    f"{jax.default_backend()} device(s), jax {jax.__version__}")),
        ("prefill, first call (compile + run)", f"{prefill_first:.2f} s"),
        (f"prefill {a.prompt} tokens", f"{prefill_s:.2f} s ({a.prompt / prefill_s:.0f} tokens/s)"),
        ("decode-step compile", f"{compile_s:.2f} s"),
        (f"decode (batch 1, f32, {a.prompt}+{a.new} tokens)", (f"{1 / step_s:.1f} tokens/s "
                                                              f"({step_s * 1e3:.0f} ms/step)")),
        (f"cached decode step at {ctx} tokens", f"{min(t_cached) * 1e3:.0f} ms"),
        (f"recompute {ctx + 1} tokens without a cache", f"{min(t_recompute) * 1e3:.0f} ms"),
        (f"cached speed-up at {ctx} context", f"{speedup:.1f}x"),
    ]
    table = "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    return rows


if __name__ == "__main__":
    main()
