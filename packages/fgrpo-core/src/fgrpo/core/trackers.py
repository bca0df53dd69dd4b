"""Experiment trackers through accelerate: ``log.trackers: [tensorboard, wandb, ...]``.

The Accelerator gets the trackers in ``log_with`` (see :class:`RunTracker`) and starts them
with ``init_trackers``, the resolved recipe (flattened to dotted keys) as the run's config;
every iteration's numeric metrics go through ``Accelerator.log`` and each evaluation's sample
grid through the trackers' ``log_images``. TensorBoard writes one run, ``RUN/tensorboard``
(:class:`OneRunTensorBoard`); mlflow keeps its store in ``RUN/mlflow`` and gets the grids as
artifacts (:class:`RunFolderMLflow`); wandb writes to ``RUN/wandb``; each names its run after the
run folder. Trackers other than TensorBoard are optional: choosing one that is not installed is a
recipe error naming the ``pip install`` that fixes it. Only the main process logs (accelerate's
rule).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from accelerate.tracking import GeneralTracker, MLflowTracker, TensorBoardTracker

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
    "tensorboard": {
        "run_name": "TensorBoard writes to RUN/tensorboard",
        "logging_dir": "TensorBoard writes to RUN/tensorboard",
        "log_dir": "TensorBoard writes to RUN/tensorboard",
        "purge_step": "a resumed run hides the events past its checkpoint",
    },
    "wandb": {"run_name": _PROJECT, "project": _PROJECT},
    "comet_ml": {"run_name": _PROJECT, "project_name": _PROJECT},
    "aim": {"run_name": _PROJECT, "logging_dir": _FOLDER, "repo": _FOLDER},
    "mlflow": {"experiment_name": _PROJECT, "run_dir": _FOLDER, "resume": "a resumed run continues its mlflow run"},
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


def _builders(name: str) -> list[Any]:
    """The callables ``log.init_kwargs.<name>`` reach, outermost first: the tracker class fgrpo
    builds, then (while one passes ``**kwargs`` on) the next: accelerate's tracker, the library's own
    callable (``SummaryWriter``, ``wandb.init`` ...); an import that fails ends the chain."""
    import importlib

    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    chain: list[Any] = [BUILT.get(name, LOGGER_TYPE_TO_CLASS[name]).__init__]
    if name in BUILT:
        chain.append(LOGGER_TYPE_TO_CLASS[name].__init__)
    module, attribute = FORWARDED_TO.get(name, ("", ""))
    if module:
        try:
            target: Any = importlib.import_module(module)
            for part in attribute.split("."):
                target = getattr(target, part)
            chain.append(target)
        except (ImportError, AttributeError, ValueError):
            chain.append(None)
    return chain


def tracker_options(name: str) -> set[str] | None:
    """The options ``log.init_kwargs.<name>`` may hold: the keywords of every callable they reach
    (:func:`_builders`) but fgrpo's own; None when any would do (a callable takes ``**kwargs`` and
    passes them to something that cannot be inspected, or to a library that is not installed)."""
    names: set[str] = set()
    for fn in _builders(name):
        found = _named_parameters(fn) if fn is not None else None
        if found is None:
            return None
        names |= found[0]
        if not found[1]:
            return names - set(OWNED.get(name, {}))
    return None


def option_defaults(name: str) -> dict[str, Any]:
    """The defaults of the options ``log.init_kwargs.<name>`` reaches (None defaults left out): an
    option's value must be of its default's kind (a number for ``flush_secs=120``, a string for
    ``comment=''``), checked at `validate` rather than in the tracker's own thread at start."""
    import inspect

    found: dict[str, Any] = {}
    for fn in _builders(name):
        try:
            params = inspect.signature(fn).parameters.values() if fn is not None else []
        except (TypeError, ValueError):
            break
        for p in params:
            if p.default is not p.empty and p.default is not None and p.name not in found:
                found[p.name] = p.default
    return found


def _kind_problem(value: Any, default: Any) -> str | None:
    """Why ``value`` does not fit an option whose default is ``default`` (None when it does)."""
    import math

    if isinstance(default, bool):
        return None if isinstance(value, bool) else "allowed: true or false"
    if isinstance(default, (int, float)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if isinstance(default, int) and not (isinstance(value, int) and not isinstance(value, bool)):
            return "allowed: an integer" if not number or float(value) != int(value) else None
        return None if number else "allowed: a finite number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "allowed: a string"
    return None


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
            errors.append(
                ConfigError(
                    key,
                    f"options for a tracker that log.trackers does not list ({list(names)!r}); "
                    "they would be ignored: add it to log.trackers or remove them",
                )
            )
            continue
        allowed = tracker_options(tracker)
        owned = OWNED.get(tracker, {})
        defaults = option_defaults(tracker)
        for option, value in given.items():
            kind = _kind_problem(value, defaults[option]) if option in defaults else None
            if kind is not None and option not in owned:
                errors.append(ConfigError(f"{key}.{option}", f"got {value!r}; {kind}"))
            elif option in owned:
                errors.append(ConfigError(f"{key}.{option}", f"fgrpo sets it ({owned[option]}); remove it"))
            elif allowed is not None and option not in allowed:
                close = difflib.get_close_matches(str(option), sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(
                    ConfigError(
                        f"{key}.{option}",
                        f"unknown option of the {tracker} tracker{hint}; allowed: {', '.join(sorted(allowed))}",
                    )
                )
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
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        if self._setup is None:
            raise RuntimeError(f"tracker {self.name!r} started before its run folder was known")
        run_dir, project, options = self._setup
        if self.name == "tensorboard":
            self.inner = BUILT[self.name](TENSORBOARD_FOLDER, str(run_dir), **options)
        elif self.name == "mlflow":
            self.inner = BUILT[self.name](project, run_dir, **options)
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


class OneRunTensorBoard(TensorBoardTracker):
    """accelerate's TensorBoard tracker writing the run config into the run's own event file:
    accelerate's ``add_hparams`` starts a second, timestamp-named run for it (and its
    ``hparams.yml`` a third folder), which TensorBoard lists next to the real one."""

    def store_init_configuration(self, values: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(dict(values), {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()


class RunFolderMLflow(MLflowTracker):
    """accelerate's mlflow tracker, kept to the run folder and given the sample grids.

    - the store: ``RUN/mlflow/mlflow.db`` (artifacts in ``RUN/mlflow/artifacts``) unless
      ``log.init_kwargs.mlflow.tracking_uri`` or ``MLFLOW_TRACKING_URI`` names another (a team's
      server); mlflow's own default is ``mlflow.db`` in the working directory;
    - the run is named after the run folder; a resumed run continues the mlflow run of that name;
    - ``log_images``, which accelerate's tracker lacks: each image an artifact
      ``<key>/iteration_NNNNNN.png`` (``eval/samples/iteration_000025.png``) through mlflow's API.
    """

    STORE = "mlflow"
    run_id: str | None  # accelerate's MLflowTracker attribute: the run to continue (None: a new run)

    def __init__(
        self,
        experiment_name: str,
        run_dir: Path,
        *,
        tracking_uri: str | None = None,
        resume: bool = False,
        **options: Any,
    ):
        import os

        if tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI"):
            store = Path(run_dir) / self.STORE
            store.mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{(store / 'mlflow.db').resolve()}"
            options.setdefault("logging_dir", str((store / "artifacts").resolve()))
        options.setdefault("run_name", Path(run_dir).name)
        super().__init__(experiment_name, **options)
        self.tracking_uri = tracking_uri
        self.resume = resume

    def start(self) -> None:
        import mlflow

        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        if self.resume and self.run_id is None:
            self.run_id = self._run_named(mlflow, self.run_name)
        super().start()

    def store_init_configuration(self, values: dict) -> None:
        """The config as params; a resumed run adds the keys it lacks (mlflow refuses to change a
        logged param, and what may change on resume, ``train.iterations`` and ``log.*``, is in
        metrics.jsonl and recipe.resolved.yaml)."""
        import mlflow

        logged = mlflow.get_run(self.active_run.info.run_id).data.params if self.run_id is not None else {}
        super().store_init_configuration({k: v for k, v in values.items() if k not in logged})

    def _run_named(self, mlflow: Any, name: str) -> str | None:
        experiment = mlflow.get_experiment_by_name(self.experiment_name)
        if experiment is None:
            return None
        found = mlflow.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.mlflow.runName = '{name}'",
            order_by=["start_time DESC"],
            max_results=1,
            output_format="list",
        )
        return found[0].info.run_id if found else None

    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        import mlflow

        for key, batch in values.items():
            images = list(batch)
            for k, image in enumerate(images):
                suffix = f"_{k}" if len(images) > 1 else ""
                mlflow.log_image(np.asarray(image), artifact_file=f"{key}/iteration_{step or 0:06d}{suffix}.png")


def log_with(names: Sequence[str], extra: Sequence[Any] = ()) -> list[Any]:
    """The Accelerator's ``log_with``: a :class:`RunTracker` per name, then ``extra`` (accelerate
    ``GeneralTracker`` instances, used as they are)."""
    if "mlflow" in names:
        keep_mlflow_home_clean()
    return [RunTracker(name) for name in names] + list(extra)


def keep_mlflow_home_clean() -> None:
    """mlflow's telemetry writes ``~/.config/mlflow/telemetry.json``, outside the run folder: off
    before mlflow is imported (``MLFLOW_DISABLE_TELEMETRY`` or ``DO_NOT_TRACK`` set by you wins)."""
    import os

    if "DO_NOT_TRACK" not in os.environ:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def bound_mlflow_calls(timeout_s: float) -> None:
    """mlflow's HTTP client retries 7 times with backoff and waits 120 s each by default: a server
    that does not answer held a run silent for minutes. Each call now takes at most ``timeout_s``
    in all: two attempts of half of it, no backoff (a value set in the environment wins)."""
    import os

    attempt = max(1, int(timeout_s // 2))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(attempt))


def start(accelerator: Any, recipe: Any, out_dir: Path, *, resume_from: int | None) -> None:
    """Start the trackers (main process; accelerate's ``init_trackers``) with the resolved recipe
    as config. TensorBoard hides events past ``resume_from`` that an interrupted attempt wrote."""
    if not accelerator.log_with:
        return
    cfg = recipe.log
    if "mlflow" in cfg.trackers:
        keep_mlflow_home_clean()
        bound_mlflow_calls(cfg.timeout_s)
    options: dict[str, dict[str, Any]] = {
        "tensorboard": {"purge_step": resume_from + 1 if resume_from is not None else 0},
        "wandb": {"name": out_dir.name, "dir": str(out_dir)},
        "mlflow": {"resume": resume_from is not None},
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
    items: Iterable[tuple[Any, Any]]
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


#: the tracker classes fgrpo builds where it does not use accelerate's own (see RunTracker.start)
BUILT: dict[str, Any] = {"tensorboard": OneRunTensorBoard, "mlflow": RunFolderMLflow}
