"""Test helpers for fgrpo components and plugins.

Conformance bases a plugin's own tests subclass, as diffusers' scheduler tests do::

    from fgrpo.core.testing import RewardConformance

    class TestMyReward(RewardConformance):
        reward_name = "my-reward"
        ...
"""

from __future__ import annotations

import importlib

try:  # detailed assertion messages inside the conformance bases, for plugin authors' tests
    import pytest

    pytest.register_assert_rewrite("fgrpo.core.testing.kernels", "fgrpo.core.testing.rewards")
except ImportError:  # pytest is only needed to run the bases
    pass

_EXPORTS = {
    "KernelConformance": "fgrpo.core.testing.kernels",
    "RewardConformance": "fgrpo.core.testing.rewards",
    "build_tiny_sd3_pipeline": "fgrpo.core.testing.tiny_pipelines",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Lazy, so that importing one base does not import diffusers for another.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
