"""KV storage formats: how one tensor kind (keys or values) of the cache is held in memory.

A format is a frozen, hashable dataclass (a static jit argument) with three pure functions:

* `init(shape, kind)`: the zero-initialised store, a dict of real buffers with a leading
  layer axis, for shape = (L, B, K, C, E) (how a leaf orders its axes is the format's own:
  f32 holds keys channel-major, see `F32`);
* `write(store, layer, slots, x, kind)`: encode a chunk x [B, K, T, E] into one layer at the
  policy's slots [B, K, T] (slot C = drop). It scatters only the written slots (and the small
  metadata of their groups), so the store is updated in place;
* `layers_per_write(L, B, K, T, E)`: how many layers one `write` may take at once (a block
  of n consecutive layers: `layer` [n] their indices, slots [n, B, K, T], x [n, B, K, T, E]);
  1 by default (`_LayerBatched` formats take more; the cache writes a chunk's layers block by
  block after the layer scan);
* `read(store, layer, kind, n=None)`: the dequantized slots of one layer, [B, K, C, E] float32;
  with a static n, only the first n slots ([B, K, n, E], bit-equal to the full read's), for
  any n with `fit(n) == n`: attention reads a layer only up to its occupied slots
  (`kvjax.cache.KVCache.attend`).

Formats: f32, bf16, fp8 (e4m3, per-token scale), int8 (symmetric, per token), int4 and int2
(asymmetric, groupwise, packed into uint8). Values, and keys with key_mode="token", are
quantized per token with groups along E. Keys with key_mode="channel" (the default, as in KIVI)
are quantized per channel with groups of `group` consecutive slots; see `_IntFormat` and
docs/formats.md for the rule that keeps this correct under arbitrary eviction. bf16 and fp8
codes are held as their raw bits (uint16 / uint8; see `float_bits`).

Mixed precision (kv_keep): `get_format(name, keep_layers=..., keep_heads=...)` wraps a format in
`Mixed`, which keeps those layers / kv heads in bf16 or f32 and stores only the rest quantized.

Scales and zero points are float16 (11-bit significand: a rounded zero point widens the
range far less than with bfloat16's 8 bits; KV activations stay well inside +-65504). They are
rounded in the safe direction (zero down, scale up) and the codes are computed from the
STORED values, so every bound below holds for what is actually stored:

* int8: |x - x^| <= scale / 2;   int4/int2: |x - x^| <= scale / 2 of the element's group;
* fp8: |x - x^| <= scale * max(2^-4 |x / scale|, 2^-10) (e4m3: 3 mantissa bits, subnormal
  step 2^-9);  bf16: 2^-8 relative;  f32: exact.

Each bound also allows a few float32 roundings of the dequantization arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

META_DTYPE = jnp.float16  # scales and zero points
TINY = 2.0**-24  # smallest positive float16 (subnormal): the floor of every scale
KINDS = ("k", "v")
KEY_MODES = ("channel", "token")
INT_BITS = (2, 4, 8)
FP8_MAX = 448.0  # largest finite float8_e4m3fn

FORMATS: dict[str, type[KVFormat]] = {}


def register(cls):
    """Class decorator: makes a format selectable by its `name`."""
    FORMATS[cls.name] = cls
    return cls


# ----------------------------------------------------------------------------- pure helpers


def _f16_down(v):
    """The largest float16 <= v (v float32): a zero point that never rises above the minimum."""
    h = v.astype(META_DTYPE)
    return jnp.where(h.astype(jnp.float32) > v, jnp.nextafter(h, META_DTYPE(-jnp.inf)), h)


def _f16_up(v):
    """The smallest float16 >= v (v float32): a scale that never shrinks below the step."""
    h = v.astype(META_DTYPE)
    return jnp.where(h.astype(jnp.float32) < v, jnp.nextafter(h, META_DTYPE(jnp.inf)), h)


def _check_bits(bits: int) -> None:
    if bits not in INT_BITS:
        raise ValueError(f"bits={bits} is not supported; choose one of {INT_BITS}")


def pack_bits(q, bits: int):
    """Pack codes q (uint8 [..., E], each < 2^bits) into uint8 [..., E * bits // 8].

    int4: byte i holds element 2i in the low nibble and 2i+1 in the high nibble; int2: byte i
    holds elements 4i..4i+3 from the lowest bit pair up; int8: unchanged.
    """
    _check_bits(bits)
    per = 8 // bits
    if q.shape[-1] % per:
        raise ValueError(
            f"pack_bits: last dim {q.shape[-1]} is not a multiple of {per} ({bits}-bit)"
        )
    q = q.astype(jnp.uint8)
    if per == 1:
        return q
    qr = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)  # [..., E/per, per]
    out = qr[..., 0]
    for j in range(1, per):
        out = out | (qr[..., j] << (bits * j))
    return out.astype(jnp.uint8)


def unpack_bits(p, bits: int):
    """Inverse of `pack_bits`: uint8 [..., E * bits // 8] -> codes uint8 [..., E].

    The nibbles (int4) or bit pairs (int2) of each byte are spread into the bytes of a wider
    word with shifts and masks, and the word is reinterpreted as bytes. This is 1.5-2x faster
    on CPU than shifting a broadcast [..., E/per, per] view (XLA vectorizes it poorly), and the
    read path of every int4/int2 layer runs it. Byte order: little-endian, as on every JAX
    backend (tested exactly in test_pack_bits_exact_layout).
    """
    _check_bits(bits)
    if bits == 8:
        return p
    if bits == 4:  # byte n0 | n1 << 4 -> uint16 with byte 0 = n0, byte 1 = n1
        u = p.astype(jnp.uint16)
        u = (u | (u << 4)) & jnp.uint16(0x0F0F)
    else:  # byte n0 | n1 << 2 | n2 << 4 | n3 << 6 -> uint32 with byte i = n_i
        u = p.astype(jnp.uint32)
        u = (u | (u << 12)) & jnp.uint32(0x000F000F)
        u = (u | (u << 6)) & jnp.uint32(0x03030303)
    q = jax.lax.bitcast_convert_type(u, jnp.uint8)  # [..., E*bits/8, 8/bits]
    return q.reshape(*p.shape[:-1], p.shape[-1] * (8 // bits))


def asym_params(lo, hi, bits: int):
    """Stored (float16) scale and zero point covering [lo, hi] with 2^bits - 1 steps."""
    levels = 2**bits - 1
    zero = _f16_down(lo.astype(jnp.float32))
    step = (hi.astype(jnp.float32) - zero.astype(jnp.float32)) / levels
    scale = _f16_up(jnp.maximum(step, TINY))
    return scale, zero


def asym_codes(x, scale, zero, bits: int):
    """Codes round((x - zero) / scale) clipped to [0, 2^bits - 1], from the stored params."""
    levels = 2**bits - 1
    r = jnp.round((x - zero.astype(jnp.float32)) / scale.astype(jnp.float32))
    return jnp.clip(r, 0, levels).astype(jnp.uint8)


def _check_group(E: int, bits: int, group: int) -> None:
    if group <= 0 or E % group:
        raise ValueError(f"group={group} must be a positive divisor of the head dim E={E}")
    if (E * bits) % 8:
        raise ValueError(f"head dim E={E} cannot be packed at {bits} bits (needs E*bits % 8 == 0)")


def _per_token_codes(x, bits: int, group: int):
    """Unpacked codes [..., E], scale and zero [..., E/group] of asymmetric per-token groups."""
    E = x.shape[-1]
    xg = x.astype(jnp.float32).reshape(*x.shape[:-1], E // group, group)  # [..., E/g, g]
    scale, zero = asym_params(xg.min(-1), xg.max(-1), bits)  # [..., E/g]
    q = asym_codes(xg, scale[..., None], zero[..., None], bits)  # [..., E/g, g]
    return q.reshape(x.shape), scale, zero


def quantize_per_token(x, bits: int, group: int) -> dict:
    """x [..., E] -> {"q": uint8 [..., E*bits//8], "scale", "zero": float16 [..., E//group]}.

    Asymmetric groups of `group` consecutive channels; x ~= q * scale + zero.
    """
    _check_bits(bits)
    _check_group(x.shape[-1], bits, group)
    q, scale, zero = _per_token_codes(x, bits, group)
    return {"q": pack_bits(q, bits), "scale": scale, "zero": zero}


def dequantize_per_token(d: dict, bits: int, group: int):
    """Inverse of `quantize_per_token`: float32 [..., E]."""
    q = unpack_bits(d["q"], bits)  # [..., E]
    E = q.shape[-1]
    qg = q.reshape(*q.shape[:-1], E // group, group).astype(jnp.float32)  # [..., E/g, g]
    x = qg * d["scale"][..., None].astype(jnp.float32) + d["zero"][..., None].astype(jnp.float32)
    return x.reshape(q.shape)


def quantize_int8(x) -> dict:
    """Symmetric per-token int8: {"q": int8 [..., E] in [-127, 127], "scale": f16 [..., 1]}."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)  # [..., 1]
    scale = _f16_up(jnp.maximum(amax / 127.0, TINY))
    q = jnp.clip(jnp.round(x / scale.astype(jnp.float32)), -127, 127).astype(jnp.int8)
    return {"q": q, "scale": scale}


def dequantize_int8(d: dict):
    return d["q"].astype(jnp.float32) * d["scale"].astype(jnp.float32)


def quantize_fp8(x) -> dict:
    """Per-token scaled e4m3: {"q": uint8 [..., E] (float8_e4m3fn bits), "scale": f16 [..., 1]}.

    Codes are held as their bits: XLA:CPU widens every op on an fp8 buffer to f32, so a
    scatter into a float8 store would convert the whole store (see `float_bits`)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)  # [..., 1]
    scale = _f16_up(jnp.maximum(amax / FP8_MAX, TINY))
    y = jnp.clip(x / scale.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    return {"q": float_bits(y, jnp.float8_e4m3fn), "scale": scale}


def dequantize_fp8(d: dict):
    return e4m3_to_f32(d["q"]) * d["scale"].astype(jnp.float32)


# ----------------------------------------------------------------------------- store helpers


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")


def _check_shape(shape) -> tuple[int, int, int, int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != 5 or min(shape) <= 0:
        raise ValueError(f"shape must be 5 positive ints (L, B, K, C, E), got {shape}")
    return shape


WRITE_BLOCK_BYTES = 4 << 20  # a block write's float32 working set (`_LayerBatched`)


def _layer(a, layer, n=None, axis=-2):
    """One layer's slice of a stacked store leaf (traced index), or a block's: `layer` [n]
    consecutive indices. n (static, `read`'s prefix): only the first n entries along `axis`
    (the slots, or the slot groups of per-channel key params)."""
    if jnp.ndim(layer):
        out = jax.lax.dynamic_slice_in_dim(a, layer[0], layer.shape[0], 0)
    else:
        out = jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
    return out if n is None else jax.lax.slice_in_dim(out, 0, n, axis=out.ndim + axis)


def scan_layer_blocks(f, carry, xs, n: int):
    """`carry` through `f(carry, layer, x)` over the layers, n consecutive ones at a time: each
    leaf of xs leads with [L]; `layer` is a scalar index and x one layer's slice when n == 1,
    else `layer` [n] indices and x a block [n, ...] (what a `write` of `layers_per_write`
    layers takes)."""
    L = jax.tree.leaves(xs)[0].shape[0]
    if n > 1:
        xs = jax.tree.map(lambda a: a.reshape((L // n, n) + a.shape[1:]), xs)

    def body(c, ix):
        i, x = ix
        return f(c, i * n + jnp.arange(n, dtype=jnp.int32) if n > 1 else i, x), None

    return jax.lax.scan(body, carry, (jnp.arange(L // n, dtype=jnp.int32), xs))[0]


def _set_layer(a, x, layer):
    """`a` with `_layer(a, layer)` replaced by x."""
    if jnp.ndim(layer):
        return jax.lax.dynamic_update_slice_in_dim(a, x, layer[0], 0)
    return jax.lax.dynamic_update_index_in_dim(a, x, layer, 0)


def scatter_slots(a, layer, slots, rows, by_channel: bool = False):
    """a[layer, b, k, slots[b, k, t]] = rows[b, k, t]; slot C (out of range) is dropped.
    by_channel: `a` holds each layer's slots last ([L, B, K, E, C]); rows are still
    [B, K, T, E] (the [B, K, T] indices around the E slice put T before E).
    A block of layers: `layer` [n] their indices, slots [n, B, K, T], rows [n, B, K, T, ...]."""
    lead = slots.shape[:-1]
    idx = [jnp.arange(n).reshape((n,) + (1,) * (len(lead) - i)) for i, n in enumerate(lead)]
    if jnp.ndim(layer):
        idx[0] = layer.reshape(idx[0].shape)
    else:
        idx = [layer, *idx]
    at = a.at[(*idx, slice(None), slots)] if by_channel else a.at[(*idx, slots)]
    return at.set(rows.astype(a.dtype), mode="drop")


def float_bits(x, dtype):
    """x rounded to the 1- or 2-byte float `dtype`, as its raw bits (uint16 / uint8).

    bf16 and fp8 stores hold bits, not float arrays: XLA:CPU widens every op on a bf16/fp8
    buffer to f32, so a scatter of one token into a bf16 store converted the whole stacked
    store and back (~1 s per decode step for 30 layers at 8k tokens). On the bits the scatter
    is in place and the read is a shift (`bf16_to_f32`, `e4m3_to_f32`)."""
    bits = jnp.uint16 if np.dtype(dtype).itemsize == 2 else jnp.uint8
    return jax.lax.bitcast_convert_type(x.astype(dtype), bits)


def bf16_to_f32(u):
    """bfloat16 bits (uint16) -> float32, exact: they are the top half of the f32's bits."""
    return jax.lax.bitcast_convert_type(u.astype(jnp.uint32) << 16, jnp.float32)


def e4m3_to_f32(u):
    """float8_e4m3fn bits (uint8) -> float32, exact.

    e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
    (m * 2^-9); 0x7F / 0xFF are NaN; there is no infinity.
    """
    b = u.astype(jnp.uint32)
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = jax.lax.bitcast_convert_type(sign | ((e + 120) << 23) | (m << 20), jnp.float32)
    sub = m.astype(jnp.float32) * jnp.float32(2.0**-9)
    sub = jnp.where(sign > 0, -sub, sub)
    nan = jax.lax.bitcast_convert_type(sign | jnp.uint32(0x7FC00000), jnp.float32)
    return jnp.where((b & 0x7F) == 0x7F, nan, jnp.where(e == 0, sub, normal))


def store_nbytes(store) -> int:
    """Real bytes of every leaf of a store (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(store))


# ----------------------------------------------------------------------------- pages
# The paged layout (kvjax/pages.py, kvjax/paged.py) stores keys and values token by token in
# pages; a format that can be paged gives it a `PageCodec` (`fmt.page_codec(kind)`).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantPages:
    """Integer-coded pages, leaves [..., E * bits / 8] (codes) and [..., E / g] (scale, zero).

    bits 8, no zero: int8 codes, x ~= q * scale (symmetric, one scale per token: g = E);
    bits 4 with zero: uint8 bytes holding element 2i in the low nibble and 2i+1 in the high
    one, x ~= q * scale + zero per group of g channels. Scales and zeros are float16. `bits` is
    static (pytree metadata), so the paged kernel dequantizes by it without a format name."""

    q: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    bits: int = dataclasses.field(default=8, metadata={"static": True})

    @property
    def head_dim(self) -> int:
        """Logical elements E per token."""
        return self.q.shape[-1] * 8 // self.bits


def decode_pages(store):
    """A page store (a float array or `QuantPages`) decoded to float32 [..., E]."""
    if not isinstance(store, QuantPages):
        return store.astype(jnp.float32)
    d = {"q": store.q, "scale": store.scale}
    if store.zero is None:
        return dequantize_int8(d)
    group = store.head_dim // store.scale.shape[-1]
    return dequantize_per_token({**d, "zero": store.zero}, store.bits, group)


@dataclasses.dataclass(frozen=True)
class PageCodec:
    """How a format holds keys or values in pages: `encode` x [..., E] -> a page store with
    leaves [..., X]; `zeros`, `decode` and `nbytes` follow from it. The paged layout allocates,
    writes and reads pages only through this, and the kernel reads what `encode` returns."""

    def encode(self, x):
        raise NotImplementedError

    def decode(self, store):
        return decode_pages(store)

    def zeros(self, shape):
        """A zeroed store for logical shape [..., E]."""
        spec = jax.eval_shape(self.encode, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)

    def nbytes(self, shape) -> int:
        """Bytes of a store of logical shape [..., E], without allocating."""
        return store_nbytes(jax.eval_shape(lambda: self.zeros(shape)))


@dataclasses.dataclass(frozen=True)
class FloatPages(PageCodec):
    """Pages of a float dtype (the kernel reads them directly)."""

    dtype: Any = jnp.float32

    def encode(self, x):
        return x.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Int8Pages(PageCodec):
    """Symmetric int8 per token (`quantize_int8`)."""

    def encode(self, x):
        d = quantize_int8(x)
        return QuantPages(d["q"], d["scale"], bits=8)


@dataclasses.dataclass(frozen=True)
class PackedPages(PageCodec):
    """Asymmetric per-token groups of `group` channels, packed at `bits` (`quantize_per_token`);
    a group spans whole bytes, so the kernel unpacks a token's groups independently."""

    bits: int = 4
    group: int = 32

    def __post_init__(self):
        _check_bits(self.bits)
        if self.group <= 0 or self.group * self.bits % 8:
            raise ValueError(
                f"{self.bits}-bit pages need groups of whole bytes: group={self.group} must be a "
                f"positive multiple of {8 // math.gcd(8, self.bits)}"
            )

    def encode(self, x):
        d = quantize_per_token(x, self.bits, self.group)
        return QuantPages(d["q"], d["scale"], d["zero"], bits=self.bits)


# ----------------------------------------------------------------------------- the protocol


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """Base format: how keys or values are stored (see the module docstring)."""

    name: ClassVar[str] = "base"
    # keys held channel-major (each layer's keys [B, K, E, C]): `read` gives a transposed
    # view, and attention puts the queries first in the score product (see `F32`)
    keys_by_channel: ClassVar[bool] = False

    def init(self, shape, kind: str) -> dict:
        raise NotImplementedError

    def write(self, store: dict, layer, slots, x, kind: str) -> dict:
        raise NotImplementedError

    def layers_per_write(self, L: int, B: int, K: int, T: int, E: int) -> int:
        """Layers one `write` takes at once (see the module docstring): here 1."""
        return 1

    def read(self, store: dict, layer, kind: str, n: int | None = None):
        """One layer's stored keys or values as float32 [B, K, C, E]. n (static): only the
        first n slots, [B, K, n, E], as the full read gives them, with no work on the rest
        (attention bounded by the occupied slots, `KVCache.attend`); n must satisfy
        `fit(n) == n`."""
        raise NotImplementedError

    def options(self) -> dict:
        """The name and every option with defaults resolved (nested formats too): two formats
        with equal options store identically, so a point's key uses this."""
        out = {"name": self.name}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.options() if isinstance(v, KVFormat) else v
        return out

    def bytes_formula(self, L: int, B: int, K: int, C: int, E: int, kind: str) -> int:
        """Exact bytes of the `kind` store of shape (L, B, K, C, E), by arithmetic: codes +
        scales/zero points + full-precision residual (tested equal to the allocated bytes)."""
        raise NotImplementedError

    def nbytes(self, shape) -> int:
        """Bytes of the key and value stores for `shape` (L, B, K, C, E), without allocating."""
        return sum(store_nbytes(jax.eval_shape(lambda k=k: self.init(shape, k))) for k in KINDS)

    def shared_by(self, n_heads: int) -> KVFormat:
        """This format for one slot pool shared by `n_heads` kv heads (`kvjax.cache.HeadPool`):
        state sized per head in slots (a key residual) grows n_heads-fold; else itself."""
        return self

    def fit(self, capacity: int) -> int:
        """The smallest capacity >= `capacity` this format can store (a cache sized at run time,
        e.g. after a compress-mode selection)."""
        return capacity
    def page_codec(self, kind: str) -> PageCodec | None:
        """How keys (kind "k") or values ("v") are held in pages, token by token (the paged
        layout), or None (the default): this format has no page layout."""
        return None


class _LayerBatched(KVFormat):
    """A format whose `write` takes a block of layers in its leading dims. A chunk's keys and
    values used to be written by a scan over the layers, and a per-channel int4 key write ran
    its ~100 small ops once per layer; in blocks of n layers they run L / n times
    (docs/benchmarks.md, "Writes of layers in blocks"). n is the most layers (a divisor of L)
    whose working set (chunk plus key residual, float32) stays within `WRITE_BLOCK_BYTES`: all
    of them in a decode step, fewer for a long prompt, whose working arrays would otherwise
    grow with L. The stores are bit-identical to a write per layer."""

    def _residual_rows(self) -> int:
        """Full-precision rows a key write works through besides the chunk's, per (layer, row,
        kv head)."""
        return 0

    def layers_per_write(self, L, B, K, T, E):
        per_layer = B * K * (T + self._residual_rows()) * E * 4
        return max(n for n in range(1, L + 1) if L % n == 0
                   and (n == 1 or n * per_layer <= WRITE_BLOCK_BYTES))


@dataclasses.dataclass(frozen=True)
class _FloatFormat(_LayerBatched):
    """Values stored as a float dtype, no metadata (bf16 as its uint16 bits, see `float_bits`)."""

    dtype: ClassVar = jnp.float32

    def _by_channel(self, kind) -> bool:
        return self.keys_by_channel and kind == "k"

    def init(self, shape, kind):
        _check_kind(kind)
        store_dtype = jnp.float32 if self.dtype == jnp.float32 else jnp.uint16
        L, B, K, C, E = _check_shape(shape)
        shape = (L, B, K, E, C) if self._by_channel(kind) else (L, B, K, C, E)
        return {"q": jnp.zeros(shape, store_dtype)}

    def bytes_formula(self, L, B, K, C, E, kind):
        return L * B * K * C * E * np.dtype(self.dtype).itemsize  # f32: 4, bf16 bits: 2

    def write(self, store, layer, slots, x, kind):
        with jax.named_scope("kv_format_write"):
            rows = x if self.dtype == jnp.float32 else float_bits(x, self.dtype)
            return {"q": scatter_slots(store["q"], layer, slots, rows, self._by_channel(kind))}

    def _decoded(self, q, kind):
        """Stored codes [..., C, E] ([..., E, C] by channel) -> float32 values [..., C, E]."""
        q = jnp.swapaxes(q, -1, -2) if self._by_channel(kind) else q
        return q if self.dtype == jnp.float32 else bf16_to_f32(q)

    def read(self, store, layer, kind, n=None):
        with jax.named_scope("kv_format_read"):
            q = _layer(store["q"], layer, n, -1 if self._by_channel(kind) else -2)
            return self._decoded(q, kind)  # [B, K, C, E]

    def values(self, store, kind):
        """Every layer's stored values, [L, B, K, C, E] float32 (the store is exact)."""
        return self._decoded(store["q"], kind)

    def holding(self, x, kind):
        """The store that holds x [L, B, K, C, E] (as `values` gives it back)."""
        x = jnp.swapaxes(x, -1, -2) if self._by_channel(kind) else x
        return {"q": x if self.dtype == jnp.float32 else float_bits(x, self.dtype)}

    def page_codec(self, kind):
        return FloatPages(self.dtype)


@register
@dataclasses.dataclass(frozen=True)
class F32(_FloatFormat):
    """Exact. Keys are held channel-major ([L, B, K, E, C]): a decode step's score product is
    then a vector times a matrix whose rows run along the slots, the form XLA:CPU reads at its
    best bandwidth; with keys slot-major it first copied each layer's keys out and read them
    as a skinny matrix (`python -m experiments.bench_decode_floor` measures both layouts)."""

    name = "f32"
    dtype = jnp.float32
    keys_by_channel = True


@register
@dataclasses.dataclass(frozen=True)
class BF16(_FloatFormat):
    name = "bf16"
    dtype = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class _ScaledFormat(_LayerBatched):
    """One code per element plus one float16 scale per (slot, kv head)."""

    code_dtype: ClassVar = jnp.int8

    def _encode(self, x) -> dict:
        raise NotImplementedError

    def _decode(self, d: dict):
        raise NotImplementedError

    def init(self, shape, kind):
        _check_kind(kind)
        shape = _check_shape(shape)
        return {
            "q": jnp.zeros(shape, self.code_dtype),  # [L, B, K, C, E]
            "scale": jnp.zeros(shape[:-1] + (1,), META_DTYPE),  # [L, B, K, C, 1]
        }

    def bytes_formula(self, L, B, K, C, E, kind):
        meta = np.dtype(META_DTYPE).itemsize
        return L * B * K * C * (E * np.dtype(self.code_dtype).itemsize + meta)  # codes + scale

    def write(self, store, layer, slots, x, kind):
        with jax.named_scope("kv_format_write"):
            d = self._encode(x)  # q [B, K, T, E], scale [B, K, T, 1]
            return {n: scatter_slots(store[n], layer, slots, d[n]) for n in ("q", "scale")}

    def read(self, store, layer, kind, n=None):
        with jax.named_scope("kv_format_read"):
            return self._decode({f: _layer(store[f], layer, n) for f in ("q", "scale")})


@register
@dataclasses.dataclass(frozen=True)
class FP8(_ScaledFormat):
    """float8_e4m3fn codes (stored as their uint8 bits) with a per-token scale amax / 448."""

    name = "fp8"
    code_dtype = jnp.uint8

    def _encode(self, x):
        return quantize_fp8(x)

    def _decode(self, d):
        return dequantize_fp8(d)


@register
@dataclasses.dataclass(frozen=True)
class Int8(_ScaledFormat):
    """Symmetric int8 per token per kv head: q = round(x / scale), scale = amax / 127."""

    name = "int8"
    code_dtype = jnp.int8

    def _encode(self, x):
        return quantize_int8(x)

    def _decode(self, d):
        return dequantize_int8(d)

    def page_codec(self, kind):
        return Int8Pages()


@dataclasses.dataclass(frozen=True)
class _IntFormat(_LayerBatched):
    """Asymmetric groupwise int4 / int2, packed into uint8 (KIVI-style).

    Values (and keys with key_mode="token") are quantized per token, groups of `group`
    channels along E: {"q": uint8 [L,B,K,C,E*bits//8], "scale", "zero": f16 [L,B,K,C,E//group]}.

    Keys with key_mode="channel" are quantized per channel over *slot groups* (slots
    [j*g, (j+1)*g) share one scale/zero per channel, `cscale`/`czero` [L,B,K,C//g,E]). New
    keys first enter a full-precision residual of `residual // group` open groups (`res`,
    `res_group`, `res_mask`), newest first. After each write:

    * a group all of whose g slots were written since it entered the residual is complete:
      it is sealed with fresh per-channel params from those g keys (every old key of the group
      was overwritten, so nothing is re-quantized);
    * the `residual // group` most recently written groups stay in the residual;
    * an incomplete group pushed out of the residual is flushed token by token: a key is coded
      with its group's existing per-channel params if they hold it without clipping and at
      least as accurately as per-token codes; otherwise it gets per-token codes with its own
      scale/zero in the `scale`/`zero` rows (the fallback; scale > 0 marks it).

    Old codes and params are never rewritten except by a complete re-seal, so no key is ever
    quantized twice and no outlier is silently clipped.
    """

    bits: ClassVar[int] = 4
    group: int = 32
    key_mode: str = "channel"
    residual: int | None = None  # default: one group
    value_group: int | None = None  # per-token group of the values; default: `group`

    def __post_init__(self):
        for opt in ("group", "value_group"):
            v = getattr(self, opt)
            if opt == "value_group" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{self.name}: {opt}={v!r} must be a positive int")
        if self.key_mode not in KEY_MODES:
            raise ValueError(f"{self.name}: key_mode={self.key_mode!r} is not one of {KEY_MODES}")
        r = self.residual
        if r is not None and (
            not isinstance(r, (int, np.integer)) or r < self.group or r % self.group
        ):
            raise ValueError(
                f"{self.name}: residual={r!r} must be a positive multiple of group={self.group} "
                f"(the residual holds whole open groups), e.g. {self.group} or {2 * self.group}"
            )

    @property
    def n_open(self) -> int:
        """Groups the key residual holds at once."""
        return (self.group if self.residual is None else self.residual) // self.group

    def options(self) -> dict:
        # per-token keys keep no residual (`_residual_rows`): the option changes nothing then,
        # so it reads as its default and makes no new point
        residual = self.n_open * self.group if self.channel_keys("k") else self.group
        return {**super().options(), "residual": residual, "value_group": self.group_of("v")}

    def channel_keys(self, kind: str) -> bool:
        return kind == "k" and self.key_mode == "channel"

    def _residual_rows(self) -> int:
        return self.n_open * self.group if self.channel_keys("k") else 0

    def shared_by(self, n_heads: int) -> KVFormat:
        """Every head keeps its residual of recent full-precision keys inside the pool."""
        if self.key_mode != "channel":
            return self
        return dataclasses.replace(self, residual=n_heads * self.n_open * self.group)

    def fit(self, capacity: int) -> int:
        """Per-channel keys run in slot groups and keep a residual: whole groups, >= residual."""
        if self.key_mode != "channel":
            return capacity
        return max(-(-capacity // self.group) * self.group, self.n_open * self.group)

    def group_of(self, kind: str) -> int:
        """The per-token group size of keys or values."""
        return self.value_group if kind == "v" and self.value_group is not None else self.group

    def init(self, shape, kind):
        _check_kind(kind)
        L, B, K, C, E = _check_shape(shape)
        g, bits = self.group_of(kind), self.bits
        if E % g:
            opt = "value_group" if g != self.group else "group"
            raise ValueError(
                f"{self.name}: {opt}={g} must divide the head dim E={E} (per-token groups run "
                f"along E); use one of {[d for d in range(1, E + 1) if E % d == 0]}"
            )
        _check_group(E, bits, g)
        store = {
            "q": jnp.zeros((L, B, K, C, E * bits // 8), jnp.uint8),  # [L, B, K, C, E*bits/8]
            "scale": jnp.zeros((L, B, K, C, E // g), META_DTYPE),  # [L, B, K, C, E/g]
            "zero": jnp.zeros((L, B, K, C, E // g), META_DTYPE),  # [L, B, K, C, E/g]
        }
        if not self.channel_keys(kind):
            return store
        R = self.n_open * g
        if C % g:
            raise ValueError(
                f"{self.name} key_mode='channel': group={g} must divide the capacity C={C} "
                f"(key groups run along slots): the capacity is a fixed-budget cache's budget, "
                "max_len for the full cache and in compress mode, and each layer group's own "
                f"with per-layer budgets; make it a multiple of {g}, or use key_mode='token'"
            )
        if R > C:
            raise ValueError(
                f"{self.name}: residual={R} exceeds the capacity C={C}; use residual <= {C}"
            )
        S = self.n_open
        store.update(
            cscale=jnp.zeros((L, B, K, C // g, E), META_DTYPE),  # [L, B, K, C/g, E]
            czero=jnp.zeros((L, B, K, C // g, E), META_DTYPE),  # [L, B, K, C/g, E]
            res=jnp.zeros((L, B, K, S, g, E), jnp.float32),  # [L, B, K, S, g, E]
            res_group=jnp.full((L, B, K, S), -1, jnp.int32),  # [L, B, K, S]
            res_mask=jnp.zeros((L, B, K, S, g), bool),  # [L, B, K, S, g]
        )
        return store

    def bytes_formula(self, L, B, K, C, E, kind):
        """Packed codes (E·bits/8 per slot) + per-token scale and zero (E/g each); per-channel
        keys add a scale and zero per channel per slot group (C/g · E each), the float32
        residual of S = residual/g open groups, its group ids (int32) and slot mask (bool)."""
        g, meta, N = self.group_of(kind), np.dtype(META_DTYPE).itemsize, L * B * K
        total = N * C * (E * self.bits // 8 + 2 * (E // g) * meta)
        if self.channel_keys(kind):
            S = self.n_open
            total += N * (2 * (C // g) * E * meta + S * g * E * 4 + S * 4 + S * g)
        return total

    def write(self, store, layer, slots, x, kind):
        with jax.named_scope("kv_format_write"):
            if self.channel_keys(kind):
                return self._write_channel(store, layer, slots, x)
            d = quantize_per_token(x, self.bits, self.group_of(kind))  # [B, K, T, ...]
            return {n: scatter_slots(store[n], layer, slots, d[n]) for n in ("q", "scale", "zero")}

    def read(self, store, layer, kind, n=None):
        with jax.named_scope("kv_format_read"):
            g = self.group_of(kind)
            q = unpack_bits(_layer(store["q"], layer, n), self.bits).astype(jnp.float32)
            B, K, C, E = q.shape  # q: [B, K, C, E] codes (C = n for a prefix)
            scale = _layer(store["scale"], layer, n)  # [B, K, C, E/g]
            tok = (
                q.reshape(B, K, C, E // g, g) * scale[..., None].astype(jnp.float32)
                + _layer(store["zero"], layer, n)[..., None].astype(jnp.float32)
            ).reshape(B, K, C, E)
            if not self.channel_keys(kind):
                return tok
            # one fused pass: per-channel params broadcast over their slot group (no repeat),
            # the per-token fallback where the slot's own scale is set, then the residual
            ng = None if n is None else n // g  # a prefix of whole slot groups (`fit`)
            cs = _layer(store["cscale"], layer, ng)[:, :, :, None, :].astype(jnp.float32)
            cz = _layer(store["czero"], layer, ng)[:, :, :, None, :].astype(jnp.float32)
            chan = q.reshape(B, K, C // g, g, E) * cs + cz  # [B, K, C/g, g, E]
            tok = tok.reshape(chan.shape)
            out = jnp.where(scale.reshape(B, K, C // g, g, -1)[..., :1] > 0, tok, chan)
            # then the residual's keys over their slots
            res = _layer(store["res"], layer)  # [B, K, S, g, E]
            res_group = _layer(store["res_group"], layer)  # [B, K, S]
            res_mask = _layer(store["res_mask"], layer)  # [B, K, S, g]
            S = res.shape[2]
            if S == 1:  # one open group: a select, so the whole read stays one fusion
                at = (jnp.arange(C // g) == res_group)[..., None] & res_mask  # [B, K, C/g, g]
                return jnp.where(at[..., None], res, out).reshape(B, K, C, E)
            # more: a scatter (a select per open group took ~2 ms longer per decode step with two
            # open groups in a scratch A/B)
            rs = _residual_slots(res_group, res_mask, C)  # [B, K, S*g]; past a prefix: dropped
            b = jnp.arange(B)[:, None, None]
            h = jnp.arange(K)[None, :, None]
            return out.reshape(B, K, C, E).at[b, h, rs].set(res.reshape(B, K, S * g, E),
                                                             mode="drop")

    def _write_channel(self, store, layer, slots, x):
        """Per-channel keys: plan every (row, head) with `_channel_book`; only when an entry
        leaves the residual are its codes computed (`_channel_codes` in a `lax.cond`: most
        decode steps of a policy that fills slots in order code nothing), then scattered.
        With one open group the kept residual rows stay where they are, so only the chunk's
        rows are written into it; with more, entries move (newest first) and the residual is
        rebuilt."""
        C = store["q"].shape[-2]
        S, g, E = store["res"].shape[-3:]
        x = x.astype(jnp.float32)  # [B, K, T, E]
        res = _layer(store["res"], layer)  # [B, K, S, g, E]
        cs, cz = _layer(store["cscale"], layer), _layer(store["czero"], layer)  # [B, K, NG, E]
        book = _channel_book(
            _layer(store["res_group"], layer),  # [B, K, S]
            _layer(store["res_mask"], layer),  # [B, K, S, g]
            slots,  # [B, K, T]
            C=C,
        )
        # one open group: the working set is needed only to code (inside the cond); with
        # more, the rebuilt residual needs it too
        xs = None if S == 1 else _working_rows(book, res, x, C)  # [M, N, E]

        def codes():
            rows = _working_rows(book, res, x, C) if xs is None else xs
            return _channel_codes(book, rows, cs, cz, g=g, bits=self.bits, C=C)

        def unflat(a):  # the plan's flat [M, ...] -> the store's leading dims, e.g. [B, K, ...]
            return a.reshape(slots.shape[:-1] + a.shape[1:])

        rows = jax.lax.cond(book["any_coded"], codes,
                            lambda: _no_codes(*book["slot"].shape, E, g, self.bits, C))
        rows = {n: unflat(a) for n, a in rows.items()}
        out = dict(store)
        for n in ("q", "scale", "zero"):
            out[n] = scatter_slots(store[n], layer, rows["dest"], rows[n])
        for n in ("cscale", "czero"):  # group NG (not sealed now) is dropped
            out[n] = scatter_slots(store[n], layer, rows["meta_dest"], rows[n])
        if S == 1:  # kept rows in place: the chunk's rows go to (entry 0, slot % g)
            new = jnp.where(book["entry"][:, g:] == 0, book["slot"][:, g:] % g, g)  # [M, T]
            flat = store["res"].reshape(store["res"].shape[:3] + (g, E))  # [L, B, K, g, E]
            out["res"] = scatter_slots(flat, layer, unflat(new), x).reshape(store["res"].shape)
        else:
            out["res"] = _set_layer(store["res"], unflat(_channel_residual(book, xs, S)), layer)
        out["res_group"] = _set_layer(store["res_group"], unflat(book["keep"]), layer)
        out["res_mask"] = _set_layer(store["res_mask"], unflat(book["res_mask"]), layer)
        return out


def _residual_slots(res_group, res_mask, C: int):
    """Slots held by the residual: [..., S] groups, [..., S, g] mask -> [..., S*g] (C = none)."""
    g = res_mask.shape[-1]
    s = res_group[..., None] * g + jnp.arange(g)  # [..., S, g]
    s = jnp.where(res_mask & (res_group[..., None] >= 0), s, C)
    return s.reshape(*s.shape[:-2], -1)


def _flat(a, k: int):
    """a with its leading dims before the last k flattened to one [M]."""
    return a.reshape((-1,) + a.shape[a.ndim - k:])


def _channel_book(res_group, res_mask, slots, *, C: int):
    """Which residual entries and chunk rows stay, are sealed or are flushed by a per-channel key
    write of every (row, kv head) at once; see `_IntFormat` for the rule.

    Leading dims [...] (e.g. [B, K], or none): res_group [..., S], res_mask [..., S, g] (the
    residual, entry 0 newest); slots [..., T]. The working set is N = S*g + T rows: the
    residual's, then the chunk's. Returns, flat over the leading dims [M]: slot [M, N] (C =
    none), gid (its slot group; NG = none), seal, flush [M, N], entry [M, N] (its residual
    entry after the write; S = not kept), keep [M, S] (the new res_group), res_mask [M, S, g],
    and any_coded (whether any row is sealed or flushed; a scalar over all). The whole plan
    (`_working_rows`, `_channel_codes`, `_channel_residual`) works over that flat [M] with
    explicit indices rather than under two `vmap`s: the same ops, traced without the batching
    rules (docs/benchmarks.md); the write puts the leading dims back."""
    S, g = res_mask.shape[-2:]
    T = slots.shape[-1]
    NG = C // g
    res_group, res_mask, slots = _flat(res_group, 1), _flat(res_mask, 2), _flat(slots, 1)
    M = slots.shape[0]
    m = jnp.arange(M)[:, None]  # [M, 1]
    new_ok = (slots >= 0) & (slots < C)
    new_slot = jnp.where(new_ok, slots, C)  # [M, T]
    hit = jnp.zeros((M, C + 1), bool).at[m, new_slot].set(True)  # [M, C+1] slots overwritten
    old_slot = _residual_slots(res_group, res_mask, C)  # [M, S*g]
    old_slot = jnp.where(jnp.take_along_axis(hit, old_slot, axis=1), C, old_slot)
    slot = jnp.concatenate([old_slot, new_slot], axis=1)  # [M, N]
    stamp = jnp.concatenate([jnp.repeat(S - jnp.arange(S), g), S + 1 + jnp.arange(T)])  # [N]
    valid = slot < C
    gid = jnp.where(valid, slot // g, NG)  # [M, N]; NG collects the invalid rows
    # group states: complete (all g slots written since it entered), recency
    count = jnp.zeros((M, NG + 1), jnp.int32).at[m, gid].add(valid.astype(jnp.int32))
    touched = (count > 0).at[:, NG].set(False)  # [M, NG+1]
    complete = (count == g).at[:, NG].set(False)
    recency = jnp.zeros((M, NG + 1), stamp.dtype).at[m, gid].max(jnp.where(valid, stamp, 0))
    top, keep = jax.lax.top_k(jnp.where(touched, recency, 0), S)  # [M, S] newest first
    keep = jnp.where(top > 0, keep, -1).astype(jnp.int32)
    match = gid[:, :, None] == keep[:, None, :]  # [M, N, S]
    stay = valid & match.any(-1)
    done = jnp.take_along_axis(complete, gid, axis=1)  # [M, N]
    seal = valid & done & ~stay
    flush = valid & ~done & ~stay
    entry = jnp.where(stay, jnp.argmax(match, axis=-1), S)  # [M, N]; S = not kept
    new_mask = jnp.zeros((M, S, g), bool).at[m, entry, slot % g].set(True, mode="drop")
    return {"slot": slot, "gid": gid, "seal": seal, "flush": flush, "entry": entry,
            "keep": keep, "res_mask": new_mask, "any_coded": jnp.any(seal | flush)}


def _working_rows(book, res, x, C: int):
    """The working set's keys, flat [M, N, E] over the leading dims: the residual's rows (res
    [..., S, g, E]), then the chunk's (x [..., T, E], zero where not stored). Flat, as
    `_channel_codes` takes and gives its rows: in the lead dims XLA gave a conditional's
    outputs transposed layouts, and an evicting step's coding ran ~0.7 ms longer
    (`python -m experiments.profile_step`, docs/benchmarks.md)."""
    S, g, E = res.shape[-3:]
    x = _flat(x, 2)
    x = jnp.where((book["slot"][:, S * g:] < C)[..., None], x, 0.0)
    return jnp.concatenate([_flat(res, 3).reshape(x.shape[0], S * g, E), x], axis=1)


def _channel_codes(book, xs, cs, cz, *, g: int, bits: int, C: int):
    """Codes and params of the rows `book` (`_channel_book`) seals or flushes: xs [M, N, E]
    the working set (`_working_rows`), cs, cz [..., NG, E] the stored per-channel params.
    Returns, flat over the leading dims: dest [M, N] (slot; C = dropped), packed codes q,
    per-token fallback params scale, zero [M, N, E/g], meta_dest [M, N] (the group sealed; NG
    = dropped) and its fresh params cscale, czero [M, N, E]. Most of a per-channel key write's
    time when it runs (docs/benchmarks.md)."""
    M, _, E = xs.shape
    NG = C // g
    cs, cz = _flat(cs, 2), _flat(cz, 2)  # [M, NG, E]
    gid, seal, flush, slot = (book[n] for n in ("gid", "seal", "flush", "slot"))
    m = jnp.arange(M)[:, None]  # [M, 1]

    def at_group(a, idx):  # a [M, NG+1, ...] at idx [M, N] -> [M, N, ...]
        return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)

    # fresh per-channel params for groups sealed now
    sealed = seal[..., None]  # [M, N, 1]
    lo = at_group(jnp.full((M, NG + 1, E), jnp.inf).at[m, gid].min(
        jnp.where(sealed, xs, jnp.inf)), gid)  # [M, N, E]
    hi = at_group(jnp.full((M, NG + 1, E), -jnp.inf).at[m, gid].max(
        jnp.where(sealed, xs, -jnp.inf)), gid)
    new_cs, new_cz = asym_params(jnp.where(sealed, lo, 0.0), jnp.where(sealed, hi, 0.0), bits)
    pad = jnp.zeros((M, 1, E), META_DTYPE)
    ch_cs = jnp.where(sealed, new_cs, at_group(jnp.concatenate([cs, pad], axis=1), gid))
    ch_cz = jnp.where(sealed, new_cz, at_group(jnp.concatenate([cz, pad], axis=1), gid))
    # channel codes (fresh params, or the group's existing ones for flushed keys)
    levels = 2**bits - 1
    has = jnp.all(ch_cs > 0, axis=-1)  # [M, N] the group has params
    r = jnp.round(
        (xs - ch_cz.astype(jnp.float32)) / jnp.where(ch_cs > 0, ch_cs, 1).astype(jnp.float32)
    )
    fits = has & jnp.all((r >= 0) & (r <= levels), axis=-1)  # [M, N] no clipping
    ch_q = jnp.clip(r, 0, levels).astype(jnp.uint8)  # [M, N, E]
    ch_x = ch_q * ch_cs.astype(jnp.float32) + ch_cz.astype(jnp.float32)  # [M, N, E]
    ch_err = jnp.max(jnp.abs(ch_x - xs), -1)  # [M, N]
    # per-token fallback codes
    tq, ts, tz = _per_token_codes(xs, bits, g)  # [M, N, E], [M, N, E/g], [M, N, E/g]
    tq_g = tq.reshape(*tq.shape[:-1], E // g, g).astype(jnp.float32)  # [M, N, E/g, g]
    tok_x = tq_g * ts[..., None].astype(jnp.float32) + tz[..., None].astype(jnp.float32)
    tok_err = jnp.max(jnp.abs(tok_x.reshape(xs.shape) - xs), -1)  # [M, N]
    use_ch = seal | (flush & fits & (ch_err <= tok_err))  # [M, N]
    codes = jnp.where(use_ch[..., None], ch_q, tq)  # [M, N, E]
    out = {
        "dest": jnp.where(seal | flush, slot, C).astype(jnp.int32),  # [M, N]
        "q": pack_bits(codes, bits),  # [M, N, E*bits/8]
        "scale": jnp.where(use_ch[..., None], jnp.zeros_like(ts), ts),  # [M, N, E/g]
        "zero": jnp.where(use_ch[..., None], jnp.zeros_like(tz), tz),  # [M, N, E/g]
        "meta_dest": jnp.where(seal, gid, NG).astype(jnp.int32),  # [M, N]
        "cscale": new_cs,  # [M, N, E]
        "czero": new_cz,  # [M, N, E]
    }
    return out


def _no_codes(M: int, N: int, E: int, g: int, bits: int, C: int):
    """`_channel_codes`'s rows when no entry leaves the residual (a decode step into the open
    group): every row dropped, nothing computed."""
    shape = (M, N)
    return {
        "dest": jnp.full(shape, C, jnp.int32),
        "q": jnp.zeros(shape + (E * bits // 8,), jnp.uint8),
        "scale": jnp.zeros(shape + (E // g,), META_DTYPE),
        "zero": jnp.zeros(shape + (E // g,), META_DTYPE),
        "meta_dest": jnp.full(shape, C // g, jnp.int32),
        "cscale": jnp.zeros(shape + (E,), META_DTYPE),
        "czero": jnp.zeros(shape + (E,), META_DTYPE),
    }


def _channel_residual(book, xs, S: int):
    """The new residual [M, S, g, E] from the working set xs [M, N, E] (`_working_rows`):
    kept rows at their new entries, newest group first; the rest zero."""
    M, _, E = xs.shape
    g = book["res_mask"].shape[-1]
    m = jnp.arange(M)[:, None]
    return jnp.zeros((M, S, g, E), jnp.float32).at[m, book["entry"], book["slot"] % g].set(
        xs, mode="drop")


@register
@dataclasses.dataclass(frozen=True)
class Int4(_IntFormat):
    """int4 defaults (measured, docs/formats.md "Choosing the defaults"): KIVI per-channel keys
    in slot groups of 64 with a 64-token residual, per-token values in groups of 64. Decoding
    token by token on the default model that is +1.0 % perplexity at 0.328x of bf16 (2048
    tokens). Per-token keys reach 0.297x but cost +6.5 %: no int4 layout here meets both the
    issue's 0.30x and 2 %, and the default keeps the quality target."""

    name = "int4"
    bits = 4
    group: int = 64

    def page_codec(self, kind):
        """Per-token groups (`group`, values `value_group`) packed two codes per byte. The paged
        kernel reads whole tokens, so per-channel keys (key_mode="channel") have no pages."""
        _check_kind(kind)
        if self.channel_keys(kind):
            raise ValueError(
                "kv format int4 with key_mode='channel' (per-channel KIVI keys) does not fit "
                "pages: the paged kernel reads whole tokens, so paged int4 quantizes keys per "
                "token; pass key_mode='token' (run.py: +kv_options.key_mode=token) or use "
                "layout='dense'"
            )
        return PackedPages(self.bits, self.group_of(kind))


@register
@dataclasses.dataclass(frozen=True)
class Int2(_IntFormat):
    """int2 defaults: KIVI per-channel keys (group 32, residual 32) and per-token values (group
    32), 0.234x of bf16. int2 is far from usable on the 135M default model (+52 % perplexity
    token by token; per-token keys are worse still), see docs/formats.md."""

    name = "int2"
    bits = 2


KEEP_DTYPES = ("f32", "bf16")
KEEP_OPTIONS = ("keep_layers", "keep_heads", "keep_units", "keep_dtype")


def _index_tuple(what: str, value) -> tuple[int, ...]:
    """A sorted tuple of distinct non-negative ints (lists and a single int are accepted)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(f"kv_keep: {what}={value!r} must be a tuple of indices") from None
    bad = [v for v in items if isinstance(v, bool) or not isinstance(v, (int, np.integer))
           or v < 0]
    if bad:
        raise ValueError(f"kv_keep: {what}={items!r} holds {bad}, which are not non-negative "
                         "integer indices")
    if len(set(items)) != len(items):
        raise ValueError(f"kv_keep: {what}={items!r} repeats an index")
    return tuple(sorted(int(v) for v in items))


def _check_keep(base, keep_dtype: str) -> None:
    """A kv_keep wrapper's base is one plain format and its kept units a float dtype."""
    if not isinstance(base, KVFormat) or isinstance(base, (Mixed, MixedUnits)):
        raise TypeError(f"kv_keep: base={base!r} must be a (non-mixed) KVFormat, "
                        "e.g. get_format('int4')")
    if keep_dtype not in KEEP_DTYPES:
        raise ValueError(f"kv_keep: keep_dtype={keep_dtype!r} is not one of {KEEP_DTYPES}")


@dataclasses.dataclass(frozen=True)
class Mixed(KVFormat):
    """Mixed precision (`kv_keep`): chosen layers and kv heads stay full precision, the rest
    use `base`.

    A (layer, head) is kept when its layer is in `keep_layers` or its head in `keep_heads`.
    The store holds real buffers only for what each part needs (leaves [rows, B, heads, C, ...]):

    * "layers": `keep_dtype` store of the kept layers, [len(keep_layers), B, K, C, E];
    * "heads": `keep_dtype` store of the kept heads in the other layers, [Lq, B, Kk, C, E];
    * "base": the base format's store of the rest, [Lq, B, K - Kk, ...].

    The traced layer index is routed through static layer -> row tables. A kept layer reads
    and writes only "layers" (`lax.cond`, so the other branch does no work); the other layers
    read "base" and "heads" and join the heads back in their order. Nothing is read at full
    size twice, and no quantized buffer exists for kept layers or heads.
    """

    name: ClassVar[str] = "mixed"
    base: KVFormat = None
    keep_layers: tuple[int, ...] = ()
    keep_heads: tuple[int, ...] = ()
    keep_dtype: str = "bf16"

    def __post_init__(self):
        _check_keep(self.base, self.keep_dtype)
        object.__setattr__(self, "keep_layers", _index_tuple("keep_layers", self.keep_layers))
        object.__setattr__(self, "keep_heads", _index_tuple("keep_heads", self.keep_heads))
        if not self.keep_layers and not self.keep_heads:
            raise ValueError("kv_keep: give keep_layers and/or keep_heads (both are empty); "
                             f"without them use the base format {self.base.name!r} itself")

    @property
    def keep(self) -> KVFormat:
        return FORMATS[self.keep_dtype]()

    def shared_by(self, n_heads: int) -> KVFormat:
        return dataclasses.replace(self, base=self.base.shared_by(n_heads))

    def fit(self, capacity: int) -> int:
        return self.base.fit(capacity)

    def layout(self, L: int, K: int):
        """(kept layers, quantized layers, kept heads, quantized heads) for L layers, K heads."""
        for what, idx, n, unit in (("keep_layers", self.keep_layers, L, "layers"),
                                   ("keep_heads", self.keep_heads, K, "kv heads")):
            bad = [i for i in idx if i >= n]
            if bad:
                raise ValueError(
                    f"kv_keep: {what}={idx} has {bad} outside the model's {n} {unit}; valid "
                    f"indices are 0..{n - 1}"
                )
        kl = self.keep_layers
        kh = self.keep_heads
        return (kl, tuple(i for i in range(L) if i not in kl),
                kh, tuple(h for h in range(K) if h not in kh))

    def init(self, shape, kind):
        _check_kind(kind)
        L, B, K, C, E = _check_shape(shape)
        kl, ql, kh, qh = self.layout(L, K)
        store = {}
        if kl:
            store["layers"] = self.keep.init((len(kl), B, K, C, E), kind)
        if ql and kh:
            store["heads"] = self.keep.init((len(ql), B, len(kh), C, E), kind)
        if ql and qh:
            store["base"] = self.base.init((len(ql), B, len(qh), C, E), kind)
        return store

    def bytes_formula(self, L, B, K, C, E, kind):
        """The parts `init` allocates: kept layers, kept heads of the other layers, the rest."""
        kl, ql, kh, qh = self.layout(L, K)
        keep = self.keep
        return ((keep.bytes_formula(len(kl), B, K, C, E, kind) if kl else 0)
                + (keep.bytes_formula(len(ql), B, len(kh), C, E, kind) if ql and kh else 0)
                + (self.base.bytes_formula(len(ql), B, len(qh), C, E, kind) if ql and qh else 0))

    def _route(self, store, layer):
        """(kept?, row in "layers" or in "heads"/"base") of a traced layer index."""
        rest = [jax.tree.leaves(store[n])[0].shape[0] for n in ("heads", "base") if n in store]
        L = len(self.keep_layers) + (rest[0] if rest else 0)
        kept = np.zeros(L, bool)
        kept[list(self.keep_layers)] = True
        row = np.zeros(L, np.int32)
        row[kept] = np.arange(kept.sum())
        row[~kept] = np.arange((~kept).sum())
        return jnp.asarray(kept)[layer], jnp.asarray(row)[layer]

    def _heads(self, store) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(K, kept heads, quantized heads) from the store's shapes."""
        if "layers" in store:
            K = store["layers"]["q"].shape[2]
        else:
            K = len(self.keep_heads) + (
                jax.tree.leaves(store["base"])[0].shape[2] if "base" in store else 0)
        kh = self.keep_heads
        return K, kh, tuple(h for h in range(K) if h not in kh)

    def read(self, store, layer, kind, n=None):
        with jax.named_scope("kv_format_read"):
            kept, row = self._route(store, layer)
            K, kh, qh = self._heads(store)

            def read_layers():
                return self.keep.read(store["layers"], row, kind, n)  # [B, K, C, E]

            def read_rest():
                parts = {}
                if "base" in store:
                    xb = self.base.read(store["base"], row, kind, n)  # [B, Kq, C, E]
                    parts.update({h: xb[:, i:i + 1] for i, h in enumerate(qh)})
                if "heads" in store:
                    xh = self.keep.read(store["heads"], row, kind, n)  # [B, Kk, C, E]
                    parts.update({h: xh[:, i:i + 1] for i, h in enumerate(kh)})
                return jnp.concatenate([parts[h] for h in range(K)], axis=1)  # [B, K, C, E]

            if "layers" not in store:
                return read_rest()
            if "heads" not in store and "base" not in store:
                return read_layers()
            return jax.lax.cond(kept, read_layers, read_rest)

    def write(self, store, layer, slots, x, kind):
        with jax.named_scope("kv_format_write"):
            kept, row = self._route(store, layer)
            _, kh, qh = self._heads(store)
            out = dict(store)
            # float parts: a row past the end is dropped by the scatter, so no branch is needed
            if "layers" in store:
                n = store["layers"]["q"].shape[0]
                out["layers"] = self.keep.write(
                    store["layers"], jnp.where(kept, row, n), slots, x, kind)
            if "heads" in store:
                n = store["heads"]["q"].shape[0]
                out["heads"] = self.keep.write(
                    store["heads"], jnp.where(kept, n, row), slots[:, list(kh)],
                    x[:, list(kh)], kind)
            if "base" in store:
                qs, qx = slots[:, list(qh)], x[:, list(qh)]  # [B, Kq, T], [B, Kq, T, E]

                def write_base(b):
                    return self.base.write(b, row, qs, qx, kind)

                out["base"] = (write_base(store["base"]) if "layers" not in store else
                               jax.lax.cond(kept, lambda b: b, write_base, store["base"]))
            return out


def _unit_tuple(value) -> tuple[tuple[int, int], ...]:
    """keep_units as a sorted tuple of distinct (layer, kv head) pairs of non-negative ints."""
    try:
        items = tuple(tuple(u) for u in value)
    except TypeError:
        raise ValueError(f"kv_keep: keep_units={value!r} must be (layer, kv head) pairs, "
                         "e.g. ((0, 1), (5, 2))") from None
    bad = [u for u in items if len(u) != 2 or any(
        isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in u)]
    if bad:
        raise ValueError(f"kv_keep: keep_units holds {bad}, which are not (layer, kv head) "
                         "pairs of non-negative integers")
    units = tuple(sorted((int(a), int(b)) for a, b in items))
    if len(set(units)) != len(units):
        raise ValueError(f"kv_keep: keep_units={units!r} repeats a unit")
    return units


@dataclasses.dataclass(frozen=True)
class MixedUnits(KVFormat):
    """Mixed precision by (layer, kv head) unit (`kv_keep` with `keep_units`): the listed units
    stay `keep_dtype`, every other one uses `base`.

    Per kv head h the store holds two real buffers (leaves [rows, B, 1, C, ...]): "keep{h}",
    the `keep_dtype` store of the layers whose unit (layer, h) is kept, and "base{h}", the base
    format's store of the other layers. Kept units have no quantized buffer, so the bytes are
    real. A traced layer index is routed per head through static layer -> row tables; reads
    pick one part per head (`lax.cond`), writes drop the float scatter for quantized units (a
    row past the end) and skip the base write for kept ones (`lax.cond`). Formats quantize
    each (layer, head) on its own, so a quantized unit stores exactly what `base` would.
    """

    name: ClassVar[str] = "mixed_units"
    base: KVFormat = None
    keep_units: tuple[tuple[int, int], ...] = ()
    keep_dtype: str = "bf16"

    def __post_init__(self):
        _check_keep(self.base, self.keep_dtype)
        object.__setattr__(self, "keep_units", _unit_tuple(self.keep_units))
        if not self.keep_units:
            raise ValueError("kv_keep: keep_units is empty; without kept units use the base "
                             f"format {self.base.name!r} itself")

    @property
    def keep(self) -> KVFormat:
        return FORMATS[self.keep_dtype]()

    def fit(self, capacity: int) -> int:
        return self.base.fit(capacity)

    def kept_layers(self, L: int, K: int) -> list[tuple[int, ...]]:
        """Per kv head, the layers whose unit is kept (checked against L layers, K heads)."""
        bad = [u for u in self.keep_units if u[0] >= L or u[1] >= K]
        if bad:
            raise ValueError(f"kv_keep: keep_units has {bad} outside the model's {L} layers x "
                             f"{K} kv heads; valid units are (0..{L - 1}, 0..{K - 1})")
        return [tuple(layer for layer, h in self.keep_units if h == head) for head in range(K)]

    def init(self, shape, kind):
        _check_kind(kind)
        L, B, K, C, E = _check_shape(shape)
        store = {}
        for h, kept in enumerate(self.kept_layers(L, K)):
            if kept:
                store[f"keep{h}"] = self.keep.init((len(kept), B, 1, C, E), kind)
            if len(kept) < L:
                store[f"base{h}"] = self.base.init((L - len(kept), B, 1, C, E), kind)
        return store

    def bytes_formula(self, L, B, K, C, E, kind):
        return sum((self.keep.bytes_formula(len(kept), B, 1, C, E, kind) if kept else 0)
                   + (self.base.bytes_formula(L - len(kept), B, 1, C, E, kind)
                      if len(kept) < L else 0)
                   for kept in self.kept_layers(L, K))

    def _routes(self, store, layer):
        """Per head: (kept?, row in its "keep" or "base" part) of a traced layer index."""
        K = len({n[4:] for n in store})
        h0 = [jax.tree.leaves(store[n])[0].shape[0] for n in (f"keep{0}", f"base{0}")
              if n in store]
        L = sum(h0)
        out = []
        for kept_layers in self.kept_layers(L, K):
            kept = np.zeros(L, bool)
            kept[list(kept_layers)] = True
            row = np.zeros(L, np.int32)
            row[kept] = np.arange(kept.sum())
            row[~kept] = np.arange((~kept).sum())
            out.append((jnp.asarray(kept)[layer], jnp.asarray(row)[layer]))
        return out

    def read(self, store, layer, kind, n=None):
        with jax.named_scope("kv_format_read"):
            parts = []
            for h, (kept, row) in enumerate(self._routes(store, layer)):
                k, b = store.get(f"keep{h}"), store.get(f"base{h}")
                if b is None:
                    parts.append(self.keep.read(k, row, kind, n))  # [B, 1, C, E]
                elif k is None:
                    parts.append(self.base.read(b, row, kind, n))
                else:
                    parts.append(jax.lax.cond(
                        kept, lambda k=k, r=row: self.keep.read(k, r, kind, n),
                        lambda b=b, r=row: self.base.read(b, r, kind, n)))
            return jnp.concatenate(parts, axis=1)  # [B, K, C, E]

    def write(self, store, layer, slots, x, kind):
        with jax.named_scope("kv_format_write"):
            out = dict(store)
            for h, (kept, row) in enumerate(self._routes(store, layer)):
                sh, xh = slots[:, h:h + 1], x[:, h:h + 1]  # [B, 1, T], [B, 1, T, E]
                k, b = store.get(f"keep{h}"), store.get(f"base{h}")
                if k is not None:  # a row past the end is dropped by the float scatter
                    n = jax.tree.leaves(k)[0].shape[0]
                    out[f"keep{h}"] = self.keep.write(k, jnp.where(kept, row, n), sh, xh, kind)
                if b is not None:
                    def write_base(s, row=row, sh=sh, xh=xh):
                        return self.base.write(s, row, sh, xh, kind)

                    out[f"base{h}"] = (write_base(b) if k is None else
                                       jax.lax.cond(kept, lambda s: s, write_base, b))
            return out


def get_format(name: str, **options) -> KVFormat:
    """The format called `name` with its options (e.g. get_format("int4", group=64)).

    `keep_layers`, `keep_heads` (tuples of indices) and `keep_dtype` ("bf16" or "f32") wrap it
    in `Mixed` (kv_keep): those layers and kv heads stay full precision. `keep_units` ((layer,
    kv head) pairs, instead of keep_layers/keep_heads) wraps it in `MixedUnits`.
    """
    if name not in FORMATS:
        raise ValueError(f"unknown kv format {name!r}; choose one of {sorted(FORMATS)}")
    keep = {k: options.pop(k) for k in KEEP_OPTIONS if k in options}
    cls = FORMATS[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    bad = [k for k in options if k not in fields]
    if bad:
        raise ValueError(
            f"kv format {name!r} has no option(s) {bad}; its options are "
            f"{fields + list(KEEP_OPTIONS)}"
        )
    fmt = cls(**options)
    if keep.get("keep_units"):
        if keep.get("keep_layers") or keep.get("keep_heads"):
            raise ValueError("kv_keep: give keep_units alone, or keep_layers/keep_heads "
                             f"(got keep_units with {sorted(k for k in keep if keep[k])})")
        return MixedUnits(fmt, keep["keep_units"], keep.get("keep_dtype", "bf16"))
    keep.pop("keep_units", None)
    if not keep.get("keep_layers") and not keep.get("keep_heads"):
        if "keep_dtype" in keep and keep["keep_dtype"] not in KEEP_DTYPES:
            raise ValueError(f"kv_keep: keep_dtype={keep['keep_dtype']!r} is not one of "
                             f"{KEEP_DTYPES}")
        return fmt
    return Mixed(fmt, **keep)


def byte_table(shape=(30, 1, 3, 2048, 64)) -> list[tuple[str, int, float]]:
    """(format, bytes of k+v, ratio to bf16) for the default formats and main variants."""
    variants = [
        ("f32", {}),
        ("bf16", {}),
        ("fp8", {}),
        ("int8", {}),
        ("int4", {}),
        ("int4", {"group": 32}),
        ("int4", {"group": 32, "value_group": 64}),
        ("int4", {"key_mode": "token"}),
        ("int4", {"key_mode": "token", "group": 32, "value_group": 64}),
        ("int4", {"key_mode": "token", "group": 32}),
        ("int2", {}),
        ("int2", {"group": 16}),
        ("int2", {"key_mode": "token"}),
        ("int2", {"group": 64, "key_mode": "token"}),
        ("int4", {"keep_layers": (0, 29)}),
        ("int4", {"keep_heads": (0,)}),
    ]
    base = get_format("bf16").nbytes(shape)
    rows = []
    for name, opts in variants:
        n = get_format(name, **opts).nbytes(shape)
        label = name + "".join(f" {k}={v}" for k, v in opts.items())
        rows.append((label, n, n / base))
    return rows


if __name__ == "__main__":
    shape = (30, 1, 3, 2048, 64)
    print(f"k+v store bytes at (L, B, K, C, E) = {shape}, ratio to bf16")
    print("| format | bytes | / bf16 |\n|---|---:|---:|")
    for label, n, ratio in byte_table(shape):
        print(f"| {label} | {n:,} | {ratio:.4f} |")
