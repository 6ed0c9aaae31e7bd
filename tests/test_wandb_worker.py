"""W&B logging in a worker process (`kvjax.wandb_worker`), against a fake `wandb` package that
the worker imports from PYTHONPATH and that writes every call to a JSON-lines file."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path
from unittest.mock import ANY

import numpy as np
import pytest

from kvjax import wandb_worker
from kvjax.tasks import TaskResult

FAKE_WANDB = textwrap.dedent('''
    import json, os, tempfile

    _MEDIA = tempfile.mkdtemp("wandb-media")  # as W&B's import makes one (removed at exit)

    def _say(*what):
        with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
            f.write(json.dumps([os.getpid(), *what]) + "\\n")

    def setup():
        _say("setup", _MEDIA)

    class Settings(dict):
        def __init__(self, **kw):
            super().__init__(kw)

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        path = dir = "fake"

        def __init__(self):
            self.summary = {}

        def log(self, data, step=None):
            data = {k: (["table", v.columns, v.data] if isinstance(v, Table) else v)
                    for k, v in data.items()}
            _say("log", step, data)

        def finish(self, exit_code=None):
            _say("finish", self.summary, exit_code)

    def init(**kw):
        if os.environ.get("FAKE_WANDB_FAIL"):
            raise RuntimeError("no network")
        _say("init", {k: kw[k] for k in ("mode", "project", "name", "group", "dir")})
        return Run()
''')


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch):
    """The worker's `wandb` is the fake; returns a reader of its calls (pid, call, ...)."""
    pkg = tmp_path / "site" / "wandb"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_WANDB)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_WANDB_LOG", str(log))
    wandb_worker.drain()  # a worker left by an earlier test has the real W&B
    yield lambda: ([json.loads(x) for x in log.read_text().splitlines()] if log.exists()
                   else [])
    wandb_worker.drain()


def record(key, sweep=None):
    return {"key": key, "sweep": sweep, "git": None,
            "point": {"policy": {"name": "lru", "budget": 8}, "kv_dtype": "int4",
                      "task": {"name": "perplexity"}},
            "metrics": {"metric": "nll", "value": 3.0},
            "cache": {"kv_bytes": 10, "closed_form_bytes": 10, "compression": 4.0},
            "timings": {"task_s": 1.0}}


def sink(tmp_path, **kw):
    return {"mode": "offline", "project": "p", "entity": None, "run_dir": tmp_path, **kw}


def head(rec):
    return {k: rec[k] for k in ("key", "sweep", "point", "git")}


def test_the_worker_logs_each_run_in_order_in_its_own_process(fake_wandb, tmp_path):
    res = TaskResult(metrics={}, curves={"step": np.array([16, 32]),
                                         "nll": np.array([4.0, np.nan], np.float32)},
                     rows=[{"sample": 0, "correct": np.bool_(True)}])
    wandb_worker.start()
    a = record("a", sweep="s")
    wandb_worker.begin(head(a), **sink(tmp_path))  # the run starts beside the point's work
    wandb_worker.submit(a, res, **sink(tmp_path))
    wandb_worker.submit(record("b"), None, **sink(tmp_path, project="q"))  # begun at the end
    wandb_worker.drain()
    calls = fake_wandb()
    assert {c[0] for c in calls} == {calls[0][0]} and calls[0][0] != os.getpid()
    names = [c[1] for c in calls]
    assert names == ["setup", "init", "log", "log", "log", "log", "finish",
                     "init", "log", "finish"]
    assert calls[1][2] == {"mode": "offline", "project": "p", "name": "lru-int4-b8-perplexity",
                           "group": "s", "dir": str(tmp_path)}
    assert calls[2][2:] == [0, {"nll": 4.0, "token": 16}]
    assert calls[3][2] == 1 and calls[3][3]["token"] == 32 and np.isnan(calls[3][3]["nll"])
    assert calls[5][3]["samples"] == ["table", ["sample", "correct"], [["0", "True"]]]
    assert calls[6][2:] == [{"value": 3.0, "cache/kv_bytes": 10, "cache/closed_form_bytes": 10,
                             "cache/compression": 4.0, "time/task_s": 1.0}, None]
    assert calls[7][2]["project"] == "q" and calls[7][2]["group"] is None


def test_a_failed_or_interrupted_point_finishes_its_run_as_failed(fake_wandb, tmp_path):
    wandb_worker.begin(head(record("a")), **sink(tmp_path))
    wandb_worker.abort("a", "offline")  # the point raised
    wandb_worker.begin(head(record("b")), **sink(tmp_path))
    wandb_worker.drain()  # this process exits (Ctrl-C) with point b still running
    assert [c[1:] for c in fake_wandb() if c[1] != "setup"] == [
        ["init", ANY], ["finish", {}, 1], ["init", ANY], ["finish", {}, 1]]


def test_a_failing_wandb_warns_on_the_workers_stderr_and_nothing_raises(
        fake_wandb, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_WANDB_FAIL", "1")
    wandb_worker.submit(record("a"), None, **sink(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wandb_worker.drain()  # the worker itself exits cleanly
    assert "W&B logging failed (RuntimeError: no network)" in capfd.readouterr().err
    assert [c[1] for c in fake_wandb()] == ["setup"]  # and begun runs are not retried:
    wandb_worker.begin(head(record("b")), **sink(tmp_path))
    wandb_worker.submit(record("b"), None, **sink(tmp_path))
    wandb_worker.drain()
    assert capfd.readouterr().err.count("W&B logging failed") == 1


def test_ctrl_c_is_the_runs_the_worker_goes_on(fake_wandb, tmp_path):
    wandb_worker.start()
    pid = wandb_worker._proc.pid
    deadline = time.monotonic() + 60
    while not fake_wandb() and time.monotonic() < deadline:  # set up: SIGINT is ignored by now
        time.sleep(0.05)
    os.kill(pid, signal.SIGINT)
    wandb_worker.submit(record("a"), None, **sink(tmp_path))
    wandb_worker.drain()
    assert [c[1] for c in fake_wandb()] == ["setup", "init", "log", "finish"]


def test_without_a_worker_the_run_logs_in_its_own_process(fake_wandb, tmp_path, monkeypatch):
    runs = []
    mod = types.ModuleType("wandb")
    mod.Settings = dict
    mod.Table = lambda columns, data: (columns, data)
    mod.init = lambda **kw: runs.append(kw) or types.SimpleNamespace(
        log=lambda *a, **k: None, summary={}, finish=lambda: None, dir="here")
    monkeypatch.setitem(sys.modules, "wandb", mod)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with pytest.warns(UserWarning, match="W&B worker did not start"):
        wandb_worker.submit(record("a"), None, **sink(tmp_path))
    assert [r["name"] for r in runs] == ["lru-int4-b8-perplexity"] and fake_wandb() == []


def test_disabled_submits_nothing_and_prestart_reads_the_command_line(fake_wandb, tmp_path):
    wandb_worker.submit(record("a"), None, **sink(tmp_path, mode="disabled"))
    assert not wandb_worker.running()
    for argv in (["wandb.mode=disabled"], ["policy=lru", "++wandb.mode='disabled'"], ["--help"],
                 ["--cfg", "job"]):
        assert wandb_worker.disabled_by(argv), argv
        wandb_worker.prestart(argv)
        assert not wandb_worker.running()
    for argv in ([], ["policy=lru", "wandb.mode=offline"], ["-m", "policy=full,lru"]):
        assert not wandb_worker.disabled_by(argv), argv
    wandb_worker.prestart(["policy=lru"])
    assert wandb_worker.running()


def test_the_temporary_folders_wandb_makes_go_with_the_worker(fake_wandb, tmp_path):
    """W&B's import makes temporary folders that only its exit handlers remove, and the worker
    skips those: it runs with a TMPDIR of its own, removed when it has exited."""
    wandb_worker.start()
    wandb_worker.submit(record("a"), None, **sink(tmp_path))
    wandb_worker.drain()
    media = fake_wandb()[0][2]
    assert Path(media).name.endswith("wandb-media") and not Path(media).exists()
    assert Path(media).parent.name.startswith("kvjax-wandb-")
    assert not Path(media).parent.exists() and wandb_worker._tmp is None


def test_folders_of_runs_that_are_gone_are_removed_when_a_worker_starts(tmp_path):
    """A killed run (SIGKILL, a launcher's worker ended abruptly) never removes its worker's
    folder; the next worker's start removes every one whose run is gone, and keeps those of
    runs still going and anything else."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{wandb_worker.TMP_PREFIX}{dead.pid}-abc"
    mine = tmp_path / f"{wandb_worker.TMP_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{wandb_worker.TMP_PREFIX}xyz"  # an old-style name: not ours to judge
    for d in (gone, mine, other):
        (d / "sub").mkdir(parents=True)
    assert wandb_worker.remove_orphans(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and mine.exists() and other.exists()