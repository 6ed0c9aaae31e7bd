"""`passkey`: a number planted in repetitive filler at a chosen depth, asked back in a chat turn.

Prompts are assembled in token space so each one is exactly `length` tokens: the chat
template's user turn holds an instruction, filler sentences with the key sentence at `depth`
(snapped to a filler-unit boundary), and the question; the assistant turn is started with
"The pass key is" so a few greedy tokens hold the answer. A sample is correct when the
decoded answer contains the number. Samples are seeded (seed + sample index) and run `batch`
at a time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.tasks.base import (
    TaskContext,
    TaskResult,
    check_chunk,
    check_depths,
    check_positive,
    contains_answer,
    register,
)
from kvjax.tasks.retrieval import RetrievalTask, planted_prompt, random_key

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key?"
ANSWER = "The pass key is"


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """A chat prompt of exactly `length` ids with the key sentence at `depth` of the filler."""
    unit = tokenizer.encode(FILLER)

    def fill(n_fill: int, fixed: int) -> tuple[list[int], int]:
        if n_fill < 0:
            raise ValueError(
                f"task 'passkey': length={length} is too short for the prompt's fixed parts "
                f"({fixed} tokens); use length >= {fixed + len(unit)}"
            )
        filler = (unit * (n_fill // len(unit) + 1))[:n_fill]
        return filler, min(round(depth * (n_fill // len(unit))) * len(unit), n_fill)

    return planted_prompt(tokenizer, length, KEY.format(key=key), QUESTION, ANSWER, fill,
                          intro=INTRO)


@register
@dataclasses.dataclass(frozen=True)
class Passkey(RetrievalTask):
    """Accuracy of retrieving a `digits`-digit pass key over `n_samples` seeded prompts."""

    name = "passkey"
    question = QUESTION
    answer = ANSWER
    length: int = 1024
    depth: float = 0.5
    n_samples: int = 5
    digits: int = 5
    new_tokens: int = 10
    chunk: int | None = None  # prefill chunk; None: each prompt in one forward

    def seq_len(self) -> int:
        return self.length + self.new_tokens

    def ratio_length(self) -> int:
        return self.length

    def validate(self) -> None:
        check_positive(self, length=self.length, n_samples=self.n_samples, digits=self.digits,
                       new_tokens=self.new_tokens)
        check_chunk(self, self.chunk)
        check_depths(self, [self.depth])
        self.check_options()
        self.check_new_tokens("key")

    def keys(self, seed: int) -> list[int]:
        return [random_key(seed * 100003 + i, self.digits) for i in range(self.n_samples)]

    def prompts(self, tokenizer, keys) -> list[list[int]]:
        return [passkey_prompt(tokenizer, self.length, self.depth, k) for k in keys]

    def check_prompts(self, tokenizer, text: str, seed: int) -> None:
        self.prompts(tokenizer, self.keys(seed))

    def run(self, ctx: TaskContext) -> TaskResult:
        return self.run_many(ctx, [ctx.policy])[0]

    def run_many(self, ctx: TaskContext, policies) -> list[TaskResult]:
        keys = self.keys(ctx.seed)
        prompts = self.prompts(ctx.tokenizer, keys)
        return [self.score(ctx, keys, out, cache) for out, cache in
                self.generate(ctx, prompts, policies, desc=f"passkey ({ctx.policy.name})")]

    def score(self, ctx: TaskContext, keys, out, cache) -> TaskResult:
        rows = []
        for i, (k, toks) in enumerate(zip(keys, out)):
            answer = ctx.tokenizer.decode(toks, skip_special_tokens=True)
            rows.append({"sample": i, "depth": self.depth, "length": self.length, "key": k,
                         "answer": answer, "correct": contains_answer(answer, k)})
        correct = [r["correct"] for r in rows]
        return TaskResult(
            metrics={"accuracy": float(np.mean(correct)), "n_correct": int(sum(correct)),
                     "n_samples": self.n_samples, "n_tokens": self.length},
            curves={"step": list(range(1, len(correct) + 1)),
                    "running_accuracy": list(np.cumsum(correct) / np.arange(1, len(correct) + 1))},
            rows=rows,
            cache=cache,
        )
