"""The shapes world's pretraining (``python -m fgrpo.worlds.shapes.pretrain``) and its probes
(``python -m fgrpo.worlds.shapes.relation_probe``), whose figures the closing notes quote."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
from fgrpo.worlds import shapes as world  # noqa: E402
from fgrpo.worlds.shapes import pretrain, pretrain_losses, relation_probe  # noqa: E402
from fgrpo.worlds.shapes.network import Architecture, ShapesNetwork, vocabulary_of  # noqa: E402
from fgrpo.worlds.shapes.scenes import relation_scenes  # noqa: E402
from fgrpo.worlds.shapes.world import ITEMS  # noqa: E402


def test_relation_probe_reads_objects_and_relation_separately():
    probe = relation_probe
    _, test = world.split(0, 16)
    position = [p for p in test if world.parse_prompt(p).category == "position"]
    rng = np.random.default_rng(0)
    scenes = [world.place(p, rng) for p in position]
    assert probe.rates(world.render_batch(scenes), position) == (1.0, 1.0)

    swapped = [world.perturb(s, p, rng, kind="position") for s, p in zip(scenes, position, strict=True)]
    assert probe.rates(world.render_batch(swapped), position) == (1.0, 0.0)  # right objects, wrong place

    recoloured = [world.perturb(s, p, rng, kind="color") for s, p in zip(scenes, position, strict=True)]
    objects, relation = probe.rates(world.render_batch(recoloured), position)
    assert objects == 0.0 and math.isnan(relation)  # no image has the objects: nothing to condition on

    mixed = scenes[:4] + swapped[4:8]
    assert probe.rates(world.render_batch(mixed), position[:8]) == (1.0, 0.5)


def test_relation_outcomes_per_image():
    probe = relation_probe
    _, test = world.split(0, 16)
    position = [p for p in test if world.parse_prompt(p).category == "position"][:6]
    rng = np.random.default_rng(1)
    scenes = [world.place(p, rng) for p in position]
    swapped = [world.perturb(s, p, rng, kind="position") for s, p in zip(scenes, position, strict=True)]
    recoloured = [world.perturb(s, p, rng, kind="color") for s, p in zip(scenes, position, strict=True)]
    images = world.render_batch(scenes[:2] + swapped[2:4] + recoloured[4:])
    assert probe.outcomes(images, position) == [1, 1, 0, 0, None, None]
    single = [p for p in test if world.parse_prompt(p).category == "single"][:1]
    assert probe.outcomes(world.render_batch([world.place(single[0], rng)]), single) == [1]


def test_relation_probe_loads_a_checkpoint_with_its_runs_lora_targets(tmp_path):
    """A run whose LoRA also covers the feed-forwards: the probe takes the shape from the recipe in
    the checkpoint's state.json (with --rank/--alpha alone the adapter lacks those modules and
    loading fails)."""
    import argparse

    from safetensors.torch import save_file

    from fgrpo.worlds.shapes.model import ShapesDiT

    probe = relation_probe
    lora = {"rank": 4, "alpha": 8, "target_modules": ["attn.to_q", "ff.net.2"]}
    trained = ShapesDiT(device="cpu", lora=lora)
    state = {k: torch.randn_like(v) for k, v in trained.trainable_state_dict().items()}
    assert any(".ff.net.2." in k for k in state)
    last = tmp_path / "run" / "checkpoints" / "last"
    last.mkdir(parents=True)
    save_file(state, str(last / "trainable.safetensors"))
    (last / "state.json").write_text(
        json.dumps({"iteration": 200, "recipe": {"model": {"name": "shapes-dit", "lora": lora}}})
    )
    args = argparse.Namespace(checkpoints=[str(last)], weights=None, rank=32, alpha=64)

    assert probe.lora_of(str(last), args) == lora
    assert probe.lora_of(str(tmp_path), args) == {"rank": 32, "alpha": 64}  # no state.json
    assert probe.lora_of(None, args) == {"rank": 32, "alpha": 64}  # the base
    (label, _), (_, policy) = probe.policies(args)
    assert label == "base"
    loaded = policy.trainable_state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_text_probe_compares_opposite_relations():
    probe = relation_probe
    prompts = [
        "a red square to the left of a blue circle",
        "a red square to the right of a blue circle",
        "a blue circle to the left of a red square",
        "a red square above a blue circle",
    ]
    codes = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0], [0.0, 1.0]])

    def encode(batch):  # one row per prompt; pooled is twice the tokens
        rows = codes[[prompts.index(q) for q in batch]]
        return {"prompt_embeds": rows[:, None, :], "pooled_prompt_embeds": 2 * rows}

    found = probe.text_distances(encode, prompts, pairs=8)
    assert found["relation word flipped"] == pytest.approx(
        (5.0, 10.0)
    )  # left<->right both ways; "above" has no "below"
    assert found["objects swapped"] == pytest.approx((10.0, 20.0))
    assert set(found) == {"relation word flipped", "objects swapped", "random pair"}
    assert probe.opposites(prompts[3]) == {
        "relation word flipped": "a red square below a blue circle",
        "objects swapped": "a blue circle above a red square",
    }


def test_marginal_probe_knows_the_conditional_mean_exactly():
    probe = relation_probe
    prompt = "a red square to the left of a blue circle"
    scenes = probe.relation_scenes(prompt)
    assert len(scenes) == 27 and len(set(scenes)) == 27  # 3 rows x 3 rows x 3 column pairs a < b
    assert all(world.satisfies(s, world.parse_prompt(prompt)) for s in scenes)
    with pytest.raises(ValueError, match="not a position prompt"):
        relation_scenes("two red circles")

    mean, variance = probe.conditional_moments(prompt)
    drawn = world.render_batch([world.place(prompt, np.random.default_rng(i)) for i in range(3000)]).double() * 2 - 1
    assert (drawn.mean(0) - mean).abs().max() < 0.06  # the data's uniform draw, by Monte Carlo
    assert variance == pytest.approx((drawn - mean).pow(2).mean().item(), rel=0.02)

    flipped, _ = probe.conditional_moments("a red square to the right of a blue circle")
    assert probe.relation_coefficient(mean, prompt) == pytest.approx(0.5)
    assert probe.relation_coefficient(flipped, prompt) == pytest.approx(-0.5)
    assert probe.relation_coefficient((mean + flipped) / 2, prompt) == pytest.approx(0.0, abs=1e-12)

    exact = world.render_batch(scenes).double() * 2 - 1  # worth, from its definition
    blind, knowing = ((exact - (mean + flipped) / 2).pow(2).mean(), (exact - mean).pow(2).mean())
    assert probe.relation_worth(prompt) == pytest.approx(((blind - knowing) / blind).item())


def test_words_probe_tells_meaning_from_a_bag_of_words():
    probe = relation_probe
    assert world.same_words_other_meaning("a red square to the left of a blue circle") == {
        "same meaning": "a blue circle to the right of a red square",
        "same words": "a blue circle to the left of a red square",
    }
    assert world.same_words_other_meaning("a green triangle and a yellow square") == {
        "same meaning": "a yellow square and a green triangle",
        "same words": "a yellow triangle and a green square",
    }
    with pytest.raises(ValueError, match="only position and color_attr"):
        world.same_words_other_meaning("three red circles")

    _, test = world.split(0, 16)
    prompts = [p for p in test if world.parse_prompt(p).category in ("position", "color_attr")]
    rng = np.random.default_rng(0)
    for p in prompts:  # Q draws P's scenes, R has P's words and draws none of them
        other = world.same_words_other_meaning(p)
        assert sorted(other["same words"].split()) == sorted(p.split())
        scene = world.place(p, rng)
        assert world.satisfies(scene, world.parse_prompt(other["same meaning"]))
        assert not world.satisfies(scene, world.parse_prompt(other["same words"]))

    def offset(key: str) -> torch.Tensor:
        return torch.randn(3, 24, 24, generator=torch.Generator().manual_seed(hash(key) % 2**31))

    def predictor(key):
        return lambda x, sigma, batch: x + torch.stack([offset(key(q)) for q in batch])

    def meaning(q):
        spec = world.parse_prompt(q)
        if spec.category == "color_attr":
            return repr(sorted(spec.objects))
        if spec.relation in ("right", "below"):  # "A right of B" is "B left of A"
            return repr((spec.objects[::-1], {"right": "left", "below": "above"}[spec.relation]))
        return repr((spec.objects, spec.relation))

    bag = probe.meaning_index(predictor(lambda q: " ".join(sorted(q.split()))), prompts, 0.7)
    reads = probe.meaning_index(predictor(meaning), prompts, 0.7)
    order = probe.meaning_index(predictor(lambda q: q), prompts, 0.7)
    assert bag[1] == 0.0 and bag[2] == 0.0
    assert reads[0] == 0.0 and reads[2] == 1.0
    assert order[0] > 0 and 0.4 < order[2] < 0.6  # every prompt a different output: neither


def test_other_arrangements_are_every_other_scene_of_the_two_objects():
    prompt = "a red square to the left of a blue circle"
    others = world.other_arrangements(prompt)
    assert others == [
        "a red square to the right of a blue circle",
        "a red square above a blue circle",
        "a red square below a blue circle",
        "a blue circle to the left of a red square",
        "a blue circle above a red square",
        "a blue circle below a red square",
    ]  # "a blue circle to the right of a red square" is P's scene in other words: not a negative
    rng = np.random.default_rng(0)
    scene = world.place(prompt, rng)
    assert not any(world.satisfies(scene, world.parse_prompt(q)) for q in others)
    # the six denote the three other scenes twice each: one wording keeps the order, one swaps it
    assert len({world.parse_prompt(q).key() for q in others}) == 3
    with pytest.raises(ValueError, match="only position prompts"):
        world.other_arrangements("a green triangle and a yellow square")

    binding = "a green triangle and a yellow square"
    assert pretrain_losses.hard_negatives(prompt, "rebinding") == ["a blue circle to the left of a red square"]
    assert pretrain_losses.hard_negatives(prompt, "arrangements") == others
    assert pretrain_losses.hard_negatives(binding, "arrangements") == ["a yellow triangle and a green square"]
    assert pretrain_losses.hard_negatives("three red circles", "arrangements") == []


def test_meaning_head_targets_are_the_scene_not_the_words():
    head = pretrain_losses.MeaningHead(32)
    p = "a red square to the left of a blue circle"
    target = head.target(p)
    assert target.shape == (sum(head.sizes),) and target.sum() == 4  # two items at count 1, two pair relations
    other = world.same_words_other_meaning(p)
    assert torch.equal(head.target(other["same meaning"]), target)
    assert not torch.equal(head.target(other["same words"]), target)
    assert all(not torch.equal(head.target(q), target) for q in world.other_arrangements(p))
    b = "a green triangle and a yellow square"
    assert torch.equal(head.target("a yellow square and a green triangle"), head.target(b))
    assert not torch.equal(head.target("a yellow triangle and a green square"), head.target(b))
    assert not torch.equal(head.target("three red circles"), head.target("two red circles"))
    # hand-indexed: item (colour, shape) k at count c is k * 4 + c's position in (1, 2, 3, 4)
    three = head.target("three red circles")
    assert three.nonzero().flatten().tolist() == [ITEMS.index(("red", "circle")) * 4 + 2]

    network = ShapesNetwork(
        Architecture(
            vocab=vocabulary_of(world.all_prompts()),
            hidden=48,
            layers=1,
            heads=1,
            text_width=32,
            text_layers=1,
            text_heads=1,
            max_words=12,
        )
    )
    loss = head(network, [p, "", b], network.encode([p, "", b])["pooled_prompt_embeds"])
    logits = head.head(network.text(network.token_ids([p, b]))[1])
    naive = (
        sum(
            -(t * torch.log(torch.sigmoid(x)) + (1 - t) * torch.log(1 - torch.sigmoid(x))).sum()
            for x, t in zip(logits, [target, head.target(b)], strict=True)
        )
        / 2
    )
    assert loss.item() == pytest.approx(naive.item(), rel=1e-5)
    loss.backward()
    assert network.text.embed.weight.grad.abs().sum() > 0 and network.transformer.proj_out.weight.grad is None


def test_layout_target_is_the_exact_posterior_mean_over_the_captions_scenes():
    """--layout's target, against a naive Bayes over the 27 scenes of "A left of B" in float64:
    at sigma 1 the mean of the scenes (the image says nothing), at low noise the drawn scene."""
    caption = "a red square to the left of a blue circle"
    scenes = pretrain_losses.LayoutDenoiser(0).renders(caption)
    spec = world.parse_prompt(caption)
    every = relation_scenes(caption)
    assert len(scenes) == 27 and len(set(every)) == 27 and all(world.satisfies(s, spec) for s in every)
    assert torch.equal(scenes, world.render_batch(every) * 2 - 1)
    g = torch.Generator().manual_seed(0)
    for sigma in (1.0, 0.9, 0.7, 0.5, 0.05):
        x = (1 - sigma) * scenes[5] + sigma * torch.randn(scenes[5].shape, generator=g)
        d = scenes.double()
        density = torch.stack(
            [torch.distributions.Normal((1 - sigma) * s, sigma).log_prob(x.double()).sum() for s in d]
        )
        naive = (torch.softmax(density, 0)[:, None, None, None] * d).sum(0)
        torch.testing.assert_close(pretrain_losses.posterior_mean(x, scenes, sigma).double(), naive, rtol=0, atol=1e-4)
    torch.testing.assert_close(pretrain_losses.posterior_mean(x, scenes, 1.0), scenes.mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(pretrain_losses.posterior_mean(x, scenes, 0.05), scenes[5], rtol=0, atol=1e-6)
    # the red square is left of the blue circle in the mean: its column 0 redder than column 2
    mean = scenes.mean(0)
    red_minus_blue = (mean[0] - mean[2]).reshape(24, 3, 8).mean((0, 2))
    assert red_minus_blue[0] > 0.2 and red_minus_blue[2] < -0.1


def test_layout_loss_reaches_the_transformer_for_position_captions_only():
    from fgrpo.worlds.shapes.network import Architecture, ShapesNetwork, default_vocabulary

    torch.manual_seed(0)
    network = ShapesNetwork(Architecture(vocab=default_vocabulary(), hidden=32, layers=1, heads=2, text_width=32))
    layout = pretrain_losses.LayoutDenoiser(0)
    pooled = torch.zeros(2, 32)
    none = layout(network, ["two red circles", ""], pooled)
    assert none.item() == 0 and not layout.scenes
    loss = layout(network, ["a red square to the left of a blue circle", "two red circles"], pooled)
    loss.backward()
    assert loss.item() > 0 and list(layout.scenes) == ["a red square to the left of a blue circle"]
    assert network.transformer.pos_embed.proj.weight.grad.abs().sum() > 0
    assert network.text.embed.weight.grad.abs().sum() > 0


def test_plan_loss_is_the_plans_distance_to_the_mean_scene_of_position_captions_only():
    from fgrpo.worlds.shapes.network import Architecture, ShapesNetwork, default_vocabulary

    torch.manual_seed(0)
    network = ShapesNetwork(
        Architecture(vocab=default_vocabulary(), hidden=32, layers=1, heads=2, text_width=32, layout_plan=16)
    )
    loss_of = pretrain_losses.PlanLoss(pretrain_losses.LayoutDenoiser(0))
    prompts = ["two red circles", "a red square to the left of a blue circle", "", "a blue circle above a red square"]
    pooled = network.encode(prompts)["pooled_prompt_embeds"]
    assert loss_of(network, ["two red circles", ""], pooled[:2]).item() == 0
    loss = loss_of(network, prompts, pooled)
    plans = network.transformer.pos_embed.plan(pooled)
    means = [world.render_batch(relation_scenes(prompts[i])).mul(2).sub(1).mean(0) for i in (1, 3)]
    naive = sum((plans[i] - m).pow(2).mean() for i, m in zip((1, 3), means, strict=True)) / 2
    assert loss.item() == pytest.approx(naive.item(), rel=1e-5)
    loss.backward()
    assert network.transformer.pos_embed.planner[0].weight.grad.abs().sum() > 0
    assert network.text.embed.weight.grad.abs().sum() > 0  # the text learns to carry the layout
    assert network.transformer.proj_out.weight.grad is None
    for flag in ("--plan", "--plan-steps"):
        with pytest.raises(SystemExit, match="--plan and --plan-steps need --layout-plan"):
            pretrain.main(["--layout-plan", "0", flag, "1", "--steps", "0"])


def test_plan_steps_train_the_text_and_the_planner_alone(capsys):
    from fgrpo.worlds.shapes.network import Architecture, ShapesNetwork, default_vocabulary

    torch.manual_seed(0)
    network = ShapesNetwork(
        Architecture(vocab=default_vocabulary(), hidden=32, layers=1, heads=2, text_width=32, layout_plan=16)
    )
    before = {k: v.clone() for k, v in network.state_dict().items()}
    train, _ = world.split(0, 16)
    loss_of = pretrain_losses.PlanLoss(pretrain_losses.LayoutDenoiser(0))
    held = [q for q in train if world.parse_prompt(q).relation is not None][:32]
    with torch.no_grad():
        start = loss_of(network, held, network.encode(held)["pooled_prompt_embeds"]).item()
    args = pretrain.parse_args(["--plan-steps", "60", "--plan-batch", "16", "--plan-lr", "3e-3"])
    assert pretrain_losses.pretrain_planner(network, train, loss_of, args) > 0
    with torch.no_grad():
        end = loss_of(network, held, network.encode(held)["pooled_prompt_embeds"]).item()
    assert end < start / 5, (start, end)
    moved = {k for k, v in network.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and all(k.startswith(("text.", "transformer.pos_embed.planner.")) for k in moved)
    assert any(k.startswith("text.") for k in moved)
    assert "plan step    60 loss" in capsys.readouterr().out


def test_contrastive_flow_negatives_are_renders_of_the_other_meaning():
    train, _ = world.split(0, 16)
    data = pretrain.PairSampler(train, seed=0, caption_noise=0.4, prompt_dropout=0.0)
    prompts = [
        "a red square to the left of a blue circle",
        "",
        "three red circles",
        "a green triangle and a yellow square",
    ]
    images, mask = data.rebound(prompts)
    assert mask.tolist() == [True, False, False, True]
    assert torch.equal(images[1:3], -torch.ones(2, 3, 24, 24))  # black: nothing drawn where no rebinding
    rebindings = [world.same_words_other_meaning(q)["same words"] for q in (prompts[0], prompts[3])]
    scores = world.evaluate((images[mask] + 1) / 2, rebindings)["accuracy"]
    assert scores.tolist() == [1.0, 1.0]  # clean renders of the rebinding, never caption noise
    first = data.batch(8)[0]
    again = pretrain.PairSampler(train, seed=0, caption_noise=0.4, prompt_dropout=0.0).batch(8)[0]
    assert first == again  # its own generator: the batches do not change


def test_binding_probe_reads_parts_and_binding_separately():
    probe = relation_probe
    prompt = "a green triangle and a yellow square"
    right = (world.Placed("green", "triangle", 0, 0), world.Placed("yellow", "square", 2, 2))
    rebound = (world.Placed("yellow", "triangle", 0, 0), world.Placed("green", "square", 2, 2))
    wrong = (world.Placed("red", "triangle", 0, 0), world.Placed("yellow", "square", 2, 2))
    images = world.render_batch([right, rebound, rebound, wrong])
    assert probe.binding_rates(images, [prompt] * 4) == (0.75, pytest.approx(1 / 3))
    parts, bound = probe.binding_rates(world.render_batch([wrong]), [prompt])
    assert parts == 0.0 and math.isnan(bound)


def test_contrastive_loss_is_info_nce_with_negative_captions():
    g = torch.Generator().manual_seed(0)
    images, texts, scale = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g), torch.tensor(7.0)
    unit = [v / v.norm() for v in images], [t / t.norm() for t in texts]
    naive = 0.0
    for i in range(3):  # image i against all 5 texts; text i against the 3 images
        row = torch.stack([scale * unit[0][i] @ t for t in unit[1]])
        column = torch.stack([scale * v @ unit[1][i] for v in unit[0]])
        naive += (torch.logsumexp(row, 0) - row[i]) / 6 + (torch.logsumexp(column, 0) - column[i]) / 6
    assert pretrain_losses.symmetric_info_nce(images, texts, scale).item() == pytest.approx(naive.item(), rel=1e-6)


def test_pretraining_with_the_contrastive_loss_trains_and_records_it(tmp_path):
    out = tmp_path / "base.safetensors"
    args = ["--hidden", "48", "--heads", "1", "--layers", "1", "--text-width", "32", "--steps", "3", "--batch", "16"]
    args += ["--eval-every", "0", "--eval-samples", "1", "--eval-steps", "1", "--threads", "1", "--out", str(out)]
    assert pretrain.main([*args, "--contrastive", "0.05", "--meaning", "0"]) == 0
    from fgrpo.worlds.shapes.network import load_network, read_metadata

    assert json.loads(read_metadata(out)["trained_with"])["contrastive"] == 0.05
    with_contrast = load_network(out).text.embed.weight.clone()
    assert pretrain.main([*args, "--contrastive", "0", "--meaning", "0"]) == 0  # the defaults have both
    plain = load_network(out).text.embed.weight.clone()
    plain_output_layer = load_network(out).transformer.proj_out.weight.clone()
    assert not torch.equal(plain, with_contrast)  # it reached the text encoder
    assert (
        pretrain.main([*args, "--meaning", "0.01", "--contrastive", "0.05", "--contrastive-negatives", "arrangements"])
        == 0
    )
    recorded = json.loads(read_metadata(out)["trained_with"])
    assert (recorded["meaning"], recorded["contrastive_negatives"]) == (0.01, "arrangements")
    both = load_network(out).text.embed.weight
    assert not torch.equal(both, plain) and not torch.equal(both, with_contrast)
    assert pretrain.main([*args, "--contrastive-flow", "0.2"]) == 0
    assert json.loads(read_metadata(out)["trained_with"])["contrastive_flow"] == 0.2
    assert not torch.equal(
        load_network(out).transformer.proj_out.weight, plain_output_layer
    )  # it reached the transformer

    module = pretrain_losses.CaptionContrast(32, 3 * 24 * 24, seed=0)
    network = load_network(out)
    prompts = ["a green triangle and a yellow square", "", "three red circles"]
    loss = module(network, prompts, network.encode(prompts)["pooled_prompt_embeds"])
    loss.backward()
    assert loss.item() > 0 and network.text.embed.weight.grad is not None
    assert network.transformer.pos_embed.proj.weight.grad is None  # only the text encoder and its own weights
