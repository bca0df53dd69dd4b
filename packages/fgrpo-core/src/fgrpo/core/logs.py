"""How much a run says: ``--log-level`` / ``-v`` / ``FGRPO_LOG_LEVEL``.

======== ======================================================================================
debug    also what diffusers, transformers and huggingface_hub say: their progress bars
         ("Loading pipeline components", "Loading weights") and their warnings
info     (default) fgrpo's own lines: progress bars on a terminal, one line per iteration and per
         evaluation in a log, messages, warnings, errors
warning  warnings and errors only
error    errors only
======== ======================================================================================

Below debug the libraries' progress bars are off and their loggers show errors only (mlflow's
warnings too): a log file holds fgrpo's lines, not a tqdm bar per loaded component. Setting
``TRANSFORMERS_VERBOSITY``, ``DIFFUSERS_VERBOSITY``, ``HF_HUB_DISABLE_PROGRESS_BARS`` or
``MLFLOW_LOGGING_LEVEL`` yourself wins.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("debug", "info", "warning", "error")
ENV = "FGRPO_LOG_LEVEL"
DEFAULT = "info"
#: the libraries quietened below debug: their environment variables (read when they are imported)
LIBRARY_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # "Creating initial MLflow database tables..." in every run's log
}

_level: str | None = None
_set_by_us: set[str] = set()


def check(value: str, where: str = "--log-level") -> str:
    """``value`` (any case) as one of :data:`LEVELS`; raises ValueError naming ``where``."""
    text = str(value).strip().lower()
    if text not in LEVELS:
        raise ValueError(f"{where}: got {value!r}; allowed: {', '.join(LEVELS)}")
    return text


def current() -> str:
    """The level in force: the last :func:`configure`, else ``FGRPO_LOG_LEVEL``, else info. An
    unreadable ``FGRPO_LOG_LEVEL`` is refused by :func:`configure` (the CLI), read as info here."""
    if _level is not None:
        return _level
    try:
        return check(os.environ.get(ENV) or DEFAULT, ENV)
    except ValueError:
        return DEFAULT


def shows(level: str) -> bool:
    """Whether a line of ``level`` is shown at the current level."""
    return LEVELS.index(level) >= LEVELS.index(current())


def configure(level: str | None = None) -> str:
    """Set the level (None: ``FGRPO_LOG_LEVEL`` or info) and apply it to the libraries, those
    already imported and those imported later; returns the level."""
    global _level
    _level = check(level, "--log-level") if level is not None else check(os.environ.get(ENV) or DEFAULT, ENV)
    quiet_libraries()
    return _level


def quiet_libraries() -> None:
    """Apply the current level to diffusers, transformers and huggingface_hub: below debug no
    progress bars and errors only; at debug their own defaults. Cheap, and safe to call again
    after a library was imported (a backbone calls it once it has imported diffusers)."""
    quiet = current() != "debug"
    for name, value in LIBRARY_ENV.items():
        if name in os.environ and name not in _set_by_us:
            continue  # the user's own setting
        if quiet:
            os.environ[name] = value
            _set_by_us.add(name)
        else:
            os.environ.pop(name, None)
            _set_by_us.discard(name)
    users = {name for name in LIBRARY_ENV if name in os.environ and name not in _set_by_us}
    no_bars = quiet
    if "HF_HUB_DISABLE_PROGRESS_BARS" in users:  # diffusers does not read it itself
        no_bars = os.environ["HF_HUB_DISABLE_PROGRESS_BARS"].strip().upper() in ("1", "ON", "YES", "TRUE")
    for module in ("diffusers", "transformers"):
        lib = sys.modules.get(f"{module}.utils.logging")
        if lib is None:
            continue
        if f"{module.upper()}_VERBOSITY" not in users:  # else the library follows the user's variable itself
            lib.set_verbosity(logging.ERROR if quiet else logging.WARNING)
        (lib.disable_progress_bar if no_bars else lib.enable_progress_bar)()
    if "mlflow" in sys.modules and "MLFLOW_LOGGING_LEVEL" not in users:
        logging.getLogger("mlflow").setLevel(logging.WARNING if quiet else logging.INFO)
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None:
        (hub.disable_progress_bars if no_bars else hub.enable_progress_bars)()
