"""experiments/profile_step.py: op time attributed to kvjax's named scopes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from experiments import profile_step as P
from experiments.bench_hf import AllSlots, parse_kv_spec
from kvjax.cache import KVCache


def test_innermost_scope_and_other():
    assert P.innermost_scope("jit(step)/while/body/attention/kv_format_read/mul") == "kv_format_read"
    assert P.innermost_scope("jit(step)/while/body/policy/top_k") == "policy"
    assert P.innermost_scope("jit(step)/while/body/dot_general") == "other"
    assert P.innermost_scope("") == "other"


def test_a_profile_attributes_op_time_to_the_scopes_that_ran_it():
    """Two scopes with real work in one jitted function: both get time, control flow is not
    counted twice (the scan's own event holds its body's), and the op map covers the module."""

    def f(x):
        def body(c, _):
            with jax.named_scope("attention"):
                c = jnp.tanh(c @ c) * 0.5
            with jax.named_scope("policy"):
                c = c + jnp.sort(c, axis=-1)[:, ::-1] * 1e-3
            return c, None
        return jax.lax.scan(body, x, None, length=4)[0] @ x

    x = jnp.ones((192, 192)) * 0.01
    g = jax.jit(f)
    hlo = g.lower(x).compile().as_text()
    scopes = P.op_scopes(hlo)
    assert {"attention", "policy"} <= set(scopes.values())
    loops = re.findall(r"%(\S+) = \([^)]*\) while\(", hlo)
    assert loops and not set(loops) & set(scopes)  # control flow left out
    jax.block_until_ready(g(x))
    got = P.profile(lambda: jax.block_until_ready([g(x) for _ in range(5)]), hlo)
    assert got.get("attention", 0) > 0 and got.get("policy", 0) > 0
    assert set(got) <= {*P.SCOPES, "other"}


def test_specs_and_table():
    assert parse_kv_spec("h2o:512:int4", "--specs") == ("h2o", 512, "int4", KVCache)
    assert parse_kv_spec("h2o:512:int4:all-slots", "--specs")[3] is AllSlots
    for bad in ("h2o:512", "h2o:x:int4", "h2o:0:int4"):
        with pytest.raises(ValueError, match="--specs .*POLICY:BUDGET:FORMAT"):
            parse_kv_spec(bad, "--specs")
    with pytest.raises(ValueError, match="--specs 'nosuch:512:int4': unknown policy 'nosuch'; "
                       "valid policies: .*h2o"):
        parse_kv_spec("nosuch:512:int4", "--specs")
    with pytest.raises(ValueError, match="--specs 'h2o:512:int3': unknown kv format 'int3'"):
        parse_kv_spec("h2o:512:int3", "--specs")
    t = P.table({"a": [{"policy": 1.0, "other": 3.0}, {"policy": 2.0, "other": 5.0}]})
    assert "| a | 5.50 | 1.50 | 4.00 |" in t and t.startswith("| spec | total | policy | other |")
