"""The commands that use a trained run's weights: ``fgrpo sample`` (images from the base model or a
checkpoint) and ``fgrpo export`` (the weights in the backbone's own format)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.consoles import err, out


def cmd_sample(args: argparse.Namespace) -> int:
    from fgrpo.core import checkpoint as ckpt
    from fgrpo.core import confine, rundir
    from fgrpo.core.building import check_prompts
    from fgrpo.core.evaluation import write_samples
    from fgrpo.core.prompts import image_errors, read_prompt_file
    from fgrpo.core.saving import load_checkpoint_weights
    from fgrpo.core.shipped import find_recipe

    try:
        rows = read_prompt_file(args.prompts)
    except OSError as exc:
        raise RecipeError([ConfigError("--prompts", f"cannot read {args.prompts}: {exc.strerror}")]) from None
    except ValueError as exc:
        raise RecipeError([ConfigError("--prompts", str(exc))]) from None
    prompts, metadata = [p for p, _ in rows], dict(rows)
    bad_images = image_errors(prompts, "--prompts")
    if bad_images:
        raise RecipeError(bad_images)
    if args.checkpoint:
        checkpoint = rundir.find_checkpoint(Path(args.checkpoint))
        if (checkpoint / ckpt.STATE).is_file():
            _verify(
                checkpoint, "--checkpoint", ema=not args.no_ema
            )  # the check resume makes, before anything is built
        given = find_recipe(args.recipe) if args.recipe is not None else None
        recipe = rundir.recipe_for_checkpoint(checkpoint, given, args.overrides)
    elif args.recipe is None:
        raise RecipeError([ConfigError("recipe", "give a RECIPE to sample its base model, or --checkpoint DIR")])
    else:
        from fgrpo.core import recipe as recipe_mod

        checkpoint, recipe = None, recipe_mod.load(args.recipe, args.overrides)
    target = rundir.output_folder(Path(args.out))
    policy = _build_policy(recipe)
    check_prompts(policy, prompts, "--prompts", lambda p: metadata.get(p, {}))
    if checkpoint is not None:
        load_checkpoint_weights(policy, checkpoint, 0.0 if args.no_ema else recipe.train.ema_decay)
    # every score a reward gives and what it read, into index.jsonl: built before any file is written
    rewards = [] if args.no_scores else recipe.build_rewards()
    with confine.new_folder(target) as folder:
        written = write_samples(
            policy,
            prompts,
            args.n,
            args.steps or recipe.eval.steps,
            args.seed,
            folder,
            rewards=rewards,
            metadata=lambda p: metadata.get(p, {}),
        )
    scored = f", scored by {', '.join(spec.label or spec.name for spec, _ in rewards)}" if rewards else ""
    out.print(f"wrote {written} samples to {args.out}{scored}", markup=False)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Copy the export a checkpoint already holds (LoRA runs write one in diffusers' format), or
    build the checkpoint's model, load its weights and let the policy export them. The checkpoint
    is checked completely first (the check resume makes); the output folder appears whole."""
    from fgrpo.core import checkpoint as ckpt
    from fgrpo.core import rundir, weights

    folder = rundir.find_checkpoint(Path(args.checkpoint))
    if not (folder / ckpt.STATE).is_file():
        raise RecipeError(
            [
                ConfigError(
                    "checkpoint",
                    f"{folder} is not a checkpoint folder (no {ckpt.STATE}); expected RUN, RUN/checkpoints/iter_N or "
                    f"RUN/checkpoints/last",
                )
            ]
        )
    _verify(folder, "checkpoint", ema=not args.no_ema)
    out_dir = rundir.output_folder(Path(args.out))
    written = export_whole(folder, out_dir, no_ema=args.no_ema)
    for path in written:
        out.print(f"wrote {path}", markup=False)
    summary = exported_weights(folder, no_ema=args.no_ema)
    used = "raw weights" if summary is None else f"EMA weights after {summary.get('updates', '?')} update(s)"
    out.print(f"exported {folder} ({used}) to {out_dir}", markup=False)
    every = (ckpt.read_state(folder)["recipe"].get("train") or {}).get("ema_every", 1)
    for line in weights.ema_warnings(summary, every) + weights.lora_warnings(out_dir):
        err.print(f"warning: {line}", markup=False)
    return 0


def export_whole(folder: Path, out_dir: Path, *, no_ema: bool) -> list[str]:
    """The export of the (verified) checkpoint ``folder`` written into the new folder ``out_dir``,
    which appears whole and read back, or not at all; the files written."""
    from fgrpo.core import confine
    from fgrpo.core.checkpoint import share_files

    with confine.new_folder(out_dir) as tmp:
        made = checkpoint_export(folder, tmp, no_ema=no_ema)
        share_files(tmp)
        verify_export(tmp, out_dir)  # before the folder appears under its name: whole and readable, or absent
        return [str(out_dir / p.relative_to(tmp)) if p.is_relative_to(tmp) else str(p) for p in made]


def exported_weights(folder: Path, *, no_ema: bool) -> dict[str, Any] | None:
    """The EMA summary of the weights checkpoint ``folder``'s export holds, None for the raw weights."""
    from fgrpo.core import checkpoint as ckpt
    from fgrpo.core import weights

    state = ckpt.read_state(folder)
    return None if no_ema or ckpt.ema_decay(state) <= 0 else weights.summary_of_checkpoint(state)


def checkpoint_export(folder: Path, target: Path, *, no_ema: bool) -> list[Path]:
    """The export of the (verified) checkpoint ``folder`` written into the folder ``target``: a copy
    of the ``export/`` it holds (the EMA's weights when the run keeps one; not with ``no_ema``),
    else its model built, its weights loaded and exported by the policy. Returns the files written."""
    from fgrpo.core import checkpoint as ckpt
    from fgrpo.core import rundir

    ema_in_use = ckpt.ema_decay(ckpt.read_state(folder)) > 0  # then the checkpoint's export/ holds the EMA's weights
    ready = folder / ckpt.EXPORT
    if ready.is_dir() and not (no_ema and ema_in_use):
        return _copy_tree(ready, target)
    recipe = rundir.recipe_for_checkpoint(folder, None, [])
    policy = _build_policy(recipe)
    export = getattr(policy, "export", None)
    if export is None:
        raise RecipeError(
            [
                ConfigError(
                    "model",
                    f"{recipe.data['model']['name']!r} has no export(): its weights are in {folder / ckpt.TRAINABLE}",
                )
            ]
        )
    from fgrpo.core.saving import load_checkpoint_weights

    load_checkpoint_weights(policy, folder, 0.0 if no_ema else recipe.train.ema_decay)
    return [Path(p) for p in export(str(target))]


def verify_export(folder: Path, shown: Path) -> None:
    """Every file of an export read back before ``fgrpo export`` says "exported": each safetensors
    file's header consistent with its bytes and its tensors loaded, each JSON file parsed (a copy
    cut short, a flipped bit in a shape or a dtype is refused, naming the file)."""
    from fgrpo.core import runread

    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = shown / path.relative_to(folder)
        try:
            if path.suffix == ".safetensors":
                runread.read_safetensors(path, what=str(name.parent))
            elif path.suffix == ".json":
                runread.read_json(path, what=str(name))
        except runread.Unreadable as exc:
            problem = ConfigError("--out", f"the export does not read back, nothing written: {exc}")
            raise RecipeError([problem]) from None


def _verify(folder: Path, key: str, *, ema: bool) -> None:
    from fgrpo.core import checkpoint as ckpt

    try:
        ckpt.verify(folder, ema=ema)
    except ckpt.CheckpointError as exc:
        raise RecipeError([ConfigError(key, str(exc))]) from None


def _copy_tree(source: Path, target: Path) -> list[Path]:
    """The files of ``source`` (checked: no links, regular files only) copied under ``target``."""
    import shutil

    made = []
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if path.is_dir():
            dest.mkdir(exist_ok=True)
        else:
            shutil.copyfile(path, dest, follow_symlinks=False)
            made.append(dest)
    return made


def _build_policy(recipe: Any) -> Any:
    import torch

    from fgrpo.core.seeding import derive_seed

    torch.manual_seed(derive_seed(recipe.seed, "build"))
    return recipe.build("model")
