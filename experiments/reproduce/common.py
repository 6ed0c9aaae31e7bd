"""What every reproduction shares: run labelled points through the harness, write the doc and
the index.

A paper module defines a `Reproduction` subclass: its paper and claim, `add_arguments` (the full
run's options) and `quick_defaults` (their `--quick` values), `points(args)` (labelled
`RunSpec`s; the same code builds the full and the `--quick` sweep), `extra(args, done)` for
measurements outside the store (e.g. a speed probe), `check(done, extra)` (the qualitative
shape `--quick` asserts) and `body(done, extra, img_dir)` (the doc's table, plot and verdict).
Every point goes through `kvjax.experiment.plan` + `execute` (results store, W&B group = the
reproduction's name), so a rerun skips the points already stored and resumes a killed sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from kvjax.experiment import RunSpec, WandbSpec, execute, plan, shared_sweep
from kvjax.results import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "reproductions"
INDEX_COLUMNS = ("paper", "claim", "ours", "verdict", "command", "minutes on 2 cores")


@dataclasses.dataclass(frozen=True)
class Done:
    """One finished point: its label and record (just stored, or read back from the store)."""

    label: str
    record: dict
    seconds: float = 0.0  # wall seconds this invocation spent on it (0: read back)

    @property
    def metrics(self) -> dict:
        return self.record["metrics"]

    def nll(self):
        """The point's per-token NLL (nll.npy beside its record)."""
        import numpy as np

        return np.load(Path(self.record["run_dir"]) / "nll.npy")

    @property
    def run_s(self) -> float:
        """The seconds the point's own run took (its record's total_s: load, task, baseline)."""
        return float(self.record.get("timings", {}).get("total_s", 0.0))


class Reproduction:
    """One paper. Subclasses set the class attributes and the four methods."""

    name: str = ""
    paper: str = ""  # "Authors. Title. Venue Year." with a link
    claim: str = ""  # the claim, quoted as a number, with its table/figure
    short_claim: str = ""  # one line for the index

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Paper-specific options (defaults: the documented full run)."""

    def quick_defaults(self) -> dict:
        """Option values `--quick` uses unless given (small lengths, under 60 s on 2 cores)."""
        raise NotImplementedError

    def points(self, args) -> list[tuple[str, RunSpec]]:
        raise NotImplementedError

    def extra(self, args, done: dict[str, Done]) -> dict:
        return {}

    def check(self, done: dict[str, Done], extra: dict) -> None:
        """Assert the robust qualitative shape (run by `--quick`, hence by the CI test)."""

    def body(self, args, done: dict[str, Done], extra: dict, img_dir: Path) -> tuple[str, str, str]:
        """(markdown body: setting, table, plot, verdict; one-line result; verdict word)."""
        raise NotImplementedError


def spec(task, *, name: str, args, policy: str = "full", **kw) -> RunSpec:
    """A RunSpec for a reproduction point: results in args.results, W&B group = `name`, no
    speed probe unless given."""
    kw.setdefault("speed", _no_speed())
    return RunSpec(task=task, policy=policy, sweep=name, results=args.results,
                   wandb=WandbSpec(mode=args.wandb), progress=False, force=args.force, **kw)


def fraction_points(prefix: str, task, fractions, labels, table: dict, budget, **kw):
    """Points `{prefix}{f}/{label}`: for each cache fraction f of the task's length and each
    policy label, the table's policy (label -> (description, policy, options given the
    budget)) at `budget(f, task.length)` slots; `kw` as for `spec`."""
    pts = []
    for f in fractions:
        b = budget(f, task.length)
        for lab in labels:
            _, pol, opts = table[lab]
            pts.append((f"{prefix}{f}/{lab}", spec(task, policy=pol, budget=b,
                                                   policy_options=opts(b), **kw)))
    return pts


def _no_speed():
    from kvjax.experiment import SpeedSpec

    return SpeedSpec(prompt=0)


def kv_bytes_per_token(d: Done) -> float:
    """Measured bytes per cached token of the point's k + v stores (codes, scales and zero
    points, full-precision residual and fallback rows included; positions excluded): the
    record's kv_bytes over the cache capacity."""
    c = d.record["cache"]
    return c["kv_bytes"] / c["capacity"]


def run_points(points: list[tuple[str, RunSpec]], echo=print) -> dict[str, Done]:
    """Plan every point first (bad settings fail before any model work), then execute them in
    order; a point already in the store is read back, not rerun. Compress-mode points on one
    prompt task share its prefill (`kvjax.experiment.shared_sweep`: score once, select many)."""
    plans = [(label, plan(s)) for label, s in points]
    done = {}
    with shared_sweep([p for _, p in plans]):
        for label, p in plans:
            t = time.perf_counter()
            out = execute(p, Path(p.spec.results).parent / "runs" / p.key, echo=lambda m: None)
            record = out.record if out.record is not None else out.existing
            seconds = time.perf_counter() - t if out.record is not None else 0.0
            done[label] = Done(label, record, seconds)
            m = record["metrics"]
            echo(f"  {label:<28} {m['metric']} {m['value']:.3f}  ({seconds:.0f} s"
                 f"{'' if out.record is not None else ', from the store'})")
    return done


def wilson(k: int, n: int) -> tuple[float, float]:
    """The 95 % Wilson score interval (lo, hi) of a proportion: k successes of n trials."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n and n > 0, got k={k}, n={n}")
    z = 1.959963984540054  # the normal's 97.5 % quantile
    p, z2 = k / n, z * z / n
    centre = (p + z2 / 2) / (1 + z2)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n)) / (1 + z2)
    return max(0.0, centre - half), min(1.0, centre + half)


def int_list(s: str) -> tuple[int, ...]:
    """A command-line list "1,2,4" -> (1, 2, 4) (empty items ignored)."""
    return tuple(int(x) for x in s.split(",") if x)


def float_list(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x)


def name_list(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def command_line(name: str, argv: list[str]) -> str:
    return " ".join(["python -m experiments.reproduce", name, *argv])


def write_doc(rep: Reproduction, args, argv: list[str], done: dict[str, Done], extra: dict,
              wall_s: float, docs: Path) -> Path:
    """docs/NAME.md (paper, claim, the body, the command and wall time) and the index row."""
    img_dir = docs / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    body, ours, verdict = rep.body(args, done, extra, img_dir)
    cmd = command_line(rep.name, argv)
    minutes = (sum(d.run_s for d in done.values()) + extra.get("seconds", 0.0)) / 60
    text = "\n".join([
        f"# Reproduction: {rep.name}",
        "",
        f"**Paper.** {rep.paper}",
        "",
        f"**Claim.** {rep.claim}",
        "",
        (f"**Command.** `{cmd}` — {minutes:.1f} min of wall time on this 2-core CPU machine, "
        f"shared with other jobs (the sum of the {len(done)} harness points' own run times "
        f"from their records, plus {extra.get('seconds', 0.0) / 60:.1f} min of measurements "
        f"outside the store). Records: results store `{args.results}`, W&B offline group "
        f"`{rep.name}`; a rerun reads stored points back (this invocation: "
        f"{wall_s / 60:.1f} min)."),
        "",
        body.strip(),
        "",
    ])
    path = docs / f"{rep.name}.md"
    atomic_write_text(path, text)
    index = docs / "index.json"
    rows = json.loads(index.read_text()) if index.is_file() else {}
    rows[rep.name] = {"paper": f"[{rep.name}]({rep.name}.md)", "claim": rep.short_claim,
                      "ours": ours, "verdict": verdict, "command": f"`{cmd}`",
                      "minutes on 2 cores": f"{minutes:.0f}"}
    atomic_write_text(index, json.dumps(rows, indent=1, sort_keys=True) + "\n")
    write_index(docs, rows)
    return path


def write_index(docs: Path, rows: dict) -> None:
    lines = [
        "# Paper reproductions",
        "",
        ("Each row is one command: `python -m experiments.reproduce NAME` runs the paper's sweep "
        "through the normal harness (results store, W&B offline group NAME) and rewrites "
        "NAME.md; `--quick` runs a reduced version that asserts the qualitative shape (the CI "
        "test `tests/test_reproduce.py` runs every `--quick`). Adding a paper is one file in "
        "`experiments/reproduce/` (a `Reproduction` subclass, see `common.py`)."),
        "",
        "| " + " | ".join(INDEX_COLUMNS) + " |",
        "|" + "---|" * len(INDEX_COLUMNS),
    ]
    lines += ["| " + " | ".join(r[c] for c in INDEX_COLUMNS) + " |" for _, r in sorted(rows.items())]
    atomic_write_text(docs / "README.md", "\n".join(lines) + "\n")
