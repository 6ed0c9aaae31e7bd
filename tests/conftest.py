"""Shared fixtures: the real default model (loaded once per session) and the reference data.

The reference files in tests/data come from ../shared/reference (HF transformers 5.2, f32, on the
same GGUF; see tests/data/REFERENCE.md), copied so a fresh clone passes without that folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"

# No persistent compilation cache in the tests: twice with it on, a worker crashed (SIGSEGV)
# inside JAX's cache read, in `backend.deserialize_executable` of a small jitted step of
# test_serve (faulthandler's trace), never reproduced in isolation; loading XLA:CPU executables
# back has open crash reports upstream (jax-ml/jax#28908). The landing CI gained nothing from
# it either: its run with the cache (empty at start) took 547 s, the landing before, without
# it and with ~2 min less of tests, 391 s. run.py keeps its own cache (`xla_cache`).


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
