"""The report's figures: which charts the metrics allow, in reading order, with each world's own
words (its categories' name, which way each gold metric is better) read from the recipe's
registered components, and the base's value (the evaluation at iteration 0) marked on each."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from fgrpo.core import registry
from fgrpo.core.charts import (
    Series,
    is_constant,
    is_number,
    line_chart,
    series,
    smoothed,
    smoothing_window,
    x_axes,
)

# --- what the metrics hold ---------------------------------------------------------------------


def numeric_keys(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if is_number(value):
                seen.setdefault(key)
    return list(seen)


def categorised_keys(keys: Sequence[str]) -> dict[str, list[str]]:
    """``eval/<label>/<detail>`` -> its categories, for details reported per category."""
    out: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "eval" and parts[1] != "reward":
            base = "/".join(parts[:3])
            if base in keys:
                out.setdefault(base, []).append(parts[3])
    return out


@attrs.define
class Figures:
    """The figures of the curves section, and the series left out of them for being constant."""

    axes: Mapping[str, Mapping[float, float]]
    items: list[tuple[str, str, list[str]]] = attrs.Factory(list)  # (anchor, title, [chart html ...])
    constant: dict[str, float] = attrs.Factory(dict)  # what stayed the same: metric (or chart) -> value

    def chart(
        self,
        lines: Sequence[Series],
        *,
        title: str,
        width: int = 560,
        height: int = 240,
        categories: bool = False,
        **marks: Any,
    ) -> str:
        """A chart of the series that vary; the constant ones are noted once, not drawn
        (``categories``: a metric and its per-category series, noted as one entry when all agree)."""
        lines = [line for line in lines if line.points]
        flat = [line for line in lines if is_constant(line) and not line.faint]
        drawn = [line for line in lines if line not in flat]
        if categories and len(flat) > 1 and not drawn and len({line.points[0][1] for line in flat}) == 1:
            n = len(flat) - 1
            self.constant[f"{flat[0].key} (and its {n} categor{'y' if n == 1 else 'ies'})"] = flat[0].points[0][1]
        else:
            for line in flat:
                self.constant.setdefault(line.key or line.label, line.points[0][1])
        if all(line.faint for line in drawn):
            return ""
        return line_chart(drawn, title=title, axes=self.axes, width=width, height=height, **marks)

    def add(self, anchor: str, title: str, *charts: str) -> None:
        charts = tuple(c for c in charts if c)
        if charts:
            self.items.append((anchor, title, list(charts)))


def base_value(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The base model's value of an evaluation metric: the evaluation at iteration 0 (``eval.at_start``)."""
    value = next((r.get(key) for r in rows if r.get("iteration") == 0 and key in r), None)
    return float(value) if value is not None and is_number(value) else None


def figures(rows: Sequence[Mapping[str, Any]], recipe: Mapping[str, Any] | None = None) -> Figures:
    """Every chart the metrics allow, in reading order, on the x axes of :func:`x_axes`."""
    keys = numeric_keys(rows)
    traits = component_traits(recipe or {})
    figs = Figures(x_axes(rows, recipe or {}))
    chart = figs.chart

    train_rewards = [k for k in keys if k.startswith("reward/") and k.count("/") == 1]  # not reward/LABEL/DETAIL
    raw = series(rows, "reward_mean", "reward_mean, each iteration", faint=True, color=0)
    window = smoothing_window(len(raw.points))
    train = [raw, smoothed(raw, window, f"reward_mean, mean of {window} iterations" if window > 1 else "reward_mean")]
    if len(train_rewards) > 1:
        train += [smoothed(series(rows, k, color=i + 1), window, k) for i, k in enumerate(train_rewards)]
    held_out = [series(rows, "eval/reward_mean")] + (
        [series(rows, f"eval/{k}", color=i + 1) for i, k in enumerate(train_rewards)] if len(train_rewards) > 1 else []
    )
    figs.add(
        "fig-reward",
        "Reward: training batches (smoothed; each iteration faint) and held-out evaluation",
        chart(train, title="train reward"),
        chart(held_out, title="held-out reward", base=base_value(rows, "eval/reward_mean"), better="higher"),
    )
    categorised = categorised_keys(keys)
    for base, categories in categorised.items():
        noun = traits.category_noun.get(f"reward/{base.split('/')[1]}", "category")
        title = f"Held-out {base[len('eval/') :]} per {noun}"
        lines = [series(rows, base, ALL_LABEL)] + [series(rows, f"{base}/{c}", category_label(c)) for c in categories]
        figs.add(f"fig-{slug(base)}", title, chart(lines, title=base, categories=True))
    # a reward's own "gold" detail (runs without an evaluator); an evaluator's gold/... metrics
    # are drawn by gold_figures instead
    golds = [k for k in keys if k.startswith("eval/") and k.count("/") == 2 and "gold" in k.split("/")[-1]]
    golds = [] if any(k.startswith("gold/") for k in keys) else golds
    proxies = {f"eval/reward/{g.split('/')[1]}" for g in golds}  # drawn beside their gold metric below
    plain = [
        k
        for k in keys
        if k.startswith("eval/") and k.count("/") == 2 and k not in categorised and k not in golds and k not in proxies
    ]
    if plain:
        figs.add(
            "fig-eval",
            "Held-out metrics",
            *[chart([series(rows, k)], title=k, width=360, height=210, base=base_value(rows, k)) for k in plain],
        )
    for gold in golds:
        label = gold.split("/")[1]
        proxy = f"eval/reward/{label}" if f"eval/reward/{label}" in keys else "eval/reward_mean"
        figs.add(
            f"fig-gold-{slug(gold)}",
            f"Proxy against gold: {proxy} (optimised) and {gold} (not optimised)",
            chart([series(rows, proxy)], title=f"proxy: {proxy}", base=base_value(rows, proxy), better="higher"),
            chart([series(rows, gold, color=1)], title=f"gold: {gold}", base=base_value(rows, gold)),
        )
    gold_figures(figs, rows, keys, traits)
    figs.add(
        "fig-ratio",
        "Importance ratio, clipping and KL",
        chart(
            [series(rows, k) for k in ("ratio_mean", "ratio_min", "ratio_max")],
            title="ratio",
            width=420,
            min_relative_span=0.0,  # a ratio's distance from 1 is the information, however small
        ),
        chart(
            [series(rows, k) for k in ("clipfrac", "clipfrac_above", "clipfrac_below")],
            title="clip fraction",
            width=420,
        ),
        chart([series(rows, k) for k in ("kl", "approx_kl")], title="KL", width=420),
    )
    phases = [
        k for k in keys if k.startswith("time_") and k.endswith("_s") and k not in ("time_iteration_s", "time_eval_s")
    ]
    figs.add(
        "fig-time",
        "Time per iteration by phase, and per evaluation (seconds)",
        chart([series(rows, k) for k in phases], title="seconds per iteration, by phase"),
        chart([series(rows, "time_eval_s", color=len(phases))], title="seconds per evaluation"),
    )
    return figs


# --- gold metrics (evaluators) -------------------------------------------------------------------


def gold_metrics(keys: Sequence[str]) -> dict[str, dict[str, list[str]]]:
    """``gold/<label>/<metric>[/<category>]`` keys as {label: {metric: [categories]}}."""
    found: dict[str, dict[str, list[str]]] = {}
    for key in keys:
        parts = key.split("/")
        if parts[0] != "gold" or len(parts) < 3:
            continue
        metric = found.setdefault(parts[1], {}).setdefault(parts[2], [])
        if len(parts) == 4:
            metric.append(parts[3])
    return found


def gold_figures(
    figs: Figures, rows: Sequence[Mapping[str, Any]], keys: Sequence[str], traits: Traits | None = None
) -> None:
    """Per evaluator: the optimised proxy (the held-out reward) beside each gold metric, each with
    the base's value and which way is better, then each gold metric per category (scenario type,
    edit kind: the evaluator's ``category_noun``) that reports categories."""
    traits = traits or Traits()
    proxy = "eval/reward_mean"
    for label, metrics in gold_metrics(keys).items():
        directions = traits.directions.get(label, {})
        noun = traits.category_noun.get(label, "category")
        gold = [
            figs.chart(
                [series(rows, f"gold/{label}/{m}", color=1)],
                title=f"gold: {m}",
                width=360,
                height=210,
                base=base_value(rows, f"gold/{label}/{m}"),
                better=directions.get(m),
            )
            for m in metrics
        ]
        if any(gold):
            figs.add(
                f"fig-gold-{slug(label)}",
                f"Proxy against gold: {proxy} (optimised) and {label}'s metrics (not optimised)",
                figs.chart(
                    [series(rows, proxy)],
                    title=f"proxy: {proxy}",
                    width=360,
                    height=210,
                    base=base_value(rows, proxy),
                    better="higher",
                ),
                *gold,
            )
        per_category = [
            figs.chart(
                [series(rows, f"gold/{label}/{m}/{c}", category_label(c), color=i) for i, c in enumerate(categories)],
                title=f"{m} per {noun}",
                width=420,
                categories=True,
                better=directions.get(m),
            )
            for m, categories in metrics.items()
            if categories
        ]
        figs.add(f"fig-gold-{slug(label)}-types", f"Gold per {noun}: {label}", *per_category)


@attrs.frozen
class Traits:
    """What the recipe's components declare about their metrics, for the charts' words: per
    evaluator label (and ``"reward/<label>"`` per reward), which way each gold metric is better and what its
    categories are called."""

    directions: Mapping[str, Mapping[str, str]] = attrs.Factory(dict)
    category_noun: Mapping[str, str] = attrs.Factory(dict)


def component_traits(recipe: Mapping[str, Any]) -> Traits:
    """:class:`Traits` of the recipe's reward and evaluators, read from their registered classes
    (``directions``, ``category_noun``); a component that is not installed, or a recipe the report
    cannot read, gives the generic words."""
    named: dict[str, tuple[str, Any]] = {}
    for kind, section, prefix in (("reward", "reward", "reward/"), ("evaluator", "evaluator", "")):
        given = recipe.get(section)
        for spec in given if isinstance(given, list) else [given] if given else []:
            name = spec if isinstance(spec, str) else spec.get("name") if isinstance(spec, dict) else None
            label = (spec.get("label") or name) if isinstance(spec, dict) else name
            if isinstance(name, str) and isinstance(label, str):
                named[prefix + label] = (kind, name)
    directions, nouns = {}, {}
    for label, (kind, name) in named.items():
        try:
            cls = registry.load(kind, name) if isinstance(name, str) else None
        except Exception:  # noqa: BLE001 - a report is drawn with generic words rather than not at all
            cls = None
        declared = getattr(cls, "directions", None)
        if isinstance(declared, Mapping):
            directions[label] = {str(k): str(v) for k, v in declared.items()}
        noun = getattr(cls, "category_noun", None)
        if isinstance(noun, str) and noun:
            nouns[label] = noun
    return Traits(directions, nouns)


#: the per-category charts' two averages: every sample counts the same in one, every category in the other
ALL_LABEL = "all samples (mean of every sample)"


def category_label(category: str) -> str:
    return "overall (mean of the categories' means)" if category == "overall" else category


def slug(key: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in key).strip("-")
