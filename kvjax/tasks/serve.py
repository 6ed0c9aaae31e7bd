"""`serve`: a stream of passkey requests served with continuous batching over one KV pool
(kvjax/serve.py), so a policy and format are measured under load: throughput, time to first
token, per-token latency, pages used and shared, bytes offloaded, and the answers' accuracy.

Workload (seeded): `n_requests` arrivals with exponential gaps (Poisson, `rate` per second
of the measured clock); each a passkey chat prompt of a length drawn from [prompt_min,
prompt_max] with the key at a uniform depth, answered in a length drawn from [new_min,
new_max] greedy tokens (generation runs to that length: a fixed workload across policies);
a `followup` share of sessions ask again ("What was the pass key?") `think_s` seconds
(mean, exponential) after the answer, continuing their cache; a `cancel` share leave after a
random number of tokens. Every prompt starts with the chat template's system part and the
passkey instruction: the static prefix the server prefills once (`prefix_cache`).

Pool: `pool_mib` MiB of keys and values (format metadata included) for every configuration,
so formats and policies are compared at the same memory. Paged: as many pages as fit, `rows`
request rows (+ one prefix row); dense: as many rows of the policy's capacity as fit (the
prefix state takes one). A turn's answer is correct when it contains the key.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache import get_layout
from kvjax.formats import get_format
from kvjax.policies import get_policy
from kvjax.serve import ModelRunner, Server, Turn, percentiles
from kvjax.tasks.base import Task, TaskContext, TaskResult, check_positive, fmt, register
from kvjax.tasks.passkey import ANSWER, INTRO, passkey_prompt
from kvjax.tasks.retrieval import prompt_head, random_key

FOLLOWUP = "What was the pass key? Answer with the number only."
FOLLOWUP_ROOM = 48  # tokens a follow-up turn may take before `resolve` measures it


def followup_turn(tokenizer) -> list[int]:
    """Ids that close the assistant's answer, ask FOLLOWUP in a new user turn and start the
    assistant's answer with "The pass key is" (from the model's chat template)."""
    marks = ("@@KVJAX_A@@", "@@KVJAX_B@@", "@@KVJAX_C@@")
    text = tokenizer.apply_chat_template(
        [{"role": r, "content": m} for r, m in zip(("user", "assistant", "user"), marks)], True)
    between, after = text.split(marks[1])[1].split(marks[2])
    return (tokenizer.encode(between) + tokenizer.encode(FOLLOWUP) + tokenizer.encode(after)
            + tokenizer.encode(ANSWER))


def static_prefix(tokenizer) -> list[int]:
    """What every passkey prompt starts with: the chat template's head and the instruction."""
    return prompt_head(tokenizer, INTRO)


@register
@dataclasses.dataclass(frozen=True)
class Serve(Task):
    """Passkey requests under load (see the module docstring)."""

    name = "serve"
    metric = "accuracy"
    higher_is_better = True
    has_prompt = True
    n_requests: int = 32
    rate: float = 2.0
    prompt_min: int = 128
    prompt_max: int = 160
    new_min: int = 8
    new_max: int = 12
    followup: float = 0.25
    think_s: float = 1.0
    cancel: float = 0.0
    pool_mib: float = 32.0
    rows: int = 16
    prefix_cache: bool = True
    offload_after: float | None = None
    digits: int = 5
    followup_tokens: int | None = None  # set by `resolve`: a follow-up turn's length

    @staticmethod
    def table_rows(m: dict, options: dict) -> list[tuple[str, str, str]]:
        pages = f", {m['pool_pages']} pages" if m.get("pool_pages") is not None else ""
        load = (f"{m.get('generated')} tokens in {fmt(m.get('makespan_s'), '.1f')} s; "
                f"{m.get('turns')} turns, {m.get('cancelled')} cancelled")
        ttft = f"{fmt(m.get('ttft_p50'), '.2f')} / {fmt(m.get('ttft_p95'), '.2f')} s"
        tpot = f"{fmt(m.get('tpot_p50'), '.0f', 1e3)} / {fmt(m.get('tpot_p95'), '.0f', 1e3)} ms"
        pool = (f"{m.get('cache_rows')} rows{pages}; at most {m.get('peak_sessions')} sessions "
                "held at once")
        return [
            ("throughput", f"{fmt(m.get('throughput_tok_s'), '.1f')} tok/s", load),
            ("TTFT p50 / p95", ttft, "arrival to first token (queueing + prefill)"),
            ("TPOT p50 / p95", tpot, "per output token after the first"),
            ("pool", f"{fmt(m.get('pool_bytes'), ',.2f', 2.0**-20)} MiB", pool),
        ]

    def seq_len(self) -> int:
        turn = FOLLOWUP_ROOM if self.followup_tokens is None else self.followup_tokens
        more = turn + self.new_max if self.followup > 0 else 0
        return self.prompt_max + self.new_max + more

    def resolve(self, tokenizer) -> Serve:
        return dataclasses.replace(self, followup_tokens=len(followup_turn(tokenizer)))

    def validate(self) -> None:
        check_positive(self, n_requests=self.n_requests, prompt_min=self.prompt_min,
                       prompt_max=self.prompt_max, new_min=self.new_min, new_max=self.new_max,
                       rows=self.rows, digits=self.digits)
        if self.prompt_min > self.prompt_max or self.new_min > self.new_max:
            raise ValueError(f"task 'serve': need prompt_min <= prompt_max and new_min <= "
                             f"new_max, got {self.prompt_min}..{self.prompt_max}, "
                             f"{self.new_min}..{self.new_max}")
        if self.new_min < self.digits + 2:
            raise ValueError(f"task 'serve': new_min={self.new_min} cannot hold a "
                             f"{self.digits}-digit key; use new_min >= {self.digits + 2}")
        for k in ("followup", "cancel"):
            if not 0 <= getattr(self, k) <= 1:
                raise ValueError(f"task 'serve': {k}={getattr(self, k)!r} must be in [0, 1]")
        for k in ("rate", "think_s", "pool_mib"):
            if not getattr(self, k) > 0:
                raise ValueError(f"task 'serve': {k}={getattr(self, k)!r} must be > 0")
        if self.offload_after is not None and self.offload_after < 0:
            raise ValueError(f"task 'serve': offload_after={self.offload_after!r} must be >= 0 "
                             "seconds (or null: never offload)")

    def check_prompts(self, tokenizer, text: str, seed: int) -> None:
        passkey_prompt(tokenizer, self.prompt_min, 0.5, random_key(seed, self.digits))
        if len(static_prefix(tokenizer)) >= self.prompt_min:
            raise ValueError(f"task 'serve': prompt_min={self.prompt_min} leaves nothing after "
                             "the static prefix; raise it")

    def requests(self, tokenizer, seed: int) -> list[Turn]:
        """The seeded workload: first turns (follow-ups hang off `Turn.then`)."""
        rng = np.random.default_rng(seed)
        n = self.n_requests
        gaps = rng.exponential(1.0 / self.rate, n)
        arrival = np.cumsum(gaps) - gaps[0]
        length = rng.integers(self.prompt_min, self.prompt_max + 1, n)
        depth = rng.uniform(0.0, 1.0, n)
        new = rng.integers(self.new_min, self.new_max + 1, (2, n))
        more = rng.random(n) < self.followup
        think = rng.exponential(self.think_s, n)
        leave = rng.random(n) < self.cancel
        leave_at = rng.integers(1, np.maximum(new[0], 2))
        again = followup_turn(tokenizer)
        out = []
        for i in range(n):
            key = random_key(seed * 100003 + i, self.digits)
            t = Turn(rid=i, arrival=float(arrival[i]), max_new=int(new[0, i]), prefix=0, key=key,
                     tokens=passkey_prompt(tokenizer, int(length[i]), float(depth[i]), key),
                     cancel_at=int(leave_at[i]) if leave[i] else None)
            if more[i]:
                t.then = Turn(rid=n + i, arrival=float(think[i]), tokens=again,
                              max_new=int(new[1, i]), key=key)
            out.append(t)
        return out

    def check_cache(self, ctx: TaskContext) -> None:
        """The pool holds this point's rows and the full-cache baseline's (`pool`)."""
        self.pool(ctx)

    def pool(self, ctx: TaskContext):
        """(layout, rows) of a pool of `pool_mib` MiB of keys and values (and, for a point the
        harness compares with a full-cache dense f32 baseline, a check that the baseline fits
        too, before this point runs)."""
        if not ctx.is_baseline:
            base = dataclasses.replace(ctx, policy=get_policy("full"), fmt=get_format("f32"),
                                       layout=None, is_baseline=True)
            try:
                self.pool(base)
            except ValueError as e:
                raise ValueError(f"{e} (the full-cache dense f32 baseline serves the same "
                                 "requests from the same pool)") from None
        layout = ctx.layout or get_layout("dense")
        budget = int(self.pool_mib * 2**20)
        extra = 1 if self.prefix_cache else 0
        one = layout.abstract(ctx.cfg, 1, ctx.policy, ctx.fmt, ctx.max_len)
        if layout.name == "paged":
            if layout.num_pages is not None:
                raise ValueError("task 'serve' sizes the page pool from pool_mib: leave "
                                 f"cache.num_pages=null (got {layout.num_pages})")
            per = one.pages.page_nbytes()
            n = budget // per
            return dataclasses.replace(layout, num_pages=max(1, n)), self.rows + extra
        per = one.kv_nbytes()
        rows = budget // per
        if rows < 1 + extra:
            raise ValueError(f"task 'serve': pool_mib={self.pool_mib} holds {rows} dense rows "
                             f"of {per / 2**20:.2f} MiB; it needs {1 + extra}: raise pool_mib")
        return layout, rows

    def run(self, ctx: TaskContext) -> TaskResult:
        if ctx.policy.mode != "evict":
            raise ValueError(f"task 'serve' runs policies in mode='evict' (the server decodes "
                             f"as it goes); got {ctx.policy.name!r} mode={ctx.policy.mode!r}")
        reqs = self.requests(ctx.tokenizer, ctx.seed)
        layout, rows = self.pool(ctx)
        offload = self.offload_after
        if offload is not None and layout.name != "paged":
            if not ctx.is_baseline:
                raise ValueError(f"task 'serve': offload_after={offload} moves pages to host "
                                 "memory: it needs cache.layout=paged")
            offload = None  # the full-cache dense baseline serves the same requests unpaged
        cache = layout.init(ctx.cfg, rows, ctx.policy, ctx.fmt, ctx.max_len)
        server = Server(ModelRunner(ctx.params, ctx.cfg), cache,
                        prefixes=[static_prefix(ctx.tokenizer)], prefix_cache=self.prefix_cache,
                        offload_after=offload)
        res = server.run(reqs)
        return summarize(res, ctx.tokenizer, cache_rows=rows,
                         pool_bytes=layout_bytes(res.cache), page_bytes=page_bytes(res.cache))


def layout_bytes(cache) -> int:
    return int(cache.kv_nbytes())


def page_bytes(cache) -> int | None:
    pages = getattr(cache, "pages", None)
    return None if pages is None else int(pages.page_nbytes())


def summarize(res, tokenizer, *, cache_rows: int, pool_bytes: int, page_bytes) -> TaskResult:
    """The task result of a serve run: accuracy over finished turns with a key, latency
    percentiles, throughput and pool figures; one row per turn; the step series as curves."""
    rows, correct = [], []
    for t in res.turns:
        answer = tokenizer.decode(t.out, skip_special_tokens=True)
        ok = None if t.cancelled or t.key is None else str(t.key) in answer
        if ok is not None:
            correct.append(ok)
        rows.append({"rid": t.rid, "session": t.session, "arrival": t.arrival,
                     "prompt_tokens": len(t.tokens), "prefill_tokens": t.prefill_tokens,
                     "new_tokens": len(t.out), "ttft": t.ttft(), "tpot": t.tpot(),
                     "cancelled": t.cancelled, "answer": answer, "correct": ok})
    s = res.stats
    ttft = percentiles([t.ttft() for t in res.turns])
    tpot = percentiles([t.tpot() for t in res.turns])
    metrics = {
        "accuracy": float(np.mean(correct)) if correct else float("nan"),
        "n_correct": int(sum(correct)), "n_scored": len(correct),
        **{f"ttft_{k}": v for k, v in ttft.items()}, **{f"tpot_{k}": v for k, v in tpot.items()},
        "cache_rows": cache_rows, "pool_bytes": pool_bytes, "page_bytes": page_bytes,
        "pool_pages": None if page_bytes is None else pool_bytes // page_bytes,
        **{k: v for k, v in s.items()},
    }
    steps = res.steps
    curves = {"step": list(range(len(steps["t"]))), "clock_s": steps["t"],
              "active": steps["active"], "pages_used": steps["pages_used"],
              "pages_shared": steps["pages_shared"], "host_bytes": steps["host_bytes"]}
    arrays = {f"serve_{k}": np.asarray(v, np.float64) for k, v in curves.items() if k != "step"}
    # no cache: the server's pool is shared by its rows, no one sequence's (its bytes are in
    # the metrics); the record's per-sequence bytes come from the speed probe or a fresh cache
    return TaskResult(metrics=metrics, arrays=arrays, curves=curves, rows=rows)
