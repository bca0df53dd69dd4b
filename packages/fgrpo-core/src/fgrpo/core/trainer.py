"""The training loop: one iteration (:func:`iteration`) reads top to bottom: move the sampler, roll
out, score, compute advantages, update, evaluate, log, checkpoint; :func:`train` runs them.

A run is opened (its folder claimed, its components built, a checkpoint restored) by
:func:`fgrpo.core.opening.open_run`, built by :func:`fgrpo.core.building.build_run` and saved by
:mod:`fgrpo.core.saving`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import evaluation, report, rollout, scoring, timing, trackers, update, visuals, weights
from fgrpo.core.config import RecipeError, first_line
from fgrpo.core.hookspecs import plugin_manager
from fgrpo.core.interrupts import Interrupts
from fgrpo.core.opening import close_run
from fgrpo.core.registry import ComponentError
from fgrpo.core.run import Run
from fgrpo.core.runlog import read_metrics
from fgrpo.core.saving import keep_best, save_checkpoint
from fgrpo.core.threads import ThreadGovernor


def iteration(run: Run, it: int) -> dict[str, Any]:
    clock = run.io.clock
    clock.read()  # what evaluation or set-up left on the clock is not this iteration's
    if it < idle_iterations(run):
        return {"idle": 1.0, "lr": run.learner.optimizer.param_groups[0]["lr"]}
    timing.synchronize(run.learner.policy.device)
    t0 = time.perf_counter()
    run.sampler.advance(it)
    refreshed = rollout.refresh_prompts(run, it)
    where = f"the batch of iteration {it}"
    worker = scoring.RewardWorker(run, where) if run.recipe.train.reward_worker else None
    traj = rollout.rollout(run, it, on_chunk=worker.submit if worker else None)
    timing.synchronize(run.learner.policy.device)
    t1 = time.perf_counter()
    scores, details = worker.scores() if worker else scoring.decode_and_score(run, traj, where)
    t2 = time.perf_counter()
    adv, adv_stats = rollout.advantages(run, traj, scores)
    stats = update.update(run, traj, adv, it)
    update.move_old_policy(run)
    run.learner.scheduler.step()
    metrics = {
        **adv_stats,
        **{f"reward/{k}": v.mean().item() for k, v in scores.items()},
        **{
            f"reward/{k}/{key}": v
            for k, d in details.items()
            for key, v in scoring.detail_means(d, by_category=False).items()
        },
        **update.summarize(stats),
    }
    t3 = time.perf_counter()
    n_samples = traj.batch_size * run.learner.launch.data_processes
    return {
        **metrics,
        "lr": run.learner.optimizer.param_groups[0]["lr"],
        **({"prompts_refreshed": float(refreshed)} if refreshed is not None else {}),
        "trained_steps": traj.num_trained_steps,
        "nfe_rollout": traj.nfe,
        **{f"nfe_rollout/{k}": v for k, v in rollout.nfe_by_phase(traj).items()},
        "nfe_train": stats.nfe,
        "time_rollout_s": t1 - t0,
        "time_train_s": t3 - t2,
        **timing.accounting(clock.read(), t3 - t0),
        "samples_per_s": n_samples / (t3 - t0),
    }


def idle_iterations(run: Run) -> int:
    """The objective's first iterations that do nothing (an optional ``idle_iterations``, AWM's
    two epochs that only draw prompts): no rollout, no score, no update, no move of the old policy
    or the EMA, no scheduler step. Their prompts are spent (a later iteration draws the prompts it
    would draw anyway), and the row says ``idle: 1``."""
    return int(getattr(run.objective, "idle_iterations", 0))


def train(run: Run, interrupts: Interrupts | None = None) -> dict[str, Any]:
    """Iterations from ``run.start_iteration`` to ``train.iterations``; returns the last metrics.
    ``interrupts``: a signal it received stops the run after the iteration in progress, checkpointed
    (as the guard's stop is)."""
    cfg, hooks = run.recipe.train, plugin_manager().hook
    total = cfg.iterations
    row: dict[str, Any] = {}
    if (
        run.saved_at is None and run.recipe.eval.every and run.recipe.eval.at_start
    ):  # not resumed (from iteration 0 either)
        base = run_evaluation(run, 0)
        _, best = watch(run, 0, base)
        row = record(run, 0, base)
        if best and run.io.out_dir is not None:  # a guard that stops keeps the base too: the gold may only fall
            keep_best(run, 0)
    run.io.display.start_at(run.start_iteration)
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
        run.io.display.iteration_done(done, row)
        if interrupts is not None and done < total and interrupts.agreed(run.learner.launch):
            stop = True
        if run.io.out_dir is not None and (
            stop or best or done == total or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
        ):
            save_checkpoint(run, done)
            if best:
                keep_best(run, done)
        if stop:
            break
    finish(run)
    return row


def watch(run: Run, done: int, metrics: dict[str, Any]) -> tuple[bool, bool]:
    """The over-optimisation guard (``eval.guard``) on this iteration's evaluation: its
    ``guard/...`` metrics join the row. Returns (stop now, keep this iteration as the best: with
    action stop the loop then writes a checkpoint that ``checkpoints/best`` names), decided by
    the main process (which evaluates) and shared with the others."""
    guard = run.guard
    if guard is None:
        return False, False
    stop = best = False
    if run.is_main and guard.watches(metrics):
        metrics.update(guard.observe(done, metrics))
        best = bool(metrics["guard/new_best"]) and guard.config.action == "stop"
        if metrics["guard/fired"]:
            run.io.display.say(guard.message(done))
            stop = guard.config.action == "stop"
    return run.learner.launch.share((stop, best))


def record(run: Run, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One row of metrics.jsonl (main process), also sent to the experiment trackers."""
    if not (run.is_main and run.io.log is not None):
        return {"iteration": step, **metrics}
    row = run.io.log.write(step, metrics)
    run.accelerator.log(trackers.scalars(row), step=step)
    return row


def run_evaluation(run: Run, it: int) -> dict[str, float]:
    metrics: dict[str, float] = {}
    if run.is_main:
        t0 = time.perf_counter()
        metrics = evaluation.evaluate(run, it, run.io.out_dir)
        if metrics:
            metrics["time_eval_s"] = time.perf_counter() - t0
        run.io.display.evaluation_done(it, metrics, evaluated_weights(run))
        plugin_manager().hook.fgrpo_evaluation(run=run, iteration=it, metrics=metrics)
    elif run.learner.launch.sharded_weights:
        evaluation.evaluation_samples(run, it)  # the main process's forwards need this process's shards
    elif run.learner.launch.data_rank == 0:
        # context parallel: every forward of the main process (evaluators' too) needs its group's
        # processes, which evaluate alongside it the same way, writing nothing
        evaluation.evaluate(run, it, None)
    run.learner.launch.wait()
    return metrics


def evaluated_weights(run: Run) -> str:
    """Which weights evaluation used: the EMA's (and how often it moved) or the raw ones."""
    if run.learner.ema is None:
        return "raw weights"
    updates = weights.ema_updates(run.learner.optimizer_steps, run.recipe.train.ema_every)
    return f"EMA weights after {updates} update{'s' if updates != 1 else ''}"


def finish(run: Run) -> None:
    if run.is_main and run.io.out_dir is not None:
        try:
            run.io.report = report.write(run.io.out_dir)
        except (RecipeError, ComponentError) as exc:  # the trained run stands; only its page is missing
            run.io.display.say(f"report.html not written: {first_line(exc, 300)}")
        last = ckpt.last_complete(run.io.out_dir / "checkpoints")  # never read through a link planted as last
        for line in weights.checkpoint_warnings(last) if last is not None else []:
            run.io.display.warn(line)
    if run.is_main and run.io.out_dir is not None and run.recipe.log.plots:
        if visuals.have_matplotlib():
            try:
                declared = [getattr(e, "directions", None) or {} for _, e in run.evaluators]
                directions = {m: d for each in declared for m, d in each.items()}
                visuals.curves(read_metrics(run.io.out_dir), run.io.out_dir / "curves.png", directions)
            except OSError as exc:  # a full disk: the trained run stands, the old picture too
                run.io.display.say(f"curves.png not written: {exc.strerror or exc}")
        else:
            run.io.display.say(
                'curves.png skipped: matplotlib is not installed (pip install "fgrpo-core[plots]"); report.html has '
                "the curves"
            )
    close_run(run)
