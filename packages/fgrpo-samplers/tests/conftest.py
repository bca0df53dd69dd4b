"""The samplers' tests run on the public toy policy (fgrpo.core.testing.GaussianPolicy)."""

from __future__ import annotations

import pytest

from fgrpo.core.testing.toys import GaussianPolicy


@pytest.fixture
def make_policy():
    return GaussianPolicy


@pytest.fixture
def policy() -> GaussianPolicy:
    return GaussianPolicy()
