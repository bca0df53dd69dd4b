"""The registry-driven trainer: builds a run from a recipe, trains, checkpoints, resumes.

One iteration (``iteration`` below) reads top to bottom: move the sampler, roll out, score,
compute advantages, update, evaluate, log, checkpoint.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import evaluation, launch, media, phases, report, rundir, scoring, timing, trackers, visuals, weights
from fgrpo.core.config import ConfigError, RecipeError, first_line
from fgrpo.core.data import PromptSchedule
from fgrpo.core.ema import EMA, ema_weights
from fgrpo.core.guard import Guard
from fgrpo.core.hookspecs import plugin_manager
from fgrpo.core.protocols import Exporting, Policy
from fgrpo.core.recipe import Recipe
from fgrpo.core.registry import ComponentError
from fgrpo.core.run import Run
from fgrpo.core.runlog import Display, MetricsLog, read_metrics
from fgrpo.core.seeding import derive_seed
from fgrpo.core.threads import ThreadGovernor

# --- one iteration -----------------------------------------------------------------------------


def iteration(run: Run, it: int) -> dict[str, Any]:
    clock = run.clock
    clock.read()  # what evaluation or set-up left on the clock is not this iteration's
    timing.synchronize(run.policy.device)
    t0 = time.perf_counter()
    run.sampler.advance(it)
    refreshed = phases.refresh_prompts(run, it)
    where = f"the batch of iteration {it}"
    worker = scoring.RewardWorker(run, where) if run.recipe.train.reward_worker else None
    traj = phases.rollout(run, it, on_chunk=worker.submit if worker else None)
    timing.synchronize(run.policy.device)
    t1 = time.perf_counter()
    scores, details = worker.scores() if worker else scoring.decode_and_score(run, traj, where)
    t2 = time.perf_counter()
    adv, adv_stats = phases.advantages(run, traj, scores)
    stats = phases.update(run, traj, adv, it)
    phases.move_old_policy(run)
    run.scheduler.step()
    metrics = {
        **adv_stats,
        **{f"reward/{k}": v.mean().item() for k, v in scores.items()},
        **{
            f"reward/{k}/{key}": v
            for k, d in details.items()
            for key, v in scoring.detail_means(d, by_category=False).items()
        },
        **phases.summarize(stats),
    }
    t3 = time.perf_counter()
    n_samples = traj.batch_size * run.parallel.processes
    return {
        **metrics,
        "lr": run.optimizer.param_groups[0]["lr"],
        **({"prompts_refreshed": float(refreshed)} if refreshed is not None else {}),
        "trained_steps": traj.num_trained_steps,
        "nfe_rollout": traj.nfe,
        **{f"nfe_rollout/{k}": v for k, v in phases.nfe_by_phase(traj).items()},
        "nfe_train": stats.nfe,
        "time_rollout_s": t1 - t0,
        "time_train_s": t3 - t2,
        **timing.accounting(clock.read(), t3 - t0),
        "samples_per_s": n_samples / (t3 - t0),
    }


def train(run: Run) -> dict[str, Any]:
    """Iterations from ``run.start_iteration`` to ``train.iterations``; returns the last metrics."""
    cfg, hooks = run.recipe.train, plugin_manager().hook
    total = cfg.iterations
    row: dict[str, Any] = {}
    if (
        run.saved_at is None and run.recipe.eval.every and run.recipe.eval.at_start
    ):  # not resumed (from iteration 0 either)
        base = run_evaluation(run, 0)
        _, best = watch(run, 0, base)
        row = record(run, 0, base)
        if best and run.out_dir is not None:  # a guard that stops keeps the base too: the gold may only fall
            keep_best(run, 0)
    run.display.start_at(run.start_iteration)
    governor = ThreadGovernor()
    for it in range(run.start_iteration, total):
        metrics = iteration(run, it)
        metrics["threads"] = governor.step() or torch.get_num_threads()
        done = it + 1
        evaluated = bool(run.recipe.eval.every) and (done % run.recipe.eval.every == 0 or done == total)
        if evaluated:
            metrics.update(run_evaluation(run, done))
        stop, best = watch(run, done, metrics) if evaluated else (False, False)
        row = record(run, done, metrics)
        hooks.fgrpo_iteration_end(run=run, iteration=done, metrics=row)
        run.display.iteration_done(done, row)
        if run.out_dir is not None and (
            stop or best or done == total or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
        ):
            save_checkpoint(run, done)
            if best:
                keep_best(run, done)
        if stop:
            break
    finish(run)
    return row


def keep_best(run: Run, done: int) -> None:
    """Checkpoint ``done`` (written if not yet) becomes ``checkpoints/best``."""
    save_checkpoint(run, done)
    if run.is_main:
        assert run.out_dir is not None  # a run that checkpoints has its run folder
        ckpt.point_best(run.out_dir / "checkpoints", ckpt.folder_name(done))


def watch(run: Run, done: int, metrics: dict[str, Any]) -> tuple[bool, bool]:
    """The over-optimisation guard (``eval.guard``) on this iteration's evaluation: its
    ``guard/...`` metrics join the row. Returns (stop now, keep this iteration as the best: with
    action stop the loop then writes a checkpoint that ``checkpoints/best`` names), decided by
    the main process (which evaluates) and shared with the others."""
    guard = run.guard
    if guard is None:
        return False, False
    stop = best = False
    if run.is_main and guard.config.metric in metrics:
        metrics.update(guard.observe(done, metrics))
        best = bool(metrics["guard/new_best"]) and guard.config.action == "stop"
        if metrics["guard/fired"]:
            run.display.say(guard.message(done))
            stop = guard.config.action == "stop"
    return run.parallel.share((stop, best))


def record(run: Run, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One row of metrics.jsonl (main process), also sent to the experiment trackers."""
    if not (run.is_main and run.log is not None):
        return {"iteration": step, **metrics}
    row = run.log.write(step, metrics)
    run.accelerator.log(trackers.scalars(row), step=step)
    return row


def run_evaluation(run: Run, it: int) -> dict[str, float]:
    metrics: dict[str, float] = {}
    if run.is_main:
        t0 = time.perf_counter()
        metrics = evaluation.evaluate(run, it, run.out_dir)
        if metrics:
            metrics["time_eval_s"] = time.perf_counter() - t0
        run.display.evaluation_done(it, metrics, evaluated_weights(run))
        plugin_manager().hook.fgrpo_evaluation(run=run, iteration=it, metrics=metrics)
    elif run.parallel.sharded_weights:
        evaluation.evaluation_samples(run, it)  # the main process's forwards need this process's shards
    run.parallel.wait()
    return metrics


def evaluated_weights(run: Run) -> str:
    """Which weights evaluation used: the EMA's (and how often it moved) or the raw ones."""
    if run.ema is None:
        return "raw weights"
    updates = weights.ema_updates(run.optimizer_steps, run.recipe.train.ema_every)
    return f"EMA weights after {updates} update{'s' if updates != 1 else ''}"


def finish(run: Run) -> None:
    if run.is_main and run.out_dir is not None:
        try:
            report.write(run.out_dir)
        except (RecipeError, ComponentError) as exc:  # the trained run stands; only its page is missing
            run.display.say(f"report.html not written: {first_line(exc, 300)}")
        last = ckpt.last_complete(run.out_dir / "checkpoints")  # never read through a link planted as last
        for line in weights.checkpoint_warnings(last) if last is not None else []:
            run.display.warn(line)
    if run.is_main and run.out_dir is not None and run.recipe.log.plots:
        if visuals.have_matplotlib():
            visuals.curves(read_metrics(run.out_dir), run.out_dir / "curves.png")
        else:
            run.display.say(
                'curves.png skipped: matplotlib is not installed (pip install "fgrpo-core[plots]"); report.html has '
                "the curves"
            )
    close_run(run)


def close_run(run: Run) -> None:
    """Close the metrics log and the trackers, release the run folder's lock (idempotent)."""
    if run.log is not None:
        run.log.close()
    while run.accelerator.trackers:  # not accelerate's end_training: it also ends the process group
        run.accelerator.trackers.pop().finish()
    if run.folder is not None:
        run.folder.release()


def end_process_group() -> None:
    """Leave the process group once every process has finished (a no-op in one process). A process
    that exits with the group alive can abort while gloo's threads are torn down ("terminate called
    without an active exception", exit -6), and the launcher then fails a run that had finished."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --- building a run ----------------------------------------------------------------------------


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
    if cfg.prompts_per_iteration % parallel.processes:
        raise RecipeError(
            [
                ConfigError(
                    "train.prompts_per_iteration",
                    f"got {cfg.prompts_per_iteration}; must be a multiple of the {parallel.processes} processes",
                )
            ]
        )
    schedule = PromptSchedule(
        prompts.train_prompts(), cfg.prompts_per_iteration, recipe.seed, acc.process_index, parallel.processes
    )
    display = Display(console, quiet=quiet or recipe.log.quiet, total=cfg.iterations, enabled=parallel.is_main)
    return Run(
        recipe=recipe,
        policy=policy,
        sampler=sampler,
        objective=objective,
        prompts=prompts,
        rewards=rewards,
        parallel=parallel,
        trainable=trainable,
        optimizer=optimizer,
        scheduler=scheduler,
        ema=EMA(trainable, cfg.ema_decay) if cfg.ema_decay > 0 else None,
        schedule=schedule,
        display=display,
        out_dir=out_dir,
        evaluators=evaluators,
        guard=Guard.from_recipe(recipe.eval.guard, dict((s.label, e) for s, e in evaluators))
        if recipe.eval.guard
        else None,
        old=old_policy(objective, trainable),
    )


def old_policy(objective: Any, trainable: list[torch.nn.Parameter]) -> EMA | None:
    """The objective's old policy (``needs_old``): a copy of the trainable weights, moved toward
    them after every iteration by ``objective.old_decay`` (the same arithmetic as an EMA). For a
    LoRA policy it is a second set of adapter weights, swapped in for its forwards; under full
    fine-tuning a copy of the weights."""
    return EMA(trainable, 0.0) if getattr(objective, "needs_old", False) else None


# --- checkpoints -------------------------------------------------------------------------------


def save_checkpoint(run: Run, done: int) -> None:
    """Write checkpoint ``done``: the main process writes what the processes holding part of the
    training state gathered (every process in a sharded run, :meth:`~fgrpo.core.launch.Launch.gathered`).
    Once per iteration: the guard may have written it already."""
    if run.saved_at == done:
        return
    run.saved_at = done
    run.parallel.wait()
    parts = run.parallel.gathered(lambda: checkpoint_parts(run))
    if parts is not None:
        assert run.out_dir is not None  # a run that checkpoints has its run folder
        ema_summary = parts.pop("ema_summary")
        prompts_state = getattr(run.prompts, "state_dict", None)  # an optional PromptSource method
        path = ckpt.write(
            run.out_dir / "checkpoints",
            done,
            **parts,
            rng={0: {"torch": torch.get_rng_state()}},
            state={
                "iteration": done,
                "data_position": done * run.recipe.train.prompts_per_iteration,
                "sampler": run.sampler.state_dict(),
                "optimizer_steps": run.optimizer_steps,
                "recipe": run.recipe.data,
                "processes": run.parallel.processes,
                "run_id": run.folder.run_id if run.folder is not None else None,
                weights.STATE_KEY: ema_summary,
                **({"guard": run.guard.state_dict()} if run.guard is not None else {}),
                **({"prompts": prompts_state()} if callable(prompts_state) else {}),
            },
            keep=run.recipe.train.keep_checkpoints,
        )
        plugin_manager().hook.fgrpo_checkpoint_saved(run=run, iteration=done, path=str(path))
    run.parallel.wait()


def checkpoint_parts(run: Run) -> dict[str, Any]:
    """The training state a checkpoint holds, as whole tensors (collective in a sharded run): the
    trainable weights, the EMA, the optimizer and scheduler, and what writes the ``export/``
    folder (None when the policy writes none): the policy's own-format export of the weights
    evaluation uses (the EMA's when the run keeps one)."""
    with run.parallel.whole_weights(run.trainable):
        trainable = run.policy.trainable_state_dict()
    ema = run.ema.state_dict() if run.ema is not None else None
    old = run.old.state_dict() if run.old is not None else None
    optimizer = {
        "optimizer": run.parallel.optimizer_state(run.optimizer, run.trainable),
        "scheduler": run.scheduler.state_dict(),
    }
    export = None
    if getattr(run.policy, "export_in_checkpoints", False):
        with ema_weights(run.ema), run.parallel.whole_weights(run.trainable):
            exported = run.policy.trainable_state_dict()
        # export_in_checkpoints: the policy has export()
        export = functools.partial(cast(Exporting, run.policy).export, state=exported)
    ema_summary = (
        weights.ema_summary(run.ema, run.optimizer_steps, run.recipe.train.ema_every) if run.ema is not None else None
    )
    return {
        "trainable": trainable,
        "ema": ema,
        "old": old,
        "optimizer": optimizer,
        "export": export,
        "ema_summary": ema_summary,
    }


def restore(run: Run, folder: Path) -> int:
    """Load checkpoint ``folder`` into the run (its recipe was checked when the folder was
    claimed); returns the iterations it had done."""
    state = ckpt.read_state(folder)
    with run.parallel.whole_weights(run.trainable, modify=True):
        run.policy.load_trainable_state_dict(ckpt.read_tensors(folder / ckpt.TRAINABLE, run.policy.device))
    if run.ema is not None:
        run.ema.load_state_dict(ckpt.read_tensors(folder / ckpt.EMA, run.policy.device))
    if run.old is not None:
        run.old.load_state_dict(ckpt.read_tensors(folder / ckpt.OLD, run.policy.device))
    opt = ckpt.read_torch(folder / ckpt.OPTIMIZER)
    run.parallel.load_optimizer_state(run.optimizer, run.trainable, opt["optimizer"])
    run.scheduler.load_state_dict(opt["scheduler"])
    torch.set_rng_state(ckpt.read_torch(folder / "rng-rank0.pt")["torch"])
    run.sampler.load_state_dict(state["sampler"])
    run.optimizer_steps = int(state.get("optimizer_steps", 0))  # absent before it was saved: EMA counts restart
    if run.guard is not None and "guard" in state:
        run.guard.load_state_dict(state["guard"])
    load_prompts = getattr(run.prompts, "load_state_dict", None)  # an optional PromptSource method
    if "prompts" in state and callable(load_prompts):
        load_prompts(state["prompts"])
    return int(state["iteration"])


# --- opening a run folder ----------------------------------------------------------------------


def open_run(
    recipe: Recipe,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    start_over: bool = False,
    console: Console | None = None,
    quiet: bool = False,
    extra_trackers: Sequence[Any] = (),
) -> Run:
    """The run ``fgrpo compose`` trains: its folder claimed (locked, checked), its components
    built, the newest complete checkpoint restored when resuming; only then is anything written
    (check first, write after), and its trackers started (``log.trackers`` and
    ``extra_trackers``, accelerate GeneralTracker instances). ``close_run`` (or ``finish``)
    releases the folder. ``console``: where the run's lines go (default: the terminal)."""
    console = Console(highlight=False, soft_wrap=True) if console is None else console
    mode = rundir.RESUME if resume else rundir.START_OVER if start_over else rundir.NEW
    parallel = launch.start(
        train=recipe.train, log_with=trackers.log_with(recipe.log.trackers, extra_trackers) or None
    )
    folder, out_dir, resume_from = claim_folder(parallel, recipe, out, mode)
    try:
        run = build_run(recipe, out_dir=out_dir, console=console, quiet=quiet, parallel=parallel)
        run.folder = folder
        if resume_from:
            run.start_iteration = run.saved_at = resume_from_checkpoint(run, resume_from)
        if folder is not None:
            start_writing(run, folder, resumed=resume_from is not None)
    except BaseException:
        if folder is not None:
            folder.abandon()
        raise
    say_where_it_starts(run, folder, resume_from, resume)
    return run


def claim_folder(
    parallel: launch.Launch, recipe: Recipe, out: str | Path | None, mode: str
) -> tuple[rundir.RunFolder | None, Path, Path | None]:
    """The run folder, claimed by the main process (None on the others), its path and the checkpoint
    to resume from, on every process."""
    folder, failure = None, None
    if parallel.is_main:
        try:
            folder = rundir.claim(recipe, out, mode)
        except RecipeError as exc:
            failure = exc
    plan = parallel.share(
        None if folder is None else (str(folder.path), folder.resume_from and str(folder.resume_from))
    )
    if failure is not None:
        raise failure
    if plan is None:
        raise RecipeError([ConfigError("--out", "the main process could not open the run folder")])
    return folder, Path(plan[0]), Path(plan[1]) if plan[1] else None


def resume_from_checkpoint(run: Run, folder: Path) -> int:
    """:func:`restore`, a checkpoint that does not fit the run refused as ``--resume``'s error."""
    try:
        return restore(run, folder)
    except ckpt.CheckpointError as exc:
        raise RecipeError([ConfigError("--resume", str(exc))]) from None
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:  # files that read but do not fit
        raise RecipeError(
            [ConfigError("--resume", f"{folder} is not a valid checkpoint of this run: {first_line(exc)}")]
        ) from None


def start_writing(run: Run, folder: rundir.RunFolder, *, resumed: bool) -> None:
    """The trackers, the resolved recipe and the metrics log of the claimed folder (main process).
    The trackers start first: one that fails to start (its options were checked at `validate`; a
    library can still refuse) is one line, and the run did not begin."""
    at = run.start_iteration if resumed else None
    try:
        trackers.start(run.accelerator, run.recipe, folder.path, resume_from=at)
    except Exception as exc:  # noqa: BLE001 - any tracker library's own error
        raise RecipeError(
            [ConfigError("log.trackers", f"a tracker could not start: {type(exc).__name__}: {first_line(exc, 300)}")]
        ) from None
    folder.write_recipe(run.recipe)
    run.log = MetricsLog(folder.path, resume_from=at)


def say_where_it_starts(run: Run, folder: rundir.RunFolder | None, resume_from: Path | None, resume: bool) -> None:
    if folder is not None:
        for skipped, why in folder.skipped:
            run.display.say(
                f"{skipped.name} is not complete ({why}): kept, set aside if the run writes its iteration again"
            )
    if resume_from:
        run.display.say(f"resuming {run.out_dir} from {resume_from.name} (iteration {run.start_iteration})")
    elif folder is not None and folder.started_over:
        run.display.say(f"starting {run.out_dir} over from iteration 0 (--start-over)")
    elif resume:
        run.display.say(f"nothing to resume in {run.out_dir}: starting from iteration 0")


# --- a trained policy outside a run ------------------------------------------------------------


def load_checkpoint_weights(policy: Policy, folder: Path, ema_decay: float) -> None:
    """Load a checkpoint's trainable weights into ``policy`` (its EMA weights when it has them and
    the recipe trains with an EMA)."""
    if not (folder / ckpt.TRAINABLE).is_file():
        raise RecipeError([ConfigError("--checkpoint", f"{folder} holds no {ckpt.TRAINABLE}")])
    try:
        if (folder / ckpt.EMA).is_file() and ema_decay > 0:
            params = [p for p in policy.trainable_parameters() if p.requires_grad]
            ema = EMA(params, ema_decay)
            ema.load_state_dict(ckpt.read_tensors(folder / ckpt.EMA, policy.device))
            with torch.no_grad():
                for p, s in zip(params, ema.shadow, strict=True):
                    p.copy_(s)
        else:
            policy.load_trainable_state_dict(ckpt.read_tensors(folder / ckpt.TRAINABLE, policy.device))
    except ckpt.CheckpointError as exc:
        raise RecipeError([ConfigError("--checkpoint", str(exc))]) from None
    except (ValueError, RuntimeError, KeyError) as exc:  # shapes or names that do not fit the model
        raise RecipeError(
            [ConfigError("--checkpoint", f"{folder} does not fit the model: {first_line(exc)}")]
        ) from None
