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

from kvjax.loading.hub import cache_root

DATA = Path(__file__).parent / "data"

# Compiled programs persist between test runs beside the cached model (JAX's persistent
# compilation cache, every program however small): XLA compilation is most of the tiny-model
# tests' time, and a warm run skips it (tests/test_formats_matrix.py: 93 s cold, 23 s warm).
jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla-tests"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
