"""Frozen, hashable configs. They are passed straight into `jit` as static arguments.

Axis vocabulary used in shape comments and einsum strings across kvjax (written once, here):

    L  layers              B  batch rows            T  query tokens in this chunk
    S  key slots (cache capacity C, plus the chunk)  C  cache capacity (slots)
    D  model width         H  query heads           K  kv heads (Hkv)
    G  query heads per kv head (H // K)              E  head dim
    F  MLP hidden width    V  vocabulary
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, SwiGLU, MHA/MQA/GQA through `n_kv_heads`."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 2048
    name: str = "custom"

    def __post_init__(self):
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelConfig.{f} must be positive, got {getattr(self, f)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(MHA: equal, MQA: 1, GQA: a divisor)"
            )

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


def tiny_config(n_heads: int = 4, n_kv_heads: int = 2, **kw) -> ModelConfig:
    """A small random-init config for fast tests."""
    base = {
        "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": n_heads,
        "n_kv_heads": n_kv_heads, "head_dim": 8, "d_ff": 64, "rope_theta": 10000.0,
        "norm_eps": 1e-5, "tie_embeddings": False, "max_seq_len": 128, "name": "tiny",
    }
    base.update(kw)
    return ModelConfig(**base)
