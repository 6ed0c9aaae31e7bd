"""Where a batch-1 decode step's time goes on CPU: the full step against the weight matmuls alone.

    python -m experiments.bench_decode_floor              # SmolLM2-135M, f32, ~1 min

Side by side, interleaved: `generate.decode_step` (cache donated) with a full cache holding
8, 128 and 1024 tokens, and a scan over the 30 layers doing only the seven projections of each
layer plus the LM head at T = 1 (no norms, RoPE, attention or cache). Their ratio says how much
of the step is the model's weights read through XLA:CPU's matrix-vector products; GB/s = f32
weight bytes / time. A plain reduction over the same bytes gives the machine's read bandwidth.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_formats import emit, header, load_real
from kvjax.cache import KVCache
from kvjax.formats import get_format
from kvjax.generate import decode_step
from kvjax.policies import get_policy


def matmuls_only(cfg):
    """The seven projections of every layer, then the head at the last position only (as
    prefill and decode compute it)."""

    @jax.jit
    def run(params, x):  # x [B, T, D]
        def body(x, layer):
            lp = jax.tree.map(lambda a: a[layer], params["layers"])
            q = jnp.einsum("BTD,DHE->BTHE", x, lp["wq"])  # [B, T, H, E]
            k = jnp.einsum("BTD,DKE->BTKE", x, lp["wk"])  # [B, T, K, E]
            v = jnp.einsum("BTD,DKE->BTKE", x, lp["wv"])
            o = jnp.einsum("BTHE,HED->BTD", q, lp["wo"]) + jnp.sum(k) + jnp.sum(v)
            g = jnp.einsum("BTD,DF->BTF", o, lp["w_gate"])  # [B, T, F]
            u = jnp.einsum("BTD,DF->BTF", o, lp["w_up"])
            return x + jnp.einsum("BTF,FD->BTD", jax.nn.silu(g) * u, lp["w_down"]), None

        x, _ = jax.lax.scan(body, x, jnp.arange(cfg.n_layers))
        head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]  # [D, V]
        return jnp.einsum("BTD,DV->BTV", x[:, -1:], head)

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8, 128, 1024])
    ap.add_argument("--out", help="also write the Markdown to this file")
    args = ap.parse_args(argv)
    cfg, params = load_real()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    tok = jnp.zeros((1,), jnp.int32)
    mats = matmuls_only(cfg)
    x = jnp.ones((1, 1, cfg.d_model), jnp.float32)
    read = jax.jit(lambda p: sum(jnp.sum(a) for a in jax.tree.leaves(p)))
    caches = {}
    for n in args.contexts:
        c = KVCache.init(cfg, 1, get_policy("full"), get_format("f32"), n + args.reps + 4)
        c = c.replace(pos=jnp.where(jnp.arange(c.capacity) < n, jnp.arange(c.capacity), -1)
                      .astype(jnp.int32) + jnp.zeros_like(c.pos), length=jnp.full((1,), n))
        for _ in range(2):
            lg, c = decode_step(params, tok, c, cfg)
        caches[n] = c
    jax.block_until_ready((mats(params, x), read(params), lg))
    times: dict[str, list[float]] = {"matmuls + head only": [], "read all weights (sum)": []}
    times |= {f"decode step, {n} tokens cached": [] for n in args.contexts}
    for _ in range(args.reps):
        t = time.perf_counter()
        jax.block_until_ready(mats(params, x))
        times["matmuls + head only"].append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(read(params))
        times["read all weights (sum)"].append(time.perf_counter() - t)
        for n in args.contexts:
            t = time.perf_counter()
            lg, caches[n] = decode_step(params, tok, caches[n], cfg)
            lg.block_until_ready()
            times[f"decode step, {n} tokens cached"].append(time.perf_counter() - t)
    floor = float(np.median(times["matmuls + head only"]))
    lines = [header("bench_decode_floor", argv),
             (f"### Batch-1 decode step against its weight matmuls (f32 weights "
              f"{weight_bytes / 1e6:.0f} MB, {args.reps} interleaved repetitions, median)"), "",
             "| what | ms | / matmuls only | weight GB/s |", "|---|---:|---:|---:|"]
    for label, ts in times.items():
        ms = 1e3 * float(np.median(ts))
        lines.append(f"| {label} | {ms:.1f} | {ms / 1e3 / floor:.2f}x | "
                     f"{weight_bytes / 1e9 / (ms / 1e3):.1f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
