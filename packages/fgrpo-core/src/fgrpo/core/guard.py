"""The over-optimisation guard (``eval.guard``): the proxy reward rises while a gold metric falls.

Reward hacking shows as a divergence between what RL optimises (the proxy: the held-out reward,
``eval/reward_mean`` by default) and a gold metric it does not optimise (an evaluator's, e.g.
``gold/driving-closed-loop/cl_score``). At every evaluation the guard compares both with the
previous evaluation; ``patience`` evaluations in a row where the proxy went up and the gold went
the wrong way (down for a metric where higher is better) make it fire:

- ``action: warn``: one line on the terminal and ``guard/fired = 1`` in the metrics; training
  goes on (and the guard counts afresh);
- ``action: stop``: the run stops after that evaluation with a checkpoint of the iteration it
  stopped at, and ``checkpoints/best`` names the checkpoint of the best gold value seen (the guard
  writes one at every evaluation that improves it).

Its counters and best value travel in every checkpoint (``state.json``), so a resumed run fires
exactly where the uninterrupted one would have.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, TypeGuard

import attrs

from fgrpo.core.config import ConfigError, check_params, param

ACTIONS = ("warn", "stop")
DIRECTIONS = ("auto", "higher", "lower")


@attrs.define
class GuardConfig:
    """The keys of ``eval.guard``."""

    metric: str = param(help="the gold metric watched, a logged key such as gold/driving-closed-loop/cl_score")
    proxy: str = param(
        "eval/reward_mean", help="the proxy watched, a logged evaluation key (default the held-out reward)"
    )
    patience: int = param(
        2, ge=1, help="evaluations in a row where the proxy rose while the gold fell before the guard fires"
    )
    action: Literal["warn", "stop"] = param(
        "warn", choices=ACTIONS, help="warn: say so and go on; stop: stop the run, checkpoints/best = the best gold"
    )
    direction: Literal["auto", "higher", "lower"] = param(
        "auto",
        choices=DIRECTIONS,
        help="which way the gold metric is better; auto: the evaluator's declaration (else higher)",
    )
    min_change: float = param(0.0, ge=0, help="changes of at most this size (either metric) count as no change")


def check_guard(_instance: Any, _attribute: Any, value: Any) -> None:
    """Validator of ``eval.guard``: null or a mapping of :class:`GuardConfig` keys."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ValueError(
            f"expected a mapping such as {{metric: gold/NAME/METRIC, patience: 2, action: stop}} or null, got "
            f"{value!r}"
        )
    _, errors = check_params(GuardConfig, value, "")
    if errors:
        raise ValueError("; ".join(str(e) for e in errors))


def guard_recipe_errors(resolved: Mapping[str, Any]) -> list[ConfigError]:
    """The guard's gold metric must come from an evaluator of the recipe (``gold/<label>/...``)."""
    guard = (resolved.get("eval") or {}).get("guard")
    if not guard:
        return []
    metric = str(guard.get("metric", ""))
    labels = [e.get("label") for e in resolved.get("evaluator") or [] if isinstance(e, Mapping)]
    parts = metric.split("/")
    if len(parts) < 3 or parts[0] != "gold" or parts[1] not in labels:
        known = ", ".join(f"gold/{label}/..." for label in labels) or "none: add an evaluator section"
        return [
            ConfigError("eval.guard.metric", f"got {metric!r}; allowed: a metric of the recipe's evaluators ({known})")
        ]
    return []


@attrs.define
class Guard:
    """The guard's state between evaluations; :meth:`observe` takes each evaluation's metrics."""

    config: GuardConfig
    higher_is_better: bool = True
    previous: tuple[float, float] | None = None  # (proxy, gold) at the last evaluation
    streak: int = 0
    best: float | None = None
    best_iteration: int | None = None
    fired_at: list[int] = attrs.Factory(list)

    @classmethod
    def from_recipe(cls, spec: Mapping[str, Any], evaluators: Mapping[str, Any]) -> Guard:
        config = GuardConfig(**dict(spec))
        higher = config.direction != "lower"
        if config.direction == "auto":
            label, metric = config.metric.split("/")[1], "/".join(config.metric.split("/")[2:])
            declared = getattr(evaluators.get(label), "directions", {}) or {}
            higher = declared.get(metric, declared.get(metric.split("/")[0], "higher")) != "lower"
        return cls(config=config, higher_is_better=higher)

    def observe(self, iteration: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Update with one evaluation; returns the ``guard/...`` metrics of it (``fired`` 1 when
        it fires now, ``new_best`` 1 when the gold is the best seen)."""
        cfg = self.config
        proxy, gold = metrics.get(cfg.proxy), metrics.get(cfg.metric)
        if not (_finite(proxy) and _finite(gold)):
            return {}
        proxy, gold = float(proxy), float(gold)
        signed = gold if self.higher_is_better else -gold
        new_best = self.best is None or signed > self.best
        if new_best:
            self.best, self.best_iteration = signed, iteration
        fired = False
        if self.previous is not None:
            rose = proxy - self.previous[0] > cfg.min_change
            worse = (self.previous[1] - signed) > cfg.min_change
            self.streak = self.streak + 1 if (rose and worse) else 0
            if self.streak >= cfg.patience:
                fired = True
                self.fired_at.append(iteration)
                self.streak = 0
        self.previous = (proxy, signed)
        return {"guard/streak": float(self.streak), "guard/fired": float(fired), "guard/new_best": float(new_best)}

    @property
    def stops(self) -> bool:
        return self.config.action == "stop" and bool(self.fired_at)

    def message(self, iteration: int) -> str:
        cfg = self.config
        way = "fell" if self.higher_is_better else "rose"
        what = "stopping the run" if cfg.action == "stop" else "training goes on (eval.guard.action: warn)"
        kept = " (checkpoints/best)" if cfg.action == "stop" else ""
        best = (
            ""
            if self.best_iteration is None
            else f"; the best {cfg.metric} was at iteration {self.best_iteration}{kept}"
        )
        return (
            f"over-optimisation guard: {cfg.proxy} rose while {cfg.metric} {way} for {cfg.patience} evaluation(s) "
            f"in a row (iteration {iteration}); {what}{best}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "previous": list(self.previous) if self.previous is not None else None,
            "streak": self.streak,
            "best": self.best,
            "best_iteration": self.best_iteration,
            "fired_at": list(self.fired_at),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        previous = state.get("previous")
        self.previous = tuple(previous) if previous is not None else None
        self.streak = int(state.get("streak", 0))
        self.best = state.get("best")
        self.best_iteration = state.get("best_iteration")
        self.fired_at = list(state.get("fired_at", []))


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
