"""Serving: continuous batching of a stream of requests over one cache (paged pool or dense
rows), with a prefix cache for static prompt parts, request lifecycle (finish, cancel,
multi-turn sessions) and host offload of idle sessions' pages.

    server = Server(runner, cache, prefixes=[system_prompt_ids], offload_after=2.0)
    result = server.run(requests)          # Turn records, step series, pool statistics

The cache is built by its layout (`layout.init(cfg, rows, policy, fmt, max_len)`); the server
only drives it through its methods: `rows` / `set_rows` (a request's prefill runs on its own
row, kvjax/paged.py and kvjax/cache.py), `share_prefix`, `free`, and for the paged pool the
allocator's `swap_out` / `swap_in` (kvjax/pages.py). The model runs through `ModelRunner`
(jitted `forward` on rows, compiled ahead of time so compile time never enters the clock);
`AllocatorRunner` drives only the cache's `begin` / `finish` (the allocator, no model) for
fast lifecycle tests.

Clock: simulated, advanced by the measured wall time of every real step (each jitted prefill
and decode call, and each offload copy, timed to completion); requests arrive on it (Poisson
arrivals are drawn by the caller), and when nothing runs it jumps to the next arrival.

Admission (FCFS, no preemption): a session (a first turn and its follow-up turns) is admitted
when a row is free and, on the paged layout, the pages it can hold at most over its whole
life fit the unreserved pool (pages its static prefix shares are not counted); on the dense
layout a row is its reservation. So the pool never runs out under jit (checked after each
step). A session paused between turns keeps its row and pages; with `offload_after` its own
pages (not those it shares) move to host memory once it has been idle that long, releasing
its reservation, and come back (reserved again, FCFS) when its next turn arrives.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import pages as pg
from kvjax.config import ModelConfig
from kvjax.model import forward
from kvjax.paged import PagedCache

# --------------------------------------------------------------------------- host memory


def host_memory_kind(device=None) -> str | None:
    """The device's host memory kind ("pinned_host", else "unpinned_host"), or None when the
    backend exposes none or is the CPU, whose "host" memory kinds are the same RAM (then host
    copies are numpy arrays; a CI worker segfaulted once after moving pages through CPU
    `pinned_host`, which numpy copies avoid)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


def to_host(tree):
    """Every leaf moved to host memory (`jax.device_put` with the host memory kind)."""
    kind = host_memory_kind()
    if kind is None:
        return jax.tree.map(np.asarray, tree)
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)


def to_device(tree):
    """Every leaf back in device memory."""
    dev = jax.devices()[0]
    return jax.tree.map(lambda x: jax.device_put(x, jax.sharding.SingleDeviceSharding(dev)), tree)


def bytes_by_memory(tree) -> dict[str, int]:
    """Bytes of the leaves per memory kind ("device", "pinned_host", ...; numpy: "host")."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        kind = x.sharding.memory_kind if isinstance(x, jax.Array) else "host"
        out[kind or "device"] = out.get(kind or "device", 0) + int(x.nbytes)
    return out


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Turn:
    """One turn of a session: its tokens (the whole prompt for a first turn, the new user
    message for a follow-up), the tokens to generate (always `max_new` greedy tokens: no
    end-of-turn stop, so a workload is the same for every policy), and what the run records."""

    rid: int
    arrival: float  # seconds on the simulated clock (follow-ups: think time after the last)
    tokens: list[int]
    max_new: int
    prefix: int = -1  # index of the server's static prefix it starts with (-1: none)
    cancel_at: int | None = None  # the client leaves after this many generated tokens
    key: Any = None  # what a correct answer contains (quality), or None
    then: Turn | None = None  # the session's next turn (arrival = think time after this one)
    # filled by the run
    session: int = -1
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    out: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    prefill_tokens: int = 0  # tokens this turn's prefill computed (prefix reuse saves some)

    def turns(self):
        t = self
        while t is not None:
            yield t
            t = t.then

    def ttft(self) -> float:
        return self.first_token - self.arrival

    def tpot(self) -> float | None:
        n = len(self.out)
        return None if n < 2 else (self.finished - self.first_token) / (n - 1)


@dataclasses.dataclass
class _Session:
    row: int
    turn: Turn
    need: int  # reservation: pages (paged) the session may hold at most, 1 row (dense)
    idle_since: float | None = None  # paused between turns since (None: running)
    swapped: Any = None  # pages in host memory while offloaded


# --------------------------------------------------------------------------- runners


def bucket(n: int, lo: int = 16) -> int:
    """The padded length a prefill of n tokens compiles for: the next power of two >= lo."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def step_rows(params, tokens, cache, cfg: ModelConfig, idx, n_valid):
    """tokens [b, T] (right-padded, n_valid [b] real; 0 = the row is not written) into rows
    idx [b] (distinct) of `cache`, computing only those rows: a request's prefill (b = 1) or
    a decode step of the running rows (T = 1). Returns the greedy next token [b] and the
    cache."""
    at = jnp.maximum(n_valid - 1, 0)
    logits, sub = forward(params, tokens, cache.rows(idx), cfg, n_valid, logits_at=at)
    return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache.set_rows(idx, sub)


def distinct(tree):
    """The tree with a leaf that repeats an earlier one's buffer copied (a compiled step
    cannot take one buffer donated twice, e.g. a paged cache's read tables = its tables)."""
    seen: set[int] = set()

    def one(x):
        if id(x) in seen:
            return jnp.copy(x)
        seen.add(id(x))
        return x

    return jax.tree.map(one, tree)


class ModelRunner:
    """The model's jitted steps, each compiled ahead of time once per shape (`compile_s`
    counts that time; the steps' own time is what the server's clock measures)."""

    def __init__(self, params, cfg: ModelConfig):
        self.params, self.cfg = params, cfg
        self.compiled: dict = {}
        self.compile_s = 0.0

    def _call(self, fn, params, tokens, cache, *rest):
        args = (params, tokens, distinct(cache), *rest)
        key = (fn.__name__,) + tuple(a.shape for a in args if isinstance(a, np.ndarray))
        if key not in self.compiled:
            t = time.perf_counter()
            self.compiled[key] = fn.lower(params, tokens, cache, self.cfg, *rest).compile()
            self.compile_s += time.perf_counter() - t
        return self.compiled[key](*args)

    def step(self, cache, tokens, idx, n_valid):
        """`step_rows` (tokens, idx, n_valid: numpy)."""
        return self._call(step_rows, self.params, tokens, cache, idx, n_valid)


@jax.jit
def _allocate(cache, idx, n_valid):
    """What `forward` does to the allocator of rows idx: reserve (and evict) and advance."""
    return cache.set_rows(idx, cache.rows(idx).begin(n_valid).finish(n_valid))


@jax.jit
def _free(cache, rows):
    """`cache.free(rows)`, compiled (eagerly it is a few dozen small dispatches)."""
    return cache.free(rows)


@jax.jit
def _share(cache, src, dst, n_tokens):
    """`cache.share_prefix(src, dst, n_tokens)`, compiled."""
    return cache.share_prefix(src, dst, n_tokens)


class AllocatorRunner:
    """No model: each step only reserves and advances (the cache's `begin` / `finish`, what
    `forward` does to the allocator), answering token 0. For lifecycle and leak tests."""

    compile_s = 0.0

    def step(self, cache, tokens, idx, n_valid):
        return np.zeros(len(idx), np.int32), _allocate(cache, idx, n_valid)


# --------------------------------------------------------------------------- the server


@dataclasses.dataclass
class ServeResult:
    turns: list[Turn]  # every turn, in arrival order of first turns
    steps: dict  # per step: "t", "kind", "seconds", "active", "pages_used", "pages_shared"
    stats: dict  # totals (see `Server.run`)
    cache: Any  # the final cache (empty)


class Server:
    """Continuous batching over `cache` (its batch = rows; the last len(prefixes) rows hold the
    static prefixes when `prefix_cache`). See the module docstring."""

    def __init__(self, runner, cache, *, prefixes: Sequence[Sequence[int]] = (),
                 prefix_cache: bool = True, offload_after: float | None = None):
        self.runner, self.cache = runner, cache
        self.paged = isinstance(cache, PagedCache)
        self.prefixes = [list(p) for p in prefixes]
        self.prefix_cache = prefix_cache and bool(self.prefixes)
        B = int(cache.length.shape[0])
        n_pre = len(self.prefixes) if self.prefix_cache else 0
        if B <= n_pre:
            raise ValueError(f"the cache has {B} rows; {n_pre} prefix rows need at least one "
                             "more for requests")
        if offload_after is not None and not self.paged:
            raise ValueError("offload_after needs the paged layout (pages move to host memory); "
                             "the dense layout keeps whole rows: use offload_after=None")
        self.prefix_rows = list(range(B - n_pre, B))
        self.free_rows = list(range(B - n_pre))
        self.offload_after = offload_after
        self.clock = 0.0
        self.sessions: dict[int, _Session] = {}
        self.reserved = 0
        self.steps = {k: [] for k in ("t", "kind", "seconds", "active", "pages_used",
                                      "pages_shared", "host_bytes")}
        self.totals = {"prefill_s": 0.0, "decode_s": 0.0, "offload_s": 0.0, "prefix_s": 0.0,
                       "bytes_offloaded": 0, "pages_offloaded": 0, "offloads": 0,
                       "peak_pages": 0, "peak_shared": 0, "peak_active": 0,
                       "peak_sessions": 0, "peak_host_bytes": 0}
        self.host_bytes = 0

    # ---- capacity

    @property
    def page(self) -> int:
        return self.cache.pages.page_size

    def capacity(self) -> int:
        """Reservation units available to sessions: pages outside the prefix rows (paged),
        request rows (dense)."""
        if not self.paged:
            return len(self.free_rows) + len(self.sessions)
        held = np.asarray(self.cache.pages.block_tables)[self.prefix_rows]
        return self.cache.pages.num_pages - len(np.unique(held[held >= 0]))

    def need(self, turn: Turn, swapped: int = 0, done: int = 0) -> int:
        """What a session reserves from this turn on: the pages it can hold at most (paged;
        `done` tokens already held, `swapped` pages coming back), or 1 row (dense)."""
        if not self.paged:
            return 1
        total = done + sum(len(t.tokens) + t.max_new for t in turn.turns()) - (not done)
        shared = len(self.prefixes[turn.prefix]) // self.page if (
            self.prefix_cache and turn.prefix >= 0 and not done) else 0
        cap = self.cache.layout.pages_per_row(self.cache.policy, self.cache.max_len)
        return min(cap, pg.cdiv(total, self.page) - shared)

    # ---- timing and bookkeeping

    def _step(self, kind, tokens, idx, n_valid):
        """Run a model step on rows idx of the cache, timed to completion; the clock advances
        by it. Returns the step's next tokens."""
        t, compiling = time.perf_counter(), self.runner.compile_s
        tokens, self.cache = self.runner.step(self.cache, tokens, idx, n_valid)
        jax.block_until_ready((tokens, self.cache))
        dt = time.perf_counter() - t - (self.runner.compile_s - compiling)  # compile: not served
        self.clock += dt
        self.totals[f"{kind}_s"] += dt
        self._record(kind, dt)
        self._check()
        return np.asarray(tokens)

    def _record(self, kind, dt):
        n_active = sum(s.idle_since is None for s in self.sessions.values())
        used = shared = 0
        if self.paged:
            rc = np.asarray(self.cache.pages.refcount)
            used, shared = int(np.sum(rc > 0)), int(np.sum(np.maximum(rc - 1, 0)))
        for k, v in zip(self.steps, (self.clock, kind, dt, n_active, used, shared,
                                     self.host_bytes)):
            self.steps[k].append(v)
        t = self.totals
        t["peak_pages"] = max(t["peak_pages"], used)
        t["peak_shared"] = max(t["peak_shared"], shared)
        t["peak_active"] = max(t["peak_active"], n_active)
        t["peak_sessions"] = max(t["peak_sessions"], len(self.sessions))
        t["peak_host_bytes"] = max(t["peak_host_bytes"], self.host_bytes)

    def _check(self):
        if self.paged:
            pg.check(self.cache.pages)

    # ---- prefill

    def _prefill(self, row: int, tokens: Sequence[int]) -> int:
        """Feed `tokens` into `row` (after what it holds); the greedy next token."""
        n = len(tokens)
        T = bucket(n)
        toks = np.zeros((1, T), np.int32)
        toks[0, :n] = tokens
        first = self._step("prefill", toks, np.asarray([row], np.int32),
                           np.asarray([n], np.int32))
        return int(first[0])

    def install_prefixes(self) -> None:
        """Prefill each static prefix once into its row (timed as `prefix_s`)."""
        if not self.prefix_cache:
            return
        for row, tokens in zip(self.prefix_rows, self.prefixes):
            t = self.clock
            self._prefill(row, tokens)
            self.totals["prefill_s"] -= self.clock - t
            self.totals["prefix_s"] += self.clock - t

    # ---- lifecycle

    def _start(self, turn: Turn, s: _Session) -> None:
        """Prefill a turn into its session's row and take its first token."""
        tokens = turn.tokens
        if turn.session != turn.rid:  # a follow-up: the last turn's last token goes in first
            tokens = [s.turn.out[-1]] + tokens
        elif self.prefix_cache and turn.prefix >= 0:
            pre = self.prefixes[turn.prefix]
            B = self.cache.length.shape[0]
            dst = np.zeros(B, bool)
            dst[s.row] = True
            self.cache = _share(self.cache, self.prefix_rows[turn.prefix], dst, len(pre))
            tokens = tokens[len(pre):]
        turn.admitted = self.clock
        turn.prefill_tokens = len(tokens)
        tok = self._prefill(s.row, tokens)
        turn.first_token = self.clock
        turn.out.append(tok)
        s.turn, s.idle_since = turn, None
        self._after_token(s)

    def _admit(self, turn: Turn) -> bool:
        """Start `turn` if its session's reservation fits; False: it waits."""
        s = self.sessions.get(turn.session)
        if s is not None and s.swapped is None:  # paused session, pages on the device
            self._start(turn, s)
            return True
        if s is not None:  # offloaded: reserve again, then pages come back
            need = self.need(turn, done=int(self.cache.length[s.row]))
            if self.reserved + need > self.capacity():
                return False
            self.reserved += need
            s.need = need
            t = time.perf_counter()
            pages = pg.swap_in(self.cache.pages, s.row, to_device(s.swapped))
            self.cache = self.cache.replace_pages(pages)
            jax.block_until_ready(self.cache)
            dt = time.perf_counter() - t
            self.clock += dt
            self.totals["offload_s"] += dt
            self.host_bytes -= sum(bytes_by_memory(s.swapped[1:]).values())
            s.swapped = None
            self._record("swap_in", dt)
            self._start(turn, s)
            return True
        need = self.need(turn)
        if not self.free_rows or self.reserved + need > self.capacity():
            return False
        turn.session = turn.rid
        s = _Session(row=self.free_rows.pop(0), turn=turn, need=need)
        self.sessions[turn.session] = s
        self.reserved += need
        self._start(turn, s)
        return True

    def _admit_arrived(self) -> None:
        """Admit arrived turns first come, first served; once one waits, later new sessions
        wait behind it, but follow-ups of existing sessions (which hold a row) may still start."""
        blocked, waiting = False, []
        while self.queue and self.queue[0][0] <= self.clock:
            item = heapq.heappop(self.queue)
            turn = item[2]
            if (blocked and turn.session not in self.sessions) or not self._admit(turn):
                blocked = True
                waiting.append(item)
        for item in waiting:
            heapq.heappush(self.queue, item)

    def _after_token(self, s: _Session) -> None:
        """Finish, cancel or pause the session after its turn's latest token."""
        turn = s.turn
        done = len(turn.out) >= turn.max_new
        if turn.cancel_at is not None and len(turn.out) >= turn.cancel_at and not done:
            turn.cancelled = done = True
            turn.then = None  # the client left: the session ends
        if not done:
            return
        turn.finished = self.clock
        if turn.then is not None:  # the session continues: keep row and pages
            nxt = turn.then
            nxt.session, nxt.arrival = turn.session, self.clock + nxt.arrival
            s.idle_since = self.clock
            heapq.heappush(self.queue, (nxt.arrival, nxt.rid, nxt))
            return
        self._end(s)

    def _end(self, s: _Session) -> None:
        B = self.cache.length.shape[0]
        rows = np.zeros(B, bool)
        rows[s.row] = True
        self.cache = _free(self.cache, rows)
        self.reserved -= s.need
        self.free_rows.append(s.row)
        del self.sessions[s.turn.session]

    def _offload_idle(self) -> None:
        """Move the pages of sessions idle for `offload_after` seconds to host memory."""
        if self.offload_after is None:
            return
        for s in self.sessions.values():
            if (s.idle_since is None or s.swapped is not None
                    or self.clock - s.idle_since < self.offload_after):
                continue
            t = time.perf_counter()
            pages, (slots, k, v) = pg.swap_out(self.cache.pages, s.row)
            s.swapped = (slots, *to_host((k, v)))
            self.cache = self.cache.replace_pages(pages)
            jax.block_until_ready((self.cache, s.swapped[1:]))
            dt = time.perf_counter() - t
            self.clock += dt
            moved = sum(bytes_by_memory(s.swapped[1:]).values())
            self.host_bytes += moved
            t_ = self.totals
            t_["offload_s"] += dt
            t_["bytes_offloaded"] += moved
            t_["pages_offloaded"] += len(slots)
            t_["offloads"] += 1
            self.reserved -= s.need
            s.need = 0
            self._record("swap_out", dt)

    def _decode(self) -> None:
        """One token for every running session, on their rows only (padded with idle rows to
        a batch of `bucket(n, 4)` rows, at most all rows, so few batch shapes compile)."""
        running = [s for s in self.sessions.values() if s.idle_since is None]
        B = int(self.cache.length.shape[0])
        b = min(B, bucket(len(running), 4))
        busy = {s.row for s in running}
        idx = [s.row for s in running] + [r for r in range(B) if r not in busy][:b - len(running)]
        toks = np.zeros((b, 1), np.int32)
        toks[:len(running), 0] = [s.turn.out[-1] for s in running]
        n_valid = (np.arange(b) < len(running)).astype(np.int32)
        nxt = self._step("decode", toks, np.asarray(idx, np.int32), n_valid)
        for s, tok in zip(running, nxt):
            s.turn.out.append(int(tok))
            self._after_token(s)

    # ---- the run

    def run(self, requests: Sequence[Turn]) -> ServeResult:
        """Serve `requests` (first turns; follow-ups hang off `Turn.then`) to the end. Returns
        every turn with its times and tokens, the step series and totals; the cache ends as
        empty as it started (prefix rows freed, checked)."""
        self._validate(requests)
        self.queue = [(r.arrival, r.rid, r) for r in requests]
        heapq.heapify(self.queue)
        t0 = min((r.arrival for r in requests), default=0.0)
        self.clock = t0
        self.install_prefixes()
        while self.queue or self.sessions:
            self._admit_arrived()
            if any(s.idle_since is None for s in self.sessions.values()):
                self._decode()
            else:  # nothing runs: jump to the next arrival or offload
                events = [a for a, _, _ in self.queue if a > self.clock]
                if self.offload_after is not None:
                    events += [s.idle_since + self.offload_after for s in self.sessions.values()
                               if s.idle_since is not None and s.swapped is None]
                events = [e for e in events if e > self.clock]
                if not events and self.queue:
                    head = self.queue[0][2]
                    raise RuntimeError(
                        f"request {head.rid} can never be admitted: it needs {self.need(head)} "
                        f"of {self.capacity()} units, {self.reserved} held by paused sessions")
                self.clock = min(events, default=self.clock)
            self._offload_idle()
        makespan = self.clock - t0
        if self.prefix_cache:
            rows = np.zeros(self.cache.length.shape[0], bool)
            rows[self.prefix_rows] = True
            self.cache = _free(self.cache, rows)
        if self.paged:
            pg.check(self.cache.pages)
            left = int(np.sum(np.asarray(self.cache.pages.refcount) > 0))
            if left:
                raise pg.PagedCacheError(f"{left} pages still held after every request ended")
        turns = [t for r in requests for t in r.turns() if t.first_token is not None]
        gen = sum(len(t.out) for t in turns)
        stats = dict(self.totals, makespan_s=makespan, generated=gen,
                     throughput_tok_s=gen / makespan if makespan > 0 else None,
                     prefill_tokens=sum(t.prefill_tokens for t in turns),
                     compile_s=self.runner.compile_s, turns=len(turns),
                     cancelled=sum(t.cancelled for t in turns))
        return ServeResult(turns, self.steps, stats, self.cache)

    def _validate(self, requests) -> None:
        room = self.capacity()
        if self.paged and self.prefix_cache and not int(self.cache.length[self.prefix_rows[0]]):
            room -= sum(pg.cdiv(len(p), self.page) for p in self.prefixes)  # not installed yet
        for r in requests:
            if r.prefix >= len(self.prefixes) or r.prefix < -1:
                raise ValueError(f"request {r.rid}: prefix={r.prefix} but the server has "
                                 f"{len(self.prefixes)} prefixes")
            total = sum(len(t.tokens) + t.max_new for t in r.turns()) - 1  # last: not fed
            limit = self.cache.max_len if self.paged else (
                self.cache.capacity if self.cache.policy.budget is None else None)
            if limit is not None and total > limit:
                raise ValueError(f"request {r.rid}: its session needs {total} tokens, above "
                                 f"the cache's {limit} per row")
            if self.need(r) > room:
                unit = "pages" if self.paged else "rows"
                raise ValueError(f"request {r.rid} needs {self.need(r)} {unit}, more than the "
                                 f"cache's {room} for requests: build a bigger pool")
            pre = self.prefixes[r.prefix] if r.prefix >= 0 else []
            if r.tokens[:len(pre)] != pre or len(r.tokens) <= len(pre):
                raise ValueError(f"request {r.rid}: its prompt does not start with prefix "
                                 f"{r.prefix} (or holds nothing after it)")
            for t in r.turns():
                if not t.tokens or t.max_new < 1:
                    raise ValueError(f"request {t.rid}: a turn needs >= 1 token and "
                                     f"max_new >= 1, got {len(t.tokens)} and {t.max_new}")


def percentiles(xs, qs=(50, 95, 99)) -> dict:
    """{p50: ..., p95: ...} of the values (None for none)."""
    xs = [x for x in xs if x is not None]
    return {f"p{q}": (float(np.percentile(xs, q)) if xs else None) for q in qs}


__all__ = ["AllocatorRunner", "ModelRunner", "ServeResult", "Server", "Turn", "bucket",
           "bytes_by_memory", "distinct", "host_memory_kind", "percentiles", "step_rows",
           "to_device", "to_host"]
