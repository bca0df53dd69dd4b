"""The registry-driven trainer: builds a run from a recipe, trains, checkpoints, resumes.

One iteration (``iteration`` below) reads top to bottom: move the sampler, roll out, score,
compute advantages, update, evaluate, log, checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs
import torch
from rich.console import Console

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import evaluation, phases, report, rundir, sharding, tensors, timing, trackers, visuals, weights
from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.data import PromptSchedule
from fgrpo.core.ema import EMA
from fgrpo.core.hookspecs import plugin_manager
from fgrpo.core.protocols import Exporting, Policy
from fgrpo.core.registry import ComponentError
from fgrpo.core.recipe import Recipe
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
    where = f"the batch of iteration {it}"
    worker = phases.RewardWorker(run, where) if run.recipe.train.reward_worker else None
    traj = phases.rollout(run, it, on_chunk=worker.submit if worker else None)
    timing.synchronize(run.policy.device)
    t1 = time.perf_counter()
    scores, details = worker.scores() if worker else phases.decode_and_score(run, traj, where)
    t2 = time.perf_counter()
    adv, adv_stats = phases.advantages(run, traj, scores)
    stats = phases.update(run, traj, adv, it)
    run.scheduler.step()
    metrics = {
        **adv_stats,
        **{f"reward/{k}": v.mean().item() for k, v in scores.items()},
        **{f"reward/{k}/{key}": v for k, d in details.items() for key, v in phases.detail_means(d, by_category=False).items()},
        **phases.summarize(stats),
    }
    t3 = time.perf_counter()
    n_samples = traj.batch_size * run.accelerator.num_processes
    return {
        **metrics,
        "lr": run.optimizer.param_groups[0]["lr"],
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
    if run.start_iteration == 0 and run.recipe.eval.every and run.recipe.eval.at_start:
        row = record(run, 0, run_evaluation(run, 0))
    run.display.start_at(run.start_iteration)
    governor = ThreadGovernor()
    for it in range(run.start_iteration, total):
        metrics = iteration(run, it)
        metrics["threads"] = governor.step() or torch.get_num_threads()
        done = it + 1
        if run.recipe.eval.every and (done % run.recipe.eval.every == 0 or done == total):
            metrics.update(run_evaluation(run, done))
        row = record(run, done, metrics)
        hooks.fgrpo_iteration_end(run=run, iteration=done, metrics=row)
        run.display.iteration_done(done, row)
        if run.out_dir is not None and (done == total or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)):
            save_checkpoint(run, done)
    finish(run)
    return row


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
    elif run.sharded_weights:
        evaluation.evaluation_samples(run, it)  # the main process's forwards need this process's shards
    run.accelerator.wait_for_everyone()
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
            run.display.say(f"report.html not written: {str(exc).splitlines()[0]}")
        for line in weights.checkpoint_warnings(run.out_dir / "checkpoints" / "last"):
            run.display.warn(line)
    if run.is_main and run.out_dir is not None and run.recipe.log.plots:
        if visuals.have_matplotlib():
            visuals.curves(read_metrics(run.out_dir), run.out_dir / "curves.png")
        else:
            run.display.say('curves.png skipped: matplotlib is not installed (pip install "fgrpo-core[plots]"); report.html has the curves')
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


#: how the processes of a run share work: each rolls out its own prompt groups and gradients are
#: averaged by one all-reduce per optimizer step (``phases.sync_gradients``); FSDP launches shard
#: the network instead (:mod:`fgrpo.core.sharding`)
DATA_PARALLEL = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU", "MULTI_SDAA")


def accelerate_settings(train: Any = None, env: Any = None) -> tuple[str, int]:
    """(mixed precision, gradient accumulation steps) of a run: the recipe's ``train`` keys when
    set, else what ``accelerate launch`` passed on (flags or its config file, as environment
    variables), else no / 1. A recipe and a launcher that disagree are refused."""
    env = os.environ if env is None else env
    launched_precision = env.get("ACCELERATE_MIXED_PRECISION", "").lower() or None
    launched_steps = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS") or None
    wanted_precision = getattr(train, "mixed_precision", "auto")
    wanted_steps = getattr(train, "gradient_accumulation_steps", 0)
    errors = []
    if wanted_precision == "auto":
        precision = launched_precision or "no"
    else:
        precision = wanted_precision
        if launched_precision not in (None, "no", precision):
            errors.append(ConfigError(
                "train.mixed_precision",
                f"got {precision!r} but accelerate was launched with mixed precision {launched_precision!r}; "
                "set one of them (train.mixed_precision: auto follows accelerate)",
            ))
    if precision not in ("no", "bf16", "fp16"):
        errors.append(ConfigError("train.mixed_precision", f"accelerate asks for {precision!r}; allowed: no, bf16, fp16"))
    try:
        steps_from_launcher = int(launched_steps) if launched_steps is not None else None
    except ValueError:
        steps_from_launcher = None
        errors.append(ConfigError("train.gradient_accumulation_steps", f"accelerate passed {launched_steps!r}; expected an integer"))
    if wanted_steps:
        steps = wanted_steps
        if steps_from_launcher not in (None, 1, steps):
            errors.append(ConfigError(
                "train.gradient_accumulation_steps",
                f"got {steps} but accelerate was launched with {steps_from_launcher}; set one of them (0 follows accelerate)",
            ))
    else:
        steps = steps_from_launcher or 1
    if errors:
        raise RecipeError(errors)
    return precision, steps


def make_accelerator(cpu: bool | None = None, train: Any = None, **options: Any) -> Any:
    """The run's Accelerator, with the mixed precision and gradient accumulation of
    :func:`accelerate_settings` (fp16 needs a GPU) and, with several processes,
    ``train.process_group_timeout_s`` as the longest wait for the others at a collective (a
    stopped or crashed peer then ends the run with an error, not a silent hang); ``options`` go to
    its constructor (``log_with``). Data-parallel and FSDP launches run (FSDP also on the CPU, see
    :mod:`fgrpo.core.sharding`); other kinds are refused."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if cpu is None:
        cpu = not torch.cuda.is_available()
    precision, steps = accelerate_settings(train)
    if precision == "fp16" and (cpu or not torch.cuda.is_available()):
        raise RecipeError([ConfigError(
            "train.mixed_precision",
            "fp16 mixed precision needs a GPU (accelerate ignores it on the CPU); use bf16 or no",
        )])
    if AcceleratorState._shared_state.get("_mixed_precision") not in (None, precision):
        AcceleratorState._reset_state()  # a new run in the same process (tests, tools): its own precision
    timeout = getattr(train, "process_group_timeout_s", None)
    cpu, handlers = sharding.accelerator_options(cpu, timedelta(seconds=timeout) if timeout else None)
    acc = Accelerator(cpu=cpu, mixed_precision=precision, gradient_accumulation_steps=steps, kwargs_handlers=handlers, **options)
    kind = sharding.kind(acc)
    if kind == "MULTI_CPU" and sharding.launched_sharded():
        sharding.enable_on_cpu(acc)
        kind = sharding.FSDP
    if kind not in DATA_PARALLEL and kind not in (sharding.FSDP, sharding.DEEPSPEED):
        raise RecipeError([ConfigError(
            "accelerate",
            f"distributed type {kind} (from the accelerate config or launch flags) is not supported: fgrpo runs data "
            "parallel (recipes/accelerate/ddp.yaml), sharded with FSDP2 (fsdp-lora.yaml, fsdp-full.yaml) or with "
            "DeepSpeed ZeRO-2 (deepspeed-zero2.yaml); to fit memory also use LoRA, gradient checkpointing, "
            "model.text_encoder_device: cpu and bf16 weights",
        )])
    if sharding.launched_deepspeed() and kind != sharding.DEEPSPEED:
        raise RecipeError([ConfigError(
            "accelerate",
            f"the launch asks for DeepSpeed but accelerate set up {kind} (a DeepSpeed run needs processes started by "
            "accelerate launch or torchrun, and the deepspeed package); fgrpo does not run it as something else",
        )])
    if kind == sharding.DEEPSPEED:
        sharding.check_deepspeed(acc)
    return acc


def check_prompts(
    policy: Any, prompts: Sequence[str], key: str, metadata: Callable[[str], Mapping[str, Any]] | None = None
) -> None:
    """Refuse prompts the policy cannot read, before anything runs: a policy with a closed
    vocabulary (``shapes-dit``) says why through an optional ``check_prompts(prompts) -> [problem]``.
    A policy conditioned on more than text (image-to-video) is first given the prompts'
    ``metadata`` lookup through its optional ``use_prompt_metadata``."""
    bind = getattr(policy, "use_prompt_metadata", None)
    if bind is not None:
        bind(metadata if metadata is not None else (lambda _prompt: {}))
    check = getattr(policy, "check_prompts", None)
    problems = check(list(prompts)) if check is not None else []
    if problems:
        shown = [ConfigError(key, p) for p in problems[:5]]
        more = [ConfigError(key, f"... and {len(problems) - 5} more prompts the model cannot read")] if len(problems) > 5 else []
        raise RecipeError(shown + more)


def compile_transformer(policy: Policy, device: torch.device) -> None:
    """``train.compile``: compile the policy's transformer in place, lazily at its first call, so the
    policy keeps calling the same module. Refused before any work when it cannot succeed: a model
    without a transformer module, or a CPU without the C++ compiler inductor builds its kernels with
    (otherwise the run would fail minutes later, at the first forward, deep inside torch)."""
    transformer = getattr(policy, "transformer", None)
    if not isinstance(transformer, torch.nn.Module):
        raise RecipeError([ConfigError("train.compile", f"the model {type(policy).__name__} has no transformer module to compile")])
    if device.type == "cpu":
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()
        except exc.InvalidCxxCompiler:
            raise RecipeError(
                [ConfigError("train.compile", "true needs a C++ compiler on the CPU (inductor builds its kernels with g++, or $CXX) and none was found; allowed: false, or install one")]
            ) from None
    transformer.compile()


def build_run(
    recipe: Recipe, *, out_dir: Path | None, console: Console, quiet: bool = False, accelerator: Any = None, policy: Policy | None = None
) -> Run:
    """A run of ``recipe``; ``policy``: an already built model instead of the recipe's (benchmarks)."""
    acc = accelerator or make_accelerator(train=recipe.train)
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
    trainable = [p for p in policy.trainable_parameters() if p.requires_grad]
    if not trainable:
        raise RecipeError([ConfigError("model", "the policy has no trainable parameters")])
    broadcast_parameters(acc, trainable)
    cfg = recipe.train
    beta1, beta2 = cfg.adam_betas
    optimizer = torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=(beta1, beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    if sharding.is_sharded(acc):
        trainable = sharding.prepare(acc, policy, optimizer, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if cfg.prompts_per_iteration % acc.num_processes:
        raise RecipeError([ConfigError("train.prompts_per_iteration", f"got {cfg.prompts_per_iteration}; must be a multiple of the {acc.num_processes} processes")])
    schedule = PromptSchedule(
        prompts.train_prompts(), cfg.prompts_per_iteration, recipe.seed, acc.process_index, acc.num_processes
    )
    display = Display(console, quiet=quiet or recipe.log.quiet, total=cfg.iterations, enabled=acc.is_main_process)
    return Run(
        recipe=recipe,
        policy=policy,
        sampler=sampler,
        objective=objective,
        prompts=prompts,
        rewards=rewards,
        accelerator=acc,
        trainable=trainable,
        optimizer=optimizer,
        scheduler=scheduler,
        ema=EMA(trainable, cfg.ema_decay) if cfg.ema_decay > 0 else None,
        schedule=schedule,
        display=display,
        out_dir=out_dir,
    )


def broadcast_parameters(acc: Any, params: list[torch.nn.Parameter]) -> None:
    if acc.num_processes > 1:
        import torch.distributed as dist

        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)


# --- checkpoints -------------------------------------------------------------------------------


def save_checkpoint(run: Run, done: int) -> None:
    """Write checkpoint ``done`` (the main process writes; in a sharded run every process first
    takes part in gathering the whole tensors)."""
    assert run.out_dir is not None  # a run that checkpoints has its run folder
    run.accelerator.wait_for_everyone()
    if run.is_main or run.sharded:
        trainable = run.policy.trainable_state_dict()
        ema = run.ema.state_dict() if run.ema is not None else None
        optimizer = sharding.optimizer_state(run.accelerator, run.optimizer, run.trainable)
        export = export_in_checkpoint(run)
        ema_summary = weights.ema_summary(run.ema, run.optimizer_steps, run.recipe.train.ema_every) if run.ema is not None else None
    if run.is_main:
        path = ckpt.write(
            run.out_dir / "checkpoints",
            done,
            trainable=trainable,
            ema=ema,
            optimizer={"optimizer": optimizer, "scheduler": run.scheduler.state_dict()},
            rng={0: {"torch": torch.get_rng_state()}},
            state={
                "iteration": done,
                "data_position": done * run.recipe.train.prompts_per_iteration,
                "sampler": run.sampler.state_dict(),
                "optimizer_steps": run.optimizer_steps,
                "recipe": run.recipe.data,
                "processes": run.accelerator.num_processes,
                "run_id": run.folder.run_id if run.folder is not None else None,
                weights.STATE_KEY: ema_summary,
            },
            keep=run.recipe.train.keep_checkpoints,
            export=export,
        )
        plugin_manager().hook.fgrpo_checkpoint_saved(run=run, iteration=done, path=str(path))
    run.accelerator.wait_for_everyone()


def export_in_checkpoint(run: Run) -> Any:
    """What writes the checkpoint's ``export/`` folder (None when the policy writes none): the
    policy's own-format export of the weights evaluation uses (the EMA's when the run keeps one).
    A sharded run gathers those weights first, on every process."""
    if not getattr(run.policy, "export_in_checkpoints", False):
        return None
    if not run.sharded:
        return lambda folder: export_policy(run, folder)
    with run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext():
        weights = run.policy.trainable_state_dict()
    exporting = cast(Exporting, run.policy)  # export_in_checkpoints: it has export()
    return lambda folder: exporting.export(folder, state=weights)


def export_policy(run: Run, folder: str) -> list[str]:
    """The policy's own-format export (what users deploy): with the EMA weights when the run
    keeps an EMA, as evaluation uses them."""
    context = run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext()
    with context:
        # export_in_checkpoint, its caller, checked export_in_checkpoints: the policy has export()
        return list(cast(Exporting, run.policy).export(folder))


def restore(run: Run, folder: Path) -> int:
    """Load checkpoint ``folder`` into the run (its recipe was checked when the folder was
    claimed); returns the iterations it had done."""
    state = ckpt.read_state(folder)
    run.policy.load_trainable_state_dict(ckpt.read_tensors(folder / ckpt.TRAINABLE, run.policy.device))
    if run.ema is not None:
        run.ema.load_state_dict(ckpt.read_tensors(folder / ckpt.EMA, run.policy.device))
    opt = ckpt.read_torch(folder / ckpt.OPTIMIZER)
    sharding.load_optimizer_state(run.accelerator, run.optimizer, run.trainable, opt["optimizer"])
    run.scheduler.load_state_dict(opt["scheduler"])
    torch.set_rng_state(ckpt.read_torch(folder / "rng-rank0.pt")["torch"])
    run.sampler.load_state_dict(state["sampler"])
    run.optimizer_steps = int(state.get("optimizer_steps", 0))  # absent before it was saved: EMA counts restart
    return int(state["iteration"])


# --- opening a run folder ----------------------------------------------------------------------


def _share(acc: Any, value: Any) -> Any:
    """The main process's ``value`` on every process."""
    if acc.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


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
    acc = make_accelerator(train=recipe.train, log_with=trackers.log_with(recipe.log.trackers, extra_trackers) or None)
    folder, failure = None, None
    if acc.is_main_process:
        try:
            folder = rundir.claim(recipe, out, mode)
        except RecipeError as exc:
            failure = exc
    plan = _share(acc, None if folder is None else (str(folder.path), folder.resume_from and str(folder.resume_from)))
    if failure is not None:
        raise failure
    if plan is None:
        raise RecipeError([ConfigError("--out", "the main process could not open the run folder")])
    out_dir, resume_from = Path(plan[0]), plan[1] and Path(plan[1])
    try:
        run = build_run(recipe, out_dir=out_dir, console=console, quiet=quiet, accelerator=acc)
        run.folder = folder
        if resume_from:
            try:
                run.start_iteration = restore(run, resume_from)
            except ckpt.CheckpointError as exc:
                raise RecipeError([ConfigError("--resume", str(exc))]) from None
            except (KeyError, ValueError, TypeError, RuntimeError) as exc:  # files that read but do not fit
                first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
                raise RecipeError([ConfigError("--resume", f"{resume_from} is not a valid checkpoint of this run: {first}")]) from None
        if folder is not None:
            _start_trackers(acc, recipe, out_dir, resume_from=run.start_iteration if resume_from else None)
            folder.write_recipe(recipe)
            run.log = MetricsLog(out_dir, resume_from=run.start_iteration if resume_from else None)
    except BaseException:
        if folder is not None:
            folder.abandon()
        raise
    if folder is not None:
        for skipped, why in folder.skipped:
            run.display.say(f"{skipped.name} is not complete ({why}): kept, set aside if the run writes its iteration again")
    if resume_from:
        run.display.say(f"resuming {out_dir} from {resume_from.name} (iteration {run.start_iteration})")
    elif folder is not None and folder.started_over:
        run.display.say(f"starting {out_dir} over from iteration 0 (--start-over)")
    elif resume:
        run.display.say(f"nothing to resume in {out_dir}: starting from iteration 0")
    return run


def _start_trackers(acc: Any, recipe: Recipe, out_dir: Path, resume_from: int | None) -> None:
    """The trackers, started before the recipe is written: one that fails to start (its options
    were checked at `validate`; a library can still refuse) is one line, and the run did not begin."""
    try:
        trackers.start(acc, recipe, out_dir, resume_from=resume_from)
    except Exception as exc:  # noqa: BLE001 - any tracker library's own error
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise RecipeError([ConfigError("log.trackers", f"a tracker could not start: {type(exc).__name__}: {first}")]) from None


# --- the on-policy check -----------------------------------------------------------------------


def first_ratio_check(recipe: Recipe, console: Console) -> tuple[float, Run]:
    """One iteration, one batch, one gradient step: the largest |ratio - 1| of the stored actions'
    re-evaluated log-probs before the first optimizer step (0 when rollout and update agree)."""
    cfg = attrs.evolve(recipe.train, iterations=1, minibatch_size=0, inner_epochs=1, drop_zero_advantage=False)
    checked = attrs.evolve(recipe, train=cfg, eval=attrs.evolve(recipe.eval, every=0))
    run = build_run(checked, out_dir=None, console=console, quiet=True)
    metrics = iteration(run, 0)
    return metrics["first_ratio_deviation"], run


@torch.no_grad()
def diagnose(run: Run) -> list[str]:
    """Why re-evaluated log-probs differ from the rollout's: the usual suspects, each tested."""
    cfg = run.recipe.train
    found = []
    if cfg.rollout_precision != "same":
        dtype = next(iter(run.trainable)).dtype
        found.append(
            f"the rollout ran under {cfg.rollout_precision} autocast (train.rollout_precision) while the update "
            f"runs in {str(dtype).replace('torch.', '')}: different dtypes give different velocities"
        )
    run.sampler.advance(0)
    traj = phases.rollout(run, 0)
    x, index = traj.latents[:, 0], traj.step_index[:, 0]
    sigma = traj.sigmas[index]
    a = run.policy.velocity(x, sigma, traj.cond)
    b = run.policy.velocity(x, sigma, traj.cond)
    if not torch.equal(a, b):
        found.append("the policy is not deterministic: two identical velocity calls differ (dropout? non-deterministic kernels?)")
    one = run.policy.velocity(x[:1], sigma[:1], tensors.index(traj.cond, slice(0, 1)))
    if not torch.equal(one, a[:1]):
        found.append(
            "batch composition changes the network's output: the update evaluates (sample, step) pairs in "
            "forward passes of a different size than the rollout (train.micro_batch_size, train.rollout_prompts)"
        )
    if not found:
        found.append("the kernel's log-prob of the stored action disagrees with the rollout: check the sampler's sigmas and step indices")
    return found


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
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RecipeError([ConfigError("--checkpoint", f"{folder} does not fit the model: {first[:300]}")]) from None
