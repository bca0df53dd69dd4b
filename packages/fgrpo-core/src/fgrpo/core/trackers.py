"""Experiment trackers through accelerate: ``log.trackers: [tensorboard, wandb, ...]``.

The Accelerator gets the trackers in ``log_with`` and starts them with ``init_trackers``, the
resolved recipe (flattened to dotted keys) as the run's config; every iteration's numeric metrics
go through ``Accelerator.log`` and each evaluation's sample grid through the trackers'
``log_images``. TensorBoard writes where it always did, ``RUN/tensorboard``. Trackers other than
TensorBoard are optional: choosing one that is not installed is a recipe error naming the
``pip install`` that fixes it. Only the main process logs (accelerate's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

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


def check_names(_instance: Any, _attribute: Any, names: Sequence[str]) -> None:
    """attrs validator of ``log.trackers``: known to accelerate, installed, each named once."""
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


def log_with(names: Sequence[str], out_dir: Path | None, extra: Sequence[Any] = ()) -> list[Any]:
    """The Accelerator's ``log_with``: TensorBoard as an accelerate tracker writing to
    ``RUN/tensorboard``, the other names as accelerate resolves them, then ``extra`` (accelerate
    ``GeneralTracker`` instances). Nothing without a run folder."""
    if out_dir is None:
        return []
    chosen: list[Any] = []
    for name in names:
        if name == "tensorboard":
            from accelerate.tracking import TensorBoardTracker

            # started (and its writer created) by init_trackers, on the main process only
            chosen.append(TensorBoardTracker(TENSORBOARD_FOLDER, str(out_dir)))
        else:
            chosen.append(name)
    return chosen + list(extra)


def start(accelerator: Any, recipe: Any, out_dir: Path) -> None:
    """``init_trackers`` with the resolved recipe as config (main process only, by accelerate)."""
    if not accelerator.log_with:
        return
    cfg = recipe.log
    init_kwargs = {"wandb": {"name": out_dir.name, "dir": str(out_dir)}}
    for name, options in (cfg.init_kwargs or {}).items():
        init_kwargs[name] = {**init_kwargs.get(name, {}), **options}
    config = {**flat_config(recipe.data), "recipe_source": str(recipe.source), "run_dir": str(out_dir)}
    accelerator.init_trackers(cfg.project, config=config, init_kwargs=init_kwargs)


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
