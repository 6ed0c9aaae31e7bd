"""task=qa (JSONL question answering, kvpress's pipeline) and the RULER generators.

Scorers are checked on hand-made cases, the validator on broken files (one error naming the
line, raised by `plan` before any model work), the generators against their construction
(needle depth, answers recomputed from the text, seeded reproducibility, the length budget),
the question-after-selection path against an independent full-prompt prefill, and the task
end to end on the tiny model through `kvjax.experiment.run`.
"""

from __future__ import annotations

import collections
import json
import re

import jax
import numpy as np
import pytest

from experiments import ruler
from experiments.leaderboard import leaderboard, markdown
from kvjax import experiment
from kvjax.config import tiny_config
from kvjax.experiment import ConfigError, ModelSpec, RunSpec, SpeedSpec
from kvjax.formats import get_format
from kvjax.generate import generate, generate_many
from kvjax.model import init_params
from kvjax.policies import get_policy
from kvjax.tasks import get_task
from kvjax.tasks.base import chat_frame
from kvjax.tasks.qa import load_qa, normalize, score_answer, summarize, token_f1
from kvjax.tasks.text import CharTokenizer

TINY = ModelSpec("tiny")
CHAR = CharTokenizer(tiny_config().vocab_size)


def write(tmp_path, rows, name="data.jsonl") -> str:
    p = tmp_path / name
    p.write_bytes(b"".join(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode()
                           for r in rows))
    return str(p)


GOOD = {"context": "the key is 42.", "question": "what is the key?", "answers": ["42"]}


# ----------------------------------------------------------------------------- scoring


def test_scores_on_hand_made_cases():
    s = score_answer(" The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"])
    assert s["match_all"] == pytest.approx(2 / 3) and s["match_part"] == 1.0 and s["exact"] == 0.0
    assert score_answer("PARIS", ["paris"])["match_all"] == 1.0  # case-insensitive (RULER)
    assert score_answer("The Paris.", ["paris"])["exact"] == 1.0  # articles, punctuation
    assert score_answer("Paris, France", ["paris"])["exact"] == 0.0
    assert normalize("  The  Eiffel-Tower! ") == "eiffeltower"
    assert token_f1("the cat sat", "cat sat down") == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert token_f1("dog", "cat") == 0.0
    assert score_answer("cat sat", ["dog", "cat sat down"])["f1"] == pytest.approx(0.8)


def test_summary_averages_categories_equally():
    rows = [{"category": "a", **score_answer("x", ["x"])},
            {"category": "b", **score_answer("y", ["x"])},
            {"category": "b", **score_answer("y", ["x"])},
            {"category": "b", **score_answer("x", ["x"])}]
    m = summarize(rows, "match_all")
    assert m["by_category"]["a"]["match_all"] == 1.0
    assert m["by_category"]["b"]["match_all"] == pytest.approx(1 / 3)
    assert m["score"] == pytest.approx((1 + 1 / 3) / 2)  # per category, then the mean
    assert m["match_all"] == pytest.approx(2 / 4) and m["n_samples"] == 4


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad,msg", [
    ({"context": "c", "question": "q"}, r"line 2: missing field\(s\) \['answers'\]"),
    ({**GOOD, "context": "  "}, "line 2: empty context"),
    ({**GOOD, "answers": "42"}, "line 2: 'answers' must be a non-empty list"),
    ({**GOOD, "answers": []}, "line 2: 'answers' must be a non-empty list"),
    ({**GOOD, "answer": ["42"]}, r"line 2: unknown field\(s\) \['answer'\]"),
    ({**GOOD, "question": 3}, "line 2: 'question' must be a string"),
    (b"\xff\xfe not utf-8\n", "line 2: not UTF-8"),
    (b"{not json\n", "line 2: not valid JSON"),
    (b"[1, 2]\n", "line 2: expected a JSON object"),
])
def test_bad_lines_are_one_error_naming_the_line(tmp_path, bad, msg):
    path = write(tmp_path, [GOOD, bad, GOOD])
    with pytest.raises(ValueError, match=msg):
        get_task("qa", file=path)
    spec = RunSpec(task=get_task("qa", file=write(tmp_path, [GOOD], "ok.jsonl")), model=TINY,
                   results=str(tmp_path / "r.jsonl"))
    spec = experiment.dataclasses.replace(spec, task=experiment.dataclasses.replace(
        spec.task, file=path))
    with pytest.raises(ConfigError, match=msg):  # plan: before the model loads
        experiment.plan(spec)


def test_settings_errors(tmp_path):
    with pytest.raises(ValueError, match="needs task.file"):
        get_task("qa")
    with pytest.raises(ValueError, match="no such file"):
        get_task("qa", file=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="scorer='bleu'; valid choices: match_all"):
        get_task("qa", file=write(tmp_path, [GOOD]), scorer="bleu")
    with pytest.raises(ValueError, match="has no samples"):
        get_task("qa", file=write(tmp_path, [b"\n"], "empty.jsonl"))
    with pytest.raises(ValueError, match="query_aware='no' must be true"):
        get_task("qa", file=write(tmp_path, [GOOD]), query_aware="no")


def test_point_key_is_the_file_content_not_its_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write(tmp_path / "a", [GOOD])
    b = write(tmp_path / "b", [GOOD])
    c = write(tmp_path, [{**GOOD, "answers": ["43"]}], "c.jsonl")

    def key(path):
        spec = RunSpec(task=get_task("qa", file=path), model=TINY, speed=SpeedSpec(0, 0),
                       results=str(tmp_path / "r.jsonl"))
        p = experiment.plan(spec)
        assert "path" not in json.dumps(p.point["task"]) and path not in json.dumps(p.point)
        return p.key

    assert key(a) == key(b) != key(c)
    assert load_qa(a)[1] == load_qa(b)[1] != load_qa(c)[1]


# ----------------------------------------------------------------------------- generation


def test_question_fed_after_a_full_prefill_equals_the_whole_prompt():
    """`generate(..., suffixes=)` with the full cache is the same computation as reading
    prompt + suffix in one prefill; generate_many with suffixes equals one generate each."""
    cfg = tiny_config(n_layers=1, max_seq_len=96)
    params = init_params(cfg, jax.random.PRNGKey(3))
    fmt = get_format("f32")
    prompts, suffixes = [list(range(1, 31)), list(range(5, 22))], [[7, 8, 9], [3, 4, 5, 6, 2]]
    whole = [p + s for p, s in zip(prompts, suffixes)]
    want, _ = generate(params, cfg, whole, 5, get_policy("full"), fmt, max_len=96)
    got, _ = generate(params, cfg, prompts, 5, get_policy("full"), fmt, max_len=96,
                      suffixes=suffixes)
    np.testing.assert_array_equal(got, want)
    policies = [get_policy("tova", budget=None, ratio=0.5, mode="compress"),
                get_policy("knorm", budget=None, ratio=0.25, mode="compress")]
    many = generate_many(params, cfg, prompts, 5, policies, fmt, max_len=96, suffixes=suffixes)
    for policy, (tokens, cache) in zip(policies, many):
        one, ref = generate(params, cfg, prompts, 5, policy, fmt, max_len=96, suffixes=suffixes)
        np.testing.assert_array_equal(tokens, one)
        np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(ref.pos))
        # the selection kept int(n (1 - ratio)) context tokens; the suffix and answer follow
        held = (np.asarray(cache.pos) >= 0).sum(-1)  # [L, B, K]
        for b, p in enumerate(prompts):
            assert (held[:, b] == policy.kept(len(p)) + len(suffixes[b]) + 5).all()


# ----------------------------------------------------------------------------- RULER


def test_ruler_is_seeded_and_fits_its_length():
    a = ruler.generate(CHAR, [2048], 2, seed=7)
    assert a == ruler.generate(CHAR, [2048], 2, seed=7)
    assert a != ruler.generate(CHAR, [2048], 2, seed=8)
    assert {r["category"] for r in a} == set(ruler.TASKS) and len(a) == 2 * len(ruler.TASKS)
    for r in a:
        m = r["meta"]
        assert m["seed"] == 7 and m["version"] == ruler.VERSION and m["length"] == 2048
        assert ruler.n_tokens(CHAR, r) == m["prompt_tokens"]
        assert m["prompt_tokens"] + m["tokens_to_generate"] <= 2048
        assert m["prompt_tokens"] + m["tokens_to_generate"] > 2048 * 0.8  # the haystack fills it


def test_ruler_needles_answers_and_depths():
    for task in ("niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery",
                 "niah_single_1", "niah_multikey_3"):
        r = ruler.sample(CHAR, task, 8192, seed=1, index=0)
        c = ruler.TASKS[task]
        ctx, query = r["context"], r["question"]
        n_queries = c["nq"]
        assert len(r["answers"]) == c["nv"] * n_queries
        needles = r["meta"]["needles"]
        assert len(needles) == max(c["nk"], c["nq"]) * c["nv"]
        for needle in needles:
            assert ctx.count(needle) == 1
        for value in r["answers"]:  # each answer is the value of a needle whose key is asked
            (needle,) = [n for n in needles if n.endswith(f": {value}.")]
            key = re.match(r"One of the special magic \w+ for (.+) is: ", needle).group(1)
            assert key in query and key in r["answer_prefix"]
        if c["haystack"] == "essay":  # after int(n_sentences * depth) document sentences
            body = ctx[ctx.index("\n") + 1:]
            bare = body
            for needle in needles:
                bare = bare.replace(needle, "")
            n_sents = len(ruler.sentences(bare))
            assert n_sents > 20
            for needle, depth in zip(sorted(needles, key=body.index), r["meta"]["depths"]):
                before = body[:body.index(needle)]
                for other in needles:
                    before = before.replace(other, "")
                assert len(ruler.sentences(before)) == int(n_sents * depth), (task, depth)
    single = ruler.sample(CHAR, "niah_single_1", 1024, seed=1, index=0)
    assert single["question"].startswith("What is the special magic number for ")


def test_ruler_vt_cwe_fwe_answers_by_construction():
    vt = ruler.sample(CHAR, "vt", 2048, seed=2, index=0)
    main = vt["context"].split("\n", 1)[1]  # after the in-context example
    main = main[main.index("following text"):]
    assign = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", main))
    value = re.search(r"assigned the value (\d+)", vt["question"]).group(1)

    def resolve(v):
        while assign[v].startswith("VAR "):
            v = assign[v][4:]
        return assign[v]

    assert sorted(v for v in assign if resolve(v) == value) == sorted(vt["answers"])
    cwe = ruler.sample(CHAR, "cwe", 2048, seed=2, index=0)
    listed = re.findall(r"\d+\. (\w+)", cwe["context"].split("Memorize the ones")[-1])
    counts = collections.Counter(listed)
    top = [w for w, _ in counts.most_common(10)]
    assert sorted(top) == sorted(cwe["answers"])
    assert min(counts[w] for w in cwe["answers"]) > max(
        n for w, n in counts.items() if w not in cwe["answers"])
    fwe = ruler.sample(CHAR, "fwe", 2048, seed=2, index=0)
    words = fwe["context"].split("coded words. ")[1].split()
    counts = collections.Counter(w for w in words if w != "...")
    assert [w for w, _ in counts.most_common(3)] == fwe["answers"]


def test_ruler_rejects_unknown_tasks():
    with pytest.raises(ValueError, match="unknown task.*valid choices: niah_single_1"):
        ruler.generate(CHAR, [1024], 1, 0, ["qa_1"])


@pytest.mark.parametrize("argv, msg", [(["--n", "0"], "--n must be >= 1 .*got 0"),
                                       (["--tasks", "vt", "qa_1"],
                                        "--tasks: unknown task.*qa_1; valid choices: niah_")])
def test_ruler_cli_rejects_bad_counts_and_tasks_before_the_tokenizer(tmp_path, capsys, argv,
                                                                     msg):
    out = tmp_path / "ruler.jsonl"
    with pytest.raises(SystemExit) as e:
        ruler.main([*argv, "--out", str(out)])
    assert e.value.code == 2 and re.search(msg, capsys.readouterr().err)
    assert not out.exists()


# ----------------------------------------------------------------------------- end to end


def test_qa_runs_end_to_end_on_the_tiny_model(tmp_path):
    """Through kvjax.experiment.run: per-category scores, per-sample outputs beside the
    record, and the compress-mode split (only the context is prefilled unless query_aware)."""
    rows = [{"context": "alpha beta gamma " * 6, "question": "which?", "answers": ["beta"],
             "answer_prefix": "it is", "category": "x", "id": "s1"},
            {"context": "one two three " * 4, "question": "a longer question?",
             "answers": ["two", "zzz"], "category": "y"},
            {"context": "red green " * 9, "question": "colour?", "answers": ["green"]}]
    path = write(tmp_path, rows)
    common = {"model": TINY, "speed": SpeedSpec(0, 0), "results": str(tmp_path / "r.jsonl")}
    prefilled = {}
    for aware in (False, True):
        spec = RunSpec(task=get_task("qa", file=path, max_new_tokens=4, batch=3,
                                     query_aware=aware), policy="tova",
                       policy_options=(("mode", "compress"),), ratio=0.5, **common)
        lines = []
        out = experiment.run(spec, tmp_path / f"run{aware}", echo=lines.append)
        m = out.record["metrics"]
        assert set(m["by_category"]) == {"x", "y", "all"} and m["n_samples"] == 3
        table = {ln.split("  ")[1] if ln.startswith("  ") else ln.split("  ")[0]: ln
                 for ln in lines[0].splitlines()[2:]}  # the printed table, by row name
        for cat, c in m["by_category"].items():
            assert f"{c['match_all']:.4f}  match_all, {c['n']} samples" in table[cat]
        samples = json.loads((tmp_path / f"run{aware}" / "samples.json").read_text())
        assert [s["line"] for s in samples] == [1, 2, 3] and samples[0]["id"] == "s1"
        for s in samples:
            assert len(s["output"]) <= 4 and set(s) >= {"match_all", "exact", "f1", "answers"}
            want = score_answer(s["output"], s["answers"])
            assert m["by_category"][s["category"]]["n"] >= 1 and s["f1"] == want["f1"]
        prefilled[aware] = [s["prefilled_tokens"] for s in samples]
    # query_aware moves the question (its tokens) into the prefilled part
    q = [len(CHAR.encode(r["question"])) for r in rows]
    assert [b - a for a, b in zip(prefilled[False], prefilled[True])] == q
    spec = RunSpec(task=get_task("qa", file=path, max_new_tokens=4), sweep="lb", **common)
    experiment.run(spec, tmp_path / "full", echo=lambda *a: None)
    res = leaderboard(str(tmp_path / "r.jsonl"), "lb", str(tmp_path / "lb"), echo=lambda *a: None)
    assert (tmp_path / "lb" / "leaderboard.png").is_file() and res["full"] is not None


def test_leaderboard_table_shape():
    cells = {"knorm": {0.25: 50.0, 0.5: 40.0, 0.75: 10.0}, "tova": {0.25: 60.0, 0.5: 55.0}}
    text = markdown(cells, 70.0, (0.25, 0.5, 0.75)).splitlines()
    assert text[0] == "| policy | ratio 0.25 | ratio 0.5 | ratio 0.75 | mean |"
    assert text[2] == "| full cache | 70.0 | 70.0 | 70.0 | 70.0 |"
    assert text[3].startswith("| tova | 60.0 | 55.0 | – |")  # sorted by mean, gaps marked
    assert text[4] == "| knorm | 50.0 | 40.0 | 10.0 | 33.3 |"
    errors = {"full": {None: 2.0}, "tova": {0.25: 5.0}}
    text = markdown(cells, 70.0, (0.25, 0.5, 0.75), errors).splitlines()
    assert text[2] == "| full cache | 70.0 ± 2.0 | 70.0 ± 2.0 | 70.0 ± 2.0 | 70.0 |"
    assert text[3].startswith("| tova | 60.0 ± 5.0 | 55.0 | – |")


def test_score_se_by_hand():
    """The category-averaged score's standard error: sqrt(sum_c var_c / n_c) / C."""
    from kvjax.tasks.qa import score_se, summarize

    rows = [{"category": "a", "match_all": v} for v in (1.0, 0.0)]
    rows += [{"category": "b", "match_all": v} for v in (1.0, 1.0, 0.5)]
    want = np.sqrt(0.5 / 2 + (1 / 12) / 3) / 2
    assert score_se(rows, "match_all") == pytest.approx(want, rel=1e-12)
    assert score_se(rows + [{"category": "c", "match_all": 1.0}], "match_all") is None
    full = [{**r, "match_part": 0.0, "exact": 0.0, "f1": 0.0} for r in rows]
    assert summarize(full, "match_all")["score_se"] == pytest.approx(want, rel=1e-12)


def test_leaderboard_reads_the_standard_error_beside_an_older_record(tmp_path):
    """A record stored without `score_se` gets it from its samples.json."""
    from experiments.leaderboard import record_se

    rows = [{"category": "a", "match_all": v} for v in (1.0, 0.0, 1.0)]
    (tmp_path / "samples.json").write_text(json.dumps(rows))
    rec = {"metrics": {"value": 2 / 3}, "run_dir": str(tmp_path),
           "point": {"task": {"name": "qa", "scorer": "match_all"}}}
    assert record_se(rec) == pytest.approx(100 * np.sqrt((1 / 3) / 3))
    assert record_se({**rec, "metrics": {"value": 0.5, "score_se": 0.1}}) == pytest.approx(10.0)
    assert record_se({**rec, "run_dir": str(tmp_path / "gone")}) is None


def test_hydra_composes_task_qa(tmp_path):
    from hydra import compose, initialize_config_dir

    from kvjax import harness

    path = write(tmp_path, [GOOD])
    with initialize_config_dir(str(harness.CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["task=qa", f"task.file={path}", "policy=tova",
                                           "ratio=0.5", "policy.mode=compress",
                                           "task.query_aware=true"])
        missing = compose("config", overrides=["task=qa"])
    spec = harness.spec_from_config(cfg)
    assert spec.task.file == path and spec.task.query_aware and spec.task.max_new_tokens == 32
    with pytest.raises(ConfigError, match="needs task.file=PATH.jsonl"):
        harness.spec_from_config(missing)


def test_prompt_room_is_counted_per_batch(tmp_path):
    """A batch pads its contexts and its questions separately, so it needs its longest
    context plus its longest question; across batches the most of that."""
    rows = [{**GOOD, "context": "c" * 50, "question": "q"},
            {**GOOD, "context": "c", "question": "q" * 30}]
    path = write(tmp_path, rows)
    head, tail = (len(x) for x in chat_frame(CHAR))
    one = get_task("qa", file=path, batch=1).resolve(CHAR).prompt_tokens
    both = get_task("qa", file=path, batch=2).resolve(CHAR).prompt_tokens
    assert one == head + tail + 50 + 1
    assert both == head + tail + 50 + 30
    aware = get_task("qa", file=path, batch=2, query_aware=True).resolve(CHAR).prompt_tokens
    assert aware == head + tail + 51  # the question is in the prefilled part: no padding gap
    with pytest.raises(ValueError, match="prompt_tokens=10 but"):
        get_task("qa", file=path, prompt_tokens=10).resolve(CHAR)
