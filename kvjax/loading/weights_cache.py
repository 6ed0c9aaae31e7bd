"""A GGUF model's dequantized float32 weights, config and tokenizer, cached as one safetensors file.

Dequantizing the default GGUF takes seconds and parsing its metadata (49k tokens, read one
field at a time by gguf-py) takes seconds more, on every run. The first load writes what they
produce into `cache_root()/weights/<gguf sha256>.f32.<loader>.safetensors`: the params as
float32 tensors, the ModelConfig and the tokenizer (its `tokenizers` JSON) in the header's
metadata. Later loads memory-map it: the header gives config and tokenizer without touching the
weights, the tensors are views of the mapped file.

The name holds everything that changes the content: the GGUF's sha256, the dtype, and `loader`,
a hash of the loading code and of the gguf/tokenizers versions (a change to any of them is a
new file; the stale one is removed when the new one is written). Writes are atomic (a temp file
renamed into place), so a reader never sees half a file; a file that fails its checks (header,
size, every tensor's name/shape/dtype, a CRC32 of the data) is rebuilt with a one-line message.
The CRC32 runs once per version of the file: a marker beside it (`.verified`, as for the GGUF)
records the check with the file's size and mtime, and a file changed since is checked again.
The file is standard safetensors (`safetensors.safe_open` reads it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import struct
import sys
import zlib
from importlib import metadata as importlib_metadata
from pathlib import Path

import numpy as np

from kvjax.config import ModelConfig
from kvjax.loading.hub import marker_ok, marker_path, write_marker
from kvjax.loading.params import param_shapes

DTYPE = "f32"
_ALIGN = 64  # the data section starts on a 64-byte boundary (aligned float32 views)
_LOADER_FILES = ("gguf_loader.py", "params.py", "tokenizer.py", "weights_cache.py")


class CorruptWeights(ValueError):
    """A cached weights file that cannot be used as is (it is rebuilt)."""


@functools.lru_cache(maxsize=1)
def loader_version() -> str:
    """Hash of the code and library versions that turn a GGUF into params and a tokenizer."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _LOADER_FILES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes())
    for dist in ("gguf", "tokenizers"):
        try:
            h.update(f"{dist}={importlib_metadata.version(dist)}".encode())
        except importlib_metadata.PackageNotFoundError:
            h.update(f"{dist}=?".encode())
    return h.hexdigest()[:12]


def weights_path(gguf_sha256: str, root: Path) -> Path:
    """Where the cached weights of the GGUF with this sha256 live under cache root `root`."""
    return root / "weights" / f"{gguf_sha256[:32]}.{DTYPE}.{loader_version()}.safetensors"


def _flatten(params: dict) -> dict[str, np.ndarray]:
    """{"layers.wq": ..., "embed": ...}: the params pytree (two levels) with dotted names."""
    flat = {}
    for k, v in params.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            flat[k] = v
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    params: dict = {}
    for name, a in flat.items():
        outer, _, inner = name.partition(".")
        if inner:
            params.setdefault(outer, {})[inner] = a
        else:
            params[outer] = a
    return params


def save(path: Path, cfg: ModelConfig, params: dict, tokenizer, gguf_sha256: str) -> None:
    """Write params (float32) + config + tokenizer as one safetensors file, atomically."""
    flat = {k: np.ascontiguousarray(v, np.float32) for k, v in sorted(_flatten(params).items())}
    tensors, offset, crc = {}, 0, 0
    for name, a in flat.items():
        tensors[name] = {"dtype": "F32", "shape": list(a.shape),
                         "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        crc = zlib.crc32(memoryview(a).cast("B"), crc)
    meta = {
        "format": "pt",  # what safetensors' own writers put here; kvjax reads numpy either way
        "kvjax.gguf_sha256": gguf_sha256,
        "kvjax.loader": loader_version(),
        "kvjax.dtype": DTYPE,
        "kvjax.crc32": str(crc),
        "kvjax.data_bytes": str(offset),
        "kvjax.config": json.dumps(dataclasses.asdict(cfg)),
        "kvjax.tokenizer": tokenizer.tok.to_str(),
        "kvjax.tokenizer_extra": json.dumps({"bos_id": tokenizer.bos_id,
                                             "eos_id": tokenizer.eos_id,
                                             "chat_template": tokenizer.chat_template}),
    }
    header = json.dumps({"__metadata__": meta, **tensors}).encode()
    header += b" " * (-(8 + len(header)) % _ALIGN)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for a in flat.values():
                f.write(memoryview(a).cast("B"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    for stale in path.parent.glob(f"{gguf_sha256[:32]}.{DTYPE}.*.safetensors*"):
        if stale not in (path, marker_path(path)):
            stale.unlink(missing_ok=True)


def _read_header(path: Path) -> tuple[dict, dict, int]:
    """(metadata, tensor entries, data start) of a safetensors file, checked against its size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > size - 8:
                raise CorruptWeights(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise CorruptWeights(f"unreadable header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptWeights("no __metadata__ in the header")
    meta = header.pop("__metadata__")
    try:
        data_bytes = int(meta["kvjax.data_bytes"])
    except (KeyError, ValueError):
        raise CorruptWeights("no kvjax.data_bytes in the metadata") from None
    if size != 8 + n + data_bytes:
        raise CorruptWeights(f"{size} bytes, expected {8 + n + data_bytes} (truncated?)")
    return meta, header, 8 + n


def _check_meta(meta: dict, gguf_sha256: str) -> None:
    want = {"kvjax.gguf_sha256": gguf_sha256, "kvjax.loader": loader_version(),
            "kvjax.dtype": DTYPE}
    for k, v in want.items():
        if meta.get(k) != v:
            raise CorruptWeights(f"metadata {k}={meta.get(k)!r}, expected {v!r}")


def read_header(path: Path, gguf_sha256: str) -> tuple[ModelConfig, object]:
    """(ModelConfig, Tokenizer) from a cached file's header alone (no weights are read); kept
    per file version, as a run asks for config, tokenizer and weights in turn."""
    st = path.stat()
    return _header(path.resolve(), st.st_size, st.st_mtime_ns, st.st_ino, gguf_sha256)


@functools.lru_cache(maxsize=2)
def _header(path: Path, size: int, mtime_ns: int, ino: int, gguf_sha256: str):
    import tokenizers

    from kvjax.loading.tokenizer import Tokenizer

    meta, _, _ = _read_header(path)
    _check_meta(meta, gguf_sha256)
    try:
        cfg = ModelConfig(**json.loads(meta["kvjax.config"]))
        extra = json.loads(meta["kvjax.tokenizer_extra"])
        tok = Tokenizer(tokenizers.Tokenizer.from_str(meta["kvjax.tokenizer"]), **extra)
    except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exception on a bad JSON)
        raise CorruptWeights(f"bad config or tokenizer ({type(e).__name__}: {e})") from None
    return cfg, tok


def read(path: Path, gguf_sha256: str, cfg: ModelConfig) -> dict:
    """The params, as float32 views of the memory-mapped file; every tensor's name, shape and
    dtype must be those `assemble_params` builds for `cfg`, and the data must match its CRC32."""
    expected_shapes = _flatten(param_shapes(cfg))
    meta, entries, start = _read_header(path)
    _check_meta(meta, gguf_sha256)
    if set(entries) != set(expected_shapes):
        raise CorruptWeights(f"tensors {sorted(entries)}, expected {sorted(expected_shapes)}")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    crc = meta.get("kvjax.crc32")
    if not marker_ok(path, crc32=crc):  # checked once per version of the file
        if str(data_crc32(mm[start:])) != crc:
            raise CorruptWeights("the data's CRC32 does not match its header")
        with contextlib.suppress(OSError):  # a read-only cache: check again next time
            write_marker(path, crc32=crc)
    flat = {}
    for name, e in entries.items():
        b, end = e["data_offsets"]
        shape = tuple(e["shape"])
        if e["dtype"] != "F32" or shape != tuple(expected_shapes[name]) or end - b != 4 * int(
                np.prod(shape)):
            raise CorruptWeights(f"tensor {name}: {e}, expected F32 {expected_shapes[name]}")
        flat[name] = mm[start + b:start + end].view(np.float32).reshape(shape)
    return _unflatten(flat)


def data_crc32(data) -> int:
    """CRC32 of a cached file's data section (540 MB for the default model)."""
    return zlib.crc32(data)


def say(msg: str) -> None:
    """One line on stderr (loading runs before any table is printed)."""
    print(f"kvjax: {msg}", file=sys.stderr, flush=True)
