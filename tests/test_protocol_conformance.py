"""tests/protocol_conformance.py (checked by mypy) names every built-in component: a component
registered by one of the fgrpo distributions but missing from its table would escape the
static protocol check."""

import importlib.metadata as md

import pytest

import protocol_conformance
from fgrpo.core import registry, shipped

FGRPO_DISTRIBUTIONS = set(shipped.DISTRIBUTIONS)


@pytest.mark.parametrize("kind", sorted(registry.GROUPS))
def test_the_static_tables_name_every_built_in_component(kind):
    built_in = {
        ep.name: ep.value.split("[")[0].strip()
        for ep in md.entry_points(group=registry.GROUPS[kind])
        if ep.dist is not None and ep.dist.metadata["Name"] in FGRPO_DISTRIBUTIONS
    }
    table = protocol_conformance.BY_KIND.get(kind)
    assert table is not None, (
        f"tests/protocol_conformance.py has no {kind!r} table: add the kind to tools/protocol_tables.py"
    )
    listed = {name: f"{cls.__module__}:{cls.__qualname__}" for name, cls in table.items()}
    missing, stale = sorted(set(built_in) - set(listed)), sorted(set(listed) - set(built_in))
    assert listed == built_in, (
        f"tests/protocol_conformance.py's {kind} table differs from the entry points (not listed: {missing}, "
        f"no longer registered: {stale}): run python tools/protocol_tables.py"
    )
