"""Tokenizer: byte-level BPE rebuilt from GGUF metadata (or a HF tokenizer.json), plus chat template.

GGUF files store the vocabulary, merges and token types, but not the pre-tokenizer: llama.cpp
names it (`tokenizer.ggml.pre`) and hard-codes its rules. We map each supported name to the
equivalent `tokenizers` pre-tokenizer; getting this wrong changes ids silently (SmolLM2 splits
every digit into its own pre-token), so unknown names are an error rather than a guess.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import gguf
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

CONTROL = int(gguf.TokenType.CONTROL)
USER_DEFINED = int(gguf.TokenType.USER_DEFINED)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level()]
    ),
    "gpt2": _byte_level,
}

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
_SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def render_chatml(
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    default_system: str | None = None,
) -> str:
    """ChatML, as SmolLM2's template writes it: optional default system turn, one block per turn."""
    parts = []
    if default_system is not None and messages and messages[0]["role"] != "system":
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


# Templates rendered natively (exact string match), so the default model needs no jinja2.
BUILTIN_TEMPLATES = {
    SMOLLM2_CHAT_TEMPLATE: lambda msgs, gen: render_chatml(msgs, gen, _SMOLLM2_SYSTEM),
}


def _check_messages(messages) -> None:
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise TypeError(
                f"chat message {i} must be a dict with string 'role' and 'content', got {m!r}"
            )


class Tokenizer:
    """Text <-> token ids for one model: `encode` adds no BOS; special tokens in text stay atomic."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        chat_template: str | None = None,
    ):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(int(i))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages` (a list of {'role', 'content'}) per the model's template.

        Known templates are rendered natively; any other needs jinja2 (rendered the way HF
        transformers does: sandboxed, trim_blocks, lstrip_blocks).
        """
        _check_messages(messages)
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (none in the checkpoint)")
        builtin = BUILTIN_TEMPLATES.get(self.chat_template)
        if builtin is not None:
            return builtin(messages, add_generation_prompt)
        return self._render_jinja(messages, add_generation_prompt)

    def _render_jinja(self, messages, add_generation_prompt: bool) -> str:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ValueError(
                "this model's chat template is not one kvjax renders natively; "
                "install jinja2 (pip install jinja2) to render it"
            ) from None

        def raise_exception(msg):
            raise ValueError(f"chat template error: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_or_empty(self.bos_id),
            eos_token=self._token_or_empty(self.eos_id),
        )

    def _token_or_empty(self, i: int | None) -> str:
        return "" if i is None else (self.id_to_token(i) or "")

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    @classmethod
    def from_gguf(cls, src: str | os.PathLike | gguf.GGUFReader) -> Tokenizer:
        """Rebuild the byte-level BPE tokenizer stored in a GGUF file's `tokenizer.*` metadata."""
        from kvjax.loading.gguf_loader import metadata, open_gguf

        reader = src if isinstance(src, gguf.GGUFReader) else open_gguf(src)
        kind = metadata(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)"
            )
        pre = metadata(reader, "tokenizer.ggml.pre", "gpt2")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
            )
        tokens = metadata(reader, "tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges")]
        types = metadata(reader, "tokenizer.ggml.token_type", [1] * len(tokens))

        tok = tokenizers.Tokenizer(
            models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=merges,
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        added = [
            AddedToken(t, special=(ty == CONTROL), normalized=False)
            for t, ty in zip(tokens, types)
            if ty in (CONTROL, USER_DEFINED)
        ]
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])
        return cls(
            tok,
            bos_id=_opt_int(metadata(reader, "tokenizer.ggml.bos_token_id", None)),
            eos_id=_opt_int(metadata(reader, "tokenizer.ggml.eos_token_id", None)),
            chat_template=metadata(reader, "tokenizer.chat_template", None),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Wrap a HF checkpoint's tokenizer.json; BOS/EOS and template from its config files."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (needed to tokenize)")
        tok = tokenizers.Tokenizer.from_file(str(tj))
        tcfg = _read_json(path / "tokenizer_config.json")
        mcfg = _read_json(path / "config.json")

        def special_id(key: str) -> int | None:
            t = tcfg.get(key)
            if isinstance(t, dict):
                t = t.get("content")
            if isinstance(t, str) and tok.token_to_id(t) is not None:
                return tok.token_to_id(t)
            v = mcfg.get(f"{key}_id")
            if isinstance(v, list):
                v = v[0] if v else None
            return _opt_int(v)

        template = tcfg.get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(
            tok,
            bos_id=special_id("bos_token"),
            eos_id=special_id("eos_token"),
            chat_template=template,
        )


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def _read_json(p: Path) -> dict:
    if not p.is_file():
        return {}
    return json.loads(p.read_text())
