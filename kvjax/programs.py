"""Compiled programs kept on disk across runs, so that a warm run skips JAX's tracing too.

JAX's persistent compilation cache (`kvjax.harness.set_xla_cache`) skips XLA's compile, but
every process still traces and lowers each program before it can look one up: 7 s of the
19 s warm main job on a 2-core AVX2 box (docs/benchmarks.md, "Warm sweep point"). `stored_jit`
is `jax.jit` whose compiled executables are also written to a folder
(`jax.experimental.serialize_executable`) and loaded back by a later process without tracing.

A program's file name is a hash of everything that changes the executable: the function (its
name, line and closure), the sources of kvjax (and its policies and kernels), JAX's version and
options (this thread's too: matmul precision, x64), XLA_FLAGS, the device and the CPU's
instruction set, the static arguments and pytree metadata (by `repr` and by the classes they
are built of) and every argument's shape and dtype. Not stored: a function or a static's class
defined outside kvjax (the hash would not cover its code) and a static whose `repr` names an
object's address. The store is off until `set_program_store` names a folder (run.py does), and
serves one process on one device; under an outer trace, `stored_jit` is plain `jax.jit`. A
store that cannot be read or written warns and the run goes on without it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import os
import pickle
import re
import tempfile
import threading
import warnings
import weakref
from pathlib import Path

import jax
from jax._src import config as jax_config  # trace_context: what jit keys on
from jax.experimental import serialize_executable

_store: Path | None = None
_instances: weakref.WeakSet = weakref.WeakSet()
# programs "loaded", "compiled" (and stored), "deferred" (to the next run), "unstored"
stats: collections.Counter = collections.Counter()
STORE_MAX_BYTES = 2 << 30  # least recently used programs go past this

# Only executables XLA has just compiled are written: one that JAX loaded back from its own
# persistent cache serializes without its code on XLA:CPU (jax 0.10.2: "Function ..._fusion
# not found" when it runs). What a compile for the store passes to XLA (XLA's default value):
# it changes JAX's cache key, so that the program is compiled, never loaded from that cache.
FRESH = {"xla_embed_ir_in_executable": False}
_UNSTABLE = re.compile(r" at 0x[0-9a-f]+|object at ")
_NOT_IN_KEY = re.compile(r"cache|log|explain")  # JAX options that do not change a program


def set_program_store(path: str | os.PathLike | None) -> None:
    """Keep compiled programs of `stored_jit` functions in this folder (None: off)."""
    global _store
    _store = None if path is None else Path(os.path.expanduser(path))


def package_roots() -> dict[str, Path]:
    """kvjax's source folders, by the prefix they install under."""
    import kvjax
    import kvjax.kernels
    import kvjax.policies

    return {"kvjax": Path(kvjax.__file__).parent,
            "kvjax/policies": Path(kvjax.policies.__file__).parent,
            "kvjax/kernels": Path(kvjax.kernels.__file__).parent}


def source_sha256(roots: dict[str, Path]) -> str:
    """sha256 of the Python sources under each root (prefix -> folder), named as installed, so
    an editable and a regular install of the same code agree; a root nested in another counts
    once, under its own prefix."""
    nested = {r.resolve() for r in roots.values()}
    h = hashlib.sha256()
    for prefix, root in sorted(roots.items()):
        root = root.resolve()
        for f in sorted(root.rglob("*.py")):
            inner = f.parents[: len(f.relative_to(root).parents) - 1]  # folders below root
            if any(p in nested for p in inner):
                continue
            h.update(f"{prefix}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _machine() -> str:
    """What every program's key shares and a process cannot change: code, JAX, XLA flags, the
    device and, on CPU, the instruction set XLA compiles for (a store may be shared)."""
    import jaxlib

    dev = jax.devices()[0]
    return "\n".join([
        source_sha256(package_roots()), jax.__version__, jaxlib.__version__,
        os.environ.get("XLA_FLAGS", ""), dev.platform, dev.device_kind,
        getattr(dev.client, "platform_version", ""), _cpu_flags() if dev.platform == "cpu" else "",
    ])


def _cpu_flags() -> str:
    """The host CPU's feature flags (Linux; empty elsewhere, where the device kind stands)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    return ""


def _environment() -> str:
    """`_machine` and JAX's options now: global ones and this thread's (precision, x64...)."""
    return "\n".join([
        _machine(),
        repr(sorted((k, _stable_repr(v)) for k, v in jax.config.values.items()
                    if not _NOT_IN_KEY.search(k))),
        repr([_stable_repr(v) for v in jax_config.trace_context()]),
    ])


def _stable_repr(value) -> str:
    """repr, or the type's name where repr names an address (the same in every process)."""
    r = repr(value)
    return type(value).__qualname__ if _UNSTABLE.search(r) else r


_TRUSTED = ("builtins", "kvjax", "jax", "jaxlib", "numpy", "ml_dtypes")  # versions in the key


def _classes(obj, seen: set | None = None) -> set[str]:
    """The classes (module.qualname) an argument's value is built of, walking containers and
    dataclass fields: `repr` names a class by its qualified name only, and the key's code hash
    covers only kvjax's classes."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return set()
    seen.add(id(obj))
    cls = obj if isinstance(obj, type) else type(obj)
    found = {f"{cls.__module__}.{cls.__qualname__}"}
    if isinstance(obj, (tuple, list, set, frozenset)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    else:
        items = []
    for item in items:
        found |= _classes(item, seen)
    return found


def _node_data(treedef) -> list:
    """Every node's (type, metadata) in a pytree structure: a cache's policy and format ride
    in it as static metadata."""
    data = treedef.node_data()
    return [data, *(d for c in treedef.children() for d in _node_data(c))]


def _foreign(classes: set[str]) -> bool:
    return any(c.split(".", 1)[0] not in _TRUSTED for c in classes)


def clear_loaded() -> None:
    """Drop every program held in memory (with `jax.clear_caches`); the store keeps them."""
    for f in list(_instances):
        f._loaded.clear()


def _usable() -> bool:
    """The store serves this call: on, one process on one device, outside any trace, and none
    of JAX's modes an executable cannot honour (disable_jit, debug_nans/infs) is set."""
    from jax._src import core

    return (_store is not None and jax.process_count() == 1 and jax.device_count() == 1
            and core.trace_state_clean() and not jax.config.jax_disable_jit
            and not jax.config.jax_debug_nans and not jax.config.jax_debug_infs)


def _jax_cache_on() -> bool:
    return bool(jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache)


_local = threading.local()  # .events: this thread's JAX events while `_thread_events` runs
_listening = []  # our listener, once registered


def _count_event(event: str, **_) -> None:
    counts = getattr(_local, "events", None)
    if counts is not None:
        counts[event] += 1


@contextlib.contextmanager
def _thread_events():
    """JAX's monitoring events recorded in this thread inside the block, by name."""
    if not _listening:
        jax.monitoring.register_event_listener(_count_event)
        _listening.append(_count_event)
    _local.events = collections.Counter()
    try:
        yield _local.events
    finally:
        _local.events = None


@contextlib.contextmanager
def _no_persistent_write():
    """JAX's cache does not keep what `FRESH` compiles under a key no one asks for again
    (its write floor raised, in this thread only, where this JAX has that option)."""
    from jax._src import config

    floor = getattr(config, "persistent_cache_min_compile_time_secs", None)
    with floor(float("inf")) if floor is not None else contextlib.nullcontext():
        yield


def _type_of(x) -> tuple:
    """A leaf's shape, dtype, weak type and memory: what a program is compiled for here (one
    device). Not its aval: under jax 0.12 the arrays a loaded program returns carry avals with
    another layout object (equal by repr, not by identity), so every call fed them missed the
    programs held in memory and loaded the same file again. An Array's aval is cached on it
    (`typeof` of every leaf cost ~5x the decode dispatch)."""
    a = x.aval if isinstance(x, jax.Array) else jax.typeof(x)
    return a.shape, a.dtype, a.weak_type, getattr(a, "memory_space", None)


class StoredJit:
    """`jax.jit(fun, static_argnames=..., donate_argnames=...)`, its executables kept on disk
    (see the module docstring). `.compile(*args)` compiles (or loads) without running;
    `.lower`, `.trace` and the rest are the jitted function's."""

    def __init__(self, fun, static_argnames=(), donate_argnames=()):
        self.jitted = jax.jit(fun, static_argnames=static_argnames,
                              donate_argnames=donate_argnames)
        self._signature = inspect.signature(fun)
        self._static = frozenset(static_argnames)
        self._name = f"{fun.__module__}.{fun.__qualname__}"
        self._loaded: dict = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fun)
        _instances.add(self)

    def __getattr__(self, name):
        return getattr(self.jitted, name)

    @functools.cached_property
    def _identity(self) -> str | None:
        """The function as keys name it (qualified name, line, closure); None where its file is
        outside kvjax's sources, which the key's code hash covers."""
        code = self.__wrapped__.__code__
        where = Path(code.co_filename).resolve()
        if not any(where.is_relative_to(r.resolve()) for r in package_roots().values()):
            return None
        return f"{self._name}:{code.co_firstlineno} {self._cells!r}"

    @functools.cached_property
    def _cells(self) -> list:
        return [c.cell_contents for c in self.__wrapped__.__closure__ or ()]

    def __call__(self, *args, **kwargs):
        compiled, dynamic = self._program(args, kwargs)
        if compiled is None:
            return self.jitted(*args, **kwargs)
        return compiled(**dynamic)

    def compile(self, *args, **kwargs):
        """Compile (or load) the program for these arguments without running it."""
        compiled, _ = self._program(args, kwargs)
        return compiled if compiled is not None else self.jitted.lower(*args, **kwargs).compile()

    def _program(self, args, kwargs):
        """(the stored program for these arguments, the dynamic ones by name), or (None, None)
        where the store does not serve them."""
        if not _usable():
            return None, None
        _machine()  # its first call imports kvjax's policies and kernels, hence Pallas, whose
        # options (jax 0.12) join the trace context: before the key, not between two calls
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        static = tuple((k, v) for k, v in bound.arguments.items() if k in self._static)
        dynamic = {k: v for k, v in bound.arguments.items() if k not in self._static}
        leaves, treedef = jax.tree.flatten(dynamic)
        types = tuple(_type_of(x) for x in leaves)
        key = (static, treedef, types, jax_config.trace_context())  # precision, x64
        compiled = self._loaded.get(key)
        if compiled is None:
            with self._lock:
                compiled = self._loaded.get(key) or self._load_or_compile(bound, static,
                                                                          treedef, types)
                self._loaded[key] = compiled
        return compiled, dynamic

    def _load_or_compile(self, bound, static, treedef, types):
        classes = _classes([static, _node_data(treedef), self._cells])
        described = "\n".join([str(self._identity), repr(static), str(treedef), repr(types),
                               repr(sorted(classes))])
        digest = hashlib.sha256(f"{_environment()}\n{described}".encode()).hexdigest()
        path = _store / f"{self._name.rsplit('.', 1)[-1]}-{digest[:32]}.pkl"
        if self._identity is None or _UNSTABLE.search(described) or _foreign(classes):
            # no key that another process could trust or recognize: a class outside kvjax
            # (its code is not hashed), an address in a repr
            stats["unstored"] += 1
            return self.jitted.trace(**bound.arguments).lower().compile()
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            with contextlib.suppress(OSError):  # its last use, for the size limit
                os.utime(path)
            stats["loaded"] += 1
            return compiled
        except FileNotFoundError:
            pass
        except OSError as e:  # the store cannot be read: compile, as without it
            _store_failed(e)
        except Exception:  # noqa: BLE001  (unreadable or from another build: compile again)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        lowered = self.jitted.trace(**bound.arguments).lower()
        seen = path.with_suffix(".seen")
        if _jax_cache_on() and not _exists(seen):
            # A program whose code is new to the store (kvjax was edited) may still be in JAX's
            # cache: take it from there for this run, and store it only if JAX compiled it
            # afresh (it wrote it). Else the next run compiles it afresh and stores it: the
            # first run after an edit costs no more than before the store existed.
            with _thread_events() as events:
                compiled = lowered.compile()
            if not events["/jax/compilation_cache/cache_misses"]:
                _write(seen, b"")
                stats["deferred"] += 1
                return compiled
        else:
            with _no_persistent_write():
                compiled = lowered.compile(compiler_options=FRESH)
        with contextlib.suppress(OSError):
            seen.unlink(missing_ok=True)
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
        except jax.errors.JaxRuntimeError:
            # XLA:CPU cannot serialize some executables once they have run ("`LessThan` is not
            # serializable", a sort's comparator): JAX hands back one it compiled before in
            # this process when another key lowers to the same program. The next process
            # compiles it afresh and stores it.
            stats["unserializable"] += 1
            return compiled
        if _write(path, data):
            stats["compiled"] += 1
        return compiled


def _store_failed(error: OSError) -> None:
    """The store's folder cannot be read or written (permissions, a full disk): say so, once
    per place, and go on without it."""
    warnings.warn(f"program store {_store}: {error}; compiling without it", stacklevel=3)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError as e:
        _store_failed(e)
        return True  # (a `.seen` marker: compile afresh, which is always right)


def _write(path: Path, data: bytes) -> bool:
    """Write atomically (readable by all, for a store shared between users), then drop the
    least recently used programs past `STORE_MAX_BYTES`. False where the write failed."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as f:
            tmp = f.name
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _store_failed(e)
        return False
    held = []
    for p in path.parent.glob("*.pkl"):
        with contextlib.suppress(OSError):  # another process may be dropping it
            st = p.stat()
            held.append((st.st_mtime, st.st_size, p))
    total = 0
    for _, size, p in sorted(held, reverse=True):
        total += size
        if total > STORE_MAX_BYTES and p != path:
            with contextlib.suppress(OSError):
                p.unlink(missing_ok=True)
    return True


def stored_jit(fun=None, *, static_argnames=(), donate_argnames=()):
    """Decorator: `StoredJit` of `fun` (as `functools.partial(jax.jit, ...)` would be used)."""
    if fun is None:
        return functools.partial(stored_jit, static_argnames=static_argnames,
                                 donate_argnames=donate_argnames)
    return StoredJit(fun, static_argnames, donate_argnames)
