"""Shared fixtures: the real default model (loaded once per session) and the reference data.

The reference files in tests/data come from ../shared/reference (HF transformers 5.2, f32, on the
same GGUF; see tests/data/REFERENCE.md), copied so a fresh clone passes without that folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax.harness import XLA_CACHE_MIN_COMPILE_S
from kvjax.loading.hub import cache_root

DATA = Path(__file__).parent / "data"

# Compiled programs persist between tests, workers and runs beside the cached model (JAX's
# persistent compilation cache, keyed by the program: tests that build the same program from
# different Python functions share it), but only programs that took >= 0.5 s to compile (as
# run.py does): 30 % of the programs, 90 % of the compile time (JAX_LOG_COMPILES=1: 209
# programs of test_formats_matrix, test_serve and the start of test_reference). Loading an XLA:CPU
# executable back can crash: twice with every program cached (no floor) a worker died
# (SIGSEGV) inside JAX's cache read, in `backend.deserialize_executable` of a small jitted step
# of test_serve (faulthandler's trace), never reproduced in isolation; upstream has open crash
# reports (jax-ml/jax#28908). The floor skips the many small programs; with no cache at all the
# cold CI run took 29 min of CPU, not 24 (docs/benchmarks.md, "CI time").
# Its own folder: JAX reads every program from the cache whatever its compile time (the floor
# only limits writes), so a folder filled without the floor would still load the small ones.
jax.config.update("jax_compilation_cache_dir",
                  str(cache_root() / f"xla-tests-{XLA_CACHE_MIN_COMPILE_S}s"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", XLA_CACHE_MIN_COMPILE_S)


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
