"""Two local processes, 2 CPU devices each, joined by `jax.distributed` (gloo collectives) into
one 2 x 2 mesh: the sharded forward over both equals one process's unsharded forward, and a
`run.py` point run by both is recorded once with one process's perplexity."""

import os
import socket
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs():
    import jax

    from kvjax.config import tiny_config
    from kvjax.model import init_params

    cfg = tiny_config(head_dim=64, max_seq_len=128)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(0)))
    toks = (np.arange(2 * 16, dtype=np.int32).reshape(2, 16) * 7) % cfg.vocab_size
    return cfg, params, toks


def _cache(cfg, layout):
    from kvjax.experiment import build_format
    from kvjax.policies import get_policy

    return layout.init(cfg, 2, get_policy("h2o", budget=64), build_format("int4", {}), 128)


def worker(process_id: int, port: int, out: str) -> None:
    from kvjax.mesh import init_distributed

    init_distributed(f"127.0.0.1:{port}", 2, process_id)
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from kvjax.cache import get_layout
    from kvjax.mesh import MeshSpec, shard_params
    from kvjax.model import forward_jit

    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
    cfg, params, toks = _inputs()
    mesh = MeshSpec(data=2, model=2)
    sparams, _ = shard_params(params, cfg, mesh)
    logits, _ = forward_jit(sparams, jnp.asarray(toks), _cache(cfg, get_layout(
        "dense", mesh=mesh)), cfg)
    full = multihost_utils.process_allgather(logits, tiled=True)  # [B, T, V] on every process
    if process_id == 0:
        np.save(out, np.asarray(full))


def test_two_processes_share_one_mesh(tmp_path):
    import jax.numpy as jnp

    from kvjax.cache import get_layout
    from kvjax.model import forward_jit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "logits.npy")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(i), str(port), out],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    cfg, params, toks = _inputs()
    want, _ = forward_jit(params, jnp.asarray(toks), _cache(cfg, get_layout("dense")), cfg)
    np.testing.assert_allclose(np.load(out), np.asarray(want), atol=1e-5, rtol=0)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


def test_run_py_point_across_two_processes(tmp_path):
    """The same `run.py` command in 2 processes (distributed.*, 2 CPU devices each, a 2 x 2
    mesh): one record (the second process finds the key stored), its perplexity equal to the
    point run in one process without a mesh."""
    from hydra import compose, initialize_config_dir

    from kvjax import harness
    from kvjax.experiment import run
    from kvjax.results import ResultsStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    point = ["model=tiny", "task.length=48", "task.chunk=16", "speed.prompt=0",
             "wandb.mode=disabled", "policy=h2o", "budget=32", "policy.window=8"]
    args = [*point, "mesh.data=2", "mesh.model=2", f"results={tmp_path}/r.jsonl", "xla_cache=null",
            f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
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
    assert abs(rec["metrics"]["value"] - one.record["metrics"]["value"]) < 1e-5
    assert rec["cache"]["per_device_bytes"] < one.record["cache"]["total_bytes"]
