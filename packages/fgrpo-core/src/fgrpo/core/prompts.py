"""Built-in prompt sources: a text file per split, or prompts listed in the recipe."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from fgrpo.core.config import param


def _existing_file(_instance, attribute, value):
    if value is not None and not Path(value).is_file():
        raise ValueError(f"got {value!r}; expected an existing .txt or .jsonl file of prompts")


def read_prompt_file(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``.txt``: one prompt a line. ``.jsonl``: {"prompt": ..., other keys are metadata}."""
    path = Path(path)
    rows: list[tuple[str, dict[str, Any]]] = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            if path.suffix == ".jsonl":
                obj = json.loads(line)
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise ValueError(f"{path}:{number}: expected an object with a 'prompt' string")
                rows.append((obj.pop("prompt"), obj))
            else:
                rows.append((line, {}))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


@attrs.define
class TextFilePrompts:
    """Prompts from files (paths relative to the working directory)."""

    train: str = param(validator=_existing_file, help="training prompts: .txt (a line each) or .jsonl")
    test: str | None = param(None, validator=_existing_file, help="held-out prompts for evaluation")
    _meta: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict)
    _splits: dict[str, list[str]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        for split in ("train", "test"):
            path = getattr(self, split)
            rows = read_prompt_file(path) if path else []
            self._splits[split] = [p for p, _ in rows]
            self._meta.update({p: m for p, m in rows})

    def train_prompts(self) -> list[str]:
        return list(self._splits["train"])

    def test_prompts(self) -> list[str]:
        return list(self._splits["test"])

    def metadata(self, prompt: str) -> Mapping[str, Any]:
        return self._meta.get(prompt, {})


@attrs.define
class ListPrompts:
    """Prompts written in the recipe itself."""

    train: list[str] = param()
    test: list[str] = param(factory=list)

    def __attrs_post_init__(self) -> None:
        if not self.train:
            raise ValueError("prompts.train: expected at least one prompt")

    def train_prompts(self) -> list[str]:
        return list(self.train)

    def test_prompts(self) -> list[str]:
        return list(self.test)

    def metadata(self, prompt: str) -> Mapping[str, Any]:
        return {}
