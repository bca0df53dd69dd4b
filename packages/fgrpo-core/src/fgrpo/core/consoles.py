"""The terminal consoles every command prints through: ``out`` (results) and ``err`` (errors, warnings, notes)."""

from __future__ import annotations

import os

from rich.console import Console


def _console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 160  # logs and pipes: do not cut component paths at 80 columns
    return console


err = _console(stderr=True)
out = _console()
