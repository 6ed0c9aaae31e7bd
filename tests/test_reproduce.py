"""Paper reproductions: the re-computation task against independent forwards, the shape checks
failing on a wrong shape, and every reproduction's `--quick` end to end (real model)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.reproduce import PAPERS, get
from experiments.reproduce.__main__ import main
from experiments.reproduce.common import Done
from experiments.reproduce.recompute import PerplexityRecompute
from kvjax.cache import init_cache
from kvjax.experiment import ModelSpec, load
from kvjax.formats import get_format
from kvjax.model import forward
from kvjax.policies import get_policy
from kvjax.tasks.base import TaskContext
from kvjax.tasks.perplexity import Perplexity
from kvjax.tasks.text import default_text, encode_prefix


@pytest.fixture(scope="module")
def tiny():
    m = load(ModelSpec("tiny"))
    f32 = get_format("f32")
    ctx = TaskContext(m.params, m.cfg, m.tokenizer, get_policy("full"), f32, 64, default_text())
    return m, ctx


def test_recompute_with_a_window_past_the_text_is_the_full_cache(tiny):
    _, ctx = tiny
    full = Perplexity(length=64, chunk=16).run(ctx).arrays["nll"]
    rec = PerplexityRecompute(length=64, chunk=8, window=64).run(ctx).arrays["nll"]
    np.testing.assert_allclose(rec, full, rtol=1e-4, atol=1e-4)


def test_recompute_chunk_one_is_a_fresh_forward_over_the_last_window(tiny):
    """chunk=1: token i is predicted from ids[i-W .. i] alone, positions from 0 (checked against
    one forward per token over exactly those ids)."""
    m, ctx = tiny
    W, n = 5, 24
    rec = PerplexityRecompute(length=n, chunk=1, window=W).run(ctx).arrays["nll"]
    ids = encode_prefix(m.tokenizer, ctx.text, n)
    for i in (0, 3, W, 11, n - 2):
        seq = ids[max(0, i - W):i + 1]
        cache = init_cache(m.cfg, 1, get_policy("full"), ctx.fmt, len(seq))
        logits, _ = forward(m.params, jnp.asarray([seq], jnp.int32), cache, m.cfg)
        want = -jax.nn.log_softmax(logits[0, -1])[ids[i + 1]]
        assert rec[i] == pytest.approx(float(want), rel=1e-4, abs=1e-4), i
    # a shorter window loses context: the numbers differ from the full cache
    full = Perplexity(length=n, chunk=8).run(ctx).arrays["nll"]
    assert not np.allclose(rec[W + 1:], full[W + 1:], atol=1e-3)


def test_recompute_rejects_a_bad_window():
    with pytest.raises(ValueError, match="window=0"):
        PerplexityRecompute(length=64, window=0).validate()


def _done(tmp_path, label, nll):
    """A finished point whose per-token NLL is `nll` everywhere (perplexity e^nll)."""
    d = tmp_path / label.replace("/", "_")
    d.mkdir()
    np.save(d / "nll.npy", np.full(100, nll, np.float32))
    return Done(label, {"run_dir": str(d), "metrics": {"perplexity": float(np.exp(nll))}})


def test_streamingllm_check_fails_when_sinks_do_not_help(tmp_path):
    rep = get("streamingllm")
    good = {"W64/0/cache": _done(tmp_path, "w", 4.0), "W64/4/cache": _done(tmp_path, "s", 3.0),
            "W64/recompute": _done(tmp_path, "r", 2.95)}
    rep.check(good, {})
    with pytest.raises(AssertionError, match="window"):
        rep.check({**good, "W64/0/cache": _done(tmp_path, "w2", 3.1)}, {})
    with pytest.raises(AssertionError, match="re-computation"):
        rep.check({**good, "W64/recompute": _done(tmp_path, "r2", 2.0)}, {})


def test_tova_check_fails_when_tova_does_not_beat_the_window(tmp_path):
    rep = get("tova")
    good = {"full": _done(tmp_path, "f", 2.5), "0.5/tova": _done(tmp_path, "t", 2.6),
            "0.5/window": _done(tmp_path, "w", 3.2)}
    rep.check(good, {})
    with pytest.raises(AssertionError, match="window"):
        rep.check({**good, "0.5/window": _done(tmp_path, "w2", 2.62)}, {})


def _retrieval(k, n, kv=None, total=None, capacity=74):
    cache = {"kv_bytes": kv, "total_bytes": total, "capacity": capacity}
    return Done("x", {"metrics": {"accuracy": k / n, "n_correct": k, "n_samples": n},
                      "cache": cache})


def test_pyramid_check_fails_on_unequal_bytes_or_an_unanswerable_task():
    """The comparison must be at equal k+v bytes (a head pool may add its owner byte per
    slot, nothing else), and the full cache must retrieve."""
    rep = get("pyramid")
    good = {"passkey/full": _retrieval(5, 5),
            "passkey/64/snapkv": _retrieval(0, 5, 51200, 52000),
            "passkey/64/pyramid": _retrieval(1, 5, 51200, 52012),
            "passkey/64/adasnapkv": _retrieval(2, 5, 51200, 52000 + 200)}
    rep.check(good, {})
    with pytest.raises(AssertionError, match="not equal bytes"):
        rep.check({**good, "passkey/64/pyramid": _retrieval(1, 5, 51300, 52112)}, {})
    with pytest.raises(AssertionError, match="more than uniform"):
        rep.check({**good, "passkey/64/adasnapkv": _retrieval(2, 5, 51200, 52000 + 201)}, {})
    with pytest.raises(AssertionError, match="full cache retrieves"):
        rep.check({**good, "passkey/full": _retrieval(2, 5)}, {})


def test_pyramid_compare_counts_only_separated_intervals_as_wins():
    from experiments.reproduce.pyramid import compare

    done = {"passkey/48/snapkv": _retrieval(2, 20), "passkey/48/pyramid": _retrieval(15, 20),
            "passkey/48/adasnapkv": _retrieval(5, 20), "passkey/64/snapkv": _retrieval(18, 20),
            "passkey/64/pyramid": _retrieval(6, 20), "passkey/64/adasnapkv": _retrieval(18, 20)}
    got = {(c["budget"], c["policy"]): c["result"] for c in
           compare(done, ["passkey"], (48, 64), ("snapkv", "pyramid", "adasnapkv"))}
    assert got == {(48, "pyramid"): "win", (48, "adasnapkv"): "tie",
                   (64, "pyramid"): "loss", (64, "adasnapkv"): "tie"}


@pytest.mark.parametrize("answer,lost", [(" 865.\nsystem", True), (" 8656.", True),
                                         (" 86556.", False), (" 123456.", False),
                                         (" 8655 6", True), (" none", False)])
def test_pyramid_lost_digits_is_a_proper_subsequence_of_the_key(answer, lost):
    from experiments.reproduce.pyramid import lost_digits

    row = {"answer": answer, "key": 86556, "correct": "86556" in answer}
    assert lost_digits(row) is lost


def _gqa_extra(**change):
    """A finished gqa run's measurements (the shape `check` asserts), with `change` applied."""
    before = {"MHA-4": {"kv_bytes": 4096, "n_kv_heads": 4, "perplexity": 9.0},
              "GQA-2": {"kv_bytes": 2048, "n_kv_heads": 2, "perplexity": 9.0},
              **{f"MQA-1 {m}": {"kv_bytes": 1024, "n_kv_heads": 1, "perplexity": 20.0}
                 for m in ("mean", "first", "random")}}
    extra = {"before": before, "mha_max_nll_diff": 1e-7,
             "curves": {f"MQA-1 {m}": {"loss": [4.0, 3.5, 3.0, 2.9, 2.8]}
                        for m in ("mean", "first", "random")},
             "roundtrip_exact": {f"MQA-1 {m}": True for m in ("mean", "first", "random")}}
    extra.update(change)
    return extra


def test_gqa_check_fails_on_a_wrong_shape():
    rep = get("gqa")
    rep.check({}, _gqa_extra())
    flat = {m: {"loss": [4.0, 4.0, 4.1, 4.0]} for m in ("MQA-1 mean", "MQA-1 first", "MQA-1 random")}
    with pytest.raises(AssertionError, match="loss"):
        rep.check({}, _gqa_extra(curves=flat))
    with pytest.raises(AssertionError, match="NLL"):
        rep.check({}, _gqa_extra(mha_max_nll_diff=0.3))
    bytes_off = _gqa_extra()
    bytes_off["before"]["MHA-4"]["kv_bytes"] = 3000
    with pytest.raises(AssertionError, match="KV bytes"):
        rep.check({}, bytes_off)
    with pytest.raises(AssertionError, match="round trip"):
        rep.check({}, _gqa_extra(roundtrip_exact={"MQA-1 mean": False, "MQA-1 first": True,
                                                  "MQA-1 random": True}))


def test_unknown_reproduction_names_the_choices():
    with pytest.raises(SystemExit, match="streamingllm"):
        main(["nosuchpaper"])


def test_help_lists_every_paper_with_its_claim(capsys):
    """`--help` (exit 0) and no name at all (a usage error, exit 2) print the papers."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in PAPERS:
        assert f"  {name} " in out and get(name).short_claim in out
    assert main([]) == 2
    assert "usage: python -m experiments.reproduce NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="NAME comes first: python -m experiments.reproduce "
                       "h2o --quick"):
        main(["--quick", "h2o"])


def test_a_bad_paper_option_is_one_line_before_any_point_runs(tmp_path, capsys, monkeypatch):
    """A setting the harness refuses (found when every point is planned) exits 2 with its
    message, no traceback, before any point executes."""
    from experiments.reproduce import common

    monkeypatch.setattr(common, "execute", lambda *a, **k: pytest.fail("a point ran"))
    assert main(["streamingllm", "--quick", "--windows", "-4", "--results",
                 str(tmp_path / "r.jsonl"), "--wandb", "disabled"]) == 2
    assert "error: task 'perplexity_recompute': window=-4 must be a positive integer" in (
        capsys.readouterr().err)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PAPERS))
def test_quick(name, tmp_path):
    """`python -m experiments.reproduce NAME --quick`: the reduced sweep through the harness,
    its shape asserted, its doc and index row written (under 60 s on 2 cores)."""
    assert main([name, "--quick", "--results", str(tmp_path / "r.jsonl"), "--wandb",
                 "disabled"]) == 0
    doc = (tmp_path / "quick-docs" / f"{name}.md").read_text()
    assert "**Claim.**" in doc and "## Verdict" in doc
    assert f"[{name}]({name}.md)" in (tmp_path / "quick-docs" / "README.md").read_text()
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == len(
        get(name).points(_quick_args(name, tmp_path)))


def _quick_args(name, tmp_path):
    import argparse

    rep = get(name)
    p = argparse.ArgumentParser()
    rep.add_arguments(p)
    args = p.parse_args([])
    for k, v in rep.quick_defaults().items():
        setattr(args, k, v)
    args.results, args.wandb, args.force = str(tmp_path / "r2.jsonl"), "disabled", False
    return args


def test_beyond_context_is_refused_unless_asked():
    """A task past the model's 8192-token context is a ConfigError before the model loads;
    beyond_context=True (StreamingLLM's dense baseline) plans it."""
    from kvjax.experiment import ConfigError, RunSpec, plan

    spec = RunSpec(task=Perplexity(length=8200, chunk=128), speed=_no_speed())
    with pytest.raises(ConfigError, match="context length 8192"):
        plan(spec)
    assert plan(dataclasses.replace(spec, beyond_context=True)).max_len == 8200


def _no_speed():
    from kvjax.experiment import SpeedSpec

    return SpeedSpec(prompt=0)


def test_wilson_matches_the_score_test_it_inverts():
    """wilson(k, n) is the set of p whose score test |k/n - p| <= z sqrt(p (1 - p) / n) passes
    (found here by bisection), and the textbook 0/20 bound 0.161."""
    from experiments.reproduce.common import wilson

    z = 1.959963984540054

    def edge(k, n, lo, hi, inside_at_hi):
        for _ in range(60):
            mid = (lo + hi) / 2
            ok = abs(k / n - mid) <= z * np.sqrt(mid * (1 - mid) / n)
            lo, hi = (lo, mid) if ok == inside_at_hi else (mid, hi)
        return (lo + hi) / 2

    for k, n in ((0, 20), (3, 20), (11, 20), (20, 20), (1, 5)):
        lo, hi = wilson(k, n)
        p = k / n
        assert lo == pytest.approx(edge(k, n, 0.0, p, True) if k else 0.0, abs=1e-9)
        assert hi == pytest.approx(edge(k, n, p, 1.0, False) if k < n else 1.0, abs=1e-9)
    assert wilson(0, 20)[1] == pytest.approx(0.1611, abs=1e-4)
    with pytest.raises(ValueError, match="k=3, n=2"):
        wilson(3, 2)


def test_snapkv_check_fails_on_a_wrong_shape():
    """The check reads the mildest compression's per-head point and fails when SnapKV loses
    keys the full cache finds, or when the full cache itself fails (nothing to compare)."""
    rep = get("snapkv")
    good = {"passkey/full": _retrieval(5, 5), "passkey/1.33333x/snapkv": _retrieval(5, 5),
            "passkey/8x/snapkv": _retrieval(0, 5), "passkey/1.33333x/window": _retrieval(0, 5)}
    rep.check(good, {})
    with pytest.raises(AssertionError, match=r"SnapKV at 1.33333x: 3/5 vs full 5/5"):
        rep.check({**good, "passkey/1.33333x/snapkv": _retrieval(3, 5)}, {})
    with pytest.raises(AssertionError, match="full cache finds only"):
        rep.check({**good, "passkey/full": _retrieval(1, 5)}, {})


def _ppl(label, perplexity):
    return Done(label, {"metrics": {"perplexity": perplexity}})


def test_kivi_check_fails_when_channel_keys_do_not_beat_token_keys():
    rep = get("kivi")
    good = {"ppl/int2/R32": _ppl("c", 20.0), "ppl/int2/token": _ppl("t", 140.0)}
    rep.check(good, {})
    with pytest.raises(AssertionError, match="per-token keys"):
        rep.check({**good, "ppl/int2/token": _ppl("t", 25.0)}, {})


def _ppl_bytes(label, perplexity, kv_bytes):
    return Done(label, {"metrics": {"perplexity": perplexity},
                        "cache": {"kv_bytes": kv_bytes, "capacity": 64}})


def test_critical_heads_check_fails_on_a_wrong_shape():
    rep = get("critical_heads")
    every = "int2/random0/90"
    good = {"f32": _ppl_bytes("f", 50.0, 1000), "int2/0": _ppl_bytes("0", 57.0, 250),
            every: _ppl_bytes("a", 50.2, 500)}
    rep.check(good, {})
    with pytest.raises(AssertionError, match="does not lose"):
        rep.check({**good, "int2/0": _ppl_bytes("0", 51.0, 250)}, {})
    with pytest.raises(AssertionError, match="cost no bytes"):
        rep.check({**good, every: _ppl_bytes("a", 50.2, 250)}, {})
    with pytest.raises(AssertionError, match="every unit kept"):
        rep.check({**good, every: _ppl_bytes("a", 53.0, 500)}, {})
