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

from fgrpo.core import cli, visuals
from fgrpo.core.runlog import read_metrics

ITERATIONS, EVERY, PROMPTS = 2, 1, 6


@pytest.fixture(scope="module")
def shapes_run(root, tmp_path_factory):
    """A short shapes run through the CLI: (folder, what compose printed)."""
    out = tmp_path_factory.mktemp("report") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main([
            "compose", "shapes", "--out", str(out), "--quiet",
            "--set", f"train.iterations={ITERATIONS}", "--set", "train.prompts_per_iteration=2",
            "--set", f"eval.every={EVERY}", "--set", f"eval.max_prompts={PROMPTS}", "--set", "eval.samples_per_prompt=2",
        ])
    assert code == 0
    return out, printed.getvalue()


class Page(HTMLParser):
    """The report's structure: ids, links, figures with their charts, images, external refs."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.nav: list[str] = []
        self.figures: dict[str, list[dict]] = {}
        self.images: list[dict] = []
        self.tags: list[str] = []
        self.refs: list[str] = []
        self._figure: str | None = None
        self._svg: dict | None = None
        self._in_nav = self._in_strip = False
        self._filmstrip_rows: list[list[dict]] = []
        self._row: list[dict] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if "id" in a:
            self.ids.add(a["id"])
        for key in ("src", "href"):
            if key in a:
                self.refs.append(a[key])
        if tag == "nav":
            self._in_nav = True
        elif tag == "a" and self._in_nav:
            self.nav.append(a["href"])
        elif tag == "figure":
            self._figure = a["id"]
            self.figures[a["id"]] = []
        elif tag == "svg" and self._figure is not None:
            self._svg = {"label": a.get("aria-label"), "series": {}}
            self.figures[self._figure].append(self._svg)
        elif tag == "polyline" and self._svg is not None:
            self._svg["series"][a["data-series"]] = len(a["points"].split())
        elif tag == "table" and a.get("class") == "filmstrip":
            self._in_strip = True
        elif tag == "tr" and self._in_strip:
            self._row = []
            self._filmstrip_rows.append(self._row)
        elif tag == "img":
            self.images.append(a)
            if self._row is not None:
                self._row.append(a)

    def handle_endtag(self, tag):
        if tag == "nav":
            self._in_nav = False
        elif tag == "figure":
            self._figure = None
        elif tag == "svg":
            self._svg = None
        elif tag == "table":
            self._in_strip, self._row = False, None


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
    expected = {"fig-reward", "fig-eval-shapes-accuracy", "fig-gold-shapes-gold", "fig-gold-shapes-gold-types", "fig-ratio", "fig-time"}
    assert expected <= set(page.figures), sorted(page.figures)
    for anchor, charts in page.figures.items():
        assert f"#{anchor}" in page.nav
        assert charts and all(chart["series"] for chart in charts), anchor
    evaluations = [r["iteration"] for r in rows if "eval/reward_mean" in r]
    assert evaluations == [0, 1, 2]
    reward = page.figures["fig-reward"][0]["series"]
    assert reward == {"train reward_mean": ITERATIONS, "eval/reward_mean": len(evaluations)}
    categories = sorted(k.split("/")[-1] for k in rows[0] if k.startswith("eval/shapes/accuracy/"))
    assert categories and set(page.figures["fig-eval-shapes-accuracy"][0]["series"]) == {"all", *categories}
    # the evaluator's gold metric (shapes-gold) beside the optimised proxy, and per category
    proxy, gold = page.figures["fig-gold-shapes-gold"]
    assert list(proxy["series"]) == ["eval/reward_mean"] and list(gold["series"]) == ["gold/shapes-gold/gold_error"]
    assert set(page.figures["fig-gold-shapes-gold-types"][0]["series"]) == set(categories)
    for row in rows:  # the same numbers as the verifier's detail, per category too
        assert row["gold/shapes-gold/gold_error"] == row["eval/shapes/gold_error"]
        assert all(row[f"gold/shapes-gold/gold_error/{c}"] == row[f"eval/shapes/gold_error/{c}"] for c in categories)
    ratio, clip, kl = page.figures["fig-ratio"]
    assert set(ratio["series"]) == {"ratio_mean", "ratio_min", "ratio_max"} and "kl" in kl["series"]
    phases = {k for r in rows for k in r if k.startswith("time_") and k.endswith("_s") and k != "time_iteration_s"}
    assert {"time_rollout_s", "time_reward_s", "time_train_s", "time_eval_s"} <= phases
    assert set(page.figures["fig-time"][0]["series"]) == phases
    # the filmstrip: every stored tile of every evaluation, as a decodable embedded image
    tiles = {it: json.loads((out / "samples" / f"eval_{it:06d}" / "index.json").read_text()) for it in evaluations}
    assert all(len(t) == PROMPTS for t in tiles.values())
    strip = [row for row in page._filmstrip_rows if row]
    assert len(strip) == PROMPTS and all(len(row) == len(evaluations) for row in strip)
    for i, row in enumerate(strip):
        for img, it in zip(row, evaluations):
            assert img["alt"].startswith(tiles[it][i]["prompt"])  # the same prompt along the row
            data = base64.b64decode(img["src"].split(",", 1)[1])
            assert data == (out / "samples" / f"eval_{it:06d}" / tiles[it][i]["file"]).read_bytes()
            assert Image.open(io.BytesIO(data)).size == (24, 24)
    text = (out / "report.html").read_text()
    assert f"({PROMPTS * len(evaluations)} images)" in text
    assert text.count('<tr><th>') - text.count('class="prompt"') >= len(evaluations)  # the evaluation table


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
    assert all(re.search(r"\(\d+\.\d s\): reward_mean [\d.]+ .*shapes/accuracy [\d.]+", line) for line in lines)


def test_grid_has_separators_scores_and_what_was_read():
    images = torch.zeros(3, 3, 8, 8)
    images[:, 0] = 1.0  # three red squares
    plain = np.asarray(visuals.grid_image(images, ["a", "b", "c"], cell=32, columns=3, gap=2))
    noted = np.asarray(visuals.grid_image(images, ["a", "b", "c"], ["score 1 · read: red square"] * 3, cell=32, columns=3, gap=2))
    assert plain.shape[1] == 3 * 32 + 2 * 2
    assert (plain[:32, 32:34] == visuals.SEPARATOR).all() and (plain[:32, 66:68] == visuals.SEPARATOR).all()
    assert (plain[:32, :32] == (255, 0, 0)).all()
    assert noted.shape[0] > plain.shape[0]  # the note has lines of its own
    note = noted[plain.shape[0] : noted.shape[0], :32]
    assert ((note != 255).any(-1)).sum() > 20  # text drawn under the caption


def test_evaluation_bar_with_eta_in_a_terminal(root):
    from rich.console import Console

    from fgrpo.core import recipe as recipe_mod
    from fgrpo.core.trainer import build_run, run_evaluation

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120, color_system=None)
    run = build_run(recipe_mod.load(root / "recipes" / "vector.yaml", ["eval.every=1", "eval.batch_size=8"]),
                    out_dir=None, console=console)
    assert not run.display.quiet
    with run.display:
        metrics = run_evaluation(run, 0)
    text = screen.getvalue()
    assert re.search(r"evaluation at 0 .* \d+/4 .* eta", text)  # one step per test prompt, with the time left
    assert "eval at iteration 0/30" in text and f"reward_mean {metrics['eval/reward_mean']:.4g}" in text


def test_without_matplotlib_curves_png_is_one_line_of_notice(root, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(visuals, "have_matplotlib", lambda: False)
    out = tmp_path / "run"
    assert cli.main(["compose", "vector", "--out", str(out), "--quiet", "--set", "train.iterations=2", "--set", "eval.every=2"]) == 0
    printed = capsys.readouterr().out
    notices = [line for line in printed.splitlines() if "matplotlib is" in line]
    assert notices == ['curves.png skipped: matplotlib is not installed (pip install "fgrpo-core[plots]"); report.html has the curves']
    assert not (out / "curves.png").exists() and (out / "report.html").is_file()


@pytest.mark.parametrize("lo, hi", [(0.9995, 1.0003), (0.0503, 0.0547), (0, 1.3e-4), (-3.9, -3.7), (0, 2e6), (0, 55)])
def test_axis_ticks_have_distinct_labels(lo, hi):
    from fgrpo.core.report import _tick_label, _ticks

    ticks = _ticks(lo, hi)
    labels = [_tick_label(t, ticks[1] - ticks[0], max(map(abs, ticks))) for t in ticks]
    assert len(ticks) >= 3 and len(set(labels)) == len(labels), labels
    assert ticks[0] >= lo - 1e-12 and ticks[-1] <= hi + 1e-12
