"""Plan a whole sweep before its first point runs (a Hydra callback, registered in
configs/config.yaml).

`python run.py -m a=1,2 b=x,y` used to discover a bad point (an unknown kv_dtype, a budget above
the task's length) only when the launcher reached it, after the points before it had run.
`PlanSweep.on_multirun_start` runs in the launching process before the sweeper: it expands the
sweep's overrides with Hydra's own parser and `BasicSweeper.split_arguments`, composes every
point's config with Hydra's config loader (what the launcher will compose, on any launcher:
basic, joblib, submitit) and calls `kvjax.experiment.plan` on each. A bad point is one line on
stderr naming the point's overrides and the error, and the process exits with status 2 before
anything runs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_points(config: DictConfig) -> tuple[list[list[str]], set[str]]:
    """Every point of the sweep as its list of overrides, in the order BasicSweeper runs them,
    and the keys that the sweep varies."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    arguments = params + list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
    loader = GlobalHydra.instance().config_loader()
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    swept = {o.get_key_element() for o in overrides if o.is_sweep_override()}
    points = [point for batch in BasicSweeper.split_arguments(overrides, None) for point in batch]
    return points, swept


def check_point(config: DictConfig, point: list[str]):
    """Compose one point's job config as the launcher will, and plan it (no model work)."""
    from kvjax.experiment import plan
    from kvjax.harness import spec_from_config

    job = GlobalHydra.instance().config_loader().load_sweep_config(
        master_config=config, sweep_overrides=list(point))
    with open_dict(job):
        del job["hydra"]  # the job's function sees the config without it, as run_job does
    return plan(spec_from_config(job))


def sweep_errors(config: DictConfig) -> list[str]:
    """One line per point that cannot run: `sweep point #i (its swept overrides): error`."""
    from kvjax import experiment
    from kvjax.experiment import ConfigError

    experiment.SWEEP_PLANS.clear()  # this sweep's plans only (none for another sweeper)
    if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return []  # other sweepers (optuna) choose their points while they run
    points, swept = sweep_points(config)
    errors = []
    for i, point in enumerate(points):
        try:
            experiment.SWEEP_PLANS.append(check_point(config, point))
        except (ConfigError, HydraException, OmegaConfBaseException) as e:
            cause = f": {e.__cause__}" if e.__cause__ is not None else ""  # Hydra's why
            message = " ".join(f"{e}{cause}".split())
            name = " ".join(o for o in point if o.split("=", 1)[0] in swept) or " ".join(point)
            errors.append(f"error: sweep point #{i} ({name}): {message}")
    return errors


class PlanSweep(Callback):
    """Refuse a sweep with any bad point before its first point runs (exit status 2). The
    plans are kept (`kvjax.experiment.SWEEP_PLANS`): points that can share a prefill then run
    together when the first of them runs (in-process launchers)."""

    plans: tuple = ()  # the planned points (basic sweeper only), for the end's summary
    before: dict | None = None  # their stores' statuses when the sweep started

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # as harness.main does for one run: Hydra logs INFO here, and JAX reports at INFO each
        # backend it probes and does not find ("Unable to initialize backend 'tpu'")
        logging.getLogger("jax").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)  # Optuna's: 7 "setup plugin" lines
        errors = sweep_errors(config)
        if errors:
            print("\n".join(errors), file=sys.stderr)
            sys.exit(2)
        from kvjax import experiment

        self.plans = tuple(experiment.SWEEP_PLANS)
        self.before = stored_status(self.plans)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.plans:
            print(sweep_summary(self.plans, self.before, stored_status(self.plans)),
                  file=sys.stderr)


def stored_status(plans: Sequence) -> dict[tuple[str, str], str]:
    """(results store, key) -> "done" or "failed", for the planned points' keys in their
    stores (the last record of a key counts, as the store's readers take it)."""
    from kvjax.results import ResultsStore, is_failure

    out = {}
    for path in dict.fromkeys(str(p.spec.results) for p in plans):
        records, _ = ResultsStore(path).read()
        for r in records:
            out[path, r.get("key")] = "failed" if is_failure(r) else "done"
    return out


def sweep_summary(plans: Sequence, before: dict, after: dict) -> str:
    """One line at the end of a sweep: how many of its points ran, were already stored (and so
    skipped), failed, or were not recorded. Points with one key (e.g. `full` at several
    budgets, which it ignores) count once. (Hydra raises a point's failure after the last
    point instead of ending the sweep, so a sweep with a failure prints its traceback, not
    this line.)"""
    keys = list(dict.fromkeys((str(p.spec.results), p.key) for p in plans))
    skipped = sum(before.get(k) == "done" for k in keys)
    ran = sum(after.get(k) == "done" and before.get(k) != "done" for k in keys)
    failed = sum(after.get(k) == "failed" for k in keys)
    missing = len(keys) - skipped - ran - failed
    same = f" ({len(keys)} distinct)" if len(keys) < len(plans) else ""
    return (f"sweep: {len(plans)} points{same}: {ran} ran, {skipped} already in the results "
            "store (skipped)" + (f", {failed} failed" if failed else "")
            + (f", {missing} not recorded" if missing else "")
            + "; `python -m experiments.report` compares them")
