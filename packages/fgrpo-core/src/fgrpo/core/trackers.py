"""Experiment trackers through accelerate: ``log.trackers: [tensorboard, wandb, ...]``.

The Accelerator gets the trackers in ``log_with`` (see :class:`RunTracker`) and starts them
with ``init_trackers``, the resolved recipe (flattened to dotted keys) as the run's config;
every iteration's numeric metrics go through ``Accelerator.log`` and each evaluation's sample
grid through the trackers' ``log_images``. TensorBoard writes where it always did, ``RUN/tensorboard``. Trackers other than
TensorBoard are optional: choosing one that is not installed is a recipe error naming the
``pip install`` that fixes it. Only the main process logs (accelerate's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from accelerate.tracking import GeneralTracker

#: accelerate's tracker names -> the pip package that provides each
PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "comet_ml": "comet-ml",
    "mlflow": "mlflow",
    "aim": "aim",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}
TENSORBOARD_FOLDER = "tensorboard"


def check_names(names: Sequence[str]) -> None:
    """``log.trackers``: known to accelerate, installed, each named once."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    known = sorted(set(PACKAGES) | set(LOGGER_TYPE_TO_CLASS))
    available = {str(t) for t in get_available_trackers()}
    problems = []
    for name in names:
        if name not in known:
            problems.append(f"unknown tracker {name!r} (accelerate knows: {', '.join(known)})")
        elif name in PACKAGES and name not in available:
            problems.append(f"{name} is not installed: pip install {PACKAGES[name]}")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        problems.append(f"{', '.join(repeated)} listed twice")
    if problems:
        raise ValueError(f"got {list(names)!r}: " + "; ".join(problems))


def check_init_kwargs(value: Mapping[str, Any]) -> None:
    bad = [str(k) for k, v in value.items() if not isinstance(v, Mapping)]
    if bad:
        raise ValueError(f"got {dict(value)!r}; expected a mapping of options per tracker (not for {', '.join(bad)})")


#: where accelerate's tracker passes the ``log.init_kwargs`` options it does not take itself:
#: (module, attribute) of the tracker library's own callable
FORWARDED_TO = {
    "tensorboard": ("torch.utils.tensorboard", "SummaryWriter"),
    "wandb": ("wandb", "init"),
    "comet_ml": ("comet_ml", "start"),
    "aim": ("aim", "Run"),
    "clearml": ("clearml", "Task.init"),
    "dvclive": ("dvclive", "Live"),
    "swanlab": ("swanlab", "init"),
    "trackio": ("trackio", "init"),
}
_PROJECT = "log.project"
_FOLDER = "the run folder"
#: options fgrpo sets itself (or accelerate's tracker sets from log.project), with why
OWNED: dict[str, dict[str, str]] = {
    "tensorboard": {"run_name": "TensorBoard writes to RUN/tensorboard", "logging_dir": "TensorBoard writes to RUN/tensorboard",
                    "log_dir": "TensorBoard writes to RUN/tensorboard",
                    "purge_step": "a resumed run hides the events past its checkpoint"},
    "wandb": {"run_name": _PROJECT, "project": _PROJECT},
    "comet_ml": {"run_name": _PROJECT, "project_name": _PROJECT},
    "aim": {"run_name": _PROJECT, "logging_dir": _FOLDER, "repo": _FOLDER},
    "mlflow": {"experiment_name": _PROJECT},
    "clearml": {"run_name": _PROJECT},
    "dvclive": {"run_name": _PROJECT, "live": "an object, not a recipe value"},
    "swanlab": {"run_name": _PROJECT, "project": _PROJECT},
    "trackio": {"run_name": _PROJECT, "project": _PROJECT},
}


def _named_parameters(fn: Any) -> tuple[set[str], bool] | None:
    """(keyword names ``fn`` takes, whether it also takes any **kwargs); None when unknown."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def tracker_options(name: str) -> set[str] | None:
    """The options ``log.init_kwargs.<name>`` may hold: the keywords of accelerate's tracker class
    and, where it passes the rest on, of the library's callable; None when any would do (or the
    library, not installed, cannot say)."""
    import importlib

    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    own = _named_parameters(LOGGER_TYPE_TO_CLASS[name].__init__)
    if own is None:
        return None
    names, forwards = own
    if forwards:
        module, attribute = FORWARDED_TO.get(name, ("", ""))
        try:
            target: Any = importlib.import_module(module)
            for part in attribute.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError, ValueError):
            return None
        more = _named_parameters(target)
        if more is None or more[1]:
            return None
        names |= more[0]
    return names - set(OWNED.get(name, {}))


def init_kwargs_errors(names: Sequence[str], options: Mapping[str, Mapping[str, Any]], prefix: str) -> list[Any]:
    """``log.init_kwargs`` checked at `validate`, before anything is written: each tracker known and
    listed in ``log.trackers``, each option one the tracker itself takes and not one fgrpo sets."""
    import difflib

    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    from fgrpo.core.config import ConfigError

    errors = []
    for tracker, given in options.items():
        key = f"{prefix}.init_kwargs.{tracker}"
        if tracker not in LOGGER_TYPE_TO_CLASS:
            known = sorted(set(PACKAGES) | set(LOGGER_TYPE_TO_CLASS))
            errors.append(ConfigError(key, f"unknown tracker {tracker!r} (accelerate knows: {', '.join(known)})"))
            continue
        if tracker not in names:
            errors.append(ConfigError(key, f"options for a tracker that log.trackers does not list ({list(names)!r}); "
                                           "they would be ignored: add it to log.trackers or remove them"))
            continue
        allowed = tracker_options(tracker)
        owned = OWNED.get(tracker, {})
        for option in given:
            if option in owned:
                errors.append(ConfigError(f"{key}.{option}", f"fgrpo sets it ({owned[option]}); remove it"))
            elif allowed is not None and option not in allowed:
                close = difflib.get_close_matches(str(option), sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(ConfigError(f"{key}.{option}", f"unknown option of the {tracker} tracker{hint}; allowed: {', '.join(sorted(allowed))}"))
    return errors


class RunTracker(GeneralTracker):
    """One of accelerate's trackers, built when the run starts rather than with the Accelerator.

    The Accelerator exists before the run folder is claimed (the main process claims it, then
    shares it), but accelerate takes ``log_with`` at construction: each named tracker is passed
    as this thin custom tracker (accelerate's way of adding one), which builds the real tracker
    (``LOGGER_TYPE_TO_CLASS[name]``) in ``start()`` with the run's folder and project, and
    forwards everything to it. TensorBoard writes to ``RUN/tensorboard``.
    """

    requires_logging_directory = False

    def __init__(self, name: str):
        super().__init__(_blank=True)
        self.name = name
        self.inner: Any = None
        self._setup: tuple[Path, str, dict[str, Any]] | None = None

    def configure(self, run_dir: Path, project: str, options: Mapping[str, Any]) -> None:
        self._setup = (run_dir, project, dict(options))

    def start(self) -> None:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, TensorBoardTracker

        if self._setup is None:
            raise RuntimeError(f"tracker {self.name!r} started before its run folder was known")
        run_dir, project, options = self._setup
        if self.name == "tensorboard":
            self.inner = TensorBoardTracker(TENSORBOARD_FOLDER, str(run_dir), **options)
        else:
            cls = LOGGER_TYPE_TO_CLASS[self.name]
            args = (project, str(run_dir)) if cls.requires_logging_directory else (project,)
            self.inner = cls(*args, **options)
        self.inner.start()

    @property
    def tracker(self) -> Any:
        return self.inner.tracker

    def store_init_configuration(self, values: dict) -> None:
        self.inner.store_init_configuration(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.inner.log(values, step=step, **kwargs)

    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if hasattr(self.inner, "log_images"):
            self.inner.log_images(values, step=step, **kwargs)

    def finish(self) -> None:
        self.inner.finish()


def log_with(names: Sequence[str], extra: Sequence[Any] = ()) -> list[Any]:
    """The Accelerator's ``log_with``: a :class:`RunTracker` per name, then ``extra`` (accelerate
    ``GeneralTracker`` instances, used as they are)."""
    return [RunTracker(name) for name in names] + list(extra)


def start(accelerator: Any, recipe: Any, out_dir: Path, *, resume_from: int | None) -> None:
    """Start the trackers (main process; accelerate's ``init_trackers``) with the resolved recipe
    as config. TensorBoard hides events past ``resume_from`` that an interrupted attempt wrote."""
    if not accelerator.log_with:
        return
    cfg = recipe.log
    options: dict[str, dict[str, Any]] = {
        "tensorboard": {"purge_step": resume_from + 1 if resume_from is not None else 0},
        "wandb": {"name": out_dir.name, "dir": str(out_dir)},
    }
    for name, extra in (cfg.init_kwargs or {}).items():
        options[name] = {**options.get(name, {}), **extra}
    for tracker in accelerator.log_with:
        if isinstance(tracker, RunTracker):
            tracker.configure(out_dir, cfg.project, options.get(tracker.name, {}))
    config = {**flat_config(recipe.data), "recipe_source": str(recipe.source), "run_dir": str(out_dir)}
    accelerator.init_trackers(cfg.project, config=config)


def flat_config(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested recipe data as ``{"sampler.kernel.eta": 0.7, "reward.0.name": "shapes", ...}``:
    scalars only, which every tracker (TensorBoard's hparams too) accepts; None as "null"."""
    if isinstance(data, Mapping):
        items = data.items()
    elif isinstance(data, (list, tuple)):
        items = enumerate(data)
    else:
        return {prefix: "null" if data is None else data}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flat_config(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def scalars(row: Mapping[str, Any]) -> dict[str, float | int]:
    """The numeric metrics of a metrics.jsonl row (not the iteration itself)."""
    return {
        k: v for k, v in row.items() if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def log_image(accelerator: Any, key: str, image: np.ndarray, step: int) -> None:
    """One (H, W, 3) uint8 image to every started tracker that takes images."""
    batch = image[None]  # (1, H, W, 3)
    for tracker in accelerator.trackers:
        log_images = getattr(tracker, "log_images", None)
        if log_images is None:
            continue
        if tracker.name == "tensorboard":
            log_images({key: batch}, step=step, dataformats="NHWC")
        else:
            log_images({key: batch}, step=step)
