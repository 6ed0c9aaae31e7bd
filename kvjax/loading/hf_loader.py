"""Local Hugging Face checkpoint directories -> (ModelConfig, params, Tokenizer).

A directory with config.json (Llama-style keys), one or more *.safetensors files and
tokenizer.json. Weights are torch Linear [out, in] in HF rotate_half layout already, so loading
is transposes and reshapes into kvjax's stacked einsum layout; nothing is permuted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kvjax.config import ModelConfig
from kvjax.loading.params import HF_NAMES, assemble_params
from kvjax.loading.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama",)


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    """ModelConfig from a transformers LlamaConfig dict; unsupported variants are errors."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope scaling {rope_type!r} is not supported (only unscaled RoPE)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    try:
        d_model = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            d_model=d_model,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or d_model // n_heads),
            d_ff=int(cfg["intermediate_size"]),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            name=name,
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weight files")
    out: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(f, framework="np") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                out[k] = st.get_tensor(k)
    return out


def load_hf_dir(
    path: str | os.PathLike, name: str | None = None
) -> tuple[ModelConfig, dict, Tokenizer]:
    """Load a local HF Llama checkpoint directory as (ModelConfig, float32 params, Tokenizer)."""
    path = Path(path)
    if not is_hf_dir(path):
        raise FileNotFoundError(f"{path} is not a HF checkpoint directory (no config.json)")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), name or path.name)
    raw = _read_tensors(path)

    def read(key: str) -> np.ndarray:
        if key not in raw:
            raise ValueError(f"checkpoint {path} lacks tensor {key!r}")
        return np.asarray(raw[key]).astype(np.float32)

    params = assemble_params(cfg, HF_NAMES, read, "config.json")
    return cfg, params, Tokenizer.from_hf_dir(path)
