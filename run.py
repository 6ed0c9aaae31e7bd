"""kvjax's experiment runner: `python run.py [overrides]`, `python run.py -m ...` for sweeps.

One run = one (model, policy, kv_dtype, budget, task) point: it prints a short table, writes
metrics.json (and per-token arrays) into Hydra's run directory, appends one record to the
results store and logs the run to W&B (offline by default). See docs/harness.md.
"""

import atexit
import logging
import os
import signal
import sys

_finished = False  # set once main() has returned: everything is written


def _skip_teardown() -> None:
    """Registered first, so it runs after every other exit handler (W&B's flush, JAX's clean-up,
    after Python has joined the non-daemon threads): once a run has finished, leave without the
    interpreter's teardown of every module and object (start + exit of a warm main job: 1.02 ->
    0.14 s, docs/benchmarks.md). A run that failed exits the ordinary way, with its code."""
    if _finished:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


atexit.register(_skip_teardown)

from kvjax import wandb_worker  # the standard library only

wandb_worker.prestart(sys.argv[1:])  # W&B's imports run beside this process's own (below)

import hydra  # after the exit handler above, so that it runs last

from kvjax import harness
from kvjax.tasks.base import interrupted_message, on_sigint


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg) -> float:
    return harness.main(cfg)  # the point's objective, for a searching sweeper (Optuna)


if __name__ == "__main__":
    # a scheduler's stop (SLURM, `kill`) ends a run as Ctrl-C does: one line, nothing half
    # written, the W&B worker's folder removed; the status says which signal (143)
    signal.signal(signal.SIGTERM, on_sigint)
    try:
        main()
    except KeyboardInterrupt:  # outside a point (a launcher's own wait: joblib's, submitit's)
        line, status = interrupted_message(
            "the run stopped; points already finished are in the results store, and the same "
            "command skips them")
        print(line, file=sys.stderr)
        sys.exit(status)
    _finished = True
