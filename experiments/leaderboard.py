"""A leaderboard like kvpress's RULER one: average score per policy x compression ratio, with
the full cache as the reference line (one table, one plot).

    python -m experiments.leaderboard run --data data/ruler_4k.jsonl --name ruler_4k
    python -m experiments.report --leaderboard ruler_4k      # or: experiments.leaderboard show

`run` plans every (policy, ratio) point of `task=qa task.file=DATA` in compress mode (kvpress's
setting) plus the full cache, as the sweep NAME, and executes them through the normal harness
with one prefill per batch of samples for all the policies that can share it
(`kvjax.experiment.execute_shared`). `leaderboard` reads the store's records of sweep NAME:
rows are policies, columns the ratios, cells the task's `score` (RULER: string_match_all
averaged over categories) in percent, as kvpress's leaderboard prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvjax.results import ResultsStore

RATIOS = (0.25, 0.5, 0.75)
POLICIES = ("random", "knorm", "streaming", "tova", "snapkv", "h2o")
FULL = "full"


def specs(data: str, name: str, policies, ratios, *, model: str = "smollm2-135m",
          max_new_tokens: int = 32, batch: int = 4, query_aware: bool = False,
          results: str = "results/results.jsonl"):
    """The RunSpecs of a leaderboard: the full cache, then every policy x ratio (compress)."""
    from kvjax.experiment import ModelSpec, RunSpec, SpeedSpec
    from kvjax.tasks import get_task

    task = get_task("qa", file=data, max_new_tokens=max_new_tokens, batch=batch,
                    query_aware=query_aware)
    common = {"task": task, "model": ModelSpec(model), "sweep": name, "results": results,
                  "speed": SpeedSpec(prompt=0, new_tokens=0)}
    out = [RunSpec(policy=FULL, **common)]
    out += [RunSpec(policy=p, policy_options=(("mode", "compress"),), ratio=r, **common)
            for p in policies for r in ratios]
    return out


def run(data: str, name: str, policies=POLICIES, ratios=RATIOS, echo=print, **options) -> float:
    """Plan and execute a leaderboard (points already stored are skipped); its wall seconds."""
    from kvjax.experiment import execute_shared, plan

    t = time.perf_counter()
    plans = [plan(s) for s in specs(data, name, policies, ratios, **options)]
    root = Path("outputs") / "leaderboard" / name
    dirs = [root / f"{p.policy.name}_r{p.policy.ratio}_{p.key}" for p in plans]
    execute_shared(plans, dirs, echo)
    return time.perf_counter() - t


def table(records: list[dict]) -> tuple[dict, dict, float | None, dict]:
    """({policy: {ratio: score %}}, {policy: {ratio: n_samples}}, the full cache's score %,
    {policy or FULL: {ratio: standard error %}}) from the records of one sweep (the last record
    of each key counts)."""
    latest = {r["key"]: r for r in records}
    cells: dict = defaultdict(dict)
    counts: dict = defaultdict(dict)
    errors: dict = defaultdict(dict)
    full = None
    for r in latest.values():
        pol = r["point"]["policy"]
        score, se = 100 * r["metrics"]["value"], record_se(r)
        if se is not None:
            errors[pol["name"]][pol.get("ratio")] = se  # the full cache's ratio is None
        if pol["name"] == FULL:
            full = score
            continue
        cells[pol["name"]][pol.get("ratio")] = score
        counts[pol["name"]][pol.get("ratio")] = r["metrics"].get("n_samples")
    return dict(cells), dict(counts), full, dict(errors)


def record_se(record: dict) -> float | None:
    """The standard error (percentage points) of a qa record's score: stored with it
    (`metrics.score_se`), else computed from the per-sample scores beside it (samples.json);
    None when neither is there or a category has one sample."""
    from kvjax.tasks.qa import QA, score_se

    se = record["metrics"].get("score_se")
    if se is None:
        path = Path(record.get("run_dir") or "") / "samples.json"
        if not path.is_file():
            return None
        scorer = record["point"]["task"].get("scorer") or QA.scorer
        se = score_se(json.loads(path.read_text()), scorer)
    return None if se is None else 100 * se


def markdown(cells: dict, full: float | None, ratios, errors: dict | None = None) -> str:
    """The table: a row per policy (sorted by its mean score), a column per ratio; a cell is
    `score ± standard error` where `errors` has it."""
    errors = errors or {}
    fmt = lambda v, e: f"{v:.1f}" if e is None else f"{v:.1f} ± {e:.1f}"
    head = "| policy | " + " | ".join(f"ratio {r}" for r in ratios) + " | mean |"
    lines = [head, "|" + "---|" * (len(ratios) + 2)]
    if full is not None:
        f = fmt(full, errors.get(FULL, {}).get(None))
        lines.append("| full cache | " + " | ".join(f for _ in ratios) + f" | {full:.1f} |")
    mean = lambda row: sum(row.get(r, 0.0) for r in ratios) / len(ratios)
    for name, row in sorted(cells.items(), key=lambda kv: -mean(kv[1])):
        vals = [fmt(row[r], errors.get(name, {}).get(r)) if r in row else "–" for r in ratios]
        lines.append(f"| {name} | " + " | ".join(vals) + f" | {mean(row):.1f} |")
    return "\n".join(lines)


def plot(cells: dict, full: float | None, ratios, path: Path, title: str,
         errors: dict | None = None) -> None:
    """Score against compression ratio, a line per policy (with standard-error bars where
    known), the full cache dashed (kvpress's leaderboard plot)."""
    errors = errors or {}
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, row in sorted(cells.items()):
        xs = [r for r in ratios if r in row]
        err = [errors.get(name, {}).get(r) for r in xs]
        ax.errorbar(xs, [row[r] for r in xs], yerr=None if None in err else err, marker="o",
                    capsize=3, label=name)
    if full is not None:
        ax.axhline(full, color="black", linestyle="--", label="full cache")
    ax.set_xlabel("compression ratio (fraction of the context removed)")
    ax.set_ylabel("average score (%)")
    ax.set_xticks(list(ratios))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def leaderboard(store: str, name: str, out: str | None = None, ratios=RATIOS,
                echo=print) -> dict:
    """Write leaderboard.md and leaderboard.png of sweep `name` into `out` (default
    reports/leaderboard_NAME); a sweep with no qa records is a ValueError."""
    records, _ = ResultsStore(store).read()
    records = [r for r in records if r.get("sweep") == name
               and r["point"]["task"]["name"] == "qa"]
    if not records:
        raise ValueError(f"no task=qa records of sweep {name!r} in {store} (run "
                         f"`python -m experiments.leaderboard run --name {name} --data ...`)")
    files = {str((r["point"]["task"].get("file") or {}).get("sha256")) for r in records}
    if len(files) > 1:
        raise ValueError(f"sweep {name!r} mixes {len(files)} data files; one leaderboard reads "
                         "one file")
    models = {r["point"]["model"]["name"] for r in records}
    cells, counts, full, errors = table(records)
    n = next(iter(next(iter(counts.values())).values())) if counts else None
    d = Path(out or f"reports/leaderboard_{name}")
    d.mkdir(parents=True, exist_ok=True)
    title = f"{name}: {', '.join(sorted(models))}, compress mode"
    plot(cells, full, ratios, d / "leaderboard.png", title, errors)
    text = (f"# Leaderboard {name}\n\n{title}; average score (%) over categories, "
            f"{n} samples per point; ± one standard error of the score over the samples (bars "
            f"in the plot). Data file sha256: {min(files)}\n\n"
            f"![leaderboard](leaderboard.png)\n\n{markdown(cells, full, ratios, errors)}\n")
    (d / "leaderboard.md").write_text(text)
    echo(markdown(cells, full, ratios, errors))
    echo(f"leaderboard: {d / 'leaderboard.md'}")
    return {"dir": d, "cells": cells, "full": full, "errors": errors}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.leaderboard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run every point of a leaderboard")
    r.add_argument("--data", required=True, help="a task=qa JSONL file (experiments.ruler)")
    r.add_argument("--name", required=True, help="the sweep name the leaderboard reads")
    r.add_argument("--policies", nargs="+", default=list(POLICIES))
    r.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--max-new-tokens", type=int, default=32)
    r.add_argument("--batch", type=int, default=4)
    r.add_argument("--query-aware", action="store_true")
    for p in (r, s := sub.add_parser("show", help="write the table and plot")):
        p.add_argument("--store", default="results/results.jsonl")
    s.add_argument("name")
    s.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "run":
            seconds = run(args.data, args.name, args.policies, args.ratios, model=args.model,
                          max_new_tokens=args.max_new_tokens, batch=args.batch,
                          query_aware=args.query_aware, results=args.store)
            print(f"leaderboard {args.name}: {seconds:.0f} s wall")
            leaderboard(args.store, args.name, ratios=tuple(args.ratios))
        else:
            leaderboard(args.store, args.name, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
