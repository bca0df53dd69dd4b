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
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import confine, runread, stages, weights
from fgrpo.core.charts import (
    AXES,
    fmt,
    is_number,
)
from fgrpo.core.config import first_line
from fgrpo.core.figures import Traits, categorised_keys, component_traits, figures, gold_metrics, numeric_keys
from fgrpo.core.runlog import METRICS, metrics_rows
from fgrpo.core.shipped import DISTRIBUTIONS, version

REPORT = "report.html"


def gold_table(rows: Sequence[Mapping[str, Any]], traits: Traits | None = None) -> str:
    """The gold metrics (and the guard's) at every evaluation, then the first metric per category."""
    evals = [r for r in rows if any(k.startswith("gold/") for k in r)]
    if not evals:
        return ""
    keys = numeric_keys(evals)
    found = gold_metrics(keys)
    columns = ["eval/reward_mean"] + [f"gold/{label}/{m}" for label, metrics in found.items() for m in metrics]
    columns += [k for k in ("guard/streak", "guard/fired") if k in keys]
    parts = ["<h3>gold metrics</h3>", _table(evals, [c for c in columns if c in keys], strip="gold/")]
    for label, metrics in found.items():
        for metric, categories in metrics.items():
            if categories:
                base = f"gold/{label}/{metric}"
                noun = (traits or Traits()).category_noun.get(label, "category")
                parts.append(f"<h3>{html.escape(base)} per {html.escape(noun)}</h3>")
                parts.append(_table(evals, [base] + [f"{base}/{c}" for c in categories], strip=f"{base}/"))
    return "\n".join(parts)


def gold_filmstrip(run_dir: Path, notes: list[str] | None = None) -> tuple[str, int]:
    """The evaluators' pictures (``samples/gold_N/<label>/``), one filmstrip per evaluator; every
    folder, index and tile read as the evaluation filmstrip's are (:func:`indexed_tiles`)."""
    notes = [] if notes is None else notes
    by_label: dict[str, list[tuple[int, list[dict[str, Any]]]]] = {}
    for iteration, folder in _numbered_folders(run_dir, "gold_"):
        for label_folder in sorted(p for p in folder.iterdir() if confine.not_a_link(p).is_dir()):
            tiles = indexed_tiles(run_dir, label_folder, notes)
            if tiles is not None:
                by_label.setdefault(label_folder.name, []).append((iteration, tiles))
    parts, images = [], 0
    for label, evals in sorted(by_label.items()):
        table, n, badges = strip_table(evals)
        parts.append(
            f'<h3>{html.escape(label)}</h3><p class="legend-line">Badges: {html.escape(LEGENDS[badges])}.</p>'
            f'<div class="wide">{table}</div>'
        )
        images += n
    return "\n".join(parts), images


# --- evaluations and filmstrip ------------------------------------------------------------------


def evaluation_table(rows: Sequence[Mapping[str, Any]]) -> str:
    evals = [r for r in rows if is_number(r.get("eval/reward_mean"))]
    if not evals:
        return "<p>No evaluation in this run (eval.every is 0).</p>"
    keys = numeric_keys(evals)
    columns = (
        ["eval/reward_mean"]
        + [k for k in keys if k.startswith("eval/") and k.count("/") == 2]
        + (["time_eval_s"] if "time_eval_s" in keys else [])
    )
    categorised = categorised_keys(keys)
    main = next((b for b in categorised if b.endswith("accuracy")), next(iter(categorised), None))
    parts = [f"<div>{_table(evals, columns)}</div>"]
    if main is not None:
        per_category = _table(evals, [f"{main}/{c}" for c in categorised[main]], strip=f"{main}/")
        parts.append(f"<div><h3>{html.escape(main)} per category</h3>{per_category}</div>")
    return f'<div class="side">{"".join(parts)}</div>'


def _table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], strip: str = "eval/") -> str:
    head = "".join(f"<th>{html.escape(c[len(strip) :] if c.startswith(strip) else c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = "".join(f"<td>{fmt(r[c]) if is_number(r.get(c)) else ''}</td>" for c in columns)
        body.append(f"<tr><th>{r['iteration']}</th>{cells}</tr>")
    return (
        f'<div class="wide"><table '
        f'class="evals"><thead><tr><th>iteration</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    )


def _data_uri(path: Path, what: str) -> str:
    mime = "image/jpeg" if path.suffix.lower() in (".jpg", ".jpeg") else "image/png"
    data = runread.read_bytes(path, limit=runread.LIMITS["image"], what=what)
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _numbered_folders(run_dir: Path, prefix: str) -> list[tuple[int, Path]]:
    """(N, folder) of ``RUN/samples/<prefix>N`` (``eval_``, ``gold_``), in order; a link among them
    refuses the report (:class:`fgrpo.core.confine.Escape`)."""
    samples = confine.not_a_link(run_dir / "samples")
    if not samples.is_dir():
        return []
    found = []
    for folder in samples.iterdir():
        number = folder.name.removeprefix(prefix)
        if folder.name.startswith(prefix) and number.isdigit() and confine.not_a_link(folder).is_dir():
            found.append((int(number), folder))
    return sorted(found)


def indexed_tiles(run_dir: Path, folder: Path, notes: list[str]) -> list[dict[str, Any]] | None:
    """The tiles ``folder/index.json`` lists (a JSON list of objects, each naming its ``file`` inside
    ``folder``, with its prompt, score and what the verifier read), or None when the folder holds no
    index. An index damaged the way a kill or a full disk leaves one, or a tile without a file, is
    left out and said in ``notes``; a name that leads out of the folder, a link, a FIFO or a device
    refuses the report (:class:`fgrpo.core.runread.Unreadable`, :class:`fgrpo.core.confine.Escape`)."""
    index = confine.not_a_link(folder / "index.json")
    if not index.exists():
        return None
    shown = index.relative_to(run_dir)
    try:
        tiles = runread.read_json(index, what=str(shown))
    except runread.Unreadable as exc:
        if "not valid JSON" not in str(exc):
            raise
        notes.append(f"{shown} does not read as JSON: left out")
        return None
    if not isinstance(tiles, list):
        notes.append(f"{shown} is not a list of tiles: left out")
        return None
    kept = []
    for k, tile in enumerate(tiles):
        if not isinstance(tile, dict) or "file" not in tile:
            notes.append(f"{shown}: tile {k} names no file: left out")
            continue
        path = confine.inside(folder, tile["file"], what=f"{shown}: tile {k}")
        if path.is_file():
            score = tile.get("score")
            kept.append(
                dict(
                    tile,
                    path=path,
                    prompt=str(tile.get("prompt", "")),
                    read=str(tile.get("read") or ""),
                    score=score if is_number(score) else None,
                )
            )
    return kept


def evaluations_with_tiles(run_dir: Path, notes: list[str] | None = None) -> list[tuple[int, list[dict[str, Any]]]]:
    """(iteration, tiles) for every evaluation that stored filmstrip tiles, in order
    (:func:`indexed_tiles`)."""
    notes = [] if notes is None else notes
    found = []
    for iteration, folder in _numbered_folders(run_dir, "eval_"):
        tiles = indexed_tiles(run_dir, folder, notes)
        if tiles is not None:
            found.append((iteration, tiles))
    return found


def tile_class(tile: Mapping[str, Any]) -> str:
    """The CSS class of a filmstrip tile: an edit's tile (source -> output, ``sources`` in its
    index row) is shown wider, in proportion to the images it holds (tiles written before tiles
    named their size; a tile that names it is shown at that size: :func:`tile_size`)."""
    sources = tile.get("sources")
    return f"tile edit{min(int(sources), 3)}" if is_number(sources) and sources else "tile"


def tile_size(tile: Mapping[str, Any]) -> str:
    """``style="width:Wpx"`` for a tile whose index names its width (its file's own: a driving
    scene is 384 px wide, a magnified shapes cell grid 96), else nothing (the CSS class decides)."""
    width: Any = tile.get("width")
    return f' style="width:{int(width)}px"' if is_number(width) and 8 <= float(width) <= 1024 else ""


#: what each kind of badge means, under the filmstrip
LEGENDS = {
    "verdict": "green: passed, red: failed, by the world's pass rule (the score beside it)",
    "binary": "green: passed (score 1), red: failed (score 0)",
    "graded": "coloured from red (the lowest score shown) to green (the highest)",
}


def score_style(scores: Sequence[Any], verdicts: Sequence[Any] = ()) -> Any:
    """How a filmstrip badge is drawn: the world's verdict (``passed`` in the tile: pass / fail
    with the score beside it) where the tiles carry one; else pass (green) / fail (red) when every
    score is 0 or 1 (a verifier's strict verdict); else from red (the strip's lowest) to green (its
    highest). Returns (style(score, passed) -> (classes, inline style, text), the kind)."""
    finite = [s for s in scores if is_number(s)]
    kind = (
        "verdict"
        if any(isinstance(v, bool) for v in verdicts)
        else "binary"
        if finite and all(s in (0, 1) for s in finite)
        else "graded"
    )
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)

    def style(score: Any, passed: Any = None) -> tuple[str, str, str]:
        shown = f"{score:.3g}" if is_number(score) else ""
        if kind == "verdict" and isinstance(passed, bool):
            return (
                ("score pass" if passed else "score fail"),
                "",
                ("pass" if passed else "fail") + (f" · {shown}" if shown else ""),
            )
        if not is_number(score):
            return "score", "", ""
        if kind == "binary":
            return ("score pass" if score == 1 else "score fail"), "", shown
        t = (score - lo) / (hi - lo) if hi > lo else 1.0
        hue = round(120 * t)  # 0 red, 60 amber, 120 green
        return "score graded", f' style="background:hsl({hue},70%,88%);color:hsl({hue},80%,24%)"', shown

    return style, kind


def filmstrip(run_dir: Path, notes: list[str] | None = None) -> tuple[str, int, str]:
    """A table: one row per evaluation prompt, one column per evaluation; (html, images, the kind
    of its badges: a key of :data:`LEGENDS`)."""
    evals = evaluations_with_tiles(run_dir, notes)
    if not evals:
        return "<p>No evaluation images in this run.</p>", 0, "graded"
    return strip_table(evals)


def strip_table(evals: Sequence[tuple[int, list[dict[str, Any]]]]) -> tuple[str, int, str]:
    """The filmstrip of ``evals`` ((iteration, tiles) each): one row per prompt, one column per
    evaluation; (html, images, the kind of its badges)."""
    n = max((len(tiles) for _, tiles in evals), default=0)
    if n == 0:  # evaluations whose every tile was left out (the notes say why)
        return "", 0, "graded"
    every = [t for _, tiles in evals for t in tiles]
    style, kind = score_style([t.get("score") for t in every], [t.get("passed") for t in every])
    head = f"<thead><tr><th>prompt</th>{''.join(f'<th>iter {it}</th>' for it, _ in evals)}</tr></thead>"
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
            classes, inline, text = style(score, tile.get("passed"))
            caption = (f'<span class="{classes}"{inline}>{html.escape(text)}</span>' if text else "") + (
                f"<br><span class=read>{html.escape(read)}</span>" if read else ""
            )
            alt = html.escape(f"{prompt} (score {score})", quote=True)
            cells.append(
                f'<td><img src="{_data_uri(tile["path"], str(tile["path"]))}" alt="{alt}" '
                f'title="{html.escape(read, quote=True)}" class="{tile_class(tile)}"{tile_size(tile)}>'
                f"<div class=caption>{caption}</div></td>"
            )
            images += 1
        body.append(f'<tr><th class="prompt">{html.escape(prompt)}</th>{"".join(cells)}</tr>')
    # a few evaluations make a narrow table: the prompts then go to two tables side by side
    halves = 2 if len(evals) <= 6 and len(body) > 8 else 1
    size = -(-len(body) // halves)
    tables = [
        f'<table class="filmstrip">{head}<tbody>{"".join(body[i : i + size])}</tbody></table>'
        for i in range(0, len(body), size)
    ]
    return f'<div class="side">{"".join(tables)}</div>', images, kind


# --- the page ----------------------------------------------------------------------------------

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}
.page{max-width:1400px;margin:0 auto;padding:16px 24px}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}h3{font-size:15px}
nav a{margin-right:12px}
.top{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:8px 32px;align-items:start}
.side{display:flex;flex-wrap:wrap;gap:8px 32px;align-items:flex-start}.side>*{max-width:100%;overflow-x:auto}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:20px 28px}
figure{margin:0;min-width:0}figure.span{grid-column:1/-1}
figcaption{font-weight:600;margin-bottom:4px}
.charts{display:flex;flex-wrap:wrap;gap:8px 24px}.charts>.chart{min-width:0}
svg.chart{font:11px sans-serif;display:block}svg .title{font-weight:600}svg .frame{fill:none;stroke:#999}
svg .grid{stroke:#eee}svg line.base{stroke:#555;stroke-dasharray:5 3}svg text.base{fill:#555}
.legend{font-size:11px;margin:2px 0 0 58px}.legend span{display:inline-block;margin:0 14px 2px 0;white-space:nowrap}
.legend i{display:inline-block;width:14px;height:3px;vertical-align:middle;margin-right:5px}
.legend i.faint{opacity:.35}.legend i.base{height:0;border-top:2px dashed #555;background:none}
.constant{color:#555;font-size:12px}
.warning{background:#fff4e5;border-left:4px solid #f29900;padding:6px 10px;margin:10px 0}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}
table.filmstrip td{text-align:center;vertical-align:top;min-width:84px}
table.filmstrip th.prompt{text-align:left;max-width:220px;font-weight:normal}
img.tile{width:72px;height:auto;image-rendering:pixelated;display:block;margin:auto}
img.tile.edit1{width:146px}img.tile.edit2{width:220px}img.tile.edit3{width:294px}
.caption{font-size:11px;margin-top:2px}.score{display:inline-block;padding:0 5px;border-radius:3px;font-weight:600}
.pass{background:#e6f4ea;color:#137333}.fail{background:#fce8e6;color:#c5221f}
.read{color:#777;font-size:10px}.meta td,.meta th{text-align:left}
.wide{overflow-x:auto}pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:12px}
input.axis{position:absolute;opacity:0;pointer-events:none}
.axis-choice label{border:1px solid #bbb;border-radius:4px;padding:1px 8px;margin-left:4px;cursor:pointer;
font-size:12px}
""" + "".join(
    # the chosen x axis: its groups shown, its button pressed; iteration by default
    f".x-{a}{{display:{'inline' if a == 'iteration' else 'none'}}}"
    f"#x-{a}:checked~.page .x-{a}{{display:inline}}"
    + "".join(f"#x-{a}:checked~.page .x-{b}{{display:none}}" for b, _ in AXES if b != a)
    + f"#x-{a}:checked~.page label[for=x-{a}]{{background:#333;color:#fff;border-color:#333}}"
    for a, _ in AXES
)


def _compact(keys: Sequence[str]) -> list[str]:
    """``eval/x/clean/a``, ``eval/x/clean/b`` -> ``eval/x/clean/{a, b}`` (categories of one metric)."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        head, _, tail = key.rpartition("/")
        groups.setdefault(head if key.count("/") == 3 else key, []).append(tail if key.count("/") == 3 else "")
    return [
        f"{head}/{{{', '.join(tails)}}}" if len(tails) > 1 else (f"{head}/{tails[0]}" if tails[0] else head)
        for head, tails in groups.items()
    ]


def evaluated_weights(recipe: Mapping[str, Any]) -> str:
    """Which weights the evaluations used, from the recipe (the run's lines say how often the EMA moved)."""
    train = recipe.get("train") or {}
    if train.get("ema_decay"):
        return (
            f"the EMA of the trained weights (decay {train['ema_decay']}, updated every "
            f"{train.get('ema_every', 1)} optimizer steps)"
        )
    return "the raw trained weights (no EMA)"


def _recipe(run_dir: Path, notes: list[str]) -> tuple[str, dict[str, Any]]:
    """The run's recipe.resolved.yaml: its text and, when it reads as a recipe, its data (through
    the recipe loader's YAML guard: an alias bomb is a note, not a report that never ends)."""
    path = confine.not_a_link(run_dir / "recipe.resolved.yaml")
    if not path.exists():
        return "", {}
    text = runread.read_bytes(path, limit=runread.LIMITS["yaml"], what=str(path)).decode("utf-8", "replace")
    try:
        data = runread.loads_yaml(text, what="recipe.resolved.yaml")
    except runread.Unreadable as exc:
        notes.append(
            f"recipe.resolved.yaml does not read as YAML ({first_line(exc, 160)}): its components are not shown"
        )
        return text, {}
    if data is not None and not isinstance(data, dict):
        notes.append(f"recipe.resolved.yaml is not a recipe (a {type(data).__name__}): its components are not shown")
        return text, {}
    return text, data or {}


def earlier_stages(run_dir: Path) -> str:
    """Links to the reports of the stages trained before this run (a recipe's ``then:``, in
    ``stages/N`` of its folder): the names only, nothing of theirs read, no link followed."""
    folder = run_dir / stages.FOLDER
    if folder.is_symlink() or not folder.is_dir():
        return ""
    found = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir() and not p.is_symlink())
    if not found:
        return ""
    links = ", ".join(f'<a href="{stages.FOLDER}/{k}/report.html">stage {k}</a>' for k in found)
    return f'<p class="note">This run is the last stage of its recipe; the stages before it: {links}.</p>'


def render(run_dir: Path) -> str:
    """The report's HTML; everything it shows is read first, and a name that leads out of the run
    folder refuses the whole report (:class:`fgrpo.core.confine.Escape`), before anything is written."""
    run_dir = Path(run_dir)
    notes: list[str] = []
    rows, skipped = metrics_rows(run_dir)
    if skipped:
        notes.append(
            f"{skipped} line{'s' if skipped > 1 else ''} of metrics.jsonl {'are' if skipped > 1 else 'is'} not "
            f"{'metrics rows' if skipped > 1 else 'a metrics row'} (a line cut by a kill or a full disk?): left out"
        )
    recipe_text, recipe = _recipe(run_dir, notes)
    figs = figures(rows, recipe)
    strip, n_images, badges = filmstrip(run_dir, notes)
    handed_over = weights.checkpoint_warnings(last) if (last := ckpt.last_complete(run_dir / "checkpoints")) else []
    warnings = "".join(f'<p class="warning">warning: {html.escape(line)}</p>' for line in handed_over)
    done = max((r["iteration"] for r in rows), default=0)
    train = recipe.get("train")
    total = train.get("iterations", "?") if isinstance(train, dict) else "?"

    def component(section: str) -> str:
        spec = recipe.get(section)
        if isinstance(spec, list):
            return ", ".join(f"{s.get('name')} (weight {s.get('weight')})" for s in spec if isinstance(s, dict))
        return str(spec.get("name")) if isinstance(spec, dict) else ""

    meta = [("run folder", str(run_dir.resolve())), ("iterations", f"{done} of {total}")]
    meta += [(s, component(s)) for s in ("model", "sampler", "reward", "objective", "prompts") if component(s)]
    meta.append(("evaluated with", evaluated_weights(recipe)))
    meta.append(
        (
            "written",
            time.strftime("%Y-%m-%d %H:%M:%S")
            + " by "
            + ", ".join(f"{d} {version(d)}" for d in DISTRIBUTIONS if version(d)),
        )
    )
    nav = "".join(f'<a href="#{a}">{html.escape(t.split(":")[0])}</a>' for a, t, _ in figs.items)
    gold = gold_section(run_dir, rows, notes, component_traits(recipe))
    nav += '<a href="#evaluations">evaluations</a><a href="#filmstrip">filmstrip</a>' + (
        '<a href="#gold">gold</a>' if gold else ""
    )
    nav += '<a href="#recipe">recipe</a>'
    radios = "".join(
        f'<input type="radio" name="x-axis" id="x-{a}" class="axis"{" checked" if a == "iteration" else ""}>'
        for a, _ in AXES
    )
    choice = "x axis:" + "".join(f'<label for="x-{a}">{html.escape(t)}</label>' for a, t in AXES)
    fig_html = "\n".join(
        f'<figure id="{a}" '
        f'class="curves{" span" if len(charts) > 1 else ""}"><figcaption>{html.escape(t)}</figcaption>'
        f'<div class="charts">{"".join(charts)}</div></figure>'
        for a, t, charts in figs.items
    )
    by_value: dict[float, list[str]] = {}
    for key, value in figs.constant.items():
        by_value.setdefault(value, []).append(key)
    by_value = {value: _compact(keys) for value, keys in by_value.items()}
    constant = (
        (
            '<p class="constant" id="constant">Constant over the run, not drawn: '
            + "; ".join(
                f"{', '.join(html.escape(k) for k in keys)} = {fmt(value)}" for value, keys in by_value.items()
            )
            + "</p>"
        )
        if figs.constant
        else ""
    )
    legend = LEGENDS[badges]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fgrpo report: {html.escape(run_dir.name)}</title>
<style>{STYLE}</style></head><body>
{radios}
<div class="page">
<h1>fgrpo run report: {html.escape(run_dir.name)}</h1>
<div class="top">
<table class="meta">{"".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in meta)}</table>
<div><nav>{nav}</nav><p class="axis-choice">{choice}</p></div>
</div>
{warnings}
{earlier_stages(run_dir)}
{"".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)}
<h2 id="curves">Curves</h2>
{constant}
<div class="grid">
{fig_html or "<p>No metrics yet.</p>"}
</div>
<h2 id="evaluations">Evaluations</h2>
{evaluation_table(rows)}
<h2 id="filmstrip">Filmstrip</h2>
<p>The first sample of each evaluation prompt, drawn from the same noise at every evaluation ({n_images} images);
under each its score ({legend}) and, in grey, what the reward read.</p>
<div class="wide">{strip}</div>
{gold}
<h2 id="recipe">Recipe</h2>
<details><summary>recipe.resolved.yaml</summary><pre>{html.escape(recipe_text)}</pre></details>
</div>
</body></html>
"""


def gold_section(
    run_dir: Path, rows: Sequence[Mapping[str, Any]], notes: list[str] | None = None, traits: Traits | None = None
) -> str:
    """The evaluators' part of the page (empty without one): their table and their filmstrip."""
    table = gold_table(rows, traits)
    strip, n = gold_filmstrip(run_dir, notes)
    if not table and not n:
        return ""
    return (
        f'<h2 id="gold">Gold metrics</h2>\n<p>What the evaluators measured (RL does not optimise it).</p>\n{table}\n'
        + (f"<p>The evaluators' pictures ({n} images).</p>\n{strip}" if n else "")
    )


def _unwritable(target: Path, exc: OSError) -> str:
    """Why ``target`` could not be written. A report replaces the file through a new one beside it:
    where the file exists but its folder takes no new file (/proc), "No such file" alone would
    name the wrong one."""
    why = exc.strerror or str(exc)
    try:
        exists = target.exists()
    except OSError:  # a name too long to look up
        exists = False
    if exists:
        return f"cannot write {target} (a new file in {target.parent}: {why}); nothing was written"
    return f"cannot write {target}: {why}"


def write(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report of ``run_dir`` (default ``RUN/report.html``) atomically; returns its path.
    Refusals (not a run, a name leading out of it, an ``--out`` that cannot be written) are one
    line each, and leave every file as it was."""
    from fgrpo.core.config import ConfigError, RecipeError

    run_dir = Path(run_dir)
    metrics = run_dir / METRICS
    if not (metrics.is_file() or metrics.is_symlink()):
        raise RecipeError([ConfigError("RUN", f"{run_dir} holds no {METRICS}: not a run folder")])
    target = Path(out) if out is not None else run_dir / REPORT
    try:
        folder = target.is_dir() and not target.is_symlink()
    except OSError:  # a name too long: writing it says so below
        folder = False
    if folder:
        raise RecipeError(
            [ConfigError("--out", f"{target} is a folder; give the report's file name (e.g. {target / REPORT})")]
        )
    page = render(run_dir)
    try:
        if not target.parent.exists():
            target.parent.mkdir(parents=True)
        confine.write_atomic(target, page)
    except OSError as exc:
        raise RecipeError([ConfigError("--out", _unwritable(target, exc))]) from None
    return target
