"""flux-pref-grpo.yaml's step and loss against Pref-GRPO's own code (CodeGoat24/Pref-GRPO at 3e787f6),
transcribed below line by line: the SDE step its FLUX script runs (--grpo_step_mode flow:
fastvideo/grpo/steps.py:12-56, on train_flux.py:413-415's shift-3 schedule) is fgrpo's ``sde`` kernel,
and its RatioNorm loss (--rationorm: train_flux.py:729-756, one sample per forward) is the
``grpo-guard`` objective, gradients included."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.objectives import GRPOGuard
from fgrpo.core.protocols import StepBatch


def reference_sigmas(steps: int = 25, shift: float = 3.0) -> torch.Tensor:
    """train_flux.py:413-415: sd3_time_shift(shift, torch.linspace(1, 0, steps + 1)), float32."""
    t = torch.linspace(1, 0, steps + 1)
    return (shift * t) / (1 + (shift - 1) * t)


def flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample):
    """fastvideo/grpo/steps.py:12-56 with prev_sample given and return_stats=True."""
    sigma = sigmas[index]
    sigma_prev = sigmas[index + 1]
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    pred_original_sample = latents - sigma * model_output
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    prev_sample_mean = (
        latents * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    noise_scale = std_dev_t * torch.sqrt(-1 * dt)
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * (noise_scale**2))
        - torch.log(noise_scale)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, pred_original_sample, log_prob, prev_sample_mean, noise_scale, dt


def rationorm_loss(new_log_probs, old_log_probs, prev_sample_mean, old_prev_sample_mean, noise_scale, dt, adv):
    """train_flux.py:723-756 for one sample (its (1,) tensors), clip 1e-4, advantages clipped at 5."""
    advantages = torch.clamp(adv, -5.0, 5.0)
    dt_f = dt.to(torch.float32)
    sqrt_dt = torch.sqrt(torch.clamp(torch.abs(dt_f), min=1e-20))
    sigma_t = (noise_scale.to(torch.float32) / sqrt_dt).mean()
    diff_sq = (prev_sample_mean.to(torch.float32) - old_prev_sample_mean.to(torch.float32)) ** 2
    reduce_dims = tuple(range(1, diff_sq.ndim))
    ratio_mean_bias = diff_sq.mean(dim=reduce_dims)
    scale = sqrt_dt.mean() * sigma_t
    scale = torch.clamp(scale, min=1e-20)
    ratio_mean_bias = ratio_mean_bias / (2.0 * (scale**2))
    ratio = torch.exp((new_log_probs - old_log_probs + ratio_mean_bias) * scale)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - 1e-4, 1.0 + 1e-4)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    return policy_loss / (sqrt_dt.mean() ** 2)


INDICES = [0, 1, 7, 13, 22, 23]  # sigma == 1 (the sigma_max branch), the middle, the last trained step


@pytest.mark.parametrize("index", INDICES)
def test_the_sde_kernel_is_pref_grpos_flow_grpo_step(index):
    g = torch.Generator().manual_seed(index)
    sigmas = reference_sigmas()
    x, v = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    kernel = registry.create("kernel", "sde", eta=0.7)
    drawn = kernel.step(v, x, sigmas, index, generator=g)
    _, _, log_prob, mean, noise_scale, _ = flow_grpo_step(v, x, 0.7, sigmas, index, drawn.prev_sample)
    torch.testing.assert_close(drawn.mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(drawn.std.reshape(-1)[0], noise_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(drawn.log_prob, log_prob, rtol=1e-5, atol=1e-5)


def test_grpo_guard_is_pref_grpos_rationorm_loss():
    """Six samples at six different steps (the random subset), each its own forward in the reference
    (batch 1): fgrpo's minibatch mean over them equals the mean of the reference's per-sample losses,
    and so do the gradients with respect to the new velocities. The velocities moved by 1e-3 to 1 so
    that some ratios leave [1 - 1e-4, 1 + 1e-4] (the clip binds) and some stay inside."""
    g = torch.Generator().manual_seed(0)
    sigmas = reference_sigmas()
    kernel = registry.create("kernel", "sde", eta=0.7)
    b = len(INDICES)
    index = torch.tensor(INDICES)
    x, v_old = torch.randn(b, 16, 8, 8, generator=g), torch.randn(b, 16, 8, 8, generator=g)
    old = kernel.step(v_old, x, sigmas, index, generator=g)
    moved = torch.tensor([1e-3, 1.0, 1e-3, 1.0, 1e-2, 1.0]).reshape(b, 1, 1, 1)
    delta = moved * torch.randn(b, 16, 8, 8, generator=g)
    adv = torch.tensor([1.3, -0.7, 6.0, -2.2, 0.4, -5.5])  # two beyond the clip at 5

    v_ours = (v_old + delta).requires_grad_(True)
    new = kernel.step(v_ours, x, sigmas, index, prev_sample=old.prev_sample)
    std, dt = new.std.reshape(b), sigmas[index + 1] - sigmas[index]
    batch = StepBatch(new.log_prob, old.log_prob, adv, new.mean, old.mean, std, dt)
    ours = GRPOGuard(clip_range=1e-4, adv_clip=5.0)(batch)
    ours.loss.backward()

    v_ref = (v_old + delta).requires_grad_(True)
    losses, inside = [], []
    for i, step in enumerate(INDICES):
        rows = slice(i, i + 1)
        _, _, old_lp, old_mean, _, _ = flow_grpo_step(v_old[rows], x[rows], 0.7, sigmas, step, old.prev_sample[rows])
        _, _, new_lp, new_mean, scale, step_dt = flow_grpo_step(
            v_ref[rows], x[rows], 0.7, sigmas, step, old.prev_sample[rows]
        )
        losses.append(rationorm_loss(new_lp, old_lp, new_mean, old_mean, scale, step_dt, adv[rows]))
        ratio = torch.exp((new_lp - old_lp + ((new_mean - old_mean) ** 2).mean() / (2 * scale**2)) * scale)
        inside.append(abs(float(ratio.detach()) - 1) < 1e-4)
    reference = torch.stack(losses).mean()  # gradient accumulation: the mean over the samples (:810)
    reference.backward()
    assert 0 < sum(inside) < b  # both branches of the clip are exercised
    torch.testing.assert_close(ours.loss, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_ours.grad, v_ref.grad, rtol=1e-4, atol=1e-9)
    assert v_ours.grad.abs().max() > 0


@pytest.mark.slow
def test_the_recipe_trains_an_iteration_on_a_tiny_flux(root, tmp_path, monkeypatch):
    """flux-pref-grpo.yaml as shipped, on a tiny random FLUX at 64 px with stand-in rewards (the judge
    and CLIP need weights): its sampler, objective and advantages compose, each sample trains
    int(24 x 0.6) = 14 steps of 0..23, and the 2 prompts x 8 samples make 2 optimizer steps."""
    pytest.importorskip("diffusers")
    from fgrpo.core import cli
    from fgrpo.core.runlog import read_metrics
    from fgrpo.models.testing import build_tiny_flux_pipeline
    from fgrpo.samplers.full import FullSampler
    from test_real_recipes import stand_in_datasets

    build_tiny_flux_pipeline(tmp_path / "tiny")
    stand_in_datasets(tmp_path)
    monkeypatch.chdir(tmp_path)
    seen = []
    original = FullSampler.trained_steps

    def spy(self, candidates, batch, generator):
        steps = original(self, candidates, batch, generator)
        seen.append(steps)
        return steps

    monkeypatch.setattr(FullSampler, "trained_steps", spy)
    out = tmp_path / "run"
    args = ["compose", str(root / "recipes" / "flux-pref-grpo.yaml"), "--out", str(out), "--quiet"]
    for item in (
        f"model.path={tmp_path / 'tiny'}",
        "model.resolution=64",
        "model.max_sequence_length=16",
        "model.lora={rank: 4, alpha: 8, init: default}",
        "model.text_encoder_device=null",
        "reward=[{name: pairwise, weight: 0.4, judge: {name: brightness}}, {name: jpeg-compressibility, weight: 0.6}]",
        "train.iterations=1",
        "train.prompts_per_iteration=2",
        "train.minibatch_size=8",
        "train.mixed_precision=no",
        "eval.every=0",
    ):
        args += ["--set", item]
    assert cli.main(args) == 0
    trained = torch.cat(seen)  # one rollout per prompt (train.rollout_prompts 1)
    assert trained.shape == (16, 14) and int(trained.max()) <= 23
    assert len({tuple(row) for row in trained.tolist()}) > 1  # drawn per sample
    [row] = [r for r in read_metrics(out) if "optimizer_steps" in r]
    assert row["optimizer_steps"] == 2
