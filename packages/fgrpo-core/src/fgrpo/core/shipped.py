"""What the five fgrpo distributions ship, known to fgrpo-core even when the others are absent:
their versions (``fgrpo --version``), the built-in recipes (``fgrpo compose shapes``) and which
distribution provides a built-in component (so an unknown name says what to install: the table
is generated from the packages' entry points, :mod:`fgrpo.core.builtin_components`).

The recipes are the repository's ``recipes/*.yaml``: ``fgrpo/core/recipes`` is a symbolic link
to that folder, so an editable install reads them in place and a built wheel or sdist carries
copies as package data (setuptools follows the link) — one set of files, nothing copied by hand.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
from collections import Counter
from importlib import resources
from pathlib import Path

from fgrpo.core.builtin_components import COMPONENTS
from fgrpo.core.config import ConfigError, RecipeError

DISTRIBUTIONS = ("fgrpo-core", "fgrpo-samplers", "fgrpo-rewards", "fgrpo-models", "fgrpo-worlds")


def kind_provider(kind: str) -> str | None:
    """The distribution that provides most built-in components of ``kind`` besides fgrpo-core
    (which provides the objectives and the list/text-file/folder prompt sources itself), or None."""
    counts = Counter(dist for (k, _), (dist, _) in COMPONENTS.items() if k == kind and dist != "fgrpo-core")
    return counts.most_common(1)[0][0] if counts else None


def version(distribution: str) -> str | None:
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None


def versions_text() -> str:
    """One line per fgrpo distribution: ``fgrpo-core 0.1.0`` or ``fgrpo-models not installed``."""
    return "\n".join(f"{d} {version(d) or 'not installed'}" for d in DISTRIBUTIONS)


def install_line(distribution: str, extras: tuple[str, ...] = ()) -> str:
    return f'pip install "{distribution}[{",".join(extras)}]"' if extras else f"pip install {distribution}"


def missing_provider_hint(kind: str, name: str) -> str | None:
    """Why ``name`` is unknown when the built-in distribution that provides it is not installed:
    the package to install. None when that distribution is installed (a typo, a third-party name)."""
    if (kind, name) in COMPONENTS:
        dist, extras = COMPONENTS[(kind, name)]
        if version(dist) is None:
            return f"it comes with {dist}, which is not installed: {install_line(dist, extras)}"
        return None
    provider = kind_provider(kind)
    if provider is not None and version(provider) is None:
        return f"the built-in {kind}s come with {provider}, which is not installed: {install_line(provider)}"
    return None


# --- recipes -------------------------------------------------------------------------------------


def recipes_folder() -> Path:
    return Path(str(resources.files("fgrpo.core") / "recipes"))


def accelerate_configs() -> dict[str, Path]:
    """The shipped accelerate configs (``recipes/accelerate/*.yaml``) by name: ``ddp``, ``cpu``, ..."""
    folder = recipes_folder() / "accelerate"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def find_accelerate_config(arg: str) -> str:
    """``arg`` itself when it is a file, else the shipped accelerate config of that name (``ddp`` or
    ``ddp.yaml``), so that an installed fgrpo finds them without the repository. Anything else is
    a RecipeError naming ``--config_file``, what ``arg`` is and the shipped names (accelerate
    itself would fail later with a FileNotFoundError traceback)."""
    path = Path(arg)
    if arg and path.is_file():
        return arg
    configs = accelerate_configs()
    name = path.stem if path.suffix == ".yaml" else arg
    if arg and len(path.parts) == 1 and name in configs:
        return str(configs[name])
    if not arg:
        what = "empty"
    elif path.is_dir():
        what = "a folder"
    else:
        close = difflib.get_close_matches(name, list(configs), n=1) if len(path.parts) == 1 else []
        what = "no such file" + (f"; did you mean {close[0]!r}?" if close else "")
    raise RecipeError([ConfigError("--config_file", f"got {arg!r} ({what}); {accelerate_configs_allowed()}")])


def accelerate_configs_allowed() -> str:
    return (
        f"allowed: an accelerate config file, or a shipped config: {', '.join(sorted(accelerate_configs())) or 'none'}"
    )


def recipe_names() -> list[str]:
    folder = recipes_folder()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def find_recipe(arg: str) -> Path:
    """A recipe file: ``arg`` itself when it exists, else the built-in recipe of that name
    (``shapes`` or ``shapes.yaml``). Raises a RecipeError naming the built-in recipes."""
    path = Path(arg)
    if path.exists() or len(path.parts) != 1:
        return path
    shipped = recipes_folder() / (arg if arg.endswith(".yaml") else f"{arg}.yaml")
    if shipped.is_file():
        return shipped
    close = difflib.get_close_matches(path.stem if path.suffix == ".yaml" else arg, recipe_names(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise RecipeError(
        [
            ConfigError(
                arg,
                f"no such recipe file, and no built-in recipe of that name{hint}; built-in recipes: "
                f"{recipes_like(arg)}; fgrpo recipes lists each with what it shows",
            )
        ]
    )


def recipes_like(arg: str, room: int = 300) -> str:
    """The built-in recipes' names for an error line: all of them when they fit in ``room``
    characters, else the closest to ``arg`` and where the others are (an error line is capped)."""
    names = recipe_names()
    listed = ", ".join(names)
    if not names or len(listed) <= room:
        return listed or "none installed"
    closest = difflib.get_close_matches(arg, names, n=8, cutoff=0.0)
    return f"{', '.join(closest)} and {len(names) - len(closest)} more"


def with_shipped_configs(options: list[str]) -> list[str]:
    """accelerate's ``--config_file NAME`` with NAME a shipped config (``ddp``, ``fsdp-lora``, ...)
    replaced by its path; a RecipeError for a NAME that is neither a file nor shipped, or none."""
    out, errors = list(options), []
    for i, word in enumerate(out):
        try:
            if word == "--config_file" and i + 1 < len(out):
                out[i + 1] = find_accelerate_config(out[i + 1])
            elif word == "--config_file":
                errors.append(ConfigError("--config_file", f"got nothing; {accelerate_configs_allowed()}"))
            elif word.startswith("--config_file="):
                out[i] = "--config_file=" + find_accelerate_config(word.split("=", 1)[1])
        except RecipeError as exc:
            errors += exc.errors
    if errors:
        raise RecipeError(errors)
    return out
