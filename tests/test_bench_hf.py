"""experiments/bench_hf.py without torch: the kvjax -> HF weight mapping, the install hint, flags.

The mapping is checked by writing it as a HF checkpoint directory and reading that back with
kvjax's own HF loader (`load_hf_dir`), which must give back the same config and params.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file

from experiments import bench_hf
from kvjax.config import tiny_config
from kvjax.loading.hf_loader import config_from_hf, load_hf_dir
from kvjax.model import init_params


@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_round_trips_through_the_hf_loader(tmp_path, tied):
    cfg = tiny_config(n_heads=4, n_kv_heads=2, tie_embeddings=tied, rope_theta=5e4, norm_eps=1e-6)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(3)))
    sd = bench_hf.hf_state_dict(cfg, params)
    assert ("lm_head.weight" in sd) and sd["lm_head.weight"].shape == (cfg.vocab_size, cfg.d_model)
    if tied:
        del sd["lm_head.weight"]  # a tied checkpoint stores the embedding once
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(bench_hf.hf_config_dict(cfg)))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, "<unk>"))
    tok.save(str(tmp_path / "tokenizer.json"))

    cfg2, params2, _ = load_hf_dir(tmp_path, name=cfg.name)
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_config_dict_is_a_llama_config():
    cfg = tiny_config(n_heads=6, n_kv_heads=3, head_dim=16)  # head_dim * H != d_model
    d = bench_hf.hf_config_dict(cfg)
    assert d["model_type"] == "llama" and d["head_dim"] == 16
    assert config_from_hf(d, cfg.name) == cfg


def test_missing_torch_names_the_install_commands(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ImportError) as e:
        bench_hf._import_hf()
    msg = str(e.value)
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in msg
    assert "pip install transformers" in msg
    with pytest.raises(ImportError):  # main fails before loading any model
        bench_hf.main(["--rounds", "1"])


def test_transformers_loads_with_the_repo_kernels_folder_off_the_path(monkeypatch):
    """transformers 5.25 imports HF's hub package `kernels` if `find_spec("kernels")` finds one;
    from the repo root it found kvjax's top-level `kernels/` and bench_hf died importing."""
    import importlib.util
    import types

    root = str(Path(bench_hf.__file__).resolve().parents[1])
    monkeypatch.syspath_prepend(root)
    ours = str(Path(root, "kernels", "__init__.py"))
    assert importlib.util.find_spec("kernels").origin == ours  # the shadowing guarded against
    seen = []

    class Transformers(types.ModuleType):
        @property
        def LlamaForCausalLM(self):  # loads modeling_llama, and hub_kernels with it
            spec = importlib.util.find_spec("kernels")  # None, or HF's where it is installed
            seen.append(spec and spec.origin)
            return object

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "transformers", Transformers("transformers"))
    before = list(sys.path)
    bench_hf._import_hf()
    assert len(seen) == 1 and seen[0] != ours
    assert sys.path == before


def test_flags():
    a = bench_hf.parse_args([])
    assert (a.prompt, a.contexts, a.rounds, a.hf_threads) == ([512, 2048], [128, 512, 1024], 5,
                                                              None)
    assert a.kv_extra == ["h2o:512:int4"] and bench_hf.json_path("t/hf.md") == "t/hf.json"
    a = bench_hf.parse_args(["--contexts", "64", "--hf-threads", "2", "--kv-extra",
                             "h2o:512:int4", "h2o:512:int4:all-slots"])
    assert a.contexts == [64] and a.hf_threads == [2] and len(a.kv_extra) == 2
    for bad in (["--steps", "0"], ["--contexts", "0"], ["--hf-threads", "0"], ["--prompt", "0"],
                ["--kv-extra", "h2o:x:int4"], ["--kv-extra", "h2o"],
                ["--kv-extra", "h2o:512:int4:all"], ["--kv-extra", "nosuch:512:int4"],
                ["--kv-extra", "h2o:512:int3"]):
        with pytest.raises(SystemExit):
            bench_hf.parse_args(bad)


def test_numbers_json_beside_the_table(tmp_path):
    """The JSON beside `--out` holds the table's medians and kvjax's speed-up over each HF
    variant (HF seconds / kvjax seconds, as the table's ratio columns), per measure; a
    kvjax-only variant (--kv-extra) has seconds and no ratio."""
    variants, hf = ["kvjax", "hf2", "hf1", "h2o:512:int4"], ["hf2", "hf1"]
    measures = [("prefill", 512), ("decode", 128), ("decode", 1024)]
    med = {("kvjax", measures[0]): 0.5, ("hf2", measures[0]): 1.0, ("hf1", measures[0]): 1.5,
           ("kvjax", measures[1]): 0.02, ("hf2", measures[1]): 0.06, ("hf1", measures[1]): 0.05,
           ("h2o:512:int4", measures[1]): 0.03, ("kvjax", measures[2]): 0.04,
           ("hf2", measures[2]): 0.07, ("hf1", measures[2]): 0.06}
    path = bench_hf.json_path(str(tmp_path / "t.md"))
    bench_hf.write_json(path, {"variants": variants,
                               "rows": bench_hf.records(measures, variants, hf, med)})
    data = json.loads((tmp_path / "t.json").read_text())
    rows = {(r["measure"], r["tokens"]): r for r in data["rows"]}
    assert rows["prefill", 512]["seconds"] == {"kvjax": 0.5, "hf2": 1.0, "hf1": 1.5}
    assert rows["prefill", 512]["speedup_vs"] == {"hf2": 2.0, "hf1": 3.0}
    assert rows["decode", 128]["seconds"]["h2o:512:int4"] == 0.03
    assert rows["decode", 128]["speedup_vs"]["hf2"] == pytest.approx(3.0)
    assert rows["decode", 1024]["speedup_vs"] == pytest.approx({"hf2": 1.75, "hf1": 1.5})


def test_floors_count_the_projection_flops_of_the_params():
    """bench_floors' GFLOP figure: 2 x tokens x every projection weight of every layer, the
    count read off the params themselves (embedding, norms and head excluded)."""
    from experiments import bench_floors

    cfg = tiny_config(n_heads=6, n_kv_heads=2, head_dim=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    weights = sum(params["layers"][k].size for k in
                  ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    assert bench_floors.projection_flops(cfg, 7) == 2 * 7 * weights


def test_floors_count_causal_attention_products_from_the_mask():
    """q.k and p.v over the pairs a causal mask keeps: 2 products x 2 E FLOP per kept pair."""
    from experiments import bench_floors

    cfg = tiny_config(n_heads=6, n_kv_heads=2, head_dim=16)
    kept = int(np.tril(np.ones((9, 9), bool)).sum())
    assert bench_floors.causal_attention_flops(cfg, 9) == (
        kept * 2 * (2 * cfg.head_dim) * cfg.n_heads * cfg.n_layers)


def test_floors_need_torch_before_any_model_loads(monkeypatch):
    from experiments import bench_floors

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(bench_floors, "load_model", lambda *a: pytest.fail("model loaded"))
    with pytest.raises(ImportError, match="pip install transformers"):
        bench_floors.main(["--rounds", "1"])
    with pytest.raises(SystemExit):
        bench_floors.main(["--rounds", "0"])


def test_floors_without_attention_removes_only_the_attention():
    """bench_floors' `WithoutAttention` prefill: the same program with attention's output
    replaced by the queries. Layer 0 stores the same keys and values as the real cache (they do
    not depend on attention); the layers after it and the logits differ (attention is gone)."""
    from experiments import bench_floors
    from kvjax.cache import KVCache
    from kvjax.formats import get_format
    from kvjax.generate import prefill
    from kvjax.policies import get_policy

    cfg = tiny_config(n_heads=6, n_kv_heads=2, head_dim=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    out = {}
    for kind in (KVCache, bench_floors.WithoutAttention):
        cache = kind.init(cfg, 1, get_policy("full"), get_format("f32"), 8)
        out[kind] = prefill(params, prompt, cache, cfg)
    (lg, real), (lg_bare, bare) = out.values()
    assert isinstance(bare, bench_floors.WithoutAttention)
    first, second = (bare.layer_view(0), real.layer_view(0)), (bare.layer_view(1), real.layer_view(1))
    np.testing.assert_array_equal(np.asarray(first[0].k), np.asarray(first[1].k))
    np.testing.assert_array_equal(np.asarray(first[0].v), np.asarray(first[1].v))
    assert not np.allclose(np.asarray(second[0].k), np.asarray(second[1].k))
    assert not np.allclose(np.asarray(lg_bare), np.asarray(lg))


def test_floors_in_place_layers_decode_the_same_and_copy_no_layer():
    """bench_floors' `InPlaceLayers`: every layer's cache in buffers of its own. From the same
    prompt (`decode_bases`) its decode steps give the same logits and, stacked back, the same
    cache as `KVCache`'s (`WithoutAttention`'s do not); its compiled step takes no dynamic slice
    of a layer's stored keys or values, which the stacked cache's does."""
    import re

    import jax.numpy as jnp

    from experiments import bench_floors
    from kvjax.cache import KVCache
    from kvjax.generate import decode_step

    cfg = tiny_config(n_heads=6, n_kv_heads=2, head_dim=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    bases = bench_floors.decode_bases(params, cfg, [3, 1, 4, 1, 5, 9, 2, 6], 12,
                                      jax.random.PRNGKey(0))
    (tok, cache), (tok_ours, ours) = bases[KVCache], bases[bench_floors.InPlaceLayers]
    assert int(tok_ours[0]) == int(tok[0])
    bare_lg, _ = decode_step(params, tok, bases[bench_floors.WithoutAttention][1], cfg)
    shapes = "|".join(",".join(map(str, s["q"].shape[1:])) for s in (cache.k, cache.v))
    layer_slices = {}  # instructions that slice one layer's stored keys or values
    for c in (cache, ours):
        text = decode_step.jitted.lower(params, tok, c, cfg).compile().as_text()
        layer_slices[type(c)] = len(re.findall(rf"= f32\[(1,)?({shapes})\]\S* dynamic-slice\(",
                                               text))
    assert layer_slices[KVCache] > 0 and layer_slices[bench_floors.InPlaceLayers] == 0
    for step in range(3):
        lg_ref, cache = decode_step(params, tok, cache, cfg)
        lg_ours, ours = decode_step(params, tok, ours, cfg)
        np.testing.assert_array_equal(np.asarray(lg_ours), np.asarray(lg_ref))
        if step == 0:
            assert not np.allclose(np.asarray(bare_lg), np.asarray(lg_ref))
        tok = jnp.argmax(lg_ref, -1).astype(jnp.int32)
    assert isinstance(ours, bench_floors.InPlaceLayers) and len(ours.k) == cfg.n_layers
    jax.tree.map(np.testing.assert_array_equal, ours.stacked(), cache)


def test_bench_bounded_specs_and_paired_summary():
    """bench_bounded: a bad spec, policy or format stops before the model loads; the summary
    pairs each round's bounded and all-slots times."""
    from experiments import bench_bounded

    assert bench_bounded.parse_spec("128:h2o:int4:512") == (128, "h2o", "int4", 512)
    for bad in ("128:h2o:int4", "x:h2o:int4:512", "0:h2o:int4:512"):
        with pytest.raises(ValueError, match="--specs"):
            bench_bounded.parse_spec(bad)
    for bad in (["--specs", "128:nope:int4:512"], ["--specs", "128:h2o:int5:512"],
                ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench_bounded.main(bad)
    rows = bench_bounded.summarize({("s", "bounded"): [1.0, 2.0, 3.0],
                                    ("s", "all slots"): [2.0, 2.5, 2.0]})
    assert rows == [{"spec": "s", "bounded_s": 2.0, "all_slots_s": 2.0, "paired_diff_s": -0.5,
                     "bounded_faster": 2, "rounds": 3}]


def test_time_decode_is_greedy_decoding_from_a_copy():
    """The benchmarks' kvjax decode timing (`time_decode`): the tokens of `generate`'s greedy
    decoding, from a copy of the cache it is given (which stays usable for the next round)."""
    from kvjax.cache import KVCache
    from kvjax.formats import get_format
    from kvjax.generate import generate, prefill, sample
    from kvjax.policies import get_policy

    cfg = tiny_config()
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompt, key = list(range(3, 20)), jax.random.PRNGKey(0)
    full, f32 = get_policy("full"), get_format("f32")
    lg, base = prefill(params, [prompt], KVCache.init(cfg, 1, full, f32, 40), cfg)
    tok = sample(lg, key)
    want, _ = generate(params, cfg, [prompt], 7, full, f32, max_len=40)
    for _ in range(2):  # the base cache is not consumed
        dt, toks = bench_hf.time_decode(params, cfg, tok, base, 6, key)
        assert dt > 0 and [int(tok[0]), *toks] == np.asarray(want).ravel()[-7:].tolist()


def test_report_prints_and_writes_the_table_and_its_json(tmp_path, capsys):
    """`report`: every benchmark's output; the Markdown printed, and with --out also written
    there with its figures as JSON beside it."""
    bench_hf.report("| a |\n|---|", None, {"x": 1})
    assert "| a |" in capsys.readouterr().out and not list(tmp_path.iterdir())
    out = tmp_path / "t.md"
    bench_hf.report("| a |\n|---|", str(out), {"x": [1, 2]})
    assert out.read_text() == "| a |\n|---|\n"
    assert json.loads((tmp_path / "t.json").read_text()) == {"x": [1, 2]}
    bench_hf.report("| b |", str(tmp_path / "new" / "dir" / "t.md"), {})  # its folder is made
    assert (tmp_path / "new" / "dir" / "t.md").read_text() == "| b |\n"
