"""Checkpoint and tokenizer loading: GGUF, local HF safetensors directories, the model hub."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from kvjax.config import ModelConfig
from kvjax.loading import weights_cache
from kvjax.loading.gguf_loader import config_from_gguf, load_gguf, metadata, open_gguf
from kvjax.loading.hf_loader import config_from_hf, is_hf_dir, load_hf_dir
from kvjax.loading.hub import (
    DEFAULT_MODEL,
    MODELS,
    cache_root,
    fetch_model,
    file_sha256,
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
    name = _registered_name(name_or_path)
    cached = _cached_header(path, name, cache_dir)
    return cached[0] if cached else config_from_gguf(open_gguf(path), name=name)


def _registered_name(name_or_path) -> str | None:
    """The registry's name for a model named by it; None for a path (the file names it)."""
    return None if Path(name_or_path).expanduser().is_file() else get_spec(str(name_or_path)).name


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
    A GGUF's params come from its dequantized-weights cache once it has one (read-only views of
    the memory-mapped file, `kvjax.loading.weights_cache`).
    """
    kind, path = _resolve(name_or_path, cache_dir)
    if kind == "hf":
        return load_hf_dir(path)
    return _load_gguf_file(path, _registered_name(name_or_path), cache_dir)


def load_tokenizer(
    name_or_path: str | os.PathLike = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None
) -> Tokenizer:
    """The tokenizer alone, resolved as `load_model` resolves names (no weights are read): for
    checks that need token counts before a model loads."""
    kind, path = _resolve(name_or_path, cache_dir)
    if kind == "hf":
        return Tokenizer.from_hf_dir(path)
    cached = _cached_header(path, None, cache_dir)
    return cached[1] if cached else Tokenizer.from_gguf(open_gguf(path))


def _named(cfg: ModelConfig, name: str | None, path: Path) -> ModelConfig:
    """The config named as `config_from_gguf` names it: the registry's name, else the file's
    general.name (stored as the cached config's name, "" when absent), else the file stem."""
    return dataclasses.replace(cfg, name=name or cfg.name or path.stem)


def _weights_file(path: Path, cache_dir) -> tuple[str, Path]:
    """(the GGUF's sha256, where its dequantized-weights cache file lives)."""
    sha = file_sha256(path)
    return sha, weights_cache.weights_path(sha, cache_root(cache_dir))


def _cached_header(path: Path, name: str | None, cache_dir) -> tuple[ModelConfig, Tokenizer] | None:
    """(config, tokenizer) from the GGUF's cached weights file when there is a good one (its
    header only); None sends the caller to the GGUF (a damaged file is rebuilt, and reported,
    when the weights load)."""
    sha, cached = _weights_file(path, cache_dir)
    if not cached.is_file():
        return None
    try:
        cfg, tok = weights_cache.read_header(cached, sha)
    except weights_cache.CorruptWeights:
        return None
    return _named(cfg, name, path), tok


def _load_gguf_file(path: Path, name: str | None, cache_dir=None
                    ) -> tuple[ModelConfig, dict, Tokenizer]:
    """Config, float32 params and tokenizer of a GGUF file, through the dequantized-weights
    cache (kvjax.loading.weights_cache): memory-mapped when cached, else dequantized and
    cached for the next load."""
    sha, cached = _weights_file(path, cache_dir)
    if cached.is_file():
        try:
            cfg, tok = weights_cache.read_header(cached, sha)
            return _named(cfg, name, path), weights_cache.read(cached, sha, cfg), tok
        except weights_cache.CorruptWeights as e:
            weights_cache.say(f"the cached weights {cached} are damaged ({e}); rebuilding them")
    reader = open_gguf(path)
    cfg, params = load_gguf(reader, name=name)
    tok = Tokenizer.from_gguf(reader)
    general = metadata(reader, "general.name", None) or ""
    try:
        weights_cache.save(cached, dataclasses.replace(cfg, name=general), params, tok, sha)
    except OSError as e:
        weights_cache.say(f"could not cache the dequantized weights at {cached}: {e}")
    return cfg, params, tok
