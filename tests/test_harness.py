"""run.py and the harness: Hydra configs, pre-load checks, point keys, end-to-end runs on the
tiny model, baselines, skipping, W&B, the CLI, and a killed-then-resumed sweep."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from kvjax import experiment, harness
from kvjax.experiment import ConfigError, plan
from kvjax.results import ResultsStore
from kvjax.tasks.text import default_text

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `experiments` is a top-level folder, importable from the root
    sys.path.insert(0, str(ROOT))
TINY = ["model=tiny", "task.length=64", "task.chunk=16", "speed.prompt=0",
        "wandb.mode=disabled"]


def cfg_of(*overrides):
    with initialize_config_dir(str(harness.CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def spec_of(*overrides, tmp=None):
    extra = [f"results={tmp}/results.jsonl"] if tmp is not None else []
    return harness.spec_from_config(cfg_of(*overrides, *extra))


def no_omegaconf(obj) -> bool:
    if isinstance(obj, (DictConfig, ListConfig)):
        return False
    if dataclasses.is_dataclass(obj):
        return all(no_omegaconf(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return all(no_omegaconf(x) for x in obj)
    if isinstance(obj, dict):
        return all(no_omegaconf(x) for x in obj.values())
    return True


# ----------------------------------------------------------------------------- configs


def test_defaults_compose_to_a_frozen_spec():
    cfg = cfg_of()
    assert cfg.model.name == "smollm2-135m" and cfg.policy.name == "full"
    assert cfg.task.name == "perplexity" and cfg.task.length == 1024 and cfg.task.chunk == 128
    assert cfg.kv_dtype == "f32" and cfg.budget is None and cfg.max_len is None
    assert cfg.wandb.mode == "offline" and cfg.results == "results/results.jsonl"
    spec = harness.spec_from_config(cfg)
    assert spec.results == str(Path("results/results.jsonl").resolve())
    assert no_omegaconf(spec) and hash(spec.task) and hash(spec.model)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kv_dtype = "int4"


def test_every_task_and_policy_config_composes():
    for task in ("perplexity", "passkey", "needle", "agreement"):
        spec = spec_of(f"task={task}")
        assert spec.task.name == task
    names = sorted(p.stem for p in (ROOT / "configs" / "policy").glob("*.yaml"))
    assert {"full", "window"} <= set(names)
    for name in names:
        assert spec_of(f"policy={name}").policy == name
    assert spec_of("+experiment=pareto").sweep == "pareto"


@pytest.mark.parametrize("override, words", [
    ("foo=1", ["foo"]),
    ("task.lenght=5", ["lenght"]),
    ("policy=nope", ["policy/nope", "full"]),
    ("task=nope", ["task/nope", "perplexity"]),
    ("budget=abc", ["budget", "abc"]),
])
def test_hydra_rejects_unknown_keys_options_and_types(override, words):
    with pytest.raises((HydraException, OmegaConfBaseException)) as e:
        cfg_of(override)
    assert all(w in str(e.value) for w in words)


@pytest.mark.parametrize("overrides, pattern", [
    (["kv_dtype=int3"], r"unknown kv_dtype 'int3'; valid choices: bf16, f32, fp8, int2, int4, int8"),
    (["policy=lru", "budget=2048"], r"budget=2048 is above the length of task 'perplexity' \(1024"),
    (["policy=snapkv"], r"prefill-only.*'perplexity' has no prompt.*needle, passkey"),
    (["model.name=nope"], r"unknown model 'nope'; registered models: smollm2-135m"),
    (["task.text_file=/no/such.txt"], r"no such file"),
    (["wandb.mode=sometimes"], r"wandb.mode='sometimes'; valid choices: offline, online"),
    (["+policy.windw=3", "policy=lru"], r"policy 'lru' has no option\(s\) \['windw'\]"),
    (["max_len=100"], r"max_len=100 is shorter than task 'perplexity' needs \(1024"),
])
def test_bad_combinations_fail_before_the_model_loads(overrides, pattern, monkeypatch):
    monkeypatch.setattr(experiment, "load", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=pattern):
        plan(spec_of(*overrides))


@pytest.mark.parametrize("overrides, pattern", [
    (["task=passkey", "task.length=20"], (r"task 'passkey': length=20 is too short for the "
                                         r"prompt's fixed parts \(\d+ tokens\); use length >= ")),
    (["task=needle", "task.lengths=[20]"], r"task 'needle': length 20 is too short"),
])
def test_prompt_that_cannot_be_built_fails_before_the_model_loads(overrides, pattern, tmp_path,
                                                                  monkeypatch):
    """Token counts need the tokenizer only: it is read without the weights."""
    monkeypatch.setattr(experiment, "load", lambda *a: pytest.fail("the model was loaded"))
    spec = spec_of("model=tiny", "wandb.mode=disabled", *overrides, tmp=tmp_path)
    with pytest.raises(ConfigError, match=pattern):
        experiment.run(spec, tmp_path / "run")
    assert not (tmp_path / "results.jsonl").exists()


def test_main_exits_with_the_error_message(capsys, monkeypatch):
    monkeypatch.setattr(experiment, "load", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        harness.main(cfg_of("kv_dtype=int3"))
    assert e.value.code == 2
    assert "error: unknown kv_dtype 'int3'" in capsys.readouterr().err


def test_main_stores_a_failure_after_planning_and_raises_it(tmp_path, monkeypatch):
    """A run that fails after `plan` leaves a failure record with the point's key; a bad
    config (refused by `plan`, or a single run's prompt check) leaves nothing."""
    def boom(spec, run_dir):
        raise RuntimeError("device out of memory")

    monkeypatch.setattr(harness, "run", boom)
    cfg = cfg_of(*TINY, f"results={tmp_path}/r.jsonl")
    with pytest.raises(RuntimeError, match="device out of memory"):
        harness.main(cfg)
    (failed,) = ResultsStore(tmp_path / "r.jsonl").records()
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: device out of memory"
    assert failed["key"] == plan(harness.spec_from_config(cfg)).key
    with pytest.raises(SystemExit):
        harness.main(cfg_of(*TINY, "kv_dtype=int3", f"results={tmp_path}/bad.jsonl"))
    monkeypatch.setattr(harness, "run", lambda *a: experiment.run(spec_of(
        *TINY, "task=passkey", "task.length=20", tmp=tmp_path), tmp_path / "run"))
    with pytest.raises(SystemExit) as e:  # one run's bad input found after planning
        harness.main(cfg_of(*TINY, f"results={tmp_path}/bad.jsonl"))
    assert e.value.code == 2 and not (tmp_path / "bad.jsonl").exists()


def test_point_key_ignores_volatile_settings_and_dedupes_equivalent_points(tmp_path):
    key = lambda *o: plan(spec_of(*o)).key
    base = key("policy=lru", "kv_dtype=int4")
    assert base == key("policy=lru", "kv_dtype=int4", "wandb.mode=disabled", "force=true",
                       f"results={tmp_path}/x.jsonl", "progress=false", "xla_cache=null")
    assert base == key("policy=lru", "kv_dtype=int4", "budget=256")  # the policy's default
    assert base != key("policy=lru", "kv_dtype=int4", "budget=128")
    assert base != key("policy=lru", "kv_dtype=int4", "sweep=s1")
    assert base != key("policy=lru", "kv_dtype=int8")
    assert base != key("policy=lru", "kv_dtype=int4", "task.chunk=64")
    assert key("policy=full") == key("policy=full", "budget=128")  # full ignores budget
    p = plan(spec_of("policy=full", "budget=128"))
    assert p.policy.budget is None and "ignored" in p.notes[0]


# ----------------------------------------------------------------------------- running


def test_end_to_end_records_baseline_cache_skip_and_force(tmp_path):
    lines = []
    full = spec_of(*TINY, tmp=tmp_path)
    out = experiment.run(full, tmp_path / "run0", echo=lines.append)
    rec = out.record
    assert out.stored and rec["metrics"]["baseline_source"] == "this run"
    assert rec["metrics"]["delta"] == 0.0 and rec["metrics"]["metric"] == "perplexity"
    assert rec["cache"]["kv_bytes"] == rec["cache"]["closed_form_bytes"] == 2 * 2 * 2 * 32 * 64 * 4
    assert rec["cache"]["compression"] == 1.0
    assert rec["config"]["task"]["length"] == 64 and rec["config"]["wandb"]["mode"] == "disabled"
    assert rec["git"]["commit"] is None or len(rec["git"]["commit"]) == 40
    assert rec["env"]["versions"]["jax"] and rec["text"]["source"] == "pydoc_data.topics"
    assert len(rec["text"]["sha256"]) == 64
    saved = json.loads((tmp_path / "run0" / "metrics.json").read_text())
    assert saved["key"] == rec["key"] and saved["metrics"] == rec["metrics"]
    nll = np.load(tmp_path / "run0" / "nll.npy")
    assert nll.dtype == np.float32 and nll.shape == (63,)
    assert np.exp(nll.mean(dtype=np.float64)) == pytest.approx(rec["metrics"]["perplexity"])
    table = "\n".join(lines)
    for word in ("perplexity", "full cache", "delta", "cache bytes (measured)",
                 "cache bytes (closed form)", "compression", "prefill / decode"):
        assert word in table

    win = spec_of(*TINY, "policy=window", "budget=16", "kv_dtype=bf16", tmp=tmp_path)
    rec2 = experiment.run(win, tmp_path / "run1", echo=lines.append).record
    m = rec2["metrics"]
    assert m["baseline_source"] == "cache" and m["baseline"] == rec["metrics"]["value"]
    assert m["delta"] == pytest.approx(m["value"] - m["baseline"])
    assert rec2["cache"]["capacity"] == 16 and rec2["cache"]["compression"] == 8.0

    skipped = experiment.run(win, tmp_path / "run2", echo=lines.append)
    assert skipped.skipped and skipped.record is None and "skip: point" in lines[-1]
    assert not (tmp_path / "run2").exists()
    forced = experiment.run(dataclasses.replace(win, force=True), tmp_path / "run3",
                            echo=lines.append)
    assert forced.stored
    recs = ResultsStore(tmp_path / "results.jsonl").records()
    assert sorted(r["key"] for r in recs) == sorted([rec["key"], rec2["key"]])
    assert recs[-1]["run_dir"].endswith("run3")


def test_text_file_speed_probe_and_wandb_offline(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("Ünïcode prose, plain and simple. " * 40, encoding="utf-8")
    spec = spec_of("model=tiny", f"task.text_file={text}", "task.length=48", "task.chunk=16",
                   "speed.prompt=16", "speed.new_tokens=4", "wandb.mode=offline",
                   "policy=window", "budget=32", tmp=tmp_path)
    rec = experiment.run(spec, tmp_path / "run", echo=lambda *a: None).record
    assert rec["metrics"]["n_tokens"] == 48 and rec["text"]["source"] == str(text.resolve())
    assert rec["metrics"]["baseline_source"] == "computed"
    t = rec["timings"]
    assert t["prefill_s"] > 0 and t["decode_tok_s"] > 0 and t["prefill_tokens"] == 16
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


@pytest.fixture(scope="module")
def xla_dir(tmp_path_factory):
    """A persistent XLA cache shared by this module's subprocesses (same programs, one compile)."""
    return tmp_path_factory.mktemp("xla")


def test_cli_prints_the_table_and_writes_the_run_dir(tmp_path, xla_dir):
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *TINY, "policy=window", "budget=16",
         f"results={tmp_path}/r.jsonl", f"hydra.run.dir={tmp_path}/run", f"xla_cache={xla_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "perplexity" in out.stdout and "compression" in out.stdout and "delta" in out.stdout
    assert {"metrics.json", "nll.npy"} <= {p.name for p in (tmp_path / "run").iterdir()}
    bad = subprocess.run([sys.executable, str(ROOT / "run.py"), "kv_dtype=int3"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "valid choices" in bad.stderr


def test_killed_sweep_resumes_without_duplicates_and_reports_every_point(tmp_path, xla_dir):
    """A sweep killed after its second record, then re-run with the joblib launcher."""
    from experiments.report import POINT_GID, build_report

    store = tmp_path / "results.jsonl"
    sweep = [sys.executable, str(ROOT / "run.py"), "-m", *TINY, "policy=window,full",
             "kv_dtype=f32,bf16", "budget=16", "sweep=t", f"results={store}",
             f"hydra.sweep.dir={tmp_path}/multirun", f"xla_cache={xla_dir}"]
    proc = subprocess.Popen(sweep, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if store.exists() and len(store.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = ResultsStore(store).records()
    assert 2 <= len(first) < 4, "the sweep should have been killed part-way"
    out = subprocess.run([*sweep, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = ResultsStore(store).records()
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)) == 4  # {window, full} x {f32, bf16}
    assert {r["key"]: r["created"] for r in first}.items() <= {
        r["key"]: r["created"] for r in recs}.items()  # done points were skipped, not redone
    assert all(json.loads(line) for line in store.read_text().splitlines())

    rep = build_report(store, tmp_path / "report", sweep="t", echo=lambda *a, **k: None)
    (group, points), = rep["pareto"].items()  # one model, task, text, length, layout, mode
    png = (tmp_path / "report" / f"{group.slug()}.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert group.task == "perplexity" and group.text == recs[0]["text"]["sha256"]
    assert {p["key"] for p in points} == set(keys)
    assert "report.md" in os.listdir(tmp_path / "report")
    assert POINT_GID == "point"


@pytest.mark.slow
def test_real_model_smoke(tmp_path, ref):
    """`python run.py` on SmolLM2-135M with a short text: the per-token NLL matches the
    reference numbers of an independent implementation (same text start, same ids)."""
    t = time.time()
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "task.length=64", "task.chunk=32",
         "speed.prompt=16", "speed.new_tokens=2", "wandb.mode=disabled", "xla_cache=null",
         f"results={tmp_path}/r.jsonl", f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.time() - t < 90
    rec = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert rec["model"]["name"] == "smollm2-135m" and rec["model"]["n_layers"] == 30
    nll = np.load(tmp_path / "run" / "nll.npy")
    assert nll.shape == (63,)
    if default_text().startswith(ref["text"]):  # pydoc_data differs between Pythons
        np.testing.assert_allclose(nll, ref["nll"][:63], atol=2e-3)


def test_paged_layout_runs_from_the_cli(tmp_path):
    """`cache.layout=paged cache.impl=pallas` reaches the task (interpret mode on CPU), is part
    of the point key, and a policy the paged layout cannot run is refused before any work."""
    base = [sys.executable, str(ROOT / "run.py"), "model=tiny", "task.length=48",
            "speed.prompt=8", "speed.new_tokens=2", "wandb.mode=disabled",
            f"results={tmp_path / 'r.jsonl'}", f"hydra.run.dir={tmp_path / 'run'}"]
    out = subprocess.run(base + ["cache.layout=paged", "cache.impl=pallas", "policy=window",
                                 "budget=16"], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    assert "cache=paged(page=16, pallas)" in out.stdout
    rec = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])
    assert rec["point"]["cache"]["layout"] == "paged"
    bad = subprocess.run(base + ["cache.layout=paged", "policy=h2o", "budget=16"],
                         capture_output=True, text=True, cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "not supported on the paged layout" in bad.stderr


# ----------------------------------------------------------------------------- sweep planning


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]])
def test_a_sweep_with_a_bad_point_is_refused_before_any_point_runs(tmp_path, launcher):
    """Every point is planned first: a bad one is one line naming its overrides and value."""
    store = tmp_path / "results.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", *TINY, "policy=window",
         "kv_dtype=f32,int3", "budget=16,abc", f"results={store}",
         f"hydra.sweep.dir={tmp_path}/multirun", *launcher],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    abc = ("Error merging override budget=abc: Value 'abc' of type 'str' could not be "
           "converted to Integer full_key: budget object_type=RunConf")
    int3 = "unknown kv_dtype 'int3'; valid choices: bf16, f32, fp8, int2, int4, int8"
    assert lines == [f"error: sweep point #1 (kv_dtype=f32 budget=abc): {abc}",
                     f"error: sweep point #2 (kv_dtype=int3 budget=16): {int3}",
                     f"error: sweep point #3 (kv_dtype=int3 budget=abc): {abc}"]
    assert not store.exists() and not (tmp_path / "multirun").exists()  # nothing ran


def test_a_point_failing_at_run_time_is_stored_and_reported_and_the_sweep_goes_on(tmp_path):
    """passkey with 20 tokens passes `plan` but its prompt cannot be built (a run-time
    failure); the basic sweeper runs the next point, the store holds the failure, the report
    lists it, and a later run of the point is not skipped because of it."""
    from experiments.report import build_report

    store = tmp_path / "results.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", *TINY, "task=passkey,perplexity",
         "task.length=20", "sweep=f", f"results={store}", f"hydra.sweep.dir={tmp_path}/m"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 1 and "too short for the prompt's fixed parts" in out.stderr
    recs = {r["point"]["task"]["name"]: r for r in ResultsStore(store).records()}
    failed, done = recs["passkey"], recs["perplexity"]
    assert failed["status"] == "failed" and "status" not in done
    assert failed["error"].startswith("ConfigError: task 'passkey': length=20 is too short")
    assert failed["key"] == plan(spec_of(*TINY, "task=passkey", "task.length=20", "sweep=f",
                                         tmp=tmp_path)).key
    assert ResultsStore(store).find(failed["key"]) is None  # not done: a rerun retries it
    assert ResultsStore(store).find(done["key"])["key"] == done["key"]
    rep = build_report(store, tmp_path / "report", sweep="f", echo=lambda *a, **k: None)
    assert [r["key"] for r in rep["failed"]] == [failed["key"]]
    assert "## Failed runs" in (tmp_path / "report" / "report.md").read_text()
