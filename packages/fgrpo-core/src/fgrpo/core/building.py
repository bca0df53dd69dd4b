"""Building a run from a recipe: its components, its optimizer and schedule, its launch, the EMA and
the objective's old policy (:func:`build_run`)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from fgrpo.core import launch, media
from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.data import PromptSchedule
from fgrpo.core.ema import EMA
from fgrpo.core.guard import Guard
from fgrpo.core.protocols import AnyObjective, Policy
from fgrpo.core.recipe import Recipe
from fgrpo.core.run import Learner, Run, RunIO
from fgrpo.core.runlog import Display
from fgrpo.core.seeding import derive_seed
from fgrpo.core.timing import Clock


def lr_lambda(cfg: Any) -> Any:
    def factor(it: int) -> float:
        if cfg.warmup_iterations and it < cfg.warmup_iterations:
            return (it + 1) / cfg.warmup_iterations
        span = max(1, cfg.iterations - cfg.warmup_iterations)
        progress = min(1.0, (it - cfg.warmup_iterations) / span)
        if cfg.lr_schedule == "linear":
            return 1.0 - progress
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def check_prompts(
    policy: Any, prompts: Sequence[str], key: str, metadata: Callable[[str], Mapping[str, Any]] | None = None
) -> None:
    """Refuse prompts the policy cannot read, before anything runs: prompts with a number of
    source images the policy does not take (``source_image_count``, :mod:`fgrpo.core.media`), and
    what a policy with a closed vocabulary (``shapes-dit``) says through an optional
    ``check_prompts(prompts) -> [problem]``. A policy that reads more of a prompt's row than its
    source images first gets the prompts' ``metadata`` lookup through its optional
    ``use_prompt_metadata``."""
    bind = getattr(policy, "use_prompt_metadata", None)
    if bind is not None:
        bind(metadata if metadata is not None else (lambda _prompt: {}))
    problems = media.count_problems(policy, prompts)
    check = getattr(policy, "check_prompts", None)
    if not problems and check is not None:
        problems = check(list(prompts))
    if problems:
        shown = [ConfigError(key, p) for p in problems[:5]]
        more = (
            [ConfigError(key, f"... and {len(problems) - 5} more prompts the model cannot read")]
            if len(problems) > 5
            else []
        )
        raise RecipeError(shown + more)


def compile_transformer(policy: Policy, device: torch.device) -> None:
    """``train.compile``: compile the policy's transformer in place, lazily at its first call, so the
    policy keeps calling the same module. Refused before any work when it cannot succeed: a model
    without a transformer module, or a CPU without the C++ compiler inductor builds its kernels with
    (otherwise the run would fail minutes later, at the first forward, deep inside torch)."""
    transformer = getattr(policy, "transformer", None)
    if not isinstance(transformer, torch.nn.Module):
        raise RecipeError(
            [ConfigError("train.compile", f"the model {type(policy).__name__} has no transformer module to compile")]
        )
    if device.type == "cpu":
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()
        except exc.InvalidCxxCompiler:
            raise RecipeError(
                [
                    ConfigError(
                        "train.compile",
                        "true needs a C++ compiler on the CPU (inductor builds its kernels with g++, or $CXX) and "
                        "none was found; allowed: false, or install one",
                    )
                ]
            ) from None
    transformer.compile()


def build_run(
    recipe: Recipe,
    *,
    out_dir: Path | None,
    console: Console,
    quiet: bool = False,
    parallel: launch.Launch | None = None,
    policy: Policy | None = None,
) -> Run:
    """A run of ``recipe``; ``parallel``: its launch (default: :func:`fgrpo.core.launch.start`);
    ``policy``: an already built model instead of the recipe's (benchmarks)."""
    parallel = parallel or launch.start(train=recipe.train)
    acc = parallel.accelerator
    # components draw their initial weights (LoRA init, ...) from the global RNG: same on every rank
    torch.manual_seed(derive_seed(recipe.seed, "build"))
    random.seed(derive_seed(recipe.seed, "python"))
    policy = recipe.build("model") if policy is None else policy
    if recipe.train.compile:
        compile_transformer(policy, acc.device)
    sampler = recipe.build("sampler")
    objective = recipe.build("objective")
    prompts = recipe.build("prompts")
    check_prompts(policy, prompts.train_prompts() + prompts.test_prompts(), "prompts", prompts.metadata)
    rewards = recipe.build_rewards()
    evaluators = recipe.build_evaluators()
    trainable = [p for p in policy.trainable_parameters() if p.requires_grad]
    if not trainable:
        raise RecipeError([ConfigError("model", "the policy has no trainable parameters")])
    cfg = recipe.train
    optimizer = torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        betas=(cfg.adam_betas[0], cfg.adam_betas[1]),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    trainable = parallel.prepare(policy, optimizer, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # the processes of a context-parallel group hold the same prompts: the batch is shared per group
    shares = parallel.data_processes
    if cfg.prompts_per_iteration % shares:
        held = f"{shares} context-parallel groups" if parallel.replicas > 1 else f"{shares} processes"
        raise RecipeError(
            [
                ConfigError(
                    "train.prompts_per_iteration", f"got {cfg.prompts_per_iteration}; must be a multiple of the {held}"
                )
            ]
        )
    schedule = PromptSchedule(
        prompts.train_prompts(), cfg.prompts_per_iteration, recipe.seed, parallel.data_rank, shares
    )
    display = Display(console, quiet=quiet or recipe.log.quiet, total=cfg.iterations, enabled=parallel.is_main)
    learner = Learner(
        policy=policy,
        trainable=trainable,
        optimizer=optimizer,
        scheduler=scheduler,
        launch=parallel,
        ema=EMA(trainable, cfg.ema_decay) if cfg.ema_decay > 0 else None,
        old_policy=old_policy(objective, trainable),
    )
    return Run(
        recipe=recipe,
        learner=learner,
        io=RunIO(display=display, clock=Clock(policy.device), out_dir=out_dir),
        sampler=sampler,
        objective=objective,
        prompts=prompts,
        rewards=rewards,
        schedule=schedule,
        evaluators=evaluators,
        guard=Guard.from_recipe(recipe.eval.guard, dict((s.label, e) for s, e in evaluators))
        if recipe.eval.guard is not None
        else None,
    )


def old_policy(objective: AnyObjective, trainable: list[torch.nn.Parameter]) -> EMA | None:
    """The objective's old policy (``needs_old``): a copy of the trainable weights, moved toward
    them after every iteration by ``objective.old_decay`` (the same arithmetic as an EMA). For a
    LoRA policy it is a second set of adapter weights, swapped in for its forwards; under full
    fine-tuning a copy of the weights."""
    return EMA(trainable, 0.0) if objective.needs_old else None
