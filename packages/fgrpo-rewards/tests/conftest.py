"""Fixtures shared by the reward tests: tiny random models in temporary folders, no downloads."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def offline():
    """Hub look-ups fail fast: only folders written by the tests can load."""
    import huggingface_hub.constants as hub

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(hub, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="session")
def clip_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from fgrpo.rewards.testing import save_tiny_clip

    return save_tiny_clip(tmp_path_factory.mktemp("tiny-clip"))
