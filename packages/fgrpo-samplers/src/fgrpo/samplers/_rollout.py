"""The group-rollout machinery shared by the ``full``, ``fast`` and ``mixgrpo`` samplers.

A sampler only decides *which kernel runs each step* and *which steps are trained*; it describes
that as a program (a list of :class:`Step`) plus a (B, S) table of trained step indices, and
:func:`run` does the rest, identically for all three:

- the prompts are encoded ONCE (batch = number of prompts, P) and the conditioning is repeated
  ``group_size`` (G) times with ``repeat_interleave``, so the G samples of a prompt are adjacent;
- the initial noise is drawn per sample (B = P x G draws) or, with ``share_noise``, per prompt and
  repeated, so the G samples of a group start from the same noise (flow_grpo Fast, DanceGRPO and
  MixGRPO do this);
- with a shared noise, the first ``prefix`` steps (which must be deterministic and untrained) run
  once per prompt at batch P; the latents branch into G samples (``repeat_interleave``) when the
  first step at or after ``prefix`` begins. Every other step runs at batch B;
- stochastic steps get their Gaussian noise from ``generator`` here (drawn in float32, in step
  order, at batch B) and pass it to the kernel as ``noise=``, so two rollouts with equally seeded
  generators are identical whether or not the prefix was shared;
- the state before, the action after, the log-prob, mean and std of every trained step are
  recorded into a :class:`~fgrpo.core.protocols.Trajectory`;
- NFE is counted honestly: every ``policy.velocity`` call on ``n`` rows costs
  ``n * policy.evaluations_per_call`` network evaluations (a shared prefix step costs P rows, not
  B). ``trajectory.nfe`` is the total, ``info["nfe"]`` the split by phase.

Everything runs under ``torch.no_grad()`` in float32 latents (the policy casts to its own dtype).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fgrpo.core import seeding, tensors
from fgrpo.core.protocols import Kernel, Policy, Trajectory
from fgrpo.samplers.schedules import Schedule, check_sigmas


@attrs.frozen
class Step:
    """One network evaluation and one transition ``sigmas[index] -> sigmas[index + 1]``."""

    kernel: Kernel
    sigmas: torch.Tensor
    index: int
    phase: str  # NFE bookkeeping: "prefix", "window", "suffix", "flash", "sde", ...


FINALS = ("sample", "x0", "ode")  #: what a rollout may return as its final sample (see :func:`run`)


# --- schedules, randomness ---------------------------------------------------------------------


def main_sigmas(policy: Policy, steps: int, schedule: Mapping[str, Any] | None) -> torch.Tensor:
    """The sampling schedule: ``policy.sigmas(steps)`` or the configured ``Schedule``."""
    sigmas = policy.sigmas(steps) if schedule is None else Schedule(**dict(schedule))(steps)
    sigmas = check_sigmas(torch.as_tensor(sigmas).to(device=policy.device, dtype=torch.float32))
    if sigmas.shape != (steps + 1,):
        raise ValueError(f"sigmas: expected steps + 1 = {steps + 1} values, got {sigmas.shape[0]}")
    return sigmas


def _generator_device(generator: torch.Generator | None, fallback: torch.device) -> torch.device:
    return generator.device if generator is not None else torch.device(fallback)


def randint(low: int, high: int, generator: torch.Generator | None) -> int:
    """One integer uniformly in [low, high), drawn from ``generator``."""
    device = _generator_device(generator, torch.device("cpu"))
    return int(torch.randint(low, high, (1,), generator=generator, device=device).item())


def step_stds(kernel: Kernel, sigmas: torch.Tensor, indices: Sequence[int]) -> dict[int, float]:
    """The std the kernel uses at each step, probed on a 1-element dummy state (no network).

    The std of every shipped kernel depends on the schedule only; the probe is how samplers know,
    before sampling, which steps have std 0 (e.g. ``cps`` stepping to sigma' = 0) and must never be
    trained.
    """
    zero = torch.zeros(1, 1, device=sigmas.device, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for i in indices:
            std = kernel.step(zero, zero, sigmas, int(i), noise=zero).std
            out[int(i)] = float(torch.as_tensor(std).reshape(-1)[0])
    return out


def trainable(kernel: Kernel, sigmas: torch.Tensor, indices: Sequence[int]) -> list[int]:
    """``indices`` without the steps where ``kernel`` has std 0 (never trained)."""
    stds = step_stds(kernel, sigmas, indices)
    return [i for i in indices if stds[i] > 0.0]


def _per_sample_std(std: torch.Tensor, n: int) -> torch.Tensor:
    std = torch.as_tensor(std, dtype=torch.float32)
    if std.numel() == 1:
        return std.reshape(1).expand(n)
    return std.reshape(std.shape[0], -1)[:, 0].expand(n)


# --- the rollout -------------------------------------------------------------------------------


def run(
    policy: Policy,
    prompts: Sequence[str],
    group_size: int,
    *,
    program: Sequence[Step],
    sigmas: torch.Tensor,
    trained: torch.Tensor,
    share_noise: bool,
    prefix: int = 0,
    generator: torch.Generator | None = None,
    phases: Sequence[str] = (),
    info: dict[str, Any] | None = None,
    final: str = "sample",
    kl_kernel: Kernel | None = None,
    policy_weight: torch.Tensor | None = None,
) -> Trajectory:
    """Run ``program`` for ``group_size`` samples of each prompt and record the ``trained`` steps.

    ``trained`` is a (B, S) long tensor of program positions (which are also indices into
    ``sigmas``: trained steps always belong to the main schedule, which the program follows up to
    its last trained step). ``prefix`` steps are computed once per prompt (needs ``share_noise``;
    they must be deterministic and untrained). ``phases`` lists the NFE keys always reported
    (with 0 when a phase is empty this time), so the metrics keep the same keys every iteration.
    ``final``: 'x0' returns the last step's predicted clean sample x - sigma v instead of the state
    after the last step ('sample'; 'ode' too: :func:`with_final` has made that step deterministic).
    ``policy_weight`` (B, S): the policy loss's weight of each recorded step (0: the step is there for
    the KL term only, ``kl_steps: all``); a recorded deterministic step is booked as ``kl_kernel``'s
    step at its state (its mean, std and the log-prob of the deterministic action), so the update
    treats it as any other.
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError("rollout needs at least one prompt")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n_prompts, group = len(prompts), int(group_size)
    batch = n_prompts * group
    trained = torch.as_tensor(trained, dtype=torch.long)
    if trained.dim() != 2 or trained.shape[0] != batch or trained.shape[1] < 1:
        raise ValueError(f"trained steps must be (B={batch}, S>=1), got {tuple(trained.shape)}")
    if prefix and not share_noise:
        raise ValueError("a shared prefix needs a shared initial noise")
    for position in range(prefix):
        if program[position].kernel.stochastic:
            raise ValueError(f"step {position} of the shared prefix is stochastic")
    if final not in FINALS:
        raise ValueError(f"final must be one of {FINALS}, got {final!r}")
    if bool((trained < prefix).any()) or bool((trained >= len(program)).any()):
        raise ValueError("trained steps must lie after the shared prefix and inside the program")

    device = torch.device(policy.device)
    epc = int(policy.evaluations_per_call)
    n_trained = trained.shape[1]
    # slot[b, p] = j when step p is the j-th trained step of sample b, else -1
    slot = torch.full((batch, len(program)), -1, dtype=torch.long)
    slot[torch.arange(batch)[:, None], trained] = torch.arange(n_trained).expand(batch, n_trained)

    with torch.no_grad():
        cond_p = policy.encode(prompts)
        cond_b = tensors.repeat_interleave(cond_p, group) if group > 1 else cond_p
        if share_noise:
            x = torch.as_tensor(policy.initial_noise(n_prompts, generator=generator))
        else:
            x = torch.as_tensor(policy.initial_noise(batch, generator=generator))
        x = x.to(device=device, dtype=torch.float32)
        if x.shape[0] != batch and prefix == 0:
            x = x.repeat_interleave(group, dim=0)
        shape = tuple(x.shape[1:])

        latents = torch.empty((batch, n_trained, *shape), dtype=torch.float32, device=device)
        next_latents = torch.empty_like(latents)
        means = torch.empty_like(latents)
        log_probs = torch.empty((batch, n_trained), dtype=torch.float32, device=device)
        stds = torch.empty((batch, n_trained), dtype=torch.float32, device=device)
        filled = torch.zeros((batch, n_trained), dtype=torch.bool)

        nfe: dict[str, int] = dict.fromkeys(phases, 0)
        calls = 0
        previous: Kernel | None = None
        for position, step in enumerate(program):
            if position >= prefix and x.shape[0] != batch:
                x = x.repeat_interleave(group, dim=0)  # branch: one trajectory per sample
            rows = x.shape[0]
            cond = cond_b if rows == batch else cond_p
            if step.kernel is not previous and hasattr(step.kernel, "reset"):
                step.kernel.reset()  # multistep kernels start a fresh history for each run
            previous = step.kernel

            sigma = step.sigmas[step.index].to(device=device, dtype=torch.float32).reshape(1).repeat(rows)
            velocity = policy.velocity(x, sigma, cond)
            calls += 1
            nfe[step.phase] = nfe.get(step.phase, 0) + rows * epc

            noise = seeding.randn(x.shape, generator, device) if step.kernel.stochastic else None
            out = step.kernel.step(velocity, x, step.sigmas, step.index, noise=noise)
            if final == "x0" and position == len(program) - 1:
                predicted_x0 = x - sigma.reshape(-1, *([1] * (x.dim() - 1))) * velocity.to(torch.float32)

            column = slot[:, position]
            record = column >= 0
            if bool(record.any()) and not step.kernel.stochastic:
                if kl_kernel is None:
                    raise RuntimeError(f"step {position} is deterministic and recorded without a kernel to book it (a sampler bug)")
                out = kl_kernel.step(velocity, x, step.sigmas, step.index, prev_sample=out.prev_sample)
            if bool(record.any()):
                which = record.nonzero().squeeze(1)
                cols = column[which]
                filled[which, cols] = True
                which, cols = which.to(device), cols.to(device)
                latents[which, cols] = x[which]
                next_latents[which, cols] = out.prev_sample.float()[which]
                means[which, cols] = out.mean.float()[which]
                log_probs[which, cols] = out.log_prob.float()[which]
                stds[which, cols] = _per_sample_std(out.std, rows).to(device)[which]
            x = out.prev_sample.to(torch.float32)

    if not bool(filled.all()):
        raise RuntimeError("some trained steps were never sampled (a sampler bug)")
    if bool((stds <= 0).any()):
        raise RuntimeError("a trained step has std 0; such steps must never be trained (a sampler bug)")

    total = sum(nfe.values())
    details = {
        "nfe": dict(nfe),
        "nfe_per_sample": total / batch,
        "calls": calls,
        "evaluations_per_call": epc,
        "phases": [step.phase for step in program],
        "shared_prefix_steps": prefix,
    }
    details.update(info or {})
    details["final"] = final
    return Trajectory(
        prompts=[p for p in prompts for _ in range(group)],
        group_index=torch.arange(n_prompts, device=device).repeat_interleave(group),
        cond=cond_b,
        sigmas=sigmas,
        step_index=trained.to(device),
        latents=latents,
        next_latents=next_latents,
        log_probs=log_probs,
        means=means,
        stds=stds,
        final=predicted_x0 if final == "x0" else x,
        nfe=total,
        info=details,
        policy_weight=None if policy_weight is None else torch.as_tensor(policy_weight, dtype=torch.float32).to(device),
    )
