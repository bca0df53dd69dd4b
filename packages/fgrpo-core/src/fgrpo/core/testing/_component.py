"""What every conformance base shares: the component under test is named (an entry point) or given
(a class, e.g. one defined in a test file), built from recipe keys, and documents its keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fgrpo.core import registry
from fgrpo.core.config import help_lines


def component_class(kind: str, name: str, cls: type | None, base: str) -> type:
    """The class under test: ``cls`` when given, else the one registered as ``name``."""
    if cls is not None:
        return cls
    if not name:
        raise AssertionError(f"a {base} subclass sets {kind}_name (an entry point) or {kind}_class")
    return registry.load(kind, name)


def build(kind: str, name: str, cls: type | None, params: Mapping[str, Any]) -> Any:
    """The component built from its recipe keys, checked as a recipe's would be."""
    if cls is not None:
        return registry.build(kind, cls, params)
    return registry.create(kind, name, **dict(params))


def check_registered_and_documented(kind: str, name: str, cls: type | None, *, docstring: bool) -> type:
    """The entry point exists (when the test names one) and every recipe key has a help line."""
    if name:
        assert name in registry.names(kind), (
            f"{name!r} is not in the {registry.GROUPS[kind]} entry points: {registry.names(kind)}"
        )
    target = component_class(kind, name, cls, f"{kind} conformance base")
    if docstring:
        assert (target.__doc__ or "").strip(), f"the {kind} class needs a docstring"
    for key, _default, help_text in help_lines(target):
        assert help_text, f"recipe key {key!r} has no help line"
    return target
