"""Turn the results store into a comparison report: `python -m experiments.report`.

Writes into one directory (default reports/<sweep or all>/):

* report.md: the Pareto plots, needle heatmaps and the full table, PNGs beside it;
* report.html: the same, self-contained (PNGs embedded);
* pareto_<task>_<model>_L<length>_<layout>_<mode>_<text>.png (<model>: its name, plus 8 hex of
  a digest of the rest of its identity; <task>: its name, plus 8 hex of a digest of its
  non-default settings): one plot per group of comparable runs, those of one (model, task
  with its settings, text sha256, length, cache layout, policy mode): quality against measured
  cache bytes, one line per policy with its non-default options (its Pareto frontier), one
  marker per kv format, each point labelled with its budget, the group's own full-cache
  baseline dashed;
* needle_<policy>_<format>_b<budget>_<key>.png: each needle run's depth x length accuracy grid;
* a list of failed runs (records with status "failed") with their errors.

Records are narrowed with --sweep NAME and --where path=value (paths into the record's point,
e.g. policy.name=h2o, task.name=needle, kv_dtype=int4); a point run more than once counts once
(its last record). Corrupt store lines are reported with their line numbers and skipped.
With --wandb the same panels are published as a W&B Report (needs wandb-workspaces and a
login); `build_wandb_report` only constructs it, so it can be checked offline.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator

from kvjax.results import ResultsStore, is_failure, summary_row

MARKERS = {"f32": "o", "bf16": "s", "fp8": "^", "int8": "D", "int4": "v", "int2": "P"}
EXTRA_MARKERS = "X*hp<>8"
POINT_GID = "point"
BUDGET_GID = "budget"
BASELINE_GID = "baseline"


# ----------------------------------------------------------------------------- selecting


def lookup(point: dict, path: str):
    """point['a']['b'] for 'a.b' (None when missing)."""
    cur = point
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def select(records: list[dict], sweep: str | None = None, where: list[str] = ()) -> list[dict]:
    """Filter by sweep and `path=value` conditions; keep the last record of each key."""
    conds = []
    for w in where:
        if "=" not in w:
            raise ValueError(f"--where {w!r}: expected path=value, e.g. policy.name=h2o")
        k, v = w.split("=", 1)
        conds.append((k.strip(), v.strip()))
    latest: dict[str, dict] = {}
    for r in records:
        if sweep is not None and r.get("sweep") != sweep:
            continue
        if all(str(lookup(r["point"], k)) == v for k, v in conds):
            latest[r["key"]] = r
    return list(latest.values())


def no_match(records: list[dict], sweep: str | None, where: list[str]) -> str:
    """Why a filter left nothing: each condition with the values the store holds for it."""
    def values(vals) -> str:
        vals = sorted({"(none)" if v is None else str(v) for v in vals})
        return ", ".join(vals[:20]) + (f" (+{len(vals) - 20} more)" if len(vals) > 20 else "")

    parts = [f"--sweep {sweep!r}: the store's sweeps are {values(r.get('sweep') for r in records)}"
             ] if sweep is not None else []
    for w in where:
        k = w.split("=", 1)[0].strip()
        parts.append(f"--where {w!r}: the store's {k} values are "
                     f"{values(lookup(r['point'], k) for r in records)}")
    return f"no record of the {len(records)} in the store matches; " + "; ".join(parts)


# Task fields that do not split groups: the length is a group field of its own, and a batch of
# prompts answers as one prompt at a time does (tests/test_tasks.py)
TASK_SAME = ("length", "lengths", "batch")


def _short_digests(s: str) -> str:
    """Each long hex digest in s cut to 12 characters (for headings)."""
    return re.sub(r"\b([0-9a-f]{12})[0-9a-f]{20,}\b", r"\1", s)


class Group(NamedTuple):
    """What makes runs comparable: same model, task with its settings, text, length, cache
    layout, policy mode."""

    model: str
    task: str
    text: str
    length: Any
    layout: str
    mode: str
    options: str = ""  # the task's settings that differ from its defaults: "(depth=0.05)"

    def model_label(self) -> str:
        """The model for headings: its identity with each hex digest cut to 12 characters."""
        return _short_digests(self.model)

    def title(self) -> str:
        length = "/".join(map(str, self.length)) if isinstance(self.length, tuple) else self.length
        return (f"{self.task}{_short_digests(self.options)} | {self.model_label()} | length "
                f"{length} | {self.layout} | {self.mode} | text {self.text[:8]}")

    def slug(self) -> str:
        """A file name: the model's name, plus a digest of the rest of its identity if any; the
        task's name, plus a digest of its non-default settings if any."""
        length = "-".join(map(str, self.length)) if isinstance(self.length, tuple) else self.length
        name, paren, _ = self.model.partition("(")
        model = name + (f"-{_digest(self.model)}" if paren else "")
        task = self.task + (f"-{_digest(self.options)}" if self.options else "")
        return _slug(f"pareto_{task}_{model}_L{length}_{self.layout}_{self.mode}_"
                     f"{self.text[:8]}")


def _digest(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:8]


def task_label(task: dict) -> str:
    """The task's name with its settings that differ from the defaults (length aside)."""
    from kvjax.experiment import options_label  # jax: only where labels are made

    return options_label("task", task, skip=TASK_SAME)


def policy_label(policy: dict) -> str:
    """The policy's name with its options that differ from the defaults (budget aside)."""
    from kvjax.experiment import options_label

    return options_label("policy", policy, skip=("budget", "mode", "ratio"))


def _hashable(v):
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def group_of(record: dict) -> Group:
    """The comparable group of a record; fields missing from older records read as defaults
    (no text hash: "unknown"; no cache layout: dense; no policy mode: evict)."""
    pt = record["point"]
    model = pt.get("model") or {}
    name = str(model.get("name", "unknown"))
    extra = {k: v for k, v in model.items() if k != "name" and v not in (0, {}, [], None)}
    overrides = extra.pop("overrides", None)  # [[key, value], ...] as a RunSpec stores them
    parts = [f"{k}={v}" for k, v in sorted(extra.items())]
    if isinstance(overrides, dict):
        overrides = sorted(overrides.items())
    parts += [f"{k}={v}" for k, v in overrides or ()]
    if parts:
        name += "(" + ",".join(parts) + ")"
    task = pt["task"]
    length = task.get("length", task.get("lengths", pt.get("max_len")))
    return Group(
        model=name, task=task["name"],
        text=str((record.get("text") or {}).get("sha256") or "unknown"),
        length=_hashable(length),
        layout=str((pt.get("cache") or {}).get("layout", "dense")),
        mode=str(pt["policy"].get("mode") or "evict"),
        options=task_label(task)[len(str(task["name"])):],
    )


def groups(records: list[dict]) -> dict[Group, list[dict]]:
    """Records by comparable group, groups in a stable order."""
    out = defaultdict(list)
    for r in records:
        out[group_of(r)].append(r)
    return dict(sorted(out.items(), key=lambda kv: tuple(map(str, kv[0]))))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return str(n)


def marker_for(fmt: str, seen: dict) -> str:
    if fmt in MARKERS:
        return MARKERS[fmt]
    if fmt not in seen:
        seen[fmt] = EXTRA_MARKERS[len(seen) % len(EXTRA_MARKERS)]
    return seen[fmt]


# ----------------------------------------------------------------------------- plots


def frontier(points: list[tuple[float, float]], higher_is_better: bool) -> list[tuple]:
    """The Pareto-optimal (bytes, quality) points, by increasing bytes: no other point has
    fewer or equal bytes and better or equal quality."""
    best, out = None, []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1] if higher_is_better else p[1])):
        if best is None or (y > best if higher_is_better else y < best):
            out.append((x, y))
            best = y
    return out


def pareto_figure(recs: list[dict], title: str):
    """Quality vs measured cache bytes for one group of comparable records (see `group_of`).

    Every run is a marker (shape = kv format, colour = policy with its non-default options)
    with its budget written beside it; each policy's line joins its Pareto frontier; the
    group's full-cache baseline is a dashed line. Each policy's markers are smaller than the
    one's before it, so runs that land on the same spot stay visible as rings. Returns
    (figure, points), one dict per plotted point; each marker is a Line2D with gid "point" and
    label "policy|kv_dtype|budget", each budget label a Text with gid "budget", each baseline
    a Line2D with gid "baseline", so tests can read the artists.
    """
    metric = recs[0]["metrics"]["metric"]
    higher = bool(recs[0]["metrics"].get("higher_is_better"))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    by_policy = defaultdict(list)
    for r in recs:
        by_policy[policy_label(r["point"]["policy"])].append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    extra, points, handles = {}, [], []
    for i, (policy, rs) in enumerate(sorted(by_policy.items())):
        color = colors[i % len(colors)]
        size = max(3.0, 12.0 - 2.5 * i)  # later policies drawn smaller, on top
        for r in rs:
            x, y = r["cache"]["kv_bytes"], r["metrics"]["value"]
            fmt, budget = r["point"]["kv_dtype"], r["point"]["policy"].get("budget")
            ax.plot([x], [y], linestyle="none", marker=marker_for(fmt, extra), color=color,
                    markersize=size, markeredgecolor="white", markeredgewidth=0.6,
                    gid=POINT_GID, label=f"{policy}|{fmt}|{budget}")
            if budget is not None:
                ax.annotate(str(budget), (x, y), xytext=(4, 4), textcoords="offset points",
                            fontsize=7, color=color, gid=BUDGET_GID)
            points.append({"policy": policy, "kv_dtype": fmt, "budget": budget, "x": x, "y": y,
                           "key": r["key"]})
        front = frontier([(p["x"], p["y"]) for p in points if p["policy"] == policy], higher)
        ax.plot([p[0] for p in front], [p[1] for p in front], "-", color=color, alpha=0.6)
        handles.append(Line2D([], [], color=color, label=policy))
    baselines = sorted({r["metrics"].get("baseline") for r in recs} - {None})
    for b in baselines:  # one per seed in the group
        ax.axhline(b, color="gray", linestyle="--", linewidth=1, gid=BASELINE_GID)
    if baselines:
        handles.append(Line2D([], [], color="gray", linestyle="--", label="full cache (f32)"))
    for f in sorted({p["kv_dtype"] for p in points}):
        handles.append(Line2D([], [], linestyle="none", marker=marker_for(f, extra),
                              color="black", label=f"format {f}"))
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=2))  # ticks at 1, 2, 4, ... KiB/MiB
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel("KV cache bytes per sequence (measured, k+v with scales)")
    ax.set_ylabel(f"{metric} ({'higher' if higher else 'lower'} is better)")
    ax.set_title(f"{metric} vs cache memory\n{title}", fontsize=9)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig, points


def needle_figure(record: dict):
    """The depth x length accuracy heatmap of one needle record."""
    g = record["metrics"]["grid"]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(g["lengths"]), 1.2 + 0.6 * len(g["depths"])))
    im = ax.imshow(g["accuracy"], vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(g["lengths"])), [str(n) for n in g["lengths"]])
    ax.set_yticks(range(len(g["depths"])), [f"{d:.2f}" for d in g["depths"]])
    for i, row in enumerate(g["accuracy"]):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    pt = record["point"]
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{pt['policy']['name']} / {pt['kv_dtype']} / budget {pt['policy'].get('budget')}",
                 fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- tables


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def markdown_table(records: list[dict]) -> str:
    """Every run, one row each, with what changes its numbers: task settings, policy and format
    options that differ from their defaults, the task's length, ratio, layout and mode."""
    from kvjax.experiment import format_label  # jax: only where the table is made

    rows = []
    for r in sorted(records, key=_order):
        pt, g = r["point"], group_of(r)
        row = summary_row(r) | {"task": task_label(pt["task"]),
                                "policy": policy_label(pt["policy"]), "kv_dtype": format_label(pt)}
        length = "/".join(map(str, g.length)) if isinstance(g.length, tuple) else g.length
        rows.append(row | {"ratio": pt["policy"].get("ratio"), "length": length,
                           "layout": g.layout, "mode": g.mode, "sweep": r.get("sweep"),
                           "created": r.get("created")})
    if not rows:
        return "_no records_\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _order(r):
    pt = r["point"]
    b = pt["policy"].get("budget")
    return (pt["task"]["name"], pt["policy"]["name"], str(pt.get("kv_dtype")),
            -1 if b is None else b)


def failures_table(failed: list[dict]) -> str:
    """The failed runs: what they were and the error each raised."""
    lines = ["| task | policy | kv_dtype | budget | layout | sweep | key | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(failed, key=_order):
        pt = r["point"]
        cells = [pt["task"]["name"], pt["policy"]["name"], pt.get("kv_dtype"),
                 pt["policy"].get("budget"), group_of(r).layout, r.get("sweep"), r["key"],
                 str(r.get("error", "")).replace("|", "/").replace("\n", " ")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the report


def _slug(s) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(s))


def build_report(store_path, out_dir, sweep: str | None = None, where=(), echo=print) -> dict:
    """Write report.md, report.html and the PNGs; returns what was written and plotted."""
    store = ResultsStore(store_path)
    records, problems = store.read()
    for p in problems:
        echo(f"warning: {store.path}: skipped {p}", file=sys.stderr)
    selected = select(records, sweep, list(where))
    if records and not selected:
        raise ValueError(no_match(records, sweep, list(where)))
    records = [r for r in selected if not is_failure(r)]
    failed = [r for r in selected if is_failure(r)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("pareto_*.png"), *out.glob("needle_*.png")]:  # an earlier report's
        stale.unlink()
    title = f"kvjax report: {sweep or 'all runs'}"
    md = [f"# {title}\n", f"Store: `{store.path}`, {len(records)} point(s)"
          + (f", {len(failed)} failed" if failed else "")
          + (f", filter {' '.join(where)}" if where else "") + ".\n"]
    if problems:
        md.append("Skipped store lines: " + "; ".join(str(p) for p in problems) + ".\n")
    images, pareto = [], {}
    for group, recs in groups(records).items():
        fig, points = pareto_figure(recs, group.title())
        name = f"{group.slug()}.png"
        fig.savefig(out / name, dpi=120, bbox_inches="tight")
        plt.close(fig)
        pareto[group] = points
        images.append(name)
        md += [f"## {group.title()}\n", f"![pareto {group.task}]({name})\n"]
    needles = sorted((r for r in records if r["point"]["task"]["name"] == "needle"), key=_order)
    if needles:
        md.append("## Needle in a haystack: accuracy by depth and length\n")
    for r in needles:
        pt = r["point"]
        name = (f"needle_{_slug(pt['policy']['name'])}_{_slug(pt['kv_dtype'])}_"
                f"b{pt['policy'].get('budget')}_{r['key']}.png")
        fig = needle_figure(r)
        fig.savefig(out / name, dpi=120, bbox_inches="tight")
        plt.close(fig)
        images.append(name)
        md.append(f"![needle {pt['policy']['name']} {pt['kv_dtype']}]({name})\n")
    md += ["## All runs\n", markdown_table(records)]
    if failed:
        md += ["## Failed runs\n", failures_table(failed)]
    text = "\n".join(md)
    (out / "report.md").write_text(text, encoding="utf-8")
    (out / "report.html").write_text(to_html(title, text, out), encoding="utf-8")
    return {"dir": out, "records": records, "failed": failed, "problems": problems,
            "images": images, "pareto": pareto}


def to_html(title: str, markdown: str, img_dir: Path) -> str:
    """A self-contained HTML page of the report (images embedded, the table as HTML)."""
    body = []
    for block in markdown.split("\n\n"):
        block = block.strip()
        m = re.fullmatch(r"!\[(.*?)\]\((.*?)\)", block)
        if m:
            data = base64.b64encode((img_dir / m.group(2)).read_bytes()).decode()
            body.append(f'<p><img alt="{html.escape(m.group(1))}" '
                        f'src="data:image/png;base64,{data}"></p>')
        elif block.startswith("#"):
            level = len(block) - len(block.lstrip("#"))
            body.append(f"<h{level}>{html.escape(block.lstrip('#').strip())}</h{level}>")
        elif block.startswith("|"):
            rows = [r.strip("|").split("|") for r in block.splitlines() if not r.startswith("|---")]
            cells = ["<tr>" + "".join(f"<{'th' if i == 0 else 'td'}>{html.escape(c.strip())}"
                                      f"</{'th' if i == 0 else 'td'}>" for c in row) + "</tr>"
                     for i, row in enumerate(rows)]
            body.append("<table>" + "".join(cells) + "</table>")
        elif block:
            body.append(f"<p>{html.escape(block)}</p>")
    style = ("body{font-family:sans-serif;max-width:1200px;margin:auto}"
             "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;"
             "padding:2px 6px;text-align:right}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def build_wandb_report(records: list[dict], project: str, entity: str, sweep: str | None = None):
    """A W&B Report (wandb-workspaces) with the same panels; constructed, not saved."""
    import wandb_workspaces.reports.v2 as wr

    runset = wr.Runset(entity=entity, project=project, name=sweep or "all runs",
                       filters=f"Config('sweep') = '{sweep}'" if sweep else "",
                       groupby=["point.policy.name"])
    panels = []
    for task in sorted({r["point"]["task"]["name"] for r in records}):
        metric = next(r["metrics"]["metric"] for r in records
                      if r["point"]["task"]["name"] == task)
        panels.append(wr.ScatterPlot(title=f"{task}: {metric} vs cache bytes",
                                     x="cache/kv_bytes", y=metric, log_x=True))
    return wr.Report(
        project=project, entity=entity, title=f"kvjax: {sweep or 'all runs'}",
        description="Quality against KV-cache memory (kvjax experiments.report)",
        blocks=[wr.H1(f"kvjax: {sweep or 'all runs'}"),
                wr.P("Quality against measured KV-cache bytes: one point per run."),
                wr.PanelGrid(runsets=[runset], panels=panels),
                wr.H2("All runs"), wr.MarkdownBlock(text=markdown_table(records))],
    )


def default_out(sweep: str | None) -> str:
    """The report directory when --out is not given."""
    return f"reports/{_slug(sweep or 'all')}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", "--results", default="results/results.jsonl",
                    help="results store (JSONL; run.py's `results=`)")
    ap.add_argument("--out", default=None, help="output dir (default reports/<sweep or all>)")
    ap.add_argument("--sweep", default=None, help="only records of this sweep name")
    ap.add_argument("--where", action="append", default=[], metavar="PATH=VALUE",
                    help="only records whose point has PATH=VALUE (repeatable)")
    ap.add_argument("--wandb", action="store_true", help="also publish a W&B Report")
    ap.add_argument("--project", default="kvjax")
    ap.add_argument("--entity", default=None)
    ap.add_argument("--leaderboard", default=None, metavar="NAME",
                    help="write sweep NAME's policy x ratio leaderboard (experiments.leaderboard)")
    args = ap.parse_args(argv)
    if args.leaderboard:
        from experiments.leaderboard import leaderboard

        try:
            leaderboard(args.store, args.leaderboard, args.out)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if not Path(args.store).is_file():
        print(f"error: no results store at {args.store} (run `python run.py` first)",
              file=sys.stderr)
        return 2
    out = args.out or default_out(args.sweep)
    try:
        res = build_report(args.store, out, args.sweep, args.where, echo=print)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {res['dir'] / 'report.md'} ({len(res['records'])} points, "
          f"{len(res['failed'])} failed, {len(res['images'])} images, "
          f"{len(res['problems'])} skipped lines)")
    for r in res["failed"]:
        print(f"failed: {r['key']} ({r.get('sweep') or 'no sweep'}): {r.get('error')}")
    if args.wandb:
        import wandb

        entity = args.entity or wandb.Api().default_entity
        report = build_wandb_report(res["records"], args.project, entity, args.sweep)
        report.save()
        print(f"W&B report: {report.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
