"""fgrpo from Python: docs/python-api.md's example runs as it stands (a script in a fresh folder),
and a component registered by a script is found, listed, checked and built like an entry point's,
with the registry's one-line refusals."""

from __future__ import annotations

import re
import subprocess
import sys

import attrs
import pytest
import torch

from fgrpo.core import cli, recipe, registry
from fgrpo.core.config import RecipeError, param
from fgrpo.core.protocols import RewardResult
from fgrpo.core.runlog import read_metrics


def test_the_documented_example_runs_as_written(root, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "python-api.md").read_text(), re.S)
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = map(float, re.search(r"held-out reward (-?[\d.]+) -> (-?[\d.]+)", done.stdout).groups())
    assert after > before  # the registered reward was optimised
    run = tmp_path / "runs" / "python-api"
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows if "eval/reward_mean" in r] == [0, 10, 20]
    assert rows[-1]["lr"] == pytest.approx(5e-3)  # the override
    assert "reward/close-to-origin" in rows[-1] and (run / "report.html").is_file()
    assert (run / "checkpoints" / "last" / "trainable.safetensors").is_file()
    assert not (run / ".fgrpo.lock").exists() or not _locked(run)  # released


def _locked(run) -> bool:
    import fcntl

    with open(run / ".fgrpo.lock") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


@attrs.define
class Brightness:
    level: float = param(0.5, ge=0, le=1, help="target brightness")

    def __call__(self, outputs, prompts, metadata):
        return RewardResult(scores=-(torch.as_tensor(outputs).float().mean(dim=1) - self.level).abs())


@pytest.fixture
def registered():
    registry.register("reward", "script-brightness", Brightness)
    yield Brightness
    registry.unregister("reward", "script-brightness")


def vector_recipe(reward):
    return {
        "model": {"name": "vector"},
        "sampler": {"name": "full", "steps": 2},
        "reward": reward,
        "objective": {"name": "grpo"},
        "prompts": {"name": "list", "train": ["a"]},
        "train": {"iterations": 1, "group_size": 2, "prompts_per_iteration": 1},
    }


def test_a_registered_component_is_checked_built_and_listed_like_an_entry_point(registered):
    checked = recipe.from_dict(vector_recipe({"name": "script-brightness", "level": 0.25}))
    ((_, built),) = checked.build_rewards()
    assert isinstance(built, Brightness) and built.level == 0.25
    assert checked.data["reward"][0]["level"] == 0.25
    with pytest.raises(RecipeError) as info:  # the same key checks as an installed reward's
        recipe.from_dict(vector_recipe({"name": "script-brightness", "level": 2, "lvl": 1}))
    assert [str(e) for e in info.value.errors] == [
        "reward.lvl: unknown key (did you mean 'level'?); allowed keys: level",
        "reward.level: got 2.0; allowed: >= 0 and <= 1",
    ]
    (entry,) = [e for e in registry.entries("reward") if e.name == "script-brightness"]  # what `fgrpo plugins` lists
    assert entry.target == f"{__name__}:Brightness" and entry.distribution == f"registered in {__name__}"
    assert registry.status(entry) == ("ok", "") and [k for k, _, _ in cli._keys(Brightness)] == ["level"]
    assert "script-brightness" in registry.names("reward")


def test_registration_is_refused_in_one_line_when_it_cannot_work():
    with pytest.raises(
        registry.ComponentError, match=r"^unknown component kind 'rewards'; kinds: kernel, sampler, reward"
    ):
        registry.register("rewards", "x", Brightness)
    with pytest.raises(registry.ComponentError, match=r"a component name is letters, digits"):
        registry.register("reward", "my reward", Brightness)
    with pytest.raises(registry.ComponentError, match=r"expected a component class or factory, got int"):
        registry.register("reward", "seven", 7)
    with pytest.raises(
        registry.AmbiguousComponent,
        match=r"reward 'target-distance' is already registered by fgrpo-rewards; register yours under another name",
    ):
        registry.register("reward", "target-distance", Brightness)
    assert "seven" not in registry.names("reward")


def test_register_again_replaces_and_unregister_takes_it_back():
    @registry.register("reward", "script-twice")
    class First(Brightness):
        pass

    assert registry.load("reward", "script-twice") is First
    registry.register("reward", "script-twice", Brightness)  # the notebook cell, run again
    assert registry.load("reward", "script-twice") is Brightness
    registry.unregister("reward", "script-twice")
    with pytest.raises(registry.UnknownComponent, match=r"unknown reward 'script-twice'"):
        registry.load("reward", "script-twice")
