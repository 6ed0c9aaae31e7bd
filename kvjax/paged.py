"""The paged layout as the model sees it: `PagedLayout` builds a `PagedCache`, which the model's
`forward` drives through the same protocol as the dense `KVCache` (kvjax/cache.py).

The pool, block tables and allocator are kvjax/pages.py; what a policy keeps comes from its
`page_rule()` (kvjax.policies.base.PageRule) and how keys and values are stored from the
format's page codecs (`fmt.page_codec(kind)`), so a new policy or format never touches this
file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention import attention, rope
from kvjax.cache import check_nonfinite, store_by_layer
from kvjax.formats import store_nbytes
from kvjax.kernels.paged_attention import (
    NO_PAGE,
    check_page_size,
    gather_pages,
    paged_attention,
)
from kvjax.pages import (
    PagedKVCache,
    advance,
    cdiv,
    check,
    copy_pages,
    evict_pages,
    free,
    memory_stats,
    page_codecs,
    reserve,
    share_prefix,
    window_pages,
    window_span,
    write,
)
from kvjax.policies import POLICIES, Policy
from kvjax.policies.base import PageRule

IMPLS = ("reference", "pallas")


def page_rule(policy: Policy) -> PageRule:
    """The policy's `page_rule()`, or a ValueError naming the registered policies that declare
    one (asked through the protocol, `Policy.page_rule`)."""
    rule = policy.page_rule()
    if rule is None and policy.mode != "evict":
        raise ValueError(
            f"policy {policy.name!r} with mode={policy.mode!r} is not supported on the paged "
            "layout (pages evict by position at every step: mode='evict'); use layout='dense' "
            "for compress mode"
        )
    if rule is None:
        ok = sorted(name for name, cls in POLICIES.items()
                    if cls.page_rule is not Policy.page_rule)
        raise ValueError(
            f"policy {policy.name!r} is not supported on the paged layout (a page holds every kv "
            "head, so only position-based, page-granular eviction maps onto it, and the policy "
            f"declares no page rule); supported on paged: {', '.join(ok)}; use layout='dense' for "
            f"{policy.name!r}"
        )
    return rule


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
        page_rule(policy)
        page_codecs(fmt)
        policy.validate(max_len)

    def check_pool(self, policy, max_len: int) -> None:
        """Raise a ValueError when a fixed pool cannot hold even one row (a run would stop with
        every row preempted); smaller pools are for the server and tests, not for a point."""
        need = self.pages_per_row(policy, max_len)
        if self.num_pages is not None and self.num_pages < need:
            raise ValueError(
                f"num_pages={self.num_pages} ({self.num_pages * self.page_size} slots) cannot "
                f"hold one row: policy {policy.name!r} with max_len={max_len} needs {need} pages "
                f"of {self.page_size}; use num_pages >= {need} per row, or null (enough for "
                "every row)")

    def notes(self, policy) -> tuple[str, ...]:
        """Where a point on pages differs from the dense layout's (the run prints them): whole
        sink pages stay attended; the Pallas kernel serves one-token steps only."""
        out = []
        rule = page_rule(policy)
        if rule.sinks % self.page_size:
            kept = cdiv(rule.sinks, self.page_size) * self.page_size
            out.append(f"paged: the pages holding the first {rule.sinks} (sink) tokens stay "
                       f"whole, so the first {kept} tokens stay attended (the dense layout "
                       f"keeps {rule.sinks}); sinks that fill whole pages "
                       f"({self.page_size}) match it")
        if self.impl == "pallas":
            out.append("cache.impl=pallas: the kernel runs for one-token steps (decode, "
                       "task.chunk=1); a forward over more tokens (prefill, chunks) uses the "
                       "reference attention")
        return tuple(out)

    def pages_per_row(self, policy, max_len: int) -> int:
        """Pages one row can hold at once: all of max_len without eviction; with a window W and
        sinks S, the sink pages plus the pages W consecutive tokens can span, whatever the
        chunk size (pages a chunk pushes out are reused within the same call)."""
        M = cdiv(max_len, self.page_size)
        rule = page_rule(policy)
        if rule.window is None:
            return M
        return min(M, cdiv(rule.sinks, self.page_size) + window_span(rule.window, self.page_size))

    def init(self, cfg, batch: int, policy, fmt, max_len: int | None = None) -> PagedCache:
        """An empty paged cache for `batch` rows of up to `max_len` tokens."""
        max_len = cfg.max_seq_len if max_len is None else max_len
        self.validate(policy, fmt, max_len)
        n = self.num_pages or batch * self.pages_per_row(policy, max_len)
        pages = PagedKVCache.init(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, batch, n, self.page_size, max_len, fmt
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
    and values to store; `store_layers` scans `store` over them (copy-on-write copies first);
    `finish` advances the lengths.

    Eviction follows the policy's `PageRule` (window W, sinks; e.g. window: W = budget, sinks 0;
    streaming: W = budget - n_sink, sinks = n_sink): after each forward call a row keeps the
    pages holding its first `sinks` tokens and every page holding one of its last W tokens, so
    between W and W + page - 1 recent tokens stay attended (the dense window attends exactly
    W). A chunk's tokens whose page would not be kept are never stored. Keys are stored rotated
    at their absolute positions; when the rule rotates at positions within the cache
    (`rope_in_cache`, streaming rope="cache") the sink pages' keys are re-rotated by the
    evicted count when read (RoPE scores depend only on position differences, so the other
    keys need no change). A preempted row (pool too small) may also have lost its oldest
    window pages.
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
    def rule(self) -> PageRule:
        """What the policy keeps on pages (its `page_rule()`)."""
        return page_rule(self.policy)

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
        return self.pages.nbytes() + store_nbytes(
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
        return self.replace_pages(share_prefix(self.pages, src, dst, n_tokens))

    def free(self, rows) -> PagedCache:
        """End the sequences in rows [B] bool; their pages return to the pool (`free`)."""
        return self.replace_pages(free(self.pages, rows))

    def rows(self, idx) -> PagedCache:
        """Rows idx [b] int32 alone, over the whole pool (run `forward` on it, put it back with
        `set_rows`: a prefill of one request costs its own tokens, not the batch's)."""
        idx = jnp.asarray(idx, jnp.int32)
        pg = self.pages
        pages = pg.replace(block_tables=pg.block_tables[idx], lengths=pg.lengths[idx],
                           preempted=pg.preempted[idx])
        return self.replace(pages=pages, read_tables=self.read_tables[idx],
                            granted=self.granted[idx], cow=self.cow[:, idx])

    def set_rows(self, idx, sub) -> PagedCache:
        """This cache's rows idx [b] replaced by `sub` (from `rows`), with sub's pool (the
        newer one: sub's forward allocated from and wrote into it)."""
        idx = jnp.asarray(idx, jnp.int32)
        pg, sp = self.pages, sub.pages
        pages = sp.replace(block_tables=pg.block_tables.at[idx].set(sp.block_tables),
                           lengths=pg.lengths.at[idx].set(sp.lengths),
                           preempted=pg.preempted.at[idx].set(sp.preempted))
        return self.replace(pages=pages, read_tables=self.read_tables.at[idx].set(sub.read_tables),
                            granted=self.granted.at[idx].set(sub.granted),
                            cow=self.cow.at[:, idx].set(sub.cow), nonfinite=sub.nonfinite)

    def replace_pages(self, pages: PagedKVCache) -> PagedCache:
        """This cache over `pages`, reading through their block tables (after `free`,
        `share_prefix`, `kvjax.pages.swap_out` / `swap_in`)."""
        return self.replace(pages=pages, read_tables=pages.block_tables)

    # ---- the protocol `kvjax.model.forward` calls

    def _keep(self, lengths):
        """[B, M] table slots held once rows have `lengths` tokens (None: keep everything)."""
        rule = self.rule
        if rule.window is None:
            return None
        return window_pages(lengths, self.pages.max_pages, self.pages.page_size, rule.window,
                            rule.sinks)

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
                pages = evict_pages(pages, ~keep)
            pages, granted, (src, dst) = reserve(pages, n_valid, keep, defer_copy=True)
        return self.replace(
            pages=pages, read_tables=self.pages.block_tables, granted=granted,
            cow=jnp.stack([src, dst]),
        )

    def layer_view(self, layer, empty: bool = False) -> PagedView:
        """`empty` (a dense cache skips its slots) is not used: pages are read by length."""
        return PagedView(layer=layer)

    def _shift(self):
        """[B] tokens evicted from each row when the rule rotates keys at positions within the
        cache (`PageRule.rope_in_cache`), else None."""
        if not self.rule.rope_in_cache or self.rule.window is None:
            return None
        page, P = self.pages.page_size, self.pages.num_pages
        bt, ln = self.read_tables, self.pages.lengths
        j = jnp.arange(self.pages.max_pages)[None, :]  # [1, M]
        fill = jnp.clip(ln[:, None] - j * page, 0, page)  # [B, M] tokens in each table slot
        held = jnp.sum(jnp.where((bt >= 0) & (bt < P), fill, 0), axis=1)  # [B]
        return ln - held

    def _sink_pages(self) -> int:
        rule = self.rule
        return 0 if rule.window is None else cdiv(rule.sinks, self.pages.page_size)

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
        window = self.rule.window
        if window is None:
            return bt, ln, jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32) * page, bt.shape)
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

    def store_layers(self, updates, pos_new) -> PagedCache:
        return store_by_layer(self, updates, pos_new)

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


__all__ = ["IMPLS", "PagedCache", "PagedLayout", "PagedView", "page_rule"]
