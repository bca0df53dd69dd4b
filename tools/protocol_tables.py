"""Write the two tables generated from the entry points of the fgrpo distributions.

- ``tests/protocol_conformance.py`` names every built-in component under its protocol's
  ``type[...]`` so that mypy checks each class against the protocol;
- ``fgrpo/core/builtin_components.py`` says which distribution (and extras) provides each built-in
  component, read from the packages' ``pyproject.toml``: fgrpo-core names the package to install
  when a recipe names a component whose distribution is absent.

tests/test_protocol_conformance.py and tests/test_packaging.py fail when either lags behind the
entry points. After adding or removing a built-in component: ``python tools/protocol_tables.py``
(in the development environment, where the packages are installed editable), then ``mypy``.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

import tomllib

from fgrpo.core import registry
from fgrpo.core.shipped import DISTRIBUTIONS

#: registry kind -> (the protocol it satisfies, the table's name)
TABLES = {
    "kernel": ("Kernel", "KERNELS"),
    "sampler": ("Sampler", "SAMPLERS"),
    "reward": ("Reward", "REWARDS"),
    "model": ("Policy", "MODELS"),
    "objective": ("Objective", "OBJECTIVES"),
    "prompts": ("PromptSource", "PROMPTS"),
    "evaluator": ("Evaluator", "EVALUATORS"),
}
ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tests" / "protocol_conformance.py"
COMPONENTS_TARGET = ROOT / "packages" / "fgrpo-core" / "src" / "fgrpo" / "core" / "builtin_components.py"

COMPONENTS_HEADER = '''"""Which fgrpo distribution provides each built-in component, and with which extras: (kind,
name) -> (distribution, extras). Generated from the packages' pyproject.toml entry points by
``python tools/protocol_tables.py`` (tests/test_packaging.py fails when it lags behind them); do
not edit by hand."""

from __future__ import annotations
'''


def declared_components(root: Path = ROOT) -> dict[tuple[str, str], tuple[str, tuple[str, ...]]]:
    """(kind, name) -> (distribution, extras) of every component the packages' pyprojects declare."""
    kinds = {group: kind for kind, group in registry.GROUPS.items()}
    found = {}
    for distribution in DISTRIBUTIONS:
        meta = tomllib.loads((root / "packages" / distribution / "pyproject.toml").read_text())["project"]
        for group, points in meta.get("entry-points", {}).items():
            if group not in kinds:  # hook plugins (fgrpo.plugins) are not components
                continue
            for name, target in points.items():
                extras = re.findall(r"\[(.*)\]", target)
                named = tuple(e.strip() for e in extras[0].split(",")) if extras else ()
                found[(kinds[group], name)] = (distribution, named)
    return dict(sorted(found.items()))


def render_components(root: Path = ROOT) -> str:
    lines = [COMPONENTS_HEADER, "COMPONENTS: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {"]
    for (kind, name), (distribution, extras) in declared_components(root).items():
        listed = ", ".join(f'"{e}"' for e in extras) + ("," if len(extras) == 1 else "")
        lines.append(f'    ("{kind}", "{name}"): ("{distribution}", ({listed})),')
    lines.append("}")
    return "\n".join(lines) + "\n"


HEADER = '''"""The built-in components, checked by mypy against the protocols they promise to satisfy.

Each table maps an entry-point name to its class under the protocol's ``type[...]``: mypy checks
every class's instances structurally against the protocol (attributes, method signatures). The
root pyproject lists this file in ``[tool.mypy] files``; ``test_protocol_conformance.py`` checks
that the tables name exactly the components the four fgrpo distributions register. Written by
``python tools/protocol_tables.py``: run it after adding or removing a built-in component.
"""

from __future__ import annotations
'''


def built_ins(kind: str) -> dict[str, tuple[str, str]]:
    """name -> (module, class) of every component of ``kind`` the fgrpo distributions register."""
    found = {}
    for ep in md.entry_points(group=registry.GROUPS[kind]):
        if ep.dist is not None and ep.dist.metadata["Name"] in DISTRIBUTIONS:
            module, _, attr = ep.value.split("[")[0].strip().partition(":")
            found[ep.name] = (module, attr)
    return dict(sorted(found.items()))


def render() -> str:
    unknown = sorted(set(registry.GROUPS) - set(TABLES))
    if unknown:
        raise SystemExit(f"tools/protocol_tables.py: no protocol for component kind(s) {unknown}: add them to TABLES")
    components = {kind: built_ins(kind) for kind in TABLES}
    imports = sorted({(m, a) for found in components.values() for m, a in found.values()})
    clashing = {a for m, a in imports if sum(a == other for _, other in imports) > 1}
    local = {(m, a): f"{a}_{m.rsplit('.', 1)[-1]}" if a in clashing else a for m, a in imports}
    lines = [HEADER]
    protocols = ", ".join(sorted(p for p, _ in TABLES.values()))
    lines.append(f"from fgrpo.core.protocols import {protocols}")
    lines += [f"from {m} import {a}" + (f" as {local[m, a]}" if local[m, a] != a else "") for m, a in imports]
    lines.append("")
    for kind, (protocol, table) in TABLES.items():
        lines.append(f"{table}: dict[str, type[{protocol}]] = {{")
        lines += [f'    "{name}": {local[target]},' for name, target in components[kind].items()]
        lines.append("}")
    lines.append("")
    lines.append("#: registry kind -> its table")
    lines.append("BY_KIND: dict[str, dict[str, type]] = {")
    lines += [f'    "{kind}": {table},' for kind, (_, table) in TABLES.items()]
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    TARGET.write_text(render(), encoding="utf-8")
    COMPONENTS_TARGET.write_text(render_components(), encoding="utf-8")
    ruff = Path(sys.executable).with_name("ruff")  # imports sorted and wrapped as the checks want them
    for target in (TARGET, COMPONENTS_TARGET):
        if ruff.exists():
            subprocess.run([str(ruff), "check", "--fix", "--quiet", "--select", "I", str(target)], check=False)
            subprocess.run([str(ruff), "format", "--quiet", str(target)], check=False)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
