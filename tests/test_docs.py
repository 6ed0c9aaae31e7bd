"""The docs cannot drift: every registered policy is documented, and the example outputs are
marked blocks that `python -m experiments.docs_examples` regenerates from real runs."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `experiments` is a top-level folder, importable from the root
    sys.path.insert(0, str(ROOT))

from experiments import docs_examples
from kvjax.policies import POLICIES

HARNESS = (ROOT / "docs" / "harness.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_registered_policy_is_in_the_docs_policy_lists():
    row = next(line for line in HARNESS.splitlines() if line.startswith("| `policy` |"))
    listed = set(re.search(r"group: `([^`]*)`", row)[1].split())
    assert listed == set(POLICIES)
    settings = {"h2o_kvpress", "snapkv_kvpress", "streaming_kvpress"}  # kvpress's settings of one
    assert {p.stem for p in (ROOT / "configs" / "policy").glob("*.yaml")} == set(POLICIES) | settings
    readme_rows = set(re.findall(r"^\| `(\w+)` \|", README, re.MULTILINE))
    assert set(POLICIES) <= readme_rows


def test_readme_says_how_to_upload_offline_runs():
    assert re.search(r"`wandb sync [^`]*offline-run-\*`", README)


def test_the_example_outputs_are_marked_blocks_of_real_commands():
    """Each block's command is one that runs (or one the sweep planner refuses), and its output
    has the shape that command prints; the numbers come from `experiments.docs_examples`."""
    blocks = docs_examples.examples(HARNESS)
    assert len(blocks) == HARNESS.count("<!-- docs_example: ") >= 2
    for command, out in blocks:
        args = shlex.split(command)
        assert args[:2] == ["python", "run.py"]
        lines = out.splitlines()
        if "-m" in args:  # an error example: one line per bad point
            assert lines and all(re.match(r"error: sweep point #\d+ \(", ln) for ln in lines)
            continue
        options = dict(a.split("=", 1) for a in args[2:])
        head = lines[0]
        assert head.startswith("kvjax | model=smollm2-135m | policy=" + options["policy"] + "(")
        assert f"| kv_dtype={options['kv_dtype']} |" in head
        assert set(lines[1]) == {"-"}  # the table's rule, as format_table prints it
        names = [ln.split("  ")[0] for ln in lines[2:]]
        assert names == ["perplexity", "cache bytes (measured)", "cache bytes (closed form)",
                         "payload", "compression", "prefill", "decode", "run time"]


def test_rewrite_replaces_each_marked_block_with_its_commands_output():
    text = ("intro\n<!-- docs_example: python run.py a=1 -->\n```\nold\n```\n"
            "<!-- /docs_example -->\nmiddle\n<!-- docs_example: python run.py -m b=1,2 -->\n"
            "```\nold too\n```\n<!-- /docs_example -->\nend\n")
    new = docs_examples.rewrite(text, lambda cmd: f"out of {cmd}\n")
    assert new == text.replace("old\n", "out of python run.py a=1\n").replace(
        "old too\n", "out of python run.py -m b=1,2\n")
    assert docs_examples.rewrite(new, lambda cmd: f"out of {cmd}") == new
    with pytest.raises(ValueError, match="1 docs_example markers but 0 complete blocks"):
        docs_examples.rewrite("<!-- docs_example: python run.py -->\n```\nx\n```\n", str)


def test_a_missing_file_is_rejected_before_any_example_runs(capsys, monkeypatch):
    monkeypatch.setattr(docs_examples, "run_command", lambda command: pytest.fail(command))
    with pytest.raises(SystemExit) as e:
        docs_examples.main(["docs/harness.md", "docs/nosuch.md"])
    assert e.value.code == 2 and "no such file: docs/nosuch.md" in capsys.readouterr().err


def test_ci_runs_the_readme_test_command_in_parallel():
    """.ci/run runs exactly the README's test command, and that command uses xdist."""
    readme = [ln for ln in README.splitlines() if ln.startswith('pip install -e ".[dev]" && ')]
    test_cmd = next(ln.split("#")[0].strip() for ln in readme if " pytest" in ln)
    assert test_cmd == 'pip install -e ".[dev]" && pytest -n auto'
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test_cmd
