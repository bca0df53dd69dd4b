"""`fgrpo report` and what a run shows while and after it runs: the self-contained HTML report
(parsed, every figure and image it claims checked), the sample grids with scores and what was
read, and one line per evaluation in non-terminal output."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fgrpo.core import charts, cli, visuals
from fgrpo.core.runlog import read_metrics

ITERATIONS, EVERY, PROMPTS = 2, 1, 6


@pytest.fixture(scope="module")
def shapes_run(root, tmp_path_factory):
    """A short shapes run through the CLI: (folder, what compose printed)."""
    out = tmp_path_factory.mktemp("report") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main(
            [
                "compose",
                "shapes",
                "--out",
                str(out),
                "--quiet",
                "--set",
                f"train.iterations={ITERATIONS}",
                "--set",
                "train.prompts_per_iteration=2",
                "--set",
                f"eval.every={EVERY}",
                "--set",
                f"eval.max_prompts={PROMPTS}",
                "--set",
                "eval.samples_per_prompt=2",
            ]
        )
    assert code == 0
    return out, printed.getvalue()


class Page(HTMLParser):
    """The report's structure: ids, links, figures with their charts (series per x axis, the
    faint ones, the legend), images, external refs, the filmstrip's score classes."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.nav: list[str] = []
        self.figures: dict[str, list[dict]] = {}
        self.images: list[dict] = []
        self.tags: list[str] = []
        self.refs: list[str] = []
        self.radios: list[dict] = []
        self.classes: list[tuple[str, str]] = []  # (tag, class) of every element
        self.in_grid: list[str] = []  # the figures inside the curves' grid
        self.constant = ""
        self._figure: str | None = None
        self._svg: dict | None = None
        self._axis: str | None = None
        self._legend: dict | None = None
        self._in_nav = self._in_strip = self._in_constant = False
        self._grid_depth = 0
        self._filmstrip_rows: list[list[dict]] = []
        self._row: list[dict] | None = None
        self.scores: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        self.classes.append((tag, a.get("class") or ""))
        if "id" in a:
            self.ids.add(a["id"])
        for key in ("src", "href"):
            if key in a:
                self.refs.append(a[key])
        if tag == "div" and (self._grid_depth or a.get("class") == "grid"):
            self._grid_depth += 1
        if tag == "input":
            self.radios.append(a)
        elif tag == "nav":
            self._in_nav = True
        elif tag == "a" and self._in_nav:
            self.nav.append(a["href"])
        elif tag == "figure":
            self._figure = a["id"]
            self.figures[a["id"]] = []
            if self._grid_depth:
                self.in_grid.append(a["id"])
        elif tag == "svg" and self._figure is not None:
            self._svg = {
                "label": a.get("aria-label"),
                "series": {},
                "axes": {},
                "faint": set(),
                "legend": [],
                "texts": [],
            }
            self.figures[self._figure].append(self._svg)
        elif tag == "g" and self._svg is not None:
            self._axis = a["class"].removeprefix("x-")
            self._svg["axes"][self._axis] = {}
        elif tag == "polyline" and self._svg is not None:
            n = len(a["points"].split())
            self._svg["axes"][self._axis][a["data-series"]] = n
            if self._axis == "iteration":
                self._svg["series"][a["data-series"]] = n
            if a.get("stroke-opacity"):
                self._svg["faint"].add(a["data-series"])
        elif tag == "div" and a.get("class") == "legend" and self._figure is not None:
            self._legend = self.figures[self._figure][-1]
        elif tag == "p" and a.get("class") == "constant":
            self._in_constant = True
        elif tag == "table" and a.get("class") == "filmstrip":
            self._in_strip = True
        elif tag == "tr" and self._in_strip:
            self._row = []
            self._filmstrip_rows.append(self._row)
        elif tag == "span" and self._in_strip and "score" in (a.get("class") or ""):
            self.scores.append(a["class"])
        elif tag == "img":
            self.images.append(a)
            if self._row is not None:
                self._row.append(a)

    def handle_data(self, data):
        if self._legend is not None and data.strip():
            self._legend["legend"].append(data.strip())
        if self._svg is not None and data.strip():
            self._svg["texts"].append(data.strip())
        if self._in_constant:
            self.constant += data

    def handle_endtag(self, tag):
        if tag == "div" and self._grid_depth:
            self._grid_depth -= 1
        if tag == "nav":
            self._in_nav = False
        elif tag == "figure":
            self._figure = None
        elif tag == "svg":
            self._svg = None
        elif tag == "g":
            self._axis = None
        elif tag == "div" and self._legend is not None:
            self._legend = None
        elif tag == "p":
            self._in_constant = False
        elif tag == "table":
            self._in_strip, self._row = False, None

    def drawn(self) -> set[str]:
        return {name for charts in self.figures.values() for chart in charts for name in chart["series"]}


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_compose_ends_with_the_report_path(shapes_run):
    out, printed = shapes_run
    assert printed.strip().splitlines()[-1] == f"report: {out / 'report.html'}"
    assert (out / "report.html").is_file()


def test_report_holds_every_figure_and_image_it_claims(shapes_run):
    out, _ = shapes_run
    page = parse(out / "report.html")
    rows = read_metrics(out)
    # no external assets, no scripts: readable from the file alone
    assert "script" not in page.tags and "link" not in page.tags and "iframe" not in page.tags
    assert [r for r in page.refs if not r.startswith(("data:image/", "#"))] == []
    # every entry of the navigation leads to something on the page
    assert page.nav and all(href[1:] in page.ids for href in page.nav)
    # the curves the issue asks for, each chart drawing every series it names
    expected = {"fig-reward", "fig-gold-shapes-gold", "fig-time"}
    assert expected <= set(page.figures), sorted(page.figures)
    # accuracy per category: a chart, or (it did not move in 2 iterations) one entry of the constants
    assert "fig-eval-shapes-accuracy" in page.figures or "eval/shapes/accuracy (and its " in page.constant
    assert page.in_grid == list(page.figures)  # every figure in the page-wide grid
    for anchor, drawn in page.figures.items():
        assert f"#{anchor}" in page.nav
        assert drawn and all(chart["series"] for chart in drawn), anchor
    evaluations = [r["iteration"] for r in rows if "eval/reward_mean" in r]
    assert evaluations == [0, 1, 2]
    # every metric the issue names is either drawn or named in the one line of constants
    drawn, constant = page.drawn(), page.constant
    for key in [
        "eval/reward_mean",
        "eval/reward/shapes",
        "gold/shapes-gold/gold_error",
        "ratio_mean",
        "clipfrac",
        "kl",
        "time_rollout_s",
        "time_eval_s",
    ]:
        assert key in drawn or re.search(
            rf"(: |, |; ){re.escape(key)}( \(and its \d+ categor(y|ies)\))?(, | = )", constant
        ), key
    train = page.figures["fig-reward"][0]
    assert train["label"] == "train reward" and train["series"]["reward_mean, each iteration"] == ITERATIONS
    assert train["faint"] == {"reward_mean, each iteration"}
    phases = {
        k
        for r in rows
        for k in r
        if k.startswith("time_") and k.endswith("_s") and k not in ("time_iteration_s", "time_eval_s")
    }
    per_iteration, per_evaluation = page.figures["fig-time"]
    assert set(per_iteration["series"]) <= phases and "time_eval_s" not in per_iteration["series"]
    assert per_evaluation["series"] == {"time_eval_s": len(evaluations)}
    # the filmstrip: every stored tile of every evaluation, as a decodable embedded image, its score coloured
    # the evaluator's gold metric (shapes-gold) beside the optimised proxy; the same numbers as the
    # verifier's own detail, per category too
    series = [list(chart["series"]) for chart in page.figures["fig-gold-shapes-gold"]]
    assert ["gold/shapes-gold/gold_error"] in series  # the proxy beside it, unless it stayed constant (then noted)
    assert ["eval/reward_mean"] in series or "eval/reward_mean" in page.constant
    categories = sorted(k.split("/")[-1] for k in rows[0] if k.startswith("eval/shapes/gold_error/"))
    assert categories
    for row in rows:
        if "gold/shapes-gold/gold_error" in row:
            assert row["gold/shapes-gold/gold_error"] == row["eval/shapes/gold_error"]
            assert all(
                row[f"gold/shapes-gold/gold_error/{c}"] == row[f"eval/shapes/gold_error/{c}"] for c in categories
            )
    tiles = {it: json.loads((out / "samples" / f"eval_{it:06d}" / "index.json").read_text()) for it in evaluations}
    assert all(len(t) == PROMPTS for t in tiles.values())
    strip = [row for row in page._filmstrip_rows if row]
    assert len(strip) == PROMPTS and all(len(row) == len(evaluations) for row in strip)
    for i, row in enumerate(strip):
        for img, it in zip(row, evaluations, strict=True):
            assert img["alt"].startswith(tiles[it][i]["prompt"])  # the same prompt along the row
            data = base64.b64decode(img["src"].split(",", 1)[1])
            assert data == (out / "samples" / f"eval_{it:06d}" / tiles[it][i]["file"]).read_bytes()
            # a 24 px cell grid is stored magnified 4x (nearest) and shown at that size
            assert Image.open(io.BytesIO(data)).size == (96, 96) == (tiles[it][i]["width"], tiles[it][i]["height"])
            assert img["style"] == "width:96px"
    verdicts = [("pass" if t["score"] == 1 else "fail") for it in evaluations for t in tiles[it]]
    assert sorted(page.scores) == sorted(f"score {v}" for v in verdicts)  # strict scores: pass/fail
    text = (out / "report.html").read_text()
    assert (
        f"({PROMPTS * len(evaluations)} images)" in text and "green: passed (score 1), red: failed (score 0)" in text
    )
    assert text.count("<tr><th>") - text.count('class="prompt"') >= len(evaluations)  # the evaluation table
    assert "evaluated with</th><td>the raw trained weights (no EMA)" in text


def test_every_chart_offers_three_x_axes_and_a_legend_outside_the_plot(shapes_run):
    """iteration, training time and samples: each chart draws its series on each (one shown at a
    time, chosen by radio buttons and CSS, no script); the legend is HTML under the plot, so its
    swatches never overlap the numbers."""
    out, _ = shapes_run
    page = parse(out / "report.html")
    radios = [r for r in page.radios if r.get("type") == "radio"]
    assert [r["id"] for r in radios] == ["x-iteration", "x-time", "x-samples"] and "checked" in radios[0]
    assert {r["name"] for r in radios} == {"x-axis"}
    text = (out / "report.html").read_text()
    assert "#x-time:checked~.page .x-time{display:inline}" in text and ".x-time{display:none}" in text
    for label in ("iteration", "training time (min)", "samples trained on"):
        assert f">{label}</label>" in text
    charts = [chart for charts in page.figures.values() for chart in charts]
    for chart in charts:
        assert set(chart["axes"]) == {"iteration", "time", "samples"}
        assert all(series == chart["series"] for series in chart["axes"].values()), chart["label"]
        assert not any(" = " in t for t in chart["texts"])  # no legend inside the plot
        drawn = [entry for entry in chart["legend"] if not entry.startswith("base (iteration 0) = ")]
        assert len(drawn) == len(chart["series"])  # and one entry for the base's dashed line, where marked
    assert ("div", "grid") in page.classes and ("div", "top") in page.classes


def synthetic_rows(n=60, every=10):
    rows = []
    for it in range(n + 1):
        row = {"iteration": it}
        if it:
            row.update(
                {
                    "reward_mean": 0.3 + 0.004 * it + (0.2 if it % 2 else -0.2),
                    "time_iteration_s": 1.5,
                    "time_rollout_s": 1.0 + 0.01 * (it % 3),
                    "time_train_s": 0.4 + 0.01 * (it % 2),
                    "kl": 0.0,
                    "ratio_mean": 1.0 + 1e-3 * it,
                }
            )
        if it % every == 0:
            row.update(
                {
                    "eval/reward_mean": 0.4 + 0.002 * it,
                    "eval/shapes/clean": 1.0,
                    "eval/shapes/accuracy": 0.4 + 0.002 * it,
                    "time_eval_s": 39.0 + it / 10,
                }
            )
        rows.append(row)
    return rows


def test_train_reward_is_smoothed_with_the_raw_points_faint_and_eval_on_its_own():
    from fgrpo.core import report

    rows = synthetic_rows()
    figs = report.figures(rows, {"train": {"group_size": 8, "prompts_per_iteration": 8}})
    anchor, _, (train, held_out) = figs.items[0]
    assert (
        anchor == "fig-reward"
        and 'aria-label="train reward"' in train
        and 'aria-label="held-out reward (higher is better)"' in held_out
    )
    page = Page()
    page.feed(f'<figure id="f">{train}{held_out}</figure>')
    train_chart, held_chart = page.figures["f"]
    window = charts.smoothing_window(60)
    assert window == 5
    assert train_chart["series"] == {
        "reward_mean, each iteration": 60,
        f"reward_mean, mean of {window} iterations": 60,
    }
    assert train_chart["faint"] == {"reward_mean, each iteration"} and held_chart["series"] == {"eval/reward_mean": 7}
    raw = charts.series(rows, "reward_mean")
    smooth = charts.smoothed(raw, window, "s")
    ys = [y for _, y in raw.points]
    assert smooth.points[10][1] == pytest.approx(sum(ys[8:13]) / 5)  # centred: no lag
    assert smooth.points[0][1] == pytest.approx(sum(ys[:3]) / 3)
    assert (
        max(
            abs(a[1] - b)
            for a, b in zip(smooth.points[5:-5], [0.3 + 0.004 * x for x, _ in raw.points[5:-5]], strict=True)
        )
        < 0.05
    )


def test_constant_metrics_are_one_line_and_eval_time_has_its_own_chart():
    from fgrpo.core import report

    figs = report.figures(synthetic_rows())
    page = Page()
    page.feed("".join(f'<figure id="{a}">{"".join(c)}</figure>' for a, _, c in figs.items))
    assert figs.constant == {"eval/shapes/clean": 1.0, "kl": 0.0}  # a metric without categories: its own entry
    assert "eval/shapes/clean" not in page.drawn() and "kl" not in page.drawn() and "ratio_mean" in page.drawn()
    per_iteration, per_evaluation = page.figures["fig-time"]
    assert set(per_iteration["series"]) == {"time_rollout_s", "time_train_s"} and set(per_evaluation["series"]) == {
        "time_eval_s"
    }
    axes = charts.x_axes(synthetic_rows(), {"train": {"group_size": 8, "prompts_per_iteration": 8}})
    assert axes["samples"][10] == 640 and axes["iteration"][10] == 10
    assert axes["time"][0] == 0 and axes["time"][10] == pytest.approx(
        (10 * 1.5 + 39) / 60
    )  # the eval at 0 came before
    assert axes["time"][11] == pytest.approx((11 * 1.5 + 39 + 40) / 60)


def test_filmstrip_scores_are_coloured():
    from fgrpo.core.report import score_style

    style, kind = score_style([0.0, 1.0, 1.0])
    assert kind == "binary" and style(1.0) == ("score pass", "", "1") and style(0.0) == ("score fail", "", "0")
    style, kind = score_style([0.2, 0.5, 0.8])
    assert kind == "graded"
    (low, low_css, _), (high, high_css, _) = style(0.2), style(0.8)
    assert low == high == "score graded" and "hsl(0," in low_css and "hsl(120," in high_css
    # a world's verdict wins over the score: a combined score of 1.15 that failed the rule is a fail
    style, kind = score_style([0.149, 1.15], [True, False])
    assert kind == "verdict"
    assert style(1.15, False) == ("score fail", "", "fail · 1.15") and style(0.149, True)[0] == "score pass"


def test_filmstrip_keeps_prompts_and_noise_fixed_across_evaluations(shapes_run):
    out, _ = shapes_run
    first = json.loads((out / "samples" / "eval_000000" / "index.json").read_text())
    last = json.loads((out / "samples" / f"eval_{ITERATIONS:06d}" / "index.json").read_text())
    assert [t["prompt"] for t in first] == [t["prompt"] for t in last]
    assert all(t["read"] and isinstance(t["score"], float) for t in first)


def test_report_command_writes_elsewhere_and_refuses_a_non_run(shapes_run, tmp_path, capsys):
    out, _ = shapes_run
    target = tmp_path / "elsewhere.html"
    assert cli.main(["report", str(out), "--out", str(target)]) == 0
    assert f"report: {target}" in capsys.readouterr().out
    assert parse(target).figures.keys() == parse(out / "report.html").figures.keys()
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "holds no metrics.jsonl: not a run folder" in capsys.readouterr().err


def test_one_line_per_evaluation_when_not_a_terminal(shapes_run):
    _, printed = shapes_run
    lines = [line for line in printed.splitlines() if line.startswith("eval at iteration")]
    assert [line.split(" ")[3].split("/")[0] for line in lines] == ["0", "1", "2"]  # the base's too
    shown = (
        r"\(\d+\.\d s, (raw weights|EMA weights after \d+ updates?)\): reward_mean [\d.]+ " r".*shapes/accuracy [\d.]+"
    )
    assert all(re.search(shown, line) for line in lines)


def test_grid_has_separators_scores_and_what_was_read():
    images = torch.zeros(3, 3, 8, 8)
    images[:, 0] = 1.0  # three red squares
    plain = np.asarray(visuals.grid_image(images, ["a", "b", "c"], cell=32, columns=3, gap=2))
    noted = np.asarray(
        visuals.grid_image(images, ["a", "b", "c"], ["score 1 · read: red square"] * 3, cell=32, columns=3, gap=2)
    )
    assert plain.shape[1] == 3 * 32 + 2 * 2
    assert (plain[:32, 32:34] == visuals.SEPARATOR).all() and (plain[:32, 66:68] == visuals.SEPARATOR).all()
    assert (plain[:32, :32] == (255, 0, 0)).all()
    assert noted.shape[0] > plain.shape[0]  # the note has lines of its own
    note = noted[plain.shape[0] : noted.shape[0], :32]
    assert ((note != 255).any(-1)).sum() > 20  # text drawn under the caption


def test_evaluation_bar_with_eta_in_a_terminal(root):
    from rich.console import Console

    from fgrpo.core import recipe as recipe_mod
    from fgrpo.core.building import build_run
    from fgrpo.core.trainer import run_evaluation

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120, color_system=None)
    run = build_run(
        recipe_mod.load(root / "recipes" / "vector.yaml", ["eval.every=1", "eval.batch_size=8"]),
        out_dir=None,
        console=console,
    )
    assert not run.io.display.quiet
    with run.io.display:
        metrics = run_evaluation(run, 0)
    text = screen.getvalue()
    assert re.search(r"evaluation at 0 .* \d+/4 .* eta", text)  # one step per test prompt, with the time left
    assert "eval at iteration 0/30" in text and f"reward_mean {metrics['eval/reward_mean']:.4g}" in text


def test_without_matplotlib_curves_png_is_one_line_of_notice(root, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(visuals, "have_matplotlib", lambda: False)
    out = tmp_path / "run"
    assert (
        cli.main(
            ["compose", "vector", "--out", str(out), "--quiet", "--set", "train.iterations=2", "--set", "eval.every=2"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    notices = [line for line in printed.splitlines() if "matplotlib is" in line]
    assert notices == [
        'curves.png skipped: matplotlib is not installed (pip install "fgrpo-core[plots]"); report.html has the curves'
    ]
    assert not (out / "curves.png").exists() and (out / "report.html").is_file()


@pytest.mark.parametrize("lo, hi", [(0.9995, 1.0003), (0.0503, 0.0547), (0, 1.3e-4), (-3.9, -3.7), (0, 2e6), (0, 55)])
def test_axis_ticks_have_distinct_labels(lo, hi):
    from fgrpo.core.charts import _tick_label, _ticks

    ticks = _ticks(lo, hi)
    labels = [_tick_label(t, ticks[1] - ticks[0], max(map(abs, ticks))) for t in ticks]
    assert len(ticks) >= 3 and len(set(labels)) == len(labels), labels
    assert ticks[0] >= lo - 1e-12 and ticks[-1] <= hi + 1e-12
