"""An iteration's rollout and its advantages (scoring, between the two, is :mod:`fgrpo.core.scoring`).

Each is a plain function of the run and the data of the step before it; ``trainer.iteration``
calls them in order, then :func:`fgrpo.core.update.update`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from fgrpo.core import tensors
from fgrpo.core.advantages import combine
from fgrpo.core.ema import ema_weights
from fgrpo.core.protocols import Trajectory
from fgrpo.core.run import Run
from fgrpo.core.seeding import generator
from fgrpo.core.timing import TimedPolicy


@torch.no_grad()
def refresh_prompts(run: Run, iteration: int) -> bool | None:
    """A prompt source whose scenes depend on the policy (an optional ``refresh(policy, iteration,
    seed) -> bool``: e.g. starting states from the policy's own closed loop) updates them before
    the iteration's rollout; None when it has no such method. Its state travels in checkpoints
    (optional ``state_dict`` / ``load_state_dict``)."""
    refresh = getattr(run.prompts, "refresh", None)
    if refresh is None:
        return None
    return bool(refresh(run.learner.policy, iteration, run.recipe.seed))


def autocast(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager:
    if precision == "same":
        return contextlib.nullcontext()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[precision]
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def cat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    fields = ("group_index", "step_index", "latents", "next_latents", "log_probs", "means", "stds", "final")
    joined = {name: torch.cat([getattr(p, name) for p in parts]) for name in fields}
    ids = [p.sample_ids for p in parts if p.sample_ids is not None]
    sample_ids = torch.cat(ids) if len(ids) == len(parts) else None
    if first.policy_weight is not None:
        weights = [p.policy_weight for p in parts if p.policy_weight is not None]
        if len(weights) != len(parts):
            raise ValueError("trajectories to join: some have a policy_weight and some do not")
        joined["policy_weight"] = torch.cat(weights)
    if first.step_nodes is not None:  # numbered within each prompt's tree: chunks join as they are
        nodes = [p.step_nodes for p in parts if p.step_nodes is not None]
        if len(nodes) != len(parts):
            raise ValueError("trajectories to join: some have step_nodes and some do not")
        joined["step_nodes"] = torch.cat(nodes)
    return Trajectory(
        prompts=[p for part in parts for p in part.prompts],
        cond=tensors.cat([p.cond for p in parts]),
        sigmas=first.sigmas,
        nfe=sum(p.nfe for p in parts),
        info={"chunks": [p.info for p in parts]},
        sample_ids=sample_ids,
        **joined,
    )


@torch.no_grad()
def rollout(run: Run, iteration: int, on_chunk: Callable[[Trajectory], None] | None = None) -> Trajectory:
    """This process's prompt groups, rolled out in chunks whose noise depends only on the chunk's
    global prompt slots: 1 or N processes draw the same samples. ``on_chunk`` receives each
    chunk as soon as it is sampled (the reward worker scores it while the next one rolls out)."""
    cfg = run.recipe.train
    local = run.schedule.local(iteration)
    chunk = cfg.rollout_prompts or len(local)
    parts = []
    policy = TimedPolicy(run.learner.policy, run.io.clock)
    with run.io.display.bar("rollout", len(local)) as advance, sampling_policy(run):
        for start in range(0, len(local), chunk):
            slots, prompts = zip(*local[start : start + chunk], strict=True)
            g = generator(run.recipe.seed, "rollout", iteration, slots[0], device=run.learner.policy.device)
            with run.accelerator.autocast(), autocast(run.learner.policy.device, cfg.rollout_precision):
                traj = run.sampler.rollout(policy, list(prompts), cfg.group_size, generator=g)
            # group ids become global prompt slots: unique across chunks and processes
            traj.group_index = torch.as_tensor(slots, device=traj.group_index.device)[traj.group_index]
            traj.sample_ids = sample_ids(traj, cfg.group_size)
            parts.append(traj)
            if on_chunk is not None:
                on_chunk(traj)
            advance(len(slots))
    return cat_trajectories(parts)


def sample_ids(traj: Trajectory, group_size: int) -> torch.Tensor:
    """(B,) each sample's global id: its prompt group's global slot x G + its place in the group
    (a sampler keeps the G samples of a prompt adjacent)."""
    place = torch.arange(traj.batch_size, device=traj.group_index.device) % group_size
    return traj.group_index * group_size + place


def sampling_policy(run: Run) -> contextlib.AbstractContextManager:
    """The weights rollouts come from: the objective's old policy when it samples from it
    (DiffusionNFT), else the current ones."""
    return ema_weights(run.learner.old_policy if run.objective.samples_from_old else None)


def nfe_by_phase(traj: Trajectory) -> dict[str, int]:
    """The rollout's NFE split by the sampler's phases (prefix, window, flash, ...), over chunks."""
    out: dict[str, int] = {}
    for info in traj.info.get("chunks", [traj.info]):
        for phase, n in (info.get("nfe") or {}).items():
            out[phase] = out.get(phase, 0) + int(n)
    return out


def advantages(run: Run, traj: Trajectory, scores: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-normalised advantages computed on the whole batch gathered from every process
    (identically on each), then this process's slice."""
    acc, shares = run.accelerator, run.learner.launch  # a context-parallel group's replicas count once
    device = run.learner.policy.device
    gathered = {k: shares.one_per_share(acc.gather(v.to(device))) for k, v in scores.items()}
    groups = shares.one_per_share(acc.gather(traj.group_index.to(device)))
    weights = {spec.label or spec.name: spec.weight for spec in run.recipe.rewards}  # built specs carry their label
    cfg = run.recipe.train
    adv, stats = combine(
        gathered,
        weights,
        groups,
        mode=cfg.advantage,
        global_std=cfg.global_std,
        eps=cfg.advantage_eps,
        per_prompt=cfg.per_prompt,
        unbiased=cfg.advantage_std == "unbiased",
    )
    # what the update leaves out (samples whose advantage is exactly 0), over every process
    stats["dropped_fraction"] = (adv == 0).double().mean().item() if cfg.drop_zero_advantage else 0.0
    n = traj.batch_size
    local = adv[shares.data_rank * n : (shares.data_rank + 1) * n]
    return local.to(device=device, dtype=torch.float32), stats
