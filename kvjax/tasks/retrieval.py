"""What the retrieval tasks (`passkey`, `needle`) share: a number planted in a long chat prompt
of an exact token count, asked back, and answered in a few greedy tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kvjax.tasks.base import Task, chat_frame


@dataclasses.dataclass(frozen=True)
class RetrievalTask(Task):
    """A task scored by whether greedy answers contain a seeded `digits`-digit number (its
    subclasses have the fields `digits` and `new_tokens`, the greedy tokens per answer)."""

    metric = "accuracy"
    higher_is_better = True
    has_prompt = True

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
    before, after = chat_frame(tokenizer)
    head = before + (tokenizer.encode(intro) if intro else [])
    planted = tokenizer.encode(plant)
    tail = tokenizer.encode(question) + after + tokenizer.encode(answer)
    fixed = len(head) + len(planted) + len(tail)
    body, at = fill(length - fixed, fixed)
    return head + body[:at] + planted + body[at:] + tail
