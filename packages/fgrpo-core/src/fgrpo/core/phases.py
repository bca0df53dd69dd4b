"""The phases of one training iteration: rollout, scoring, advantages, update.

Each is a plain function of the run and the data of the phase before it; ``trainer.iteration``
calls them in order.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch

from fgrpo.core import sharding, tensors
from fgrpo.core.advantages import combine
from fgrpo.core.config import shown
from fgrpo.core.protocols import StepBatch, Trajectory
from fgrpo.core.registry import ComponentError
from fgrpo.core.run import Run
from fgrpo.core.seeding import generator
from fgrpo.core.timing import TimedPolicy


class RewardError(ComponentError):
    """A reward returned something the update must not use (NaN, inf, a wrong shape)."""


# --- rollout -----------------------------------------------------------------------------------


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
    return Trajectory(
        prompts=[p for part in parts for p in part.prompts],
        cond=tensors.cat([p.cond for p in parts]),
        sigmas=first.sigmas,
        nfe=sum(p.nfe for p in parts),
        info={"chunks": [p.info for p in parts]},
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
    policy = TimedPolicy(run.policy, run.clock)
    with run.display.phase("rollout", len(local)) as advance:
        for start in range(0, len(local), chunk):
            slots, prompts = zip(*local[start : start + chunk], strict=True)
            g = generator(run.recipe.seed, "rollout", iteration, slots[0], device=run.policy.device)
            with run.accelerator.autocast(), autocast(run.policy.device, cfg.rollout_precision):
                traj = run.sampler.rollout(policy, list(prompts), cfg.group_size, generator=g)
            # group ids become global prompt slots: unique across chunks and processes
            traj.group_index = torch.as_tensor(slots, device=traj.group_index.device)[traj.group_index]
            parts.append(traj)
            if on_chunk is not None:
                on_chunk(traj)
            advance(len(slots))
    return cat_trajectories(parts)


def nfe_by_phase(traj: Trajectory) -> dict[str, int]:
    """The rollout's NFE split by the sampler's phases (prefix, window, flash, ...), over chunks."""
    out: dict[str, int] = {}
    for info in traj.info.get("chunks", [traj.info]):
        for phase, n in (info.get("nfe") or {}).items():
            out[phase] = out.get(phase, 0) + int(n)
    return out


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


def _batch(prompts: Sequence[str]) -> str:
    first = list(dict.fromkeys(prompts))[:3]
    more = ", ..." if len(set(prompts)) > 3 else ""
    return f"{len(prompts)} samples of the prompts {', '.join(shown(p) for p in first)}{more}"


def call_reward(spec: Any, call: Callable[[], Any], prompts: list[str], where: str) -> Any:
    """``call()`` (the reward on the batch); with ``spec.timeout_s``, in a daemon thread that is
    given up on (and the run stopped) after that many seconds. Any failure becomes a RewardError
    naming the reward and the prompts."""
    timeout = getattr(spec, "timeout_s", None)
    try:
        if timeout is None:
            return call()
        box: dict[str, Any] = {}
        grad = torch.is_grad_enabled()  # grad mode is per thread

        def target() -> None:
            try:
                with torch.set_grad_enabled(grad):
                    box["result"] = call()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc

        worker = threading.Thread(target=target, name=f"reward {spec.label}", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise RewardError(
                f"reward {spec.label!r} did not return within {timeout:g} s (reward.timeout_s) on {where} "
                f"({_batch(prompts)})"
            )
        if "error" in box:
            raise box["error"]
        return box["result"]
    except RewardError:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        raise RewardError(
            f"reward {spec.label!r} raised {type(exc).__name__}: {first} on {where} ({_batch(prompts)})"
        ) from exc


def score(rewards: Sequence[tuple[Any, Any]], outputs: Any, prompts: Sequence[str], metadata: Sequence[Any], *, where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every reward on the batch; a malformed result stops the run before an update uses it.
    Videos reach a reward frame by frame (every ``frame_stride``-th frame of the reward's spec)
    unless the reward declares ``accepts_video = True``."""
    scores: dict[str, torch.Tensor] = {}
    details: dict[str, Any] = {}
    prompts = list(prompts)
    for spec, reward in rewards:
        if is_video_batch(outputs) and not getattr(reward, "accepts_video", False):
            stride = getattr(spec, "frame_stride", 1)
            call = functools.partial(score_frames, reward, outputs, prompts, metadata, stride)
        else:
            call = functools.partial(reward, outputs, prompts, list(metadata))
        result = call_reward(spec, call, prompts, where)
        if not hasattr(result, "scores"):
            raise RewardError(
                f"reward {spec.label!r} returned {shown(result)} for {where} ({_batch(prompts)}); "
                "expected a RewardResult(scores=...)"
            )
        try:
            s = torch.as_tensor(result.scores).detach()
            if s.is_complex():
                raise TypeError
        except (TypeError, ValueError, RuntimeError):
            raise RewardError(
                f"reward {spec.label!r} returned scores {shown(result.scores)} for {where} ({_batch(prompts)}); "
                "expected a tensor of numbers"
            ) from None
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
                f"(sample {i}, prompt {shown(prompts[i])}; {int(bad.sum())} non-finite of {len(prompts)})"
            )
        scores[spec.label] = s.float()
        details[spec.label] = getattr(result, "details", {})
    return scores, details


def detail_means(details: dict[str, Any], by_category: bool = True) -> dict[str, float]:
    """Mean of every per-sample float detail; when the reward reports a ``category`` per sample
    (e.g. GenEval-like categories) and ``by_category``, also the mean per category as
    ``key/category`` and, with several categories, their unweighted mean as ``key/overall``
    (GenEval's overall score: every task counts the same, however many prompts it has)."""
    numeric = {}
    for key, value in details.items():
        t = torch.as_tensor(value) if isinstance(value, (list, tuple)) and value and isinstance(value[0], (int, float, bool)) else value
        if isinstance(t, torch.Tensor) and t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool):
            numeric[key] = t.float().reshape(-1).cpu()
    out = {key: t.mean().item() for key, t in numeric.items()}
    categories = details.get("category")
    if by_category and isinstance(categories, (list, tuple)) and categories and all(isinstance(c, str) for c in categories):
        names = sorted(set(categories))
        masks = [torch.tensor([c == name for c in categories]) for name in names]
        for key, t in numeric.items():
            if len(t) != len(categories):
                continue
            per_category = [t[mask].mean().item() for mask in masks]
            out.update({f"{key}/{name}": m for name, m in zip(names, per_category, strict=True)})
            if len(names) > 1:
                out[f"{key}/overall"] = sum(per_category) / len(per_category)
    return out


def cat_details(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-sample details of consecutive chunks joined (tensors concatenated, lists extended);
    a key that is not per-sample in every chunk is left out."""
    joined: dict[str, Any] = {}
    for key in parts[0] if parts else ():
        values = [part.get(key) for part in parts]
        tensors = [v for v in values if isinstance(v, torch.Tensor) and v.dim()]
        sequences = [v for v in values if isinstance(v, (list, tuple))]
        if len(tensors) == len(values):
            joined[key] = torch.cat([v.reshape(len(v), -1).squeeze(1) for v in tensors])
        elif len(sequences) == len(values):
            joined[key] = [item for v in sequences for item in v]
    return joined


def decode_and_score(run: Run, traj: Trajectory, where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The rollout's outputs decoded and scored by every reward, each phase on the run's clock:
    the scores and each reward's per-sample details."""
    with run.clock.phase("decode"):
        outputs = decode(run, traj)
    metadata = [run.prompts.metadata(p) for p in traj.prompts]
    with run.clock.phase("reward"):
        return score(run.rewards, outputs, traj.prompts, metadata, where=where)


class RewardWorker:
    """Decodes and scores rollout chunks in one background thread while the main thread rolls
    out the next chunk (``train.reward_worker``; overlap needs ``train.rollout_prompts`` smaller
    than the batch). Rewards that wait (a remote judge, an OCR engine releasing the GIL) then
    cost little more than the rollout; errors surface in :meth:`scores`."""

    def __init__(self, run: Run, where: str):
        self.run, self.where = run, where
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fgrpo-reward")
        self._futures: list[Any] = []

    def submit(self, chunk: Trajectory) -> None:
        self._futures.append(self._pool.submit(self._score, chunk))

    def _score(self, chunk: Trajectory) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        with torch.no_grad():
            return decode_and_score(self.run, chunk, self.where)

    def scores(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every chunk's scores and details, joined in rollout order (waits for the last ones)."""
        try:
            parts = [f.result() for f in self._futures]
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
        scores = {k: torch.cat([s[k] for s, _ in parts]) for k in parts[0][0]}
        return scores, {k: cat_details([d[k] for _, d in parts]) for k in parts[0][1]}


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
    nfe: int = 0  # the update's forwards, the reference pass included
    reference_nfe: int = 0  # the reference pass alone
    first_ratio_deviation: torch.Tensor | None = None  # max |ratio - 1| before the first optimizer step
    grad_norms: list[torch.Tensor] = attrs.Factory(list)


def pair_batches(traj: Trajectory, samples: torch.Tensor, per_forward: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sample, step) pairs of the given samples, sample-major, in forward passes of ``per_forward``."""
    steps = traj.num_trained_steps
    rows = samples.repeat_interleave(steps)
    cols = torch.arange(steps).repeat(len(samples))
    size = per_forward or len(rows)
    return list(zip(rows.split(size), cols.split(size), strict=True))


def step_batch(
    run: Run, traj: Trajectory, adv: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, ref: Reference | None = None
) -> tuple[StepBatch, int]:
    """Re-evaluate the stored actions of these (sample, step) pairs under the current policy
    (``ref``: the reference pass of the KL term, see :func:`reference`)."""
    policy, kernel = TimedPolicy(run.policy, run.clock), run.sampler.kernel
    x = traj.latents[rows, cols]
    x_next = traj.next_latents[rows, cols]
    index = traj.step_index[rows, cols]
    sigmas = traj.sigmas
    cond = tensors.index(traj.cond, rows)
    v = policy.velocity(x, sigmas[index], cond)
    new = kernel.step(v, x, sigmas, index, prev_sample=x_next)
    nfe = len(rows) * policy.evaluations_per_call
    ref_mean = ref_velocity = None
    if ref is not None:
        ref_mean, ref_velocity = ref.mean[rows, cols], ref.velocity[rows, cols]
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


@attrs.frozen
class Reference:
    """The reference policy's mean and velocity at every stored (x_t, t): (B, S, *shape) each."""

    mean: torch.Tensor
    velocity: torch.Tensor
    nfe: int


@torch.no_grad()
def reference(run: Run, traj: Trajectory, samples: torch.Tensor) -> Reference | None:
    """The KL term's reference prediction of every trained (sample, step) pair of ``samples``,
    computed once per iteration without gradient (the reference does not change during the
    update, whatever the number of inner epochs), in forward passes of
    ``train.reference_batch_size`` pairs under one switch to the reference; None when the
    objective needs no reference."""
    if not run.objective.needs_reference:
        return None
    cfg = run.recipe.train
    policy, kernel = TimedPolicy(run.policy, run.clock), run.sampler.kernel
    mean = torch.zeros_like(traj.means)
    velocity = torch.zeros_like(traj.means)
    nfe = 0
    passes = pair_batches(traj, samples.to(traj.latents.device), cfg.reference_batch_size or cfg.micro_batch_size) if len(samples) else []
    # sharded weights: every process makes as many forwards (each one all-gathers the weights)
    padding = sharding.missing_passes(run.accelerator, len(passes)) if run.sharded_weights else 0
    with policy.reference():
        for rows, cols in passes:
            x, index = traj.latents[rows, cols], traj.step_index[rows, cols]
            with run.accelerator.autocast():
                v = policy.velocity(x, traj.sigmas[index], tensors.index(traj.cond, rows))
            velocity[rows, cols] = v.float()
            mean[rows, cols] = kernel.step(v, x, traj.sigmas, index, prev_sample=traj.next_latents[rows, cols]).mean
            nfe += len(rows) * policy.evaluations_per_call
        first = torch.zeros(1, dtype=torch.long, device=traj.latents.device)
        for _ in range(padding):
            with run.accelerator.autocast():
                policy.velocity(traj.latents[first, first], traj.sigmas[traj.step_index[first, first]], tensors.index(traj.cond, first))
    return Reference(mean=mean, velocity=velocity, nfe=nfe)


def sync_gradients(run: Run, params: Sequence[torch.nn.Parameter]) -> None:
    """Average gradients over processes: one all-reduce of a flat buffer per optimizer step.
    (A Policy need not be one nn.Module, so DDP's forward hooks are not used.) A sharded run's
    gradients were averaged by FSDP's reduce-scatter in backward: nothing to do."""
    if run.accelerator.num_processes == 1 or run.sharded:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = run.accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="mean")
    offset = 0
    for p, g in zip(params, grads, strict=True):
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
        assert batch.velocity is not None  # step_batch always computes it
        sharding.backward(run.accelerator, batch.velocity.float().sum() * 0.0)


def optimizer_step(run: Run, params: Sequence[torch.nn.Parameter]) -> torch.Tensor | None:
    """One optimizer step on the accumulated gradients: averaged over the processes, unscaled
    (fp16), clipped to ``train.max_grad_norm``; returns the norm before clipping (None without
    clipping). DeepSpeed does all of it in ``engine.step()``."""
    cfg, acc = run.recipe.train, run.accelerator
    engine = sharding.deepspeed_engine(acc)
    if engine is not None:
        norm = sharding.deepspeed_step(engine)
        return norm if cfg.max_grad_norm > 0 else None
    scaler = getattr(acc, "scaler", None)
    sync_gradients(run, params)
    if scaler is not None:
        scaler.unscale_(run.optimizer)  # after the all-reduce: every process sees the same inf/nan
    norm = None
    if cfg.max_grad_norm > 0:
        norm = sharding.full(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)).detach()
    if scaler is not None:
        scaler.step(run.optimizer)
        scaler.update()
    else:
        run.optimizer.step()
    return norm


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
    stats = UpdateStats()
    params = run.trainable
    n = traj.batch_size
    per_step = cfg.minibatch_size or n
    accumulate = max(1, int(acc.gradient_accumulation_steps))
    kept, most = informative(run, adv)
    stats.samples = len(kept)
    ref = reference(run, traj, kept)
    stats.reference_nfe = stats.nfe = ref.nfe if ref is not None else 0
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
                # sharded: every process makes as many passes (each backward reduces gradients over them)
                padding = sharding.missing_passes(acc, len(passes)) if run.sharded else 0
                for rows, cols in passes:
                    with acc.autocast():
                        batch, nfe = step_batch(run, traj, adv, rows, cols, ref)
                        out = run.objective(batch)
                    loss = out.loss * (len(rows) / total_pairs)
                    with run.clock.section("model"):
                        sharding.backward(acc, loss)
                    stats.nfe += nfe
                    for key, value in out.metrics.items():
                        stats.metrics[key].append(value.detach())
                    if stats.optimizer_steps == 0:  # on device: read once, by summarize
                        dev = (batch.log_prob.detach() - batch.old_log_prob).exp().sub(1).abs().max()
                        worst = stats.first_ratio_deviation
                        stats.first_ratio_deviation = dev if worst is None else torch.maximum(worst, dev)
                idle_passes(run, traj, adv, padding)
                norm = optimizer_step(run, params)
                if norm is not None:
                    stats.grad_norms.append(norm)
                stats.optimizer_steps += 1
                run.optimizer_steps += 1
                if run.ema is not None and run.ema.due(run.optimizer_steps, cfg.ema_every, cfg.ema_rule):
                    for _ in range(cfg.ema_repeats):  # flow_grpo: once per minibatch, the weights unchanged in between
                        run.ema.update(run.ema.warmup_decay(run.optimizer_steps) if cfg.ema_warmup else None)
                advance()
    return stats


def summarize(stats: UpdateStats) -> dict[str, float]:
    """The update's metrics as numbers: everything the loop kept on device is read here, in one
    transfer."""
    keys = list(stats.metrics)
    values = []
    for key in keys:
        stacked = torch.stack([v.float().reshape(()) for v in stats.metrics[key]])
        values.append(stacked.min() if key.endswith("_min") else stacked.max() if key.endswith("_max") else stacked.mean())
    if stats.grad_norms:
        keys.append("grad_norm")
        values.append(torch.stack([g.float().reshape(()) for g in stats.grad_norms]).mean())
    if stats.first_ratio_deviation is not None:
        keys.append("first_ratio_deviation")
        values.append(torch.as_tensor(stats.first_ratio_deviation).float().reshape(()))
    out: dict[str, float] = dict(zip(keys, torch.stack(values).double().tolist(), strict=True)) if values else {}
    out["optimizer_steps"] = stats.optimizer_steps
    out["trained_samples"] = stats.samples
    out["nfe_reference"] = stats.reference_nfe
    return out
