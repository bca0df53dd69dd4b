"""A conformance test suite for transition kernels (``fgrpo.kernels`` entry points).

Subclass :class:`KernelConformance` in a test module, name the kernel (or give its class) and its
parameters, and pytest runs every check of the :class:`fgrpo.core.protocols.Kernel` contract on it::

    from fgrpo.core.testing import KernelConformance

    class TestMyKernel(KernelConformance):
        kernel_name = "my-kernel"          # the entry-point name (or kernel_class = MyKernel)
        kernel_params = {"eta": 0.5}

What is checked: construction through the registry (defaults, a bad parameter raises
``RecipeError``), output shapes and float32 dtypes (also for bf16/fp16/float64 inputs), the
log-prob against ``torch.distributions.Normal`` averaged over non-batch dimensions, bit-identical
re-evaluation of a stored action, reproducibility with ``noise`` and with ``generator``,
per-sample ``index`` tensors, finiteness over a sweep of schedules (sigma = 1 at the start,
sigma' = 0 at the end, tiny sigmas), zero-std steps, gradients, and ``ValueError`` on bad input.

Kernels with state (a ``reset()`` method, e.g. a multistep solver) are reset before every step
these checks take, so each checked step is the first of a run. A kernel whose log-prob is not the
normalised Gaussian density overrides :meth:`KernelConformance.expected_log_prob`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch

from fgrpo.core.config import RecipeError
from fgrpo.core.protocols import Kernel, KernelStep
from fgrpo.core.testing import _component


def _shifted(steps: int, shift: float) -> list[float]:
    grid = [1 - i / steps for i in range(steps + 1)]
    return [shift * s / (1 + (shift - 1) * s) for s in grid]


class KernelConformance:
    """Base class of a kernel's tests; pytest collects the subclasses (``Test...``)."""

    #: the kernel's entry-point name in the ``fgrpo.kernels`` group
    kernel_name: ClassVar[str] = ""
    #: or the kernel class itself (a kernel that is not installed, e.g. defined in a test)
    kernel_class: ClassVar[type | None] = None
    #: parameters the kernel is built with for these checks
    kernel_params: ClassVar[dict[str, Any]] = {}
    #: parameters that must be refused with ``RecipeError`` (an unknown key works for any kernel)
    bad_params: ClassVar[dict[str, Any]] = {"eta": -1.0}
    #: sample shapes every check runs on (batch first)
    shapes: ClassVar[tuple[tuple[int, ...], ...]] = ((4, 2, 3, 5), (3, 7))
    #: schedules of the finiteness sweep; each is decreasing within [0, 1]
    sweep_schedules: ClassVar[tuple[tuple[float, ...], ...]] = (
        tuple(1 - i / 8 for i in range(9)),  # linear, 1 -> 0
        tuple(_shifted(10, 3.0)),  # SD3 shift, 1 -> 0
        (1.0, 0.9999999, 0.5, 1e-3, 1e-7, 0.0),  # hugging both ends
        (1.0, 0.0),  # a single step
        (0.97, 0.6, 0.2, 0.05),  # starts below 1, ends above 0
        (2e-2, 1e-4, 1e-6, 1e-30, 0.0),  # tiny sigmas
    )
    #: tolerance of the log-prob against torch.distributions.Normal
    logprob_atol: ClassVar[float] = 1e-4

    # --- hooks ---------------------------------------------------------------------------------

    def make_kernel(self, **overrides: Any) -> Any:
        return self.build(**{**self.kernel_params, **overrides})

    def build(self, **params: Any) -> Any:
        """The kernel built from exactly ``params``, checked as a recipe's keys would be."""
        return _component.build("kernel", self.kernel_name, self.kernel_class, params)

    def expected_log_prob(self, prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """The log-prob the kernel must return (default: the normalised Gaussian density)."""
        lp = torch.distributions.Normal(mean.double(), std.double().expand_as(mean)).log_prob(prev_sample.double())
        return lp.reshape(lp.shape[0], -1).mean(dim=1)

    def step(self, kernel: Any, *args: Any, **kwargs: Any) -> KernelStep:
        """``kernel.step`` as the first step of a run (stateful kernels are reset first)."""
        reset = getattr(kernel, "reset", None)
        if callable(reset):
            reset()
        return kernel.step(*args, **kwargs)

    # --- helpers -------------------------------------------------------------------------------

    @property
    def stochastic(self) -> bool:
        return bool(type(self.make_kernel()).stochastic)

    @staticmethod
    def inputs(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        sample = torch.randn(shape, generator=g).to(dtype)
        velocity = torch.randn(shape, generator=g).to(dtype)
        return velocity, sample

    @staticmethod
    def sigmas(values: tuple[float, ...] | None = None) -> torch.Tensor:
        if values is None:
            values = (1.0, 0.8, 0.55, 0.3, 0.1, 0.0)
        return torch.tensor(values, dtype=torch.float32)

    @staticmethod
    def stochastic_index(sigmas: torch.Tensor) -> int:
        """A step with positive sigma' (every stochastic kernel has std > 0 there)."""
        return int(sigmas.shape[0]) - 3

    def one_step(self, seed: int) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(kernel, velocity, sample, sigmas, index): a step with positive sigma' on the first shape."""
        sigmas = self.sigmas()
        velocity, sample = self.inputs(self.shapes[0], seed=seed)
        return self.make_kernel(), velocity, sample, sigmas, self.stochastic_index(sigmas)

    def _check_output(self, out: KernelStep, shape: tuple[int, ...]) -> None:
        assert isinstance(out, KernelStep)
        batch = shape[0]
        for name in ("prev_sample", "mean"):
            t = getattr(out, name)
            assert t.shape == shape, f"{name}: shape {tuple(t.shape)}, expected {shape}"
            assert t.dtype == torch.float32, f"{name}: dtype {t.dtype}, expected float32"
        assert out.std.shape == (batch,) + (1,) * (len(shape) - 1), f"std: shape {tuple(out.std.shape)}"
        assert out.std.dtype == torch.float32
        assert out.log_prob.shape == (batch,), f"log_prob: shape {tuple(out.log_prob.shape)}"
        assert out.log_prob.dtype == torch.float32

    # --- construction --------------------------------------------------------------------------

    def test_registry_defaults(self):
        _component.check_registered_and_documented("kernel", self.kernel_name, self.kernel_class, docstring=True)
        kernel = self.build()
        assert isinstance(kernel, Kernel)
        assert isinstance(type(kernel).stochastic, bool)
        if attrs.has(type(kernel)):  # stochastic is a class attribute, not a recipe key
            assert "stochastic" not in {f.name for f in attrs.fields(type(kernel))}

    def test_bad_param_raises_recipe_error(self):
        with pytest.raises(RecipeError):
            self.build(**self.bad_params)
        with pytest.raises(RecipeError, match="unknown key"):
            self.build(no_such_key=1)

    # --- shapes, dtypes ------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
    def test_shapes_and_float32(self, dtype):
        kernel = self.make_kernel()
        for shape in self.shapes:
            velocity, sample = self.inputs(shape, dtype=dtype)
            sigmas = self.sigmas().to(dtype)
            out = self.step(kernel, velocity, sample, sigmas, 1)
            self._check_output(out, shape)
            again = self.step(kernel, velocity, sample, sigmas, 1, prev_sample=out.prev_sample)
            self._check_output(again, shape)

    def test_low_precision_inputs_are_upcast(self):
        """bf16 inputs give the float32 result of the (upcast) bf16 values."""
        kernel = self.make_kernel()
        shape = self.shapes[0]
        velocity, sample = self.inputs(shape, dtype=torch.bfloat16)
        sigmas = self.sigmas()
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))
        low = self.step(kernel, velocity, sample, sigmas, 1, noise=noise)
        high = self.step(kernel, velocity.float(), sample.float(), sigmas, 1, noise=noise)
        for name in ("prev_sample", "mean", "std", "log_prob"):
            assert torch.equal(getattr(low, name), getattr(high, name)), name

    # --- the log-prob --------------------------------------------------------------------------

    def test_log_prob_matches_normal(self):
        kernel = self.make_kernel()
        sigmas = self.sigmas()
        for shape in self.shapes:
            velocity, sample = self.inputs(shape, seed=1)
            for index in range(sigmas.shape[0] - 1):
                out = self.step(kernel, velocity, sample, sigmas, index)
                if not self.stochastic:
                    assert torch.equal(out.log_prob, torch.zeros_like(out.log_prob))
                    assert torch.equal(out.std, torch.zeros_like(out.std))
                    assert torch.equal(out.mean, out.prev_sample)
                    continue
                if bool((out.std == 0).any()):
                    continue  # zero-std steps: see test_zero_std_steps
                expected = self.expected_log_prob(out.prev_sample, out.mean, out.std)
                torch.testing.assert_close(out.log_prob.double(), expected, atol=self.logprob_atol, rtol=1e-5)
                # a different action has its own (lower on average) density, also as Normal says
                other = out.mean + 2 * out.std * torch.randn(shape, generator=torch.Generator().manual_seed(9))
                ev = self.step(kernel, velocity, sample, sigmas, index, prev_sample=other)
                torch.testing.assert_close(
                    ev.log_prob.double(),
                    self.expected_log_prob(other, ev.mean, ev.std),
                    atol=self.logprob_atol,
                    rtol=1e-5,
                )

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_reevaluation_is_bit_identical(self, dtype):
        """log pi of the stored action under the same velocity: exactly the sampling-time value."""
        kernel = self.make_kernel()
        sigmas = self.sigmas()
        for shape in self.shapes:
            velocity, sample = self.inputs(shape, seed=2, dtype=dtype)
            batch = shape[0]
            per_sample = torch.arange(batch) % (sigmas.shape[0] - 1)
            for index in [*range(sigmas.shape[0] - 1), per_sample]:
                gen = torch.Generator().manual_seed(11)
                out = self.step(kernel, velocity, sample, sigmas, index, generator=gen)
                again = self.step(kernel, velocity, sample, sigmas, index, prev_sample=out.prev_sample)
                assert torch.equal(again.log_prob, out.log_prob)
                assert torch.equal(again.mean, out.mean)
                assert torch.equal(again.std, out.std)
                assert torch.equal(again.prev_sample, out.prev_sample)
                ratio = torch.exp(again.log_prob - out.log_prob)
                assert torch.equal(ratio, torch.ones_like(ratio))

    # --- randomness ----------------------------------------------------------------------------

    def test_noise_override(self):
        kernel, velocity, sample, sigmas, index = self.one_step(seed=4)
        shape = self.shapes[0]
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        a = self.step(kernel, velocity, sample, sigmas, index, noise=noise)
        b = self.step(kernel, velocity, sample, sigmas, index, noise=noise.clone())
        assert torch.equal(a.prev_sample, b.prev_sample)
        assert torch.equal(a.log_prob, b.log_prob)
        if self.stochastic:
            torch.testing.assert_close(a.prev_sample, a.mean + a.std * noise)
            c = self.step(kernel, velocity, sample, sigmas, index, noise=-noise)
            assert not torch.equal(a.prev_sample, c.prev_sample)
            assert bool((a.std > 0).all())
        else:
            assert torch.equal(a.prev_sample, a.mean)

    def test_generator_reproducible(self):
        kernel, velocity, sample, sigmas, index = self.one_step(seed=6)
        shape = self.shapes[0]

        def run(seed):
            return self.step(kernel, velocity, sample, sigmas, index, generator=torch.Generator().manual_seed(seed))

        a, b, c = run(7), run(7), run(8)
        assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)
        # the draw is torch.randn(shape, generator=...) in float32: the same as passing that noise
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float32)
        d = self.step(kernel, velocity, sample, sigmas, index, noise=noise)
        assert torch.equal(a.prev_sample, d.prev_sample)
        if self.stochastic:
            assert not torch.equal(a.prev_sample, c.prev_sample)
        else:
            assert torch.equal(a.prev_sample, c.prev_sample)

    # --- per-sample steps ----------------------------------------------------------------------

    def test_per_sample_index(self):
        """A LongTensor index gives, row by row, what int-index calls on single rows give."""
        kernel = self.make_kernel()
        sigmas = self.sigmas()
        for shape in self.shapes:
            velocity, sample = self.inputs(shape, seed=12)
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(13))
            index = torch.arange(shape[0]).flip(0) % (sigmas.shape[0] - 1)
            out = self.step(kernel, velocity, sample, sigmas, index, noise=noise)
            ev = self.step(kernel, velocity, sample, sigmas, index, prev_sample=out.prev_sample)
            assert torch.equal(ev.log_prob, out.log_prob)
            for row in range(shape[0]):
                sl = slice(row, row + 1)
                one = self.step(kernel, velocity[sl], sample[sl], sigmas, int(index[row]), noise=noise[sl])
                for name in ("prev_sample", "mean", "std", "log_prob"):
                    torch.testing.assert_close(getattr(one, name), getattr(out, name)[sl], rtol=1e-6, atol=1e-6)
            # a 0-d tensor index behaves as the int
            scalar = self.step(kernel, velocity, sample, sigmas, torch.tensor(2), noise=noise)
            as_int = self.step(kernel, velocity, sample, sigmas, 2, noise=noise)
            assert torch.equal(scalar.prev_sample, as_int.prev_sample)

    # --- edge cases ----------------------------------------------------------------------------

    def test_finite_over_schedule_sweep(self):
        kernel = self.make_kernel()
        shape = self.shapes[0]
        velocity, sample = self.inputs(shape, seed=14)
        velocity, sample = 3 * velocity, 3 * sample
        for values in self.sweep_schedules:
            sigmas = self.sigmas(values)
            for index in range(sigmas.shape[0] - 1):
                gen = torch.Generator().manual_seed(index)
                out = self.step(kernel, velocity, sample, sigmas, index, generator=gen)
                again = self.step(kernel, velocity, sample, sigmas, index, prev_sample=out.prev_sample)
                other = self.step(kernel, velocity, sample, sigmas, index, prev_sample=sample)
                where = f"sigmas={values}, index={index}"
                for o in (out, again, other):
                    for name in ("prev_sample", "mean", "std"):
                        assert bool(torch.isfinite(getattr(o, name)).all()), f"{name} not finite at {where}"
                    assert bool((o.std >= 0).all()), where
                    assert not bool(torch.isnan(o.log_prob).any()), f"log_prob NaN at {where}"
                # sampled actions and their re-evaluation have finite log-probs; an arbitrary
                # action under a std of 1e-30 may legitimately be -inf in float32
                for o in (out, again):
                    assert bool(torch.isfinite(o.log_prob).all()), f"log_prob not finite at {where}"
                assert torch.equal(again.log_prob, out.log_prob), where

    def test_zero_std_steps(self):
        """Where std == 0 the step is deterministic: log-prob 0 and x' = mean, never NaN."""
        kernel = self.make_kernel()
        shape = self.shapes[0]
        velocity, sample = self.inputs(shape, seed=15)
        for values in self.sweep_schedules:
            sigmas = self.sigmas(values)
            for index in range(sigmas.shape[0] - 1):
                out = self.step(kernel, velocity, sample, sigmas, index, generator=torch.Generator().manual_seed(0))
                ev = self.step(kernel, velocity, sample, sigmas, index, prev_sample=sample)
                zero = (out.std == 0).reshape(-1)
                if not bool(zero.any()):
                    continue
                assert torch.equal(out.log_prob[zero], torch.zeros_like(out.log_prob[zero]))
                assert torch.equal(ev.log_prob[zero], torch.zeros_like(ev.log_prob[zero]))
                assert torch.equal(out.prev_sample[zero], out.mean[zero])

    def test_gradient_reaches_velocity(self):
        """The update differentiates the re-evaluated log-prob (stochastic) or x' (ODE) w.r.t. v."""
        kernel, velocity, sample, sigmas, index = self.one_step(seed=16)
        with torch.no_grad():
            out = self.step(kernel, velocity, sample, sigmas, index, generator=torch.Generator().manual_seed(1))
        v = (velocity + 0.05).requires_grad_(True)
        ev = self.step(kernel, v, sample, sigmas, index, prev_sample=out.prev_sample)
        target = ev.log_prob.sum() if self.stochastic else ev.mean.sum()
        (grad,) = torch.autograd.grad(target, v)
        assert bool(torch.isfinite(grad).all()) and bool((grad != 0).any())

    # --- bad input -----------------------------------------------------------------------------

    def _bad_calls(self):
        shape = self.shapes[0]
        velocity, sample = self.inputs(shape)
        sigmas = self.sigmas()
        n = sigmas.shape[0]
        other = torch.randn(shape[0], *[d + 1 for d in shape[1:]])
        yield "index", (velocity, sample, sigmas, n - 1), {}
        yield "index", (velocity, sample, sigmas, -1), {}
        yield "index", (velocity, sample, sigmas, 1.0), {}
        yield "index", (velocity, sample, sigmas, True), {}
        yield "index", (velocity, sample, sigmas, torch.full((shape[0],), n - 1)), {}
        yield "index", (velocity, sample, sigmas, torch.zeros(shape[0] + 1, dtype=torch.long)), {}
        yield "index", (velocity, sample, sigmas, torch.zeros(shape[0])), {}
        yield "velocity", (other, sample, sigmas, 0), {}
        yield "noise", (velocity, sample, sigmas, 0), {"noise": other}
        yield "prev_sample", (velocity, sample, sigmas, 0), {"prev_sample": other}
        yield "sample", (velocity.long(), sample.long(), sigmas, 0), {}
        yield "velocity", (velocity.long(), sample, sigmas, 0), {}
        yield "sigmas", (velocity, sample, sigmas[None], 0), {}
        yield "sigmas", (velocity, sample, sigmas[:1], 0), {}
        yield "sigmas", (velocity, sample, (sigmas * 10).long(), 0), {}
        yield "sigmas", (velocity, sample, sigmas.flip(0), 0), {}
        yield "sigmas", (velocity, sample, sigmas + 0.5, 0), {}

    def test_bad_input_raises_value_error(self):
        kernel = self.make_kernel()
        for name, args, kwargs in self._bad_calls():
            with pytest.raises(ValueError) as info:
                self.step(kernel, *args, **kwargs)
            message = str(info.value)
            assert name in message, f"the error for a bad {name} does not name it: {message!r}"
            assert "expected" in message and "got" in message, message
