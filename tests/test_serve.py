"""Serving (kvjax/serve.py): prefix reuse equals prefilling whole, the server's tokens equal
`generate` on each whole conversation (prefix cache, multi-turn, cancel, host offload), host
swapping moves exactly the row's own pages, and 500 requests leave the pool empty.

Tiny random model; the 500-request run drives only the allocator (`AllocatorRunner`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import pages
from kvjax.cache import get_layout
from kvjax.config import tiny_config
from kvjax.experiment import tiny_params
from kvjax.formats import get_format
from kvjax.generate import generate
from kvjax.model import forward_jit as forward
from kvjax.policies import get_policy
from kvjax.serve import (
    AllocatorRunner,
    ModelRunner,
    Server,
    Turn,
    bytes_by_memory,
    host_memory_kind,
    to_device,
    to_host,
)

F32 = get_format("f32")
FULL = get_policy("full")
PAGE = 8


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(n_heads=4, n_kv_heads=2)
    return cfg, tiny_params(cfg, 0)  # numpy-filled: no eager jax.random compiles


def _fwd(p, cfg, cache, rows, tokens):
    """Feed tokens [T] into rows (the same tokens each) through `cache.rows` / `set_rows`."""
    idx = jnp.asarray(rows, jnp.int32)
    toks = jnp.asarray(np.tile(np.asarray(tokens, np.int32), (len(rows), 1)))
    logits, sub = forward(p, toks, cache.rows(idx), cfg)
    return np.asarray(logits[:, -1]), cache.set_rows(idx, sub)


@pytest.mark.parametrize("layout, policy, split", [
    ("paged", FULL, False),  # shared pages: equals one whole-prompt prefill
    ("dense", get_policy("h2o", budget=20, window=4), True),  # copied state with H2O's stats
], ids=["paged-full", "dense-h2o"])
def test_prefix_reuse_equals_prefilling_whole(model, layout, policy, split):
    """Row 2 holds a 12-token prefix; row 0 takes it (shared pages / a copied prefill state)
    and prefills only its 12 own tokens, then decodes 3 tokens: the logits equal a fresh row
    that prefilled the whole prompt (split: in two chunks at the prefix, where an evicting
    policy's result depends on the chunking), to 1e-5."""
    cfg, p = model
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, cfg.vocab_size, 24).tolist()
    cont = rng.integers(0, cfg.vocab_size, 3).tolist()
    lay = get_layout(layout, **({"page_size": PAGE, "num_pages": 12} if layout == "paged" else {}))
    cache = lay.init(cfg, 3, policy, F32, 32)
    _, cache = _fwd(p, cfg, cache, [2], prompt[:12])
    dst = jnp.asarray([True, False, False])
    cache = cache.share_prefix(2, dst, 12)
    got, cache = _fwd(p, cfg, cache, [0], prompt[12:])
    ref = lay.init(cfg, 3, policy, F32, 32)
    if split:
        _, ref = _fwd(p, cfg, ref, [1], prompt[:12])
        want, ref = _fwd(p, cfg, ref, [1], prompt[12:])
    else:
        want, ref = _fwd(p, cfg, ref, [1], prompt)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for t in cont:
        got, cache = _fwd(p, cfg, cache, [0], [t])
        want, ref = _fwd(p, cfg, ref, [1], [t])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    if layout == "paged":
        used = np.asarray(cache.pages.refcount)
        assert int(np.sum(used > 1)) == 1  # the prefix's one full page is still shared
        assert pages.invariant_errors(cache.pages) == []


def test_server_tokens_equal_generate_with_prefix_turns_cancel_and_offload(model):
    """A Poisson-ish stream over a paged pool with a static prefix, a follow-up turn (its
    session swapped to host memory while idle, offload_after=0), and a cancelled request:
    every turn's greedy tokens equal `generate` on the whole conversation (dense layout, whole
    prompt); pages moved to host, came back, and the pool ends empty."""
    cfg, p = model
    rng = np.random.default_rng(0)
    pre = rng.integers(0, cfg.vocab_size, 11).tolist()
    reqs = [Turn(rid=i, arrival=0.001 * i, tokens=pre + rng.integers(0, 64, 2 + i).tolist(),
                 max_new=5, prefix=0) for i in range(4)]
    reqs[1].then = Turn(rid=10, arrival=0.0, tokens=rng.integers(0, 64, 4).tolist(), max_new=4)
    reqs[2].cancel_at = 2
    cache = get_layout("paged", page_size=PAGE, num_pages=14).init(cfg, 4, FULL, F32, 40)
    res = Server(ModelRunner(p, cfg), cache, prefixes=[pre], offload_after=0.0).run(reqs)

    t2 = reqs[1].then
    convs = [r.tokens for r in reqs] + [reqs[1].tokens + reqs[1].out + t2.tokens]
    want, _ = generate(p, cfg, convs, 5, FULL, F32, max_len=40)
    for turn, w in zip(reqs + [t2], want):
        assert turn.out == w[:len(turn.out)].tolist(), turn.rid
    assert [len(t.out) for t in reqs + [t2]] == [5, 5, 2, 5, 4]
    assert reqs[2].cancelled and res.stats["cancelled"] == 1
    s = res.stats
    assert s["offloads"] >= 1 and s["pages_offloaded"] >= 1
    assert s["bytes_offloaded"] == s["pages_offloaded"] * cache.pages.page_nbytes()
    assert s["peak_shared"] >= 1  # the prefix's full page served several rows at once
    assert s["prefill_tokens"] == sum(len(r.tokens) - len(pre) for r in reqs) + len(t2.tokens) + 1
    assert res.cache.pages.refcount.sum() == 0 and (res.cache.pages.block_tables == -1).all()


def test_swap_out_moves_only_the_rows_own_pages_to_host():
    """Row 1 shares row 0's first page and holds 2 pages of its own in a pool of 3: swap_out
    takes exactly those 2 (to host memory) and frees them; while row 2 holds them, swap_in
    is refused; once row 2 ends, the same contents come back into fresh pages."""
    L, K, E = 2, 2, 4
    rng = np.random.default_rng(0)

    def kv(T):
        return [jnp.asarray(rng.standard_normal((L, 3, T, K, E)), jnp.float32) for _ in "kv"]

    cache = pages.PagedKVCache.init(L, K, E, 3, 3, PAGE, 32, F32)
    append = jax.jit(pages.append)  # one program, not dozens of eager ones
    cache, _ = append(cache, *kv(8), jnp.asarray([8, 0, 0]))
    cache = pages.share_prefix(cache, 0, jnp.asarray([False, True, False]))
    cache, _ = append(cache, *kv(12), jnp.asarray([0, 12, 0]))
    before = [np.asarray(x[1, :, :20]) for x in pages.gather(cache, 0)[:2]]
    cache, (slots, k, v) = pages.swap_out(cache, 1)
    assert slots.tolist() == [1, 2] and int(cache.free_count()) == 2
    host = to_host((k, v))
    assert bytes_by_memory(host) == {host_memory_kind() or "host": 2 * cache.page_nbytes()}
    cache, _ = append(cache, *kv(12), jnp.asarray([0, 0, 12]))  # reuses both pages
    with pytest.raises(pages.OutOfPagesError, match="row 1 needs 2 pages back, 0 of 3"):
        pages.swap_in(cache, 1, (slots, *to_device(host)))
    cache = pages.free(cache, jnp.asarray([False, False, True]))
    cache = pages.swap_in(cache, 1, (slots, *to_device(host)))
    assert pages.invariant_errors(cache) == []
    after = [np.asarray(x[1, :, :20]) for x in pages.gather(cache, 0)[:2]]
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def test_500_requests_leave_the_pool_empty(model):
    """500 requests (ragged prompts and outputs, a shared prefix, follow-up turns, cancels,
    host offload) through the allocator alone, with the pool short of pages (sessions wait):
    invariants hold after every step (the server checks them), the pool never preempts, pages
    are shared and swapped, and everything is free at the end."""
    cfg, _ = model
    rng = np.random.default_rng(1)
    pre = [1] * 10
    reqs, rid = [], 1000
    for i in range(500):
        r = Turn(rid=i, arrival=float(i) * 1e-4, tokens=pre + [2] * int(rng.integers(1, 12)),
                 max_new=int(rng.integers(1, 6)), prefix=0)
        if i % 7 == 0:
            r.then = Turn(rid=rid, arrival=1e-3, tokens=[3] * int(rng.integers(1, 5)), max_new=2)
            rid += 1
        if i % 11 == 0:
            r.cancel_at = 1
        reqs.append(r)
    cache = get_layout("paged", page_size=PAGE, num_pages=30).init(cfg, 9, FULL, F32, 40)
    res = Server(AllocatorRunner(), cache, prefixes=[pre], offload_after=5e-4).run(reqs)
    s = res.stats
    assert s["turns"] == 500 + sum(r.then is not None for r in reqs) - sum(
        r.then is not None and r.cancel_at == 1 and r.max_new > 1 for r in reqs)
    assert s["peak_pages"] <= 30 and s["peak_shared"] >= 1 and s["offloads"] >= 1
    pool = res.cache.pages
    assert int(pool.refcount.sum()) == 0 and (np.asarray(pool.block_tables) == -1).all()
    assert int(pool.lengths.sum()) == 0 and not np.asarray(pool.preempted).any()


def test_bad_server_input_is_refused_before_any_work(model):
    cfg, _ = model
    dense = get_layout("dense").init(cfg, 2, FULL, F32, 16)
    with pytest.raises(ValueError, match="offload_after needs the paged layout"):
        Server(AllocatorRunner(), dense, offload_after=1.0)
    srv = Server(AllocatorRunner(), dense, prefixes=[[1, 2, 3]])
    with pytest.raises(ValueError, match="does not start with prefix 0"):
        srv.run([Turn(rid=0, arrival=0.0, tokens=[1, 2, 4, 5], max_new=1, prefix=0)])
    with pytest.raises(ValueError, match="needs 20 tokens, above the cache's 16"):
        srv.run([Turn(rid=0, arrival=0.0, tokens=[1, 2, 3] + [0] * 10, max_new=8, prefix=0)])
    paged = get_layout("paged", page_size=PAGE, num_pages=3).init(cfg, 2, FULL, F32, 40)
    with pytest.raises(ValueError, match="needs 4 pages, more than the cache's 3"):
        Server(AllocatorRunner(), paged).run([Turn(rid=0, arrival=0.0, tokens=[1] * 30,
                                                   max_new=2)])


def test_serve_task_workload_and_plan_errors():
    """The `serve` task's seeded workload (every prompt starts with the static prefix, lengths
    and outputs in range, follow-ups on their sessions) and its bad settings, refused at plan
    time with the option named."""
    from kvjax.experiment import ConfigError, ModelSpec, RunSpec, plan
    from kvjax.tasks import get_task
    from kvjax.tasks.serve import static_prefix
    from kvjax.tasks.text import CharTokenizer

    task = get_task("serve", n_requests=12, prompt_min=340, prompt_max=360, new_min=7,
                    new_max=9, followup=0.5).resolve(CharTokenizer(64))
    tok = CharTokenizer(64)
    reqs, again = task.requests(tok, 3), task.requests(tok, 3)
    assert [r.tokens for r in reqs] == [r.tokens for r in again]
    pre = static_prefix(tok)
    assert all(r.tokens[:len(pre)] == pre and 340 <= len(r.tokens) <= 360 for r in reqs)
    assert all(7 <= t.max_new <= 9 for r in reqs for t in r.turns())
    assert sorted(r.arrival for r in reqs) == [r.arrival for r in reqs]
    assert 0 < sum(r.then is not None for r in reqs) < 12
    assert task.seq_len() == 360 + 9 + task.followup_tokens + 9

    def spec(**kw):
        opts = {"n_requests": 2, "prompt_min": 340, "prompt_max": 360, "new_min": 7,
                "new_max": 9, **kw.pop("task", {})}
        return RunSpec(task=get_task("serve", **opts), model=ModelSpec("tiny", 0, (
            ("max_seq_len", 1024),)), results="/nonexistent/r.jsonl", **kw)

    assert plan(spec(cache=(("layout", "paged"),))).key != plan(spec(
        cache=(("layout", "paged"),), task={"prefix_cache": False})).key
    with pytest.raises(ValueError, match="new_min=3 cannot hold a 5-digit key"):
        get_task("serve", new_min=3)
    with pytest.raises(ValueError, match="followup=1.5 must be in"):
        get_task("serve", followup=1.5)
    with pytest.raises(ConfigError, match="too short for the prompt's fixed parts"):
        plan(spec(task={"prompt_min": 100, "prompt_max": 120}))
    # a pool too small for the rows (this point's, or the full-cache baseline's it is compared
    # with) is refused here too, not after the model loads (an audit got a traceback)
    with pytest.raises(ConfigError, match=r"pool_mib=0.001 holds 0 dense rows"):
        plan(spec(task={"pool_mib": 0.001}))
    with pytest.raises(ConfigError, match="the full-cache dense f32 baseline serves the same"):
        plan(spec(task={"pool_mib": 0.001}, cache=(("layout", "paged"),)))


def test_the_run_table_shows_the_serving_figures(tmp_path):
    """`python run.py task=serve` prints throughput, latency percentiles and the pool under its
    accuracy, each from the record's metrics (the harness on the tiny model)."""
    from kvjax.experiment import ModelSpec, RunSpec, SpeedSpec, WandbSpec, run
    from kvjax.tasks import get_task

    lines = []
    task = get_task("serve", n_requests=3, prompt_min=340, prompt_max=360, new_min=7,
                    new_max=9, followup=0.0, pool_mib=1.0)
    spec = RunSpec(task=task, model=ModelSpec("tiny", 0, (("max_seq_len", 1024),)),
                   results=str(tmp_path / "r.jsonl"), wandb=WandbSpec(mode="disabled"),
                   speed=SpeedSpec(prompt=0), progress=False)
    out = run(spec, tmp_path / "run", echo=lines.append)
    m = out.record["metrics"]
    rows = {ln.split("  ")[0]: ln for ln in lines[0].splitlines()[2:]}
    assert list(rows)[:5] == ["accuracy", "throughput", "TTFT p50 / p95", "TPOT p50 / p95",
                              "pool"]
    assert f"{m['throughput_tok_s']:.1f} tok/s  {m['generated']} tokens in" in rows["throughput"]
    assert f"{m['ttft_p50']:.2f} / {m['ttft_p95']:.2f} s" in rows["TTFT p50 / p95"]
    assert f"{m['tpot_p50'] * 1e3:.0f} / {m['tpot_p95'] * 1e3:.0f} ms" in rows["TPOT p50 / p95"]
    assert f"{m['pool_bytes'] / 2**20:,.2f} MiB  {m['cache_rows']} rows;" in rows["pool"]
    # with the probe off, the bytes are one sequence's cache, not the pool shared out per row
    # (an audit found the pool / rows: 8x "compression" for the full cache)
    c = out.record["cache"]
    assert c["compression"] == 1.0 and c["kv_bytes"] == c["full_f32_bytes"]
    paged = run(dataclasses.replace(spec, cache=(("layout", "paged"),)), tmp_path / "paged",
                echo=lambda s: None).record
    assert paged["cache"]["compression"] == pytest.approx(1.0, rel=0.1)  # whole pages
    assert paged["cache"]["kv_bytes"] != paged["metrics"]["pool_bytes"] // paged["metrics"][
        "cache_rows"]
