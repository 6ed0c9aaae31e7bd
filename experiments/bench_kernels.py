"""Paged decode-attention kernel benchmark for an H200 (and a CPU smoke run).

    python experiments/bench_kernels.py --out docs/data/bench_kernels_h200.md     # on the GPU
    python experiments/bench_kernels.py --interpret --tiny --out /tmp/bench.md    # CPU smoke

1. Compile check: every variant (storage f32/bf16/int8/int4 x page sizes 8..256, plus GQA
   ratios and the attention-mass output) is compiled (interpret=False unless --interpret), run
   once on small inputs and compared with the jnp reference. Failures are recorded, not fatal.
2. Benchmark: achieved bandwidth of KV reads (bytes of the pages the rows' lengths cover,
   scales included) across batch, context length, page size and storage dtype, against the
   XLA reference (gather + dense attention) and against
   jax.experimental.pallas.ops.gpu.paged_attention where it imports (f32/bf16/int8 only).
   Every benchmark working set is >= 5x the H200's 50 MB L2 (the table lists it), page ids are
   a random permutation (fragmented pool), and calls run back to back inside one jitted loop
   whose next query depends on the previous output, so nothing is hoisted or cached.
3. A small tuning sweep (pages per block, splits, warps) on one configuration.

The markdown table is rewritten after every row, so a timeout still leaves what was measured.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.formats import QuantPages, get_format
from kvjax.kernels import paged_attention as pa

H200_TBPS = 4.8
L2_BYTES = 50 * 2**20
# (B, ctx, page, K, G, E) of the tuning sweep (and experiments.profile_kernel): int4 pages of
# 64 x 4k tokens are 320 MiB, >= 5x the L2 (bf16: 1 GiB)
TUNE_SHAPE = (64, 4096, 16, 8, 4, 128)

try:
    from jax.experimental.pallas.ops.gpu import paged_attention as upstream
except Exception:  # noqa: BLE001 -- deprecated/removed in newer jax; any failure means "absent"
    upstream = None


def kv_bytes_per_token(kind: str, K: int, E: int, group: int = 32) -> int:
    """Bytes of k+v of one token (all kv heads), scales included."""
    group = min(group, E)
    per = {"f32": 4 * E, "bf16": 2 * E, "int8": E + 2, "int4": E // 2 + 2 * 2 * (E // group)}
    return 2 * K * per[kind]


def page_codec(kind: str, E: int):
    """The page codec of format `kind` (int4: per-token groups of min(32, E))."""
    options = {"group": min(32, E), "key_mode": "token"} if kind == "int4" else {}
    return get_format(kind, **options).page_codec("k")


def make_inputs(seed, kind, B, ctx, K, G, E, page, ragged=False, q_dtype=jnp.bfloat16):
    """Pages for B rows of `ctx` tokens in a randomly permuted pool (+ a few spare pages)."""
    rng = np.random.default_rng(seed)
    M = -(-ctx // page)
    P = B * M + 4
    lengths = rng.integers(1, ctx + 1, B) if ragged else np.full(B, ctx)
    bt = rng.permutation(P)[: B * M].reshape(B, M).astype(np.int32)
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)

    def pool(k):
        x = jax.random.normal(k, (K, P, page, E), jnp.float32)
        return page_codec(kind, E).encode(x)

    q = jax.random.normal(k3, (B, K * G, E), jnp.float32).astype(q_dtype)
    return q, pool(k1), pool(k2), jnp.asarray(bt), jnp.asarray(lengths, jnp.int32)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def time_per_call(fn, q, args, iters):
    """Seconds per call of fn(q, *args), `iters` dependent calls inside one jitted loop."""

    @jax.jit
    def loop(q, *args):
        def body(_, q):
            o = _first(fn(q, *args))
            return (q.astype(jnp.float32) + 1e-6 * o.astype(jnp.float32)).astype(q.dtype)

        return jax.lax.fori_loop(0, iters, body, q)

    jax.block_until_ready(loop(q, *args))  # compile + warm up
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(q, *args))
        best = min(best, time.perf_counter() - t0)
    return best / iters


class Report:
    """Markdown sections, rewritten to --out after each row."""

    def __init__(self, path, header):
        self.path, self.parts = path, [header]

    def add(self, line):
        self.parts.append(line)
        print(line, flush=True)
        if self.path:
            with open(self.path, "w") as f:
                f.write("\n".join(self.parts) + "\n")


# --------------------------------------------------------------------------- 1. compile check


def compile_check(rep, args):
    rep.add("\n## Compile check (every variant, vs the jnp reference)\n")
    rep.add("| kind | page | G | E | mass | status | max abs err | compile+run s |")
    rep.add("|---|---:|---:|---:|---|---|---:|---:|")
    E = 16 if args.tiny else 64
    variants = [
        (k, p, 3, False) for k in ("f32", "bf16", "int8", "int4") for p in pa.VALID_PAGE_SIZES
    ]
    variants += [
        ("bf16", 16, 1, False),
        ("bf16", 16, 8, False),
        ("bf16", 16, 3, True),
        ("int4", 16, 3, True),
    ]
    if args.tiny:
        variants = [v for v in variants if v[1] <= 16]
    ok = 0
    for kind, page, G, mass in variants:
        t0 = time.perf_counter()
        try:
            q, kp, vp, bt, ln = make_inputs(
                0,
                kind,
                3,
                2 * page + 5,
                2,
                G,
                E,
                page,
                ragged=True,
                q_dtype=jnp.float32 if kind == "f32" else jnp.bfloat16,
            )
            got = pa.paged_attention(q, kp, vp, bt, ln, return_mass=mass, interpret=args.interpret)
            want = pa.paged_attention_reference(
                q.astype(jnp.float32), kp, vp, bt, ln, return_mass=mass
            )
            err = float(jnp.max(jnp.abs(_first(got).astype(jnp.float32) - _first(want))))
            if mass:
                err = max(err, float(jnp.max(jnp.abs(got[1] - want[1]))))
            tol = 1e-3 if kind == "f32" else 3e-2
            status = "ok" if err <= tol and np.isfinite(err) else f"MISMATCH (tol {tol})"
            ok += status == "ok"
        except Exception as e:  # noqa: BLE001 -- record and go on
            status, err = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:160]}", float("nan")
            traceback.print_exc()
        rep.add(
            f"| {kind} | {page} | {G} | {E} | {mass} | {status} | {err:.2e} | "
            f"{time.perf_counter() - t0:.1f} |"
        )
    rep.add(f"\n{ok}/{len(variants)} variants compiled and matched the reference.")
    return ok == len(variants)


# --------------------------------------------------------------------------- 2. benchmark


def _ours(interpret, **kw):
    def fn(q, kp, vp, bt, ln):
        return pa.paged_attention(q, kp, vp, bt, ln, interpret=interpret, **kw)

    return fn


def _xla(q, kp, vp, bt, ln):
    return pa.paged_attention_reference(q, kp, vp, bt, ln)


def _upstream(interpret, M):
    k_splits = min(16, M)
    while M % k_splits:
        k_splits //= 2

    def fn(q, kp, vp, bt, ln):
        ks = vs = None
        if isinstance(kp, QuantPages):
            kp, ks = kp.q, kp.scale[..., 0]
            vp, vs = vp.q, vp.scale[..., 0]
        return upstream.paged_attention(
            q,
            kp,
            vp,
            bt,
            ln,
            ks,
            vs,
            k_splits=k_splits,
            pages_per_compute_block=min(8, M // k_splits),
            interpret=interpret,
        )

    return fn


def bench_row(rep, args, kind, B, ctx, page, K, G, E, impls, extra=""):
    try:
        q, kp, vp, bt, ln = make_inputs(1, kind, B, ctx, K, G, E, page)
    except Exception as e:  # noqa: BLE001
        rep.add(
            f"| inputs | {kind} | {page} | {B} | {ctx} | {K}x{G} | {E} | | failed: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:120]} | | | | {extra} |"
        )
        return
    read = int(np.sum(-(-np.asarray(ln) // page)) * page) * kv_bytes_per_token(kind, K, E)
    ws = read / 2**20
    times = {}
    for name, fn in impls:
        try:
            times[name] = time_per_call(fn, q, (kp, vp, bt, ln), args.iters)
        except Exception as e:  # noqa: BLE001
            times[name] = None
            print(f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    base = times.get("xla")
    for name, t in times.items():
        if t is None:
            rep.add(
                f"| {name} | {kind} | {page} | {B} | {ctx} | {K}x{G} | {E} | {ws:,.0f} | "
                f"failed | | | | {extra} |"
            )
            continue
        gbs = read / t / 1e9
        speed = f"{base / t:.2f}x" if base else ""
        rep.add(
            f"| {name} | {kind} | {page} | {B} | {ctx} | {K}x{G} | {E} | {ws:,.{0 if ws >= 10 else 3}f} | "
            f"{t * 1e6:,.1f} | {gbs:,.0f} | {100 * gbs / (H200_TBPS * 1e3):.1f}% | {speed} | "
            f"{extra} |"
        )


def benchmark(rep, args, t_start):
    rep.add("\n## Decode attention: achieved KV-read bandwidth\n")
    rep.add(
        "GB/s = bytes of the k/v pages covered by the rows' lengths (scales included) / time "
        f"per call; % of the H200's {H200_TBPS} TB/s. xla = gather + dense attention.\n"
    )
    rep.add(
        "| impl | kv | page | B | ctx | KxG | E | KV MiB | us/call | GB/s | % peak | "
        "vs xla | note |"
    )
    rep.add("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    if args.tiny:
        shapes = [(2, 64, 16), (3, 48, 8)]
        K, G, E = 2, 3, 16
    else:
        # KV working sets: bf16 1-2 GiB, int8 0.5-1 GiB, int4 320-640 MiB (L2: 50 MB)
        shapes = [
            (16, 16384, 16),
            (64, 4096, 16),
            (256, 1024, 16),
            (32, 16384, 16),
            (128, 4096, 16),
            (64, 4096, 64),
            (32, 16384, 64),
        ]
        K, G, E = 8, 4, 128
    for B, ctx, page in shapes:
        for kind in ("bf16", "int8", "int4"):
            if time.perf_counter() - t_start > args.budget_s:
                rep.add(f"\n(stopped: time budget {args.budget_s:.0f}s reached)")
                return
            impls = [("xla", _xla), ("kvjax", _ours(args.interpret))]
            if upstream is not None and kind in ("bf16", "int8"):
                impls.append(("jax-upstream", _upstream(args.interpret, -(-ctx // page))))
            bench_row(rep, args, kind, B, ctx, page, K, G, E, impls)
    if not args.tiny:  # SmolLM2-135M shape (K=3, G=3, E=64) and a page-size sweep
        for page in (8, 16, 32, 64, 128):
            if time.perf_counter() - t_start > args.budget_s:
                return
            bench_row(
                rep,
                args,
                "bf16",
                64,
                8192,
                page,
                3,
                3,
                64,
                [("kvjax", _ours(args.interpret))],
                "SmolLM2 shape",
            )


def tuning(rep, args, t_start):
    rep.add(f"\n## Tuning sweep ({', '.join(args.tune_kinds)})\n")
    rep.add(
        "| impl | kv | page | B | ctx | KxG | E | KV MiB | us/call | GB/s | % peak | "
        "vs xla | note |"
    )
    rep.add("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    B, ctx, page, K, G, E = (2, 64, 16, 2, 3, 16) if args.tiny else TUNE_SHAPE
    grid = [(ppb, s, w) for ppb in args.tune_ppb for s in (None, 4, 16) for w in args.tune_warps]
    if args.tiny:
        grid = [(1, None, 4), (2, 2, 4)]
    for kind in args.tune_kinds:
        for ppb, splits, warps in grid:
            if time.perf_counter() - t_start > args.budget_s:
                rep.add(f"\n(stopped: time budget {args.budget_s:.0f}s reached)")
                return
            fn = _ours(args.interpret, pages_per_block=ppb, num_splits=splits, num_warps=warps)
            bench_row(rep, args, kind, B, ctx, page, K, G, E, [("kvjax", fn)],
                      f"ppb={ppb} splits={splits or 'auto'} warps={warps}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="markdown file to (re)write as rows come in")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run)")
    ap.add_argument("--iters", type=int, default=None, help="calls per timing (default 50/2)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop starting new rows after this many seconds",
    )
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-bench", action="store_true", help="only the check and the tuning")
    ap.add_argument("--tune-kinds", nargs="+", default=["bf16"], choices=["bf16", "int8", "int4"])
    ap.add_argument("--tune-ppb", nargs="+", type=int, default=[1, 2, 4, 8], help="pages/block")
    ap.add_argument("--tune-warps", nargs="+", type=int, default=[4, 8])
    args = ap.parse_args(argv)
    args.iters = args.iters or (2 if args.tiny else 50)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    header = (
        f"# Paged attention kernels\n\ndevice: {dev.device_kind} ({dev.platform}); jax "
        f"{jax.__version__}; python {platform.python_version()}; interpret={args.interpret}"
        f"; upstream pallas.ops.gpu.paged_attention: "
        f"{'available' if upstream else 'not importable'}\n\ncommand: `python "
        f"experiments/bench_kernels.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
    )
    rep = Report(args.out, header)
    all_ok = True if args.skip_check else compile_check(rep, args)
    if not args.skip_bench:
        benchmark(rep, args, t_start)
    tuning(rep, args, t_start)
    rep.add(f"\ntotal {time.perf_counter() - t_start:.0f}s")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
