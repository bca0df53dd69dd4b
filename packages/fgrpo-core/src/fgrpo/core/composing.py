"""``fgrpo compose`` past its dry run: one recipe trained into its run folder, or a recipe in stages
trained stage by stage (:mod:`fgrpo.core.stages`), and what a stop leaves to go on with."""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from fgrpo.core import recipe as recipe_mod
from fgrpo.core import registry, stages
from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.consoles import err, out


def compose(recipe: Any, args: argparse.Namespace) -> int:
    """Train ``recipe`` as ``args`` (compose's options) say; the exit code."""
    from fgrpo.core.opening import end_process_group

    if recipe.later:
        root = claim_root(recipe, args.out, again=args.resume or args.start_over)
        train = partial(compose_one, args=args, resume_out=str(root))
        code = train_in_turn(recipe, root, train, say=lambda line: out.print(line, markup=False))
    else:
        code = compose_one(recipe, args.out, args=args)
    end_process_group()
    return code


def compose_one(
    recipe: Any, out_dir: str | Path | None, *, args: argparse.Namespace, resume_out: str | None = None
) -> int:
    """Train one recipe into ``out_dir`` (None: a new default folder); a stop names the command
    that goes on (with ``--out resume_out``, else compose's own)."""
    from fgrpo.core.interrupts import Interrupts, resume_line
    from fgrpo.core.opening import close_run, open_run
    from fgrpo.core.trainer import train

    run = open_run(recipe, out=out_dir, resume=args.resume, start_over=args.start_over, console=out, quiet=args.quiet)
    folder = run.io.out_dir
    assert folder is not None  # compose always trains into a run folder
    try:
        run.io.display.say(f"training {recipe.source} -> {folder} ({accelerate_summary(run)})")
        with run.io.display, Interrupts(note=run.is_main) as interrupts:
            train(run, interrupts)
    finally:
        close_run(run)
    if interrupts.stopped_by is not None:
        if run.is_main:
            err.print(resume_line(args.recipe, resume_out or args.out, args.overrides, run), markup=False)
        return interrupts.exit_code
    run.io.display.say(
        f"done: metrics in {folder / 'metrics.jsonl'}, weights in {folder / 'checkpoints' / 'last'}"
        + (f", curves in {folder / 'curves.png'}" if (folder / "curves.png").exists() else "")
    )
    if run.io.report is not None:  # else the run said why it is missing
        run.io.display.say(f"report: {run.io.report}")
    return 0


# --- recipes in stages ---------------------------------------------------------------------------


def starting_from(recipe: Any, export: Path) -> Any:
    """``recipe`` (a later stage) with its model starting from the weights in ``export``."""
    data = copy.deepcopy(recipe.data)
    data["model"].update(registry.load("model", data["model"]["name"]).start_from(str(export)))
    return recipe_mod.from_dict(data, source=recipe.source)


def claim_root(recipe: Any, out: str | None, *, again: bool) -> Path:
    """The run folder of a recipe in stages: ``out``, or a new default folder; a new run (not
    ``again``: --resume, --start-over) refuses one that holds anything. In a launch of several
    processes each needs the same folder, so ``--out`` is required, and the main process checks it."""
    from fgrpo.core import rundir

    launched = int(os.environ.get("WORLD_SIZE") or 1) > 1
    if out is None and launched:
        raise RecipeError([ConfigError("--out", "a recipe in stages launched on several processes needs --out DIR")])
    if out is None:
        return rundir.new_default_folder(recipe)
    root = Path(out)
    if process_rank() == 0 and not again and root.is_dir() and any(root.iterdir()):
        held = f"{root} already holds a run; pass --resume to continue it or choose another --out"
        raise RecipeError([ConfigError("--out", held)])
    return root


def train_in_turn(recipe: Any, root: Path, train: Callable[[Any, Path], int], say: Callable[[str], None]) -> int:
    """Train each stage of ``recipe`` with ``train(stage, folder)`` (an exit code) from the policy the
    one before ended with; the stages that ended already (a resumed run) are skipped."""
    plan = recipe.all_stages()
    for k, stage in enumerate(plan, 1):
        folder = folder_of(root, k, len(plan))
        if k > 1:
            stage = starting_from(stage, export_for_next(folder_of(root, k - 1, len(plan))))
        if k < len(plan) and finished(folder, stage):
            say(f"stage {k} of {len(plan)}: trained already in {folder}")
            continue
        say(f"stage {k} of {len(plan)}: {folder}")
        code = train(stage, folder)
        if code:
            return code
    return 0


def folder_of(out: Path, stage: int, count: int) -> Path:
    """Where stage ``stage`` (1-based) of ``count`` trains: the last into ``out`` itself."""
    return out if stage == count else out / stages.FOLDER / str(stage)


def finished(folder: Path, recipe: Any) -> bool:
    """Whether the run of ``recipe`` in ``folder`` ended: its newest complete checkpoint is of the
    last iteration, or of the one where the over-optimisation guard stopped it (``action: stop``;
    the next stage then starts from there, not from ``checkpoints/best``). A run of another recipe
    is refused, as ``--resume`` refuses it."""
    from fgrpo.core import checkpoint as ckpt
    from fgrpo.core import rundir

    newest, _ = ckpt.newest(folder / "checkpoints")
    if newest is None:
        return False
    try:
        state = ckpt.read_state(newest)
    except ckpt.CheckpointError:
        return False  # resuming it says what is wrong
    rundir.refuse_another_recipe(state, recipe)
    guard = recipe.eval.guard
    stopped = guard is not None and guard.get("action") == "stop" and bool((state.get("guard") or {}).get("fired_at"))
    return int(state["iteration"]) >= recipe.train.iterations or stopped


def export_for_next(folder: Path) -> Path:
    """The weights the stage after the one trained in ``folder`` starts from: its newest complete
    checkpoint exported into ``folder/export/iter_NNNNNN`` (as ``fgrpo export`` writes it; kept, and
    read back, when an earlier run of the recipe wrote it; a stage trained on after it, its
    ``train.iterations`` raised, gets a new one)."""
    from fgrpo.core import checkpoint as ckpt
    from fgrpo.core import trained

    newest, _ = ckpt.newest(folder / "checkpoints")
    assert newest is not None, f"{folder} ended without a checkpoint"
    target = folder / stages.EXPORT / newest.name
    if process_rank() != 0:
        return target  # the main process writes it before it claims the next stage's folder, which they wait for
    if not target.is_dir():
        target.parent.mkdir(exist_ok=True)
        trained.export_whole(newest, target, no_ema=False)
    else:
        trained.verify_export(target, target)
    return target


def process_rank() -> int:
    """This process's rank in a launch (accelerate launch and torchrun set RANK), 0 alone."""
    try:
        return int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)
    except ValueError:
        return 0


def accelerate_summary(run: Any) -> str:
    acc, launched = run.accelerator, run.learner.launch
    kind = launched.description
    if launched.replicas > 1:
        kind = f"context parallel: {launched.data_processes} group(s) of {launched.replicas}"
    return (
        f"{launched.processes} process(es){', ' + kind if kind else ''}, device {run.learner.policy.device}, "
        f"mixed precision {acc.mixed_precision}, "
        f"gradient accumulation {acc.gradient_accumulation_steps}"
    )
