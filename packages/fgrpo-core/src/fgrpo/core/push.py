"""``fgrpo push SOURCE REPO``: a run's trained weights onto the Hugging Face Hub.

SOURCE is a run folder (its newest complete checkpoint), a checkpoint folder, or an export folder
(what ``fgrpo export`` wrote). The upload is the export (:func:`fgrpo.core.trained.checkpoint_export`:
the checkpoint's ``export/``, or the policy's export of its weights) and a model card
(``README.md``: the recipe, the base model, the run's last evaluation), staged in a temporary
folder, read back, and sent as one commit with ``HfApi.create_repo(exist_ok=True)`` and
``HfApi.upload_folder``.

Nothing is contacted without a token (``HF_TOKEN`` or huggingface_hub's stored login), and every
call to the hub has a total deadline (:func:`fgrpo.core.hub.within`): a short ``whoami`` first, so an
unreachable hub or a refused token is one line and exit 2 before anything is created.
``--dry-run`` prints what would be uploaded, without a token or the network.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from fgrpo.core.config import ConfigError, RecipeError, first_line
from fgrpo.core.consoles import out

#: seconds the token check (``whoami``) and the repository's creation may take, each
PROBE_TIMEOUT_S = 15.0
#: evaluation metrics the model card lists at most
CARD_METRICS = 24
INSTALL = "pip install 'huggingface-hub>=0.21'"


def _refuse(key: str, message: str) -> RecipeError:
    return RecipeError([ConfigError(key, message)])


def cmd_push(args: argparse.Namespace) -> int:
    hub = _huggingface_hub()
    _check_repo_id(args.repo)
    with tempfile.TemporaryDirectory(prefix="fgrpo-push-") as tmp:
        staging = Path(tmp) / "upload"
        staging.mkdir()
        about = stage(Path(args.source), staging, no_ema=args.no_ema)
        (staging / "README.md").write_text(model_card(args.repo, about, sorted(_files(staging))), encoding="utf-8")
        files = sorted(_files(staging))
        what = f"{args.repo} ({'private' if args.private else 'public'} model repository)"
        if args.dry_run:
            out.print(f"would upload {len(files)} files from {about['source']} to {what}:", markup=False)
            for name in files:
                out.print(f"  {name} ({(staging / name).stat().st_size} bytes)", markup=False)
            return 0
        from fgrpo.core.hub import offline

        if offline():
            raise _refuse("push", "HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE) forbids contacting the hub; unset it")
        token = _token(hub)
        api = hub.HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
        user = _call(api.whoami, deadline=PROBE_TIMEOUT_S, doing="checking the token")
        _call(
            api.create_repo,
            args.repo,
            repo_type="model",
            private=args.private,
            exist_ok=True,
            deadline=PROBE_TIMEOUT_S,
            doing=f"creating {args.repo}",
        )
        commit = _call(
            api.upload_folder,
            repo_id=args.repo,
            repo_type="model",
            folder_path=str(staging),
            commit_message=f"fgrpo push of {about['source']}",
            deadline=float(args.timeout),
            doing=f"uploading to {args.repo}",
        )
    name = (user or {}).get("name", "?") if isinstance(user, dict) else "?"
    url = getattr(commit, "repo_url", None) or f"{api.endpoint}/{args.repo}"
    out.print(f"pushed {len(files)} files from {about['source']} to {url} (as {name})", markup=False)
    return 0


# --- what is uploaded -----------------------------------------------------------------------------


def stage(source: Path, staging: Path, *, no_ema: bool) -> dict[str, Any]:
    """The export of ``source`` (a run, a checkpoint or an export folder) written into ``staging``
    and read back; returns what the model card says about it (the source, the checkpoint's
    recipe and iteration, the run folder)."""
    from fgrpo.core import checkpoint as ckpt
    from fgrpo.core import rundir
    from fgrpo.core.trained import _copy_tree, _verify, checkpoint_export, exported_weights, verify_export

    if not source.is_dir():
        raise _refuse("SOURCE", f"{source} is not a folder; expected RUN, RUN/checkpoints/iter_N or an export folder")
    if (source / ckpt.STATE).is_file() or (source / "checkpoints").is_dir() or source.name in ("last", "checkpoints"):
        folder = rundir.find_checkpoint(source)
        _verify(folder, "SOURCE", ema=not no_ema)
        checkpoint_export(folder, staging, no_ema=no_ema)
        state = ckpt.read_state(folder)
        run = folder.parent.parent if folder.parent.name == "checkpoints" else None
        about = {"source": str(folder), "recipe": state["recipe"], "iteration": int(state["iteration"]), "run": run}
        summary = exported_weights(folder, no_ema=no_ema)
        about["weights"] = "raw weights" if summary is None else f"EMA weights ({summary.get('updates', '?')} updates)"
    else:
        links = [p for p in source.rglob("*") if p.is_symlink() or not (p.is_file() or p.is_dir())]
        if links:
            raise _refuse("SOURCE", f"{links[0]} is a link or not a regular file; an export folder holds plain files")
        if not any(p.suffix == ".safetensors" for p in source.rglob("*")):
            raise _refuse(
                "SOURCE",
                f"{source} holds no .safetensors weights; expected RUN, RUN/checkpoints/iter_N or an export folder "
                "(fgrpo export --out DIR)",
            )
        _copy_tree(source, staging)
        about = {"source": str(source), "recipe": None, "iteration": None, "run": None, "weights": None}
    verify_export(staging, Path(about["source"]))
    return about


def _files(folder: Path) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]


def model_card(repo: str, about: dict[str, Any], files: list[str]) -> str:
    """The repository's README.md: metadata the hub reads (library, tags, base model when it is a hub
    id), then the recipe, the base model, the run's last evaluation and how to load the weights."""
    from fgrpo.core.hub import looks_like_a_path

    recipe = about.get("recipe") or {}
    model = recipe.get("model") or {}
    base = model.get("path") if isinstance(model.get("path"), str) else None
    peft_adapter = "adapter_config.json" in files
    diffusers_lora = any(f.startswith("pytorch_lora_weights") for f in files)
    front = ["---", f"library_name: {'diffusers' if diffusers_lora else 'peft' if peft_adapter else 'fgrpo'}"]
    front += ["tags:", "- fgrpo", "- flow-grpo", "- reinforcement-learning"] + (["- lora"] if peft_adapter else [])
    if base and not looks_like_a_path(base) and not os.path.isdir(os.path.expanduser(base)):
        front.append(f"base_model: {base}")
    lines = [*front, "---", "", f"# {repo}", "", "Trained with fgrpo (online RL of flow-matching models)."]
    if recipe:
        import yaml

        lines += ["", "## Recipe", ""]
        for section in ("model", "sampler", "objective", "reward", "prompts"):
            value = recipe.get(section)
            entries = value if isinstance(value, list) else [value]
            names = [str(e.get("name")) for e in entries if isinstance(e, dict) and "name" in e]
            if names:
                lines.append(f"- {section}: {', '.join(names)}")
        lines.append(f"- base model: {base or 'the shipped base of ' + str(model.get('name', '?'))}")
        lines.append(f"- checkpoint: iteration {about['iteration']} ({about['weights']})")
        resolved = yaml.safe_dump(recipe, sort_keys=False).rstrip()
        lines += ["", "The whole recipe (resolved):", "", "```yaml", resolved, "```"]
    metrics = _last_evaluation(about.get("run"), about.get("iteration"))
    if metrics:
        lines += ["", f"## Evaluation (iteration {metrics.pop('iteration')})", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in metrics.items()]
    lines += ["", "## Files", "", *[f"- `{f}`" for f in files if f != "README.md"], "", "## Loading", ""]
    if diffusers_lora:
        lines.append("`pipe.load_lora_weights(REPO)` on the base pipeline (diffusers' LoRA format).")
    if peft_adapter:
        lines.append("`PeftModel.from_pretrained(base_transformer, REPO)` (a PEFT adapter).")
    if not (diffusers_lora or peft_adapter):
        lines.append("The weights file(s) above, in the backbone's own format (fgrpo export).")
    return "\n".join(lines) + "\n"


def _last_evaluation(run: Path | None, iteration: int | None) -> dict[str, Any]:
    """The run's last evaluation metrics (``eval/``, ``gold/``) at or before ``iteration``; none when
    the run folder or its metrics are absent or unreadable (the card is made without them)."""
    if run is None:
        return {}
    from fgrpo.core import runread
    from fgrpo.core.runlog import read_metrics

    try:
        rows = read_metrics(run)
    except (OSError, ValueError, runread.Unreadable):
        return {}
    for row in reversed(rows):
        if iteration is not None and row.get("iteration", 0) > iteration:
            continue
        picked = {
            k: v
            for k, v in row.items()
            if k.startswith(("eval/", "gold/")) and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if picked:
            return {"iteration": row.get("iteration"), **dict(sorted(picked.items())[:CARD_METRICS])}
    return {}


# --- the hub ------------------------------------------------------------------------------------


def _huggingface_hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise _refuse("push", f"needs huggingface_hub, which is not installed: {INSTALL}") from None
    return huggingface_hub


def _check_repo_id(repo: str) -> None:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except Exception as exc:  # HFValidationError
        why = first_line(exc)
        raise _refuse("REPO", f"{repo!r} is not a hub repository id ({why}); expected NAME or OWNER/NAME") from None


def _token(hub: Any) -> str:
    token = os.environ.get("HF_TOKEN") or hub.get_token()
    if not token:
        raise _refuse(
            "push",
            "no Hugging Face token: set HF_TOKEN or log in with `hf auth login` (nothing was uploaded; --dry-run "
            "shows what would be)",
        )
    return str(token)


def _call(fn: Any, *args: Any, deadline: float, doing: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` within ``deadline`` seconds in all, or one refusal that says what failed."""
    from fgrpo.core.hub import within

    try:
        return within(deadline, fn, *args, **kwargs)
    except TimeoutError:
        raise _refuse("push", f"{doing}: the hub gave no answer within {deadline:g} s; nothing more is sent") from None
    except Exception as exc:  # connection refused, DNS, proxy, 401/403, a rejected repository ...
        status = getattr(getattr(exc, "response", None), "status_code", None)
        refused = {401: "the hub refused the token (401)", 403: "the token may not write there (403)"}
        why = refused.get(status) if isinstance(status, int) else None
        why = why or f"{type(exc).__name__}: {first_line(exc) if str(exc).strip() else 'no detail'}"
        raise _refuse("push", f"{doing}: {why}") from None


__all__ = ["cmd_push", "model_card", "stage"]
