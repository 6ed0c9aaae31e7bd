"""experiments.report on a synthetic store: plots hold every point, heatmaps, table, filters,
corrupt lines, the CLI, and the W&B Report built offline."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `experiments` is a top-level folder, importable from the root
    sys.path.insert(0, str(ROOT))

from experiments import report
from kvjax.results import ResultsStore


def rec(key, policy, fmt, budget, value, kv_bytes, task="perplexity", sweep="s", grid=None):
    metric = {"perplexity": "perplexity", "needle": "accuracy"}[task]
    metrics = {"task": task, "metric": metric, "value": value, "baseline": 10.0,
               "delta": value - 10.0, "higher_is_better": task == "needle"}
    if grid is not None:
        metrics["grid"] = grid
    return {
        "key": key, "sweep": sweep, "created": "2026-01-01T00:00:00+00:00",
        "point": {"policy": {"name": policy, "budget": budget}, "kv_dtype": fmt,
                  "task": {"name": task}},
        "metrics": metrics,
        "cache": {"kv_bytes": kv_bytes, "closed_form_bytes": kv_bytes,
                  "compression": 1000 / kv_bytes},
        "timings": {"prefill_s": 0.5, "decode_tok_s": 20.0},
    }


GRID = {"depths": [0.0, 0.5, 1.0], "lengths": [256, 512], "accuracy": [[1, 0], [1, 1], [0, 1]]}
RECORDS = [
    rec("a", "full", "f32", None, 10.0, 1000),
    rec("b", "full", "int4", None, 10.2, 150),
    rec("c", "h2o", "f32", 128, 11.0, 250),
    rec("d", "h2o", "int4", 128, 11.5, 40),
    rec("e", "h2o", "bf16", 512, 10.4, 500),
    rec("f", "streaming", "int2", 128, 14.0, 20),
    rec("g", "h2o", "int4", 128, 0.5, 40, task="needle", grid=GRID),
    rec("h", "full", "f32", None, 1.0, 1000, task="needle", grid=GRID),
    rec("z", "h2o", "f32", 64, 99.0, 10, sweep="other"),
]


@pytest.fixture
def store(tmp_path):
    s = ResultsStore(tmp_path / "results.jsonl")
    for r in RECORDS:
        s.append(r)
    with open(s.path, "a") as f:
        f.write("{truncated\n")
    s.append(rec("c", "h2o", "f32", 128, 11.0, 250))  # a duplicate key is not appended
    return s


def test_report_plots_every_point_and_writes_heatmaps_and_table(store, tmp_path):
    warnings = []
    res = report.build_report(store.path, tmp_path / "out", sweep="s",
                              echo=lambda *a, **k: warnings.append(a[0]))
    out = tmp_path / "out"
    assert [str(p) for p in res["problems"]] == [
        "line 10: not valid JSON (Expecting property name enclosed in double quotes at column 2)"]
    assert "line 10" in warnings[0]
    swept = {r["key"] for r in RECORDS if r["sweep"] == "s"}
    plotted = {p["key"] for pts in res["pareto"].values() for p in pts}
    assert plotted == swept
    assert sorted(g.task for g in res["pareto"]) == ["needle", "perplexity"]
    for group in res["pareto"]:
        png = out / f"{group.slug()}.png"
        assert png.read_bytes().startswith(b"\x89PNG") and mpimg.imread(png).shape[0] > 100
    heatmaps = sorted(p.name for p in out.glob("needle_*.png"))
    assert heatmaps == ["needle_full_f32_bNone_h.png", "needle_h2o_int4_b128_g.png"]
    md = (out / "report.md").read_text()
    assert all(f"]({name})" in md for name in res["images"])
    assert md.count("\n| perplexity |") == 6 and md.count("\n| needle |") == 2
    assert "Skipped store lines: line 10" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(res["images"]) and "<table>" in html


def label(r) -> str:
    pt = r["point"]
    return f"{pt['policy']['name']}|{pt['kv_dtype']}|{pt['policy']['budget']}"


def test_pareto_artists_hold_every_point_with_its_marker():
    recs = [r for r in RECORDS if r["point"]["task"]["name"] == "perplexity"]
    assert len(report.groups(recs)) == 1  # same (model, task, text, length, layout, mode)
    fig, points = report.pareto_figure(recs, "perplexity")
    ax = fig.axes[0]
    markers = [ln for ln in ax.get_lines() if ln.get_gid() == report.POINT_GID]
    got = sorted((ln.get_label(), float(ln.get_xdata()[0]), float(ln.get_ydata()[0]),
                  ln.get_marker()) for ln in markers)
    want = sorted((label(r), r["cache"]["kv_bytes"], r["metrics"]["value"],
                   report.MARKERS[r["point"]["kv_dtype"]]) for r in recs)
    assert got == want and len(points) == len(recs)
    assert ax.get_xscale() == "log"
    colors = {ln.get_label().split("|")[0]: ln.get_color() for ln in markers}
    assert len(set(colors.values())) == 3  # one colour per policy


def test_frontier_keeps_only_pareto_optimal_points():
    pts = [(40, 11.5), (250, 11.0), (500, 10.4), (300, 12.0)]
    assert report.frontier(pts, higher_is_better=False) == [(40, 11.5), (250, 11.0), (500, 10.4)]
    assert report.frontier([(1, 0.2), (2, 0.1), (3, 0.9)], True) == [(1, 0.2), (3, 0.9)]


def test_select_filters_and_keeps_the_last_record_per_key():
    recs = RECORDS + [rec("a", "full", "f32", None, 9.0, 1000)]
    assert {r["key"] for r in report.select(recs, where=["policy.name=h2o"])} == {"c", "d", "e", "g", "z"}
    assert {r["key"] for r in report.select(recs, "s", ["kv_dtype=int4", "task.name=needle"])} == {"g"}
    assert [r["metrics"]["value"] for r in report.select(recs) if r["key"] == "a"] == [9.0]
    with pytest.raises(ValueError, match="path=value"):
        report.select(recs, where=["oops"])


def test_cli(store, tmp_path, capsys):
    assert report.main(["--store", str(store.path), "--out", str(tmp_path / "cli"),
                        "--where", "task.name=perplexity"]) == 0
    assert "report:" in capsys.readouterr().out
    assert (tmp_path / "cli" / "report.md").is_file()
    assert report.main(["--store", str(tmp_path / "missing.jsonl")]) == 2


def test_wandb_report_is_built_offline():
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    r = report.build_wandb_report(RECORDS[:5], project="kvjax", entity="someone", sweep="s")
    assert isinstance(r, wr.Report) and r.entity == "someone" and r.project == "kvjax"
    grid = next(b for b in r.blocks if isinstance(b, wr.PanelGrid))
    assert [p.y for p in grid.panels] == ["perplexity"] and grid.panels[0].x == "cache/kv_bytes"
    assert "sweep" in grid.runsets[0].filters
    table = next(b for b in r.blocks if isinstance(b, wr.MarkdownBlock))
    assert table.text.count("\n| perplexity |") == 5
    json.dumps(r.title)


def with_fields(r, model="m", text="t1", length=1024, layout=None, mode=None, baseline=10.0):
    """`rec` with the fields that decide comparability (record layout of kvjax.experiment)."""
    r = json.loads(json.dumps(r))
    r["point"]["model"] = {"name": model, "init_seed": 0, "overrides": {}}
    r["point"]["task"]["length"] = length
    if layout is not None:
        r["point"]["cache"] = {"layout": layout, "page_size": 16}
    if mode is not None:
        r["point"]["policy"]["mode"] = mode
    r["text"] = {"sha256": text}
    r["metrics"]["baseline"] = baseline
    return r


def test_a_report_replaces_an_earlier_reports_images_only(store, tmp_path):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "pareto_gone.png").write_bytes(b"old")
    (out / "notes.txt").write_text("mine")
    res = report.build_report(store.path, out, echo=lambda *a, **k: None)
    assert not (out / "pareto_gone.png").exists() and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.glob("*.png")) == sorted(res["images"])


def test_a_filter_that_matches_nothing_is_an_error_naming_the_values_held(store, tmp_path):
    """--sweep/--where that select nothing from a non-empty store: exit 2 before any file is
    written, with the values the store holds for each condition."""
    out = tmp_path / "rep"
    assert report.main(["--store", str(store.path), "--out", str(out),
                        "--where", "policy.name=nosuch"]) == 2
    assert not out.exists()
    with pytest.raises(ValueError, match=r"no record of the 9 in the store matches; --sweep "
                       r"'nope': the store's sweeps are other, s; --where 'kv_dtype=int4': "
                       r"the store's kv_dtype values are bf16, f32, int2, int4"):
        report.build_report(store.path, out, "nope", ["kv_dtype=int4"])


def test_a_real_model_identity_gives_a_short_heading_and_file_name():
    """A real model's identity (format, 64-hex sha256, tokenizer) splits groups in full, but the
    heading shows its digest cut to 12 and the file name a digest of the whole identity."""
    sha = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    ident = {"name": "smollm2-135m", "format": "gguf", "sha256": sha,
             "tokenizer": "gguf (in the file)"}
    groups = []
    for tokenizer in ("gguf (in the file)", "other.json"):
        r = with_fields(rec("a", "full", "f32", None, 10.0, 1000))
        r["point"]["model"] = ident | {"tokenizer": tokenizer}
        groups.append(report.group_of(r))
    g, other = groups
    assert sha in g.model and g != other  # grouped by the whole identity
    assert "sha256=b179c9523d0e," in g.title() and sha not in g.title()
    assert re.fullmatch(r"pareto_perplexity_smollm2-135m-[0-9a-f]{8}_L1024_dense_evict_t1",
                        g.slug())
    assert g.slug() != other.slug()
    plain = report.group_of(with_fields(rec("a", "full", "f32", None, 10.0, 1000), model="m"))
    assert plain.slug() == "pareto_perplexity_m_L1024_dense_evict_t1" and "| m |" in plain.title()


def test_only_comparable_runs_share_a_plot_each_with_its_own_baseline(tmp_path):
    """Model, task, text, length, layout and mode each split the runs into their own plot,
    whose dashed baseline is that group's full-cache value; budgets label the points."""
    base = [rec("a", "full", "f32", None, 10.0, 1000), rec("c", "h2o", "f32", 128, 11.0, 250),
            rec("d", "h2o", "int4", 256, 11.5, 40)]
    variants = {  # group name -> field overrides; each has its own baseline value
        "plain": {}, "model": {"model": "other"}, "text": {"text": "t2"},
        "length": {"length": 512}, "paged": {"layout": "paged"}, "compress": {"mode": "compress"},
    }
    store = ResultsStore(tmp_path / "r.jsonl")
    for i, (name, fields) in enumerate(variants.items()):
        for r in base:
            store.append(with_fields(r | {"key": f"{name}-{r['key']}"}, baseline=20.0 + i,
                                     **fields))
    store.append(with_fields(rec("plain-e", "h2o", "f32", 64, 12.0, 60), mode="evict",
                             baseline=20.0))  # "evict" spelled out joins the missing mode
    res = report.build_report(store.path, tmp_path / "out", echo=lambda *a, **k: None)
    assert len(res["pareto"]) == len(variants) and len(set(res["images"])) == len(variants)
    by_prefix = {}
    for group, points in res["pareto"].items():
        prefixes = {p["key"].split("-")[0] for p in points}
        assert len(prefixes) == 1, f"{group} mixes runs of {prefixes}"
        by_prefix[prefixes.pop()] = (group, points)
    assert set(by_prefix) == set(variants)
    plain, plain_points = by_prefix["plain"]
    assert {p["key"] for p in plain_points} == {"plain-a", "plain-c", "plain-d", "plain-e"}
    assert plain.mode == "evict" and plain.layout == "dense"  # a missing mode reads as evict
    assert by_prefix["paged"][0].layout == "paged" and by_prefix["compress"][0].mode == "compress"
    assert len({g.slug() for g in res["pareto"]}) == len(variants)
    for i, name in enumerate(variants):
        group, _ = by_prefix[name]
        recs = [r for r in res["records"] if report.group_of(r) == group]
        fig, points = report.pareto_figure(recs, group.title())
        ax = fig.axes[0]
        lines = [ln for ln in ax.get_lines() if ln.get_gid() == report.BASELINE_GID]
        assert [float(ln.get_ydata()[0]) for ln in lines] == [20.0 + i]
        labels = sorted((t.get_text(), t.xy) for t in ax.texts if t.get_gid() == report.BUDGET_GID)
        assert labels == sorted((str(p["budget"]), (p["x"], p["y"])) for p in points
                                if p["budget"] is not None)
        report.plt.close(fig)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| paged | evict |" in md and "| dense | compress |" in md


def test_task_settings_split_groups_and_options_label_rows_and_series(tmp_path):
    """Runs whose task settings differ (passkey depth) are not one plot; a batch size (the same
    answers) and spelled-out defaults do not split them. Policy options make their own series
    and the table names both (an audit found such rows identical but for their keys)."""
    def passkey(key, policy, budget, value, depth=0.5, batch=8, **opts):
        r = with_fields(rec(key, policy, "f32", budget, value, 100 + len(key)), length=256)
        r["point"]["task"] = {"name": "passkey", "length": 256, "depth": depth, "batch": batch,
                              "n_samples": 5, "digits": 5}
        r["point"]["policy"] |= opts
        r["metrics"] |= {"metric": "accuracy", "higher_is_better": True}
        return r

    store = ResultsStore(tmp_path / "r.jsonl")
    for r in [passkey("a", "full", None, 1.0), passkey("b", "streaming", 64, 1.0, batch=1),
              passkey("c", "streaming", 64, 0.0, depth=0.05),
              passkey("d", "streaming", 64, 0.5, n_sink=1),
              passkey("e", "h2o", 64, 0.5, depth=0.05)]:
        store.append(r)
    res = report.build_report(store.path, tmp_path / "out", echo=lambda *a, **k: None)
    by_keys = {frozenset(p["key"] for p in pts): g for g, pts in res["pareto"].items()}
    assert set(by_keys) == {frozenset("abd"), frozenset("ce")}
    deep = by_keys[frozenset("ce")]
    assert deep.options == "(depth=0.05)" and deep.title().startswith("passkey(depth=0.05) |")
    assert by_keys[frozenset("abd")].options == ""
    assert by_keys[frozenset("abd")].slug() != deep.slug()
    assert re.search(r"^pareto_passkey-[0-9a-f]{8}_", deep.slug())
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| passkey(depth=0.05) | streaming | f32 | 64 |" in md
    assert "| passkey | streaming(n_sink=1) | f32 | 64 |" in md
    recs = [r for r in res["records"] if r["key"] in "abd"]
    fig, _ = report.pareto_figure(recs, "t")
    markers = {ln.get_label(): ln for ln in fig.axes[0].get_lines()
               if ln.get_gid() == report.POINT_GID}
    assert set(markers) == {"full|f32|None", "streaming|f32|64", "streaming(n_sink=1)|f32|64"}
    sizes = [markers[k].get_markersize()
             for k in sorted(markers, key=lambda k: k.split("|")[0])]  # the policies' order
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3  # rings, not hidden
    colors = {markers[k].get_color() for k in markers}
    assert len(colors) == 3
    report.plt.close(fig)

def test_failed_runs_are_listed_not_plotted(tmp_path, capsys):
    store = ResultsStore(tmp_path / "r.jsonl")
    store.append(rec("a", "full", "f32", None, 10.0, 1000))
    failed = {"key": "f", "status": "failed", "sweep": "s", "error": "RuntimeError: out of memory",
              "point": {"policy": {"name": "h2o", "budget": 64}, "kv_dtype": "int4",
                        "task": {"name": "perplexity"}}}
    store.append(failed)
    res = report.build_report(store.path, tmp_path / "out", echo=lambda *a, **k: None)
    assert [r["key"] for r in res["failed"]] == ["f"] and [r["key"] for r in res["records"]] == ["a"]
    assert {p["key"] for pts in res["pareto"].values() for p in pts} == {"a"}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Failed runs" in md and "| h2o | int4 | 64 | dense | s | f | RuntimeError: out of memory |" in md
    assert report.main(["--store", str(store.path), "--out", str(tmp_path / "cli")]) == 0
    # run.py's name for the store works too
    assert report.main(["--results", str(store.path), "--out", str(tmp_path / "cli2")]) == 0
    assert "failed: f (s): RuntimeError: out of memory" in capsys.readouterr().out


def test_readme_names_the_report_path_the_cli_writes():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`(reports/[^`]*report\.md)`", readme))
    default = report.default_out(None) + "/report.md"
    assert named == {default}


def test_the_runs_table_tells_apart_what_changes_the_numbers(tmp_path):
    """Two runs that differ only in a policy preset's options, a format option, the ratio or
    the task's length get rows that differ in those cells; measured and closed-form totals sit
    side by side (kv_bytes is k+v only)."""
    base = with_fields(rec("a", "snapkv", "int4", 64, 0.5, 100, task="needle", grid=GRID))
    base["point"]["policy"] |= {"mode": "compress", "ratio": None, "window": 32, "kernel": 7,
                                "pool": "max", "per_head": True}
    base["point"]["format"] = {"name": "int4", "group": 64, "key_mode": "channel",
                               "residual": 64, "value_group": 64}
    base["cache"] |= {"total_bytes": 123, "closed_form_bytes": 123}
    preset = json.loads(json.dumps(base)) | {"key": "b"}
    preset["point"]["policy"] |= {"window": 64, "pool": "avg"}
    token = json.loads(json.dumps(base)) | {"key": "c"}
    token["point"]["format"]["key_mode"] = "token"
    ratio = json.loads(json.dumps(base)) | {"key": "d"}
    ratio["point"]["policy"] |= {"budget": None, "ratio": 0.25}
    short = with_fields(json.loads(json.dumps(base)) | {"key": "e"}, length=512)
    short["point"]["policy"], short["point"]["format"] = base["point"]["policy"], base["point"]["format"]
    rows = report.markdown_table([base, preset, token, ratio, short]).splitlines()
    cols = [c.strip() for c in rows[0].strip("|").split("|")]
    cells = {r.split("|")[cols.index("key") + 1].strip(): [c.strip() for c in r.strip("|").split("|")]
             for r in rows[2:]}
    col = lambda key, name: cells[key][cols.index(name)]
    assert col("a", "policy") == "snapkv" and col("a", "kv_dtype") == "int4"
    assert col("b", "policy") == "snapkv(pool=avg, window=64)"
    assert col("c", "kv_dtype") == "int4(key_mode=token)"
    assert col("d", "ratio") == "0.25" and col("a", "ratio") == ""
    assert col("e", "length") == "512" and col("a", "length") == "1,024"
    assert col("a", "total_bytes") == col("a", "closed_form_bytes") == "123"
