"""`perplexity_recompute`: sliding window with re-computation (StreamingLLM's baseline).

Every chunk of `chunk` tokens is scored from a fresh full cache that holds only the `window`
tokens before it: one forward prefills those tokens, a second scores the chunk (the same call as
one forward over window + chunk tokens, without computing logits for the window). A token at
offset j of its chunk therefore sees window + j previous tokens, exactly what it sees in the
chunked streaming runs with a cache of `window` slots; chunk=1 is the paper's exact setting (a
fresh forward over the last `window` tokens for every token). Positions restart at 0 in every
window, so the model never sees a position past window + chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import init_cache
from kvjax.config import ModelConfig
from kvjax.model import forward
from kvjax.policies import get_policy
from kvjax.tasks.base import TaskContext, TaskResult, bar, check_positive, nll_chunk, register
from kvjax.tasks.perplexity import nll_result
from kvjax.tasks.streaming import TextTask, text_ids


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _prefill(params, tokens, n_valid, cache, cfg: ModelConfig):
    """The window's tokens into the fresh cache (one logit row computed, unused)."""
    _, cache = forward(params, tokens, cache, cfg, n_valid, logits_at=jnp.zeros_like(n_valid))
    return cache


@register
@dataclasses.dataclass(frozen=True)
class PerplexityRecompute(TextTask):
    """Perplexity of the first `length` tokens, each chunk re-computed over its last `window`
    tokens (the run's policy is not used: every window gets a fresh full cache)."""

    name = "perplexity_recompute"
    metric = "perplexity"
    higher_is_better = False
    window: int = 1024

    def validate(self) -> None:
        super().validate()
        check_positive(self, window=self.window)

    def run(self, ctx: TaskContext) -> TaskResult:
        ids = np.asarray(text_ids(self, ctx), np.int32)
        n, W = len(ids), self.window
        chunk = min(self.chunk, n)
        full = get_policy("full")
        nll = np.zeros(n - 1, np.float32)  # nll[i] = -log p(ids[i+1] | ids[max(0, i-W-j)..i])
        starts = list(range(0, n - 1, chunk))
        for s in bar(starts, ctx, f"{self.name} (window {W})"):
            cache = init_cache(ctx.cfg, 1, full, ctx.fmt, W + chunk)
            lo = max(0, s - W)
            if s > lo:
                window = np.zeros((1, W), np.int32)  # [1, W] right-padded
                window[0, :s - lo] = ids[lo:s]
                cache = _prefill(ctx.params, jnp.asarray(window), jnp.asarray([s - lo], jnp.int32),
                                 cache, ctx.cfg)
            m = min(chunk, n - 1 - s)  # scored tokens (each with a target)
            toks = np.zeros((1, chunk), np.int32)  # [1, chunk]
            tgts = np.zeros((1, chunk), np.int32)
            toks[0, :m], tgts[0, :m] = ids[s:s + m], ids[s + 1:s + m + 1]
            out, cache = nll_chunk(ctx.params, jnp.asarray(toks), jnp.asarray(tgts),
                                   jnp.asarray([m], jnp.int32), cache, ctx.cfg)
            nll[s:s + m] = np.asarray(out[0, :m])
        cache.check_finite()
        return nll_result(nll, n, chunk, starts, cache)
