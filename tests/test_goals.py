"""experiments/goals.py: issue 14's goals read from bench_hf / bench_sweep_point JSON."""

import json

import pytest

from experiments import goals


def hf_json(path, prefill_512, decode_128, decode_1024, extra_1024=None):
    """A bench_hf JSON with kvjax's seconds for HF's 1.0 s (prefill) and 0.1 s (decode)."""
    rows = [{"measure": "prefill", "tokens": 512,
             "seconds": {"kvjax": prefill_512, "hf2": 1.0, "hf1": 2.0}},
            {"measure": "decode", "tokens": 128, "seconds": {"kvjax": decode_128, "hf2": 0.1}},
            {"measure": "decode", "tokens": 1024,
             "seconds": {"kvjax": decode_1024, "hf2": 0.1,
                         **({} if extra_1024 is None else {goals.EXTRA: extra_1024})}}]
    path.write_text(json.dumps({"variants": ["kvjax", "hf2"], "rows": rows}))
    return str(path)


def test_goals_per_run_and_across_runs(tmp_path):
    fast = hf_json(tmp_path / "fast.json", 0.5, 0.04, 0.042, extra_1024=0.045)
    slow = hf_json(tmp_path / "slow.json", 0.9, 0.045, 0.06)
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"cold": [{"wall_s": 60.0}],
                                 "warm": [{"wall_s": 7.0}, {"wall_s": 9.0}, {"wall_s": 7.5}]}))
    ab = tmp_path / "ab.json"
    ab.write_text(json.dumps({"abc warm": [{"wall_s": 12.0}], "def warm": [{"wall_s": 6.0}]}))
    table, summary = goals.report([fast, slow, str(sweep), str(ab)])

    p512 = summary["prefill 512 tokens, speed vs HF"]
    assert p512["figures"] == {"fast": pytest.approx(2.0), "slow": pytest.approx(1 / 0.9)}
    assert (p512["runs"], p512["met"]) == (2, 1)
    flat = summary["decode flat: step at 1024 / step at 128"]
    assert flat["figures"]["fast"] == pytest.approx(1.05) and flat["met"] == 1
    assert flat["figures"]["slow"] == pytest.approx(0.06 / 0.045)
    h2o = summary["h2o/512 int4 decode at 1024 tokens, speed vs HF"]
    assert h2o["figures"] == {"fast": pytest.approx(0.1 / 0.045)} and h2o["met"] == 1
    assert summary["prefill 2048 tokens, speed vs HF"]["runs"] == 0
    warm = summary["warm run.py point, wall"]
    assert warm["figures"] == {"sweep": 7.5, "ab [abc]": 12.0, "ab [def]": 6.0}
    assert warm["met"] == 2  # the median of a file's warm runs, not its best
    assert "| 2.00x yes | 1.11x no |" in table and "not measured" in table
    assert "| 1 of 2 |" in table and "| 2 of 3 |" in table


def test_goals_cli_writes_table_and_json(tmp_path, capsys):
    run = hf_json(tmp_path / "run.json", 0.7, 0.04, 0.05)
    out = tmp_path / "new" / "goals.md"  # a folder made for it
    summary = goals.main([run, "--out", str(out)])
    assert "decode at 128 tokens" in capsys.readouterr().out
    assert out.read_text().startswith(f"`python -m experiments.goals {run}`")
    assert json.loads((tmp_path / "new" / "goals.json").read_text()) == summary
    with pytest.raises(SystemExit):
        goals.main([str(tmp_path / "missing.json")])
    assert "no such file" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"cold": []}))
    with pytest.raises(SystemExit):
        goals.main([str(other)])
    assert "neither a bench_hf JSON" in capsys.readouterr().err
    for name, text in (("notjson.json", "{x"), ("list.json", "[1]")):
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as e:
            goals.main([str(tmp_path / name)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"error: {tmp_path / name}: " in err
