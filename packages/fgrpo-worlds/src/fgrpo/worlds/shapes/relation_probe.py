"""Does a shapes-dit policy know where to put things, or only what to draw?

    .venv/bin/python -m fgrpo.worlds.shapes.relation_probe [RUN/checkpoints/last ...]

For the held-out ``position`` and ``color_attr`` prompts it samples the shipped base (and, for
each checkpoint folder given, the base with that run's trainable weights) with the evaluation's
ODE sampler and prints: how often the image holds exactly the required objects (clean, nothing
else), for position prompts how often the relation holds *given* the right objects, and for
color_attr prompts how often the colours are bound to the right shapes *given* the right colours
and shapes (a bag of words binds right half of the time). Two
distinct random cells satisfy a relation 37.5% of the time, so a conditional rate near that means
the relation words are ignored. A checkpoint's LoRA shape (rank, alpha, target modules) is read
from the recipe in its ``state.json``; a folder holding only trainable weights takes --rank and
--alpha (the shapes recipes use 32/64) on the backbone's default targets.

``--text`` asks instead whether the (frozen) text encoder tells opposite relations apart: over every
position prompt "A REL B" it prints the mean distance between its conditioning (the token outputs,
flattened, and the pooled vector) and that of "A OPP B" (the relation word flipped), "B REL A" (the
objects swapped; both the opposite layout) and of random pairs of position prompts. A LoRA on the
transformer sees only this conditioning: what it does not separate, RL cannot teach apart.

``--words`` asks whether the transformer reads a two-object prompt's meaning or only its words.
For each held-out ``position`` and ``color_attr`` prompt P it takes two others written by the
grammar: Q says the same with the words reordered ("B OPP A"; "a C2 S2 and a C1 S1") and R uses
P's very words for another scene ("B REL A"; the colours bound to the other shapes, "a C2 S1 and
a C1 S2"). On the same noisy image of a scene of P (sigma ``--sigma``) it prints the mean distance
of the x0 predictions d(P, Q) and d(P, R) and the *meaning index* d(P, R) / (d(P, R) + d(P, Q)):
1 when the prediction follows the meaning, 0 for a bag of words (R has P's words), 0.5 when word
order matters but not what it means.

``--split train`` probes 16 training prompts per category instead of the held-out ones.

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
import numpy as np
import torch

from fgrpo.core import checkpoint as ckpt
from fgrpo.core.evaluation import generate
from fgrpo.worlds import shapes as world
from fgrpo.worlds.shapes.model import ShapesDiT
from fgrpo.worlds.shapes.scenes import relation_scenes
from fgrpo.worlds.shapes.verifier import read_cells, spec_for
from fgrpo.worlds.shapes.world import OPPOSITE, relation_holds

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


def binding_rates(images: torch.Tensor, prompts: list[str]) -> tuple[float, float]:
    """For colour-binding prompts: (fraction of images that draw exactly the required colours and
    shapes, clean, however bound; fraction of those that bind them right). A bag of words binds
    right half of the time (the two bindings use the same words)."""
    reading = read_cells(images)
    parts, right = 0, 0
    for b, prompt in enumerate(prompts):
        required = spec_for(prompt).required
        drawn = Counter(p.item for p in reading.scene(b))
        if bool(reading.clean[b]) and _colours_and_shapes(drawn) == _colours_and_shapes(required):
            parts += 1
            right += drawn == required
    return parts / len(prompts), right / parts if parts else float("nan")


def _colours_and_shapes(items: Counter) -> tuple[Counter, Counter]:
    return Counter(c for c, _ in items.elements()), Counter(s for _, s in items.elements())


def probe(policy: ShapesDiT, prompts: list[str], samples: int, steps: int, seed: int) -> str:
    """The report line's figures for one category's prompts: the objects, then the relation
    (position) or the binding (color_attr) given the parts."""
    images = generate(policy, prompts, samples, steps, torch.Generator().manual_seed(seed))
    repeated = [q for q in prompts for _ in range(samples)]
    objects, relation = rates(images, repeated)
    line = f"objects exactly right {objects:.3f}"
    if spec_for(prompts[0]).relation is not None:
        return line + f"  relation given the objects {relation:.3f}"
    parts, bound = binding_rates(images, repeated)
    return line + f"  right colours and shapes {parts:.3f}, bound right given them {bound:.3f}"


def opposites(prompt: str) -> dict[str, str]:
    """The prompts "A REL B" is compared with, written by the world's grammar: the relation word
    flipped ("A OPP B") and the objects swapped ("B REL A"; both give the opposite layout)."""
    spec = world.parse_prompt(prompt)
    assert spec.relation is not None, f"{prompt!r} names no relation"
    return {
        "relation word flipped": world.prompt_of(attrs.evolve(spec, relation=OPPOSITE[spec.relation])),
        "objects swapped": world.same_words_other_meaning(prompt)["same words"],
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


def meaning_index(predict, prompts: list[str], sigma: float, seed: int = 0) -> tuple[float, float, float]:
    """(d(P, Q), d(P, R), the meaning index) over ``prompts`` (module docstring, ``--words``):
    ``predict(x, sigma, prompts)`` is the x0 prediction for noisy images ``x`` (B, 3, 24, 24)."""
    rng = np.random.default_rng(seed)
    x0 = world.render_batch([world.place(q, rng) for q in prompts]) * 2 - 1
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    x = (1 - sigma) * x0 + sigma * noise
    others = [world.same_words_other_meaning(q) for q in prompts]
    with torch.no_grad():
        base = predict(x, sigma, prompts)
        same_meaning = predict(x, sigma, [o["same meaning"] for o in others])
        same_words = predict(x, sigma, [o["same words"] for o in others])
    d_meaning = (base - same_meaning).flatten(1).norm(dim=1).mean().item()
    d_words = (base - same_words).flatten(1).norm(dim=1).mean().item()
    total = d_meaning + d_words
    return d_meaning, d_words, d_words / total if total else float("nan")


def policy_x0(policy: ShapesDiT):
    """A policy's x0 prediction x - sigma v, as :func:`meaning_index` takes it."""

    def predict(x: torch.Tensor, sigma: float, prompts: list[str]) -> torch.Tensor:
        return x - sigma * policy.velocity(x, sigma, policy.encode(prompts))

    return predict


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
    p.add_argument("--words", action="store_true", help="does the prediction follow the meaning or the words?")
    p.add_argument("--split", choices=("test", "train"), default="test", help="held-out prompts, or 16 training ones")
    p.add_argument("--sigma", type=float, default=0.7, help="--words: the noise level of the compared predictions")
    args = p.parse_args()
    if args.words:
        return words_report(args)
    if args.marginal:
        return marginal_report(args)
    if args.text:
        position = world.all_prompts(["position"])  # the text encoder is frozen: one for every run
        for name, (tokens, pooled) in text_distances(
            ShapesDiT(path=args.weights, device="cpu").encode, position
        ).items():
            print(f"{name:22s} tokens {tokens:7.3f}  pooled {pooled:6.3f}  ({len(position)} position prompts)")
        return
    by_category = {c: probe_prompts(c, args.split) for c in ("position", "color_attr")}
    print(f"chance of a relation between two random cells: {CHANCE:.3f}; {args.split} prompts")
    for label, policy in policies(args):
        for category, prompts in by_category.items():
            figures = probe(policy, prompts, args.samples, args.steps, args.seed)
            print(f"{label}: {category:10s} {figures}  ({len(prompts) * args.samples} samples)", flush=True)


def lora_of(checkpoint: str | None, args: argparse.Namespace) -> dict:
    """The LoRA a checkpoint was trained with (the recipe its state.json holds); --rank and --alpha
    on the default targets for the base or a folder without a state.json."""
    if checkpoint is not None and (Path(checkpoint) / ckpt.STATE).is_file():
        lora = ckpt.read_state(Path(checkpoint))["recipe"].get("model", {}).get("lora")
        if lora:
            return lora
    return {"rank": args.rank, "alpha": args.alpha}


def policies(args: argparse.Namespace) -> Iterator[tuple[str, ShapesDiT]]:
    """("base", the base policy), then (folder, the base with that checkpoint's trainable weights)."""
    for label in ["base", *args.checkpoints]:
        policy = ShapesDiT(path=args.weights, device="cpu", lora=lora_of(None if label == "base" else label, args))
        if label != "base":
            policy.load_trainable_state_dict(ckpt.read_tensors(Path(label) / ckpt.TRAINABLE))
        yield label, policy


def probe_prompts(category: str, split: str, count: int = 16) -> list[str]:
    """A category's held-out prompts (``split`` "test"), or ``count`` of its training prompts
    evenly spread over the grammar's order ("train")."""
    train, test = world.split(0, 16)
    prompts = [q for q in (test if split == "test" else train) if spec_for(q).category == category]
    return prompts if split == "test" else prompts[:: max(1, len(prompts) // count)][:count]


def words_report(args: argparse.Namespace) -> None:
    train = set(world.split(0, 16)[0])
    for category in world.REBINDABLE:
        prompts = probe_prompts(category, args.split)
        twins = sum(world.same_words_other_meaning(q)["same words"] in train for q in prompts)
        print(f"{category}: {twins} of {len(prompts)} {args.split} prompts have a training prompt of the same words")
    for label, policy in policies(args):
        for category in world.REBINDABLE:
            prompts = probe_prompts(category, args.split)
            d_meaning, d_words, index = meaning_index(policy_x0(policy), prompts, args.sigma, args.seed)
            print(
                f"{label}: {category:10s} sigma {args.sigma}: d(same meaning) {d_meaning:.4f}  d(same words) "
                f"{d_words:.4f}  meaning index {index:.2f} (1 reads the meaning, 0 a bag of words; {len(prompts)} "
                "prompts)",
                flush=True,
            )


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
