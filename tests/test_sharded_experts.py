"""Wan 2.2's two experts under every launch kind: 2 CPU processes over gloo, a tiny Wan 2.2 T2V
(two experts, boundary 0.875) whose trained steps fall on both sides of the boundary. Sharded
(FSDP2, ZeRO-3, ZeRO-2) equals data parallel within float tolerance and resumes bit for bit
(tests/sharded_worker.py trains it data parallel, sharded, resumed, crossed); the differences
measured before and after are in recipes/accelerate/README.md ("A network per noise level").
FSDP2 with a window of 2 runs in the default suite (about 40 s alone), the other cases are slow.

With 4 steps and shift 3 the timesteps are 1000 (the high-noise expert), 858, 602 and 9 (the
low-noise one): a window in steps 0-1 crosses the boundary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from test_sharded import (
    assert_rows_close,
    last,
    needs,
    optimizer_tensors,
    rows,
    run_worker,
    two_process_recipe,
    without_timing,
)

GRPO = {"name": "grpo", "clip_range": 1e-3, "kl_beta": 0.01}
#: (sampler, objective) of each case: the window straddles the boundary (both experts in every
#: sample), a window of 1 whose start falls on either side (a sample trains one expert or the
#: other), DanceGRPO's random subset (each sample its own two of the four steps); DiffusionNFT's
#: points (two of the four levels per sample, the old policy's and the reference's predictions)
SETTINGS = {
    "window-2": ({"name": "fast", "steps": 4, "window": 2, "window_range": [0, 2], "share_prefix": False}, GRPO),
    "window-1": ({"name": "fast", "steps": 4, "window": 1, "window_range": [0, 2], "share_prefix": False}, GRPO),
    "random-subset": ({"name": "full", "steps": 4, "timestep_fraction": 0.5, "random_subset": True}, GRPO),
    "nft": (
        {"name": "ode", "steps": 4},
        {"name": "nft", "nft_beta": 1.0, "kl_beta": 0.01, "timestep_fraction": 0.5},
    ),
}


@pytest.fixture(scope="module")
def tiny_wan22(tmp_path_factory) -> str:
    from fgrpo.models.testing import build_tiny_wan22_pipeline

    path = tmp_path_factory.mktemp("tiny-wan22")
    build_tiny_wan22_pipeline(path)
    return str(path)


def wan22_recipe(folder: Path, pipeline: str, case: str) -> Path:
    """Two prompts per iteration (one per process), LoRA on both experts, KL to the base (a
    reference pass), an EMA, a checkpoint every iteration."""
    model = {
        "name": "wan",
        "path": pipeline,
        "device": "cpu",
        "max_sequence_length": 16,
        "resolution": 32,
        "num_frames": 5,
        "guidance_scale": 1.0,
        "lora": {"rank": 4},
    }
    sampler = SETTINGS[case][0] | ({"kernel": {"name": "sde", "eta": 0.7}} if case != "nft" else {})
    return two_process_recipe(
        folder / f"wan22-{case}.yaml", model, sampler, SETTINGS[case][1], {"every": 0}, group_size=3, lr=1e-2
    )


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


CASES = [
    pytest.param("fsdp", "window-2", id="fsdp-window-2"),
    pytest.param("fsdp", "window-1", id="fsdp-window-1", marks=pytest.mark.slow),
    pytest.param("fsdp", "random-subset", id="fsdp-random-subset", marks=pytest.mark.slow),
    pytest.param("fsdp", "nft", id="fsdp-nft", marks=pytest.mark.slow),
    pytest.param("zero3", "window-2", id="zero3-window-2", marks=pytest.mark.slow),
    pytest.param("zero3", "random-subset", id="zero3-random-subset", marks=pytest.mark.slow),
    pytest.param("deepspeed", "window-1", id="zero2-window-1", marks=pytest.mark.slow),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind, case", CASES)
def test_both_experts_sharded_equal_data_parallel_and_resume_exactly(kind, case, tiny_wan22, tmp_path):
    needs(kind)
    recipe = wan22_recipe(tmp_path, tiny_wan22, case)
    runs = tmp_path / "runs"
    report = run_worker(kind, recipe, runs)
    assert report[0]["sharded"]["sharded"] and report[1]["sharded"]["padding_passes"] > 0
    # both experts trained: each one's LoRA moved from its initial (zero) up-projection
    trained = load_file(str(last(runs / "ddp") / "trainable.safetensors"))
    for expert in ("transformer.", "transformer_2."):
        moved = [v for k, v in trained.items() if k.startswith(expert) and "lora_B" in k]
        assert moved and any(bool(v.abs().max() > 0) for v in moved), expert
    # one sharded iteration from a data-parallel checkpoint (both experts, padding passes of both):
    # the data-parallel iteration to float rounding (before lockstep passes: 0.012). nft's
    # gradient is as close (2e-6 relative) but many of its elements lie far below AdamW's eps
    # (1e-6), where a step is 1e4 x the gradient: its weights differ by 4e-5
    a = load_file(str(last(runs / "ddp") / "trainable.safetensors"))
    assert report[0]["crossed"]["start"] == 2 and report[0]["crossed"]["sharded"]
    crossed = load_file(str(last(runs / "crossed") / "trainable.safetensors"))
    assert largest_difference(a, crossed) <= (1e-4 if case == "nft" else 1e-6), largest_difference(a, crossed)
    assert rows(runs / "crossed")[-1]["grad_norm"] == pytest.approx(rows(runs / "ddp")[-1]["grad_norm"], rel=1e-5)
    # three sharded iterations from the start: the same run (before: 0.04). Rounding grows faster
    # than on one transformer: each reward is a distance of about 45 held in float32 (4e-6 apart)
    # and a group's rewards spread 0.15, so the advantages carry 1e-5 relative rounding into the
    # next iterations (at lr 1e-2: 1.2e-5 in the weights after three)
    for name in ("trainable.safetensors", "ema.safetensors", "export/pytorch_lora_weights_transformer_2.safetensors"):
        a, b = load_file(str(last(runs / "ddp") / name)), load_file(str(last(runs / "sharded") / name))
        assert a.keys() == b.keys() and a, name
        assert largest_difference(a, b) <= 1e-4, (name, largest_difference(a, b))
    a, b = optimizer_tensors(runs / "ddp"), optimizer_tensors(runs / "sharded")
    assert a.keys() == b.keys() and largest_difference(a, b) <= 1e-4
    assert_rows_close(rows(runs / "ddp"), rows(runs / "sharded"), rel=1e-3)
    # resumed sharded: bit for bit the uninterrupted sharded run
    for name in ("trainable.safetensors", "ema.safetensors"):
        a, b = load_file(str(last(runs / "sharded") / name)), load_file(str(last(runs / "resumed") / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    a, b = optimizer_tensors(runs / "sharded"), optimizer_tensors(runs / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert without_timing(rows(runs / "sharded")) == without_timing(rows(runs / "resumed"))


# --- the plan of passes, without processes -----------------------------------------------------


def test_every_process_runs_the_same_group_at_the_same_pass():
    """Two processes' passes of mixed groups (a pair's group: its level's sign here): each planned
    pass holds one group, both processes make the same groups in the same order, every pair is made
    once, and padding passes sit at their group's level; without groups, or where the passes are
    not collective, the passes are kept as they are."""
    from fgrpo.core.points import lockstep
    from fgrpo.core.protocols import ForwardGroups

    groups = ForwardGroups(of=lambda sigma: (sigma < 0.5).long(), levels=(1.0, 0.0))
    policy = type("Policy", (), {"forward_groups": groups})()
    level = torch.tensor([[0.9, 0.2, 0.1], [0.8, 0.7, 0.3], [0.6, 0.4, 0.95]])  # (item, unit) -> level

    def passes_of(items, per_forward):
        pairs = [(i, u) for i in items for u in range(3)]
        chunks = [pairs[k : k + per_forward] for k in range(0, len(pairs), per_forward)]
        return [(torch.tensor([i for i, _ in c]), torch.tensor([u for _, u in c])) for c in chunks]

    def levels(made):
        return level[made[0], made[1]]

    processes = [passes_of([0, 1, 2], 2), passes_of([1], 2)]
    # what each process has of each group, naively: its pairs' levels counted per pass
    own = [
        [sum(any((float(x) >= 0.5) == (g == 0) for x in levels(p)) for p in ps) for g in (0, 1)] for ps in processes
    ]
    busiest = [max(own[0][g], own[1][g]) for g in (0, 1)]
    plans = []
    for rank, passes in enumerate(processes):
        asked: list[int] = []

        def missing(n, asked=asked):  # the launch's collective: the busiest process's count of the group
            asked.append(n)
            return busiest[len(asked) - 1] - n

        plans.append(lockstep.plan(policy, passes, levels, missing, collective=True))
        assert asked == own[rank]
    group_of = []
    for rank, planned in enumerate(plans):
        seen, order = [], []
        for made, pad in planned:
            if made is None:
                order.append(int(groups.of(torch.tensor([pad]))[0]))
                continue
            g = groups.of(levels(made))
            assert len(set(g.tolist())) == 1
            order.append(int(g[0]))
            seen += list(zip(made[0].tolist(), made[1].tolist(), strict=True))
        expected = [(int(i), int(u)) for rows, cols in processes[rank] for i, u in zip(rows, cols, strict=True)]
        assert sorted(seen) == sorted(expected) and len(seen) == len(expected)
        group_of.append(order)
    assert group_of[0] == group_of[1] == sorted(group_of[0])
    assert len(group_of[0]) == sum(busiest)
    # no groups, or passes nobody else takes part in: the passes as they are, then the padding
    for plain, collective in ((type("Plain", (), {})(), True), (policy, False)):
        planned = lockstep.plan(plain, processes[1], levels, lambda n: 1, collective)
        assert planned == [(p, None) for p in processes[1]] + [(None, None)]
