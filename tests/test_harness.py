"""run.py and the harness: Hydra configs, pre-load checks, point keys, end-to-end runs on the
tiny model, baselines, skipping, W&B, the CLI, and a killed-then-resumed sweep."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from kvjax import experiment, harness, wandb_worker
from kvjax.experiment import ConfigError, plan
from kvjax.policies import get_policy
from kvjax.results import ResultsStore
from kvjax.tasks.text import DEFAULT_SOURCE, default_text, sha256_text

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `experiments` is a top-level folder, importable from the root
    sys.path.insert(0, str(ROOT))
TINY = ["model=tiny", "task.length=64", "task.chunk=16", "speed.prompt=0",
        "wandb.mode=disabled"]


def cfg_of(*overrides):
    with initialize_config_dir(str(harness.CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def spec_of(*overrides, tmp=None):
    extra = [f"results={tmp}/results.jsonl"] if tmp is not None else []
    return harness.spec_from_config(cfg_of(*overrides, *extra))


def no_omegaconf(obj) -> bool:
    if isinstance(obj, (DictConfig, ListConfig)):
        return False
    if dataclasses.is_dataclass(obj):
        return all(no_omegaconf(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return all(no_omegaconf(x) for x in obj)
    if isinstance(obj, dict):
        return all(no_omegaconf(x) for x in obj.values())
    return True


# ----------------------------------------------------------------------------- configs


def test_defaults_compose_to_a_frozen_spec():
    cfg = cfg_of()
    assert cfg.model.name == "smollm2-135m" and cfg.policy.name == "full"
    assert cfg.task.name == "perplexity" and cfg.task.length == 1024 and cfg.task.chunk == 128
    assert cfg.kv_dtype == "f32" and cfg.budget is None and cfg.max_len is None
    assert cfg.wandb.mode == "offline" and cfg.results == "results/results.jsonl"
    spec = harness.spec_from_config(cfg)
    assert spec.results == str(Path("results/results.jsonl").resolve())
    assert no_omegaconf(spec) and hash(spec.task) and hash(spec.model)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kv_dtype = "int4"


def test_every_task_and_policy_config_composes():
    for task in ("perplexity", "passkey", "needle", "agreement"):
        spec = spec_of(f"task={task}")
        assert spec.task.name == task
    names = sorted(p.stem for p in (ROOT / "configs" / "policy").glob("*.yaml"))
    assert {"full", "window"} <= set(names)
    for name in names:  # a file is its policy, or a setting of one (h2o_kvpress is h2o)
        assert spec_of(f"policy={name}").policy == name.split("_kvpress")[0]
    assert spec_of("+experiment=pareto").sweep == "pareto"


@pytest.mark.parametrize("override, words", [
    ("foo=1", ["foo"]),
    ("task.lenght=5", ["lenght"]),
    ("policy=nope", ["policy/nope", "full"]),
    ("task=nope", ["task/nope", "perplexity"]),
    ("budget=abc", ["budget", "abc"]),
])
def test_hydra_rejects_unknown_keys_options_and_types(override, words):
    with pytest.raises((HydraException, OmegaConfBaseException)) as e:
        cfg_of(override)
    assert all(w in str(e.value) for w in words)


@pytest.mark.parametrize("overrides, pattern", [
    (["kv_dtype=int3"], r"unknown kv_dtype 'int3'; valid choices: bf16, f32, fp8, int2, int4, int8"),
    (["policy=lru", "budget=2048"], r"budget=2048 is above the length of task 'perplexity' \(1024"),
    (["policy=lru", "budget=1024"], r"budget=1024 equals the length of task 'perplexity' \(1024"),
    (["policy=snapkv"], r"mode=compress.*'perplexity' has no prompt.*needle, passkey, qa\)"),
    (["policy=snapkv", "task=serve", "task.n_requests=4"],
     r"task 'serve' runs its policy in mode=evict only .*\(needle, passkey, qa\) or a policy"),
    (["policy=h2o", "policy.mode=stream"], r"mode='stream' is not one of \('evict', 'compress'\)"),
    (["policy=snapkv", "policy.mode=evict", "task=passkey"],
     r"policy 'snapkv' cannot run mode='evict'.*its modes: compress"),
    (["policy=h2o", "budget=64", "ratio=0.5"], r"give budget= or ratio=, not both"),
    (["policy=h2o", "ratio=1.5"], r"ratio=1.5 must be in \[0, 1\)"),
    (["policy=full", "ratio=1.5"], r"ratio=1.5 must be in \[0, 1\)"),
    (["policy=full", "budget=-5"], r"budget=-5 must be a positive integer"),
    (["seed=-1", "task=passkey", "task.length=256"], r"seed=-1 must be a non-negative integer"),
    (["cache.layout=paged", "cache.num_pages=2", "policy=window", "budget=64", "task.length=256"],
     r"num_pages=2 \(32 slots\) cannot hold one row: policy 'window' .* needs \d+ pages"),
    (["policy=h2o", "ratio=0.5", "task=needle"], r"ratio=0.5 with mode=evict needs one prompt"),
    (["model.name=nope"], r"unknown model 'nope'; registered models: smollm2-135m"),
    (["task.text_file=/no/such.txt"], r"no such file"),
    (["wandb.mode=sometimes"], r"wandb.mode='sometimes'; valid choices: offline, online"),
    (["+policy.windw=3", "policy=lru"], r"policy 'lru' has no option\(s\) \['windw'\]"),
    (["max_len=100"], r"max_len=100 is shorter than task 'perplexity' needs \(1024"),
])
def test_bad_combinations_fail_before_the_model_loads(overrides, pattern, monkeypatch):
    monkeypatch.setattr(experiment, "load", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=pattern):
        plan(spec_of("model=tiny", *overrides))


@pytest.mark.parametrize("overrides, pattern", [
    (["task=passkey", "task.length=20"], (r"task 'passkey': length=20 is too short for the "
                                         r"prompt's fixed parts \(\d+ tokens\); use length >= ")),
    (["task=needle", "task.lengths=[20]"], r"task 'needle': length 20 is too short"),
])
def test_prompt_that_cannot_be_built_fails_before_the_model_loads(overrides, pattern, tmp_path,
                                                                  monkeypatch):
    """Token counts need the tokenizer only: it is read without the weights."""
    monkeypatch.setattr(experiment, "load", lambda *a: pytest.fail("the model was loaded"))
    spec = spec_of("model=tiny", "wandb.mode=disabled", *overrides, tmp=tmp_path)
    with pytest.raises(ConfigError, match=pattern):
        experiment.run(spec, tmp_path / "run")
    assert not (tmp_path / "results.jsonl").exists()


def test_main_exits_with_the_error_message(capsys, monkeypatch):
    monkeypatch.setattr(experiment, "load", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        harness.main(cfg_of("kv_dtype=int3"))
    assert e.value.code == 2
    assert "error: unknown kv_dtype 'int3'" in capsys.readouterr().err


def test_main_stores_a_failure_after_planning_and_raises_it(tmp_path, monkeypatch):
    """A run that fails after `plan` leaves a failure record with the point's key; a bad
    config (refused by `plan`, or a single run's prompt check) leaves nothing."""
    def boom(spec, run_dir, echo=print):
        raise RuntimeError("device out of memory")

    monkeypatch.setattr(harness, "run", boom)
    cfg = cfg_of(*TINY, f"results={tmp_path}/r.jsonl")
    with pytest.raises(RuntimeError, match="device out of memory"):
        harness.main(cfg)
    (failed,) = ResultsStore(tmp_path / "r.jsonl").records()
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: device out of memory"
    assert failed["key"] == plan(harness.spec_from_config(cfg)).key
    with pytest.raises(SystemExit):
        harness.main(cfg_of(*TINY, "kv_dtype=int3", f"results={tmp_path}/bad.jsonl"))
    monkeypatch.setattr(harness, "run", lambda *a: experiment.run(spec_of(
        *TINY, "task=passkey", "task.length=20", tmp=tmp_path), tmp_path / "run"))
    with pytest.raises(SystemExit) as e:  # one run's bad input found after planning
        harness.main(cfg_of(*TINY, f"results={tmp_path}/bad.jsonl"))
    assert e.value.code == 2 and not (tmp_path / "bad.jsonl").exists()


def test_point_key_ignores_volatile_settings_and_dedupes_equivalent_points(tmp_path):
    key = lambda *o: plan(spec_of("model=tiny", *o)).key
    base = key("policy=lru", "kv_dtype=int4")
    assert base == key("policy=lru", "kv_dtype=int4", "wandb.mode=disabled", "force=true",
                       f"results={tmp_path}/x.jsonl", "progress=false", "xla_cache=null")
    assert base == key("policy=lru", "kv_dtype=int4", "budget=256")  # the policy's default
    assert base != key("policy=lru", "kv_dtype=int4", "budget=128")
    assert base != key("policy=lru", "kv_dtype=int4", "sweep=s1")
    assert base != key("policy=lru", "kv_dtype=int8")
    assert base != key("policy=lru", "kv_dtype=int4", "task.chunk=64")
    assert key("policy=full") == key("policy=full", "budget=128")  # full ignores budget
    # with no prompt the speed probe does not run: its token count changes nothing
    assert key("speed.prompt=0") == key("speed.prompt=0", "speed.new_tokens=8")
    assert key("speed.prompt=0") != key("speed.prompt=32")
    assert key("speed.prompt=32") != key("speed.prompt=32", "speed.new_tokens=8")
    p = plan(spec_of("model=tiny", "policy=full", "budget=128"))
    assert p.policy.budget is None and "ignored" in p.notes[0]


def test_a_chunk_at_least_the_budget_is_noted_before_the_run():
    """Streaming eviction acts between chunks and a chunk attends to itself, so with
    task.chunk >= budget the budget barely binds (an audit measured delta +0.0085 at chunk 128
    against +1.56 at chunk 1, budget 64): the plan says so, and not below the budget."""
    notes = lambda *o: [n for n in plan(spec_of("model=tiny", "task.length=256", *o)).notes
                        if "task.chunk=" in n]
    (note,) = notes("policy=streaming", "budget=64", "task.chunk=128")
    assert "task.chunk=128 >= budget=64" in note and "up to 191" in note
    assert notes("policy=streaming", "budget=64", "task.chunk=1") == []
    assert notes("policy=streaming", "budget=64", "task.chunk=32") == []
    assert notes("policy=full", "task.chunk=128") == []


def test_point_key_is_the_content_of_text_format_and_code(tmp_path, monkeypatch):
    """Editing a text file makes a new point; the same text under another path, `length=all`
    and its count, `int4` and `int4` with its default options spelled out are one point."""
    text = "Some plain prose, written twice. " * 20  # 660 characters = tokens of `tiny`
    a, b = tmp_path / "a.txt", tmp_path / "sub" / "b.txt"
    b.parent.mkdir()
    a.write_text(text)
    b.write_text(text)
    key = lambda *o: plan(spec_of("model=tiny", "task.length=640", *o)).key
    ka = key(f"task.text_file={a}")
    assert ka == key(f"task.text_file={b}")
    a.write_text(text.replace("prose", "verse"))
    assert key(f"task.text_file={a}") != ka
    assert key(f"task.text_file={b}", "task.length=all") == key(f"task.text_file={b}",
                                                                "task.length=660")
    assert key("kv_dtype=int4") == key("kv_dtype=int4", "+kv_options.group=64",
                                       "+kv_options.residual=64", "+kv_options.value_group=64")
    assert key("kv_dtype=int4") != key("kv_dtype=int4", "+kv_options.group=32")
    # per-token keys keep no residual: a residual setting there changes nothing, and no key
    token = key("kv_dtype=int4", "+kv_options.key_mode=token")
    assert token == key("kv_dtype=int4", "+kv_options.key_mode=token", "+kv_options.residual=128")
    assert key("kv_dtype=int4") != key("kv_dtype=int4", "+kv_options.residual=128")
    p = plan(spec_of("model=tiny", f"task.text_file={b}", "task.length=all"))
    pt = p.point
    assert p.spec.task.length == 660 and pt["task"]["length"] == 660
    assert pt["text"] == {"sha256": sha256_text(text), "n_tokens": 660}
    assert "text_file" not in pt["task"] and str(tmp_path) not in json.dumps(pt)
    assert pt["format"] == {"name": "f32"} and pt["model"]["name"] == "tiny"
    assert pt["code"]["version"] == "0.1.0" and len(pt["code"]["source_sha256"]) == 16
    # and the JAX that compiled it, on which backend: another JAX moves the numbers
    assert pt["code"]["jax"] == jax.__version__ and pt["code"]["backend"] == "cpu"
    experiment.code_identity.cache_clear()
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    try:
        assert key() != plan(spec_of("model=tiny")).key
    finally:
        monkeypatch.undo()
        experiment.code_identity.cache_clear()
    # the default text enters by content too (it used to differ between Python versions)
    assert plan(spec_of("model=tiny")).point["text"]["sha256"] == sha256_text(default_text())
    monkeypatch.setattr(experiment, "load_text", lambda f: ("other words " * 200, "x"))
    assert plan(spec_of("model=tiny")).key != key()
    monkeypatch.undo()
    # the code: a changed source file changes its hash (editable and regular installs agree)
    src = tmp_path / "pkg"
    (src / "policies").mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")
    (src / "policies" / "p.py").write_text("y = 2\n")
    h = experiment.source_sha256({"kvjax": src, "kvjax/policies": src / "policies"})
    flat_k, flat_p = tmp_path / "k", tmp_path / "p"  # an editable install's layout
    flat_k.mkdir()
    flat_p.mkdir()
    (flat_k / "a.py").write_text("x = 1\n")
    (flat_p / "p.py").write_text("y = 2\n")
    assert experiment.source_sha256({"kvjax": flat_k, "kvjax/policies": flat_p}) == h
    (src / "a.py").write_text("x = 2\n")
    assert experiment.source_sha256({"kvjax": src, "kvjax/policies": src / "policies"}) != h


def test_allow_dirty_false_refuses_uncommitted_code(monkeypatch):
    monkeypatch.setattr(experiment, "git_info", lambda **kw: {"commit": "c" * 40, "dirty": True})
    with pytest.raises(ConfigError, match="allow_dirty=false and the kvjax checkout has "
                                          "uncommitted code changes"):
        plan(spec_of("model=tiny", "allow_dirty=false"))
    assert plan(spec_of("model=tiny")).key  # the default runs, its key covers the source


@pytest.mark.slow
def test_model_key_is_the_file_content_not_its_path(tmp_path):
    """A link to the cached GGUF and the registered name are one model; its sha256 is pinned."""
    from kvjax.loading import MODELS, fetch_model

    link = tmp_path / "m.gguf"
    link.symlink_to(fetch_model("smollm2-135m"))
    by_name = plan(spec_of("task.length=64")).point["model"]
    assert plan(spec_of(f"model.name={link}", "task.length=64")).point["model"] == by_name
    assert by_name["sha256"] == MODELS["smollm2-135m"].sha256 and by_name["name"] == "smollm2-135m"


def run_py(*args, cwd, timeout=300, **kw):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, check=False, **kw)


def _bad_input(case: str, tmp_path: Path) -> tuple[list[str], str]:
    """(overrides, the error's pattern) of each bad input that used to give a traceback."""
    if case == "empty text":
        (tmp_path / "empty.txt").write_text("")
        return [f"task.text_file={tmp_path / 'empty.txt'}"], r"empty.txt' has 0 token\(s\)"
    if case == "short text":
        (tmp_path / "short.txt").write_text("x" * 201)
        return ([f"task.text_file={tmp_path / 'short.txt'}", "task.length=1024"],
                (r"task.length=1024 but task.text_file=.*short.txt' has only 201 tokens; use "
                 r"task.length<=201, or task.length=all"))
    if case == "group vs head dim":
        return (["kv_dtype=int4", "+kv_options.group=48"],
                r"group=48 must divide the head dim E=64.*head dim 64")
    if case == "directory as model":
        return [f"model.name={tmp_path}"], r"is a directory but not a HF checkpoint"
    if case == "corrupt gguf":
        (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(60))
        return ([f"model.name={tmp_path / 'm.gguf'}"],
                r"m.gguf' ?: cannot read its header: .* \(truncated or corrupt\?\)")
    assert case == "length word"
    return ["task.length=most"], r"length='most' must be a positive integer or 'all'"


BAD_INPUTS = ["empty text", "short text", "group vs head dim", "directory as model",
              "corrupt gguf", "length word"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_a_config_error_before_the_model_loads(case, tmp_path, monkeypatch):
    overrides, pattern = _bad_input(case, tmp_path)
    monkeypatch.setattr(experiment, "load", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=pattern):
        experiment.run(spec_of("model=tiny", *overrides, tmp=tmp_path), tmp_path / "run")
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_from_run_py_is_one_line_and_exit_code_2(case, tmp_path):
    overrides, pattern = _bad_input(case, tmp_path)
    out = run_py("model=tiny", *overrides, "wandb.mode=disabled", f"results={tmp_path}/r.jsonl",
                 f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert re.search(pattern, lines[0]) and not (tmp_path / "r.jsonl").exists()


def test_schemas_are_not_choices_of_their_groups():
    """`model=model_schema` / `task=perplexity_schema` are not options (they used to be)."""
    for override, group, real in (("model=model_schema", "model", {"smollm2-135m", "tiny"}),
                                  ("task=perplexity_schema", "task", {"perplexity", "needle"})):
        with pytest.raises(HydraException) as e:
            cfg_of(override)
        options = str(e.value).split(f"Available options in '{group}':")[1].split("Config")[0]
        assert real <= set(options.split()) and "_schema" not in options
    assert cfg_of("model=tiny").model.init_seed == 0  # the schema still types the group
    with pytest.raises((HydraException, OmegaConfBaseException), match="init_seed=abc"):
        cfg_of("model=tiny", "model.init_seed=abc")


SHIPPED_MODELS = sorted(p.stem for p in (ROOT / "configs" / "model").glob("*.yaml"))


@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m != "tiny" else m
                                   for m in SHIPPED_MODELS])
def test_every_format_fits_every_shipped_model_at_its_defaults(model, monkeypatch):
    """plan sizes the cache on the model's real head dim (`model=tiny kv_dtype=int4` failed with
    int4's default group 64 on the tiny model's head dim 32)."""
    from kvjax.formats import FORMATS

    monkeypatch.setattr(experiment, "load", lambda *a: pytest.fail("the model was loaded"))
    for fmt in sorted(FORMATS):
        for policy in ("full", "h2o"):
            plan(spec_of(f"model={model}", f"kv_dtype={fmt}", f"policy={policy}"))


def test_ctrl_c_is_one_line_records_nothing_and_keeps_the_store(tmp_path, monkeypatch, capsys):
    store = tmp_path / "results.jsonl"
    store.write_text('{"key": "old"}\n')
    before = store.read_bytes()

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "load", interrupted)
    with pytest.raises(SystemExit) as e:
        harness.main(cfg_of(*TINY, f"results={store}"))
    assert e.value.code == 130
    assert capsys.readouterr().err.splitlines() == [
        "interrupted: this point was not recorded; the results store is intact"]
    assert store.read_bytes() == before


def test_ctrl_c_swallowed_by_a_finalizer_still_stops_the_run(tmp_path, monkeypatch, capsys):
    """Python raises a SIGINT's KeyboardInterrupt at whatever bytecode runs next; inside a
    finalizer (or a gc callback: JAX has one) it is only printed, as an "Exception ignored"
    traceback, and the run went on to the end. The run now stops at the task's next step,
    status 130, nothing recorded, no traceback, and its SIGINT and unraisable hooks are undone."""
    from kvjax.tasks import base

    unraisable = []
    record = unraisable.append
    monkeypatch.setattr(sys, "unraisablehook", record)

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    class Bar(base.Progress):
        def __iter__(self):
            for i, item in enumerate(super().__iter__()):
                if i == 1:  # of 4 chunks
                    Finalized()  # its __del__ runs (and swallows the interrupt) right here
                yield item

    monkeypatch.setattr(base, "Progress", Bar)
    store = tmp_path / "r.jsonl"
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with pytest.raises(SystemExit) as e:
            harness.main(cfg_of(*TINY, f"results={store}"))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert sys.unraisablehook is record
        assert not base.INTERRUPTED.is_set()  # or the worker's next task would stop at once
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert e.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "interrupted: this point was not recorded; the results store is intact")
    assert not store.exists()
    assert unraisable == []


@pytest.mark.parametrize("sig, status, head", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "stopped by SIGTERM")])
def test_ctrl_c_during_a_run_py_task(tmp_path, sig, status, head):
    """SIGINT while the task streams (its progress bar is on screen): one line, status 130.
    SIGTERM (a scheduler's stop, `kill`) the same, status 143; it used to end the process with
    no line and leave the W&B worker's temporary folder behind."""
    store = tmp_path / "r.jsonl"
    store.write_text('{"key": "old"}\n')
    err = tmp_path / "err.txt"
    # a terminal's Ctrl-C: the child starts with SIGINT handled, even if this process inherited
    # it ignored (an ignored SIGINT passes on to a child: CI's workers had one)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "run.py"), "model=tiny", "task.length=30000",
             "task.chunk=1", "progress=true", "speed.prompt=0", "wandb.mode=disabled",
             f"results={store}", f"hydra.run.dir={tmp_path}/run", "xla_cache=null"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=f,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        signal.signal(signal.SIGINT, inherited)
        deadline = time.time() + 240
        while time.time() < deadline and "perplexity (full)" not in err.read_text():
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(sig)
        try:
            assert proc.wait(timeout=60) == status
        except subprocess.TimeoutExpired:  # show where it hangs: faulthandler's dump on SIGABRT
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            pytest.fail(f"run.py did not exit within 60 s of {sig.name}; its stderr ends:\n"
                        + err.read_text()[-6000:])
    text = err.read_text()
    assert "Traceback" not in text
    assert text.rstrip().splitlines()[-1].endswith(
        f"{head}: this point was not recorded; the results store is intact")
    assert store.read_text() == '{"key": "old"}\n'


def test_xla_cache_keeps_programs_over_the_compile_time_floor(tmp_path):
    """run.py's cache: its folder, and only programs that compile in >= 0.5 s (loading small
    XLA:CPU executables back crashed a test worker; see XLA_CACHE_MIN_COMPILE_S)."""
    import jax

    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        harness.set_xla_cache(str(tmp_path / "x"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "x")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_xla_cache_follows_kvjax_cache(tmp_path, monkeypatch):
    """Beside the models, in a folder named by the compile-time floor (a folder written with
    another floor may hold programs this one would not load)."""
    folder = f"xla-{harness.XLA_CACHE_MIN_COMPILE_S}s"
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "c"))
    assert cfg_of().xla_cache == str(tmp_path / "c" / folder)
    assert cfg_of().program_store == str(tmp_path / "c" / "programs")
    monkeypatch.delenv("KVJAX_CACHE")
    assert cfg_of().xla_cache == str(Path.home() / ".cache" / "kvjax" / folder)


def test_a_later_run_loads_its_programs_and_records_the_same_numbers(tmp_path, monkeypatch):
    """run.py's `program_store`: by the third run of a point (each a new process: nothing
    compiled in memory) the task's, prefill's and decode's programs all load from the store.
    The first stores those XLA compiled afresh; the second, those JAX's cache served first."""
    import jax

    from kvjax.programs import clear_loaded

    monkeypatch.chdir(tmp_path)
    store = ResultsStore(tmp_path / "r.jsonl")
    runs = []
    for _ in range(3):
        clear_loaded()
        jax.clear_caches()
        harness.main(cfg_of(*[o for o in TINY if not o.startswith("speed.")], "speed.prompt=8",
                            "speed.new_tokens=2", f"results={store.path}", "force=true",
                            f"program_store={tmp_path}/programs", "xla_cache=null"))
        runs.append(store.records()[-1])
    first, second, third = (r["timings"]["programs"] for r in runs)
    n = first.get("compiled", 0) + first.get("deferred", 0)
    assert n >= 5 and "loaded" not in first  # the chunk step, prefill, decode, ...
    want = {"loaded": first.get("compiled", 0), "compiled": first.get("deferred", 0)}
    assert second == {k: v for k, v in want.items() if v}
    assert third == {"loaded": n}
    assert runs[0]["metrics"] == runs[1]["metrics"] == runs[2]["metrics"]


# ----------------------------------------------------------------------------- running


def test_record_dirty_flag_is_uncommitted_code_not_other_files(tmp_path, monkeypatch):
    """A record's `git.dirty` reads the checkout as `allow_dirty` does: uncommitted code under
    kvjax/, policies/, kernels/ or run.py, not a results file or notes beside them."""
    import subprocess

    repo = tmp_path / "repo"
    (repo / "kvjax").mkdir(parents=True)
    (repo / "kvjax" / "a.py").write_text("x = 1\n")

    def git(*args):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    (repo / "results.jsonl").write_text("{}\n")  # a run's output, untracked
    assert experiment.git_info(repo)["dirty"] is True
    assert experiment.git_info(repo, code_only=True)["dirty"] is False
    (repo / "kvjax" / "a.py").write_text("x = 2\n")
    assert experiment.git_info(repo, code_only=True)["dirty"] is True

    monkeypatch.setattr(experiment, "git_info", lambda repo=None, code_only=False: {
        "commit": "c" * 40, "dirty": not code_only})  # other files changed, no code
    rec = experiment.run(spec_of(*TINY, tmp=tmp_path), tmp_path / "run0", echo=lambda s: None)
    assert rec.record["git"] == {"commit": "c" * 40, "dirty": False}

def test_end_to_end_records_baseline_cache_skip_and_force(tmp_path):
    lines = []
    full = spec_of(*TINY, tmp=tmp_path)
    out = experiment.run(full, tmp_path / "run0", echo=lines.append)
    rec = out.record
    assert out.stored and rec["metrics"]["baseline_source"] == "this run"
    assert rec["metrics"]["delta"] == 0.0 and rec["metrics"]["metric"] == "perplexity"
    c = rec["cache"]
    assert c["kv_bytes"] == c["payload_bytes"] == 2 * 2 * 2 * 64 * 64 * 4  # 2·L·Hkv·D·T·4
    assert c["closed_form_bytes"] == c["total_bytes"] == c["kv_bytes"] + 2 * 2 * 64 * 4 + 4 + 2
    assert rec["cache"]["compression"] == 1.0
    assert rec["config"]["task"]["length"] == 64 and rec["config"]["wandb"]["mode"] == "disabled"
    assert rec["git"]["commit"] is None or len(rec["git"]["commit"]) == 40
    assert rec["env"]["versions"]["jax"] and rec["text"]["source"] == DEFAULT_SOURCE
    assert len(rec["text"]["sha256"]) == 64
    saved = json.loads((tmp_path / "run0" / "metrics.json").read_text())
    assert saved["key"] == rec["key"] and saved["metrics"] == rec["metrics"]
    nll = np.load(tmp_path / "run0" / "nll.npy")
    assert nll.dtype == np.float32 and nll.shape == (63,)
    assert np.exp(nll.mean(dtype=np.float64)) == pytest.approx(rec["metrics"]["perplexity"])
    table = "\n".join(lines)
    for word in ("perplexity", "full cache", "delta", "cache bytes (measured)",
                 "cache bytes (closed form)", "payload", "compression", "prefill / decode"):
        assert word in table

    win = spec_of(*TINY, "policy=window", "budget=16", "kv_dtype=bf16", tmp=tmp_path)
    rec2 = experiment.run(win, tmp_path / "run1", echo=lines.append).record
    m = rec2["metrics"]
    assert m["baseline_source"] == "cache" and m["baseline"] == rec["metrics"]["value"]
    assert m["delta"] == pytest.approx(m["value"] - m["baseline"])
    assert rec2["cache"]["capacity"] == 16 and rec2["cache"]["compression"] == 8.0

    assert rec2["cache"]["closed_form_bytes"] == rec2["cache"]["total_bytes"]

    with open(tmp_path / "results.jsonl", "a") as f:
        f.write("{not json\n")
    lines.clear()
    skipped = experiment.run(win, tmp_path / "run2", echo=lines.append)
    assert skipped.skipped and skipped.record is None
    assert lines[0].startswith(f"warning: results store {tmp_path / 'results.jsonl'}: skipping "
                               "line 3: not valid JSON")
    assert "skip: point" in lines[1]  # ... and the stored result, as its run printed it
    assert lines[2].startswith("kvjax | model=tiny | policy=window(budget=16, mode=evict) | "
                               "kv_dtype=bf16")
    assert f"{rec2['metrics']['value']:.4f}" in lines[2] and "force=true reruns it" in lines[2]
    assert not (tmp_path / "run2").exists()
    forced = experiment.run(dataclasses.replace(win, force=True), tmp_path / "run3",
                            echo=lines.append)
    assert forced.stored
    recs, problems = ResultsStore(tmp_path / "results.jsonl").read()
    assert [p.line for p in problems] == [2]  # the corrupt line was copied through, not lost
    assert sorted(r["key"] for r in recs) == sorted([rec["key"], rec2["key"]])
    assert recs[-1]["run_dir"].endswith("run3")


def test_text_file_speed_probe_and_wandb_offline(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("Ünïcode prose, plain and simple. " * 40, encoding="utf-8")
    spec = spec_of("model=tiny", f"task.text_file={text}", "task.length=96", "task.chunk=16",
                   "speed.prompt=16", "speed.new_tokens=4", "wandb.mode=offline",
                   "policy=h2o", "budget=64", "kv_dtype=int4", tmp=tmp_path)
    rec = experiment.run(spec, tmp_path / "run", echo=lambda *a: None).record
    assert rec["metrics"]["n_tokens"] == 96 and rec["text"]["source"] == str(text.resolve())
    c = rec["cache"]  # int4 with its residual and scales: the closed form is the real bytes
    assert c["closed_form_bytes"] == c["total_bytes"] > c["kv_bytes"] > c["payload_bytes"]
    assert c["payload_bytes"] == 2 * 2 * 2 * 64 * 64 * 0.5
    assert rec["metrics"]["baseline_source"] == "computed"
    t = rec["timings"]
    assert t["prefill_s"] > 0 and t["decode_tok_s"] > 0 and t["prefill_tokens"] == 16
    wandb_worker.drain()  # W&B logs in its worker process; this waits for it
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


@pytest.fixture(scope="module")
def xla_dir(tmp_path_factory):
    """A persistent XLA cache shared by this module's subprocesses (same programs, one compile)."""
    return tmp_path_factory.mktemp("xla")


def test_cli_prints_the_table_and_writes_the_run_dir(tmp_path, xla_dir):
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *TINY, "policy=window", "budget=16",
         f"results={tmp_path}/r.jsonl", f"hydra.run.dir={tmp_path}/run", f"xla_cache={xla_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "perplexity" in out.stdout and "compression" in out.stdout and "delta" in out.stdout
    assert {"metrics.json", "nll.npy"} <= {p.name for p in (tmp_path / "run").iterdir()}
    log = (tmp_path / "run" / "run.log").read_text()  # the run's log holds what it printed
    assert "cache bytes (closed form)" in log and "results store:" in log
    # the same point run again (its programs over the floor loaded from the cache), with W&B
    # offline: its worker process has written the whole W&B run when run.py returns
    programs = set(os.listdir(xla_dir))
    tmp = tmp_path / "tmp"  # the run's TMPDIR: W&B leaves nothing there
    tmp.mkdir()
    again = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *TINY[:-1], "wandb.mode=offline", "policy=window",
         "budget=16", "force=true", f"results={tmp_path}/r.jsonl",
         f"hydra.run.dir={tmp_path}/run2", f"xla_cache={xla_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        check=False, env={**os.environ, "TMPDIR": str(tmp)})
    assert again.returncode == 0, again.stderr
    assert not [p.name for p in tmp.rglob("*wandb*")]
    assert set(os.listdir(xla_dir)) >= programs
    assert TINY[-1] == "wandb.mode=disabled" and "W&B" not in again.stderr
    (wandb_file,) = (tmp_path / "run2" / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"summary_table" in wandb_file.read_bytes() and b"running_nll" in wandb_file.read_bytes()
    bad = subprocess.run([sys.executable, str(ROOT / "run.py"), "kv_dtype=int3"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "valid choices" in bad.stderr


def test_killed_sweep_resumes_without_duplicates_and_reports_every_point(tmp_path, xla_dir):
    """A sweep killed after its second record, then re-run with the joblib launcher."""
    from experiments.report import POINT_GID, build_report

    store = tmp_path / "results.jsonl"
    sweep = [sys.executable, str(ROOT / "run.py"), "-m", *TINY, "policy=window,full",
             "kv_dtype=f32,bf16", "budget=16", "sweep=t", f"results={store}",
             f"hydra.sweep.dir={tmp_path}/multirun", f"xla_cache={xla_dir}"]
    proc = subprocess.Popen(sweep, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if store.exists() and len(store.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = ResultsStore(store).records()
    assert 2 <= len(first) < 4, "the sweep should have been killed part-way"
    out = subprocess.run([*sweep, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"sweep: 4 points: {4 - len(first)} ran, {len(first)} already in the results store "
            "(skipped); `python -m experiments.report` compares them") in out.stderr
    recs = ResultsStore(store).records()
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)) == 4  # {window, full} x {f32, bf16}
    assert {r["key"]: r["created"] for r in first}.items() <= {
        r["key"]: r["created"] for r in recs}.items()  # done points were skipped, not redone
    assert all(json.loads(line) for line in store.read_text().splitlines())

    rep = build_report(store, tmp_path / "report", sweep="t", echo=lambda *a, **k: None)
    (group, points), = rep["pareto"].items()  # one model, task, text, length, layout, mode
    png = (tmp_path / "report" / f"{group.slug()}.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert group.task == "perplexity" and group.text == recs[0]["text"]["sha256"]
    assert {p["key"] for p in points} == set(keys)
    assert "report.md" in os.listdir(tmp_path / "report")
    assert POINT_GID == "point"


@pytest.mark.slow
def test_real_model_smoke(tmp_path, ref, xla_test_cache):
    """`python run.py` on SmolLM2-135M with a short text: the per-token NLL matches the
    reference numbers of an independent implementation (same text start, same ids)."""
    t = time.time()
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "task.length=64", "task.chunk=32",
         "speed.prompt=16", "speed.new_tokens=2", "wandb.mode=disabled",
         f"xla_cache={xla_test_cache}", f"results={tmp_path}/r.jsonl",
         f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.time() - t < 90
    rec = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert rec["model"]["name"] == "smollm2-135m" and rec["model"]["n_layers"] == 30
    nll = np.load(tmp_path / "run" / "nll.npy")
    assert nll.shape == (63,)
    assert default_text().startswith(ref["text"])  # the shipped text, on every Python
    np.testing.assert_allclose(nll, ref["nll"][:63], atol=2e-3)


def test_paged_layout_runs_from_the_cli(tmp_path):
    """`cache.layout=paged cache.impl=pallas` reaches the task (interpret mode on CPU), is part
    of the point key, and a policy the paged layout cannot run is refused before any work."""
    base = [sys.executable, str(ROOT / "run.py"), "model=tiny", "task.length=48",
            "speed.prompt=8", "speed.new_tokens=2", "wandb.mode=disabled",
            f"results={tmp_path / 'r.jsonl'}", f"hydra.run.dir={tmp_path / 'run'}"]
    out = subprocess.run(base + ["cache.layout=paged", "cache.impl=pallas", "policy=window",
                                 "budget=16"], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    assert "cache=paged(page=16, pallas)" in out.stdout
    rec = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])
    assert rec["point"]["cache"]["layout"] == "paged"
    bad = subprocess.run(base + ["cache.layout=paged", "policy=h2o", "budget=16"],
                         capture_output=True, text=True, cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "not supported on the paged layout" in bad.stderr


# ----------------------------------------------------------------------------- sweep planning


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]])
def test_a_sweep_with_a_bad_point_is_refused_before_any_point_runs(tmp_path, launcher):
    """Every point is planned first: a bad one is one line naming its overrides and value."""
    store = tmp_path / "results.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", *TINY, "policy=window",
         "kv_dtype=f32,int3", "budget=16,abc", f"results={store}",
         f"hydra.sweep.dir={tmp_path}/multirun", *launcher],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    abc = ("Error merging override budget=abc: Value 'abc' of type 'str' could not be "
           "converted to Integer full_key: budget object_type=RunConf")
    int3 = "unknown kv_dtype 'int3'; valid choices: bf16, f32, fp8, int2, int4, int8"
    assert lines == [f"error: sweep point #1 (kv_dtype=f32 budget=abc): {abc}",
                     f"error: sweep point #2 (kv_dtype=int3 budget=16): {int3}",
                     f"error: sweep point #3 (kv_dtype=int3 budget=abc): {abc}"]
    assert not store.exists() and not (tmp_path / "multirun").exists()  # nothing ran
    assert "Unable to initialize backend" not in out.stdout  # JAX's INFO about absent backends


def test_a_point_failing_at_run_time_is_stored_and_reported_and_the_sweep_goes_on(tmp_path):
    """A model whose RoPE base is NaN passes `plan` but puts NaN keys into the cache (a run-time
    failure); the basic sweeper runs the next point, the store holds the failure, the report
    lists it, and a later run of the point is not skipped because of it."""
    from experiments.report import build_report

    store = tmp_path / "results.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "-m", *TINY, "++model.overrides.rope_theta=nan,1e4",
         "sweep=f", f"results={store}", f"hydra.sweep.dir={tmp_path}/m"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 1 and "NaN or inf keys/values reached the KV cache" in out.stderr
    recs = {str(r["point"]["model"]): r for r in ResultsStore(store).records()}
    (failed,) = [r for r in recs.values() if r.get("status") == "failed"]
    (done,) = [r for r in recs.values() if "status" not in r]
    assert failed["error"].startswith("FloatingPointError: NaN or inf keys/values")
    assert failed["key"] == plan(spec_of(*TINY, "++model.overrides.rope_theta=nan", "sweep=f",
                                         tmp=tmp_path)).key
    assert ResultsStore(store).find(failed["key"]) is None  # not done: a rerun retries it
    assert ResultsStore(store).find(done["key"])["key"] == done["key"]
    rep = build_report(store, tmp_path / "report", sweep="f", echo=lambda *a, **k: None)
    assert [r["key"] for r in rep["failed"]] == [failed["key"]]
    assert "## Failed runs" in (tmp_path / "report" / "report.md").read_text()


def test_compress_points_of_a_sweep_share_one_prefill(tmp_path):
    """Score once, select many through the harness: compress-mode points over the same prompts
    run as one group (one prefill), and each point's record equals the one it gets alone."""
    base = ["model=tiny", "task=passkey", "task.length=400", "task.n_samples=2",
            "speed.prompt=0", "wandb.mode=disabled", "policy.mode=compress", "ratio=0.5"]
    names = ("tova", "knorm", "h2o")
    plans = [plan(spec_of(*base, f"policy={n}", tmp=tmp_path / "shared")) for n in names]
    lines = []
    outs = experiment.execute_shared(plans, [tmp_path / n for n in names], lines.append)
    assert sum("shared prefill" in line for line in lines) == 1
    assert [o.stored for o in outs] == [True] * 3
    for n, out in zip(names, outs):
        alone = experiment.execute(plan(spec_of(*base, f"policy={n}", tmp=tmp_path / n)),
                                   tmp_path / f"{n}-alone", print)
        assert alone.record["key"] == out.record["key"]
        drop = {"baseline_source"}  # computed by the first run, then read from its cache
        assert ({k: v for k, v in alone.record["metrics"].items() if k not in drop}
                == {k: v for k, v in out.record["metrics"].items() if k not in drop}), n
        assert [r["answer"] for r in alone.result.rows] == [r["answer"] for r in out.result.rows]



def test_compress_mode_bytes_are_the_tasks_compressed_prompts_not_the_probes(tmp_path):
    """In compress mode a cache holds what it kept of its prompt, so its bytes come from the
    task's prompts: with the speed probe on (a 64-token prompt) they are what they are with it
    off. An audit found a knorm ratio=0.5 point's compression 3.60x with the probe (its
    256-token prompt kept) and 1.96x without; the task's cache held the latter."""
    base = ["model=tiny", "task=passkey", "task.length=400", "task.n_samples=2",
            "wandb.mode=disabled", "policy=knorm", "policy.mode=compress", "ratio=0.5"]
    off = experiment.run(spec_of(*base, "speed.prompt=0", tmp=tmp_path / "off"),
                         tmp_path / "off-run", echo=lambda s: None).record
    on = experiment.run(spec_of(*base, "speed.prompt=64", "speed.new_tokens=2",
                                tmp=tmp_path / "on"), tmp_path / "on-run", echo=lambda s: None)
    assert on.record["timings"]["prefill_s"] is not None  # the probe ran
    assert on.record["cache"] == off["cache"]
    assert off["cache"]["capacity"] >= 200  # half of the 400-token prompt kept, + the answer

def test_the_speed_probe_fits_its_prompt_and_steps_in_max_len(tmp_path):
    """The probe prefills a prompt and then decodes 1 + new_tokens tokens; a paged row may not
    grow past max_len, so the prompt is cut to max_len - new_tokens - 1 (with the task's length
    a multiple of the page size, one token more ran the pool out of pages)."""
    spec = spec_of("model=tiny", "task.length=48", "task.chunk=16", "speed.prompt=64",
                   "speed.new_tokens=2", "wandb.mode=disabled", "cache.layout=paged",
                   "policy=window", "budget=16", tmp=tmp_path)
    out = experiment.run(spec, tmp_path / "run", echo=lambda *a: None)
    assert out.record["timings"]["prefill_tokens"] == 48 - 2 - 1


def test_policy_mode_composes_over_the_default_policy():
    """Hydra validates a sweep's fixed overrides against the default config (policy=full) before
    the swept policy replaces it: `-m policy=h2o,knorm policy.mode=compress` needs full.yaml to
    have a mode. The full cache ignores it (the baseline of both modes)."""
    cfg = cfg_of("policy.mode=compress")
    assert cfg.policy.name == "full" and cfg.policy.mode == "compress"
    p = plan(spec_of("model=tiny", "policy.mode=compress"))
    assert p.policy.name == "full" and p.point == plan(spec_of("model=tiny")).point
    assert cfg_of("policy=h2o", "policy.mode=compress").policy.mode == "compress"


def test_the_table_names_non_default_format_options_and_mixed_precision(tmp_path):
    """The printed header shows a format's options that differ from its defaults, and a
    mixed-precision format (kept units) has no single bytes per value to print."""
    lines = []
    out = experiment.run(spec_of(*TINY, "kv_dtype=int4", "+kv_options.key_mode=token",
                                 tmp=tmp_path), tmp_path / "a", echo=lines.append)
    assert "| kv_dtype=int4(key_mode=token) |" in lines[0].splitlines()[0]
    assert out.record["point"]["kv_dtype"] == "int4"
    lines.clear()
    experiment.run(spec_of(*TINY, "kv_dtype=int2", "+kv_options.keep_units=[[0,1]]",
                           tmp=tmp_path), tmp_path / "b", echo=lines.append)
    head, *_ = lines[0].splitlines()
    payload = next(ln for ln in lines[0].splitlines() if ln.startswith("payload"))
    assert "kv_dtype=int2(" in head and "keep_units=" in head
    assert "mixed precision" in payload and "None" not in payload


def test_sweep_summary_counts_points_by_what_happened_to_them():
    """The line at a sweep's end: points with one key count once; stored before = skipped."""
    from types import SimpleNamespace

    from kvjax.sweep import sweep_summary

    plans = [SimpleNamespace(key=k, spec=SimpleNamespace(results="r.jsonl"))
             for k in ("a", "a", "b", "c", "d", "e")]
    before = {("r.jsonl", "b"): "done", ("r.jsonl", "c"): "failed"}
    after = before | {("r.jsonl", "a"): "done", ("r.jsonl", "c"): "done",
                      ("r.jsonl", "d"): "failed"}
    assert sweep_summary(plans, before, after) == (
        "sweep: 6 points (5 distinct): 2 ran, 1 already in the results store (skipped), 1 "
        "failed, 1 not recorded; `python -m experiments.report` compares them")


def test_the_table_header_lists_policy_options_in_declaration_order(tmp_path):
    """A stored record's policy keys come back sorted; the header lists them in the policy's
    declaration order either way, so a sweep's fresh and skipped points read alike."""
    out = experiment.run(spec_of(*TINY, "policy=streaming", "budget=16", tmp=tmp_path),
                         tmp_path / "a", echo=lambda s: None)
    rec = json.loads(json.dumps(out.record, sort_keys=True))
    head = experiment.format_table(out.record).splitlines()[0]
    assert experiment.format_table(rec).splitlines()[0] == head
    fields = [f.name for f in dataclasses.fields(type(get_policy("streaming")))]
    shown = [k for k in re.findall(r"(\w+)=", head.split("policy=streaming(")[1].split(")")[0])]
    assert shown == [f for f in fields if f in shown]


def test_a_paged_point_notes_where_it_differs_from_the_dense_layout():
    """Pages hold whole sink pages (an audit measured streaming at 4 sinks on pages closer to
    the full cache than on the dense layout, and equal at 16 sinks, one page), and the Pallas
    kernel serves one-token steps only: the plan says both before the run."""
    def notes(*o):
        return [n for n in plan(spec_of("model=tiny", "task.length=64", "cache.layout=paged",
                                        "policy=streaming", "budget=32", *o)).notes
                if n.startswith(("paged:", "cache.impl="))]

    (sink,) = notes("policy.n_sink=4")
    assert "first 4 (sink) tokens stay whole, so the first 16 tokens stay attended" in sink
    assert notes("policy.n_sink=16") == []
    assert [n.split(":")[0] for n in notes("policy.n_sink=16", "cache.impl=pallas")] == [
        "cache.impl=pallas"]
    assert not [n for n in plan(spec_of("model=tiny", "task.length=64", "policy=streaming",
                                        "budget=32")).notes if n.startswith("paged:")]


def test_records_show_per_layer_and_per_head_budgets(tmp_path):
    """`capacity` is a mean; a pyramid point's record also lists each layer group's slots and
    an adakv point's each kv head's (an audit found only the mean recorded)."""
    run = lambda *o: experiment.run(spec_of(*TINY, "task.length=256", *o, tmp=tmp_path),
                                    tmp_path / "-".join(o), echo=lambda s: None).record["cache"]
    pyr = run("policy=pyramid", "budget=96", "policy.n_groups=2")
    groups = pyr["layer_capacities"]  # [[lo, hi, slots], ...]
    caps = [c for _, _, c in groups]
    assert len(groups) > 1 and caps == sorted(caps, reverse=True) and caps[0] > caps[-1]
    L = groups[-1][1]
    assert pyr["capacity"] == pytest.approx(sum((hi - lo) * c for lo, hi, c in groups) / L)
    ada = run("policy=adakv", "budget=32")
    slots = np.asarray(ada["head_slots"])  # [L, K]
    assert slots.ndim == 2 and slots.shape[0] == L and "layer_capacities" not in ada
    assert (slots.sum(axis=1) <= slots.shape[1] * 32).all() and slots.min() >= 0
    assert "head_slots" not in run("policy=h2o", "budget=32")
