"""The group-rollout machinery shared by the ``full``, ``fast`` and ``mixgrpo`` samplers.

A sampler only decides *which kernel runs each step* and *which steps are trained*; it describes
that as a :class:`Plan` (the program, a list of :class:`Step`, plus a (B, S) table of trained step
indices, the schedule and the final sample; :meth:`fgrpo.samplers.base.GroupSampler.rollout`
writes it), and :func:`run` does the rest, identically for all three:

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

from collections.abc import Sequence
from typing import Any, cast

import attrs
import torch

from fgrpo.core import seeding, tensors
from fgrpo.core.protocols import Kernel, Policy, Trajectory


@attrs.frozen
class Step:
    """One network evaluation and one transition ``sigmas[index] -> sigmas[index + 1]``."""

    kernel: Kernel
    sigmas: torch.Tensor
    index: int
    phase: str  # NFE bookkeeping: "prefix", "window", "suffix", "flash", "sde", ...


FINALS = ("sample", "x0", "ode")  #: what a rollout may return as its final sample (see :class:`Plan`)


@attrs.frozen
class Plan:
    """What one rollout runs: the steps in order, how many of them the group shares.

    A sampler's ``program`` writes ``steps`` and optionally ``prefix`` (the first steps computed
    once per prompt: deterministic, untrained; needs ``share_noise``), ``phases`` (the NFE keys
    always reported, with 0 when a phase is empty this time, so the metrics keep the same keys
    every iteration) and ``info`` (logged with the rollout). ``GroupSampler.rollout`` completes
    it: ``sigmas`` (the main schedule), ``trained`` (a (B, S) long tensor of program positions,
    which are also indices into ``sigmas``: trained steps always belong to the main schedule,
    which the program follows up to its last trained step), ``share_noise`` and ``final`` ('x0'
    returns the last step's predicted clean sample x - sigma v instead of the state after the
    last step, 'sample'; 'ode' too: the last step was made deterministic). With ``kl_steps: all``
    also ``policy_weight`` (B, S): the policy loss's weight of each recorded step (0: the step is
    there for the KL term only), and ``kl_kernel``, as whose step a recorded deterministic step is
    booked at its state (its mean, std and the log-prob of the deterministic action), so the
    update treats it as any other.
    """

    steps: list[Step]
    prefix: int = 0
    phases: tuple[str, ...] = ()
    info: dict[str, Any] = attrs.Factory(dict)
    sigmas: torch.Tensor | None = None
    trained: torch.Tensor | None = None
    share_noise: bool = False
    final: str = "sample"
    kl_kernel: Kernel | None = None
    policy_weight: torch.Tensor | None = None

    def check(self, batch: int) -> None:
        """Refuse a plan :func:`run` cannot run for ``batch`` samples (a sampler bug)."""
        trained = self.trained
        if trained is None or trained.dim() != 2 or trained.shape[0] != batch:
            raise ValueError(
                f"trained steps must be (B={batch}, S), got {None if trained is None else tuple(trained.shape)}"
            )
        if trained.shape[1] == 0 and any(step.kernel.stochastic for step in self.steps):
            raise ValueError("a rollout with stochastic steps trains at least one of them")
        if self.prefix and not self.share_noise:
            raise ValueError("a shared prefix needs a shared initial noise")
        for position in range(self.prefix):
            if self.steps[position].kernel.stochastic:
                raise ValueError(f"step {position} of the shared prefix is stochastic")
        if self.final not in FINALS:
            raise ValueError(f"final must be one of {FINALS}, got {self.final!r}")
        if bool((trained < self.prefix).any()) or bool((trained >= len(self.steps)).any()):
            raise ValueError("trained steps must lie after the shared prefix and inside the program")


def _per_sample_std(std: torch.Tensor, n: int) -> torch.Tensor:
    std = torch.as_tensor(std, dtype=torch.float32)
    if std.numel() == 1:
        return std.reshape(1).expand(n)
    return std.reshape(std.shape[0], -1)[:, 0].expand(n)


@attrs.define
class Record:
    """The trained steps of a rollout as they are sampled: (B, S, ...) tensors filled step by step."""

    slot: torch.Tensor  # slot[b, p] = j when program position p is the j-th trained step of sample b, else -1
    latents: torch.Tensor
    next_latents: torch.Tensor
    means: torch.Tensor
    log_probs: torch.Tensor
    stds: torch.Tensor
    filled: torch.Tensor

    @classmethod
    def empty(cls, trained: torch.Tensor, steps: int, shape: tuple[int, ...], device: torch.device) -> Record:
        batch, n_trained = trained.shape
        slot = torch.full((batch, steps), -1, dtype=torch.long)
        slot[torch.arange(batch)[:, None], trained] = torch.arange(n_trained).expand(batch, n_trained)
        latents = torch.empty((batch, n_trained, *shape), dtype=torch.float32, device=device)
        return cls(
            slot=slot,
            latents=latents,
            next_latents=torch.empty_like(latents),
            means=torch.empty_like(latents),
            log_probs=torch.empty((batch, n_trained), dtype=torch.float32, device=device),
            stds=torch.empty((batch, n_trained), dtype=torch.float32, device=device),
            filled=torch.zeros((batch, n_trained), dtype=torch.bool),
        )

    def records(self, position: int) -> bool:
        return bool((self.slot[:, position] >= 0).any())

    def step(self, position: int, x: torch.Tensor, out: Any) -> None:
        """Keep the state before and the outcome of program step ``position`` where it is trained."""
        column = self.slot[:, position]
        record = column >= 0
        if not bool(record.any()):
            return
        which = record.nonzero().squeeze(1)
        cols = column[which]
        self.filled[which, cols] = True
        device = self.latents.device
        which, cols = which.to(device), cols.to(device)
        self.latents[which, cols] = x[which]
        self.next_latents[which, cols] = out.prev_sample.float()[which]
        self.means[which, cols] = out.mean.float()[which]
        self.log_probs[which, cols] = out.log_prob.float()[which]
        self.stds[which, cols] = _per_sample_std(out.std, x.shape[0]).to(device)[which]

    def check(self) -> None:
        if not bool(self.filled.all()):
            raise RuntimeError("some trained steps were never sampled (a sampler bug)")
        if bool((self.stds <= 0).any()):
            raise RuntimeError("a trained step has std 0; such steps must never be trained (a sampler bug)")


# --- the rollout -------------------------------------------------------------------------------


def run(
    policy: Policy, prompts: Sequence[str], group_size: int, plan: Plan, generator: torch.Generator | None = None
) -> Trajectory:
    """Run ``plan`` for ``group_size`` samples of each prompt and record its trained steps (none for
    a deterministic plan: its trajectory then holds only the final samples and their conditioning,
    what the forward-process objectives train on)."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("rollout needs at least one prompt")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    group, batch = int(group_size), len(prompts) * int(group_size)
    if plan.trained is not None:
        plan = attrs.evolve(plan, trained=torch.as_tensor(plan.trained, dtype=torch.long))
    plan.check(batch)
    assert plan.trained is not None  # check() refuses a plan without trained steps
    device = torch.device(policy.device)
    epc = int(policy.evaluations_per_call)

    with torch.no_grad():
        cond_p = policy.encode(prompts)
        cond_b = tensors.repeat_interleave(cond_p, group) if group > 1 else cond_p
        x = torch.as_tensor(policy.initial_noise(len(prompts) if plan.share_noise else batch, generator=generator))
        x = x.to(device=device, dtype=torch.float32)
        if x.shape[0] != batch and plan.prefix == 0:
            x = x.repeat_interleave(group, dim=0)
        record = Record.empty(plan.trained, len(plan.steps), tuple(x.shape[1:]), device)
        nfe: dict[str, int] = dict.fromkeys(plan.phases, 0)
        previous: Kernel | None = None
        for position, step in enumerate(plan.steps):
            if position >= plan.prefix and x.shape[0] != batch:
                x = x.repeat_interleave(group, dim=0)  # branch: one trajectory per sample
            if step.kernel is not previous and hasattr(step.kernel, "reset"):
                step.kernel.reset()  # multistep kernels start a fresh history for each run
            previous = step.kernel
            rows = x.shape[0]
            sigma = step.sigmas[step.index].to(device=device, dtype=torch.float32).reshape(1).repeat(rows)
            velocity = policy.velocity(x, sigma, cond_b if rows == batch else cond_p)
            nfe[step.phase] = nfe.get(step.phase, 0) + rows * epc
            noise = seeding.randn(x.shape, generator, device) if step.kernel.stochastic else None
            out = step.kernel.step(velocity, x, step.sigmas, step.index, noise=noise)
            if plan.final == "x0" and position == len(plan.steps) - 1:
                x0 = x - sigma.reshape(-1, *([1] * (x.dim() - 1))) * velocity.to(torch.float32)
            if not step.kernel.stochastic and record.records(position):
                out = booked(plan, position, velocity, x, out)
            record.step(position, x, out)
            x = out.prev_sample.to(torch.float32)
    record.check()
    return trajectory(prompts, group, plan, cond_b, record, x0 if plan.final == "x0" else x, nfe, epc)


def booked(plan: Plan, position: int, velocity: torch.Tensor, x: torch.Tensor, out: Any) -> Any:
    """A recorded deterministic step (``kl_steps: all``) as ``plan.kl_kernel``'s step to the same
    next state."""
    if plan.kl_kernel is None:
        raise RuntimeError(
            f"step {position} is deterministic and recorded without a kernel to book it (a sampler bug)"
        )
    step = plan.steps[position]
    return plan.kl_kernel.step(velocity, x, step.sigmas, step.index, prev_sample=out.prev_sample)


def trajectory(
    prompts: list[str],
    group: int,
    plan: Plan,
    cond: Any,
    record: Record,
    final: torch.Tensor,
    nfe: dict[str, int],
    epc: int,
) -> Trajectory:
    """The rollout's :class:`Trajectory`: its trained steps, its final samples and its NFE."""
    assert plan.trained is not None  # run() checked the plan
    batch, total = len(prompts) * group, sum(nfe.values())
    device = record.latents.device
    info = {
        "nfe": dict(nfe),
        "nfe_per_sample": total / batch,
        "calls": len(plan.steps),
        "evaluations_per_call": epc,
        "phases": [step.phase for step in plan.steps],
        "shared_prefix_steps": plan.prefix,
        **plan.info,
        "final": plan.final,
    }
    return Trajectory(
        prompts=[p for p in prompts for _ in range(group)],
        group_index=torch.arange(len(prompts), device=device).repeat_interleave(group),
        cond=cond,
        sigmas=cast(torch.Tensor, plan.sigmas),  # the sampler's schedule: set when it completed the Plan
        step_index=plan.trained.to(device),
        latents=record.latents,
        next_latents=record.next_latents,
        log_probs=record.log_probs,
        means=record.means,
        stds=record.stds,
        final=final,
        nfe=total,
        info=info,
        policy_weight=None
        if plan.policy_weight is None
        else torch.as_tensor(plan.policy_weight, dtype=torch.float32).to(device),
    )
