"""`qa`: bring-your-own question answering from a JSONL file, with kvpress's pipeline semantics.

Each line is a JSON object with `context` (non-empty), `question` and `answers` (a non-empty
list of strings), and optionally `answer_prefix`, `id`, `category` and `meta` (a free-form
object, e.g. a generator's seed and version). The chat template wraps context + question, as
in kvpress's pipeline:

    prefilled = <chat head> context            (query_aware: context + question)
    fed after = question <chat tail> answer_prefix   (query_aware: <chat tail> answer_prefix)

In compress mode the policy selects from the prefilled part only (the question is not visible
to the selection unless `query_aware`), then the rest is fed into the grown cache and up to
`max_new_tokens` are decoded greedily; in evict mode the whole prompt goes through the policy.
Scores per sample (`score_answer`): RULER's string_match_all (the fraction of answers in the
output) and string_match_part (any answer in it), exact match after SQuAD normalization and
token F1; reported per category and overall. The metric `score` is the mean over categories
of `scorer` (RULER and kvpress average per task). Samples run `batch` at a time; in compress
mode one prefill serves every policy of a shared sweep (`run_many`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import re
import string
from pathlib import Path

import numpy as np

from kvjax.tasks.base import (
    Task,
    TaskContext,
    TaskResult,
    batched_generate,
    chat_frame,
    check_chunk,
    check_positive,
    check_query_aware,
    fmt,
    register,
)

REQUIRED = ("context", "question", "answers")
OPTIONAL = ("answer_prefix", "id", "category", "meta")
SCORERS = ("match_all", "match_part", "exact", "f1")
DEFAULT_CATEGORY = "all"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One validated line of a QA file (`line` counts from 1)."""

    line: int
    context: str
    question: str
    answers: tuple[str, ...]
    answer_prefix: str = ""
    id: str | None = None
    category: str = DEFAULT_CATEGORY


def file_error(path, line: int, msg: str) -> ValueError:
    return ValueError(f"task 'qa': task.file={str(path)!r} line {line}: {msg}")


def parse_line(path, n: int, raw: bytes) -> Sample:
    """One JSONL line -> Sample, or a ValueError naming the file, the line and the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise file_error(path, n, f"not UTF-8 ({e})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise file_error(path, n, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise file_error(path, n, f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise file_error(path, n, f"missing field(s) {missing}; every line needs {list(REQUIRED)}")
    unknown = sorted(set(obj) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise file_error(path, n, f"unknown field(s) {unknown}; valid fields: "
                                  f"{list(REQUIRED + OPTIONAL)}")
    for k in ("context", "question", "answer_prefix", "category"):
        if k in obj and not isinstance(obj[k], str):
            raise file_error(path, n, f"{k!r} must be a string, got {type(obj[k]).__name__}")
    if not obj["context"].strip():
        raise file_error(path, n, "empty context")
    answers = obj["answers"]
    if (not isinstance(answers, list) or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)):
        raise file_error(path, n, f"'answers' must be a non-empty list of non-empty strings, "
                                  f"got {answers!r}")
    if "meta" in obj and not isinstance(obj["meta"], dict):
        raise file_error(path, n, "'meta' must be a JSON object")
    return Sample(n, obj["context"], obj["question"], tuple(answers),
                  obj.get("answer_prefix", ""), None if obj.get("id") is None else str(obj["id"]),
                  obj.get("category") or DEFAULT_CATEGORY)


@functools.lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int) -> tuple[tuple[Sample, ...], str]:
    data = Path(path).read_bytes()
    samples = tuple(parse_line(path, n, raw) for n, raw in enumerate(data.splitlines(), 1)
                    if raw.strip())
    if not samples:
        raise ValueError(f"task 'qa': task.file={path!r} has no samples (one JSON object a line)")
    return samples, hashlib.sha256(data).hexdigest()


def load_qa(path: str) -> tuple[tuple[Sample, ...], str]:
    """(samples, sha256 of the file's bytes); every problem is one ValueError naming the line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"task 'qa': task.file={path!r}: no such file")
    st = p.stat()
    return _load(str(p.resolve()), st.st_size, st.st_mtime_ns)


# ----------------------------------------------------------------------------- scoring


def normalize(s: str) -> str:
    """SQuAD's answer normalization: lowercase, drop punctuation and articles, squeeze spaces."""
    s = "".join(c for c in s.lower() if c not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(pred: str, ref: str) -> float:
    p, r = normalize(pred).split(), normalize(ref).split()
    common = sum((collections.Counter(p) & collections.Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def score_answer(pred: str, answers) -> dict:
    """Every score of one output against its reference answers, each in [0, 1].

    match_all / match_part: RULER's string_match_all / string_match_part (case-insensitive
    substring: the fraction of answers found / whether any is); exact: normalized equality
    with any answer; f1: the best token F1 over the answers."""
    low = pred.lower()
    found = [a.lower() in low for a in answers]
    return {"match_all": sum(found) / len(answers), "match_part": float(any(found)),
            "exact": float(any(normalize(pred) == normalize(a) for a in answers)),
            "f1": max(token_f1(pred, a) for a in answers)}


def summarize(rows: list[dict], scorer: str) -> dict:
    """Mean of every score per category and overall; `score` is the mean over categories of
    `scorer` (equal weight per category, as RULER's and kvpress's averages)."""
    by_cat: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)
    means = lambda rs: {k: float(np.mean([r[k] for r in rs])) for k in SCORERS}
    per_cat = {c: {**means(rs), "n": len(rs)} for c, rs in sorted(by_cat.items())}
    return {"score": float(np.mean([m[scorer] for m in per_cat.values()])),
            "score_se": score_se(rows, scorer),
            **means(rows), "n_samples": len(rows), "by_category": per_cat}


def score_se(rows: list[dict], scorer: str) -> float | None:
    """The standard error of `score` (the mean over C categories of each one's mean):
    sqrt(sum_c s_c^2 / n_c) / C, s_c the category's sample standard deviation. None when a
    category has a single sample (no spread to estimate)."""
    by_cat: dict[str, list[float]] = collections.defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(float(r[scorer]))
    if not by_cat or min(len(v) for v in by_cat.values()) < 2:
        return None
    var = sum(float(np.var(v, ddof=1)) / len(v) for v in by_cat.values())
    return float(np.sqrt(var)) / len(by_cat)


def until_eos(tokens, tokenizer) -> list[int]:
    """The generated ids up to (without) the first end-of-sequence id: what follows it is not
    part of the answer."""
    toks = [int(t) for t in tokens]
    eos = getattr(tokenizer, "eos_id", None)
    return toks[:toks.index(eos)] if eos is not None and eos in toks else toks


# ----------------------------------------------------------------------------- the task


@register
@dataclasses.dataclass(frozen=True)
class QA(Task):
    """Question answering over a JSONL file's contexts (see the module docstring)."""

    name = "qa"
    metric = "score"
    higher_is_better = True
    has_prompt = True
    modes = ("evict", "compress")

    file: str | None = None
    max_new_tokens: int = 32
    query_aware: bool = False
    scorer: str = "match_all"
    batch: int = 4
    chunk: int | None = None  # prefill chunk; None: each context in one forward
    prompt_tokens: int | None = None  # room for a prompt; null: counted from the file

    @staticmethod
    def table_rows(m: dict, options: dict) -> list[tuple[str, str, str]]:
        scorer = options.get("scorer", "match_all")
        se = m.get("score_se")
        rows = [("score std. error", fmt(se, ".4f"), f"of the mean of {scorer} over categories")]
        cats = m.get("by_category") or {}
        for cat, c in cats.items() if len(cats) > 1 else ():
            rows.append((f"  {cat}", fmt(c.get(scorer), ".4f"), f"{scorer}, {c.get('n')} samples"))
        return rows

    def seq_len(self) -> int:
        if self.prompt_tokens is None:
            raise ValueError("task 'qa': prompt_tokens is unknown until the file is tokenized "
                             "(`resolve`)")
        return self.prompt_tokens + self.max_new_tokens

    def validate(self) -> None:
        if not self.file:
            raise ValueError("task 'qa' needs task.file=PATH.jsonl (one JSON object a line with "
                             f"{list(REQUIRED)}, optional {list(OPTIONAL)})")
        check_positive(self, max_new_tokens=self.max_new_tokens, batch=self.batch)
        check_chunk(self, self.chunk)
        check_query_aware(self)
        if self.prompt_tokens is not None:
            check_positive(self, prompt_tokens=self.prompt_tokens)
        if self.scorer not in SCORERS:
            raise ValueError(f"task 'qa': scorer={self.scorer!r}; valid choices: "
                             f"{', '.join(SCORERS)}")
        load_qa(self.file)

    def samples(self) -> tuple[Sample, ...]:
        return load_qa(self.file)[0]

    def identity(self) -> dict:
        """The point key's view of the file: its content hash, never its path."""
        return {"file": {"sha256": load_qa(self.file)[1]}}

    def parts(self, tokenizer) -> list[tuple[list[int], list[int]]]:
        """(prefilled ids, ids fed after it) of every sample (module docstring)."""
        head, tail = chat_frame(tokenizer)
        out = []
        for s in self.samples():
            context, question = tokenizer.encode(s.context), tokenizer.encode(s.question)
            prefix = tokenizer.encode(s.answer_prefix) if s.answer_prefix else []
            if self.query_aware:
                out.append((head + context + question, tail + prefix))
            else:
                out.append((head + context, question + tail + prefix))
        return out

    def resolve(self, tokenizer) -> QA:
        """The task with `prompt_tokens` counted with this tokenizer (before the model loads):
        over the batches, the longest prefilled part plus the longest part fed after it (the
        room right-padded rows need, `kvjax.generate.check_fits`)."""
        parts = self.parts(tokenizer)
        n = max(max(len(a) for a, _ in parts[i:i + self.batch])
                + max(len(b) for _, b in parts[i:i + self.batch])
                for i in range(0, len(parts), self.batch))
        if self.prompt_tokens is not None and self.prompt_tokens < n:
            raise ValueError(f"task 'qa': prompt_tokens={self.prompt_tokens} but the longest "
                             f"prompt of {self.file!r} has {n} tokens; use prompt_tokens=null")
        return self if self.prompt_tokens is not None else dataclasses.replace(self, prompt_tokens=n)

    def check_prompts(self, tokenizer, text: str, seed: int) -> None:
        self.resolve(tokenizer)

    def run(self, ctx: TaskContext) -> TaskResult:
        return self.run_many(ctx, [ctx.policy])[0]

    def run_many(self, ctx: TaskContext, policies) -> list[TaskResult]:
        samples, parts = self.samples(), self.parts(ctx.tokenizer)
        compress = policies[0].mode == "compress"
        if any((p.mode == "compress") != compress for p in policies):
            raise ValueError("task 'qa': run_many needs policies of one mode")
        if compress:
            prompts, suffixes = [a for a, _ in parts], [s for _, s in parts]
        else:
            prompts, suffixes = [a + s for a, s in parts], None
        outs = batched_generate(ctx, prompts, self.max_new_tokens, self.chunk, self.batch,
                                policies, suffixes, desc=f"qa ({ctx.policy.name})")
        results = []
        for out, cache in outs:
            rows = []
            for s, (pre, post), toks in zip(samples, parts, out):
                pred = ctx.tokenizer.decode(until_eos(toks, ctx.tokenizer),
                                            skip_special_tokens=True)
                rows.append({"line": s.line, "id": s.id, "category": s.category,
                             "prompt_tokens": len(pre) + len(post),
                             "prefilled_tokens": len(pre) if compress else len(pre + post),
                             "answers": list(s.answers), "output": pred,
                             **score_answer(pred, s.answers)})
            results.append(TaskResult(metrics=summarize(rows, self.scorer), rows=rows,
                                      cache=cache))
        return results
