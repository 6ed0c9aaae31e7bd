"""Decode with attention bounded by the occupied slots against attention over every slot.

    python -m experiments.bench_bounded [--specs 128:h2o:int4:512 1024:h2o:int4:512 ...]
                                        [--steps 8] [--rounds 21] [--wait-idle SECONDS]
                                        [--out FILE]

`KVCache.attend` reads and scores a layer only up to the smallest of `cache.prefixes()` that
covers its occupied slots; `AllSlots` (experiments/bench_hf.py) reads every slot. Each spec
N:POLICY:FORMAT:CAPACITY prefills N tokens of the default text into both caches (the real
model, f32 weights, batch 1); every round times `--steps` greedy decode steps of each variant
of each spec (bench_hf's `time_decode`), rotating the order, so the two variants of a spec run
minutes apart at most. Per spec: both medians, the median of the per-round differences
(bounded - all slots) and in how many rounds the bounded step was faster. kvjax only; `bench_hf --kv-extra ...:all-slots` puts the
same variants beside HF, with fewer rounds than a ~1 ms difference needs on a noisy box.
`--out FILE` writes the table and, beside it, the figures as JSON.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from experiments.bench_hf import AllSlots, report, time_decode, timed_rounds
from kvjax.cache import KVCache
from kvjax.experiment import git_info
from kvjax.formats import get_format
from kvjax.generate import prefill, sample
from kvjax.loading import load_model
from kvjax.model import to_device
from kvjax.policies import get_policy
from kvjax.tasks.text import default_text, encode_prefix

DEFAULT_SPECS = ["100:h2o:int4:512", "128:h2o:int4:512", "1024:h2o:int4:512",
                 "128:full:f32:512", "1024:full:f32:1032"]
VARIANTS = {"bounded": KVCache, "all slots": AllSlots}


def parse_spec(spec: str) -> tuple[int, str, str, int]:
    """N:POLICY:FORMAT:CAPACITY -> (N, policy, format, capacity); ValueError names the spec."""
    parts = spec.split(":")
    if len(parts) != 4 or not parts[0].isdigit() or not parts[3].isdigit():
        raise ValueError(f"--specs {spec!r}: expected N:POLICY:FORMAT:CAPACITY with N and "
                         "CAPACITY positive integers, e.g. 128:h2o:int4:512")
    n, cap = int(parts[0]), int(parts[3])
    if n < 1 or cap < 1:
        raise ValueError(f"--specs {spec!r}: N and CAPACITY must be positive")
    return n, parts[1], parts[2], cap


def summarize(times: dict) -> list[dict]:
    """{(spec, variant): [seconds per round]} -> per spec: both medians, the median of the
    per-round differences (bounded - all slots) and the rounds in which bounded was faster."""
    out = []
    for spec in dict.fromkeys(s for s, _ in times):
        b, a = np.asarray(times[spec, "bounded"]), np.asarray(times[spec, "all slots"])
        out.append({"spec": spec, "bounded_s": float(np.median(b)),
                    "all_slots_s": float(np.median(a)),
                    "paired_diff_s": float(np.median(b - a)),
                    "bounded_faster": int(np.sum(b < a)), "rounds": len(b)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=DEFAULT_SPECS,
                    metavar="N:POLICY:FORMAT:CAPACITY")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per measurement")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="as bench_hf: wait for idle cores before each round, redo disturbed "
                         "rounds")
    ap.add_argument("--out", default=None, help="also write the table here (and FILE.json)")
    a = ap.parse_args(argv)
    try:
        specs = {s: parse_spec(s) for s in a.specs}
        for _, policy, fmt, cap in specs.values():  # names checked before the model loads
            get_policy(policy, budget=cap)
            get_format(fmt)
    except ValueError as e:
        ap.error(str(e))
    if a.steps < 1 or a.rounds < 1:
        ap.error("--steps and --rounds must be positive")

    cfg, np_params, tokenizer = load_model()
    params = to_device(np_params)
    ids = encode_prefix(tokenizer, default_text(), max(n for n, *_ in specs.values()))
    base, rng = {}, jax.random.PRNGKey(0)
    for spec, (n, policy, fmt, cap) in specs.items():
        pol = get_policy(policy, budget=cap)
        for name, cls in VARIANTS.items():
            logits, cache = prefill(params, [ids[:n]], cls.init(cfg, 1, pol, get_format(fmt),
                                                               cap), cfg)
            base[spec, name] = (sample(logits, rng), cache)

    def timed(key, steps):  # seconds per greedy decode step
        return time_decode(params, cfg, *base[key], steps, rng)[0]

    keys = list(base)
    for key in keys:  # compile, then one warm call each
        timed(key, 2)
        timed(key, 2)

    def one_round(r):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        got = {key: timed(key, a.steps) for key in order}
        return got, "; ".join(f"{s} {v} {got[s, v] * 1e3:.1f} ms" for s, v in keys)

    kept, others, discarded = timed_rounds(a.rounds, a.wait_idle, one_round)
    rows = summarize({key: [got[key] for got in kept] for key in keys})
    table = ("| decode step | bounded | all slots | bounded - all slots, per round (median) | "
             "rounds bounded was faster |\n|---|---:|---:|---:|---:|\n" + "\n".join(
                 f"| {r['spec']} | {r['bounded_s'] * 1e3:.2f} ms | {r['all_slots_s'] * 1e3:.2f} "
                 f"ms | {r['paired_diff_s'] * 1e3:+.2f} ms | {r['bounded_faster']} of "
                 f"{r['rounds']} |" for r in rows))
    head = (f"`python -m experiments.bench_bounded` ({', '.join(a.specs)}; N tokens cached, "
            f"policy, format, capacity), jax {jax.__version__}, {a.steps} decode steps per "
            f"measurement, medians of {len(kept)} interleaved rounds"
            + (f" ({discarded} discarded: other processes busy)" if discarded else "") + "\n\n")
    report(head + table, a.out, {
        "code": git_info(code_only=True), "steps": a.steps, "rows": rows, "other_cores": others,
        "other_cores_median": statistics.median([o for o in others if o is not None] or [0.0])})
    return rows


if __name__ == "__main__":
    main()
