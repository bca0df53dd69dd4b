"""Lifecycle hooks for plugins (pluggy, project name "fgrpo", entry-point group fgrpo.plugins).

A plugin is a module with functions decorated by ``fgrpo.core.hookspecs.hookimpl``::

    from fgrpo.core.hookspecs import hookimpl

    @hookimpl
    def fgrpo_iteration_end(run, iteration, metrics):
        ...
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

import attrs
import pluggy

hookspec = pluggy.HookspecMarker("fgrpo")
hookimpl = pluggy.HookimplMarker("fgrpo")
GROUP = "fgrpo.plugins"


@hookspec
def fgrpo_iteration_end(run: Any, iteration: int, metrics: dict[str, float]) -> None:
    """After every training iteration, with that iteration's metrics."""


@hookspec
def fgrpo_checkpoint_saved(run: Any, iteration: int, path: str) -> None:
    """After a checkpoint folder has been written completely."""


@hookspec
def fgrpo_evaluation(run: Any, iteration: int, metrics: dict[str, float]) -> None:
    """After an evaluation on the test prompts."""


@hookspec
def fgrpo_register_commands(subparsers: Any) -> None:
    """Add subcommands to the ``fgrpo`` CLI (an argparse subparsers object).

    Give each parser ``set_defaults(handler=function(args) -> int)``.
    """


@attrs.frozen
class PluginFailure:
    name: str
    distribution: str
    error: str


_manager: pluggy.PluginManager | None = None
_failures: list[PluginFailure] = []


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager; each fgrpo.plugins entry point loaded on its own."""
    global _manager
    if _manager is None:
        import sys

        pm = pluggy.PluginManager("fgrpo")
        pm.add_hookspecs(sys.modules[__name__])
        for ep in md.entry_points(group=GROUP):
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
            try:
                pm.register(ep.load(), name=ep.name)
            except (
                BaseException
            ) as exc:  # one broken plugin (even sys.exit() or KeyboardInterrupt) must not silence the others
                _failures.append(PluginFailure(ep.name, dist, f"{type(exc).__name__}: {exc}"))
        _manager = pm
    return _manager


def failures() -> list[PluginFailure]:
    plugin_manager()
    return list(_failures)


def register_commands(subparsers: Any) -> None:
    """Each plugin's ``fgrpo_register_commands`` on its own: one that fails (or exits) is
    reported by ``fgrpo plugins`` and the CLI keeps every other command."""
    pm = plugin_manager()
    for impl in pm.hook.fgrpo_register_commands.get_hookimpls():
        try:
            impl.function(subparsers=subparsers)
        except BaseException as exc:
            failure = PluginFailure(
                pm.get_name(impl.plugin) or "?", "?", f"fgrpo_register_commands: {type(exc).__name__}: {exc}"
            )
            if failure not in _failures:
                _failures.append(failure)
