"""The paged KV cache's allocator: a page pool per layer, per-row block tables, reserving,
freeing, prefix sharing with reference counts and copy-on-write, invariants and memory stats.

Layout (one block table serves every layer, as in vLLM):

    k, v          page stores, leaves [L, K, P, page, X]   (a format's `PageCodec` encodes them)
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

The model-facing cache built on this (`PagedLayout`, `PagedCache`) is kvjax/paged.py.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.formats import FORMATS, KVFormat, PageCodec, store_nbytes
from kvjax.kernels.paged_attention import (
    NO_PAGE,
    VALID_PAGE_SIZES,
    check_page_size,
    gather_pages,
    paged_attention,
    paged_attention_reference,
)


class OutOfPagesError(RuntimeError):
    """The pool has too few free pages (or a row's block table too few slots) for a request."""


class PagedCacheError(RuntimeError):
    """A paged cache broke an invariant (preempted rows, bad block tables, wrong refcounts)."""


def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))


def cdiv(a, b):
    """Ceiling division (ints or arrays)."""
    return (a + b - 1) // b


def page_codecs(fmt: KVFormat) -> tuple[PageCodec, PageCodec]:
    """The key and value page codecs of a kv format, or a ValueError naming the registered
    formats that declare one (asked through the protocol, `KVFormat.page_codec`)."""
    codecs = (fmt.page_codec("k"), fmt.page_codec("v"))
    if None in codecs:
        ok = [name for name, cls in FORMATS.items() if cls.page_codec is not KVFormat.page_codec]
        raise ValueError(
            f"kv format {fmt.name!r} is not supported on the paged layout (it declares no page "
            f"codec); supported: {', '.join(ok)}; use layout='dense' for {fmt.name!r}"
        )
    return codecs


@struct.dataclass
class PagedKVCache:
    """Page pool + block tables + allocator state (see the module docstring for shapes)."""

    k: Any
    v: Any
    block_tables: jax.Array
    lengths: jax.Array
    refcount: jax.Array
    preempted: jax.Array
    k_codec: PageCodec = struct.field(pytree_node=False)
    v_codec: PageCodec = struct.field(pytree_node=False)

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
        fmt: KVFormat,
    ) -> PagedKVCache:
        """An empty cache: `num_pages` pages of `page_size` tokens, rows of up to `max_len`,
        keys and values stored by the kv format's page codecs."""
        check_page_size(page_size)
        k_codec, v_codec = page_codecs(fmt)
        if num_pages < 1 or batch < 1 or max_len < 1:
            raise ValueError(
                f"need num_pages, batch, max_len >= 1, got {num_pages}, {batch}, {max_len}"
            )
        shape = (n_layers, n_kv_heads, num_pages, page_size, head_dim)
        M = cdiv(max_len, page_size)
        return cls(
            k=k_codec.zeros(shape),
            v=v_codec.zeros(shape),
            block_tables=jnp.full((batch, M), NO_PAGE, jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            refcount=jnp.zeros((num_pages,), jnp.int32),
            preempted=jnp.zeros((batch,), bool),
            k_codec=k_codec,
            v_codec=v_codec,
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
        return store_nbytes(
            (self.k, self.v, self.block_tables, self.lengths, self.refcount, self.preempted)
        )

    def kv_nbytes(self) -> int:
        """Bytes of the k/v page pools alone."""
        return store_nbytes((self.k, self.v))

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
        (j >= (ln // page)[:, None]) & (j < cdiv(new_len, page)[:, None]) & (n_new[:, None] > 0)
    )  # [B, M]
    ids = cache.block_tables  # [B, M]
    valid = (ids >= 0) & (ids < P)
    shared = cache.refcount[jnp.clip(ids, 0, P - 1)] > 1
    fits = cdiv(new_len, page) <= M  # [B]
    if keep is not None:
        in_range = in_range & keep
    return in_range & (~valid | shared), fits


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


def _fresh_ids(cache: PagedKVCache, req):
    """Free page ids for the table entries req [B, M] (row-major order, ascending ids; P where
    req is unset or the pool has run out)."""
    P = cache.num_pages
    rank = jnp.cumsum(req.reshape(-1)).reshape(req.shape) - 1  # [B, M]
    free_list = jnp.nonzero(cache.refcount == 0, size=P, fill_value=P)[0]  # [P] ascending
    return jnp.where(req & (rank < P), free_list[jnp.clip(rank, 0, P - 1)], P)  # [B, M]


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
    new_ids = _fresh_ids(cache, req)  # [B, M], P = none

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

    def put(store, x, codec):
        enc = codec.encode(x)  # leaves [B, T, K, X]
        return jax.tree.map(
            lambda s, e: s.at[layer, kh, slot, off].set(e.astype(s.dtype), mode="drop"), store, enc
        )

    return cache.replace(k=put(cache.k, k_new, cache.k_codec), v=put(cache.v, v_new, cache.v_codec))


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
    shared = jnp.where(jnp.arange(M) < cdiv(n, page), cache.block_tables[src], NO_PAGE)  # [M]
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


# --------------------------------------------------------------------------- swapping


def swap_out(cache: PagedKVCache, row: int):
    """Take the pages only `row` holds (refcount 1) out of the pool (eager, on the host side):
    their table entries become NO_PAGE and the pages return to the pool; pages the row shares
    (a prefix) stay. The row keeps its length and must not run until `swap_in`. Returns
    (cache, swapped): swapped = (slots [n] table slots, k, v page stores [L, K, n, page, X])
    for the caller to keep (e.g. in host memory)."""
    bt, rc = np.asarray(cache.block_tables[row]), np.asarray(cache.refcount)
    slots = np.flatnonzero((bt >= 0) & (bt < cache.num_pages))
    slots = slots[rc[bt[slots]] == 1]
    ids = jnp.asarray(bt[slots], jnp.int32)
    k, v = (jax.tree.map(lambda x: x[:, :, ids], s) for s in (cache.k, cache.v))
    drop = np.zeros(cache.block_tables.shape, bool)
    drop[row, slots] = True
    return _release(cache, jnp.asarray(drop)), (slots, k, v)


def swap_in(cache: PagedKVCache, row: int, swapped) -> PagedKVCache:
    """Put pages taken by `swap_out` back into `row` (eager): fresh pages from the pool for its
    swapped table slots, their contents written back. Raises `OutOfPagesError` when the pool
    has too few free pages."""
    slots, k, v = swapped
    free = int(np.sum(np.asarray(cache.refcount) == 0))
    if len(slots) > free:
        raise OutOfPagesError(
            f"swap_in: row {row} needs {len(slots)} pages back, {free} of {cache.num_pages} are "
            "free; free or swap out other rows first"
        )
    want = np.zeros(cache.block_tables.shape, bool)
    want[row, slots] = True
    ids = _fresh_ids(cache, jnp.asarray(want))  # [B, M]
    new = ids[row, jnp.asarray(slots, jnp.int32)]  # [n]

    def put(store, got):
        return jax.tree.map(lambda x, g: x.at[:, :, new].set(g.astype(x.dtype)), store, got)

    return cache.replace(
        k=put(cache.k, k), v=put(cache.v, v),
        block_tables=jnp.where(want, ids, cache.block_tables),
        refcount=cache.refcount.at[new].add(1),
    )


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


__all__ = [
    "NO_PAGE",
    "VALID_PAGE_SIZES",
    "OutOfPagesError",
    "PagedCacheError",
    "PagedKVCache",
    "advance",
    "append",
    "attend",
    "cdiv",
    "check",
    "copy_pages",
    "evict_pages",
    "free",
    "gather",
    "invariant_errors",
    "memory_stats",
    "page_codecs",
    "reserve",
    "share_prefix",
    "swap_in",
    "swap_out",
    "window_evict",
    "window_pages",
    "window_span",
    "write",
]
