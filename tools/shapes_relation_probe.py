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

``--weights FILE`` probes another base (a pretraining's output) instead of the shipped one.

``--marginal`` asks whether the transformer uses the relation where the layout is decided, at
sigma = 1: there the loss-optimal x0 prediction is the conditional mean E[x0 | prompt], known
exactly here (the average render over every pair of cells in the relation). Per position prompt
it prints the *relation coefficient* of the model's prediction (averaged over noise draws) along
Delta = E[x0 | A REL B] - E[x0 | A OPP B]: <pred - midpoint, Delta> / |Delta|^2, +0.5 when the
prediction is the right conditional mean, 0 when it ignores the relation word, -0.5 when it
reverses it; and the relation's *worth*, the fraction of the sigma = 1 loss of a relation-blind
prediction (the midpoint) that knowing the relation removes: |Delta / 2|^2 / (Var + |Delta / 2|^2).
A small worth is a weak training signal: the flow loss hardly rewards learning the relation.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file

from fgrpo.core.evaluation import generate
from fgrpo.models.shapes_dit import ShapesDiT
from fgrpo.rewards import shapes as world
from fgrpo.rewards.shapes.scenes import relation_pairs
from fgrpo.rewards.shapes.verifier import read_cells, spec_for
from fgrpo.rewards.shapes.world import OPPOSITE, Placed, relation_holds

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


def relation_scenes(prompt: str) -> list[tuple[Placed, Placed]]:
    """Every scene of a position prompt: its two objects in each ordered pair of distinct cells
    in the relation (the pretraining data draws one of them uniformly)."""
    spec = world.parse_prompt(prompt)
    (ca, sa, _), (cb, sb, _) = spec.objects
    return [(Placed(ca, sa, *a), Placed(cb, sb, *b)) for a, b in relation_pairs(spec.relation)]


def conditional_moments(prompt: str) -> tuple[torch.Tensor, float]:
    """(E[x0 | prompt] (3, 24, 24) in the model's [-1, 1] pixels, E||x0 - E[x0 | prompt]||^2 per
    pixel) over the prompt's scenes, exactly."""
    images = world.render_batch(relation_scenes(prompt)).double() * 2 - 1
    mean = images.mean(0)
    return mean, (images - mean).pow(2).mean().item()


def relation_coefficient(prediction: torch.Tensor, prompt: str) -> float:
    """The relation coefficient of an x0 ``prediction`` (3, 24, 24) for position ``prompt``: +0.5
    at E[x0 | prompt], -0.5 at E[x0 | relation flipped], 0 at their midpoint (module docstring)."""
    mean, _ = conditional_moments(prompt)
    flipped, _ = conditional_moments(opposites(prompt)["relation word flipped"])
    delta = mean - flipped
    return (((prediction.double() - (mean + flipped) / 2) * delta).sum() / delta.pow(2).sum()).item()


def relation_worth(prompt: str) -> float:
    """The share of a relation-blind prediction's sigma-1 loss that knowing the relation removes."""
    mean, variance = conditional_moments(prompt)
    flipped, _ = conditional_moments(opposites(prompt)["relation word flipped"])
    half = ((mean - flipped) / 2).pow(2).mean().item()
    return half / (variance + half)


def predicted_x0_at_noise(policy: ShapesDiT, prompt: str, draws: int, seed: int) -> torch.Tensor:
    """The policy's x0 prediction at sigma = 1 (x0 = x - v), averaged over ``draws`` noise images."""
    x = torch.randn((draws, *policy.latent_shape), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        v = policy.velocity(x, 1.0, policy.encode([prompt] * draws))
    return (x - v).mean(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="*", help="checkpoint folders holding trainable.safetensors")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64)
    p.add_argument("--samples", type=int, default=16, help="samples per test prompt")
    p.add_argument("--steps", type=int, default=20, help="ODE steps")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--text", action="store_true", help="compare the text conditioning of opposite relations")
    p.add_argument("--weights", help="a shapes-dit weights file to probe instead of the shipped base")
    p.add_argument("--marginal", action="store_true", help="does the x0 prediction at sigma 1 use the relation?")
    args = p.parse_args()
    if args.marginal:
        return marginal_report(args)
    if args.text:
        position = world.all_prompts(["position"])  # the text encoder is frozen: one for every run
        for name, (tokens, pooled) in text_distances(
            ShapesDiT(path=args.weights, device="cpu").encode, position
        ).items():
            print(f"{name:22s} tokens {tokens:7.3f}  pooled {pooled:6.3f}  ({len(position)} position prompts)")
        return
    _, test = world.split(0, 16)
    by_category = {c: [q for q in test if spec_for(q).category == c] for c in ("position", "color_attr")}
    print(f"chance of a relation between two random cells: {CHANCE:.3f}")
    for label, policy in policies(args):
        for category, prompts in by_category.items():
            objects, relation = probe(policy, prompts, args.samples, args.steps, args.seed)
            tail = f"  relation given the objects {relation:.3f}" if category == "position" else ""
            print(
                f"{label}: {category:10s} objects exactly right {objects:.3f}{tail}  ({len(prompts) * args.samples} "
                f"samples)",
                flush=True,
            )


def policies(args: argparse.Namespace) -> Iterator[tuple[str, ShapesDiT]]:
    """("base", the base policy), then (folder, the base with that checkpoint's trainable weights)."""
    for label in ["base", *args.checkpoints]:
        policy = ShapesDiT(path=args.weights, device="cpu", lora={"rank": args.rank, "alpha": args.alpha})
        if label != "base":
            policy.load_trainable_state_dict(load_file(str(Path(label) / "trainable.safetensors")))
        yield label, policy


def marginal_report(args: argparse.Namespace) -> None:
    train, test = world.split(0, 16)
    split = {
        "train": [q for q in train if spec_for(q).category == "position"][::8][:32],
        "test": [q for q in test if spec_for(q).category == "position"],
    }
    worth = [relation_worth(q) for q in split["test"]]
    print(f"relation worth at sigma 1: {sum(worth) / len(worth):.4f} of a relation-blind prediction's loss")
    for label, policy in policies(args):
        for name, prompts in split.items():
            found = [
                relation_coefficient(predicted_x0_at_noise(policy, q, args.samples, args.seed), q) for q in prompts
            ]
            mean = sum(found) / len(found)
            print(
                f"{label}: {name:5s} relation coefficient at sigma 1 {mean:+.3f} (min {min(found):+.3f}, max "
                f"{max(found):+.3f}; +0.5 knows it, 0 ignores it; {len(prompts)} prompts)",
                flush=True,
            )


if __name__ == "__main__":
    main()
