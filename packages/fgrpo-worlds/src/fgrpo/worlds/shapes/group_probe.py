"""How much learning signal do GRPO groups carry, per category of the shapes world?

    .venv/bin/python -m fgrpo.worlds.shapes.group_probe [--recipe recipes/shapes.yaml] [--checkpoint DIR]
                                                  [--groups 8 16 32] [--prompts 32]

Rolls out groups of G samples of training prompts with the recipe's own sampler and policy (the
shipped base, or a checkpoint's trainable weights), scores them with the strict verifier and
prints, per category and group size: the strict accuracy, the fraction of groups whose rewards
are not all equal (the groups that get a non-zero advantage; the others are dropped by
``train.drop_zero_advantage``), and for ``position`` the fraction of groups whose spread can
teach the relation: at least one sample with exactly the required objects whose relation holds
and one whose relation fails (otherwise the spread only rewards drawing the objects). It also
prints how often the relation holds given the right objects (chance: 0.375).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.seeding import generator
from fgrpo.worlds.shapes.relation_probe import outcomes
from fgrpo.worlds.shapes.verifier import evaluate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/shapes.yaml")
    p.add_argument("--checkpoint", help="a checkpoint folder whose trainable weights to load (LoRA as in the recipe)")
    p.add_argument("--groups", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--prompts", type=int, default=32, help="training prompts per category")
    p.add_argument("--chunk", type=int, default=512, help="samples per rollout call")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--categories", nargs="+", help="only these categories (default: all)")
    args = p.parse_args()
    recipe = recipe_mod.load(args.recipe)
    policy = recipe.build("model")
    if args.checkpoint:
        policy.load_trainable_state_dict(ckpt.read_tensors(Path(args.checkpoint) / ckpt.TRAINABLE, policy.device))
    sampler = recipe.build("sampler")
    source = recipe.build("prompts")
    by_category: dict[str, list[str]] = {}
    for prompt in dict.fromkeys(source.train_prompts()):
        by_category.setdefault(source.metadata(prompt)["category"], []).append(prompt)
    print(f"{args.recipe} {args.checkpoint or 'base'}: {args.prompts} training prompts per category")
    for category, prompts in by_category.items():
        if args.categories and category not in args.categories:
            continue
        prompts = prompts[: args.prompts]
        for group in args.groups:
            per_call = max(1, args.chunk // group)
            accuracy, informative, relation_groups, holds = [], 0, 0, []
            for start in range(0, len(prompts), per_call):
                chunk = prompts[start : start + per_call]
                g = generator(args.seed, "probe", group, start)
                with torch.no_grad():
                    traj = sampler.rollout(policy, chunk, group, generator=g)
                    images = policy.decode(traj.final)
                details = evaluate(images, traj.prompts, [source.metadata(q) for q in traj.prompts])
                acc = details["accuracy"].reshape(len(chunk), group)
                accuracy.append(acc)
                informative += int((acc.max(1).values != acc.min(1).values).sum())
                if category == "position":
                    found = outcomes(images, traj.prompts)
                    holds += [o for o in found if o is not None]
                    for i in range(len(chunk)):
                        row = found[i * group : (i + 1) * group]
                        relation_groups += int(1 in row and 0 in row)
            acc = torch.cat(accuracy)
            line = (
                f"{category:10s} G={group:3d}  strict {acc.mean():.3f}  non-flat groups "
                f"{informative / len(prompts):.3f}"
            )
            if category == "position":
                rate = sum(holds) / len(holds) if holds else float("nan")
                line += (
                    f"  relation-informative groups {relation_groups / len(prompts):.3f}  relation | objects "
                    f"{rate:.3f}"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
