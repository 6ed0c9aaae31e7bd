"""The sharded model and cache (kvjax.mesh) on 8 forced host devices, in a subprocess (the
device count is fixed when jax first starts): results equal one device, per-device bytes are
the total over the shards, and decoding compiles once."""

import json
import os
import subprocess
import sys

import pytest

DEVICES = 8


def worker() -> dict:
    """Runs in the subprocess; returns what the test asserts on."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.cache import _bytes, device_bytes, get_layout
    from kvjax.config import tiny_config
    from kvjax.experiment import build_format
    from kvjax.generate import decode_step, generate
    from kvjax.mesh import MeshSpec, abstract_sharded, cache_specs, shard_params
    from kvjax.model import forward_jit, init_params
    from kvjax.policies import get_policy

    assert jax.device_count() == DEVICES
    cfg = tiny_config(head_dim=64, max_seq_len=128)
    params = init_params(cfg, jax.random.PRNGKey(0))
    mesh = MeshSpec(data=2, model=2)
    sparams, reasons = shard_params(params, cfg, mesh)
    layout = get_layout("dense", mesh=mesh)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (80, 61)]
    out = {"param_reasons": list(reasons),
           "wq_spec": list(sparams["layers"]["wq"].sharding.spec),
           "wo_shard": list(sparams["layers"]["wo"].addressable_shards[0].data.shape)}

    def compare(name, c1, c2, policy, fmt, **extra):
        kv1 = (c1.k, c1.v, c1.pos, c1.stats)
        kv2 = (c2.k, c2.v, c2.pos, c2.stats)
        diff = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                   for a, b in zip(jax.tree.leaves(kv1), jax.tree.leaves(kv2)))
        per_dev, _ = abstract_sharded(layout.abstract(cfg, 2, policy, fmt, 128), mesh)
        out[name] = {
            "cache_maxdiff": diff, "pos_equal": bool(np.array_equal(c1.pos, c2.pos)),
            "kv_total": _bytes(kv1), "kv_device": device_bytes(kv2),
            "nbytes": c1.nbytes(), "nbytes_device": c2.nbytes(per_device=True),
            "abstract_device": _bytes(per_dev.buffers()),
            "length_bytes": _bytes(c1.length), "flag_bytes": _bytes(c1.nonfinite),
            "k_spec": list(jax.tree.leaves(c2.k)[0].sharding.spec)[:3],
            "reasons": list(cache_specs(c2, mesh).reasons), **extra,
        }

    # forward (full policy, f32): logits and cache of a prompt chunk
    fmt, full = build_format("f32", {}), get_policy("full")
    toks = jnp.asarray([p[:48] for p in prompts], jnp.int32)
    lg1, c1 = forward_jit(params, toks, get_layout("dense").init(cfg, 2, full, fmt, 128), cfg)
    lg2, c2 = forward_jit(sparams, toks, layout.init(cfg, 2, full, fmt, 128), cfg)
    compare("full", c1, c2, full, fmt, logits_maxdiff=float(jnp.max(jnp.abs(lg1 - lg2))))

    # generate with a policy that evicts (h2o) into int4 storage (scales, zeros, residual)
    fmt, h2o = build_format("int4", {}), get_policy("h2o", budget=64)
    t1, c1 = generate(params, cfg, prompts, 8, h2o, fmt, max_len=128)
    decode_step.clear_cache()
    t2, c2 = generate(sparams, cfg, prompts, 8, h2o, fmt, max_len=128, layout=layout)
    compare("h2o_int4", c1, c2, h2o, fmt, tokens_equal=bool(np.array_equal(t1, t2)),
            decode_compiles=decode_step._cache_size())

    # a cache with room beyond its tokens: attention reads 128 of 512 slots (`prefixes`), the
    # prefix picked from positions sharded over rows and kv heads
    h2o = get_policy("h2o", budget=512)
    t1, c1 = generate(params, cfg, prompts, 8, h2o, fmt, max_len=512)
    t2, c2 = generate(sparams, cfg, prompts, 8, h2o, fmt, max_len=512, layout=layout)
    t3, _ = generate(params, cfg, prompts, 8, get_policy("h2o", budget=128), fmt,
                     max_len=128)  # 128 slots: no bound (nothing evicted in either)
    out["bounded"] = {"prefixes": list(c1.prefixes()), "tokens_equal": bool(
        np.array_equal(t1, t2)), "unbounded_tokens_equal": bool(np.array_equal(t1, t3)),
        "cache_maxdiff": max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(
            b, np.float32)))) for a, b in zip(jax.tree.leaves((c1.k, c1.v, c1.pos, c1.stats)),
                                                jax.tree.leaves((c2.k, c2.v, c2.pos, c2.stats))))}
    return out


@pytest.fixture(scope="module")
def result(forced_devices, xla_test_cache):
    env = dict(os.environ, XLA_FLAGS=forced_devices(DEVICES), JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), xla_test_cache], env=env,
                       cwd=root, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_params_are_sharded_megatron_style(result):
    assert result["param_reasons"] == []
    assert result["wq_spec"] == [None, None, "model", None]
    assert result["wo_shard"] == [2, 2, 64, 32]  # [L, H/2, E, D]


@pytest.mark.parametrize("case", ["full", "h2o_int4"])
def test_sharded_forward_and_generate_equal_one_device(result, case):
    r = result[case]
    if case == "full":  # forward
        assert r["logits_maxdiff"] < 1e-5
    else:  # generate: prefill, 8 decode steps, h2o evicting into int4
        assert r["tokens_equal"]
    assert r["pos_equal"] and r["cache_maxdiff"] < 1e-5
    assert r["k_spec"] == [None, "data", "model"]
    assert r["reasons"] == []


@pytest.mark.parametrize("case", ["full", "h2o_int4"])
def test_per_device_bytes(result, case):
    r = result[case]
    assert r["kv_device"] * 4 == r["kv_total"]  # k, v (+ int4 scales, zeros, residual), pos, stats
    # + lengths [B] over data only, the nonfinite flags [L] replicated
    want = r["kv_total"] // 4 + r["length_bytes"] // 2 + r["flag_bytes"]
    assert r["nbytes_device"] == want == r["abstract_device"]
    assert r["nbytes"] > r["nbytes_device"]


def test_sharded_bounded_reads_equal_one_device(result):
    """Attention bounded by the occupied slots (a 512-slot cache holding < 128 tokens) decodes
    the same tokens and cache sharded as on one device, and as a cache with no room to bound."""
    r = result["bounded"]
    assert r["prefixes"] == [128, 256, 512]
    assert r["tokens_equal"] and r["unbounded_tokens_equal"] and r["cache_maxdiff"] < 1e-5


def test_decode_compiles_once(result):
    assert result["h2o_int4"]["decode_compiles"] == 1  # 8 steps, the cache keeps its sharding


def _abstract(policy, batch=2, **cfg_kw):
    from kvjax.cache import KVCache
    from kvjax.config import tiny_config
    from kvjax.experiment import build_format
    from kvjax.policies import get_policy

    cfg = tiny_config(head_dim=64, max_seq_len=128, **cfg_kw)
    return cfg, KVCache.abstract(cfg, batch, get_policy(policy, budget=64), build_format("int4", {}),
                                 128)


def test_what_does_not_divide_is_replicated_with_a_reason():
    import jax

    from kvjax.cache import _bytes
    from kvjax.mesh import MeshSpec, abstract_sharded, cache_specs, param_specs
    from kvjax.model import init_params

    cfg, cache = _abstract("h2o", batch=3, n_heads=6, n_kv_heads=3)
    s = cache_specs(cache, MeshSpec(data=2, model=3))
    assert s.reasons == ("batch rows: 3 do not divide over mesh.data=2; replicated",)
    assert all(tuple(p)[:3] == (None, None, "model") for p in jax.tree.leaves(
        (s.specs.k, s.specs.pos), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    local, _ = abstract_sharded(cache, MeshSpec(data=2, model=3))
    assert _bytes((local.k, local.v, local.pos)) * 3 == _bytes((cache.k, cache.v, cache.pos))
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    p = param_specs(params, cfg, MeshSpec(model=2))
    assert p.reasons == ("kv heads (wq/wk/wv/wo): 3 do not divide over mesh.model=2; replicated",)
    assert tuple(p.specs["layers"]["wq"]) == () and tuple(p.specs["layers"]["w_up"])[2] == "model"
    from kvjax.model import split_layers  # per-layer [in, out] matrices: the same axes

    s = param_specs(jax.eval_shape(split_layers, params), cfg, MeshSpec(model=2)).specs["layers"]
    assert len(s["wq"]) == cfg.n_layers and all(tuple(w) == () for w in s["wq"])
    assert tuple(s["w_up"][0]) == (None, "model") and tuple(s["w_down"][1]) == ("model", None)
    s = param_specs(jax.eval_shape(split_layers, params), cfg, MeshSpec(model=3)).specs["layers"]
    assert tuple(s["wq"][0]) == (None, "model") and tuple(s["wo"][0]) == ("model", None)


def test_head_pool_shards_batch_only_and_paged_is_refused():
    from kvjax.cache import get_layout
    from kvjax.config import tiny_config
    from kvjax.experiment import build_format
    from kvjax.mesh import MeshSpec, cache_specs
    from kvjax.policies import get_policy

    _, pool = _abstract("adakv")
    s = cache_specs(pool, MeshSpec(data=2, model=2))
    assert s.reasons == ("head pool: its kv heads share one slot axis; replicated over model",)
    assert tuple(s.specs.owner)[:3] == (None, "data", None)
    cfg = tiny_config(head_dim=8, max_seq_len=64)
    paged = get_layout("paged").init(cfg, 1, get_policy("full"), build_format("f32", {}), 64)
    with pytest.raises(TypeError, match="page pool is shared by every row"):
        cache_specs(paged, MeshSpec(model=2))


def test_too_few_devices_is_one_clear_error():
    import jax

    from kvjax.mesh import MeshSpec

    n = jax.device_count() + 1
    with pytest.raises(ValueError, match=f"mesh.data={n} mesh.model=1 needs {n} devices.*"
                       f"xla_force_host_platform_device_count={n}"):
        MeshSpec(data=n).check_devices()
    with pytest.raises(ValueError, match="mesh.model=0 must be an integer >= 1"):
        MeshSpec(model=0)


def test_run_py_sweeps_the_mesh_with_equal_results(tmp_path, forced_devices, xla_test_cache):
    """`run.py -m mesh={data:1,model:1},{data:2,model:2}` on 4 forced devices: two points (the
    mesh is a layout, so it is in each point's key and record), one perplexity; too few
    devices is one line before the model loads."""
    from kvjax.results import ResultsStore

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["model=tiny", "task.length=48",
            "task.chunk=16", "speed.prompt=0", "wandb.mode=disabled", "policy=h2o", "budget=32",
            "policy.window=8", f"results={tmp_path}/r.jsonl", f"xla_cache={xla_test_cache}"]
    env = dict(os.environ, XLA_FLAGS=forced_devices(4),
               JAX_PLATFORMS="cpu")
    run_py = [sys.executable, os.path.join(root, "run.py")]
    p = subprocess.run([*run_py, "-m", *args, "mesh={data:1,model:1},{data:2,model:2}",
                        f"hydra.sweep.dir={tmp_path}/m"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = {(r["point"].get("cache", {}).get("mesh") or {}).get("model", 1) * 10
            + (r["point"].get("cache", {}).get("mesh") or {}).get("data", 1): r
            for r in ResultsStore(tmp_path / "r.jsonl").records()}
    assert sorted(recs) == [11, 22] and len({r["key"] for r in recs.values()}) == 2
    one, mesh = recs[11], recs[22]
    assert "mesh" not in one["cache"] and "cache" not in one["point"]  # no mesh: keys unchanged
    assert abs(mesh["metrics"]["value"] - one["metrics"]["value"]) < 1e-5
    assert mesh["cache"]["mesh"]["replicated"] == [
        "batch rows: 1 do not divide over mesh.data=2; replicated"]
    # batch 1 is replicated over data, kv heads split over model: half of k, v, pos, stats
    kv = one["cache"]["kv_bytes"]
    assert one["cache"]["total_bytes"] - mesh["cache"]["per_device_bytes"] > kv // 2 - 1024
    assert "mesh=data 2 x model 2" in p.stdout and "cache bytes per device" in p.stdout
    few = subprocess.run([*run_py, *args, "mesh.data=2", "mesh.model=4",
                          f"hydra.run.dir={tmp_path}/r"],
                         env=dict(env, XLA_FLAGS=forced_devices(2)),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert few.returncode == 2
    assert few.stderr.strip().splitlines()[-1] == (
        "error: mesh.data=2 mesh.model=4 needs 8 devices, this process has 2 (cpu); on CPU "
        "start it with XLA_FLAGS=--xla_force_host_platform_device_count=8, or lower the mesh")


if __name__ == "__main__":  # argv[1]: the tests' compile cache folder
    from kvjax.harness import set_xla_cache

    set_xla_cache(sys.argv[1])
    print(json.dumps(worker()))
