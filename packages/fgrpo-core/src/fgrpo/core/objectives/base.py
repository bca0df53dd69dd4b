"""The typed members every objective declares (:class:`fgrpo.core.protocols.Objective`), with their
defaults: an objective subclasses the base of what it trains on and overrides what differs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from fgrpo.core.config import ConfigError


class _Declared:
    """What both kinds default to: no old policy, rollouts from the current weights, no pairs, no
    rule beyond the objective's own keys."""

    __slots__ = ()
    samples_from_old: ClassVar[bool] = False
    pairwise: ClassVar[bool] = False

    @property
    def needs_old(self) -> bool:
        return False

    @staticmethod
    def check_recipe(resolved: Mapping[str, Any]) -> list[ConfigError]:
        return []


class TransitionObjective(_Declared):
    """An objective on the stored transitions of a rollout's stochastic steps (a
    :class:`~fgrpo.core.protocols.StepBatch`): no old policy, no pairs. A subclass says whether it
    needs the reference (``needs_reference``) and writes ``__call__``."""

    __slots__ = ()
    trains_on: ClassVar[Literal["transitions"]] = "transitions"


class ForwardProcessObjective(_Declared):
    """An objective on finished samples re-noised on the forward process (a
    :class:`~fgrpo.core.protocols.ForwardBatch`): a subclass writes ``point_times`` and
    ``__call__``, and where it keeps an old policy ``needs_old`` and ``old_decay``, where it trains
    on pairs ``pairwise = True`` and ``pairs``."""

    __slots__ = ()
    trains_on: ClassVar[Literal["forward"]] = "forward"
