"""The worlds ``tools/bench/objectives.py`` ranks objectives on: which recipes, which held-out metric
(higher is better) and which gold (lower is better, with its limit), and how to read both from a
run; and the tables over seeds.

A board's gold limit is either a ratio to the base's gold (shapes, shapes-edit: at most 1.2x the
base's error on every seed) or the base's own value (driving: collisions at most the BC base's).
"Best at the gold limit" is the recipe with the highest mean held-out metric at the end of its
budget among those whose gold keeps the limit on every seed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import _bench
import attrs

# the objectives of the leaderboard on the shapes world, each its shipped recipe
SHAPES = {
    "grpo": ("recipes/shapes.yaml", []),
    "grpo-guard": ("recipes/shapes-guard.yaml", []),
    "fast": ("recipes/shapes-fast.yaml", []),
    "mixgrpo-flash": ("recipes/shapes-mixgrpo.yaml", []),
    "nft": ("recipes/shapes-nft.yaml", []),
    "awm": ("recipes/shapes-awm.yaml", []),
    "dpo": ("recipes/shapes-dpo.yaml", []),
    "pairwise": ("recipes/shapes-pairwise.yaml", []),
    "dgpo": ("recipes/shapes-dgpo.yaml", []),
    "flow-dppo": ("recipes/shapes-dppo.yaml", []),
    "tempflow": ("recipes/shapes-tempflow.yaml", []),
    "flash": ("recipes/shapes-flash.yaml", []),
    "branch": ("recipes/shapes-branch.yaml", []),
}

# the editing recipe (NFT) and the same world under the other objectives. The others were measured
# on the previous recipe's reward (similarity weight 0.15), which they keep so their cells reproduce:
# awm is that recipe whole, nft-shapes nft with its shapes settings, grpo / flow-dppo / dgpo theirs.
_EDIT_SDE = "sampler={name: full, steps: 10, kernel: {name: cps, eta: 0.8}}"
_EDIT_REWARD = (
    "reward=[{name: shapes-edit, score: strict}, {name: image-similarity, backbone: ssim, grid: 3, spare: 1, "
    "weight: 0.15}]"
)
SHAPES_EDIT = {
    "nft": ("recipes/shapes-edit.yaml", []),
    "awm": ("recipes/shapes-edit.yaml", [_EDIT_REWARD, "objective={name: awm, kl_beta: 0.6, train_timesteps: 3}"]),
    "nft-shapes": (
        "recipes/shapes-edit.yaml",
        [_EDIT_REWARD, "objective={name: nft, nft_beta: 1.0, kl_beta: 0.0, decay_type: 1, timestep_fraction: 0.3}"],
    ),
    "grpo": (
        "recipes/shapes-edit.yaml",
        [_EDIT_REWARD, _EDIT_SDE, "objective={name: grpo, clip_range: 1.0e-4, kl_beta: 0.05}"],
    ),
    "flow-dppo": (
        "recipes/shapes-edit.yaml",
        [_EDIT_REWARD, _EDIT_SDE, "objective={name: flow-dppo, kl_mask_threshold: 1.0e-5, kl_beta: 0.05}"],
    ),
    "dgpo": (
        "recipes/shapes-edit.yaml",
        [_EDIT_REWARD, "objective={name: dgpo, dpo_beta: 100.0, timesteps: 4, trunc_steps: 6}"],
    ),
}

# the planner recipe (NFT) and Flow-GRPO on the same reward (the recipe before it, 93e83e7^:
# SDE eta 0.3 with noise correlated over 3 steps of the plan, every step trained, clip 0.01, beta 0.02)
_DRIVING_SDE = (
    "sampler={name: full, steps: 10, timestep_fraction: 1.0, kernel: {name: correlated, base: {name: sde, eta: 0.3}, "
    "length: 3.0}}"
)
DRIVING = {
    "nft": ("recipes/driving-nft.yaml", []),
    "grpo": (
        "recipes/driving-nft.yaml",
        [
            _DRIVING_SDE,
            "objective={name: grpo, clip_range: 0.01, kl_beta: 0.02}",
            "train.lr=2.0e-4",
        ],
    ),
    "awm": ("recipes/driving-nft.yaml", ["objective={name: awm, kl_beta: 1.0, train_timesteps: 3}"]),
    "flow-dppo": (
        "recipes/driving-nft.yaml",
        [
            _DRIVING_SDE,
            "objective={name: flow-dppo, kl_mask_threshold: 1.0e-5, kl_beta: 0.02}",
            "train.lr=2.0e-4",
        ],
    ),
    "dgpo": ("recipes/driving-nft.yaml", ["objective={name: dgpo, dpo_beta: 100.0, timesteps: 4, trunc_steps: 6}"]),
}


def _mean(values: Any) -> float:
    import torch

    return float(torch.as_tensor(values).float().mean())


def read_shapes(run: Any, iteration: int) -> dict[str, float]:
    """Held-out strict accuracy and gold error, read by the shapes verifier (whatever the recipe trains on)."""
    from fgrpo.core import evaluation
    from fgrpo.core.registry import create

    outputs, prompts = evaluation.evaluation_samples(run, iteration)
    verifier = create("reward", "shapes", score="strict")
    details = verifier(outputs, list(prompts), [run.prompts.metadata(p) for p in prompts]).details
    return {"metric": _mean(details["accuracy"]), "gold": _mean(details["gold_error"])}


def read_shapes_edit(run: Any, iteration: int) -> dict[str, float]:
    """Held-out edit accuracy and the preservation gold error, read by the shapes-edit verifier."""
    from fgrpo.core import evaluation
    from fgrpo.core.registry import create

    outputs, prompts = evaluation.evaluation_samples(run, iteration)
    verifier = create("reward", "shapes-edit", score="strict")
    details = verifier(outputs, list(prompts), [run.prompts.metadata(p) for p in prompts]).details
    return {"metric": _mean(details["edit"]), "gold": _mean(details["gold_preservation_error"])}


def read_driving(run: Any, iteration: int) -> dict[str, float]:
    """CL-score and collisions of the closed loop on the held-out scenarios (the recipe's evaluator)."""
    from fgrpo.core import evaluation

    metrics = evaluation.gold_metrics(run, iteration, None, None, [])
    return {
        "metric": metrics["gold/driving-closed-loop/cl_score"],
        "gold": metrics["gold/driving-closed-loop/collision"],
    }


@attrs.frozen
class Board:
    world: str
    recipes: Mapping[str, tuple[str, list[str]]]
    main: str
    metric: str
    gold: str
    read: Callable[[Any, int], dict[str, float]]
    gold_ratio: float | None = 1.2  # None: the gold may not exceed the base's own

    def gold_limit(self, base_gold: float) -> float:
        return base_gold * self.gold_ratio if self.gold_ratio is not None else base_gold

    def limit_words(self) -> str:
        return f"<= {self.gold_ratio}x the base's" if self.gold_ratio is not None else "<= the base's"


BOARDS = {
    "shapes": Board("shapes", SHAPES, "grpo", "held-out strict accuracy", "gold error", read_shapes),
    "shapes-edit": Board(
        "shapes-edit", SHAPES_EDIT, "nft", "held-out edit accuracy", "preservation gold error", read_shapes_edit
    ),
    "driving": Board("driving", DRIVING, "nft", "CL-score", "collisions", read_driving, gold_ratio=None),
}


def normalised(point: Mapping[str, Any]) -> dict[str, Any]:
    """A point with ``metric`` and ``gold`` (runs saved before the boards named them accuracy and gold_error)."""
    out = dict(point)
    out.setdefault("metric", point.get("accuracy"))
    out.setdefault("gold", point.get("gold_error"))
    return out


def mean_spread(values: Sequence[float], digits: int = 3) -> str:
    """``mean`` for one value, ``mean ± sd`` over several (the sample standard deviation)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def final_points(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """recipe name -> seed -> the run's last evaluation (normalised)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["name"], {})[int(r.get("seed", 0))] = normalised(r["points"][-1])
    return out


def base_points(runs: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """seed -> the base's evaluation (iteration 0; the same policy for every recipe of a seed)."""
    return {int(r.get("seed", 0)): normalised(r["points"][0]) for r in runs}


def leaderboard(board: Board, runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per recipe over its seeds: the held-out metric and the gold at the end of the budget (mean ±
    sd), the gold against its limit on each seed, and the best recipe that keeps the limit."""
    finals, bases = final_points(runs), base_points(runs)
    seeds = sorted(bases)
    header = ["recipe", "seeds", f"{board.metric}", f"{board.gold}", f"gold {board.limit_words()} on every seed"]
    body, qualified = [], []
    for name, by_seed in finals.items():
        metric = [by_seed[s]["metric"] for s in sorted(by_seed)]
        gold = [by_seed[s]["gold"] for s in sorted(by_seed)]
        keeps = [by_seed[s]["gold"] <= board.gold_limit(bases[s]["gold"]) + 1e-12 for s in sorted(by_seed)]
        verdict = "yes" if all(keeps) else f"no ({sum(not k for k in keeps)} of {len(keeps)})"
        body.append([name, len(by_seed), mean_spread(metric), mean_spread(gold, 4), verdict])
        if all(keeps) and len(by_seed) == len(seeds):
            qualified.append((statistics.fmean(metric), name))
    base_metric = [bases[s]["metric"] for s in seeds]
    base_gold = [bases[s]["gold"] for s in seeds]
    lines = [
        f"{board.world}: the end of each budget over seeds {', '.join(map(str, seeds))} (mean ± sd); the base "
        f"{mean_spread(base_metric)} / {mean_spread(base_gold, 4)}",
        _bench.table(header, body),
    ]
    if qualified:
        score, name = max(qualified)
        lines.append(f"best at the gold limit: {name} ({board.metric} {score:.3f})")
    else:
        lines.append("best at the gold limit: none keeps the limit on every seed")
    return lines
