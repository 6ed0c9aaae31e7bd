"""Issue 14's prefill and decode goals against the floors of this CPU, kvjax and HF side by side.

    python -m experiments.bench_floors --wait-idle 60 [--prompt 512 2048] [--context 128]

Needs torch and transformers, as `experiments.bench_hf` (whose HF model this builds from the same
f32 weights). Batch 1, interleaved rounds (each rotates which variant goes first), medians.

* prefill of P tokens: kvjax's `prefill`, HF's forward (`logits_to_keep=1`), and the model's
  projections alone (q, k, v, o, gate, up, down of every layer at T = P: no norms, RoPE,
  attention or head) once as XLA ops and once as torch's `F.linear` on HF's own modules. The goal
  (kvjax >= 1.25x HF) needs kvjax's prefill <= HF / 1.25; kvjax's prefill contains those
  projections, so where XLA's projections alone take longer, no kvjax built on XLA:CPU's matmuls
  can reach it on these cores.
* kvjax without attention: the same prefill through a cache whose `attend` returns the queries
  unchanged (`WithoutAttention`): every other op of kvjax's own program (projections, norms, RoPE
  of the keys, the cache write, the head), in place. Its time plus exact causal attention's
  products at the projections' XLA rate is the least kvjax's program can take with any attention.
* decode at N cached tokens: kvjax's `decode_step` (+ greedy token), HF's cached step, and one
  read of every f32 weight (a sum over all parameters, in XLA and in torch). Batch-1 decode reads
  all weights once per token, so that read is the floor of a step in any framework; the goal
  (kvjax >= 2x HF) needs a step <= HF / 2. With two or more contexts, the cache the longest
  holds beyond the shortest, read once at that weight-read rate, bounds how flat a step can be
  (goal: the step at the longest <= 1.1x the step at the shortest). Two more decode variants
  split the step's growth with the context: kvjax without attention (`WithoutAttention`: what
  grows besides attention), and kvjax with every layer's cache in buffers of its own that XLA's
  attention products read in place (`InPlaceLayers`: the stacked cache's per-layer slice copies
  gone, which is what per-layer cache buffers would give).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from experiments.bench_decode_floor import matmuls_only
from experiments.bench_formats import header
from experiments.bench_hf import (
    _cache_of,
    _import_hf,
    build_hf_model,
    cache_kwarg,
    report,
    time_decode,
    timed_rounds,
)
from kvjax.cache import KVCache, LayerView
from kvjax.formats import get_format
from kvjax.generate import prefill, sample
from kvjax.loading import load_model
from kvjax.model import to_device
from kvjax.policies import get_policy
from kvjax.tasks.text import default_text, encode_prefix

GOAL = {"prefill": 1.25, "decode": 2.0}  # issue 14: kvjax speed / HF speed at least this
FLAT = 1.1  # issue 14: decode step at the longest context <= this x the step at the shortest


@struct.dataclass
class WithoutAttention(KVCache):
    """The dense cache with its attention replaced by the identity on the queries (and zero
    probabilities): kvjax's program minus attention, for a floor measurement only."""

    def attend(self, view, q, k, v, pos_new, rope_theta: float):
        B, T = q.shape[:2]
        return q, jnp.zeros((B, k.shape[2], T, view.pos.shape[-1] + T), jnp.float32)


@struct.dataclass
class InPlaceLayers(KVCache):
    """The dense cache with each layer's stored keys and values in buffers of their own (k and v
    are tuples of one-layer stores), for a floor measurement only. `attend` runs the layer's
    attention in the `lax.switch` branch of that layer, so its products read the layer's own
    buffers in place; the stacked cache's layer is a dynamic slice, which XLA:CPU copies out
    first. Positions and policy stats stay stacked. For policies that never read the cached
    keys and values themselves (`full`): the view they get holds none."""

    @classmethod
    def of(cls, cache: KVCache) -> InPlaceLayers:
        """`cache` in fresh buffers (it may be donated), each layer's stores its own."""
        L = cache.pos.shape[0]

        def own(tree, i):  # layer i as a stack of one
            return jax.tree.map(lambda a: jnp.array(a[i : i + 1]), tree)

        rest = jax.tree.map(jnp.copy, (cache.pos, cache.stats, cache.length, cache.nonfinite))
        return cls(tuple(own(cache.k, i) for i in range(L)),
                   tuple(own(cache.v, i) for i in range(L)), *rest,
                   fmt=cache.fmt, policy=cache.policy)

    def stacked(self) -> KVCache:
        """The same cache as a `KVCache` (stacked stores)."""
        def stack(stores):
            return jax.tree.map(lambda *a: jnp.concatenate(a), *stores)

        return KVCache(k=stack(self.k), v=stack(self.v), pos=self.pos, stats=self.stats,
                       length=self.length, nonfinite=self.nonfinite, fmt=self.fmt,
                       policy=self.policy)

    def _one(self, i: int) -> KVCache:
        """Layer i alone: a one-layer `KVCache` over its own buffers."""
        return KVCache(k=self.k[i], v=self.v[i], pos=self.pos[i : i + 1],
                       stats=jax.tree.map(lambda s: s[i : i + 1], self.stats),
                       length=self.length, nonfinite=self.nonfinite[i : i + 1],
                       fmt=self.fmt, policy=self.policy)

    def layer_view(self, layer, empty: bool = False) -> LayerView:
        return LayerView(k=None, v=None, pos=self.pos[layer],
                         stats=jax.tree.map(lambda s: s[layer], self.stats), length=self.length,
                         empty=empty, layer=layer)

    def attend(self, view, q, k, v, pos_new, rope_theta: float):
        def branch(i, q, k, v):  # layer i's keys and values read from its own stores
            own = LayerView(k=self.fmt.read(self.k[i], 0, "k"), v=self.fmt.read(self.v[i], 0, "v"),
                            pos=view.pos, stats=view.stats, length=view.length, empty=view.empty)
            return KVCache.attend(self, own, q, k, v, pos_new, rope_theta)

        layers = [functools.partial(branch, i) for i in range(len(self.k))]
        return jax.lax.switch(view.layer, layers, q, k, v)

    def store_layers(self, updates, pos_new) -> InPlaceLayers:
        """Each layer's update written into its own buffers (positions, stats and flags into
        the stacked arrays, in place)."""
        out = self
        ks, vs = list(self.k), list(self.v)
        for i in range(len(self.k)):
            one = self._one(i).store(jnp.zeros((1,), jnp.int32),
                                     jax.tree.map(lambda u, i=i: u[i : i + 1], updates), pos_new)
            ks[i], vs[i] = one.k, one.v
            out = out.replace(
                pos=out.pos.at[i].set(one.pos[0]),
                stats=jax.tree.map(lambda s, n, i=i: s.at[i].set(n[0]), out.stats, one.stats),
                nonfinite=out.nonfinite.at[i].set(one.nonfinite[0]))
        return out.replace(k=tuple(ks), v=tuple(vs))


def decode_bases(params, cfg, prompt, capacity: int, key) -> dict:
    """Per decode variant's cache class, (first sampled token, full f32 cache after `prompt`):
    `KVCache`, `WithoutAttention` (its own prefill), and `InPlaceLayers` (KVCache's cache with
    its layers apart: the same tokens and values)."""
    out = {}
    for kind in (KVCache, WithoutAttention):
        cache = kind.init(cfg, 1, get_policy("full"), get_format("f32"), capacity)
        lg, cache = prefill(params, [prompt], cache, cfg)
        out[kind] = (sample(lg, key), cache)
    tok, cache = out[KVCache]
    out[InPlaceLayers] = (tok, InPlaceLayers.of(cache))
    return out


def projection_flops(cfg, tokens: int) -> float:
    """Multiply-adds x 2 of the seven projections of every layer over `tokens` tokens."""
    d, hq, hk, e, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    per_token = d * e * (2 * hq + 2 * hk) + 3 * d * f
    return 2.0 * tokens * cfg.n_layers * per_token


def causal_attention_flops(cfg, tokens: int) -> float:
    """Multiply-adds x 2 of exact causal attention's two products (q.k and p.v) over `tokens`
    tokens: T (T + 1) / 2 query-key pairs per query head and layer, 2 E each."""
    pairs = tokens * (tokens + 1) / 2
    return 2.0 * 2 * cfg.head_dim * pairs * cfg.n_heads * cfg.n_layers


def torch_projections(torch, model):
    """HF's own projection modules applied in sequence, as `matmuls_only` does in XLA."""
    layers = model.model.layers

    def run(x):  # x [1, T, D]
        for lyr in layers:
            a = lyr.self_attn
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
            o = a.o_proj(q) + k.sum() + v.sum()
            m = lyr.mlp
            x = x + m.down_proj(torch.nn.functional.silu(m.gate_proj(o)) * m.up_proj(o))
        return x

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--context", type=int, nargs="+", default=[128])
    ap.add_argument("--steps", type=int, default=8, help="greedy steps per timed decode block")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before each round wait (at most this long) for other processes to "
                         "use < 0.2 cores; rounds during which they used more are redone")
    ap.add_argument("--out", default=None, help="also write the table here (and FILE.json)")
    a = ap.parse_args(argv)
    if min(*a.prompt, *a.context, a.steps, a.rounds) < 1:
        ap.error("--prompt, --context, --steps and --rounds must be positive")
    torch, transformers = _import_hf()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)

    cfg, np_params, tokenizer = load_model(a.model)
    params = to_device(np_params)
    model = build_hf_model(cfg, np_params, "sdpa")
    ckw = cache_kwarg(model)
    del np_params
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    ids = np.asarray(encode_prefix(tokenizer, default_text(),
                                   max(*a.prompt, *a.context) + a.steps + 1), np.int64)
    full, f32, key = get_policy("full"), get_format("f32"), jax.random.PRNGKey(0)
    mats = matmuls_only(cfg)
    read_xla = jax.jit(lambda p: sum(jnp.sum(x) for x in jax.tree.leaves(p)))
    proj_torch = torch_projections(torch, model)
    xs = {p: jnp.ones((1, p, cfg.d_model), jnp.float32) for p in a.prompt}
    xs_t = {p: torch.ones((1, p, cfg.d_model)) for p in a.prompt}

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    kv_base, hf_base = {}, {}
    for n in a.context:
        for kind, base in decode_bases(params, cfg, ids[:n].tolist(), n + a.steps, key).items():
            kv_base[n, kind] = base
        with torch.inference_mode():
            out = model(input_ids=torch.from_numpy(ids[None, :n]), use_cache=True,
                        logits_to_keep=1)
        hf_base[n] = (out.logits[:, -1:].argmax(-1), _cache_of(out))

    def kv_decode(n, kind=KVCache):
        return time_decode(params, cfg, *kv_base[n, kind], a.steps, key)[0]

    def hf_decode(n):
        tok, cache = hf_base[n]
        with torch.inference_mode():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                tok = model(input_ids=tok, **{ckw: cache}, use_cache=True).logits[:, -1:].argmax(-1)
            dt = (time.perf_counter() - t0) / a.steps
        cache.crop(-a.steps)
        return dt

    def kv_prefill(p, cache_type=KVCache):
        lg, _ = prefill(params, [ids[:p].tolist()], cache_type.init(cfg, 1, full, f32, p), cfg)
        lg.block_until_ready()

    def torch_read():
        with torch.inference_mode():
            return sum(float(w.sum()) for w in model.parameters())

    def hf_prefill(p):
        with torch.inference_mode():
            model(input_ids=torch.from_numpy(ids[None, :p]), use_cache=False, logits_to_keep=1)

    def torch_proj(p):
        with torch.inference_mode():
            proj_torch(xs_t[p])

    variants = {}
    for p in a.prompt:
        variants[("prefill", p)] = {
            "kvjax": lambda p=p: kv_prefill(p),
            "HF": lambda p=p: hf_prefill(p),
            "XLA floor": lambda p=p: mats(params, xs[p]).block_until_ready(),
            "torch floor": lambda p=p: torch_proj(p),
            "kvjax without attention": lambda p=p: kv_prefill(p, WithoutAttention)}
    for n in a.context:
        variants[("decode", n)] = {
            "kvjax": lambda n=n: kv_decode(n), "HF": lambda n=n: hf_decode(n),
            "XLA floor": lambda: read_xla(params).block_until_ready(),
            "torch floor": torch_read,
            "kvjax, cache read in place": lambda n=n: kv_decode(n, InPlaceLayers),
            "kvjax without attention": lambda n=n: kv_decode(n, WithoutAttention)}

    def once(measure, v):
        fn = variants[measure][v]
        return fn() if measure[0] == "decode" and v not in ("XLA floor", "torch floor") \
            else timed(fn)

    t = time.perf_counter()
    for m, fns in variants.items():  # warm-up: compiles, first torch calls
        for v in fns:
            once(m, v)
    print(f"set-up (compiles, context prefills, warm-up): {time.perf_counter() - t:.0f} s",
          flush=True)

    times = {(m, v): [] for m in variants for v in variants[m]}
    names = ["kvjax", "HF", "XLA floor", "torch floor"]

    def one_round(r):
        got = {}
        for m, fns in variants.items():
            order = list(fns)[r % len(fns):] + list(fns)[: r % len(fns)]
            got |= {(m, v): once(m, v) for v in order}
        return got, "; ".join(f"{m[0]} {m[1]}: " + " / ".join(
            f"{v} {got[m, v] * 1e3:.1f} ms" for v in fns) for m, fns in variants.items())

    kept, others, discarded = timed_rounds(a.rounds, a.wait_idle, one_round)
    for got in kept:
        for k, dt in got.items():
            times[k].append(dt)
    med = {k: statistics.median(v) for k, v in times.items() if v}

    rows, summary, notes = [], [], []
    for m, fns in variants.items():
        kind, n = m
        kv, hf, fx, ft = (med[m, v] for v in names)
        goal = hf / GOAL[kind]
        if kind == "prefill":
            label, work = f"prefill {n} tokens", projection_flops(cfg, n) / 1e9
            floor, unit = f"projections only ({work:.0f} GFLOP)", "GFLOP/s"
        else:
            label, work = f"decode at {n} tokens, per token", weight_bytes / 1e9
            floor, unit = f"read all weights ({weight_bytes / 1e6:.0f} MB)", "GB/s"
        rows.append(f"| {label} | {kv * 1e3:.1f} ms | {hf * 1e3:.1f} ms | {hf / kv:.2f}x | "
                    f"{GOAL[kind]}x: <= {goal * 1e3:.1f} ms | {floor} | {fx * 1e3:.1f} ms "
                    f"({work / fx:.1f} {unit}) | {ft * 1e3:.1f} ms ({work / ft:.1f} {unit}) | "
                    f"{fx / goal:.2f}x |")
        summary.append({"measure": kind, "tokens": n, "seconds": {v: med[m, v] for v in fns},
                        "goal_seconds": goal, "xla_floor_over_goal": fx / goal})
        if kind == "prefill":  # + attention's products at the projections' rate (an estimate)
            att = causal_attention_flops(cfg, n) / 1e9
            products = att / (work / fx)  # seconds at the projections' rate
            with_att, bare = fx + products, med[m, "kvjax without attention"]
            notes.append(f"* prefill {n} tokens: exact causal attention's q.k and p.v products "
                         f"are {att:.1f} GFLOP more; at the XLA projections' rate "
                         f"({work / fx:.1f} GFLOP/s) the projections and those products take "
                         f"{with_att * 1e3:.1f} ms = {with_att / goal:.2f}x the goal's "
                         f"{goal * 1e3:.1f} ms, before norms, RoPE, softmax and the head. kvjax "
                         f"without attention takes {bare * 1e3:.1f} ms (its attention "
                         f"{(kv - bare) * 1e3:.1f} ms, {att / (kv - bare):.1f} GFLOP/s of those "
                         f"products); with those products at that rate, "
                         f"{(bare + products) * 1e3:.1f} ms = {(bare + products) / goal:.2f}x "
                         "the goal.")
            summary[-1] |= {"attention_gflop": att, "xla_floor_with_attention_seconds": with_att,
                            "without_attention_seconds": bare,
                            "without_attention_floor_over_goal": (bare + products) / goal}
    if len(a.context) > 1:  # the longer cache read once at the weights' read rate
        lo, hi = min(a.context), max(a.context)
        extra = kv_base[hi, KVCache][1].nbytes() - kv_base[lo, KVCache][1].nbytes()
        rate = weight_bytes / med[("decode", lo), "XLA floor"]
        step = med[("decode", lo), "kvjax"]
        least = (step + extra / rate) / step

        def grows(v):  # a variant's step at hi minus its step at lo
            return med[("decode", hi), v] - med[("decode", lo), v]

        def steps(v):
            return f"{med[('decode', lo), v] * 1e3:.1f} -> {med[('decode', hi), v] * 1e3:.1f} ms"

        in_place, bare = grows("kvjax, cache read in place"), grows("kvjax without attention")
        with_in_place = (step + in_place) / step
        notes.append(f"* decode flatness: the cache at {hi} tokens holds {extra / 1e6:.1f} MB "
                     f"more than at {lo}; read once at the weights' XLA read rate "
                     f"({rate / 1e9:.1f} GB/s) that is {extra / rate * 1e3:.2f} ms, so a step "
                     f"at {hi} is at least {least:.3f}x kvjax's step at {lo} "
                     f"(goal <= {FLAT}x; measured "
                     f"{med[('decode', hi), 'kvjax'] / step:.3f}x). From {lo} to {hi} tokens "
                     f"kvjax's step grows {grows('kvjax') * 1e3:.2f} ms ({steps('kvjax')}); "
                     f"without attention {bare * 1e3:.2f} ms "
                     f"({steps('kvjax without attention')}); with every layer's cache in its "
                     f"own buffers, read in place by XLA's own attention products "
                     f"(`InPlaceLayers`), {in_place * 1e3:.2f} ms "
                     f"({steps('kvjax, cache read in place')}): kvjax's step at {lo} plus that "
                     f"growth is {with_in_place:.3f}x its step at {lo}.")
        summary.append({"measure": "decode flatness", "tokens": [lo, hi],
                        "extra_cache_bytes": extra, "least_ratio": least,
                        "ratio": med[("decode", hi), "kvjax"] / step, "goal_ratio": FLAT,
                        "growth_seconds": {v: grows(v) for v in variants[("decode", lo)]
                                           if "floor" not in v},
                        "in_place_ratio": with_in_place})
    head = (f"{header('bench_floors', argv)}\nmachine: {platform.processor() or platform.machine()}"
            f", {cores} core(s), jax {jax.__version__}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}; f32, batch 1, HF at {cores} threads (sdpa); medians of "
            f"{len(others)} interleaved rounds"
            + (f" ({discarded} discarded: other processes busy)" if discarded else "")
            + ("" if None in others or not others else
               f"; other processes used {min(others):.2f}-{max(others):.2f} cores") + "\n\n")
    table = ("| measure | kvjax | HF | kvjax speed / HF | goal | floor | XLA floor | "
             "torch floor | XLA floor / goal |\n|---|---:|---:|---:|---|---|---:|---:|---:|\n"
             + "\n".join(rows) + ("\n\n" + "\n".join(notes) if notes else ""))
    report(head + table, a.out, {"machine": head, "rounds": len(others), "discarded": discarded,
                                 "other_cores": others, "rows": summary})
    return summary


if __name__ == "__main__":
    main()
