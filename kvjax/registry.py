"""Name -> class registries (policies, tasks) share one lookup with errors listing the choices."""

from __future__ import annotations

import dataclasses


def lookup(kind: str, kinds: str, registry: dict, name: str, options) -> type:
    """The dataclass registered as `name`, after checking the option names against its fields;
    an unknown name or option raises ValueError listing the valid ones."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid {kinds}: {', '.join(sorted(registry))}")
    cls = registry[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(options) - fields)
    if bad:
        raise ValueError(
            f"{kind} {name!r} has no option(s) {bad}; its options are: {', '.join(sorted(fields))}"
        )
    return cls
