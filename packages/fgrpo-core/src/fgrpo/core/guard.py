"""The over-optimisation guard (``eval.guard``): the proxy reward rises while a gold metric falls.

Reward hacking shows as a divergence between what RL optimises (the proxy: the held-out reward,
``eval/reward_mean`` by default) and gold metrics it does not optimise (an evaluator's, e.g.
``gold/driving-closed-loop/cl_score``). The guard watches every gold metric a world names as a
limit (an evaluator's ``limits``: the driving world's CL-score, speed above the limit, jerk and
collisions), or the ones ``metric`` names. At every evaluation it compares each with the previous
evaluation; ``patience`` evaluations in a row where the proxy went up and one watched metric went
the wrong way (down for a metric where higher is better) by more than its tolerance make it fire:

- ``action: warn``: one line on the terminal and ``guard/fired = 1`` in the metrics; training
  goes on (and the guard counts afresh);
- ``action: stop``: the run stops after that evaluation with a checkpoint of the iteration it
  stopped at, and ``checkpoints/best`` names the checkpoint of the best value seen of the first
  watched metric (the headline: the guard writes one at every evaluation that improves it).

A world's tolerance per limit (``limits = {"jerk": 0.25, ...}``, in the metric's units) keeps its
evaluation noise from firing the guard; ``min_change`` raises every tolerance, the proxy's too.
Its counters and best value travel in every checkpoint (``state.json``), so a resumed run fires
exactly where the uninterrupted one would have.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeGuard

import attrs

from fgrpo.core.config import ConfigError, check_params, param

ACTIONS = ("warn", "stop")
DIRECTIONS = ("auto", "higher", "lower")


@attrs.define
class GuardConfig:
    """The keys of ``eval.guard``."""

    metric: str | list[str] | None = param(
        None,
        help="the gold metrics watched: a logged key such as gold/driving-closed-loop/cl_score, a list of them, or "
        "null for every limit the recipe's evaluators name (the first watched is the one checkpoints/best follows)",
    )
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
        help="which way the gold metrics are better; auto: the evaluator's declaration (else higher)",
    )
    min_change: float = param(
        0.0, ge=0, help="changes of at most this size (the proxy or a gold metric) count as no change"
    )


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


def declared_limits(evaluator: Any) -> dict[str, float]:
    """The gold metrics an evaluator (class or instance) names as the limits a guard watches, with
    the smallest change of each that counts (its ``limits``: a mapping, or a list for no tolerance)."""
    limits = getattr(evaluator, "limits", None) or {}
    return {str(k): float(v) for k, v in limits.items()} if isinstance(limits, Mapping) else dict.fromkeys(limits, 0.0)


def watched_metrics(metric: str | Sequence[str] | None, evaluators: Mapping[str, Any]) -> list[str]:
    """The logged keys a guard watches: ``metric`` as given, or every limit of ``evaluators``
    (label -> evaluator class or instance), in the recipe's order."""
    if metric is not None:
        return [metric] if isinstance(metric, str) else list(metric)
    return [f"gold/{label}/{key}" for label, evaluator in evaluators.items() for key in declared_limits(evaluator)]


def guard_recipe_errors(resolved: Mapping[str, Any]) -> list[ConfigError]:
    """The guard's gold metrics must come from the recipe's evaluators (``gold/<label>/...``); with
    no ``metric``, the evaluators must name limits."""
    guard = (resolved.get("eval") or {}).get("guard")
    if guard is None:
        return []
    from fgrpo.core import registry

    specs = [e for e in resolved.get("evaluator") or [] if isinstance(e, Mapping)]
    labels = [e.get("label") for e in specs]
    known = ", ".join(f"gold/{label}/..." for label in labels) or "none: add an evaluator section"
    if guard.get("metric") is None:
        evaluators = {}
        for spec in specs:
            try:
                evaluators[str(spec.get("label"))] = registry.load("evaluator", str(spec.get("name")))
            except registry.ComponentError:
                return []  # the evaluator's own error is reported
        if watched_metrics(None, evaluators):
            return []
        why = "the recipe's evaluators name no limits to watch" if specs else "the recipe has no evaluator to watch"
        return [ConfigError("eval.guard.metric", f"missing, and {why}; allowed: a metric of its evaluators ({known})")]
    errors = []
    for metric in watched_metrics(guard.get("metric"), {}):
        parts = str(metric).split("/")
        if len(parts) < 3 or parts[0] != "gold" or parts[1] not in labels:
            errors.append(
                ConfigError(
                    "eval.guard.metric", f"got {metric!r}; allowed: a metric of the recipe's evaluators ({known})"
                )
            )
    return errors


@attrs.define
class Watched:
    """One gold metric the guard watches: its key, which way is better, its tolerance."""

    key: str
    higher_is_better: bool = True
    tolerance: float = 0.0

    def signed(self, value: float) -> float:
        return value if self.higher_is_better else -value


@attrs.define
class Guard:
    """The guard's state between evaluations; :meth:`observe` takes each evaluation's metrics."""

    config: GuardConfig
    watched: list[Watched] = attrs.Factory(list)
    # the proxy, each watched metric (signed) and the proxy when that metric was last seen
    previous: dict[str, float] | None = None
    streaks: dict[str, int] = attrs.Factory(dict)
    best: float | None = None  # of the first watched metric (signed)
    best_iteration: int | None = None
    fired_at: list[int] = attrs.Factory(list)
    fired_by: list[str] = attrs.Factory(list)  # the metrics that made it fire last

    @classmethod
    def from_recipe(cls, spec: Mapping[str, Any], evaluators: Mapping[str, Any]) -> Guard:
        config = GuardConfig(**dict(spec))
        watched = []
        for key in watched_metrics(config.metric, evaluators):
            label, metric = key.split("/")[1], "/".join(key.split("/")[2:])
            higher = config.direction != "lower"
            if config.direction == "auto":
                declared = getattr(evaluators.get(label), "directions", {}) or {}
                higher = declared.get(metric, declared.get(metric.split("/")[0], "higher")) != "lower"
            limits = declared_limits(evaluators.get(label))
            tolerance = limits.get(metric, limits.get(metric.split("/")[0], 0.0))
            watched.append(Watched(key, higher, max(tolerance, config.min_change)))
        return cls(config=config, watched=watched)

    @property
    def headline(self) -> Watched:
        return self.watched[0]

    @property
    def higher_is_better(self) -> bool:
        return self.headline.higher_is_better

    def watches(self, metrics: Mapping[str, Any]) -> bool:
        """Whether this evaluation logged what the guard watches (the proxy and its headline)."""
        return self.config.proxy in metrics and self.headline.key in metrics

    def observe(self, iteration: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Update with one evaluation; returns the ``guard/...`` metrics of it (``fired`` 1 when
        it fires now, ``new_best`` 1 when the headline gold metric is the best seen, ``streak``
        the longest run of worsening among the watched metrics)."""
        cfg = self.config
        proxy = metrics.get(cfg.proxy)
        values = {w.key: metrics.get(w.key) for w in self.watched}
        if not (_finite(proxy) and _finite(values[self.headline.key])):
            return {}
        now = {"proxy": float(proxy)} | {
            w.key: w.signed(float(v)) for w in self.watched if _finite(v := values[w.key])
        }
        new_best = self.best is None or now[self.headline.key] > self.best
        if new_best:
            self.best, self.best_iteration = now[self.headline.key], iteration
        fired = False
        if self.previous is not None:
            before = self.previous
            for w in self.watched:
                if w.key not in now or w.key not in before:
                    continue  # an evaluator that runs less often (its ``every``): its streak waits for it
                # against its own last evaluation, and the proxy as it was then
                rose = now["proxy"] - before.get(f"proxy/{w.key}", before["proxy"]) > cfg.min_change
                worse = before[w.key] - now[w.key] > w.tolerance
                self.streaks[w.key] = self.streaks.get(w.key, 0) + 1 if (rose and worse) else 0
            by = [w.key for w in self.watched if self.streaks.get(w.key, 0) >= cfg.patience]
            if by:
                fired = True
                self.fired_at.append(iteration)
                self.fired_by = by
                self.streaks = {}
        seen = {f"proxy/{key}": now["proxy"] for key in now if key != "proxy"}
        self.previous = {**(self.previous or {}), **now, **seen}
        streak = max(self.streaks.values(), default=0)
        return {"guard/streak": float(streak), "guard/fired": float(fired), "guard/new_best": float(new_best)}

    @property
    def stops(self) -> bool:
        return self.config.action == "stop" and bool(self.fired_at)

    def message(self, iteration: int) -> str:
        cfg = self.config
        by = {w.key: w for w in self.watched}
        moved = ", ".join(f"{key} {'fell' if by[key].higher_is_better else 'rose'}" for key in self.fired_by)
        what = "stopping the run" if cfg.action == "stop" else "training goes on (eval.guard.action: warn)"
        kept = " (checkpoints/best)" if cfg.action == "stop" else ""
        best = (
            ""
            if self.best_iteration is None
            else f"; the best {self.headline.key} was at iteration {self.best_iteration}{kept}"
        )
        return (
            f"over-optimisation guard: {cfg.proxy} rose while {moved} for {cfg.patience} evaluation(s) "
            f"in a row (iteration {iteration}); {what}{best}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "previous": self.previous,
            "streaks": dict(self.streaks),
            "best": self.best,
            "best_iteration": self.best_iteration,
            "fired_at": list(self.fired_at),
            "fired_by": list(self.fired_by),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        previous = state.get("previous")
        if isinstance(previous, list):  # a checkpoint of one watched metric: [proxy, gold]
            previous = {"proxy": previous[0], self.headline.key: previous[1]}
        self.previous = dict(previous) if previous is not None else None
        streaks = state.get("streaks")
        self.streaks = (
            {str(k): int(v) for k, v in streaks.items()}
            if isinstance(streaks, Mapping)
            else {self.headline.key: int(state.get("streak", 0))}
        )
        self.best = state.get("best")
        self.best_iteration = state.get("best_iteration")
        self.fired_at = list(state.get("fired_at", []))
        self.fired_by = list(state.get("fired_by", []))


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
