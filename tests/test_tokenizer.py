"""Tokenizer: SmolLM2's GGUF tokenizer against HF transformers' ids (tests/data), tiny GGUF cases."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from kvjax.loading.tokenizer import SMOLLM2_CHAT_TEMPLATE, Tokenizer, render_chatml

DATA = Path(__file__).parent / "data"
META = json.loads((DATA / "meta.json").read_text())
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# --------------------------------------------------------------------------- the real tokenizer


@pytest.fixture(scope="session")
def smollm_tok(smollm) -> Tokenizer:
    return smollm[2]


@pytest.mark.slow
def test_text_ids_match_reference_exactly(smollm_tok):
    text = (DATA / "text.txt").read_text(encoding="utf-8")
    ref = np.load(DATA / "text_ids.npy").tolist()
    ids = smollm_tok.encode(text)
    assert len(ids) == len(ref) == 2340
    assert ids == ref


@pytest.mark.slow
def test_decode_round_trips(smollm_tok):
    text = (DATA / "text.txt").read_text(encoding="utf-8")
    assert smollm_tok.decode(smollm_tok.encode(text)) == text
    odd = "naïve café — 日本語 🙂\ttabs\n\n  spaces 3.14159"
    assert smollm_tok.decode(smollm_tok.encode(odd)) == odd


@pytest.mark.slow
def test_sample_ids(smollm_tok):
    assert smollm_tok.encode(META["sample"]) == META["sample_ids"]


@pytest.mark.slow
def test_digits_are_split_individually(smollm_tok):
    ids = smollm_tok.encode(META["digits_sample"])
    assert ids == META["digits_sample_ids"]
    assert ids != META["digits_sample_ids_without_digit_split"]


@pytest.mark.slow
def test_chat_template_text_and_ids(smollm_tok):
    msgs = META["chat_messages"]
    assert smollm_tok.chat_template == SMOLLM2_CHAT_TEMPLATE
    assert smollm_tok.apply_chat_template(msgs) == META["chat_template_text"]
    assert smollm_tok.encode_chat(msgs) == META["chat_template_ids"]


@pytest.mark.slow
def test_special_tokens_and_ids(smollm_tok):
    tok = smollm_tok
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.decode([1, 4093, 2]) == "<|im_start|>user<|im_end|>"
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert tok.encode(META["sample"])[0] != tok.bos_id  # no BOS added


@pytest.mark.slow
def test_chat_template_variants(smollm_tok):
    sys_first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert smollm_tok.apply_chat_template(sys_first, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    assert smollm_tok.apply_chat_template([]) == "<|im_start|>assistant\n"


CONVERSATIONS = [
    [],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a\nb"}],
    [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "  spaced  "},
    ],
    [{"role": "assistant", "content": "first"}, {"role": "system", "content": "late system"}],
]


def test_builtin_chatml_matches_jinja_rendering_of_the_template():
    jinja2 = pytest.importorskip("jinja2.sandbox")
    env = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            want = env.from_string(SMOLLM2_CHAT_TEMPLATE).render(
                messages=msgs, add_generation_prompt=gen
            )
            assert render_chatml(msgs, gen, system) == want, (msgs, gen)


# --------------------------------------------------------------------------- tiny GGUF tokenizers


def write_tokenizer_gguf(path, pre="smollm", model="gpt2", template=None):
    tokens = (
        SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell", "hello", "12"]
    )
    merges = ["h e", "l l", "he ll", "hell o", "1 2"]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_tokenizer_model(model)
    wr.add_tokenizer_pre(pre)
    wr.add_token_list(tokens)
    wr.add_token_types([int(t) for t in types])
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    if template is not None:
        wr.add_chat_template(template)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def test_tiny_gguf_tokenizer_merges_specials_and_digits(tmp_path):
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf"))
    hello, twelve = tok.token_to_id("hello"), tok.token_to_id("12")
    assert tok.encode("hello") == [hello]
    assert tok.encode("<|im_start|>hello<|im_end|>") == [1, hello, 2]
    assert twelve not in tok.encode("123")  # smollm: one pre-token per digit
    assert len(tok.encode("123")) == 3
    plain = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "p.gguf", pre="gpt2"))
    assert plain.encode("123")[0] == twelve  # plain gpt2 keeps digit runs together


def test_unsupported_pre_tokenizer_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"'llama-bpe'.*supported: smollm, gpt2"):
        Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", pre="llama-bpe"))


def test_unsupported_tokenizer_model_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"'llama'.*supported: 'gpt2'"):
        Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", model="llama"))


def test_chat_template_errors(tmp_path):
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf"))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TypeError, match="message 0"):
        tok.apply_chat_template([{"role": "user"}])


def test_builtin_template_is_used_for_smollm2_template(tmp_path):
    tok = Tokenizer.from_gguf(
        write_tokenizer_gguf(tmp_path / "t.gguf", template=SMOLLM2_CHAT_TEMPLATE)
    )
    text = tok.apply_chat_template(META["chat_messages"])
    assert text == META["chat_template_text"]
    assert tok.encode_chat(META["chat_messages"])[:2] == [1, tok.encode("s")[0]]


def test_unknown_template_renders_with_jinja_or_says_to_install_it(tmp_path):
    template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", template=template))
    msgs = [{"role": "user", "content": "hi"}]
    try:
        import jinja2  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="install jinja2"):
            tok.apply_chat_template(msgs)
    else:
        assert tok.apply_chat_template(msgs) == "[user]hi<|im_end|>"


def test_tokenizer_alone_equals_the_models(smollm_tok, ref):
    """`load_tokenizer` (no weights read; the harness's prompt checks) gives the same ids."""
    from kvjax.loading import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    text = ref["text"][:3000]
    assert tok.encode(text) == smollm_tok.encode(text)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], True) == \
        smollm_tok.apply_chat_template([{"role": "user", "content": "hi"}], True)
