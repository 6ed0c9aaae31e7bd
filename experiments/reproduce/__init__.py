"""Paper reproductions: `python -m experiments.reproduce NAME [--quick]`.

Each paper is one module here exposing `REPRODUCTION` (a `common.Reproduction`); PAPERS maps
the command's NAME to it.
"""

from __future__ import annotations

import importlib

PAPERS = {"streamingllm": "experiments.reproduce.streamingllm",
          "h2o": "experiments.reproduce.h2o",
          "tova": "experiments.reproduce.tova",
          "pyramid": "experiments.reproduce.pyramid",
          "gqa": "experiments.reproduce.gqa",
          "snapkv": "experiments.reproduce.snapkv",
          "kivi": "experiments.reproduce.kivi",
          "critical_heads": "experiments.reproduce.critical_heads"}


def get(name: str):
    if name not in PAPERS:
        raise SystemExit(f"unknown reproduction {name!r}; valid choices: {', '.join(sorted(PAPERS))}")
    return importlib.import_module(PAPERS[name]).REPRODUCTION
