"""Score once, select many: a compress-mode passkey sweep with one prefill per point against one
prefill shared by every point, side by side in one run (the same prompts, policies, ratios).

    python -m experiments.bench_shared_prefill                       # 5 policies x 3 ratios
    python -m experiments.bench_shared_prefill --length 512 --samples 2 --rounds 1

Both arms run the passkey task's own prompts and scoring (`Passkey.run_many`): `separate` calls
it once per (policy, ratio), so each point prefills the prompts; `shared` calls it once with
every point, so `kvjax.generate.generate_many` prefills them once and each point selects from
that prefill. The answers must be identical (checked); the ratio is the wall-time speedup.
Rounds alternate the arms (this machine is shared and noisy); the first round compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from experiments.bench_formats import emit, header, load_real
from kvjax.formats import get_format
from kvjax.loading import load_tokenizer
from kvjax.policies import get_policy
from kvjax.tasks import TaskContext, get_task
from kvjax.tasks.text import default_text

POLICIES = ("snapkv", "tova", "knorm", "h2o", "streaming")
RATIOS = (0.25, 0.5, 0.75)


def points(ratios) -> list:
    """Every (policy, ratio) in compress mode, with rotated keys so all share one prefill."""
    extra = {"streaming": {"rope": "original"}}
    mode = {"snapkv": {}}
    return [get_policy(name, budget=None, ratio=r, **mode.get(name, {"mode": "compress"}),
                       **extra.get(name, {}))
            for name in POLICIES for r in ratios]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=1024, help="passkey prompt tokens")
    ap.add_argument("--samples", type=int, default=4, help="prompts per point (one batch)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds after the compile one")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    try:  # the task checks --length and --samples (its prompts: seed 0) before the model loads
        task = get_task("passkey", length=args.length, n_samples=args.samples, new_tokens=8)
        tokenizer = load_tokenizer("smollm2-135m")
        task.check_prompts(tokenizer, default_text(), 0)
    except ValueError as e:
        ap.error(str(e))

    cfg, params = load_real()
    ctx = TaskContext(params, cfg, tokenizer, get_policy("full"), get_format("f32"),
                      task.seq_len(), default_text())
    pols = points(RATIOS)
    times = {"separate": [], "shared": []}
    answers, acc = {}, {}
    for rnd in range(args.rounds + 1):
        for arm in ("separate", "shared") if rnd % 2 == 0 else ("shared", "separate"):
            t = time.perf_counter()
            if arm == "separate":
                res = [task.run(dataclasses.replace(ctx, policy=p)) for p in pols]
            else:
                res = task.run_many(ctx, pols)
            if rnd:
                times[arm].append(time.perf_counter() - t)
            answers[arm] = [[r["answer"] for r in x.rows] for x in res]
            if arm == "shared":
                acc = {p: r.metrics["accuracy"] for p, r in zip(pols, res)}
            print(f"round {rnd} {arm}: {time.perf_counter() - t:.1f} s", flush=True)
    assert answers["separate"] == answers["shared"], "shared prefill changed an answer"
    sep, sh = min(times["separate"]), min(times["shared"])
    lines = [header("bench_shared_prefill", argv),
             (f"### Passkey sweep, {len(POLICIES)} policies x {len(RATIOS)} ratios (compress "
              f"mode), {args.samples} prompts of {args.length} tokens, 8 new tokens, batch "
              f"{args.samples}; best of {args.rounds} interleaved rounds"), "",
             "| arm | prefills | wall s | speedup |", "|---|---:|---:|---:|",
             f"| one prefill per point (`Task.run`) | {len(pols)} | {sep:.1f} | 1.00x |",
             f"| one shared prefill (`Task.run_many`) | 1 | {sh:.1f} | {sep / sh:.2f}x |", "",
             "Answers identical in both arms (checked). Accuracy per point:", "",
             "| policy | " + " | ".join(f"ratio {r}" for r in RATIOS) + " |",
             "|---|" + "---:|" * len(RATIOS)]
    for name in POLICIES:
        row = [acc[p] for p in pols if p.name == name]
        lines.append(f"| {name} | " + " | ".join(f"{a:.2f}" for a in row) + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
