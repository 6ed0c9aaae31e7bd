"""Regenerate the example outputs in the docs from real runs: `python -m experiments.docs_examples`.

A marked block in a markdown file

    <!-- docs_example: python run.py policy=lru kv_dtype=int4 -->
    ```
    (output)
    ```
    <!-- /docs_example -->

holds what the command printed. This script runs each command from the repository root with
its results, baselines and run directory in a fresh temporary directory (so the run is cold:
no stored point, no cached baseline) and W&B off, and rewrites the block with the output:
stdout when the command succeeds, stderr when it fails (an error example). Lines naming the
temporary directory (the record's run dir, the store path) are left out. Timings differ
from run to run, so the test suite checks the blocks' structure (tests/test_docs.py), not
their numbers.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/harness.md",)
BLOCK = re.compile(r"(<!-- docs_example: (?P<cmd>.+?) -->\n)```\n(?P<out>.*?)```\n"
                   r"(<!-- /docs_example -->)", re.DOTALL)
DROP = ("record: ", "results store: ")


def examples(text: str) -> list[tuple[str, str]]:
    """(command, current output) of each marked block."""
    return [(m["cmd"], m["out"]) for m in BLOCK.finditer(text)]


def rewrite(text: str, runner: Callable[[str], str]) -> str:
    """`text` with each marked block's output replaced by `runner(command)`."""
    opened = text.count("<!-- docs_example: ")
    if opened != len(examples(text)):
        raise ValueError(f"{opened} docs_example markers but {len(examples(text))} complete "
                         "blocks: each needs a ``` block and <!-- /docs_example --> after it")

    def sub(m: re.Match) -> str:
        out = runner(m["cmd"]).rstrip("\n") + "\n"
        return f"{m[1]}```\n{out}```\n{m[4]}"

    return BLOCK.sub(sub, text)


def run_command(command: str) -> str:
    """What `command` (a `python run.py ...` line) prints, run cold in a temporary directory."""
    args = shlex.split(command)
    if args[:2] != ["python", "run.py"]:
        raise ValueError(f"docs_example commands must start with 'python run.py': {command!r}")
    with tempfile.TemporaryDirectory(prefix="kvjax-docs-") as tmp:
        extra = [f"results={tmp}/results.jsonl", "wandb.mode=disabled", "progress=false"]
        extra.append(f"hydra.sweep.dir={tmp}/multirun" if "-m" in args
                     else f"hydra.run.dir={tmp}/run")
        proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *args[2:], *extra],
                              cwd=ROOT, capture_output=True, text=True, check=False)
        out = proc.stdout if proc.returncode == 0 else proc.stderr
        return "\n".join(line for line in out.splitlines()
                         if tmp not in line and not line.startswith(DROP))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.docs_examples", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", default=list(DOCS), help="markdown files (repo-relative)")
    args = ap.parse_args(argv)
    missing = [name for name in args.files if not (ROOT / name).is_file()]
    if missing:  # before any example runs
        ap.error(f"no such file: {', '.join(missing)} (names are relative to {ROOT})")
    for name in args.files:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")

        def runner(command: str, name=name) -> str:
            print(f"{name}: running {command}", flush=True)
            return run_command(command)

        path.write_text(rewrite(text, runner), encoding="utf-8")
        print(f"{name}: {len(examples(text))} example(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
