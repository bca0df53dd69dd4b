"""Where pretrained weights come from: a local folder, or a Hugging Face hub id, found fast or
refused with one message that says how to make it available.

``from_pretrained`` on a hub id that is neither cached nor reachable spends tens of seconds in
retries and then raises an error that names neither the recipe key nor a remedy. Components that
load weights (backbones, reward models) call :func:`pretrained_source` first::

    source = pretrained_source(self.path, key="model.path")
    pipe = FluxPipeline.from_pretrained(source.location, **source.kwargs)

huggingface_hub (a dependency of accelerate, transformers and diffusers) is imported lazily.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from fgrpo.core.config import first_line

#: seconds the one reachability probe of the hub may take (no retries)
PROBE_TIMEOUT_S = 8.0


class WeightsUnavailable(OSError):
    """The weights a recipe names are absent: the message says which key, which id, and what to do.

    An ``OSError``, so the registry reports it as a component that could not be built (exit 2)."""


@attrs.frozen
class PretrainedSource:
    """What to pass to ``from_pretrained``: ``location`` (a folder or a hub id) and ``kwargs``
    (``local_files_only=True`` when the hub is not to be contacted)."""

    location: str
    kwargs: dict[str, Any]
    local: bool


def looks_like_a_path(value: str) -> bool:
    """A hub id is ``name`` or ``owner/name``; anything else with separators is meant as a folder."""
    return (
        value.startswith(("/", "./", "../", "~", "."))
        or "\\" in value
        or value.count("/") > 1
        or (len(value) > 1 and value[1] == ":")  # C:\...
    )


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on") or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ).strip().lower() in ("1", "true", "yes", "on")


def _cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - huggingface_hub comes with accelerate
        return os.path.join(os.environ.get("HF_HOME", "~/.cache/huggingface"), "hub")


def _cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, local_files_only=True, allow_patterns=["*.json"])
    except Exception:  # LocalEntryNotFoundError, or a malformed id: not usable from the cache
        return False
    return True


def _probe(repo_id: str) -> str | None:
    """None when the hub answers for ``repo_id``; else why not (one request, no retries)."""
    try:
        from huggingface_hub import model_info
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover
        return None
    try:
        within(PROBE_TIMEOUT_S, model_info, repo_id, timeout=PROBE_TIMEOUT_S)
    except GatedRepoError:
        return None  # it exists; the download itself says how to accept the licence
    except RepositoryNotFoundError:
        return "the hub has no such model (or it is private: log in with `hf auth login`)"
    except Exception as exc:  # connection refused, DNS failure, timeout, proxy errors ...
        return (
            f"the hub cannot be reached ({type(exc).__name__}: {first_line(exc) if str(exc).strip() else 'no detail'})"
        )
    return None


def within(seconds: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or TimeoutError after ``seconds`` in all: huggingface_hub's own
    ``timeout`` bounds each socket operation, so a server trickling bytes could hold it longer.
    (A call that overruns goes on in a daemon thread; its answer is dropped.)"""
    import threading

    box: list[Any] = []

    def call() -> None:
        try:
            box.append((True, fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box.append((False, exc))

    worker = threading.Thread(target=call, name="fgrpo-hub-probe", daemon=True)
    worker.start()
    worker.join(seconds)
    if not box:
        raise TimeoutError(f"no answer within {seconds:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def unavailable_message(key: str, value: str, why: str) -> str:
    return (
        f"{key}: {value!r} {why} (and no local folder of that name exists). Use a local folder (the output of "
        f"save_pretrained, or a hub snapshot "
        f"downloaded elsewhere with `hf download {value} --local-dir DIR`) as {key}: DIR; or copy a hub cache "
        f"that holds it and set HF_HOME to it (looked in {_cache_dir()}); HF_HUB_OFFLINE=1 then keeps "
        "every load off the network"
    )


def pretrained_source(value: str, *, key: str) -> PretrainedSource:
    """Resolve a recipe's weights location, failing fast with one actionable message.

    - an existing folder (``~`` expanded) is used as is;
    - something that looks like a path but does not exist is reported as a missing folder;
    - a hub id found in the local cache (``HF_HOME``) loads from it without network when
      ``HF_HUB_OFFLINE=1`` or when the hub cannot be reached;
    - a hub id that is not cached, with the hub unreachable or ``HF_HUB_OFFLINE=1``, raises
      :class:`WeightsUnavailable` at once (one probe of at most ``PROBE_TIMEOUT_S`` seconds).
    """
    expanded = os.path.expanduser(value)
    if os.path.isdir(expanded):
        return PretrainedSource(expanded, {}, local=True)
    if os.path.exists(expanded):
        raise WeightsUnavailable(f"{key}: {value!r} is a file; expected a folder (save_pretrained output) or a hub id")
    if looks_like_a_path(value):
        parent = Path(expanded).parent
        hint = "" if parent.is_dir() else f" (nor does its parent {str(parent)!r})"
        raise WeightsUnavailable(f"{key}: the local folder {value!r} does not exist{hint}")
    cached = _cached(value)
    if offline():
        if cached:
            return PretrainedSource(value, {"local_files_only": True}, local=False)
        raise WeightsUnavailable(
            unavailable_message(
                key, value, "is not in the local hub cache and HF_HUB_OFFLINE=1 forbids downloading it"
            )
        )
    why = _probe(value)
    if why is None:
        return PretrainedSource(value, {}, local=False)
    if cached and why.startswith("the hub cannot be reached"):
        return PretrainedSource(value, {"local_files_only": True}, local=False)
    raise WeightsUnavailable(unavailable_message(key, value, f"is not in the local hub cache and {why}"))


__all__ = [
    "PretrainedSource",
    "WeightsUnavailable",
    "looks_like_a_path",
    "pretrained_source",
    "unavailable_message",
    "within",
]
