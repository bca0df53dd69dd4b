"""Transition kernels: one step sigmas[index] -> sigmas[index + 1] of a flow-matching sampler.

Each kernel satisfies :class:`fgrpo.core.protocols.Kernel` and is registered under the entry point
group ``fgrpo.kernels``: ``euler``, ``sde`` (Flow-GRPO), ``wan-sde`` (flow_grpo's Wan 2.1 noise),
``dance`` (DanceGRPO), ``cps`` (coefficients-preserving), ``dpmpp2m`` and ``dpmpp3m``
(DPM-Solver++(2M) and (3M), deterministic, keep a one- or two-step history: call ``reset()`` before
each run). All arithmetic is float32.

A step whose ``std`` is zero (every step of ``euler``/``dpmpp2m``, the last step to sigma' = 0 of
``cps``, any step with eta = 0) is deterministic: its log-prob is 0 and it must not be trained.

Every built-in kernel subclasses :class:`fgrpo.samplers.kernels.base.KernelBase` (input checks,
noise, log-prob) and writes only its formula; a third-party kernel can do the same.
"""

from fgrpo.samplers.kernels.cps import CPSKernel
from fgrpo.samplers.kernels.dance import DanceKernel
from fgrpo.samplers.kernels.dpmpp2m import DPMpp2MKernel
from fgrpo.samplers.kernels.dpmpp3m import DPMpp3MKernel
from fgrpo.samplers.kernels.euler import EulerKernel
from fgrpo.samplers.kernels.sde import SDEKernel
from fgrpo.samplers.kernels.wan_sde import WanSDEKernel

__all__ = ["CPSKernel", "DPMpp2MKernel", "DPMpp3MKernel", "DanceKernel", "EulerKernel", "SDEKernel", "WanSDEKernel"]
