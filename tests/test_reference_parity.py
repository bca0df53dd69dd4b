"""Every shipped real-model recipe against the reference it reproduces (recipes/references/parity.yaml).

Two kinds of checks. The table: each recipe's resolved values equal the reference's, value by value,
except the deviations the table lists with a reason (fgrpo.core.parity). The models: each recipe's
model section, built on a tiny random pipeline of its backbone, behaves as the reference's: the LoRA
adapter is initialised and placed as peft places the reference's LoraConfig on the same network
(item 3 and 4 of issue 21), the text is encoded to the reference's length (item 6), the weights are
in the reference's dtypes (item 8), and Wan's kernel, schedule and timesteps are flow_grpo's (items
1 and 11).
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from fgrpo.core import cli, parity, registry
from fgrpo.core import recipe as recipe_mod
from fgrpo.models.lora import LORA_INITS
from test_real_recipes import stand_in_datasets

TABLE = parity.load_table()
#: the diffusers backbones: a recipe on one is a real-scale recipe
BACKBONES = {
    "sd3",
    "flux",
    "flux2",
    "flux2-klein",
    "qwen-image",
    "z-image",
    "wan",
    "wan-i2v",
    "hunyuan-video-1.5",
    "flux-kontext",
    "qwen-image-edit",
    "qwen-image-edit-plus",
}


def recipe_files(root):
    return sorted((root / "recipes").glob("*.yaml"))


def test_every_real_recipe_has_a_reference_entry(root):
    real = {p.stem for p in recipe_files(root) if yaml.safe_load(p.read_text())["model"]["name"] in BACKBONES}
    assert real, "no real-scale recipes found"
    listed = set(TABLE["recipes"]) | set(TABLE.get("without_reference") or {})
    assert real - listed == set(), "recipes without a parity entry: add them to recipes/references/parity.yaml"
    assert set(TABLE["recipes"]) - real == set(), "table entries without a recipe"
    for name, why in (TABLE.get("without_reference") or {}).items():
        assert why, f"{name}: say why it reproduces no reference"


def test_every_entry_names_a_known_source():
    for name, entry in TABLE["recipes"].items():
        ref = entry["reference"]
        source = TABLE["sources"][ref["source"]]
        assert len(source["commit"]) == 40 and "/" in source["repo"], name
        assert ref.get("config") and ref.get("processes"), name


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parity")
    stand_in_datasets(folder)
    return folder


def resolved(root, name, datasets, monkeypatch):
    monkeypatch.chdir(datasets)
    return recipe_mod.load(root / "recipes" / f"{name}.yaml").data


@pytest.mark.parametrize("name", sorted(TABLE["recipes"]))
def test_recipe_reproduces_its_reference(name, root, datasets, monkeypatch):
    rows, problems = parity.compare(name, resolved(root, name, datasets, monkeypatch), TABLE)
    assert problems == []
    assert all(row.status != parity.STATUS_DIFFERENT for row in rows)
    assert sum(row.status == parity.STATUS_SAME for row in rows) >= 30


def test_an_unlisted_difference_is_a_problem(root, datasets, monkeypatch):
    data = resolved(root, "sd35m-ocr", datasets, monkeypatch)
    data["model"]["max_sequence_length"] = 256
    data["train"]["iterations"] = 100000  # the listed deviation no longer differs: stale
    _, problems = parity.compare("sd35m-ocr", data, TABLE)
    assert any("text_length" in p and "128" in p and "256" in p for p in problems)
    assert any("iterations" in p and "listed as a deviation" in p for p in problems)
    data["model"]["lora"]["target_modules"] = list(reversed(data["model"]["lora"]["target_modules"]))  # order is free
    assert not any("lora_targets" in p for p in parity.compare("sd35m-ocr", data, TABLE)[1])


def test_a_key_the_recipe_lacks_needs_a_reason(root, datasets, monkeypatch):
    """A deterministic sampler has no eta and NFT no clip range: rows n/a, with the table's reason;
    AWM's SA-Solver noise is a deviation with recipe null; any other missing key is a problem."""
    data = resolved(root, "sd35m-nft-ocr", datasets, monkeypatch)
    rows, problems = parity.compare("sd35m-nft-ocr", data, TABLE)
    by = {r.name: r for r in rows}
    assert problems == [] and by["eta"].status == parity.STATUS_UNUSED and by["eta"].recipe is None
    assert by["clip_range"].status == parity.STATUS_UNUSED
    awm = {
        r.name: r
        for r in parity.compare(
            "sd35m-awm-geneval", resolved(root, "sd35m-awm-geneval", datasets, monkeypatch), TABLE
        )[0]
    }
    assert awm["eta"].status == parity.STATUS_DEVIATION and "SA-Solver" in awm["eta"].note
    del data["objective"]["adv_mode"]
    assert any(
        "adv_mode" in p and "has no objective.adv_mode" in p for p in parity.compare("sd35m-nft-ocr", data, TABLE)[1]
    )


def test_validate_against_reference_prints_the_table(root, datasets, monkeypatch, capsys):
    monkeypatch.chdir(datasets)
    recipe = str(root / "recipes" / "wan-ocr.yaml")
    assert cli.main(["validate", recipe, "--against-reference"]) == 0
    printed = capsys.readouterr().out
    assert "general_ocr_wan2_1" in printed and "879042cf5707" in printed
    assert "wan-sde" in printed and "train_wan2_1.py:959" in printed and "intended" in printed
    assert cli.main(["validate", recipe, "--against-reference", "--set", "objective.kl_form=flow_grpo"]) == 1
    assert "the reference has 'mean'" in capsys.readouterr().err
    assert cli.main(["validate", recipe, "--against-reference", "no-such-entry"]) == 2
    assert "entries:" in capsys.readouterr().err


def test_hunyuan_video_draws_unirls_sde_steps(root, datasets, monkeypatch):
    """HunyuanVideo 1.5's recipe, built, draws at every iteration the SDE steps UniRL's
    AllSDEScheduler draws from the reference config's own numbers (16 steps, timestep_fraction
    [0.0, 0.6], num_sde_steps 8: yaml:155,175-176), the same for every sample, Euler elsewhere."""
    from fgrpo.samplers.sparse import SparseSampler
    from test_sparse_sampler import unirl_sde_indices

    data = resolved(root, "hunyuan-video-1.5-pickscore", datasets, monkeypatch)
    spec = dict(data["sampler"])
    assert spec.pop("name") == "sparse"
    sampler = SparseSampler(**spec)
    for it in range(200):
        sampler.advance(it)
        assert sampler.state_dict()["drawn"] == unirl_sde_indices(16, (0.0, 0.6), 8, it), f"iteration {it}"
    plan = sampler.program(torch.linspace(1.0, 0.0, 17), None)
    assert [step.kernel.stochastic for step in plan.steps] == [i in plan.info["drawn"] for i in range(16)]


# --- the recipes' models on tiny pipelines ------------------------------------------------------


def tiny_pipeline(backbone: str):
    from fgrpo.models import testing

    if backbone == "sd3":
        return testing.build_tiny_sd3_pipeline(sd35=True)  # SD3.5's dual attention in block 0: attn2
    if backbone == "wan":
        from diffusers import UniPCMultistepScheduler

        pipe = testing.build_tiny_wan_pipeline()
        pipe.scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
        return pipe  # Wan 2.1's released scheduler
    return {
        "flux": testing.build_tiny_flux_pipeline,
        "qwen-image": testing.build_tiny_qwen_image_pipeline,
        "flux-kontext": testing.build_tiny_flux_kontext_pipeline,
        "qwen-image-edit": testing.build_tiny_qwen_image_edit_pipeline,
    }[backbone]()


#: one recipe per distinct model section (the sd35m-* recipes share theirs, as the qwen-image-* do)
MODEL_RECIPES = [
    "sd35m-ocr",
    "flux-pickscore",
    "flux-pref-grpo",
    "qwen-image-pickscore",
    "wan-ocr",
    "flux-kontext-counting-edit",
    "qwen-image-edit-counting-edit",
]
SMALL = {
    "sd3": {"resolution": 64},
    "flux": {"resolution": 64},
    "qwen-image": {"resolution": 64},
    "wan": {"resolution": 32, "num_frames": 5},
    "flux-kontext": {"resolution": 64},
    "qwen-image-edit": {"resolution": 64, "source_resolution": [64, 64]},
}


def sample_prompt(policy):
    """A prompt the policy takes: an editing backbone's carries a source image."""
    from fgrpo.core.media import Prompt
    from fgrpo.core.testing import SyntheticImage

    text = "a sign that says fgrpo"
    return (
        Prompt(text, images=(SyntheticImage(0, 48, 32),)) if getattr(policy, "source_image_count", (0, 0))[0] else text
    )


def test_the_model_recipes_cover_every_model_section(root):
    """Every flow_grpo recipe's model section is built below (and Pref-GRPO's FLUX one). The Flow-Factory
    and UniRL recipes' backbones (FLUX.2, Z-Image, Wan 2.2, HunyuanVideo 1.5) are checked against their
    pipelines by their conformance classes (packages/fgrpo-models/tests), their LoRA rank, alpha, init
    and targets by the table."""

    def section(name):
        return yaml.safe_dump(yaml.safe_load((root / "recipes" / f"{name}.yaml").read_text())["model"], sort_keys=True)

    flow_grpo = [n for n, e in TABLE["recipes"].items() if e["reference"]["source"] == "flow_grpo"]
    pref_grpo = [n for n, e in TABLE["recipes"].items() if e["reference"]["source"] == "pref_grpo"]
    assert {section(n) for n in flow_grpo + pref_grpo} == {section(n) for n in MODEL_RECIPES}


@pytest.fixture(scope="module", params=MODEL_RECIPES)
def built(request, root):
    """(recipe name, resolved model spec, the table's values, the policy on a tiny pipeline)."""
    pytest.importorskip("diffusers")
    name = request.param
    spec = yaml.safe_load((root / "recipes" / f"{name}.yaml").read_text())["model"]
    backbone = spec.pop("name")
    spec.pop("path")
    checked, errors = registry.check_spec("model", {"name": backbone, "path": "x", **spec})
    assert errors == []
    cls = registry.load("model", backbone)
    keys = {**spec, **SMALL[backbone], "device": "cpu", "text_encoder_device": None}
    policy = cls.from_pipeline(tiny_pipeline(backbone), **keys)
    return name, checked, TABLE["recipes"][name]["values"], policy


def reference_adapter(backbone: str, values):
    """The reference's LoraConfig applied with peft to the same tiny transformer."""
    from peft import LoraConfig, get_peft_model

    transformer = tiny_pipeline(backbone).transformer
    config = LoraConfig(
        r=values["lora_rank"]["value"],
        lora_alpha=values["lora_alpha"]["value"],
        init_lora_weights=LORA_INITS[values["lora_init"]["value"]],
        target_modules=values["lora_targets"]["value"],
    )
    return get_peft_model(transformer, config).base_model.model


def adapted(module) -> dict[str, int]:
    """Adapted module name -> LoRA parameter count."""
    from peft.tuners.lora import LoraLayer

    return {
        name.removeprefix("base_model.model."): sum(p.numel() for n, p in m.named_parameters() if "lora_" in n)
        for name, m in module.named_modules()
        if isinstance(m, LoraLayer)
    }


def test_lora_is_placed_and_initialised_as_the_references(built):
    """Issue 21, items 3 and 4: the same modules (exact names: not SD3.5's attn2, not Wan's
    feed-forward) with the same parameter count, and A drawn N(0, 1/r) as peft's gaussian init, or
    (Pref-GRPO's init_lora_weights=True) uniform in +-1/sqrt(fan_in) as peft's default (kaiming_uniform_
    with a = sqrt(5)), std 1/sqrt(3 fan_in)."""
    name, checked, values, policy = built
    ours, theirs = adapted(policy.transformer), adapted(reference_adapter(checked["name"], values))
    assert ours == theirs, name
    if checked["name"] == "sd3":
        assert not any(".attn2." in n for n in ours) and any(
            ".attn2." in n for n, _ in policy.transformer.named_modules()
        )
    rank = values["lora_rank"]["value"]
    named = dict(policy.transformer.named_parameters())
    b = torch.cat([p.detach().flatten() for n, p in named.items() if "lora_B" in n])
    assert torch.count_nonzero(b) == 0  # starts as the base model
    if values["lora_init"]["value"] == "gaussian":
        a = torch.cat([p.detach().flatten() for n, p in named.items() if "lora_A" in n])
        assert math.isclose(float(a.std()), 1 / rank, rel_tol=0.1) and abs(float(a.mean())) < 0.2 / rank
        return
    assert values["lora_init"]["value"] == "default", name
    by_fan_in: dict[int, list[torch.Tensor]] = {}
    for n, p in named.items():
        if "lora_A" in n:
            by_fan_in.setdefault(p.shape[1], []).append(p.detach().flatten())
    for fan_in, parts in by_fan_in.items():
        a, bound = torch.cat(parts), 1 / math.sqrt(fan_in)
        assert float(a.abs().max()) <= bound and math.isclose(float(a.std()), bound / math.sqrt(3), rel_tol=0.1)


def test_text_is_encoded_to_the_references_length(built):
    """Item 6: SD3 and FLUX pad T5 to 128 tokens (SD3: after CLIP's 77), Wan to 512, Qwen-Image to 512."""
    name, checked, values, policy = built
    width = policy.encode([sample_prompt(policy)])["prompt_embeds"].shape[1]
    deviation = (TABLE["recipes"][name].get("deviations") or {}).get("text_length")
    length = (
        deviation["recipe"] if deviation else values["text_length"]["value"]
    )  # Qwen-Image-Edit: room for its image tokens
    assert width == (77 + length if checked["name"] == "sd3" else length), name


def test_weights_are_in_the_references_dtypes(built):
    """Item 8: transformer, VAE and text encoders each in the reference's dtype."""
    name, _, values, policy = built
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    assert policy.transformer.dtype == dtypes[values["dtype"]["value"]], name
    assert policy.pipeline.vae.dtype == dtypes[values["vae_dtype"]["value"]], name
    assert {m.dtype for m in policy.text_encoders()} == {dtypes[values["text_encoder_dtype"]["value"]]}, name


@pytest.mark.parametrize("built", ["wan-ocr"], indirect=True)
@torch.no_grad()
def test_wan_kernel_schedule_and_timesteps_are_flow_grpos(built, root, datasets, monkeypatch):
    """Items 1 and 11 through wan-ocr.yaml: its kernel's std is g sqrt(-dt) with g = sigmas[1] * sigma
    (wan_pipeline_with_logprob.py:47-51), on diffusers 0.33.1's UniPC grid, and the transformer sees
    that scheduler's int64 timesteps."""
    name, _, _, policy = built
    import numpy as np

    spec = resolved(root, name, datasets, monkeypatch)["sampler"]
    sampler = registry.create("sampler", spec["name"], **{k: v for k, v in spec.items() if k != "name"})
    sigmas = policy.sigmas(20)
    alphas = np.linspace(1, 1 / 1000, 21)
    grid = np.flip(3 * (1 - alphas) / (1 + 2 * (1 - alphas)))[:-1].copy()
    torch.testing.assert_close(sigmas[:-1], torch.from_numpy(grid).float(), rtol=0, atol=0)
    x = torch.zeros(20, 3)
    std = sampler.kernel.step(x, x, sigmas, torch.arange(20), noise=x).std.flatten()
    torch.testing.assert_close(std, sigmas[1] * sigmas[:-1] * torch.sqrt(sigmas[:-1] - sigmas[1:]), rtol=1e-6, atol=0)
    seen = []
    policy.transformer.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    cond = policy.encode(["a"])
    policy.velocity(policy.initial_noise(1), sigmas[2].expand(1), cond)
    assert float(seen[-1][0]) == float((grid[2] * 1000).astype(np.int64)) == 963.0
