"""`agreement`: KL divergence and top-1 agreement of next-token distributions vs the full cache.

The full f32 cache runs beside the run's cache over the same chunks (a distribution per token
is V floats, too big to store, so the reference is recomputed in lockstep). KL is
KL(p_full || p_run) in nats, averaged over the scored positions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache import KVCache, init_cache
from kvjax.policies import get_policy
from kvjax.tasks.base import (
    Task,
    TaskContext,
    TaskResult,
    agreement_chunk,
    bar,
    check_positive,
    chunked,
    effective_chunk,
    nll_chunk,
    register,
)
from kvjax.tasks.perplexity import running_mean, text_ids


@register
@dataclasses.dataclass(frozen=True)
class Agreement(Task):
    """Agreement with the full cache over the first `length` tokens of the text."""

    name = "agreement"
    metric = "kl"
    higher_is_better = False
    has_prompt = False
    length: int = 512
    chunk: int = 128
    text_file: str | None = None

    def seq_len(self) -> int:
        return self.length

    def validate(self) -> None:
        check_positive(self, length=self.length, chunk=self.chunk)
        if self.length < 2:
            raise ValueError(f"task 'agreement': length={self.length} must be >= 2")

    def run(self, ctx: TaskContext) -> TaskResult:
        ids = text_ids(self, ctx)
        n = len(ids)
        chunk = effective_chunk(self.chunk, ctx.policy, ctx.max_len, n)
        cache = init_cache(ctx.cfg, 1, ctx.policy, ctx.fmt, ctx.max_len, ctx.layout)
        ref = None
        if not ctx.is_baseline:
            ref = KVCache.init(ctx.cfg, 1, get_policy("full"), _f32(), ctx.max_len)
        kl, top1, nll, ref_nll = (np.zeros(n, np.float32) for _ in range(4))
        steps = list(chunked(ids, chunk))
        for s, toks, tgts, nv in bar(steps, ctx, f"agreement ({ctx.policy.name})"):
            m = int(nv[0])
            if ref is None:
                out, cache = nll_chunk(ctx.params, toks, tgts, nv, cache, ctx.cfg)
                nll[s:s + m] = ref_nll[s:s + m] = np.asarray(out[0, :m])
                top1[s:s + m] = 1.0
            else:
                k, t1, o, r, cache, ref = agreement_chunk(ctx.params, toks, tgts, nv, cache, ref,
                                                          ctx.cfg)
                kl[s:s + m] = np.asarray(k[0, :m])
                top1[s:s + m] = np.asarray(t1[0, :m])
                nll[s:s + m], ref_nll[s:s + m] = np.asarray(o[0, :m]), np.asarray(r[0, :m])
        cache.check_finite()
        # scored positions: all n (KL/top-1 need no target); nll: the n - 1 with a target
        nll, ref_nll = nll[: n - 1], ref_nll[: n - 1]
        ends = [min(s + chunk, n) for s, *_ in steps]
        return TaskResult(
            metrics={
                "kl": float(kl.mean(dtype=np.float64)), "top1": float(top1.mean()),
                "perplexity": float(np.exp(nll.mean(dtype=np.float64))),
                "perplexity_full": float(np.exp(ref_nll.mean(dtype=np.float64))),
                "n_tokens": n, "chunk_used": chunk,
            },
            arrays={"kl": kl, "top1": top1.astype(np.float32), "nll": nll},
            curves={"step": ends, "running_kl": running_mean(kl, ends),
                    "running_top1": running_mean(top1, ends)},
            cache=cache,
        )


def _f32():
    from kvjax.formats import get_format

    return get_format("f32")
