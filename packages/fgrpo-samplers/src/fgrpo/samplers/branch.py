"""``branch`` (BranchGRPO): tree rollouts with shared prefixes, split noise and depth pruning.

As the authors' code (Fredreic1849/BranchGRPO @ ffc3c90, fastvideo/train_branchgrpo_flux.py;
line numbers in docs/method.md): each prompt grows ONE tree from one initial noise. Every step
runs the stochastic kernel (DanceGRPO's SDE step, ``dance``, eta 0.3, by default) once per node of
the tree; at a split point each node has two children, two draws of the step whose noise is
scaled by ``split_noise_scale`` (x' = mean + scale * std * eps, the log-prob still that of the
unscaled Gaussian, as ``flux_step_with_split``); elsewhere one child. With s split points a tree
has 2^s leaves, the G = ``group_size`` samples of the prompt (G = 2^s is required), and the
network is evaluated once per node: sum over steps of the nodes at that step, not G x steps.

Every edge of the tree is a trained transition (the reference trains them all,
``collect_all_transitions``), less the depths ``depth_pruning`` leaves out (a child at depth
d = step + 1; with ``depth_pruning_slide`` the pruned depths move up by one every
``depth_pruning_slide_interval`` iterations, no higher than ``depth_pruning_stop_depth``). The
trajectory is rectangular, (B, S): row b holds the path of leaf b, so an edge shared by k leaves
appears in k rows with identical states; only the first leaf below it trains it (its
``policy_weight`` 1, the copies 0), so each edge counts once, as in the reference.
``step_nodes`` (B, S) names the node each step leads to; the update gives the step its node's
advantage: the mean of the leaves' advantages below the node, z-scored among the nodes of its
depth in the tree (:func:`fgrpo.core.advantages.tree_advantages`, the reference's
``compute_node_rewards_from_leaves`` and ``compute_hierarchical_advantages_by_depth``).

Width pruning mode 1 (``width_pruning: 1``) keeps the first ``width_pruning_ratio`` of each leaf's
edges after the last split (what the reference's advantage sort keeps, see ``width_pruned``).
Not implemented (docs/method.md): the mixed ODE/SDE window (``mix_ode_sde_tree``), width pruning
mode 2, the probability-weighted node rewards (``tree_prob_weighted``) and
``pruning_step_ratio``; the shipped script leaves all of them off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import attrs
import torch

from fgrpo.core import seeding, tensors
from fgrpo.core.config import ConfigError, param
from fgrpo.core.protocols import Policy, Trajectory
from fgrpo.core.registry import component
from fgrpo.samplers._rollout import Plan, Record, Step, trajectory
from fgrpo.samplers.base import EULER, GroupSampler, final_param, key, resolve_final, schedule_param


def check_points(_instance: Any, _attribute: Any, value: Any) -> None:
    """Validator of ``split_points`` and ``depth_pruning``: null or distinct integers >= 0."""
    if value is None:
        return
    if not isinstance(value, list | tuple) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise ValueError(f"expected a list of integers >= 0 or null, got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"got {list(value)!r}; allowed: distinct values")


def default_splits(steps: int, leaves: int) -> list[int]:
    """The reference's uniform rule (``parse_split_points`` with ``tree_split_rounds``): r = log2(G)
    rounds at i * (steps // r)."""
    rounds = int(math.log2(leaves))
    interval = steps // rounds if rounds else steps
    return [min(i * interval, steps - 1) for i in range(rounds)]


def group_error(steps: int, splits: Sequence[int] | None, group_size: int) -> str | None:
    """Why ``group_size`` cannot be the leaf count of the tree, or None."""
    if splits is not None:
        if group_size != 2 ** len(splits):
            return (
                f"the tree of split_points {list(splits)!r} has 2^{len(splits)} = {2 ** len(splits)} leaves, but "
                f"train.group_size is {group_size}; allowed: group_size = 2 ** len(split_points)"
            )
        return None
    if group_size < 1 or group_size & (group_size - 1):
        return f"train.group_size is {group_size}; with split_points null the tree needs a power of two (2, 4, 8, 16)"
    if int(math.log2(group_size)) > steps:
        return f"train.group_size {group_size} needs log2(G) = {int(math.log2(group_size))} splits; steps is {steps}"
    return None


@attrs.define
class BranchSampler(GroupSampler):
    """BranchGRPO: one tree per prompt, split at ``split_points`` into two children with the noise
    scaled by ``split_noise_scale``; every edge trained once with its node's per-depth advantage
    (see the module docstring)."""

    steps: int = param(20, ge=1, help="sampling steps (the reference: 20)")
    split_points: list[int] | None = param(
        None,
        validator=check_points,
        help="steps where every node splits in two (the reference script: [0, 3, 6, 9]); group_size must be "
        "2 ** len(split_points); null = log2(group_size) splits at i * (steps // log2(group_size))",
    )
    split_noise_scale: float = param(
        4.0, gt=0, help="the split steps' noise is scaled by this (the reference's script: 4.0, its default 0.3)"
    )
    depth_pruning: list[int] | None = param(
        None,
        validator=check_points,
        help="child depths (step + 1) whose edges are not trained (the reference's depth_pruning); null = none",
    )
    depth_pruning_slide: bool = param(
        False, help="the pruned depths move up by one every depth_pruning_slide_interval iterations"
    )
    depth_pruning_slide_interval: int = param(
        30, ge=1, help="iterations between two moves of the pruned depths (the script: 30)"
    )
    depth_pruning_stop_depth: int | None = param(
        None, help="the shallowest pruned depth stops moving here; null = the last split point (the reference)"
    )
    width_pruning: int = param(
        0,
        choices=(0, 1),
        help="1: of the edges after the last split point, train only the first width_pruning_ratio of each leaf's "
        "(the reference's width_pruning_mode 1); 0: all (mode 2 is not implemented)",
    )
    width_pruning_ratio: float = param(
        0.5, gt=0, le=1, help="the share of those edges width_pruning keeps (at least 1)"
    )
    schedule: dict | None = schedule_param()
    final: str | None = final_param()
    kernel: Any = component(
        "kernel", default="dance", help="the stochastic kernel of every step (the reference: dance)"
    )

    share_noise: bool = attrs.field(default=True, init=False)  # a tree grows from one noise per prompt
    iteration: int = attrs.field(default=0, init=False)

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        errors = super().check_keys(keys, prefix)
        steps = keys.get("steps")
        if steps is None:
            return errors
        for name, high in (("split_points", steps - 1), ("depth_pruning", steps)):
            given = keys.get(name)
            if given is not None and any(v > high or (name == "depth_pruning" and v < 1) for v in given):
                low = 1 if name == "depth_pruning" else 0
                errors.append(
                    ConfigError(key(prefix, name), f"got {list(given)!r}; allowed: values in {low} .. {high}")
                )
        return errors

    @staticmethod
    def check_recipe(resolved: Mapping[str, Any]) -> list[ConfigError]:
        sampler, train = resolved.get("sampler") or {}, resolved.get("train") or {}
        group_size = train.get("group_size") if isinstance(train, Mapping) else None
        if not isinstance(group_size, int):
            return []
        error = group_error(int(sampler.get("steps", 20)), sampler.get("split_points"), group_size)
        return [ConfigError("train.group_size", error)] if error else []

    # --- the tree --------------------------------------------------------------------------------

    def splits(self, group_size: int) -> list[int]:
        error = group_error(self.steps, self.split_points, group_size)
        if error:
            raise ValueError(f"sampler.split_points: {error}")
        given = self.split_points
        return sorted(given) if given is not None else default_splits(self.steps, group_size)

    def pruned_depths(self, splits: Sequence[int]) -> set[int]:
        """The child depths not trained this iteration (the reference's sliding window)."""
        if not self.depth_pruning:
            return set()
        base = sorted(self.depth_pruning)
        if not self.depth_pruning_slide:
            return set(base)
        stop = self.depth_pruning_stop_depth
        stop = (max(splits) if splits else 0) if stop is None else int(stop)
        # the reference counts its training steps from 1 (fgrpo's iteration 0 is its step 1)
        shift = min((self.iteration + 1) // self.depth_pruning_slide_interval, max(0, base[0] - stop))
        return {d - shift for d in base}

    def width_pruned(self, trained: list[int], splits: Sequence[int]) -> list[int]:
        """``width_pruning: 1``: the trained steps after the last split point cut to their first
        max(1, int(n * ratio)). The reference sorts each last-split branch's later edges by advantage
        and keeps the best; those edges all lead to nodes of one leaf at depths where every node is a
        leaf, so they share one advantage and its stable sort keeps them in step order."""
        if not self.width_pruning or not splits:
            return trained
        later = [s for s in trained if s > max(splits)]
        if not later:
            return trained
        keep = max(1, int(len(later) * self.width_pruning_ratio))
        return [s for s in trained if s <= max(splits)] + later[:keep]

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        raise NotImplementedError("branch grows a tree: its rollout is its own (BranchSampler.rollout)")

    def rollout(
        self,
        policy: Policy,
        prompts: Sequence[str],
        group_size: int,
        *,
        generator: torch.Generator | None = None,
    ) -> Trajectory:
        prompts, group = list(prompts), int(group_size)
        if not prompts:
            raise ValueError("rollout needs at least one prompt")
        splits = self.splits(group)
        sigmas = self.sigmas(policy, self.steps)
        final = resolve_final(self.final, self.kernel)
        if final == "ode" and self.steps - 1 in splits:
            raise ValueError(
                f"sampler.final: 'ode' makes the last step {self.steps - 1} deterministic; it cannot split"
            )
        kernels = [EULER if (final == "ode" and i == self.steps - 1) else self.kernel for i in range(self.steps)]
        stds = self.kernel_stds(sigmas)
        pruned = self.pruned_depths(splits)
        trained = [i for i in range(self.steps) if kernels[i] is self.kernel and stds[i] > 0 and i + 1 not in pruned]
        trained = self.width_pruned(trained, splits)
        if not trained:
            raise ValueError(
                f"no edge of the tree to train: std {stds.tolist()} on {sigmas.tolist()}, "
                f"pruned depths {sorted(pruned)}"
            )
        tree = Tree(group, splits, len(prompts))
        table = torch.tensor(trained, dtype=torch.long).expand(tree.batch, len(trained)).clone()
        steps = [Step(k, sigmas, i, tree.phase(i)) for i, k in enumerate(kernels)]
        plan = Plan(
            steps,
            prefix=min(splits) + 1 if splits else self.steps,  # evaluated once per tree, the first split too
            phases=("shared", "leaves"),
            info={"split_points": splits, "nodes": tree.nodes_per_step(self.steps), "pruned_depths": sorted(pruned)},
            sigmas=sigmas,
            trained=table,
            share_noise=True,
            final=final,
        )
        traj = grow(policy, prompts, plan, tree, self.split_noise_scale, generator)
        traj.step_nodes = tree.step_nodes(trained).to(traj.step_index.device)
        traj.policy_weight = tree.owners(trained).to(traj.step_index.device)
        traj.info["tree_edges"] = int(traj.policy_weight.sum().item())
        return traj

    def advance(self, iteration: int) -> None:
        self.iteration = int(iteration)

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.iteration = int(state.get("iteration", 0))


@attrs.frozen
class Tree:
    """The shape of the trees of a rollout: ``leaves`` = G per prompt, binary splits at ``splits``,
    ``prompts`` trees side by side (prompt-major; the children of node j are 2j and 2j + 1)."""

    leaves: int
    splits: list[int]
    prompts: int

    @property
    def batch(self) -> int:
        return self.prompts * self.leaves

    def nodes_after(self, step: int) -> int:
        """Nodes per tree at depth step + 1 (the children of step ``step``)."""
        return 2 ** sum(1 for s in self.splits if s <= step)

    def nodes_per_step(self, steps: int) -> list[int]:
        """Nodes per tree that every step evaluates (at depth ``step``)."""
        return [self.nodes_after(i - 1) if i else 1 for i in range(steps)]

    def phase(self, step: int) -> str:
        return "leaves" if step and self.nodes_after(step - 1) == self.leaves else "shared"

    def leaf_rows(self, step: int) -> torch.Tensor:
        """(B,) the row of each leaf's node after step ``step`` among the rollout's nodes then."""
        return torch.arange(self.batch) // (self.leaves // self.nodes_after(step))

    def step_nodes(self, trained: Sequence[int]) -> torch.Tensor:
        """(B, S) the node (within its tree) each trained step of each leaf leads to."""
        leaf = torch.arange(self.batch) % self.leaves
        return torch.stack([leaf // (self.leaves // self.nodes_after(s)) for s in trained], 1)

    def owners(self, trained: Sequence[int]) -> torch.Tensor:
        """(B, S) 1 where the leaf is the first below the step's node (it trains the edge), else 0."""
        leaf = torch.arange(self.batch) % self.leaves
        return torch.stack([(leaf % (self.leaves // self.nodes_after(s)) == 0).float() for s in trained], 1)


def grow(
    policy: Policy,
    prompts: list[str],
    plan: Plan,
    tree: Tree,
    split_noise_scale: float,
    generator: torch.Generator | None,
) -> Trajectory:
    """Run the trees: one network evaluation per node and step, two children at a split (noise
    drawn in float32 from ``generator``, node by node, child by child), and the record of every
    trained step as the path of each leaf."""
    assert plan.trained is not None and plan.sigmas is not None  # BranchSampler.rollout completed the plan
    device, epc = torch.device(policy.device), int(policy.evaluations_per_call)
    with torch.no_grad():
        cond_p = policy.encode(prompts)
        conds = {1: cond_p}
        x = torch.as_tensor(policy.initial_noise(len(prompts), generator=generator)).to(device, torch.float32)
        record = Record.empty(plan.trained, len(plan.steps), tuple(x.shape[1:]), device)
        nfe: dict[str, int] = dict.fromkeys(plan.phases, 0)
        x0 = x
        for i, step in enumerate(plan.steps):
            per_tree = x.shape[0] // len(prompts)
            if per_tree not in conds:
                conds[per_tree] = tensors.repeat_interleave(cond_p, per_tree)
            sigma = plan.sigmas[i].to(device=device, dtype=torch.float32).reshape(1).repeat(x.shape[0])
            velocity = policy.velocity(x, sigma, conds[per_tree])
            nfe[step.phase] += x.shape[0] * epc
            split = i in tree.splits
            if split:  # both children start from the parent's state and its one evaluation
                x, velocity = x.repeat_interleave(2, 0), velocity.repeat_interleave(2, 0)
            noise = None
            if step.kernel.stochastic:
                noise = seeding.randn(tuple(x.shape), generator, device) * (split_noise_scale if split else 1.0)
            out = step.kernel.step(velocity, x, step.sigmas, step.index, noise=noise)
            rows = tree.leaf_rows(i).to(device)
            if i == len(plan.steps) - 1:
                s = sigma[:1].reshape(-1, *([1] * (x.dim() - 1)))
                x0 = (x - s * velocity.to(torch.float32))[rows]
            std = torch.as_tensor(out.std, dtype=torch.float32)
            leaf_out = SimpleNamespace(
                prev_sample=out.prev_sample[rows],
                mean=out.mean[rows],
                log_prob=out.log_prob[rows],
                std=std if std.numel() == 1 else std.reshape(std.shape[0], -1)[rows],
            )
            record.step(i, x[rows], leaf_out)
            x = out.prev_sample.to(torch.float32)
    record.check()
    final = x0 if plan.final == "x0" else x
    return trajectory(
        prompts, tree.leaves, plan, tensors.repeat_interleave(cond_p, tree.leaves), record, final, nfe, epc
    )
