"""Per-head budgets (`adakv`, a slot pool per layer) on the default model: bytes, quality at
equal bytes, how the heads' shares spread, and decode-step time, side by side in one run.

    python -m experiments.bench_adakv                          # ~8 min on 2 CPU cores
    python -m experiments.bench_adakv --only bytes speed
    python -m experiments.bench_adakv --tokens 2048 --budgets 64 128

Sections:

* `bytes`: real bytes of allocated caches (SmolLM2-135M shape, 2048 max tokens, batch 1) at
  each budget: the `adakv` pool, a fixed per-head cache of the same budget (`h2o`), and the
  full-length cache that masking-based per-head budgets (kvpress's AdaKV) keep in memory.
* `ppl`: perplexity of the first `--tokens` tokens of tests/data/text_ids.npy fed token by
  token (each token reads the evicted cache, as in decoding) under full, h2o, adakv (score
  acc), tova per head and adakv (score current) at each budget; the pairs hold the same bytes.
  Also the spread of the heads' slot shares at the end (adakv): per layer the largest and
  smallest share over the budget.
* `prompt`: the SnapKV setting: a `--prompt`-token prefix of the text is prefilled in chunks of
  64, the cache is compressed (`cache.compress`), then the next `--continue` tokens are fed
  token by token; ΔNLL of those tokens against the full cache, for h2o, adakv, snapkv and
  adasnapkv (Ada-SnapKV: SnapKV's scores, budgets allocated over all heads) at each budget.
* `speed`: decode-step time of adakv against h2o at equal budget after `--tokens` tokens,
  repetitions interleaved (real weights, batch 1).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_formats import TEXT_IDS, emit, header, load_real, stream_nll
from kvjax.cache import KVCache
from kvjax.formats import get_format
from kvjax.generate import decode_step, prefill
from kvjax.policies import get_policy
from kvjax.tasks.base import nll_chunk

SECTIONS = ("bytes", "ppl", "prompt", "speed")
WINDOW = 16  # every policy's protected recent window (per head)
PAIRS = (("h2o", {}), ("adakv", {"score_by": "acc"}), ("tova", {"per_head": True}),
         ("adakv", {"score_by": "current"}))
PROMPT_POLICIES = (("h2o", {}), ("adakv", {}), ("snapkv", {}), ("adasnapkv", {}))
_nll_step = jax.jit(nll_chunk, static_argnames=("cfg",), donate_argnames=("cache",))


def label(name: str, opts: dict) -> str:
    return name + "".join(f" {k}={v}" for k, v in opts.items())


def make(name: str, budget: int, opts: dict):
    return get_policy(name, budget=budget, window=WINDOW, **opts)


def section_bytes(cfg, budgets, max_len: int = 2048) -> list[str]:
    out = [f"### Cache bytes, SmolLM2-135M shape, {max_len} max tokens, batch 1 (allocated)", "",
           ("| budget / head | format | adakv pool (k+v / all) | h2o fixed (k+v / all) | "
           "masked full length (k+v) | pool / masked |"), "|---:|---|---:|---:|---:|---:|"]
    for b in budgets:
        for f in ("bf16", "int4"):
            fmt = get_format(f)
            pool = KVCache.init(cfg, 1, make("adakv", b, {}), fmt, max_len)
            fixed = KVCache.init(cfg, 1, make("h2o", b, {}), fmt, max_len)
            masked = KVCache.init(cfg, 1, get_policy("full"), fmt, max_len)
            out.append(f"| {b} | {f} | {pool.kv_nbytes():,} / {pool.nbytes():,} | "
                       f"{fixed.kv_nbytes():,} / {fixed.nbytes():,} | {masked.kv_nbytes():,} | "
                       f"{pool.kv_nbytes() / masked.kv_nbytes():.3f} |")
    return out


def shares(cache, budget: int) -> str:
    """max and min head share over the budget, averaged over the layers; max over layers."""
    s = np.asarray(cache.head_slots())[:, 0] / budget  # [L, K]
    return (f"{s.max(-1).mean():.2f} / {s.min(-1).mean():.2f} "
            f"(extremes {s.max():.2f} / {s.min():.2f})")


def section_ppl(cfg, params, budgets, tokens: int) -> list[str]:
    ids = np.load(TEXT_IDS)[:tokens]
    fmt = get_format("f32")
    base = None
    rows = []
    for budget in (None,) + tuple(budgets):
        runs = [("full", {})] if budget is None else PAIRS
        for name, opts in runs:
            policy = get_policy("full") if budget is None else make(name, budget, opts)
            t = time.perf_counter()
            got: dict = {}
            nll = stream_nll(params, cfg, ids, fmt, 1, policy=policy, final=got)
            ppl = float(np.exp(nll.astype(np.float64).mean()))
            base = ppl if base is None else base
            spread = shares(got["cache"], budget) if name == "adakv" else ""
            rows.append((budget or tokens, label(name, opts), ppl, 100 * (ppl / base - 1),
                         got["cache"].kv_nbytes(), spread))
            print(f"  ppl {budget} {label(name, opts)}: {ppl:.4f} ({rows[-1][3]:+.2f} %) "
                  f"{time.perf_counter() - t:.0f} s {spread}", flush=True)
    out = [(f"### Perplexity, {tokens} tokens of tests/data/text_ids.npy fed token by token, f32, "
            f"window {WINDOW} per head"), "",
           ("| budget / head | policy | PPL | ΔPPL vs full | k+v bytes | adakv head share "
           "max / min per layer (÷ budget) |"), "|---:|---|---:|---:|---:|---|"]
    out += [f"| {b} | {n} | {p:.4f} | {d:+.2f} % | {kv:,} | {s} |" for b, n, p, d, kv, s in rows]
    return out


def continuation_nll(params, cfg, ids: np.ndarray, policy, n_prompt: int):
    """Prefill ids[:n_prompt] (chunks of 64), compress, then feed the rest token by token:
    nll of ids[n_prompt + 1:] and the final cache."""
    cache = KVCache.init(cfg, 1, policy, get_format("f32"), len(ids))
    _, cache = prefill(params, [ids[:n_prompt].tolist()], cache, cfg, chunk=64)
    cache = cache.compress(len(ids) - n_prompt)
    nll = []
    for i in range(n_prompt, len(ids) - 1):
        out, cache = _nll_step(params, jnp.asarray(ids[None, i:i + 1]),
                               jnp.asarray(ids[None, i + 1:i + 2]), jnp.ones((1,), jnp.int32),
                               cache, cfg)
        nll.append(float(out[0, 0]))
    return np.asarray(nll), cache


def section_prompt(cfg, params, budgets, n_prompt: int, n_cont: int) -> list[str]:
    ids = np.load(TEXT_IDS)[:n_prompt + n_cont + 1]
    full, _ = continuation_nll(params, cfg, ids, get_policy("full"), n_prompt)
    rows = [("—", "full", full.mean(), 0.0, "")]
    for budget in budgets:
        for name, opts in PROMPT_POLICIES:
            t = time.perf_counter()
            nll, cache = continuation_nll(params, cfg, ids, make(name, budget, opts), n_prompt)
            spread = shares(cache, budget) if name.startswith("ada") else ""
            rows.append((budget, label(name, opts), nll.mean(), nll.mean() - full.mean(), spread))
            print(f"  prompt {budget} {label(name, opts)}: ΔNLL {rows[-1][3]:+.4f} "
                  f"{time.perf_counter() - t:.0f} s {spread}", flush=True)
    out = [(f"### Prompt of {n_prompt} tokens prefilled (chunks of 64) and compressed, then "
            f"{n_cont} tokens token by token (tests/data/text_ids.npy, f32, window {WINDOW} "
            "per head)"), "",
           ("| budget / head | policy | mean NLL | ΔNLL vs full | PPL ratio | head share "
            "max / min per layer (÷ budget) |"), "|---:|---|---:|---:|---:|---|"]
    out += [f"| {b} | {n} | {m:.4f} | {d:+.4f} | {np.exp(d):.3f}x | {s} |"
            for b, n, m, d, s in rows]
    return out


def section_speed(cfg, params, budget: int, tokens: int, reps: int) -> list[str]:
    ids = jnp.asarray(np.load(TEXT_IDS)[:tokens][None])
    fwd = jax.jit(lambda p, t, c: jax.lax.scan(
        lambda c, x: (decode_step.__wrapped__(p, x[None], c, cfg)[1], None), c, t[0])[0])
    labels, caches, times = [], {}, {}
    tok = jnp.zeros((1,), jnp.int32)
    for name, opts in PAIRS[:2]:
        key = label(name, opts)
        cache = fwd(params, ids, KVCache.init(cfg, 1, make(name, budget, opts),
                                              get_format("f32"), tokens + reps + 4))
        for _ in range(2):
            lg, cache = decode_step(params, tok, cache, cfg)
        lg.block_until_ready()
        labels.append(key)
        caches[key], times[key] = cache, []
    for _ in range(reps):
        for key in labels:
            t = time.perf_counter()
            lg, caches[key] = decode_step(params, tok, caches[key], cfg)
            lg.block_until_ready()
            times[key].append(time.perf_counter() - t)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    first = labels[0]
    out = [(f"### Decode-step time, budget {budget} per head, after {tokens} tokens "
            f"(real weights, batch 1, {reps} interleaved repetitions, median)"), "",
           f"| policy | step ms | / {first} |", "|---|---:|---:|"]
    out += [f"| {k} | {ms[k]:.1f} | {ms[k] / ms[first]:.2f}x |" for k in labels]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--budgets", nargs="+", type=int, default=[64])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (section prompt)")
    ap.add_argument("--continue", dest="cont", type=int, default=256,
                    help="tokens fed one by one after the compressed prompt (section prompt)")
    ap.add_argument("--out", help="also write the Markdown to this file")
    args = ap.parse_args(argv)
    for flag, value, least in (("--tokens", args.tokens, 2), ("--reps", args.reps, 1),
                               ("--prompt", args.prompt, 1), ("--continue", args.cont, 1)):
        if value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    # (cache length, budgets, policies) of each section: checked before the model loads
    sizes = {"bytes": (2048, args.budgets, (("adakv", {}), ("h2o", {}))),
             "ppl": (args.tokens, args.budgets, PAIRS),
             "prompt": (args.prompt + args.cont + 1, args.budgets, PROMPT_POLICIES),
             "speed": (args.tokens + args.reps + 4, args.budgets[:1], PAIRS[:2])}
    for section in args.only:
        max_len, budgets, policies = sizes[section]
        for b in budgets:
            for name, opts in policies:
                try:
                    make(name, b, opts).validate(max_len)
                except ValueError as e:
                    ap.error(f"--budgets {b} (section {section}): {e}")
    lines = [header("bench_adakv", argv)]
    cfg, params = load_real()
    if "bytes" in args.only:
        lines += section_bytes(cfg, args.budgets) + [""]
    if "ppl" in args.only:
        lines += section_ppl(cfg, params, args.budgets, args.tokens) + [""]
    if "prompt" in args.only:
        lines += section_prompt(cfg, params, args.budgets, args.prompt, args.cont) + [""]
    if "speed" in args.only:
        lines += section_speed(cfg, params, args.budgets[0], args.tokens, args.reps) + [""]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
