"""Decode-step time of the eviction policies, measured side by side in one run.

  1. h2o / lru (and the others) against `full` at equal capacity: goal <= 1.15x;
  2. a budget-512 cache after 8k tokens seen against after 1k: goal flat (<= 1.1x),
     beside `full` whose cache grows from 1k to 8k slots.

The caches are filled synthetically (random keys and values, positions and lengths as if the
tokens had been decoded, so every measured step evicts), then each configuration runs
`generate.decode_step` in interleaved rounds; the figures are the median and the 10th
percentile of the per-step wall times and the median CPU time of this process per step (the
work done: the figure least disturbed by other load on a shared machine).

    python -m experiments.bench_policies                       # SmolLM2-135M, f32, CPU
    python -m experiments.bench_policies --model mid --rounds 3  # random mid-size config
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import rope, rope_table
from kvjax.cache import KVCache, LayerView
from kvjax.config import ModelConfig
from kvjax.formats import get_format
from kvjax.generate import decode_step
from kvjax.model import init_params, to_device
from kvjax.policies import get_policy
from kvjax.policies.base import scatter_slots


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    policy: object
    max_len: int
    seen: int  # tokens in the cache's past when timing starts


def load(model: str):
    if model == "mid":
        cfg = ModelConfig(vocab_size=8192, d_model=512, n_layers=12, n_heads=8, n_kv_heads=2,
                          head_dim=64, d_ff=1536, max_seq_len=8192, name="mid")
        return cfg, init_params(cfg, jax.random.PRNGKey(0))
    from kvjax.loading import load_model

    cfg, params, _ = load_model(model)
    return cfg, to_device(params)


def filled(cfg: ModelConfig, case: Case, fmt, seed: int = 0) -> KVCache:
    """A cache whose slots hold `seen` tokens' worth of state (the newest ones, plus sinks)."""
    cache = KVCache.init(cfg, 1, case.policy, fmt, case.max_len)
    L, B, K, C = cache.pos.shape
    n_sink = getattr(case.policy, "n_sink", 0)
    held = min(case.seen, C)
    recent = np.arange(case.seen - (held - min(n_sink, held)), case.seen)
    pos = np.concatenate([np.arange(min(n_sink, held)), recent]).astype(np.int32)
    pos = np.concatenate([pos, np.full(C - held, -1, np.int32)])  # [C]
    key = jax.random.PRNGKey(seed)
    kx, kv, ks = jax.random.split(key, 3)
    x_k = 0.5 * jax.random.normal(kx, (L, B, K, C, cfg.head_dim))
    x_v = 0.5 * jax.random.normal(kv, (L, B, K, C, cfg.head_dim))
    slots = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C))
    k, v = cache.k, cache.v
    for layer in range(L):
        k = fmt.write(k, layer, slots, x_k[layer], "k")
        v = fmt.write(v, layer, slots, x_v[layer], "v")
    stats = jax.tree.map(lambda s: _noise(ks, s), cache.stats)
    return cache.replace(k=k, v=v, pos=jnp.broadcast_to(jnp.asarray(pos), (L, B, K, C)),
                         stats=stats, length=jnp.full((B,), case.seen, jnp.int32))


def _noise(key, s):
    """Plausible stats: small positive scores, or recent clock values for integer stats."""
    if jnp.issubdtype(s.dtype, jnp.floating):
        return jax.random.uniform(key, s.shape, s.dtype)
    if s.dtype == bool:
        return s
    return jnp.zeros(s.shape, s.dtype)


def time_steps(params, cfg, cache, steps: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds (all threads of this process) of each of `steps` decode steps,
    after one untimed step. CPU time counts the work done, so it is the figure least moved by
    other processes competing for the cores."""
    tok = jnp.zeros((1,), jnp.int32)
    logits, cache = decode_step(params, tok, cache, cfg)
    logits.block_until_ready()
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        logits, cache = decode_step(params, tok, cache, cfg)
        logits.block_until_ready()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def policy_only(cfg: ModelConfig, policy, C: int, seen: int, reps: int = 200) -> float:
    """Median seconds of the policy's own work in one decode step: `update` (plus the cached-key
    positions RoPE needs) for every layer, and the pos scatter, without the model around it."""
    B, K, E, L = 1, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    pos = jnp.broadcast_to(jnp.arange(seen - C, seen, dtype=jnp.int32), (B, K, C))
    view = LayerView(k=jnp.ones((B, K, C, E)), v=jnp.ones((B, K, C, E)), pos=pos,
                     stats=policy.init_stats(B, K, C), length=jnp.full((B,), seen, jnp.int32))
    probs = cfg.group_size * jax.nn.softmax(
        jax.random.normal(jax.random.PRNGKey(0), (B, K, 1, C + 1)), axis=-1)  # [B, K, 1, C + 1]
    k_new = jnp.ones((B, 1, K, E))
    pos_new = jnp.full((B, 1), seen, jnp.int32)

    @jax.jit
    def run(view, probs):
        def body(carry, _):
            v, acc = carry
            slots, stats = policy.update(v, k_new, k_new, pos_new, probs)
            key_pos = policy.rope_positions(v, pos_new)[1]
            if key_pos is not None:  # what the model then spends rotating the cached keys
                table = rope_table(C, E, cfg.rope_theta)  # as KVCache.attend does
                acc = acc + jnp.sum(rope(v.k, key_pos, cfg.rope_theta, table))
            p = scatter_slots(v.pos, slots, jnp.broadcast_to(pos_new[:, None, :], slots.shape))
            return (dataclasses.replace(v, pos=p, stats=stats), acc), None

        return jax.lax.scan(body, (view, jnp.float32(0)), None, length=L)[0]

    jax.block_until_ready(run(view, probs))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(view, probs))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cases(budget: int, short: int, long: int):
    b = budget
    return [
        Case("full C=budget", get_policy("full"), b, b - 64),
        Case("window", get_policy("window", budget=b), long, short),
        Case("streaming", get_policy("streaming", budget=b), long, short),
        Case("h2o", get_policy("h2o", budget=b), long, short),
        Case("lru", get_policy("lru", budget=b), long, short),
        Case("lru topk", get_policy("lru", budget=b, used_by="topk"), long, short),
        Case("tova", get_policy("tova", budget=b), long, short),
        Case("knorm", get_policy("knorm", budget=b), long, short),
        Case("random", get_policy("random", budget=b), long, short),
        Case("h2o @long", get_policy("h2o", budget=b), long, long),
        Case("lru @long", get_policy("lru", budget=b), long, long),
        Case("full @short", get_policy("full"), short, short - 64),
        Case("full @long", get_policy("full"), long, long - 64),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registered model name, or 'mid'")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--short", type=int, default=1024, help="tokens seen, short context")
    ap.add_argument("--long", type=int, default=8192, help="tokens seen, long context")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    ap.add_argument("--only", nargs="*", help="labels to run (default: all)")
    args = ap.parse_args(argv)
    for flag, value, least in (("--budget", args.budget, 64), ("--short", args.short, 64),
                               ("--long", args.long, 64), ("--steps", args.steps, 1),
                               ("--rounds", args.rounds, 1)):
        if value < least:  # the full cases start 64 tokens below their capacity
            ap.error(f"{flag} must be >= {least}, got {value}")
    every = cases(args.budget, args.short, args.long)
    labels = [c.label for c in every]
    bad = [label for label in args.only or () if label not in labels]
    if bad:
        ap.error(f"--only: unknown label(s) {', '.join(map(repr, bad))}; valid labels: "
                 f"{', '.join(map(repr, labels))}")

    cfg, params = load(args.model)
    fmt = get_format("f32")
    todo = [c for c in every if not args.only or c.label in args.only]
    for c in todo:  # compile and warm every configuration first
        t0 = time.perf_counter()
        time_steps(params, cfg, filled(cfg, c, fmt), 1)
        print(f"# compiled {c.label:14s} ({time.perf_counter() - t0:.1f} s)", flush=True)
    wall = {c.label: [] for c in todo}
    cpu = {c.label: [] for c in todo}
    for _ in range(args.rounds):
        for c in todo:
            w, u = time_steps(params, cfg, filled(cfg, c, fmt), args.steps)
            wall[c.label] += w
            cpu[c.label] += u
    med = {k: statistics.median(v) for k, v in wall.items()}
    low = {k: float(np.percentile(v, 10)) for k, v in wall.items()}
    work = {k: statistics.median(v) for k, v in cpu.items()}

    print(f"\nmodel={cfg.name} budget={args.budget} backend={jax.default_backend()} "
          f"steps={args.steps} rounds={args.rounds}")
    print("| configuration | capacity | tokens seen | wall ms/step median | wall p10 | "
          "CPU ms/step median | ratio: wall median, wall p10, CPU |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for c in todo:
        ref = None
        if c.label.startswith("full @"):
            ref = "full C=budget"
        elif "@long" in c.label:
            ref = c.label.replace(" @long", "")
        elif not c.label.startswith("full"):
            ref = "full C=budget"
        ratio = ""
        if ref in med:
            ratio = (f"{med[c.label] / med[ref]:.2f}x, {low[c.label] / low[ref]:.2f}x, "
                     f"{work[c.label] / work[ref]:.2f}x vs {ref}")
        print(f"| {c.label} | {c.policy.capacity(c.max_len)} | {c.seen} | "
              f"{1e3 * med[c.label]:.1f} | {1e3 * low[c.label]:.1f} | {1e3 * work[c.label]:.1f} | "
              f"{ratio} |")

    print(f"\npolicy work alone per decode step ({cfg.n_layers} layers, C={args.budget}):")
    print("| policy | ms/step | share of the full step (median) |")
    print("|---|---:|---:|")
    base = med.get("full C=budget")
    for c in todo:
        if "@" in c.label or c.label.startswith("full"):
            continue
        dt = policy_only(cfg, c.policy, args.budget, c.seen)
        share = f"{100 * dt / base:.1f}%" if base else ""
        print(f"| {c.label} | {1e3 * dt:.2f} | {share} |")


if __name__ == "__main__":
    main()
