"""Deterministic generation (Euler steps of the flow ODE), and evaluation on the held-out prompts."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fgrpo.core import media, tensors, trackers, visuals
from fgrpo.core.advantages import total_reward
from fgrpo.core.config import ConfigError, RecipeError, first_line, shown
from fgrpo.core.ema import ema_weights
from fgrpo.core.protocols import EvalContext, EvaluatorResult
from fgrpo.core.registry import ComponentError
from fgrpo.core.run import Run
from fgrpo.core.scoring import detail_means, score
from fgrpo.core.seeding import generator


@torch.no_grad()
def generate(
    policy: Any,
    prompts: Sequence[str],
    per_prompt: int,
    steps: int,
    g: torch.Generator | None,
    *,
    sigmas: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> Any:
    """``per_prompt`` samples of each prompt (prompt-major): Euler steps x + dt v of the flow ODE in
    float32 on ``sigmas`` (default: the policy's own schedule of ``steps`` steps), from ``noise``
    (default: drawn from ``g``)."""
    cond = tensors.repeat_interleave(policy.encode(list(prompts)), per_prompt)
    n = len(prompts) * per_prompt
    x = torch.as_tensor(policy.initial_noise(n, g) if noise is None else noise).to(torch.float32)
    sigmas = policy.sigmas(steps) if sigmas is None else sigmas
    sigmas = torch.as_tensor(sigmas).to(device=x.device, dtype=torch.float32)
    for i in range(sigmas.shape[0] - 1):
        v = policy.velocity(x, sigmas[i].expand(n), cond)
        x = x + (sigmas[i + 1] - sigmas[i]) * v.to(torch.float32)
    return policy.decode(x)


def evaluation_sigmas(run: Run) -> torch.Tensor | None:
    """The schedule evaluation integrates on: the sampler's (``Sampler.sigmas(policy, steps)`` when
    it offers one, e.g. a recipe's ``sampler.schedule``) with ``eval.steps`` steps, else the policy's."""
    sigmas = getattr(run.sampler, "sigmas", None)
    return sigmas(run.learner.policy, run.recipe.eval.steps) if callable(sigmas) else None


@contextlib.contextmanager
def guidance(policy: Any, scale: float | None) -> Iterator[None]:
    """The policy's ``guidance_scale`` set to ``scale`` for a while (None: left as it is)."""
    if scale is None:
        yield
        return
    if not hasattr(policy, "guidance_scale"):
        raise RecipeError(
            [
                ConfigError(
                    "eval.guidance_scale",
                    f"got {scale!r}, but the policy {type(policy).__name__} has no guidance_scale",
                )
            ]
        )
    trained = policy.guidance_scale
    policy.guidance_scale = scale
    try:
        yield
    finally:
        policy.guidance_scale = trained


def evaluate(run: Run, iteration: int, out_dir: Path | None) -> dict[str, float]:
    """Every test prompt, ``samples_per_prompt`` times, with the same noise at every evaluation
    (so curves compare like with like), on the sampler's schedule with ``eval.steps`` steps and
    ``eval.guidance_scale`` (flow_grpo's eval_guidance_scale). Metrics are prefixed ``eval/``."""
    generated = evaluation_samples(run, iteration)
    if generated is None:
        return {}
    outputs, all_prompts = generated
    metadata = [run.prompts.metadata(p) for p in all_prompts]
    groups = (
        torch.arange(len(all_prompts)) // run.recipe.eval.samples_per_prompt
    )  # prompt-major: a prompt's samples are a group
    scores, details = score(
        run.rewards, outputs, all_prompts, metadata, where=f"evaluation at iteration {iteration}", groups=groups
    )
    metrics: dict[str, float] = {}
    weights = {}
    for spec, reward in run.rewards:
        label = spec.label or spec.name  # built specs carry their label (the name when the recipe gives none)
        weights[label] = spec.weight
        metrics[f"eval/reward/{label}"] = scores[label].mean().item()
        for key, value in detail_means(details[label]).items():
            metrics[f"eval/{spec.label}/{key}"] = value
        extra = getattr(reward, "eval_metrics", None)
        if extra is not None:
            for key, value in extra(outputs, all_prompts, metadata).items():
                metrics[f"eval/{key}"] = float(value)
    # the one reward the update normalises, as it combines them (sum or product)
    total = total_reward({k: scores[k].cpu() for k in weights}, weights, run.recipe.train.advantage).float()
    metrics["eval/reward_mean"] = total.mean().item()
    if out_dir is not None and run.recipe.log.sample_grid:
        pictures = (
            outputs if visuals.is_image_batch(outputs) else drawn_outputs(run, outputs, all_prompts, metadata, total)
        )
        if pictures is not None:
            write_eval_samples(run, iteration, out_dir, pictures, all_prompts, total, details)
    metrics.update(gold_metrics(run, iteration, out_dir, outputs, all_prompts))
    return metrics


def drawn_outputs(
    run: Run, outputs: Any, prompts: Sequence[str], metadata: Sequence[Any], total: torch.Tensor
) -> torch.Tensor | None:
    """Pictures of outputs that are not images (trajectories), for the sample grid and the
    filmstrip: a reward that can draw its outputs offers ``draw(outputs, prompts, metadata,
    scores, per_prompt) -> (B, 3, H, W)`` (each sample's picture may show its whole group, e.g.
    every candidate plan coloured by its score); the first such reward draws them. None when no
    reward draws."""
    for _spec, reward in run.rewards:
        draw = getattr(reward, "draw", None)
        if draw is not None:
            with torch.no_grad():
                return draw(outputs, list(prompts), list(metadata), total, run.recipe.eval.samples_per_prompt)
    return None


class EvaluatorError(ComponentError):
    """An evaluator failed or returned something that is not metrics."""


def gold_metrics(
    run: Run, iteration: int, out_dir: Path | None, samples: Any, sample_prompts: list[str]
) -> dict[str, float]:
    """Every evaluator of the recipe on the held-out prompts, with the policy as evaluation uses it
    (EMA weights, ``eval.guidance_scale``): its metrics as ``gold/<label>/<key>``; its pictures as
    tiles of the report's gold filmstrip (``samples/gold_N/<label>/``). An evaluator with
    ``every`` runs only at the iterations it names."""
    last = run.recipe.train.iterations
    evaluators = [(s, e) for s, e in getattr(run, "evaluators", None) or [] if s.runs_at(iteration, last)]
    if not evaluators:
        return {}
    cfg = run.recipe.eval
    prompts = run.prompts.test_prompts()
    prompts = prompts[: cfg.max_prompts] if cfg.max_prompts else prompts
    sigmas = evaluation_sigmas(run)

    def sample(chunk: Sequence[str], per_prompt: int, g: torch.Generator | None = None) -> Any:
        with run.accelerator.autocast():
            return generate(run.learner.policy, list(chunk), per_prompt, cfg.steps, g, sigmas=sigmas)

    metrics: dict[str, float] = {}
    with ema_weights(run.learner.ema), guidance(run.learner.policy, cfg.guidance_scale), torch.no_grad():
        for spec, evaluator in evaluators:
            ctx = EvalContext(
                policy=run.learner.policy,
                prompts=list(prompts),
                metadata=run.prompts.metadata,
                generate=sample,
                samples=samples,
                sample_prompts=list(sample_prompts),
                seed=run.recipe.seed,
                iteration=iteration,
                device=run.learner.policy.device,
            )
            with run.io.display.bar(f"gold {spec.label} at {iteration}", total=1) as advance:
                result = _call_evaluator(spec, evaluator, ctx, iteration)
                advance(1)
            metrics.update({f"gold/{spec.label}/{key}": value for key, value in result.metrics.items()})
            if out_dir is not None and result.pictures and run.recipe.log.sample_grid:
                write_gold_pictures(result.pictures, out_dir / "samples" / f"gold_{iteration:06d}" / spec.label)
    return metrics


def _call_evaluator(spec: Any, evaluator: Any, ctx: EvalContext, iteration: int) -> EvaluatorResult:
    where = f"evaluator {spec.label!r} at the evaluation of iteration {iteration}"
    try:
        result = evaluator(ctx)
    except ComponentError:
        raise
    except Exception as exc:
        raise EvaluatorError(f"{where} raised {type(exc).__name__}: {first_line(exc)}") from exc
    metrics = getattr(result, "metrics", None)
    if not isinstance(metrics, Mapping):
        raise EvaluatorError(
            f"{where} returned {shown(result)}; expected an EvaluatorResult(metrics={{name: number}})"
        )
    bad = [
        k
        for k, v in metrics.items()
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float))
    ]
    if bad:
        raise EvaluatorError(f"{where} returned metrics that are not numbers: {shown(bad)}")
    return EvaluatorResult(
        metrics={k: float(v) for k, v in metrics.items()}, pictures=list(getattr(result, "pictures", []) or [])
    )


def write_gold_pictures(pictures: Sequence[Any], folder: Path) -> None:
    images = torch.stack([torch.as_tensor(p.image).float() for p in pictures])
    rows = [
        {
            "prompt": p.prompt,
            "sample": 0,
            "score": None if p.score is None else round(float(p.score), 4),
            "read": p.read,
            **({"passed": bool(p.passed)} if getattr(p, "passed", None) is not None else {}),
        }
        for p in pictures
    ]
    visuals.write_tiles(images, rows, folder)


def evaluation_samples(run: Run, iteration: int) -> tuple[Any, list[str]] | None:
    """The outputs :func:`evaluate` scores and their prompts (None without test prompts). Where
    every forward involves every process (sharded weights) the other processes call this too."""
    cfg = run.recipe.eval
    prompts = run.prompts.test_prompts()
    if cfg.max_prompts:
        prompts = prompts[: cfg.max_prompts]
    if not prompts:
        return None
    per_call = max(1, cfg.batch_size // cfg.samples_per_prompt)
    outputs, all_prompts = [], []
    sigmas = evaluation_sigmas(run)
    with (
        ema_weights(run.learner.ema),
        guidance(run.learner.policy, cfg.guidance_scale),
        run.accelerator.autocast(),
        run.io.display.bar(f"evaluation at {iteration}", total=len(prompts)) as advance,
    ):
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start : start + per_call]
            g = generator(run.recipe.seed, "eval", start, device=run.learner.policy.device)
            outputs.append(generate(run.learner.policy, chunk, cfg.samples_per_prompt, cfg.steps, g, sigmas=sigmas))
            all_prompts += [p for p in chunk for _ in range(cfg.samples_per_prompt)]
            advance(len(chunk))
    return (torch.cat(outputs) if isinstance(outputs[0], torch.Tensor) else tensors.cat(outputs)), all_prompts


#: the most evaluation prompts a filmstrip and a sample grid show
SHOWN_PROMPTS = 32


def spread_over_categories(categories: Sequence[str | None], count: int = SHOWN_PROMPTS) -> list[int]:
    """Up to ``count`` indices of prompts, taken in turn from each category (in the order the
    categories first appear, each category's prompts in order), so that a filmstrip of a test set
    sorted by category shows every category rather than the first one's 32 prompts."""
    by_category: dict[str | None, list[int]] = {}
    for i, category in enumerate(categories):
        by_category.setdefault(category, []).append(i)
    queues = list(by_category.values())
    picked: list[int] = []
    for rank in range(max(map(len, queues), default=0)):
        picked += [queue[rank] for queue in queues if rank < len(queue)]
    return sorted(picked[:count])


def prompt_category(metadata: Mapping[str, Any]) -> str | None:
    """A prompt's category as its source names it (``category``; GenEval's ``tag``), or None."""
    for key in ("category", "tag"):
        if isinstance(metadata.get(key), str):
            return str(metadata[key])
    return None


def write_eval_samples(
    run: Run,
    iteration: int,
    out_dir: Path,
    outputs: torch.Tensor,
    prompts: Sequence[str],
    total: torch.Tensor,
    details: dict[str, Any],
) -> None:
    """The first sample of (up to) 32 test prompts spread over their categories — the same prompts
    and noise at every evaluation — as a grid with each image's score and what the rewards read
    (``samples/eval_N.png``, also sent to the trackers) and as tiles for the report's filmstrip
    (``samples/eval_N/``). A reward's per-sample ``passed`` (its world's pass rule) makes the
    tile's badge pass/fail; its ``marks`` (boxes in fractions of the output) are outlined."""
    per_prompt = run.recipe.eval.samples_per_prompt
    firsts = list(range(0, len(prompts), per_prompt))
    shown = spread_over_categories([prompt_category(run.prompts.metadata(prompts[i])) for i in firsts])
    pick = [firsts[k] for k in shown]
    reward_details = [d for d in details.values() if isinstance(d, dict)]
    reads = [d["read"] for d in reward_details if _per_sample_strings(d.get("read"), len(prompts))]
    verdicts = [v for d in reward_details if (v := _per_sample_bools(d.get("passed"), len(prompts))) is not None]
    marks = next((d["marks"] for d in reward_details if _per_sample_boxes(d.get("marks"), len(prompts))), None)
    rows: list[dict[str, Any]] = [
        {
            "prompt": prompts[i],
            "sample": 0,
            "score": round(total[i].item(), 4),
            "read": "; ".join(r[i] for r in reads),
            **({"passed": all(v[i] for v in verdicts)} if verdicts else {}),
            **({"sources": len(media.source_images(prompts[i]))} if media.source_images(prompts[i]) else {}),
        }
        for i in pick
    ]
    notes = [
        ("pass · " if row.get("passed") else "fail · " if "passed" in row else "")
        + f"score {row['score']:.3g}"
        + (f" · read: {row['read']}" if row["read"] else "")
        for row in rows
    ]
    name = f"eval_{iteration:06d}"
    shown_prompts = [prompts[i] for i in pick]
    shown_images = sources_then_outputs(outputs[pick], shown_prompts)
    if marks is not None:
        boxes = [[(float(x0), float(y0), float(x1), float(y1)) for x0, y0, x1, y1 in marks[i]] for i in pick]
        shown_images = visuals.outline(
            shown_images, boxes, panels=[1 + len(media.source_images(p)) for p in shown_prompts]
        )
    grid = visuals.sample_grid(
        shown_images, [row["prompt"] for row in rows], out_dir / "samples" / f"{name}.png", notes=notes
    )
    visuals.write_tiles(shown_images, rows, out_dir / "samples" / name)
    trackers.log_image(run.accelerator, "eval/samples", np.asarray(grid), iteration)


def sources_then_outputs(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """What a grid or filmstrip tile shows: the output alone, or for prompts with source images
    (edits) source -> output side by side (:func:`fgrpo.core.media.side_by_side`)."""
    if not any(media.source_images(p) for p in prompts):
        return images
    return media.side_by_side(media.reward_sources(prompts, images), images)


def _per_sample_strings(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n and all(isinstance(v, str) for v in value)


def _per_sample_bools(value: Any, n: int) -> list[bool] | None:
    """A per-sample verdict (bool or 0/1 values, a tensor or a list) as bools, else None."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and len(value) == n:
        value = value.tolist()
    if isinstance(value, (list, tuple)) and len(value) == n and all(v in (0, 1) for v in value):
        return [bool(v) for v in value]
    return None


def _per_sample_boxes(value: Any, n: int) -> bool:
    """``[[x0, y0, x1, y1], ...]`` per sample, fractions of the output image."""
    return (
        isinstance(value, (list, tuple))
        and len(value) == n
        and all(
            isinstance(boxes, (list, tuple))
            and all(
                isinstance(b, (list, tuple)) and len(b) == 4 and all(isinstance(c, (int, float)) for c in b)
                for b in boxes
            )
            for boxes in value
        )
    )


def write_samples(
    policy: Any,
    prompts: Sequence[str],
    n: int,
    steps: int,
    seed: int,
    out: Path,
    batch_size: int = 64,
    *,
    rewards: Sequence[tuple[Any, Any]] = (),
    metadata: Callable[[str], Any] = lambda _prompt: {},
) -> int:
    """``n`` samples of every prompt as PNG files (tensors as .pt for non-image outputs) and an
    ``index.jsonl`` naming each file's prompt, seed and index; returns how many were written.
    With ``rewards`` ((spec, reward) pairs, as a run holds them) each row also holds every reward's
    score (``scores``) and its per-sample details (``details``: what a verifier read, whether the
    sample passed, ...), each prompt's ``n`` samples scored as one group with its ``metadata``.

    Prompts are generated together, about ``batch_size`` samples per forward; the initial noise of
    prompt ``i`` is drawn from its own generator (seed, "sample", i), so a prompt's samples do not
    depend on the other prompts of the file or on the batch size."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    per_call = max(1, batch_size // max(1, n))
    for start in range(0, len(prompts), per_call):
        chunk = list(prompts[start : start + per_call])
        noise = torch.cat(
            [
                torch.as_tensor(policy.initial_noise(n, generator(seed, "sample", start + j, device=policy.device)))
                for j in range(len(chunk))
            ]
        )
        images = generate(policy, chunk, n, steps, None, noise=noise)
        judged = _scored_rows(rewards, images, chunk, n, metadata) if rewards else [{}] * (len(chunk) * n)
        for j, prompt in enumerate(chunk):
            i = start + j
            for k in range(n):
                row = j * n + k
                if visuals.is_image_batch(images):
                    from PIL import Image

                    name = f"{i:05d}_{k:02d}.png"
                    Image.fromarray(visuals.to_uint8(images[row : row + 1])[0]).save(out / name)
                else:
                    name = f"{i:05d}_{k:02d}.pt"
                    torch.save(images[row].cpu(), out / name)
                rows.append({"file": name, "prompt": prompt, "seed": seed, "index": k, **judged[row]})
    (out / "index.jsonl").write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
    return len(rows)


def _scored_rows(
    rewards: Sequence[tuple[Any, Any]], outputs: Any, chunk: list[str], n: int, metadata: Callable[[str], Any]
) -> list[dict[str, Any]]:
    """Each sample's ``scores`` (every reward's, by its label) and ``details`` (each reward's
    per-sample details) for ``index.jsonl``; a prompt's ``n`` samples are one group."""
    prompts = [p for p in chunk for _ in range(n)]
    scores, details = score(
        rewards,
        outputs,
        prompts,
        [metadata(p) for p in prompts],
        where="fgrpo sample",
        groups=torch.arange(len(prompts)) // n,
    )
    return [
        {
            "scores": {label: _json_value(s[i].item()) for label, s in scores.items()},
            "details": {label: per_sample_details(d, i, len(prompts)) for label, d in details.items()},
        }
        for i in range(len(prompts))
    ]


def per_sample_details(details: Any, i: int, n: int) -> dict[str, Any]:
    """Sample ``i``'s entry of every per-sample detail (a tensor or a list of ``n`` values) that
    JSON can hold; details of the whole batch (scalars, other lengths) are left out."""
    if not isinstance(details, Mapping):
        return {}
    picked = {}
    for key, value in details.items():
        if isinstance(value, torch.Tensor) and value.dim() and len(value) == n:
            value = value[i].tolist()
        elif isinstance(value, (list, tuple)) and len(value) == n:
            value = value[i]
        else:
            continue
        value = _json_value(value)
        if value is not _SKIP:
            picked[str(key)] = value
    return picked


_SKIP = object()


def _json_value(value: Any) -> Any:
    """``value`` as JSON holds it (non-finite numbers as null), or ``_SKIP`` for what it cannot."""
    import math

    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    return _SKIP
