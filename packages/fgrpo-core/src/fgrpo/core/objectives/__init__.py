"""Policy objectives: turn training points and their advantages into a loss.

Registered under the entry-point group ``fgrpo.objectives``. On stored transitions of stochastic
sampling steps: ``grpo`` and ``grpo-guard``; on forward-process points (finished samples
re-noised): ``nft`` (DiffusionNFT), ``awm`` (advantage-weighted matching) and ``dpo`` (online
Flow-DPO).
"""

from fgrpo.core.objectives.awm import AWM
from fgrpo.core.objectives.dpo import DPO
from fgrpo.core.objectives.grpo import GRPO
from fgrpo.core.objectives.grpo_guard import GRPOGuard
from fgrpo.core.objectives.nft import NFT

__all__ = ["AWM", "DPO", "GRPO", "GRPOGuard", "NFT"]
