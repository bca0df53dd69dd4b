"""Context parallelism (model.context_parallel: Ulysses) run for real on CPU processes over gloo.

- default suite: a tiny SD3 (with a dual-attention layer, unequal token blocks) and a tiny Wan
  transformer split over 2 processes against the same transformer whole: output and the weight
  gradients summed over the group;
- slow: one iteration of a recipe of each, 2 processes splitting every sample's tokens, and 4
  processes = 2 groups x 2 with data parallel, against the same iteration in 1 process: the same
  rollout latents and log-probs, advantages, the update's gradient (summed within a group,
  averaged over groups), the weights after it and the evaluation's mean reward, to float tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from _helpers import torchrun

pytest.importorskip("diffusers")
pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent


def _recipe(tmp_path: Path, backbone: str) -> Path:
    from fgrpo.models.testing import build_tiny_sd3_pipeline, build_tiny_wan_pipeline

    pipeline = tmp_path / backbone
    model: dict = {"name": backbone, "path": str(pipeline), "device": "cpu", "lora": {"rank": 4}}
    if backbone == "sd3":
        build_tiny_sd3_pipeline(pipeline, sd35=True)  # a dual-attention layer too
        model["resolution"] = [64, 80]  # 4 x 5 = 20 image tokens
    else:
        build_tiny_wan_pipeline(pipeline)
        model.update(resolution=[32, 48], num_frames=5, max_sequence_length=16)
    data = {
        "model": model,
        "sampler": {"name": "full", "steps": 2},
        "reward": "jpeg-compressibility",
        "objective": "grpo",
        "prompts": {"name": "list", "train": ["a cat", "a dog", "a red car", "two birds"], "test": ["a cat"]},
        "train": {
            "iterations": 1,
            "group_size": 2,
            "prompts_per_iteration": 2,
            "rollout_prompts": 1,  # the noise of a group depends on its global slot only
            "lr": 1e-2,
            "max_grad_norm": 0,  # the gradient as summed and averaged, not rescaled by a clip
        },
    }
    path = tmp_path / f"{backbone}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(recipe: Path, out: Path, processes: int, *sets: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = torchrun(processes) if processes > 1 else [sys.executable]
    done = subprocess.run(
        [*launcher, str(HERE / "cp_worker.py"), str(recipe), str(out), *sets],
        env=env,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _same(one: dict, many: dict) -> None:
    assert many["identical"] and one["moved"] > 1e-4  # every process holds the same weights; the update moved them
    for key in ("latents", "final", "log_probs", "advantages", "gradients"):
        a, b = torch.tensor(one[key]), torch.tensor(many[key])
        scale = float(a.abs().max())  # gradients are ~1e-3: the tolerance is relative to the largest
        assert scale > 0 and a.shape == b.shape, key
        assert torch.allclose(a, b, atol=1e-5 * max(scale, 1.0) if key != "gradients" else 1e-5 * scale, rtol=0), (
            key,
            float((a - b).abs().max()),
        )
    assert torch.allclose(torch.tensor(one["weights"]), torch.tensor(many["weights"]), atol=1e-5, rtol=0)
    # the evaluation ran (no process left waiting); its reward is a JPEG size in KB of pixels rounded
    # to uint8, which float-level differences move by a byte or so (seen: 5e-4 for SD3)
    assert one["eval_reward"] is not None and many["eval_reward"] == pytest.approx(one["eval_reward"], abs=1e-2)


def test_a_transformer_split_over_two_processes_equals_it_whole(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "transformers.json"
    done = subprocess.run(
        [*torchrun(2), str(HERE / "cp_transformer_worker.py"), str(out)],
        env=env,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for backbone, found in json.loads(out.read_text()).items():
        assert found["output"] < 1e-5, backbone
        assert found["gradients"] < 1e-5 * found["largest_gradient"], backbone


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each backbone's recipe and its iteration in 1 process (computed once for the module)."""
    found: dict[str, tuple[Path, dict]] = {}

    def get(backbone: str) -> tuple[Path, dict]:
        if backbone not in found:
            folder = tmp_path_factory.mktemp(backbone)
            recipe = _recipe(folder, backbone)
            found[backbone] = (recipe, _run(recipe, folder / "one.json", 1))
        return found[backbone]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("backbone", ["sd3", "wan"])
def test_two_processes_splitting_each_sample_equal_one(tmp_path, one_process, backbone):
    recipe, one = one_process(backbone)
    two = _run(recipe, tmp_path / "two.json", 2, "model.context_parallel.ulysses_degree=2")
    assert (two["processes"], two["replicas"]) == (2, 2)
    _same(one, two)


@pytest.mark.slow
@pytest.mark.parametrize("backbone", ["sd3", "wan"])
def test_two_groups_of_two_with_data_parallel_equal_one(tmp_path, one_process, backbone):
    recipe, one = one_process(backbone)
    four = _run(recipe, tmp_path / "four.json", 4, "model.context_parallel.ulysses_degree=2")
    assert (four["processes"], four["replicas"]) == (4, 2)
    assert four["summary"].startswith("4 process(es), context parallel: 2 group(s) of 2, device cpu")
    _same(one, four)
