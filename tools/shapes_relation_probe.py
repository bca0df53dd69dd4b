#!/usr/bin/env python
"""Does a shapes-dit policy know where to put things, or only what to draw?

    .venv/bin/python tools/shapes_relation_probe.py [RUN/checkpoints/last ...]

For the held-out ``position`` and ``color_attr`` prompts it samples the shipped base (and, for
each checkpoint folder given, the base with that run's trainable weights) with the evaluation's
ODE sampler and prints: how often the image holds exactly the required objects (clean, nothing
else), and for position prompts how often the relation holds *given* the right objects. Two
distinct random cells satisfy a relation 37.5% of the time, so a conditional rate near that means
the relation words are ignored. A checkpoint of a LoRA run needs the run's LoRA shape (--rank,
--alpha; the shapes recipes use 32/64).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

from fgrpo.core.evaluation import generate
from fgrpo.models.shapes_dit import ShapesDiT
from fgrpo.rewards import shapes as world
from fgrpo.rewards.shapes.verifier import read_cells, spec_for
from fgrpo.rewards.shapes.world import relation_holds

CHANCE = 0.375  # P(two distinct uniformly random cells of the 3x3 grid are in a given relation)


def outcomes(images: torch.Tensor, prompts: list[str]) -> list[int | None]:
    """Per image: None unless it holds exactly the required objects (clean); then 1 or 0 whether
    the prompt's relation holds (1 for a prompt without a relation)."""
    reading = read_cells(images)
    out: list[int | None] = []
    for b, prompt in enumerate(prompts):
        spec = spec_for(prompt)
        scene = reading.scene(b)
        if not (bool(reading.clean[b]) and Counter(p.item for p in scene) == Counter(spec.required)):
            out.append(None)
        elif spec.relation is None:
            out.append(1)
        else:
            a, other = (o[:2] for o in spec.objects)
            out.append(int(relation_holds(scene, a, other, spec.relation)))
    return out


def rates(images: torch.Tensor, prompts: list[str]) -> tuple[float, float]:
    """(fraction of images holding exactly the required objects, clean; fraction of those whose
    relation holds: NaN when no prompt has a relation or no image has the objects)."""
    found = outcomes(images, prompts)
    with_relation = [o for o, q in zip(found, prompts) if o is not None and spec_for(q).relation is not None]
    objects = sum(o is not None for o in found) / len(prompts)
    return objects, sum(with_relation) / len(with_relation) if with_relation else float("nan")


def probe(policy: ShapesDiT, prompts: list[str], samples: int, steps: int, seed: int) -> tuple[float, float]:
    images = generate(policy, prompts, samples, steps, torch.Generator().manual_seed(seed))
    return rates(images, [q for q in prompts for _ in range(samples)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="*", help="checkpoint folders holding trainable.safetensors")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64)
    p.add_argument("--samples", type=int, default=16, help="samples per test prompt")
    p.add_argument("--steps", type=int, default=20, help="ODE steps")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    _, test = world.split(0, 16)
    by_category = {c: [q for q in test if spec_for(q).category == c] for c in ("position", "color_attr")}
    print(f"chance of a relation between two random cells: {CHANCE:.3f}")
    for label in ["base", *args.checkpoints]:
        policy = ShapesDiT(device="cpu", lora={"rank": args.rank, "alpha": args.alpha})
        if label != "base":
            policy.load_trainable_state_dict(load_file(str(Path(label) / "trainable.safetensors")))
        for category, prompts in by_category.items():
            objects, relation = probe(policy, prompts, args.samples, args.steps, args.seed)
            tail = f"  relation given the objects {relation:.3f}" if category == "position" else ""
            print(f"{label}: {category:10s} objects exactly right {objects:.3f}{tail}  ({len(prompts) * args.samples} samples)", flush=True)


if __name__ == "__main__":
    main()
