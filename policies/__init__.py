"""Cache policies (installed as kvjax.policies): one file per policy, found automatically."""

from __future__ import annotations

import importlib
import pkgutil

from kvjax.policies.base import MODES, POLICIES, Policy, register
from kvjax.registry import lookup

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")


def get_policy(name: str, **options) -> Policy:
    """Build a policy by name; unknown names and options get an error listing the choices."""
    return lookup("policy", "policies", POLICIES, name, options)(**options)


__all__ = ["MODES", "POLICIES", "Policy", "get_policy", "register"]
