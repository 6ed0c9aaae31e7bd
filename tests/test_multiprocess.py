"""Two local processes, 2 CPU devices each, joined by `jax.distributed` (gloo collectives) into
one 2 x 2 mesh: a `run.py` point (h2o, budget 32, on the sharded dense cache) run by both is
recorded once, with one unsharded process's answers. Its batch of 2 prompts is split over the
hosts, so the decoded tokens are gathered from both processes (`kvjax.mesh.to_numpy`). (A
forward-level variant gathering the logits of both processes measured the same equality at
1e-5; it was dropped for CI time. Perplexity on a mesh equals one device's in test_mesh.py.)"""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_py_point_across_two_processes(tmp_path, forced_devices, xla_test_cache):
    """The same `run.py` command in 2 processes (distributed.*, 2 CPU devices each, a 2 x 2
    mesh, one prompt of the batch on each host): one record (the second process finds the key
    stored), its answers equal to the point run in one process without a mesh."""
    from hydra import compose, initialize_config_dir

    from kvjax import harness
    from kvjax.experiment import run
    from kvjax.results import ResultsStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    point = ["model=tiny", "task=passkey", "task.length=340", "task.n_samples=2", "task.batch=2",
             "task.chunk=128", "speed.prompt=0",
             "wandb.mode=disabled", "policy=h2o", "budget=32", "policy.window=8"]
    args = [*point, "mesh.data=2", "mesh.model=2", f"results={tmp_path}/r.jsonl",
            f"xla_cache={xla_test_cache}", f"distributed.coordinator=127.0.0.1:{port}",
            "distributed.num_processes=2"]
    env = dict(os.environ, XLA_FLAGS=forced_devices(2),
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "run.py"), *args,
                               f"distributed.process_id={i}", f"hydra.run.dir={tmp_path}/p{i}"],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    (rec,) = ResultsStore(tmp_path / "r.jsonl").records()
    assert rec["point"]["cache"]["mesh"] == {"data": 2, "model": 2}
    assert sum("already there" in log for log in logs) == 1
    with initialize_config_dir(str(harness.CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*point, f"results={tmp_path}/one.jsonl",
                                           "xla_cache=null"])
    one = run(harness.spec_from_config(cfg), tmp_path / "one", echo=lambda *a, **k: None)
    answers = [[s["answer"] for s in json.loads((d / "samples.json").read_text())]
               for d in (tmp_path / "p0", tmp_path / "p1", tmp_path / "one")]
    assert len(answers[2]) == 2 and answers[0] == answers[1] == answers[2]  # both hosts: all rows
    same = lambda m: {k: v for k, v in m.items() if k != "baseline_source"}  # computed / cache
    assert same(rec["metrics"]) == same(one.record["metrics"])
    assert rec["cache"]["per_device_bytes"] < one.record["cache"]["total_bytes"]
