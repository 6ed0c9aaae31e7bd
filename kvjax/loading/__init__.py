"""Checkpoint and tokenizer loading: GGUF, local HF safetensors directories, the model hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvjax.config import ModelConfig
from kvjax.loading.gguf_loader import config_from_gguf, load_gguf, open_gguf
from kvjax.loading.hf_loader import config_from_hf, is_hf_dir, load_hf_dir
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
    "load_config",
    "load_gguf",
    "load_hf_dir",
    "load_model",
    "load_tokenizer",
    "locate",
]


def locate(name_or_path, cache_dir=None) -> tuple[str, Path]:
    """("gguf" | "hf", path) of a model: see `_resolve` (a registered name is fetched)."""
    return _resolve(name_or_path, cache_dir)


def load_config(
    name_or_path: str | os.PathLike = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None
) -> ModelConfig:
    """The ModelConfig alone, from the GGUF header or config.json (no weights are read): for
    checks that need the head dim or context length before a model loads."""
    kind, path = _resolve(name_or_path, cache_dir)
    if kind == "hf":
        return config_from_hf(json.loads((path / "config.json").read_text()), path.name)
    name = None if Path(name_or_path).expanduser().is_file() else get_spec(str(name_or_path)).name
    return config_from_gguf(open_gguf(path), name=name)


def _resolve(name_or_path, cache_dir) -> tuple[str, Path]:
    """("gguf" | "hf", path) of a registered name, a .gguf file or a HF directory; existing
    paths win over registry names, a registered name is fetched into the cache first."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return "gguf", p
    if is_hf_dir(p):
        return "hf", p
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
    return "gguf", fetch_model(spec.name, cache_dir=cache_dir)


def load_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None
) -> tuple[ModelConfig, dict, Tokenizer]:
    """(ModelConfig, float32 numpy params, Tokenizer) from a registered name, a .gguf or a HF dir.

    Existing paths win over registry names; a registered name is fetched into the cache first.
    """
    kind, path = _resolve(name_or_path, cache_dir)
    if kind == "hf":
        return load_hf_dir(path)
    name = None if Path(name_or_path).expanduser().is_file() else get_spec(str(name_or_path)).name
    return _load_gguf_file(path, name=name)


def load_tokenizer(
    name_or_path: str | os.PathLike = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None
) -> Tokenizer:
    """The tokenizer alone, resolved as `load_model` resolves names (no weights are read): for
    checks that need token counts before a model loads."""
    kind, path = _resolve(name_or_path, cache_dir)
    return Tokenizer.from_hf_dir(path) if kind == "hf" else Tokenizer.from_gguf(open_gguf(path))


def _load_gguf_file(path: Path, name: str | None) -> tuple[ModelConfig, dict, Tokenizer]:
    reader = open_gguf(path)
    cfg, params = load_gguf(reader, name=name)
    return cfg, params, Tokenizer.from_gguf(reader)
