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

``--text`` asks instead whether the (frozen) text encoder tells opposite relations apart: over every
position prompt "A REL B" it prints the mean distance between its conditioning (the token outputs,
flattened, and the pooled vector) and that of "A OPP B" (the relation word flipped), "B REL A" (the
objects swapped; both the opposite layout) and of random pairs of position prompts. A LoRA on the
transformer sees only this conditioning: what it does not separate, RL cannot teach apart.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file

from fgrpo.core.evaluation import generate
from fgrpo.models.shapes_dit import ShapesDiT
from fgrpo.rewards import shapes as world
from fgrpo.rewards.shapes.verifier import read_cells, spec_for
from fgrpo.rewards.shapes.world import OPPOSITE, relation_holds

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
    with_relation = [
        o for o, q in zip(found, prompts, strict=True) if o is not None and spec_for(q).relation is not None
    ]
    objects = sum(o is not None for o in found) / len(prompts)
    return objects, sum(with_relation) / len(with_relation) if with_relation else float("nan")


def probe(policy: ShapesDiT, prompts: list[str], samples: int, steps: int, seed: int) -> tuple[float, float]:
    images = generate(policy, prompts, samples, steps, torch.Generator().manual_seed(seed))
    return rates(images, [q for q in prompts for _ in range(samples)])


def opposites(prompt: str) -> dict[str, str]:
    """The prompts "A REL B" is compared with, written by the world's grammar: the relation word
    flipped ("A OPP B") and the objects swapped ("B REL A"; both give the opposite layout)."""
    spec = world.parse_prompt(prompt)
    return {
        "relation word flipped": world.prompt_of(attrs.evolve(spec, relation=OPPOSITE[spec.relation])),
        "objects swapped": world.prompt_of(attrs.evolve(spec, objects=spec.objects[::-1])),
    }


def text_distances(encode, prompts: list[str], pairs: int = 2000, seed: int = 0) -> dict[str, tuple[float, float]]:
    """{comparison: (mean distance of the flattened token outputs, of the pooled vectors)} over
    ``prompts`` (position prompts); ``encode`` is a policy's ``encode``."""
    with torch.no_grad():
        cond = encode(prompts)
    tokens, pooled = cond["prompt_embeds"].flatten(1), cond["pooled_prompt_embeds"]
    index = {q: i for i, q in enumerate(prompts)}
    found: dict[str, list[tuple[int, int]]] = {"relation word flipped": [], "objects swapped": []}
    for q in prompts:
        for name, other in opposites(q).items():
            if other in index and other != q:
                found[name].append((index[q], index[other]))
    g = torch.Generator().manual_seed(seed)
    found["random pair"] = torch.randint(len(prompts), (pairs, 2), generator=g).tolist()

    def mean_distance(x: torch.Tensor, ij: list) -> float:
        i, j = torch.tensor(ij).T
        return (x[i] - x[j]).norm(dim=1).mean().item()

    return {name: (mean_distance(tokens, ij), mean_distance(pooled, ij)) for name, ij in found.items() if ij}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="*", help="checkpoint folders holding trainable.safetensors")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64)
    p.add_argument("--samples", type=int, default=16, help="samples per test prompt")
    p.add_argument("--steps", type=int, default=20, help="ODE steps")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--text", action="store_true", help="compare the text conditioning of opposite relations")
    args = p.parse_args()
    if args.text:
        position = world.all_prompts(["position"])  # the text encoder is frozen: one for every run
        for name, (tokens, pooled) in text_distances(ShapesDiT(device="cpu").encode, position).items():
            print(f"{name:22s} tokens {tokens:7.3f}  pooled {pooled:6.3f}  ({len(position)} position prompts)")
        return
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
            print(
                f"{label}: {category:10s} objects exactly right {objects:.3f}{tail}  ({len(prompts) * args.samples} "
                f"samples)",
                flush=True,
            )


if __name__ == "__main__":
    main()
