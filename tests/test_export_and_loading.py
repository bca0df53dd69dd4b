"""A trained LoRA leaves fgrpo in diffusers' own format (every checkpoint, and ``fgrpo export``);
weights that are absent are refused at once with one message saying what to do."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from _helpers import run_fgrpo
from fgrpo.core import cli
from fgrpo.core.hub import WeightsUnavailable, pretrained_source
from fgrpo.models.sd3 import SD3Policy
from fgrpo.models.testing import build_tiny_sd3_pipeline

SEQ = 8


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd3")
    build_tiny_sd3_pipeline(path)
    return str(path)


def write_recipe(folder, model_path, *, lora="{rank: 4}", ema=0.0):
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(f"""
        seed: 0
        model: {{name: sd3, path: {model_path}, device: cpu, max_sequence_length: {SEQ}, lora: {lora}}}
        sampler: {{name: full, steps: 2, kernel: {{name: sde, eta: 0.7}}}}
        reward: {{name: jpeg-compressibility}}
        objective: {{name: grpo, clip_range: 1.0e-3}}
        prompts: {{name: list, train: ["a red circle", "a blue square"]}}
        train: {{iterations: 2, group_size: 2, prompts_per_iteration: 2, lr: 0.05, ema_decay: {ema}}}
        log: {{trackers: [], plots: false, quiet: true}}
    """)
    )
    return str(recipe)


def velocity_of(policy, probe):
    x, sigma, cond = probe
    with torch.no_grad():
        return policy.velocity(x, sigma, cond)


def test_checkpoints_export_loads_with_diffusers_and_fgrpo_export(tiny_sd3, tmp_path, capsys):
    from diffusers import StableDiffusion3Pipeline

    run = tmp_path / "run"
    assert cli.main(["compose", write_recipe(tmp_path, tiny_sd3, ema=0.5), "--out", str(run), "--quiet"]) == 0
    last = run / "checkpoints" / "last"
    assert (last / "export" / "pytorch_lora_weights.safetensors").is_file()

    # the policy as the run left it: trained weights, and the EMA the export holds
    policy = SD3Policy(path=tiny_sd3, device="cpu", max_sequence_length=SEQ, lora={"rank": 4})
    probe = (
        policy.initial_noise(2, torch.Generator().manual_seed(0)),
        torch.tensor([0.8, 0.4]),
        policy.encode(["a red circle", "x"]),
    )
    from fgrpo.core.saving import load_checkpoint_weights

    load_checkpoint_weights(policy, last, ema_decay=0.5)
    ema_velocity = velocity_of(policy, probe)
    load_checkpoint_weights(policy, last, ema_decay=0.0)
    raw_velocity = velocity_of(policy, probe)
    assert not torch.allclose(ema_velocity, raw_velocity)

    for args, expected in (([], ema_velocity), (["--no-ema"], raw_velocity)):
        out = tmp_path / ("export" + "".join(args))
        assert cli.main(["export", str(last), "--out", str(out), *args]) == 0
        assert "pytorch_lora_weights.safetensors" in capsys.readouterr().out
        plain = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
        plain.load_lora_weights(str(out))  # what a user does with it
        loaded = SD3Policy.from_pipeline(plain, device="cpu", max_sequence_length=SEQ, lora=None)
        torch.testing.assert_close(velocity_of(loaded, probe), expected, rtol=0, atol=1e-5)

    assert cli.main(["export", str(last), "--out", str(tmp_path / "export")]) == 2  # not empty
    assert cli.main(["export", str(tmp_path), "--out", str(tmp_path / "e2")]) == 2  # not a checkpoint
    assert "not a checkpoint folder" in capsys.readouterr().err


def test_full_fine_tuning_exports_the_transformer(tiny_sd3, tmp_path):
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    run = tmp_path / "run"
    recipe = write_recipe(tmp_path, tiny_sd3, lora="null")
    assert cli.main(["compose", recipe, "--out", str(run), "--quiet", "--set", "train.iterations=1"]) == 0
    last = run / "checkpoints" / "last"
    assert not (last / "export").exists()  # a whole transformer is not copied into every checkpoint
    assert cli.main(["export", str(last), "--out", str(tmp_path / "out")]) == 0
    exported = SD3Transformer2DModel.from_pretrained(str(tmp_path / "out" / "transformer")).state_dict()
    trained = load_file(str(last / "trainable.safetensors"))
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)


def test_local_paths_and_absent_hub_ids_fail_fast(tmp_path, monkeypatch):
    assert pretrained_source(str(tmp_path), key="model.path").local
    with pytest.raises(WeightsUnavailable, match="the local folder './no/such/folder' does not exist"):
        pretrained_source("./no/such/folder", key="model.path")
    with pytest.raises(WeightsUnavailable, match="is a file"):
        (tmp_path / "f").write_text("x")
        pretrained_source(str(tmp_path / "f"), key="model.path")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsUnavailable) as info:
        pretrained_source("someone/some-model", key="model.path")
    message = str(info.value)
    for part in ("model.path: 'someone/some-model'", "HF_HUB_OFFLINE=1", "HF_HOME", "--local-dir", "local folder"):
        assert part in message, (part, message)


def test_an_unreachable_hub_is_one_message_without_retries(tmp_path):
    """No HF_HUB_OFFLINE, an endpoint that refuses connections: exit 2 at once, no traceback."""
    recipe = write_recipe(tmp_path, "stabilityai/stable-diffusion-3.5-medium")
    env = {"HF_HUB_OFFLINE": "", "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    start = time.monotonic()
    done = run_fgrpo("compose", recipe, "--dry-run", env=env, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert (
        "'stabilityai/stable-diffusion-3.5-medium' is not in the local hub cache and the hub cannot be reached"
        in done.stderr
    )
    assert elapsed < 60, f"took {elapsed:.0f} s"  # a generous bound: the retry loops it replaces took about a minute


def test_a_missing_local_folder_is_reported_as_such(tmp_path):
    """Every diffusers backbone fgrpo-models registers (the list is the entry points')."""
    from fgrpo.core import registry, shipped

    backbones = [
        name
        for (kind, name), (distribution, extras) in shipped.COMPONENTS.items()
        if kind == "model" and distribution == "fgrpo-models" and "diffusers" in extras
    ]
    assert len(backbones) >= 12 and "z-image" in backbones
    for name in backbones:
        with pytest.raises(
            registry.BuildError, match=f"model.path: the local folder {str(tmp_path / 'nowhere')!r} does not exist"
        ):
            registry.create("model", name, path=str(tmp_path / "nowhere"), device="cpu")


def test_reward_models_from_the_hub_fail_fast_too(monkeypatch):
    pytest.importorskip("transformers")
    from fgrpo.core import registry

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("clip-score", "pickscore"):
        with pytest.raises(
            registry.BuildError, match="reward.path: 'someone/no-such-clip' is not in the local hub cache"
        ):
            registry.create("reward", name, path="someone/no-such-clip", device="cpu")
