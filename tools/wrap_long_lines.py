"""Wrap what ruff's formatter leaves longer than the line length: string literals and comments.

ruff format wraps code at ``line-length`` but never splits a string literal or a comment, so a
long message stays one long line (E501). This splits such a string at a space into implicitly
concatenated parts (parenthesised where it is not inside brackets already) and rewraps a long
comment into comment lines, then the formatter lays the parts out. Python joins implicitly
concatenated literals when it parses them, so every edit keeps the module's AST exactly: a file
is rewritten only when ``ast.dump`` of the new text equals that of the old (docstrings, whose
text would change, are left alone, as are lines the tool cannot split).

Usage: ``python tools/wrap_long_lines.py [--line-length N] PATH ...`` (folders are walked); run
``ruff format`` after it (tools/lint.sh does both). Prints the files it changed.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

SKIP_DIRS = {".venv", ".git", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache"}
PRAGMA = re.compile(r"#\s*(type:|noqa|fmt:|pragma|pyright:|mypy:)")
PREFIX = re.compile(r"^([rRbBuUfF]*)(['\"])")


def _dump(source: str) -> str | None:
    try:
        return ast.dump(ast.parse(source))
    except SyntaxError:
        return None


def _split_point(body: str, room: int, fstring: bool) -> int | None:
    """The index in ``body`` after which to cut (at a space, before ``room`` characters, outside an
    f-string's replacement fields and escapes), or None."""
    best, depth, i = None, 0, 0
    while i < len(body) and i < room:
        ch = body[i]
        if ch == "\\":
            i += 2
            continue
        if fstring and ch in "{}":
            if i + 1 < len(body) and body[i + 1] == ch and depth == 0:
                i += 2
                continue
            depth += 1 if ch == "{" else -1
        elif ch == " " and depth == 0 and i > 0:
            best = i + 1  # the space stays with the first part
        i += 1
    return best if best is not None and best < len(body) else None


def _split_string(token: str, start_col: int, limit: int) -> str | None:
    """``token`` (one single-line literal) as two implicitly concatenated literals, or None."""
    match = PREFIX.match(token)
    if match is None or token[match.end() - 1 : match.end() + 2] in ('"""', "'''"):
        return None
    prefix, quote = match.group(1), match.group(2)
    body = token[len(prefix) + 1 : -1]
    room = limit - start_col - len(prefix) - 2  # the first part must end (quote included) by the limit
    cut = _split_point(body, room, "f" in prefix.lower())
    if cut is None or cut < 8:
        return None
    return f"{prefix}{quote}{body[:cut]}{quote} {prefix}{quote}{body[cut:]}{quote}"


def _wrap_comment(line: str, limit: int) -> list[str] | None:
    """A standalone comment line rewrapped into lines within ``limit``, or None."""
    stripped = line.lstrip()
    if not stripped.startswith("#") or PRAGMA.match(stripped) or stripped.startswith("#!"):
        return None
    indent = line[: len(line) - len(stripped)]
    marker = "#: " if stripped.startswith("#:") else "# "
    text = stripped[len(marker.rstrip()) :].strip()
    width = limit - len(indent) - len(marker)
    if width < 20:
        return None
    parts = textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)
    if len(parts) < 2:
        return None
    return [f"{indent}{marker}{p}" for p in parts]


def wrap_source(source: str, limit: int) -> str:
    """One pass: every string and comment that crosses ``limit`` on an overlong line split once."""
    lines = source.splitlines(keepends=True)
    long_rows = {i + 1 for i, line in enumerate(lines) if len(line.rstrip("\r\n")) > limit}
    if not long_rows:
        return source
    edits: dict[int, list[tuple[int, int, str]]] = {}  # row -> (start col, end col, replacement)
    comment_rows: dict[int, list[str]] = {}
    depth = 0
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    for tok in tokens:
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        row, col = tok.start
        if row not in long_rows or row in edits or row in comment_rows:
            continue
        if tok.type == tokenize.STRING and tok.start[0] == tok.end[0] and tok.end[1] > limit:
            split = _split_string(tok.string, col, limit)
            if split is not None:
                edits[row] = [(col, tok.end[1], split if depth > 0 else f"({split})")]
        elif tok.type == tokenize.COMMENT and tok.end[1] > limit:
            line = lines[row - 1]
            if line[:col].strip() == "":
                wrapped = _wrap_comment(line.rstrip("\r\n"), limit)
                if wrapped is not None:
                    comment_rows[row] = wrapped
            elif not PRAGMA.match(tok.string) and len(line[:col].rstrip()) <= limit:
                # a trailing comment: it moves above its line, at that line's indentation
                code = line[:col].rstrip()
                indent = code[: len(code) - len(code.lstrip())]
                above = _wrap_comment(indent + tok.string, limit) or [indent + tok.string]
                comment_rows[row] = [*above, code]
    if not edits and not comment_rows:
        return source
    out = []
    for row, line in enumerate(lines, start=1):
        ending = line[len(line.rstrip("\r\n")) :]
        if row in comment_rows:
            out.extend(part + (ending or "\n") for part in comment_rows[row])
            continue
        for start, end, text in sorted(edits.get(row, []), reverse=True):
            line = line[:start] + text + line[end:]
        out.append(line)
    return "".join(out)


def wrap_file(path: Path, limit: int) -> bool:
    source = path.read_text(encoding="utf-8")
    before = _dump(source)
    if before is None:
        return False
    new = wrap_source(source, limit)
    if new == source or _dump(new) != before:
        return False
    path.write_text(new, encoding="utf-8")
    return True


def python_files(paths: list[str]) -> list[Path]:
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += [f for f in sorted(p.rglob("*.py")) if not SKIP_DIRS & set(f.parts)]
        elif p.suffix == ".py":
            found.append(p)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["."])
    parser.add_argument("--line-length", type=int, default=119)
    args = parser.parse_args(argv)
    changed = [str(f) for f in python_files(args.paths) if wrap_file(f, args.line_length)]
    for name in changed:
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
