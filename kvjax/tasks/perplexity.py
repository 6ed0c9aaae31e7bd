"""`perplexity`: streaming NLL over a text, chunk by chunk through the live cache.

Tokens inside one chunk attend to each other causally and to the cache; the policy places the
chunk (evicting if needed) after it is scored. chunk=1 is exact token-by-token streaming;
larger chunks are faster and let eviction act every `chunk` tokens. A chunk above the
policy's `max_chunk` is clamped to it (recorded as `chunk_used`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache import init_cache
from kvjax.tasks.base import (
    Task,
    TaskContext,
    TaskResult,
    bar,
    check_positive,
    chunked,
    effective_chunk,
    nll_chunk,
    register,
)
from kvjax.tasks.text import encode_prefix


def text_ids(task, ctx: TaskContext) -> list[int]:
    """The first `task.length` ids of the context's text (at least 2 are needed)."""
    ids = encode_prefix(ctx.tokenizer, ctx.text, task.length)
    if len(ids) < 2:
        raise ValueError(f"task {task.name!r}: the text has {len(ids)} token(s); need >= 2")
    return ids


def running_mean(values: np.ndarray, ends: list[int]) -> list[float]:
    c = np.cumsum(values, dtype=np.float64)
    return [float(c[e - 1] / e) for e in ends]


@register
@dataclasses.dataclass(frozen=True)
class Perplexity(Task):
    """Perplexity of the first `length` tokens of the text (default: pydoc_data.topics)."""

    name = "perplexity"
    metric = "perplexity"
    higher_is_better = False
    has_prompt = False
    length: int = 1024
    chunk: int = 128
    text_file: str | None = None

    def seq_len(self) -> int:
        return self.length

    def validate(self) -> None:
        check_positive(self, length=self.length, chunk=self.chunk)
        if self.length < 2:
            raise ValueError(f"task 'perplexity': length={self.length} must be >= 2")

    def run(self, ctx: TaskContext) -> TaskResult:
        ids = text_ids(self, ctx)
        n = len(ids)
        chunk = effective_chunk(self.chunk, ctx.policy, ctx.max_len, n)
        cache = init_cache(ctx.cfg, 1, ctx.policy, ctx.fmt, ctx.max_len, ctx.layout)
        nll = np.zeros(n, np.float32)
        steps = list(chunked(ids, chunk))
        for s, toks, tgts, nv in bar(steps, ctx, f"perplexity ({ctx.policy.name})"):
            out, cache = nll_chunk(ctx.params, toks, tgts, nv, cache, ctx.cfg)
            m = int(nv[0])
            nll[s:s + m] = np.asarray(out[0, :m])
        cache.check_finite()
        nll = nll[: n - 1]  # nll[i] = -log p(ids[i+1] | ids[:i+1]); the last token has no target
        ends = [min(s + chunk, n - 1) for s, *_ in steps if s < n - 1]
        mean = float(nll.mean(dtype=np.float64))
        return TaskResult(
            metrics={"perplexity": float(np.exp(mean)), "nll": mean, "n_tokens": n,
                     "chunk_used": chunk},
            arrays={"nll": nll},
            curves={"step": ends, "running_nll": running_mean(nll, ends)},
            cache=cache,
        )
