"""The phases of one training iteration: rollout, scoring, advantages, update.

Each is a plain function of the run and the data of the phase before it; ``trainer.iteration``
calls them in order.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from fgrpo.core import sharding, tensors
from fgrpo.core.advantages import combine
from fgrpo.core.protocols import StepBatch, Trajectory
from fgrpo.core.registry import ComponentError
from fgrpo.core.run import Run
from fgrpo.core.seeding import generator


class RewardError(ComponentError):
    """A reward returned something the update must not use (NaN, inf, a wrong shape)."""


# --- rollout -----------------------------------------------------------------------------------


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "same":
        return contextlib.nullcontext()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


def cat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    fields = ("group_index", "step_index", "latents", "next_latents", "log_probs", "means", "stds", "final")
    joined = {name: torch.cat([getattr(p, name) for p in parts]) for name in fields}
    return Trajectory(
        prompts=[p for part in parts for p in part.prompts],
        cond=tensors.cat([p.cond for p in parts]),
        sigmas=first.sigmas,
        nfe=sum(p.nfe for p in parts),
        info={"chunks": [p.info for p in parts]},
        **joined,
    )


@torch.no_grad()
def rollout(run: Run, iteration: int) -> Trajectory:
    """This process's prompt groups, rolled out in chunks whose noise depends only on the chunk's
    global prompt slots: 1 or N processes draw the same samples."""
    cfg = run.recipe.train
    local = run.schedule.local(iteration)
    chunk = cfg.rollout_prompts or len(local)
    parts = []
    with run.display.phase("rollout", len(local)) as advance:
        for start in range(0, len(local), chunk):
            slots, prompts = zip(*local[start : start + chunk])
            g = generator(run.recipe.seed, "rollout", iteration, slots[0], device=run.policy.device)
            with run.accelerator.autocast(), autocast(run.policy.device, cfg.rollout_precision):
                traj = run.sampler.rollout(run.policy, list(prompts), cfg.group_size, generator=g)
            # group ids become global prompt slots: unique across chunks and processes
            traj.group_index = torch.as_tensor(slots, device=traj.group_index.device)[traj.group_index]
            parts.append(traj)
            advance(len(slots))
    return cat_trajectories(parts)


# --- rewards -----------------------------------------------------------------------------------


@torch.no_grad()
def decode(run: Run, traj: Trajectory) -> Any:
    return run.policy.decode(traj.final)


def is_video_batch(outputs: Any) -> bool:
    return isinstance(outputs, torch.Tensor) and outputs.dim() == 5 and outputs.shape[2] == 3


def score_frames(reward: Any, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Any], stride: int) -> Any:
    """An image reward on videos (B, T, 3, H, W): frames 0, stride, 2 stride, ... of every video
    scored as images with their video's prompt and metadata; a video's score is the mean over its
    frames, numeric details are averaged per video, other details listed per video."""
    from fgrpo.core.protocols import RewardResult

    frames = videos[:, ::stride]
    b, t = frames.shape[:2]
    result = reward(frames.reshape(b * t, *frames.shape[2:]), [p for p in prompts for _ in range(t)], [m for m in metadata for _ in range(t)])
    scores = torch.as_tensor(result.scores).detach()
    if scores.shape != (b * t,):
        return result  # malformed: reported by score() with the shape it has
    details: dict[str, Any] = {}
    for key, value in result.details.items():
        if isinstance(value, torch.Tensor) and value.shape[:1] == (b * t,) and (value.is_floating_point() or value.dtype == torch.bool):
            details[key] = value.float().reshape(b, t, *value.shape[1:]).mean(dim=1)
        elif isinstance(value, (list, tuple)) and len(value) == b * t:
            details[key] = [list(value[i * t : (i + 1) * t]) for i in range(b)]
        else:
            details[key] = value
    return RewardResult(scores=scores.float().reshape(b, t).mean(dim=1), details=details)


def score(rewards: Sequence[tuple[Any, Any]], outputs: Any, prompts: Sequence[str], metadata: Sequence[Any], *, where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every reward on the batch; a malformed result stops the run before an update uses it.
    Videos reach a reward frame by frame (every ``frame_stride``-th frame of the reward's spec)
    unless the reward declares ``accepts_video = True``."""
    scores: dict[str, torch.Tensor] = {}
    details: dict[str, Any] = {}
    for spec, reward in rewards:
        if is_video_batch(outputs) and not getattr(reward, "accepts_video", False):
            result = score_frames(reward, outputs, prompts, metadata, getattr(spec, "frame_stride", 1))
        else:
            result = reward(outputs, list(prompts), list(metadata))
        s = torch.as_tensor(result.scores).detach()
        if s.shape != (len(prompts),):
            raise RewardError(
                f"reward {spec.label!r} returned scores of shape {tuple(s.shape)} for {where} "
                f"of {len(prompts)} samples; expected ({len(prompts)},)"
            )
        bad = ~torch.isfinite(s.float())
        if bad.any():
            i = int(bad.nonzero()[0])
            raise RewardError(
                f"reward {spec.label!r} returned {s[i].item()} for {where} "
                f"(sample {i}, prompt {prompts[i]!r}; {int(bad.sum())} non-finite of {len(prompts)})"
            )
        scores[spec.label] = s.float()
        details[spec.label] = result.details
    return scores, details


def advantages(run: Run, traj: Trajectory, scores: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-normalised advantages computed on the whole batch gathered from every process
    (identically on each), then this process's slice."""
    acc = run.accelerator
    device = run.policy.device
    gathered = {k: acc.gather(v.to(device)) for k, v in scores.items()}
    groups = acc.gather(traj.group_index.to(device))
    weights = {spec.label: spec.weight for spec in run.recipe.rewards}
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
    local = adv[acc.process_index * n : (acc.process_index + 1) * n]
    return local.to(device=device, dtype=torch.float32), stats


# --- update ------------------------------------------------------------------------------------


@attrs.define
class UpdateStats:
    metrics: dict[str, list[torch.Tensor]] = attrs.Factory(lambda: defaultdict(list))
    optimizer_steps: int = 0
    samples: int = 0  # samples the update trained on (after the zero-advantage filter)
    nfe: int = 0
    first_ratio_deviation: float | None = None  # max |ratio - 1| before the first optimizer step
    grad_norms: list[float] = attrs.Factory(list)


def pair_batches(traj: Trajectory, samples: torch.Tensor, per_forward: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sample, step) pairs of the given samples, sample-major, in forward passes of ``per_forward``."""
    steps = traj.num_trained_steps
    rows = samples.repeat_interleave(steps)
    cols = torch.arange(steps).repeat(len(samples))
    size = per_forward or len(rows)
    return list(zip(rows.split(size), cols.split(size)))


def step_batch(run: Run, traj: Trajectory, adv: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> tuple[StepBatch, int]:
    """Re-evaluate the stored actions of these (sample, step) pairs under the current policy."""
    policy, kernel = run.policy, run.sampler.kernel
    x = traj.latents[rows, cols]
    x_next = traj.next_latents[rows, cols]
    index = traj.step_index[rows, cols]
    sigmas = traj.sigmas
    cond = tensors.index(traj.cond, rows)
    v = policy.velocity(x, sigmas[index], cond)
    new = kernel.step(v, x, sigmas, index, prev_sample=x_next)
    nfe = len(rows) * policy.evaluations_per_call
    ref_mean = ref_velocity = None
    if run.objective.needs_reference:
        with torch.no_grad(), policy.reference():
            ref_velocity = policy.velocity(x, sigmas[index], cond)
            ref_mean = kernel.step(ref_velocity, x, sigmas, index, prev_sample=x_next).mean
        nfe *= 2
    batch = StepBatch(
        log_prob=new.log_prob,
        old_log_prob=traj.log_probs[rows, cols],
        advantages=adv[rows],
        mean=new.mean,
        old_mean=traj.means[rows, cols],
        std=traj.stds[rows, cols],
        dt=sigmas[index + 1] - sigmas[index],
        velocity=v,
        ref_mean=ref_mean,
        ref_velocity=ref_velocity,
    )
    return batch, nfe


def sync_gradients(run: Run, params: Sequence[torch.nn.Parameter]) -> None:
    """Average gradients over processes: one all-reduce of a flat buffer per optimizer step.
    (A Policy need not be one nn.Module, so DDP's forward hooks are not used.) A sharded run's
    gradients were averaged by FSDP's reduce-scatter in backward: nothing to do."""
    if run.accelerator.num_processes == 1 or run.sharded:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = run.accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="mean")
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def idle_passes(run: Run, traj: Trajectory, adv: torch.Tensor, count: int) -> None:
    """``count`` forward/backward passes that change no gradient (loss weight 0), on this process's
    first (sample, step) pair: in a sharded run every process must make as many passes as the
    busiest one, since each pass all-gathers parameters and reduce-scatters gradients."""
    one = torch.zeros(1, dtype=torch.long, device=traj.latents.device)
    for _ in range(count):
        with run.accelerator.autocast():
            batch, _ = step_batch(run, traj, adv, one, one)
        (batch.velocity.float().sum() * 0.0).backward()


def informative(run: Run, adv: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This process's samples the update trains on, and the most any process has.

    With ``train.drop_zero_advantage`` (flow_grpo) samples whose advantage is exactly 0 (flat
    groups) are left out, so the policy loss and the KL average over informative samples only;
    otherwise every sample."""
    n = adv.shape[0]
    if not run.recipe.train.drop_zero_advantage:
        return torch.arange(n), n
    kept = (adv != 0).nonzero().squeeze(1).cpu()
    counts = run.accelerator.gather(torch.tensor([len(kept)], device=adv.device))
    return kept, int(counts.max())


def minibatches(kept: torch.Tensor, most: int, n: int, per_step: int, order: torch.Tensor | None) -> list[torch.Tensor]:
    """``kept`` (in the order ``order`` permutes them) split into the minibatches of one epoch.

    Without dropped samples: minibatches of ``per_step`` samples. When samples were dropped, each
    minibatch shrinks in proportion (ceil(most * per_step / n) samples), as flow_grpo's keep their
    number; every process makes the same number of minibatches (empty ones where it has fewer
    samples), since each one ends with a gradient all-reduce."""
    if most == 0:
        return []
    size = math.ceil(most * per_step / n)
    chunks = list((kept if order is None else kept[order]).split(size))
    return chunks + [kept[:0]] * (math.ceil(most / size) - len(chunks))


def update(run: Run, traj: Trajectory, adv: torch.Tensor, iteration: int) -> UpdateStats:
    """``inner_epochs`` passes over the samples in minibatches; an optimizer step every
    ``gradient_accumulation_steps`` minibatches (accelerate's setting by default, 1), its gradient
    the mean over all their (sample, step) pairs. Forwards run under the run's mixed precision
    (accelerate's autocast); with fp16 the loss is scaled (accelerate's GradScaler)."""
    cfg = run.recipe.train
    acc = run.accelerator
    scaler = getattr(acc, "scaler", None)
    stats = UpdateStats()
    params = run.trainable
    n = traj.batch_size
    per_step = cfg.minibatch_size or n
    accumulate = max(1, int(acc.gradient_accumulation_steps))
    kept, most = informative(run, adv)
    stats.samples = len(kept)
    per_epoch = math.ceil(most / math.ceil(most * per_step / n)) if most else 0
    total_steps = cfg.inner_epochs * math.ceil(per_epoch / accumulate)
    with run.display.phase("update", total_steps) as advance:
        for epoch in range(cfg.inner_epochs):
            order = (
                torch.randperm(len(kept), generator=generator(run.recipe.seed, "minibatch", iteration, epoch))
                if cfg.shuffle_minibatches
                else None
            )
            batches = minibatches(kept, most, n, per_step, order)
            for first in range(0, len(batches), accumulate):
                group = batches[first : first + accumulate]
                run.optimizer.zero_grad(set_to_none=True)
                total_pairs = sum(len(samples) for samples in group) * traj.num_trained_steps
                passes = [
                    pair for samples in group if len(samples)
                    for pair in pair_batches(traj, samples.to(traj.latents.device), cfg.micro_batch_size)
                ]
                # sharded: every process makes as many passes (each one all-gathers and reduce-scatters)
                padding = sharding.missing_passes(acc, len(passes)) if run.sharded else 0
                for rows, cols in passes:
                    with acc.autocast():
                        batch, nfe = step_batch(run, traj, adv, rows, cols)
                        out = run.objective(batch)
                    loss = out.loss * (len(rows) / total_pairs)
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    stats.nfe += nfe
                    for key, value in out.metrics.items():
                        stats.metrics[key].append(value.detach())
                    if stats.optimizer_steps == 0:
                        dev = (batch.log_prob.detach() - batch.old_log_prob).exp().sub(1).abs().max().item()
                        stats.first_ratio_deviation = max(stats.first_ratio_deviation or 0.0, dev)
                idle_passes(run, traj, adv, padding)
                sync_gradients(run, params)
                if scaler is not None:
                    scaler.unscale_(run.optimizer)  # after the all-reduce: every process sees the same inf/nan
                if cfg.max_grad_norm > 0:
                    norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                    stats.grad_norms.append(float(sharding.full(norm)))
                if scaler is not None:
                    scaler.step(run.optimizer)
                    scaler.update()
                else:
                    run.optimizer.step()
                stats.optimizer_steps += 1
                run.optimizer_steps += 1
                if run.ema is not None and run.optimizer_steps % cfg.ema_every == 0:
                    run.ema.update(run.ema.warmup_decay(run.optimizer_steps) if cfg.ema_warmup else None)
                advance()
    return stats


def summarize(stats: UpdateStats) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, values in stats.metrics.items():
        stacked = torch.stack([v.float().reshape(()) for v in values])
        if key.endswith("_min"):
            out[key] = stacked.min().item()
        elif key.endswith("_max"):
            out[key] = stacked.max().item()
        else:
            out[key] = stacked.mean().item()
    out["optimizer_steps"] = stats.optimizer_steps
    out["trained_samples"] = stats.samples
    if stats.grad_norms:
        out["grad_norm"] = sum(stats.grad_norms) / len(stats.grad_norms)
    if stats.first_ratio_deviation is not None:
        out["first_ratio_deviation"] = stats.first_ratio_deviation
    return out
