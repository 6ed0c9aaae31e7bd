"""Hydra launchers and sweepers: submitit_local runs each point as its own job (a subprocess, as
submitit_slurm runs it as a SLURM job), Ray as a Ray task; every record lands in one store. The
Optuna sweeper searches under a memory cap. Ray is an extra (`.[ray]`, a large install); the
Optuna sweeper is in `.[dev]`, so its test always runs."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.results import ResultsStore

ROOT = Path(__file__).resolve().parent.parent
def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


TINY = ["model=tiny", "task.length=32", "task.chunk=16", "speed.prompt=0", "wandb.mode=disabled"]


def test_submitit_local_sweep_lands_in_one_store(tmp_path, xla_test_cache):
    store = tmp_path / "r.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=submitit_local", *TINY,
         "policy=window,full", "budget=16", "sweep=s", f"results={store}",
         f"hydra.sweep.dir={tmp_path}/m", f"xla_cache={xla_test_cache}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Submitit 'local' sweep output dir" in out.stderr + out.stdout
    recs = ResultsStore(store).records()
    assert sorted(r["point"]["policy"]["name"] for r in recs) == ["full", "window"]
    assert len({r["key"] for r in recs}) == 2 and {r["sweep"] for r in recs} == {"s"}
    assert sorted(Path(r["run_dir"]).name for r in recs) == ["0", "1"]
    jobs = [p for p in (tmp_path / "m" / ".submitit").iterdir() if p.name.isdigit()]
    assert len(jobs) == 2  # one submitit job (its id) per point


@pytest.mark.skipif(not _has("hydra_plugins.hydra_ray_launcher"),
                    reason='the Ray launcher is an extra: pip install -e ".[ray]"')
def test_ray_local_sweep_lands_in_one_store(tmp_path, xla_test_cache):
    """hydra/launcher=ray starts a local Ray instance; each point is a Ray task."""
    store = tmp_path / "r.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=ray",
         "+hydra.launcher.ray.init.num_cpus=2", "+hydra.launcher.ray.init.include_dashboard=false",
         *TINY, "policy=window,full", "budget=16", "sweep=r", f"results={store}",
         f"hydra.sweep.dir={tmp_path}/m", f"xla_cache={xla_test_cache}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Started a local Ray instance" in out.stderr + out.stdout
    recs = ResultsStore(store).records()
    assert sorted(r["point"]["policy"]["name"] for r in recs) == ["full", "window"]
    assert {r["sweep"] for r in recs} == {"r"} and len({r["key"] for r in recs}) == 2


@pytest.mark.parametrize("launcher, target, field, value", [
    ("slurm", "submitit_launcher.SlurmLauncher", "timeout_min", 120),
    ("ray_cluster", "ray_launcher.RayLauncher", "ray", {"init": {"address": "auto"},
                                                        "remote": {"num_cpus": 4, "num_gpus": 1}}),
])
def test_cluster_launcher_examples_compose(launcher, target, field, value):
    """The documented cluster configs resolve to their launcher (the cluster itself is not here)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kvjax import harness

    if launcher == "ray_cluster" and not _has("hydra_plugins.hydra_ray_launcher"):
        pytest.skip('the Ray launcher is an extra: pip install -e ".[ray]"')
    with initialize_config_dir(str(harness.CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    got = cfg.hydra.launcher[field]
    assert (OmegaConf.to_container(got) if not isinstance(got, int) else got) == value


def test_optuna_search_under_a_memory_cap_records_every_trial(tmp_path, xla_test_cache):
    """3 trials of +experiment=optuna_streaming on the tiny model, the search space narrowed on
    the command line: each trial is a recorded point; one over the cap scores the penalty and
    the best is the lowest perplexity among the trials under it."""
    import yaml

    store, cap = tmp_path / "r.jsonl", 40000
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", "+experiment=optuna_streaming", *TINY[:1],
         "task.length=64", *TINY[2:], "hydra.sweeper.n_trials=3", "budget=choice(16,32)",
         "policy.n_sink=choice(0,4)", "kv_dtype=f32", f"objective.max_cache_bytes={cap}",
         f"results={store}", f"hydra.sweep.dir={tmp_path}/m", f"xla_cache={xla_test_cache}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "alembic" not in out.stdout + out.stderr  # its INFO "setup plugin" lines
    recs = ResultsStore(store).records()
    assert len(recs) == 3 and {r["sweep"] for r in recs} == {"optuna_streaming"}
    over = [r for r in recs if r["cache"]["total_bytes"] > cap]
    under = [r for r in recs if r["cache"]["total_bytes"] <= cap]
    assert over and under  # the seeded sampler's 3 trials fall on both sides of the cap
    assert out.stdout.count("(penalty): cache") == len(over)
    best = yaml.safe_load((tmp_path / "m" / "optimization_results.yaml").read_text())
    winner = min(under, key=lambda r: r["metrics"]["value"])
    assert best["best_value"] == pytest.approx(winner["metrics"]["value"])
    assert best["best_params"] == {"policy.n_sink": winner["point"]["policy"]["n_sink"],
                                   "budget": winner["point"]["policy"]["budget"]}


@pytest.mark.parametrize("higher, cap, penalty, want", [
    (False, None, None, 12.5), (False, 100, None, 12.5), (False, 99, None, 1e9),
    (True, 99, None, -1e9), (False, 99, 7.0, 7.0)])
def test_objective_is_the_metric_or_the_penalty_over_the_cap(higher, cap, penalty, want):
    from kvjax.harness import objective

    rec = {"metrics": {"value": 12.5, "higher_is_better": higher}, "cache": {"total_bytes": 100}}
    assert objective(rec, cap, penalty, echo=lambda *a: None) == want
