"""Paged KV cache: a page pool per layer, per-row block tables, a functional allocator, and
prefix sharing with reference counts and copy-on-write.

Layout (one block table serves every layer, as in vLLM):

    k, v          page stores, leaves [L, K, P, page, X]   (X = E, or E//2 for packed int4)
    block_tables  [B, M] int32, page id of each row's j-th page, NO_PAGE (-1) = none
    lengths       [B] int32, tokens written per row (logical positions 0..length-1)
    refcount      [P] int32, rows referencing each page (0 = free)
    preempted     [B] bool, rows that could not get pages under jit (sticky; checked on host)

Everything is an array of static shape: allocating, freeing, sharing and evicting are pure
functions, jit-able, and never change shapes, so decode never recompiles. A decode step is

    cache, granted = reserve(cache, n_new)          # pages for the new tokens (+ copy-on-write)
    per layer l (inside the layer scan):
        cache = write(cache, l, k_new, v_new, granted)
        out = attend(cache, l, q, granted)          # Pallas kernel or the jnp reference
    cache = advance(cache, granted)

Out of pages: called eagerly, `reserve` raises `OutOfPagesError` before touching anything. Under
jit it cannot raise, so it preempts: rows are served in batch order, the first rows that do not
fit get `granted = 0`, their tokens are not stored, their length does not advance and
`preempted[b]` is set; `check(cache)` raises on the host. Their attention output for that step
is computed over the tokens they already hold (finite, but not the intended result).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.attention import attention, rope
from kvjax.cache import check_nonfinite
from kvjax.kernels.paged_attention import (
    NO_PAGE,
    VALID_PAGE_SIZES,
    QuantPages,
    check_page_size,
    gather_pages,
    paged_attention,
    paged_attention_reference,
    quantize_pages,
)

KINDS = ("f32", "bf16", "int8", "int4")


class OutOfPagesError(RuntimeError):
    """The pool has too few free pages (or a row's block table too few slots) for a request."""


class PagedCacheError(RuntimeError):
    """A paged cache broke an invariant (preempted rows, bad block tables, wrong refcounts)."""


def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))


def _cdiv(a, b):
    return (a + b - 1) // b


def _empty_store(kind, shape, group, scale_dtype):
    """Zeroed page store for logical shape [L, K, P, page, E]."""
    *lead, E = shape
    if kind == "f32":
        return jnp.zeros(shape, jnp.float32)
    if kind == "bf16":
        return jnp.zeros(shape, jnp.bfloat16)
    if kind == "int8":
        return QuantPages(jnp.zeros(shape, jnp.int8), jnp.zeros((*lead, 1), scale_dtype))
    if kind == "int4":
        if E % group or group % 2:
            raise ValueError(f"int4 pages need an even group dividing head_dim={E}, got {group}")
        return QuantPages(
            jnp.zeros((*lead, E // 2), jnp.uint8),
            jnp.zeros((*lead, E // group), scale_dtype),
            jnp.zeros((*lead, E // group), scale_dtype),
        )
    raise ValueError(f"unknown kv kind {kind!r} for pages; choose one of {KINDS}")


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@struct.dataclass
class PagedKVCache:
    """Page pool + block tables + allocator state (see the module docstring for shapes)."""

    k: Any
    v: Any
    block_tables: jax.Array
    lengths: jax.Array
    refcount: jax.Array
    preempted: jax.Array
    kind: str = struct.field(pytree_node=False, default="bf16")
    group: int = struct.field(pytree_node=False, default=32)
    value_group: int | None = struct.field(pytree_node=False, default=None)  # None: `group`

    @classmethod
    def init(
        cls,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        batch: int,
        num_pages: int,
        page_size: int,
        max_len: int,
        kind: str = "bf16",
        group: int = 32,
        scale_dtype=jnp.float16,
        value_group: int | None = None,
    ) -> PagedKVCache:
        """An empty cache: `num_pages` pages of `page_size` tokens, rows of up to `max_len`
        (int4: keys in groups of `group` channels, values of `value_group`, default `group`)."""
        check_page_size(page_size)
        if num_pages < 1 or batch < 1 or max_len < 1:
            raise ValueError(
                f"need num_pages, batch, max_len >= 1, got {num_pages}, {batch}, {max_len}"
            )
        shape = (n_layers, n_kv_heads, num_pages, page_size, head_dim)
        M = _cdiv(max_len, page_size)
        return cls(
            k=_empty_store(kind, shape, group, scale_dtype),
            v=_empty_store(kind, shape, value_group or group, scale_dtype),
            block_tables=jnp.full((batch, M), NO_PAGE, jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            refcount=jnp.zeros((num_pages,), jnp.int32),
            preempted=jnp.zeros((batch,), bool),
            kind=kind,
            group=group,
            value_group=value_group,
        )

    @classmethod
    def for_model(
        cls,
        cfg,
        batch: int,
        num_pages: int,
        page_size: int = 16,
        max_len: int | None = None,
        kind: str = "bf16",
        **kw,
    ) -> PagedKVCache:
        """An empty cache shaped for a `ModelConfig`."""
        return cls.init(
            cfg.n_layers,
            cfg.n_kv_heads,
            cfg.head_dim,
            batch,
            num_pages,
            page_size,
            cfg.max_seq_len if max_len is None else max_len,
            kind,
            **kw,
        )

    @property
    def _leaf(self):
        return jax.tree.leaves(self.k)[0]

    @property
    def page_size(self) -> int:
        return self._leaf.shape[3]

    @property
    def num_pages(self) -> int:
        return self._leaf.shape[2]

    @property
    def max_pages(self) -> int:
        return self.block_tables.shape[1]

    @property
    def max_len(self) -> int:
        return self.max_pages * self.page_size

    def nbytes(self) -> int:
        """Real bytes of every buffer: pools (metadata included) and allocator state."""
        return _nbytes(
            (self.k, self.v, self.block_tables, self.lengths, self.refcount, self.preempted)
        )

    def kv_nbytes(self) -> int:
        """Bytes of the k/v page pools alone."""
        return _nbytes((self.k, self.v))

    def page_nbytes(self) -> int:
        """Bytes one page occupies across all layers, heads, k and v."""
        return self.kv_nbytes() // self.num_pages

    def free_count(self):
        return jnp.sum(self.refcount == 0)


# --------------------------------------------------------------------------- allocation


def _requests(cache: PagedKVCache, n_new, keep=None):
    """[B, M] bool: table slots that need a fresh page to take n_new tokens per row.

    A slot needs one when it is a new page past the row's pages, or the partially filled page
    the next token lands in is shared (refcount > 1: copy-on-write) or was evicted. With keep
    [B, M], only kept slots get pages (tokens of the others are not stored).
    """
    page, P, M = cache.page_size, cache.num_pages, cache.max_pages
    ln = cache.lengths
    new_len = ln + n_new
    j = jnp.arange(M)[None, :]  # [1, M]
    in_range = (
        (j >= (ln // page)[:, None]) & (j < _cdiv(new_len, page)[:, None]) & (n_new[:, None] > 0)
    )  # [B, M]
    ids = cache.block_tables  # [B, M]
    valid = (ids >= 0) & (ids < P)
    shared = cache.refcount[jnp.clip(ids, 0, P - 1)] > 1
    fits = _cdiv(new_len, page) <= M  # [B]
    if keep is not None:
        in_range = in_range & keep
    return in_range & (~valid | shared), fits


def pages_needed(cache: PagedKVCache, n_new, keep=None) -> jax.Array:
    """Fresh pages each row needs to take n_new [B] more tokens (copy-on-write included)."""
    req, _ = _requests(cache, jnp.asarray(n_new, jnp.int32), keep)
    return req.sum(axis=1)


def _check_reserve(cache: PagedKVCache, n_new, keep=None) -> None:
    req, fits = jax.device_get(_requests(cache, n_new, keep))
    ln, n = np.asarray(cache.lengths), np.asarray(n_new)
    if (n < 0).any():
        raise ValueError(f"n_new must be >= 0, got {n.tolist()}")
    if not fits.all():
        b = int(np.flatnonzero(~fits)[0])
        raise OutOfPagesError(
            f"row {b} would hold {int(ln[b] + n[b])} tokens, past max_len={cache.max_len} "
            f"({cache.max_pages} pages of {cache.page_size}); build the cache with a larger max_len"
        )
    need, free = int(req.sum()), int(np.sum(np.asarray(cache.refcount) == 0))
    if need > free:
        raise OutOfPagesError(
            f"out of KV pages: this step needs {need} fresh pages (per row {req.sum(1).tolist()}), "
            f"{free} of {cache.num_pages} are free (page size {cache.page_size}); free finished "
            "rows, evict pages, or build the pool with more pages"
        )


def reserve(cache: PagedKVCache, n_new, keep=None, defer_copy: bool = False):
    """Allocate pages so row b can take n_new[b] tokens; copy-on-write shared partial pages.

    keep [B, M] (optional): only these table slots get pages; tokens landing elsewhere are not
    stored (pass the same mask to `write`). Returns (cache, granted [B]): granted[b] = n_new[b],
    or 0 for a row preempted under jit (eagerly, running out raises `OutOfPagesError` before
    any work). defer_copy: do not copy the copy-on-write pages; return (cache, granted,
    (src [B], dst [B])) instead (P = no copy) for the caller to copy per layer (`copy_pages`).
    """
    n_new = jnp.broadcast_to(jnp.asarray(n_new, jnp.int32), cache.lengths.shape)
    if not _is_traced(cache, n_new, keep):
        _check_reserve(cache, n_new, keep)
    P, page = cache.num_pages, cache.page_size
    B, M = cache.block_tables.shape
    req, fits = _requests(cache, n_new, keep)  # [B, M], [B]
    count = jnp.where(fits, req.sum(axis=1), 0)  # [B]
    n_free = jnp.sum(cache.refcount == 0)
    ok = fits & (jnp.cumsum(count) <= n_free)  # [B] rows served in batch order
    req = req & ok[:, None]
    rank = jnp.cumsum(req.reshape(-1)).reshape(B, M) - 1  # [B, M]
    free_list = jnp.nonzero(cache.refcount == 0, size=P, fill_value=P)[0]  # [P] ascending
    new_ids = jnp.where(req, free_list[jnp.clip(rank, 0, P - 1)], P)  # [B, M], P = none

    old = cache.block_tables
    old_valid = (old >= 0) & (old < P)
    j0 = jnp.clip(cache.lengths // page, 0, M - 1)  # [B] page the next token lands in
    rows = jnp.arange(B)
    cow = req[rows, j0] & old_valid[rows, j0] & (cache.lengths % page != 0)  # [B]
    src = jnp.where(cow, old[rows, j0], P)  # [B]
    dst = jnp.where(cow, new_ids[rows, j0], P)  # [B]

    refcount = cache.refcount.at[new_ids.reshape(-1)].add(1, mode="drop")
    refcount = refcount.at[src].add(-1, mode="drop")
    tables = jnp.where(req, new_ids, old)

    granted = jnp.where(ok, n_new, 0)
    preempted = cache.preempted | ((n_new > 0) & ~ok)
    cache = cache.replace(block_tables=tables, refcount=refcount, preempted=preempted)
    if defer_copy:
        return cache, granted, (src, dst)

    def copy(store):
        return jax.tree.map(
            lambda x: x.at[:, :, dst].set(x[:, :, jnp.clip(src, 0, P - 1)], mode="drop"), store
        )

    k, v = jax.lax.cond(
        jnp.any(cow), lambda kv: (copy(kv[0]), copy(kv[1])), lambda kv: kv, (cache.k, cache.v)
    )
    return cache.replace(k=k, v=v), granted


def copy_pages(cache: PagedKVCache, layer, src, dst) -> PagedKVCache:
    """Copy page src[b] to page dst[b] in one layer's k and v pools (dst = P: no copy)."""
    P = cache.num_pages

    def copy(store):
        return jax.tree.map(
            lambda x: x.at[layer, :, dst].set(x[layer, :, jnp.clip(src, 0, P - 1)], mode="drop"),
            store,
        )

    return cache.replace(k=copy(cache.k), v=copy(cache.v))


def write(cache: PagedKVCache, layer, k_new, v_new, granted=None, keep=None) -> PagedKVCache:
    """Store the first granted[b] tokens of k_new, v_new ([B, T, K, E] or [B, K, E]) of one layer
    at positions lengths[b] + t (call `reserve` first, `advance` after the last layer). With
    keep [B, M], only tokens whose table slot is kept are stored."""
    if k_new.ndim == 3:
        k_new, v_new = k_new[:, None], v_new[:, None]
    B, T, K, _ = k_new.shape
    P, page, M = cache.num_pages, cache.page_size, cache.max_pages
    if granted is None:
        granted = jnp.full((B,), T, jnp.int32)
    t = jnp.arange(T)[None, :]  # [1, T]
    pos = cache.lengths[:, None] + t  # [B, T]
    slot = jnp.take_along_axis(cache.block_tables, jnp.clip(pos // page, 0, M - 1), axis=1)
    ok = (t < granted[:, None]) & (slot >= 0) & (slot < P)  # [B, T]
    if keep is not None:
        ok = ok & jnp.take_along_axis(keep, jnp.clip(pos // page, 0, M - 1), axis=1)
    slot = jnp.where(ok, slot, P)[:, :, None]  # [B, T, 1], P = dropped
    off = (pos % page)[:, :, None]  # [B, T, 1]
    kh = jnp.arange(K)[None, None, :]  # [1, 1, K]

    def put(store, x, group):
        enc = quantize_pages(x, cache.kind, group, _scale_dtype(store))  # leaves [B, T, K, X]
        return jax.tree.map(
            lambda s, e: s.at[layer, kh, slot, off].set(e.astype(s.dtype), mode="drop"), store, enc
        )

    v_group = cache.value_group or cache.group
    return cache.replace(k=put(cache.k, k_new, cache.group), v=put(cache.v, v_new, v_group))


def _scale_dtype(store):
    return store.scale.dtype if isinstance(store, QuantPages) else jnp.float16


def advance(cache: PagedKVCache, granted) -> PagedKVCache:
    """Count the tokens written by `write` in every layer."""
    return cache.replace(lengths=cache.lengths + granted)


def append(cache: PagedKVCache, k_new, v_new, n_new=None):
    """Reserve, write every layer and advance: k_new, v_new [L, B, T, K, E] (prefill helper)."""
    L, B, T = k_new.shape[:3]
    n_new = jnp.full((B,), T, jnp.int32) if n_new is None else n_new
    cache, granted = reserve(cache, n_new)
    for layer in range(L):
        cache = write(cache, layer, k_new[layer], v_new[layer], granted)
    return advance(cache, granted), granted


def attend(
    cache: PagedKVCache,
    layer,
    q,
    granted=None,
    *,
    impl: str = "pallas",
    interpret: bool = False,
    return_mass: bool = False,
    **kernel_kw,
):
    """Decode attention of q [B, H, E] over one layer's pages (lengths + granted tokens)."""
    lengths = cache.lengths if granted is None else cache.lengths + granted
    args = (q, cache.k, cache.v, cache.block_tables, lengths)
    if impl == "pallas":
        return paged_attention(
            *args, layer=layer, return_mass=return_mass, interpret=interpret, **kernel_kw
        )
    if impl == "reference":
        return paged_attention_reference(
            *args, layer=layer, return_mass=return_mass, sm_scale=kernel_kw.get("sm_scale")
        )
    raise ValueError(f"attention impl {impl!r}: choose 'pallas' or 'reference'")


def gather(cache: PagedKVCache, layer):
    """Dense view of one layer for chunked (T > 1) attention: k, v [B, K, M*page, E] float32
    and valid [B, M*page] (token written and its page present)."""
    page, P = cache.page_size, cache.num_pages
    k = gather_pages(cache.k, cache.block_tables, layer)
    v = gather_pages(cache.v, cache.block_tables, layer)
    ok = jnp.repeat((cache.block_tables >= 0) & (cache.block_tables < P), page, axis=1)
    valid = ok & (jnp.arange(cache.max_len)[None, :] < cache.lengths[:, None])
    return k, v, valid


# --------------------------------------------------------------------------- freeing and sharing


def _release(cache: PagedKVCache, drop) -> PagedKVCache:
    """Drop the table entries where drop [B, M] is set, decrementing their pages' refcounts."""
    P = cache.num_pages
    ids = cache.block_tables
    drop = drop & (ids >= 0) & (ids < P)
    refcount = cache.refcount.at[jnp.where(drop, ids, P).reshape(-1)].add(-1, mode="drop")
    return cache.replace(block_tables=jnp.where(drop, NO_PAGE, ids), refcount=refcount)


def free(cache: PagedKVCache, rows) -> PagedKVCache:
    """End the sequences in rows [B] bool: their pages return to the pool once unreferenced."""
    rows = jnp.asarray(rows, bool)
    cache = _release(cache, jnp.broadcast_to(rows[:, None], cache.block_tables.shape))
    return cache.replace(
        lengths=jnp.where(rows, 0, cache.lengths), preempted=jnp.where(rows, False, cache.preempted)
    )


def share_prefix(cache: PagedKVCache, src, dst, n_tokens=None) -> PagedKVCache:
    """Rows dst [B] bool (ended first) share the pages of row src's first n_tokens tokens
    (default: all of them). A later write into a shared page copies it first."""
    B, M = cache.block_tables.shape
    dst = jnp.asarray(dst, bool) & (jnp.arange(B) != src)
    src_len = cache.lengths[src]
    n = src_len if n_tokens is None else jnp.asarray(n_tokens, jnp.int32)
    if not _is_traced(cache, src, dst, n) and not 0 <= int(n) <= int(src_len):
        raise ValueError(
            f"share_prefix: n_tokens={int(n)} must lie in [0, length of row "
            f"{int(src)} = {int(src_len)}]"
        )
    n = jnp.clip(n, 0, src_len)
    cache = free(cache, dst)
    P, page = cache.num_pages, cache.page_size
    shared = jnp.where(jnp.arange(M) < _cdiv(n, page), cache.block_tables[src], NO_PAGE)  # [M]
    ok = (shared >= 0) & (shared < P)
    refcount = cache.refcount.at[jnp.where(ok, shared, P)].add(jnp.sum(dst), mode="drop")
    tables = jnp.where(dst[:, None], shared[None, :], cache.block_tables)
    return cache.replace(
        block_tables=tables, refcount=refcount, lengths=jnp.where(dst, n, cache.lengths)
    )


def evict_pages(cache: PagedKVCache, drop) -> PagedKVCache:
    """Page-granular eviction: drop [B, M] table entries (tokens there are no longer attended;
    lengths and positions of the remaining tokens do not change)."""
    return _release(cache, jnp.asarray(drop, bool))


def window_span(window: int, page: int) -> int:
    """The most pages `window` consecutive tokens can touch."""
    return (window + page - 2) // page + 1


def window_pages(lengths, max_pages: int, page: int, window: int, sinks: int = 0):
    """[B, M] bool: table slots holding one of the first `sinks` tokens or one of the last
    `window` of `lengths` [B] tokens (the pages `window_evict` keeps)."""
    j = jnp.arange(max_pages)[None, :]  # [1, M]
    recent = (j + 1) * page > (lengths - window)[:, None]
    return recent | (j * page < sinks)


def window_evict(cache: PagedKVCache, window: int, sinks: int = 0, rows=None) -> PagedKVCache:
    """Keep, per row, the pages holding the first `sinks` tokens and the last `window` tokens
    (window: sinks=0; StreamingLLM: sinks>0). Page-granular, so up to page-1 extra recent tokens
    stay attended; the pool then holds at most cdiv(sinks, page) + cdiv(window, page) + 1 pages
    per row. rows [B] bool limits it to some rows (default: all)."""
    drop = ~window_pages(cache.lengths, cache.max_pages, cache.page_size, window, sinks)
    if rows is not None:
        drop = drop & jnp.asarray(rows, bool)[:, None]
    return evict_pages(cache, drop)


# --------------------------------------------------------------------------- host checks


def invariant_errors(cache: PagedKVCache) -> list[str]:
    """Host-side audit: every table id lies in the pool (or is NO_PAGE), each page's refcount
    equals the table entries pointing at it, lengths lie in [0, max_len]."""
    bt, ln = np.asarray(cache.block_tables), np.asarray(cache.lengths)
    rc, P = np.asarray(cache.refcount), cache.num_pages
    errs = []
    bad = (bt < NO_PAGE) | (bt >= P)
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        errs.append(f"block_tables[{b}, {j}] = {bt[b, j]} outside the pool of {P} pages")
    refs = np.bincount(bt[(bt >= 0) & (bt < P)], minlength=P)
    if (refs != rc).any():
        p = int(np.flatnonzero(refs != rc)[0])
        errs.append(f"page {p}: refcount {rc[p]} but {refs[p]} table references")
    if (ln < 0).any() or (ln > cache.max_len).any():
        errs.append(f"lengths {ln.tolist()} outside [0, max_len={cache.max_len}]")
    return errs


def check(cache: PagedKVCache) -> None:
    """Raise `PagedCacheError` for preempted rows or broken invariants (call on the host)."""
    pre = np.flatnonzero(np.asarray(cache.preempted))
    if pre.size:
        raise PagedCacheError(
            f"rows {pre.tolist()} were preempted: the pool ran out of pages (or a row reached "
            f"max_len={cache.max_len}); their last outputs are not valid. Free rows or use a "
            "bigger pool"
        )
    errs = invariant_errors(cache)
    if errs:
        raise PagedCacheError("; ".join(errs))


def memory_stats(cache: PagedKVCache) -> dict:
    """Host-side occupancy: pages in use, distinct token slots filled, and the waste (allocated
    slots holding no token) of the pages in use."""
    ln, bt = np.asarray(cache.lengths), np.asarray(cache.block_tables)
    page, P = cache.page_size, cache.num_pages
    j = np.arange(bt.shape[1])[None, :]
    fill = np.clip(ln[:, None] - j * page, 0, page)  # [B, M] tokens in each table entry
    ok = (bt >= 0) & (bt < P)
    filled = np.zeros(P, np.int64)
    np.maximum.at(filled, bt[ok], fill[ok])
    pages_used = int(np.sum(np.asarray(cache.refcount) > 0))
    return {
        "page_size": page,
        "pages_used": pages_used,
        "logical_tokens": int(ln.sum()),
        "stored_tokens": int(filled.sum()),
        "slots_allocated": pages_used * page,
        "bytes_used": pages_used * cache.page_nbytes(),
        "waste": 1.0 - int(filled.sum()) / max(1, pages_used * page),
    }


# --------------------------------------------------------------------------- model integration
# `PagedLayout(...).init(cfg, batch, policy, fmt, max_len)` builds a `PagedCache`: the cache the
# model's `forward` drives through the same protocol as the dense `KVCache` (see kvjax/cache.py).

PAGED_POLICIES = ("full", "window", "streaming")
PAGED_FORMATS = ("f32", "bf16", "int8", "int4")
IMPLS = ("reference", "pallas")


def page_kind(fmt) -> tuple[str, int, int | None]:
    """(page kind, int4 key group, int4 value group) storing a kvjax.formats format in pages,
    or a ValueError naming what pages support."""
    name = getattr(fmt, "name", fmt)
    if name in ("f32", "bf16", "int8"):
        return name, 32, None
    if name == "int4" and getattr(fmt, "key_mode", "token") == "token":
        return "int4", fmt.group, getattr(fmt, "value_group", None)
    if name == "int4":
        raise ValueError(
            "kv format int4 with key_mode='channel' (per-channel KIVI keys) does not fit "
            "pages: the paged kernel reads whole tokens, so paged int4 quantizes keys per token; "
            "pass key_mode='token' (run.py: +kv_options.key_mode=token) or use layout='dense'"
        )
    raise ValueError(
        f"kv format {name!r} is not supported on the paged layout; supported: "
        f"{', '.join(PAGED_FORMATS)} (int4 with key_mode='token'); use layout='dense' for {name!r}"
    )


def eviction_rule(policy) -> tuple[int, int] | None:
    """(window, sinks) of the page-granular rule for a policy, None for no eviction."""
    name = policy.name
    if name not in PAGED_POLICIES:
        raise ValueError(
            f"policy {name!r} is not supported on the paged layout (a page holds every kv head, "
            "so only position-based, page-granular eviction maps onto it); supported on paged: "
            f"{', '.join(PAGED_POLICIES)}; use layout='dense' for {name!r}"
        )
    if name == "full" or policy.budget is None:
        return None
    if name == "window":
        return policy.budget, 0
    return policy.budget - policy.n_sink, policy.n_sink


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """The paged layout: a pool of `num_pages` pages of `page_size` tokens shared by the rows.

    impl: "reference" (gathered pages + kvjax.attention) or "pallas" (the paged kernel for
    decode steps, T = 1; chunks of T > 1 use the reference). interpret: run the kernel in
    Pallas interpret mode (None: on anything but a GPU). num_pages None: enough pages that no
    row ever waits (`pages_per_row` each). probs: also return the attention mass (no paged
    policy reads it; for inspection and future page-level scoring).
    """

    name: ClassVar[str] = "paged"
    page_size: int = 16
    num_pages: int | None = None
    impl: str = "reference"
    interpret: bool | None = None
    num_splits: int | None = None
    probs: bool = False

    def __post_init__(self):
        check_page_size(self.page_size)
        if self.impl not in IMPLS:
            raise ValueError(f"attention impl {self.impl!r} is not one of {IMPLS}")
        n = self.num_pages
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_pages={n!r} must be a positive integer or None (auto)")

    def validate(self, policy, fmt, max_len: int) -> None:
        """Raise a ValueError naming what the paged layout supports, before any model work."""
        eviction_rule(policy)
        page_kind(fmt)
        policy.validate(max_len)

    def pages_per_row(self, policy, max_len: int) -> int:
        """Pages one row can hold at once: all of max_len without eviction; with a window W and
        sinks S, the sink pages plus the pages W consecutive tokens can span, whatever the
        chunk size (pages a chunk pushes out are reused within the same call)."""
        M = _cdiv(max_len, self.page_size)
        rule = eviction_rule(policy)
        if rule is None:
            return M
        window, sinks = rule
        return min(M, _cdiv(sinks, self.page_size) + window_span(window, self.page_size))

    def init(self, cfg, batch: int, policy, fmt, max_len: int | None = None) -> PagedCache:
        """An empty paged cache for `batch` rows of up to `max_len` tokens."""
        max_len = cfg.max_seq_len if max_len is None else max_len
        self.validate(policy, fmt, max_len)
        kind, group, value_group = page_kind(fmt)
        n = self.num_pages or batch * self.pages_per_row(policy, max_len)
        pages = PagedKVCache.init(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, batch, n, self.page_size, max_len, kind,
            group, value_group=value_group,
        )
        return PagedCache(
            pages=pages,
            read_tables=pages.block_tables,
            granted=jnp.zeros((batch,), jnp.int32),
            cow=jnp.full((2, batch), n, jnp.int32),
            nonfinite=jnp.zeros((cfg.n_layers,), bool),
            policy=policy,
            fmt=fmt,
            layout=self,
            max_len=max_len,
        )

    def abstract(self, cfg, batch: int, policy, fmt, max_len: int | None = None) -> PagedCache:
        """Shapes and dtypes without allocating."""
        return jax.eval_shape(lambda: self.init(cfg, batch, policy, fmt, max_len))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedView:
    """What one layer's attention needs of a paged cache: the layer index (pools stay whole)."""

    layer: jax.Array


@struct.dataclass
class PagedCache:
    """A `PagedKVCache` driven by the model through the cache protocol.

    Per forward call: `begin` (once, outside the layer scans) releases the pages the rule drops
    once the chunk is in and reserves pages for the chunk's kept tokens; per layer, `attend`
    reads the pool through the tables as they were before `begin` and `update` returns the keys
    and values to store; a second scan `store`s them (copy-on-write copies first); `finish`
    advances the lengths.

    Eviction rule (window W = budget, sinks 0; streaming W = budget - n_sink, sinks = n_sink):
    after each forward call a row keeps the pages holding its first `sinks` tokens and every
    page holding one of its last W tokens, so between W and W + page - 1 recent tokens stay
    attended (the dense window attends exactly W). A chunk's tokens whose page would not be
    kept are never stored. Keys are stored rotated at their absolute positions; for streaming
    with rope="cache" the sink pages' keys are re-rotated by the evicted count when read
    (RoPE scores depend only on position differences, so the other keys need no change).
    A preempted row (pool too small) may also have lost its oldest window pages.
    """

    pages: PagedKVCache
    read_tables: jax.Array  # [B, M] the block tables attention reads this call (before `begin`)
    granted: jax.Array  # [B] tokens this forward call stores per row (set by `begin`)
    cow: jax.Array  # [2, B] copy-on-write page pairs (src, dst; P = none) `store` copies
    nonfinite: jax.Array  # [L] NaN/inf reached a layer's write
    policy: Any = struct.field(pytree_node=False)
    fmt: Any = struct.field(pytree_node=False)
    layout: PagedLayout = struct.field(pytree_node=False)
    max_len: int = struct.field(pytree_node=False)

    @property
    def length(self) -> jax.Array:
        return self.pages.lengths

    @property
    def capacity(self) -> int:
        """Tokens the policy keeps per row (its budget; max_len for `full`)."""
        return self.policy.capacity(self.max_len)

    @property
    def rule(self):
        return eviction_rule(self.policy)

    @property
    def interpret(self) -> bool:
        if self.layout.interpret is None:
            return jax.default_backend() != "gpu"
        return self.layout.interpret

    def segments(self):
        """One group of layers: the pool is shared by all of them."""
        return ((0, self.nonfinite.shape[0], self),)

    def join(self, caches) -> PagedCache:
        (cache,) = caches
        return cache

    def nbytes(self) -> int:
        """Real bytes of every buffer: page pools (scales included), tables, allocator state."""
        return self.pages.nbytes() + _nbytes(
            (self.read_tables, self.granted, self.cow, self.nonfinite)
        )

    def kv_nbytes(self) -> int:
        """Bytes of the k/v page pools (format metadata included)."""
        return self.pages.kv_nbytes()

    def memory_stats(self) -> dict:
        """Host-side occupancy of the pool (pages used, tokens held, waste)."""
        return memory_stats(self.pages)

    def check_finite(self) -> None:
        """Raise on the host for NaN/inf keys/values or preempted rows / broken tables."""
        check_nonfinite(self.nonfinite)
        check(self.pages)

    def share_prefix(self, src, dst, n_tokens=None) -> PagedCache:
        """Rows dst [B] bool share row src's first n_tokens tokens (`share_prefix`)."""
        pages = share_prefix(self.pages, src, dst, n_tokens)
        return self.replace(pages=pages, read_tables=pages.block_tables)

    def free(self, rows) -> PagedCache:
        """End the sequences in rows [B] bool; their pages return to the pool (`free`)."""
        pages = free(self.pages, rows)
        return self.replace(pages=pages, read_tables=pages.block_tables)

    # ---- the protocol `kvjax.model.forward` calls

    def _keep(self, lengths):
        """[B, M] table slots held once rows have `lengths` tokens (None: keep everything)."""
        if self.rule is None:
            return None
        window, sinks = self.rule
        return window_pages(lengths, self.pages.max_pages, self.pages.page_size, window, sinks)

    def begin(self, n_valid) -> PagedCache:
        """Release the pages the rule drops once this chunk's n_valid [B] tokens are in, then
        reserve pages for the tokens it keeps. Attention still reads the released pages
        (through `read_tables`): the pool is written only in the write scan, after every read,
        so a page freed and reused within one call is overwritten only after it was read.
        Copy-on-write is deferred to `store` for the same reason."""
        with jax.named_scope("page_reserve"):
            pages = self.pages
            keep = self._keep(pages.lengths + n_valid)
            if keep is not None:
                pages = _release(pages, ~keep)
            pages, granted, (src, dst) = reserve(pages, n_valid, keep, defer_copy=True)
        return self.replace(
            pages=pages, read_tables=self.pages.block_tables, granted=granted,
            cow=jnp.stack([src, dst]),
        )

    def layer_view(self, layer) -> PagedView:
        return PagedView(layer=layer)

    def _shift(self):
        """[B] tokens evicted from each row (streaming rope="cache" only, else None)."""
        if self.policy.name != "streaming" or self.policy.rope != "cache" or self.rule is None:
            return None
        page, P = self.pages.page_size, self.pages.num_pages
        bt, ln = self.read_tables, self.pages.lengths
        j = jnp.arange(self.pages.max_pages)[None, :]  # [1, M]
        fill = jnp.clip(ln[:, None] - j * page, 0, page)  # [B, M] tokens in each table slot
        held = jnp.sum(jnp.where((bt >= 0) & (bt < P), fill, 0), axis=1)  # [B]
        return ln - held

    def _sink_pages(self) -> int:
        return _cdiv(self.rule[1], self.pages.page_size) if self.rule else 0

    def held_table(self, sinks: bool = True):
        """The table slots attention reads, compacted to what the rule can hold.

        Returns (table [B, R] page ids, n [B] tokens, start [B, R] position of each slot's first
        token): token c of the compact table is token c % page of page table[b, c // page], and
        tokens c < n[b] are exactly the row's held tokens in position order. Without eviction
        this is the block table (R = M). With a window rule it is the sink slots (when `sinks`)
        followed by R_w = `window_span(W, page)` slots from the first recent page, so attention
        reads O(W) tokens, not O(length).
        """
        pg = self.pages
        page, M = pg.page_size, pg.max_pages
        bt, ln = self.read_tables, pg.lengths
        if self.rule is None:
            return bt, ln, jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32) * page, bt.shape)
        window, _ = self.rule
        sp = self._sink_pages()
        rw = min(M, window_span(window, page))
        j0 = jnp.clip(jnp.maximum(sp, (ln - window) // page), 0, M)  # [B] first recent page
        jr = j0[:, None] + jnp.arange(rw, dtype=jnp.int32)[None, :]  # [B, R_w]
        table = jnp.where(jr < M, jnp.take_along_axis(bt, jnp.clip(jr, 0, M - 1), 1), NO_PAGE)
        n = jnp.clip(ln - j0 * page, 0, rw * page)  # [B] tokens in the recent slots
        start = jr * page
        if sinks and sp:
            table = jnp.concatenate([bt[:, :sp], table], axis=1)  # [B, sp + R_w]
            n = jnp.minimum(ln, sp * page) + n
            start = jnp.concatenate([jnp.broadcast_to(jnp.arange(sp) * page, (ln.shape[0], sp)),
                                     start], axis=1).astype(jnp.int32)
        return table, n, start

    def attend(self, view: PagedView, q, k, v, pos_new, rope_theta: float):
        """Attention of a chunk over the held pages plus the chunk itself (causal).

        q [B, T, H, E], k, v [B, T, K, E] unrotated; pos_new [B, T] (-1 = padding). Returns
        out [B, T, H, E] and probs [B, K, T, R*page + T]: the tokens of `held_table()`, then
        the chunk (on the kernel path None unless the layout sets probs=True).
        """
        q = rope(q, pos_new[:, :, None], rope_theta)  # [B, T, H, E]
        k = rope(k, pos_new[:, :, None], rope_theta)  # [B, T, K, E]
        shift = self._shift()
        if q.shape[1] == 1 and self.layout.impl == "pallas":
            return self._attend_kernel(view.layer, q, k, v, pos_new, shift, rope_theta)
        return self._attend_gathered(view.layer, q, k, v, pos_new, shift, rope_theta)

    def _attend_gathered(self, layer, q, k, v, pos_new, shift, rope_theta):
        """Reference path: gather the held pages densely, then `kvjax.attention.attention`."""
        pg = self.pages
        table, n, start = self.held_table()  # [B, R], [B], [B, R]
        k_c = gather_pages(pg.k, table, layer)  # [B, K, N, E], N = R * page
        v_c = gather_pages(pg.v, table, layer)
        B, K, N, _ = k_c.shape
        c = jnp.arange(N, dtype=jnp.int32)
        ok = jnp.repeat((table >= 0) & (table < pg.num_pages), pg.page_size, axis=1)  # [B, N]
        ok = ok & (c[None, :] < n[:, None])
        pos_c = jnp.repeat(start, pg.page_size, axis=1) + c % pg.page_size  # [B, N]
        pos_c = jnp.broadcast_to(jnp.where(ok, pos_c, -1)[:, None, :], (B, K, N))  # [B, K, N]
        if shift is not None:  # sink pages: keys re-rotated by the evicted count
            ns = self._sink_pages() * pg.page_size
            sk = rope(k_c[:, :, :ns], jnp.broadcast_to(shift[:, None, None], (B, K, ns)),
                      rope_theta)
            k_c = k_c.at[:, :, :ns].set(sk)
        return attention(q, k, v, pos_new, k_c, v_c, pos_c)

    def _attend_kernel(self, layer, q, k, v, pos_new, shift, rope_theta):
        """Decode path: the Pallas kernel over the held pages, merged with the token itself
        (and, for re-rotated sinks, the sink pages) through the kernel's log-sum-exp."""
        pg = self.pages
        B, _, H, E = q.shape
        K = k.shape[2]
        G = H // K
        qg = q[:, 0].reshape(B, K, G, E).astype(jnp.float32)  # [B, K, G, E]
        xk = jnp.swapaxes(k, 1, 2).astype(jnp.float32)  # [B, K, 1, E] extra keys: the token
        xv = jnp.swapaxes(v, 1, 2).astype(jnp.float32)  # [B, K, 1, E]
        x_ok = jnp.ones((B, 1), bool)  # [B, X]
        table, n, _ = self.held_table(sinks=shift is None)  # [B, R], [B]
        n_sink = 0
        if shift is not None:  # sink pages leave the kernel: read, re-rotate, score here
            sp = self._sink_pages()
            n_sink = sp * pg.page_size
            bt = self.read_tables[:, :sp]  # [B, sp]
            sk = gather_pages(pg.k, bt, layer)  # [B, K, n_sink, E]
            sv = gather_pages(pg.v, bt, layer)
            sk = rope(sk, jnp.broadcast_to(shift[:, None, None], sk.shape[:3]), rope_theta)
            s_ok = jnp.repeat((bt >= 0) & (bt < pg.num_pages), pg.page_size, axis=1)
            s_ok = s_ok & (jnp.arange(n_sink)[None, :] < pg.lengths[:, None])  # [B, n_sink]
            xk = jnp.concatenate([sk, xk], axis=2)  # [B, K, X, E]
            xv = jnp.concatenate([sv, xv], axis=2)
            x_ok = jnp.concatenate([s_ok, x_ok], axis=1)
        s_x = jnp.einsum("BKGE,BKXE->BKGX", qg, xk) * (E**-0.5)  # [B, K, G, X]
        s_x = jnp.where(x_ok[:, None, None, :], s_x, -jnp.inf)
        lse_x = jax.nn.logsumexp(s_x, axis=-1)  # [B, K, G]
        outs = paged_attention(
            q[:, 0], pg.k, pg.v, table, n, layer=layer, extra_lse=lse_x.reshape(B, H),
            return_lse=True, return_mass=self.layout.probs, num_splits=self.layout.num_splits,
            interpret=self.interpret,
        )
        o, lse = outs[0], outs[-1]  # [B, H, E], [B, H]
        p_x = jnp.exp(s_x - lse.reshape(B, K, G)[..., None])  # [B, K, G, X]
        out = o.reshape(B, K, G, E).astype(jnp.float32)
        out = out + jnp.einsum("BKGX,BKXE->BKGE", p_x, xv)  # [B, K, G, E]
        out = out.reshape(B, 1, H, E).astype(q.dtype)
        if not self.layout.probs:
            return out, None
        q_ok = (pos_new >= 0)[:, None, :, None]  # [B, 1, 1, 1]
        p_x = p_x.sum(axis=2)  # [B, K, X]
        probs = jnp.concatenate([p_x[..., :n_sink], outs[1], p_x[..., -1:]], axis=-1)
        return out, jnp.where(q_ok, probs[:, :, None, :], 0.0)  # [B, K, 1, N + 1]

    def update(self, view: PagedView, k, v, pos_new, probs, rope_theta: float):
        """What to store: keys rotated at their absolute positions, and values."""
        return rope(k, pos_new[:, :, None], rope_theta), v

    def store(self, layer, update, pos_new) -> PagedCache:
        """Write one layer's chunk into its reserved pages (inside the write-only scan)."""
        k, v = update
        with jax.named_scope("cache_update"):
            t = jnp.arange(k.shape[1])[None, :]
            stored = (t < self.granted[:, None])[:, :, None, None]  # [B, T, 1, 1]
            bad = ~jnp.all(jnp.where(stored, jnp.isfinite(k) & jnp.isfinite(v), True))
            keep = self._keep(self.pages.lengths + self.granted)
            pages = copy_pages(self.pages, layer, self.cow[0], self.cow[1])
            pages = write(pages, layer, k, v, self.granted, keep)
            return self.replace(
                pages=pages, nonfinite=self.nonfinite.at[layer].set(self.nonfinite[layer] | bad)
            )

    def finish(self, n_valid) -> PagedCache:
        """Count the stored tokens (the rule's pages were released in `begin`)."""
        pages = advance(self.pages, self.granted)
        return self.replace(
            pages=pages, read_tables=pages.block_tables, granted=jnp.zeros_like(self.granted),
            cow=jnp.full_like(self.cow, pages.num_pages),
        )


__all__ = [
    "IMPLS",
    "KINDS",
    "NO_PAGE",
    "PAGED_FORMATS",
    "PAGED_POLICIES",
    "VALID_PAGE_SIZES",
    "OutOfPagesError",
    "PagedCache",
    "PagedCacheError",
    "PagedKVCache",
    "PagedLayout",
    "advance",
    "append",
    "attend",
    "check",
    "copy_pages",
    "evict_pages",
    "eviction_rule",
    "free",
    "gather",
    "invariant_errors",
    "memory_stats",
    "page_kind",
    "pages_needed",
    "reserve",
    "share_prefix",
    "window_evict",
    "window_pages",
    "window_span",
    "write",
]
