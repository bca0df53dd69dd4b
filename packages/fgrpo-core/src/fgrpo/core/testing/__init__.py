"""Test helpers for fgrpo components and plugins.

Conformance bases a plugin's own tests subclass, as diffusers' scheduler tests do::

    from fgrpo.core.testing import RewardConformance

    class TestMyReward(RewardConformance):
        reward_name = "my-reward"
        ...

One base per protocol: ``KernelConformance``, ``SamplerConformance``, ``RewardConformance``,
``PolicyConformance`` (fgrpo-models' ``fgrpo.models.testing`` adds the diffusers-specific checks
and tiny pipelines) and ``ObjectiveConformance``. A kernel, sampler or objective under test is
named by its entry point or, when it is not installed (defined in the test itself), given as a
class (``kernel_class = MyKernel``). ``GaussianPolicy`` is a toy policy with a closed-form
velocity for tests of samplers, objectives and the trainer; ``SyntheticImage`` an in-memory
source image for tests of editing backbones and rewards.
"""

from __future__ import annotations

import importlib

try:  # detailed assertion messages inside the conformance bases, for plugin authors' tests
    import pytest

    pytest.register_assert_rewrite(
        "fgrpo.core.testing._component",
        "fgrpo.core.testing.kernels",
        "fgrpo.core.testing.objectives",
        "fgrpo.core.testing.policies",
        "fgrpo.core.testing.rewards",
        "fgrpo.core.testing.samplers",
    )
except ImportError:  # pytest is only needed to run the bases
    pass

_EXPORTS = {
    "GaussianPolicy": "fgrpo.core.testing.toys",
    "KernelConformance": "fgrpo.core.testing.kernels",
    "ObjectiveConformance": "fgrpo.core.testing.objectives",
    "PolicyConformance": "fgrpo.core.testing.policies",
    "RewardConformance": "fgrpo.core.testing.rewards",
    "SamplerConformance": "fgrpo.core.testing.samplers",
    "SyntheticImage": "fgrpo.core.testing.toys",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Lazy, so that importing one base does not import diffusers for another.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
