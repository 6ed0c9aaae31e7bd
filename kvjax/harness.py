"""The Hydra side of the harness: structured-config schemas and DictConfig -> RunSpec.

`run.py` is a thin `@hydra.main` wrapper around `main`. The schemas registered here validate
the input (unknown keys and wrong types are Hydra errors naming them); `spec_from_config`
turns the resolved config into frozen kvjax dataclasses, so JAX code never sees a DictConfig.
Task schemas are generated from the task dataclasses, so a new task needs no schema code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import types
import typing
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from kvjax.experiment import ConfigError, ModelSpec, RunSpec, SpeedSpec, WandbSpec, plan, run
from kvjax.loading.hub import cache_root
from kvjax.mesh import MeshSpec
from kvjax.programs import set_program_store
from kvjax.results import ResultsStore, record_failure
from kvjax.tasks import TASKS, get_task
from kvjax.tasks.base import INTERRUPTED, interrupted_message, on_sigint, quiet_unraisable

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclasses.dataclass
class ModelConf:
    name: str = MISSING
    init_seed: int = 0
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SpeedConf:
    prompt: int = 256
    new_tokens: int = 16


@dataclasses.dataclass
class CacheConf:
    layout: str = "dense"  # dense | paged (kvjax.cache.get_layout)
    impl: str = "reference"  # attention: reference | pallas (paged only)
    page_size: int = 16  # paged only
    num_pages: int | None = None  # paged only; null: enough that no row waits


@dataclasses.dataclass
class MeshConf:
    data: int = 1  # devices the batch is split over
    model: int = 1  # devices the kv heads (cache, attention, projections) are split over


@dataclasses.dataclass
class DistributedConf:
    coordinator: str | None = None  # host:port of process 0; null: one process
    num_processes: int = 1
    process_id: int = 0


@dataclasses.dataclass
class ObjectiveConf:
    max_cache_bytes: int | None = None  # memory cap on cache.total_bytes (null: none)
    penalty: float | None = None  # a point over the cap returns this (null: PENALTY, signed)


@dataclasses.dataclass
class WandbConf:
    mode: str = "offline"
    project: str = "kvjax"
    entity: str | None = None


@dataclasses.dataclass
class RunConf:
    """The top-level schema (configs/config.yaml fills it)."""

    model: Any = MISSING
    policy: Any = MISSING
    task: Any = MISSING
    kv_dtype: str = "f32"
    kv_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    budget: int | None = None
    ratio: float | None = None
    seed: int = 0
    max_len: int | None = None
    sweep: str | None = None
    results: str = "results/results.jsonl"
    baselines: str | None = None
    force: bool = False
    progress: bool | None = None
    allow_dirty: bool = True
    xla_cache: str | None = None
    program_store: str | None = None
    speed: SpeedConf = dataclasses.field(default_factory=SpeedConf)
    cache: CacheConf = dataclasses.field(default_factory=CacheConf)
    mesh: MeshConf = dataclasses.field(default_factory=MeshConf)
    objective: ObjectiveConf = dataclasses.field(default_factory=ObjectiveConf)
    distributed: DistributedConf = dataclasses.field(default_factory=DistributedConf)
    wandb: WandbConf = dataclasses.field(default_factory=WandbConf)


def _omegaconf_type(t):
    """tuple[X, ...] -> list[X] (OmegaConf holds sequences as lists); a union of several types
    (e.g. `int | str` for `length=all`) -> Any (OmegaConf has no unions; the task checks it)."""
    if typing.get_origin(t) is tuple:
        return list[typing.get_args(t)[0]]
    several = len([a for a in typing.get_args(t) if a is not type(None)]) > 1
    if typing.get_origin(t) in (typing.Union, types.UnionType) and several:
        return Any
    return t


def task_schema(cls) -> type:
    """A mutable structured-config dataclass mirroring a task's fields (plus `name`)."""
    hints = typing.get_type_hints(cls)
    fields = [("name", str, dataclasses.field(default=cls.name))]
    for f in dataclasses.fields(cls):
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        fields.append((f.name, _omegaconf_type(hints[f.name]),
                       dataclasses.field(default_factory=lambda d=default: d)
                       if isinstance(default, list) else dataclasses.field(default=default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Conf", fields)


def register_configs() -> None:
    """Schemas live outside the config groups (a group's yaml pulls its schema in with
    `/NAME_schema@_here_`), so `model=` and `task=` offer only real choices. `${kvjax_cache:X}`
    is the model cache folder ($KVJAX_CACHE, else ~/.cache/kvjax) joined with X."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConf)
    cs.store(name="model_schema", node=ModelConf)
    for name, cls in TASKS.items():
        cs.store(name=f"{name}_schema", node=task_schema(cls))
    OmegaConf.register_new_resolver("kvjax_cache", lambda sub="": str(cache_root() / sub),
                                    replace=True)


register_configs()


def _abs(path: str | None) -> str | None:
    """Relative paths are relative to the directory the command was started in."""
    if path is None:
        return None
    from hydra.utils import to_absolute_path

    return to_absolute_path(os.path.expanduser(path))


def spec_from_config(cfg: DictConfig) -> RunSpec:
    """The frozen RunSpec of a composed config (task options are checked by the task)."""
    c = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    task_opts = dict(c["task"])
    policy_opts = dict(c["policy"] or {})
    if "name" not in policy_opts:
        raise ConfigError(f"the policy config needs a 'name' key, got {policy_opts}")
    try:
        task = get_task(task_opts.pop("name"), **task_opts)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    m = c["model"]
    try:
        mesh = MeshSpec(**c["mesh"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return RunSpec(
        task=task,
        model=ModelSpec(m["name"], m["init_seed"], tuple(sorted(m["overrides"].items()))),
        policy=policy_opts.pop("name"),
        policy_options=tuple(sorted(policy_opts.items())),
        kv_dtype=c["kv_dtype"],
        kv_options=tuple(sorted(c["kv_options"].items())),
        budget=c["budget"], ratio=c["ratio"], seed=c["seed"], max_len=c["max_len"], sweep=c["sweep"],
        speed=SpeedSpec(**c["speed"]), cache=tuple(c["cache"].items()), mesh=mesh, results=_abs(c["results"]),
        baselines=_abs(c["baselines"]), wandb=WandbSpec(**c["wandb"]), force=c["force"],
        progress=c["progress"], allow_dirty=c["allow_dirty"], config=c,
    )


def run_dir() -> Path:
    """Hydra's output directory for this job (the cwd outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()


# Programs that compile faster than this are not written to the persistent cache. Loading an
# XLA:CPU executable back can crash the process: a test worker died twice (SIGSEGV in
# `backend.deserialize_executable`, loading a small jitted step) while every program was cached;
# upstream has open reports (jax-ml/jax#28908). The crashes seen on 2026-12-02 were the worker
# reaching Linux's limit on memory mappings (`kvjax.experiment.release_compiled_near_map_limit`
# now keeps processes below it). The floor keeps ~90 % of the compile time
# cached with ~30 % of the programs (docs/benchmarks.md, "CI time"). JAX reads whatever a cache
# folder holds, so the folder's name carries the floor (configs/config.yaml, tests/conftest.py).
XLA_CACHE_MIN_COMPILE_S = 0.5


def set_xla_cache(path: str | None) -> None:
    """Persist compiled XLA programs across runs (those that compile in at least
    `XLA_CACHE_MIN_COMPILE_S`), so a warm sweep point recompiles only its small programs."""
    if path:
        import jax

        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", XLA_CACHE_MIN_COMPILE_S)


def run_log_echo():
    """print, and the same line into the run's log file (Hydra's `run.log`) when there is one."""
    log = logging.getLogger("kvjax.run")
    log.propagate = False  # the console gets the print; the file handlers get the record
    log.handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    log.setLevel(logging.INFO)

    def echo(msg: str, file=None) -> None:
        print(msg, file=file, flush=True)
        log.info(msg)

    return echo


def in_sweep() -> bool:
    """Whether this job is one point of `run.py -m`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


PENALTY = 1e9  # |objective| of a point over the memory cap, worse than any real metric


def objective(record: dict, max_cache_bytes: int | None, penalty: float | None,
              echo=print) -> float:
    """What a searching sweeper (hydra/sweeper=optuna) optimizes: the point's task metric, or
    `penalty` when its cache (`cache.total_bytes`, every buffer) is above `max_cache_bytes`.
    The point has run and is recorded either way, so the search's every trial is in the store.
    penalty=None: PENALTY where lower is better, -PENALTY where higher is."""
    m, nbytes = record["metrics"], record["cache"]["total_bytes"]
    if max_cache_bytes is None or nbytes <= max_cache_bytes:
        return float(m["value"])
    if penalty is None:
        penalty = -PENALTY if m["higher_is_better"] else PENALTY
    echo(f"objective: {penalty:g} (penalty): cache {nbytes} bytes > the cap "
         f"objective.max_cache_bytes={max_cache_bytes}; the point is recorded")
    return float(penalty)


def main(cfg: DictConfig):
    """One run from a composed config; a ConfigError exits with its message (status 2).
    Returns the point's objective (`objective`), which a searching sweeper (Optuna) optimizes.

    A point that fails after it was planned is stored as a failure record (the report lists
    it; a single run's bad input, found after planning, is only its error) and its error is
    raised to Hydra, so a sweeper that continues past failing points (the basic one runs its
    whole batch) does so. Ctrl-C exits with one line (status 130; run.py's SIGTERM: 143),
    nothing recorded and the store intact (records are only ever appended whole, see
    `kvjax.results`)."""
    logging.getLogger("jax").setLevel(logging.WARNING)
    echo = run_log_echo()
    d = cfg.distributed
    if d.num_processes > 1:  # before any JAX work: the mesh then spans every process
        from kvjax.mesh import init_distributed

        init_distributed(d.coordinator, d.num_processes, d.process_id)
    try:
        spec = spec_from_config(cfg)
        planned = plan(spec)
    except ConfigError as e:
        echo(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    handler = None  # Ctrl-C is never lost (`on_sigint`); an ignored SIGINT stays ignored
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        INTERRUPTED.clear()
        handler = signal.signal(signal.SIGINT, on_sigint)
        unraisable, sys.unraisablehook = sys.unraisablehook, quiet_unraisable(sys.unraisablehook)
    try:
        set_xla_cache(cfg.xla_cache)
        set_program_store(cfg.program_store)
        out = run(planned, run_dir(), echo)
        return objective(out.record or out.existing, cfg.objective.max_cache_bytes,
                         cfg.objective.penalty, echo)
    except KeyboardInterrupt:
        line, status = interrupted_message(
            "this point was not recorded; the results store is intact")
        echo(line, file=sys.stderr)
        sys.exit(status)
    except Exception as e:
        if isinstance(e, ConfigError) and not in_sweep():  # bad input to one run: no record
            echo(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        record_failure(ResultsStore(spec.results), key=planned.key, point=planned.point,
                       sweep=spec.sweep, error=e, run_dir=run_dir())
        raise
    finally:
        if handler is not None:  # as it was: in-process callers (tests, sweeps) go on
            signal.signal(signal.SIGINT, handler)
            sys.unraisablehook = unraisable
            INTERRUPTED.clear()
