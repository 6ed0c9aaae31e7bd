"""`agreement`: KL divergence and top-1 agreement of next-token distributions vs the full cache.

The full f32 cache runs beside the run's cache over the same chunks (a distribution per token
is V floats, too big to store, so the reference is recomputed in lockstep). KL is
KL(p_full || p_run) in nats, averaged over the scored positions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache import KVCache
from kvjax.policies import get_policy
from kvjax.tasks.base import TaskContext, TaskResult, agreement_chunk, fmt, nll_chunk, register
from kvjax.tasks.streaming import TextTask, running_mean, stream_text


@register
@dataclasses.dataclass(frozen=True)
class Agreement(TextTask):
    """Agreement with the full cache over the first `length` tokens of the text."""

    name = "agreement"
    metric = "kl"
    higher_is_better = False
    length: int = 512

    @staticmethod
    def table_rows(m: dict, options: dict) -> list[tuple[str, str, str]]:
        return [
            ("top-1 agreement", fmt(m.get("top1"), ".4f"),
             "share of positions whose most likely token is the full cache's"),
            ("perplexity", fmt(m.get("perplexity"), ".4f"),
             f"full cache {fmt(m.get('perplexity_full'), '.4f')} on the same tokens"),
        ]

    def run(self, ctx: TaskContext) -> TaskResult:
        ref = None
        if not ctx.is_baseline:
            ref = KVCache.init(ctx.cfg, 1, get_policy("full"), _f32(), ctx.max_len)

        def step(toks, tgts, nv, cache):
            nonlocal ref
            if ref is None:  # the run is the full cache: it agrees with itself
                out, cache = nll_chunk(ctx.params, toks, tgts, nv, cache, ctx.cfg)
                return {"nll": out, "ref_nll": out, "top1": np.ones(out.shape, np.float32)}, cache
            k, t1, o, r, cache, ref = agreement_chunk(ctx.params, toks, tgts, nv, cache, ref,
                                                      ctx.cfg)
            return {"kl": k, "top1": t1, "nll": o, "ref_nll": r}, cache

        st = stream_text(self, ctx, step, ("kl", "top1", "nll", "ref_nll"))
        n, chunk = st.n, st.chunk
        kl, top1, nll, ref_nll = (st.values[k] for k in ("kl", "top1", "nll", "ref_nll"))
        # scored positions: all n (KL/top-1 need no target); nll: the n - 1 with a target
        nll, ref_nll = nll[: n - 1], ref_nll[: n - 1]
        ends = [min(s + chunk, n) for s in st.starts]
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
            cache=st.cache,
        )


def _f32():
    from kvjax.formats import get_format

    return get_format("f32")
