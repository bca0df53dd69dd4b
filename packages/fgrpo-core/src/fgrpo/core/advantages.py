"""Group-relative advantages: each sample's reward compared with the other samples of its prompt.

Pure functions; the trainer passes the options (``global_std``, ``per_prompt``, the std
estimator and epsilon, the multi-reward mode). The defaults match flow_grpo's per-prompt stat
tracker: statistics in float64, the *population* standard deviation (numpy's ``np.std``, ddof=0,
which is also defined for a group of one), (r - mean) / (std + 1e-4), statistics from the current
batch only (flow_grpo clears its tracker every epoch). MixGRPO and DanceGRPO divide by the
unbiased std (torch's ``Tensor.std``) + 1e-8: ``unbiased=True, eps=1e-8``. ``per_prompt=False``
normalises with the whole batch's mean and std (flow_grpo ``per_prompt_stat_tracking: False``,
MixGRPO/DanceGRPO ``use_group: False``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch

from fgrpo.core.registry import ComponentError

Aggregation = Literal["reward_sum", "advantage_sum", "reward_product", "gdpo"]
AGGREGATIONS = ("reward_sum", "advantage_sum", "reward_product", "gdpo")


class NegativeReward(ComponentError, ValueError):
    """A reward below 0 under ``reward_product`` (a run stops with this one line)."""


def total_reward(
    rewards: Mapping[str, torch.Tensor], weights: Mapping[str, float], mode: str = "reward_sum"
) -> torch.Tensor:
    """The one float64 reward per sample that ``reward_sum`` and ``reward_product`` normalise (and
    evaluation logs as ``reward_mean``): the weighted sum, or CaRL's product of every reward raised
    to its weight, so that a sample scoring 0 on one reward scores 0 whatever the others say."""
    names = sorted(rewards)
    if mode != "reward_product":
        # a tensor, not sum()'s start 0: rewards is not empty
        return cast(torch.Tensor, sum(weights[k] * rewards[k].detach().to(torch.float64) for k in names))
    total = torch.ones_like(rewards[names[0]], dtype=torch.float64)
    for k in names:
        r = rewards[k].detach().to(torch.float64)
        if (r < 0).any():
            raise NegativeReward(
                f"reward {k!r} gave {r.min().item():g}; train.advantage: reward_product takes rewards >= 0 "
                "(each is raised to its weight)"
            )
        total = total * r ** weights[k]
    return total


def _check(rewards: torch.Tensor, group_index: torch.Tensor) -> None:
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_index must both have shape (B,), got {tuple(rewards.shape)} "
            f"and {tuple(group_index.shape)}"
        )
    if rewards.numel() == 0:
        raise ValueError("no rewards: the batch is empty")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; a reward function returned an invalid score")


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()


def _normalise(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    global_std: bool,
    eps: float,
    per_prompt: bool = True,
    unbiased: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 advantages (B,) and, per prompt group, whether all its rewards are equal (G,)."""
    _check(rewards, group_index)
    r = rewards.detach().to(torch.float64)
    _, inverse = torch.unique(group_index, return_inverse=True)
    n = int(inverse.max()) + 1
    flat = _flat(r, inverse, n)
    if not per_prompt:  # one group: the whole batch
        inverse, n = torch.zeros_like(inverse), 1
    zeros = r.new_zeros(n)
    count = zeros.index_add(0, inverse, torch.ones_like(r))
    mean = zeros.index_add(0, inverse, r) / count
    centred = r - mean[inverse]
    if global_std or not per_prompt:
        std = r.std(unbiased=unbiased).expand(n)
    else:
        # a group of one has no unbiased std (0/0): it is flat and gets zeros below anyway
        std = (zeros.index_add(0, inverse, centred**2) / (count - 1 if unbiased else count)).sqrt()
    # A flat group carries no signal; test it exactly (max == min) rather than trusting the mean's
    # rounding, so that it gives exact zeros and not (tiny error) / 1e-4.
    same = flat if per_prompt else _flat(r, inverse, 1)
    advantages = torch.where(same[inverse], 0.0, centred / (std[inverse] + eps))
    return advantages, flat


def _flat(r: torch.Tensor, inverse: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) whether every reward of each group is the same number."""
    hi = r.new_full((n,), -torch.inf).scatter_reduce(0, inverse, r, "amax")
    lo = r.new_full((n,), torch.inf).scatter_reduce(0, inverse, r, "amin")
    return hi == lo


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    per_prompt: bool = True,
    unbiased: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-prompt z-scores (r - mean_group) / (std_group + eps), and statistics for logging.

    ``group_index`` (B,) gives each sample's prompt (any integers; order does not matter).
    ``global_std`` divides by the std of all rewards of the batch instead of the group's (useful
    when rewards are sparse and groups are often nearly flat); ``per_prompt=False`` also takes the
    batch's mean instead of the group's; ``unbiased`` uses the n - 1 std. Groups whose rewards are
    all equal, including groups of one sample, get exactly zero advantages (with
    ``per_prompt=False``: a batch whose rewards are all equal). Returns advantages with the
    rewards' dtype and device, and ``zero_std_ratio`` (fraction of flat prompt groups, whatever
    the normalisation), ``reward_mean``, ``reward_std`` (population std of the batch) as Python
    floats.
    """
    advantages, flat = _normalise(rewards, group_index, global_std, eps, per_prompt, unbiased)
    r = rewards.detach().to(torch.float64)
    stats = {
        "zero_std_ratio": flat.double().mean().item(),
        "reward_mean": r.mean().item(),
        "reward_std": r.std(unbiased=False).item(),
    }
    return advantages.to(_out_dtype(rewards)), stats


def combine(
    rewards: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_index: torch.Tensor,
    *,
    mode: Aggregation = "reward_sum",
    global_std: bool = False,
    eps: float = 1e-4,
    per_prompt: bool = True,
    unbiased: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages from several named rewards.

    ``reward_sum`` (flow_grpo's behaviour): normalise the weighted sum of the raw rewards.
    ``advantage_sum``: normalise each reward on its own, then take the weighted sum, so that a
    reward with a large scale or spread does not drown the others.
    ``reward_product``: normalise the product of the rewards, each raised to its weight (CaRL's
    multiplicative reward across separately registered rewards; every reward must be >= 0).
    ``gdpo`` (GDPO, as Pref-GRPO's ``apply_gdpo``): ``advantage_sum``, then that sum renormalised
    over the whole batch by ``_renormalise``.

    Statistics: those of the weighted reward sum (what flow_grpo logs as ``avg``), plus
    ``reward_mean/NAME`` and ``reward_std/NAME`` for each reward. In ``advantage_sum`` and ``gdpo``
    modes a group counts in ``zero_std_ratio`` when it is flat for every reward (its advantages are
    all zero).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(map(repr, AGGREGATIONS))}")
    if not rewards:
        raise ValueError("no rewards to combine")
    if set(rewards) != set(weights):
        raise ValueError(f"rewards {sorted(rewards)} and weights {sorted(weights)} must name the same rewards")
    names = sorted(rewards)
    out_dtype = functools.reduce(torch.promote_types, (_out_dtype(rewards[k]) for k in names))
    total = total_reward(rewards, weights, mode)
    options: dict[str, Any] = {"global_std": global_std, "eps": eps, "per_prompt": per_prompt, "unbiased": unbiased}
    advantages, stats = group_advantages(total, group_index, **options)
    if mode in ("advantage_sum", "gdpo"):
        advantages = torch.zeros_like(total)
        all_flat = None
        for k in names:
            adv_k, flat_k = _normalise(rewards[k], group_index, **options)
            advantages = advantages + weights[k] * adv_k
            all_flat = flat_k if all_flat is None else all_flat & flat_k
        assert all_flat is not None  # names is not empty
        stats["zero_std_ratio"] = all_flat.double().mean().item()
    if mode == "gdpo":
        advantages = _renormalise(advantages, eps, unbiased)
    for k in names:
        r = rewards[k].detach().to(torch.float64)
        stats[f"reward_mean/{k}"] = r.mean().item()
        stats[f"reward_std/{k}"] = r.std(unbiased=False).item()
    return advantages.to(out_dtype), stats


def _renormalise(summed: torch.Tensor, eps: float, unbiased: bool) -> torch.Tensor:
    """GDPO's last step (Pref-GRPO fastvideo/rewards/dispatcher.py:698-704 at 3e787f6): the
    weighted sum of the per-reward advantages, z-scored over the whole batch of every process
    (Pref-GRPO gathers it; fgrpo's batch is already gathered) with the same std estimator and eps
    as the per-reward step.

    Every per-reward advantage sums to 0 over its group (or over the batch), so the batch mean is 0
    up to rounding and the step is in effect a division by the batch std. An exact 0 (a group flat
    for every reward, or advantages that cancel) therefore stays an exact 0, so that
    ``drop_zero_advantage`` still finds it, where the reference leaves -mean / (std + eps), a
    rounding error (measured below 1e-16 in float64).
    """
    # a batch of one has no unbiased std (0/0); its one advantage is 0 and stays 0 below anyway
    std = summed.std(unbiased=unbiased) if summed.numel() > 1 else summed.new_zeros(())
    return torch.where(summed == 0, 0.0, (summed - summed.mean()) / (std + eps))


#: BranchGRPO's per-depth normalisation (Fredreic1849/BranchGRPO fastvideo/train_branchgrpo_flux.py
#: at ffc3c90, ``compute_hierarchical_advantages_by_depth``): a depth whose node std is below FLAT_STD
#: has zero advantages; otherwise (m - mean) / (std + DEPTH_EPS), with the unbiased std over the nodes
TREE_FLAT_STD = 1e-6
TREE_DEPTH_EPS = 1e-8


def tree_advantages(advantages: torch.Tensor, group_index: torch.Tensor, step_nodes: torch.Tensor) -> torch.Tensor:
    """(B, S) float64 advantage of every trained transition of a tree rollout (BranchGRPO).

    ``advantages`` (B,): each leaf's (sample's) group-normalised advantage; ``step_nodes`` (B, S):
    the node of its prompt's tree that step s of sample b leads to (numbered within the tree, so
    that (group_index[b], step_nodes[b, s]) names a node). A node's value is the mean over the
    leaves below it; at each depth (column s) of each tree the nodes' values are z-scored among
    the nodes of that depth: (m - mean) / (std + 1e-8), the unbiased std over the nodes, 0 when
    the depth has one node or its std is below 1e-6 (a flat depth). The reference averages the
    leaves' raw rewards, not their advantages: a z-score of the means is the same for any positive
    affine map of the leaf values, so the two agree up to the epsilons (docs/method.md).
    """
    if step_nodes.dim() != 2 or step_nodes.shape[0] != advantages.shape[0]:
        raise ValueError(f"step_nodes must be (B={advantages.shape[0]}, S), got {tuple(step_nodes.shape)}")
    a = advantages.detach().to(torch.float64)
    groups = group_index.to(a.device).long()
    out = torch.zeros(step_nodes.shape, dtype=torch.float64, device=a.device)
    for s in range(step_nodes.shape[1]):
        out[:, s] = _depth_advantages(a, groups, step_nodes[:, s].to(a.device).long())
    return out


def _depth_advantages(a: torch.Tensor, groups: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """(B,) one depth: each row's node value z-scored among the nodes of its tree at this depth."""
    keys = torch.stack([groups, nodes], 1)
    unique, node_of_row = torch.unique(keys, dim=0, return_inverse=True)
    n_nodes = unique.shape[0]
    zeros = a.new_zeros(n_nodes)
    value = zeros.index_add(0, node_of_row, a) / zeros.index_add(0, node_of_row, torch.ones_like(a))
    _, tree_of_node = torch.unique(unique[:, 0], return_inverse=True)
    n_trees = int(tree_of_node.max()) + 1
    count = a.new_zeros(n_trees).index_add(0, tree_of_node, torch.ones_like(value))
    mean = a.new_zeros(n_trees).index_add(0, tree_of_node, value) / count
    centred = value - mean[tree_of_node]
    # a depth with one node has no unbiased std (0/0): its advantage is 0 below
    std = (a.new_zeros(n_trees).index_add(0, tree_of_node, centred**2) / (count - 1).clamp(min=1)).sqrt()
    flat = (count[tree_of_node] <= 1) | (std[tree_of_node] < TREE_FLAT_STD)
    node_adv = torch.where(flat, 0.0, centred / (std[tree_of_node] + TREE_DEPTH_EPS))
    return node_adv[node_of_row]
