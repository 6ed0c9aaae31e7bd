"""kvjax against HF transformers on the same CPU: prefill time and greedy decode time per token.

    python -m experiments.bench_hf [--prompt 512 2048] [--contexts 128 512 1024] [--steps 8]
                                   [--rounds 5] [--hf-threads 2 1] [--wait-idle SECONDS]
                                   [--kv-extra h2o:512:int4 [h2o:512:int4:all-slots]]
                                   [--out FILE]

Both sides run the same weights in f32 at batch 1: kvjax (dense `full` cache, jitted prefill and
decode step, compile excluded by warm-up, timed through `block_until_ready`) and a
`transformers.LlamaForCausalLM` on torch CPU (eval, `torch.inference_mode`, `use_cache=True`, its
default `DynamicCache`, `logits_to_keep=1` in prefill as `generate` runs it) built from kvjax's
dequantized params (`hf_state_dict`). Before timing, the two models' logits are compared on a
prompt and over a few cached greedy steps; a disagreement stops the run.

Measured side by side in one run: every round times each variant once per measure, rotating
which goes first, and the table gives medians over rounds. "Decode at N" is the mean time per
token of `--steps` greedy steps (model step + argmax) starting from a cache that holds N tokens;
kvjax's cache capacity is N + steps, what `generate` allocates for that run. `--kv-extra`
variants (policy, budget, storage format; kvjax only, e.g. h2o with 512 slots in int4) decode in
the same rounds from a prompt of N tokens read into that policy's cache; with `:all-slots` its
attention reads every slot, not only up to the occupied ones (`AllSlots`). `--out FILE` writes
the table and, beside it, the medians as JSON (`json_path`).

Threads: JAX's CPU backend runs on every core of this process's CPU affinity; HF is timed with
`torch.set_num_threads` at that many threads and, as a control, at 1 (`--hf-threads`). On a
shared machine the 1-thread control matters: when another process holds a core, torch's
OpenMP ops wait for a descheduled worker at every barrier and 2 threads run several times slower
than 1. `--wait-idle` waits for idle cores before each round and redoes rounds that other
processes disturbed; the table's header says how busy the other processes were.

torch and transformers are not kvjax dependencies; `_import_hf` says how to install them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache import KVCache, copy
from kvjax.config import ModelConfig
from kvjax.experiment import git_info
from kvjax.formats import get_format
from kvjax.generate import decode_step, prefill, sample
from kvjax.loading import load_model
from kvjax.model import forward_jit, to_device
from kvjax.policies import get_policy
from kvjax.tasks.text import default_text, encode_prefix

ALL_SLOTS = "all-slots"


@struct.dataclass
class AllSlots(KVCache):
    """The dense cache with attention over all its slots, occupied or not (`KVCache.attend`
    reads only up to the occupied ones): `--kv-extra h2o:512:int4:all-slots` times, in the same
    rounds, what that bound saves a cache with more room than tokens."""

    bounded_reads: ClassVar[bool] = False


INSTALL_HINT = (
    "experiments/bench_hf.py needs torch and transformers, which kvjax does not depend on. "
    "Install the CPU build of torch and then transformers:\n"
    "    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu\n"
    "    pip install transformers\n"
    "(plain `pip install torch` downloads the multi-GB CUDA build on Linux; where a local CPU "
    "wheel is on pip's find-links, as on the project's dev box, `pip install torch==2.13.0` "
    "takes it.)"
)


def _import_hf():
    """(torch, transformers) or an ImportError that gives the exact install commands.

    The repo's top-level `kernels/` (installed as kvjax.kernels) would shadow HF's hub package
    `kernels` while the repo root is on sys.path (`python -m` from it): transformers 5.25 finds
    it and fails importing names from it. The root is off sys.path while transformers loads
    Llama (its answer, "no hub kernels", is cached)."""
    root = Path(__file__).resolve().parents[1]
    path = list(sys.path)
    sys.path[:] = [p for p in path if Path(p or ".").resolve() != root]
    try:
        import torch
        import transformers

        transformers.LlamaForCausalLM  # noqa: B018 -- a lazy import: load it here
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT}\n(import failed: {e})") from e
    finally:
        sys.path[:] = path
    return torch, transformers


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A transformers `LlamaConfig` (config.json) dict for `cfg`; `config_from_hf` inverts it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }


def hf_state_dict(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """kvjax params -> a `LlamaForCausalLM` state dict (float32 numpy, torch Linear [out, in]).

    The inverse of `kvjax.loading.hf_loader.load_hf_dir`'s layout: kvjax keeps q/k in HF's
    rotate_half order, so this is only transposes and reshapes. Tied models also get
    `lm_head.weight` (the embedding), as `LlamaForCausalLM.state_dict()` lists it.
    """
    D, H, K, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def a(x) -> np.ndarray:
        return np.asarray(x, np.float32)

    lp = {n: a(w) for n, w in params["layers"].items()}
    sd = {"model.embed_tokens.weight": a(params["embed"]),
          "model.norm.weight": a(params["final_norm"])}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = lp["attn_norm"][i]
        sd[p + "self_attn.q_proj.weight"] = lp["wq"][i].reshape(D, H * E).T
        sd[p + "self_attn.k_proj.weight"] = lp["wk"][i].reshape(D, K * E).T
        sd[p + "self_attn.v_proj.weight"] = lp["wv"][i].reshape(D, K * E).T
        sd[p + "self_attn.o_proj.weight"] = lp["wo"][i].reshape(H * E, D).T
        sd[p + "post_attention_layernorm.weight"] = lp["mlp_norm"][i]
        sd[p + "mlp.gate_proj.weight"] = lp["w_gate"][i].T
        sd[p + "mlp.up_proj.weight"] = lp["w_up"][i].T
        sd[p + "mlp.down_proj.weight"] = lp["w_down"][i].T
    tied = cfg.tie_embeddings
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] if tied else a(params["lm_head"]).T
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def build_hf_model(cfg: ModelConfig, params, attn: str = "sdpa"):
    """A float32 `LlamaForCausalLM` in eval mode holding kvjax's weights."""
    torch, transformers = _import_hf()
    hcfg = transformers.LlamaConfig(**hf_config_dict(cfg), dtype=torch.float32)
    hcfg._attn_implementation = attn
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hcfg)
    sd = {k: torch.from_numpy(v) for k, v in hf_state_dict(cfg, params).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hcfg)  # real inv_freq, not meta
    return model.float().eval()


def cache_kwarg(model) -> str:
    """The name of a transformers forward's cache argument: `cache` from 5.2x on, before that
    `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    """The cache a transformers forward returned (`cache`, or `past_key_values` before 5.2x)."""
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def _busy_jiffies() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine from /proc/stat, None where absent."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals) - idle) / hz, sum(vals) / hz


class CpuProbe:
    """How many cores processes other than this one kept busy since construction."""

    def __init__(self):
        self.t, self.own, self.busy = time.perf_counter(), time.process_time(), _busy_jiffies()

    def others(self) -> float | None:
        busy = _busy_jiffies()
        if busy is None or self.busy is None:
            return None
        wall = time.perf_counter() - self.t
        own = time.process_time() - self.own
        return max(0.0, (busy[0] - self.busy[0] - own) / max(wall, 1e-9))


IDLE_CORES = 0.2  # "idle" for --wait-idle: other processes use fewer cores than this


def wait_idle(max_wait: float, threshold: float = IDLE_CORES, sample: float = 2.0) -> float:
    """Sleep until other processes use < `threshold` cores over `sample` s (at most `max_wait`
    s); returns the seconds waited. For shared machines: torch's timings suffer most there."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait:
        probe = CpuProbe()
        time.sleep(sample)
        busy = probe.others()
        if busy is None or busy < threshold:
            break
    return time.perf_counter() - t0


def timed_rounds(rounds: int, wait: float, one_round):
    """Interleaved timing rounds on a shared machine. `one_round(r)` times round r and returns
    (its results, a line to print). With `wait` > 0 each round first waits (at most `wait` s)
    for idle cores, and a round during which other processes used >= IDLE_CORES is redone (at
    most 3x `rounds` attempts in all). Returns (the kept rounds' results, the cores other
    processes used during each (None: unknown), how many rounds were discarded)."""
    kept, others, attempts, discarded = [], [], 0, 0
    while len(kept) < rounds and attempts < 3 * rounds:
        attempts += 1
        if wait:
            waited = wait_idle(wait, IDLE_CORES)
            if waited > 3:
                print(f"  waited {waited:.0f} s for idle cores", flush=True)
        probe = CpuProbe()
        got, line = one_round(len(kept))
        busy = probe.others()
        tag = "" if busy is None else f" [others: {busy:.2f} cores]"
        if wait and busy is not None and busy >= IDLE_CORES and attempts < 3 * rounds:
            discarded += 1
            print(f"discarded (other processes were busy){tag}: {line}", flush=True)
            continue
        kept.append(got)
        others.append(busy)
        print(f"round {len(kept)}/{rounds}{tag}: {line}", flush=True)
    if len(kept) < rounds:
        print(f"only {len(kept)} of {rounds} rounds ran", flush=True)
    return kept, others, discarded


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, nargs="+", default=[512, 2048],
                    help="prefill prompt lengths")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024],
                    help="tokens in the cache when decode starts")
    ap.add_argument("--steps", type=int, default=8, help="greedy steps per timed decode block")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    ap.add_argument("--check-tokens", type=int, default=64, help="prompt of the logits check")
    ap.add_argument("--hf-threads", type=int, nargs="+", default=None,
                    help="torch thread counts to time HF with (default: the cores JAX runs on, "
                         "i.e. this process's CPU affinity, and 1)")
    ap.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"],
                    help="transformers attention implementation")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="shared machines: before each round wait (at most this long) until "
                         "other processes use < 0.2 cores, and redo (up to 3x rounds attempts in "
                         "all) rounds during which they used more")
    ap.add_argument("--kv-extra", nargs="*", default=["h2o:512:int4"],
                    metavar="POLICY:BUDGET:FORMAT[:all-slots]",
                    help="kvjax-only decode variants timed in the same rounds; ':all-slots' "
                         "attends over every slot of the cache (`AllSlots`), not only up to "
                         "the occupied ones")
    ap.add_argument("--out", default=None,
                    help="also write the Markdown table here, and its medians as JSON beside it "
                         "(FILE with .json)")
    a = ap.parse_args(argv)
    sizes = [*a.contexts, *a.prompt, a.steps, a.rounds, *(a.hf_threads or [])]
    if min(sizes) < 1 or a.check_tokens < 2:
        ap.error("sizes, --steps, --rounds and --hf-threads must be positive, --check-tokens >= 2")
    for spec in a.kv_extra:
        try:
            parse_kv_spec(spec)
        except ValueError as e:
            ap.error(str(e))
    return a


def parse_kv_spec(spec: str, flag: str = "--kv-extra") -> tuple[str, int, str, type]:
    """A cache variant POLICY:BUDGET:FORMAT[:all-slots] -> (policy, budget, format, cache
    class: `KVCache`, or `AllSlots` with the suffix); a ValueError names the flag and spec,
    and an unknown policy or format the valid ones (so scripts check before any work)."""
    parts = spec.split(":")
    if (len(parts) not in (3, 4) or not parts[1].isdigit() or int(parts[1]) < 1
            or parts[3:] not in ([], [ALL_SLOTS])):
        raise ValueError(f"{flag} {spec!r}: expected POLICY:BUDGET:FORMAT or "
                         f"POLICY:BUDGET:FORMAT:{ALL_SLOTS}, e.g. h2o:512:int4")
    try:
        get_policy(parts[0], budget=int(parts[1]))
        get_format(parts[2])
    except ValueError as e:
        raise ValueError(f"{flag} {spec!r}: {e}") from None
    return parts[0], int(parts[1]), parts[2], AllSlots if parts[3:] else KVCache


def main(argv=None):
    a = parse_args(argv)
    torch, transformers = _import_hf()  # fail before the model loads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = list(dict.fromkeys(a.hf_threads or [cores, 1]))
    torch.set_num_threads(threads[0])
    print(f"JAX CPU backend: {jax.device_count()} device(s) on {cores} core(s); HF timed with "
          f"torch.set_num_threads({', '.join(map(str, threads))})", flush=True)

    cfg, np_params, tokenizer = load_model(a.model)
    params = to_device(np_params)
    model = build_hf_model(cfg, np_params, a.hf_attn)
    ckw = cache_kwarg(model)
    del np_params
    n_ids = max(*a.prompt, *a.contexts, a.check_tokens) + a.steps + 1
    ids = np.asarray(encode_prefix(tokenizer, default_text(), n_ids), np.int64)
    fmt, full = get_format("f32"), get_policy("full")
    key = jax.random.PRNGKey(0)

    def kv_cache(n):
        return KVCache.init(cfg, 1, full, fmt, n)

    # ---- agreement: full-sequence logits, then cached greedy steps on both sides
    n_chk, n_dec = a.check_tokens, 8
    chk = ids[:n_chk]
    lg_j, _ = forward_jit(params, jnp.asarray(chk[None], jnp.int32), kv_cache(n_chk), cfg)
    with torch.inference_mode():
        lg_h = model(input_ids=torch.from_numpy(chk[None]), use_cache=False).logits.numpy()
    lg_j = np.asarray(lg_j)
    d_prompt = float(np.abs(lg_j - lg_h).max())
    scale = float(np.abs(lg_j).max())
    argmax_same = float((lg_j.argmax(-1) == lg_h.argmax(-1)).mean())

    lj, cj = prefill(params, [chk.tolist()], kv_cache(n_chk + n_dec), cfg)
    with torch.inference_mode():
        out = model(input_ids=torch.from_numpy(chk[None]), use_cache=True, logits_to_keep=1)
        lh, ch = out.logits[:, -1], _cache_of(out)
        d_dec, toks_j, toks_h = 0.0, [], []
        for _ in range(n_dec):
            d_dec = max(d_dec, float(np.abs(np.asarray(lj) - lh.numpy()).max()))
            tj, th = int(np.asarray(lj).argmax()), int(lh.argmax())
            toks_j.append(tj)
            toks_h.append(th)
            lj, cj = decode_step(params, jnp.asarray([tj], jnp.int32), cj, cfg)
            out = model(input_ids=torch.tensor([[tj]]), **{ckw: ch}, use_cache=True)
            lh, ch = out.logits[:, -1], _cache_of(out)
    agree = (f"logits max |d| = {d_prompt:.2e} over {n_chk} prompt positions (max |logit| "
             f"{scale:.1f}, argmax equal at {argmax_same:.0%}); cached greedy steps: max |d| = "
             f"{d_dec:.2e}, tokens {'identical' if toks_j == toks_h else 'DIFFER'} "
             f"({n_dec} steps)")
    print("agreement:", agree, flush=True)
    if d_prompt > 1e-2 * max(scale, 1.0) or toks_j != toks_h:
        raise SystemExit("kvjax and HF logits disagree; not timing two different models")

    # ---- kvjax: prefill and per-context decode, compiled before timing. "kvjax" is the full
    # f32 cache HF is compared with; each --kv-extra variant (policy, budget, format) is timed
    # in the same rounds for decode only.
    kv_setups = {"kvjax": (full, fmt, 0, KVCache)}  # (policy, format, least max_len, cache)
    for spec in a.kv_extra:
        name, budget, form, cls = parse_kv_spec(spec)
        kv_setups[f"kvjax {name}/{budget} {form}" + " (all slots)" * (cls is AllSlots)] = (
            get_policy(name, budget=budget), get_format(form), budget, cls)

    def kv_prefill(p):
        lg, _ = prefill(params, [ids[:p].tolist()], kv_cache(p + a.steps), cfg)
        lg.block_until_ready()

    def hf_prefill(p):
        with torch.inference_mode():
            model(input_ids=torch.from_numpy(ids[None, :p]), use_cache=True, logits_to_keep=1)

    kv_base, hf_base = {}, {}
    t = time.perf_counter()
    for p in a.prompt:
        kv_prefill(p)
    for n in a.contexts:
        for v, (pol, form, least, cache_cls) in kv_setups.items():
            lg, c = prefill(params, [ids[:n].tolist()],
                            cache_cls.init(cfg, 1, pol, form, max(n + a.steps, least)), cfg)
            kv_base[v, n] = (sample(lg, key), c)
        with torch.inference_mode():
            out = model(input_ids=torch.from_numpy(ids[None, :n]), use_cache=True,
                        logits_to_keep=1)
        hf_base[n] = (out.logits[:, -1:].argmax(-1), _cache_of(out))

    def kv_decode(v, n):
        """Seconds per greedy token from n cached tokens, and the tokens."""
        return time_decode(params, cfg, *kv_base[v, n], a.steps, key)

    def hf_decode(n):
        tok, cache = hf_base[n]
        toks = []
        with torch.inference_mode():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                out = model(input_ids=tok, **{ckw: cache}, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                toks.append(tok)
            dt = (time.perf_counter() - t0) / a.steps
        cache.crop(-a.steps)  # drop this block's tokens: back to n for the next round
        return dt, [int(x) for x in toks]

    hf_vars = [f"hf{t}" for t in threads]
    variants = ["kvjax", *hf_vars, *list(kv_setups)[1:]]
    measures = [("prefill", p) for p in a.prompt] + [("decode", n) for n in a.contexts]

    def applies(variant, measure) -> bool:
        return measure[0] == "decode" or variant == "kvjax" or variant in hf_vars

    def run(variant, measure):
        """(seconds, greedy tokens or None) of one timed measurement."""
        kind, n = measure
        if variant.startswith("kvjax"):
            if kind == "prefill":
                t0 = time.perf_counter()
                kv_prefill(n)
                return time.perf_counter() - t0, None
            return kv_decode(variant, n)
        torch.set_num_threads(int(variant[2:]))
        if kind == "prefill":
            t0 = time.perf_counter()
            hf_prefill(n)
            return time.perf_counter() - t0, None
        return hf_decode(n)

    for v in hf_vars:  # warm-up: compiles each capacity's decode step; first torch calls
        for n in a.contexts:
            for kv in kv_setups:
                run(kv, ("decode", n))
            run(v, ("decode", n))
    print(f"set-up (kvjax compiles, context prefills, warm-up): {time.perf_counter() - t:.0f} s",
          flush=True)

    # ---- timed rounds; each round rotates which variant goes first
    times = {(v, m): [] for v in variants for m in measures if applies(v, m)}
    same = {(v, n): a.steps for v in hf_vars for n in a.contexts}

    def one_round(r):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        got = {(v, m): run(v, m) for m in measures for v in order if applies(v, m)}
        return got, "; ".join(f"{m[0]} {m[1]}: " + " / ".join(
            f"{v} {got[v, m][0] * 1e3:.0f} ms" for v in variants if (v, m) in got)
            for m in measures)

    kept, others, discarded = timed_rounds(a.rounds, a.wait_idle, one_round)
    for got in kept:
        for (v, m), (dt, toks) in got.items():
            times[v, m].append(dt)
            if v in hf_vars and m[0] == "decode":
                ref = got["kvjax", m][1]
                same[v, m[1]] = min(same[v, m[1]], sum(x == y for x, y in zip(ref, toks)))

    med = {k: statistics.median(v) for k, v in times.items() if v}

    def cell(sec, n_tok):
        if n_tok > 1:
            return f"{sec:.2f} s ({n_tok / sec:.0f} tok/s)"
        return f"{sec * 1e3:.1f} ms ({1 / sec:.1f} tok/s)"

    rows = []
    for m in measures:
        kind, n = m
        if kind == "prefill":
            label, n_tok = f"prefill {n} tokens", n
        else:
            worst = min(same[v, n] for v in hf_vars)
            label = (f"decode at {n} tokens, per token ({a.steps} greedy steps; same tokens "
                     f"{worst}/{a.steps})")
            n_tok = 1
        rows.append((label, *(cell(med[v, m], n_tok) if (v, m) in med else "—" for v in variants),
                     *(f"{med[v, m] / med['kvjax', m]:.2f}x" for v in hf_vars)))
    hf_cols = [f"HF, {t} thread{'s' * (t > 1)}" for t in threads]
    load = ("" if None in others or not others else
            f"; other processes kept {min(others):.2f}-{max(others):.2f} of the {cores} cores "
            f"busy during the rounds (median {statistics.median(others):.2f})")
    head = (f"machine: {platform.processor() or platform.machine()}, {cores} core(s) "
            f"(JAX CPU backend uses all of them), jax {jax.__version__}, torch {torch.__version__}"
            f", transformers {transformers.__version__} (attn {a.hf_attn}); f32 weights, batch 1;"
            f" medians of {len(others)} interleaved rounds"
            + (f" ({discarded} more discarded: other processes busy)" if discarded else "")
            + load + f"\nagreement: {agree}\n\n")
    extra = list(kv_setups)[1:]
    table = ("| measure | kvjax | " + " | ".join(hf_cols + extra) + " | "
             + " | ".join(f"kvjax speed / {c}" for c in hf_cols) + " |\n|---"
             + "|---:" * (len(variants) + len(threads)) + "|\n"
             + "\n".join("| " + " | ".join(r) + " |" for r in rows))
    report(head + table, a.out, {
        "machine": head.split("\n")[0], "code": git_info(code_only=True), "agreement": agree,
        "rounds": len(others), "discarded": discarded, "other_cores": others, "steps": a.steps,
        "variants": variants, "rows": records(measures, variants, hf_vars, med)})
    return rows


def time_decode(params, cfg, tok, base, steps: int, key) -> tuple[float, list[int]]:
    """kvjax's seconds per greedy token over `steps` decode steps (model step + `sample`) from
    `tok` and a copy of the cache `base` (`decode_step` donates its cache), and the tokens."""
    c = copy(base)
    jax.block_until_ready(c)
    toks = []
    t0 = time.perf_counter()
    for _ in range(steps):
        lg, c = decode_step(params, tok, c, cfg)
        tok = sample(lg, key)
        toks.append(tok)
    tok.block_until_ready()
    dt = (time.perf_counter() - t0) / steps
    return dt, [int(x[0]) for x in toks]


def records(measures, variants, hf_vars, med) -> list[dict]:
    """Per measure (("prefill", tokens) or ("decode", context)): the median seconds of every
    variant that ran it and kvjax's speed-up over each HF variant (HF seconds / kvjax seconds,
    the table's ratio columns)."""
    return [{"measure": kind, "tokens": n,
             "seconds": {v: med[v, (kind, n)] for v in variants if (v, (kind, n)) in med},
             "speedup_vs": {v: med[v, (kind, n)] / med["kvjax", (kind, n)] for v in hf_vars}}
            for kind, n in measures]


def write_json(path: str, summary: dict) -> None:
    """A benchmark's figures as JSON beside its table, for checks (here: the medians per variant
    and measure, kvjax's speed-up over each HF variant as the ratio columns)."""
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)


def report(text: str, out: str | None, figures: dict) -> None:
    """Print a benchmark's Markdown; with `--out FILE`, also write it there and `figures` as
    JSON beside it (`json_path`)."""
    print()
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
        write_json(json_path(out), figures)


def json_path(out: str) -> str:
    """Where `--out FILE` also writes the figures as JSON (for checks): FILE with .json."""
    return os.path.splitext(out)[0] + ".json"


if __name__ == "__main__":
    main()
