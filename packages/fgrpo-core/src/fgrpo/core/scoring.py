"""Scoring: the rewards on a batch of outputs, checked before anything uses them (the trainer's
scoring phase, evaluation, ``fgrpo sample``'s scores), and the per-sample details they report
averaged into metrics.

A reward runs on the batch (videos frame by frame unless it accepts videos), with a deadline when
its spec sets ``timeout_s``; a failure or a malformed result stops the run with a
:class:`RewardError` naming the reward and the prompts.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fgrpo.core import media
from fgrpo.core.config import first_line, shown
from fgrpo.core.protocols import Trajectory
from fgrpo.core.registry import ComponentError
from fgrpo.core.run import Run


class RewardError(ComponentError):
    """A reward returned something the update must not use (NaN, inf, a wrong shape)."""


@torch.no_grad()
def decode(run: Run, traj: Trajectory) -> Any:
    return run.learner.policy.decode(traj.final)


def is_video_batch(outputs: Any) -> bool:
    return isinstance(outputs, torch.Tensor) and outputs.dim() == 5 and outputs.shape[2] == 3


def score_frames(
    reward: Any, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Any], stride: int, **sources: Any
) -> Any:
    """An image reward on videos (B, T, 3, H, W): frames 0, stride, 2 stride, ... of every video
    scored as images with their video's prompt, metadata (and ``sources``, when the reward takes
    them); a video's score is the mean over its frames, numeric details are averaged per video,
    other details listed per video."""
    from fgrpo.core.protocols import RewardResult

    frames = videos[:, ::stride]
    b, t = frames.shape[:2]
    per_frame = {k: [s for s in v for _ in range(t)] for k, v in sources.items()}
    result = reward(
        frames.reshape(b * t, *frames.shape[2:]),
        [p for p in prompts for _ in range(t)],
        [m for m in metadata for _ in range(t)],
        **per_frame,
    )
    scores = torch.as_tensor(result.scores).detach()
    if scores.shape != (b * t,):
        return result  # malformed: reported by score() with the shape it has
    details: dict[str, Any] = {}
    for key, value in result.details.items():
        if (
            isinstance(value, torch.Tensor)
            and value.shape[:1] == (b * t,)
            and (value.is_floating_point() or value.dtype == torch.bool)
        ):
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
        raise RewardError(
            f"reward {spec.label!r} raised {type(exc).__name__}: {first_line(exc)} on {where} ({_batch(prompts)})"
        ) from exc


def score(
    rewards: Sequence[tuple[Any, Any]],
    outputs: Any,
    prompts: Sequence[str],
    metadata: Sequence[Any],
    *,
    where: str,
    groups: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every reward on the batch; a malformed result stops the run before an update uses it.
    Videos reach a reward frame by frame (every ``frame_stride``-th frame of the reward's spec)
    unless the reward declares ``accepts_video = True``. A reward that declares
    ``accepts_sources = True`` also gets ``sources=``: each sample's source images
    (:func:`fgrpo.core.media.reward_sources`). A group-aware reward (``groupwise = True``) also
    receives ``groups``, each sample's prompt group (the batch holds whole groups)."""
    scores: dict[str, torch.Tensor] = {}
    details: dict[str, Any] = {}
    prompts = list(prompts)
    sources: list[Any] | None = None
    for spec, reward in rewards:
        extra = {}
        if getattr(reward, "accepts_sources", False):  # loaded once for every reward that takes them
            sources = media.reward_sources(prompts, outputs) if sources is None else sources
            extra["sources"] = sources
        if getattr(reward, "groupwise", False):
            if groups is None:
                raise RewardError(f"reward {spec.label!r} judges whole prompt groups, and {where} gave none")
            call = functools.partial(reward, outputs, prompts, list(metadata), groups=groups, **extra)
        elif is_video_batch(outputs) and not getattr(reward, "accepts_video", False):
            stride = getattr(spec, "frame_stride", 1)
            call = functools.partial(score_frames, reward, outputs, prompts, metadata, stride, **extra)
        else:
            call = functools.partial(reward, outputs, prompts, list(metadata), **extra)
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
        t = (
            torch.as_tensor(value)
            if isinstance(value, (list, tuple)) and value and isinstance(value[0], (int, float, bool))
            else value
        )
        if isinstance(t, torch.Tensor) and t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool):
            numeric[key] = t.float().reshape(-1).cpu()
    out = {key: t.mean().item() for key, t in numeric.items()}
    categories = details.get("category")
    if (
        by_category
        and isinstance(categories, (list, tuple))
        and categories
        and all(isinstance(c, str) for c in categories)
    ):
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
    with run.io.clock.span("decode"):
        outputs = decode(run, traj)
    metadata = [run.prompts.metadata(p) for p in traj.prompts]
    with run.io.clock.span("reward"):
        return score(run.rewards, outputs, traj.prompts, metadata, where=where, groups=traj.group_index.cpu())


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
