"""KV memory of the paged layout (CPU): waste under continuous batching, and prefix sharing.

    python experiments/bench_paged_memory.py [--out FILE.md]

1. Waste. A continuous-batching run: 64 slots serve 256 requests whose prompt and output
   lengths are drawn from a seeded log-normal mix (max_len 2048); a finished row is freed and
   the next request admitted (its prompt prefilled in one chunk). At every decode step we
   record the tokens held, the bytes a contiguous cache preallocating max_len per active row
   holds, and the bytes of the pages in use. Waste = 1 - token bytes / held bytes.
2. Prefix sharing. N requests share one 1000-token system prompt, then add 32-256 user tokens
   and generate 128. Unshared: each row stores the prompt; shared: row 0 prefills it and the
   others share its pages (copy-on-write on the partial last page).

Page counts come from running kvjax.pages' allocator (jitted reserve/write/advance/free) on a
small-headed pool; bytes are pages x the bytes of one page of a SmolLM2-135M pool (L=30, K=3,
E=64) in that storage format, read from the pool's buffer shapes and dtypes (jax.eval_shape),
plus the block tables and refcounts. Contiguous bytes are those of a dense [L, B, K, max_len, E]
store in the same format.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import pages
from kvjax.formats import get_format

L, K, E = 30, 3, 64  # SmolLM2-135M
MAX_LEN = 2048
SLOTS, REQUESTS = 64, 256


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def page_format(kind: str):
    """The format `kind` as pages store it (int4: per-token groups of 32)."""
    return get_format(kind, **({"group": 32, "key_mode": "token"} if kind == "int4" else {}))


def page_bytes(page: int, kind: str) -> int:
    """Bytes of one page (k and v, all layers and kv heads) of a SmolLM2 pool."""
    fmt = page_format(kind)
    pool = jax.eval_shape(lambda: pages.PagedKVCache.init(L, K, E, 1, 4, page, page, fmt))
    return _nbytes((pool.k, pool.v)) // 4


def token_bytes(kind: str) -> int:
    """Bytes of one token (k and v, all layers and kv heads) of a dense store."""
    return 2 * page_format(kind).page_codec("k").nbytes((L, 1, K, 1, E))


def workload(seed=0):
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(200), 0.9, REQUESTS), 8, 1024).astype(int)
    output = np.clip(rng.lognormal(np.log(150), 0.8, REQUESTS), 4, 1024).astype(int)
    return prompt, np.minimum(output, MAX_LEN - prompt)


def _small(batch, num_pages, page, max_len=MAX_LEN):
    return pages.PagedKVCache.init(1, 1, 2, batch, num_pages, page, max_len, get_format("f32"))


@jax.jit
def _decode(cache, active):
    cache, g = pages.reserve(cache, active.astype(jnp.int32))
    cache = pages.write(
        cache, 0, jnp.ones((active.shape[0], 1, 1, 2)), jnp.ones((active.shape[0], 1, 1, 2)), g
    )
    return pages.advance(cache, g), g


@jax.jit
def _prefill(cache, n):
    chunk = jnp.ones((n.shape[0], 1024, 1, 2))
    cache, g = pages.reserve(cache, n)
    cache = pages.write(cache, 0, chunk, chunk, g)
    return pages.advance(cache, g), g


_free = jax.jit(pages.free)


def continuous_batching(page: int):
    """Per decode step: (tokens held, active rows, pages in use), over the whole run."""
    prompt, output = workload()
    num_pages = SLOTS * MAX_LEN // page  # never the bottleneck: measure waste, not preemption
    cache = _small(SLOTS, num_pages, page)
    queue = list(range(REQUESTS))
    req = np.full(SLOTS, -1)
    left = np.zeros(SLOTS, int)
    trace = []
    while queue or (req >= 0).any():
        admit = np.zeros(SLOTS, np.int32)
        for s in np.flatnonzero(req < 0):
            if queue:
                r = queue.pop(0)
                req[s], left[s], admit[s] = r, output[r], prompt[r]
        if admit.any():
            cache, g = _prefill(cache, jnp.asarray(admit))
            assert (np.asarray(g) == admit).all()
        active = req >= 0
        cache, g = _decode(cache, jnp.asarray(active))
        assert (np.asarray(g) == active).all(), "pool too small"
        left -= active
        ln = np.asarray(cache.lengths)
        trace.append(
            (int(ln[active].sum()), int(active.sum()), int(np.sum(np.asarray(cache.refcount) > 0)))
        )
        done = active & (left <= 0)
        if done.any():
            cache = _free(cache, jnp.asarray(done))
            req[done] = -1
    assert pages.invariant_errors(cache) == []
    return np.array(trace), cache


def waste_table(kinds=("bf16", "int4"), page_sizes=(8, 16, 32, 64)):
    rows = []
    for page in page_sizes:
        t0 = time.perf_counter()
        trace, cache = continuous_batching(page)
        tokens, active, used = trace.T.astype(float)
        table_bytes = _nbytes((cache.block_tables, cache.lengths, cache.refcount, cache.preempted))
        for kind in kinds:
            tb, pb = token_bytes(kind), page_bytes(page, kind)
            contig = active * MAX_LEN * tb
            pag = used * pb + table_bytes
            held = tokens * tb
            rows.append(
                {
                    "page": page,
                    "kind": kind,
                    "steps": len(trace),
                    "contig_waste": 1 - held.sum() / contig.sum(),
                    "paged_waste": 1 - held.sum() / pag.sum(),
                    "slot_waste": 1 - tokens.sum() / (used * page).sum(),
                    "contig_peak": contig.max(),
                    "paged_peak": pag.max(),
                    "secs": time.perf_counter() - t0,
                }
            )
    return rows


@jax.jit
def _append_rows(cache, n):
    chunk = jnp.ones((n.shape[0], 1024, 1, 2))
    cache, g = pages.reserve(cache, n)
    cache = pages.write(cache, 0, chunk, chunk, g)
    return pages.advance(cache, g), g


def prefix_sharing(n_req: int, page: int, system: int = 1000, seed: int = 0):
    """Pages in use for n_req requests sharing a system prompt, unshared vs shared."""
    rng = np.random.default_rng(seed)
    user = rng.integers(32, 257, n_req)
    gen = 128
    out = {}
    for share in (False, True):
        cache = _small(n_req, n_req * 2048 // page, page)
        if share:
            first = np.zeros(n_req, np.int32)
            first[0] = system
            cache, _ = _append_rows(cache, jnp.asarray(first))
            cache = pages.share_prefix(cache, 0, jnp.arange(n_req) > 0)
        else:
            cache, _ = _append_rows(cache, jnp.full((n_req,), system, jnp.int32))
        cache, _ = _append_rows(cache, jnp.asarray(user, jnp.int32))
        for _ in range(gen):
            cache, _ = _decode(cache, jnp.ones((n_req,), bool))
        assert pages.invariant_errors(cache) == []
        out[share] = int(np.sum(np.asarray(cache.refcount) > 0))
    return out[False], out[True], int(np.sum(user)) + n_req * (system + gen)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the markdown tables here (default: stdout only)")
    args = ap.parse_args(argv)
    lines = [
        (
            f"Workload: {REQUESTS} requests through {SLOTS} slots, max_len {MAX_LEN}; "
            f"SmolLM2-135M pool (L={L}, K={K}, E={E}). jax {jax.__version__}."
        ),
        "",
        (
            "| page | kv | decode steps | waste contiguous | waste paged (bytes) | "
            "waste paged (slots) | peak contiguous | peak paged |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in waste_table():
        lines.append(
            f"| {r['page']} | {r['kind']} | {r['steps']} | {r['contig_waste']:.1%} | "
            f"{r['paged_waste']:.2%} | {r['slot_waste']:.2%} | "
            f"{r['contig_peak'] / 2**20:,.0f} MiB | {r['paged_peak'] / 2**20:,.0f} MiB |"
        )
    lines += [
        "",
        (
            "Prefix sharing: one 1000-token system prompt, 32-256 user tokens, 128 generated, "
            "page 16."
        ),
        "",
        (
            "| requests | tokens (logical) | pages unshared | pages shared | bf16 unshared | "
            "bf16 shared | int4 shared | saving |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bf, i4 = page_bytes(16, "bf16"), page_bytes(16, "int4")
    for n in (1, 4, 16, 64):
        un, sh, tok = prefix_sharing(n, 16)
        lines.append(
            f"| {n} | {tok:,} | {un:,} | {sh:,} | {un * bf / 2**20:,.1f} MiB | "
            f"{sh * bf / 2**20:,.1f} MiB | {sh * i4 / 2**20:,.1f} MiB | {1 - sh / un:.1%} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
