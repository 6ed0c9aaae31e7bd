"""`needle`: a depth x length grid of retrieval accuracy (needle in a haystack).

The haystack is real prose (the task's text, default kvjax/data/python_docs.txt). For each context
length and depth, a sentence holding a seeded magic number is inserted at that fraction of
the haystack (moved back to the nearest sentence end within 64 tokens), inside the model's
chat template, with the question after it and the answer started as in `passkey`. Each cell
averages `n_samples` seeded samples; a length's prompts (depths x samples) run `batch` at a time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.tasks.base import (
    TaskContext,
    TaskResult,
    bar,
    check_chunk,
    check_depths,
    check_positive,
    contains_answer,
    register,
)
from kvjax.tasks.retrieval import RetrievalTask, planted_prompt, random_key
from kvjax.tasks.text import encode_prefix

NEEDLE = " The special magic number is {key}. "
QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"
ANSWER = "The special magic number is"


def sentence_boundary(tokenizer, ids: list[int], pos: int, window: int = 64) -> int:
    """The nearest index <= pos right after a token ending a sentence (else pos)."""
    for j in range(pos, max(0, pos - window), -1):
        if tokenizer.decode([ids[j - 1]]).rstrip(" ").endswith((".", "\n")):
            return j
    return pos


def needle_prompt(tokenizer, haystack: list[int], length: int, depth: float, key: int):
    """A chat prompt of exactly `length` ids: haystack prefix with the needle at `depth`."""

    def fill(n_hay: int, fixed: int) -> tuple[list[int], int]:
        if n_hay < 1:
            raise ValueError(
                f"task 'needle': length {length} is too short for the prompt's fixed parts "
                f"({fixed} tokens); use lengths >= {fixed + 16}"
            )
        if n_hay > len(haystack):
            raise ValueError(
                f"task 'needle': the text has {len(haystack)} tokens, too few for length {length}"
            )
        hay = haystack[:n_hay]
        return hay, sentence_boundary(tokenizer, hay, round(depth * n_hay))

    return planted_prompt(tokenizer, length, NEEDLE.format(key=key), QUESTION, ANSWER, fill)


@register
@dataclasses.dataclass(frozen=True)
class Needle(RetrievalTask):
    """Retrieval accuracy per (depth, length) cell; the metric is the grid's mean."""

    name = "needle"
    question = QUESTION
    answer = ANSWER
    lengths: tuple[int, ...] = (256, 512, 1024)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    n_samples: int = 1
    digits: int = 7
    new_tokens: int = 12
    chunk: int | None = None  # prefill chunk; None: each prompt in one forward
    text_file: str | None = None

    @staticmethod
    def table_rows(m: dict, options: dict) -> list[tuple[str, str, str]]:
        g = m.get("grid") or {}
        by_len = [f"{n}: {sum(col) / len(col):.2f}"
                  for n, col in zip(g.get("lengths", ()), zip(*g.get("accuracy", ())))]
        return [("accuracy by length", "", ", ".join(by_len) + " (mean over depths; the report "
                 "draws the depth x length grid)")] if by_len else []

    def seq_len(self) -> int:
        return max(self.lengths) + self.new_tokens

    def ratio_length(self) -> int | None:
        return self.lengths[0] if len(self.lengths) == 1 else None

    def validate(self) -> None:
        check_positive(self, n_samples=self.n_samples, digits=self.digits,
                       new_tokens=self.new_tokens)
        check_chunk(self, self.chunk)
        if not self.lengths:
            raise ValueError("task 'needle': lengths must be a non-empty list of token counts")
        for n in self.lengths:
            check_positive(self, length=n)
        check_depths(self, self.depths)
        self.check_options()
        self.check_new_tokens("number")

    def cells(self) -> list[tuple[int, float, int]]:
        """(depth index, depth, sample) of every prompt at one length."""
        return [(i, d, s) for i, d in enumerate(self.depths) for s in range(self.n_samples)]

    def cell_prompts(self, tokenizer, haystack, seed: int, j: int):
        """(keys, prompts) of the cells at length index j."""
        cells = self.cells()
        keys = [random_key((seed * 1009 + j) * 100003 + n, self.digits) for n in range(len(cells))]
        return keys, [needle_prompt(tokenizer, haystack, self.lengths[j], d, k)
                      for (_, d, _), k in zip(cells, keys)]

    def check_prompts(self, tokenizer, text: str, seed: int) -> None:
        haystack = encode_prefix(tokenizer, text, max(self.lengths))
        for j in range(len(self.lengths)):
            self.cell_prompts(tokenizer, haystack, seed, j)

    def run(self, ctx: TaskContext) -> TaskResult:
        return self.run_many(ctx, [ctx.policy])[0]

    def run_many(self, ctx: TaskContext, policies) -> list[TaskResult]:
        haystack = encode_prefix(ctx.tokenizer, ctx.text, max(self.lengths))
        acc = np.zeros((len(policies), len(self.depths), len(self.lengths)))
        rows, caches = [[] for _ in policies], [None] * len(policies)
        for j, length in enumerate(bar(self.lengths, ctx, f"needle ({ctx.policy.name})")):
            cells = self.cells()
            keys, prompts = self.cell_prompts(ctx.tokenizer, haystack, ctx.seed, j)
            outs = self.generate(ctx, prompts, policies)
            for p, (out, caches[p]) in enumerate(outs):
                for (i, d, s), k, toks in zip(cells, keys, out):
                    answer = ctx.tokenizer.decode(toks, skip_special_tokens=True)
                    ok = contains_answer(answer, k)
                    acc[p, i, j] += ok / self.n_samples
                    rows[p].append({"length": length, "depth": d, "sample": s, "key": k,
                                    "answer": answer, "correct": ok})
        return [TaskResult(
            metrics={"accuracy": float(acc[p].mean()),
                     "grid": {"depths": list(self.depths), "lengths": list(self.lengths),
                              "accuracy": acc[p].tolist()},
                     "n_samples": self.n_samples},
            rows=rows[p],
            cache=caches[p],
        ) for p in range(len(policies))]
