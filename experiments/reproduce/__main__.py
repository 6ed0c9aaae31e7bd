"""`python -m experiments.reproduce NAME [--quick] [paper options]`.

Full run: the paper's sweep through the harness, then docs/reproductions/NAME.md and the index.
`--quick`: the reduced sweep (small lengths, the real model), its shape asserted; it writes its
doc under the results directory (never over the committed one) unless --docs is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.reproduce import PAPERS, get
from experiments.reproduce.common import DOCS, run_points, write_doc
from kvjax.experiment import ConfigError
from kvjax.results import atomic_write_text


def measure_extra(rep, args, name: str, done) -> dict:
    """The paper's measurements outside the store (`rep.extra`), kept beside the store in
    NAME-extra.json under the options that produced them, so a rerun that only rewrites the doc
    reads them back (unless --force)."""
    settings = {k: v for k, v in sorted(vars(args).items())
                if k not in ("results", "docs", "wandb", "force")}
    path = Path(args.results).parent / f"{name}-extra.json"
    saved = json.loads(path.read_text()) if path.is_file() else []
    for entry in saved:
        if entry["settings"] == json.loads(json.dumps(settings)) and not args.force:
            print(f"  measurements read back from {path}")
            return entry["extra"]
    extra = rep.extra(args, done)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(saved + [{"settings": settings, "extra": extra}], indent=1))
    return extra


def usage() -> str:
    """The command line and each paper's one-line claim."""
    lines = [f"  {n:15s} {get(n).short_claim}" for n in sorted(PAPERS)]
    return ("usage: python -m experiments.reproduce NAME [--quick] [--help] [paper options]\n\n"
            "NAME, one of:\n" + "\n".join(lines) + "\n\n"
            "`python -m experiments.reproduce NAME --help` lists that paper's options.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in PAPERS:
        named = [a for a in argv if a in PAPERS]
        if argv[0].startswith("-") and named:
            raise SystemExit(f"the paper's NAME comes first: python -m experiments.reproduce "
                             f"{named[0]} {' '.join(a for a in argv if a != named[0])}")
        get(argv[0])  # exits naming the valid choices
    name, rest = argv[0], argv[1:]
    rep = get(name)
    parser = argparse.ArgumentParser(prog=f"python -m experiments.reproduce {name}")
    parser.add_argument("--quick", action="store_true", help="reduced sweep, shape asserted")
    parser.add_argument("--results", default=None,
                        help="results store (default results/reproduce[-quick].jsonl)")
    parser.add_argument("--docs", default=None, help="where NAME.md goes")
    parser.add_argument("--wandb", default="offline", choices=("offline", "online", "disabled"))
    parser.add_argument("--force", action="store_true", help="rerun points already stored")
    rep.add_arguments(parser)
    args = parser.parse_args(rest)
    if args.quick:
        explicit = {a.split("=")[0].lstrip("-").replace("-", "_") for a in rest if a.startswith("--")}
        for k, v in rep.quick_defaults().items():
            if k not in explicit:
                setattr(args, k, v)
    args.results = args.results or f"results/reproduce{'-quick' if args.quick else ''}.jsonl"
    docs = Path(args.docs) if args.docs else (
        Path(args.results).parent / "quick-docs" if args.quick else DOCS)
    t = time.perf_counter()
    print(f"{name}: {'quick' if args.quick else 'full'} sweep -> {args.results}")
    try:
        done = run_points(rep.points(args))
    except ConfigError as e:  # a bad setting, found when the points are planned
        print(f"error: {e}", file=sys.stderr)
        return 2
    extra = measure_extra(rep, args, name, done)
    wall = time.perf_counter() - t
    if args.quick:
        rep.check(done, extra)
        print(f"{name} --quick: the shape holds ({wall:.0f} s)")
    path = write_doc(rep, args, rest, done, extra, wall, docs)
    print(f"wrote {path} ({wall / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
