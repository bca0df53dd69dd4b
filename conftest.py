"""Repository-wide pytest settings.

The models in the default test run are tiny: on a shared 2-core machine torch's intra-op threads
cost more than they give (measured 30x slower with 2 threads under load), so tests, and the
processes they start, use one thread.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Every test starts on one thread and leaves torch's count as it found it: a run a test composes
    may set its own, and a count left behind would slow every test after it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
