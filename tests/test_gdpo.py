"""train.advantage: gdpo — GDPO as Pref-GRPO computes it (CodeGoat24/Pref-GRPO at 3e787f6,
fastvideo/rewards/dispatcher.py:614-704): each reward z-scored within its prompt group (628-641),
the weighted sum of those advantages (697), that sum z-scored over the batch gathered from every
process (698-702)."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core import cli, rollout
from fgrpo.core.advantages import combine
from fgrpo.core.runlog import read_metrics

D64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=D64)


def test_hand_computed_two_rewards_two_groups_of_three():
    # unbiased std, eps 0 so that the numbers are exact.
    # a, group 0 [0, 1, 2]: mean 1, std 1 -> [-1, 0, 1]; group 1 [3, 3, 6]: mean 4, deviations
    #   [-1, -1, 2], variance 6 / 2 = 3 -> [-1, -1, 2] / sqrt 3.
    # b, group 0 [2, 0, 1]: mean 1, std 1 -> [1, -1, 0]; group 1 [5, 5, 5]: flat -> [0, 0, 0].
    # weights a 1, b 2: sum = [1, -2, 1, -1/sqrt 3, -1/sqrt 3, 2/sqrt 3]; its batch mean is 0 and its
    # squares sum to 6 + 2 = 8, so its unbiased batch std is sqrt(8 / 5) and the advantages are the
    # sum / sqrt(1.6).
    rewards = {"a": t([0, 1, 2, 3, 3, 6]), "b": t([2, 0, 1, 5, 5, 5])}
    groups = torch.tensor([4, 4, 4, 9, 9, 9])
    adv, stats = combine(rewards, {"a": 1.0, "b": 2.0}, groups, mode="gdpo", unbiased=True, eps=0.0)
    s3 = math.sqrt(3)
    expected = t([1, -2, 1, -1 / s3, -1 / s3, 2 / s3]) / math.sqrt(1.6)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-15)
    assert stats["zero_std_ratio"] == 0.0  # group 1 is flat for b only
    # advantage_sum is the same sum before the renormalisation
    summed, _ = combine(rewards, {"a": 1.0, "b": 2.0}, groups, mode="advantage_sum", unbiased=True, eps=0.0)
    torch.testing.assert_close(summed, expected * math.sqrt(1.6), rtol=0, atol=1e-15)


def test_a_group_flat_for_every_reward_stays_exactly_zero():
    # group 2 is flat for both rewards: exact zeros after the renormalisation too, so that
    # drop_zero_advantage still leaves it out. The batch mean of the summed advantages is 0 in exact
    # arithmetic but rounds to -2.6e-16 here, which the reference would leave as -mean / std.
    rewards = {"a": t([0.1, 0.2, 0.3, 0.1, 0.1, 0.1]), "b": t([0.1, 0.2, 0.3, 0.3, 0.3, 0.3])}
    weights, groups = {"a": 0.4, "b": 0.6}, torch.tensor([0, 0, 0, 2, 2, 2])
    summed, _ = combine(rewards, weights, groups, mode="advantage_sum")
    assert summed.mean().item() == pytest.approx(-2.59e-16, rel=1e-2)
    adv, stats = combine(rewards, weights, groups, mode="gdpo")
    assert adv[3:].tolist() == [0.0, 0.0, 0.0] and (adv[:3] != 0).all()
    assert stats["zero_std_ratio"] == 0.5
    # a batch of one sample (a group of one) is 0, not the NaN of an unbiased std of one number
    adv, _ = combine({"a": t([0.7])}, {"a": 1.0}, torch.tensor([0]), mode="gdpo", unbiased=True, eps=1e-8)
    assert adv.tolist() == [0.0]


def _reference_gdpo(processes, weights, num_generations, use_group):
    """Pref-GRPO's compute_weighted_advantages with apply_gdpo, in float64 Python floats and loops.

    ``processes``: per process, {reward: list of floats}, its samples in whole groups of
    ``num_generations`` adjacent samples. Returns the advantages of every process, concatenated.
    """

    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):  # torch.Tensor.std: unbiased
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    def gather(per_process):
        return [x for xs in per_process for x in xs]

    summed = []  # per process
    for local in processes:
        adv = [0.0] * len(next(iter(local.values())))
        for name, w in weights.items():
            r = local[name]
            if use_group:
                a = [0.0] * len(r)
                for i in range(len(r) // num_generations):
                    g = r[i * num_generations : (i + 1) * num_generations]
                    m, s = mean(g), std(g) + 1e-8
                    for j, x in enumerate(g):
                        a[i * num_generations + j] = (x - m) / s
            else:
                everyone = gather([q[name] for q in processes])
                m, s = mean(everyone), std(everyone) + 1e-8
                a = [(x - m) / s for x in r]
            adv = [x + w * y for x, y in zip(adv, a, strict=True)]
        summed.append(adv)
    everyone = gather(summed)
    m, s = mean(everyone), std(everyone) + 1e-8
    return [(x - m) / s for x in everyone]


@pytest.mark.parametrize("use_group", [True, False])
@pytest.mark.parametrize(("n_processes", "groups_per_process", "g", "n_rewards"), [(1, 5, 8, 2), (4, 3, 6, 3)])
def test_matches_a_naive_float64_reading_of_the_reference(use_group, n_processes, groups_per_process, g, n_rewards):
    gen = torch.Generator().manual_seed(n_processes * 100 + n_rewards)
    names = [f"r{k}" for k in range(n_rewards)]
    weights = {k: float(w) for k, w in zip(names, torch.rand(n_rewards, generator=gen, dtype=D64) * 2, strict=True)}
    scales = {k: 10.0 ** (k_i - 1) for k_i, k in enumerate(names)}  # rewards of different scales
    processes = [
        {k: (torch.randn(groups_per_process * g, generator=gen, dtype=D64) * scales[k]).tolist() for k in names}
        for _ in range(n_processes)
    ]
    processes[0][names[0]][:g] = [0.5] * g  # one group flat for one reward
    expected = t(_reference_gdpo(processes, weights, g, use_group))
    # fgrpo's batch: every process's samples gathered, any group labels
    rewards = {k: t([x for local in processes for x in local[k]]) for k in names}
    n_groups = n_processes * groups_per_process
    labels = torch.randperm(n_groups, generator=gen).repeat_interleave(g) * 7
    options = {"unbiased": True, "eps": 1e-8, "per_prompt": use_group}
    adv, _ = combine(rewards, weights, labels, mode="gdpo", **options)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    # the order of the samples does not matter
    perm = torch.randperm(len(labels), generator=gen)
    shuffled, _ = combine({k: v[perm] for k, v in rewards.items()}, weights, labels[perm], mode="gdpo", **options)
    torch.testing.assert_close(shuffled, expected[perm], rtol=0, atol=1e-12)


def test_the_recipe_key_validates_and_a_bad_value_lists_gdpo(root, capsys):
    recipe = str(root / "recipes" / "vector.yaml")
    assert cli.main(["validate", recipe, "--set", "train.advantage=gdpo"]) == 0
    capsys.readouterr()
    assert cli.main(["validate", recipe, "--set", "train.advantage=gpdo"]) == 2
    err = capsys.readouterr().err
    assert "train.advantage: got 'gpdo'; allowed: " in err and "'gdpo'" in err, err
    assert "Traceback" not in err


def test_a_two_reward_run_trains_on_gdpo_advantages(root, tmp_path, monkeypatch):
    seen = []

    def spy(*args, **kwargs):
        adv, stats = combine(*args, **kwargs)
        seen.append((kwargs["mode"], adv))
        return adv, stats

    monkeypatch.setattr(rollout, "combine", spy)
    out = tmp_path / "run"
    two = (
        "reward=[{name: target-distance, label: near, weight: 0.3}, "
        "{name: target-distance, form: gaussian, label: bump, weight: 0.7}]"
    )
    args = ["compose", str(root / "recipes" / "vector.yaml"), "--out", str(out), "--quiet"]
    for item in (two, "train.advantage=gdpo", "train.iterations=2", "eval.every=0"):
        args += ["--set", item]
    assert cli.main(args) == 0
    rows = [r for r in read_metrics(out) if "reward_mean/near" in r]
    assert len(rows) == 2 and all(math.isfinite(r["reward_mean/bump"]) for r in rows)
    assert [mode for mode, _ in seen] == ["gdpo", "gdpo"]
    for _, adv in seen:  # renormalised over the batch: mean 0, population std 1 (flow_grpo's eps 1e-4)
        assert abs(adv.double().mean().item()) < 1e-6
        assert adv.double().std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)
