"""Cache policies (installed as kvjax.policies): one file per policy, found automatically."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from kvjax.policies.base import POLICIES, LayerView, Policy, compress_cache, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")


def get_policy(name: str, **options) -> Policy:
    """Build a policy by name; unknown names and options get an error listing the choices."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(options) - fields)
    if bad:
        raise ValueError(
            f"policy {name!r} has no option(s) {bad}; its options are: {', '.join(sorted(fields))}"
        )
    return cls(**options)


__all__ = ["POLICIES", "LayerView", "Policy", "compress_cache", "get_policy", "register"]
