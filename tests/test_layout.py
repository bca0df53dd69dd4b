"""fgrpo is a PEP 420 namespace shared by five distributions: no fgrpo/__init__.py anywhere; the
packages' modules import each other without cycles, and each package only what it declares."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import fgrpo


def test_no_namespace_init_file(root):
    offenders = [p for p in root.glob("packages/*/src/fgrpo/__init__.py")]
    assert offenders == []
    assert sorted(p.parent.parent.name for p in root.glob("packages/*/src/fgrpo")) == [
        "fgrpo-core",
        "fgrpo-models",
        "fgrpo-rewards",
        "fgrpo-samplers",
        "fgrpo-worlds",
    ]


def test_namespace_spans_all_packages():
    assert getattr(fgrpo, "__file__", None) is None
    parts = sorted(p.split("/")[-3] for p in fgrpo.__path__)
    assert parts == ["fgrpo-core", "fgrpo-models", "fgrpo-rewards", "fgrpo-samplers", "fgrpo-worlds"]


# --- imports: no cycles, and each package imports only what it declares ---------------------------

#: import name -> distribution, where they differ
DISTRIBUTION_OF = {"PIL": "pillow", "yaml": "pyyaml"}


def _module_name(path: Path) -> str:
    parts = path.parts[path.parts.index("src") + 1 :]
    return ".".join(parts).removesuffix(".py").removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (absolute names)."""
    if "src" not in path.parts:  # a tool: a script, no package of its own
        package = ""
    else:
        package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_no_import_cycle_between_modules(root):
    """Not even through an import inside a function (config <-> registry was one)."""
    sources = {_module_name(p): p for p in root.glob("packages/*/src/fgrpo/**/*.py")}
    graph = {name: (_imports(path) & sources.keys()) - {name} for name, path in sources.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(name) :], name]))
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize("package", ["fgrpo-core", "fgrpo-samplers", "fgrpo-rewards", "fgrpo-models", "fgrpo-worlds"])
def test_a_package_imports_only_what_it_declares(root, package):
    """Every third-party module a package's code imports is one of its dependencies or extras, and
    another fgrpo package only when it depends on it (fgrpo-core depends on none of them)."""
    project = tomllib.loads((root / "packages" / package / "pyproject.toml").read_text())["project"]
    requirements = [
        *project["dependencies"],
        *(r for extra in project.get("optional-dependencies", {}).values() for r in extra),
    ]
    declared = {canonicalize_name(Requirement(r).name) for r in requirements} | {package}
    undeclared = {}
    for path in (root / "packages" / package / "src").rglob("*.py"):
        for module in _imports(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            dist = f"fgrpo-{module.split('.')[1]}" if top == "fgrpo" else DISTRIBUTION_OF.get(top, top)
            if canonicalize_name(dist) not in declared:
                undeclared.setdefault(dist, path.name)
    assert undeclared == {}, (
        f"{package} imports distributions it does not declare (distribution: a file): {undeclared}"
    )


def _fgrpo_imports(path: Path) -> set[str]:
    """The fgrpo subpackages (``fgrpo.core``, ``fgrpo.worlds``, ...) ``path`` imports."""
    return {".".join(m.split(".")[:2]) for m in _imports(path) if m.startswith("fgrpo.") and m.count(".") >= 1}


def test_the_worlds_sit_on_top(root):
    """fgrpo.worlds imports only fgrpo-core, -models and -rewards (and itself); nothing else in the
    packages, tools or tests imports it but the worlds' own tests and the cross-package tests that
    train a world's recipe (components reach it through entry points, by name)."""
    worlds = root / "packages" / "fgrpo-worlds"
    below = {"fgrpo.core", "fgrpo.models", "fgrpo.rewards", "fgrpo.worlds"}
    upward = {
        f"{p.relative_to(root)}: {sorted(_fgrpo_imports(p) - below)}"
        for p in (worlds / "src").rglob("*.py")
        if _fgrpo_imports(p) - below
    }
    assert upward == set()
    others = [p for p in root.glob("packages/*/src/fgrpo/**/*.py") if worlds not in p.parents]
    others += list((root / "tools").rglob("*.py"))
    assert [str(p.relative_to(root)) for p in others if "fgrpo.worlds" in _fgrpo_imports(p)] == []


def test_no_path_games_in_tools_and_tests(root):
    """Tools and tests import fgrpo's modules as installed packages: no sys.path insert (a world's
    pretraining is ``python -m fgrpo.worlds.<world>.pretrain``, not a script beside its siblings)."""
    files = [*(root / "tools").rglob("*.py"), *(root / "tests").rglob("*.py"), *root.glob("packages/*/tests/*.py")]
    found = [
        f"{p.relative_to(root)}:{n}"
        for p in files
        if p.name != "test_layout.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append)|sys\.path\[:?\]? ?=", line)
    ]
    assert found == []


def test_the_registry_imports_no_component_package():
    """``fgrpo plugins`` and recipe checks import the registry: it reads entry points, it never
    imports fgrpo-samplers, -models or -rewards (python -X importtime lists every import)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import fgrpo.core.registry"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.splitlines() if line.startswith("import time:")]
    assert "fgrpo.core.registry" in imported
    components = ("fgrpo.samplers", "fgrpo.models", "fgrpo.rewards", "fgrpo.worlds")
    assert [m for m in imported if m.startswith(components)] == []


LAUNCH_KIND = re.compile(r"deepspeed|fsdp|num_processes|distributed_type|DistributedType|MULTI_GPU", re.IGNORECASE)


def _launch_kind_tokens(path: Path) -> list[str]:
    """The names in ``path``'s code that name a launch kind, and the strings that are one (the
    words in comments and docstrings are prose, not branches)."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        name = token.type == tokenize.NAME and LAUNCH_KIND.search(token.string)
        literal = token.type == tokenize.STRING and LAUNCH_KIND.fullmatch(token.string.strip("'\""))
        if name or literal:
            found.append(f"{path.name}:{token.start[0]} {token.string}")
    return found


def test_launch_kinds_live_in_fgrpo_core_launch(root):
    """What differs between one process, data parallel, FSDP2 and DeepSpeed is fgrpo.core.launch's:
    no other module names a launch kind (ee123f8: trainer.py 14 such tokens, phases.py 3)."""
    launch = root / "packages" / "fgrpo-core" / "src" / "fgrpo" / "core" / "launch"
    sources = [p for p in root.glob("packages/*/src/fgrpo/**/*.py") if launch not in p.parents]
    assert any(p.name == "update.py" for p in sources) and any(p.name == "trainer.py" for p in sources)
    assert [hit for path in sources for hit in _launch_kind_tokens(path)] == []
    assert _launch_kind_tokens(launch / "start.py")  # the check sees a launch kind where there is one


#: generated tables may be long (they are written by tools, not read as code)
GENERATED = {"builtin_components.py"}


def test_source_files_stay_readable(root):
    """No source file above 700 lines but generated tables; the trainer stays the loop (the
    structure issue: trainer.py held five concerns in 592 lines, testing/pipelines.py 1153)."""
    sizes = {
        str(p.relative_to(root)): len(p.read_text().splitlines())
        for p in root.glob("packages/*/src/fgrpo/**/*.py")
        if p.name not in GENERATED
    }
    assert {p: n for p, n in sizes.items() if n > 700} == {}
    core = "packages/fgrpo-core/src/fgrpo/core/"
    assert sizes[core + "trainer.py"] <= 450 and sizes[core + "update.py"] <= 450 and sizes[core + "rollout.py"] <= 450


CAPABILITIES = ("trains_on", "needs_old", "samples_from_old", "pairwise", "needs_reference")


def test_objective_capabilities_are_typed_members_not_probed(root):
    """The trainer reads what an objective trains on and needs as typed members
    (fgrpo.core.objectives.base), never ``getattr(objective, "needs_old", False)``."""
    probe = re.compile(r"getattr\([^)]*[\"'](" + "|".join(CAPABILITIES) + r")[\"']")
    files = [*root.glob("packages/*/src/fgrpo/**/*.py"), *(root / "tools").rglob("*.py")]
    found = [
        f"{p.relative_to(root)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert found == []
    assert probe.search('getattr(run.objective, "needs_old", False)')  # the check sees a probe


#: the modules that open files themselves, and why; every other module reads a run folder's or a
#: checkpoint's files through fgrpo.core.runread (issue 50: each new surface that read for itself
#: re-opened a hole the others had closed)
OWN_READERS = {
    "fgrpo/core/runread.py": "the one reader of run folders and checkpoints",
    "fgrpo/core/config.py": "open_regular and read_text_file, the primitives: a user's recipe and prompt files",
    "fgrpo/core/confine.py": "atomic writes; /proc/self/status for the umask",
    "fgrpo/core/threads.py": "/proc/stat and the cgroup's CPU quota",
    "fgrpo/core/parity.py": "the reference-parity table shipped with the package",
    "fgrpo/core/prompts.py": "a user's prompt files (dataset folders)",
    "fgrpo/core/media.py": "a user's source images",
}
#: calls that read a file (a mode with w, a or x writes: not a read)
READ_CALLS = {"open", "read_text", "read_bytes", "load", "safe_load", "safe_open", "load_file", "fdopen"}


def _reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in READ_CALLS:
            continue
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if owner == "runread" or (name == "load" and owner not in ("json", "torch", "yaml", "pickle", "np")):
            continue  # the reader itself; load_state_dict and friends
        method = isinstance(func, ast.Attribute) and owner not in ("os", "Image", "io", "builtins")
        place = node.args[0:1] if method else node.args[1:2]  # Path.open(mode) / open(path, mode)
        mode = next((a.value for a in place if isinstance(a, ast.Constant)), None)
        mode = next(
            (k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)), mode
        )
        if name in ("open", "fdopen") and owner != "os" and isinstance(mode, str) and set(mode) & set("wax"):
            continue
        if name in ("open", "fdopen") and owner == "" and not node.args:
            continue
        flags = {n.attr for a in node.args[1:2] for n in ast.walk(a) if isinstance(n, ast.Attribute)}
        if name == "open" and owner == "os" and flags & {"O_RDWR", "O_WRONLY", "O_CREAT"}:
            continue  # a file opened to write (the run folder's lock)
        found.append(f"{path.name}:{node.lineno} {owner + '.' if owner else ''}{name}")
    return found


def test_run_folders_are_read_through_one_reader(root):
    """No module of fgrpo-core, and no probe of a world's checkpoints, opens a file itself but the
    ones listed with their reason; they read through fgrpo.core.runread (confined, regular files
    only, bounded, bounded parsers)."""
    sources = [
        *root.glob("packages/fgrpo-core/src/fgrpo/core/**/*.py"),
        *root.glob("packages/fgrpo-worlds/src/fgrpo/worlds/*/*probe.py"),
    ]
    offenders = {}
    for path in sources:
        key = "/".join(path.parts[path.parts.index("fgrpo") :])
        if key in OWN_READERS or "/testing/" in key:
            continue
        reads = _reads(path)
        if reads:
            offenders[key] = reads
    assert offenders == {}
    assert _reads(root / "packages/fgrpo-core/src/fgrpo/core/runread.py")  # the check sees a read where there is one
