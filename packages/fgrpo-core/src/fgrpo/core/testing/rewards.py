"""``RewardConformance``: the tests every reward passes, for a reward's own test module to subclass.

A plugin author writes::

    import torch
    from fgrpo.core.testing import RewardConformance

    class TestMyReward(RewardConformance):
        reward_name = "my-reward"            # the entry-point name in the fgrpo.rewards group
        reward_params = {"target": 0.5}      # recipe keys of the reward

        def make_inputs(self):
            images = torch.rand(4, 3, 16, 16)
            return images, ["a", "b", "c", "d"], [{}, {}, {}, {}]

and gets, without writing them: the reward is found and built by the registry from its recipe
keys; it satisfies the ``Reward`` protocol; it returns a ``RewardResult`` whose ``scores`` are a
floating tensor of shape (B,), finite, the same on a second call, permuted when the batch is
permuted (no sample's score depends on its neighbours); every ``details`` entry has one value per
sample; the inputs are not modified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch

from fgrpo.core import media, registry
from fgrpo.core.protocols import Reward, RewardResult


def take(batch: Any, order: Sequence[int]) -> Any:
    """The rows ``order`` of a batch: a tensor (first dim), a list/tuple, or a dict of those."""
    if isinstance(batch, torch.Tensor):
        return batch[torch.as_tensor(list(order), dtype=torch.long, device=batch.device)]
    if isinstance(batch, Mapping):
        return {k: take(v, order) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(batch[i] for i in order)
    try:  # numpy arrays and other sequences with fancy indexing
        return batch[list(order)]
    except Exception as exc:  # pragma: no cover - a reward with an exotic output type
        raise TypeError(f"cannot reorder a batch of type {type(batch).__name__}") from exc


def batch_length(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    if hasattr(value, "shape") and value.shape:
        return int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def _snapshot(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone()
    if isinstance(batch, Mapping):
        return {k: _snapshot(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_snapshot(v) for v in batch)
    return batch


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


#: rewards built by the conformance fixture, one per test class (models load once per class)
_BUILT: dict[type, Any] = {}


class RewardConformance:
    """Subclass, set ``reward_name`` (and ``reward_params``), implement ``make_inputs``.

    ``make_inputs()`` returns (outputs, prompts, metadata) for a batch of at least 2 samples
    whose scores are not all equal (so that a shuffle is visible). ``atol`` is the tolerance of
    the determinism and order checks (batched networks may differ in the last bits).
    """

    reward_name: ClassVar[str] = ""
    reward_params: ClassVar[dict[str, Any]] = {}
    atol: ClassVar[float] = 1e-5

    def make_inputs(self) -> tuple[Any, list[str], list[Mapping[str, Any]]]:
        raise NotImplementedError("a RewardConformance subclass implements make_inputs()")

    def make_reward(self) -> Any:
        return registry.create("reward", self.reward_name, **dict(self.reward_params))

    @pytest.fixture
    def reward(self) -> Any:
        """The reward, built once per test class (``make_reward``) and shared by its tests."""
        if not self.reward_name:
            pytest.fail(f"{type(self).__name__} sets no reward_name")
        cls = type(self)
        if cls not in _BUILT:
            _BUILT[cls] = self.make_reward()
        return _BUILT[cls]

    @staticmethod
    def groups_of(prompts: Sequence[str]) -> torch.Tensor:
        """A group-aware reward's groups: the samples of one prompt are a group."""
        ids: dict[str, int] = {}
        return torch.tensor([ids.setdefault(p, len(ids)) for p in prompts], dtype=torch.long)

    def score(self, reward: Any, outputs: Any, prompts: list[str], metadata: list) -> RewardResult:
        """The reward on a batch, as the trainer calls it (with ``sources=`` when it accepts them,
        ``groups=`` when it judges whole groups)."""
        extra: dict[str, Any] = (
            {"sources": media.reward_sources(prompts, outputs)} if getattr(reward, "accepts_sources", False) else {}
        )
        if getattr(reward, "groupwise", False):
            extra["groups"] = self.groups_of(prompts)
        result = reward(outputs, prompts, metadata, **extra)
        assert isinstance(result, RewardResult), (
            f"{self.reward_name} returned {type(result).__name__}, expected fgrpo.core.protocols.RewardResult"
        )
        return result

    # --- the checks -----------------------------------------------------------------------------

    def test_registered(self) -> None:
        assert self.reward_name in registry.names("reward"), (
            f"{self.reward_name!r} is not in the fgrpo.rewards entry points: {registry.names('reward')}"
        )

    def test_satisfies_protocol(self, reward: Any) -> None:
        assert isinstance(reward, Reward)

    def test_inputs_well_formed(self) -> None:
        outputs, prompts, metadata = self.make_inputs()
        assert len(prompts) >= 2, "make_inputs() needs at least 2 samples"
        assert batch_length(outputs) == len(prompts) == len(metadata)

    def test_scores_shape_dtype_finite(self, reward: Any) -> None:
        outputs, prompts, metadata = self.make_inputs()
        scores = self.score(reward, outputs, prompts, metadata).scores
        assert isinstance(scores, torch.Tensor), f"scores must be a tensor, got {type(scores).__name__}"
        assert scores.is_floating_point(), f"scores must be floating point, got {scores.dtype}"
        assert tuple(scores.shape) == (len(prompts),), (
            f"scores shape {tuple(scores.shape)}, expected ({len(prompts)},)"
        )
        assert torch.isfinite(scores).all(), f"non-finite scores: {scores}"

    def test_deterministic(self, reward: Any) -> None:
        outputs, prompts, metadata = self.make_inputs()
        first = self.score(reward, outputs, prompts, metadata).scores.detach().cpu()
        second = self.score(reward, outputs, prompts, metadata).scores.detach().cpu()
        torch.testing.assert_close(first, second, atol=self.atol, rtol=0)

    def test_batch_order_equivariant(self, reward: Any) -> None:
        outputs, prompts, metadata = self.make_inputs()
        n = len(prompts)
        order = [(i + 1) % n for i in range(n)]  # a rotation: no sample keeps its place
        base = self.score(reward, outputs, prompts, metadata).scores.detach().cpu()
        shuffled = (
            self.score(reward, take(outputs, order), take(list(prompts), order), take(list(metadata), order))
            .scores.detach()
            .cpu()
        )
        torch.testing.assert_close(shuffled, base[order], atol=self.atol, rtol=0)

    def test_details_have_batch_length(self, reward: Any) -> None:
        outputs, prompts, metadata = self.make_inputs()
        details = self.score(reward, outputs, prompts, metadata).details
        assert isinstance(details, Mapping)
        for name, value in details.items():
            assert batch_length(value) == len(prompts), (
                f"details[{name!r}] has {batch_length(value)} entries for {len(prompts)} samples"
            )

    def test_inputs_not_modified(self, reward: Any) -> None:
        outputs, prompts, metadata = self.make_inputs()
        before = (_snapshot(outputs), list(prompts), _snapshot(list(metadata)))
        self.score(reward, outputs, prompts, metadata)
        assert _same(before[0], outputs), "the reward modified its outputs argument in place"
        assert before[1] == list(prompts)
        assert _same(before[2], list(metadata))

    def test_group_aware_reward_scores_each_group_on_its_own(self, reward: Any) -> None:
        """A group-aware reward (``groupwise``) gives a group's samples the same scores alone as
        inside the batch: groups are judged independently."""
        if not getattr(reward, "groupwise", False):
            pytest.skip("not group-aware")
        outputs, prompts, metadata = self.make_inputs()
        base = self.score(reward, outputs, prompts, metadata).scores.detach().cpu()
        groups = self.groups_of(prompts)
        for g in groups.unique().tolist():
            index = (groups == g).nonzero().squeeze(1).tolist()
            alone = self.score(
                reward, take(outputs, index), take(list(prompts), index), take(list(metadata), index)
            ).scores
            torch.testing.assert_close(alone.detach().cpu(), base[index], atol=self.atol, rtol=0)
