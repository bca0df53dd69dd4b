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

from collections.abc import Mapping, Sequence
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
            self.inner = OneRunTensorBoard(TENSORBOARD_FOLDER, str(run_dir), **options)
        elif self.name == "mlflow":
            self.inner = RunFolderMLflow(project, run_dir, **options)
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

    def __init__(self, experiment_name: str, run_dir: Path, *, tracking_uri: str | None = None, resume: bool = False, **options: Any):
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
        found = mlflow.search_runs([experiment.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'",
                                   order_by=["start_time DESC"], max_results=1, output_format="list")
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
