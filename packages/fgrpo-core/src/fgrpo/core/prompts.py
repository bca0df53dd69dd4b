"""Built-in prompt sources: a text file per split, a dataset folder, or prompts listed in the recipe.

Every source maps a prompt to its metadata (the keys of a JSONL row other than ``prompt``: GenEval's
``tag``/``include``/``exclude``, OCR's ``text`` ...), which the trainer passes to the rewards. A row
that names source images (``image``: a path or a list of paths, relative to the file's folder, as
flow_grpo's editing datasets write it) yields a :class:`fgrpo.core.media.Prompt` carrying them; every
image is checked when the recipe is validated (missing, not an image, empty, CMYK, 16-bit, larger
than the decompression-bomb limit: one error naming the file and line each).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fgrpo.core import media
from fgrpo.core.config import ConfigError, param, read_text_file


def _existing_file(_instance, attribute, value):
    if value is not None and not Path(value).is_file():
        raise ValueError(f"got {value!r}; expected an existing .txt or .jsonl file of prompts")


MAX_PROMPT_FILE_BYTES = 256 << 20

SOURCES_HELP = (
    "rows' 'image' are the prompts' source images (editing, image-to-video); false: prompts are text only, "
    "'image' stays metadata"
)


#: metadata keys that name files (the source images of editing and image-to-video): a relative path
#: is resolved against the prompt file's ``images/`` folder if it holds the file (Flow-Factory's
#: dataset layout), else against the prompt file's own folder (flow_grpo's)
MEDIA_KEYS = ("image",)


def _resolve(value: str, folder: Path) -> str:
    if not value or Path(value).is_absolute():
        return value
    for base in (folder / "images", folder):
        if (base / value).is_file():
            return str((base / value).resolve())
    return str(folder / value)  # missing: checked (and reported with its line) at validation


def resolve_media(row: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``row`` with the files its :data:`MEDIA_KEYS` name (a path or a list of paths) as paths
    resolved against ``folder`` (absolute when the file exists)."""
    for key in MEDIA_KEYS:
        value = row.get(key)
        if isinstance(value, str):
            row[key] = _resolve(value, folder)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            row[key] = [_resolve(v, folder) for v in value]
    return row


def _media_of(row: Mapping[str, Any]) -> list[str] | str | None:
    """The source image paths a row names, or a message saying why its media key is malformed."""
    paths: list[str] = []
    for key in MEDIA_KEYS:
        value = row.get(key)
        if value is None:
            continue
        if isinstance(value, str) and value:
            paths.append(value)
        elif isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            paths.extend(value)
        else:
            return f"'{key}' must be a path or a non-empty list of paths, got {json.dumps(value)[:80]}"
    return paths


def read_prompt_file(path: str | Path, sources: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """``.txt``: one prompt a line. ``.jsonl``: {"prompt": ..., other keys are metadata}; a row
    with ``image`` gives a :class:`~fgrpo.core.media.Prompt` with those source images (paths
    resolved against the file's folder, see :func:`resolve_media`) and its ``file:line``;
    ``sources=False``: the prompt is its text only and ``image`` stays metadata (a text-to-image
    recipe on a dataset that also lists images)."""
    path = Path(path)
    rows: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(
        read_text_file(path, limit=MAX_PROMPT_FILE_BYTES, what="a prompt file").splitlines(), 1
    ):
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
            text = obj.pop("prompt")
            given = _media_of(obj)
            if isinstance(given, str):
                raise ValueError(f"{path}:{number}: {given}")
            meta = resolve_media(obj, path.parent)
            if given and sources:
                images = _media_of(meta)
                assert isinstance(images, list)  # resolve_media kept the paths that _media_of accepted
                rows.append((media.Prompt(text, images, origin=f"{path}:{number}"), meta))
            else:
                rows.append((text, meta))
        else:
            rows.append((line, {}))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def image_errors(prompts: Sequence[str], key: str) -> list[ConfigError]:
    """One error per source image that cannot be used, naming the prompt's file and line, the image
    as the row gives it and what is allowed (every image of every prompt, each file once)."""
    errors = []
    seen: set[Any] = set()
    for prompt in prompts:
        for ref in media.source_images(prompt):
            if ref in seen or not isinstance(ref, str):
                continue
            seen.add(ref)
            problem = media.check_image(ref)
            if problem is not None:
                origin = getattr(prompt, "origin", None) or "a prompt"
                errors.append(ConfigError(key, f"{origin}: source image {ref!r} {problem}; {media.allowed_text()}"))
    return errors


def index_splits(
    files: Mapping[str, str | Path | None], sources: bool = True
) -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
    """Prompts per split and the metadata of every prompt (a prompt listed twice with different
    metadata is an error: ``metadata(prompt)`` could not tell them apart)."""
    splits: dict[str, list[str]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for split, path in files.items():
        rows = read_prompt_file(path, sources) if path else []
        splits[split] = [p for p, _ in rows]
        for prompt, data in rows:
            if prompt in meta and meta[prompt] != data:
                raise ValueError(f"{path}: prompt {media.where(prompt)} appears twice with different metadata")
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


def check_split_files(
    files: Mapping[str, Path | None], prefix: str, key: str | None = None, sources: bool = True
) -> list[ConfigError]:
    """The split files read as building the source would, before a run is built: `validate`
    refuses what `compose` would (a line that is not JSON, an empty file, a prompt in both splits
    with different metadata; named by ``key``, default the split's own), and every source image
    the rows name is checked (:func:`image_errors`, named by the split); all errors at once."""

    def error(split: str, exc: Exception) -> ConfigError:
        name = key or split
        return ConfigError(
            f"{prefix}.{name}" if prefix else name,
            f"cannot read it: {exc.strerror}" if isinstance(exc, OSError) else str(exc),
        )

    errors: list[ConfigError] = []
    for split, path in files.items():
        if path is None:
            continue
        try:
            rows = read_prompt_file(path, sources)
        except (OSError, ValueError) as exc:
            errors.append(error(split, exc))
            continue
        errors.extend(image_errors([p for p, _ in rows], f"{prefix}.{split}" if prefix else split))
    if not errors:
        try:
            index_splits(files, sources)
        except (OSError, ValueError) as exc:  # a prompt in both splits with different metadata
            errors.append(error("test", exc))
    return errors


def listed_prompts(files: Mapping[str, Path | None], sources: bool = True) -> list[str]:
    """Every prompt of the split files (train, then test), for checks at validation."""
    return [p for path in files.values() if path is not None for p, _ in read_prompt_file(path, sources)]


@attrs.define
class TextFilePrompts(_IndexedSplits):
    """Prompts from files (paths relative to the working directory)."""

    train: str = param(validator=_existing_file, help="training prompts: .txt (a line each) or .jsonl")
    test: str | None = param(None, validator=_existing_file, help="held-out prompts for evaluation")
    sources: bool = param(True, help=SOURCES_HELP)
    _meta: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict)
    _splits: dict[str, list[str]] = attrs.field(init=False, factory=dict)

    @staticmethod
    def split_files(values: Mapping[str, Any]) -> dict[str, Path | None]:
        return {split: Path(values[split]) if values.get(split) else None for split in ("train", "test")}

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], prefix: str) -> list[ConfigError]:
        return check_split_files(cls.split_files(values), prefix, sources=values.get("sources", True))

    @classmethod
    def listed_prompts(cls, values: Mapping[str, Any]) -> list[str]:
        return listed_prompts(cls.split_files(values), values.get("sources", True))

    def __attrs_post_init__(self) -> None:
        self._splits, self._meta = index_splits({"train": self.train, "test": self.test}, self.sources)


def _existing_folder(_instance, attribute, value):
    if not Path(value).is_dir():
        raise ValueError(
            f"got {value!r}; expected an existing folder holding train.txt/test.txt or "
            f"train_metadata.jsonl/test_metadata.jsonl"
        )


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

    Editing datasets (flow_grpo's ``dataset/counting_edit``): a row's ``image`` names its source
    image relative to the folder (or its ``images/`` subfolder); a list of paths gives several
    (Qwen-Image-Edit-Plus). The prompt is then a :class:`~fgrpo.core.media.Prompt` of the
    instruction and its images: rows with the same instruction and different images are different
    prompts. GenEval keys stay metadata (the ``geneval`` reward scores edited images with them).
    """

    path: str = param(
        validator=_existing_folder, help="dataset folder (flow_grpo layout: dataset/geneval, dataset/ocr, ...)"
    )
    train: str = param("train", help="training split: reads <train>_metadata.jsonl, <train>.jsonl or <train>.txt")
    test: str | None = param("test", help="held-out split for evaluation; null = none")
    sources: bool = param(True, help=SOURCES_HELP)
    _meta: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict)
    _splits: dict[str, list[str]] = attrs.field(init=False, factory=dict)

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], prefix: str) -> list[ConfigError]:
        errors = []
        for key in ("train", "test"):
            split = values.get(key)
            if split is not None and split_file(values["path"], split) is None:
                names = " or ".join(p.format(split=split) for p in SPLIT_FILES)
                errors.append(
                    ConfigError(
                        f"{prefix}.{key}" if prefix else key, f"got {split!r}; {values['path']} has no {names}"
                    )
                )
        return errors or check_split_files(
            cls.split_files(values), prefix, key="path", sources=values.get("sources", True)
        )

    @staticmethod
    def split_files(values: Mapping[str, Any]) -> dict[str, Path | None]:
        return {
            split: split_file(values["path"], values[split]) if values.get(split) else None
            for split in ("train", "test")
        }

    @classmethod
    def listed_prompts(cls, values: Mapping[str, Any]) -> list[str]:
        return listed_prompts(cls.split_files(values), values.get("sources", True))

    def __attrs_post_init__(self) -> None:
        files = self.split_files({"path": self.path, "train": self.train, "test": self.test})
        self._splits, self._meta = index_splits(files, self.sources)


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

    @classmethod
    def listed_prompts(cls, values: Mapping[str, Any]) -> list[str]:
        return [*values.get("train", []), *values.get("test", [])]
