"""The task protocol, the context a task runs in, and the jitted steps the tasks share.

A task is a frozen dataclass of its settings with `seq_len()` (the longest sequence it feeds,
known before the model loads), `validate()` and `run(ctx) -> TaskResult`. Every task runs the
model through `forward`, so the cache policy and storage format are live throughout.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from kvjax.cache import KVCache
from kvjax.config import ModelConfig
from kvjax.generate import generate, generate_many
from kvjax.model import forward, kl_divergence, log_probs, token_nll
from kvjax.programs import stored_jit

TASKS: dict[str, type[Task]] = {}


def register(cls):
    """Class decorator: makes a task selectable by its `name`."""
    TASKS[cls.name] = cls
    return cls


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """Everything a task run needs: the model, the cache policy and format, the text."""

    params: Any
    cfg: ModelConfig
    tokenizer: Any
    policy: Any
    fmt: Any
    max_len: int
    text: str
    seed: int = 0
    is_baseline: bool = False
    progress: bool | None = None  # None: a bar only when attached to a terminal
    layout: Any = None  # the cache layout (kvjax.cache.get_layout); None: dense


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """metrics: scalars (the task's `metric` among them); arrays: per-token numpy arrays saved
    as <name>.npy; curves: per-step series ({"step": [...], name: [...]}); rows: per-sample or
    per-cell table rows; cache: the final cache of the task's sequences, batch B (for byte
    accounting, per sequence), or None where it has none (serve's pool is shared by its rows)."""

    metrics: dict
    arrays: dict = dataclasses.field(default_factory=dict)
    curves: dict = dataclasses.field(default_factory=dict)
    rows: list = dataclasses.field(default_factory=list)
    cache: Any = None


@dataclasses.dataclass(frozen=True)
class Task:
    """Base task. `has_prompt`: it prefills a prompt and then decodes; `modes`: the policy modes
    it runs (compress, a selection once after a prompt, as prefill-only policies such as
    SnapKV need); `metric`: the quality number, `higher_is_better` its direction."""

    name: ClassVar[str] = "base"
    metric: ClassVar[str] = "value"
    higher_is_better: ClassVar[bool] = False
    has_prompt: ClassVar[bool] = False
    modes: ClassVar[tuple[str, ...]] = ("evict",)

    def seq_len(self) -> int:
        raise NotImplementedError

    def ratio_length(self) -> int | None:
        """The one prompt (or text) length a `ratio=` turns into an evict-mode budget; None
        when the task has several."""
        return None

    def validate(self) -> None:
        """Raise a clear error for settings that cannot work (before the model loads)."""

    def resolve(self, tokenizer) -> Task:
        """The task with settings that depend on the tokenizer filled in (e.g. a file's longest
        prompt), before `seq_len` is asked; run before the model loads."""
        return self

    def identity(self) -> dict:
        """Fields the point key must see by content, replacing their values (a data file by
        its bytes' sha256, never its path)."""
        return {}

    def check_prompts(self, tokenizer, text: str, seed: int) -> None:
        """Raise ValueError when the settings cannot make the task's prompts (those `run` will
        build for `seed`) with this tokenizer, e.g. a length below the prompt's fixed parts;
        run before the model loads."""

    def check_cache(self, ctx: TaskContext) -> None:
        """Raise ValueError when the task cannot hold its caches as configured (e.g. a memory
        pool too small for one row); run before the model loads, so `ctx.params` is None."""

    @staticmethod
    def table_rows(metrics: dict, options: dict) -> list[tuple[str, str, str]]:
        """(label, value, note) rows that `python run.py`'s table prints under the task's metric:
        the task's other headline numbers, from its record's metrics and task options."""
        return []

    def run(self, ctx: TaskContext) -> TaskResult:
        raise NotImplementedError

    def run_many(self, ctx: TaskContext, policies) -> list[TaskResult]:
        """One result per policy (the context's policy replaced). Prompt tasks override it to
        read each prompt once for every compress-mode policy (`generate_many`)."""
        return [self.run(dataclasses.replace(ctx, policy=p)) for p in policies]


def fmt(x, spec: str, scale: float = 1.0) -> str:
    """A table value: x * scale formatted, or "n/a" when missing or NaN."""
    return "n/a" if x is None or math.isnan(x) else format(x * scale, spec)


def check_positive(task: Task, **values) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"task {task.name!r}: {k}={v!r} must be a positive integer")


def check_query_aware(task: Task) -> None:
    """`query_aware` must be a bool: the question inside the prompt, or fed after a
    compress-mode selection (retrieval tasks and qa share the option)."""
    if type(task.query_aware) is not bool:
        raise ValueError(f"task {task.name!r}: query_aware={task.query_aware!r} must be true "
                         "(the question inside the prompt) or false (fed after the selection)")


def check_chunk(task: Task, chunk) -> None:
    """A prefill chunk: a positive token count, or None for the whole prompt at once."""
    if chunk is not None:
        check_positive(task, chunk=chunk)


def check_depths(task: Task, depths: Sequence[float]) -> None:
    bad = [d for d in depths if not 0.0 <= float(d) <= 1.0]
    if bad or not depths:
        raise ValueError(
            f"task {task.name!r}: depths {list(depths)} must be a non-empty list of "
            "fractions in [0, 1] (0 = start of the context, 1 = end)"
        )


INTERRUPTED = threading.Event()
_stopped_by = signal.SIGINT


def on_sigint(signum, frame):
    """SIGINT handler (the harness installs it for a point; run.py installs it for SIGTERM,
    so a scheduler's stop ends a run as Ctrl-C does): remembered, then raised as
    KeyboardInterrupt. Remembered because Python raises it at whatever bytecode runs next,
    which can be a finalizer or a weakref callback that only prints it ("Exception ignored in
    ...") and goes on; `bar` then raises it again at the task's next step."""
    global _stopped_by
    _stopped_by = signum
    INTERRUPTED.set()
    raise KeyboardInterrupt


def stopped_by() -> int:
    """The signal of the last interrupt `on_sigint` raised (SIGINT when none did)."""
    return _stopped_by if INTERRUPTED.is_set() else signal.SIGINT


def interrupted_message(what: str) -> tuple[str, int]:
    """The one line and the exit status of a run stopped by a signal (`stopped_by`)."""
    sig = stopped_by()
    head = "interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}"
    return f"{head}: {what}", 128 + int(sig)


def quiet_unraisable(hook):
    """An unraisable hook that drops a KeyboardInterrupt `on_sigint` raised inside a finalizer
    or gc callback (already remembered, so `bar` raises it again) and passes the rest to hook:
    a Ctrl-C then prints its one line, not an "Exception ignored" traceback."""

    def quiet(unraisable):
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and INTERRUPTED.is_set()):
            hook(unraisable)

    return quiet


class Progress(tqdm):
    """tqdm that stops with KeyboardInterrupt at the next item once a SIGINT came (`on_sigint`)."""

    def __iter__(self):
        for item in super().__iter__():
            if INTERRUPTED.is_set():
                raise KeyboardInterrupt
            yield item


def bar(iterable, ctx: TaskContext, desc: str, total: int | None = None) -> Progress:
    """Progress over `iterable`, quiet unless attached to a terminal (or forced by ctx.progress)."""
    disable = None if ctx.progress is None else not ctx.progress
    return Progress(iterable, desc=desc, total=total, disable=disable, leave=False,
                    dynamic_ncols=True)


@stored_jit(static_argnames=("cfg",), donate_argnames=("cache",))
def nll_chunk(params, tokens, targets, n_valid, cache: KVCache, cfg: ModelConfig):
    """Forward one chunk; nll [B, T] of each target (the next token) and the new cache."""
    logits, cache = forward(params, tokens, cache, cfg, n_valid)
    return token_nll(logits, targets), cache


@stored_jit(static_argnames=("cfg",), donate_argnames=("cache", "ref_cache"))
def agreement_chunk(params, tokens, targets, n_valid, cache, ref_cache, cfg: ModelConfig):
    """One chunk through the run's cache and a full f32 reference cache side by side.

    Returns KL(p_ref || p) [B, T], top-1 agreement [B, T], nll and reference nll [B, T], and
    both new caches."""
    logits, cache = forward(params, tokens, cache, cfg, n_valid)
    ref_logits, ref_cache = forward(params, tokens, ref_cache, cfg, n_valid)
    lp, lr = log_probs(logits), log_probs(ref_logits)
    kl = jnp.maximum(kl_divergence(lr, lp), 0.0)  # >= 0 up to rounding
    top1 = jnp.argmax(logits, axis=-1) == jnp.argmax(ref_logits, axis=-1)
    take = lambda a: -jnp.take_along_axis(a, targets[..., None], axis=-1)[..., 0]
    return kl, top1, take(lp), take(lr), cache, ref_cache


def chunked(ids: Sequence[int], chunk: int):
    """(start, tokens [1, chunk], targets [1, chunk], n_valid [1]) over ids, zero-padded.

    targets[t] = ids[start + t + 1] (0 past the end: those positions have no target)."""
    n = len(ids)
    n_chunks = math.ceil(n / chunk)
    padded = np.zeros(n_chunks * chunk + 1, np.int32)
    padded[:n] = ids
    for s in range(0, n, chunk):
        yield (
            s,
            jnp.asarray(padded[None, s:s + chunk]),
            jnp.asarray(padded[None, s + 1:s + chunk + 1]),
            jnp.asarray([min(chunk, n - s)], jnp.int32),
        )


def greedy_generate(ctx: TaskContext, prompts: Sequence[Sequence[int]], new_tokens: int,
                    chunk: int | None, policies=None, suffixes=None):
    """Greedy answers under each policy (default: the context's), format and layout:
    [(tokens [B, new_tokens] numpy, final cache)], one per policy. Several policies share one
    prefill (`kvjax.generate.generate_many`); one runs `kvjax.generate.generate`. suffixes:
    tokens per row fed after the prompt is read and selected (`kvjax.generate.feed`)."""
    if policies is None or len(policies) == 1:
        policy = ctx.policy if policies is None else policies[0]
        return [generate(ctx.params, ctx.cfg, prompts, new_tokens, policy, ctx.fmt,
                         max_len=ctx.max_len, chunk=chunk, layout=ctx.layout,
                         suffixes=suffixes)]
    return generate_many(ctx.params, ctx.cfg, prompts, new_tokens, policies, ctx.fmt,
                         max_len=ctx.max_len, chunk=chunk, layout=ctx.layout, suffixes=suffixes)


def batched_generate(ctx: TaskContext, prompts: Sequence[Sequence[int]], new_tokens: int,
                     chunk: int | None, batch: int, policies=None, suffixes=None,
                     desc: str | None = None):
    """`greedy_generate` over `prompts` `batch` rows at a time (a batch's rows of different
    lengths are right-padded; no row sees another, so each row's answer is the one it gets
    alone): [(tokens [N, new_tokens] numpy, the last batch's cache)], one per policy. A
    progress bar over the batches when `desc` is given."""
    n_policies = 1 if policies is None else len(policies)
    tokens, caches = [[] for _ in range(n_policies)], [None] * n_policies
    starts = range(0, len(prompts), batch)
    for b in starts if desc is None else bar(starts, ctx, desc):
        rows = slice(b, b + batch)
        # the last batch's caches go before this batch's are built (one per policy each)
        caches, outs = [None] * n_policies, None
        outs = greedy_generate(ctx, prompts[rows], new_tokens, chunk, policies,
                               None if suffixes is None else suffixes[rows])
        for p, (out, caches[p]) in enumerate(outs):
            tokens[p].append(out)
    return [(np.concatenate(t), c) for t, c in zip(tokens, caches)]


def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """Ids before and after a user message's content in the model's chat template (with the
    assistant's generation prompt), so prompts can be assembled with exact token counts."""
    marker = "@@KVJAX_CONTENT@@"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], True)
    before, after = text.split(marker)
    return tokenizer.encode(before), tokenizer.encode(after)


def contains_answer(answer: str, key: int) -> bool:
    return str(key) in answer
