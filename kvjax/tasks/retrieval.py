"""What the retrieval tasks (`passkey`, `needle`) share: a number planted in a long chat prompt
of an exact token count, asked back, and answered in a few greedy tokens.

`query_aware` (default true) places the question inside the prompt, so a compress-mode policy
selects with the question in view (SnapKV's protocol: the observation window ends on it).
`query_aware=false` is kvpress's pipeline (the `qa` task's default): the prompt up to the end
of the context is read and selected first, and the question, the chat template's close and
the answer's start are fed after the selection, so no selection sees them. The prompt's ids are
the same either way; evict-mode policies read them in one piece.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from kvjax.tasks.base import (
    Task,
    batched_generate,
    chat_frame,
    check_positive,
    check_query_aware,
)


@dataclasses.dataclass(frozen=True)
class RetrievalTask(Task):
    """A task scored by whether greedy answers contain a seeded `digits`-digit number (its
    subclasses have the fields `digits` and `new_tokens`, the greedy tokens per answer)."""

    metric = "accuracy"
    higher_is_better = True
    has_prompt = True
    modes = ("evict", "compress")
    question: ClassVar[str] = ""  # the question and the answer's start that end each prompt
    answer: ClassVar[str] = ""
    query_aware: bool = True  # false: the question is fed after a compress-mode selection
    batch: int = 8  # prompts per forward (the answers are those of one prompt at a time)

    def check_options(self) -> None:
        """`query_aware` a bool, `batch` a positive count (ValueError: plan reports it)."""
        check_query_aware(self)
        check_positive(self, batch=self.batch)

    def generate(self, ctx, prompts, policies, desc: str | None = None):
        """Greedy answers [(tokens, last batch's cache)] per policy, `batch` prompts at a time,
        the question where `query_aware` puts it: in the prompt, or (compress mode,
        query_aware=false) fed after the selection."""
        if self.query_aware or policies[0].mode != "compress":
            return batched_generate(ctx, prompts, self.new_tokens, self.chunk, self.batch,
                                    policies, desc=desc)
        if any(p.mode != "compress" for p in policies):
            raise ValueError(f"task {self.name!r}: run_many needs policies of one mode")
        n = len(question_tail(ctx.tokenizer, self.question, self.answer))
        return batched_generate(ctx, [p[:-n] for p in prompts], self.new_tokens, self.chunk,
                                self.batch, policies, [p[-n:] for p in prompts], desc=desc)

    def check_new_tokens(self, noun: str) -> None:
        """`new_tokens` must leave room for the whole number (digits are single tokens)."""
        if self.new_tokens < self.digits:
            raise ValueError(
                f"task {self.name!r}: new_tokens={self.new_tokens} cannot hold a {self.digits}-digit "
                f"{noun} (digits are single tokens); use new_tokens >= {self.digits + 2}"
            )


def random_key(seed: int, digits: int) -> int:
    rng = np.random.default_rng(seed)
    return int(rng.integers(10 ** (digits - 1), 10**digits))


def planted_prompt(tokenizer, length: int, plant: str, question: str, answer: str,
                   fill: Callable[[int, int], tuple[list[int], int]], intro: str = "") -> list[int]:
    """A chat prompt of exactly `length` ids: the user turn holds `intro`, a body with `plant`
    inside it and `question`; the assistant turn is started with `answer`.

    fill(n_body, n_fixed) -> (body ids [n_body], index to plant at) sizes the body to the ids
    the fixed parts leave (n_fixed of them), raising if that cannot make a prompt."""
    head = prompt_head(tokenizer, intro)
    planted = tokenizer.encode(plant)
    tail = question_tail(tokenizer, question, answer)
    fixed = len(head) + len(planted) + len(tail)
    body, at = fill(length - fixed, fixed)
    return head + body[:at] + planted + body[at:] + tail


def prompt_head(tokenizer, intro: str = "") -> list[int]:
    """The ids that start a retrieval prompt: the chat template's head and `intro` (what
    every prompt of a task shares: a server's static prefix)."""
    return chat_frame(tokenizer)[0] + (tokenizer.encode(intro) if intro else [])


def question_tail(tokenizer, question: str, answer: str) -> list[int]:
    """The ids that end a retrieval prompt: the question, the chat template's close of the
    user turn and the assistant's answer start."""
    return tokenizer.encode(question) + chat_frame(tokenizer)[1] + tokenizer.encode(answer)
