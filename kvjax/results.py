"""The local results store (one JSON line per run) and the W&B sink.

The store is a JSON-lines file. `append` takes an exclusive lock beside it, rewrites the whole
file to a temporary file, fsyncs it and `os.replace`s it over the store: a run killed at any
moment leaves either the old file or the new one, never a partial line. Appending a record
whose key is already present is a no-op, so a sweep resumed or launched twice holds each point
once. Reading reports corrupt lines with their line number and skips them; appends copy them
through unchanged, so no other record is ever lost.

A run's key is the sha256 of its canonical point config (see `kvjax.experiment.point_config`):
volatile settings (W&B mode, paths, progress) are not part of it.

A point that fails while it runs is stored too, as a record with `status: "failed"` and the
error (`record_failure`), so a sweep that continues past it leaves a trace the report lists.
A failed record does not count as done: the point runs again, and its record replaces the
failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SCHEMA = 1
WANDB_MODES = ("offline", "online", "disabled")
FAILED = "failed"


def is_failure(record: dict) -> bool:
    """A record of a point that raised while it ran (no metrics)."""
    return record.get("status") == FAILED


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(point: dict) -> str:
    """Short stable hash of a point config (sorted keys, so dict order does not matter)."""
    return hashlib.sha256(canonical_json(point).encode()).hexdigest()[:16]


def to_jsonable(obj: Any) -> Any:
    """Numpy scalars/arrays, tuples and non-finite floats -> plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):
        return to_jsonable(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a fsynced temporary file and os.replace. The file gets
    the mode a plain `open` would (0666 minus the umask), not mkstemp's private 0600, so a
    store shared by a group on a cluster stays readable and writable by it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A line of the store that is not a valid record."""

    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class ResultsStore:
    """The JSON-lines results store at `path` (created on the first append)."""

    path: Path

    def __init__(self, path: str | os.PathLike):
        object.__setattr__(self, "path", Path(path).expanduser().resolve())

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive advisory lock held by one writer at a time (processes and hosts on a
        shared POSIX file system)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _lines(self) -> list[str]:
        if not self.path.exists():
            return []
        return self.path.read_text(encoding="utf-8", errors="replace").splitlines()

    def read(self) -> tuple[list[dict], list[Problem]]:
        """(records in file order, problems): corrupt lines are reported, never fatal."""
        records, problems = [], []
        for i, line in enumerate(self._lines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(Problem(i, f"not valid JSON ({e.msg} at column {e.colno})"))
                continue
            if not isinstance(rec, dict) or "key" not in rec:
                problems.append(Problem(i, "not a kvjax record (no 'key')"))
                continue
            rec["_line"] = i
            records.append(rec)
        return records, problems

    def records(self, warn: bool = True) -> list[dict]:
        """Valid records; each corrupt line is reported as a warning with its line number."""
        records, problems = self.read()
        if warn:
            for p in problems:
                warnings.warn(f"results store {self.path}: skipping {p}", stacklevel=2)
        return records

    def find(self, key: str) -> dict | None:
        """The last finished record with this key, or None (failures do not count)."""
        found = [r for r in self.records(warn=False)
                 if r.get("key") == key and not is_failure(r)]
        return found[-1] if found else None

    def done_keys(self) -> set[str]:
        return {r["key"] for r in self.records(warn=False) if not is_failure(r)}

    def append(self, record: dict, replace: bool = False) -> bool:
        """Add one record atomically. If its key is already stored: nothing is written and the
        result is False, or with `replace` the old line(s) of that key give way to this one.
        A stored failure of the key always gives way."""
        line = json.dumps(to_jsonable(record), sort_keys=True, allow_nan=False)
        with self.lock():
            kept = []
            for existing in self._lines():
                key, failed = _key_of(existing)
                if key == record["key"]:
                    if not (replace or failed):
                        return False
                    continue
                kept.append(existing)
            atomic_write_text(self.path, "\n".join(kept + [line]) + "\n")
        return True


def _key_of(line: str) -> tuple[str | None, bool]:
    """(key, is a failure record) of a store line; (None, False) for a corrupt one."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None, False
    return (rec.get("key"), is_failure(rec)) if isinstance(rec, dict) else (None, False)


def record_failure(store: ResultsStore, *, key: str, point: dict, sweep: str | None,
                   error: BaseException, run_dir: str | os.PathLike) -> bool:
    """Store that the point `key` raised `error` while it ran (never over a finished record)."""
    record = {
        "schema": SCHEMA, "key": key, "status": FAILED, "sweep": sweep,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "run_dir": str(Path(run_dir).resolve()), "point": point,
        "error": f"{type(error).__name__}: {error}",
    }
    return store.append(record)


def _wandb_failed(e: Exception) -> None:
    warnings.warn(f"W&B logging failed ({type(e).__name__}: {e}); the local record is safe",
                  stacklevel=3)


def begin_wandb(head: dict, *, mode: str, project: str, entity: str | None,
                run_dir: str | os.PathLike):
    """Start the W&B run of a point before its work: `head` holds the record's "key", "sweep",
    "point" and "git" (its config). Returns the run, or None (disabled; on failure, warned)."""
    if mode == "disabled":
        return None
    try:
        import wandb

        pt = head["point"]
        name = f"{pt['policy']['name']}-{pt['kv_dtype']}-b{pt['policy'].get('budget')}-{pt['task']['name']}"
        return wandb.init(
            mode=mode, project=project, entity=entity, dir=str(run_dir), name=name,
            group=head.get("sweep") or None, job_type=pt["task"]["name"],
            config={"point": pt, "key": head["key"], "sweep": head.get("sweep"),
                    "git": head.get("git")},
            tags=[pt["policy"]["name"], pt["kv_dtype"], pt["task"]["name"]],
            # the config holds the checkout's git state (`git_info`); W&B's own probe of the
            # run directory only warned "git root ... does not exist" for every point
            reinit="finish_previous", settings=wandb.Settings(silent=True, disable_git=True),
        )
    except Exception as e:  # noqa: BLE001  (W&B must never lose the local record)
        _wandb_failed(e)
        return None


def log_wandb(record: dict, curves: dict, rows: list, *, mode: str, project: str,
              entity: str | None, run_dir: str | os.PathLike, run=None) -> str | None:
    """Log one run to W&B (config, summary metrics, per-step curves `{"step": [...], name:
    [...]}`, the summary table and the per-sample `rows`) and finish it. `run`: the point's run
    from `begin_wandb`, else one starts here. Runs call this through `kvjax.wandb_worker`, in a
    worker process.

    Returns the W&B run path, or None when disabled or on failure. Never raises: the local
    record is already written, so any W&B error is a warning.
    """
    if mode == "disabled":
        return None
    if run is None:
        run = begin_wandb(record, mode=mode, project=project, entity=entity, run_dir=run_dir)
        if run is None:
            return None
    try:
        import wandb

        try:
            curves = dict(curves)
            steps = curves.pop("step", None)
            if steps is not None:
                for i, step in enumerate(steps):
                    run.log({k: v[i] for k, v in curves.items()} | {"token": step}, step=i)
            summary = {k: v for k, v in record["metrics"].items() if isinstance(v, (int, float))}
            summary |= {f"cache/{k}": v for k, v in record["cache"].items()
                        if isinstance(v, (int, float))}
            summary |= {f"time/{k}": v for k, v in record["timings"].items()
                        if isinstance(v, (int, float))}
            run.summary.update(summary)
            row = summary_row(record)
            run.log({"summary_table": wandb.Table(columns=list(row), data=[list(row.values())])})
            if rows:
                cols = list(rows[0])
                run.log({"samples": wandb.Table(
                    columns=cols, data=[[str(r[c]) for c in cols] for r in rows])})
            path = run.path if mode == "online" else run.dir
        finally:
            run.finish()
        return path
    except Exception as e:  # noqa: BLE001  (W&B must never lose the local record)
        _wandb_failed(e)
        return None


def summary_row(record: dict) -> dict:
    """The flat table row of a record (the report and W&B use the same columns)."""
    pt, m, c, t = record["point"], record["metrics"], record["cache"], record["timings"]
    return {
        "task": pt["task"]["name"], "policy": pt["policy"]["name"],
        "kv_dtype": pt["kv_dtype"], "budget": pt["policy"].get("budget"),
        "metric": m["metric"], "value": m["value"], "baseline": m.get("baseline"),
        "delta": m.get("delta"), "kv_bytes": c["kv_bytes"], "total_bytes": c.get("total_bytes"),
        "closed_form_bytes": c["closed_form_bytes"], "compression": c["compression"],
        "prefill_s": t.get("prefill_s"), "decode_tok_s": t.get("decode_tok_s"),
        "key": record["key"],
    }
