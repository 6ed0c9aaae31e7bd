"""RULER's synthetic tasks (Hsieh et al., 2024), generated offline and seeded, as `task=qa` JSONL.

    python -m experiments.ruler --lengths 4096 --n 50 --out data/ruler_4k.jsonl

Definitions follow NVIDIA/RULER (scripts/data/synthetic/*.py, synthetic.yaml, constants.py):
the needle family (niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery),
variable tracking (vt), common-words (cwe) and frequent-words (fwe) extraction, with RULER's
templates, answer prefixes and generation budgets, split into context / question /
answer_prefix the way kvpress's RULER data set is (the question is what follows the context).
Every sample is sized by binary search so that chat template + prompt + RULER's
tokens_to_generate fit the length (RULER's max_seq_length). Scoring is RULER's
string_match_all for all of these (task=qa scorer=match_all).

Offline substitutions (RULER downloads these): the `essay` haystack is the shipped
kvjax/data/python_docs.txt instead of Paul Graham's essays; the word keys (adjective-noun
pairs from `wonderwords` in RULER) and the cwe word list (english_words.json) are drawn from
the words of that same text. RULER's qa_1/qa_2 (SQuAD, HotpotQA) are not generated: neither
data set is available offline. Each line's `meta` holds the generator, its version, the seed,
the length and the needles' depths.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import string
import sys
import uuid
from pathlib import Path

import numpy as np

from kvjax.tasks.base import chat_frame
from kvjax.tasks.text import default_text

GENERATOR, VERSION = "kvjax.experiments.ruler", 1
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]

# RULER's scripts/data/synthetic/constants.py, cut where kvpress's data set cuts the question.
TEMPLATES = {
    "niah": (("Some special magic {type_v} are hidden within the following text. Make sure to "
             "memorize it. I will quiz you about the {type_v} afterwards.\n{context}\n"),
             "What are all the special magic {type_v} for {query} mentioned in the provided text?",
             " The special magic {type_v} for {query} mentioned in the provided text are", 128),
    "vt": (("Memorize and track the chain(s) of variable assignment hidden in the following "
           "text.\n\n{context}\n"),
           "Question: Find all variables that are assigned the value {query} in the text above.",
           (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
           "variables are assigned the value {query}, they are: "), 30),
    "cwe": (("Below is a numbered list of words. In these words, some appear more often than "
            "others. Memorize the ones that appear most often.\n{context}\n"),
            "Question: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:", 120),
    "fwe": (("Read the following coded text and track the frequency of each coded word. Find the "
            "three most frequently appeared coded words. {context}\n"),
            ("Question: Do not provide any explanation. Please ignore the dots '....'. What are "
            "the three most frequently appeared words in the above coded text?"),
            (" Answer: According to the coded text above, the three most frequently appeared "
            "words are:"), 50),
}

# RULER's scripts/synthetic.yaml (the 13 tasks less qa_1, qa_2).
TASKS = {
    "niah_single_1": {"kind": "niah", "haystack": "noise", "k": "words", "v": "numbers", "nk": 1, "nv": 1, "nq": 1},
    "niah_single_2": {"kind": "niah", "haystack": "essay", "k": "words", "v": "numbers", "nk": 1, "nv": 1, "nq": 1},
    "niah_single_3": {"kind": "niah", "haystack": "essay", "k": "words", "v": "uuids", "nk": 1, "nv": 1, "nq": 1},
    "niah_multikey_1": {"kind": "niah", "haystack": "essay", "k": "words", "v": "numbers", "nk": 4, "nv": 1,
                            "nq": 1},
    "niah_multikey_2": {"kind": "niah", "haystack": "needle", "k": "words", "v": "numbers", "nk": 1, "nv": 1,
                            "nq": 1},
    "niah_multikey_3": {"kind": "niah", "haystack": "needle", "k": "uuids", "v": "uuids", "nk": 1, "nv": 1,
                            "nq": 1},
    "niah_multivalue": {"kind": "niah", "haystack": "essay", "k": "words", "v": "numbers", "nk": 1, "nv": 4,
                            "nq": 1},
    "niah_multiquery": {"kind": "niah", "haystack": "essay", "k": "words", "v": "numbers", "nk": 1, "nv": 1,
                            "nq": 4},
    "vt": {"kind": "vt", "chains": 1, "hops": 4},
    "cwe": {"kind": "cwe", "freq_cw": 30, "freq_ucw": 3, "num_cw": 10},
    "fwe": {"kind": "fwe", "alpha": 2.0},
}


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essay haystack as words (RULER: the essays' text split on whitespace)."""
    return tuple(re.sub(r"\s+", " ", default_text()).split(" "))


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Distinct lowercase alphabetic words (4-10 letters) of the shipped text, sorted."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,10}\b", default_text()))))


def random_value(rng: random.Random, kind: str) -> str:
    """RULER's generate_random: a 7-digit number, a word pair or a uuid4."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(vocabulary())}-{rng.choice(vocabulary())}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r}; valid choices: numbers, words, uuids")


def sentences(text: str) -> list[str]:
    """Sentences of `text` (a stand-in for nltk's sent_tokenize)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def insert_by_depth(rng: random.Random, sents: list[str], items: list[str]) -> tuple[str, list]:
    """RULER's essay insertion: each item after int(n_sentences * depth) sentences, depths
    drawn without replacement from DEPTHS; (text, depths in [0, 1] in insertion order)."""
    depths = sorted(rng.sample(DEPTHS, len(items)))
    cuts = [0] + [int(len(sents) * d / 100) for d in depths] + [len(sents)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(items):
            parts.append(items[i - 1])
    return " ".join(p for p in parts if p), [d / 100 for d in depths]


def niah(rng: random.Random, n: int, haystack: str, k: str, v: str, nk: int, nv: int, nq: int):
    """RULER's niah generate_input_output with `n` haystack units: (fields, answers, meta)."""
    nk = max(nk, nq)
    keys, values, needles = [], [], []
    for _ in range(nk):
        keys.append(random_value(rng, k))
        values.append([random_value(rng, v) for _ in range(nv)])
        needles += [NEEDLE.format(type_v=v, key=keys[-1], value=x) for x in values[-1]]
    rng.shuffle(needles)
    if haystack == "essay":
        words = essay_words()
        text = " ".join((words * (n // len(words) + 1))[:n])
        context, depths = insert_by_depth(rng, sentences(text), needles)
    else:
        if haystack == "noise":
            units = [NOISE] * n
        else:
            units = [NEEDLE.format(type_v=v, key=random_value(rng, k), value=random_value(rng, v))
                     for _ in range(n)]
        at = sorted(rng.sample(range(n), len(needles)), reverse=True)
        for i, needle in zip(at, needles):
            units.insert(i, needle)
        context = "\n".join(units)
        depths = [i / n for i in sorted(at)]
    chosen = rng.sample(range(nk), nq)
    queries = [keys[i] for i in chosen]
    answers = [a for i in chosen for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    head, question, prefix, _ = TEMPLATES["niah"]
    type_v = v
    if nq * nv == 1:  # RULER's singular wording
        head, question, prefix = (s.replace("Some", "A").replace("are all", "is")
                                  .replace("are", "is").replace("answers", "answer")
                                  for s in (head, question, prefix))
        type_v = v[:-1]
    fields = {"context": head.format(type_v=type_v, context=context),
              "question": question.format(type_v=type_v, query=query),
              "answer_prefix": prefix.format(type_v=type_v, query=query)}
    return fields, answers, {"depths": depths, "needles": needles}


def vt_chains(rng: random.Random, chains: int, hops: int, icl: bool = False):
    """RULER's generate_chains: (variables per chain, statements per chain)."""
    k = 3 if icl else 5
    names: list[str] = []
    while len(set(names)) < chains * (hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    names = list(dict.fromkeys(names))
    out_vars, out_chains = [], []
    for c in range(chains):
        vs = names[c * (hops + 1):(c + 1) * (hops + 1)]
        value = 12345 if icl else rng.randint(10000, 99999)
        out_vars.append(vs)
        out_chains.append([f"VAR {vs[0]} = {value}"]
                          + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)])
    return out_vars, out_chains


def vt_text(rng: random.Random, n: int, chains: int, hops: int, icl: bool = False):
    """RULER's variable tracking in a noise haystack of n sentences: (context, query, answer)."""
    variables, stmts = vt_chains(rng, chains, hops, icl)
    units = [NOISE] * n
    for chain in stmts:
        at = sorted(rng.sample(range(len(units)), len(chain)))
        for j, (i, s) in enumerate(zip(at, chain)):
            units.insert(i + j, s)
    context = "\n".join(units).replace(". \n", ".\n")
    return context, stmts[0][0].split("=")[-1].strip(), variables[0]


def vt(rng: random.Random, n: int, chains: int, hops: int):
    """Variable tracking with RULER's one in-context example (a short chain, value replaced)."""
    head, question, prefix, _ = TEMPLATES["vt"]
    ex_ctx, ex_q, ex_vars = vt_text(rng, 5, chains, hops, icl=True)
    new_value = str(rng.randint(10000, 99999))
    example = (head.format(context=ex_ctx) + question.format(query=ex_q)
               + prefix.format(num_v=hops + 1, query=ex_q) + " " + " ".join(ex_vars))
    example = example.replace("12345", new_value)
    context, query, answer = vt_text(rng, n, chains, hops)
    fields = {"context": example + "\n" + head.format(context=context),
              "question": question.format(query=query),
              "answer_prefix": prefix.format(num_v=hops + 1, query=query)}
    return fields, answer, {}


def cwe_example(rng: random.Random, n_words: int, common: int, uncommon: int, num_cw: int):
    """RULER's get_example: (numbered list, the num_cw common words)."""
    words = rng.sample(vocabulary(), n_words)
    cw, ucw = words[:num_cw], words[num_cw:]
    listed = cw * common + ucw * uncommon
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), cw


def cwe(rng: random.Random, n: int, freq_cw: int, freq_ucw: int, num_cw: int, length: int):
    """Common-words extraction with RULER's one few-shot example (its <4k / >=4k settings)."""
    head, question, prefix, _ = TEMPLATES["cwe"]
    small = length < 4096
    ex_ctx, ex_ans = cwe_example(rng, 20 if small else 40, 3 if small else 10, 1 if small else 3,
                                 num_cw)
    ctx, ans = cwe_example(rng, n, 6 if small else freq_cw, 1 if small else freq_ucw, num_cw)
    example = (head.format(context=ex_ctx) + question + prefix + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_ans)))
    return ({"context": example + "\n" + head.format(context=ctx), "question": question,
             "answer_prefix": prefix}, ans, {})


def fwe(rng: random.Random, n: int, alpha: float, length: int):
    """Frequent-words extraction: Zipf(alpha) counts over coded 6-letter words, the most
    frequent replaced by '...' (noise); the answers are ranks 2-4."""
    head, question, prefix, _ = TEMPLATES["fwe"]
    size = max(length // 50, 4)
    vocab: list[str] = []
    while len(set(vocab)) < size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(set(vocab))
    rng.shuffle(vocab)
    vocab[0] = "..."
    k = np.arange(1, len(vocab) + 1)
    zeta = float(np.sum(np.arange(1, 1_000_000, dtype=np.float64) ** -alpha))
    counts = (n * k ** -alpha / zeta).astype(int)
    words = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(words)
    return ({"context": head.format(context=" ".join(words)), "question": question,
             "answer_prefix": prefix}, vocab[1:4], {})


def make(task: str, rng: random.Random, n: int, length: int):
    c = TASKS[task]
    if c["kind"] == "niah":
        return niah(rng, n, c["haystack"], c["k"], c["v"], c["nk"], c["nv"], c["nq"])
    if c["kind"] == "vt":
        return vt(rng, n, c["chains"], c["hops"])
    if c["kind"] == "cwe":
        return cwe(rng, n, c["freq_cw"], c["freq_ucw"], c["num_cw"], length)
    return fwe(rng, n, c["alpha"], length)


def min_units(c: dict) -> int:
    """The fewest haystack units that can hold a task's needles or chain statements."""
    if c["kind"] == "niah":
        return max(c["nk"], c["nq"]) * c["nv"]
    return c["chains"] * (c["hops"] + 1) if c["kind"] == "vt" else 1


def n_tokens(tokenizer, fields: dict) -> int:
    """Tokens of the chat prompt task=qa builds from these fields."""
    head, tail = chat_frame(tokenizer)
    return len(head) + len(tail) + sum(len(tokenizer.encode(fields[k]))
                                       for k in ("context", "question", "answer_prefix"))


def sample(tokenizer, task: str, length: int, seed: int, index: int) -> dict:
    """One JSONL line: the largest haystack (units as in RULER: sentences, words or list
    entries) whose prompt + RULER's tokens_to_generate fits `length` tokens, found by
    bisection with a generator seeded by (seed, task, length, index)."""
    budget = length - TEMPLATES[TASKS[task]["kind"]][3]
    key = f"{seed}:{task}:{length}:{index}"

    def build(n):
        fields, answers, meta = make(task, random.Random(key), n, length)
        return fields, answers, meta, n_tokens(tokenizer, fields)

    probe = 64  # RULER's estimate: tokens per unit from a small haystack, 3x slack
    per_unit = max(build(2 * probe)[3] - build(probe)[3], 1) / probe
    hi = max(int(3 * budget / per_unit), probe)
    if task == "cwe":
        hi = min(hi, len(vocabulary()))
    lo, best = min_units(TASKS[task]), None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = build(mid)
        if got[3] <= budget:
            best, lo = got, mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise ValueError(f"ruler: length {length} is too short for task {task!r}")
    fields, answers, meta, n = best
    return {**fields, "answers": list(answers), "id": f"{task}/{length}/{index}",
            "category": task,
            "meta": {"generator": GENERATOR, "version": VERSION, "seed": seed, "length": length,
                     "prompt_tokens": n, "tokens_to_generate": TEMPLATES[TASKS[task]["kind"]][3],
                     **meta}}


def generate(tokenizer, lengths, n: int, seed: int, tasks=None) -> list[dict]:
    tasks = list(TASKS) if tasks is None else list(tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"ruler: unknown task(s) {bad}; valid choices: {', '.join(TASKS)}")
    return [sample(tokenizer, t, L, seed, i) for L in lengths for t in tasks for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.ruler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096],
                    help="context lengths in tokens (RULER's max_seq_length), e.g. 1024 4096")
    ap.add_argument("--n", type=int, default=50, help="samples per task and length")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--tasks", nargs="+", default=None, help=f"subset of {', '.join(TASKS)}")
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer sizes the prompts")
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n must be >= 1 (samples per task and length), got {args.n}")
    bad = [t for t in args.tasks or () if t not in TASKS]
    if bad:  # before the tokenizer loads
        ap.error(f"--tasks: unknown task(s) {', '.join(bad)}; valid choices: {', '.join(TASKS)}")
    from kvjax.experiment import ModelSpec, load_tokenizer

    try:
        rows = generate(load_tokenizer(ModelSpec(args.model)), args.lengths, args.n, args.seed,
                        args.tasks)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                   encoding="utf-8")
    print(f"wrote {len(rows)} samples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
