"""``fgrpo report RUN``: one self-contained HTML page to look at after a run.

The page holds the curves (inline SVG: reward, held-out metrics per category, proxy against gold
where a reward logs a gold metric, ratio/clip/KL, time per phase), a table of the evaluations,
and a filmstrip: the same evaluation prompts and noise at every evaluation, image by image
(the tiles ``evaluation.write_eval_samples`` stores), embedded as data URIs. No scripts, no
external assets, no server: the file can be mailed or attached to an issue.
"""

from __future__ import annotations

import base64
import html
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fgrpo.core.runlog import METRICS, read_metrics
from fgrpo.core.shipped import DISTRIBUTIONS, version

REPORT = "report.html"
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
Series = tuple[str, list[tuple[float, float]]]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: Sequence[Mapping[str, Any]], key: str, label: str | None = None) -> Series:
    return label or key, [(r["iteration"], float(r[key])) for r in rows if _number(r.get(key))]


# --- SVG line charts ---------------------------------------------------------------------------


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if step * m >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.4g}" if v != 0 else "0"


def _tick_label(v: float, step: float, size: float) -> str:
    """Enough decimals to tell neighbouring ticks apart (1.0002 and 1.0000, not 1 and 1);
    ``size`` is the largest |tick|: tiny or huge axes get the short general format."""
    if 1e-3 <= size < 1e6:
        decimals = max(0, -math.floor(math.log10(step) + 1e-9))
        decimals += 0 if abs(step * 10**decimals - round(step * 10**decimals)) < 1e-6 else 1
        return f"{v:.{decimals}f}"
    return _fmt(round(v / step) * step)


def line_chart(lines: Sequence[Series], *, title: str, width: int = 520, height: int = 230) -> str:
    """An inline SVG chart of one or more series (x = iteration); ``""`` when nothing to draw."""
    lines = [(label, pts) for label, pts in lines if pts]
    if not lines:
        return ""
    xs = [x for _, pts in lines for x, _ in pts]
    ys = [y for _, pts in lines for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.05 or max(abs(y0) * 0.05, 1e-3)
    y0, y1 = y0 - pad, y1 + pad
    left, right, top, bottom = 58, 10, 24 + 14 * ((len(lines) + 2) // 3), 30
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{html.escape(title)}" class="chart">',
        f'<text x="{left}" y="14" class="title">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>',
    ]
    yticks = _ticks(y0, y1)
    for t in yticks:
        label = _tick_label(t, yticks[1] - yticks[0], max(map(abs, yticks))) if len(yticks) > 1 else _fmt(t)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>')
        out.append(f'<text x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{label}</text>')
    for t in _ticks(x0, x1):
        if float(t).is_integer():
            out.append(f'<text x="{px(t):.1f}" y="{top + ph + 14}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 3}" text-anchor="middle">iteration</text>')
    for i, (label, pts) in enumerate(lines):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5" data-series="{html.escape(label)}"/>')
        if len(pts) <= 40:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.2" fill="{color}"/>' for x, y in pts]
        lx, ly = left + (i % 3) * (pw / 3), 30 + 14 * (i // 3)
        out.append(f'<line x1="{lx:.1f}" x2="{lx + 14:.1f}" y1="{ly - 4}" y2="{ly - 4}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{lx + 18:.1f}" y="{ly}">{html.escape(label)} = {_fmt(pts[-1][1])}</text>')
    out.append("</svg>")
    return "\n".join(out)


# --- what the metrics hold ---------------------------------------------------------------------


def _keys(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if _number(value):
                seen.setdefault(key)
    return list(seen)


def _categorised(keys: Sequence[str]) -> dict[str, list[str]]:
    """``eval/<label>/<detail>`` -> its categories, for details reported per category."""
    out: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "eval" and parts[1] != "reward":
            base = "/".join(parts[:3])
            if base in keys:
                out.setdefault(base, []).append(parts[3])
    return out


def figures(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, list[str]]]:
    """(anchor, title, [svg ...]) of every chart the metrics allow, in reading order."""
    keys = _keys(rows)
    figs: list[tuple[str, str, list[str]]] = []

    def add(anchor: str, title: str, *charts: str) -> None:
        charts = tuple(c for c in charts if c)
        if charts:
            figs.append((anchor, title, list(charts)))

    train_rewards = [k for k in keys if k.startswith("reward/") and k.count("/") == 1]  # not reward/LABEL/DETAIL
    add("fig-reward", "Reward: training batches and held-out evaluation",
        line_chart([series(rows, "reward_mean", "train reward_mean"), series(rows, "eval/reward_mean")]
                   + ([series(rows, k) for k in train_rewards] if len(train_rewards) > 1 else []), title="reward"))
    categorised = _categorised(keys)
    for base, categories in categorised.items():
        title = f"Held-out {base[len('eval/'):]} per category"
        lines = [series(rows, base, "all")] + [series(rows, f"{base}/{c}", c) for c in categories]
        add(f"fig-{_slug(base)}", title, line_chart(lines, title=base))
    golds = [k for k in keys if k.startswith("eval/") and k.count("/") == 2 and "gold" in k.split("/")[-1]]
    proxies = {f"eval/reward/{g.split('/')[1]}" for g in golds}  # drawn beside their gold metric below
    plain = [k for k in keys if k.startswith("eval/") and k.count("/") == 2 and k not in categorised and k not in golds and k not in proxies]
    if plain:
        add("fig-eval", "Held-out metrics", *[line_chart([series(rows, k)], title=k, width=340, height=200) for k in plain])
    for gold in golds:
        label = gold.split("/")[1]
        proxy = f"eval/reward/{label}" if f"eval/reward/{label}" in keys else "eval/reward_mean"
        add(f"fig-gold-{_slug(gold)}", f"Proxy against gold: {proxy} (optimised) and {gold} (not optimised)",
            line_chart([series(rows, proxy)], title=f"proxy: {proxy}", width=400),
            line_chart([series(rows, gold)], title=f"gold: {gold}", width=400))
    add("fig-ratio", "Importance ratio, clipping and KL",
        line_chart([series(rows, k) for k in ("ratio_mean", "ratio_min", "ratio_max")], title="ratio", width=400),
        line_chart([series(rows, k) for k in ("clipfrac", "clipfrac_above", "clipfrac_below")], title="clip fraction", width=400),
        line_chart([series(rows, k) for k in ("kl", "approx_kl")], title="KL", width=400))
    times = [k for k in keys if k.startswith("time_") and k.endswith("_s") and k != "time_iteration_s"]
    add("fig-time", "Time per phase (seconds)", line_chart([series(rows, k) for k in times], title="seconds per phase"))
    return figs


def _slug(key: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in key).strip("-")


# --- evaluations and filmstrip ------------------------------------------------------------------


def evaluation_table(rows: Sequence[Mapping[str, Any]]) -> str:
    evals = [r for r in rows if _number(r.get("eval/reward_mean"))]
    if not evals:
        return "<p>No evaluation in this run (eval.every is 0).</p>"
    keys = _keys(evals)
    columns = ["eval/reward_mean"] + [k for k in keys if k.startswith("eval/") and k.count("/") == 2] + (
        ["time_eval_s"] if "time_eval_s" in keys else [])
    categorised = _categorised(keys)
    main = next((b for b in categorised if b.endswith("accuracy")), next(iter(categorised), None))
    parts = [_table(evals, columns)]
    if main is not None:
        parts.append(f"<h3>{html.escape(main)} per category</h3>")
        parts.append(_table(evals, [f"{main}/{c}" for c in categorised[main]], strip=f"{main}/"))
    return "\n".join(parts)


def _table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], strip: str = "eval/") -> str:
    head = "".join(f"<th>{html.escape(c[len(strip):] if c.startswith(strip) else c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = "".join(f"<td>{_fmt(r[c]) if _number(r.get(c)) else ''}</td>" for c in columns)
        body.append(f"<tr><th>{r['iteration']}</th>{cells}</tr>")
    return f'<div class="wide"><table class="evals"><thead><tr><th>iteration</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _data_uri(path: Path) -> str:
    mime = "image/jpeg" if path.suffix.lower() in (".jpg", ".jpeg") else "image/png"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def evaluations_with_tiles(run_dir: Path) -> list[tuple[int, list[dict[str, Any]]]]:
    """(iteration, tiles) for every evaluation that stored filmstrip tiles, in order."""
    found = []
    for index in sorted((run_dir / "samples").glob("eval_*/index.json")):
        try:
            tiles = json.loads(index.read_text())
            iteration = int(index.parent.name.split("_")[1])
        except (ValueError, json.JSONDecodeError, IndexError):
            continue
        found.append((iteration, [dict(t, path=index.parent / t["file"]) for t in tiles if (index.parent / t["file"]).is_file()]))
    return found


def tile_class(tile: Mapping[str, Any]) -> str:
    """The CSS class of a filmstrip tile: an edit's tile (source -> output, ``sources`` in its
    index row) is shown wider, in proportion to the images it holds."""
    sources = tile.get("sources")
    return f"tile edit{min(int(sources), 3)}" if _number(sources) and sources else "tile"


def filmstrip(run_dir: Path) -> tuple[str, int]:
    """A table: one row per evaluation prompt, one column per evaluation; (html, images)."""
    evals = evaluations_with_tiles(run_dir)
    if not evals:
        return "<p>No evaluation images in this run.</p>", 0
    n = max(len(tiles) for _, tiles in evals)
    head = "".join(f"<th>iter {it}</th>" for it, _ in evals)
    body, images = [], 0
    for i in range(n):
        prompt = next((tiles[i]["prompt"] for _, tiles in evals if i < len(tiles)), "")
        cells = []
        for _, tiles in evals:
            if i >= len(tiles) or tiles[i]["prompt"] != prompt:
                cells.append("<td></td>")
                continue
            tile = tiles[i]
            read = tile.get("read") or ""
            score = tile.get("score")
            caption = (f"{score:.3g}" if _number(score) else "") + (f"<br><span class=read>{html.escape(read)}</span>" if read else "")
            alt = html.escape(f"{prompt} (score {score})", quote=True)
            cells.append(f'<td><img src="{_data_uri(tile["path"])}" alt="{alt}" title="{html.escape(read, quote=True)}" class="{tile_class(tile)}">'
                         f"<div class=score>{caption}</div></td>")
            images += 1
        body.append(f'<tr><th class="prompt">{html.escape(prompt)}</th>{"".join(cells)}</tr>')
    table = f'<table class="filmstrip"><thead><tr><th>prompt</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    return table, images


# --- the page ----------------------------------------------------------------------------------

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}
nav a{margin-right:12px}figure{display:inline-block;margin:8px 16px 8px 0;vertical-align:top}
figcaption{font-weight:600;margin-bottom:4px}svg.chart{font:11px sans-serif;margin-right:8px}
svg .title{font-weight:600}svg .frame{fill:none;stroke:#999}svg .grid{stroke:#eee}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}
table.filmstrip td{text-align:center;vertical-align:top;width:84px}table.filmstrip th.prompt{text-align:left;max-width:180px;font-weight:normal}
img.tile{width:72px;height:auto;image-rendering:pixelated;display:block;margin:auto}
img.tile.edit1{width:146px}img.tile.edit2{width:220px}img.tile.edit3{width:294px}
.score{font-size:11px}.read{color:#777;font-size:10px}.meta td,.meta th{text-align:left}
.wide{overflow-x:auto}pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:12px}
"""


def render(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    recipe_text = (run_dir / "recipe.resolved.yaml").read_text() if (run_dir / "recipe.resolved.yaml").is_file() else ""
    recipe = yaml.safe_load(recipe_text) if recipe_text else {}
    figs = figures(rows)
    strip, n_images = filmstrip(run_dir)
    done = max((r["iteration"] for r in rows), default=0)
    total = (recipe.get("train") or {}).get("iterations", "?")

    def component(section: str) -> str:
        spec = recipe.get(section)
        if isinstance(spec, list):
            return ", ".join(f"{s.get('name')} (weight {s.get('weight')})" for s in spec if isinstance(s, dict))
        return str(spec.get("name")) if isinstance(spec, dict) else ""

    meta = [("run folder", str(run_dir.resolve())), ("iterations", f"{done} of {total}")]
    meta += [(s, component(s)) for s in ("model", "sampler", "reward", "objective", "prompts") if component(s)]
    meta.append(("written", time.strftime("%Y-%m-%d %H:%M:%S") + " by " + ", ".join(f"{d} {version(d)}" for d in DISTRIBUTIONS if version(d))))
    nav = "".join(f'<a href="#{a}">{html.escape(t)}</a>' for a, t, _ in figs)
    nav += '<a href="#evaluations">evaluations</a><a href="#filmstrip">filmstrip</a><a href="#recipe">recipe</a>'
    fig_html = "\n".join(
        f'<figure id="{a}" class="curves"><figcaption>{html.escape(t)}</figcaption>{"".join(charts)}</figure>' for a, t, charts in figs
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fgrpo report: {html.escape(run_dir.name)}</title>
<style>{STYLE}</style></head><body>
<h1>fgrpo run report: {html.escape(run_dir.name)}</h1>
<table class="meta">{"".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in meta)}</table>
<nav>{nav}</nav>
<h2 id="curves">Curves</h2>
{fig_html or "<p>No metrics yet.</p>"}
<h2 id="evaluations">Evaluations</h2>
{evaluation_table(rows)}
<h2 id="filmstrip">Filmstrip</h2>
<p>The first sample of each evaluation prompt, drawn from the same noise at every evaluation ({n_images} images);
under each its score and, in grey, what the reward read.</p>
<div class="wide">{strip}</div>
<h2 id="recipe">Recipe</h2>
<details><summary>recipe.resolved.yaml</summary><pre>{html.escape(recipe_text)}</pre></details>
</body></html>
"""


def write(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report of ``run_dir`` (default ``RUN/report.html``) atomically; returns its path."""
    run_dir = Path(run_dir)
    if not (run_dir / METRICS).is_file():
        from fgrpo.core.config import ConfigError, RecipeError

        raise RecipeError([ConfigError("RUN", f"{run_dir} holds no {METRICS}: not a run folder")])
    out = Path(out) if out is not None else run_dir / REPORT
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(run_dir), encoding="utf-8")
    tmp.replace(out)
    return out
