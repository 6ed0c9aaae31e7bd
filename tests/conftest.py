"""Shared fixtures: the real default model (loaded once per session) and the reference data.

The reference files in tests/data come from ../shared/reference (HF transformers 5.2, f32, on the
same GGUF; see tests/data/REFERENCE.md), copied so a fresh clone passes without that folder.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version
from pathlib import Path

# Tests compile hundreds of programs and run most of them once on tiny shapes, so LLVM's
# optimization is mostly wasted on them: at level 0 the suite's CPU time fell by a third
# (docs/benchmarks.md, "CI time"), while the few compute-heavy real-model tests run a little
# slower. XLA:CPU's older elemental emitters halve the compile time of such programs again
# (a cold `pytest -n 2 tests/test_formats_matrix.py tests/test_reference.py`: 280 -> 192 s of
# CPU); jaxlib 0.10 still has the switch, 0.11 and 0.12 abort on it. Set before anything can
# start JAX's backend; subprocesses (run.py, the mesh and multi-process tests) inherit it.
# What users run keeps XLA's default.


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS with `flags` added to this process's (for a subprocess: it keeps the tests'
    own flags)."""
    return " ".join(f for f in (*flags, os.environ.get("XLA_FLAGS")) if f)


ELEMENTAL = tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11)
os.environ["XLA_FLAGS"] = xla_flags("--xla_backend_optimization_level=0",
                                    *(["--xla_cpu_use_fusion_emitters=false"] * ELEMENTAL))
# `jax.jit(..., compiler_options=RUN_FAST)` undoes both for a test's own program over the real
# weights, where running dominates: a 2048-token forward runs in 7.3 s instead of 16.0 s and
# compiles in 1.8 s instead of 0.9 s.
RUN_FAST = {"xla_backend_optimization_level": 1,
            **({"xla_cpu_use_fusion_emitters": True} if ELEMENTAL else {})}

import numpy as np
import pytest

from kvjax.experiment import release_compiled_near_map_limit
from kvjax.harness import XLA_CACHE_MIN_COMPILE_S, set_xla_cache
from kvjax.loading.hub import cache_root

DATA = Path(__file__).parent / "data"

# Compiled programs persist between tests, workers and runs beside the cached model, as run.py
# keeps them (`set_xla_cache`: only programs that compile in >= XLA_CACHE_MIN_COMPILE_S, whose
# comment says why): tests that build the same program from different Python functions share
# it; with no cache at all the cold CI run took 29 min of CPU, not 26.5 (docs/benchmarks.md,
# "CI time"). A folder of its own, named by the floor, as JAX loads whatever a folder holds.
XLA_TEST_CACHE = str(cache_root() / f"xla-tests-{XLA_CACHE_MIN_COMPILE_S}s")
set_xla_cache(XLA_TEST_CACHE)


@pytest.fixture(scope="session")
def xla_test_cache():
    """The tests' compile cache folder, for subprocesses (run.py's `xla_cache=`), so a warm CI
    run loads their programs too (the 8-device mesh worker: 25.7 -> 10.6 s) and test programs
    stay out of run.py's own folder."""
    return XLA_TEST_CACHE


@pytest.fixture(autouse=True)
def _no_program_store(monkeypatch):
    """Tests that run `harness.main` turn run.py's program store on; it stays in that test."""
    from kvjax import programs

    monkeypatch.setattr(programs, "_store", None)


@pytest.fixture(autouse=True)
def _map_limit():
    """A test worker compiles hundreds of programs; past half of vm.max_map_count it drops the
    compiled ones (`release_compiled_near_map_limit`: at the limit XLA crashes the worker)."""
    yield
    release_compiled_near_map_limit()


@pytest.fixture(scope="session")
def forced_devices():
    """n -> XLA_FLAGS for a subprocess with n host devices, keeping the tests' own flags."""
    return lambda n: xla_flags(f"--xla_force_host_platform_device_count={n}")


@pytest.fixture(scope="session")
def ref():
    """Reference arrays and metadata computed by an independent implementation."""
    return {
        "text": (DATA / "text.txt").read_text(encoding="utf-8"),
        "text_ids": np.load(DATA / "text_ids.npy"),
        "nll": np.load(DATA / "nll_2048.npy"),
        "logits_last": np.load(DATA / "sample_logits_last.npy"),
        "greedy": np.load(DATA / "greedy_512p_128n.npy"),
        "meta": json.loads((DATA / "meta.json").read_text()),
    }


@pytest.fixture(scope="session")
def smollm():
    """(cfg, numpy params, tokenizer) of the default model, fetched and cached on first use."""
    from kvjax.loading import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm_dev(smollm):
    """(cfg, device params): f32 on CPU."""
    from kvjax.model import to_device

    cfg, params, _ = smollm
    return cfg, to_device(params)
