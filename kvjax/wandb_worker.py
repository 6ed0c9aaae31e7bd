"""W&B logging in a worker process, off the run's cores and off its Python lock.

Offline W&B costs a run ~1.5 CPU-seconds before its first value is logged (wandb 0.31: import
~0.5 s, service setup ~0.2 s, `wandb.init` ~0.4 s). Done in the run's own process, even in a
background thread, that work competed with the model's XLA threads for two cores and held
Python's lock while the run dispatched its programs: the warm main job's task took 5.5 s with
W&B offline against 4.1 s with it disabled (docs/benchmarks.md). Here a worker process imports
W&B and starts its service; run.py starts it (`prestart`) before its own single-threaded imports,
so that work lands on the core those leave idle. Messages go to the worker as JSON lines on its
stdin: when a point starts (`begin`) the worker starts its W&B run (`wandb.init`) beside the
point's work; when the point's record is written (`submit`) the worker logs it and finishes the
run; a point that fails or is interrupted finishes as a failed run (exit code 1). The worker
warns on its stderr (the run's terminal) and never raises. A sweep's points hand their records
over and go on; `drain`, run at exit, closes the worker's stdin and waits until everything is
logged, so a run's W&B files are complete when its process ends.

Only the standard library is imported at module level: run.py imports this before JAX.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings

_proc: subprocess.Popen | None = None
_tmp: str | None = None  # the worker's TMPDIR, removed once it has exited
_NOT_BEGUN = object()  # the worker got no `begin` for a point it logs
_SKIP_FLAGS = {"-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc",
               "--shell-completion", "--version"}  # Hydra prints and exits: nothing to log


def disabled_by(argv: list[str]) -> bool:
    """The command line sets `wandb.mode=disabled` or only asks Hydra for help/config."""
    for a in argv:
        key, _, value = a.lstrip("+~").partition("=")
        if a in _SKIP_FLAGS or (key == "wandb.mode" and value.strip("'\"") == "disabled"):
            return True
    return False


def prestart(argv: list[str]) -> None:
    """Start the worker now, before the run's imports, unless the command line turns W&B off.
    A guess from the command line only: a config that disables W&B leaves the worker idle (it
    exits with the run); without it, a point's `begin` starts the worker."""
    if not disabled_by(argv):
        start()


def running() -> bool:
    return _proc is not None and _proc.poll() is None


def start() -> None:
    """Start the worker unless one is running (no-op where none can start: `submit` then logs
    in this process)."""
    global _proc, _tmp
    if running():
        return
    _remove_tmp()  # a worker that died left its folder
    remove_orphans()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import sys; sys.path.append({root!r}); from kvjax.wandb_worker import serve; serve()"
    try:
        # W&B makes temporary folders as it imports and removes them at interpreter exit,
        # which the worker skips (`serve`): they go with its own TMPDIR, removed by `drain`
        _tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-")
        # -P: the working directory (a checkout's top-level folders) shadows nothing of W&B's
        _proc = subprocess.Popen([sys.executable, "-P", "-c", code], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, text=True, encoding="utf-8",
                                 env={**os.environ, "TMPDIR": _tmp})
    except OSError as e:
        warnings.warn(f"W&B worker did not start ({e}); logging in this process", stacklevel=2)
        _proc = None
        _remove_tmp()
        return
    atexit.register(drain)


TMP_PREFIX = "kvjax-wandb-"  # + the pid of the run that made it + "-" + mkdtemp's letters


def remove_orphans(root: str | None = None) -> list[str]:
    """Remove the worker folders whose run is gone (killed before its exit handlers ran:
    SIGKILL, a launcher's worker process ended abruptly); returns their paths. A folder whose
    pid runs (its own run, or another run's) is kept."""
    root = root or tempfile.gettempdir()
    gone = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(TMP_PREFIX):].partition("-")[0]
            if not (name.startswith(TMP_PREFIX) and pid.isdigit()) or _alive(int(pid)):
                continue
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(os.path.join(root, name))
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process
        return True
    return True


def _remove_tmp() -> None:
    global _tmp
    tmp, _tmp = _tmp, None
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def _send(msg: dict) -> bool:
    """Write one message to the worker (started if needed); False where no worker takes it."""
    start()
    if not running():
        return False
    try:
        _proc.stdin.write(json.dumps(msg, default=_plain) + "\n")
        _proc.stdin.flush()
        return True
    except (OSError, ValueError):  # the worker died
        return False


def _sink(mode, project, entity, run_dir) -> dict:
    return {"mode": mode, "project": project, "entity": entity,
            "run_dir": os.path.abspath(run_dir)}


def begin(head: dict, *, mode: str, project: str, entity: str | None,
          run_dir: str | os.PathLike) -> None:
    """A point starts: the worker starts its W&B run now (`kvjax.results.begin_wandb`; `head`:
    the record's "key", "sweep", "point", "git"), beside the point's work rather than after it.
    Where no worker runs, `submit` logs everything in this process at the end."""
    if mode != "disabled":
        _send({"kind": "begin", "head": head, "sink": _sink(mode, project, entity, run_dir)})


def abort(key: str, mode: str) -> None:
    """The point `key` failed or was interrupted: its W&B run (if begun) finishes as failed."""
    if mode != "disabled" and running():
        _send({"kind": "abort", "key": key})


def submit(record: dict, result, *, mode: str, project: str, entity: str | None,
           run_dir: str | os.PathLike) -> None:
    """Hand one finished point to the worker and return; logged in this process where no
    worker takes it. `result`: the task's `TaskResult` (its curves and rows are logged)."""
    if mode == "disabled":
        return
    curves = dict(result.curves) if result is not None else {}
    rows = list(result.rows) if result is not None else []
    sink = _sink(mode, project, entity, run_dir)
    if _send({"kind": "log", "record": record, "curves": curves, "rows": rows, "sink": sink}):
        return
    from kvjax.results import log_wandb

    log_wandb(record, curves, rows, **sink)


def drain() -> None:
    """Wait until the worker has logged everything handed to it, and let it exit. Ctrl-C stops
    it (what it had not logged yet is lost to W&B; the local records are safe)."""
    global _proc
    proc, _proc = _proc, None
    if proc is None:
        return
    try:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.kill()
        proc.wait()
        print("interrupted: W&B logging stopped; the local records are safe", file=sys.stderr)
        return
    finally:
        _remove_tmp()
    if rc != 0:
        warnings.warn(f"W&B worker exited with status {rc}; some runs may be missing from W&B "
                      "(the local records are safe)", stacklevel=2)


def _plain(obj):
    """Numpy arrays and scalars as JSON values (NaN stays NaN, as W&B logs it)."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def serve() -> None:
    """The worker: import W&B and start its service, then act on each message from stdin:
    begin a point's run, log and finish it, or finish it as failed (an aborted point; at end
    of input, a point still open was interrupted)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's; it closes our stdin
    with contextlib.suppress(Exception):  # a failure shows up, as a warning, in begin_wandb
        import wandb

        wandb.setup()
        # what every wandb.init imports as its run starts (launch inputs: most of its time)
        importlib.import_module("wandb.sdk.launch.inputs.internal")
    from kvjax.results import begin_wandb, log_wandb

    begun = {}  # point key -> its W&B run (None: it failed to start, already warned)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["kind"] == "begin":
            begun[msg["head"]["key"]] = begin_wandb(msg["head"], **msg["sink"])
        elif msg["kind"] == "log":
            run = begun.pop(msg["record"]["key"], _NOT_BEGUN)
            if run is not None:  # not begun: log_wandb starts the run itself
                log_wandb(msg["record"], msg["curves"], msg["rows"], **msg["sink"],
                          run=None if run is _NOT_BEGUN else run)
        elif msg["kind"] == "abort":
            _finish_failed(begun.pop(msg["key"], None))
    for run in begun.values():
        _finish_failed(run)
    # every run has finished (its files are written): skip the interpreter's and W&B's teardown
    # (~0.25 s that the run's `drain` would wait for; W&B's service exits with this process)
    sys.stderr.flush()
    os._exit(0)


def _finish_failed(run) -> None:
    if run is not None:
        with contextlib.suppress(Exception):
            run.finish(exit_code=1)
