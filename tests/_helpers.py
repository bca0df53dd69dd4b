from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def load_tool(relative: str, name: str | None = None) -> Any:
    """The module of ``tools/<relative>``, loaded in this process. A script finds its sibling modules
    (``tools/bench/_bench.py``) because python puts its folder first on sys.path; here the siblings
    it imports are loaded from their files first and leave sys.modules with it (a sibling named like
    an installed package would otherwise stand in for that package in every later import)."""
    path = ROOT / "tools" / relative
    siblings = _sibling_imports(path)
    before = set(sys.modules)
    try:
        for sibling in siblings:
            sys.modules[sibling.stem] = _module_from(sibling, sibling.stem)
        module = _module_from(path, name or path.stem)
    finally:
        for added in set(sys.modules) - before:
            if Path(getattr(sys.modules[added], "__file__", None) or "/").parent == path.parent:
                del sys.modules[added]
    return module


def _module_from(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sibling_imports(path: Path) -> list[Path]:
    """The files beside ``path`` that it imports by their bare module name."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return [path.parent / f"{n}.py" for n in sorted(names) if "." not in n and (path.parent / f"{n}.py").is_file()]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(processes: int = 2) -> list[str]:
    """``torchrun`` for ``processes`` local processes with a static rendezvous on 127.0.0.1:
    ``--standalone`` connects to the machine's hostname, which a sandbox or CI container may not
    resolve (seen in CI: the launcher exited 1)."""
    return [
        str(BIN / "torchrun"),
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(processes),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]


@contextlib.contextmanager
def crash_after(iteration: int) -> Iterator[None]:
    """In-process runs inside are interrupted (as by Ctrl-C) once ``iteration`` is done."""
    from fgrpo.core.hookspecs import hookimpl, plugin_manager

    class Crash:
        @hookimpl
        def fgrpo_iteration_end(self, run, iteration: int, metrics) -> None:  # noqa: ARG002 - the hook's signature
            if iteration == at:
                raise KeyboardInterrupt

    at = iteration
    pm = plugin_manager()
    pm.register(Crash(), name="crash")
    try:
        yield
    finally:
        pm.unregister(name="crash")


def run_fgrpo(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600):
    """Run the installed ``fgrpo`` console script as a user would."""
    exe = Path(sys.executable).with_name("fgrpo")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, env=full_env, cwd=cwd or ROOT, timeout=timeout
    )


class OpenAudit:
    """Every path this process opens or lists under ``forbidden`` (resolved, so a path through a
    link that leads there counts), recorded while armed: Python's audit hooks see ``open``,
    ``os.open``, ``os.listdir`` and ``os.scandir``, whoever calls them. One hook per process."""

    forbidden: str | None = None
    hits: list[tuple[str, str]] = []
    log: str | None = None  # also append each hit to this file at once (a process killed later keeps its record)
    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            sys.addaudithook(cls._hook)
            cls._installed = True

    @classmethod
    def _hook(cls, event: str, args: tuple) -> None:
        root = cls.forbidden
        if root is None or event not in ("open", "os.listdir", "os.scandir") or not args:
            return
        target = args[0]
        if not isinstance(target, (str, bytes, os.PathLike)):
            return
        try:
            path = os.path.realpath(os.fsdecode(target))
        except (TypeError, ValueError, OSError):
            return
        if path == root or path.startswith(root + os.sep):
            cls.hits.append((event, path))
            if cls.log is not None:
                with open(cls.log, "a") as fh:
                    fh.write(f"{os.getpid()} {event} {path}\n")


def rewind_to(checkpoints: Path, iteration: int) -> None:
    """Make a run folder look stopped after ``iteration``: its newer checkpoints go aside (next to
    checkpoints/, where --resume does not look) and ``last`` names that iteration's checkpoint."""
    from fgrpo.core.checkpoint import folder_name, iteration_of

    for folder in list(checkpoints.iterdir()):
        newer = iteration_of(folder)
        if newer is not None and newer > iteration:
            folder.rename(checkpoints.parent / f"set-aside-{folder.name}")
    (checkpoints / "last").unlink()
    (checkpoints / "last").symlink_to(folder_name(iteration))


def assert_same_training(reference: Path, other: Path) -> None:
    """Two run folders trained the same: byte-identical trainable weights in ``checkpoints/last``
    and the same metrics rows (all but the timings)."""
    import torch
    from safetensors.torch import load_file

    a, b = (load_file(str(d / "checkpoints" / "last" / "trainable.safetensors")) for d in (reference, other))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert metric_rows(reference) == metric_rows(other)


def metric_rows(folder: Path) -> list[dict]:
    """The rows of a run folder's metrics.jsonl without the timings (they differ run to run)."""
    import json

    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(("time_", "samples_per_s"))} for line in lines
    ]


def stop_and_resume(recipe: str | Path, runs: Path, sets: list[str], *, stop: int, newest: int) -> tuple[Path, Path]:
    """``recipe`` with the ``--set`` arguments ``sets`` composed in process twice: ``runs/a``
    uninterrupted, ``runs/b`` stopped after iteration ``stop`` with the checkpoint of iteration
    ``newest`` as its newest (:func:`rewind_to`), then resumed. Returns (a, b)."""
    from fgrpo.core import cli

    a, b = runs / "a", runs / "b"
    assert cli.main(["compose", str(recipe), "--out", str(a), *sets]) == 0
    assert cli.main(["compose", str(recipe), "--out", str(b), *sets, "--set", f"train.iterations={stop}"]) == 0
    rewind_to(b / "checkpoints", newest)
    assert cli.main(["compose", str(recipe), "--out", str(b), *sets, "--resume"]) == 0
    return a, b


def registration(kind: str, name: str, component: Any) -> Any:
    """A module-scoped autouse fixture (bind it to a name in the test module, where pytest finds it)
    that registers ``component`` as the ``kind`` named ``name`` for the module's tests where the
    editable install predates its entry point (a fresh install registers it: nothing to do)."""
    import pytest

    from fgrpo.core import registry

    @pytest.fixture(autouse=True, scope="module")
    def fixture() -> Iterator[None]:
        try:
            registry.load(kind, name)
        except registry.ComponentError:
            registry.register(kind, name, component)
            yield
            registry.unregister(kind, name)
        else:
            yield

    return fixture


#: ``--set`` values for a tiny randomly initialised shapes network (LoRA rank 4) and one short iteration
TINY_SHAPES = [
    "model.random_init=true",
    "model.hidden=32",
    "model.heads=1",
    "model.layers=1",
    "model.text_width=32",
    "model.lora.rank=4",
    "train.iterations=1",
    "train.prompts_per_iteration=2",
    "train.group_size=2",
    "train.minibatch_size=0",
    "sampler.steps=2",
    "log.plots=false",
]
