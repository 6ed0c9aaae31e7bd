"""Mixed precision (kv_keep): kept layers/heads read back in full precision, the rest within
their format's bound; real bytes equal the closed form; bad indices get clear errors; and the
compiled decode step never holds a full-precision copy of a quantized cache."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import formats as F
from kvjax.cache import KVCache
from kvjax.config import ModelConfig
from kvjax.formats import Mixed, get_format, store_nbytes
from kvjax.generate import decode_step
from kvjax.model import init_params
from kvjax.policies import get_policy

L, B, K, C, E = 4, 2, 3, 16, 16


@functools.partial(jax.jit, static_argnums=(0, 1))
def write_read(fmt, base, x, slots):
    """Write x[l] at slots into every layer of a k and a v store of `fmt` and of `base` inside
    a scan (traced layer), then read every layer back: [2 formats, 2 kinds, L, B, K, C, E]."""

    def one(f, kind):
        def body(s, layer):
            return f.write(s, layer, slots, x[layer], kind), None

        store, _ = jax.lax.scan(body, f.init((L, B, K, C, E), kind), jnp.arange(L))
        return jax.lax.map(lambda layer: f.read(store, layer, kind), jnp.arange(L))

    return jnp.stack([jnp.stack([one(f, kind) for kind in "kv"]) for f in (fmt, base)])


CASES = [
    ("int4", {"group": 8, "key_mode": "channel", "value_group": 16, "keep_layers": (0, 3)}),
    ("int4", {"group": 8, "value_group": 16, "keep_heads": (1,)}),
    ("int2", {"group": 8, "keep_layers": (2,), "keep_heads": (0, 2), "keep_dtype": "f32"}),
    ("int8", {"keep_layers": (1,), "keep_heads": (2,)}),
    ("fp8", {"keep_layers": (0, 1, 2, 3), "keep_dtype": "f32"}),
]


@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_kept_layers_and_heads_read_back_in_full_precision(name, opts):
    """Kept (layer, head) pairs read back exactly (bf16-exact data for bf16); the others read
    back bit for bit what the base format alone stores for them, keys and values."""
    fmt = get_format(name, **opts)
    assert isinstance(fmt, Mixed)
    base = get_format(name, **{k: v for k, v in opts.items() if not k.startswith("keep_")})
    x = np.random.default_rng(0).normal(size=(L, B, K, C, E)).astype(np.float32)
    if fmt.keep_dtype == "bf16":
        x = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    slots = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C))
    got, ref = np.asarray(write_read(fmt, base, jnp.asarray(x), slots))  # [2, L, B, K, C, E]
    for layer in range(L):
        for h in range(K):
            if layer in fmt.keep_layers or h in fmt.keep_heads:
                np.testing.assert_array_equal(got[:, layer, :, h], np.stack([x[layer, :, h]] * 2))
            else:
                np.testing.assert_array_equal(got[:, layer, :, h], ref[:, layer, :, h])
                assert np.abs(got[:, layer, :, h] - x[layer, :, h]).max() > 0


def closed_form(fmt: Mixed, shape) -> int:
    """Kept layers (all heads) and kept heads (other layers) at keep_dtype, the rest in base."""
    L_, B_, K_, C_, E_ = shape
    lk = len(fmt.keep_layers)
    kh = len(fmt.keep_heads)
    width = {"f32": 4, "bf16": 2}[fmt.keep_dtype]
    full = 2 * (lk * K_ + (L_ - lk) * kh) * B_ * C_ * E_ * width  # k and v
    rest = (L_ - lk, B_, K_ - kh, C_, E_)
    quant = fmt.base.nbytes(rest) if min(rest) > 0 else 0
    return full + quant


@pytest.mark.parametrize("opts", [
    {"keep_layers": (0, 29)}, {"keep_heads": (1,)}, {"keep_layers": (0,), "keep_heads": (2,)},
    {"keep_layers": (3, 7), "keep_dtype": "f32"},
])
def test_bytes_equal_the_closed_form_and_the_saving_is_real(opts):
    shape = (30, 1, 3, 2048, 64)
    fmt = get_format("int4", **opts)
    real = sum(store_nbytes(jax.eval_shape(lambda k=k: fmt.init(shape, k))) for k in "kv")
    assert real == fmt.nbytes(shape) == closed_form(fmt, shape)
    # the quantized store has rows only for what is not kept
    store = jax.eval_shape(lambda: fmt.init(shape, "k"))
    lq = 30 - len(fmt.keep_layers)
    assert store["base"]["q"].shape[:3] == (lq, 1, 3 - len(fmt.keep_heads))
    # cheaper than the whole cache at keep_dtype, dearer than the base format alone
    keep_all = get_format(fmt.keep_dtype).nbytes(shape)
    assert fmt.base.nbytes(shape) < real < keep_all


def test_hashable_frozen_and_normalized():
    a = get_format("int4", keep_layers=[29, 0], keep_heads=1)
    b = get_format("int4", keep_layers=(0, 29), keep_heads=(1,))
    assert a == b and hash(a) == hash(b)
    assert a.keep_layers == (0, 29) and a.keep_heads == (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.keep_layers = (1,)
    assert get_format("int4", keep_layers=()) == get_format("int4")  # nothing kept: the base


@pytest.mark.parametrize("opts,shape,match", [
    ({"keep_layers": (0, 30)}, (30, 1, 3, 64, 64),
     r"keep_layers=\(0, 30\) has \[30\] outside the model's 30 layers; valid indices are 0\.\.29"),
    ({"keep_heads": (3,)}, (30, 1, 3, 64, 64),
     r"keep_heads=\(3,\) has \[3\] outside the model's 3 kv heads; valid indices are 0\.\.2"),
])
def test_bad_indices_name_the_index_and_the_valid_range(opts, shape, match):
    with pytest.raises(ValueError, match=match):
        get_format("int4", **opts).init(shape, "k")


@pytest.mark.parametrize("opts,match", [
    ({"keep_layers": (-1,)}, r"keep_layers=\(-1,\) holds \[-1\], which are not non-negative"),
    ({"keep_heads": (1, 1)}, r"keep_heads=\(1, 1\) repeats an index"),
    ({"keep_layers": (0,), "keep_dtype": "fp16"}, r"keep_dtype='fp16' is not one of \('f32', "),
    ({"keep_layers": ("a",)}, r"holds \['a'\]"),
    ({"keep_layers": (0,), "groop": 8}, r"no option\(s\) \['groop'\].*keep_layers"),
])
def test_bad_options_are_clear(opts, match):
    with pytest.raises(ValueError, match=match):
        get_format("int4", **opts)


def test_mixed_needs_something_to_keep_and_a_plain_base():
    with pytest.raises(ValueError, match="both are empty"):
        Mixed(get_format("int4"))
    with pytest.raises(TypeError, match="non-mixed"):
        Mixed(get_format("int4", keep_layers=(0,)), keep_layers=(1,))


# ----------------------------------------------------------------------------- keep_units

ALL_UNITS = tuple((layer, h) for layer in range(L) for h in range(K))
UNIT_CASES = [
    ("int2", {"group": 8, "keep_units": ((3, 0), (0, 1), (3, 2))}),  # per-channel keys
    ("int4", {"group": 8, "value_group": 16, "key_mode": "token", "keep_units": [[1, 1]],
              "keep_dtype": "f32"}),
    ("int8", {"keep_units": ALL_UNITS[1:]}),  # one quantized unit left
]


@pytest.mark.parametrize("name,opts", UNIT_CASES, ids=[n for n, _ in UNIT_CASES])
def test_kept_units_read_back_in_full_precision(name, opts):
    """Kept (layer, head) units read back exactly (bf16-exact data for bf16); every other unit
    reads back bit for bit what the base format alone stores for it."""
    fmt = get_format(name, **opts)
    assert isinstance(fmt, F.MixedUnits)
    base = get_format(name, **{k: v for k, v in opts.items() if not k.startswith("keep_")})
    x = np.random.default_rng(1).normal(size=(L, B, K, C, E)).astype(np.float32)
    if fmt.keep_dtype == "bf16":
        x = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    slots = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C))
    got, ref = np.asarray(write_read(fmt, base, jnp.asarray(x), slots))  # [2, 2, L, B, K, C, E]
    for layer in range(L):
        for h in range(K):
            if (layer, h) in fmt.keep_units:
                np.testing.assert_array_equal(got[:, layer, :, h], np.stack([x[layer, :, h]] * 2))
            else:
                np.testing.assert_array_equal(got[:, layer, :, h], ref[:, layer, :, h])
                assert np.abs(got[:, layer, :, h] - x[layer, :, h]).max() > 0


@pytest.mark.parametrize("units", [((0, 0),), ((5, 1), (29, 2), (0, 0), (17, 1))])
def test_kept_units_cost_their_full_precision_bytes_only(units):
    """Real buffers = kept units at bf16 + the base format of one unit times the others (the
    formats' bytes are linear in units), so each kept unit adds exactly its own difference."""
    shape = (30, 1, 3, 2048, 64)
    fmt = get_format("int4", keep_units=units)
    real = sum(store_nbytes(jax.eval_shape(lambda k=k: fmt.init(shape, k))) for k in "kv")
    one = (1, 1, 1, 2048, 64)
    closed = len(units) * 2 * 2048 * 64 * 2 + (90 - len(units)) * fmt.base.nbytes(one)
    assert real == fmt.nbytes(shape) == closed
    assert fmt.base.nbytes(shape) < real < get_format("bf16").nbytes(shape)


def test_all_units_kept_in_f32_give_the_f32_cache_logits():
    """On the tiny model, every unit kept in f32 is the f32 cache (same logits over a prompt
    and decode steps, up to f32 rounding: the cache holds the same values, but the programs
    differ, and XLA may order a product's sums differently; 7e-9 apart on an AVX-512 box);
    one quantized unit changes them by far more."""
    from kvjax.cache import init_cache
    from kvjax.config import tiny_config
    from kvjax.model import forward_jit

    cfg = tiny_config(n_layers=3, n_kv_heads=2, head_dim=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 40), 0, cfg.vocab_size)
    units = tuple((layer, h) for layer in range(3) for h in range(2))

    def logits(fmt):
        cache = init_cache(cfg, 1, get_policy("full"), fmt, 64)
        out = []
        for lo, hi in ((0, 32), (32, 33), (33, 40)):
            lg, cache = forward_jit(params, tokens[:, lo:hi], cache, cfg)
            out.append(lg)
        return np.asarray(jnp.concatenate(out, axis=1))

    want = logits(get_format("f32"))
    int2 = {"group": 8, "residual": 8}
    np.testing.assert_allclose(
        logits(get_format("int2", **int2, keep_units=units, keep_dtype="f32")), want,
        rtol=1e-6, atol=1e-7)
    one_left = get_format("int2", **int2, keep_units=units[1:], keep_dtype="f32")
    assert np.abs(logits(one_left) - want).max() > 1e-4


@pytest.mark.parametrize("opts,match", [
    ({"keep_units": ((0, 3),)}, (r"keep_units has \[\(0, 3\)\] outside the model's 30 layers x 3 "
                                r"kv heads; valid units are \(0\.\.29, 0\.\.2\)")),
    ({"keep_units": ((0, 1), (0, 1))}, r"repeats a unit"),
    ({"keep_units": ((0,),)}, r"keep_units holds \[\(0,\)\]"),
    ({"keep_units": ((0, 1),), "keep_layers": (2,)}, r"give keep_units alone"),
])
def test_bad_units_are_clear(opts, match):
    with pytest.raises(ValueError, match=match):
        get_format("int4", **opts).init((30, 1, 3, 64, 64), "k")


# ----------------------------------------------------------------------------- memory

# 8 layers, 2 kv heads, E = 16, 1024 slots: the whole cache in f32 is 1 MiB, one layer 128 KiB
MEM_CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2,
                      head_dim=16, d_ff=64, max_seq_len=1024, name="mem")


def decode_temp_bytes(fmt) -> int:
    params = init_params(MEM_CFG, jax.random.PRNGKey(0))
    cache = KVCache.abstract(MEM_CFG, 1, get_policy("full"), fmt, 1024)
    tok = jax.ShapeDtypeStruct((1,), jnp.int32)
    return decode_step.lower(params, tok, cache, MEM_CFG).compile().memory_analysis(
    ).temp_size_in_bytes


@pytest.mark.parametrize("name,opts", [
    ("int4", {"group": 8, "value_group": 16}),
    ("int2", {"group": 8}),  # per-channel keys
    ("int4", {"group": 8, "value_group": 16, "keep_layers": (0,), "keep_heads": (1,)}),
])
def test_decode_step_dequantizes_one_layer_not_the_whole_cache(name, opts):
    """The compiled decode step's temporary bytes stay far below a full-precision copy of the
    whole cache: attention dequantizes one layer at a time inside the layer scan."""
    c = MEM_CFG
    whole_f32 = 2 * c.n_layers * c.n_kv_heads * 1024 * c.head_dim * 4
    temp = decode_temp_bytes(get_format(name, **opts))
    assert temp < whole_f32 / 4, (temp, whole_f32)


def test_unpack_is_the_inverse_of_pack_on_every_byte():
    """The bit-spreading unpack (little-endian word reinterpretation) on all 256 bytes."""
    p = jnp.arange(256, dtype=jnp.uint8)[None]
    for bits in (2, 4):
        per = 8 // bits
        want = np.stack([(np.arange(256) >> (bits * j)) & (2**bits - 1) for j in range(per)], -1)
        np.testing.assert_array_equal(np.asarray(F.unpack_bits(p, bits))[0],
                                      want.reshape(-1))
