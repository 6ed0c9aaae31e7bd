"""Cache writes in blocks of layers against a scan of per-layer writes, side by side.

    python -m experiments.bench_write_layers [--rounds 7] [--steps 8] [--wait-idle 60] [--out F]

`forward` stores a chunk's keys and values after its layer scan with `cache.store_layers`: for
the dense layout and the base formats, in blocks of as many layers as the format takes at once
(`fmt.layers_per_write`; all 30 in a decode step). Before, a scan wrote one layer at a time, so
a per-channel int4 key write ran its ~100 small XLA ops once per layer. This script compiles
both versions of the same step (the per-layer one with `KVCache.store_layers` swapped for
`kvjax.cache.store_by_layer` while it traces) and times them interleaved on the real model:
decode steps after the cached tokens each case names, and 128-token chunks (the main job's
perplexity step). Both must leave bit-identical caches and logits (checked before timing).
Prints medians and their ratio, and the median of each round's ratio of the two (adjacent
in time, so less exposed to a noisy machine's drift), then each compiled program's temporary buffers
(`memory_analysis`), for these steps and for one-chunk prefills (`PREFILLS`, compiled, not
run), whose blocks are bounded by `formats.WRITE_BLOCK_BYTES`; --out writes the Markdown and a
JSON beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_hf import timed_rounds
from kvjax.cache import KVCache, copy, store_by_layer
from kvjax.formats import get_format
from kvjax.generate import prefill
from kvjax.loading import load_model
from kvjax.model import forward, to_device
from kvjax.policies import get_policy
from kvjax.tasks.text import default_text, encode_prefix

# (label, policy, budget (None: room for all), format, cached tokens, chunk tokens)
CASES = [
    ("full f32, decode", "full", None, "f32", 1024, 1),
    ("full int4, decode", "full", None, "int4", 1024, 1),
    ("h2o/512 int4, decode (evicting)", "h2o", 512, "int4", 1024, 1),
    ("h2o/512 int4, decode", "h2o", 512, "int4", 128, 1),
    ("lru/512 int4, 128-token chunk", "lru", 512, "int4", 512, 128),
]
PREFILLS = [("full f32, prefill", "f32", 2048), ("full int4, prefill", "int4", 2048)]


@contextlib.contextmanager
def layer_by_layer():
    """Dense caches store through a scan of per-layer writes (the code before store_layers)."""
    batched = KVCache.store_layers
    KVCache.store_layers = store_by_layer
    try:
        yield
    finally:
        KVCache.store_layers = batched


def traced_as(version: str):
    """The context a version's step is traced in: "by layer" under the swap."""
    return layer_by_layer() if version == "by layer" else contextlib.nullcontext()


def temp_bytes(fn, *args) -> int:
    """The compiled program's temporary buffers (beyond its arguments and outputs)."""
    return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8, help="decode steps (chunks) per round")
    ap.add_argument("--wait-idle", type=float, default=0.0,
                    help="before each round wait up to this many s for idle cores")
    ap.add_argument("--out", help="also write the Markdown here (and JSON beside it)")
    a = ap.parse_args(argv)

    cfg, np_params, tokenizer = load_model("smollm2-135m")
    params = to_device(np_params)
    del np_params
    need = max([n + a.steps * t for *_, n, t in CASES] + [n for *_, n in PREFILLS]) + 1
    ids = np.asarray(encode_prefix(tokenizer, default_text(), need), np.int32)
    assert len(ids) >= need, f"the default text gives {len(ids)} tokens, {need} needed"

    def step_fn():
        """A jitted chunk step of its own (its own trace, so each version keeps its program)."""
        def step(params, tokens, cache):
            logits, cache = forward(params, tokens, cache, cfg, logits_at=jnp.array([0]))
            return logits[:, 0], cache
        return jax.jit(step, donate_argnums=(2,))

    versions = ("by layer", "batched")
    setups, fns, temp = {}, {}, {}
    for label, pol, budget, form, n, t in CASES:
        policy = get_policy(pol, budget=budget) if budget else get_policy(pol)
        fmt = get_format(form)
        cap = fmt.fit(budget or n + a.steps * t)
        _, cache = prefill(params, [ids[:n].tolist()], KVCache.init(cfg, 1, policy, fmt, cap),
                           cfg)
        chunks = [jnp.asarray(ids[None, n + i * t:n + (i + 1) * t]) for i in range(a.steps)]
        setups[label] = (cache, chunks)
        for v in versions:
            with traced_as(v):  # traced (and compiled) now, under the swap for "by layer"
                fns[label, v] = step_fn()
                jax.block_until_ready(fns[label, v](params, chunks[0], copy(cache)))
                temp[label, v] = temp_bytes(fns[label, v], params, chunks[0], cache)
    for label, form, n in PREFILLS:
        cache = KVCache.init(cfg, 1, get_policy("full"), get_format(form), n)
        tokens = jnp.asarray(ids[None, :n])
        for v in versions:
            with traced_as(v):
                temp[label, v] = temp_bytes(step_fn(), params, tokens, cache)

    def run(label, version):
        """Seconds per step over the chunks, and the final logits and cache."""
        cache, chunks = setups[label]
        c = copy(cache)
        jax.block_until_ready(c)
        f = fns[label, version]
        t0 = time.perf_counter()
        for chunk in chunks:
            lg, c = f(params, chunk, c)
        jax.block_until_ready((lg, c))
        return (time.perf_counter() - t0) / len(chunks), (lg, c)

    for label, *_ in CASES:  # the same numbers both ways, before any timing
        _, one = run(label, "batched")
        _, two = run(label, "by layer")
        for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(two), strict=True):
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                raise SystemExit(f"{label}: the two versions differ; not timing them")
    print("both versions: identical logits and caches in every case", flush=True)

    def one_round(r):
        got = {}
        for label, *_ in CASES:
            for v in versions[r % 2:] + versions[:r % 2]:
                got[label, v] = run(label, v)[0]
        return got, "; ".join(f"{label}: " + " / ".join(f"{got[label, v] * 1e3:.1f}"
                                                          for v in versions)
                              for label, *_ in CASES)

    kept, others, discarded = timed_rounds(a.rounds, a.wait_idle, one_round)
    rows, records = [], []
    for label, pol, budget, form, n, t in CASES:
        med = {v: float(np.median([k[label, v] for k in kept])) for v in versions}
        ratio = med["by layer"] / med["batched"]
        per_round = [k[label, "by layer"] / k[label, "batched"] for k in kept]
        rows.append(f"| {label} | {n} | {med['by layer'] * 1e3:.1f} | "
                    f"{med['batched'] * 1e3:.1f} | {ratio:.2f}x | {np.median(per_round):.2f}x "
                    f"({sum(r > 1 for r in per_round)}/{len(per_round)}) |")
        records.append({"case": label, "policy": pol, "budget": budget, "format": form,
                        "cached_tokens": n, "chunk": t, "by_layer_s": med["by layer"],
                        "batched_s": med["batched"], "speedup": ratio,
                        "per_round_speedup": per_round})
    mem_rows, mem = [], []
    for label, t in [(c[0], c[5]) for c in CASES] + [(c[0], c[2]) for c in PREFILLS]:
        mib = {v: temp[label, v] / 2**20 for v in versions}
        mem_rows.append(f"| {label} | {t} | {mib['by layer']:.1f} | {mib['batched']:.1f} |")
        mem.append({"case": label, "chunk": t, "by_layer_temp_bytes": temp[label, "by layer"],
                    "batched_temp_bytes": temp[label, "batched"]})
    busy = [o for o in others if o is not None]
    text = "\n".join([
        (f"Medians of {len(kept)} interleaved rounds of {a.steps} steps each "
        f"({discarded} discarded as busy; other processes "
        f"{max(busy) if busy else float('nan'):.2f} cores at most); jax {jax.__version__}."), "",
        ("| case | cached tokens | per-layer writes (scan), ms/step | batched over layers, ms/step "
        "| speed-up | per-round speed-up, median (rounds faster) |"), "|---|---:|---:|---:|---:|---:|",
        *rows, "",
        "Temporary buffers of each compiled step (MiB, `memory_analysis().temp_size_in_bytes`):",
        "", "| case | tokens in the chunk | per-layer writes | batched over layers |",
        "|---|---:|---:|---:|", *mem_rows])
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        with open(a.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump({"rounds": len(kept), "steps": a.steps, "records": records,
                       "temp": mem}, f, indent=1)


if __name__ == "__main__":
    main()
