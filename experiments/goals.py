"""Issue 14's speed goals, checked against recorded benchmark runs.

    python -m experiments.goals FILE.json [FILE.json ...] [--out FILE.md]

Reads the JSON that `python -m experiments.bench_hf --out FILE.md` writes beside its table and
the JSON of `python -m experiments.bench_sweep_point --out FILE.md`, and prints one row per goal
with each run's figure, whether it meets the goal, and in how many of the runs that measured it
it holds. A goal counts as met only where it holds in every run: these machines drift by more
than the margins involved. Nothing is re-measured here.

Goals (issue 14): prefill at least 1.25x HF (2 threads) at 512 and 2048 tokens; decode at
least 2x HF at 128, 512 and 1024 cached tokens, with the full f32 cache and with h2o/512 int4;
decode flat (the step at 1024 at most 1.1x the step at 128); a warm `run.py` point in at most
8 s wall (the median of a file's warm runs; an A/B file gives one run per version).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

HF = "hf2"  # bench_hf's HF variant on the same 2 threads as kvjax
EXTRA = "kvjax h2o/512 int4"
CONTEXTS = (128, 512, 1024)


def goals() -> list[tuple[str, str, float, str]]:
    """(goal, the figure's unit, threshold, '>=' or '<=') in the report's order."""
    rows = [(f"prefill {n} tokens, speed vs HF", "x", 1.25, ">=") for n in (512, 2048)]
    rows += [(f"decode at {n} tokens, speed vs HF", "x", 2.0, ">=") for n in CONTEXTS]
    rows += [("decode flat: step at 1024 / step at 128", "x", 1.1, "<=")]
    rows += [(f"h2o/512 int4 decode at {n} tokens, speed vs HF", "x", 2.0, ">=")
             for n in CONTEXTS]
    rows += [("warm run.py point, wall", "s", 8.0, "<=")]
    return rows


def hf_figures(data: dict) -> dict[str, float]:
    """The goals' figures in one bench_hf JSON ({goal: value}; missing measures are left out)."""
    sec = {(r["measure"], r["tokens"]): r["seconds"] for r in data["rows"]}
    out = {}
    for n in (512, 2048):
        s = sec.get(("prefill", n), {})
        if "kvjax" in s and HF in s:
            out[f"prefill {n} tokens, speed vs HF"] = s[HF] / s["kvjax"]
    for n in CONTEXTS:
        s = sec.get(("decode", n), {})
        if "kvjax" in s and HF in s:
            out[f"decode at {n} tokens, speed vs HF"] = s[HF] / s["kvjax"]
        if EXTRA in s and HF in s:
            out[f"h2o/512 int4 decode at {n} tokens, speed vs HF"] = s[HF] / s[EXTRA]
    lo, hi = sec.get(("decode", 128), {}), sec.get(("decode", 1024), {})
    if "kvjax" in lo and "kvjax" in hi:
        out["decode flat: step at 1024 / step at 128"] = hi["kvjax"] / lo["kvjax"]
    return out


def runs_of(path: str) -> list[tuple[str, dict[str, float]]]:
    """[(run label, {goal: figure})] of one JSON file: a bench_hf run, or a bench_sweep_point
    file (one run per key that ends in 'warm': 'warm' itself, or an A/B file's versions)."""
    with open(path) as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    stem = os.path.splitext(os.path.basename(path))[0]
    if not isinstance(data, dict):
        data = {}  # a JSON list or value: neither kind, said below
    if "rows" in data and "variants" in data:
        return [(stem, hf_figures(data))]
    warm = {k: v for k, v in data.items() if k.endswith("warm") and isinstance(v, list) and v}
    if not warm:
        raise ValueError(f"{path}: neither a bench_hf JSON (rows, variants) nor a "
                         "bench_sweep_point JSON (a 'warm' list of runs)")
    return [(stem if k == "warm" else f"{stem} [{k.removesuffix(' warm')}]",
             {"warm run.py point, wall": statistics.median(r["wall_s"] for r in v)})
            for k, v in warm.items()]


def met(value: float, threshold: float, op: str) -> bool:
    return value >= threshold if op == ">=" else value <= threshold


def report(paths: list[str]) -> tuple[str, dict]:
    """The Markdown table (goals x runs) and its content as a dict (for checks)."""
    runs = [run for p in paths for run in runs_of(p)]
    lines = ["| goal | " + " | ".join(label for label, _ in runs) + " | met in |",
             "|---|" + "---:|" * (len(runs) + 1)]
    summary = {}
    for goal, unit, threshold, op in goals():
        cells, ok = [], []
        for _, figs in runs:
            if goal not in figs:
                cells.append("—")
                continue
            ok.append(met(figs[goal], threshold, op))
            cells.append(f"{figs[goal]:.2f}{unit} {'yes' if ok[-1] else 'no'}")
        verdict = f"{sum(ok)} of {len(ok)}" if ok else "not measured"
        lines.append(f"| {goal} ({op} {threshold:g}{unit}) | " + " | ".join(cells)
                     + f" | {verdict} |")
        summary[goal] = {"threshold": threshold, "op": op, "runs": len(ok), "met": sum(ok),
                         "figures": {label: figs[goal] for label, figs in runs if goal in figs}}
    return "\n".join(lines) + "\n", summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="bench_hf / bench_sweep_point JSON files")
    ap.add_argument("--out", default=None, help="also write the table here (and FILE.json)")
    a = ap.parse_args(argv)
    missing = [p for p in a.files if not os.path.isfile(p)]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    try:
        table, summary = report(a.files)
    except ValueError as e:
        ap.error(str(e))
    print(table)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(f"`python -m experiments.goals {' '.join(a.files)}`\n\n{table}")
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
