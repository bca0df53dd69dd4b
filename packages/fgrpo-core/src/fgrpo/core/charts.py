"""Inline SVG line charts for the run report: series read from metrics rows, smoothed where they
are noisy, drawn against one of several x axes (iteration, training time, samples) chosen by radio
buttons and CSS, with no script."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
#: the x axes a reader chooses between (radio buttons and CSS, no script): id, axis title
AXES = (("iteration", "iteration"), ("time", "training time (min)"), ("samples", "samples trained on"))


@attrs.frozen
class Series:
    """One line of a chart: (iteration, value) points; ``faint``: drawn light behind the others
    (the raw points under a smoothed line), its last value not repeated in the legend."""

    label: str
    points: list[tuple[float, float]]
    faint: bool = False
    color: int | None = None
    key: str = ""  # the metric, where the label is short ("all" in a per-category chart)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: Sequence[Mapping[str, Any]], key: str, label: str | None = None, **style: Any) -> Series:
    return Series(
        label or key, [(r["iteration"], float(r[key])) for r in rows if is_number(r.get(key))], key=key, **style
    )


def smoothing_window(n: int) -> int:
    """A centred moving average over about a fifteenth of the run (odd, 1 for short runs)."""
    w = max(1, round(n / 15))
    return w if w % 2 else w + 1


def smoothed(line: Series, window: int, label: str) -> Series:
    ys = [y for _, y in line.points]
    half = window // 2
    out = []
    for i, (x, _) in enumerate(line.points):
        part = ys[max(0, i - half) : i + half + 1]
        out.append((x, sum(part) / len(part)))
    return Series(label, out, color=line.color, key=line.key)


def is_constant(line: Series) -> bool:
    """Two points or more, all the same value: a chart would show a flat line."""
    ys = [y for _, y in line.points]
    return len(ys) >= 2 and max(ys) - min(ys) <= 1e-12 * max(1.0, abs(ys[0]))


def x_axes(rows: Sequence[Mapping[str, Any]], recipe: Mapping[str, Any]) -> dict[str, dict[float, float]]:
    """iteration -> x on each axis of :data:`AXES`: the iteration, the training time at its end
    (minutes: the iterations' and earlier evaluations' time, from metrics.jsonl) and the samples
    trained on (group_size x prompts_per_iteration per iteration)."""
    train = recipe.get("train") or {}
    per_iteration = (train.get("group_size") or 0) * (train.get("prompts_per_iteration") or 0)
    time, elapsed = {}, 0.0
    for row in sorted(rows, key=lambda r: r["iteration"]):
        it = row["iteration"]
        if is_number(row.get("time_iteration_s")):
            elapsed += row["time_iteration_s"]
        time[it] = elapsed / 60
        if is_number(row.get("time_eval_s")):
            elapsed += row["time_eval_s"]  # after this row's point: it evaluated the weights at its end
    its = {r["iteration"] for r in rows}
    return {
        "iteration": {i: float(i) for i in its},
        "time": time,
        "samples": {i: float(i * per_iteration) for i in its},
    }


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if step * m >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def fmt(v: float) -> str:
    return f"{v:.4g}" if v != 0 else "0"


def legend_value(v: float) -> str:
    """``v`` with the fewest significant digits (4 to 8) within 1e-4 of it relatively: a ratio of
    1.00025 reads 1.0003, not 1."""
    text = fmt(v)
    for digits in range(5, 9):
        if abs(float(text) - v) <= 1e-4 * abs(v):
            break
        text = f"{v:.{digits}g}"
    return text


#: the narrowest band a chart's y axis spans, as a fraction of its largest |value|: a held-out
#: reward moving from 0.5664 to 0.5668 is drawn nearly flat, not as a cliff
MIN_RELATIVE_SPAN = 0.02


def y_range(ys: Sequence[float], base: float | None, min_relative_span: float) -> tuple[float, float]:
    """The y axis's (low, high): the values (and the base's, where marked) with 5% to spare, at
    least ``min_relative_span`` of the largest |value| wide, about the values' middle."""
    values = list(ys) + ([base] if base is not None else [])
    lo, hi = min(values), max(values)
    span = max(hi - lo, min_relative_span * max(abs(lo), abs(hi)))
    if span <= 0:
        span = max(abs(lo) * 0.1, 2e-2)
    middle = (lo + hi) / 2
    lo, hi = min(lo, middle - span / 2), max(hi, middle + span / 2)
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def _tick_label(v: float, step: float, size: float) -> str:
    """Enough decimals to tell neighbouring ticks apart (1.0002 and 1.0000, not 1 and 1);
    ``size`` is the largest |tick|: tiny or huge axes get the short general format."""
    if 1e-3 <= size < 1e6:
        decimals = max(0, -math.floor(math.log10(step) + 1e-9))
        decimals += 0 if abs(step * 10**decimals - round(step * 10**decimals)) < 1e-6 else 1
        return f"{v:.{decimals}f}"
    return fmt(round(v / step) * step)


def _color(line: Series, i: int) -> str:
    return COLORS[(line.color if line.color is not None else i) % len(COLORS)]


def line_chart(
    lines: Sequence[Series],
    *,
    title: str,
    axes: Mapping[str, Mapping[float, float]] | None = None,
    width: int = 560,
    height: int = 240,
    base: float | None = None,
    better: str | None = None,
    min_relative_span: float = MIN_RELATIVE_SPAN,
) -> str:
    """One chart of one or more series: an inline SVG (one group of lines per x axis of
    :data:`AXES`, the chosen one shown, each over the whole run) and an HTML legend under it,
    each series with its last value; ``""`` when nothing to draw. ``base``: the base model's
    value, drawn as a dashed line; ``better``: "higher" or "lower", said in the title. The chart
    is shown at most ``width`` pixels wide, so every chart's text is the same size."""
    lines = [line for line in lines if line.points]
    if not lines:
        return ""
    axes = axes or {"iteration": {x: x for line in lines for x, _ in line.points}}
    y0, y1 = y_range([y for line in lines for _, y in line.points], base, min_relative_span)
    title = f"{title} ({better} is better)" if better in ("higher", "lower") else title
    left, right, top, bottom = 58, 12, 22, 32
    pw, ph = width - left - right, height - top - bottom

    def py(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
        f'role="img" aria-label="{html.escape(title)}" class="chart">',
        f'<text x="{left}" y="14" class="title">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>',
    ]
    yticks = _ticks(y0, y1)
    if base is not None:
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{py(base):.1f}" y2="{py(base):.1f}" class="base"/>'
            f'<text x="{left + pw - 4}" y="{py(base) - 3:.1f}" text-anchor="end" class="base">'
            f"base {legend_value(base)}</text>"
        )
    for t in yticks:
        label = _tick_label(t, yticks[1] - yticks[0], max(map(abs, yticks))) if len(yticks) > 1 else fmt(t)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>')
        out.append(f'<text x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{label}</text>')
    for axis, axis_title in AXES:
        at = axes.get(axis)
        if not at:
            continue
        if not any(x in at for line in lines for x, _ in line.points):
            continue
        x0, x1 = min(at.values()), max(at.values())  # the whole run: the charts of a page line up
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1

        def px(x: float, x0: float = x0, x1: float = x1) -> float:
            return left + (x - x0) / (x1 - x0) * pw

        out.append(f'<g class="x-{axis}">')
        xticks = _ticks(x0, x1)
        for t in xticks:
            label = _tick_label(t, xticks[1] - xticks[0], max(map(abs, xticks))) if len(xticks) > 1 else fmt(t)
            if axis == "time" or float(t).is_integer():
                out.append(
                    f'<text x="{px(t):.1f}" y="{top + ph + 14}" '
                    f'text-anchor="middle">{label if axis == "time" else int(t)}</text>'
                )
        out.append(f'<text x="{left + pw / 2}" y="{height - 3}" text-anchor="middle">{axis_title}</text>')
        for i, line in enumerate(lines):
            pts = [(at[x], y) for x, y in line.points if x in at]
            color = _color(line, i)
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            style = ' stroke-opacity="0.3" stroke-width="1"' if line.faint else ' stroke-width="1.6"'
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{color}"{style} '
                f'data-series="{html.escape(line.label)}"/>'
            )
            if line.faint or len(pts) <= 40:
                radius, opacity = (1.6, ' fill-opacity="0.3"') if line.faint else (2.2, "")
                out += [
                    f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{radius}" fill="{color}"{opacity}/>' for x, y in pts
                ]
        out.append("</g>")
    out.append("</svg>")
    legend = []
    for i, line in enumerate(lines):
        value = "" if line.faint else f" = {legend_value(line.points[-1][1])}"
        swatch = f'<i style="background:{_color(line, i)}"{" class=faint" if line.faint else ""}></i>'
        legend.append(f"<span>{swatch}{html.escape(line.label)}{value}</span>")
    if base is not None:
        legend.append(f'<span><i class="base"></i>base (iteration 0) = {legend_value(base)}</span>')
    return (
        f'<div class="chart" style="flex:0 1 {width}px">{"".join(out)}'
        f'<div class="legend">{"".join(legend)}</div></div>'
    )
