"""Nothing outside a run folder is read or written through it: the one rule, and its helpers.

A run folder or a checkpoint names files of its own: the tiles an evaluation's ``index.json``
lists, the files of a checkpoint and of its ``export/``, the checkpoint ``last`` names. Any such
name is resolved by :func:`inside`, which refuses it unless it leads to a path below the folder
with no symbolic link on the way: an absolute path, a ``..`` or a link (to ``/etc``, to another
run's images) would make ``fgrpo report`` embed, ``fgrpo export`` copy or a resumed run write a
file that is not the run's. :func:`links_below` checks a whole tree the same way. The path a user
types on the command line is theirs; only what fgrpo reads *from* a folder is confined.

Files fgrpo writes appear whole or not at all (:func:`write_atomic`, :func:`new_folder`): each
is written under a fresh temporary name, created exclusively (never opened through a link
planted under that name), and renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

from fgrpo.core.config import open_regular  # noqa: F401 - the one way a confined file is opened
from fgrpo.core.registry import ComponentError


class Escape(ComponentError):
    """A name read from a run folder or checkpoint that leads out of it: ``str()`` is one line."""


def link_message(path: Path) -> str:
    return (
        f"{path} is a link; fgrpo reads and writes a run folder's own files only, never through links (replace the "
        f"link by what it points to)"
    )


def inside(root: Path, name: Any, *, what: str) -> Path:
    """``root / name`` for a ``name`` read from inside ``root`` (``what`` says where it was read,
    e.g. ``"RUN/samples/eval_000002/index.json: tile 3"``); :class:`Escape` unless ``name`` is a
    relative path of plain parts whose every step below ``root`` is not a link."""
    parts = PurePath(name).parts if isinstance(name, str) and name and "\0" not in name else ()
    if not parts or PurePath(name).is_absolute() or any(part in ("..", ".") for part in parts):
        raise Escape(f"{what} names {name!r}, which is not a file of {root}")
    path = Path(root)
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise Escape(f"{what}: {link_message(path)}")
    return path


def not_a_link(path: Path, *, what: str = "") -> Path:
    """``path`` itself, refused when it is a link (a run folder's fixed names: metrics.jsonl ...)."""
    if path.is_symlink():
        raise Escape(f"{what}: {link_message(path)}" if what else link_message(path))
    return path


def links_below(root: Path, *, skip: tuple[str, ...] = ()) -> list[tuple[Path, str]]:
    """Every entry under ``root`` that a confined read or write must not meet: links, and files
    that are not regular (FIFOs, sockets, devices: opening one can block forever). ``skip``: names
    directly under ``root`` not to look into. Each with why, in walking order."""
    found: list[tuple[Path, str]] = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if here == Path(root):
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        for name in sorted(dirs + files):
            path = here / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                found.append((path, "is a link"))
            elif not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                found.append((path, "is not a regular file"))
        dirs[:] = [d for d in dirs if not (here / d).is_symlink()]
    return found


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it, a new file) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Make the files fgrpo just wrote in ``path`` durable, then the folder itself."""
    for item in path.iterdir():
        if item.is_file() and not item.is_symlink():
            with item.open("rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less the umask (0644 under the usual 022)."""
    try:  # Linux reports the umask without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _temporary(path: Path) -> tuple[int, Path]:
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")  # O_EXCL | O_NOFOLLOW
    os.fchmod(fd, file_mode())  # mkstemp's 0600, as open() would have made it
    return fd, Path(name)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` whole or not at all: a fresh temporary file next to it, fsynced,
    then renamed over it (a link at ``path`` is replaced, never written through). Raises OSError
    (IsADirectoryError when ``path`` is a folder); no temporary file is left behind."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(21, "Is a directory", str(path))
    fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def new_folder(path: Path) -> Iterator[Path]:
    """A temporary folder next to ``path`` to fill; renamed to ``path`` (absent or an empty
    folder) when the block ends, removed when it fails: an output folder is whole or absent."""
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        tmp.chmod(file_mode() | (file_mode() & 0o444) >> 2)  # mkdtemp's 0700, as mkdir would have made it
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
