"""Compiled programs kept on disk (`kvjax.programs`): loaded back, they compute what `jax.jit`
computes; their key covers what changes a program; a bad file, an outer trace and an unstable
static fall back to compiling."""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import programs
from kvjax.cache import copy, init_cache
from kvjax.config import tiny_config
from kvjax.formats import get_format
from kvjax.generate import sample
from kvjax.model import init_params, to_device
from kvjax.policies import get_policy
from kvjax.programs import clear_loaded, stats, stored_jit
from kvjax.tasks.base import nll_chunk

CFG = tiny_config()


@pytest.fixture(scope="module")
def setup():
    """Params, a chunk of 12 tokens with targets, and a sliding-window f32 cache of 8 slots."""
    params = to_device(init_params(CFG, jax.random.PRNGKey(0)))
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, 13), 0, CFG.vocab_size)
    cache = init_cache(CFG, 1, get_policy("window", budget=8), get_format("f32"), 16)
    return params, ids[:, :12], ids[:, 1:], jnp.array([12], jnp.int32), cache


def new_process():
    """Forget every compiled program, as a new process starts (JAX's own included: XLA:CPU may
    not serialize an executable that has run, and JAX would hand one back)."""
    clear_loaded()
    jax.clear_caches()


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on, in a fresh folder, nothing compiled in memory; as if JAX's persistent cache
    were off, so that every compile is fresh and stored at once (`test_a_program_jax_could_...`
    covers the other way)."""
    monkeypatch.setattr(programs, "_store", tmp_path / "programs")
    monkeypatch.setattr(programs, "_jax_cache_on", lambda: False)
    new_process()
    stats.clear()
    yield tmp_path / "programs"
    new_process()


@contextlib.contextmanager
def programs_off():
    store = programs._store
    programs.set_program_store(None)
    try:
        yield
    finally:
        programs.set_program_store(store)


def files(store):
    return sorted(store.glob("*.pkl")) if store.exists() else []


def same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_a_program_loaded_back_computes_what_jit_computes(setup, store):
    params, toks, tgts, nv, _ = setup
    with programs_off():  # an h2o/int4 cache that evicts in this chunk
        cache = init_cache(CFG, 1, get_policy("h2o", budget=8, window=2),
                           get_format("int4", group=4), 16)
    want = nll_chunk.jitted(params, toks, tgts, nv, copy(cache), CFG)
    first = nll_chunk(params, toks, tgts, nv, copy(cache), CFG)
    assert stats == {"compiled": 1} and len(files(store)) == 1
    assert files(store)[0].stat().st_mode & 0o777 == 0o644  # a store users can share
    new_process()
    donated = copy(cache)
    again = nll_chunk(params, toks, tgts, nv, donated, CFG)
    assert stats == {"compiled": 1, "loaded": 1} and len(files(store)) == 1
    assert same(first, want) and same(again, want)
    assert float(jnp.abs(want[0]).sum()) > 0  # a real NLL, not zeros
    assert all(x.is_deleted() for x in jax.tree.leaves(donated))  # the cache is still donated
    nll_chunk.compile(params, toks, tgts, nv, copy(cache), CFG)  # held: nothing new
    nll_chunk(params, toks, tgts, nv, again[1], CFG)  # the loaded program's own cache fed back
    assert stats == {"compiled": 1, "loaded": 1}  # (jax 0.12 loaded it again: another layout)


def test_a_program_jax_may_have_served_is_stored_by_the_next_run(setup, store, monkeypatch):
    """With JAX's cache on, a program that JAX did not compile and write this run (it may come
    from JAX's cache, whose executables do not serialize whole) is used as it is, and the next
    run compiles it for the store. (One that JAX wrote, the event `_thread_events` watches, is
    stored at once: `bench_sweep_point`'s cold run shows it on the real model.)"""
    monkeypatch.setattr(programs, "_jax_cache_on", lambda: True)
    monkeypatch.setattr(programs, "_thread_events",
                        lambda: contextlib.nullcontext(collections.Counter()))
    params, toks, tgts, nv, cache = setup
    want = nll_chunk.jitted(params, toks, tgts, nv, copy(cache), CFG)
    for expect in ({"deferred": 1}, {"deferred": 1, "compiled": 1},
                   {"deferred": 1, "compiled": 1, "loaded": 1}):
        new_process()
        assert same(nll_chunk(params, toks, tgts, nv, copy(cache), CFG), want)
        assert stats == expect
    assert [p.suffix for p in store.iterdir()] == [".pkl"]


def test_the_key_covers_shapes_statics_and_code(setup, store, monkeypatch):
    params, toks, tgts, nv, cache = setup
    base = nll_chunk(params, toks, tgts, nv, copy(cache), CFG)
    nll_chunk(params, toks[:, :4], tgts[:, :4], nv // 3, copy(cache), CFG)
    assert len(files(store)) == 2
    other = dataclasses.replace(CFG, rope_theta=CFG.rope_theta * 4)
    moved = nll_chunk(params, toks, tgts, nv, copy(cache), other)
    assert len(files(store)) == 3 and not same(moved[0], base[0])
    new_process()
    monkeypatch.setattr(programs, "source_sha256", lambda roots: "edited")
    programs._machine.cache_clear()
    try:
        nll_chunk(params, toks, tgts, nv, copy(cache), CFG)
    finally:
        programs._machine.cache_clear()
    assert len(files(store)) == 4 and stats["loaded"] == 0


def test_the_key_covers_jax_options_set_in_a_context_and_the_cpu(store, monkeypatch):
    """Matmul precision (a context jit keys its own cache on) changes the program, in memory and
    on disk; so does the CPU's instruction set, for a store shared between machines."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8))
    sample(x, None)
    with jax.default_matmul_precision("highest"):
        sample(x, None)
    assert stats == {"compiled": 2} and len(files(store)) == 2
    new_process()
    monkeypatch.setattr(programs, "_cpu_flags", lambda: "avx2 another-cpu")
    programs._machine.cache_clear()
    try:
        sample(x, None)
    finally:
        programs._machine.cache_clear()
    assert stats == {"compiled": 3} and len(files(store)) == 3


def test_an_unreadable_file_is_compiled_again(setup, store):
    params, toks, tgts, nv, cache = setup
    want = nll_chunk(params, toks, tgts, nv, copy(cache), CFG)
    (path,) = files(store)
    path.write_bytes(b"not a program")
    new_process()
    assert same(nll_chunk(params, toks, tgts, nv, copy(cache), CFG), want)
    assert stats == {"compiled": 2} and files(store) == [path] and path.stat().st_size > 1000


def test_under_an_outer_trace_it_is_jit(setup, store):
    params, toks, tgts, nv, cache = setup
    outer = jax.jit(lambda p, c: nll_chunk(p, toks, tgts, nv, c, CFG)[0].sum())
    assert np.isclose(float(outer(params, copy(cache))),
                      float(nll_chunk.jitted(params, toks, tgts, nv, copy(cache), CFG)[0].sum()))
    assert not files(store) and not stats


def test_under_jax_debug_modes_and_inside_a_trace_it_is_jit(setup, store):
    """disable_jit and debug_nans need jit's own path; a call with only static arguments inside
    an outer trace is traced, not run (`_init_dense` under `eval_shape`)."""
    params, toks, tgts, nv, cache = setup
    with jax.disable_jit():
        nll_chunk(params, toks, tgts, nv, copy(cache), CFG)
    with jax.debug_nans(True):
        nll_chunk(params, toks, tgts, nv, copy(cache), CFG)
    jax.eval_shape(lambda: init_cache(CFG, 1, get_policy("window", budget=8), get_format("f32"),
                                      16))
    assert not files(store) and not stats


def test_what_another_process_could_not_trust_or_recognize_is_not_stored(store):
    f = stored_jit(lambda x: x + 1)  # outside kvjax's sources: its code is not in the key
    assert float(f(jnp.float32(1))) == 2.0

    class Window(type(get_policy("window", budget=8))):
        __repr__ = object.__repr__  # names an address

    init_cache(CFG, 1, Window(budget=8), get_format("f32"), 16)

    class Mine(type(get_policy("window", budget=8))):
        """Defined outside kvjax, with a stable repr: its code is not in the key either."""

    init_cache(CFG, 1, Mine(budget=8), get_format("f32"), 16)
    assert not files(store) and stats == {"unstored": 3}


def test_a_store_it_cannot_write_warns_and_computes(setup, tmp_path, monkeypatch):
    """An unwritable or full store costs the programs it would keep, never the run."""
    monkeypatch.setattr(programs, "_store", tmp_path / "a-file")
    monkeypatch.setattr(programs, "_jax_cache_on", lambda: False)
    (tmp_path / "a-file").write_text("not a folder")
    params, toks, tgts, nv, cache = setup
    new_process()
    stats.clear()
    with pytest.warns(UserWarning, match="a-file"):
        got = nll_chunk(params, toks, tgts, nv, copy(cache), CFG)
    assert same(got, nll_chunk.jitted(params, toks, tgts, nv, copy(cache), CFG))
    assert not stats and [p.name for p in tmp_path.iterdir()] == ["a-file"]
    new_process()


def test_off_it_writes_nothing(setup, tmp_path, monkeypatch):
    monkeypatch.setattr(programs, "_store", None)
    params, toks, tgts, nv, cache = setup
    stats.clear()
    nll_chunk(params, toks, tgts, nv, copy(cache), CFG)
    assert not stats and not list(tmp_path.iterdir())


def test_the_store_drops_the_least_recently_used_past_its_size(store, monkeypatch):
    sample(jnp.zeros((1, 3)), None)
    (one,) = files(store)
    monkeypatch.setattr(programs, "STORE_MAX_BYTES", one.stat().st_size + 10)
    sample(jnp.zeros((1, 4)), None)
    assert len(files(store)) == 1 and files(store) != [one]
