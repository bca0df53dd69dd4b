"""Policy objectives: turn a trained step's new log-probs and advantages into a loss.

Registered under the entry-point group ``fgrpo.objectives``: ``grpo`` and ``grpo-guard``.
"""

from fgrpo.core.objectives.grpo import GRPO
from fgrpo.core.objectives.guard import GRPOGuard

__all__ = ["GRPO", "GRPOGuard"]
