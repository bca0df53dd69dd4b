"""The vector policy: the Policy protocol, reproducible bases, LoRA/full references, state dicts."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.config import RecipeError
from fgrpo.core.protocols import Policy
from fgrpo.core.testing import PolicyConformance
from fgrpo.core.vectors import target_vectors
from fgrpo.models.vector import VectorPolicy, base_samples

PROMPTS = ["target 0.5 -1.0", "target -1 1", "a cat"]


def make(**params) -> VectorPolicy:
    return registry.create("model", "vector", **params)


def probe(policy: VectorPolicy, n: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, policy.dim, generator=gen)
    sigma = torch.rand(n, generator=gen)
    cond = policy.encode([PROMPTS[i % len(PROMPTS)] for i in range(n)])
    return x, sigma, cond


def perturb(policy: VectorPolicy, seed: int = 1, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))


def test_registered_and_satisfies_the_protocol():
    policy = make()
    assert isinstance(policy, VectorPolicy)
    assert isinstance(policy, Policy)
    assert policy.device == torch.device("cpu")
    assert policy.evaluations_per_call == 1
    assert policy.cond_dim == policy.dim == 2


def test_shapes_and_dtypes():
    policy = make(dim=3)
    prompts = ["target 1 2 3", "hello"]
    cond = policy.encode(prompts)
    assert cond.shape == (2, 3) and cond.dtype == torch.float32
    torch.testing.assert_close(cond[0], torch.tensor([1.0, 2.0, 3.0]))
    noise = policy.initial_noise(5, torch.Generator().manual_seed(0))
    assert noise.shape == (5, 3) and noise.dtype == torch.float32
    torch.testing.assert_close(noise, policy.initial_noise(5, torch.Generator().manual_seed(0)))
    v = policy.velocity(noise[:2], torch.tensor([1.0, 0.5]), cond)
    assert v.shape == (2, 3) and v.dtype == torch.float32 and torch.isfinite(v).all()
    torch.testing.assert_close(
        policy.velocity(noise[:2], torch.tensor(0.5), cond), policy.velocity(noise[:2], torch.tensor([0.5, 0.5]), cond)
    )
    assert policy.decode(noise) is not None and torch.equal(policy.decode(noise), noise)
    assert policy.encode([]).shape == (0, 3)


def test_sigmas_are_the_shifted_linear_schedule():
    policy = make(shift=3.0)
    sigmas = policy.sigmas(10)
    assert sigmas.shape == (11,) and sigmas.dtype == torch.float32
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert (sigmas[1:] < sigmas[:-1]).all()
    t = 0.5
    assert math.isclose(float(policy.sigmas(2)[1]), 3 * t / (1 + 2 * t), rel_tol=1e-6)
    torch.testing.assert_close(make(shift=1.0).sigmas(4), torch.linspace(1, 0, 5))
    with pytest.raises(ValueError):
        policy.sigmas(0)


def test_conditioning_starts_with_the_reward_target():
    policy = make(cond_dim=5)
    cond = policy.encode(PROMPTS)
    assert cond.shape == (3, 5)
    torch.testing.assert_close(cond[:, :2], target_vectors(PROMPTS, 2))
    assert (cond[:, 2:].abs() <= 1).all()
    unconditional = make(cond_dim=0)
    x, sigma, _ = probe(unconditional, 3)
    c = unconditional.encode(PROMPTS)
    assert c.shape == (3, 0)
    assert unconditional.velocity(x, sigma, c).shape == (3, 2)


def test_bad_target_in_prompt_is_a_clear_error():
    with pytest.raises(ValueError, match="names a target of 1 numbers"):
        make().encode(["target 0.5"])


def test_base_is_reproducible_from_init():
    x, sigma, cond = probe(make())
    torch.testing.assert_close(make(init=3).velocity(x, sigma, cond), make(init=3).velocity(x, sigma, cond))
    assert not torch.allclose(make(init=3).velocity(x, sigma, cond), make(init=4).velocity(x, sigma, cond))
    # building a policy does not consume the global random stream
    torch.manual_seed(0)
    a = torch.rand(1)
    torch.manual_seed(0)
    make(init=7, lora={"rank": 2})
    assert torch.equal(a, torch.rand(1))


def test_reference_disables_a_changed_lora_adapter():
    policy = make(lora={"rank": 4})
    x, sigma, cond = probe(policy)
    base = policy.velocity(x, sigma, cond).detach()
    names = [n for n, _ in policy.net.named_parameters() if _.requires_grad]
    assert names and all("lora_" in n for n in names)
    perturb(policy)
    adapted = policy.velocity(x, sigma, cond).detach()
    assert not torch.allclose(adapted, base, atol=1e-4)
    with policy.reference():
        torch.testing.assert_close(policy.velocity(x, sigma, cond), base)
        with policy.reference():  # nesting keeps the reference until the outermost exit
            torch.testing.assert_close(policy.velocity(x, sigma, cond), base)
        torch.testing.assert_close(policy.velocity(x, sigma, cond), base)
    torch.testing.assert_close(policy.velocity(x, sigma, cond), adapted)
    assert all(p.requires_grad for p in policy.trainable_parameters())


def test_reference_is_the_base_under_full_fine_tuning():
    policy = make()
    x, sigma, cond = probe(policy)
    base = policy.velocity(x, sigma, cond).detach()
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.5)
    policy.velocity(x, sigma, cond).pow(2).sum().backward()
    optimizer.step()
    assert not torch.allclose(policy.velocity(x, sigma, cond), base, atol=1e-4)
    with policy.reference():
        torch.testing.assert_close(policy.velocity(x, sigma, cond), base)


def test_gradients_reach_only_the_trainable_parameters():
    policy = make(lora={"rank": 2})
    x, sigma, cond = probe(policy)
    policy.velocity(x, sigma, cond).sum().backward()
    trainable = {id(p) for p in policy.trainable_parameters()}
    for name, p in policy.net.named_parameters():
        if id(p) in trainable:
            assert p.grad is not None, name
        else:
            assert p.grad is None, name


@pytest.mark.parametrize("rank", [0, 3])
def test_trainable_state_dict_round_trip(rank):
    policy = make(lora={"rank": rank}, init=5)
    perturb(policy)
    state = policy.trainable_state_dict()
    assert set(state) == {n for n, p in policy.net.named_parameters() if p.requires_grad}
    fresh = make(lora={"rank": rank}, init=5)
    x, sigma, cond = probe(policy)
    assert not torch.allclose(fresh.velocity(x, sigma, cond), policy.velocity(x, sigma, cond))
    fresh.load_trainable_state_dict(state)
    torch.testing.assert_close(fresh.velocity(x, sigma, cond), policy.velocity(x, sigma, cond))
    with fresh.reference(), policy.reference():  # the reference is untouched by the load
        torch.testing.assert_close(fresh.velocity(x, sigma, cond), policy.velocity(x, sigma, cond))
    with pytest.raises(ValueError, match="missing"):
        fresh.load_trainable_state_dict({})
    with pytest.raises(ValueError, match="unexpected"):
        make(lora={"rank": 1 if rank == 0 else 0}).load_trainable_state_dict(state)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rank", [0, 2])
def test_dtype_option(dtype, rank):
    low = make(dtype=dtype, lora={"rank": rank})
    ref = make(lora={"rank": rank})
    assert all(p.dtype == getattr(torch, dtype) for n, p in low.net.named_parameters() if "lora_" not in n)
    x, sigma, cond = probe(low)
    v = low.velocity(x, sigma, cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    torch.testing.assert_close(v, ref.velocity(x, sigma, cond), atol=0.1, rtol=0.1)
    v.sum().backward()
    assert all(p.grad is not None for p in low.trainable_parameters())


def test_bad_keys_are_reported_together():
    with pytest.raises(RecipeError) as info:
        make(dtype="float64", time_dim=7, hidden=0)
    text = str(info.value)
    assert "model.dtype" in text and "model.time_dim" in text and "model.hidden" in text


def test_base_weights_file_round_trip(tmp_path):
    policy = make(init=11, lora={"rank": 2})
    file = tmp_path / "base.safetensors"
    policy.save_base(file)
    loaded = make(init=0, path=str(file))
    x, sigma, cond = probe(policy)
    with policy.reference():
        torch.testing.assert_close(loaded.velocity(x, sigma, cond), policy.velocity(x, sigma, cond))
    with pytest.raises(registry.ComponentError, match="model.path"):
        make(hidden=8, path=str(file))
    with pytest.raises(registry.ComponentError, match="no such file"):
        make(path=str(tmp_path / "missing.safetensors"))


def test_twenty_flow_matching_steps_reduce_the_loss():
    policy = make(init=1)
    gen = torch.Generator().manual_seed(0)
    prompts = ["target 1 1", "target -1 0.5", "target 0 -1", "target 0.3 0.3"] * 16
    cond = policy.encode(prompts)
    x0 = target_vectors(prompts, 2)
    optimizer = torch.optim.Adam(policy.trainable_parameters(), lr=1e-2)

    def loss_at(step_gen):
        eps = torch.randn(x0.shape, generator=step_gen)
        sigma = torch.rand(len(prompts), generator=step_gen)
        xt = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps
        return (policy.velocity(xt, sigma, cond) - (eps - x0)).pow(2).mean()

    before = loss_at(torch.Generator().manual_seed(99)).item()
    for _ in range(20):
        loss = loss_at(gen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = loss_at(torch.Generator().manual_seed(99)).item()
    assert after < 0.7 * before


def test_pretrained_base_samples_its_modes():
    policy = make(pretrain_steps=300, init=0)
    steps = 20
    sigmas = policy.sigmas(steps)
    x = policy.initial_noise(256, torch.Generator().manual_seed(0))
    cond = policy.encode(["target 1 1"] * 128 + ["a cat"] * 128)
    with torch.no_grad():
        for i in range(steps):  # Euler ODE, sigma 1 -> 0
            x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigmas[i].expand(len(x)), cond)
    modes = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    data = base_samples("modes", 256, 2, torch.Generator().manual_seed(0))
    assert torch.cdist(data, modes).min(dim=1).values.median() < 0.2
    nearest = torch.cdist(x, modes).min(dim=1).values
    assert nearest.median() < 0.3
    noise = policy.initial_noise(256, torch.Generator().manual_seed(0))
    assert torch.cdist(noise, modes).min(dim=1).values.median() > nearest.median() + 0.2


def test_grpo_on_target_distance_learns_in_a_few_iterations():
    """Self-contained Flow-GRPO (the DESIGN's SDE kernel, one gradient step per iteration).

    Guards the property the trainer's end-to-end test relies on: the vector policy and the
    target-distance reward learn within 30 iterations of 8 prompts x 8 samples x 10 steps.
    """
    torch.manual_seed(0)
    policy = make()
    reward = registry.create("reward", "target-distance")
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=3e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(0)
    points = torch.rand(8, 2, generator=torch.Generator().manual_seed(1)) * 2 - 1
    prompts = [f"target {a:.2f} {b:.2f}" for a, b in points.tolist() for _ in range(8)]
    sigmas, eta = policy.sigmas(10), 0.7

    def step(v, x, i, prev=None):
        s, s_next = sigmas[i], sigmas[i + 1]
        dt = s_next - s
        g = eta * torch.sqrt(s / (1 - (sigmas[1] if s >= 1 else s)))
        mean = x * (1 + g**2 / (2 * s) * dt) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
        std = g * torch.sqrt(-dt)
        if prev is None:
            prev = mean + std * torch.randn(x.shape, generator=gen)
        log_prob = (-((prev - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(1)
        return prev, log_prob

    cond = policy.encode(prompts)
    history = []
    for _ in range(30):
        with torch.no_grad():
            x = policy.initial_noise(len(prompts), gen)
            states, actions, old = [], [], []
            for i in range(10):
                nxt, lp = step(policy.velocity(x, sigmas[i].expand(len(x)), cond), x, i)
                states.append(x), actions.append(nxt), old.append(lp)
                x = nxt
        r = reward(policy.decode(x), prompts, [{}] * len(prompts)).scores.view(8, 8)
        history.append(r.mean().item())
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-4)).flatten()
        optimizer.zero_grad()
        for i in range(10):
            _, lp = step(policy.velocity(states[i], sigmas[i].expand(len(x)), cond), states[i], i, actions[i])
            (-(adv * torch.exp(lp - old[i])).mean() / 10).backward()
        optimizer.step()
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert last > first + 0.3, history


class TestVectorConformance(PolicyConformance):
    model_name = "vector"
    model_params = {"lora": {"rank": 4}, "pretrain_steps": 50}
    prompts = ("target 1 1", "target -1 0.5")
    reward = {"name": "target-distance"}
    outputs_in_unit_range = False  # the outputs are the vectors themselves


class TestVectorFullFineTuningConformance(TestVectorConformance):
    model_params = {"lora": None}  # the frozen copy of the base is the reference
