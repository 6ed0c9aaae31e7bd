"""Checkpoint and tokenizer loading: GGUF, local HF safetensors directories, the model hub."""

from __future__ import annotations

import os
from pathlib import Path

from kvjax.config import ModelConfig
from kvjax.loading.gguf_loader import load_gguf, open_gguf
from kvjax.loading.hf_loader import is_hf_dir, load_hf_dir
from kvjax.loading.hub import (
    DEFAULT_MODEL,
    MODELS,
    fetch_model,
    get_spec,
    registered_names,
    resolve,
)
from kvjax.loading.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "Tokenizer",
    "fetch_model",
    "load_gguf",
    "load_hf_dir",
    "load_model",
    "load_tokenizer",
]


def load_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None
) -> tuple[ModelConfig, dict, Tokenizer]:
    """(ModelConfig, float32 numpy params, Tokenizer) from a registered name, a .gguf or a HF dir.

    Existing paths win over registry names; a registered name is fetched into the cache first.
    """
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return _load_gguf_file(p, name=None)
    if is_hf_dir(p):
        return load_hf_dir(p)
    s = str(name_or_path)
    if p.is_dir() and resolve(s) is None:
        raise FileNotFoundError(
            f"{p} is a directory but not a HF checkpoint (no config.json); "
            "pass a .gguf file or a directory with config.json, *.safetensors and tokenizer.json"
        )
    if s.endswith(".gguf") or os.sep in s:
        raise FileNotFoundError(
            f"no such model file or directory: {p} (registered model names: "
            f"{', '.join(registered_names())})"
        )
    spec = get_spec(s)
    return _load_gguf_file(fetch_model(spec.name, cache_dir=cache_dir), name=spec.name)


def load_tokenizer(
    name_or_path: str | os.PathLike = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None
) -> Tokenizer:
    """The tokenizer alone, resolved as `load_model` resolves names (no weights are read): for
    checks that need token counts before a model loads."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return Tokenizer.from_gguf(open_gguf(p))
    if is_hf_dir(p):
        return Tokenizer.from_hf_dir(p)
    spec = get_spec(str(name_or_path))
    return Tokenizer.from_gguf(open_gguf(fetch_model(spec.name, cache_dir=cache_dir)))


def _load_gguf_file(path: Path, name: str | None) -> tuple[ModelConfig, dict, Tokenizer]:
    reader = open_gguf(path)
    cfg, params = load_gguf(reader, name=name)
    return cfg, params, Tokenizer.from_gguf(reader)
