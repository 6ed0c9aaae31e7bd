"""The load experiment: passkey requests with Poisson arrivals served with continuous batching
over one KV pool (task `serve`, kvjax/serve.py), per policy and format at the same pool size.

    python -m experiments.serve_sim                                  # one point: full, f32, paged
    python -m experiments.serve_sim --policy streaming --budget 64 --n-requests 64 --rate 4
    python -m experiments.serve_sim --compare --doc docs/serving.md  # the docs' table and plot
    python -m experiments.serve_sim --compare --tiny                 # the same on the tiny model

Every point goes through the harness (`kvjax.experiment.plan` / `execute`, as `run.py
task=serve` does): keyed by content, appended to the results store, logged to W&B (offline by
default), with the full-cache dense baseline's accuracy beside it. The clock is simulated:
arrivals are drawn on it and it advances by the measured wall time of every jitted step
(compilation excluded), so throughput and latency are real step times on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvjax.experiment import ConfigError, ModelSpec, RunSpec, SpeedSpec, WandbSpec, execute, plan
from kvjax.harness import set_xla_cache
from kvjax.loading.hub import cache_root
from kvjax.results import WANDB_MODES
from kvjax.tasks.serve import Serve

INT4 = (("key_mode", "token"),)  # the paged int4 codec reads whole tokens
TINY_INT4 = (("group", 4), ("key_mode", "token"), ("value_group", 8))  # head dim 8
# (label, policy, budget, kv_dtype, kv_options, layout, task overrides)
ARMS = (
    ("full f32 dense (baseline)", "full", None, "f32", (), "dense", {}),
    ("full f32 paged", "full", None, "f32", (), "paged", {}),
    ("streaming-64 f32 paged", "streaming", 64, "f32", (), "paged", {}),
    ("h2o-64 f32 dense", "h2o", 64, "f32", (), "dense", {}),
    ("full int4 paged", "full", None, "int4", INT4, "paged", {}),
    ("full f32 paged, no prefix cache", "full", None, "f32", (), "paged",
     {"prefix_cache": False}),
    ("full f32 paged, offload after 0.5 s", "full", None, "f32", (), "paged",
     {"offload_after": 0.5}),
)
TINY_TASK = {"n_requests": 24, "prompt_min": 340, "prompt_max": 400, "new_min": 7,
             "new_max": 12, "pool_mib": 0.6, "rows": 8, "rate": 50.0, "think_s": 0.02}


def spec(args, policy, budget, kv_dtype, kv_options, layout, task) -> RunSpec:
    """The harness spec of one point (speed probe off: the server measures speed)."""
    model = ModelSpec("tiny", 0, (("max_seq_len", 1024), ("vocab_size", 64))) if args.tiny \
        else ModelSpec(args.model)
    cache = (("layout", layout),) + ((("page_size", args.page_size),) if layout == "paged"
                                     else ())
    if args.tiny and kv_options == INT4:
        kv_options = TINY_INT4
    return RunSpec(task=task, model=model, policy=policy, budget=budget, kv_dtype=kv_dtype,
                   kv_options=kv_options, seed=args.seed, sweep=args.sweep,
                   speed=SpeedSpec(0, 0), cache=cache, results=args.results,
                   wandb=WandbSpec(mode=args.wandb), force=args.force)


def base_task(args) -> Serve:
    opts = dict(TINY_TASK) if args.tiny else {}
    for k in ("n_requests", "rate", "pool_mib", "rows", "followup", "cancel", "offload_after"):
        v = getattr(args, k)
        if v is not None:
            opts[k] = v
    return Serve(**opts)


def run_point(args, label, p) -> dict:
    """Execute planned point `p` (`label` names it in the output)."""
    run_dir = Path(args.runs) / p.key
    print(f"== {label}: point {p.key}", flush=True)
    out = execute(p, run_dir)
    rec = out.record or out.existing
    m = rec["metrics"]
    print(f"   accuracy {m['accuracy']:.2f} (baseline {m['baseline']}), "
          f"{m['throughput_tok_s']:.1f} tok/s, ttft p50 {m['ttft_p50']:.2f} s, peak "
          f"{m['peak_active']} running, compile {m['compile_s']:.0f} s", flush=True)
    return {"label": label, "record": rec, "run_dir": rec["run_dir"]}


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def table(points) -> list[str]:
    """The comparison table (one row per point)."""
    lines = [("| configuration | rows | pool pages | peak running | peak pages | peak shared | "
              "accuracy | tok/s | TTFT p50 / p95 s | TPOT p50 / p95 ms | prefill tokens | "
              "prefill s | offloaded MiB |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pt in points:
        m = pt["record"]["metrics"]
        acc = f"{m['accuracy']:.2f} ({m['n_correct']}/{m['n_scored']})"
        lines.append(
            f"| {pt['label']} | {m['cache_rows']} | {m['pool_pages'] or '-'} | "
            f"{m['peak_active']} | {m['peak_pages'] or '-'} | {m['peak_shared'] or '-'} | "
            f"{acc} | {m['throughput_tok_s']:.1f} | {m['ttft_p50']:.2f} / {m['ttft_p95']:.2f} | "
            f"{1e3 * m['tpot_p50']:.0f} / {1e3 * m['tpot_p95']:.0f} | {m['prefill_tokens']} | "
            f"{m['prefill_s']:.1f} | {_mib(m['bytes_offloaded'])} |")
    return lines


def plot(points, path: Path) -> None:
    """Requests decoding and paged pool occupancy over the clock, and accuracy against the
    most requests decoding at once, per point (one color per point in every panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for i, pt in enumerate(points):
        m, curves, color = pt["record"]["metrics"], pt.get("curves"), f"C{i}"
        axes[2].scatter(m["peak_active"], m["accuracy"], color=color, label=pt["label"])
        if not curves:
            continue
        axes[0].step(curves["clock_s"], curves["active"], where="post", color=color)
        if m["pool_pages"]:
            used = [u / m["pool_pages"] for u in curves["pages_used"]]
            axes[1].step(curves["clock_s"], used, where="post", color=color)
    axes[0].set(xlabel="clock (s, measured step times)", ylabel="requests decoding",
                title="concurrency at the same pool size")
    axes[1].set(xlabel="clock (s)", ylabel="share of the pool's pages in use",
                title="paged pool occupancy")
    axes[2].set(xlabel="most requests decoding at once", ylabel="passkey accuracy",
                title="quality vs concurrency", ylim=(-0.05, 1.05))
    axes[2].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


HBM_GIB = 141  # one H200
LINK_GB_S = 50.0  # assumed effective host<->device copy rate (PCIe Gen5 x16 is 64 GB/s nominal)
SESSION = 4096  # tokens an idle chat session holds
SYSTEM = 1024  # tokens of a shared system prompt
SESSIONS = 64


def sized_estimate() -> list[str]:
    """What prefix sharing and host offload save on a GPU, from the caches' abstract shapes
    (`KVCache.abstract`, `PagedLayout.abstract`; nothing allocated): Llama-3-8B / -70B configs
    (experiments/scale_table.py), bf16 and int4 (per token) keys and values, pages of 16."""
    from experiments.scale_table import MODELS
    from kvjax.cache import KVCache, get_layout
    from kvjax.formats import get_format
    from kvjax.policies import get_policy

    full = get_policy("full")
    lines = [(f"| model | kv | bytes / token (`KVCache.abstract`) | page of 16 (`PagedLayout."
             f"abstract`) | idle {SESSION}-token session | {SESSIONS} sessions' {SYSTEM}-token "
             f"system prompt: unshared / shared | idle sessions one {HBM_GIB} GiB HBM holds | "
             f"swap one back at {LINK_GB_S:.0f} GB/s |"),
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, cfg in MODELS.items():
        for kv, opts in (("bf16", {}), ("int4", {"key_mode": "token"})):
            fmt = get_format(kv, **opts)
            per_tok = KVCache.abstract(cfg, 1, full, fmt, 1024).kv_nbytes() / 1024
            page = get_layout("paged", page_size=16).abstract(cfg, 1, full, fmt, 1024)
            page_b = page.pages.page_nbytes()
            sess = -(-SESSION // 16) * page_b
            unshared = SESSIONS * -(-SYSTEM // 16) * page_b
            shared = -(-SYSTEM // 16) * page_b
            lines.append(
                f"| {name} | {kv} | {per_tok / 2**10:,.0f} KiB | {page_b / 2**20:.2f} MiB | "
                f"{sess / 2**30:.2f} GiB | {unshared / 2**30:.1f} / {shared / 2**30:.2f} GiB | "
                f"{int(HBM_GIB * 2**30 // sess)} | {1e3 * sess / (LINK_GB_S * 1e9):.0f} ms |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="full")
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--kv-dtype", default="f32")
    ap.add_argument("--layout", default="paged", choices=("paged", "dense"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--n-requests", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second")
    ap.add_argument("--pool-mib", type=float, default=None, help="KV pool size (all configs)")
    ap.add_argument("--rows", type=int, default=None, help="paged: request rows")
    ap.add_argument("--followup", type=float, default=None)
    ap.add_argument("--cancel", type=float, default=None)
    ap.add_argument("--offload-after", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="the tiny random model (smoke test)")
    ap.add_argument("--compare", action="store_true", help="run every arm of the docs' table")
    ap.add_argument("--doc", default=None, help="write the comparison (Markdown) here")
    ap.add_argument("--results", default="results/serve.jsonl")
    ap.add_argument("--runs", default="results/serve_runs")
    ap.add_argument("--sweep", default="serve_sim")
    ap.add_argument("--wandb", default="offline", choices=WANDB_MODES)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--estimate", action="store_true",
                    help="only the sized GPU estimate (no model run), into --doc if given")
    args = ap.parse_args(argv)
    if args.estimate:
        lines = sized_estimate()
        print("\n".join(lines))
        if args.doc:
            replace_between(Path(args.doc), "serve_sim:estimate",
                            [f"<!-- written by `{command()}` -->", "", *lines])
        return
    set_xla_cache(str(cache_root() / "xla"))
    try:  # every point is planned (policy, format, task checked) before any runs
        task = base_task(args)
        if not args.compare:
            kv_options = INT4 if args.kv_dtype == "int4" and args.layout == "paged" else ()
            arms = [(f"{args.policy} {args.kv_dtype} {args.layout}", args.policy, args.budget,
                     args.kv_dtype, kv_options, args.layout, task)]
        else:
            arms = [(label, pol, budget, kv, opts, layout, dataclasses.replace(task, **over))
                    for label, pol, budget, kv, opts, layout, over in ARMS]
        plans = [(label, plan(spec(args, *point))) for label, *point in arms]
    except ConfigError as e:
        ap.error(str(e))
    points = [run_point(args, label, p) for label, p in plans]
    for pt in points:
        pt["curves"] = load_curves(pt["run_dir"])
    lines = table(points)
    print("\n".join(lines))
    if args.doc:
        img = Path(args.doc).parent / "img" / "serving_load.png"
        plot(points, img)
        write_doc(Path(args.doc), args, task, points, lines, img)
        print(f"wrote {args.doc} and {img}")


def load_curves(run_dir) -> dict | None:
    """The step series a point saved in its run dir (`serve_<name>.npy`), or None."""
    import numpy as np

    files = {n: Path(run_dir) / f"serve_{n}.npy" for n in ("clock_s", "active", "pages_used")}
    if not all(f.exists() for f in files.values()):
        return None
    return {n: np.load(f).tolist() for n, f in files.items()}


def write_doc(path: Path, args, task, points, lines, img) -> None:
    """The comparison into `path` between its serve_sim markers (the rest stays)."""
    body = [f"<!-- written by `{command()}` -->", "", describe(task, points), "", *lines, "",
            f"![load]({img.relative_to(path.parent)})"]
    replace_between(path, "serve_sim", body)


def command() -> str:
    return "python -m experiments.serve_sim " + " ".join(sys.argv[1:])


def describe(task, points) -> str:
    """The workload and pool in one sentence."""
    m = points[0]["record"]["metrics"]
    return (f"Workload: {task.n_requests} requests at {task.rate:g}/s, prompts "
            f"{task.prompt_min}-{task.prompt_max} tokens, answers {task.new_min}-"
            f"{task.new_max} tokens, {task.followup:.0%} follow-up turns (think time mean "
            f"{task.think_s:g} s), {task.cancel:.0%} cancelled; pool {task.pool_mib:g} MiB of "
            f"keys and values; paged: page 16, {task.rows} request rows; seed "
            f"{points[0]['record']['point']['seed']}; {m['turns']} turns served per point.")


def replace_between(path: Path, name: str, body: list[str]) -> None:
    """Put `body` between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in `path` (appended
    with the markers when absent)."""
    start, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Serving\n"
    if start not in text:
        text += f"\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(head + start + "\n" + "\n".join(body) + "\n" + end + tail)


if __name__ == "__main__":
    main()
