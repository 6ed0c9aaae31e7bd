"""Where a batch-1 decode step's time goes on CPU: the full step against the weight matmuls alone.

    python -m experiments.bench_decode_floor              # SmolLM2-135M, f32, ~1 min
    python -m experiments.bench_decode_floor --prefill 512 2048   # and prefill, ~3 min more

Side by side, interleaved: `generate.decode_step` (cache donated) with a full cache holding
8, 128 and 1024 tokens, and a scan over the 30 layers doing only the seven projections of each
layer plus the LM head at T = 1 (no norms, RoPE, attention or cache), each with the layers'
weights stacked ([L, ...] arrays, sliced inside the scan) and split (`kvjax.model.split_layers`,
one buffer per layer, picked by `lax.switch`). Their ratio says how much of the step is the
model's weights read through XLA:CPU's matrix-vector products; GB/s = f32 weight bytes / time.
A plain reduction over the same bytes gives the machine's read bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_formats import TEXT_IDS, emit, header, load_real
from kvjax.cache import KVCache
from kvjax.formats import get_format
from kvjax.generate import decode_step, prefill
from kvjax.model import _dots, split_layers, stack_layers
from kvjax.policies import get_policy


def matmuls_only(cfg):
    """The seven projections of every layer, then the head at the last position only (as
    prefill and decode compute it); params stacked or split, reached as the model does
    (`kvjax.model._dots`)."""
    L = cfg.n_layers

    @jax.jit
    def run(params, x):  # x [B, T, D]
        def body(x, layer):
            w = params["layers"]
            q, k, v = _dots(w, layer, 0, L, x, "wq", "wk", "wv")  # [B, T, H·E], [B, T, K·E]
            o = _dots(w, layer, 0, L, q, "wo")[0] + jnp.sum(k) + jnp.sum(v)  # [B, T, D]
            g, u = _dots(w, layer, 0, L, o, "w_gate", "w_up")  # [B, T, F]
            return x + _dots(w, layer, 0, L, jax.nn.silu(g) * u, "w_down")[0], None

        x, _ = jax.lax.scan(body, x, jnp.arange(L))
        head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]  # [D, V]
        return jnp.einsum("BTD,DV->BTV", x[:, -1:], head)

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8, 128, 1024])
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="also time one-chunk prefills of these prompt lengths, both layouts")
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--out", help="also write the Markdown to this file")
    args = ap.parse_args(argv)
    cfg, split = load_real()
    layouts = {"stacked": stack_layers(split, cfg), "split": split_layers(split)}
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(split))
    tok = jnp.zeros((1,), jnp.int32)
    mats = matmuls_only(cfg)
    x = jnp.ones((1, 1, cfg.d_model), jnp.float32)
    read = jax.jit(lambda p: sum(jnp.sum(a) for a in jax.tree.leaves(p)))

    def cache(n):
        c = KVCache.init(cfg, 1, get_policy("full"), get_format("f32"), n + args.reps + 4)
        return c.replace(pos=jnp.where(jnp.arange(c.capacity) < n, jnp.arange(c.capacity), -1)
                         .astype(jnp.int32) + jnp.zeros_like(c.pos), length=jnp.full((1,), n))

    caches = {(lay, n): cache(n) for lay in layouts for n in args.contexts}

    def step(lay, n):
        lg, caches[lay, n] = decode_step(layouts[lay], tok, caches[lay, n], cfg)
        return lg

    runs = {"read all weights (sum)": lambda: read(split)}
    for lay, params in layouts.items():
        runs[f"matmuls + head only, {lay} layers"] = functools.partial(mats, params, x)
    for n in args.contexts:
        for lay in layouts:
            runs[f"decode step, {n} tokens cached, {lay} layers"] = functools.partial(step, lay, n)
    for _ in range(2):  # compile, then one warm call each
        jax.block_until_ready([f() for f in runs.values()])
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(args.reps):
        for label, f in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[label].append(time.perf_counter() - t)
    floor = float(np.median(times["matmuls + head only, split layers"]))
    lines = [header("bench_decode_floor", argv),
             (f"### Batch-1 decode step against its weight matmuls (f32 weights "
              f"{weight_bytes / 1e6:.0f} MB, {args.reps} interleaved repetitions, median)"), "",
             "| what | ms | / matmuls only (split) | weight GB/s |", "|---|---:|---:|---:|"]
    for label, ts in times.items():
        ms = 1e3 * float(np.median(ts))
        lines.append(f"| {label} | {ms:.1f} | {ms / 1e3 / floor:.2f}x | "
                     f"{weight_bytes / 1e9 / (ms / 1e3):.1f} |")
    if args.prefill:
        lines += ["", *prefill_table(cfg, layouts, args.prefill, args.prefill_reps)]
    emit(lines, args.out)


def prefill_table(cfg, layouts, lengths, reps) -> list[str]:
    """One-chunk prefills of the default text's first n tokens into a full cache, the layouts
    interleaved: the matmuls there are [n, D] x [D, F], where a weight copy weighs less."""
    ids = np.load(TEXT_IDS).tolist()

    def run(lay, n):
        c = KVCache.init(cfg, 1, get_policy("full"), get_format("f32"), n)
        return prefill(layouts[lay], [ids[:n]], c, cfg)[0]

    runs = {(lay, n): functools.partial(run, lay, n) for n in lengths for lay in layouts}
    jax.block_until_ready([f() for f in runs.values()])  # compile
    times: dict = {k: [] for k in runs}
    for _ in range(reps):
        for k, f in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t)
    out = [f"### One-chunk prefill ({reps} interleaved repetitions: median, min-max)", "",
           "| prompt | " + " | ".join(f"{lay} layers" for lay in layouts) + " | stacked / split |",
           "|---|" + "---:|" * (len(layouts) + 1)]
    for n in lengths:
        med = {lay: float(np.median(times[lay, n])) for lay in layouts}
        cells = [f"{med[lay]:.3f} s ({min(times[lay, n]):.2f}-{max(times[lay, n]):.2f})"
                 for lay in layouts]
        out.append(f"| {n} tokens | " + " | ".join(cells)
                   + f" | {med['stacked'] / med['split']:.2f}x |")
    return out


if __name__ == "__main__":
    main()
