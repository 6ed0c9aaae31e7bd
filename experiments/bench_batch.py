"""Throughput of a retrieval task (passkey, needle) at task.batch=1 vs larger batches.

    python -m experiments.bench_batch [--task passkey] [--batches 1 8] [--policy full]
                                      [--kv-dtype f32] [--rounds 3] [--wait-idle 30]
                                      [--out FILE.md] [opt=value ...]

On the real model (`smollm2-135m`): each batch size runs the task once to compile, then
`--rounds` interleaved rounds time every batch size in turn (these machines are noisy, so the
ratios of one round are side by side). The table gives medians, prompts per second, the
speed-up over the first batch size and the median of each round's own speed-up. The run stops
if any batch size answers differently from the first (rows must be identical: batching must
not change results). Task options go as `key=value` (defaults: passkey length=512
n_samples=8). `--out FILE.md` also writes FILE.json with the medians.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import time

import jax

import kvjax.generate
from experiments.bench_hf import report, timed_rounds
from kvjax.experiment import ModelSpec, build_format, git_info, load, load_tokenizer
from kvjax.policies import get_policy
from kvjax.tasks import TaskContext, get_task
from kvjax.tasks.text import default_text

DEFAULTS = {"passkey": {"length": 512, "n_samples": 8}, "needle": {"lengths": [512],
                                                                   "n_samples": 2}}

MODEL = ModelSpec("smollm2-135m")

PHASES = {"start": "prefill", "decode": "decode"}


def time_phases(spent: dict) -> None:
    """Wrap `kvjax.generate.start` and `decode` (which `generate` looks up at each call) so
    that the seconds each takes, up to its results being ready, add up in `spent`."""
    def timer(f, phase):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(*args, **kw))
            spent[phase] += time.perf_counter() - t0
            return out
        return timed

    for name, phase in PHASES.items():
        setattr(kvjax.generate, name, timer(getattr(kvjax.generate, name), phase))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="passkey", choices=sorted(DEFAULTS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--policy", default="full")
    ap.add_argument("--kv-dtype", default="f32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wait-idle", type=float, default=0.0,
                    help="wait up to this many s for idle cores before each round; redo busy ones")
    ap.add_argument("--out", default=None, help="also write the Markdown here (and FILE.json)")
    ap.add_argument("options", nargs="*", help="task options key=value (JSON values)")
    a = ap.parse_args(argv)
    if min(a.batches) < 1 or a.rounds < 1:
        ap.error("--batches and --rounds must be positive")
    opts = dict(DEFAULTS[a.task])
    try:  # the task (and its prompts: seed 0), policy and format, before the model loads
        for kv in a.options:
            k, eq, v = kv.partition("=")
            if not (k and eq):
                raise ValueError(f"task option {kv!r} is not key=value")
            try:
                opts[k] = json.loads(v) if v[:1] in "[{0123456789-tf" else v
            except json.JSONDecodeError as e:
                raise ValueError(f"task option {kv!r}: {v!r} is not JSON ({e})") from None
        task = get_task(a.task, **opts)
        policy, fmt = get_policy(a.policy), build_format(a.kv_dtype, {})
        task.check_prompts(load_tokenizer(MODEL), default_text(), 0)
    except (TypeError, ValueError) as e:  # ConfigError is a ValueError
        ap.error(str(e))
    model = load(MODEL)
    ctx = TaskContext(model.params, model.cfg, model.tokenizer, policy, fmt, task.seq_len(),
                      default_text())
    tasks = {b: dataclasses.replace(task, batch=b) for b in a.batches}
    spent = collections.Counter()
    time_phases(spent)
    rows = None
    for b, t in tasks.items():  # the first run compiles this batch size's shapes
        got = t.run(ctx).rows
        rows = got if rows is None else rows
        if got != rows:
            raise SystemExit(f"batch={b} answers differ from batch={a.batches[0]}")

    def one_round(_):
        secs, phases = {}, {}
        for b, t in tasks.items():
            spent.clear()
            t0 = time.perf_counter()
            res = t.run(ctx)
            secs[b] = time.perf_counter() - t0
            phases[b] = dict(spent)
            if res.rows != rows:
                raise SystemExit(f"batch={b} answers differ from batch={a.batches[0]}")
        return (secs, phases), "  ".join(f"batch {b}: {s:.2f} s" for b, s in secs.items())

    kept, others, discarded = timed_rounds(a.rounds, a.wait_idle, one_round)
    phases = [p for _, p in kept]
    kept = [s for s, _ in kept]
    first, n = a.batches[0], len(rows)
    base = statistics.median(r[first] for r in kept)
    summary, lines = {}, []
    for b in a.batches:
        sec = statistics.median(r[b] for r in kept)
        speed = statistics.median(r[first] / r[b] for r in kept)
        split = {ph: statistics.median(p[b][ph] for p in phases) for ph in PHASES.values()}
        summary[b] = {"seconds": sec, "prompts_per_s": n / sec, "speedup": base / sec,
                      "speedup_per_round": speed, **{f"{k}_s": v for k, v in split.items()}}
        lines.append(f"| {b} | {sec:.2f} s | {split['prefill']:.2f} s | {split['decode']:.2f} s "
                     f"| {n / sec:.2f} | {summary[b]['speedup']:.2f}x | {speed:.2f}x |")
    busy = [o for o in others if o is not None]
    load_note = (f"; other processes {min(busy):.2f}-{max(busy):.2f} cores" if busy else "")
    text = (f"{a.task} {json.dumps(opts)} ({n} prompts), policy {a.policy}, kv {a.kv_dtype}; "
            f"medians of {len(kept)} interleaved rounds after a compiling run ({discarded} "
            f"discarded as busy{load_note}); answers identical at every batch size\n\n"
            "| task.batch | time | prefill | decode | prompts/s | speed-up | "
            "per-round speed-up, median |\n|---:|---:|---:|---:|---:|---:|---:|\n"
            + "\n".join(lines))
    report(text, a.out, {"code": git_info(code_only=True), "task": a.task, "options": opts,
                         "policy": a.policy, "kv_dtype": a.kv_dtype, "rounds": len(kept),
                         "batches": {str(b): v for b, v in summary.items()}})
    return summary


if __name__ == "__main__":
    main()
