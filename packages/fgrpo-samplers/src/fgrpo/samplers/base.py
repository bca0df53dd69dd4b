"""The public base of a group sampler: what every sampler declares, checks and leaves to the rollout.

A sampler decides *which kernel runs each step* and *which steps are trained*; :class:`GroupSampler`
does the rest (the schedule, the ``final`` sample, the steps a kernel with std 0 cannot train, and
the group rollout of the completed :class:`Plan` by :func:`fgrpo.samplers._rollout.run`). A
sampler is an attrs class whose fields are its recipe keys and which writes
:meth:`GroupSampler.program`::

    import attrs
    from typing import Any
    from fgrpo.core.config import param
    from fgrpo.core.registry import component
    from fgrpo.samplers.base import EULER, GroupSampler, Plan, Step, final_param, schedule_param

    @attrs.define
    class LastStepsSampler(GroupSampler):
        steps: int = param(10, ge=1, help="sampling steps")
        last: int = param(2, ge=1, help="stochastic (trained) steps at the end")
        share_noise: bool = param(False, help="the G samples of a prompt start from the same noise")
        schedule: dict | None = schedule_param()
        final: str | None = final_param()
        kernel: Any = component("kernel", default="sde", help="the stochastic kernel")

        def program(self, sigmas, generator):  # Euler steps, then the kernel's
            first = self.steps - self.last
            euler = [Step(EULER, sigmas, i, "ode") for i in range(first)]
            return Plan(euler + [Step(self.kernel, sigmas, i, "sde") for i in range(first, self.steps)])

The built-in samplers take their deterministic steps with the built-in kernels directly
(:data:`EULER`, DPM-Solver++), not through the registry: a plugin that registers a kernel under
the same name changes what recipes name, never the inside of a sampler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core import registry
from fgrpo.core.config import ConfigError, RecipeError, param, shown
from fgrpo.core.protocols import Kernel, Policy, Trajectory
from fgrpo.samplers import _rollout
from fgrpo.samplers._rollout import FINALS, Plan, Step
from fgrpo.samplers.kernels.euler import EulerKernel
from fgrpo.samplers.schedules import Schedule, check_sigmas

#: the deterministic Euler step every built-in sampler takes outside its stochastic steps (stateless)
EULER = EulerKernel()


# --- recipe keys every sampler shares -----------------------------------------------------------


def check_schedule(_instance: Any, _attribute: Any, value: Any) -> None:
    """Validator of the ``schedule`` key: None or a mapping accepted by ``schedules.Schedule``."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping such as {{type: shift, shift: 3.0}} or null, got {value!r}")
    try:
        Schedule(**dict(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"got {dict(value)!r}; {exc}") from None


def schedule_param() -> Any:
    """The ``schedule`` key every sampler shares."""
    return param(
        None,
        validator=check_schedule,
        help="null: the model's own sigmas; else a schedule mapping, e.g. {type: shift, shift: 3.0}",
    )


def final_param() -> Any:
    """The ``final`` key every sampler shares."""
    return param(
        None,
        choices=FINALS,
        help="the final image: 'sample' = the last step's x' (flow_grpo), 'x0' = the last step's "
        "predicted x0 = x - sigma v (DanceGRPO; MixGRPO drop_last_sample), 'ode' = a deterministic, "
        "untrained last step; null = the kernel's reference (sde, cps: sample; dance: x0)",
    )


def key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def kernel_error(spec: Any, prefix: str) -> ConfigError | None:
    """An error if the kernel (a name, a {name: ...} mapping or a built kernel) is deterministic."""
    target = spec
    name = spec if isinstance(spec, str) else spec.get("name") if isinstance(spec, Mapping) else None
    if name is not None:
        try:
            target = registry.load("kernel", str(name))
        except registry.ComponentError:
            return None  # reported by the registry's own check of the kernel key
    shown_name = name if name is not None else type(spec).__name__
    if not getattr(target, "stochastic", False):
        return ConfigError(
            key(prefix, "kernel"),
            f"got the deterministic kernel {shown_name!r}; a sampler trains its kernel's steps and needs a "
            "stochastic one (sde, dance, cps)",
        )
    if name is not None and _silent(spec, name):  # a built kernel's noise shows at its first rollout
        return ConfigError(
            key(prefix, "kernel"),
            f"got {shown(spec)}, which adds no noise at any step (std 0): a sampler trains its kernel's "
            "steps and needs noise (a noise level such as eta > 0)",
        )
    return None


def _silent(spec: Any, name: str) -> bool:
    """Whether a stochastic kernel, as configured, has std 0 at every step of a probe schedule
    (``sde`` with ``eta: 0`` is the ODE in disguise: nothing to train)."""
    params = {k: v for k, v in spec.items() if k != "name"} if isinstance(spec, Mapping) else {}
    try:  # the keys were checked (check_params runs the cross-key rules after the per-key checks)
        kernel = registry.construct("kernel", registry.load("kernel", str(name)), params, str(name))
    except (RecipeError, registry.ComponentError):
        return False  # its own keys are reported where they are checked
    return not bool((step_stds(kernel, torch.linspace(1.0, 0.0, 11)) > 0).any())


# --- the schedule, randomness and the kernel's std ------------------------------------------------


def main_sigmas(policy: Policy, steps: int, schedule: Mapping[str, Any] | None) -> torch.Tensor:
    """The sampling schedule: ``policy.sigmas(steps)`` or the configured ``Schedule``."""
    sigmas = policy.sigmas(steps) if schedule is None else Schedule(**dict(schedule))(steps)
    sigmas = check_sigmas(torch.as_tensor(sigmas).to(device=policy.device, dtype=torch.float32))
    if sigmas.shape != (steps + 1,):
        raise ValueError(f"sigmas: expected steps + 1 = {steps + 1} values, got {sigmas.shape[0]}")
    return sigmas


def randint(low: int, high: int, generator: torch.Generator | None) -> int:
    """One integer uniformly in [low, high), drawn from ``generator``."""
    device = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(low, high, (1,), generator=generator, device=device).item())


def step_stds(kernel: Kernel, sigmas: torch.Tensor) -> torch.Tensor:
    """The std the kernel uses at every step of ``sigmas`` (S,), probed in one call on 1-element
    dummy states (no network).

    The std of every shipped kernel depends on the schedule only; the probe is how samplers know,
    before sampling, which steps have std 0 (e.g. ``cps`` stepping to sigma' = 0) and must never be
    trained.
    """
    steps = sigmas.shape[0] - 1
    zero = torch.zeros(steps, 1, device=sigmas.device, dtype=torch.float32)
    with torch.no_grad():
        std = kernel.step(zero, zero, sigmas, torch.arange(steps, device=sigmas.device), noise=zero).std
    return torch.as_tensor(std, dtype=torch.float32).reshape(-1).expand(steps).cpu()


# --- the final sample --------------------------------------------------------------------------


def resolve_final(final: str | None, kernel: Kernel) -> str:
    """``final``, or when null what the kernel's reference implementation decodes."""
    return final if final is not None else str(getattr(kernel, "reference_final", "sample"))


def with_final(program: Sequence[Step], final: str) -> list[Step]:
    """``program`` with its last step made a deterministic Euler step when ``final`` is 'ode'."""
    last = program[-1]
    if final != "ode" or not last.kernel.stochastic:
        return list(program)
    return [*program[:-1], Step(EULER, last.sigmas, last.index, last.phase)]


def stochastic_steps(program: Sequence[Step], kernel: Kernel) -> list[int]:
    """Positions of the program that run ``kernel`` (the candidates for training)."""
    return [position for position, step in enumerate(program) if step.kernel is kernel]


def kl_steps_param() -> Any:
    """The ``kl_steps`` key of a windowed sampler."""
    return param(
        "trained",
        choices=("trained", "all"),
        help="trained: the KL term (objective.kl_beta) acts on the trained steps only; all: on every step of the "
        "chain (the deterministic ones too, as the stochastic kernel's step at the visited state), the policy loss "
        "still on the trained steps",
    )


def kl_everywhere(
    trained: torch.Tensor, program: Sequence[Step], stds: torch.Tensor, prefix: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kl_steps: all``: the trained positions (B, S) plus every other position of the program
    after the shared prefix where the kernel has a std (``stds``: its std at every step of the
    schedule; each visited state's KL to the reference is then part of the update), sorted; and
    the policy loss's weight of each (B, S'): 1 on the trained positions, 0 on the added ones. The
    update averages the loss over all S' steps, so the policy loss's gradient is S / S' of the
    window-only one (Adam's steps do not depend on that scale; the KL's share grows)."""
    batch = trained.shape[0]
    extra = [p for p in range(prefix, len(program)) if stds[p] > 0 and not bool((trained == p).any())]
    if not extra:
        return trained, torch.ones(trained.shape, dtype=torch.float32)
    added = torch.tensor(extra, dtype=torch.long).expand(batch, len(extra))
    both = torch.cat([trained, added], 1)
    order = both.argsort(dim=1)
    weight = torch.cat([torch.ones(trained.shape), torch.zeros(added.shape)], 1)
    return torch.gather(both, 1, order), torch.gather(weight, 1, order)


# --- the sampler -------------------------------------------------------------------------------


class GroupSampler:
    """The base of a sampler (:class:`fgrpo.core.protocols.Sampler`); see the module docstring.

    A subclass is an attrs class with at least the keys ``steps``, ``share_noise``, ``schedule``
    (:func:`schedule_param`), ``final`` (:func:`final_param`) and ``kernel`` (a ``component``).
    It writes :meth:`program`, and may override :meth:`trained_steps` (which of the kernel's
    steps are trained), :meth:`check_keys` (rules between its own keys, added to
    ``super().check_keys``'s) and the state methods (``advance``, ``state_dict``,
    ``load_state_dict``; stateless by default).
    """

    __slots__ = ("_std_probe",)  # (kernel, sigmas, the kernel's std at every step): one probe per schedule

    kernel: Kernel
    steps: int
    share_noise: bool
    schedule: Mapping[str, Any] | None
    final: str | None

    #: the rollout records trained stochastic transitions (the ``ode`` sampler records none: its
    #: finished samples serve the objectives that train on the forward process)
    transitions: ClassVar[bool] = True

    #: what ``rollout`` says when the kernel has std 0 at every step it would train
    nothing_to_train: ClassVar[str] = "the kernel has std 0 at every step of {sigmas}: nothing to train"

    def __attrs_post_init__(self) -> None:
        # GroupSampler is a mixin; the samplers built on it are attrs classes
        fields = attrs.fields(type(self))  # type: ignore[arg-type]
        errors = self.check_keys({f.name: getattr(self, f.name) for f in fields if f.init})
        if errors:
            raise RecipeError(errors)

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        """The errors that involve several keys, or a key and the registry (each key's own checks
        are its field's): the kernel must be stochastic and add noise. A sampler with rules of its
        own extends the list: ``super().check_keys(keys, prefix) + [...]``.

        ``keys``: the recipe keys after the per-key checks (absent keys are not checked here).
        """
        error = kernel_error(keys["kernel"], prefix) if "kernel" in keys else None
        return [error] if error is not None else []

    def sigmas(self, policy: Policy, steps: int) -> torch.Tensor:
        """This sampler's schedule with ``steps`` steps (evaluation integrates on it)."""
        return main_sigmas(policy, steps, self.schedule)

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        """The steps of one rollout on ``sigmas`` (the main schedule of ``steps`` steps)."""
        raise NotImplementedError(f"{type(self).__name__} writes program(sigmas, generator) -> Plan")

    def trained_steps(self, candidates: list[int], batch: int, generator: torch.Generator | None) -> torch.Tensor:
        """(batch, S) program positions to train, from the kernel's steps with std > 0 (all of them)."""
        return torch.tensor(candidates, dtype=torch.long).expand(batch, len(candidates)).clone()

    def rollout(
        self,
        policy: Policy,
        prompts: Sequence[str],
        group_size: int,
        *,
        generator: torch.Generator | None = None,
    ) -> Trajectory:
        sigmas = self.sigmas(policy, self.steps)
        plan = self.program(sigmas, generator)
        final = resolve_final(self.final, self.kernel)
        steps = with_final(plan.steps, final)
        batch = len(prompts) * group_size
        trained, weight = (
            torch.zeros((batch, 0), dtype=torch.long),
            None,
        )  # the final samples and their conditioning only
        if self.transitions:
            stds = self.kernel_stds(sigmas)
            candidates = [p for p in stochastic_steps(steps, self.kernel) if stds[p] > 0]
            if not candidates:
                raise ValueError(self.nothing_to_train.format(sigmas=sigmas.tolist(), **plan.info))
            trained = self.trained_steps(candidates, batch, generator)
            if getattr(self, "kl_steps", "trained") == "all":
                trained, weight = kl_everywhere(trained, steps, stds, plan.prefix)
        plan = attrs.evolve(
            plan,
            steps=steps,
            sigmas=sigmas,
            trained=trained,
            share_noise=self.share_noise,
            final=final,
            kl_kernel=self.kernel if weight is not None else None,
            policy_weight=weight,
        )
        return _rollout.run(policy, prompts, group_size, plan, generator)

    def kernel_stds(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The kernel's std at every step of ``sigmas``: probed once per schedule (every rollout of a
        run has the same), not once per rollout."""
        probe = getattr(self, "_std_probe", None)
        if probe is None or probe[0] is not self.kernel or not torch.equal(probe[1], sigmas):
            probe = (self.kernel, sigmas, step_stds(self.kernel, sigmas))
            object.__setattr__(self, "_std_probe", probe)  # a frozen sampler keeps its probe too
        return probe[2]

    def advance(self, iteration: int) -> None:
        """Called at the start of every iteration; nothing moves by default."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


__all__ = [
    "EULER",
    "GroupSampler",
    "Plan",
    "Step",
    "check_schedule",
    "final_param",
    "kernel_error",
    "kl_everywhere",
    "kl_steps_param",
    "main_sigmas",
    "randint",
    "resolve_final",
    "schedule_param",
    "step_stds",
    "stochastic_steps",
    "with_final",
]


def step_range_errors(keys: Mapping[str, Any], prefix: str, name: str) -> list[ConfigError]:
    """A sampler's ``[low, high]`` range of step indices (``name``) within its ``steps``."""
    given, steps = keys.get(name), keys.get("steps")
    if given is None or steps is None or (len(given) == 2 and 0 <= given[0] < given[1] <= steps):
        return []
    return [
        ConfigError(
            key(prefix, name), f"got {list(given)!r}; allowed: [low, high] with 0 <= low < high <= steps ({steps})"
        )
    ]


def drawn_range(given: Sequence[int] | None, default: tuple[int, int]) -> tuple[int, int]:
    """[low, high) of a step drawn per rollout: the recipe's range, else ``default``."""
    return default if given is None else (int(given[0]), int(given[1]))
