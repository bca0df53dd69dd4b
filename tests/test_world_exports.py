"""Every shipped world's trained weights leave fgrpo and come back: a tiny run of each world's recipe,
its checkpoint's ``export/`` (the LoRA worlds), ``fgrpo export``, and the export loaded the way a
user loads it (``PeftModel.from_pretrained`` onto a fresh base transformer; the driving planner's
own weights file) gives the trained policy's velocity on the same input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from _helpers import TINY_SHAPES
from fgrpo.core import cli, rundir
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.saving import load_checkpoint_weights
from fgrpo.core.seeding import derive_seed

TINY = [*TINY_SHAPES, "eval.every=0"]
TINY_EDIT = [*TINY, "prompts.train_size=20", "prompts.test_per_category=1"]
TINY_DRIVING = [
    "prompts.train_seeds=3",
    "prompts.test_seeds=1",
    "prompts.times=[0]",
    "prompts.closed_loop=null",
    "train.iterations=1",
    "train.prompts_per_iteration=2",
    "train.group_size=2",
    "sampler.steps=2",
    "eval.every=0",
    "log.plots=false",
]
#: what "the same outputs" means: float32 arithmetic in another order (the driving export merges the
#: adapter into the base weights), so a few units in the last place of each value: relative as well
#: (a velocity of 2.8 differed by 1.2e-6, 5 ulps, on one thread)
TOLERANCE = 1e-6
SAME = {"rtol": TOLERANCE, "atol": TOLERANCE}


def sets(items):
    return [arg for item in items for arg in ("--set", item)]


def compose(root, recipe, out, tiny):
    return cli.main(["compose", str(root / "recipes" / recipe), "--out", str(out), "--quiet", *sets(tiny)])


def build(checkpoint, *, lora=True):
    """The checkpoint's model as ``fgrpo export`` builds it (the same random base for the same
    seed); ``lora=False``: that base alone, without an adapter."""
    recipe = rundir.recipe_for_checkpoint(checkpoint, None, [])
    if not lora:
        recipe, errors = recipe_mod.validate({**recipe.data, "model": {**recipe.data["model"], "lora": None}})
        assert recipe is not None, errors
    torch.manual_seed(derive_seed(recipe.seed, "build"))
    return recipe.build("model"), recipe


def probe_prompts(recipe):
    source = recipe.build("prompts")
    return source.train_prompts()[:2]


def velocity(policy, prompts):
    x = policy.initial_noise(len(prompts), torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.4])[: len(prompts)]
    with torch.no_grad():
        return policy.velocity(x, sigma, policy.encode(prompts))


def perturb(policy):
    """Noise on every trained weight: an export that loses the adapter (or a part of it), or writes
    the base's weights, cannot pass (one short tiny run may leave them where they started)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def peft_loaded(checkpoint, folder):
    """A fresh base policy (no adapter) whose transformer gets the exported adapter through peft."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    fresh, _ = build(checkpoint, lora=False)
    PeftModel.from_pretrained(fresh.transformer, str(folder))  # adapts the base transformer in place
    assert any(isinstance(m, LoraLayer) for m in fresh.transformer.modules())
    return fresh


@pytest.mark.parametrize(("recipe", "tiny"), [("shapes.yaml", TINY), ("shapes-edit.yaml", TINY_EDIT)])
def test_shapes_worlds_export_a_peft_adapter_that_round_trips(root, tmp_path, capsys, recipe, tiny):
    run = tmp_path / "run"
    assert compose(root, recipe, run, tiny) == 0
    last = run / "checkpoints" / "last"
    assert sorted(p.name for p in (last / "export").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    # fgrpo export of the trained run, loaded onto a fresh base transformer with peft
    out = tmp_path / "export"
    assert cli.main(["export", str(last), "--out", str(out)]) == 0
    assert "adapter_model.safetensors" in capsys.readouterr().out
    trained, resolved = build(last)
    load_checkpoint_weights(trained, last, ema_decay=0.0)
    prompts = probe_prompts(resolved)
    expected = velocity(trained, prompts)
    got = velocity(peft_loaded(last, out), prompts)
    torch.testing.assert_close(got, expected, **SAME)

    # an adapter far from its initialisation: every adapted layer must come back
    perturb(trained)
    trained.export(str(tmp_path / "perturbed"))
    expected = velocity(trained, prompts)
    base, _ = build(last, lora=False)
    assert (velocity(base, prompts) - expected).abs().max() > 1e-2  # the adapter matters
    got = velocity(peft_loaded(last, tmp_path / "perturbed"), prompts)
    torch.testing.assert_close(got, expected, **SAME)


def test_a_fully_fine_tuned_shapes_network_exports_a_weights_file_a_recipe_loads(root, tmp_path):
    from fgrpo.worlds.shapes.model import EXPORT_FILE, ShapesDiT

    run = tmp_path / "run"
    assert compose(root, "shapes.yaml", run, [*TINY, "model.lora=null"]) == 0
    last = run / "checkpoints" / "last"
    assert not (last / "export").exists()  # a whole network is not copied into every checkpoint
    assert cli.main(["export", str(last), "--out", str(tmp_path / "out")]) == 0
    trained, resolved = build(last)
    load_checkpoint_weights(trained, last, ema_decay=0.0)
    loaded = ShapesDiT(path=str(tmp_path / "out" / EXPORT_FILE), device="cpu")
    prompts = probe_prompts(resolved)
    torch.testing.assert_close(velocity(loaded, prompts), velocity(trained, prompts), **SAME)
    perturb(trained)
    trained.export(str(tmp_path / "perturbed"))
    loaded = ShapesDiT(path=str(tmp_path / "perturbed" / EXPORT_FILE), device="cpu")
    torch.testing.assert_close(velocity(loaded, prompts), velocity(trained, prompts), **SAME)


@pytest.mark.parametrize("lora", ["null", "{rank: 4}"])
def test_the_driving_planner_exports_its_own_weights_file(root, tmp_path, lora):
    from fgrpo.worlds.driving.planner import TrajectoryPolicy

    run = tmp_path / "run"
    assert compose(root, "driving-nft.yaml", run, [*TINY_DRIVING, f"model.lora={lora}"]) == 0
    last = run / "checkpoints" / "last"
    assert cli.main(["export", str(last), "--out", str(tmp_path / "out")]) == 0
    trained, resolved = build(last)
    load_checkpoint_weights(trained, last, ema_decay=0.0)
    prompts = probe_prompts(resolved)
    loaded = TrajectoryPolicy(path=str(tmp_path / "out" / "trajectory.safetensors"))
    torch.testing.assert_close(velocity(loaded, prompts), velocity(trained, prompts), **SAME)
    if lora != "null":  # the adapter merged into the base weights, far from its initialisation
        perturb(trained)
        trained.export(str(tmp_path / "perturbed"))
        loaded = TrajectoryPolicy(path=str(tmp_path / "perturbed" / "trajectory.safetensors"))
        torch.testing.assert_close(velocity(loaded, prompts), velocity(trained, prompts), **SAME)
