"""Pretrain the ``shapes-edit-dit`` base model: rectified-flow matching on imperfect edit pairs of
the shapes-edit world (source scene + instruction -> edited scene); writes the shipped
``fgrpo/worlds/shapes_edit/weights/shapes-edit-base.safetensors`` with its defaults.

    python -m fgrpo.worlds.shapes_edit.pretrain

What it does, what the shipped file measures and why two text layers and 15% mistakes:
docs/worlds.md, "shapes-edit: the base".
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import fgrpo.worlds.shapes_edit as world
from fgrpo.worlds.shapes.network import (
    Architecture,
    ShapesNetwork,
    count_parameters,
    load_network,
    save_network,
    vocabulary_of,
)
from fgrpo.worlds.shapes.pretrain import Progress, common_arguments, trained_with, write  # the same loop
from fgrpo.worlds.shapes.pretrain import train as train_network
from fgrpo.worlds.shapes.world import render_batch
from fgrpo.worlds.shapes_edit.model import ShapesEditDiT

DEFAULT_OUT = Path(__file__).resolve().parent / "weights" / "shapes-edit-base.safetensors"  # the shipped base


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p, _, t, e = common_arguments(
        __doc__.split("\n\n")[0],
        width=64,
        layers=3,
        heads=2,
        text_width=64,
        text_layers=2,
        steps=6000,
        batch=64,
        threads=1,
    )
    t.add_argument("--noise", type=float, default=0.15, help="fraction of targets that are mistaken edits")
    t.add_argument("--split-seed", type=int, default=0, help="seed of the instruction split (ShapesEditPrompts.seed)")
    e.add_argument("--out", default=str(DEFAULT_OUT), help="the safetensors file to write")
    return p.parse_args(argv)


class EditPairSampler:
    """Balanced (instruction, source, target) batches from the training instructions."""

    def __init__(self, train: dict[str, list[world.Edit]], seed: int, noise: float, prompt_dropout: float):
        self.train, self.categories = train, sorted(train)
        self.rng = np.random.default_rng(seed)
        self.noise, self.prompt_dropout = noise, prompt_dropout

    def batch(self, n: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """(instructions, targets, sources), pixels in [-1, 1]."""
        rng = self.rng
        prompts, sources, targets = [], [], []
        for c in rng.integers(len(self.categories), size=n):
            edits = self.train[self.categories[c]]
            edit = edits[int(rng.integers(len(edits)))]
            source, target = world.edit_pair(edit, rng, self.noise)
            prompts.append("" if rng.random() < self.prompt_dropout else edit.instruction)
            sources.append(source)
            targets.append(target)
        return prompts, render_batch(targets) * 2 - 1, render_batch(sources) * 2 - 1


def fresh_train_prompts(train: dict[str, list[world.Edit]], per_category: int, seed: int) -> list[str]:
    rng = np.random.default_rng([seed, 7])
    out: list[str] = []
    for category in world.EDIT_CATEGORIES:
        for _ in range(per_category):
            edit = train[category][int(rng.integers(len(train[category])))]
            out.append(world.make_prompt(edit, world.random_source(edit, rng)))
    return out


@torch.no_grad()
def evaluate(network: ShapesNetwork, prompts: list[str], args: argparse.Namespace, device: torch.device) -> dict:
    """Edit accuracy, preservation and cleanliness of these prompts, overall and per category."""
    from fgrpo.core.evaluation import generate

    policy = ShapesEditDiT.from_network(copy.deepcopy(network), device=device, reference_copy=False)
    outputs, shown = [], []
    per_call = max(1, 256 // args.eval_samples)
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start : start + per_call]
        g = torch.Generator(device=device).manual_seed(1000 + start)
        outputs.append(generate(policy, chunk, args.eval_samples, args.eval_steps, g).cpu())
        shown += [p for p in chunk for _ in range(args.eval_samples)]
    pairs = [world.edit_and_source(p, None) for p in shown]
    details = world.evaluate(torch.cat(outputs), [e for e, _ in pairs], [s for _, s in pairs])
    result = {k: details[k].mean().item() for k in ("edit", "preserved", "gold_preservation_error", "clean")}
    for c in world.EDIT_CATEGORIES:
        pick = [i for i, cat in enumerate(details["category"]) if cat == c]
        if pick:
            result[f"edit/{c}"] = details["edit"][pick].mean().item()
    return result


def line(r: dict) -> str:
    cats = " ".join(f"{c}={r[f'edit/{c}']:.2f}" for c in world.EDIT_CATEGORIES if f"edit/{c}" in r)
    return (
        f"edit {r['edit']:.3f} preserved {r['preserved']:.3f} gold {r['gold_preservation_error']:.2f} clean "
        f"{r['clean']:.2f} | {cats}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    train, _ = world.split_instructions(args.split_seed)
    test = world.ShapesEditPrompts(seed=args.split_seed).test_prompts()
    seen = fresh_train_prompts(train, 16, args.seed)
    instructions = [e.instruction for c in world.EDIT_CATEGORIES for e in world.all_edits(c)]
    arch = Architecture(
        vocab=vocabulary_of(instructions),
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        text_width=args.text_width,
        text_layers=args.text_layers,
        text_heads=max(1, args.text_width // 64),
        max_words=max(len(p.split()) for p in instructions),
        source_images=1,
    )
    network = ShapesNetwork(arch).to(device)
    ema = copy.deepcopy(network).requires_grad_(False)
    print(
        f"shapes-edit-dit: transformer {count_parameters(network.transformer) / 1e6:.2f}M + text "
        f"{count_parameters(network.text) / 1e6:.2f}M params; {sum(map(len, train.values()))} train instructions, "
        f"{len(test)} held-out prompts; device {device}, {args.threads} threads",
        flush=True,
    )
    data = EditPairSampler(train, args.seed, args.noise, args.prompt_dropout)
    history: list[dict] = []
    meta = trained_with(args)
    if args.checkpoint_dir:
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)

    def checkpoint(run: Progress, net: ShapesNetwork, what: str) -> None:
        t = time.perf_counter()
        held, fresh = evaluate(net, test, args, device), evaluate(net, seen, args, device)
        history.append(
            {"step": run.step, "train_s": round(run.trained, 1), "held_out": held, "train_instructions": fresh}
        )
        head = f"step {run.step:5d} train {run.trained:6.0f}s loss {run.recent_loss():.4f}"
        print(f"{head} | {what} held-out {line(held)}", flush=True)
        print(f"{'':>38} | {what} train-instr {line(fresh)} [eval {time.perf_counter() - t:.0f}s]", flush=True)
        if args.checkpoint_dir and what == "EMA":
            save_network(net, Path(args.checkpoint_dir) / f"step{run.step:05d}.safetensors", extra=meta)

    run = train_network(args, network, ema, device, data.batch, lambda r: checkpoint(r, ema, "EMA"))
    out = write(ema, args, run)
    checkpoint(run, load_network(out).to(device), "written file")  # exactly what was written (float16)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    print("history " + json.dumps(history))
    return 0


if __name__ == "__main__":
    sys.exit(main())
