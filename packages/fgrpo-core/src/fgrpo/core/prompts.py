"""Built-in prompt sources: a text file per split, a dataset folder, or prompts listed in the recipe.

Every source maps a prompt to its metadata (the keys of a JSONL row other than ``prompt``: GenEval's
``tag``/``include``/``exclude``, OCR's ``text`` ...), which the trainer passes to the rewards.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from fgrpo.core.config import ConfigError, param, read_text_file


def _existing_file(_instance, attribute, value):
    if value is not None and not Path(value).is_file():
        raise ValueError(f"got {value!r}; expected an existing .txt or .jsonl file of prompts")


MAX_PROMPT_FILE_BYTES = 256 << 20


#: metadata keys that name a file (a source image of image-to-video, later of editing): a relative
#: path is resolved against the prompt file's ``images/`` folder if it holds the file (Flow-Factory's
#: dataset layout), else against the prompt file's own folder
MEDIA_KEYS = ("image",)


def resolve_media(row: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``row`` with the files its :data:`MEDIA_KEYS` name as absolute paths (missing files are left
    as given: the policy that reads them says which prompt names which file)."""
    for key in MEDIA_KEYS:
        value = row.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            for base in (folder / "images", folder):
                if (base / value).is_file():
                    row[key] = str((base / value).resolve())
                    break
    return row


def read_prompt_file(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``.txt``: one prompt a line. ``.jsonl``: {"prompt": ..., other keys are metadata; the files
    named by :data:`MEDIA_KEYS` resolved against the file's folder}."""
    path = Path(path)
    rows: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(read_text_file(path, limit=MAX_PROMPT_FILE_BYTES, what="a prompt file").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{number}: expected an object with a 'prompt' string")
            rows.append((obj.pop("prompt"), resolve_media(obj, path.parent)))
        else:
            rows.append((line, {}))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def index_splits(files: Mapping[str, str | Path | None]) -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
    """Prompts per split and the metadata of every prompt (a prompt listed twice with different
    metadata is an error: ``metadata(prompt)`` could not tell them apart)."""
    splits: dict[str, list[str]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for split, path in files.items():
        rows = read_prompt_file(path) if path else []
        splits[split] = [p for p, _ in rows]
        for prompt, data in rows:
            if prompt in meta and meta[prompt] != data:
                raise ValueError(f"{path}: prompt {prompt!r} appears twice with different metadata")
            meta[prompt] = data
    return splits, meta


class _IndexedSplits:
    """The ``PromptSource`` of split files read by :func:`index_splits` into ``_splits``/``_meta``."""

    __slots__ = ()
    _splits: dict[str, list[str]]
    _meta: dict[str, dict[str, Any]]

    def train_prompts(self) -> list[str]:
        return list(self._splits["train"])

    def test_prompts(self) -> list[str]:
        return list(self._splits["test"])

    def metadata(self, prompt: str) -> Mapping[str, Any]:
        return self._meta.get(prompt, {})


@attrs.define
class TextFilePrompts(_IndexedSplits):
    """Prompts from files (paths relative to the working directory)."""

    train: str = param(validator=_existing_file, help="training prompts: .txt (a line each) or .jsonl")
    test: str | None = param(None, validator=_existing_file, help="held-out prompts for evaluation")
    _meta: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict)
    _splits: dict[str, list[str]] = attrs.field(init=False, factory=dict)

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], prefix: str) -> list[ConfigError]:
        return _unreadable({key: values.get(key) for key in ("train", "test")}, prefix)

    def __attrs_post_init__(self) -> None:
        self._splits, self._meta = index_splits({"train": self.train, "test": self.test})


def _unreadable(files: Mapping[str, Any], prefix: str, key: str | None = None) -> list[ConfigError]:
    """The prompt files ``files`` (split -> path) read as building them would: `validate` refuses
    what `compose` would (a line that is not JSON, an empty file), not only a missing file.
    ``key``: the recipe key to name (default: the split's own)."""

    def error(split: str, exc: Exception) -> ConfigError:
        name = key or split
        return ConfigError(f"{prefix}.{name}" if prefix else name, f"cannot read it: {exc.strerror}" if isinstance(exc, OSError) else str(exc))

    errors = []
    for split, path in files.items():
        if path is not None:
            try:
                read_prompt_file(path)
            except (OSError, ValueError) as exc:
                errors.append(error(split, exc))
    if not errors:
        try:
            index_splits(files)
        except (OSError, ValueError) as exc:  # a prompt in both splits with different metadata
            errors.append(error("test", exc))
    return errors


def _existing_folder(_instance, attribute, value):
    if not Path(value).is_dir():
        raise ValueError(f"got {value!r}; expected an existing folder holding train.txt/test.txt or train_metadata.jsonl/test_metadata.jsonl")


#: the file names a split may have in a dataset folder, in the order they are looked for
SPLIT_FILES = ("{split}_metadata.jsonl", "{split}.jsonl", "{split}.txt")


def split_file(folder: str | Path, split: str) -> Path | None:
    for pattern in SPLIT_FILES:
        path = Path(folder) / pattern.format(split=split)
        if path.is_file():
            return path
    return None


@attrs.define
class FolderPrompts(_IndexedSplits):
    """A dataset folder laid out as flow_grpo's ``dataset/<task>/``: each split is
    ``<split>_metadata.jsonl`` (GenEval: ``{"tag", "include", "exclude", "prompt"}`` a line),
    else ``<split>.jsonl``, else ``<split>.txt`` (a prompt a line). JSONL keys other than
    ``prompt`` are the prompt's metadata, passed to the rewards (the ``geneval`` reward reads
    ``tag``/``include``/``exclude``; ``ocr`` reads ``text``). The path is relative to the working
    directory.
    """

    path: str = param(validator=_existing_folder, help="dataset folder (flow_grpo layout: dataset/geneval, dataset/ocr, ...)")
    train: str = param("train", help="training split: reads <train>_metadata.jsonl, <train>.jsonl or <train>.txt")
    test: str | None = param("test", help="held-out split for evaluation; null = none")
    _meta: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict)
    _splits: dict[str, list[str]] = attrs.field(init=False, factory=dict)

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], prefix: str) -> list[ConfigError]:
        errors = []
        for key in ("train", "test"):
            split = values.get(key)
            if split is not None and split_file(values["path"], split) is None:
                names = " or ".join(p.format(split=split) for p in SPLIT_FILES)
                errors.append(ConfigError(f"{prefix}.{key}" if prefix else key, f"got {split!r}; {values['path']} has no {names}"))
        if not errors:
            files = {key: split_file(values["path"], values[key]) if values.get(key) else None for key in ("train", "test")}
            errors += _unreadable(files, prefix, key="path")
        return errors

    def __attrs_post_init__(self) -> None:
        files = {"train": split_file(self.path, self.train), "test": split_file(self.path, self.test) if self.test else None}
        self._splits, self._meta = index_splits(files)


def _not_empty(_instance: Any, _attribute: Any, value: list[str]) -> None:
    if not value:  # checked with the other keys at validation, not when the run is built
        raise ValueError("got []; expected at least one prompt")


@attrs.define
class ListPrompts:
    """Prompts written in the recipe itself."""

    train: list[str] = param(validator=_not_empty)
    test: list[str] = param(factory=list)

    def train_prompts(self) -> list[str]:
        return list(self.train)

    def test_prompts(self) -> list[str]:
        return list(self.test)

    def metadata(self, prompt: str) -> Mapping[str, Any]:
        return {}
