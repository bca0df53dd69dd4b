"""A run's checkpoints: writing one (:func:`save_checkpoint`, the best one :func:`keep_best`),
restoring a run from one (:func:`restore`), and loading a checkpoint's weights into a policy
outside a run (:func:`load_checkpoint_weights`: ``fgrpo sample``, ``fgrpo export``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import torch

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import weights
from fgrpo.core.config import ConfigError, RecipeError, first_line
from fgrpo.core.ema import EMA, ema_weights
from fgrpo.core.hookspecs import plugin_manager
from fgrpo.core.protocols import Exporting, Policy
from fgrpo.core.run import Run


def keep_best(run: Run, done: int) -> None:
    """Checkpoint ``done`` (written if not yet) becomes ``checkpoints/best``."""
    save_checkpoint(run, done)
    if run.is_main:
        assert run.io.out_dir is not None  # a run that checkpoints has its run folder
        ckpt.point_best(run.io.out_dir / "checkpoints", ckpt.folder_name(done))


def save_checkpoint(run: Run, done: int) -> None:
    """Write checkpoint ``done``: the main process writes what the processes holding part of the
    training state gathered (every process in a sharded run, :meth:`~fgrpo.core.launch.Launch.gathered`).
    Once per iteration: the guard may have written it already."""
    if run.saved_at == done:
        return
    run.saved_at = done
    run.learner.launch.wait()
    parts = run.learner.launch.gathered(lambda: checkpoint_parts(run))
    if parts is not None:
        assert run.io.out_dir is not None  # a run that checkpoints has its run folder
        ema_summary = parts.pop("ema_summary")
        prompts_state = getattr(run.prompts, "state_dict", None)  # an optional PromptSource method
        path = ckpt.write(
            run.io.out_dir / "checkpoints",
            done,
            **parts,
            rng={0: {"torch": torch.get_rng_state()}},
            state={
                "iteration": done,
                "data_position": done * run.recipe.train.prompts_per_iteration,
                "sampler": run.sampler.state_dict(),
                "optimizer_steps": run.learner.optimizer_steps,
                "recipe": run.recipe.data,
                "processes": run.learner.launch.processes,
                "run_id": run.io.folder.run_id if run.io.folder is not None else None,
                weights.STATE_KEY: ema_summary,
                **({"guard": run.guard.state_dict()} if run.guard is not None else {}),
                **({"prompts": prompts_state()} if callable(prompts_state) else {}),
            },
            keep=run.recipe.train.keep_checkpoints,
        )
        plugin_manager().hook.fgrpo_checkpoint_saved(run=run, iteration=done, path=str(path))
    run.learner.launch.wait()


def checkpoint_parts(run: Run) -> dict[str, Any]:
    """The training state a checkpoint holds, as whole tensors (collective in a sharded run): the
    trainable weights, the EMA, the optimizer and scheduler, and what writes the ``export/``
    folder (None when the policy writes none): the policy's own-format export of the weights
    evaluation uses (the EMA's when the run keeps one)."""
    with run.learner.launch.whole_weights(run.learner.trainable):
        trainable = run.learner.policy.trainable_state_dict()
    ema = run.learner.ema.state_dict() if run.learner.ema is not None else None
    old = run.learner.old_policy.state_dict() if run.learner.old_policy is not None else None
    optimizer = {
        "optimizer": run.learner.launch.optimizer_state(run.learner.optimizer, run.learner.trainable),
        "scheduler": run.learner.scheduler.state_dict(),
    }
    export = None
    if getattr(run.learner.policy, "export_in_checkpoints", False):
        with ema_weights(run.learner.ema), run.learner.launch.whole_weights(run.learner.trainable):
            exported = run.learner.policy.trainable_state_dict()
        # export_in_checkpoints: the policy has export()
        export = functools.partial(cast(Exporting, run.learner.policy).export, state=exported)
    ema_summary = (
        weights.ema_summary(run.learner.ema, run.learner.optimizer_steps, run.recipe.train.ema_every)
        if run.learner.ema is not None
        else None
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
    with run.learner.launch.whole_weights(run.learner.trainable, modify=True):
        run.learner.policy.load_trainable_state_dict(
            ckpt.read_tensors(folder / ckpt.TRAINABLE, run.learner.policy.device)
        )
    if run.learner.ema is not None:
        run.learner.ema.load_state_dict(ckpt.read_tensors(folder / ckpt.EMA, run.learner.policy.device))
    if run.learner.old_policy is not None:
        run.learner.old_policy.load_state_dict(ckpt.read_tensors(folder / ckpt.OLD, run.learner.policy.device))
    opt = ckpt.read_torch(folder / ckpt.OPTIMIZER)
    run.learner.launch.load_optimizer_state(run.learner.optimizer, run.learner.trainable, opt["optimizer"])
    run.learner.scheduler.load_state_dict(opt["scheduler"])
    torch.set_rng_state(ckpt.read_torch(folder / "rng-rank0.pt")["torch"])
    run.sampler.load_state_dict(state["sampler"])
    run.learner.optimizer_steps = int(
        state.get("optimizer_steps", 0)
    )  # absent before it was saved: EMA counts restart
    if run.guard is not None and "guard" in state:
        run.guard.load_state_dict(state["guard"])
    load_prompts = getattr(run.prompts, "load_state_dict", None)  # an optional PromptSource method
    if "prompts" in state and callable(load_prompts):
        load_prompts(state["prompts"])
    return int(state["iteration"])


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
