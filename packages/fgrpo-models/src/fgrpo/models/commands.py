"""fgrpo-models' CLI command (a plugin through the ``fgrpo_register_commands`` hook, as fgrpo-core
imports no backbone): ``fgrpo memory RECIPE``, a recipe's memory measured on fake tensors."""

from __future__ import annotations

from typing import Any

from fgrpo.core.hookspecs import hookimpl


@hookimpl
def fgrpo_register_commands(subparsers: Any) -> None:
    from fgrpo.models import memory

    memory.add_parser(subparsers)
