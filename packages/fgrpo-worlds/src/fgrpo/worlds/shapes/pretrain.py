"""Pretrain the ``shapes-dit`` base model: rectified-flow matching on rendered shapes scenes, a
caption-image contrastive loss, a meaning head and a layout planner; writes the shipped
``fgrpo/worlds/shapes/weights/shapes-base.safetensors`` with its defaults.

    python -m fgrpo.worlds.shapes.pretrain                # reproduces the shipped weights
    python -m fgrpo.worlds.shapes.pretrain --device cuda  # the same on a GPU (not bit-identical)

What each option does, what the shipped file measures and why the network plans before it draws:
docs/worlds.md, "shapes: the base".
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np
import torch
from torch import nn

from fgrpo.worlds import shapes as world
from fgrpo.worlds.shapes.model import ShapesDiT
from fgrpo.worlds.shapes.network import (
    PREDICTIONS,
    Architecture,
    ShapesNetwork,
    count_parameters,
    flow_loss,
    load_network,
    save_network,
    to_velocity,
    vocabulary_of,
)
from fgrpo.worlds.shapes.pretrain_losses import (
    NEGATIVES,
    CaptionContrast,
    LayoutDenoiser,
    MeaningHead,
    PlanLoss,
    pretrain_planner,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "weights" / "shapes-base.safetensors"  # the shipped base


def common_arguments(
    description: str,
    *,
    width: int,
    layers: int,
    heads: int,
    text_width: int,
    steps: int,
    batch: int,
    threads: int,
    decay_steps: int | None = None,
    text_layers: int = 1,
) -> tuple[argparse.ArgumentParser, argparse._ArgumentGroup, argparse._ArgumentGroup, argparse._ArgumentGroup]:
    """The parser both pretraining tools share (architecture, optimisation, evaluation), with
    the defaults that differ between them (``decay_steps`` null: ``steps``); each tool adds its own
    keys to the three groups."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument_group("architecture")
    a.add_argument("--hidden", type=int, default=width, help="transformer width")
    a.add_argument("--layers", type=int, default=layers, help="SD3 joint transformer blocks")
    a.add_argument("--heads", type=int, default=heads, help="attention heads")
    a.add_argument("--text-width", type=int, default=text_width, help="text encoder width")
    a.add_argument("--text-layers", type=int, default=text_layers, help="text encoder layers")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    t.add_argument(
        "--time-budget", type=float, default=0.0, help="stop after this many seconds of training (0: no limit)"
    )
    t.add_argument("--batch", type=int, default=batch)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--lr-min", type=float, default=2e-4)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--decay-steps", type=int, default=decay_steps or steps, help="cosine horizon of the learning rate")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--ema", type=float, default=0.999, help="EMA decay (with the usual (1+n)/(10+n) warm-up)")
    t.add_argument("--loss-floor", type=float, default=0.05, help="x0-prediction: sigma floor of the v-loss weight")
    t.add_argument("--logit-mean", type=float, default=0.5)
    t.add_argument("--logit-std", type=float, default=1.0)
    t.add_argument("--prompt-dropout", type=float, default=0.1, help="fraction of prompts replaced by '' (for CFG)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument(
        "--threads", type=int, default=threads, help="torch CPU threads (the same count gives the same weights)"
    )
    e = p.add_argument_group("evaluation and output")
    e.add_argument("--eval-every", type=int, default=1500, help="steps between evaluations (0: only at the end)")
    e.add_argument("--eval-samples", type=int, default=4, help="samples per test prompt")
    e.add_argument("--eval-steps", type=int, default=20, help="ODE steps")
    e.add_argument("--checkpoint-dir", default="", help="also keep the weights of every evaluation here")
    return p, a, t, e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p, a, t, e = common_arguments(
        __doc__.split("\n\n")[0],
        width=192,
        layers=4,
        heads=3,
        text_width=128,
        steps=1500,
        decay_steps=12000,  # the shipped file is step 1500 of a 12000-step cosine
        batch=128,
        threads=2,
    )
    a.add_argument(
        "--position-scale", type=float, default=1.0, help="factor on the image tokens' sin-cos position embedding"
    )
    a.add_argument(
        "--cell-conditioning", action="store_true", help="a per-cell term on the image tokens from the pooled text"
    )
    a.add_argument(
        "--layout-plan", type=int, default=256, help="width of a planner from the pooled text to a layout (0: none)"
    )
    t.add_argument("--prediction", choices=PREDICTIONS, default="x0", help="what the transformer outputs")
    t.add_argument(
        "--caption-noise", type=float, default=0.4, help="fraction of images rendered from a perturbed scene"
    )
    t.add_argument(
        "--clear-position",
        type=float,
        default=0.0,
        help="fraction of position images drawn with a clear layout: level, at the grid's opposite edges",
    )
    t.add_argument("--split-seed", type=int, default=0, help="seed of the train/test split (ShapesPrompts.seed)")
    t.add_argument("--test-per-category", type=int, default=16)
    t.add_argument("--autocast", choices=("none", "bfloat16"), default="none", help="autocast of the training forward")
    t.add_argument(
        "--contrastive",
        type=float,
        default=0.05,
        help="weight of the caption-image contrastive loss with same-words hard negatives (0: off)",
    )
    t.add_argument(
        "--contrastive-lr",
        type=float,
        default=1e-3,
        help="peak lr of the auxiliary modules (contrastive image encoder, meaning head)",
    )
    t.add_argument(
        "--contrastive-flow",
        type=float,
        default=0.0,
        help="weight of the push away from a same-words other-meaning render (0: off)",
    )
    t.add_argument(
        "--meaning",
        type=float,
        default=0.01,
        help="weight of an auxiliary head that predicts the caption's items, counts and relations (0: off)",
    )
    t.add_argument(
        "--layout",
        type=float,
        default=1.0,
        help="weight of the exact-posterior-mean x0 loss of position captions at high noise (0: off)",
    )
    t.add_argument("--layout-low", type=float, default=0.5, help="--layout: the lowest sigma it draws")
    t.add_argument(
        "--plan",
        type=float,
        default=1.0,
        help="--layout-plan: weight of the plan's MSE to the mean of a position caption's scenes (0: off)",
    )
    t.add_argument(
        "--plan-steps",
        type=int,
        default=2000,
        help="--layout-plan: steps that train the text encoder and the planner alone on that MSE first",
    )
    t.add_argument("--plan-lr", type=float, default=1e-3, help="--plan-steps: their AdamW learning rate")
    t.add_argument("--plan-batch", type=int, default=64, help="--plan-steps: position captions per step")
    t.add_argument(
        "--contrastive-negatives",
        choices=NEGATIVES,
        default="rebinding",
        help="hard negatives: the same-words rebinding, or for position prompts every other arrangement",
    )
    e.add_argument("--shift", type=float, default=1.0, help="time shift of the evaluation schedule")
    e.add_argument("--eval-raw", action="store_true", help="also evaluate the raw (non-EMA) weights")
    e.add_argument("--out", default=str(DEFAULT_OUT), help="the safetensors file to write")
    return p.parse_args(argv)


# --- data ---------------------------------------------------------------------------------------


class PairSampler:
    """Balanced (prompt, image) batches from the train prompts of the split."""

    def __init__(
        self, train: list[str], seed: int, caption_noise: float, prompt_dropout: float, clear_position: float = 0.0
    ):
        self.by_category: dict[str, list[world.Spec]] = defaultdict(list)
        for prompt in train:
            spec = world.parse_prompt(prompt)
            self.by_category[spec.category].append(spec)
        self.categories = sorted(self.by_category)
        self.rng = np.random.default_rng(seed)
        self.caption_noise = caption_noise
        self.prompt_dropout = prompt_dropout
        self.clear_position = clear_position
        self.negative_rng = np.random.default_rng(seed + 3)

    def rebound(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Renders of the same-words other-meaning scene of each position and colour-binding
        prompt (an empty black render elsewhere) and where they are; a generator of their own,
        so the batches are those of a run without them."""
        rebindable = [bool(q) and world.parse_prompt(q).category in world.REBINDABLE for q in prompts]
        scenes = [
            world.sample_scene(world.same_words_other_meaning(q)["same words"], self.negative_rng) if r else ()
            for q, r in zip(prompts, rebindable, strict=True)
        ]
        return world.render_batch(scenes) * 2 - 1, torch.tensor(rebindable)

    def batch(self, n: int) -> tuple[list[str], torch.Tensor]:
        rng = self.rng
        specs = []
        for c in rng.integers(len(self.categories), size=n):
            options = self.by_category[self.categories[c]]
            specs.append(options[int(rng.integers(len(options)))])
        images = world.render_batch([self.scene(s, rng) for s in specs])
        drop = rng.random(n) < self.prompt_dropout
        prompts = ["" if d else s.prompt for s, d in zip(specs, drop, strict=True)]
        return prompts, images * 2 - 1

    def scene(self, spec: world.Spec, rng: np.random.Generator) -> world.Scene:
        """A scene for the spec; a position spec, with probability ``clear_position``, in a clear
        layout (the generator is drawn from only when the option is on, so a run without it keeps
        its batches)."""
        if self.clear_position and spec.relation is not None and rng.random() < self.clear_position:
            scene = clear_layout(spec, rng)
            if rng.random() < self.caption_noise:
                scene = world.perturb(scene, spec, rng)
            return scene
        return world.sample_scene(spec, rng, self.caption_noise)


def clear_layout(spec: world.Spec, rng: np.random.Generator) -> world.Scene:
    """The two objects of a position spec level on the other axis, at the grid's opposite edges
    ("A left of B": one row, A in the first column, B in the last)."""
    (ca, sa, _), (cb, sb, _) = spec.objects
    line = int(rng.integers(world.GRID))
    first, last = 0, world.GRID - 1
    assert spec.relation is not None
    a_first = spec.relation in ("left", "above")
    ends = (first, last) if a_first else (last, first)
    if spec.relation in ("left", "right"):
        cells = ((line, ends[0]), (line, ends[1]))
    else:
        cells = ((ends[0], line), (ends[1], line))
    return (world.Placed(ca, sa, *cells[0]), world.Placed(cb, sb, *cells[1]))


# --- evaluation ---------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(network: ShapesNetwork, test: list[str], args: argparse.Namespace, device: torch.device) -> dict:
    """Strict accuracy (and more) of the test prompts, overall and per category."""
    from fgrpo.core.evaluation import generate

    policy = ShapesDiT.from_network(copy.deepcopy(network), device=device, shift=args.shift, reference_copy=False)
    outputs, prompts = [], []
    per_call = max(1, 256 // args.eval_samples)
    for start in range(0, len(test), per_call):
        chunk = test[start : start + per_call]
        g = torch.Generator(device=device).manual_seed(1000 + start)
        outputs.append(generate(policy, chunk, args.eval_samples, args.eval_steps, g).cpu())
        prompts += [p for p in chunk for _ in range(args.eval_samples)]
    details = world.evaluate(torch.cat(outputs), prompts)
    acc = details["accuracy"]
    result = {
        "accuracy": acc.mean().item(),
        "partial": details["partial"].mean().item(),
        "clean": details["clean"].mean().item(),
        "clean_cells": details["clean_cells"].mean().item(),
        "gold_error": details["gold_error"].mean().item(),
    }
    for c in world.CATEGORIES:
        pick = [i for i, cat in enumerate(details["category"]) if cat == c]
        if pick:
            result[f"acc/{c}"] = acc[pick].mean().item()
    return result


def line(r: dict) -> str:
    cats = " ".join(f"{c}={r[f'acc/{c}']:.2f}" for c in world.CATEGORIES if f"acc/{c}" in r)
    return (
        f"strict {r['accuracy']:.3f} partial {r['partial']:.3f} clean {r['clean']:.2f} "
        f"cells {r['clean_cells']:.3f} gold {r['gold_error']:.1f} | {cats}"
    )


# --- training -----------------------------------------------------------------------------------


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.decay_steps - args.warmup))
    return args.lr_min + 0.5 * (args.lr - args.lr_min) * (1 + math.cos(math.pi * progress))


@attrs.define
class Progress:
    """Where the shared training loop stands: optimizer steps, seconds of training (evaluations
    excluded) and every step's loss."""

    step: int = 0
    trained: float = 0.0
    losses: list[float] = attrs.Factory(list)

    def recent_loss(self) -> float:
        return float(np.mean(self.losses[-100:])) if self.losses else float("nan")


def trained_with(args: argparse.Namespace) -> dict[str, str]:
    """The weights file's metadata: every setting but where the files go."""
    return {
        "trained_with": json.dumps(
            {k: v for k, v in vars(args).items() if k not in ("out", "checkpoint_dir")}, sort_keys=True
        )
    }


def train(
    args: argparse.Namespace,
    network: ShapesNetwork,
    ema: ShapesNetwork,
    device: torch.device,
    next_batch: Callable[[int], tuple],
    evaluate_at: Callable[[Progress], None],
    *,
    autocast: bool = False,
    auxiliaries: Sequence[tuple[torch.nn.Module, float, float]] = (),
    negatives: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Progress:
    """Flow matching of ``network`` on ``next_batch(n)`` -> (prompts, x0, *conditioning pixels),
    AdamW under :func:`lr_at`, gradient clipping, the EMA; ``evaluate_at`` every ``--eval-every``
    steps before the last. Stops after ``--steps`` or ``--time-budget`` seconds of training.
    ``auxiliaries`` (module, weight, peak lr): each ``weight * module(network, prompts, pooled)``
    (``pooled``: the text encoding the flow loss conditioned on) joins the
    loss; a module's own parameters follow the same schedule scaled to their peak lr.
    ``negatives(prompts)`` -> (images, mask): contrastive flow matching (Stoica et al. 2025) with
    hard negatives: ``--contrastive-flow`` times the squared distance of the x0 prediction to a
    render of another scene of the same words (where ``mask``) is subtracted, unweighted by sigma
    so it acts where the layout is decided."""
    groups = [{"params": list(network.parameters()), "scale": 1.0}]
    for module, _, peak_lr in auxiliaries:
        if params := list(module.parameters()):
            groups.append({"params": params, "scale": peak_lr / args.lr})
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    run = Progress()
    cast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    while run.step < args.steps and not (args.time_budget and run.trained >= args.time_budget):
        t0 = time.perf_counter()
        prompts, x0, *extra = next_batch(args.batch)
        x0, extra = x0.to(device), [e.to(device) for e in extra]
        eps = torch.randn(x0.shape, generator=gen).to(device)
        sigma = torch.sigmoid(args.logit_mean + args.logit_std * torch.randn(args.batch, generator=gen)).to(device)
        xt = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * eps
        for group in optimizer.param_groups:
            group["lr"] = lr_at(run.step, args) * group["scale"]
        with cast:
            cond = network.encode(prompts)
            out = network(xt, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"], *extra)
        loss = flow_loss(out.float(), x0, eps, sigma, network.arch.prediction, args.loss_floor)
        total = loss
        if negatives is not None:
            other, mask = negatives(prompts)
            if mask.any():
                x0_hat = xt - sigma[:, None, None, None] * to_velocity(out.float(), xt, sigma, network.arch.prediction)
                away = (x0_hat[mask] - other[mask].to(device)).pow(2).mean() * mask.float().mean()
                total = total - args.contrastive_flow * away
        for module, weight, _ in auxiliaries:
            total = total + weight * module(network, prompts, cond["pooled_prompt_embeds"])
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(network.parameters(), args.grad_clip)
        optimizer.step()
        decay = min(args.ema, (1 + run.step) / (10 + run.step))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), network.parameters(), strict=True):
                pe.lerp_(p, 1 - decay)
        run.losses.append(loss.item())
        run.step += 1
        run.trained += time.perf_counter() - t0
        if run.step % 100 == 0:
            print(
                f"step {run.step:5d} train {run.trained:6.0f}s ({run.trained / run.step:.3f} s/step) loss "
                f"{run.recent_loss():.4f} lr {lr_at(run.step - 1, args):.2e}",
                flush=True,
            )
        if args.eval_every and run.step % args.eval_every == 0 and run.step < args.steps:
            evaluate_at(run)
    return run


def write(ema: ShapesNetwork, args: argparse.Namespace, run: Progress, meta: dict[str, str] | None = None) -> Path:
    """``--out``: the EMA weights (float16) with the settings (``meta``: :func:`trained_with`'s and
    more), the steps and the training time."""
    out = Path(args.out)
    extra = {**(meta or trained_with(args)), "steps": str(run.step), "train_seconds": f"{run.trained:.0f}"}
    save_network(ema, out, extra=extra)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    train_prompts, test = world.split(args.split_seed, args.test_per_category)
    arch = Architecture(
        vocab=vocabulary_of(world.all_prompts()),
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        text_width=args.text_width,
        text_layers=args.text_layers,
        text_heads=max(1, args.text_width // 64),
        max_words=max(len(p.split()) for p in world.all_prompts()),
        prediction=args.prediction,
        position_scale=args.position_scale,
        cell_conditioning=args.cell_conditioning,
        layout_plan=args.layout_plan,
    )
    network = ShapesNetwork(arch).to(device)
    ema = copy.deepcopy(network).requires_grad_(False)
    print(
        f"shapes-dit: transformer {count_parameters(network.transformer) / 1e6:.2f}M + text "
        f"{count_parameters(network.text) / 1e6:.2f}M params; {len(train_prompts)} train / {len(test)} test prompts; "
        f"device {device}, {args.threads} threads",
        flush=True,
    )
    data = PairSampler(train_prompts, args.seed, args.caption_noise, args.prompt_dropout, args.clear_position)
    history: list[dict] = []
    meta = trained_with(args)
    if args.checkpoint_dir:
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)

    def checkpoint(run: Progress) -> None:
        t = time.perf_counter()
        r = evaluate(ema, test, args, device)
        if args.eval_raw:
            raw = evaluate(network, test, args, device)
            r["raw_accuracy"] = raw["accuracy"]
        history.append({"step": run.step, "train_s": round(run.trained, 1), **r})
        extra = f" (raw {r['raw_accuracy']:.3f})" if args.eval_raw else ""
        print(
            f"step {run.step:5d} train {run.trained:6.0f}s loss {run.recent_loss():.4f} | EMA {line(r)}{extra} [eval "
            f"{time.perf_counter() - t:.0f}s]",
            flush=True,
        )
        if args.checkpoint_dir:
            save_network(ema, Path(args.checkpoint_dir) / f"step{run.step:05d}.safetensors", extra=meta)

    auxiliaries: list[tuple[nn.Module, float, float]] = []
    if args.contrastive:
        pixels = arch.channels * arch.size**2
        module = CaptionContrast(arch.text_width, pixels, args.seed + 2, args.contrastive_negatives).to(device)
        auxiliaries.append((module, args.contrastive, args.contrastive_lr))
    if args.layout:
        auxiliaries.append((LayoutDenoiser(args.seed + 4, args.layout_low), args.layout, args.contrastive_lr))
    if (args.plan or args.plan_steps) and not args.layout_plan:
        raise SystemExit("--plan and --plan-steps need --layout-plan (the planner they train)")
    plan_loss = PlanLoss(LayoutDenoiser(args.seed + 5))
    if args.plan_steps:
        meta["plan_seconds"] = f"{pretrain_planner(network, train_prompts, plan_loss, args):.0f}"
        ema.load_state_dict(network.state_dict())
    if args.plan:
        auxiliaries.append((plan_loss, args.plan, args.contrastive_lr))
    if args.meaning:
        auxiliaries.append((MeaningHead(arch.text_width).to(device), args.meaning, args.contrastive_lr))
    run = train(
        args,
        network,
        ema,
        device,
        data.batch,
        checkpoint,
        autocast=args.autocast == "bfloat16",
        auxiliaries=auxiliaries,
        negatives=data.rebound if args.contrastive_flow else None,
    )
    out = write(ema, args, run, meta)
    shipped = load_network(out).to(device)  # evaluate exactly what was written (float16 weights)
    t = time.perf_counter()
    final = evaluate(shipped, test, args, device)
    history.append({"step": run.step, "train_s": round(run.trained, 1), **final})
    print(
        f"step {run.step:5d} train {run.trained:6.0f}s ({run.trained / max(run.step, 1):.3f} s/step) | written file: "
        f"{line(final)} [eval {time.perf_counter() - t:.0f}s]",
        flush=True,
    )
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    print("history " + json.dumps(history))
    return 0


if __name__ == "__main__":
    sys.exit(main())
