"""Hydra launchers for sweeps: submitit_local runs each point as its own job (a subprocess, as
submitit_slurm runs it as a SLURM job), every record lands in one store."""

import subprocess
import sys
from pathlib import Path

from kvjax.results import ResultsStore

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=tiny", "task.length=32", "task.chunk=16", "speed.prompt=0", "wandb.mode=disabled"]


def test_submitit_local_sweep_lands_in_one_store(tmp_path):
    store = tmp_path / "r.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=submitit_local", *TINY,
         "policy=window,full", "budget=16", "sweep=s", f"results={store}",
         f"hydra.sweep.dir={tmp_path}/m", f"xla_cache={tmp_path}/xla"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Submitit 'local' sweep output dir" in out.stderr + out.stdout
    recs = ResultsStore(store).records()
    assert sorted(r["point"]["policy"]["name"] for r in recs) == ["full", "window"]
    assert len({r["key"] for r in recs}) == 2 and {r["sweep"] for r in recs} == {"s"}
    assert sorted(Path(r["run_dir"]).name for r in recs) == ["0", "1"]
    jobs = [p for p in (tmp_path / "m" / ".submitit").iterdir() if p.name.isdigit()]
    assert len(jobs) == 2  # one submitit job (its id) per point
