"""The shapes-dit backbone: tiny random networks for the contract, the shipped base for its accuracy."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.core import registry
from fgrpo.core.config import check_params
from fgrpo.core.protocols import Policy
from fgrpo.core.testing import PolicyConformance
from fgrpo.worlds.shapes.model import ShapesDiT
from fgrpo.worlds.shapes.network import (
    Architecture,
    ShapesNetwork,
    default_vocabulary,
    default_weights_path,
    flow_loss,
    load_network,
    read_metadata,
    save_network,
)

PROMPTS = ["a red circle", "two blue squares", "a red square to the left of a green circle"]
TINY = dict(hidden=32, layers=2, heads=2, text_width=32, text_layers=1, text_heads=1)


def tiny_network(seed: int = 0, **arch) -> ShapesNetwork:
    torch.manual_seed(seed)
    net = ShapesNetwork(Architecture(vocab=default_vocabulary(), **{**TINY, **arch}))
    # diffusers zero-initialises the output projection and adaLN gates: randomise every weight so
    # that outputs depend on the inputs and on every block
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.1)
    return net


def make(net: ShapesNetwork | None = None, **keys) -> ShapesDiT:
    keys.setdefault("device", "cpu")
    torch.manual_seed(1)  # LoRA "random" init draws from the global RNG
    return ShapesDiT.from_network(copy.deepcopy(net or tiny_network()), **keys)


def noise(policy, n=3, seed=0):
    return policy.initial_noise(n, torch.Generator().manual_seed(seed))


def test_protocol_and_shapes():
    policy = make()
    assert isinstance(policy, Policy)
    assert policy.device == torch.device("cpu") and policy.evaluations_per_call == 1
    cond = policy.encode(PROMPTS)
    assert set(cond) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert cond["prompt_embeds"].shape == (3, 11, 32) and cond["pooled_prompt_embeds"].shape == (3, 32)
    x = noise(policy)
    assert x.shape == (3, 3, 24, 24) and x.dtype == torch.float32
    sigmas = policy.sigmas(10)
    assert sigmas.shape == (11,) and sigmas[0] == 1 and sigmas[-1] == 0 and torch.all(sigmas[1:] < sigmas[:-1])
    assert torch.all(make(shift=3.0).sigmas(10)[1:-1] > sigmas[1:-1])  # shift > 1 keeps more noise
    with torch.no_grad():
        v = policy.velocity(x, sigmas[0].expand(3), cond)
        assert torch.equal(v, policy.velocity(x, sigmas[0], cond))  # a scalar sigma broadcasts
        assert not torch.allclose(v[0], policy.velocity(x, sigmas[0], policy.encode([PROMPTS[1]] * 3))[0])
    assert v.shape == x.shape and v.dtype == torch.float32
    images = policy.decode(torch.linspace(-2, 2, 3 * 3 * 24 * 24).reshape(3, 3, 24, 24))
    assert images.shape == (3, 3, 24, 24) and images.min() == 0 and images.max() == 1
    assert torch.allclose(policy.decode(torch.zeros(1, 3, 24, 24)), torch.full((1, 3, 24, 24), 0.5))
    # the text encoder is frozen; full fine-tuning trains every transformer weight
    assert {id(p) for p in policy.trainable_parameters()} == {id(p) for p in policy.transformer.parameters()}
    assert not any(p.requires_grad for p in policy.network.text.parameters())


def test_tokenizer_errors_and_the_empty_prompt():
    policy = make()
    with pytest.raises(ValueError, match="purple"):
        policy.encode(["a purple circle"])
    with pytest.raises(ValueError, match="at most 10"):
        policy.encode([" ".join(["a red circle and"] * 4)])
    ids = policy.network.token_ids(["", "A red circle."])
    assert ids[0, 0] == ids[1, 0] and torch.all(ids[0, 1:] == 0) and torch.all(ids[1, 1:4] > 1)


def test_guidance_doubles_the_batch():
    net = tiny_network()
    plain, guided = make(net), make(net, guidance_scale=3.0)
    assert guided.evaluations_per_call == 2
    cond = guided.encode(PROMPTS)
    assert {"negative_prompt_embeds", "negative_pooled_prompt_embeds"} <= set(cond)
    x, s = noise(plain), torch.full((3,), 0.7)
    with torch.no_grad():
        text = plain.velocity(x, s, plain.encode(PROMPTS))
        uncond = plain.velocity(x, s, plain.encode([""] * 3))
        assert torch.allclose(guided.velocity(x, s, cond), uncond + 3.0 * (text - uncond), atol=1e-5)


def test_lora_reference_is_the_base_model():
    net = tiny_network()
    base, adapted = make(net), make(net, lora={"rank": 4, "alpha": 4, "init": "random"})
    x, s = noise(base), torch.full((3,), 0.5)
    with torch.no_grad():
        want = base.velocity(x, s, base.encode(PROMPTS))
        cond = adapted.encode(PROMPTS)
        assert not torch.allclose(adapted.velocity(x, s, cond), want)
        with adapted.reference():
            assert torch.equal(adapted.velocity(x, s, cond), want)
        assert not torch.allclose(adapted.velocity(x, s, cond), want)  # adapters back on
    names = list(adapted.trainable_state_dict())
    assert names and all("lora_" in n for n in names)
    assert all(p.dtype == torch.float32 for p in adapted.trainable_parameters())


def test_full_fine_tuning_reference_is_a_frozen_copy():
    policy = make()
    x, s, cond = noise(policy), torch.full((3,), 0.5), policy.encode(PROMPTS)
    with torch.no_grad():
        before = policy.velocity(x, s, cond)
        for p in policy.trainable_parameters():
            p.add_(0.05)
        assert not torch.allclose(policy.velocity(x, s, cond), before)
        with policy.reference():
            assert torch.equal(policy.velocity(x, s, cond), before)
    with pytest.raises(RuntimeError, match="reference_copy"):
        with make(reference_copy=False).reference():
            pass


@pytest.mark.parametrize("lora", [None, {"rank": 4, "init": "random"}])
def test_trainable_state_dict_round_trip(lora):
    policy = make(lora=lora)
    x, s, cond = noise(policy), torch.full((3,), 0.3), policy.encode(PROMPTS)
    state = policy.trainable_state_dict()
    with torch.no_grad():
        want = policy.velocity(x, s, cond)
        for p in policy.trainable_parameters():
            p.mul_(0.5).add_(0.1)
        assert not torch.allclose(policy.velocity(x, s, cond), want)
        policy.load_trainable_state_dict(state)
        assert torch.equal(policy.velocity(x, s, cond), want)
    with pytest.raises((ValueError, RuntimeError)):
        policy.load_trainable_state_dict({k: v for k, v in list(state.items())[1:]})


def test_weights_file_round_trip_and_architecture_keys(tmp_path):
    net = tiny_network()
    path = tmp_path / "tiny.safetensors"
    save_network(net, path, dtype=torch.float32, extra={"note": "test"})
    meta = read_metadata(path)
    assert meta["note"] == "test" and Architecture.from_json(meta["architecture"]) == net.arch
    policy = ShapesDiT(path=str(path), device="cpu")  # no architecture key: read from the file
    assert (policy.hidden, policy.layers, policy.heads, policy.text_width) == (32, 2, 2, 32)
    x, s = noise(policy), torch.full((3,), 0.6)
    with torch.no_grad():
        assert torch.equal(
            policy.velocity(x, s, policy.encode(PROMPTS)), make(net).velocity(x, s, make(net).encode(PROMPTS))
        )
    ShapesDiT(path=str(path), device="cpu", hidden=32, layers=2)  # agreeing keys are fine
    with pytest.raises(ValueError, match=r"model.hidden: got 64 but the weights have 32"):
        ShapesDiT(path=str(path), device="cpu", hidden=64)
    with pytest.raises(FileNotFoundError, match="model.path"):
        ShapesDiT(path=str(tmp_path / "missing.safetensors"), device="cpu")


def test_position_scale_multiplies_the_sincos_positions_and_the_file_keeps_them(tmp_path):
    plain, scaled = tiny_network(), tiny_network(position_scale=4.0)
    positions = plain.transformer.pos_embed.pos_embed
    assert positions.abs().max() > 0.5
    torch.testing.assert_close(scaled.transformer.pos_embed.pos_embed, 4 * positions, rtol=0, atol=0)
    path = tmp_path / "scaled.safetensors"
    save_network(scaled, path, dtype=torch.float32)
    loaded = load_network(path)
    assert loaded.arch.position_scale == 4.0
    assert torch.equal(loaded.transformer.pos_embed.pos_embed, scaled.transformer.pos_embed.pos_embed)
    with pytest.raises(ValueError, match="position_scale 0"):
        Architecture(vocab=default_vocabulary(), position_scale=0)


def _assert_reads_pooled_per_call_and_survives_the_file(net, args, expected, tmp_path) -> ShapesNetwork:
    """A text-reading patch embedding: called without transformer_output (no pooled text set) it
    refuses; saved and loaded, the network gives ``expected`` again."""
    x, sigma, embeds, pooled = args
    with torch.no_grad(), pytest.raises(RuntimeError, match="transformer_output"):
        net.transformer(hidden_states=x, timestep=sigma * 1e3, encoder_hidden_states=embeds, pooled_projections=pooled)
    path = tmp_path / "net.safetensors"
    save_network(net, path, dtype=torch.float32)
    loaded = load_network(path)
    with torch.no_grad():
        assert torch.equal(loaded(*args), expected)
    return loaded


def test_cell_conditioning_starts_as_the_plain_network_and_reads_the_pooled_text_per_cell(tmp_path):
    plain = tiny_network()
    torch.manual_seed(0)
    cells = ShapesNetwork(Architecture(vocab=default_vocabulary(), **TINY, cell_conditioning=True))
    missing, unexpected = cells.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == [
        "transformer.pos_embed.cell_bias.bias",
        "transformer.pos_embed.cell_bias.weight",
    ]
    x, sigma = torch.randn(2, 3, 24, 24), torch.tensor([0.9, 0.9])
    cond = plain.encode(PROMPTS[2:] + ["a red square to the right of a green circle"])
    args = (x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"])
    with torch.no_grad():
        torch.testing.assert_close(cells(*args), plain(*args), rtol=0, atol=0)  # zero at initialisation
        embed = cells.transformer.pos_embed
        embed.cell_bias.weight.normal_(0, 0.5)
        changed = cells(*args)
        assert embed.pooled is None  # set for the call only
        assert (changed - plain(*args)).abs().amax(dim=(1, 2, 3)).min() > 1e-3
        # the term is per cell: the same pooled vector adds different rows to different cells
        rows = embed.cell_bias(cond["pooled_prompt_embeds"][:1]).reshape(9, -1)
        assert (rows[0] - rows[8]).abs().max() > 1e-3
    _assert_reads_pooled_per_call_and_survives_the_file(cells, args, changed, tmp_path)
    with pytest.raises(ValueError, match="cell_conditioning"):
        Architecture(vocab=default_vocabulary(), source_images=1, cell_conditioning=True)


def test_layout_plan_starts_as_the_plain_network_and_adds_its_embedded_plan_per_cell(tmp_path):
    plain = tiny_network()
    torch.manual_seed(0)
    planned = ShapesNetwork(Architecture(vocab=default_vocabulary(), **TINY, layout_plan=16))
    missing, unexpected = planned.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == [
        "transformer.pos_embed.plan_proj.bias",
        "transformer.pos_embed.plan_proj.weight",
        "transformer.pos_embed.planner.0.bias",
        "transformer.pos_embed.planner.0.weight",
        "transformer.pos_embed.planner.2.bias",
        "transformer.pos_embed.planner.2.weight",
    ]
    x, sigma = torch.randn(2, 3, 24, 24), torch.tensor([0.9, 0.9])
    cond = plain.encode(PROMPTS[2:] + ["a red square to the right of a green circle"])
    args = (x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"])
    embed = planned.transformer.pos_embed
    with torch.no_grad():
        torch.testing.assert_close(planned(*args), plain(*args), rtol=0, atol=0)  # zero at initialisation
        embed.plan_proj.weight.normal_(0, 0.5)
        changed = planned(*args)
        assert embed.pooled is None  # set for the call only
        assert (changed - plain(*args)).abs().amax(dim=(1, 2, 3)).min() > 1e-3
        plan = embed.plan(cond["pooled_prompt_embeds"])
        assert plan.shape == (2, 3, 24, 24)
        # each state token gets the embedding of its own cell of the plan, as proj embeds pixels
        embed.pooled = cond["pooled_prompt_embeds"]
        try:
            with_plan = embed(x)
        finally:
            embed.pooled = None
        by_hand = torch.nn.functional.conv2d(plan, embed.plan_proj.weight, embed.plan_proj.bias, stride=8)
        torch.testing.assert_close(
            with_plan - plain.transformer.pos_embed(x), by_hand.flatten(2).transpose(1, 2), rtol=0, atol=1e-5
        )
    loaded = _assert_reads_pooled_per_call_and_survives_the_file(planned, args, changed, tmp_path)
    assert loaded.arch.layout_plan == 16
    for bad, match in (
        ({"source_images": 1}, "layout_plan is for text-to-image"),
        ({"cell_conditioning": True}, "choose one"),
        ({}, "layout_plan -1"),
    ):
        with pytest.raises(ValueError, match=match):
            Architecture(vocab=default_vocabulary(), layout_plan=-1 if not bad else 8, **bad)


def test_recipe_keys_and_registry():
    _, errors = check_params(ShapesDiT, {"guidance_scale": 0.5, "lora": {"rank": -1}, "hidden": 0, "dtype": "int8"})
    assert {e.key for e in errors} == {"guidance_scale", "lora", "hidden", "dtype"}
    checked, errors = check_params(ShapesDiT, {"lora": {"rank": 8}})
    assert not errors and checked["lora"]["rank"] == 8 and checked["lora"]["alpha"] == 16
    assert check_params(ShapesDiT, {"lora": {"rank": 0}})[0]["lora"] is None
    policy = registry.create(
        "model", "shapes-dit", random_init=True, device="cpu", **{k: TINY[k] for k in ("hidden", "layers", "heads")}
    )
    assert isinstance(policy, ShapesDiT) and (policy.hidden, policy.layers, policy.heads) == (32, 2, 2)
    assert policy.text_width == 128  # an architecture key left out: Architecture's default


def test_flow_matching_loss_decreases_on_a_tiny_config():
    world = pytest.importorskip("fgrpo.worlds.shapes")
    torch.manual_seed(0)
    net = ShapesNetwork(Architecture(vocab=default_vocabulary(), **TINY))
    prompts = [
        "a red circle",
        "two blue squares",
        "a green triangle and a yellow square",
        "a red square above a blue circle",
    ] * 4
    x0 = world.sample_images(prompts, 0) * 2 - 1
    g = torch.Generator().manual_seed(0)
    eps, sigma = torch.randn(x0.shape, generator=g), torch.rand(len(prompts), generator=g)
    xt = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * eps
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        cond = net.encode(prompts)
        loss = flow_loss(
            net(xt, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"]), x0, eps, sigma, net.arch.prediction
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


# --- the shipped base ---------------------------------------------------------------------------


def test_shipped_weights_load_with_their_architecture():
    meta = read_metadata(default_weights_path())
    arch = Architecture.from_json(meta["architecture"])
    assert arch.vocab == default_vocabulary()
    policy = ShapesDiT(device="cpu")
    assert policy.architecture == arch and policy.hidden == arch.hidden
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    assert default_weights_path().endswith("weights/shapes-base.safetensors")


def test_shipped_base_strict_accuracy_is_in_the_target_band():
    """The base RL starts from: imperfect (caption noise, unseen compositions) but far from zero.

    The evaluation ``fgrpo.worlds.shapes.pretrain`` prints: every held-out test prompt of the shapes
    split, 4 samples each, 20 ODE steps, the same noise."""
    world = pytest.importorskip("fgrpo.worlds.shapes")
    from fgrpo.core.evaluation import generate

    policy = ShapesDiT(device="cpu")
    _, test = world.split(0, 16)
    outputs, prompts = [], []
    per_call = 64
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))  # the tool's setting (reproduces its printed 0.435)
    try:
        for start in range(0, len(test), per_call):
            chunk = test[start : start + per_call]
            g = torch.Generator().manual_seed(1000 + start)
            outputs.append(generate(policy, chunk, 4, 20, g))
            prompts += [p for p in chunk for _ in range(4)]
    finally:
        torch.set_num_threads(threads)
    details = world.evaluate(torch.cat(outputs), prompts)
    accuracy = details["accuracy"].mean().item()
    assert 0.30 <= accuracy <= 0.50, accuracy  # issue 25's band: weak at every skill, above chance
    assert accuracy == pytest.approx(
        0.435, abs=0.02
    )  # the tool printed 0.435 for the written file; another CPU may flip a few samples
    assert details["clean_cells"].mean().item() > 0.9  # errors are compositional, not broken glyphs


class TestShapesDiTConformance(PolicyConformance):
    model_name = "shapes-dit"
    model_params = {
        "random_init": True,
        **{k: v for k, v in TINY.items() if k != "text_heads"},
        "lora": {"rank": 4},
        "device": "cpu",
    }
    reward = {"name": "shapes"}


def test_an_editing_networks_source_cells_share_the_states_positions():
    """Kontext-style in-sequence conditioning: the source's cell tokens are embedded as the state's
    (same positions) plus a learned marker, laid out so the output's first 24 columns are the
    state's; the source changes the output of the state's tokens."""
    from fgrpo.worlds.shapes.network import edit_vocabulary

    torch.manual_seed(0)
    network = ShapesNetwork(Architecture(vocab=edit_vocabulary(), source_images=1, **TINY))
    embed = network.transformer.pos_embed
    x, source = torch.randn(2, 3, 24, 24), torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        tokens = embed(torch.cat([x, source], -1)).reshape(2, 3, 6, -1)  # the (3, 6) grid the transformer unpatchifies
        alone = type(embed).__mro__[1].forward(embed, x).reshape(2, 3, 3, -1)  # SD3's own embedding of the state
        as_state = type(embed).__mro__[1].forward(embed, source).reshape(2, 3, 3, -1)
        torch.testing.assert_close(tokens[:, :, :3], alone, rtol=0, atol=0)
        torch.testing.assert_close(tokens[:, :, 3:], as_state + embed.source_marker[0], rtol=0, atol=1e-6)
        cond = network.encode(["add a red circle", "remove the red circle"])
        sigma = torch.tensor([0.5, 0.5])
        out = network(x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"], source)
        other = network(x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"], torch.randn(2, 3, 24, 24))
    assert out.shape == x.shape and (out - other).abs().max() > 1e-4


def _tool_defaults(module: str) -> dict:
    """The settings a pretraining module records in the file it writes when run without arguments."""
    import importlib

    tool = importlib.import_module(module)
    return {k: v for k, v in vars(tool.parse_args([])).items() if k not in ("out", "checkpoint_dir")}


def test_shipped_base_is_what_the_tool_makes():
    """weights/shapes-base.safetensors was written by fgrpo.worlds.shapes.pretrain with its current
    defaults (the tool's docstring has its run: the planner's 2000 steps, then step 1500 of the
    12000-step cosine, 10 min on 2 cores), under 20 MB, with the architecture those defaults name."""
    import json
    import os

    path = default_weights_path()
    assert os.path.getsize(path) < 20e6
    meta = read_metadata(path)
    defaults = _tool_defaults("fgrpo.worlds.shapes.pretrain")
    assert json.loads(meta["trained_with"]) == defaults
    settings = ("contrastive", "meaning", "layout_plan", "plan_steps", "plan", "layout", "steps")
    assert tuple(defaults[k] for k in settings) == (0.05, 0.01, 256, 2000, 1.0, 1.0, 1500)
    assert int(meta["steps"]) == defaults["steps"] and float(meta["plan_seconds"]) > 0
    arch = Architecture.from_json(meta["architecture"])
    assert (arch.hidden, arch.layers, arch.text_layers, arch.layout_plan) == (
        defaults["hidden"],
        defaults["layers"],
        defaults["text_layers"],
        defaults["layout_plan"],
    )


def test_shipped_editing_base_is_what_the_tool_makes():
    """weights/shapes-edit-base.safetensors: an editing network (one source image, the instructions'
    vocabulary), under 20 MB, written by fgrpo.worlds.shapes_edit.pretrain with its current defaults."""
    import json
    import os

    from fgrpo.worlds.shapes_edit.model import EDIT_WEIGHTS_RESOURCE, ShapesEditDiT

    path = default_weights_path(EDIT_WEIGHTS_RESOURCE)
    assert os.path.getsize(path) < 20e6
    meta = read_metadata(path)
    arch = Architecture.from_json(meta["architecture"])
    assert arch.source_images == 1
    defaults = _tool_defaults("fgrpo.worlds.shapes_edit.pretrain")
    assert json.loads(meta["trained_with"]) == defaults
    assert (arch.hidden, arch.layers, arch.heads, arch.text_width) == (
        defaults["hidden"],
        defaults["layers"],
        defaults["heads"],
        defaults["text_width"],
    )
    policy = ShapesEditDiT(device="cpu")
    assert policy.architecture == arch
