"""Recipes in stages: a recipe's ``then:`` lists the stages trained after it, each starting from the
policy the stage before it ended with (its exported weights, which are also the new stage's
reference policy: a KL term stays near them).

A stage is written as what changes from the stage before: a mapping merges into the one it
replaces key by key, unless it names another component (``objective: {name: grpo, ...}`` after
``objective: {name: nft, ...}`` replaces the objective whole); any other value, a list included,
replaces. ``fgrpo compose`` trains stage k (of n) into ``OUT/stages/k`` and the last one into
``OUT`` itself, so that ``fgrpo export``, ``report`` and ``sample`` of ``OUT`` read the policy the
recipe ends with; ``--resume`` skips the stages that finished and continues the first that did not
(:mod:`fgrpo.core.composing` trains them).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from fgrpo.core import registry
from fgrpo.core.config import ConfigError, shown

KEY = "then"
FOLDER = "stages"  # inside the run folder of the last stage: one run folder per earlier stage
EXPORT = "export"  # inside an earlier stage's run folder: the weights the next stage starts from


def merged(before: Mapping[str, Any], stage: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe of a stage: ``stage``'s keys laid over the stage ``before`` (neither is changed)."""
    out = copy.deepcopy(dict(before))
    for key, value in stage.items():
        old = out.get(key)
        if (
            isinstance(value, Mapping)
            and isinstance(old, Mapping)
            and value.get("name", old.get("name")) == old.get("name")
        ):
            out[key] = merged(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def list_error(value: Any) -> ConfigError | None:
    """What is wrong with ``then`` as a whole: it is a non-empty list."""
    if isinstance(value, list) and value:
        return None
    return ConfigError(KEY, f"expected a list of stages (mappings of the keys each changes), got {shown(value)}")


def stage_error(i: int, stage: Any) -> ConfigError | None:
    """What is wrong with the shape of stage ``i`` of ``then``: a non-empty mapping without a ``then``."""
    if not isinstance(stage, Mapping) or not stage:
        return ConfigError(f"{KEY}.{i}", f"expected a mapping of the keys this stage changes, got {shown(stage)}")
    if KEY in stage:
        return ConfigError(f"{KEY}.{i}.{KEY}", "stages do not nest; list every stage in the recipe's then")
    return None


def start_errors(model: Mapping[str, Any], stage: Mapping[str, Any]) -> list[ConfigError]:
    """Whether a stage with the model section ``model`` (resolved) can start from the stage before,
    and does not set the keys that starting does (keys relative to the stage)."""
    cls = registry.load("model", model["name"])
    start_from = getattr(cls, "start_from", None)
    if start_from is None:
        return [
            ConfigError(
                "model.name",
                f"the model {model['name']!r} cannot start a stage from the policy the stage before ended with (it "
                "has no start_from(folder)); train the stages as separate recipes",
            )
        ]
    given = stage.get("model")
    given = given if isinstance(given, Mapping) else {}
    return [
        ConfigError(f"model.{name}", "is set by the stage before (its exported weights); leave it out")
        for name in start_from(".")
        if name in given
    ]


def for_every_stage(data: Mapping[str, Any], overrides: Sequence[str]) -> list[str]:
    """``overrides`` (``--set`` items) made to reach every stage of the recipe ``data`` (as written):
    each is repeated under ``then.N`` for each stage that sets its section itself (the others
    inherit it from the stage before). ``--set`` alone changes the first stage only."""
    later = data.get(KEY)
    out = list(overrides)
    for item in overrides:
        section = item.split("=", 1)[0].strip().split(".")[0]
        out += [
            f"{KEY}.{i}.{item.strip()}"
            for i, stage in enumerate(later if isinstance(later, list) else [])
            if isinstance(stage, Mapping) and section in stage
        ]
    return out
