"""The auxiliary losses of the shapes base's pretraining (:mod:`fgrpo.worlds.shapes.pretrain`): a
caption-image contrastive loss with hard negative captions, a head that reads a caption's meaning
off the pooled text, the exact posterior-mean layout target of position captions, and the plan
loss of the layout planner (docs/worlds.md, "shapes: the base")."""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from fgrpo.worlds import shapes as world
from fgrpo.worlds.shapes.network import ShapesNetwork, to_velocity
from fgrpo.worlds.shapes.scenes import relation_scenes
from fgrpo.worlds.shapes.world import COUNTS, ITEMS, OPPOSITE


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
