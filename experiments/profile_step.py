"""Where a decode step's time goes, by `jax.named_scope`: XLA op time per step, per scope.

    python -m experiments.profile_step [--specs POLICY:BUDGET:FORMAT[:all-slots] ...]
                                       [--context 128] [--steps 40] [--rounds 2] [--out FILE]

Each spec's cache (BUDGET slots; `full` takes it as its capacity; with `:all-slots`,
`AllSlots`: attention over every slot) gets `--context` tokens of the default text (real model,
f32 weights, batch 1); then `--steps` decode steps run under
`jax.profiler.trace`, `--rounds` times, the specs interleaved. Every XLA op event in the trace
is attributed to the innermost kvjax scope of the HLO instruction it ran (the compiled step's
`op_name` metadata; `SCOPES`); ops outside them, mostly the weight matmuls and the head, are
"other". Control-flow ops (the layer scan, conds, switches) are not counted, their bodies are.

Times are summed over XLA's threads, so on 2 cores a step's total is more than its wall time:
read the columns as where the work goes and as differences between specs or code versions,
not as latency. Quieter than wall-clock A/Bs on a noisy box, but not noise-free (compare
rounds). `--out FILE` writes the table and, beside it, the figures as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile

import jax
import numpy as np

SCOPES = ("kv_read", "kv_format_read", "attention", "policy", "cache_update", "kv_format_write")
CONTROL = ("while", "conditional", "call")  # opcodes whose events contain their bodies' ops
DEFAULT_SPECS = ["full:512:f32", "full:512:int4", "h2o:512:f32", "h2o:512:int4"]

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(\S+) = (?:\([^)]*\)|\S+) ([\w-]+)\((?:.*?op_name=\"([^\"]*)\")?")


def innermost_scope(op_name: str) -> str:
    """The innermost of `SCOPES` in an HLO op_name path ("jit(step)/attention/kv_format_read/mul"
    -> "kv_format_read"); "other" when it has none."""
    for part in reversed(op_name.split("/")):
        if part in SCOPES:
            return part
    return "other"


def op_scopes(hlo_text: str) -> dict[str, str]:
    """Each (non control-flow) instruction of a compiled module's text -> its scope."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m and m.group(2) not in CONTROL:
            out[m.group(1)] = innermost_scope(m.group(3) or "")
    return out


def scope_seconds(xplane: str, scopes: dict[str, str]) -> dict[str, float]:
    """Seconds of XLA op events in a profile (`jax.profiler.trace`'s .xplane.pb), summed per
    scope over every thread; events that are not an instruction of `scopes` are skipped."""
    from jax.profiler import ProfileData

    total = collections.Counter()
    for plane in ProfileData.from_file(xplane).planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name in scopes:
                    total[scopes[ev.name]] += ev.duration_ns * 1e-9
    return dict(total)


def profile(run, hlo_text: str) -> dict[str, float]:
    """Per-scope seconds of XLA ops while `run()` executes (it must block until done)."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
        (xplane,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return scope_seconds(xplane, op_scopes(hlo_text))


def table(rows: dict[str, list[dict]]) -> str:
    """Markdown: per spec the median over rounds of each scope's ms per step, and the total."""
    cols = [c for c in (*SCOPES, "other") if any(c in r for rs in rows.values() for r in rs)]
    head = "| spec | total | " + " | ".join(cols) + " |\n|---|" + "---:|" * (len(cols) + 1)
    lines = []
    for spec, rs in rows.items():
        med = {c: float(np.median([r.get(c, 0.0) for r in rs])) for c in cols}
        tot = float(np.median([sum(r.values()) for r in rs]))
        lines.append(f"| {spec} | {tot:.2f} | " + " | ".join(f"{med[c]:.2f}" for c in cols) + " |")
    return head + "\n" + "\n".join(lines)


def main(argv=None):
    from experiments.bench_hf import parse_kv_spec, report
    from kvjax.cache import copy
    from kvjax.experiment import git_info
    from kvjax.formats import get_format
    from kvjax.generate import decode_step, prefill, sample
    from kvjax.loading import load_model
    from kvjax.model import to_device
    from kvjax.policies import get_policy
    from kvjax.tasks.text import default_text, encode_prefix

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=DEFAULT_SPECS,
                    metavar="POLICY:BUDGET:FORMAT[:all-slots]")
    ap.add_argument("--context", type=int, default=128, help="tokens cached before the steps")
    ap.add_argument("--steps", type=int, default=40, help="decode steps profiled per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the table here (and FILE.json)")
    a = ap.parse_args(argv)
    try:  # names checked before the model loads
        specs = {s: parse_kv_spec(s, "--specs") for s in a.specs}
    except ValueError as e:
        ap.error(str(e))
    if min(a.context, a.steps, a.rounds) < 1:
        ap.error("--context, --steps and --rounds must be positive")

    cfg, np_params, tokenizer = load_model()
    params = to_device(np_params)
    ids = encode_prefix(tokenizer, default_text(), a.context)
    state = {}
    for spec, (policy, budget, fmt, cls) in specs.items():
        cache = cls.init(cfg, 1, get_policy(policy, budget=budget), get_format(fmt), budget)
        logits, cache = prefill(params, [ids], cache, cfg)
        tok = sample(logits, jax.random.PRNGKey(0))  # greedy
        hlo = decode_step.lower(params, tok, cache, cfg).compile().as_text()
        state[spec] = (tok, cache, hlo)

    # the same token at every step: no sampling program runs, whose ops' names could collide
    # with the step's; from a copy of the prefilled cache (decode_step donates it)
    def steps(tok, cache):
        c = copy(cache)
        for _ in range(a.steps):
            logits, c = decode_step(params, tok, c, cfg)
        jax.block_until_ready(logits)

    for tok, cache, _ in state.values():  # compile and warm
        steps(tok, cache)
    rows = {spec: [] for spec in specs}
    for r in range(a.rounds):
        for spec in list(specs)[r % len(specs):] + list(specs)[:r % len(specs)]:
            tok, cache, hlo = state[spec]
            got = profile(lambda tok=tok, cache=cache: steps(tok, cache), hlo)
            rows[spec].append({k: v / a.steps * 1e3 for k, v in got.items()})
            print(f"round {r + 1}/{a.rounds} {spec}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in sorted(rows[spec][-1].items())), flush=True)
    head = (f"`python -m experiments.profile_step` ({', '.join(a.specs)}; policy:budget:format), "
            f"{a.context} tokens cached, jax {jax.__version__}: ms of XLA op time per decode step "
            f"summed over threads (median of {a.rounds} rounds of {a.steps} steps)\n\n")
    out = head + table(rows)
    report(out, a.out, {"code": git_info(code_only=True), "context": a.context, "steps": a.steps,
                        "rounds": rows})
    return rows


if __name__ == "__main__":
    main()
