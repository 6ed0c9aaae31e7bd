"""Throughput of a retrieval task (passkey, needle) at task.batch=1 vs larger batches.

    python -m experiments.bench_batch [--task passkey] [--batches 1 8] [--policy full]
                                      [--kv-dtype f32] [--rounds 2] [opt=value ...]

On the real model (`smollm2-135m`): each batch size runs the task once to compile, then
`--rounds` timed runs (median); the table gives prompts per second and the speed-up over the
first batch size, and the run stops if any batch size answers differently from the first (rows
must be identical: batching must not change results). Task options go as `key=value`
(defaults: passkey length=512 n_samples=8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from kvjax.experiment import ModelSpec, build_format, load
from kvjax.policies import get_policy
from kvjax.tasks import TaskContext, get_task
from kvjax.tasks.text import default_text

DEFAULTS = {"passkey": {"length": 512, "n_samples": 8}, "needle": {"lengths": [512],
                                                                   "n_samples": 2}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="passkey", choices=sorted(DEFAULTS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--policy", default="full")
    ap.add_argument("--kv-dtype", default="f32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("options", nargs="*", help="task options key=value (JSON values)")
    a = ap.parse_args(argv)
    if min(a.batches) < 1 or a.rounds < 1:
        ap.error("--batches and --rounds must be positive")
    opts = dict(DEFAULTS[a.task])
    for kv in a.options:
        k, _, v = kv.partition("=")
        opts[k] = json.loads(v) if v[:1] in "[{0123456789-tf" else v
    task = get_task(a.task, **opts)
    model = load(ModelSpec("smollm2-135m"))
    ctx = TaskContext(model.params, model.cfg, model.tokenizer, get_policy(a.policy),
                      build_format(a.kv_dtype, {}), task.seq_len(), default_text())
    rows, lines, base = None, [], None
    for b in a.batches:
        t = dataclasses.replace(task, batch=b)
        first = t.run(ctx)  # compiles this batch size's shapes
        times = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            res = t.run(ctx)
            times.append(time.perf_counter() - t0)
        if rows is None:
            rows = first.rows
        if res.rows != rows or first.rows != rows:
            raise SystemExit(f"batch={b} answers differ from batch={a.batches[0]}")
        sec = statistics.median(times)
        base = base or sec
        n = len(rows)
        lines.append(f"| {b} | {sec:.2f} s | {n / sec:.2f} | {base / sec:.2f}x |")
        print(lines[-1], flush=True)
    head = (f"{a.task} {json.dumps(opts)} ({len(rows)} prompts), policy {a.policy}, "
            f"kv {a.kv_dtype}; medians of {a.rounds} timed runs after a compiling one; answers "
            f"identical at every batch size\n\n| task.batch | time | prompts/s | speed-up |\n"
            "|---:|---:|---:|---:|\n")
    print(head + "\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
