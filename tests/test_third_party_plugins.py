"""A kernel, a sampler and an objective written outside fgrpo's packages, as a plugin author writes
them (docs/writing-a-plugin.md shows these), pass the same conformance bases as the built-ins."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.objectives.base import TransitionObjective
from fgrpo.core.protocols import ObjectiveOutput, StepBatch
from fgrpo.core.registry import component
from fgrpo.core.testing import KernelConformance, ObjectiveConformance, SamplerConformance
from fgrpo.samplers.base import EULER, GroupSampler, Plan, Step, final_param, schedule_param
from fgrpo.samplers.kernels.base import KernelBase, StepInputs

# --- a kernel -------------------------------------------------------------------------------------


@attrs.define
class NoisyEulerKernel(KernelBase):
    """The Euler step plus Brownian noise: mu = x + dt v, std = eta sqrt(-dt)."""

    stochastic: ClassVar[bool] = True
    eta: float = param(0.5, ge=0, help="noise level")

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return s.sample + s.dt * s.velocity, self.eta * torch.sqrt(-s.dt)


class TestNoisyEulerKernel(KernelConformance):
    kernel_class = NoisyEulerKernel
    kernel_params = {"eta": 0.3}


def test_noisy_euler_by_hand():
    # sigma 0.6 -> 0.4: dt = -0.2, mu = x - 0.2 v, std = 0.3 sqrt(0.2)
    x, v, noise = torch.tensor([[0.5, -1.0]]), torch.tensor([[-0.2, 0.3]]), torch.tensor([[1.0, -2.0]])
    out = NoisyEulerKernel(eta=0.3).step(v, x, torch.tensor([1.0, 0.6, 0.4, 0.0]), 1, noise=noise)
    std = 0.3 * 0.2**0.5
    torch.testing.assert_close(out.mean, torch.tensor([[0.54, -1.06]]))
    torch.testing.assert_close(out.prev_sample, torch.tensor([[0.54 + std, -1.06 - 2 * std]]))


# --- a sampler ------------------------------------------------------------------------------------


@attrs.define
class LastStepsSampler(GroupSampler):
    """Euler steps, then ``last`` stochastic steps that are trained."""

    steps: int = param(8, ge=1, help="sampling steps")
    last: int = param(2, ge=1, help="stochastic (trained) steps at the end")
    share_noise: bool = param(False, help="the G samples of a prompt start from the same noise")
    schedule: dict | None = schedule_param()
    final: str | None = final_param()
    kernel: Any = component("kernel", default="sde", help="the stochastic kernel of the last steps")

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        first = self.steps - self.last
        euler = [Step(EULER, sigmas, i, "ode") for i in range(first)]
        return Plan(
            euler + [Step(self.kernel, sigmas, i, "sde") for i in range(first, self.steps)], phases=("ode", "sde")
        )


class TestLastStepsSampler(SamplerConformance):
    sampler_class = LastStepsSampler
    sampler_params = {"steps": 6, "last": 2}


class TestLastStepsSamplerWithTheThirdPartyKernel(SamplerConformance):
    sampler_class = LastStepsSampler
    sampler_params = {"steps": 6, "last": 3, "share_noise": True, "kernel": NoisyEulerKernel(eta=0.4)}


# --- an objective ---------------------------------------------------------------------------------


@attrs.frozen
class ReinforceObjective(TransitionObjective):
    """Importance-weighted policy gradient without a clip: loss = mean(-A exp(logp - logp_old)),
    plus kl_beta times the squared distance of the mean to the reference's."""

    kl_beta: float = param(0.0, ge=0, help="weight of the distance to the reference policy's mean")

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    def __call__(self, batch: StepBatch) -> ObjectiveOutput:
        ratio = torch.exp(batch.log_prob - batch.old_log_prob.detach())
        loss = (-batch.advantages.detach() * ratio).mean()
        if self.kl_beta > 0:
            loss = loss + self.kl_beta * (batch.mean - batch.ref_mean.detach()).pow(2).mean()
        return ObjectiveOutput(loss=loss, metrics={"ratio_mean": ratio.detach().mean(), "loss": loss.detach()})


class TestReinforceObjective(ObjectiveConformance):
    objective_class = ReinforceObjective


class TestReinforceObjectiveWithReference(ObjectiveConformance):
    objective_class = ReinforceObjective
    objective_params = {"kl_beta": 0.1}
