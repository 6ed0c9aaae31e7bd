"""Where a batch-1 decode step's time goes on CPU: the full step against the weight matmuls alone.

    python -m experiments.bench_decode_floor              # SmolLM2-135M, f32, ~2 min
    python -m experiments.bench_decode_floor --prefill 512 2048   # and prefill, ~3 min more

Side by side, interleaved: `generate.decode_step` (cache donated) with a full f32 cache holding
8, 128 and 1024 tokens, and a scan over the 30 layers doing only the seven projections of each
layer plus the LM head at T = 1 (no norms, RoPE, attention or cache), each with the layers'
weights stacked ([L, ...] arrays, sliced inside the scan) and split (`kvjax.model.split_layers`,
one buffer per layer, picked by `lax.switch`); the split step also with the f32 keys held
slot-major ([L, B, K, C, E], as values are) instead of channel-major (`formats.F32`). Their
ratio says how much of the step is the model's weights read through XLA:CPU's matrix-vector
products; GB/s = f32 weight bytes / time. A plain reduction over the same bytes gives the
machine's read bandwidth.

The second table is the floor of a step's growth with the context: each layer's cached keys and
values summed inside a scan over the layers (the least a step can do with them, one XLA op per
layer and tensor, as attention meets them), against one sum over the whole stacked cache. The
extra bytes between two contexts over the per-layer rate is the least the step must grow.
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
from kvjax.formats import F32, get_format
from kvjax.generate import decode_step, prefill
from kvjax.model import _dots, split_layers, stack_layers
from kvjax.policies import get_policy


class F32SlotKeys(F32):
    """f32 with keys held slot-major, as before channel-major keys (compared, not registered)."""

    name = "f32-slot-keys"
    keys_by_channel = False


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

    key_layouts = {"channel-major keys": get_format("f32"), "slot-major keys": F32SlotKeys()}

    def cache(n, fmt):
        c = KVCache.init(cfg, 1, get_policy("full"), fmt, n + args.reps + 4)
        return c.replace(pos=jnp.where(jnp.arange(c.capacity) < n, jnp.arange(c.capacity), -1)
                         .astype(jnp.int32) + jnp.zeros_like(c.pos), length=jnp.full((1,), n))

    variants = [("stacked", "channel-major keys"), ("split", "channel-major keys"),
                ("split", "slot-major keys")]
    caches = {(lay, kl, n): cache(n, key_layouts[kl]) for lay, kl in variants
              for n in args.contexts}

    def step(key):
        lg, caches[key] = decode_step(layouts[key[0]], tok, caches[key], cfg)
        return lg

    runs = {"read all weights (sum)": lambda: read(split)}
    for lay, params in layouts.items():
        runs[f"matmuls + head only, {lay} layers"] = functools.partial(mats, params, x)
    for n in args.contexts:
        for lay, kl in variants:
            runs[f"decode step, {n} tokens cached, {lay} layers, {kl}"] = functools.partial(
                step, (lay, kl, n))
    times = interleave(runs, args.reps)
    floor = float(np.median(times["matmuls + head only, split layers"]))
    lines = [header("bench_decode_floor", argv),
             (f"### Batch-1 decode step against its weight matmuls (f32 weights "
              f"{weight_bytes / 1e6:.0f} MB, {args.reps} interleaved repetitions, median)"), "",
             "| what | ms | / matmuls only (split) | weight GB/s |", "|---|---:|---:|---:|"]
    for label, ts in times.items():
        ms = 1e3 * float(np.median(ts))
        lines.append(f"| {label} | {ms:.1f} | {ms / 1e3 / floor:.2f}x | "
                     f"{weight_bytes / 1e9 / (ms / 1e3):.1f} |")
    lines += ["", *cache_read_table(cfg, caches, times, args.contexts, args.reps)]
    if args.prefill:
        lines += ["", *prefill_table(cfg, layouts, args.prefill, args.prefill_reps)]
    emit(lines, args.out)


def interleave(runs: dict, reps: int) -> dict[str, list[float]]:
    """Seconds of each run over `reps` interleaved repetitions (after a compile and a warm
    call each)."""
    for _ in range(2):
        jax.block_until_ready([f() for f in runs.values()])
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(reps):
        for label, f in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[label].append(time.perf_counter() - t)
    return times


def cache_read_table(cfg, caches, steps, contexts, reps) -> list[str]:
    """The cache-read floor of a step's growth with the context (see the module docstring)."""
    L = cfg.n_layers

    @jax.jit
    def per_layer(k, v):  # one sum per layer and tensor, inside the layer scan
        def body(acc, layer):
            return acc + jnp.sum(k[layer]) + jnp.sum(v[layer]), None

        return jax.lax.scan(body, jnp.float32(0), jnp.arange(L))[0]

    whole = jax.jit(lambda k, v: jnp.sum(k) + jnp.sum(v))
    stores = {n: (caches["split", "channel-major keys", n].k["q"],
                  caches["split", "channel-major keys", n].v["q"]) for n in contexts}
    runs = {(how, n): functools.partial(f, *stores[n])
            for n in contexts for how, f in (("per layer", per_layer), ("whole", whole))}
    times = {k: float(np.median(t)) for k, t in interleave(runs, reps).items()}
    nbytes = {n: sum(a.nbytes for a in stores[n]) for n in contexts}
    title = ("### The cache-read floor of a step's growth with the context (f32 keys and "
             f"values, {reps} interleaved repetitions, median)")
    out = [title, "",
           "| cached tokens (capacity) | k+v MB | per-layer sums ms (GB/s) | one sum ms (GB/s) |",
           "|---|---:|---:|---:|"]
    for n in contexts:
        mb = nbytes[n] / 1e6
        pl, wh = (times[how, n] for how in ("per layer", "whole"))
        out.append(f"| {n} ({stores[n][1].shape[3]}) | {mb:.1f} | {1e3 * pl:.2f} "
                   f"({mb / 1e3 / pl:.1f}) | {1e3 * wh:.2f} ({mb / 1e3 / wh:.1f}) |")
    lo, hi = (128 if 128 in contexts else min(contexts)), max(contexts)  # issue 14: 1024 vs 128
    step = {n: float(np.median(steps[f"decode step, {n} tokens cached, split layers, "
                                     "channel-major keys"])) for n in (lo, hi)}
    least = times["per layer", hi] - times["per layer", lo]
    verdict = (f"Step at {hi} against {lo} cached tokens: {step[hi] / step[lo]:.2f}x measured "
               f"({1e3 * (step[hi] - step[lo]):.1f} ms more). At the rate XLA:CPU sums one "
               f"layer's cache here, reading the extra cache once costs {1e3 * least:.1f} ms: a "
               f"step that reads its cache layer by layer at that rate is no flatter than "
               f"{(step[lo] + least) / step[lo]:.2f}x.")
    return out + ["", verdict]


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
