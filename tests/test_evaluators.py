"""Gold metrics as a component kind: evaluators run at evaluation with the policy, their metrics
logged as gold/<label>/..., drawn against the proxy in the report, and the over-optimisation guard
(eval.guard) that warns or stops and keeps the best checkpoint."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch

from _helpers import crash_after
from fgrpo.core import cli, registry
from fgrpo.core.config import param
from fgrpo.core.guard import Guard
from fgrpo.core.protocols import EvalContext, Evaluator, EvaluatorResult, Picture
from fgrpo.core.runlog import read_metrics
from fgrpo.core.seeding import generator
from fgrpo.core.vectors import condition_vector


@attrs.define
class TargetMiss:
    """A real gold metric of the vector world: the mean distance of fresh ODE samples (its own
    noise, 4 per prompt) to each prompt's target, per prompt sign pattern as the category."""

    per_prompt: int = param(4, ge=1, help="samples per prompt")
    directions = {"miss": "lower"}

    def __call__(self, ctx: EvalContext) -> EvaluatorResult:
        out = ctx.generate(ctx.prompts, self.per_prompt, generator(ctx.seed, "target-miss"))
        targets = torch.stack([condition_vector(p, 2, 2) for p in ctx.prompts]).repeat_interleave(self.per_prompt, 0)
        miss = (out - targets).norm(dim=1)
        side = ["left" if t[0] < 0 else "right" for t in targets]
        metrics = {"miss": miss.mean().item()}
        for name in ("left", "right"):
            metrics[f"miss/{name}"] = miss[torch.tensor([s == name for s in side])].mean().item()
        picture = torch.zeros(3, 8, 8)
        picture[1] = 1.0
        return EvaluatorResult(
            metrics, [Picture(prompt=p, image=picture, score=0.5, read="green") for p in ctx.prompts]
        )


@attrs.define
class Scripted:
    """A gold metric that peaks at ``peak`` then falls, and a proxy that always rises."""

    peak: int = param(2, help="the iteration of the best gold value")

    def __call__(self, ctx: EvalContext) -> EvaluatorResult:
        return EvaluatorResult({"gold": -abs(ctx.iteration - self.peak), "proxy": float(ctx.iteration)})


@pytest.fixture(autouse=True)
def toy_evaluators(monkeypatch):
    monkeypatch.setitem(registry._loaded, ("evaluator", "target-miss"), TargetMiss)
    monkeypatch.setitem(registry._loaded, ("evaluator", "scripted"), Scripted)


def compose(root, out, *sets: str, code: int = 0, resume: bool = False) -> list[dict]:
    args = ["compose", str(root / "recipes" / "vector.yaml"), "--out", str(out), "--quiet"] + (
        ["--resume"] if resume else []
    )
    for item in sets:
        args += ["--set", item]
    assert cli.main(args) == code
    return read_metrics(out)


GUARDED = [
    "evaluator=[{name: target-miss}, {name: scripted, label: s}]",
    "eval.every=1",
    "train.iterations=8",
    "eval.samples_per_prompt=2",
    "train.prompts_per_iteration=4",
    "train.group_size=4",
]


def test_the_protocol_and_a_built_in():
    assert isinstance(TargetMiss(), Evaluator)
    assert "shapes-gold" in registry.names("evaluator")
    assert isinstance(registry.create("evaluator", "shapes-gold"), Evaluator)


def test_evaluator_metrics_are_gold_per_category_with_pictures_and_drawn_in_the_report(root, tmp_path):
    out = tmp_path / "run"
    rows = compose(root, out, "evaluator={name: target-miss, label: miss}", "train.iterations=2", "eval.every=1")
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["iteration"] for r in evals] == [0, 1, 2]
    for row in evals:
        assert math.isfinite(row["gold/miss/miss"]) and {"gold/miss/miss/left", "gold/miss/miss/right"} <= set(row)
    assert evals[0]["gold/miss/miss"] != evals[-1]["gold/miss/miss"]  # the policy it evaluates is the trained one
    tiles = json.loads((out / "samples" / "gold_000002" / "miss" / "index.json").read_text())
    assert len(tiles) == 4 and tiles[0]["read"] == "green" and tiles[0]["score"] == 0.5
    page = (out / "report.html").read_text()
    assert 'id="fig-gold-miss"' in page and 'id="fig-gold-miss-types"' in page and 'href="#gold"' in page
    assert 'data-series="gold/miss/miss"' in page and 'data-series="eval/reward_mean"' in page
    assert 'data-series="left"' in page and "(12 images)" in page  # 4 pictures x 3 evaluations
    resolved = (out / "recipe.resolved.yaml").read_text()
    assert "label: miss" in resolved


def test_same_draws_at_every_evaluation_and_for_every_run(root, tmp_path):
    a = compose(root, tmp_path / "a", "evaluator=target-miss", "train.iterations=1", "eval.every=1")
    b = compose(root, tmp_path / "b", "evaluator=target-miss", "train.iterations=1", "eval.every=1")
    assert [r.get("gold/target-miss/miss") for r in a] == [r.get("gold/target-miss/miss") for r in b]


def test_guard_warns_and_training_goes_on(root, tmp_path, capsys):
    rows = compose(
        root, tmp_path / "run", *GUARDED, "eval.guard={metric: gold/s/gold, proxy: gold/s/proxy, patience: 2}"
    )
    assert rows[-1]["iteration"] == 8
    fired = [r["iteration"] for r in rows if r.get("guard/fired") == 1.0]
    assert fired == [4, 6, 8]  # falls from 3 on: two falls in a row at 4, counted afresh after each warning
    assert [r["iteration"] for r in rows if r.get("guard/new_best")] == [0, 1, 2]
    assert (
        "over-optimisation guard: gold/s/proxy rose while gold/s/gold fell for 2 evaluation(s)"
        in capsys.readouterr().out
    )


def test_guard_stops_and_keeps_the_best_checkpoint(root, tmp_path):
    out = tmp_path / "run"
    rows = compose(
        root, out, *GUARDED, "eval.guard={metric: gold/s/gold, proxy: gold/s/proxy, patience: 2, action: stop}"
    )
    assert rows[-1]["iteration"] == 4 and rows[-1]["guard/fired"] == 1.0
    checkpoints = out / "checkpoints"
    assert (checkpoints / "last").resolve().name == "iter_000004"
    assert (checkpoints / "best").resolve().name == "iter_000002"
    state = json.loads((checkpoints / "best" / "state.json").read_text())
    assert state["guard"]["best_iteration"] == 2 and state["iteration"] == 2
    assert "guard" in (out / "report.html").read_text()


def test_guard_keeps_the_base_when_the_gold_is_best_before_training(root, tmp_path, capsys):
    """The driving-naive case: the gold only falls, so the best checkpoint is iteration 0's (the base)."""
    out = tmp_path / "run"
    rows = compose(
        root,
        out,
        *GUARDED,
        "evaluator={name: scripted, label: s, peak: 0}",
        "eval.guard={metric: gold/s/gold, proxy: gold/s/proxy, patience: 2, action: stop}",
    )
    assert rows[-1]["iteration"] == 2 and rows[-1]["guard/fired"] == 1.0
    best = out / "checkpoints" / "best"
    assert best.resolve().name == "iter_000000"
    state = json.loads((best / "state.json").read_text())
    assert state["iteration"] == 0 and state["guard"]["best_iteration"] == 0
    assert "the best gold/s/gold was at iteration 0 (checkpoints/best)" in capsys.readouterr().out

    sets = [
        *GUARDED,
        "evaluator={name: scripted, label: s, peak: 0}",
        "train.checkpoint_every=0",
        "eval.guard={metric: gold/s/gold, proxy: gold/s/proxy, patience: 2, action: stop}",
    ]
    with crash_after(1):  # killed before any later checkpoint: the run resumes from the base's
        compose(root, tmp_path / "resumed", *sets, code=130)
    resumed = compose(root, tmp_path / "resumed", *sets, resume=True)
    keys = ("iteration", "guard/streak", "guard/fired", "guard/new_best", "reward_mean")
    assert [[r.get(k) for k in keys] for r in rows] == [[r.get(k) for k in keys] for r in resumed]


def test_guard_direction_lower_is_better_from_the_evaluator():
    guard = Guard.from_recipe({"metric": "gold/miss/miss/left"}, {"miss": TargetMiss()})
    assert guard.higher_is_better is False
    assert guard.observe(0, {"eval/reward_mean": 0.1, "gold/miss/miss/left": 1.0})["guard/new_best"] == 1.0
    assert guard.observe(1, {"eval/reward_mean": 0.2, "gold/miss/miss/left": 2.0}) == {
        "guard/streak": 1.0,
        "guard/fired": 0.0,
        "guard/new_best": 0.0,
    }
    assert (
        guard.observe(2, {"eval/reward_mean": 0.3, "gold/miss/miss/left": 3.0})["guard/fired"] == 1.0
    )  # patience 2: fires now
    assert guard.fired_at == [2]
    quiet = Guard.from_recipe({"metric": "gold/x/y", "min_change": 0.5}, {})
    quiet.observe(0, {"eval/reward_mean": 0.0, "gold/x/y": 1.0})
    assert (
        quiet.observe(1, {"eval/reward_mean": 0.4, "gold/x/y": 0.0})["guard/streak"] == 0.0
    )  # the proxy moved too little


#: the shortened driving run of issue 53: the proxy and the CL-score held or rose while the planner
#: learnt to speed (0.04 -> 1.76 m/s above the limit) and jerk (6.2 -> 10.7)
SPEEDING = [
    {"eval/reward_mean": 0.50, "cl_score": 0.80, "collision": 0.10, "speed_excess": 0.04, "jerk": 6.2},
    {"eval/reward_mean": 0.55, "cl_score": 0.80, "collision": 0.10, "speed_excess": 0.90, "jerk": 8.1},
    {"eval/reward_mean": 0.60, "cl_score": 0.81, "collision": 0.09, "speed_excess": 1.76, "jerk": 10.7},
]


def _closed_loop_rows(rows):
    label = "gold/driving-closed-loop/"
    return [{k if k.startswith("eval/") else label + k: v for k, v in row.items()} for row in rows]


def test_guard_watches_every_limit_the_world_names():
    from fgrpo.worlds.driving.closed_loop import ClosedLoop

    guard = Guard.from_recipe({}, {"driving-closed-loop": ClosedLoop()})
    assert [w.key.split("/")[-1] for w in guard.watched] == ["cl_score", "collision", "speed_excess", "jerk"]
    assert [w.higher_is_better for w in guard.watched] == [True, False, False, False]
    seen = [guard.observe(i * 25, row) for i, row in enumerate(_closed_loop_rows(SPEEDING))]
    assert [s["guard/fired"] for s in seen] == [0.0, 0.0, 1.0]
    assert guard.fired_by == ["gold/driving-closed-loop/speed_excess", "gold/driving-closed-loop/jerk"]
    message = guard.message(50)
    assert "speed_excess rose, gold/driving-closed-loop/jerk rose for 2 evaluation(s)" in message
    # watching the CL-score alone, as the guard did, it never fires on this run
    alone = Guard.from_recipe({"metric": "gold/driving-closed-loop/cl_score"}, {"driving-closed-loop": ClosedLoop()})
    assert [alone.observe(i, row)["guard/fired"] for i, row in enumerate(_closed_loop_rows(SPEEDING))] == [0.0] * 3


def test_a_change_within_the_world_s_tolerance_is_no_change():
    from fgrpo.worlds.driving.closed_loop import LIMITS, ClosedLoop

    guard = Guard.from_recipe({}, {"driving-closed-loop": ClosedLoop()})
    rows = [
        dict(SPEEDING[0], **{"eval/reward_mean": 0.5 + 0.1 * i, "jerk": 6.2 + i * LIMITS["jerk"]}) for i in range(4)
    ]
    assert all(guard.observe(i, row)["guard/fired"] == 0.0 for i, row in enumerate(_closed_loop_rows(rows)))


def test_a_guard_state_of_one_metric_resumes_into_the_new_guard():
    from fgrpo.worlds.driving.closed_loop import ClosedLoop

    guard = Guard.from_recipe({"metric": "gold/driving-closed-loop/cl_score"}, {"driving-closed-loop": ClosedLoop()})
    guard.load_state_dict({"previous": [0.5, 0.8], "streak": 1, "best": 0.8, "best_iteration": 25, "fired_at": []})
    fired = guard.observe(50, {"eval/reward_mean": 0.6, "gold/driving-closed-loop/cl_score": 0.7})
    assert fired == {"guard/streak": 0.0, "guard/fired": 1.0, "guard/new_best": 0.0}


def test_an_evaluator_with_every_runs_at_the_iterations_it_names_and_the_last(root, tmp_path):
    """``every: 0``: the last evaluation only (a slow judge, as highway-env for the planners);
    ``every: 2``: iterations 0, 2 and the last, 3; the others at every evaluation."""
    evaluators = (
        "evaluator=[target-miss, {name: target-miss, label: end, every: 0}, {name: target-miss, label: two, every: 2}]"
    )
    rows = compose(root, tmp_path / "run", evaluators, "train.iterations=3", "eval.every=1")
    evals = [r for r in rows if "eval/reward_mean" in r]
    at = {
        label: [r["iteration"] for r in evals if f"gold/{label}/miss" in r] for label in ("target-miss", "end", "two")
    }
    assert at == {"target-miss": [0, 1, 2, 3], "end": [3], "two": [0, 2, 3]}
    # the same evaluator on the same weights: the same value, whenever it runs
    assert evals[-1]["gold/end/miss"] == evals[-1]["gold/target-miss/miss"] == evals[-1]["gold/two/miss"]


def test_the_guard_compares_a_sparse_metric_with_its_own_last_evaluation():
    """A metric logged every other evaluation is compared with its last value and the proxy as it
    was then; the evaluations without it leave its streak as it was."""
    guard = Guard.from_recipe({"metric": ["gold/a/x", "gold/b/y"], "patience": 2}, {})
    rows = [
        {"eval/reward_mean": 0.1, "gold/a/x": 1.0, "gold/b/y": 1.0},
        {"eval/reward_mean": 0.2, "gold/a/x": 1.0},
        {"eval/reward_mean": 0.3, "gold/a/x": 1.0, "gold/b/y": 0.5},  # y fell while the proxy rose since it was seen
        {"eval/reward_mean": 0.4, "gold/a/x": 1.0},
        {"eval/reward_mean": 0.5, "gold/a/x": 1.0, "gold/b/y": 0.2},
    ]
    seen = [guard.observe(i, row) for i, row in enumerate(rows)]
    assert [s["guard/fired"] for s in seen] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert [s["guard/streak"] for s in seen[:4]] == [0.0, 0.0, 1.0, 1.0] and guard.fired_by == ["gold/b/y"]


def test_a_guard_without_metric_needs_an_evaluator_that_names_limits(root, capsys):
    args = ["validate", str(root / "recipes" / "vector.yaml"), "--set", "evaluator=scripted", "--set", "eval.guard={}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "eval.guard.metric: missing, and the recipe's evaluators name no limits to watch" in err, err
    assert cli.main(["validate", "driving", "--set", "eval.guard={}"]) == 0


def test_guard_resumes_exactly(root, tmp_path):
    sets = [*GUARDED, "eval.guard={metric: gold/s/gold, proxy: gold/s/proxy, patience: 2}", "train.checkpoint_every=3"]
    straight = compose(root, tmp_path / "straight", *sets)

    with crash_after(5):
        compose(root, tmp_path / "resumed", *sets, code=130)
    resumed = compose(root, tmp_path / "resumed", *sets, resume=True)
    keys = ("guard/streak", "guard/fired", "guard/new_best", "gold/target-miss/miss", "reward_mean")
    assert [[r.get(k) for k in keys] for r in straight] == [[r.get(k) for k in keys] for r in resumed]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["evaluator=nope"], "evaluator.name: unknown evaluator 'nope'"),
        (["evaluator=[scripted, scripted]"], "evaluator: two evaluators are labelled 'scripted'"),
        (
            ["evaluator={name: scripted, label: a/b}"],
            "evaluator.label: got 'a/b'; allowed: a non-empty string without '/'",
        ),
        (["evaluator={name: scripted, pek: 2}"], "evaluator.pek: unknown key (did you mean 'peak'?)"),
        (
            ["evaluator={name: scripted, every: -1}"],
            "evaluator.every: got -1; allowed: null (at every evaluation), 0 (at the last only) or N > 0",
        ),
        (
            ["eval.guard={metric: gold/other/x}", "evaluator=scripted"],
            "eval.guard.metric: got 'gold/other/x'; allowed: a metric of the recipe's evaluators (gold/scripted/...)",
        ),
        (
            ["eval.guard={metric: gold/scripted/gold, action: halt}", "evaluator=scripted"],
            "eval.guard: action: got 'halt'",
        ),
        (
            ["eval.guard={proxy: eval/reward_mean}"],
            "eval.guard.metric: missing, and the recipe has no evaluator to watch; allowed: a metric of its "
            "evaluators (none: add an evaluator section)",
        ),
    ],
)
def test_bad_evaluator_and_guard_keys_are_one_line_each(root, tmp_path, capsys, sets, message):
    args = ["validate", str(root / "recipes" / "vector.yaml")]
    for item in sets:
        args += ["--set", item]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_evaluation_logs_the_reward_the_update_normalises_a_product_under_reward_product(root, tmp_path, capsys):
    twice = (
        "reward=[{name: target-distance, form: gaussian, label: a}, {name: target-distance, form: gaussian, label: b}]"
    )
    rows = compose(
        root, tmp_path / "run", twice, "train.advantage=reward_product", "train.iterations=1", "eval.every=1"
    )
    for row in (r for r in rows if "eval/reward_mean" in r):
        a = row["eval/reward/a"]
        assert row["eval/reward/b"] == a and 0 < a < 1
        # a * a per sample: between mean(a)^2 (Jensen) and mean(a), where the weighted sum would give 2 mean(a)
        assert a * a <= row["eval/reward_mean"] < a
    # the same pair at its default distance form scores < 0: the product refuses it in one line, exit 2
    negative = twice.replace(", form: gaussian", "")
    compose(root, tmp_path / "neg", negative, "train.advantage=reward_product", "train.iterations=1", code=2)
    assert "error: reward 'a' gave -" in capsys.readouterr().err
