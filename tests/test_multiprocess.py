"""Two local processes, 2 CPU devices each, joined by `jax.distributed` (gloo collectives) into
one 2 x 2 mesh: the sharded forward over both equals one process's unsharded forward. (The
harness does not run a point across processes yet: docs/scale-out.md.)"""

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
