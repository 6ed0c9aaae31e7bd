"""GGUF checkpoints -> (ModelConfig, params) in kvjax's stacked, einsum-friendly HF layout.

Tensors are dequantized to float32 with `gguf.quants`. llama.cpp's converter permutes the rows of
attn_q / attn_k so that its RoPE pairs adjacent dims; we undo that here so every checkpoint
(GGUF or safetensors) reaches the model in HF "rotate_half" layout.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import gguf
import numpy as np

from kvjax.config import ModelConfig
from kvjax.loading.params import GGUF_NAMES, assemble_params

T = gguf.GGMLQuantizationType

SUPPORTED_TYPES: tuple[gguf.GGMLQuantizationType, ...] = (
    T.F32,
    T.F16,
    T.BF16,
    T.Q8_0,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
)
SUPPORTED_ARCHS = ("llama",)

_REQUIRED = object()


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped), turning low-level parse failures into a clear error.

    gguf-py parses the metadata field by field (seconds for a 49k-token vocabulary), so the
    last readers are kept per (file, size, mtime, inode): a run's config, tokenizer and weights
    parse it once."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = path.stat()
    return _open_gguf(path.resolve(), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, size: int, mtime_ns: int, ino: int) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise ValueError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e


def _as_reader(src: str | os.PathLike | gguf.GGUFReader) -> gguf.GGUFReader:
    return src if isinstance(src, gguf.GGUFReader) else open_gguf(src)


def metadata(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
    """The decoded value of metadata `key`; missing keys are an error unless a default is given."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file {reader.data.filename} lacks metadata key {key!r}")
        return default
    return field.contents()


def architecture(reader: gguf.GGUFReader) -> str:
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    return arch


def config_from_gguf(
    src: str | os.PathLike | gguf.GGUFReader, name: str | None = None
) -> ModelConfig:
    """ModelConfig from the `{arch}.*` hyperparameters; vocab size from the token list."""
    reader = _as_reader(src)
    arch = architecture(reader)

    def hp(key, default=_REQUIRED):
        return metadata(reader, f"{arch}.{key}", default)

    scaling = hp("rope.scaling.type", "none")
    if scaling not in ("none", "", None):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only unscaled RoPE)")
    d_model = int(hp("embedding_length"))
    n_heads = int(hp("attention.head_count"))
    head_dim = int(hp("attention.key_length", d_model // n_heads))
    if int(hp("attention.value_length", head_dim)) != head_dim:
        raise ValueError("GGUF models with value head dim != key head dim are not supported")
    rope_dims = int(hp("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(hp("vocab_size"))
    tensor_names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=int(hp("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(hp("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(hp("feed_forward_length")),
        rope_theta=float(hp("rope.freq_base", 10000.0)),
        norm_eps=float(hp("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensor_names,
        max_seq_len=int(hp("context_length")),
        name=name or metadata(reader, "general.name", None) or Path(reader.data.filename).stem,
    )


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Tensor as float32 in numpy (row-major) order, i.e. torch's [out, in] for linear weights."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which kvjax cannot "
            f"dequantize; supported types: {', '.join(t.name for t in SUPPORTED_TYPES)}"
        )
    out = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.array(out, dtype=np.float32).reshape(shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row permutation of a q/k projection [n_head*E, ...] (what llama.cpp applies)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: GGUF rows back to HF rotate_half layout."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )



def load_gguf(
    src: str | os.PathLike | gguf.GGUFReader, name: str | None = None
) -> tuple[ModelConfig, dict]:
    """Load a llama-architecture GGUF file as (ModelConfig, params of float32 numpy arrays)."""
    reader = _as_reader(src)
    cfg = config_from_gguf(reader, name=name)
    tensors = {t.name: t for t in reader.tensors}

    def read(tname: str) -> np.ndarray:
        t = tensors.get(tname)
        if t is None:
            raise ValueError(f"GGUF file {reader.data.filename} lacks tensor {tname!r}")
        return dequantize(t)

    return cfg, assemble_params(cfg, GGUF_NAMES, read, "the metadata", fix_qk=unpermute_qk)
