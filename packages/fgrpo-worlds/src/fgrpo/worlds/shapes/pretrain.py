"""Pretrain the ``shapes-dit`` base model: rectified-flow matching on rendered shapes scenes.

    .venv/bin/python -m fgrpo.worlds.shapes.pretrain                # reproduces the shipped weights
    .venv/bin/python -m fgrpo.worlds.shapes.pretrain --device cuda  # the same on a GPU (not bit-identical)

What it does (every default is what made fgrpo/worlds/shapes/weights/shapes-base.safetensors):

- data: (prompt, image) pairs rendered by the shapes world (``fgrpo.worlds.shapes``) from the
  TRAIN prompts of ``split(--split-seed, --test-per-category)`` only (no test prompt and no
  rephrasing of a test scene is ever trained on); the category of each example is drawn
  uniformly, then a prompt of it. With probability ``--caption-noise`` the image is rendered
  from a perturbed scene (one wrong count, colour, shape, relation or binding) while the caption
  stays the original: the base learns to make those mistakes, as captions make real models
  imperfect, and RL has something to fix. ``--prompt-dropout`` replaces prompts by "" (the
  null prompt of classifier-free guidance).
- loss: MSE between the network's velocity and eps - x0 at x_t = (1 - t) x0 + t eps, pixels in
  [-1, 1], t logit-normal (``--logit-mean``, ``--logit-std``); AdamW, ``--warmup`` linear steps,
  then cosine from ``--lr`` to ``--lr-min`` over ``--decay-steps`` (a horizon that does not
  depend on ``--steps``: stopping at step K gives exactly the run's checkpoint at step K), an
  EMA of the weights (``--ema``; the EMA weights are the ones evaluated and written).
  ``--contrastive W`` (0.05 by default) adds W times a caption-image contrastive loss whose hard
  negatives are each caption's same-words rebinding (:class:`CaptionContrast`;
  ``--contrastive-negatives arrangements``: every other arrangement of a position prompt's
  objects); ``--meaning W`` (0.01 by default) adds W times an auxiliary head that reads the
  caption's items, counts and relations off the pooled text vector (:class:`MeaningHead`).
- the layout: the network has a planner (``--layout-plan 256``, its width): an MLP from the
  pooled text to an image, embedded like the state's pixels and added to each cell's token
  (``Architecture.layout_plan``). ``--plan-steps 2000`` first train the text encoder and the
  planner alone to make each position caption's plan the mean of its scenes
  (:func:`pretrain_planner`, :class:`PlanLoss`); ``--plan 1`` keeps that loss on in the flow
  matching, and ``--layout 1`` adds the exact posterior mean over the caption's scenes as the x0
  target of position captions at sigma in [0.5, 1] (:class:`LayoutDenoiser`), where the
  transformer learns to draw the plan.
- evaluation: strict accuracy (``ShapesVerifier``) of the held-out TEST prompts, each sampled
  ``--eval-samples`` times with the ODE sampler the trainer's evaluation uses
  (``fgrpo.core.evaluation.generate``, ``--eval-steps`` steps, time shift ``--shift``), every
  ``--eval-every`` steps and at the end, per category; the final numbers are those of the
  written file (float16 weights).
- output: ``--out`` (safetensors, float16 so the file stays under 20 MB; the architecture,
  vocabulary and these settings in its metadata). ``--checkpoint-dir`` also keeps the file of
  every evaluation.

Stops after ``--steps`` optimizer steps, or earlier when ``--time-budget`` seconds of training
(evaluations excluded) are spent. Evaluations do not change the training (same weights with any
``--eval-every``); the same thread count gives the same weights.

Measured with the defaults (2 CPU cores, 2 threads, nothing else running; 5.69M transformer
parameters, 0.48M of them the planner, + 0.24M text encoder): the planner's 2000 steps in 23 s
(plan loss 0.0004, where the relation-blind mean scores 0.0081), then 1500 steps at 0.341 s/step
(batch 128; 511 s), about 9.5 min in all. The written file (4 samples x 69 test prompts, 20 ODE
steps):

    strict 0.435 partial 0.650 clean 1.00 cells 1.000 gold 0.2 |
    single=0.58 two=0.30 counting=0.20 position=0.62 color_attr=0.55

RL from it (recipes/shapes.yaml, 200 iterations, 2 threads, the recipe's evaluation): strict
0.395 -> 0.775, position 0.48 -> 0.80, gold error 0.199 -> 0.204 (seed 0); given the right objects
the relation holds 0.825 -> 0.902 of the time (256 samples). With the LoRA on the attention alone:
0.659 at beta 0.05, 0.703 at beta 0.01 (gold 0.235); and at 1 thread from a 1500-step file of the
same settings, 0.442 -> 0.674, position 0.53 -> 0.73 (0.78 at iteration 125).

Why a planner. Every lever below left the relation given the objects at chance: the relation is
a product of a token's position and the text that the attention must learn, and the
relation-blind prediction is a plateau the flow loss does not leave. Measured at 3000 steps
(1 thread; strict / position of the tool's evaluation; both objects right and the relation given
them from ``fgrpo.worlds.shapes.relation_probe``, chance 0.375):

    --layout-plan 256 --plan 1 (no planner steps first)      1500 steps: plan flat (red minus
                                                             blue +0.04 in every column)
    --layout-plan 256 --plan-steps 2000 --plan 1             0.337 / 0.27   0.438  0.500
      RL from it: 0.341 -> 0.478, position 0.16 -> 0.22, the relation given the objects 0.506
    --layout-plan 256 --plan-steps 2000 --plan 0             1500 steps: the plan forgotten
    --layout-plan 256 --plan-steps 2000 --plan 1 --layout 1  1500 steps: 0.457 / 0.62

The text encoder and the planner alone learn the plan of held-out captions exactly (MSE 0.0001
after 2200 steps, lr 1e-3); inside the flow matching they stay at the blind mean. With the plan
and no ``--layout`` the transformer follows it weakly (x0 at sigma 1, red minus blue by column:
+0.06 / +0.05 / -0.02 for "left of" against a plan of +0.22 / +0.03 / -0.17) and RL does not
sharpen it; ``--layout`` teaches the transformer to draw the plan, and RL then moves position.

The previous shipped file (6000 steps, no planner or layout loss; 1586 s of training):

    step  1500 ( 392 s) 0.225     step  4500 (1187 s) 0.377
    step  3000 ( 789 s) 0.290     step  6000 (1586 s) 0.402 (that file)

    that file: strict 0.402 partial 0.643 clean 1.00 cells 1.000 gold 0.10 |
               single=0.75 two=0.42 counting=0.44 position=0.20 color_attr=0.42

The rest of that 12000-step cosine reaches 0.435 / 0.464 at steps 9000 / 12000 (position 0.19),
and RL from the step-12000 file gained less, 0.507 -> 0.616. From that file: 0.417 -> 0.580 (seed
0), 0.409 -> 0.543 (seed 1), 0.355 -> 0.525 (seed 2); colour binding 0.55 -> 0.83; position 0.14
-> 0.25, only because both objects are drawn more often (given the objects, the relation holds
0.315 of the time in the base and 0.330 after RL: ``fgrpo.worlds.shapes.relation_probe``).

The file before it (no auxiliary losses, 12000 steps, 3076 s): strict 0.377 | single=0.75
two=0.48 counting=0.52 position=0.14 color_attr=0.23; the main job took it 0.406 -> 0.511 while
colour binding and position stayed flat. At its steps 1500 / 3000 / 4500 / 6000 / 7500 / 9000 /
10500: 0.156 / 0.196 / 0.304 / 0.341 / 0.362 / 0.370 / 0.391.

In that file position stays at chance level (two random cells satisfy a relation 37.5% of the time,
times the ~0.5 chance of drawing both objects right) at every step: it learns what objects to draw,
not where. A 4000-step horizon (the previous default, 17.8 min) gave 0.322 (position 0.16).

Why: it reads a two-object caption as a bag of words (``fgrpo.worlds.shapes.relation_probe
--words``: meaning index 0.51 position, 0.30 colour binding; 1 = the meaning, 0 = the words). At
3000 steps (cosine over 12000, seed 0), held-out colour binding right given the right colours and
shapes, and the meaning index:

    no auxiliary losses (1 text)    0.30   0.46      strict 0.221
    --text-layers 3                 0.48   0.22      strict 0.199
    --contrastive 0.05              0.92   0.84      strict 0.279 (position 0.43 | objects, ~70 images)
      --contrastive-negatives arrangements
                                    0.80   0.69      strict 0.261 (position 0.39 | objects, index 0.50)
    --contrastive 0.05 --meaning 0.01 (the defaults)
                                    0.97   0.95      strict 0.290 (position 0.375 | objects, index 0.55)

      --contrastive-flow 0.2        0.92   0.90      strict 0.268 (position 0.39 | objects, index 0.46)

RL from that 3000-step file (recipes/shapes.yaml, 200 iterations):
strict 0.290 -> 0.442, colour binding 0.375 -> 0.609, position 0.094 -> 0.172, gold 0.241 ->
0.247. Position: with the meaning head the text encoder tells the relations apart (``--text``:
flipping the relation word moves the pooled vector 21.2, swapping the objects 21.5, a random pair
83; without it 0.39 and 2.2), and still the transformer draws the two objects in either order:
its x0 prediction at sigma 1 for "a red square to the left of a blue circle" has red minus blue
0.06 / 0.08 / 0.04 over the left / middle / right columns where the conditional mean has 0.25 /
0.04 / -0.16 (the previous shipped file: -0.05 / -0.04 / -0.06): the layout is not learned where it is
decided. More high noise (``--logit-mean 1 --logit-std 1.5`` with the meaning head: 21 % of the
draws above sigma 0.9 instead of 4.5 %) raises the position meaning index to 0.67 (binding 0.96,
strict 0.290) and leaves the sigma-1 columns flat (0.09 / 0.10 / 0.09; relation given the objects
0.384).

Three more levers for position, each 3000 steps of the 12000-step cosine with the previous file's settings,
1 thread, two runs at a time (strict / position of the tool's evaluation; then, from
``fgrpo.worlds.shapes.relation_probe``, 256 samples of the 16 held-out position prompts: both objects
exactly right, the relation given them; chance 0.375):

    --clear-position 1.0 (every position image level, at the grid's
      opposite edges: the relation sets the columns)         0.308 / 0.19   0.348  0.337
    --clear-position 0.5                                     0.275 / 0.16   0.352  0.322
    --position-scale 4 (sin-cos positions of norm 39, not
      9.8, beside 15 of a pure-noise patch's embedding)      0.355 / 0.17   0.363  0.398
    --position-scale 4 --clear-position 1.0                  0.355 / 0.14   0.375  0.344
    --layout 1 (the exact posterior mean over the caption's
      27 scenes as the x0 target at sigma in [0.5, 1])       0.399 / 0.31   0.676  0.364
    --layout 4                                               0.413 / 0.38   0.828  0.302
    --cell-conditioning (a per-cell term on each image token
      from the pooled text; 2 threads, alone)                 0.344 / 0.22   0.395  0.347
    --position-scale 4 --layout 4 (2 threads, alone)         0.409 / 0.31   0.867  0.324

The layout loss makes the base draw both objects (0.35 -> 0.83) and not where: the relation stays
at chance in every run. Trained on clear layouts only, the x0 prediction at sigma 1 still has
relation coefficient -0.026 (``--marginal``, train prompts). With a red square planted at row 1,
column 2 at sigma 0.7 to 0.9, the predicted blue mass per cell is the same to 0.01 for "a red
square to the right of / above / to the left of a blue circle", in the shipped file and with
``--layout 4``: the text encoder separates the relations (``--text``) and the transformer does
not read them. The text does reach it: in the shipped file the context embeddings of "A left of
B" and "A right of B" are 83 apart (another colour: 188), while the pooled path is nearly shut
(the timestep-and-pooled embedding moves 0.006). Trained on nothing but the ``--layout`` target at
sigma in [0.99, 1] (300 AdamW steps of 32 position captions, lr 3e-4 or 3e-3, from the shipped
file or the ``--cell-conditioning`` run), the loss falls to the relation-blind optimum and stays
there (0.0075 to 0.0091 over batches; that optimum, the mean over the four relations of the two
objects, is 0.0081 over the 496 training captions, perfect is 0), the columns of "left of" and
"right of" equal to 0.004: a plateau, not a lack of signal. From the ``--position-scale 4
--clear-position 1.0`` run the same fit (lr 3e-3) leaves it between steps 250 and 300: loss
0.0018, red minus blue by column +0.17 / +0.01 / -0.16 for "left of" and -0.15 / +0.04 / +0.22 for
"right of". So the larger positions make the layout learnable, and in pretraining the flow loss
keeps the network on the plateau: ``--position-scale 4 --layout 4`` for 3000 steps still leaves
the relation at chance (above); the planner (the defaults) is the layout given to the network
rather than inferred. ``--clear-position``, ``--position-scale`` and ``--cell-conditioning`` are
off by default (off they change nothing: 40 steps with and without their code, bit-identical).
Trained on nothing but the layout target, a fresh network (positions x1 or x4, lr 2e-3) also sits
at the blind optimum for 600 steps (0.0082).
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
from fgrpo.worlds.shapes.scenes import relation_scenes
from fgrpo.worlds.shapes.world import COUNTS, ITEMS, OPPOSITE

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


def captions_of(prompts: list[str], pooled: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """The prompts that say something and their rows of ``pooled`` (the flow loss's own text
    encoding, so an auxiliary loss does not encode them again): the null prompt of CFG shows
    nothing in particular."""
    keep = [i for i, q in enumerate(prompts) if q]
    return [prompts[i] for i in keep], pooled[keep].float()


class CaptionContrast(torch.nn.Module):
    """A CLIP-style loss that makes the text encoder read what a caption means, not only its words
    (NegCLIP's hard negatives, Yuksekgonul et al. 2023, "When and why vision-language models behave
    like bags-of-words"): an image encoder (an MLP over the clean render's pixels) and a projection
    of the text encoder's pooled vector meet in a ``width``-dim space; each image is scored
    against every caption of the batch and every caption's same-words rebinding
    (:func:`fgrpo.worlds.shapes.world.same_words_other_meaning`), each caption against every
    image; symmetric cross entropy at a learned temperature. Only the flow loss reaches the
    transformer; the text encoder gets both. Measured (3000 steps from scratch, weight 0.05, 2
    threads): held-out colour binding right given the right colours and shapes 0.92 against 0.30
    without it; position not separated (meaning index 0.48, relation given the objects 0.43)."""

    def __init__(self, width: int, pixels: int, seed: int, negatives: str = "rebinding"):
        super().__init__()
        self.negatives = negatives
        self.image = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(pixels, 512),
            torch.nn.GELU(),
            torch.nn.Linear(512, 512),
            torch.nn.GELU(),
            torch.nn.Linear(512, width),
        )
        self.text = torch.nn.Linear(width, width)
        self.log_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.rng = np.random.default_rng(seed)

    def forward(self, network: ShapesNetwork, prompts: list[str], pooled: torch.Tensor) -> torch.Tensor:
        captions, pooled = captions_of(prompts, pooled)
        device = pooled.device
        images = world.render_batch([world.sample_scene(q, self.rng) for q in captions]).to(device) * 2 - 1
        negatives = [n for q in captions for n in hard_negatives(q, self.negatives)]
        if negatives:
            pooled = torch.cat([pooled, network.text(network.token_ids(negatives, device))[1]])
        return symmetric_info_nce(self.image(images), self.text(pooled), self.log_scale.exp().clamp(max=100.0))


class MeaningHead(torch.nn.Module):
    """An auxiliary head that reads a caption's meaning off the text encoder's pooled vector: which
    items it names at which count (one-hot per item and count) and, for a position prompt, the
    relation of each ordered pair of its items ("A left of B" sets (A, B, left) and (B, A, right)),
    so a paraphrase shares its target and a rebinding or a flipped relation does not. Binary cross
    entropy; the text encoder learns the scene a caption denotes, the flow loss how to draw it."""

    def __init__(self, width: int):
        super().__init__()
        n = len(ITEMS)
        self.counts = (1, *COUNTS)
        self.sizes = (n * len(self.counts), n * n * len(world.RELATIONS))
        self.head = torch.nn.Linear(width, sum(self.sizes))

    def target(self, prompt: str) -> torch.Tensor:
        spec = world.parse_prompt(prompt)
        items, pairs = (
            torch.zeros(len(ITEMS), len(self.counts)),
            torch.zeros(len(ITEMS), len(ITEMS), len(world.RELATIONS)),
        )
        for color, shape, count in spec.objects:
            items[ITEMS.index((color, shape)), self.counts.index(count)] = 1
        if spec.relation is not None:
            a, b = (ITEMS.index((c, s)) for c, s, _ in spec.objects)
            pairs[a, b, world.RELATIONS.index(spec.relation)] = 1
            pairs[b, a, world.RELATIONS.index(OPPOSITE[spec.relation])] = 1
        return torch.cat([items.flatten(), pairs.flatten()])

    def forward(self, network: ShapesNetwork, prompts: list[str], pooled: torch.Tensor) -> torch.Tensor:
        captions, pooled = captions_of(prompts, pooled)
        target = torch.stack([self.target(q) for q in captions]).to(pooled.device)
        # summed over the targets (most are 0), averaged over captions: each named part counts
        bce = torch.nn.functional.binary_cross_entropy_with_logits(self.head(pooled), target, reduction="sum")
        return bce / len(captions)


def posterior_mean(x: torch.Tensor, scenes: torch.Tensor, sigma: float) -> torch.Tensor:
    """E[x0 | x_sigma = x] when x0 is one of ``scenes`` (K, ...) uniformly and x_sigma = (1 - sigma)
    x0 + sigma eps, eps standard normal: the scenes weighted by their Gaussian likelihoods."""
    logits = -((x - (1 - sigma) * scenes) ** 2).flatten(1).sum(1) / (2 * sigma**2)
    return torch.einsum("k,k...->...", logits.softmax(0), scenes)


class LayoutDenoiser(torch.nn.Module):
    """The flow loss of position captions at high noise, with its variance removed: the exact
    posterior mean E[x0 | x_sigma, caption] over the caption's scenes (its two objects in every
    pair of cells in the relation, uniformly, as the data draws them) is the target of the x0
    prediction at sigma ~ U(``low``, 1), instead of the one scene drawn. Same minimiser as the
    flow loss on clean captions there (the MSE to a draw is the MSE to the mean plus the draw's
    variance), without the variance that buries the layout: at sigma 1 knowing the relation
    removes 6 % of a relation-blind prediction's loss (``fgrpo.worlds.shapes.relation_probe
    --marginal``), and the transformer learned to ignore it."""

    def __init__(self, seed: int, low: float = 0.5):
        super().__init__()
        self.low = low
        self.gen = torch.Generator().manual_seed(seed)
        self.scenes: dict[str, torch.Tensor] = {}

    def renders(self, caption: str) -> torch.Tensor:
        """(K, 3, 24, 24) in [-1, 1]: every scene of a position caption."""
        if caption not in self.scenes:
            self.scenes[caption] = world.render_batch(relation_scenes(caption)) * 2 - 1
        return self.scenes[caption]

    def forward(self, network: ShapesNetwork, prompts: list[str], pooled: torch.Tensor) -> torch.Tensor:
        captions = [q for q in prompts if q and world.parse_prompt(q).relation is not None]
        if not captions:
            return pooled.sum() * 0
        device = pooled.device
        n = len(captions)
        sigma = self.low + (1 - self.low) * torch.rand(n, generator=self.gen)
        xt, targets = [], []
        for i, q in enumerate(captions):
            scenes = self.renders(q)
            s = sigma[i]
            x0 = scenes[int(torch.randint(len(scenes), (1,), generator=self.gen))]
            x = (1 - s) * x0 + s * torch.randn(x0.shape, generator=self.gen)
            targets.append(posterior_mean(x, scenes, float(s)))
            xt.append(x)
        x, target, sigma = torch.stack(xt).to(device), torch.stack(targets).to(device), sigma.to(device)
        cond = network.encode(captions)
        out = network(x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"])
        x0_hat = x - sigma[:, None, None, None] * to_velocity(out.float(), x, sigma, network.arch.prediction)
        return (x0_hat - target).pow(2).mean()


class PlanLoss(torch.nn.Module):
    """The layout planner's supervision (``--layout-plan``): for each position caption of the
    batch, the MSE of its plan to the mean of the caption's scenes, which is the x0 a denoiser
    should predict from pure noise (:func:`posterior_mean` at sigma 1). The other categories' plans
    learn from the flow loss alone."""

    def __init__(self, scenes: LayoutDenoiser):
        super().__init__()
        self.scenes = scenes  # shares the renders' cache

    def forward(self, network: ShapesNetwork, prompts: list[str], pooled: torch.Tensor) -> torch.Tensor:
        rows = [i for i, q in enumerate(prompts) if q and world.parse_prompt(q).relation is not None]
        if not rows:
            return pooled.sum() * 0
        target = torch.stack([self.scenes.renders(prompts[i]).mean(0) for i in rows]).to(pooled.device)
        plan = network.transformer.pos_embed.plan(pooled[rows])
        return (plan.float() - target).pow(2).mean()


def pretrain_planner(network: ShapesNetwork, prompts: list[str], loss: PlanLoss, args: argparse.Namespace) -> float:
    """``--plan-steps`` of AdamW on :class:`PlanLoss` alone over the position captions of
    ``prompts``, text encoder and planner only, before the flow matching: the text learns to carry
    the layout while nothing else pulls on it (inside the flow matching the plan stays at the
    relation-blind mean: the tool's docstring). Returns the seconds spent."""
    captions = [q for q in prompts if world.parse_prompt(q).relation is not None]
    params = [*network.text.parameters(), *network.transformer.pos_embed.planner.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.plan_lr, weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed + 6)
    start, recent = time.perf_counter(), list[float]()
    for step in range(1, args.plan_steps + 1):
        batch = [captions[i] for i in torch.randint(len(captions), (args.plan_batch,), generator=gen)]
        value = loss(network, batch, network.encode(batch)["pooled_prompt_embeds"])
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        recent = [*recent[-99:], value.item()]
        if step % 500 == 0 or step == args.plan_steps:
            print(f"plan step {step:5d} loss {sum(recent) / len(recent):.4f}", flush=True)
    return time.perf_counter() - start


#: --contrastive-negatives: which captions over a prompt's own words score against its image
NEGATIVES = ("rebinding", "arrangements")


def hard_negatives(prompt: str, kind: str) -> list[str]:
    """ "rebinding": the same-words other-meaning prompt of a position or colour-binding prompt;
    "arrangements": for position prompts every other arrangement of the two objects instead
    (:func:`fgrpo.worlds.shapes.world.other_arrangements`), so the relation word counts too."""
    category = world.parse_prompt(prompt).category
    if kind == "arrangements" and category == "position":
        return world.other_arrangements(prompt)
    if category in world.REBINDABLE:
        return [world.same_words_other_meaning(prompt)["same words"]]
    return []


def symmetric_info_nce(images: torch.Tensor, texts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Image i's caption is text i; texts beyond the images' count are negatives only."""
    logits = scale * torch.nn.functional.normalize(images, dim=-1) @ torch.nn.functional.normalize(texts, dim=-1).T
    target = torch.arange(len(images), device=images.device)
    loss_images = torch.nn.functional.cross_entropy(logits, target)
    loss_texts = torch.nn.functional.cross_entropy(logits[:, : len(images)].T, target)
    return (loss_images + loss_texts) / 2


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
