"""The trainer on the vector policy: it learns, it is on-policy, it refuses bad input, it logs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from rich.console import Console

from fgrpo.core import cli
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.building import build_run
from fgrpo.core.hookspecs import hookimpl, plugin_manager
from fgrpo.core.protocols import RewardResult
from fgrpo.core.recipe import RewardSpec
from fgrpo.core.runlog import read_metrics
from fgrpo.core.scoring import RewardError, score
from fgrpo.core.trainer import iteration

QUIET = Console(quiet=True)
REQUIRED_METRICS = (
    "iteration reward_mean reward_std reward/target-distance ratio_mean clipfrac approx_kl policy_loss kl "
    "zero_std_ratio nfe_rollout nfe_train time_rollout_s time_reward_s time_train_s time_iteration_s samples_per_s"
).split()


def vector_recipe(root, *overrides):
    return recipe_mod.load(root / "recipes" / "vector.yaml", list(overrides))


def test_vector_recipe_learns(root):
    recipe = vector_recipe(root)
    run = build_run(recipe, out_dir=None, console=QUIET, quiet=True)
    first = [iteration(run, it)["reward_mean"] for it in range(3)]
    for it in range(3, recipe.train.iterations - 3):
        iteration(run, it)
    last = [iteration(run, it)["reward_mean"] for it in range(recipe.train.iterations - 3, recipe.train.iterations)]
    before, after = sum(first) / 3, sum(last) / 3
    # the reward is -distance to the prompt's target; the base ignores the prompt
    assert after > before + 0.5, (before, after)


def test_first_ratio_is_exactly_one(root):
    run = build_run(vector_recipe(root), out_dir=None, console=QUIET, quiet=True)
    metrics = iteration(run, 0)
    assert metrics["first_ratio_deviation"] == 0.0  # the first minibatch, before any step
    assert metrics["optimizer_steps"] == 4 and metrics["ratio_min"] < 1.0  # later ones are off-policy
    on_policy = build_run(vector_recipe(root, "train.minibatch_size=0"), out_dir=None, console=QUIET, quiet=True)
    metrics = iteration(on_policy, 0)
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0


@pytest.mark.parametrize("recipe_name", ["vector.yaml"])
def test_check_passes_on_shipped_recipes(root, recipe_name, capsys):
    assert cli.main(["check", str(root / "recipes" / recipe_name)]) == 0
    assert "on-policy check passed" in capsys.readouterr().out


def test_check_fails_with_a_diagnosis_on_a_dtype_mismatch(root, capsys):
    code = cli.main(["check", str(root / "recipes" / "vector.yaml"), "--set", "train.rollout_precision=bfloat16"])
    out = capsys.readouterr().out
    assert code == 1
    assert "on-policy check FAILED" in out
    assert "diagnosis: the rollout ran under bfloat16 autocast" in out


def test_run_directory_contents(root, tmp_path):
    out = tmp_path / "run"
    code = cli.main(
        [
            "compose",
            str(root / "recipes" / "vector.yaml"),
            "--out",
            str(out),
            "--quiet",
            "--set",
            "train.iterations=4",
            "--set",
            "train.checkpoint_every=2",
            "--set",
            "eval.every=2",
        ]
    )
    assert code == 0
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]  # 0 = the evaluation of the base
    for row in rows[1:]:
        for key in REQUIRED_METRICS:
            assert key in row, key
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row[key])
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2]
    assert (out / "recipe.resolved.yaml").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "last").resolve().name == "iter_000004"
    assert (out / "checkpoints" / "last" / "trainable.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").glob("iter_*")) == ["iter_000002", "iter_000004"]
    assert (out / "curves.png").is_file()


def test_existing_run_is_not_overwritten(root, tmp_path, capsys):
    args = [
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(tmp_path),
        "--quiet",
        "--set",
        "train.iterations=1",
    ]
    assert cli.main(args) == 0
    assert cli.main(args) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err


def test_resume_against_a_different_recipe_is_refused(root, tmp_path, capsys):
    base = [
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(tmp_path),
        "--quiet",
        "--set",
        "train.iterations=2",
    ]
    assert cli.main(base) == 0
    code = cli.main(
        base + ["--resume", "--set", "train.lr=0.01", "--set", "sampler.kernel.eta=0.5", "--set", "train.iterations=3"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "train.lr: 0.003 in the checkpoint, 0.01 now" in err
    assert "sampler.kernel.eta: 0.7 in the checkpoint, 0.5 now" in err
    assert "train.iterations" not in err  # extending a run is allowed


class _Broken:
    def __init__(self, value):
        self.value = value

    def __call__(self, outputs, prompts, metadata):
        scores = torch.zeros(len(prompts))
        if self.value == "shape":
            return RewardResult(scores=scores[:-1])
        scores[3] = self.value
        return RewardResult(scores=scores)


@pytest.mark.parametrize(
    "value, message",
    [
        (
            float("nan"),
            "reward 'bad' returned nan for the batch of iteration 7 (sample 3, prompt 'p3'; 1 non-finite of 6)",
        ),
        (float("inf"), "reward 'bad' returned inf for the batch of iteration 7"),
        (
            "shape",
            "reward 'bad' returned scores of shape (5,) for the batch of iteration 7 of 6 samples; expected (6,)",
        ),
    ],
)
def test_bad_reward_output_is_refused_before_the_update(value, message):
    spec = RewardSpec("bad", "bad", 1.0, {})
    prompts = [f"p{i}" for i in range(6)]
    with pytest.raises(RewardError) as info:
        score([(spec, _Broken(value))], torch.zeros(6, 2), prompts, [{}] * 6, where="the batch of iteration 7")
    assert message in str(info.value)


def test_objective_kl_uses_the_reference_with_gradient(root):
    recipe = vector_recipe(root, "objective.kl_beta=0.1", "model.lora.rank=4")
    run = build_run(recipe, out_dir=None, console=QUIET, quiet=True)
    iteration(run, 0)
    metrics = iteration(run, 1)
    assert metrics["kl"] > 0  # LoRA moved away from the reference after one step
    # the policy and the reference on every trained (sample, step) pair; 9 of the 10 steps are
    # trained since timestep_fraction defaults to flow_grpo's 0.99 (it was 2 * nfe_rollout with all 10)
    assert metrics["trained_steps"] == 9 and metrics["trained_samples"] == 64
    assert metrics["nfe_train"] == 2 * 9 * 64


@pytest.mark.parametrize(
    "sampler",
    [
        "sampler={name: mixgrpo, steps: 8, window: 2, shift_every: 2, strategy: random, flash: true, kernel: {name: "
        "sde, eta: 0.7}}",
        "sampler={name: fast, steps: 8, window: 2, kernel: {name: dance, eta: 0.3}}",
    ],
)
def test_resume_restores_ema_schedule_and_sampler_state_exactly(root, tmp_path, sampler):
    from safetensors.torch import load_file

    sets = [
        "--set",
        sampler,
        "--set",
        "train.ema_decay=0.9",
        "--set",
        "train.lr_schedule=cosine",
        "--set",
        "train.warmup_iterations=2",
        "--set",
        "train.checkpoint_every=3",
        "--quiet",
    ]
    recipe = str(root / "recipes" / "vector.yaml")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli.main(["compose", recipe, "--out", str(straight), "--set", "train.iterations=9", *sets]) == 0

    class Crash:  # a plugin that interrupts the run after iteration 5 (checkpoint 3 is the last)
        @hookimpl
        def fgrpo_iteration_end(self, run, iteration, metrics):
            if iteration == 5:
                raise KeyboardInterrupt

    pm = plugin_manager()
    pm.register(Crash(), name="crash")
    try:
        assert cli.main(["compose", recipe, "--out", str(resumed), "--set", "train.iterations=9", *sets]) == 130
    finally:
        pm.unregister(name="crash")
    assert (resumed / "checkpoints" / "last").resolve().name == "iter_000003"
    assert cli.main(["compose", recipe, "--out", str(resumed), "--set", "train.iterations=9", "--resume", *sets]) == 0
    for name in ("trainable.safetensors", "ema.safetensors"):
        a = load_file(str(straight / "checkpoints" / "last" / name))
        b = load_file(str(resumed / "checkpoints" / "last" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    state = json.loads((resumed / "checkpoints" / "last" / "state.json").read_text())
    assert state["iteration"] == 9
    rows_a, rows_b = read_metrics(straight), read_metrics(resumed)
    assert [r.get("lr") for r in rows_a] == [r.get("lr") for r in rows_b]
    assert [r.get("reward_mean") for r in rows_a] == [r.get("reward_mean") for r in rows_b]
    assert len(rows_a) == 10


def test_reward_details_are_logged_every_iteration(root):
    """A reward's per-sample details (a judge's fallback flags, a verifier's partial scores) are
    averaged into the iteration's metrics, so a fallback value is counted, never silent."""
    run = build_run(vector_recipe(root), out_dir=None, console=QUIET, quiet=True)
    spec, inner = run.rewards[0]

    class FlagsEveryThird:
        def __call__(self, outputs, prompts, metadata):
            result = inner(outputs, prompts, metadata)
            flags = torch.tensor([float(i % 3 == 0) for i in range(len(prompts))])
            return RewardResult(result.scores, {"fallback": flags, "answer": ["?"] * len(prompts)})

    run.rewards = [(spec, FlagsEveryThird())]
    metrics = iteration(run, 0)
    n = run.recipe.train.prompts_per_iteration * run.recipe.train.group_size
    assert metrics[f"reward/{spec.label}/fallback"] == pytest.approx(len(range(0, n, 3)) / n)
    assert f"reward/{spec.label}/answer" not in metrics  # text details are not averaged


def test_detail_means_overall_is_the_unweighted_mean_of_the_categories():
    from fgrpo.core.scoring import detail_means

    means = detail_means({"strict": torch.tensor([1.0, 0.0, 1.0]), "category": ["a", "a", "b"]})
    assert means == pytest.approx({"strict": 2 / 3, "strict/a": 0.5, "strict/b": 1.0, "strict/overall": 0.75})
    assert "strict/overall" not in detail_means({"strict": torch.tensor([1.0, 0.0]), "category": ["a", "a"]})
    assert detail_means({"strict": torch.tensor([1.0, 0.0]), "category": ["a", "b"]}, by_category=False) == {
        "strict": 0.5
    }
