"""The results store (atomic, duplicate-free, corrupt-line tolerant) and the W&B sink."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import types
import warnings

import pytest

from kvjax import results
from kvjax.results import ResultsStore, config_hash, log_wandb, summary_row, to_jsonable


def record(key: str, value: float = 1.0, **extra) -> dict:
    return {
        "key": key, "sweep": extra.get("sweep"),
        "point": {"policy": {"name": "window", "budget": 32}, "kv_dtype": "f32",
                  "task": {"name": "perplexity", "length": 64}},
        "metrics": {"task": "perplexity", "metric": "perplexity", "value": value,
                    "baseline": 1.0, "delta": value - 1.0, "higher_is_better": False},
        "cache": {"kv_bytes": 100, "closed_form_bytes": 100, "compression": 2.0},
        "timings": {"prefill_s": 0.1, "decode_tok_s": 10.0, "total_s": 1.0},
    }


def test_append_read_and_duplicate_keys(tmp_path):
    store = ResultsStore(tmp_path / "sub" / "r.jsonl")
    assert store.records() == [] and store.done_keys() == set()
    assert store.append(record("a"))
    assert store.append(record("b", 2.0))
    assert not store.append(record("a", 5.0))  # already stored: no-op
    recs = store.records()
    assert [r["key"] for r in recs] == ["a", "b"] and recs[0]["metrics"]["value"] == 1.0
    assert [r["_line"] for r in recs] == [1, 2]
    assert store.find("b")["metrics"]["value"] == 2.0 and store.find("zz") is None
    assert store.append(record("a", 7.0), replace=True)
    assert [(r["key"], r["metrics"]["value"]) for r in store.records()] == [("b", 2.0), ("a", 7.0)]
    text = store.path.read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())


def test_corrupt_lines_are_reported_with_line_numbers_skipped_and_kept(tmp_path):
    store = ResultsStore(tmp_path / "r.jsonl")
    store.append(record("a"))
    with open(store.path, "a") as f:
        f.write('{"key": "half", "metr\n[1, 2]\n')
    store.append(record("b"))
    recs, problems = store.read()
    assert [r["key"] for r in recs] == ["a", "b"]
    assert [p.line for p in problems] == [2, 3]
    assert "not valid JSON" in str(problems[0]) and "line 2" in str(problems[0])
    assert "not a kvjax record" in problems[1].reason
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.records()
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 2 and "skipping line 2" in msgs[0] and "skipping line 3" in msgs[1]
    assert len(store.path.read_text().splitlines()) == 4  # the corrupt lines are not dropped


def test_an_interrupted_append_leaves_the_store_intact(tmp_path, monkeypatch):
    store = ResultsStore(tmp_path / "r.jsonl")
    store.append(record("a"))
    before = store.path.read_bytes()

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(results.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        store.append(record("b"))
    assert store.path.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _payload(worker: int, i: int) -> str:
    """A record body of varying length (up to ~8 KiB, past one page) that names its writer."""
    return f"{worker}-{i}:" + "x" * ((worker * 977 + i * 131) % 8000)


def _writer(path: str, worker: int, n: int, go) -> None:
    store = ResultsStore(path)
    go.wait(60)  # every writer starts at once
    for i in range(n):
        rec = record(f"{worker}-{i}")
        body = _payload(worker, i)
        rec["payload"] = {"body": body, "sha256": hashlib.sha256(body.encode()).hexdigest()}
        store.append(rec)
        if i == n // 2:
            store.append(record("shared", value=float(worker)))  # one key, many writers


def test_concurrent_writers_keep_every_record(tmp_path):
    """8 processes x 50 records into one store at once (what parallel sweep workers do): every
    record present exactly once and whole, the contested key stored once, no corrupt line."""
    path = str(tmp_path / "r.jsonl")
    workers, n = 8, 50
    ctx = mp.get_context("spawn")  # the children must not inherit JAX's threads
    go = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(path, w, n, go)) for w in range(workers)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * workers
    recs, problems = ResultsStore(path).read()
    assert problems == []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == len(recs) == workers * n + 1
    keys = [r["key"] for r in recs]
    assert sorted(keys) == sorted([f"{w}-{i}" for w in range(workers) for i in range(n)]
                                  + ["shared"])
    for r in recs:
        if r["key"] != "shared":
            w, i = map(int, r["key"].split("-"))
            body = r["payload"]["body"]
            assert body == _payload(w, i)
            assert hashlib.sha256(body.encode()).hexdigest() == r["payload"]["sha256"]


def test_config_hash_is_order_independent_and_to_jsonable():
    import numpy as np

    assert config_hash({"a": 1, "b": {"c": 2}}) == config_hash({"b": {"c": 2}, "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    assert to_jsonable({"x": np.float32(1.5), "y": (1, 2), "z": float("nan"),
                        "w": np.arange(2)}) == {"x": 1.5, "y": [1, 2], "z": None, "w": [0, 1]}


class FakeRun:
    def __init__(self, **kw):
        self.kw, self.logged, self.summary, self.finished = kw, [], {}, False
        self.path, self.dir = "ent/proj/id", "/tmp/x"

    def log(self, data, step=None):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    mod = types.ModuleType("wandb")
    mod.runs = []

    def init(**kw):
        run = FakeRun(**kw)
        mod.runs.append(run)
        return run

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    mod.init, mod.Table = init, Table
    mod.Settings = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def test_wandb_sink_logs_config_summary_curves_and_tables(fake_wandb, tmp_path):
    curves = {"step": [16, 32], "running_nll": [4.0, 3.5]}
    rec = record("k1", sweep="s")
    assert log_wandb(rec, curves, [{"sample": 0, "correct": True}], mode="offline", project="p",
                     entity=None, run_dir=tmp_path) == "/tmp/x"
    run = fake_wandb.runs[0]
    assert run.kw["mode"] == "offline" and run.kw["project"] == "p" and run.kw["group"] == "s"
    assert run.kw["config"]["point"] == rec["point"] and run.kw["config"]["key"] == "k1"
    assert run.kw["config"]["sweep"] == "s"  # docs/harness.md lists it in the config
    assert run.kw["settings"]["disable_git"]  # the record's own git info is in the config
    assert run.logged[0] == (0, {"running_nll": 4.0, "token": 16})
    assert run.logged[1] == (1, {"running_nll": 3.5, "token": 32})
    tables = {k: v for _, d in run.logged for k, v in d.items() if k.endswith("table") or k == "samples"}
    assert tables["summary_table"].columns == list(summary_row(rec))
    assert tables["samples"].data == [["0", "True"]]
    assert run.summary["value"] == 1.0 and run.summary["cache/kv_bytes"] == 100
    assert run.finished


def test_wandb_failure_warns_and_never_raises(fake_wandb, tmp_path):
    def broken(**kw):
        raise RuntimeError("no network")

    fake_wandb.init = broken
    with pytest.warns(UserWarning, match="W&B logging failed.*no network"):
        assert log_wandb(record("k"), {}, [], mode="online", project="p", entity=None,
                         run_dir=tmp_path) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert log_wandb(record("k"), {}, [], mode="disabled", project="p", entity=None,
                         run_dir=tmp_path) is None


def test_atomic_write_text_replaces_whole_file(tmp_path):
    p = tmp_path / "m.json"
    results.atomic_write_text(p, "one")
    results.atomic_write_text(p, "two")
    assert p.read_text() == "two"
    assert sorted(os.listdir(tmp_path)) == ["m.json"]


@pytest.mark.parametrize("umask, mode", [(0o002, 0o664), (0o022, 0o644), (0o077, 0o600)])
def test_store_and_written_files_respect_the_umask(tmp_path, umask, mode):
    """A store shared by a group on a cluster: files get 0666 minus the umask, as `open`
    gives (mkstemp alone gives 0600)."""
    old = os.umask(umask)
    try:
        results.atomic_write_text(tmp_path / "metrics.json", "{}")
        store = ResultsStore(tmp_path / "results.jsonl")
        store.append(record("a"))
        store.append(record("b"))
    finally:
        os.umask(old)
    for name in ("metrics.json", "results.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode, name


def test_a_failure_record_never_hides_a_result_and_gives_way_to_one(tmp_path):
    store = ResultsStore(tmp_path / "r.jsonl")
    err = RuntimeError("out of memory")
    assert results.record_failure(store, key="a", point={"p": 1}, sweep="s", error=err,
                                  run_dir=tmp_path)
    (failed,) = store.records()
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: out of memory"
    assert store.find("a") is None and store.done_keys() == set()
    assert results.record_failure(store, key="a", point={"p": 1}, sweep="s",
                                  error=ValueError("again"), run_dir=tmp_path)
    assert [r["error"] for r in store.records()] == ["ValueError: again"]  # the latest failure
    assert store.append(record("a", 3.0))  # a result replaces the failure
    assert [r.get("status") for r in store.records()] == [None]
    assert store.find("a")["metrics"]["value"] == 3.0 and store.done_keys() == {"a"}
    assert not results.record_failure(store, key="a", point={"p": 1}, sweep="s", error=err,
                                      run_dir=tmp_path)  # never over a finished record
    assert store.find("a")["metrics"]["value"] == 3.0
