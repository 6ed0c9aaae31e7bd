"""KV storage formats on the default model (SmolLM2-135M): bytes, quality, decode-step memory
and time. Figures go to docs/formats.md ("Measured").

    python -m experiments.bench_formats                       # every section
    python -m experiments.bench_formats --only ppl --formats int4 int4:key_mode=token
    python -m experiments.bench_formats --only memory speed --context 8192 --reps 7

Sections:

* `bytes`: real k+v buffer bytes at 2048 tokens against bf16 (`kvjax.formats.byte_table`).
* `ppl`: perplexity of the first 2048 tokens of tests/data/text_ids.npy under the full policy,
  fed through `forward` `--ppl-chunk` tokens at a time (default 1: token by token, as in
  decoding; ~2.5 min per format on 2 CPU cores). A one-shot forward would score every token
  against the chunk's own float32 keys and values, so quantization would never show; with
  chunks of T tokens, a token reads exact keys/values for the up to T - 1 tokens before it in
  its chunk, which hides much of the error of formats without a full-precision residual
  (int4 per-token keys: +1.3 % at T = 64, +2.9 % at 16, +6.5 % at 1). ΔPPL is against the f32
  cache at the same chunking (so it isolates the storage format).
* `memory`: the compiled decode step's `memory_analysis()` at `--context` tokens (real shape,
  random params): temporary bytes against the whole cache in f32 and one layer's dequantized
  k and v, showing that attention reads one layer at a time and never a full-precision copy.
* `speed`: decode-step time at `--context` tokens for each format, repetitions interleaved so
  every format sees the same machine load; then where the time goes: the 30 layers' reads
  (each through a decode step's attention products, as the model uses them) and writes of each
  format alone (writes as the cache makes them, in blocks of layers, and one
  layer at a time as before `KVCache.store_layers`).

Format specs: `name[:option=value...]`, e.g. `int4:group=64:key_mode=token`.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import attention
from kvjax.cache import KVCache
from kvjax.formats import byte_table, get_format, scan_layer_blocks
from kvjax.generate import decode_step
from kvjax.policies import get_policy
from kvjax.tasks.base import nll_chunk

TEXT_IDS = Path(__file__).resolve().parents[1] / "tests" / "data" / "text_ids.npy"
SECTIONS = ("bytes", "ppl", "memory", "speed")
PPL_FORMATS = (
    "bf16", "fp8", "int8",
    "int4", "int4:group=32", "int4:group=32:value_group=64",
    "int4:key_mode=token", "int4:key_mode=token:group=32:value_group=64",
    "int2", "int2:key_mode=token", "int4:keep_layers=0",
)
SPEED_FORMATS = ("f32", "bf16", "int8", "int4", "int4:key_mode=token", "int2")


def parse_format(spec: str):
    """'int4:group=64:key_mode=token' -> the format (ints parsed, tuples as a-b-c)."""
    name, *opts = spec.split(":")
    options = {}
    for o in opts:
        k, _, v = o.partition("=")
        if "-" in v or k.startswith("keep_"):
            options[k] = tuple(int(x) for x in v.split("-") if x)
        elif v.lstrip("-").isdigit():
            options[k] = int(v)
        else:
            options[k] = v
    return get_format(name, **options)


def load_real():
    from kvjax.loading import load_model
    from kvjax.model import to_device

    cfg, params, _ = load_model("smollm2-135m")
    return cfg, to_device(params)


def real_config_random_params(seed: int = 0):
    from kvjax.loading import load_model
    from kvjax.model import init_params

    cfg = load_model("smollm2-135m")[0]
    return cfg, init_params(cfg, jax.random.PRNGKey(seed))


# ----------------------------------------------------------------------------- sections


def section_bytes() -> list[str]:
    out = ["### Bytes at 2048 tokens (k + v, metadata included), ratio to bf16", "",
           "| format | bytes | / bf16 |", "|---|---:|---:|"]
    out += [f"| {label} | {n:,} | {r:.4f} |" for label, n, r in byte_table()]
    return out


_nll_step = jax.jit(nll_chunk, static_argnames=("cfg",), donate_argnames=("cache",))


def stream_nll(params, cfg, ids: np.ndarray, fmt, chunk: int, policy=None, final=None):
    """nll[i] = -log p(ids[i+1] | ids[:i+1]) with the text fed in chunks through the cache
    (`policy`, default full). `final`, a dict, receives the last cache under "cache"."""
    n = len(ids)
    cache = KVCache.init(cfg, 1, policy or get_policy("full"), fmt, n)
    nll = np.zeros(n, np.float32)
    padded = np.zeros(math.ceil(n / chunk) * chunk + 1, np.int32)
    padded[:n] = ids
    for s in range(0, n, chunk):
        toks = jnp.asarray(padded[None, s:s + chunk])
        tgts = jnp.asarray(padded[None, s + 1:s + chunk + 1])
        nv = jnp.asarray([min(chunk, n - s)], jnp.int32)
        out, cache = _nll_step(params, toks, tgts, nv, cache, cfg)
        nll[s:s + chunk] = np.asarray(out[0, : min(chunk, n - s)])
    cache.check_finite()
    if final is not None:
        final["cache"] = cache
    return nll[: n - 1]


def section_ppl(specs, tokens: int, chunk: int) -> list[str]:
    cfg, params = load_real()
    ids = np.load(TEXT_IDS)[:tokens]
    rows, base = [], None
    for spec in ("f32",) + tuple(specs):
        t = time.perf_counter()
        nll = stream_nll(params, cfg, ids, parse_format(spec), chunk)
        ppl = float(np.exp(nll.astype(np.float64).mean()))
        base = ppl if base is None else base
        kv = KVCache.abstract(cfg, 1, get_policy("full"), parse_format(spec), tokens)
        rows.append((spec, ppl, 100 * (ppl / base - 1), kv_bytes(kv), time.perf_counter() - t))
        print(f"  ppl {spec}: {ppl:.4f} ({rows[-1][2]:+.3f} %) {rows[-1][4]:.0f} s", flush=True)
    bf16 = kv_bytes(KVCache.abstract(cfg, 1, get_policy("full"), get_format("bf16"), tokens))
    out = [(f"### Perplexity, {tokens} tokens of tests/data/text_ids.npy, full policy, chunks of "
           f"{chunk} (f32 at the same chunking is the reference)"), "",
           "| format | PPL | ΔPPL | k+v bytes / bf16 |", "|---|---:|---:|---:|"]
    out += [f"| {s} | {p:.4f} | {d:+.3f} % | {b / bf16:.4f} |" for s, p, d, b, _ in rows]
    return out


def kv_bytes(cache) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves((cache.k, cache.v)))


@jax.jit
def _fill_kv(cache, key):
    """Every layer holds `length` tokens of N(0, 1) keys/values written through the format
    (per-channel keys end in their real full-policy state: sealed groups + residual)."""
    L, B, K, C = cache.pos.shape
    E = jax.eval_shape(lambda c: c.layer_view(0), cache).k.shape[-1]
    n = cache.length[0]
    slots = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C))
    slots = jnp.where(slots < n, slots, C)

    def body(c, layer):
        kk, kv = jax.random.split(jax.random.fold_in(key, layer))
        k = jax.random.normal(kk, (B, K, C, E))
        v = jax.random.normal(kv, (B, K, C, E))
        return c.replace(k=c.fmt.write(c.k, layer, slots, k, "k"),
                         v=c.fmt.write(c.v, layer, slots, v, "v")), None

    cache, _ = jax.lax.scan(body, cache, jnp.arange(L, dtype=jnp.int32))
    pos = jnp.where(slots < n, slots, -1)
    return cache.replace(pos=jnp.broadcast_to(pos, cache.pos.shape))


def filled_cache(cfg, fmt, context: int, spare: int, batch: int = 1):
    """A full-policy cache of capacity `context` holding context - spare tokens per row."""
    cache = KVCache.init(cfg, batch, get_policy("full"), fmt, context)
    cache = cache.replace(length=jnp.full((batch,), context - spare, jnp.int32))
    return _fill_kv(cache, jax.random.PRNGKey(1))


def section_memory(specs, context: int) -> list[str]:
    cfg, params = real_config_random_params()
    L, K, E = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    whole_f32 = 2 * L * K * context * E * 4
    layer_f32 = 2 * K * context * E * 4
    tok = jnp.zeros((1,), jnp.int32)
    out = [f"### Decode-step memory at {context} tokens (real shape, batch 1)", "",
           (f"Whole cache in f32: {whole_f32 / 2**20:.1f} MiB; one layer's dequantized k + v: "
           f"{layer_f32 / 2**20:.2f} MiB."), "",
           ("| format | cache bytes (MiB) | temp bytes (MiB) | temp / whole f32 cache | "
           "temp / one layer's k+v |"), "|---|---:|---:|---:|---:|"]
    for spec in specs:
        cache = KVCache.abstract(cfg, 1, get_policy("full"), parse_format(spec), context)
        ma = decode_step.lower(params, tok, cache, cfg).compile().memory_analysis()
        temp = ma.temp_size_in_bytes
        out.append(f"| {spec} | {kv_bytes(cache) / 2**20:.1f} | {temp / 2**20:.2f} | "
                   f"{temp / whole_f32:.4f} | {temp / layer_f32:.2f} |")
        print(f"  memory {spec}: temp {temp / 2**20:.2f} MiB", flush=True)
    return out


def _layers_fn(fmt, L, B, K, C, E, what, G=1):
    """The 30 layers' reads, each through a one-token decode step's attention products over
    its C slots (G query heads per kv head), or one-token writes: "write" in the blocks of
    layers the cache writes at once, "write1" one layer at a time."""
    q = jnp.ones((B, K, 1, E), jnp.float32)
    if what == "read":
        q1 = jnp.ones((B, 1, K * G, E), jnp.float32)  # [B, T, H, E]
        kv1 = jnp.ones((B, 1, K, E), jnp.float32)  # [B, T, K, E]
        pos_new = jnp.full((B, 1), C, jnp.int32)  # [B, T]
        pos_cache = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C))  # [B, K, C]

        def run(k, v):
            def body(acc, layer):
                out, _ = attention(q1, kv1, kv1, pos_new, fmt.read(k, layer, "k"),
                                   fmt.read(v, layer, "v"), pos_cache,
                                   queries_lead=fmt.keys_by_channel)
                return acc + out.sum(), None
            return jax.lax.scan(body, 0.0, jnp.arange(L, dtype=jnp.int32))[0]
        return jax.jit(run)

    n = fmt.layers_per_write(L, B, K, 1, E) if what == "write" else 1  # as `store_layers`
    slots = jnp.full((L, B, K, 1), C - 1, jnp.int32)  # [L, B, K, T]
    x = jnp.broadcast_to(q, (L, *q.shape))  # [L, B, K, T, E]

    def run_w(k, v):
        def write(kv, layer, sx):
            return tuple(fmt.write(s, layer, *sx, kind) for s, kind in zip(kv, "kv"))
        return scan_layer_blocks(write, (k, v), (slots, x), n)
    return jax.jit(run_w, donate_argnums=(0, 1))


def section_speed(specs, context: int, reps: int, batch: int = 1) -> list[str]:
    cfg, params = real_config_random_params()
    L, K, E = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    spare = reps + 4
    caches, times, reads, writes, writes1, rw = {}, {}, {}, {}, {}, {}
    tok = jnp.zeros((batch,), jnp.int32)
    for spec in specs:
        fmt = parse_format(spec)
        c = filled_cache(cfg, fmt, context, spare, batch)
        for _ in range(2):  # compile + warm
            lg, c = decode_step(params, tok, c, cfg)
        jax.block_until_ready(lg)
        caches[spec], times[spec], reads[spec], writes[spec], writes1[spec] = c, [], [], [], []
        rfn, wfn, w1fn = (_layers_fn(fmt, L, batch, K, context, E, what, cfg.n_heads // K)
                          for what in ("read", "write", "write1"))
        rfn(c.k, c.v).block_until_ready()
        kv = wfn(jax.tree.map(jnp.copy, c.k), jax.tree.map(jnp.copy, c.v))
        kv = w1fn(*kv)
        jax.block_until_ready(kv)
        rw[spec] = (rfn, wfn, w1fn, kv)
        print(f"  speed {spec}: compiled", flush=True)
    for _ in range(reps):  # interleaved: every format sees the same load
        for spec in specs:
            t = time.perf_counter()
            lg, caches[spec] = decode_step(params, tok, caches[spec], cfg)
            lg.block_until_ready()
            times[spec].append(time.perf_counter() - t)
            rfn, wfn, w1fn, kv = rw[spec]
            c = caches[spec]
            t = time.perf_counter()
            rfn(c.k, c.v).block_until_ready()
            reads[spec].append(time.perf_counter() - t)
            t = time.perf_counter()
            kv = wfn(*kv)
            jax.block_until_ready(kv)
            writes[spec].append(time.perf_counter() - t)
            t = time.perf_counter()
            kv = w1fn(*kv)
            jax.block_until_ready(kv)
            writes1[spec].append(time.perf_counter() - t)
            rw[spec] = (rfn, wfn, w1fn, kv)
    ms = {s: 1e3 * float(np.median(times[s])) for s in specs}
    base = ms[specs[0]]
    out = [(f"### Decode-step time at {context} tokens (batch {batch}, real shape, random params, "
           f"{reps} interleaved repetitions, median)"), "",
           (f"| format | step ms | speed-up vs {specs[0]} | 30 layers' k+v reads and attention ms | "
           "30 layers' k+v writes ms (in blocks) | (a layer at a time) |"),
           "|---|---:|---:|---:|---:|---:|"]
    for s in specs:
        out.append(f"| {s} | {ms[s]:.1f} | {base / ms[s]:.2f}x | "
                   f"{1e3 * np.median(reads[s]):.1f} | {1e3 * np.median(writes[s]):.1f} | "
                   f"{1e3 * np.median(writes1[s]):.1f} |")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--formats", nargs="+", help="format specs for ppl (f32 is always the "
                    "reference); default: every format and the main variants")
    ap.add_argument("--speed-formats", nargs="+", default=list(SPEED_FORMATS))
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--ppl-chunk", type=int, default=1,
                    help="tokens per forward (1: every token reads the quantized cache; "
                    "larger chunks are faster but score within-chunk tokens on exact keys)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1, help="rows of the speed section's decode")
    ap.add_argument("--out", help="also write the Markdown to this file")
    args = ap.parse_args(argv)
    for flag, specs in (("--formats", args.formats or ()), ("--speed-formats", args.speed_formats)):
        for spec in specs:  # every format, before the f32 reference or any other work
            try:
                parse_format(spec)
            except ValueError as e:
                ap.error(f"{flag} {spec}: {e} (specs: name[:option=value...])")
    for flag in ("--ppl-tokens", "--ppl-chunk", "--context", "--reps", "--batch"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    lines = [header("bench_formats", argv)]
    if "bytes" in args.only:
        lines += section_bytes() + [""]
    if "ppl" in args.only:
        lines += section_ppl(args.formats or PPL_FORMATS, args.ppl_tokens, args.ppl_chunk) + [""]
    if "memory" in args.only:
        lines += section_memory(args.speed_formats, args.context) + [""]
    if "speed" in args.only:
        lines += section_speed(args.speed_formats, args.context, args.reps, args.batch) + [""]
    emit(lines, args.out)


def header(module: str, argv) -> str:
    """The Markdown comment naming the command, machine and jax that made a report."""
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    return (f"<!-- python -m experiments.{module} {cmd} | "
            f"{platform.processor() or platform.machine()}, jax {jax.__version__}, "
            f"{jax.devices()[0].platform} -->")


def emit(lines, out: str | None) -> None:
    """Print the report and, with `out`, write it there too."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
