"""What a run's pictures and charts show (issue 53, item 3): filmstrips spread over every category
of each world, driving tiles at their native width with candidate plans that come apart and closed
loops drawn among their traffic with the world's pass rule, charts whose axes show the data with
the base's value and which way is better, each world's own words, curves.png with every gold
metric, and the gold metrics on each evaluation's line."""

from __future__ import annotations

import re

import pytest
import torch

from fgrpo.core import charts, registry, report, runlog, visuals
from fgrpo.core.evaluation import SHOWN_PROMPTS, prompt_category, spread_over_categories

# --- filmstrips over every category ---------------------------------------------------------------


@pytest.mark.parametrize("world", ["shapes", "shapes-edit", "driving"])
def test_the_filmstrip_prompts_cover_every_category_of_the_world_s_test_set(world):
    source = registry.load("prompts", world)()
    test = source.test_prompts()
    categories = [prompt_category(source.metadata(p)) for p in test]
    assert None not in categories, "every shipped world names each prompt's category"
    shown = spread_over_categories(categories)
    assert len(shown) == min(SHOWN_PROMPTS, len(test)) and shown == sorted(set(shown))
    picked = [categories[i] for i in shown]
    assert set(picked) == set(categories), (world, sorted(set(categories) - set(picked)))
    # as evenly as the categories allow: no category shown twice more than another that has more prompts
    counts = {c: picked.count(c) for c in set(categories)}
    available = {c: categories.count(c) for c in set(categories)}
    for c in counts:
        for d in counts:
            if available[d] > counts[d]:
                assert counts[c] <= counts[d] + 1, counts


def test_a_test_set_sorted_by_category_is_shown_round_robin():
    categories = ["a"] * 40 + ["b"] * 3 + ["c"] * 40
    shown = spread_over_categories(categories, 8)
    assert [categories[i] for i in shown] == ["a", "a", "a", "b", "b", "b", "c", "c"]
    assert spread_over_categories([None] * 5, 3) == [0, 1, 2]  # no categories: the first prompts


# --- driving pictures -------------------------------------------------------------------------------


def _scenes(kinds: list[str], seed: int = 1000000):
    import fgrpo.worlds.driving.scenes as store

    prompts = [store.prompt_of(kind, seed) for kind in kinds]
    return prompts, store.scenes_for(prompts)


def test_a_driving_tile_is_drawn_at_twice_the_old_192_px_and_its_candidates_come_apart():
    from fgrpo.worlds.driving import draw

    _, scenes = _scenes(["free"])
    t = torch.arange(1, 9, dtype=torch.float32) * 0.5
    slow, fast = (torch.stack([v * t, torch.zeros(8)], -1) for v in (10.0, 30.0))  # one lane, two speeds
    image = draw.draw_scene(scenes, 0, [slow, fast], [0.0, 1.0], own=1)
    assert image.shape == (3, draw.HEIGHT + draw.PROFILE, 384)
    assert visuals.magnified(image[None]).shape[-1] == 384  # shown at its native width, not shrunk

    def rows_of(colour, region):
        target = torch.tensor(colour, dtype=torch.float32) / 255
        hits = ((region - target[:, None, None]).abs() < 2 / 255).all(0)
        return hits.nonzero()[:, 0].unique()

    low, high = draw._colour(0.0, 0.0, 1.0), draw._colour(1.0, 0.0, 1.0)
    # on the road both plans lie on the ego's lane; under it their distances part by 3x at 4 s
    right_edge = image[:, draw.HEIGHT :, -12:]
    slow_rows, fast_rows = rows_of(low, right_edge), rows_of(high, right_edge)
    assert len(slow_rows) and len(fast_rows)
    assert slow_rows.min() - fast_rows.max() > 20, (slow_rows.tolist(), fast_rows.tolist())


def test_a_closed_loop_is_drawn_as_frames_among_its_traffic_with_the_world_s_verdict():
    from fgrpo.worlds.driving import closed_loop, draw

    prompts, scenes = _scenes(["stopped", "free"])
    # constant velocity runs into the stopped car; the teacher drives the free road well
    crash = closed_loop.drive(closed_loop.constant_velocity_planner, scenes, 12.0, keep=draw.frame_times(12.0, 0.5))
    pictures = closed_loop.pictures(crash, prompts, 2)
    image = pictures[0].image
    assert draw.frame_times(12.0, 0.5) == [0.0, 3.0, 6.0, 9.0, 12.0]
    assert image.shape == (3, 5 * draw.FRAME, draw.WIDTH)
    car = torch.tensor(draw.CAR, dtype=torch.float32)[:, None, None] / 255
    crash_colour = torch.tensor(draw.CRASH, dtype=torch.float32)[:, None, None] / 255
    frames = image.split(draw.FRAME, dim=1)
    assert ((frames[0] - car).abs() < 1e-3).all(0).any(), "the traffic of the first frame is drawn"
    assert ((image - crash_colour).abs() < 1e-3).all(0).any(), "the collision is marked"
    assert pictures[0].passed is False and "collision" in pictures[0].read

    fine = closed_loop.drive(closed_loop.teacher_planner, scenes.index([1]), 12.0)
    verdict = closed_loop.pictures(fine, prompts[1:], 1)[0]
    assert verdict.passed is bool(fine.passed[0])


def test_the_pass_rule_fails_a_perfect_cl_score_driven_too_fast_or_too_roughly():
    from fgrpo.worlds.driving.rewards import JERK_BOUND, SPEED_MARGIN, passes

    no = torch.tensor([False])

    def verdict(excess: float = 0.0, jerk: float = 2.0, speed: float = 20.0, collision: bool = False) -> bool:
        return bool(
            passes(torch.tensor([collision]), no, torch.tensor([speed]), torch.tensor([excess]), torch.tensor([jerk]))
        )

    assert verdict()
    assert not verdict(excess=34.7 - 25.0)  # the CL 1.00 scene at 34.7 m/s on a 25 m/s road
    assert verdict(excess=SPEED_MARGIN) and not verdict(excess=SPEED_MARGIN + 0.01)
    assert not verdict(jerk=JERK_BOUND + 0.1)
    assert not verdict(speed=1.0)  # stuck
    assert not verdict(collision=True)


def test_the_closed_loop_reports_its_pass_rate_overall_and_per_scenario_type():
    from fgrpo.worlds.driving import closed_loop

    _, scenes = _scenes(["stopped", "free"])
    drive = closed_loop.drive(closed_loop.constant_velocity_planner, scenes, 6.0)
    metrics = closed_loop.summarize(drive, scenes.kind)
    assert metrics["pass_rate"] == pytest.approx(drive.passed.float().mean().item())
    assert metrics["pass_rate/stopped"] == 0.0  # constant velocity hits the stopped car
    assert closed_loop.DIRECTIONS["pass_rate"] == "higher"


@pytest.mark.parametrize("name", ["driving-pdms", "driving-rollout"])
def test_a_driving_reward_gives_each_sample_the_world_s_verdict(name):
    reward = registry.load("reward", name)()
    prompts, scenes = _scenes(["free", "stopped"])
    t = torch.arange(1, 9, dtype=torch.float32) * 0.5
    speeding = torch.stack([40.0 * t, torch.zeros(8)], -1)  # 40 m/s on a road whose limit is lower
    from fgrpo.worlds.driving.rewards import passes

    result = reward(torch.stack([speeding, speeding]), prompts, [{}, {}])
    d = result.details
    assert d["passed"].dtype == torch.bool
    assert (
        d["passed"].tolist()
        == passes(d["collision"], d["off_road"], d["mean_speed"], d["speed_excess"], d["jerk_rms"]).tolist()
    )
    if name == "driving-pdms":  # the whole 4 s plan is judged: 40 m/s is far above the limit
        assert not d["passed"].any()


# --- charts ------------------------------------------------------------------------------------------


def _ticks(chart_html: str) -> list[float]:
    return [float(v) for v in re.findall(r'text-anchor="end">(-?[0-9.]+)</text>', chart_html)]


def test_a_band_of_a_few_ten_thousandths_is_drawn_nearly_flat_not_as_a_cliff():
    line = charts.Series("eval/reward_mean", [(0, 0.5664), (10, 0.5668), (20, 0.5666)])
    ticks = _ticks(charts.line_chart([line], title="held-out reward"))
    assert max(ticks) - min(ticks) >= 0.01, ticks  # 2 % of 0.567, not the 0.0004 the data span
    wide = charts.Series("x", [(0, 0.2), (10, 0.8)])
    assert max(_ticks(charts.line_chart([wide], title="x"))) <= 0.85  # a wide band is drawn as it is


def test_the_base_value_is_a_dashed_line_inside_the_axis_with_its_value_in_the_legend():
    line = charts.Series("gold/shapes-gold/gold_error", [(10, 0.30), (20, 0.31)])
    drawn = charts.line_chart([line], title="gold: gold_error", base=0.199, better="lower")
    assert 'class="base"' in drawn and "base (iteration 0) = 0.199" in drawn
    y = float(re.search(r'y1="([0-9.]+)"[^>]*class="base"', drawn).group(1))
    assert 22 <= y <= 240 - 32  # inside the plot's frame: the axis reaches the base though the data do not
    assert "gold: gold_error (lower is better)" in drawn


def test_legend_values_keep_the_digits_that_tell_them_from_a_round_number():
    assert charts.legend_value(1.00025) == "1.0003"
    assert charts.legend_value(1.0) == "1" and charts.legend_value(0.5664) == "0.5664"
    ratio = charts.Series("ratio_max", [(1, 1.0), (2, 1.00025)])
    assert "ratio_max = 1.0003" in charts.line_chart([ratio], title="ratio")


def _rows(gold_label: str, metric: str, categories: list[str]) -> list[dict]:
    rows = []
    for it, shift in ((0, 0.0), (5, 0.1), (10, 0.2)):
        row = {"iteration": it, "eval/reward_mean": 0.4 + shift, f"gold/{gold_label}/{metric}": 0.3 + shift}
        row.update({f"gold/{gold_label}/{metric}/{c}": 0.3 + shift * (i + 1) for i, c in enumerate(categories)})
        rows.append(row)
    return rows


@pytest.mark.parametrize(
    ("recipe", "label", "metric", "noun", "better"),
    [
        ("driving", "driving-closed-loop", "collision", "scenario type", "lower"),
        ("shapes", "shapes-gold", "gold_error", "GenEval category", "lower"),
        ("shapes-edit", "shapes-edit-gold", "preserved", "edit kind", "higher"),
    ],
)
def test_each_world_s_charts_use_its_own_words_and_say_which_way_is_better(recipe, label, metric, noun, better):
    from fgrpo.core import recipe as recipe_mod

    data = recipe_mod.load(recipe).data
    figs = report.figures(_rows(label, metric, ["one", "two"]), data)
    titles = {anchor: title for anchor, title, _ in figs.items}
    assert titles[f"fig-gold-{label}-types"] == f"Gold per {noun}: {label}"
    gold = dict((a, c) for a, _, c in figs.items)[f"fig-gold-{label}"]
    text = "".join(gold)
    assert f"gold: {metric} ({better} is better)" in text
    assert "base (iteration 0) = 0.3" in text and "base (iteration 0) = 0.4" in text  # gold and proxy
    assert "per type" not in "".join(titles.values())


def test_a_recipe_whose_components_are_unknown_gets_the_generic_words():
    traits = report.component_traits({"evaluator": "no-such-evaluator", "reward": {"name": "nor-this"}})
    assert traits.category_noun == {} and traits.directions == {}
    figs = report.figures(_rows("x", "m", ["a", "b"]), {"evaluator": "no-such-evaluator"})
    assert ("fig-gold-x-types", "Gold per category: x") in [(a, t) for a, t, _ in figs.items]


def test_the_per_category_chart_says_what_all_and_overall_average():
    rows = [
        {"iteration": i, "eval/shapes/strict": 0.4 + i / 100, "eval/shapes/strict/overall": 0.45 + i / 90}
        | {"eval/shapes/strict/position": 0.3 + i / 80}
        for i in (0, 10, 20)
    ]
    drawn = "".join("".join(c) for _, _, c in report.figures(rows, {}).items)
    assert "all samples (mean of every sample)" in drawn
    assert "overall (mean of the categories&#x27; means)" in drawn


# --- curves.png and the evaluation line -------------------------------------------------------------


def test_curves_png_draws_the_proxy_and_every_gold_metric():
    rows = [
        {"iteration": 0, "eval/reward_mean": 0.5, "gold/driving-closed-loop/cl_score": 0.6}
        | {"gold/driving-closed-loop/jerk": 6.2, "gold/driving-closed-loop/jerk/free": 5.0},
        {"iteration": 1, "reward_mean": 0.4},
        {"iteration": 2, "eval/reward_mean": 0.7, "gold/driving-closed-loop/cl_score": 0.7}
        | {"gold/driving-closed-loop/jerk": 7.0, "eval/shapes/strict": 0.5},
    ]
    keys = visuals.curve_keys(rows)
    assert keys[0] == "reward_mean" and "eval/reward_mean" in keys and "eval/shapes/strict" in keys
    assert {"gold/driving-closed-loop/cl_score", "gold/driving-closed-loop/jerk"} <= set(keys)
    assert "gold/driving-closed-loop/jerk/free" not in keys  # per type: the report's


def test_curves_png_is_written_with_every_panel(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {"iteration": i, "eval/reward_mean": 0.5 + i / 10} | {f"gold/g/m{k}": k + i for k in range(5)}
        for i in range(3)
    ]
    path = visuals.curves(rows, tmp_path / "curves.png", {"m1": "lower"})
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
    assert width > height / 2  # two columns for six panels
    assert height >= 3 * 2.2 * 90 - 1


def test_the_evaluation_line_names_every_overall_gold_metric():
    line = runlog.evaluation_line(
        50,
        600,
        {
            "eval/reward_mean": 0.61,
            "gold/driving-closed-loop/cl_score": 0.842,
            "gold/driving-closed-loop/speed_excess": 1.76,
            "gold/driving-closed-loop/cl_score/free": 0.9,
        },
    )
    assert line.endswith("| gold: driving-closed-loop/cl_score 0.842  driving-closed-loop/speed_excess 1.76")
