"""The one way fgrpo reads a file of a run folder or a checkpoint.

A run folder is written by fgrpo, but whoever can write to it can put anything there: a name in an
index that leads to ``/etc/passwd``, a FIFO that blocks a reader forever, a link to ``/dev/zero``
that never ends, a YAML alias bomb, a 400-digit integer, a safetensors header whose shapes do not
match its offsets, ``"iteration": true``. Every read of such a file goes through this module
(``tests/test_layout.py`` fails when another module opens one), which holds each one to:

- the path: resolved once and kept inside the folder (:func:`fgrpo.core.confine.inside`: no
  absolute path, no ``..``, no link on the way; a folder's own link such as ``checkpoints/last``
  is followed by :func:`fgrpo.core.checkpoint.last_of` only to a sibling ``iter_N`` folder);
- the file: a regular file, refused before it is opened for reading when it is a FIFO, a socket,
  a device or a link (:func:`fgrpo.core.config.open_regular`);
- the size: at most :data:`LIMITS` bytes of its kind, read in chunks, refused beyond;
- the parse: JSON with integers of at most :data:`MAX_INTEGER_DIGITS` digits, YAML through the
  recipe loader's guard (no tags, aliases bounded), a safetensors header whose every tensor's
  dtype x shape equals its byte range and whose ranges tile the file, ``torch.load`` with
  ``weights_only=True``, and a checkpoint's ``state.json`` with its types checked.

What cannot be read is :class:`Unreadable`: one line saying which file and why.
"""

from __future__ import annotations

import errno
import json
import math
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fgrpo.core.config import first_line, open_regular
from fgrpo.core.registry import ComponentError

MiB = 1 << 20
#: the most bytes read of each kind of file; far above what a run writes, far below a machine's memory
LIMITS = {
    "json": 64 * MiB,  # state.json, an index of tiles, an export's adapter_config.json
    "yaml": 16 * MiB,  # recipe.resolved.yaml (a recipe file has the same limit)
    "metrics": 512 * MiB,  # metrics.jsonl: a row a few KiB, a million iterations
    "image": 64 * MiB,  # a tile of an evaluation or an evaluator's picture
    "safetensors header": 100 * MiB,  # safetensors' own limit
}
#: a JSON integer with more digits than this is refused: Python parses any length, and what
#: follows (a float, a format, a range) then fails far from the file (a 400-digit score)
MAX_INTEGER_DIGITS = 30
#: bytes per element of the safetensors dtypes
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: the largest iteration a checkpoint may record (a run of 10^9 iterations is far beyond any)
MAX_ITERATION = 10**9


class Unreadable(ComponentError):
    """A file of a run folder or checkpoint that fgrpo will not read: ``str()`` is one line."""


def read_bytes(path: Path, *, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (never through a link, never a FIFO or a device),
    at most ``limit`` of them. ``what`` names the file in the message (``RUN/metrics.jsonl``)."""
    try:
        fd = open_regular(path, follow=False)
    except ValueError as exc:  # "PATH: is a FIFO, not a regular file"
        raise Unreadable(f"{what} {str(exc).rpartition(': ')[2]}") from None
    except OSError as exc:
        raise Unreadable(f"{what} {_why(path, exc)}") from None
    with open(fd, "rb") as fh:
        chunks, size = [], 0
        while chunk := fh.read(min(MiB, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise Unreadable(f"{what} is larger than {_size(limit)}; a run writes no such file")
    return b"".join(chunks)


def _why(path: Path, exc: OSError) -> str:
    """Why ``path`` could not be opened, as the rest of a sentence that names it."""
    if exc.errno == errno.ELOOP or path.is_symlink():
        return (
            "is a link; fgrpo reads a run folder's own files only, never through links (replace the link by what "
            "it points to)"
        )
    if exc.errno == errno.ENOENT:
        return "is missing"
    return f"cannot be read ({exc.strerror})"


def _regular(path: Path, name: str) -> int | str:
    """A read-only descriptor of the regular file ``path``, or why there is none (a sentence that
    starts with ``name``)."""
    try:
        return open_regular(path, follow=False)
    except OSError as exc:
        return f"{name} {_why(path, exc)}"
    except ValueError as exc:  # "PATH: is a FIFO, not a regular file"
        return f"{name} {str(exc).rpartition(': ')[2]}"


def _size(limit: int) -> str:
    return f"{limit / MiB:g} MiB" if limit >= MiB else f"{limit} bytes"


def read_text(path: Path, *, limit: int, what: str) -> str:
    data = read_bytes(path, limit=limit, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(f"{what}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INTEGER_DIGITS})")
    return int(text)


def loads_json(data: str | bytes, *, what: str) -> Any:
    """JSON with bounded integers (:data:`MAX_INTEGER_DIGITS`); :class:`Unreadable` otherwise."""
    try:
        return json.loads(data, parse_int=_integer)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; nesting can recurse
        raise Unreadable(f"{what} is not valid JSON ({first_line(exc, 120)})") from None


def read_json(path: Path, *, what: str, limit: int = LIMITS["json"]) -> Any:
    return loads_json(read_bytes(path, limit=limit, what=what), what=what)


def loads_yaml(text: str, *, what: str) -> Any:
    """YAML through the recipe loader's guard: plain data, no duplicate keys, aliases bounded."""
    from fgrpo.core.config import RecipeError
    from fgrpo.core.yaml_reading import load_yaml

    try:
        data, errors = load_yaml(text, what)
    except RecipeError as exc:  # malformed, a tag, an alias bomb
        errors = exc.errors
    if errors:
        raise Unreadable(str(errors[0]))
    return data


def read_yaml(path: Path, *, what: str) -> Any:
    return loads_yaml(read_text(path, limit=LIMITS["yaml"], what=what), what=what)


# --- safetensors and torch files ----------------------------------------------------------------


def safetensors_problem(path: Path, name: str | None = None) -> str | None:
    """Why ``path`` is not a whole, consistent safetensors file (None when it is): a regular file
    whose header parses, names a known dtype and a shape of non-negative integers for every tensor,
    gives each tensor exactly dtype x shape bytes, and whose tensors tile the data without gap or
    overlap up to the end of the file. A truncated copy, a flipped bit in a shape or a dtype, or
    trailing bytes all fail here, before safetensors or torch allocates anything."""
    name = name or path.name
    fd = _regular(path, name)
    if isinstance(fd, str):
        return fd
    with open(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        prefix = fh.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if n <= 0 or 8 + n > size:
            return f"{name} is truncated"
        if n > LIMITS["safetensors header"]:
            return f"{name} has a header of {n} bytes (safetensors allows {_size(LIMITS['safetensors header'])})"
        try:
            header = loads_json(fh.read(n), what=name)
        except Unreadable:
            return f"{name} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{name} is not a safetensors file (its header is not a JSON object)"
    why = _tensors_problem({k: v for k, v in header.items() if k != "__metadata__"})
    if why is not None:
        return f"{name} is not a safetensors file ({why})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{name} is truncated" if 8 + n + end > size else f"{name} has trailing bytes"
    return None


def _tensors_problem(entries: Mapping[str, Any]) -> str | None:
    spans = []
    for key, entry in entries.items():
        if not isinstance(entry, dict):
            return f"tensor {key!r} is not described by an object"
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            return f"tensor {key!r} has the unknown dtype {dtype!r}"
        if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
            return f"tensor {key!r} has the shape {shape!r}"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)):
            return f"tensor {key!r} has the byte range {offsets!r}"
        begin, end = offsets
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            return f"tensor {key!r}: {dtype} x {shape} is not its {end - begin} bytes"
        spans.append((begin, end, key))
    at = 0
    for begin, end, key in sorted(spans):
        if begin != at:
            return f"tensor {key!r} starts at byte {begin}, not {at}"
        at = end
    return None


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors(path: Path, device: str = "cpu", *, what: str) -> dict[str, Any]:
    """The tensors of a checked safetensors file (:func:`safetensors_problem`)."""
    from safetensors.torch import load_file

    why = safetensors_problem(path)
    if why is not None:
        raise Unreadable(f"{what}: {why}")
    try:
        return load_file(str(path), device=device)
    except Exception as exc:  # safetensors raises its own error type for data it cannot take
        raise Unreadable(f"{what}: {path.name} does not read back ({first_line(exc)})") from None


def torch_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole ``torch.save`` archive (a regular zip file with its end record)."""
    fd = _regular(path, path.name)
    if isinstance(fd, str):
        return fd
    with open(fd, "rb") as fh:
        if not zipfile.is_zipfile(fh):  # torch.save writes a zip archive; a truncated one has no end record
            return f"{path.name} is truncated or not a torch.save file"
    return None


def read_torch(path: Path, *, what: str) -> Any:
    """``torch.load(weights_only=True)`` of a checked archive: tensors and numbers, nothing unpickled."""
    import pickle

    import torch

    why = torch_file_problem(path)
    if why is not None:
        raise Unreadable(f"{what}: {why}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if "Weights only load failed" in str(exc) or isinstance(exc, pickle.UnpicklingError):
            raise Unreadable(
                f"{what}: {path.name} holds objects other than tensors and numbers (refused to unpickle them)"
            ) from None
        raise Unreadable(f"{what}: {path.name} does not read back ({first_line(exc)})") from None


# --- a checkpoint's state -----------------------------------------------------------------------


def state_problem(state: Any) -> str | None:
    """Why a checkpoint's ``state.json`` does not hold what fgrpo wrote: an object with the
    iteration (an integer 0..10^9, not a boolean), the recipe (an object), and where present the
    optimizer steps and data position (integers >= 0), the processes (an integer >= 1), the
    sampler's and the prompts' state (objects), the run id (a string)."""
    if not isinstance(state, dict):
        return "is not a JSON object"
    if not isinstance(state.get("recipe"), dict):
        return "lacks the iteration or the recipe"
    iteration = state.get("iteration")
    if not (isinstance(iteration, int) and _natural(iteration) and iteration <= MAX_ITERATION):
        return f"records the iteration {iteration!r}; a checkpoint's is an integer 0 .. {MAX_ITERATION}"
    for key, low in (("optimizer_steps", 0), ("data_position", 0), ("processes", 1)):
        if key in state and not (_natural(state[key]) and state[key] >= low):
            return f"records {key} {state[key]!r}; allowed: an integer >= {low}"
    for key in ("sampler", "prompts", "guard"):
        if key in state and not isinstance(state[key], dict):
            return f"records {key} as {type(state[key]).__name__}; allowed: an object"
    if state.get("run_id") is not None and not isinstance(state["run_id"], str):
        return f"records the run id {state['run_id']!r}; allowed: a string"
    return None


def read_state(path: Path, *, what: str) -> dict[str, Any]:
    """A checkpoint's ``state.json``, its types checked (:func:`state_problem`)."""
    state = read_json(path, what=what)
    why = state_problem(state)
    if why is not None:
        raise Unreadable(f"{what} {why}")
    return state
