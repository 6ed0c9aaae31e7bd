"""kvjax's experiment runner: `python run.py [overrides]`, `python run.py -m ...` for sweeps.

One run = one (model, policy, kv_dtype, budget, task) point: it prints a short table, writes
metrics.json (and per-token arrays) into Hydra's run directory, appends one record to the
results store and logs the run to W&B (offline by default). See docs/harness.md.
"""

import hydra

from kvjax import harness


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg) -> float:
    return harness.main(cfg)  # the point's objective, for a searching sweeper (Optuna)


if __name__ == "__main__":
    main()
