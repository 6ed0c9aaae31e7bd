"""Evaluation tasks on the tiny random model: streaming NLL, agreement, passkey, needle."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache
from kvjax.experiment import ModelSpec, load
from kvjax.formats import get_format
from kvjax.policies import get_policy
from kvjax.tasks import TASKS, TaskContext, get_task
from kvjax.tasks.base import bar, batched_generate, chat_frame, contains_answer, nll_chunk
from kvjax.tasks.needle import needle_prompt
from kvjax.tasks.passkey import KEY, passkey_prompt
from kvjax.tasks.text import (
    DEFAULT_SOURCE,
    CharTokenizer,
    default_text,
    encode_prefix,
    load_text,
    sha256_text,
)

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parent.parent
PKG_DATA = ROOT / "kvjax" / "data"
TINY = ModelSpec("tiny", 0, (("head_dim", 32), ("max_seq_len", 8192)))


@pytest.fixture(scope="module")
def tiny():
    return load(TINY)


def ctx_for(tiny, policy="full", fmt="f32", max_len=64, text=None, **kw):
    return TaskContext(tiny.params, tiny.cfg, tiny.tokenizer, get_policy(policy, **kw),
                       get_format(fmt), max_len, text or default_text(),
                       is_baseline=(policy, fmt) == ("full", "f32"))


def test_default_text_is_the_shipped_file_not_the_running_python(monkeypatch):
    """The default text is package data, the same bytes on every Python (pydoc_data differs
    between versions): no pydoc_data import, the sha256 its note names, the start of the
    reference text, under 1.5 MB."""
    monkeypatch.setitem(sys.modules, "pydoc_data", None)  # any import of it now fails
    default_text.cache_clear()
    text = default_text()
    ref = (DATA / "text.txt").read_text(encoding="utf-8")
    note = (PKG_DATA / "python_docs.md").read_text(encoding="utf-8")
    raw = (PKG_DATA / "python_docs.txt").read_bytes()
    assert text.encode("utf-8") == raw and sha256_text(text) in note
    assert text.startswith(ref) and len(raw) < 1.5e6
    assert load_text(None) == (text, DEFAULT_SOURCE)


def test_default_text_is_package_data_of_a_regular_install(tmp_path):
    """setuptools' build_py (what a wheel holds) copies the text and its note. `-P`: the repo
    root stays off sys.path, or its top-level kernels/ shadows an installed HF `kernels`, whose
    setuptools entry point then fails to import."""
    out = subprocess.run(
        [sys.executable, "-P", "-c", "from setuptools import setup; setup()", "-q", "build_py",
         "--build-lib", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    built = tmp_path / "kvjax" / "data"
    assert (built / "python_docs.txt").read_bytes() == (PKG_DATA / "python_docs.txt").read_bytes()
    assert (built / "python_docs.md").is_file()


@pytest.mark.slow
def test_default_text_has_enough_tokens_for_long_contexts():
    """>= 20k tokens of the default model (StreamingLLM reproductions need >= 16k)."""
    from kvjax.loading import load_tokenizer

    assert len(load_tokenizer("smollm2-135m").encode(default_text())) >= 20_000


def test_load_text_file_and_bad_files(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("héllo wörld", encoding="utf-8")
    assert load_text(str(p)) == ("héllo wörld", str(p.resolve()))
    assert load_text(None)[1] == DEFAULT_SOURCE
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_text(str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_text(str(bad))


def test_encode_prefix_equals_whole_text_prefix():
    tok = CharTokenizer(64)
    text = default_text()[:5000]
    assert encode_prefix(tok, text, 100) == tok.encode(text)[:100]
    assert encode_prefix(tok, "short", 100) == tok.encode("short")


def test_perplexity_matches_one_shot_forward_for_any_chunk(tiny):
    ctx = ctx_for(tiny)
    ids = encode_prefix(tiny.tokenizer, ctx.text, 64)
    cache = KVCache.init(tiny.cfg, 1, get_policy("full"), get_format("f32"), 64)
    toks = jnp.asarray([ids])
    targets = jnp.asarray([ids[1:] + [0]])
    one_shot, _ = nll_chunk(tiny.params, toks, targets, jnp.asarray([64]), cache, tiny.cfg)
    want = np.asarray(one_shot[0, :63])
    for chunk in (16, 1000):  # 1000 is clamped to the text: one chunk
        res = get_task("perplexity", length=64, chunk=chunk).run(ctx)
        nll = res.arrays["nll"]
        assert nll.dtype == np.float32 and nll.shape == (63,)
        np.testing.assert_allclose(nll, want, atol=2e-5)
        assert res.metrics["perplexity"] == pytest.approx(np.exp(want.mean()), rel=1e-5)
        assert res.metrics["chunk_used"] == min(chunk, 64)
        assert res.curves["running_nll"][-1] == pytest.approx(want.mean(), rel=1e-5)
    assert 2.0 < np.exp(want.mean()) < 200.0  # a random 64-token model: about uniform


def test_perplexity_with_eviction_differs(tiny):
    window = ctx_for(tiny, "window", budget=16)
    res = get_task("perplexity", length=64, chunk=16).run(window)
    full = get_task("perplexity", length=64, chunk=16).run(ctx_for(tiny))
    assert res.cache.capacity == 16
    assert not np.allclose(res.arrays["nll"][20:], full.arrays["nll"][20:])
    np.testing.assert_allclose(res.arrays["nll"][:16], full.arrays["nll"][:16], atol=2e-5)
    assert res.metrics["chunk_used"] == 16  # never clamped: a chunk longer than the cache works
    big = get_task("perplexity", length=64, chunk=64).run(window)
    assert big.metrics["chunk_used"] == 64 and big.cache.capacity == 16


def test_agreement_full_vs_itself_and_vs_bf16(tiny):
    task = get_task("agreement", length=64, chunk=16)
    same = task.run(ctx_for(tiny))
    assert same.metrics["kl"] == 0.0 and same.metrics["top1"] == 1.0
    bf16 = task.run(ctx_for(tiny, fmt="bf16"))
    assert 0.0 <= bf16.metrics["kl"] < 1e-3
    assert bf16.metrics["top1"] > 0.9
    assert bf16.metrics["perplexity_full"] == pytest.approx(same.metrics["perplexity"], rel=1e-5)
    assert bf16.arrays["kl"].shape == (64,) and bf16.arrays["nll"].shape == (63,)
    rows = {r[0]: r for r in TASKS["agreement"].table_rows(bf16.metrics, {})}
    assert rows["top-1 agreement"][1] == f"{bf16.metrics['top1']:.4f}"
    assert rows["perplexity"][1:] == (f"{bf16.metrics['perplexity']:.4f}", (
        f"full cache {bf16.metrics['perplexity_full']:.4f} on the same tokens"))
    assert TASKS["perplexity"].table_rows(same.metrics, {}) == []  # its one number is the metric


def test_passkey_prompt_exact_length_depth_and_chat_template():
    tok = CharTokenizer(64)
    for depth in (0.0, 0.5, 1.0):
        ids = passkey_prompt(tok, 600, depth, 12345)
        assert len(ids) == 600
        text = tok.decode(ids)
        before, _ = chat_frame(tok)
        assert ids[: len(before)] == before
        key_at = text.index(KEY.format(key=12345).lower()[:20]) / len(text)
        assert abs(key_at - depth) < 0.35
        assert text.endswith("assistant: the pass key is")
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tok, 50, 0.5, 12345)


def test_needle_prompt_exact_length_and_sentence_boundary():
    tok = CharTokenizer(64)
    hay = tok.encode(default_text()[:3000])
    ids = needle_prompt(tok, hay, 500, 0.5, 7654321)
    assert len(ids) == 500
    text = tok.decode(ids)
    assert "the special magic number is 7654321." in text
    with pytest.raises(ValueError, match="too few"):
        needle_prompt(tok, hay[:100], 500, 0.5, 1)


def test_passkey_and_needle_run_with_eviction(tiny):
    ctx = ctx_for(tiny, "window", max_len=420, budget=64)
    res = get_task("passkey", length=400, n_samples=2, new_tokens=8, chunk=128).run(ctx)
    assert res.metrics["n_samples"] == 2 and len(res.rows) == 2
    assert {r["correct"] for r in res.rows} <= {True, False}
    assert res.cache.capacity == 64
    res = get_task("needle", lengths=[300, 400], depths=[0.0, 1.0], new_tokens=8,
                   chunk=128).run(ctx)
    grid = res.metrics["grid"]
    assert grid["lengths"] == [300, 400] and grid["depths"] == [0.0, 1.0]
    assert np.asarray(grid["accuracy"]).shape == (2, 2) and len(res.rows) == 4
    (row,) = TASKS["needle"].table_rows(res.metrics, {})
    by_len = np.asarray(grid["accuracy"]).mean(0)
    assert row[0] == "accuracy by length"
    assert row[2].startswith(f"300: {by_len[0]:.2f}, 400: {by_len[1]:.2f} (mean over depths")


def test_batched_retrieval_equals_one_prompt_at_a_time(tiny):
    """passkey and needle answer the same, row for row, `batch` prompts per forward or one:
    rows are right-padded and never see each other (eviction too is per row). Shares its
    shapes with the tests above (chunk 128, 420 slots, 2 rows; 1 row is new)."""
    ctx = ctx_for(tiny, "window", max_len=420, budget=64)
    for task in (get_task("passkey", length=400, n_samples=3, new_tokens=8, chunk=128),
                 get_task("needle", lengths=[300, 400], depths=[0.0, 1.0], new_tokens=8,
                          chunk=128)):
        one = dataclasses.replace(task, batch=1).run(ctx)
        two = dataclasses.replace(task, batch=2).run(ctx)
        assert two.rows == one.rows and two.metrics == one.metrics
    # the random model answers these prompts alike; random prompts of ragged lengths it does not
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, tiny.cfg.vocab_size, n)) for n in (100, 57, 128, 80, 9)]
    (one, _), = batched_generate(ctx, prompts, 6, 128, 1)
    (two, cache), = batched_generate(ctx, prompts, 6, 128, 2)
    np.testing.assert_array_equal(two, one)
    assert len({tuple(t) for t in one}) == 5 and cache.length.shape == (1,)  # last batch: 1 row
    with pytest.raises(ValueError, match="batch=0"):
        get_task("needle", batch=0).validate()


def test_batched_generate_frees_a_batch_s_caches_before_the_next(tiny, monkeypatch):
    """Only one batch's caches are alive at a time: with many policies sharing a prefill
    (a leaderboard: 15 caches per batch) keeping the previous batch's ran a 4k RULER sweep out of
    memory."""
    import gc
    import weakref

    from kvjax.tasks import base

    real, seen = base.greedy_generate, []

    def spy(*a, **k):
        gc.collect()
        assert all(r() is None for r in seen), "a previous batch's cache is still alive"
        outs = real(*a, **k)
        seen.extend(weakref.ref(x) for _, c in outs for x in jax.tree.leaves(c))
        return outs

    monkeypatch.setattr(base, "greedy_generate", spy)
    ctx = ctx_for(tiny, "window", max_len=420, budget=64)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, tiny.cfg.vocab_size, n)) for n in (100, 57, 128, 80, 9)]
    (_, cache), = base.batched_generate(ctx, prompts, 6, 128, 2)
    assert cache.length.shape == (1,) and len(seen) > 0


def test_contains_answer():
    assert contains_answer(" 71432.\n", 71432)
    assert not contains_answer(" 7143", 71432)


def test_get_task_errors_list_choices():
    with pytest.raises(ValueError, match="valid tasks: agreement, needle, passkey, perplexity"):
        get_task("nope")
    with pytest.raises(ValueError, match="has no option"):
        get_task("perplexity", lenght=3)
    with pytest.raises(ValueError, match="depths"):
        get_task("needle", depths=[1.5])
    with pytest.raises(ValueError, match="positive"):
        get_task("perplexity", chunk=0)
    with pytest.raises(ValueError, match="new_tokens"):
        get_task("passkey", digits=5, new_tokens=3)
    assert get_task("needle", lengths=[1, 2]).lengths == (1, 2)
    kvjax_tasks = {n for n, c in TASKS.items() if c.__module__.startswith("kvjax.")}
    assert kvjax_tasks == {"perplexity", "passkey", "needle", "agreement", "qa", "serve"}  # experiments
    # may register more (experiments.reproduce.recompute), only when imported


def test_task_seq_len_and_prompt_flags():
    assert get_task("perplexity", length=100).seq_len() == 100
    assert get_task("passkey", length=100, new_tokens=10).seq_len() == 110
    assert get_task("needle", lengths=[50, 80], new_tokens=12).seq_len() == 92
    assert [TASKS[n].has_prompt for n in ("perplexity", "agreement", "passkey", "needle")] == [
        False, False, True, True]


def test_progress_bar_is_quiet_without_a_terminal(tiny):
    ctx = ctx_for(tiny)
    assert bar(range(3), ctx, "x").disable  # pytest captures stderr: not a TTY
    assert not bar(range(3), dataclasses.replace(ctx, progress=True), "x").disable
    assert bar(range(3), dataclasses.replace(ctx, progress=False), "x").disable


def test_compress_mode_policy_is_compressed_after_the_prompt(tiny):
    ctx = ctx_for(tiny, "snapkv", max_len=420, budget=48, window=16)
    res = get_task("passkey", length=400, n_samples=1, new_tokens=8, chunk=128).run(ctx)
    assert res.cache.capacity == 48 + 8  # the selection, then room for the answer
    assert (np.asarray(res.cache.pos) >= 0).sum(-1).max() == 48 + 8


def test_prefill_reads_the_whole_prompt_by_default(tiny):
    """chunk=None (the tasks' default) feeds each prompt in one forward: an evict-mode policy
    then sees the whole prompt before it evicts, so the prompt's last logits are the full
    cache's; a chunked prefill evicts at every boundary and its later chunks read the evicted
    cache (the difference the docs promise)."""
    from kvjax.generate import start

    task = get_task("passkey", length=400, n_samples=1, new_tokens=7)
    assert task.chunk is None
    prompt = [list(np.random.default_rng(0).integers(0, tiny.cfg.vocab_size, 400))]
    h2o, f32 = get_policy("h2o", budget=48, window=8), get_format("f32")
    full, _ = start(tiny.params, tiny.cfg, prompt, get_policy("full"), f32, max_len=420)
    whole, cache = start(tiny.params, tiny.cfg, prompt, h2o, f32, max_len=420)
    chunked, _ = start(tiny.params, tiny.cfg, prompt, h2o, f32, max_len=420, chunk=64)
    assert cache.capacity == 48
    np.testing.assert_allclose(whole, full, atol=1e-5)
    assert np.abs(np.asarray(chunked) - np.asarray(full)).max() > 1e-3

def test_query_aware_false_feeds_the_question_after_the_selection(tiny):
    """query_aware=false (compress mode): SnapKV selects from the prompt up to the context's
    end, so the observation window cannot see the question; the question, the template's close
    and the answer's start are all kept (fed after). The full cache answers alike either way,
    and the option is part of the point's key."""
    from kvjax.experiment import RunSpec, SpeedSpec, plan
    from kvjax.tasks.passkey import ANSWER, QUESTION
    from kvjax.tasks.retrieval import question_tail

    n_tail = len(question_tail(tiny.tokenizer, QUESTION, ANSWER))
    ctx = ctx_for(tiny, "snapkv", max_len=420, budget=48, window=16)
    held = {}
    for aware in (True, False):
        task = get_task("passkey", length=400, n_samples=2, new_tokens=8, query_aware=aware)
        pos = np.asarray(task.run(ctx).cache.pos)  # [L, B, K, C]
        prompt = np.where((pos >= 0) & (pos < 400), pos, -1)
        tail = ((pos >= 400 - n_tail) & (pos < 400)).sum(-1)
        held[aware] = ((prompt >= 0).sum(-1), tail)
    assert (held[True][0] == 48).all()  # the selection spans the whole prompt
    assert (held[False][0] == 48 + n_tail).all()  # the selection, then the fed question
    assert (held[False][1] == n_tail).all() and n_tail > 16  # the window missed the question
    full = ctx_for(tiny, max_len=420)
    rows = [get_task("passkey", length=400, n_samples=2, new_tokens=8,
                     query_aware=a).run(full).rows for a in (True, False)]
    assert [r["answer"] for r in rows[0]] == [r["answer"] for r in rows[1]]
    keys = {plan(RunSpec(task=get_task("passkey", length=400, query_aware=a), model=TINY,
                         speed=SpeedSpec(prompt=0))).key for a in (True, False)}
    assert len(keys) == 2
    with pytest.raises(ValueError, match="query_aware='no'"):
        get_task("passkey", query_aware="no").validate()
