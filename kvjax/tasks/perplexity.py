"""`perplexity`: streaming NLL over a text, chunk by chunk through the live cache.

Tokens inside one chunk attend to each other causally and to the cache; the policy places the
chunk (evicting if needed) after it is scored. chunk=1 is exact token-by-token streaming;
larger chunks are faster and let eviction act every `chunk` tokens (`chunk_used` records the
size used: the chunk, or the text's length when that is shorter).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.tasks.base import TaskContext, TaskResult, nll_chunk, register
from kvjax.tasks.streaming import TextTask, running_mean, stream_text


@register
@dataclasses.dataclass(frozen=True)
class Perplexity(TextTask):
    """Perplexity of the first `length` tokens of the text (default: the shipped kvjax/data/python_docs.txt)."""

    name = "perplexity"
    metric = "perplexity"
    higher_is_better = False

    def run(self, ctx: TaskContext) -> TaskResult:
        def step(toks, tgts, nv, cache):
            out, cache = nll_chunk(ctx.params, toks, tgts, nv, cache, ctx.cfg)
            return {"nll": out}, cache

        st = stream_text(self, ctx, step, ("nll",))
        # nll[i] = -log p(ids[i+1] | ids[:i+1]); the last token has no target
        return nll_result(st.values["nll"][: st.n - 1], st.n, st.chunk, st.starts, st.cache)


def nll_result(nll, n: int, chunk: int, starts, cache) -> TaskResult:
    """The perplexity result of per-token NLLs [n - 1] scored in chunks starting at `starts`."""
    ends = [min(s + chunk, n - 1) for s in starts if s < n - 1]
    mean = float(nll.mean(dtype=np.float64))
    return TaskResult(
        metrics={"perplexity": float(np.exp(mean)), "nll": mean, "n_tokens": n,
                 "chunk_used": chunk},
        arrays={"nll": nll},
        curves={"step": ends, "running_nll": running_mean(nll, ends)},
        cache=cache,
    )
