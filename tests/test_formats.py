"""KV storage formats: round-trip bounds, the write/read protocol under a layer scan, bit layout,
real bytes, attention error, per-channel keys under eviction, and bad input."""

from __future__ import annotations

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import formats as F
from kvjax.formats import get_format

EPS = 1e-6  # relative slack for the float32 arithmetic of (de)quantization
HYP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- references


def f16_down(v):
    h = np.asarray(v, np.float32).astype(np.float16)
    return np.where(h.astype(np.float32) > v, np.nextafter(h, np.float16(-np.inf)), h)


def f16_up(v):
    h = np.asarray(v, np.float32).astype(np.float16)
    return np.where(h.astype(np.float32) < v, np.nextafter(h, np.float16(np.inf)), h)


def np_block_roundtrip(x, bits, axis):
    """numpy reference: asymmetric quantization of x with one (scale, zero) along `axis`."""
    x = np.asarray(x, np.float32)
    levels = 2**bits - 1
    zero = f16_down(x.min(axis, keepdims=True)).astype(np.float32)
    scale = f16_up(np.maximum((x.max(axis, keepdims=True) - zero) / np.float32(levels), F.TINY))
    scale = scale.astype(np.float32)
    q = np.clip(np.round((x - zero) / scale), 0, levels)
    return (q * scale + zero).astype(np.float32)


def structured(kind, seed, shape):
    """Test data families: normal, constant groups, zeros, large outliers, tiny, offset."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    if kind == "const":
        x = np.broadcast_to(rng.normal(size=shape[:-1] + (1,)), shape) * 3.3
    elif kind == "zeros":
        x = np.zeros(shape)
    elif kind == "outlier":
        x[rng.random(shape) < 0.05] *= 1000.0
    elif kind == "tiny":
        x = x * 1e-9
    elif kind == "offset":
        x = x * 0.01 + 100.0
    elif kind == "mixed":
        x[..., ::3] = 0.0
        x[..., 1::5] = -7.0
    return np.ascontiguousarray(x, np.float32)


KINDS = ["normal", "const", "zeros", "outlier", "tiny", "offset", "mixed"]
SHAPES = [(1, 8), (3, 16), (2, 4, 64)]


@st.composite
def tensors(draw):
    shape = draw(st.sampled_from(SHAPES))
    if draw(st.booleans()):
        x = structured(draw(st.sampled_from(KINDS)), draw(st.integers(0, 2**31)), shape)
    else:
        x = draw(hnp.arrays(np.float32, shape, elements=st.floats(-3e3, 3e3, width=32)))
    return x


@functools.partial(jax.jit, static_argnums=(1, 2))
def roundtrip_per_token(x, bits, group):
    d = F.quantize_per_token(x, bits, group)
    return F.dequantize_per_token(d, bits, group), d


@jax.jit
def roundtrip_int8(x):
    d = F.quantize_int8(x)
    return F.dequantize_int8(d), d


@jax.jit
def roundtrip_fp8(x):
    d = F.quantize_fp8(x)
    return F.dequantize_fp8(d), d


@functools.partial(jax.jit, static_argnums=(0, 5))
def jwrite(fmt, store, layer, slots, x, kind):
    return fmt.write(store, layer, slots, x, kind)


@functools.partial(jax.jit, static_argnums=(0, 3))
def jread(fmt, store, layer, kind):
    return fmt.read(store, layer, kind)


def per_token_bound(x, d, bits, group):
    """scale/2 of each element's group, plus float32 slack."""
    levels = 2**bits - 1
    s = np.repeat(np.asarray(d["scale"], np.float32), group, axis=-1)
    z = np.repeat(np.asarray(d["zero"], np.float32), group, axis=-1)
    return s / 2 + EPS * (np.abs(x) + np.abs(z) + levels * s)


# ----------------------------------------------------------------------------- round trips


@HYP
@given(x=tensors(), bits=st.sampled_from([2, 4, 8]), whole=st.booleans())
def test_per_token_roundtrip_within_half_step(x, bits, whole):
    E = x.shape[-1]
    group = E if whole else 8
    xh, d = roundtrip_per_token(jnp.asarray(x), bits, group)
    xh = np.asarray(xh)
    assert np.all(np.isfinite(xh))
    assert np.all(np.abs(xh - x) <= per_token_bound(x, d, bits, group))
    # the step is what the group's range implies (scale rounded up by at most one f16 ulp)
    xg = x.reshape(*x.shape[:-1], E // group, group)
    step = (xg.max(-1) - xg.min(-1)) / (2**bits - 1)
    scale = np.asarray(d["scale"], np.float32)
    assert np.all(
        scale
        <= np.maximum(step, F.TINY) * (1 + 2**-9) + 2e-3 * np.abs(xg.min(-1)) / 2**bits + 2**-23
    )
    # constant groups come back within a fraction of a float16 ulp (exactly when representable)
    const = xg.max(-1) == xg.min(-1)
    cerr = np.abs(xh.reshape(xg.shape)[const] - xg[const])
    assert np.all(cerr <= np.maximum(2.0**-10 * np.abs(xg[const]) / (2**bits - 1), 2.0**-24))
    exact = const & (xg.min(-1).astype(np.float16).astype(np.float32) == xg.min(-1))
    np.testing.assert_array_equal(xh.reshape(xg.shape)[exact], xg[exact])


@HYP
@given(x=tensors())
def test_int8_roundtrip_within_half_step(x):
    xh, d = roundtrip_int8(jnp.asarray(x))
    s = np.asarray(d["scale"], np.float32)
    q = np.asarray(d["q"])
    assert q.dtype == np.int8 and np.abs(q.astype(int)).max() <= 127
    assert np.all(np.abs(np.asarray(xh) - x) <= s / 2 + EPS * (np.abs(x) + 127 * s))
    amax = np.abs(x).max(-1, keepdims=True)
    assert np.all(s <= np.maximum(amax / 127, F.TINY) * (1 + 2**-10) + 2**-24)


@HYP
@given(x=tensors())
def test_fp8_roundtrip_relative_bound(x):
    xh, d = roundtrip_fp8(jnp.asarray(x))
    s = np.asarray(d["scale"], np.float32)
    q = np.asarray(d["q"])
    assert q.dtype == np.uint8  # the float8_e4m3fn bits (see formats.float_bits)
    np.testing.assert_array_equal(  # they are the e4m3 rounding of x / scale
        q.view(jnp.float8_e4m3fn).astype(np.float32),
        np.clip(x / s, -F.FP8_MAX, F.FP8_MAX).astype(jnp.float8_e4m3fn).astype(np.float32))
    y = np.abs(x) / s
    bound = s * np.maximum(2.0**-4 * y, 2.0**-10) + EPS * (np.abs(x) + s)
    err = np.abs(np.asarray(xh) - x)
    assert np.all(np.isfinite(np.asarray(xh)))
    assert np.all(err <= bound)


def test_bf16_roundtrip_relative_bound():
    x = structured("outlier", 0, (4, 64))
    f = get_format("bf16")
    st_ = jwrite(
        f, f.init((1, 1, 4, 64, 64), "k"), 0, jnp.zeros((1, 4, 1), jnp.int32), x[None, :, None], "k"
    )
    xh = np.asarray(jread(f, st_, 0, "k"))[0, :, 0]
    assert np.all(np.abs(xh - x) <= 2.0**-8 * np.abs(x))  # 8 significant bits
    assert st_["q"].dtype == jnp.uint16  # stored as the bf16 bits (see formats.float_bits)
    np.testing.assert_array_equal(xh, x.astype(jnp.bfloat16).astype(np.float32))


def test_float_stores_hold_what_was_written_in_their_layout():
    """f32 keys are held channel-major ([L, B, K, E, C], `keys_by_channel`), values and bf16
    slot-major; each reads back exactly what was written at random slots (slot C dropped),
    and `values` / `holding` give every layer's values and the store that holds them."""
    rng = np.random.default_rng(3)
    L, B, K, C, E, T = 2, 2, 3, 16, 8, 5
    for name in ("f32", "bf16"):
        f = get_format(name)
        for kind in ("k", "v"):
            s = f.init((L, B, K, C, E), kind)
            by_channel = name == "f32" and kind == "k"
            assert f._by_channel(kind) == by_channel
            assert s["q"].shape == ((L, B, K, E, C) if by_channel else (L, B, K, C, E))
            x = rng.normal(size=(B, K, T, E)).astype(np.float32)
            x = x.astype(jnp.bfloat16).astype(np.float32) if name == "bf16" else x
            slots = np.stack([rng.permutation(C + 1)[:T] for _ in range(B * K)]).reshape(B, K, T)
            s = jwrite(f, s, 1, jnp.asarray(slots, jnp.int32), x, kind)
            want = np.zeros((L, B, K, C + 1, E), np.float32)
            want[1, np.arange(B)[:, None, None], np.arange(K)[None, :, None], slots] = x
            want = want[:, :, :, :C]  # slot C: dropped
            for layer in range(L):
                np.testing.assert_array_equal(np.asarray(jread(f, s, layer, kind)), want[layer])
            np.testing.assert_array_equal(np.asarray(f.values(s, kind)), want)
            back = f.holding(jnp.asarray(want), kind)
            np.testing.assert_array_equal(np.asarray(back["q"]), np.asarray(s["q"]))


# ----------------------------------------------------------------------------- packing


def test_pack_bits_exact_layout():
    q4 = jnp.array([1, 2, 3, 4, 15, 0, 7, 8], jnp.uint8)
    p4 = np.asarray(F.pack_bits(q4, 4))
    assert p4.tolist() == [0x21, 0x43, 0x0F, 0x87]  # element 2i low nibble, 2i+1 high nibble
    q2 = jnp.array([1, 2, 3, 0, 3, 3, 0, 1], jnp.uint8)
    p2 = np.asarray(F.pack_bits(q2, 2))
    assert p2.tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 3 << 2 | 0 << 4 | 1 << 6]
    assert p4.dtype == np.uint8 and p2.dtype == np.uint8
    rng = np.random.default_rng(0)
    for bits in (2, 4, 8):
        q = jnp.asarray(rng.integers(0, 2**bits, size=(3, 5, 64)), jnp.uint8)
        p = jax.jit(F.pack_bits, static_argnums=1)(q, bits)
        back = jax.jit(F.unpack_bits, static_argnums=1)(p, bits)
        assert p.shape == (3, 5, 64 * bits // 8)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(q))


def test_value_store_layout_is_the_kernel_contract():
    """{"q": uint8 [L,B,K,C,E*bits//8], "scale", "zero": [L,B,K,C,E//g]}, x ~= q*scale + zero."""
    rng = np.random.default_rng(1)
    for name, bits in (("int4", 4), ("int2", 2)):
        f = get_format(name, group=8, value_group=16)  # values use value_group
        s = f.init((2, 1, 3, 32, 64), "v")
        assert set(s) == {"q", "scale", "zero"}
        assert s["q"].shape == (2, 1, 3, 32, 64 * bits // 8) and s["q"].dtype == jnp.uint8
        assert s["scale"].shape == s["zero"].shape == (2, 1, 3, 32, 4)
        assert s["scale"].dtype == s["zero"].dtype == jnp.float16
        x = rng.normal(size=(1, 3, 5, 64)).astype(np.float32)
        s = jwrite(f, s, 1, jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (1, 3, 5)), x, "v")
        p = np.asarray(s["q"][1, :, :, :5])  # [B, K, T, E*bits/8]
        per = 8 // bits
        q = np.stack([(p >> (bits * j)) & (2**bits - 1) for j in range(per)], -1).reshape(x.shape)
        sc = np.repeat(np.asarray(s["scale"][1, :, :, :5], np.float32), 16, -1)
        ze = np.repeat(np.asarray(s["zero"][1, :, :, :5], np.float32), 16, -1)
        np.testing.assert_allclose(
            q * sc + ze, np.asarray(jread(f, s, 1, "v"))[:, :, :5], rtol=0, atol=1e-6
        )
    for name, dt in (("int8", jnp.int8), ("fp8", jnp.uint8)):  # fp8: the e4m3 bits
        s = get_format(name).init((2, 1, 3, 32, 64), "k")
        assert s["q"].dtype == dt and s["q"].shape == (2, 1, 3, 32, 64)
        assert s["scale"].shape == (2, 1, 3, 32, 1) and s["scale"].dtype == jnp.float16


# ----------------------------------------------------------------------------- bytes

BYTE_SHAPE = (30, 1, 3, 2048, 64)


def measured_ratio(name, **opts):
    f = get_format(name, **opts)
    base = sum(
        leaf.nbytes
        for kind in "kv"
        for leaf in jax.tree.leaves(get_format("bf16").init(BYTE_SHAPE, kind))
    )
    n = sum(leaf.nbytes for kind in "kv" for leaf in jax.tree.leaves(f.init(BYTE_SHAPE, kind)))
    assert n == f.nbytes(BYTE_SHAPE)  # the abstract count agrees with the real buffers
    return n / base


def test_bytes_real_buffers_against_bf16():
    """Measured sum(nbytes) of real k+v buffers (metadata included) at 30 x 3 x 2048 x 64."""
    assert measured_ratio("f32") == 2.0
    assert measured_ratio("int8") <= 0.55
    assert measured_ratio("fp8") <= 0.55
    assert measured_ratio("int4", key_mode="token", group=32, value_group=64) <= 0.30
    assert measured_ratio("int4", key_mode="token") <= 0.30
    assert measured_ratio("int2", key_mode="token") <= 0.20
    assert measured_ratio("int2", group=64, key_mode="token") <= 0.20
    # closed forms (per token per head, bytes; bf16 = 2 * 64 * 2 = 256 for k+v):
    # int4 per-token keys g=32: 32 q + 2 groups * 4 (f16 scale + zero); values g=64: 32 + 4
    assert measured_ratio("int4", key_mode="token", group=32, value_group=64) == 76 / 256
    # int4 token, g=32 for both: 2 * (32 + 8) = 80 -> 0.3125 (1/4 + 2/g)
    assert measured_ratio("int4", key_mode="token", group=32) == 80 / 256
    # int4 defaults, channel keys g=64: keys 32 q + 4 channel params + 4 fallback rows
    # + 8 residual (64 x 64 f32 / 2048 slots) + res_group/res_mask; values g=64: 32 + 4
    assert measured_ratio("int4") == pytest.approx((48 + 36) / 256, abs=1e-3)
    # KIVI at g=32: keys 32 + 8 + 8 + 4 (residual 32), values 32 + 8
    assert measured_ratio("int4", group=32) == pytest.approx((52 + 40) / 256, abs=1e-3)
    assert measured_ratio("int2") == pytest.approx((36 + 24) / 256, abs=1e-3)


# ----------------------------------------------------------------------------- protocol

ALL = [
    ("f32", {}),
    ("bf16", {}),
    ("fp8", {}),
    ("int8", {}),
    ("int4", {"group": 8, "value_group": 16}),  # the defaults' layout: wider value groups
    ("int4", {"group": 8, "key_mode": "token", "value_group": None}),
    ("int2", {"group": 16, "key_mode": "token"}),
]  # int2 per-channel keys: the same code path as int4 (tested below with int2 and int4)


@functools.partial(jax.jit, static_argnums=(0, 4))
def scan_write(fmt, store, slots, x, kind):
    """Write x[l] at slots[l] into each layer inside lax.scan (store in the carry, traced layer)."""

    def body(s, inp):
        layer, sl, xl = inp
        s = fmt.write(s, layer, sl, xl, kind)
        return s, fmt.read(s, layer, kind)

    L = slots.shape[0]
    return jax.lax.scan(body, store, (jnp.arange(L, dtype=jnp.int32), slots, x))


def read_all(fmt, store, kind):
    return np.stack(
        [np.asarray(jread(fmt, store, layer, kind)) for layer in range(store["q"].shape[0])]
    )


def tolerance(name, amax):
    """A loose ceiling (half the widest step) given the largest |x| written; exact per-element
    bounds are tested above and below."""
    return {
        "f32": 0,
        "bf16": 2**-8,
        "fp8": 2**-4,
        "int8": 1 / 250,
        "int4": 1 / 14,
        "int2": 1 / 2.9,
    }[name] * amax


@pytest.mark.parametrize("name,opts", ALL, ids=[f"{n}-{o}" for n, o in ALL])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_protocol_write_read_in_scan(name, opts, kind):
    L, B, K, C, E = 3, 2, 2, 32, 16
    fmt = get_format(name, **opts)
    assert hash(fmt) == hash(get_format(name, **opts))
    rng = np.random.default_rng(0)
    store = fmt.init((L, B, K, C, E), kind)
    assert all(leaf.dtype != jnp.int4 for leaf in jax.tree.leaves(store))
    # fill every slot, then overwrite a few (different per layer/row/head) and drop some
    x0 = rng.normal(size=(L, B, K, C, E)).astype(np.float32)
    slots0 = np.broadcast_to(np.arange(C, dtype=np.int32), (L, B, K, C))
    store, reads0 = scan_write(fmt, store, jnp.asarray(slots0), jnp.asarray(x0), kind)
    before = read_all(fmt, store, kind)
    np.testing.assert_array_equal(before, np.asarray(reads0))
    assert np.all(np.abs(before - x0) <= tolerance(name, np.abs(x0).max()))
    T = 5  # tokens of the second write; the chunk is padded to C with dropped slots (one compile)
    slots1 = np.full((L, B, K, C), C, np.int32)
    slots1[..., :T] = np.stack(
        [
            np.stack([np.stack([rng.permutation(C)[:T] for _ in range(K)]) for _ in range(B)])
            for _ in range(L)
        ]
    )  # [L, B, K, T]
    slots1[:, :, :, T - 1] = C  # a dropped token
    x1 = (rng.normal(size=(L, B, K, C, E)) * 2).astype(np.float32)
    x1[:, :, :, T - 1 :] = 1e6  # dropped tokens never land anywhere
    amax = max(np.abs(x0).max(), np.abs(x1[:, :, :, : T - 1]).max())
    store, _ = scan_write(fmt, store, jnp.asarray(slots1), jnp.asarray(x1), kind)
    after = read_all(fmt, store, kind)
    written = np.zeros((L, B, K, C), bool)
    for idx in np.ndindex(L, B, K):
        for t in range(T - 1):
            s = slots1[idx + (t,)]
            written[idx + (s,)] = True
            xt = x1[idx + (t,)]
            assert np.all(np.abs(after[idx + (s,)] - xt) <= tolerance(name, amax)), (idx, s)
    if name in ("f32", "bf16", "fp8", "int8") or opts.get("key_mode") == "token" or kind == "v":
        # slot-independent formats: untouched slots are bit-identical, written ones match the codec
        np.testing.assert_array_equal(after[~written], before[~written])
    else:  # per-channel keys: untouched slots keep their codes (checked exactly in the tests below)
        assert np.all(np.abs(after[~written] - x0[~written]) <= tolerance(name, amax))
    assert np.abs(after).max() < 1e3


BLOCKED = [
    *ALL,
    ("int4", {"group": 8, "residual": 16}),  # per-channel keys, two open groups
    ("int2", {"group": 8}),
]


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def block_write(fmt, store, slots, x, kind, n):
    """Write layers n at a time (`layer` [n] consecutive indices), as `KVCache.store_layers`."""
    return F.scan_layer_blocks(lambda s, layer, sx: fmt.write(s, layer, *sx, kind), store,
                               (slots, x), n)


@pytest.mark.parametrize("name,opts", BLOCKED, ids=[f"{n}-{o}" for n, o in BLOCKED])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_a_block_of_layers_is_written_bit_identically_to_each_layer_alone(name, opts, kind):
    """A write of n layers at once (what `forward` does after its layer scan) stores exactly
    what a write per layer would: prompt chunks in order, then tokens at random per-layer slots
    (evictions) with drops, so per-channel keys seal, flush and keep their residual."""
    L, B, K, C, E = 4, 2, 2, 32, 16
    fmt = get_format(name, **opts)
    assert fmt.layers_per_write(L, B, K, 1, E) == L  # a decode step: every layer at once
    rng = np.random.default_rng(5)
    stores = [fmt.init((L, B, K, C, E), kind)] * 3
    for step in range(8):
        T = 6 if step < 4 else 1
        if step < 4:  # in order: 24 slots, three groups of 8 sealed
            slots = np.broadcast_to(np.arange(step * T, step * T + T, dtype=np.int32),
                                    (L, B, K, T))
        else:
            slots = rng.integers(0, C + 1, (L, B, K, T)).astype(np.int32)  # C: dropped
        x = jnp.asarray(rng.normal(size=(L, B, K, T, E)).astype(np.float32))
        slots = jnp.asarray(slots)
        stores = [scan_write(fmt, stores[0], slots, x, kind)[0],
                  block_write(fmt, stores[1], slots, x, kind, 2),
                  block_write(fmt, stores[2], slots, x, kind, L)]
        for other in stores[1:]:
            for a, b in zip(jax.tree.leaves(stores[0]), jax.tree.leaves(other), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert max(float(jnp.abs(jread(fmt, stores[1], layer, kind)).max())
               for layer in range(L)) > 0.1  # something was stored


def test_layers_per_write_bounds_the_working_set():
    """All layers of a decode step at once; a long prompt in blocks whose float32 working set
    stays within WRITE_BLOCK_BYTES; formats that route layers (kv_keep) one at a time."""
    assert get_format("int4").layers_per_write(30, 1, 3, 1, 64) == 30
    n = get_format("int4").layers_per_write(30, 1, 3, 2048, 64)
    assert 30 % n == 0 and 1 <= n < 30 and n * 3 * (2048 + 64) * 64 * 4 <= F.WRITE_BLOCK_BYTES
    assert get_format("f32").layers_per_write(30, 1, 3, 1 << 20, 64) == 1
    assert get_format("int4", keep_layers=(1,)).layers_per_write(30, 1, 3, 1, 64) == 1


def test_protocol_matches_pure_codec():
    """write+read of per-token formats == the public pure encode/decode (the kernel reuses them)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 2, 4, 32)).astype(np.float32)
    slots = jnp.broadcast_to(jnp.array([3, 0, 7, 5], jnp.int32), (1, 2, 4))
    pairs = [
        (get_format("int4", group=16, value_group=16), lambda x: roundtrip_per_token(x, 4, 16)[0]),
        (get_format("int2", group=8, key_mode="token"), lambda x: roundtrip_per_token(x, 2, 8)[0]),
        (get_format("int8"), lambda x: roundtrip_int8(x)[0]),
        (get_format("fp8"), lambda x: roundtrip_fp8(x)[0]),
    ]
    for fmt, codec in pairs:
        s = jwrite(fmt, fmt.init((1, 1, 2, 8, 32), "v"), jnp.int32(0), slots, x, "v")
        got = np.asarray(jread(fmt, s, 0, "v"))[:, :, [3, 0, 7, 5]]
        np.testing.assert_array_equal(got, np.asarray(codec(jnp.asarray(x))))


# ----------------------------------------------------------------------------- per-channel keys


def one_row_writer(fmt, T):
    """(store, slots [<=T], x [<=T, E]) -> store for a one layer/row/head key store; chunks are
    padded to T with dropped slots, as the cache pads them, so each test compiles once."""

    def w(store, slots, x):
        C = store["q"].shape[3]
        n = len(slots)
        sl = np.full((T,), C, np.int32)
        sl[:n] = slots
        xp = np.zeros((T, x.shape[-1]), np.float32)
        xp[:n] = x
        return jwrite(
            fmt, store, jnp.int32(0), jnp.asarray(sl)[None, None], jnp.asarray(xp)[None, None], "k"
        )

    return w


def read_row(fmt, store):
    return np.asarray(jread(fmt, store, jnp.int32(0), "k"))[0, 0]


def channel_bounds(fmt, store):
    """Per-slot, per-element error bound implied by what is stored: [C, E]."""
    g, bits = fmt.group, fmt.bits
    s = {n: np.asarray(v[0, 0, 0], np.float32) for n, v in store.items() if n != "res_mask"}
    tok = s["scale"][:, :1] > 0  # [C, 1] per-token fallback rows
    ts = np.repeat(s["scale"], g, -1)
    tz = np.repeat(s["zero"], g, -1)
    cs = np.repeat(s["cscale"], g, 0)
    cz = np.repeat(s["czero"], g, 0)
    levels = 2**bits - 1
    bound = np.where(
        tok, ts / 2 + EPS * (np.abs(tz) + levels * ts), cs / 2 + EPS * (np.abs(cz) + levels * cs)
    )
    rs = np.asarray(
        F._residual_slots(store["res_group"][0, 0, 0], store["res_mask"][0, 0, 0], bound.shape[0])
    )
    bound[rs[rs < bound.shape[0]]] = 0.0
    return bound


@pytest.mark.parametrize("bits,S", [(4, 1), (2, 2)])
def test_channel_keys_sequential_stream_matches_block_reference(bits, S):
    """Chunks and single tokens written in order == KIVI block quantization along tokens, with the
    S newest groups still in full precision."""
    C, E, g = 96, 16, 8
    fmt = get_format(f"int{bits}", group=g, residual=S * g, key_mode="channel")
    w = one_row_writer(fmt, 20)
    store = fmt.init((1, 1, 1, C, E), "k")
    X = structured("outlier", bits, (C, E)) + np.linspace(
        0, 5, E, dtype=np.float32
    )  # channel offsets
    n = 0
    for T in [1, 1, 13, 1, 8, 20, 3, 1, 1, 1, 19, 4]:  # padded to 20
        sl = np.arange(n, n + T, dtype=np.int32)
        store = w(store, sl, X[n : n + T])
        n += T
        got = read_row(fmt, store)
        last = (n - 1) // g
        ref = np.zeros((C, E), np.float32)
        for j in range(last + 1):
            blk = X[j * g : min((j + 1) * g, n)]
            ref[j * g : j * g + len(blk)] = (
                blk if j > last - S else np_block_roundtrip(blk, bits, 0)
            )
        assert np.all(np.abs(got - ref) <= 2e-6 * (1 + np.abs(ref)))
        assert np.all(np.asarray(store["scale"]) == 0)  # no per-token fallback in a stream


@pytest.mark.parametrize("S", [1, 2])
def test_channel_keys_under_eviction_no_requantization_and_bounded(S):
    """H2O-like victims inside sealed groups: every slot within its stored bound, outliers kept,
    and codes/params of keys that were not overwritten never change (no re-quantization). With
    one open group (S = 1) the residual is written in place; with two it is rebuilt."""
    C, E, g = 64, 16, 8
    fmt = get_format("int4", group=g, residual=S * g, key_mode="channel")
    w = one_row_writer(fmt, C)
    rng = np.random.default_rng(7)
    truth = structured("normal", 1, (C, E)) * np.linspace(0.2, 4, E, dtype=np.float32)
    store = w(fmt.init((1, 1, 1, C, E), "k"), np.arange(C), truth)
    sealed = {n: np.asarray(store[n][0, 0, 0]).copy() for n in ("q", "scale", "cscale", "czero")}
    fresh = np.zeros(C, bool)  # overwritten since the fill, or still in the residual after it
    in_res = np.asarray(
        F._residual_slots(store["res_group"][0, 0, 0], store["res_mask"][0, 0, 0], C)
    )
    fresh[in_res[in_res < C]] = True
    used_fallback = used_channel_fit = False
    for step in range(40):
        T = int(rng.integers(1, 4))
        victims = rng.permutation(C)[:T].astype(np.int32)
        x = rng.normal(size=(T, E)).astype(np.float32) * np.linspace(0.2, 4, E, dtype=np.float32)
        if step % 3 == 0:
            x[0, rng.integers(E)] = 300.0  # outlier far outside the sealed group's range
        store = w(store, victims, x)
        truth[victims] = x
        fresh[victims] = True
        got = read_row(fmt, store)
        assert np.all(np.abs(got - truth) <= channel_bounds(fmt, store)), step
        old = ~fresh
        now = {n: np.asarray(store[n][0, 0, 0]) for n in sealed}
        np.testing.assert_array_equal(now["q"][old], sealed["q"][old])
        np.testing.assert_array_equal(now["scale"][old], sealed["scale"][old])
        grp = np.arange(C) // g
        for n in ("cscale", "czero"):
            np.testing.assert_array_equal(now[n][grp[old]], sealed[n][grp[old]])
        used_fallback |= bool((now["scale"][fresh, 0] > 0).any())
        used_channel_fit |= bool((now["scale"][fresh, 0] == 0).any())
    assert used_fallback  # outliers went to per-token codes instead of being clipped
    assert np.abs(got - truth).max() < 300 * 0.07  # and the outlier itself survived


def landed(plan, C: int, g: int) -> dict:
    """A channel plan's rows as they land in the store: rows it drops (dest C, meta_dest C // g)
    zeroed, as the plan need not compute them (it skips its codes when nothing is written)."""
    out = {k: np.asarray(v) for k, v in plan.items()}
    for keys, dest, drop in ((("q", "scale", "zero"), "dest", C),
                             (("cscale", "czero"), "meta_dest", C // g)):
        for k in keys:
            out[k] = np.where((out[dest] != drop)[..., None], out[k], 0)
    return out


@pytest.mark.parametrize("bits,g,S", [(4, 8, 1), (2, 8, 2)])
def test_channel_plan_of_all_rows_and_heads_equals_each_one_alone(bits, g, S):
    """A channel write's plan (`_channel_book`, `_working_rows`, `_channel_codes`,
    `_channel_residual`) covers
    every (row, kv head) in one pass over explicit indices; each one's plan must be what the
    same rule gives it alone (vmapped over rows and heads), through in-order chunks, scattered
    evictions, padding and outliers (B = 2, K = 3)."""
    B, K, C, E = 2, 3, 64, 16
    fmt = get_format(f"int{bits}", group=g, residual=S * g, key_mode="channel")
    store = fmt.init((1, B, K, C, E), "k")
    rng = np.random.default_rng(3)

    def plan(res, res_group, res_mask, cs, cz, slots, x):  # a write's whole plan, unconditional
        book = F._channel_book(res_group, res_mask, slots, C=C)  # flat [M, ...], as the rest
        xs = F._working_rows(book, res, x, C)
        out = {**F._channel_codes(book, xs, cs, cz, g=g, bits=bits, C=C),
               **{k: book[k] for k in ("keep", "res_mask", "entry", "seal", "flush")},
               "res": F._channel_residual(book, xs, S)}
        return {k: v.reshape(slots.shape[:-1] + v.shape[1:]) for k, v in out.items()}

    together, alone = jax.jit(plan), jax.jit(jax.vmap(jax.vmap(plan)))
    names = ("res", "res_group", "res_mask", "cscale", "czero")
    n = 0
    T = 8  # every chunk padded to T with dropped slots (C), so each program compiles once
    for step in range(12):
        t = int(rng.integers(1, T + 1))
        sl = np.full((B, K, T), C, np.int32)
        if n + t <= C and step < 6:  # in order, as a prompt is read
            sl[..., :t] = np.arange(n, n + t, dtype=np.int32)
            n += t
        else:  # a different victim set per row and head, as a policy evicts
            sl[..., :t] = rng.permuted(np.broadcast_to(np.arange(C, dtype=np.int32), (B, K, C)),
                                       axis=-1)[..., :t]
        sl[1, 2, 0] = C  # a padding token among the real ones
        x = (rng.normal(size=(B, K, T, E)) * np.linspace(0.2, 4, E)).astype(np.float32)
        if step % 3 == 0:
            x[0, 1, 0, 3] = 300.0  # an outlier
        args = [store[k][0] for k in names] + [jnp.asarray(sl), jnp.asarray(x)]
        got, want = landed(together(*args), C, g), landed(alone(*args), C, g)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        store = jwrite(fmt, store, jnp.int32(0), jnp.asarray(sl), jnp.asarray(x), "k")


def test_channel_keys_ring_buffer_reseals_fresh_groups():
    """A window (ring) policy rewrites whole groups: they are sealed fresh from the new keys,
    exactly as the block reference, with no per-token fallback."""
    C, E, g = 32, 8, 8
    fmt = get_format("int2", group=g, key_mode="channel")
    w = one_row_writer(fmt, 1)
    X = structured("normal", 5, (3 * C, E)) * 3
    store = fmt.init((1, 1, 1, C, E), "k")
    for p in range(3 * C):
        store = w(store, [p % C], X[p : p + 1])
    latest = X[2 * C :]
    ref = latest.copy()
    for j in range(C // g - 1):  # the newest group is still the residual
        ref[j * g : (j + 1) * g] = np_block_roundtrip(latest[j * g : (j + 1) * g], 2, 0)
    got = read_row(fmt, store)
    assert np.all(np.abs(got - ref) <= 2e-6 * (1 + np.abs(ref)))
    assert np.all(np.asarray(store["scale"]) == 0)


# ----------------------------------------------------------------------------- attention error


def attention(q, k, v):
    """Softmax attention of queries [Tq, E] over slots k, v [C, E]."""
    s = q @ k.T / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


# stated ceilings on max |o - o_f32| for N(0,1) q, k, v with E = 64, C = 256 (docs/formats.md)
ATTN_BOUND = {"f32": 0.0, "bf16": 5e-3, "fp8": 5e-2, "int8": 1e-2, "int4": 0.12, "int2": 0.5}


@pytest.mark.parametrize(
    "name,opts",
    [
        ("f32", {}),
        ("bf16", {}),
        ("fp8", {}),
        ("int8", {}),
        ("int4", {}),
        ("int4", {"key_mode": "token"}),
        ("int2", {}),
        ("int2", {"key_mode": "token"}),
    ],
)
def test_attention_output_error(name, opts):
    C, E, Tq = 256, 64, 16
    rng = np.random.default_rng(11)
    q, k, v = (rng.normal(size=(n, E)).astype(np.float32) for n in (Tq, C, C))
    fmt = get_format(name, **opts)
    slots = jnp.arange(C, dtype=jnp.int32)[None, None]
    ks = jwrite(fmt, fmt.init((1, 1, 1, C, E), "k"), 0, slots, k[None, None], "k")
    vs = jwrite(fmt, fmt.init((1, 1, 1, C, E), "v"), 0, slots, v[None, None], "v")
    kh = np.asarray(jread(fmt, ks, 0, "k"))[0, 0]
    vh = np.asarray(jread(fmt, vs, 0, "v"))[0, 0]
    err = np.abs(attention(q, kh, vh) - attention(q, k, v)).max()
    # analytic bound from the stored errors: |do| <= max|dv| + (e^{2 eps} - 1) max|v|,
    # eps = max over queries and slots of |q . dk| / sqrt(E)
    eps = np.abs(q @ (kh - k).T).max() / np.sqrt(E)
    analytic = np.abs(vh - v).max() + np.expm1(2 * eps) * np.abs(v).max()
    print(
        f"attention max|do| {name} {opts}: {err:.2e} "
        f"(analytic {analytic:.2e}, stated {ATTN_BOUND[name]})"
    )
    assert err <= analytic * (1 + 1e-5) + 1e-6
    assert err <= ATTN_BOUND[name], (name, opts, err)


# ----------------------------------------------------------------------------- bad input


def test_unknown_format_lists_choices():
    with pytest.raises(ValueError, match=r"'int3'.*'bf16'.*'int4'"):
        get_format("int3")
    with pytest.raises(ValueError, match=r"'group'.*\[\]|has no option"):
        get_format("int8", group=32)


@pytest.mark.parametrize(
    "opts,shape,kind,match",
    [
        ({"group": 48}, (1, 1, 1, 96, 64), "k", r"group=48 must divide the head dim E=64"),
        ({"value_group": 48}, (1, 1, 1, 96, 64), "v",
         r"value_group=48 must divide the head dim E=64"),
        ({"group": 32}, (1, 1, 1, 64, 8), "k", r"group=32 must divide the head dim E=8"),
        (
            {"group": 16, "key_mode": "channel"},
            (1, 1, 1, 40, 64),
            "k",
            r"group=16 must divide the capacity C=40.*key_mode='token'",
        ),
        (
            {"group": 16, "residual": 64, "key_mode": "channel"},
            (1, 1, 1, 32, 64),
            "k",
            r"residual=64 exceeds the capacity C=32",
        ),
    ],
)
def test_bad_options_at_init(opts, shape, kind, match):
    with pytest.raises(ValueError, match=match):
        get_format("int4", **opts).init(shape, kind)


def test_bad_options_at_construction():
    with pytest.raises(ValueError, match=r"key_mode='chan'.*\('channel', 'token'\)"):
        get_format("int4", key_mode="chan")
    with pytest.raises(ValueError, match=r"residual=20 must be a positive multiple of group=16"):
        get_format("int2", group=16, residual=20)
    with pytest.raises(ValueError, match=r"group=0"):
        get_format("int4", group=0)
    with pytest.raises(ValueError, match=r"bits=3 is not supported.*\(2, 4, 8\)"):
        F.quantize_per_token(jnp.zeros((2, 8)), 3, 8)
    with pytest.raises(ValueError, match=r"kind='q' is not one of \('k', 'v'\)"):
        get_format("f32").init((1, 1, 1, 4, 8), "q")
    with pytest.raises(ValueError, match=r"shape must be 5 positive ints"):
        get_format("int8").init((1, 4, 8), "k")
    # a 16-capacity budget still works for channel keys in token mode
    get_format("int4", group=16, key_mode="token").init((1, 1, 1, 40, 64), "k")


def test_channel_keys_beat_token_keys_on_outlier_channels():
    """Keys with a few large-magnitude channels (as in real LLMs, the KIVI observation): per-channel
    groups keep the other channels fine, per-token groups do not."""
    C, E, Tq = 256, 64, 16
    rng = np.random.default_rng(12)
    q, k, v = (rng.normal(size=(n, E)).astype(np.float32) for n in (Tq, C, C))
    k[:, [3, 17, 40]] = k[:, [3, 17, 40]] * 2 + np.float32([20.0, -15.0, 30.0])
    slots = jnp.arange(C, dtype=jnp.int32)[None, None]
    errs = {}
    for mode in ("channel", "token"):
        fmt = get_format("int4", key_mode=mode)
        ks = jwrite(fmt, fmt.init((1, 1, 1, C, E), "k"), 0, slots, k[None, None], "k")
        kh = np.asarray(jread(fmt, ks, 0, "k"))[0, 0]
        errs[mode] = (np.abs(kh - k).mean(), np.abs(attention(q, kh, v) - attention(q, k, v)).max())
    print("outlier-channel keys, int4 (mean |dk|, max |do|):", errs)
    assert errs["channel"][0] < 0.5 * errs["token"][0]
    assert errs["channel"][1] < errs["token"][1]


# ----------------------------------------------------------------------------- byte formula

FORMULA_FORMATS = [
    ("f32", {}), ("bf16", {}), ("fp8", {}), ("int8", {}), ("int4", {}), ("int2", {}),
    ("int4", {"key_mode": "token"}), ("int4", {"group": 16, "residual": 48, "value_group": 32}),
    ("int2", {"group": 8, "residual": 16}), ("int4", {"keep_layers": (0,)}),
    ("int4", {"keep_heads": (1,), "keep_dtype": "f32"}), ("fp8", {"keep_layers": (1,)}),
]


@pytest.mark.parametrize("name, opts", FORMULA_FORMATS, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", [(3, 2, 3, 192, 64), (2, 1, 2, 384, 64), (2, 3, 2, 576, 128)])
def test_bytes_formula_equals_the_allocated_store(name, opts, shape):
    """`bytes_formula` is arithmetic; the store `init` allocates is the truth (also for a slot
    pool shared by several heads, whose key residual grows)."""
    for fmt in (get_format(name, **opts), get_format(name, **opts).shared_by(3)):
        for kind in F.KINDS:
            real = F.store_nbytes(fmt.init(shape, kind))
            assert fmt.bytes_formula(*shape, kind) == real, (fmt, kind)
