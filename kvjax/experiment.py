"""One experiment point: (model, policy, kv format, budget, task) -> one record.

`plan(spec)` checks everything that can be checked before the model loads (names, options,
budgets, policy/task combinations) and derives the point's key; `execute(plan, run_dir)` loads
the model, runs the task through the live cache, compares it with the full-cache baseline
(computed once per model/task/text and cached on disk), measures prefill and decode speed and
the cache's bytes, writes `metrics.json` and per-token arrays into the run directory, appends
the record to the results store and logs it to W&B. No Hydra here: `run.py` builds a
`RunSpec` from its config, and tests build one directly.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import wandb_worker
from kvjax.cache import HeadPool, closed_form_bytes, get_layout
from kvjax.generate import compile_start, decode, start
from kvjax.mesh import MeshSpec, cache_specs, shard_params
from kvjax.policies import POLICIES, get_policy
from kvjax.programs import clear_loaded, package_roots, source_sha256
from kvjax.programs import stats as program_stats
from kvjax.results import (
    SCHEMA,
    WANDB_MODES,
    ResultsStore,
    atomic_write_text,
    canonical_json,
    config_hash,
    to_jsonable,
)
from kvjax.tasks import TASKS, Task, TaskContext, TaskResult
from kvjax.tasks.base import fmt
from kvjax.tasks.streaming import ALL, TextTask
from kvjax.tasks.text import (
    DEFAULT_SOURCE,
    CharTokenizer,
    encode_prefix,
    load_text,
    sha256_text,
)

TINY = "tiny"
BASELINE_POLICY, BASELINE_FORMAT = "full", "f32"
NOMINAL_BITS = {"f32": 32, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}


class ConfigError(ValueError):
    """A setting or combination of settings that cannot run (raised before the model loads)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered model name, a .gguf path or a HF directory; "tiny" builds a random-init
    `kvjax.config.tiny_config(**overrides)` with PRNG seed `init_seed`."""

    name: str = "smollm2-135m"
    init_seed: int = 0
    overrides: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class SpeedSpec:
    """The speed probe: prefill `prompt` tokens, then decode `new_tokens` (0 disables it)."""

    prompt: int = 256
    new_tokens: int = 16


@dataclasses.dataclass(frozen=True)
class WandbSpec:
    mode: str = "offline"
    project: str = "kvjax"
    entity: str | None = None


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything one run needs, as frozen values (built from the Hydra config by run.py)."""

    task: Task
    model: ModelSpec = ModelSpec()
    policy: str = "full"
    policy_options: tuple[tuple[str, Any], ...] = ()
    kv_dtype: str = "f32"
    kv_options: tuple[tuple[str, Any], ...] = ()
    budget: int | None = None
    ratio: float | None = None  # instead of budget: fraction of the prompt removed
    seed: int = 0
    max_len: int | None = None
    sweep: str | None = None
    speed: SpeedSpec = SpeedSpec()
    cache: tuple[tuple[str, Any], ...] = (("layout", "dense"),)  # kvjax.cache.get_layout options
    # devices: batch over data, kv heads over model (kvjax.mesh)
    mesh: MeshSpec = dataclasses.field(default_factory=MeshSpec)
    results: str = "results/results.jsonl"
    baselines: str | None = None
    wandb: WandbSpec = WandbSpec()
    force: bool = False
    progress: bool | None = None
    allow_dirty: bool = True  # False: refuse to run from a checkout with uncommitted code
    beyond_context: bool = False  # True: allow tasks longer than the model's context (StreamingLLM)
    config: dict | None = dataclasses.field(default=None, compare=False, hash=False)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked spec: the policy and format objects, the cache length, the point and its key,
    and the task's text (read and decoded before the model loads)."""

    spec: RunSpec
    policy: Any
    fmt: Any
    max_len: int
    layout: Any
    point: dict
    key: str
    text: str = dataclasses.field(repr=False)
    text_source: str = ""
    notes: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- planning


def _check_model_name(model: ModelSpec) -> None:
    from kvjax.loading import registered_names, resolve

    if model.name == TINY or resolve(model.name) is not None or Path(model.name).expanduser().exists():
        return
    raise ConfigError(
        f"unknown model {model.name!r}; registered models: {', '.join(registered_names())}, "
        f"or {TINY!r} (random init), or a path to a .gguf file or a HF checkpoint directory"
    )


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    from kvjax.loading.hub import sha256_file

    return sha256_file(Path(path))


def _content_sha256(files: list[Path], root: Path) -> str:
    """sha256 over (name relative to root, sha256 of content) of each file, in name order."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
        st = f.stat()
        h.update(f"{f.relative_to(root).as_posix()}\0{_file_sha256(str(f), st.st_size, st.st_mtime_ns)}\n".encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def model_identity(model: ModelSpec) -> dict:
    """What the model is, by content (never by path): a registered model's pinned sha256, a
    .gguf file's sha256 (weights and tokenizer are both in it), a HF directory's files; the
    tiny model is its seed and overrides. Registered models are fetched (and verified) here."""
    if model.name == TINY:
        return {"name": TINY, "init_seed": model.init_seed, "overrides": dict(model.overrides),
                "tokenizer": "char"}
    from kvjax.loading import MODELS, locate
    from kvjax.loading.hub import FetchError, file_sha256

    try:
        kind, path = locate(model.name)
    except (FileNotFoundError, ValueError, FetchError) as e:
        raise ConfigError(f"model.name={model.name!r}: {e}") from None
    if kind == "hf":
        files = [f for f in path.iterdir() if f.is_file() and not f.name.startswith(".")]
        return {"name": f"hf:{_content_sha256(files, path)[:12]}", "format": "hf",
                "sha256": _content_sha256(files, path), "tokenizer": "tokenizer.json in the dir"}
    sha = file_sha256(path)  # a verified registered model's recorded sha256 (no rehash)
    name = next((m.name for m in MODELS.values() if m.sha256 == sha), f"gguf:{sha[:12]}")
    return {"name": name, "format": "gguf", "sha256": sha, "tokenizer": "gguf (in the file)"}


@functools.lru_cache(maxsize=4)
def model_config(model: ModelSpec):
    """The model's ModelConfig from its header (no weights are read)."""
    from kvjax.config import tiny_config
    from kvjax.loading import load_config

    try:
        return tiny_config(**dict(model.overrides)) if model.name == TINY else load_config(model.name)
    except TypeError as e:
        raise ConfigError(f"model.overrides: {e}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.name={model.name!r}: cannot read its header: {e}") from None


@functools.lru_cache(maxsize=1)
def code_identity() -> dict:
    """The code a point ran: kvjax's version and a hash of its sources (the code imported at
    start, uncommitted edits included; a docs-only commit leaves it unchanged), and the JAX
    that compiled it with the backend it ran on: another JAX moves the numbers (the main job's
    perplexity is 13.0410 under jax 0.10.2 and 13.0512 under 0.12.0.1, on one machine)."""
    import jaxlib

    dev = jax.devices()[0]
    return {"version": _version("kvjax"), "source_sha256": source_sha256(package_roots())[:16],
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": dev.platform,
            "device": dev.device_kind}


def resolve_text_task(task: Task, tokenizer, text: str, source: str) -> tuple[Task, int | None]:
    """(the task with `length=all` resolved, tokens it scores) for text tasks; a text too short
    for `task.length`, or empty, is a ConfigError (never a silently shorter run)."""
    if not isinstance(task, TextTask):
        return task, None
    whole = task.length == ALL
    ids = tokenizer.encode(text) if whole else encode_prefix(tokenizer, text, task.length)
    n = len(ids)
    where = "the default text" if source == DEFAULT_SOURCE else f"task.text_file={source!r}"
    if n < 2:
        raise ConfigError(
            f"{where} has {n} token(s) ({len(text)} characters); task {task.name!r} needs at "
            "least 2: pass a longer UTF-8 text"
        )
    if whole:
        return dataclasses.replace(task, length=n), n
    if n < task.length:
        raise ConfigError(
            f"task.length={task.length} but {where} has only {n} tokens; use task.length<={n}, "
            "or task.length=all to score the whole text"
        )
    return task, n


def build_format(name: str, options: dict):
    from kvjax.formats import FORMATS, get_format

    if name not in FORMATS:
        raise ConfigError(f"unknown kv_dtype {name!r}; valid choices: {', '.join(sorted(FORMATS))}")
    try:
        return get_format(name, **options)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_policy(spec: RunSpec) -> tuple[Any, tuple[str, ...]]:
    """The policy with the run's budget or ratio (full ignores both: it keeps every token).

    `ratio` removes that fraction of the prompt: in compress mode the policy applies it to
    each prompt (kept = int(n · (1 - ratio)), kvpress's compression_ratio); in evict mode it
    becomes the budget int(L · (1 - ratio)) for the task's one prompt length L."""
    if spec.policy not in POLICIES:
        raise ConfigError(
            f"unknown policy {spec.policy!r}; valid choices: {', '.join(sorted(POLICIES))}"
        )
    options, notes = dict(spec.policy_options), []
    if spec.ratio is not None and (isinstance(spec.ratio, bool) or not isinstance(
            spec.ratio, (int, float)) or not 0 <= spec.ratio < 1):
        raise ConfigError(f"ratio={spec.ratio!r} must be in [0, 1) (the fraction of the "
                          "prompt removed)")
    if spec.policy == BASELINE_POLICY:
        # it ignores a budget, not a malformed one (the other policies check theirs)
        if spec.budget is not None and (isinstance(spec.budget, bool) or not isinstance(
                spec.budget, int) or spec.budget <= 0):
            raise ConfigError(f"budget={spec.budget!r} must be a positive integer (slots per "
                              "layer and kv head)")
        for key in ("budget", "ratio"):
            if getattr(spec, key) is not None:
                notes.append(f"policy 'full' keeps every token: {key}={getattr(spec, key)} is "
                             "ignored")
        for key in ("budget", "ratio", "mode"):
            options.pop(key, None)
    elif spec.ratio is not None:
        if spec.budget is not None:
            raise ConfigError(f"give budget= or ratio=, not both (got budget={spec.budget}, "
                              f"ratio={spec.ratio})")
        if options.get("mode", "evict") == "compress" or POLICIES[spec.policy].modes == (
                "compress",):
            options["ratio"], options["budget"] = spec.ratio, None
        else:
            n = spec.task.ratio_length()
            if n is None:
                raise ConfigError(
                    f"ratio={spec.ratio} with mode=evict needs one prompt length, and task "
                    f"{spec.task.name!r} has several; give budget=, or policy.mode=compress")
            options["budget"] = max(1, int(n * (1.0 - spec.ratio)))
            notes.append(f"ratio={spec.ratio} of {n} tokens: budget={options['budget']}")
    elif spec.budget is not None:
        options["budget"] = spec.budget
    try:
        return get_policy(spec.policy, **options), tuple(notes)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def plan(spec: RunSpec) -> Plan:
    """Check the spec before any model work (the model's header and tokenizer are read, its
    weights are not); raise ConfigError naming the bad value."""
    _check_model_name(spec.model)
    try:
        spec.mesh.check_devices()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if spec.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"wandb.mode={spec.wandb.mode!r}; valid choices: {', '.join(WANDB_MODES)}")
    fmt = build_format(spec.kv_dtype, dict(spec.kv_options))
    try:
        spec.task.validate()
        text, source = load_text(getattr(spec.task, "text_file", None))
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    identity = model_identity(spec.model)
    cfg = model_config(spec.model)
    tokenizer = load_tokenizer(spec.model)
    task, n_tokens = resolve_text_task(spec.task, tokenizer, text, source)
    try:
        task = task.resolve(tokenizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    spec = dataclasses.replace(spec, task=task)
    policy, notes = build_policy(spec)
    need = task.seq_len()
    if spec.max_len is not None and spec.max_len < need:
        raise ConfigError(
            f"max_len={spec.max_len} is shorter than task {task.name!r} needs ({need} tokens); "
            f"use max_len >= {need} or max_len=null"
        )
    max_len = spec.max_len or need
    if max_len > cfg.max_seq_len and spec.model.name != TINY and not spec.beyond_context:
        raise ConfigError(
            f"task {task.name!r} needs {max_len} tokens, above the model's context length "
            f"{cfg.max_seq_len}; shorten the task (or beyond_context=True to measure past it)"
        )
    if policy.mode == "compress" and "compress" not in task.modes:  # (a bad mode: the policy's)
        ok = sorted(n for n, c in _task_classes().items() if "compress" in c.modes)
        why = ("has no prompt" if not task.has_prompt else
               "runs its policy in mode=evict only (no selection after its prompts)")
        raise ConfigError(
            f"policy {policy.name!r} runs mode=compress (it selects its cache once after a "
            f"prompt), and task {task.name!r} {why}; use a task that compresses a prompt "
            f"({', '.join(ok)}) or a policy in mode=evict"
        )
    b = policy.budget
    # equal to the length, a budget shared by every layer holds every token too (per-layer
    # budgets, e.g. pyramid's, still evict in the layers given less)
    if (policy.name != BASELINE_POLICY and policy.ratio is None and b is not None
            and (b > need or b == need and len(policy.layer_groups(cfg.n_layers, need)) == 1)):
        raise ConfigError(
            f"budget={b} {'equals' if b == need else 'is above'} the length of task "
            f"{task.name!r} ({need} tokens): policy {policy.name!r} would never evict anything; "
            f"use budget < {need} (or policy=full for the uncompressed cache)"
        )
    chunk = getattr(task, "chunk", None)
    if (policy.name != BASELINE_POLICY and policy.mode == "evict" and b is not None and chunk
            and chunk >= b):
        notes = (*notes, (
            f"task.chunk={chunk} >= budget={b}: eviction acts between chunks, and a chunk's "
            f"tokens also attend to the chunk's earlier tokens, so a token sees up to "
            f"{b + chunk - 1} (budget + chunk - 1) and the budget barely binds; task.chunk=1 "
            "evicts token by token"))
    try:
        layout = build_layout(spec.cache, spec.mesh)
        layout.validate(policy, fmt, max_len)
        layout.check_pool(policy, max_len)
        notes = (*notes, *layout.notes(policy))
        layout.abstract(cfg, 1, policy, fmt, max_len)  # the format against the real head dim
    except ValueError as e:
        raise ConfigError(f"{e} (model {identity['name']}: head dim {cfg.head_dim}, "
                          f"{cfg.n_kv_heads} kv heads)") from None
    if spec.speed.prompt < 0 or spec.speed.new_tokens < 0:
        raise ConfigError(f"speed.prompt and speed.new_tokens must be >= 0, got {spec.speed}")
    if spec.speed.prompt and spec.speed.new_tokens + 1 >= max_len:  # + a prompt and its token
        raise ConfigError(
            f"speed.new_tokens={spec.speed.new_tokens} does not fit the cache length {max_len} "
            f"with a prompt; use speed.new_tokens <= {max_len - 2}"
        )
    if isinstance(spec.seed, bool) or not isinstance(spec.seed, int) or spec.seed < 0:
        raise ConfigError(f"seed={spec.seed!r} must be a non-negative integer")
    try:
        task.check_prompts(tokenizer, text, spec.seed)
        task.check_cache(TaskContext(None, cfg, tokenizer, policy, fmt, max_len, text, spec.seed,
                                     is_baseline(policy, fmt, layout), False, layout))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not spec.allow_dirty and git_info(code_only=True)["dirty"]:
        raise ConfigError(
            "allow_dirty=false and the kvjax checkout has uncommitted code changes (git status "
            "-- kvjax policies kernels run.py): commit them, or allow_dirty=true (the point's "
            "key covers the source either way)"
        )
    point = point_config(spec, policy, max_len, layout, fmt=fmt, model=identity,
                         text={"sha256": sha256_text(text), "n_tokens": n_tokens})
    return Plan(spec, policy, fmt, max_len, layout, point, config_hash(point), text, source, notes)


def build_layout(options, mesh: MeshSpec | None = None) -> Any:
    """The cache layout of `cache.*` options; paged-only options are dropped for `dense`,
    which carries the mesh (a trivial 1 x 1 mesh is no mesh, so its points keep their keys)."""
    opts = dict(options)
    name = opts.pop("layout", "dense")
    mesh = mesh or MeshSpec()
    if name == "dense":
        opts = {k: v for k, v in opts.items() if k == "impl"}
        if not mesh.trivial:
            opts["mesh"] = mesh
    elif not mesh.trivial:
        raise ConfigError(
            f"mesh.data={mesh.data} mesh.model={mesh.model} shards the dense cache; "
            f"cache.layout={name!r} keeps one page pool for every row (use cache.layout=dense, "
            "or mesh.data=1 mesh.model=1)"
        )
    return get_layout(name, **opts)


def _task_classes():
    from kvjax.tasks import TASKS

    return TASKS


def _probe_as_run(speed: SpeedSpec) -> SpeedSpec:
    """The speed probe as it runs: with no prompt it does not run, so its token count is kept
    at the default (no new point for a setting that changes nothing)."""
    return speed if speed.prompt else dataclasses.replace(speed, new_tokens=SpeedSpec.new_tokens)


def point_config(spec: RunSpec, policy, max_len: int, layout=None, *, fmt=None, model=None,
                 text=None) -> dict:
    """What identifies a point (its key is this dict's hash), by content, never by path: the
    model (`model_identity`), the policy with every field (defaults included, so `budget=256`
    and a policy default of 256 are one point; a new field such as a protocol mode joins by
    itself), the format with every option resolved (`int4` and `int4 group=64` are one point),
    the task (chunking included; its text file by the text's sha256 and the tokens scored, a data
    file such as qa's by its bytes' sha256: `Task.identity`),
    the seed, the cache length, the speed probe (as it runs: `_probe_as_run`), the sweep name
    and the code (`code_identity`). W&B settings, paths, `force` and `progress` are left out;
    the cache layout is part of the point only when it is not the default dense one."""
    fmt = fmt if fmt is not None else build_format(spec.kv_dtype, dict(spec.kv_options))
    task = {"name": spec.task.name, **dataclasses.asdict(spec.task)}
    task.pop("text_file", None)
    task.update(spec.task.identity())
    point = {
        "model": model if model is not None else model_identity(spec.model),
        "policy": {"name": policy.name, **dataclasses.asdict(policy)},
        "kv_dtype": spec.kv_dtype,
        "format": fmt.options(),
        "task": task,
        "text": text,
        "seed": spec.seed,
        "max_len": max_len,
        "speed": dataclasses.asdict(_probe_as_run(spec.speed)),
        "sweep": spec.sweep,
        "code": code_identity(),
    }
    if layout is not None and layout != get_layout("dense"):
        point["cache"] = {"layout": layout.name, **dataclasses.asdict(layout)}
    return to_jsonable(point)


# ----------------------------------------------------------------------------- model loading


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    cfg: Any
    params: Any
    tokenizer: Any
    seconds: float


def tiny_params(cfg, seed: int):
    """Random params in `kvjax.model.init_params`'s layout, filled by numpy.

    The layout comes from tracing init_params (no compile); eager jax.random would compile
    one kernel per shape, ~9 s on a 2-core CPU. Norm weights are 1 + 0.1 N(0, 1), the
    embedding N(0, 1), every other matrix 0.02 N(0, 1)."""
    from kvjax.model import init_params

    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(seed)

    def fill(path, s):
        name = jax.tree_util.keystr(path)
        x = rng.standard_normal(s.shape).astype(np.float32)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.1 * x)
        return jnp.asarray(x if "embed" in name else 0.02 * x)

    return jax.tree_util.tree_map_with_path(fill, shapes)


@functools.lru_cache(maxsize=1)
def load_tokenizer(model: ModelSpec):
    """The model's tokenizer without its weights (prompt checks before the model loads)."""
    if model.name == TINY:
        from kvjax.config import tiny_config

        try:
            return CharTokenizer(tiny_config(**dict(model.overrides)).vocab_size)
        except TypeError as e:
            raise ConfigError(f"model.overrides: {e}") from None
    from kvjax.loading import load_tokenizer as from_checkpoint

    return from_checkpoint(model.name)


@functools.lru_cache(maxsize=1)
def load(model: ModelSpec) -> LoadedModel:
    """The model on the device (cached in-process, so a sequential sweep loads it once), its
    layers split into one buffer per layer (`kvjax.model.to_device`)."""
    from kvjax.config import tiny_config
    from kvjax.model import to_device

    t0 = time.perf_counter()
    if model.name == TINY:
        try:
            cfg = tiny_config(**dict(model.overrides))
        except TypeError as e:
            raise ConfigError(f"model.overrides: {e}") from None
        params = tiny_params(cfg, model.init_seed)
        tokenizer = load_tokenizer(model)
    else:
        from kvjax.loading import load_model

        cfg, params, tokenizer = load_model(model.name)
    params = to_device(params)
    jax.block_until_ready(params)
    return LoadedModel(cfg, params, tokenizer, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- measuring


def nominal_bytes_per_value(fmt) -> float | None:
    """Bytes per stored value without metadata (the closed form's `bytes`)."""
    if fmt.name in NOMINAL_BITS:
        return NOMINAL_BITS[fmt.name] / 8
    bits = getattr(fmt, "bits", None)
    return bits / 8 if bits else None


def compile_probe(ctx: TaskContext, prompt: list[int]) -> dict[str, float] | None:
    """Compile the speed probe's programs for `prompt` ahead (`generate.compile_start`, the
    decode step included): seconds per program, None in compress mode."""
    return compile_start(ctx.params, ctx.cfg, [prompt], ctx.policy, ctx.fmt,
                         max_len=ctx.max_len, layout=ctx.layout, decode_too=True)


def compile_probe_beside(ctx: TaskContext, prompt: list[int]):
    """`compile_probe` in a thread, so that tracing it overlaps the task's run (XLA runs the
    task's programs without Python's lock); a future of its result, or None where every
    process must run programs in one order (several processes: the probe compiles in turn)."""
    if jax.process_count() > 1:
        return None
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvjax-probe-compile")
    future = pool.submit(compile_probe, ctx, prompt)
    pool.shutdown(wait=False)
    return future


def measure_speed(ctx: TaskContext, prompt: list[int], new_tokens: int, ahead=None):
    """Prefill seconds (the whole prompt in one forward, plus the compress-mode selection) and
    decode tokens/s, each compiled before it is timed, through `kvjax.generate.start` and
    `decode`. The programs compile ahead of time (`compile_probe`; `ahead`: its future from
    `compile_probe_beside`, started before the task); only where that cannot cover them
    (compress mode) does a first, compiling call run the whole prefill and a step once more.
    Returns (timings, the batch-1 cache after prefill + decode)."""

    def run_prefill():
        t = time.perf_counter()
        logits, cache = start(ctx.params, ctx.cfg, [prompt], ctx.policy, ctx.fmt,
                              max_len=ctx.max_len, extra=new_tokens + 1, layout=ctx.layout)
        jax.block_until_ready((logits, cache))
        return time.perf_counter() - t, logits, cache

    compiled = compile_probe(ctx, prompt) if ahead is None else ahead.result()
    if compiled is None:
        first, _, _ = run_prefill()
    prefill_s, logits, cache = run_prefill()
    t = time.perf_counter()
    _, cache = decode(ctx.params, ctx.cfg, logits, cache, 1)
    decode_first = time.perf_counter() - t
    logits = jnp.zeros_like(logits)  # greedy from token 0 on: the time, not the text, matters
    t = time.perf_counter()
    _, cache = decode(ctx.params, ctx.cfg, logits, cache, new_tokens)
    decode_s = time.perf_counter() - t
    step_s = decode_s / max(new_tokens, 1)
    return {
        "prefill_s": prefill_s, "prefill_tokens": len(prompt), "prefill_chunk": len(prompt),
        "prefill_compile_s": (compiled["prefill"] if compiled is not None
                              else max(0.0, first - prefill_s)),
        "decode_tok_s": new_tokens / decode_s if decode_s > 0 else None,
        "decode_tokens": new_tokens,
        "decode_compile_s": (compiled["decode"] if compiled is not None
                             else max(0.0, decode_first - step_s)),
    }, cache


def _int_if_whole(x):
    return int(x) if float(x).is_integer() else float(x)


def formula_bytes(cfg, cache) -> int | None:
    """The cache's bytes by arithmetic (format formula + positions + stats, summed over layer
    groups); None for a layout without a formula (paged)."""
    parts = getattr(cache, "groups", (cache,))
    if not all(hasattr(p, "formula_bytes") for p in parts):
        return None
    return sum(p.formula_bytes(cfg.head_dim) for p in parts)


def cache_bytes(cfg, cache, fmt, max_len: int) -> dict:
    """Measured bytes of one sequence's cache beside its exact closed form, the textbook
    payload 2·L·Hkv·D·C·bytes and the full f32 cache.

    `cache` is a real cache; with batch B > 1 every buffer with a batch axis counts 1/B (all
    but the per-layer nonfinite flags have one)."""
    B = cache.length.shape[0]
    shared = int(np.asarray(cache.nonfinite).nbytes)
    def per_row(n):
        return None if n is None else (n - shared) // B + shared

    kv = cache.kv_nbytes() // B
    C = cache.capacity
    bpv = nominal_bytes_per_value(fmt)
    full_f32 = closed_form_bytes(cfg, max_len, 4.0)
    out = {
        "kv_bytes": int(kv), "total_bytes": int(per_row(cache.nbytes())),
        "capacity": _int_if_whole(C),  # a mean over layer groups (pyramid) may be fractional
        "bytes_per_value": bpv, "closed_form_bytes": per_row(formula_bytes(cfg, cache)),
        "payload_bytes": None if bpv is None else _int_if_whole(closed_form_bytes(cfg, C, bpv)),
        "full_f32_bytes": _int_if_whole(full_f32), "compression": full_f32 / kv,
    }
    if getattr(cache, "bounds", None):  # per-layer budgets: each group's layers and slots
        out["layer_capacities"] = [[lo, hi, int(g.capacity)]
                                   for g, (lo, hi) in zip(cache.groups, cache.bounds)]
    if any(isinstance(p, HeadPool) for p in getattr(cache, "groups", (cache,))):
        # per-head budgets: the slots each kv head holds, [L][K] (of the first row)
        out["head_slots"] = np.asarray(cache.head_slots())[:, 0].tolist()
    return out


# ----------------------------------------------------------------------------- baselines


def baseline_dir(spec: RunSpec) -> Path:
    if spec.baselines:
        return Path(spec.baselines).expanduser().resolve()
    return Path(spec.results).expanduser().resolve().parent / "baselines"


def baseline_key(plan_: Plan, text_sha: str) -> str:
    """The full-cache baseline's identity: the point's model, task, text and code (content,
    like the point key), its seed."""
    pt = plan_.point
    ident = {"model": pt["model"], "task": pt["task"], "text_sha256": text_sha,
             "seed": plan_.spec.seed, "code": pt["code"],
             "baseline": f"{BASELINE_POLICY}/{BASELINE_FORMAT}"}
    return config_hash(ident)


def is_baseline(policy, fmt, layout) -> bool:
    """The point is the full-cache baseline itself (full, f32, the default dense layout)."""
    return (policy.name == BASELINE_POLICY and fmt == build_format(BASELINE_FORMAT, {})
            and layout == get_layout("dense"))


def is_baseline_point(plan_: Plan) -> bool:
    return is_baseline(plan_.policy, plan_.fmt, plan_.layout)


def get_baseline(plan_: Plan, ctx: TaskContext, text_sha: str, result: TaskResult | None):
    """(baseline metrics, source, seconds spent computing it).

    source: "this run" (the run is the full f32 baseline; `result` is its result), "cache"
    (read from the baseline directory) or "computed" (run now and cached)."""
    path = baseline_dir(plan_.spec) / f"{baseline_key(plan_, text_sha)}.json"
    if result is None and path.is_file():
        try:
            return json.loads(path.read_text())["metrics"], "cache", 0.0
        except (json.JSONDecodeError, KeyError):
            pass  # a damaged entry is recomputed and rewritten
    source = "this run" if result is not None else "computed"
    t = time.perf_counter()
    if result is None:
        full = dataclasses.replace(ctx, policy=get_policy(BASELINE_POLICY),
                                   fmt=build_format(BASELINE_FORMAT, {}), is_baseline=True,
                                   layout=None)
        result = plan_.spec.task.run(full)
    seconds = time.perf_counter() - t
    metrics = to_jsonable(result.metrics)
    atomic_write_text(path, canonical_json({"metrics": metrics, "point": plan_.point["task"],
                                            "model": plan_.point["model"],
                                            "text_sha256": text_sha}))
    return metrics, source, seconds


# ----------------------------------------------------------------------------- provenance


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    dists = ["kvjax", "jax", "jaxlib", "flax", "numpy", "hydra-core", "omegaconf", "wandb"]
    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "versions": {d: _version(d) for d in dists},
    }


CODE_PATHS = ("kvjax", "policies", "kernels", "run.py")


def git_info(repo: Path | None = None, code_only: bool = False) -> dict:
    """{"commit": sha or None, "dirty": bool or None} of the kvjax checkout (`code_only`:
    dirty means uncommitted changes under CODE_PATHS)."""
    repo = repo or Path(__file__).resolve().parent.parent

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        paths = ("--", *CODE_PATHS) if code_only else ()
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", *paths))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `execute` did: the record (None when skipped), whether it was stored, the task's
    full result (None when skipped)."""

    record: dict | None
    stored: bool
    skipped: bool = False
    existing: dict | None = None
    result: TaskResult | None = None


def release_compiled_near_map_limit(fraction: float = 0.5) -> bool:
    """Drop JAX's in-memory compiled programs (`jax.clear_caches`) when this process holds more
    than `fraction` of Linux's limit on memory mappings (vm.max_map_count, 65530 by default);
    True when it did. Elsewhere (no /proc) a no-op.

    XLA:CPU maps three regions per compiled kernel, and a decode program over split layers
    (`kvjax.model.split_layers`: one matrix-vector kernel per layer's matmul, in `lax.switch`
    branches) holds ~800 mappings, ~4x a stacked one. A process that keeps compiling (a sweep of
    points in one process, a test worker) reaches the limit, and then LLVM cannot allocate and
    XLA crashes the process with SIGSEGV (reproduced with vm.max_map_count=1300). The programs
    come back from the persistent cache or recompile.
    """
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return False
    if held <= fraction * limit:
        return False
    jax.clear_caches()
    clear_loaded()
    return True


def execute(plan_: Plan, run_dir: str | os.PathLike, echo=print,
            precomputed: tuple[TaskResult, float] | None = None) -> Outcome:
    """Run a planned point (or skip it if the store already holds its key). `precomputed`:
    the task's (result, seconds) when `execute_shared` already ran it."""
    spec = plan_.spec
    store = ResultsStore(spec.results)
    for problem in store.read()[1]:
        echo(f"warning: results store {store.path}: skipping {problem}")
    if not spec.force:
        existing = store.find(plan_.key)
        if existing is not None:
            echo(f"skip: point {plan_.key} is already in {store.path} "
                 f"(line {existing['_line']}; force=true reruns it)")
            return Outcome(None, False, skipped=True, existing=existing)
    git = git_info(code_only=True)  # dirty: uncommitted code, as allow_dirty reads it
    w = spec.wandb
    sink = {"mode": w.mode, "project": w.project, "entity": w.entity, "run_dir": run_dir}
    wandb_worker.begin({"key": plan_.key, "sweep": spec.sweep, "point": plan_.point, "git": git},
                       **sink)
    try:
        record, stored, result = _execute(plan_, store, run_dir, echo, precomputed, git)
    except BaseException:
        wandb_worker.abort(plan_.key, w.mode)
        raise
    wandb_worker.submit(record, result, **sink)
    return Outcome(record, stored, result=result)


def _execute(plan_: Plan, store: ResultsStore, run_dir, echo, precomputed, git: dict):
    """`execute`'s work: run the point, write its record and files; (record, stored, result)."""
    spec = plan_.spec
    for note in plan_.notes:
        echo(f"note: {note}")
    release_compiled_near_map_limit()
    programs_before = collections.Counter(program_stats)
    t_start = time.perf_counter()
    model = load(spec.model)
    cfg = model.cfg
    params, mesh = model.params, getattr(plan_.layout, "mesh", None)
    if mesh is not None:
        params, param_reasons = shard_params(params, cfg, mesh)
        for r in param_reasons:
            echo(f"note: mesh: {r}")
    text, source = plan_.text, plan_.text_source
    text_sha = sha256_text(text)
    ctx = TaskContext(params, cfg, model.tokenizer, plan_.policy, plan_.fmt,
                      plan_.max_len, text, spec.seed, is_baseline_point(plan_), spec.progress,
                      plan_.layout)
    if precomputed is None:
        precomputed = shared_result(plan_, ctx, echo)
    # the probe decodes 1 + new_tokens after its prompt: all of it within max_len
    n_prompt = min(spec.speed.prompt, plan_.max_len - spec.speed.new_tokens - 1)
    probe = spec.speed.prompt and n_prompt > 0
    if probe:
        prompt = encode_prefix(model.tokenizer, text, n_prompt)
        ahead = compile_probe_beside(ctx, prompt)
    t = time.perf_counter()
    result = spec.task.run(ctx) if precomputed is None else precomputed[0]
    task_s = time.perf_counter() - t if precomputed is None else precomputed[1]
    base, base_source, base_s = get_baseline(plan_, ctx, text_sha,
                                             result if ctx.is_baseline else None)

    timings = {"load_s": model.seconds, "task_s": task_s, "baseline_s": base_s}
    if probe:
        speed, probe_cache = measure_speed(ctx, prompt, spec.speed.new_tokens, ahead)
        timings |= speed
    else:
        probe_cache = result.cache
        if probe_cache is None:  # no sequence's cache (serve's shared pool): one allocated
            probe_cache = plan_.layout.init(cfg, 1, plan_.policy, plan_.fmt, plan_.max_len)
        timings |= {"prefill_s": None, "decode_tok_s": None}
    timings["total_s"] = time.perf_counter() - t_start
    timings["programs"] = dict(program_stats - programs_before)  # stored programs of this point

    task = spec.task
    value = result.metrics[task.metric]
    b = base.get(task.metric)
    # a compress-mode cache holds what it kept of its prompt: the task's prompts, not the
    # probe's shorter one, set its size (an evict-mode cache's capacity is the budget's)
    measured = (result.cache if plan_.policy.mode == "compress" and result.cache is not None
                else probe_cache)
    cache_info = cache_bytes(cfg, measured, plan_.fmt, plan_.max_len)
    if mesh is not None:
        cache_reasons = cache_specs(measured, mesh).reasons
        for r in cache_reasons:
            echo(f"note: mesh: {r}")
        cache_info |= {"per_device_bytes": measured.nbytes(per_device=True),
                       "mesh": {**dataclasses.asdict(mesh), "replicated": param_reasons
                                + cache_reasons}}
    metrics = {"task": task.name, "metric": task.metric, "value": value, "baseline": b,
               "delta": None if b is None else value - b,
               "higher_is_better": task.higher_is_better, "baseline_source": base_source,
               **result.metrics}
    run_dir = Path(run_dir)
    record = to_jsonable({
        "schema": SCHEMA, "key": plan_.key, "sweep": spec.sweep,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "run_dir": str(run_dir.resolve()), "point": plan_.point, "config": spec.config,
        "model": {"name": spec.model.name, **dataclasses.asdict(cfg)},
        "text": {"source": source, "sha256": text_sha, "n_chars": len(text),
                 "n_tokens": plan_.point["text"]["n_tokens"]},
        "metrics": metrics, "baseline_metrics": base,
        "cache": cache_info,
        "timings": timings, "env": environment(), "git": git,
    })
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, arr in result.arrays.items():
        np.save(run_dir / f"{name}.npy", np.asarray(arr, np.float32))
    if result.rows:
        atomic_write_text(run_dir / "samples.json", json.dumps(to_jsonable(result.rows), indent=1))
    atomic_write_text(run_dir / "metrics.json", json.dumps(record, indent=1, sort_keys=True))
    stored = store.append(record, replace=spec.force)
    return record, stored, result


def shared_prefill_key(plan_: Plan) -> str | None:
    """Points with the same key can share one prefill (score once, select many): compress-mode
    policies that read a prompt alike, on the same model, task, text, format, layout and seed.
    None: the point runs alone."""
    from kvjax.generate import shares_prefill

    if not plan_.spec.task.has_prompt or not shares_prefill(plan_.policy):
        return None
    ident = {k: plan_.point.get(k) for k in plan_.point if k not in ("policy", "sweep")}
    return config_hash({**ident, "text_sha256": sha256_text(plan_.text)})


SWEEP_PLANS: list[Plan] = []  # the planned points of the sweep this process runs (kvjax.sweep)
_SHARED: dict[str, tuple[TaskResult, float]] = {}  # results computed for a later point


def shared_result(plan_: Plan, ctx: TaskContext, echo=print) -> tuple[TaskResult, float] | None:
    """This point's task result when it can share a prefill with other points of the planned
    sweep (`SWEEP_PLANS`) not stored yet: the first of them runs the whole group
    (`Task.run_many`) and the others find theirs here. None: run the point alone."""
    if plan_.key in _SHARED:
        return _SHARED.pop(plan_.key)
    key = shared_prefill_key(plan_)
    if key is None or not any(p.key == plan_.key for p in SWEEP_PLANS):
        return None
    store = ResultsStore(plan_.spec.results)
    group, seen = [], set()
    for p in SWEEP_PLANS:
        if p.key not in seen and shared_prefill_key(p) == key and (
                p.key == plan_.key or p.spec.force or store.find(p.key) is None):
            group.append(p)
            seen.add(p.key)
    if len(group) < 2:
        return None
    t = time.perf_counter()
    results = plan_.spec.task.run_many(ctx, [p.policy for p in group])
    seconds = (time.perf_counter() - t) / len(group)
    echo(f"shared prefill: this point and {len(group) - 1} more of the sweep read each prompt "
         f"of task {plan_.spec.task.name!r} once (score once, select many)")
    for p, r in zip(group, results):
        _SHARED[p.key] = (r, seconds)
    return _SHARED.pop(plan_.key)


@contextlib.contextmanager
def shared_sweep(plans: list[Plan]):
    """Within it, `execute` runs the points of `plans` that can share a prefill as one group
    (`shared_result`); every point still gets its own record."""
    SWEEP_PLANS[:] = plans
    try:
        yield
    finally:
        SWEEP_PLANS.clear()
        _SHARED.clear()


def execute_shared(plans: list[Plan], run_dirs, echo=print) -> list[Outcome]:
    """Execute planned points as a sweep does: points that can share a prefill run as one
    group (`shared_result`), and every point still gets its own record, baseline and speed
    probe. Points already stored are skipped."""
    with shared_sweep(plans):
        return [execute(p, d, echo) for p, d in zip(plans, run_dirs)]


def run(spec: RunSpec | Plan, run_dir: str | os.PathLike, echo=print) -> Outcome:
    """plan (unless given a Plan) + execute + print the table (the whole of `python run.py`,
    without Hydra)."""
    p = spec if isinstance(spec, Plan) else plan(spec)
    spec = p.spec
    out = execute(p, run_dir, echo)
    if out.record is not None:
        echo(format_table(out.record))
        echo(f"results store: {ResultsStore(spec.results).path}"
             + ("" if out.stored else " (a record with this key was already there)"))
    elif out.existing is not None:
        try:
            echo(format_table(out.existing) + "\n(the stored record; force=true reruns it)")
        except (KeyError, TypeError):
            echo("(the stored record predates this table's fields)")
    return out


# ----------------------------------------------------------------------------- printing


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} B" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return str(n)


def _baseline_note(m: dict, t: dict) -> str:
    src = m.get("baseline_source")
    if src == "computed":
        return f"incl. the full-cache baseline, {t['baseline_s']:.1f} s (now cached)"
    return {"this run": "this run is the full-cache baseline",
            "cache": "full-cache baseline read from its cache"}.get(src, "")


@functools.lru_cache(maxsize=64)
def _defaults_json(kind: str, name: str) -> str:
    try:
        if kind == "policy":
            fields = dataclasses.asdict(get_policy(name))
        elif kind == "task":
            fields = dataclasses.asdict(TASKS[name]()) if name in TASKS else {}
        else:
            fields = build_format(name, {}).options()  # defaults resolved, as a point records them
    except (TypeError, ValueError):
        fields = {}
    return json.dumps(to_jsonable(fields))


def _defaults(kind: str, name: str) -> dict:
    """The fields of policy, format or task `name` built with no options, as a point records
    them ({} if it is unknown)."""
    return json.loads(_defaults_json(kind, name))


def options_label(kind: str, fields: dict, skip=()) -> str:
    """A policy's, format's or task's name, plus the fields (other than `skip`) whose values
    differ from its defaults: what tells a preset (`snapkv_kvpress` records as snapkv with
    kvpress's settings), non-default format options (int4's key_mode=token) or task settings
    (passkey's depth) apart in a table."""
    if isinstance(fields.get("base"), dict):  # a wrapper (kept layers or units): its base's
        inner = options_label(kind, fields["base"])  # label, with the wrapper's own fields
        own = ", ".join(f"{k}={v}" for k, v in sorted(fields.items())
                        if k not in ("name", "base", *skip))
        return f"{inner[:-1]}, {own})" if inner.endswith(")") else f"{inner}({own})"
    name = str(fields.get("name"))
    defaults = _defaults(kind, name)
    diff = {k: v for k, v in fields.items()
            if k not in ("name", *skip) and (k not in defaults or defaults[k] != v)}
    return name + (f"({', '.join(f'{k}={v}' for k, v in sorted(diff.items()))})" if diff else "")


def format_label(point: dict) -> str:
    """A point's kv format with its options that differ from the defaults (older records: its
    name)."""
    fields = point.get("format")
    return options_label("format", fields) if isinstance(fields, dict) else point["kv_dtype"]


def _declared(kind: str, fields: dict) -> list[tuple[str, Any]]:
    """A policy's or task's recorded fields but its name, in declaration order (a stored
    record's keys come back sorted; fields it no longer declares last)."""
    order = list(_defaults(kind, str(fields.get("name"))))
    return sorted(((k, v) for k, v in fields.items() if k != "name"),
                  key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0]))


def format_table(record: dict) -> str:
    """The short table `python run.py` prints."""
    pt, m, c, t = record["point"], record["metrics"], record["cache"], record["timings"]
    pol = pt["policy"]
    opts = ", ".join(f"{k}={v}" for k, v in _declared("policy", pol) if v is not None)
    task = ", ".join(f"{k}={v}" for k, v in _declared("task", pt["task"]) if v is not None)
    rows = [
        (m["metric"], fmt(m["value"], ".4f"),
         f"full cache {fmt(m['baseline'], '.4f')}, delta {fmt(m['delta'], '+.4f')}"),
        *TASKS.get(pt["task"]["name"], Task).table_rows(m, pt["task"]),
        ("cache bytes (measured)", _fmt_bytes(c["total_bytes"]),
         f"every buffer; k+v incl. scales {_fmt_bytes(c['kv_bytes'])}"),
        ("cache bytes (closed form)", _fmt_bytes(c.get("closed_form_bytes")),
         "format formula (values + scales/zero points + residual) + positions + stats"),
        ("payload", _fmt_bytes(c.get("payload_bytes")),
         f"2*L*Hkv*D*C*bytes, C={c['capacity']}, " + (
             f"{c['bytes_per_value']} B/value (no metadata)" if c.get("bytes_per_value")
             else "no single bytes per value (mixed precision)")),
    ]
    if "mesh" in c:
        mesh = c["mesh"]
        rows.append(("cache bytes per device", _fmt_bytes(c["per_device_bytes"]),
                     f"the measured cache (all rows) on the busiest of {mesh['data']} x "
                     f"{mesh['model']} devices" + (f"; {len(mesh['replicated'])} axis note(s): "
                                                   "not sharded, replicated (record: cache.mesh)"
                                                   if mesh["replicated"] else "")))
    rows += [
        ("compression", f"{c['compression']:.2f}x",
         f"vs a full f32 cache of {pt['max_len']} tokens ({_fmt_bytes(c['full_f32_bytes'])})"),
    ]
    if t.get("prefill_s") is None:
        rows.append(("prefill / decode", "n/a", "speed probe off (speed.prompt=0)"))
    else:
        rows += [
            ("prefill", f"{t['prefill_s']:.3f} s",
             f"{t['prefill_tokens']} tokens; compile {t['prefill_compile_s']:.1f} s"),
            ("decode", f"{fmt(t['decode_tok_s'], '.1f')} tok/s",
             f"{t['decode_tokens']} tokens; compile {t['decode_compile_s']:.1f} s"),
        ]
    rows += [
        ("run time", f"{t['total_s']:.1f} s", _baseline_note(m, t)),
    ]
    policy = f"{pol['name']}({opts})" if opts else pol["name"]
    layout = pt.get("cache")
    if layout and layout["layout"] == "paged":
        layout = f" | cache=paged(page={layout['page_size']}, {layout['impl']})"
    elif layout and layout.get("mesh"):
        layout = f" | mesh=data {layout['mesh']['data']} x model {layout['mesh']['model']}"
    else:
        layout = ""
    head = (f"kvjax | model={pt['model']['name']} | policy={policy} | "
            f"kv_dtype={format_label(pt)}{layout} | task={pt['task']['name']}({task})")
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [head, "-" * min(len(head), 100)]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c_}" for a, b, c_ in rows]
    lines.append(f"record: key {record['key']}, run dir {record['run_dir']}")
    return "\n".join(lines)
