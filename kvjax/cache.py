"""The KV cache: an immutable pytree with a leading layer axis, and exact byte accounting.

Storage of k and v belongs to the cache's format (`kvjax.formats`), so the model never knows
whether slots hold f32 or packed int4; what each slot holds belongs to the policy. Writes go
through `write`, which scatters only the written slots (of one layer, or of every layer at
once), so a decode step never copies the whole cache.

Compress mode (`policy.mode="compress"`): the prompt is prefilled into a cache with room for
all of it, then `cache.compress(extra)` keeps the slots the policy selects and leaves `extra`
empty slots per kv head for the tokens that follow; `cache.grow(extra)` adds room to any dense
cache. Both rebuild through the format's read and write (`rebuild`), so every format works.

The caches that `kvjax.generate.prefill` and `decode_step` take are donated (their buffers are
reused in place): keep one for later with `copy(cache)` before passing it.

Layouts: `get_layout("dense")` builds this `KVCache`; `get_layout("paged", page_size=16,
impl="pallas")` builds a `kvjax.paged.PagedCache` (a page pool with block tables). Both give
`forward` the same protocol, so the model never branches on the layout:

    cache = cache.begin(n_valid)                           # once per call (paged: reserve pages)
    per layer, read-only scan:
        view = cache.layer_view(layer, fresh)  # fresh (static): no token cached yet
        out, probs = cache.attend(view, q, k, v, pos_new, rope_theta)   # q, k unrotated
        update = cache.update(view, k, v, pos_new, probs, rope_theta)   # what to store
    then every layer's updates at once (stacked by the scan):
        cache = cache.store_layers(updates, pos_new)  # batched, or a scan of cache.store
    cache = cache.finish(n_valid)                          # lengths (paged: page eviction)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.attention import attention, rope, rope_table
from kvjax.config import ModelConfig
from kvjax.formats import scan_layer_blocks, scatter_slots
from kvjax.programs import stored_jit

LAYOUTS = ("dense", "paged")
MIN_PREFIX = 128  # fewest slots `KVCache.attend` bounds a read to (fewer: a switch for nothing)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerView:
    """What a policy sees of one layer's cache (before this chunk is written)."""

    k: jax.Array  # [B, K, C, E] dequantized keys
    v: jax.Array  # [B, K, C, E] dequantized values
    pos: jax.Array  # [B, K, C] position held by each slot, -1 = empty
    stats: Any  # this policy's per-layer stats pytree, leaves [B, K, C, ...]
    length: jax.Array  # [B] tokens seen before this chunk
    owner: Any = None  # head pool only ([B, 1, P] kv head of each pool slot); else None
    layer: Any = None  # [] int32 the layer's index in the cache's stores (`KVCache.attend`)
    # static: every slot is known to be empty (a prompt's first chunk): attention skips them
    empty: bool = dataclasses.field(default=False, metadata={"static": True})


def pool_entries(pos_new, K: int, dtype=jnp.int32):
    """A chunk as a head pool (`HeadPool`) takes it: every kv head's copy of each token,
    head-major. Returns (positions [B, K·T], the kv head of each entry [K·T])."""
    T = pos_new.shape[-1]
    return jnp.tile(pos_new, (1, K)), jnp.repeat(jnp.arange(K, dtype=dtype), T)


def copy(cache):
    """A copy of any cache whose buffers survive donating the original (to `prefill`,
    `decode_step`, ...): keep a prefill state and decode from copies of it."""
    return jax.tree.map(jnp.copy, cache)


def _bytes(tree) -> int:
    """Real bytes of every leaf (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def device_bytes(tree, device=None) -> int:
    """Real bytes one device holds of every leaf: the sum of its addressable shards' nbytes
    (`device`, default the device holding the most). A leaf that is not a sharded jax.Array
    (numpy, ShapeDtypeStruct) counts whole."""
    per: dict = {}
    whole = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            for s in x.addressable_shards:
                per[s.device] = per.get(s.device, 0) + s.data.nbytes
        else:
            whole += _bytes(x)
    if device is not None:
        return whole + per.get(device, 0)
    return whole + max(per.values(), default=0)


def closed_form_bytes(cfg: ModelConfig, tokens: int, bytes_per_value: float, batch: int = 1):
    """2 · L · Hkv · D · T · bytes (· B): the textbook size of a KV cache."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * bytes_per_value * batch


def check_nonfinite(nonfinite) -> None:
    """Raise (on the host) naming the layers whose writes saw NaN or inf: nonfinite [L] bool."""
    bad = np.flatnonzero(np.asarray(nonfinite))
    if bad.size:
        raise FloatingPointError(
            f"NaN or inf keys/values reached the KV cache in layer(s) {bad.tolist()}; "
            "they were not silently stored as valid data (check the model inputs/weights)"
        )


@struct.dataclass
class KVCache:
    """k, v: format stores (leaves [L, B, K, C, ...]); pos: [L, B, K, C] int32 (-1 = empty);
    stats: the policy's pytree (leaves [L, B, K, C, ...]); length: [B] tokens seen per row;
    nonfinite: [L] bool, set when NaN/inf reached a layer's write (checked on the host).
    """

    k: Any
    v: Any
    pos: jax.Array
    stats: Any
    length: jax.Array
    nonfinite: jax.Array
    fmt: Any = struct.field(pytree_node=False)
    policy: Any = struct.field(pytree_node=False)
    # `attend` reads a layer only up to its occupied slots (a benchmark's subclass turns it off)
    bounded_reads: ClassVar[bool] = True

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None = None):
        """An empty cache for `batch` rows; capacity comes from the policy's budget."""
        max_len = cfg.max_seq_len if max_len is None else max_len
        policy.validate(max_len)
        groups = policy.layer_groups(cfg.n_layers, max_len)
        if len(groups) > 1:
            return LayerGroups.init(cfg, batch, policy, fmt, max_len)
        policy = groups[0][2]  # one group: the policy it runs (pyramid's inner one)
        if policy.head_pool and cls is KVCache:
            HeadPool.check_format(fmt, policy, cfg.n_kv_heads, cfg.head_dim, max_len)
            if policy.mode == "evict":  # compress mode pools its heads when it selects
                return HeadPool.init(cfg, batch, policy, fmt, max_len)
        L, K, E = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        C = policy.capacity(max_len)
        stats = policy.cache_stats(batch, K, C)
        return cls(
            k=fmt.init((L, batch, K, C, E), "k"),
            v=fmt.init((L, batch, K, C, E), "v"),
            pos=jnp.full((L, batch, K, C), -1, jnp.int32),
            stats=jax.tree.map(lambda s: jnp.broadcast_to(s, (L,) + s.shape), stats),
            length=jnp.zeros((batch,), jnp.int32),
            nonfinite=jnp.zeros((L,), bool),
            fmt=fmt,
            policy=policy,
        )

    @classmethod
    def abstract(cls, cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None = None):
        """The cache's shapes and dtypes without allocating (size a 70B cache on a laptop)."""
        return jax.eval_shape(lambda: cls.init(cfg, batch, policy, fmt, max_len))

    @property
    def capacity(self) -> int:
        return self.pos.shape[-1]

    def buffers(self) -> tuple:
        """Every array the cache holds (what `nbytes` counts)."""
        return (self.k, self.v, self.pos, self.stats, self.length, self.nonfinite)

    def nbytes(self, per_device: bool = False) -> int:
        """Real bytes of every buffer: stored k/v, scales, positions, policy stats, lengths.
        per_device: the bytes one device holds of a sharded cache (`kvjax.mesh`), the busiest."""
        return device_bytes(self.buffers()) if per_device else _bytes(self.buffers())

    def kv_nbytes(self) -> int:
        """Bytes of the stored keys and values alone (format metadata included)."""
        return _bytes((self.k, self.v))

    def formula_bytes(self, head_dim: int) -> int:
        """`nbytes()` by arithmetic from L, B, K, C and the head dim: the format's exact formula
        for keys and values (`fmt.bytes_formula`) + int32 positions + lengths and flags (+ a
        head pool's owner per slot) + the policy's stats, sized from their shapes (a policy's
        own pytree, which a prefill-only policy swaps at compress)."""
        L, B, K, C = self.pos.shape
        kv = sum(self.fmt.bytes_formula(L, B, K, C, head_dim, kind) for kind in ("k", "v"))
        owner = getattr(self, "n_heads", None)
        owner = 0 if owner is None else L * B * K * C * np.dtype(owner_dtype(owner)).itemsize
        return kv + L * B * K * C * 4 + B * 4 + L + owner + _bytes(self.stats)

    def head_slots(self) -> jax.Array:
        """Slots each kv head holds: [L, B, K] int32."""
        return jnp.sum(self.pos >= 0, axis=-1, dtype=jnp.int32)

    # ---- rows (serving: kvjax.serve)

    row_fields: ClassVar[tuple[str, ...]] = ("k", "v", "pos", "stats")  # batch axis 1

    def rows(self, idx) -> KVCache:
        """The cache of rows idx [b] int32 alone (run `forward` on it, put it back with
        `set_rows`)."""
        idx = jnp.asarray(idx, jnp.int32)
        sub = {f: jax.tree.map(lambda x: x[:, idx], getattr(self, f)) for f in self.row_fields}
        return self.replace(length=self.length[idx], **sub)

    def set_rows(self, idx, sub) -> KVCache:
        """This cache with rows idx [b] replaced by `sub` (from `rows`)."""
        idx = jnp.asarray(idx, jnp.int32)
        new = {f: jax.tree.map(lambda x, y: x.at[:, idx].set(y), getattr(self, f),
                               getattr(sub, f)) for f in self.row_fields}
        return self.replace(length=self.length.at[idx].set(sub.length),
                            nonfinite=self.nonfinite | sub.nonfinite, **new)

    def free(self, rows) -> KVCache:
        """End the sequences in rows [B] bool: they become as a fresh cache's rows (empty
        slots, fresh stores and stats)."""
        rows = jnp.asarray(rows, bool)
        L, B, K, C = self.pos.shape
        E = jax.eval_shape(lambda: self.fmt.read(self.k, 0, "k")).shape[-1]

        def pick(new, old):
            return jnp.where(rows.reshape((1, B) + (1,) * (old.ndim - 2)), new, old)

        fresh = self.policy.cache_stats(B, K, C)
        return self.replace(
            k=jax.tree.map(pick, self.fmt.init((L, B, K, C, E), "k"), self.k),
            v=jax.tree.map(pick, self.fmt.init((L, B, K, C, E), "v"), self.v),
            pos=pick(-1, self.pos), length=jnp.where(rows, 0, self.length),
            stats=jax.tree.map(lambda n, o: pick(n[None], o), fresh, self.stats))

    def share_prefix(self, src, dst, n_tokens=None) -> KVCache:
        """Rows dst [B] bool take a copy of row src's state (a prefill state reused: the dense
        layout cannot share slots, so it copies them). n_tokens must be None or row src's
        length (a dense row's slots cannot be cut at a position in general)."""
        traced = any(isinstance(x, jax.core.Tracer) for x in (src, n_tokens, self.length))
        if n_tokens is not None and not traced and int(n_tokens) != int(self.length[src]):
            raise ValueError(f"share_prefix on the dense layout copies the whole row: "
                             f"n_tokens={n_tokens} must be row {src}'s length "
                             f"{int(self.length[src])} (or None)")
        dst = jnp.asarray(dst, bool)
        return self.rows(jnp.where(dst, src, jnp.arange(dst.shape[0])))  # [B] row each copies

    def layer_view(self, layer, empty: bool = False) -> LayerView:
        """One layer as the policy and attention see it (k/v dequantized, one layer only).
        empty (static): the caller knows no slot holds a token yet; attention skips them."""
        with jax.named_scope("kv_read"):
            return LayerView(
                k=self.fmt.read(self.k, layer, "k"),  # [B, K, C, E]
                v=self.fmt.read(self.v, layer, "v"),  # [B, K, C, E]
                pos=self.pos[layer],  # [B, K, C]
                stats=jax.tree.map(lambda s: s[layer], self.stats),
                length=self.length,
                empty=empty,
                layer=layer,
            )

    def write(self, layer, slots, k_new, v_new, pos_new, stats) -> KVCache:
        """Store a chunk in one layer at the policy's slots (slot C = not stored).

        slots: [B, K, T]; k_new, v_new: [B, T, K, E]; pos_new: [B, T]; stats: the layer's stats.
        Or a block of n layers (`store_layers`): `layer` [n] their indices, and slots, k_new,
        v_new and stats with a leading [n].
        """
        with jax.named_scope("cache_update"):
            kt = jnp.swapaxes(k_new, -3, -2).astype(jnp.float32)  # [(n,) B, K, T, E]
            vt = jnp.swapaxes(v_new, -3, -2).astype(jnp.float32)  # [(n,) B, K, T, E]
            valid = (pos_new >= 0)[:, None, :, None]  # [B, 1, T, 1]
            ok = jnp.where(valid, jnp.isfinite(kt) & jnp.isfinite(vt), True)
            bad = ~jnp.all(ok, axis=(-4, -3, -2, -1))  # [(n,)]
            pos_b = jnp.broadcast_to(pos_new[:, None, :], slots.shape)  # [(n,) B, K, T]
            return self.replace(
                k=self.fmt.write(self.k, layer, slots, kt, "k"),
                v=self.fmt.write(self.v, layer, slots, vt, "v"),
                pos=scatter_slots(self.pos, layer, slots, pos_b),
                stats=jax.tree.map(lambda s, n: s.at[layer].set(n), self.stats, stats),
                nonfinite=self.nonfinite.at[layer].set(self.nonfinite[layer] | bad),
            )

    def compress(self, extra: int = 0):
        """Compress mode, after the prompt: per layer keep the slots `policy.select` chooses
        (`policy.kept(n)` per kv head for a row of n tokens; a head pool's policy ranks all
        heads together) and leave room for `extra` more tokens per kv head; the cache then
        grows (`policy.grown()`). Any other cache is returned as it is."""
        if self.policy.mode != "compress":
            return self
        n_keep = np.array([self.policy.kept(int(n)) for n in np.asarray(self.length)], np.int32)
        return rebuild(self, jnp.asarray(n_keep), self.policy, int(n_keep.max()) + extra,
                       select=True)

    def grow(self, extra: int):
        """The same cache with `extra` more empty slots per kv head (compacted, same format)."""
        if extra < 0:
            raise ValueError(f"grow: extra={extra} must be >= 0")
        return rebuild(self, jnp.zeros(self.length.shape, jnp.int32), self.policy,
                       self.capacity + extra, select=False)

    # ---- the protocol `kvjax.model.forward` calls (see the module docstring)

    def segments(self):
        """(lo, hi, cache) per group of layers that share one stacked cache: here, one."""
        return ((0, self.pos.shape[0], self),)

    def join(self, caches) -> KVCache:
        """Reassemble from `segments` after `forward` updated each."""
        (cache,) = caches
        return cache

    def begin(self, n_valid) -> KVCache:
        return self

    def _rotated(self, view: LayerView, x, pos_new, rope_theta: float):
        """x [B, T, ., E] rotated at the policy's chunk positions, and its cached-key positions
        ([B, K, C], or None when keys are stored rotated at their absolute positions)."""
        q_pos, key_pos = self.policy.rope_positions(view, pos_new)  # [B, T], [B, K, C] | None
        return rope(x, q_pos[:, :, None], rope_theta), key_pos

    def prefixes(self) -> tuple[int, ...]:
        """Slot counts `attend` may bound a layer's read to, ascending, ending with C: about
        C/8, C/4 and C/2, each rounded up to a prefix the format reads (`fmt.fit`: whole key
        groups, at least the residual), those of at least `MIN_PREFIX` slots. C: the slots of
        a layer's stores (a head pool's whole pool). Each is a branch to compile: finer steps
        would read less and compile longer (docs/benchmarks.md)."""
        C = self.pos.shape[-1]
        out = {self.fmt.fit(-(-C // 2**j)) for j in (3, 2, 1)}
        return tuple(sorted(n for n in out if MIN_PREFIX <= n < C)) + (C,)

    def attend(self, view: LayerView, q, k, v, pos_new, rope_theta: float):
        """Reference attention of a chunk (q [B, T, H, E], k, v [B, T, K, E], unrotated) over the
        layer's slots and itself: out [B, T, H, E], probs [B, K, T, C + T].

        Bounded by the occupied slots: slots past the last one that holds a token are empty in
        every row and head, and attention gives them exactly zero weight. So the layer's keys
        and values are read (dequantized) and scored only up to the smallest of `prefixes()`
        that covers them, picked at run time (`lax.switch`: no recompile); their probabilities
        are zero-padded back to C for the policy. A cache with room beyond its tokens (a budget
        above the context, a generation's max_len) then costs what its tokens do
        (docs/benchmarks.md, "Attention bounded by the occupied slots"). The policy still reads
        the full view (its positions and stats)."""
        q, _ = self._rotated(view, q, pos_new, rope_theta)
        k, key_pos = self._rotated(view, k, pos_new, rope_theta)
        C, E = view.pos.shape[-1], q.shape[-1]

        def over(n, kc, vc):  # attention over slots 0..n-1 (kc, vc [B, K, n, E])
            if key_pos is not None:  # positions within the cache: < C, a folded cos/sin table
                kc = rope(kc, key_pos[..., :n], rope_theta, rope_table(C, E, rope_theta))
            out, probs = attention(q, k, v, pos_new, kc, vc, view.pos[..., :n], view.empty,
                                   queries_lead=key_pos is None and self.fmt.keys_by_channel)
            if n < C:  # [B, K, T, n + T] -> [B, K, T, C + T]: the empty slots' zeros
                probs = jnp.concatenate([probs[..., :n], jnp.zeros(
                    probs.shape[:-1] + (C - n,), probs.dtype), probs[..., n:]], axis=-1)
            return out, probs

        bound = self.bounded_reads and view.layer is not None and not view.empty
        sizes = self.prefixes() if bound else ()
        if len(sizes) < 2:
            return over(C, view.k, view.v)

        def bounded(n):  # view.k and view.v go unread: XLA drops their full-length read
            return over(n, self.fmt.read(self.k, view.layer, "k", n),
                        self.fmt.read(self.v, view.layer, "v", n))

        held = jnp.max(jnp.where(view.pos >= 0, jnp.arange(1, C + 1, dtype=jnp.int32), 0))
        which = jnp.sum(held > jnp.asarray(sizes[:-1], jnp.int32))  # smallest prefix >= held
        return jax.lax.switch(which, [functools.partial(bounded, n) for n in sizes])

    def update(self, view: LayerView, k, v, pos_new, probs, rope_theta: float):
        """The policy's placement of the chunk: (slots, keys to store, values, stats)."""
        k_rot, key_pos = self._rotated(view, k, pos_new, rope_theta)
        slots, stats = self.policy.update(view, k_rot, v, pos_new, probs)
        return slots, k_rot if key_pos is None else k, v, stats

    def store(self, layer, update, pos_new) -> KVCache:
        slots, k, v, stats = update
        return self.write(layer, slots, k, v, pos_new, stats)

    def store_layers(self, updates, pos_new) -> KVCache:
        """Every layer's `update` (each leaf with a leading [L]), written in blocks of as many
        layers as the format takes at once (`fmt.layers_per_write`: a decode step writes all
        30 of SmolLM2's in one go; docs/benchmarks.md, "Writes of layers in blocks")."""
        slots, k = updates[:2]
        L, B, K, T = slots.shape
        return store_by_layer(self, updates, pos_new,
                              self.fmt.layers_per_write(L, B, K, T, k.shape[-1]))

    def finish(self, n_valid) -> KVCache:
        return self.replace(length=self.length + n_valid)

    def check_finite(self) -> None:
        """Raise (on the host) naming the layers whose keys/values held NaN or inf."""
        check_nonfinite(self.nonfinite)


def store_by_layer(cache, updates, pos_new, n: int = 1):
    """`store_layers` as a scan of `cache.store` over the layers, n at a time (`store` takes a
    block where the format does); n = 1 for a layout whose write is per layer (a head pool,
    pages)."""
    return scan_layer_blocks(lambda c, layer, u: c.store(layer, u, pos_new), cache, updates, n)


def owner_dtype(n_heads: int):
    """The owner array's dtype: int8 (one byte per pool slot), int16 from 128 kv heads."""
    return jnp.int8 if n_heads < 128 else jnp.int16


@struct.dataclass
class HeadPool(KVCache):
    """Per-head budgets with real memory (AdaKV-style): the K kv heads of a layer share one pool
    of P = K · budget slots, and `owner` names the head each slot serves, so a head that needs
    more slots takes them from one that needs fewer while the layer's bytes stay those of
    `budget` slots per head. Built by `KVCache.init` when the policy sets `head_pool`.

    Stores are [L, B, 1, P, ...] (the format sees one "head" of P slots, `fmt.shared_by(K)`);
    pos [L, B, 1, P]; owner [L, B, 1, P] int8. Attention reads the pool once for all heads and
    masks each head to its own slots. The policy's `update` sees the pool (view.pos [B, 1, P], view.owner) and
    probs [B, K, T, P + T] that are zero outside each head's slots, and answers slots [B, K, T]
    in the pool for each (head, token) (P = not stored).
    """

    owner: jax.Array
    n_heads: int = struct.field(pytree_node=False)
    row_fields: ClassVar[tuple[str, ...]] = ("k", "v", "pos", "stats", "owner")

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None = None):
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not policy.head_pool or policy.mode != "evict":
            raise ValueError(
                f"HeadPool.init: policy {policy.name!r} does not evict from a head pool "
                "(head_pool and mode='evict'); use KVCache.init"
            )
        policy.validate(max_len)
        L, K, E = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        cls.check_format(fmt, policy, K, E, max_len)
        P = K * policy.capacity(max_len)
        fmt = fmt.shared_by(K)
        stats = policy.cache_stats(batch, 1, P)
        return cls(
            k=fmt.init((L, batch, 1, P, E), "k"),
            v=fmt.init((L, batch, 1, P, E), "v"),
            pos=jnp.full((L, batch, 1, P), -1, jnp.int32),
            stats=jax.tree.map(lambda s: jnp.broadcast_to(s, (L,) + s.shape), stats),
            length=jnp.zeros((batch,), jnp.int32),
            nonfinite=jnp.zeros((L,), bool),
            owner=jnp.zeros((L, batch, 1, P), owner_dtype(K)),
            fmt=fmt,
            policy=policy,
            n_heads=K,
        )

    @staticmethod
    def check_format(fmt, policy, K: int, E: int, max_len: int) -> None:
        """Raise before any work if `fmt` cannot store this policy's pool of K · budget slots
        (kv_keep by head; a slot group that does not divide K · budget), naming valid budgets."""
        by_head = [f"{k}={getattr(fmt, k)}" for k in ("keep_heads", "keep_units")
                   if getattr(fmt, k, ())]
        if by_head:
            raise ValueError(
                f"kv_keep {by_head[0]} cannot apply to policy {policy.name!r}: its "
                "kv heads share one slot pool per layer (slots move between heads); use "
                "keep_layers, or a per-head policy"
            )
        budget = policy.budget if policy.budget is not None else max_len

        def fits(b: int) -> bool:
            try:
                for kind in ("k", "v"):
                    jax.eval_shape(lambda k=kind: fmt.shared_by(K).init((1, 1, 1, K * b, E), k))
            except ValueError:
                return False
            return True

        if not fits(budget):
            near = [b for b in range(max(1, budget - 256), min(max_len, budget + 256) + 1)
                    if b >= policy.min_budget() and fits(b)]
            near = sorted(near, key=lambda b: abs(b - budget))[:3]
            raise ValueError(
                f"policy {policy.name!r}: budget={budget} gives a pool of Hkv · budget = {K} · "
                f"{budget} = {K * budget} slots per layer, which format {fmt.name!r} cannot "
                f"store (its slot groups must divide the pool); budgets that fit near it: "
                f"{sorted(near) or 'none within 256'}"
            )

    @property
    def capacity(self) -> int:
        """Mean slots per kv head (what the closed form 2·L·Hkv·D·C·bytes needs)."""
        return self.pos.shape[-1] // self.n_heads

    def buffers(self) -> tuple:
        return super().buffers() + (self.owner,)

    def head_slots(self) -> jax.Array:
        """Slots each kv head holds: [L, B, K] int32 (they sum to at most K · budget)."""
        mine = self.owner[..., None] == jnp.arange(self.n_heads)  # [L, B, 1, P, K]
        return jnp.sum(mine & (self.pos >= 0)[..., None], axis=(2, 3), dtype=jnp.int32)

    def layer_view(self, layer, empty: bool = False) -> LayerView:
        view = super().layer_view(layer, empty)  # k, v [B, 1, P, E]; pos [B, 1, P]
        return dataclasses.replace(view, owner=self.owner[layer])

    def attend(self, view: LayerView, q, k, v, pos_new, rope_theta: float):
        """As `KVCache.attend`, over the pool with each head masked to its own slots."""
        heads = jnp.arange(self.n_heads, dtype=view.owner.dtype)[None, :, None]  # [1, K, 1]
        pos = jnp.where(view.owner == heads, view.pos, -1)  # [B, K, P]
        return super().attend(dataclasses.replace(view, pos=pos), q, k, v, pos_new, rope_theta)

    def store_layers(self, updates, pos_new) -> HeadPool:
        return store_by_layer(self, updates, pos_new)

    def write(self, layer, slots, k_new, v_new, pos_new, stats) -> HeadPool:
        """Store each (head, token) at its pool slot: slots [B, K, T] (P = not stored)."""
        B, K, T = slots.shape
        E = k_new.shape[-1]
        flat = slots.reshape(B, 1, K * T)  # head-major, as the heads' tokens are listed

        def by_head(x):  # [B, T, K, E] -> [B, K·T, 1, E]
            return jnp.swapaxes(x, 1, 2).reshape(B, K * T, 1, E)

        pos_flat, heads = pool_entries(pos_new, K, self.owner.dtype)  # [B, K·T], [K·T]
        out = super().write(layer, flat, by_head(k_new), by_head(v_new), pos_flat, stats)
        heads = jnp.broadcast_to(heads, flat.shape)
        with jax.named_scope("cache_update"):
            return out.replace(owner=self.owner.at[layer, jnp.arange(B)[:, None, None], 0,
                                                   flat].set(heads, mode="drop"))


@stored_jit(static_argnames=("policy", "capacity", "select"))
def rebuild(cache: KVCache, n_keep, policy, capacity: int, select: bool) -> KVCache:
    """A new cache of `capacity` slots per kv head holding, per layer, the slots of `cache`
    that `policy.select(view, n_keep)` keeps (select=True: the compress-mode selection; the
    result runs `policy.grown()`), or every slot (select=False: `grow`), compacted in slot
    order with the rest empty. A `policy.head_pool` selection (or a pool being grown) gives a
    `HeadPool` of K · capacity slots per layer. Keys and values go through the format's read
    and write, so any storage format works; the format rounds the capacity up to what it can
    store (`fmt.fit`)."""
    L, B, Kc, C0 = cache.pos.shape  # Kc = 1 for a pool
    K = getattr(cache, "n_heads", Kc)
    pooled = isinstance(cache, HeadPool) or (select and policy.head_pool)
    Kn = 1 if pooled else K  # head axis of the result
    fmt = cache.fmt.shared_by(K) if pooled and not isinstance(cache, HeadPool) else cache.fmt
    P = fmt.fit(K * capacity if pooled else capacity)  # slots per head axis entry
    N = Kc * C0 if pooled else C0  # candidates per head axis entry
    view0 = jax.eval_shape(lambda c: c.layer_view(0), cache)
    E = view0.k.shape[-1]
    new_policy = policy.grown() if select else policy
    if select:
        stats0 = jax.eval_shape(lambda: new_policy.cache_stats(B, Kn, P))
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(Kn)[None, :, None]

    def body(carry, layer):
        k, v, pos, owner, stats = carry
        view = cache.layer_view(layer)
        mask = policy.select(view, n_keep) if select else view.pos >= 0  # [B, Kc, C0]

        def heads(x):  # [B, Kc, C0, ...] -> [B, Kn, N, ...]
            return x.reshape((B, Kn, N) + x.shape[3:])

        m = heads(mask)
        nth = jnp.where(m, jnp.cumsum(m, axis=-1) - 1, P)  # [B, Kn, N]
        idx = jnp.full((B, Kn, P), N, jnp.int32).at[b, h, nth].set(
            jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), m.shape), mode="drop")
        ok = idx < N  # [B, Kn, P]
        src = jnp.minimum(idx, N - 1)

        def take(x, fill=0):  # [B, Kc, C0, ...] -> [B, Kn, P, ...]
            x = heads(x)
            i = src.reshape(src.shape + (1,) * (x.ndim - 3))
            got = jnp.take_along_axis(x, i, axis=2)
            return jnp.where(ok.reshape(i.shape), got, jnp.asarray(fill, x.dtype))

        slots = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, Kn, P))
        k = fmt.write(k, layer, slots, take(view.k), "k")
        v = fmt.write(v, layer, slots, take(view.v), "v")
        pos = pos.at[layer].set(take(view.pos, -1))
        if pooled:
            was = (jnp.broadcast_to(jnp.arange(K, dtype=owner.dtype)[None, :, None], mask.shape)
                   if view.owner is None else view.owner)
            owner = owner.at[layer].set(take(was))
        st = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats0) if select
              else jax.tree.map(take, view.stats))
        stats = jax.tree.map(lambda s, n: s.at[layer].set(n), stats, st)
        return (k, v, pos, owner, stats), None

    st_shape = (stats0 if select else
                jax.tree.map(lambda s: jax.ShapeDtypeStruct((B, Kn, P) + s.shape[3:], s.dtype),
                             view0.stats))
    init = (fmt.init((L, B, Kn, P, E), "k"), fmt.init((L, B, Kn, P, E), "v"),
            jnp.full((L, B, Kn, P), -1, jnp.int32),
            jnp.zeros((L, B, Kn, P), owner_dtype(K)) if pooled else jnp.zeros((L,), jnp.int8),
            jax.tree.map(lambda s: jnp.zeros((L,) + s.shape, s.dtype), st_shape))
    (k, v, pos, owner, stats), _ = jax.lax.scan(body, init, jnp.arange(L, dtype=jnp.int32))
    common = {"k": k, "v": v, "pos": pos, "stats": stats, "length": cache.length,
                  "nonfinite": cache.nonfinite, "fmt": fmt, "policy": new_policy}
    if pooled:
        return HeadPool(owner=owner, n_heads=K, **common)
    return KVCache(**common)


@struct.dataclass
class LayerGroups:
    """Per-layer budgets with real memory (PyramidKV-style): consecutive layers that share a
    budget form one `KVCache` of that capacity, and `forward` scans each group in turn (compile
    time grows with the number of groups, not with depth). Built by `KVCache.init` when the
    policy's `layer_groups` has more than one group."""

    groups: tuple
    bounds: tuple = struct.field(pytree_node=False)  # ((lo, hi), ...) layers of each group
    policy: Any = struct.field(pytree_node=False)

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, policy, fmt, max_len: int):
        parts = policy.layer_groups(cfg.n_layers, max_len)
        try:
            groups = tuple(
                KVCache.init(dataclasses.replace(cfg, n_layers=hi - lo), batch, p, fmt, max_len)
                for lo, hi, p in parts
            )
        except ValueError as e:  # a format's limit on one group's budget: say what they are
            budgets = ", ".join(f"layers {lo}-{hi - 1}: {getattr(p, 'budget', None)}"
                                for lo, hi, p in parts)
            raise ValueError(f"{e} [policy {policy.name!r} gives its layer groups the budgets "
                             f"{budgets}]") from None
        return cls(groups=groups, bounds=tuple((lo, hi) for lo, hi, _ in parts), policy=policy)

    @property
    def length(self) -> jax.Array:
        return self.groups[0].length

    @property
    def fmt(self):
        return self.groups[0].fmt

    @property
    def nonfinite(self) -> jax.Array:
        return jnp.concatenate([g.nonfinite for g in self.groups])  # [L]

    @property
    def capacity(self) -> float:
        """Mean slots per layer (what the closed form 2·L·Hkv·D·C·bytes needs)."""
        slots = sum(g.capacity * (hi - lo) for g, (lo, hi) in zip(self.groups, self.bounds))
        return slots / self.bounds[-1][1]

    def nbytes(self, per_device: bool = False) -> int:
        if per_device:
            return device_bytes(tuple(g.buffers() for g in self.groups))
        return sum(g.nbytes() for g in self.groups)

    def head_slots(self) -> jax.Array:
        """Slots each kv head holds: [L, B, K] int32 over all groups."""
        return jnp.concatenate([g.head_slots() for g in self.groups])

    def kv_nbytes(self) -> int:
        return sum(g.kv_nbytes() for g in self.groups)

    def rows(self, idx) -> LayerGroups:
        return self.join(g.rows(idx) for g in self.groups)

    def set_rows(self, idx, sub) -> LayerGroups:
        return self.join(g.set_rows(idx, s) for g, s in zip(self.groups, sub.groups))

    def free(self, rows) -> LayerGroups:
        return self.join(g.free(rows) for g in self.groups)

    def share_prefix(self, src, dst, n_tokens=None) -> LayerGroups:
        return self.join(g.share_prefix(src, dst, n_tokens) for g in self.groups)

    def segments(self):
        return tuple((lo, hi, g) for g, (lo, hi) in zip(self.groups, self.bounds))

    def join(self, caches) -> LayerGroups:
        return self.replace(groups=tuple(caches))

    def begin(self, n_valid) -> LayerGroups:
        return self.join(g.begin(n_valid) for g in self.groups)

    def finish(self, n_valid) -> LayerGroups:
        return self.join(g.finish(n_valid) for g in self.groups)

    def compress(self, extra: int = 0) -> LayerGroups:
        return self.join(g.compress(extra) for g in self.groups)

    def grow(self, extra: int) -> LayerGroups:
        return self.join(g.grow(extra) for g in self.groups)

    def check_finite(self) -> None:
        check_nonfinite(self.nonfinite)


@dataclasses.dataclass(frozen=True)
class DenseLayout:
    """Contiguous `[L, B, K, C, E]` slots per row (`KVCache`); attention is the jnp reference.
    mesh: a `kvjax.mesh.MeshSpec` to shard the cache over (batch over data, kv heads over
    model); None: one device."""

    name: ClassVar[str] = "dense"
    impl: str = "reference"
    mesh: Any = None

    def __post_init__(self):
        if self.impl != "reference":
            raise ValueError(
                f"attention impl {self.impl!r} needs layout='paged' (the Pallas kernel reads "
                "pages); the dense layout runs impl='reference'"
            )

    def validate(self, policy, fmt, max_len: int) -> None:
        policy.validate(max_len)
        if self.mesh is not None:
            self.mesh.check_devices()

    def check_pool(self, policy, max_len: int) -> None:
        """Dense rows own their slots: any row fits."""

    def notes(self, policy) -> tuple[str, ...]:
        """What this layout does differently from the dense one for `policy` (for the run's
        notes): nothing."""
        return ()

    def init(self, cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None = None):
        cache = _init_dense(cfg, batch, policy, fmt, max_len)
        if self.mesh is None:
            return cache
        from kvjax.mesh import shard_cache

        return shard_cache(cache, self.mesh)[0]

    def abstract(self, cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None = None):
        return KVCache.abstract(cfg, batch, policy, fmt, max_len)


@stored_jit(static_argnames=("cfg", "batch", "policy", "fmt", "max_len"))
def _init_dense(cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None):
    """`KVCache.init` as one program: run eagerly, each of its zero/full buffers of a new shape
    compiles a program of its own (13 in the main job, ~0.3 s of every run)."""
    return KVCache.init(cfg, batch, policy, fmt, max_len)


def get_layout(name: str = "dense", **options):
    """A cache layout by name: "dense" (options: impl="reference", mesh=None) or "paged" (page_size=16,
    num_pages=None, impl="reference"|"pallas", interpret=None, num_splits=None, probs=False).
    `layout.init(cfg, batch, policy, fmt, max_len)` builds the cache."""
    if name == "dense":
        cls = DenseLayout
    elif name == "paged":
        from kvjax.paged import PagedLayout

        cls = PagedLayout
    else:
        raise ValueError(f"unknown cache layout {name!r}; valid layouts: {', '.join(LAYOUTS)}")
    fields = [f.name for f in dataclasses.fields(cls)]
    bad = sorted(set(options) - set(fields))
    if bad:
        raise ValueError(f"layout {name!r} has no option(s) {bad}; its options are: {fields}")
    return cls(**options)


def init_cache(cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None = None,
               layout=None):
    """An empty cache in `layout` (a layout object or a name; default dense)."""
    if layout is None or isinstance(layout, str):
        layout = get_layout(layout or "dense")
    return layout.init(cfg, batch, policy, fmt, max_len)
