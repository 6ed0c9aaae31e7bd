"""What the text-streaming tasks (`perplexity`, `agreement`) share: their settings, and the loop
that feeds the first `length` tokens of the text through a fresh cache chunk by chunk."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.cache import init_cache
from kvjax.tasks.base import Task, TaskContext, bar, check_positive, chunked
from kvjax.tasks.text import encode_prefix

ALL = "all"  # task.length=all: the whole text (resolved to its token count before the model loads)


@dataclasses.dataclass(frozen=True)
class TextTask(Task):
    """A task over the first `length` tokens of the text (or all of it: `length="all"`,
    resolved to a count by `kvjax.experiment.plan`), fed in chunks of `chunk` tokens."""

    has_prompt = False
    length: int | str = 1024
    chunk: int = 128
    text_file: str | None = None

    def seq_len(self) -> int:
        if self.length == ALL:
            raise ValueError(f"task {self.name!r}: length='all' is resolved against the text first")
        return self.length

    def ratio_length(self) -> int:
        return self.length

    def validate(self) -> None:
        if self.length == ALL:
            check_positive(self, chunk=self.chunk)
            return
        if isinstance(self.length, str):
            raise ValueError(  # noqa: TRY004  (task settings errors are ValueErrors)
                f"task {self.name!r}: length={self.length!r} must be a positive integer or "
                f"{ALL!r} (the whole text)")
        check_positive(self, length=self.length, chunk=self.chunk)
        if self.length < 2:
            raise ValueError(f"task {self.name!r}: length={self.length} must be >= 2")


def text_ids(task, ctx: TaskContext) -> list[int]:
    """The first `task.length` ids of the context's text (at least 2 are needed)."""
    ids = encode_prefix(ctx.tokenizer, ctx.text, task.length)
    if len(ids) < 2:
        raise ValueError(f"task {task.name!r}: the text has {len(ids)} token(s); need >= 2")
    return ids


def running_mean(values: np.ndarray, ends: list[int]) -> list[float]:
    c = np.cumsum(values, dtype=np.float64)
    return [float(c[e - 1] / e) for e in ends]


@dataclasses.dataclass(frozen=True)
class Streamed:
    """What `stream_text` returns: n tokens streamed in chunks of `chunk` (the size used),
    starting at `starts`; `values` maps each name to a float32 [n] array (0 where the step gave
    nothing); `cache` is the final cache (already checked finite)."""

    n: int
    chunk: int
    starts: list[int]
    values: dict[str, np.ndarray]
    cache: object


def stream_text(task: TextTask, ctx: TaskContext, step: Callable, names: Sequence[str]) -> Streamed:
    """Feed the first `task.length` ids of the text through a fresh cache, chunk by chunk.

    step(tokens, targets, n_valid, cache) -> ({name: per-position values [1, chunk]}, new cache)
    (see `chunked` for its inputs); the first n_valid values of each name land in
    values[name] at the chunk's positions."""
    ids = text_ids(task, ctx)
    n = len(ids)
    chunk = min(task.chunk, n)
    cache = init_cache(ctx.cfg, 1, ctx.policy, ctx.fmt, ctx.max_len, ctx.layout)
    values = {name: np.zeros(n, np.float32) for name in names}
    steps = list(chunked(ids, chunk))
    for s, toks, tgts, nv in bar(steps, ctx, f"{task.name} ({ctx.policy.name})"):
        out, cache = step(toks, tgts, nv, cache)
        m = int(nv[0])
        for name, v in out.items():
            values[name][s:s + m] = np.asarray(v[0, :m])
    cache.check_finite()
    return Streamed(n=n, chunk=chunk, starts=[s for s, *_ in steps], values=values, cache=cache)
