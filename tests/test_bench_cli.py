"""The benchmark scripts' command lines: bad input is a one-line usage error (exit 2) naming the
value and the valid choices, before any work (the model, the timings); --help reads as whole
sentences. Nothing here loads a model or times anything: the first step of each script's work
is replaced by a failure."""

from __future__ import annotations

import importlib
import re

import pytest

# (module, argv, error pattern, the module's functions that start its work)
BAD = [
    ("profile_kernel", ["bf16", "nosuch"], r"unknown kind\(s\) nosuch; choose from bf16, int8, int4",
     []),
    ("bench_decode", ["--prompt", "-5"], r"--prompt must be >= 1, got -5", ["load_model"]),
    ("bench_decode", ["--new", "1"], r"--new must be >= 2, got 1", ["load_model"]),
    ("bench_policies", ["--only", "h2o", "nosuch"],
     r"--only: unknown label\(s\) 'nosuch'; valid labels: 'full C=budget', 'window'", ["load"]),
    ("bench_formats", ["--only", "ppl", "--formats", "int4", "nosuch"],
     r"--formats nosuch: unknown kv format 'nosuch'; choose one of \['bf16'",
     ["load_real", "section_bytes"]),
    ("bench_formats", ["--speed-formats", "int4:keep_layers=x"],
     r"--speed-formats int4:keep_layers=x: ", ["load_real", "section_bytes"]),
    ("bench_attention_blocks", ["--blocks", "256"], r"--blocks takes QxK, .*got '256'",
     ["interleaved"]),
    ("bench_attention_blocks", ["--group-sum", "abc"], r"--group-sum takes TxS, .*got 'abc'",
     ["group_sum"]),
    ("bench_attention_blocks", ["--prefill", "8", "--prefill-blocks", "256"],
     r"--prefill-blocks takes QxK, .*got '256'", ["interleaved", "prefill_ab"]),
    ("bench_vocab_scores", ["--tokens", "-1"], r"--tokens and --rounds must be >= 1", []),
    ("bench_vocab_scores", ["--rounds", "0"], r"--tokens and --rounds must be >= 1", []),
    ("bench_shared_prefill", ["--rounds", "0"], r"--rounds must be >= 1, got 0",
     ["load_real", "load_tokenizer"]),
    ("bench_shared_prefill", ["--samples", "0"], r"n_samples=0 must be a positive integer",
     ["load_real", "load_tokenizer"]),
    ("bench_batch", ["--policy", "nosuch"], r"unknown policy 'nosuch'; valid policies: adakv",
     ["load", "load_tokenizer"]),
    ("bench_batch", ["--kv-dtype", "int3"], r"unknown kv_dtype 'int3'; valid choices: bf16",
     ["load", "load_tokenizer"]),
    ("bench_batch", ["nosuchopt=3"], r"task 'passkey' has no option\(s\) \['nosuchopt'\]",
     ["load", "load_tokenizer"]),
    ("bench_batch", ["length=1x"], r"task option 'length=1x': '1x' is not JSON",
     ["load", "load_tokenizer"]),
    ("bench_adakv", ["--budgets", "-5"],
     r"--budgets -5 \(section bytes\): policy 'adakv': budget must be a positive integer",
     ["load_real"]),
    ("serve_sim", ["--tiny", "--policy", "nosuch"], r"unknown policy 'nosuch'; valid choices",
     ["execute"]),
    ("serve_sim", ["--tiny", "--kv-dtype", "int3"], r"unknown kv_dtype 'int3'", ["execute"]),
    ("serve_sim", ["--tiny", "--n-requests", "-1"], r"n_requests=-1 must be a positive integer",
     ["execute"]),
    ("serve_sim", ["--wandb", "nosuch"],
     r"--wandb: invalid choice: 'nosuch' \(choose from 'offline', 'online', 'disabled'\)",
     ["execute"]),
    ("bench_sweep_point", ["--against", "nosuchrev"], r"--against nosuchrev: unknown git revision",
     ["fresh_cache", "against"]),
]


@pytest.mark.parametrize("name, argv, msg, work", BAD,
                         ids=[f"{name} {' '.join(argv)}" for name, argv, *_ in BAD])
def test_bad_input_is_a_usage_error_before_any_work(monkeypatch, capsys, name, argv, msg, work):
    module = importlib.import_module(f"experiments.{name}")
    for fn in work:
        monkeypatch.setattr(module, fn, lambda *a, fn=fn, **k: pytest.fail(f"{fn} ran"))
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert re.search(msg, line), line


def test_profile_kernel_help_prints_usage_without_work(capsys):
    from experiments import profile_kernel

    with pytest.raises(SystemExit) as e:
        profile_kernel.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "[KIND ...]" in out and "bf16, int8, int4" in out


@pytest.mark.parametrize("name", ["bench_adakv", "bench_decode", "bench_formats",
                                  "bench_shared_prefill", "scale_table", "serve_sim",
                                  "profile_kernel"])
def test_help_describes_with_the_docstrings_whole_first_paragraph(capsys, name):
    module = importlib.import_module(f"experiments.{name}")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    first = " ".join(module.__doc__.split("\n\n")[0].split())
    assert first in out and first.endswith((".", ":", "?"))


def test_bench_sweep_point_knows_a_commit():
    from experiments.bench_sweep_point import is_commit

    assert is_commit("HEAD") and not is_commit("nosuchrev")
