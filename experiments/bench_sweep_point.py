"""Wall time of one sweep point (`python run.py ...`), cold and warm, phase by phase.

    python -m experiments.bench_sweep_point [--warm 3] [--out FILE.md] [-- run.py overrides]
    python -m experiments.bench_sweep_point --against REV --warm 6   # before/after, interleaved

Each run is a fresh `python run.py` process (default overrides: the main job, `policy=lru
kv_dtype=int4`), timed from outside (wall and CPU seconds of the process). "cold" runs with an
empty `$KVJAX_CACHE` (no XLA cache, no dequantized weights; the GGUF is linked in, so no
download), "warm" runs then reuse that cache as a second run on the same machine does. Results
go to a temporary store (`force=true`; W&B as configured, offline by default, into the run
directory), so the user's store is untouched.

`--against REV` measures the code of git revision REV (a temporary worktree) beside this
checkout: each gets its own cache and a cold run, then their warm runs alternate (the order
flips every round), so a noisy machine slows both alike. REV must have this script and the
same `policies/` and `kernels/` (an editable install imports those from this checkout).

Inside each process a small wrapper (`--child`) counts JAX's compilation-cache events (hits,
misses: programs compiled) and times the phases: imports, planning (model header, tokenizer,
checks), loading the weights, the task, the full-cache baseline, the speed probe, W&B logging
(handing the record to W&B's worker process, and waiting for that worker at exit),
and (overlapping those) JAX's tracing + lowering, which JAX's persistent cache does not skip
(`kvjax.programs` does, for the programs it stores), and backend compiles.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ["policy=lru", "kv_dtype=int4"]
PHASES = ["imports", "plan", "load", "task", "baseline", "speed_probe", "wandb", "trace_lower",
          "backend_compile"]


def child(overrides: list[str]) -> None:
    """Run run.py in this process with phase timers and JAX monitoring; print one JSON line."""
    t0 = time.perf_counter()
    from kvjax import wandb_worker

    wandb_worker.prestart(overrides)  # as run.py does, before the imports it overlaps
    from jax import monitoring

    events, durations = collections.Counter(), collections.Counter()
    monitoring.register_event_listener(lambda e, **_: events.update([e.rsplit("/", 1)[-1]]))
    monitoring.register_event_duration_secs_listener(
        lambda e, d, **_: durations.update({e.rsplit("/", 1)[-1]: d}))
    from kvjax import experiment, harness
    from kvjax.tasks import TASKS

    phases = collections.Counter({"imports": time.perf_counter() - t0})
    active: list[str] = []  # phases entered; time counts for the outermost (baseline > task)

    def timed(owner, name, phase):
        f = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            active.append(phase)
            try:
                return f(*a, **k)
            finally:
                active.pop()
                if not active:
                    phases[phase] += time.perf_counter() - t

        setattr(owner, name, wrapper)

    timed(harness, "plan", "plan")
    for name, phase in [("load", "load"), ("get_baseline", "baseline"),
                        ("measure_speed", "speed_probe")]:
        timed(experiment, name, phase)
    timed(wandb_worker, "submit", "wandb")
    for cls in TASKS.values():
        timed(cls, "run", "task")
    sys.argv = ["run.py", *overrides]
    try:
        runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    t = time.perf_counter()
    wandb_worker.drain()  # what the exit handler would wait for
    phases["wandb"] += time.perf_counter() - t
    phases["trace_lower"] = durations["jaxpr_trace_duration"] + durations[
        "jaxpr_to_mlir_module_duration"]
    phases["backend_compile"] = durations["backend_compile_duration"]
    stored = getattr(sys.modules.get("kvjax.programs"), "stats", {})  # absent before 2026-12-03
    print("BENCH " + json.dumps({
        "phases": dict(phases), "total_in_process": time.perf_counter() - t0,
        "xla_cache": {"requests": events["compile_requests_use_cache"],
                      "hits": events["cache_hits"], "misses": events["cache_misses"]},
        "programs": dict(stored),
    }), flush=True)


def one_run(cache: Path, out: Path, overrides: list[str], tag: str, root: Path = ROOT) -> dict:
    env = {**os.environ, "KVJAX_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "experiments.bench_sweep_point", "--child", "--",
           *overrides, f"results={out / 'results.jsonl'}", "force=true",
           f"hydra.run.dir={out / tag}"]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{tag} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BENCH "))
    rec = json.loads(line[6:])
    rec |= {"wall_s": wall, "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
            "load_avg": os.getloadavg()[0]}
    return rec


def fresh_cache(root: Path) -> Path:
    """An empty cache dir holding only the model file (hard-linked, else copied) + its marker."""
    from kvjax.loading import fetch_model

    gguf = fetch_model("smollm2-135m")
    root.mkdir(parents=True)
    for f in (gguf, gguf.with_name(gguf.name + ".verified")):
        try:
            os.link(f, root / f.name)
        except OSError:
            shutil.copy2(f, root / f.name)
    return root


def table(runs: dict[str, list[dict]]) -> str:
    cols = list(runs)
    med = {c: {k: statistics.median(r[k] for r in runs[c]) for k in ("wall_s", "cpu_s",
                                                                      "load_avg")} for c in cols}
    lines = ["| | " + " | ".join(f"{c} ({len(runs[c])} run{'s' * (len(runs[c]) > 1)})"
                                  for c in cols) + " |", "|---" + "|---:" * len(cols) + "|"]
    lines.append("| wall | " + " | ".join(f"{med[c]['wall_s']:.1f} s" for c in cols) + " |")
    lines.append("| CPU (user+sys) | " + " | ".join(f"{med[c]['cpu_s']:.1f} s" for c in cols)
                 + " |")
    for p in PHASES:
        lines.append(f"| {p.replace('_', ' ')} | " + " | ".join(
            f"{statistics.median(r['phases'].get(p, 0.0) for r in runs[c]):.2f} s" for c in cols)
            + " |")
    lines.append("| XLA programs: from the persistent cache / compiled | " + " | ".join(
        f"{runs[c][-1]['xla_cache']['hits']} / {runs[c][-1]['xla_cache']['misses']}"
        for c in cols) + " |")
    lines.append("| stored programs (`kvjax.programs`): loaded / compiled / not stored | " + " | ".join(
        "/".join(str(runs[c][-1].get("programs", {}).get(k, 0)) for k in ("loaded", "compiled",
                                                                          "unstored"))
        for c in cols) + " |")
    lines.append("| load average (1 min) at the end | " + " | ".join(
        f"{med[c]['load_avg']:.1f}" for c in cols) + " |")
    return "\n".join(lines)


def is_commit(rev: str) -> bool:
    """Whether `rev` names a commit of this repository (`git rev-parse --verify REV^{commit}`)."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                           f"{rev}^{{commit}}"], capture_output=True, check=False).returncode == 0


def against(rev: str, warm: int, tmp: Path, overrides: list[str]) -> dict[str, list[dict]]:
    """Cold, then `warm` alternating warm runs of revision `rev` (a worktree) and this checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=False)

    if git("diff", "--quiet", rev, "--", "policies", "kernels").returncode != 0:
        raise SystemExit(f"{rev} differs from this checkout in policies/ or kernels/, which an "
                         "editable install imports from here: compare revisions that share them")
    tree = tmp / "against"
    made = git("worktree", "add", "--detach", str(tree), rev)
    if made.returncode != 0:
        raise SystemExit(f"git worktree add {rev}: {made.stderr.strip()}")
    from kvjax.experiment import git_info

    info = git_info(ROOT, code_only=True)
    head = (info["commit"] or "this checkout")[:7] + (" + changes" if info["dirty"] else "")
    sides = {f"{rev} warm": tree, f"{head} warm": ROOT}
    caches = {name: fresh_cache(tmp / f"cache{i}") for i, name in enumerate(sides)}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for name, root in sides.items():
        rec = one_run(caches[name], tmp, overrides, "cold", root)
        print(f"{name.split()[0]} cold: {rec['wall_s']:.1f} s", flush=True)
    for i in range(warm):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            runs[name].append(one_run(caches[name], tmp, overrides, f"warm{i}", sides[name]))
            print(f"{name} {i + 1}/{warm}: {runs[name][-1]['wall_s']:.1f} s", flush=True)
    return runs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=3, help="warm runs after the cold one")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    ap.add_argument("--against", metavar="REV", help="a git revision to measure beside this one")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="run.py overrides (default: the main job)")
    a = ap.parse_args(argv)
    overrides = a.overrides or MAIN_JOB
    if a.child:
        return child(overrides)
    if a.warm < 1:
        ap.error("--warm must be >= 1")
    if a.against and not is_commit(a.against):  # else `git diff` fails as if REV differed
        ap.error(f"--against {a.against}: unknown git revision (not a commit of {ROOT})")
    tmp = Path(tempfile.mkdtemp(prefix="kvjax-sweep-point-"))
    try:
        if a.against:
            runs = against(a.against, a.warm, tmp, overrides)
        else:
            cache = fresh_cache(tmp / "cache")
            runs = {"cold": [one_run(cache, tmp, overrides, "cold")], "warm": []}
            print(f"cold: {runs['cold'][0]['wall_s']:.1f} s", flush=True)
            for i in range(a.warm):
                runs["warm"].append(one_run(cache, tmp, overrides, f"warm{i}"))
                print(f"warm {i + 1}/{a.warm}: {runs['warm'][-1]['wall_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
    text = (f"`python run.py {' '.join(overrides)}`, {os.cpu_count()} cores; medians\n\n"
            + table(runs))
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
        Path(a.out).with_suffix(".json").write_text(json.dumps(runs, indent=1) + "\n")
    return runs


if __name__ == "__main__":
    main()
