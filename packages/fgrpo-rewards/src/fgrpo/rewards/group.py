"""Rewards that judge a prompt's group of samples jointly: ``pairwise`` win rates and ``rank``.

Both are group-aware rewards (``groupwise = True``): the trainer calls them with ``groups``, each
sample's prompt group, and a batch always holds whole groups.

``pairwise`` is Pref-GRPO's reward (CodeGoat24/Pref-GRPO ``fastvideo/rewards/unifiedreward_think.py``
at 3e787f6, lines 21-103): every unordered pair (i, j) of a group, i < j, is judged once with i as
the first image, and a sample's reward is its win rate, wins / comparisons, a tie counting half a
win for each. The judge is any reward that compares two outputs (``compares`` and
``compare(first, second, prompts, metadata)`` giving 1 when the first is better, 0 when the second,
e.g. ``vlm-judge`` with ``parse: pairwise``), or any pointwise reward used as a comparator: each
sample scored once, the higher score wins, equal scores tie. ``rank`` is Flow-Factory's
``PickScore_Rank`` (X-GenGroup/Flow-Factory ``src/flow_factory/rewards/pick_score.py`` at a0b2bc5,
lines 240-242) over any pointwise reward: a sample's reward is its rank in its group divided by G,
(0, 1, ..., G - 1) / G.

Judge calls are counted per group (``judge_calls``: comparisons asked of a comparing judge, samples
scored by a pointwise one) and logged with the other details (``reward/LABEL/judge_calls``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import attrs
import torch

from fgrpo.core import tensors
from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.core.registry import component


def members_of(groups: torch.Tensor | None, n: int) -> list[list[int]]:
    """The sample indices of each group, groups in order of first appearance (no groups: one)."""
    if groups is None:
        return [list(range(n))]
    order: dict[int, list[int]] = {}
    for i, g in enumerate(torch.as_tensor(groups).cpu().tolist()):
        order.setdefault(int(g), []).append(i)
    return list(order.values())


def take(outputs: Any, index: list[int]) -> Any:
    picked = torch.as_tensor(index, dtype=torch.long)
    return (
        tensors.index(outputs, picked) if not isinstance(outputs, torch.Tensor) else outputs[picked.to(outputs.device)]
    )


def pointwise_details(details: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The judge's per-sample details (shown beside the group reward's, e.g. a verifier's accuracy)."""
    kept = {}
    for key, value in details.items():
        if (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n) or (
            isinstance(value, (list, tuple)) and len(value) == n
        ):
            kept[key] = value
    return kept


@attrs.define
class Pairwise:
    """Pref-GRPO's pairwise win rate of every sample against the others of its group (see the module
    docstring). Details: ``win_rate``, ``judge_calls`` (of the sample's group), ``ties`` (the
    sample's tied comparisons) and a pointwise judge's own per-sample details."""

    judge: Any = component(
        "reward",
        help="the judge: a reward that compares two outputs (vlm-judge with parse: pairwise) or a pointwise reward "
        "used as a comparator (the higher score wins)",
    )
    both_orders: bool = param(
        False,
        help="also judge every pair with the other sample first (a position-biased judge; twice the calls); Pref-GRPO "
        "asks each pair once",
    )
    groupwise: ClassVar[bool] = True

    def __call__(
        self,
        outputs: Any,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        groups: torch.Tensor | None = None,
    ) -> RewardResult:
        n = len(prompts)
        members = members_of(groups, n)
        wins, counts, ties, calls = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
        extra: dict[str, Any] = {}
        comparing = bool(getattr(self.judge, "compares", False))
        if comparing:
            first, second = [], []
            for group in members:
                for i, j in itertools.combinations(group, 2):
                    first.append(i)
                    second.append(j)
                    if self.both_orders:
                        first.append(j)
                        second.append(i)
            outcome = (
                torch.as_tensor(
                    self.judge.compare(
                        take(outputs, first),
                        take(outputs, second),
                        [prompts[i] for i in first],
                        [metadata[i] for i in first],
                    ).scores,
                    dtype=torch.float32,
                ).cpu()
                if first
                else torch.zeros(0)
            )
        else:
            result = self.judge(outputs, list(prompts), list(metadata))
            scores = torch.as_tensor(result.scores, dtype=torch.float64).cpu()
            extra = pointwise_details(getattr(result, "details", {}) or {}, n)
            pairs = [(i, j) for group in members for i, j in itertools.combinations(group, 2)] if n > 1 else []
            first, second = [i for i, _ in pairs], [j for _, j in pairs]
            a, b = scores[first], scores[second]
            outcome = torch.where(a > b, 1.0, torch.where(a < b, 0.0, 0.5)).float()
        for k, (i, j) in enumerate(zip(first, second, strict=True)):
            o = float(outcome[k])
            wins[i] += o
            wins[j] += 1.0 - o
            counts[i] += 1
            counts[j] += 1
            if o == 0.5:
                ties[i] += 1
                ties[j] += 1
        for group in members:
            asked = (
                sum(1 for _ in itertools.combinations(group, 2)) * (2 if self.both_orders else 1)
                if comparing
                else len(group)
            )
            calls[group] = float(asked)
        win_rate = torch.where(counts > 0, wins / counts.clamp(min=1), torch.zeros(n))
        return RewardResult(
            scores=win_rate, details={**extra, "win_rate": win_rate, "judge_calls": calls, "ties": ties}
        )


@attrs.define
class Rank:
    """A pointwise reward turned into within-group ranks: rank / G, (0, 1, ..., G - 1) / G
    (Flow-Factory's PickScore_Rank over any reward; see the module docstring). Details: ``rank``,
    ``judge_calls`` (samples scored in the sample's group) and the ranked reward's own details."""

    reward: Any = component("reward", help="the pointwise reward whose scores are ranked inside each group")
    ties: Literal["order", "average"] = param(
        "order",
        choices=("order", "average"),
        help="tied scores: order = ranked by sample order (argsort of argsort, as Flow-Factory's), average = they "
        "share their mean rank",
    )
    groupwise: ClassVar[bool] = True

    def __call__(
        self,
        outputs: Any,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        groups: torch.Tensor | None = None,
    ) -> RewardResult:
        n = len(prompts)
        result = self.reward(outputs, list(prompts), list(metadata))
        scores = torch.as_tensor(result.scores, dtype=torch.float64).cpu()
        rank, size = torch.zeros(n), torch.zeros(n)
        for group in members_of(groups, n):
            s = scores[group]
            order = s.argsort(stable=True).argsort(stable=True).double()
            if self.ties == "average":
                order = torch.stack([order[s == value].mean() for value in s])
            rank[group] = order.float()
            size[group] = float(len(group))
        details = {
            **pointwise_details(getattr(result, "details", {}) or {}, n),
            "rank": rank,
            "judge_calls": size.clone(),
        }
        return RewardResult(scores=rank / size, details=details)
