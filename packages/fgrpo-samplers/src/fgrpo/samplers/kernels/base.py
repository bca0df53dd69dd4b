"""The public base of a transition kernel: input checks, the sigma lookup, noise and the log-prob.

A kernel is one short class that writes its formula and nothing else::

    import attrs, torch
    from typing import ClassVar
    from fgrpo.core.config import param
    from fgrpo.samplers.kernels.base import KernelBase, StepInputs

    @attrs.define
    class NoisyEulerKernel(KernelBase):
        '''Euler step plus noise of std eta * sqrt(-dt): mu = x + dt v.'''

        stochastic: ClassVar[bool] = True
        eta: float = param(0.5, ge=0, help="noise level")

        def transition(self, s: StepInputs):
            return s.sample + s.dt * s.velocity, self.eta * torch.sqrt(-s.dt)

:meth:`KernelBase.step` checks the arguments (:func:`prepare`; every ``ValueError`` names the
argument, what was expected and what was given, as ``KernelConformance`` requires), hands them to
``transition`` as float32 :class:`StepInputs`, then samples x' = mean + std * noise and evaluates
its Gaussian log-prob (:func:`finish`), or for a deterministic kernel returns the computed state
with std 0 and log-prob 0 (:func:`deterministic`). A kernel that does not fit that mould calls the
same functions from its own ``step``.

Numerics: every kernel casts ``velocity``, ``sample``, ``sigmas``, ``noise`` and ``prev_sample``
to float32 before any arithmetic (whatever their dtype: bf16, fp16, float64) and returns float32
tensors. The log-prob is therefore the same number whether it is computed at sampling time or
re-computed by the update, as long as the stored action is kept in float32 (the dtype the kernel
returns it in).
"""

from __future__ import annotations

import math
import numbers
from typing import ClassVar, NamedTuple

import torch

from fgrpo.core.protocols import KernelStep

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class StepInputs(NamedTuple):
    """The checked inputs of one step, float32 and on the sample's device.

    ``sigma``/``sigma_next`` have shape (batch, 1, ..., 1) so that they broadcast against the
    sample; ``sigmas`` is the whole schedule (1-D, float32).
    """

    velocity: torch.Tensor
    sample: torch.Tensor
    sigmas: torch.Tensor
    # (batch,) long, on the sample's device; the field shadows tuple.index on purpose (kernels read s.index)
    index: torch.Tensor  # type: ignore[assignment]
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    noise: torch.Tensor | None
    prev_sample: torch.Tensor | None

    @property
    def dt(self) -> torch.Tensor:
        """sigma' - sigma (< 0), shape (batch, 1, ..., 1)."""
        return self.sigma_next - self.sigma

    def zeros_std(self) -> torch.Tensor:
        return torch.zeros_like(self.sigma)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def _check_tensor(name: str, t: object, like: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if like is not None and t.shape != like.shape:
        raise ValueError(f"{name}: expected the shape of sample {tuple(like.shape)}, got {tuple(t.shape)}")
    return t


def _as_index(index: object, batch: int, last: int, device: torch.device) -> torch.Tensor:
    """``index`` as a (batch,) long tensor with every value in [0, last]."""
    allowed = f"an int in [0, {last}] (len(sigmas) - 2) or a LongTensor of shape ({batch},)"
    if isinstance(index, torch.Tensor):
        if index.dtype in (torch.bool,) or index.is_floating_point() or index.is_complex():
            raise ValueError(f"index: expected {allowed}, got a tensor of dtype {index.dtype}")
        if index.ndim == 0:
            index = index.reshape(1).expand(batch)
        elif index.shape != (batch,):
            raise ValueError(f"index: expected {allowed}, got a tensor of shape {tuple(index.shape)}")
        index = index.to(device=device, dtype=torch.long)
        if device.type == "cuda":  # no host sync inside the update's loops: a device-side assert
            if batch:
                torch._assert_async((index.min() >= 0) & (index.max() <= last), f"index: expected {allowed}")
            return index
        # On the CPU the check costs nothing and names the bad value.
        low, high = (int(v) for v in torch.stack([index.min(), index.max()]).tolist()) if batch else (0, 0)
        if low < 0 or high > last:
            bad = low if low < 0 else high
            raise ValueError(f"index: expected {allowed}, got a value {bad} (out of range)")
        return index
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise ValueError(f"index: expected {allowed}, got {index!r}")
    if not 0 <= int(index) <= last:
        raise ValueError(f"index: expected {allowed}, got {int(index)} (out of range)")
    return torch.full((batch,), int(index), dtype=torch.long, device=device)


def prepare(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    index: int | torch.Tensor,
    *,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
) -> StepInputs:
    """Check the arguments of ``Kernel.step`` and return them as float32 (see the module doc).

    Raises ``ValueError`` naming the argument, what was expected and what was given.
    """
    _check_tensor("sample", sample)
    if sample.ndim < 1:
        raise ValueError("sample: expected a batch-first tensor with at least 1 dimension, got a scalar")
    _check_tensor("velocity", velocity, like=sample)
    if noise is not None:
        _check_tensor("noise", noise, like=sample)
    if prev_sample is not None:
        _check_tensor("prev_sample", prev_sample, like=sample)
    if noise is not None and prev_sample is not None:
        raise ValueError("noise and prev_sample: expected at most one of them, got both")
    if not isinstance(sigmas, torch.Tensor):
        raise ValueError(f"sigmas: expected a 1-D floating-point tensor, got {type(sigmas).__name__}")
    if sigmas.ndim != 1 or sigmas.shape[0] < 2 or not sigmas.is_floating_point():
        raise ValueError(
            f"sigmas: expected a 1-D floating-point tensor with at least 2 values, got {_describe(sigmas)}"
        )

    device = sample.device
    batch = sample.shape[0]
    sigmas = sigmas.to(device=device, dtype=torch.float32)
    idx = _as_index(index, batch, sigmas.shape[0] - 2, device)
    view = (batch,) + (1,) * (sample.ndim - 1)
    sigma = sigmas[idx].reshape(view)
    sigma_next = sigmas[idx + 1].reshape(view)
    # One host sync: the step must go down, inside [0, 1] (else NaNs appear far from the cause).
    ok = (sigma_next >= 0) & (sigma_next < sigma) & (sigma <= 1)
    if batch and device.type == "cuda":  # as for the index: no host sync on a GPU
        torch._assert_async(ok.all(), "sigmas: expected 1 >= sigmas[index] > sigmas[index + 1] >= 0")
    elif batch and not bool(ok.all()):
        where = int((~ok.reshape(-1)).nonzero()[0])
        i = int(idx[where])
        raise ValueError(
            f"sigmas: expected 1 >= sigmas[index] > sigmas[index + 1] >= 0, got "
            f"sigmas[{i}] = {float(sigmas[i])}, sigmas[{i + 1}] = {float(sigmas[i + 1])}"
        )
    return StepInputs(
        velocity=velocity.to(torch.float32),
        sample=sample.to(torch.float32),
        sigmas=sigmas,
        index=idx,
        sigma=sigma,
        sigma_next=sigma_next,
        noise=None if noise is None else noise.to(device=device, dtype=torch.float32),
        prev_sample=None if prev_sample is None else prev_sample.to(device=device, dtype=torch.float32),
    )


def gaussian_log_prob(
    prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, *, normalized: bool = True
) -> torch.Tensor:
    """Per-sample log-density of ``prev_sample`` under N(mean, std^2), averaged over non-batch dims.

    ``normalized``: -(x'-mu)^2/(2 std^2) - log std - log(2 pi)/2 (the exact density); otherwise
    -(x'-mu)^2 (the unnormalised form of the CPS reference code). Where std == 0 the step is
    deterministic and the log-prob is 0 (never NaN). In float32 the density of an action far
    from the mean under a std below ~1e-19 can fall below the float32 range: it is then -inf
    (sampled actions and their re-evaluation stay finite). The action is detached: gradients reach the
    log-prob through ``mean`` only. Returns float32 of shape (batch,).
    """
    x = prev_sample.detach()
    positive = std > 0
    if normalized:
        safe = torch.where(positive, std, torch.ones_like(std))
        # (x' - mu) / std first: std^2 would underflow for std < 1e-19
        lp = -0.5 * ((x - mean) / safe) ** 2 - torch.log(safe) - _HALF_LOG_2PI
    else:
        lp = -((x - mean) ** 2)
    lp = torch.where(positive, lp, torch.zeros_like(lp))
    return lp.reshape(lp.shape[0], -1).mean(dim=1)


def finish(
    inputs: StepInputs,
    mean: torch.Tensor,
    std: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    normalized: bool = True,
) -> KernelStep:
    """Sample x' = mean + std * noise (unless ``prev_sample`` was given) and its log-prob.

    Sampling and re-evaluation go through the same :func:`gaussian_log_prob`, so the log-prob of
    a stored action under the same velocity is bit-identical to the one returned at sampling time.
    Noise is ``inputs.noise`` or ``torch.randn(shape, generator=generator)`` in float32 on the
    sample's device.
    """
    prev = inputs.prev_sample
    if prev is None:
        noise = inputs.noise
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        prev = torch.where(std > 0, mean + std * noise, mean)
    log_prob = gaussian_log_prob(prev, mean, std, normalized=normalized)
    return KernelStep(prev_sample=prev, mean=mean, std=std, log_prob=log_prob)


def deterministic(inputs: StepInputs, next_sample: torch.Tensor) -> KernelStep:
    """A deterministic step: std 0, log-prob 0, mean = the computed next state.

    With ``prev_sample`` given, ``prev_sample`` is returned as is (nothing to evaluate).
    """
    batch = next_sample.shape[0]
    prev = next_sample if inputs.prev_sample is None else inputs.prev_sample
    return KernelStep(
        prev_sample=prev,
        mean=next_sample,
        std=inputs.zeros_std(),
        log_prob=torch.zeros(batch, dtype=torch.float32, device=next_sample.device),
    )


class KernelBase:
    """The base of a kernel whose step is a Gaussian N(mean, std^2) (or a deterministic map).

    A subclass sets the class attribute ``stochastic`` and writes :meth:`transition`; its recipe
    keys are attrs fields (``fgrpo.core.config.param``). ``normalized_logprob`` (a recipe key or a
    class attribute; default true) chooses the exact Gaussian log-density or the unnormalised
    -(x' - mu)^2 (see :func:`gaussian_log_prob`).
    """

    __slots__ = ()

    #: whether the step has a std and a log-prob (and can be trained)
    stochastic: ClassVar[bool]
    normalized_logprob: bool = True  # a class attribute, or a recipe key of the kernel (cps)

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean, std) of x' given the checked inputs; a deterministic kernel returns (x', None)."""
        raise NotImplementedError(f"{type(self).__name__} writes transition(s) -> (mean, std)")

    def step(
        self,
        velocity: torch.Tensor,
        sample: torch.Tensor,
        sigmas: torch.Tensor,
        index: int | torch.Tensor,
        *,
        noise: torch.Tensor | None = None,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> KernelStep:
        """:class:`fgrpo.core.protocols.Kernel`'s step: sample x' (or, with ``prev_sample``, only
        evaluate its log-prob). ``noise`` and ``generator`` are ignored by deterministic kernels."""
        s = prepare(velocity, sample, sigmas, index, noise=noise, prev_sample=prev_sample)
        mean, std = self.transition(s)
        if not self.stochastic:
            return deterministic(s, mean)
        if std is None:
            raise TypeError(f"{type(self).__name__} is stochastic but its transition returned no std")
        return finish(s, mean, std, generator=generator, normalized=bool(self.normalized_logprob))
