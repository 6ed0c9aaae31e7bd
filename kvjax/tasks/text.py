"""Texts the tasks read, and a character tokenizer for the tiny random-init model.

The default text is a file shipped in the package, `kvjax/data/python_docs.txt` (CPython
3.11's documentation topics, PSF license; source and how it was made: `python_docs.md` beside
it), so it is the same bytes on every Python version and install. Records store its sha256.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path

DEFAULT_SOURCE = "kvjax/data/python_docs.txt"


@functools.lru_cache(maxsize=1)
def default_text() -> str:
    """The shipped default text (bytes decoded as UTF-8 exactly, no newline translation)."""
    return (resources.files("kvjax") / "data" / "python_docs.txt").read_bytes().decode("utf-8")


def load_text(text_file: str | None) -> tuple[str, str]:
    """(text, source): the default text, or a UTF-8 file (a clear error if it is not one)."""
    if text_file is None:
        return default_text(), DEFAULT_SOURCE
    p = Path(text_file).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"task.text_file={text_file!r}: no such file")
    try:
        return p.read_text(encoding="utf-8"), str(p.resolve())
    except UnicodeDecodeError as e:
        raise ValueError(f"task.text_file={text_file!r} is not UTF-8 text: {e}") from None


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def encode_prefix(tokenizer, text: str, n_tokens: int) -> list[int]:
    """The first `n_tokens` ids of `text` (or all of them), tokenizing only a generous prefix.

    Byte-level BPE splits at pre-token boundaries, so ids well before the cut are the ids of
    the whole text; the prefix is grown until it yields n_tokens + a margin of ids.
    """
    n_chars = 8 * n_tokens + 1024
    while True:
        ids = tokenizer.encode(text[:n_chars])
        if n_chars >= len(text):
            return ids[:n_tokens]
        if len(ids) >= n_tokens + 64:
            return ids[:n_tokens]
        n_chars *= 2


CHARS = "\n !\"#%&'()*+,-./0123456789:;<=>?@[]_abcdefghijklmnopqrstuvwxyz"


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """One id per character (for the tiny random model only): text is lowercased, characters
    outside `CHARS` become " ", and ids are taken modulo the vocabulary (a vocabulary of at
    least len(CHARS) = 62 makes `decode` invert `encode` on lowercase text)."""

    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(CHARS)}
        space = index[" "]
        return [index.get(c, space) % self.vocab_size for c in text.lower()]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return "".join(CHARS[int(i) % len(CHARS)] for i in ids)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))
