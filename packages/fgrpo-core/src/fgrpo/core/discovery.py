"""The commands that answer a newcomer's first questions: which recipes ship and what each
showed (``fgrpo recipes``), which keys a recipe section or a component takes (``fgrpo keys``),
and a recipe to start from (``fgrpo init``)."""

from __future__ import annotations

import argparse
import difflib
import json
import re
from pathlib import Path
from typing import Any

from fgrpo.core.config import ConfigError, RecipeError, key_rows, read_text_file
from fgrpo.core.consoles import out

#: a shipped recipe's header line that says what it measured (the CPU recipes have one)
MEASURED = re.compile(r"^#\s*measured:\s*(.+)$", re.IGNORECASE | re.MULTILINE)
#: its time on CPUs, with the conditions (tools/bench/recipe_times.py writes it)
TIMED = re.compile(r"^#\s*time:\s*(.+)$", re.IGNORECASE | re.MULTILINE)
#: the worlds ``fgrpo init --world`` starts from, and the shipped recipe each copies
WORLDS = {"shapes": "shapes", "shapes-edit": "shapes-edit", "driving": "driving", "vector": "vector"}


# --- fgrpo recipes -------------------------------------------------------------------------------


def _header(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def _first_sentence(header: str, room: int = 110) -> str:
    sentence = re.split(r"(?<=[a-z0-9)\]])\. ", header, maxsplit=1)[0].rstrip(".")
    return sentence if len(sentence) <= room else sentence[: room - 3].rsplit(" ", 1)[0] + "..."


def _name_of(section: Any) -> str:
    if isinstance(section, dict):
        return str(section.get("name", ""))
    if isinstance(section, list):
        return "+".join(_name_of(s) for s in section)
    return str(section or "")


def unmeasured(text: str) -> str:
    """What ``fgrpo recipes`` says of a recipe without a ``# measured:`` line: one for GPUs this
    machine may lack, or one not trained yet."""
    return "not measured here (the GPUs its header names)" if "GPU" in _header(text) else "not measured yet"


def recipe_rows() -> list[dict[str, str]]:
    """One row per shipped recipe: its name, model, objective, sampler, what it shows (its
    header's first sentence), what it measured (its ``# measured:`` line) and how long it takes on
    CPUs (its ``# time:`` line; none for the recipes that need GPUs)."""
    from fgrpo.core.shipped import recipe_names, recipes_folder
    from fgrpo.core.yaml_reading import load_yaml

    rows = []
    for name in recipe_names():
        text = read_text_file(recipes_folder() / f"{name}.yaml", limit=1 << 20, what="a recipe")
        data, _ = load_yaml(text, name)
        data = data if isinstance(data, dict) else {}
        measured, timed = MEASURED.search(text), TIMED.search(text)
        rows.append(
            {
                "name": name,
                "model": _name_of(data.get("model")),
                "objective": _name_of(data.get("objective")),
                "sampler": _name_of(data.get("sampler")),
                "reward": _name_of(data.get("reward")),
                "shows": _first_sentence(_header(text)) or "(no header)",
                "measured": measured.group(1).strip() if measured else unmeasured(text),
                "time": timed.group(1).strip() if timed else "",
            }
        )
    return rows


def cmd_recipes(args: argparse.Namespace) -> int:
    rows = recipe_rows()
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    for row in rows:
        out.print(
            f"{row['name']}: {row['model']}, {row['objective']} ({row['sampler']}), reward {row['reward']}\n"
            f"    {row['shows']}\n    measured: {row['measured']}"
            + (f"\n    time: {row['time']}" if row["time"] else ""),
            markup=False,
        )
    out.print(f"{len(rows)} recipes; run one by name: fgrpo compose shapes", markup=False)
    return 0


# --- fgrpo keys ----------------------------------------------------------------------------------


def sections() -> dict[str, Any]:
    """The trainer's own sections by name, then ``<kind>.<name>`` for every installed component."""
    from fgrpo.core import registry
    from fgrpo.core.guard import GuardConfig
    from fgrpo.core.recipe import OWN_SECTIONS

    found: dict[str, Any] = {**OWN_SECTIONS, "eval.guard": GuardConfig}
    for kind in registry.GROUPS:
        for entry in registry.entries(kind):
            found[f"{kind}.{entry.name}"] = (kind, entry.name)
    return found


#: the sections whose keys are printed under their whole name (eval.guard.patience, not eval.patience)
OWN_KEYED = ("train", "eval", "log", "eval.guard")


def _rows_of(target: Any) -> list[dict[str, str]]:
    import attrs

    from fgrpo.core import registry

    if isinstance(target, tuple):
        target = registry.load(*target)
    return key_rows(target) if attrs.has(target) else []


def cmd_keys(args: argparse.Namespace) -> int:
    known = sections()
    if args.section is None:
        kinds: dict[str, list[str]] = {}
        for target in known.values():
            if isinstance(target, tuple):
                kinds.setdefault(target[0], []).append(target[1])
        own = [name for name, target in known.items() if not isinstance(target, tuple)]
        out.print("recipe sections: " + ", ".join(own), markup=False)
        for kind, names in kinds.items():
            out.print(f"{kind}: {', '.join(names)}", markup=False)
        out.print("keys of one: fgrpo keys train, fgrpo keys objective.grpo, fgrpo keys model.sd3", markup=False)
        return 0
    wanted = [args.section] if args.section in known else [n for n in known if n.startswith(args.section + ".")]
    if not wanted:
        close = difflib.get_close_matches(args.section, list(known), n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise RecipeError(
            [ConfigError("SECTION", f"got {args.section!r}{hint}; allowed: train, eval, log, a kind or kind.name")]
        )
    for name in wanted:
        rows = _rows_of(known[name])
        out.print(f"{name}:" if rows else f"{name}: no keys", markup=False)
        for row in rows:
            allowed = f" ({row['allowed']})" if row["allowed"] else ""
            out.print(
                f"  {name if name in OWN_KEYED else name.split('.')[0]}.{row['key']}: {row['type']}{allowed}, "
                f"default {row['default']}\n      {row['help']}",
                markup=False,
            )
    return 0


# --- fgrpo init ----------------------------------------------------------------------------------

MODEL_TEMPLATE = """\
# A starting recipe for {model} (fgrpo init --model {model}): Flow-GRPO with PickScore on your prompts.
# Every key is checked before anything runs: fgrpo validate THIS_FILE. Every key a section takes,
# with its default: fgrpo keys train, fgrpo keys model.{model}, ... Shipped recipes to compare
# with: fgrpo recipes.
seed: 0
model:
  name: {model}
  path: {path}  # a hub id or a local folder (save_pretrained output)
  lora: {{rank: 32, alpha: 64}}  # null: full fine-tuning
sampler: {{name: full, steps: 10, kernel: {{name: sde, eta: 0.7}}}}  # every step stochastic and trained
reward: {{name: pickscore}}  # pip install "fgrpo-rewards[clip]"; fgrpo plugins lists every reward
objective: {{name: grpo, clip_range: 1.0e-4, kl_beta: 0.04}}
# Your prompts: a list here, or files of one prompt a line (or JSON lines with metadata):
#   prompts: {{name: text-file, train: prompts/train.txt, test: prompts/test.txt}}
prompts:
  name: list
  train: ["a photo of a red bicycle leaning on a wall", "a watercolor fox in the snow", "a sign that reads OPEN"]
  test: ["a glass teapot on a wooden table"]
train:
{train}
eval: {{every: 25, samples_per_prompt: 4}}
"""


def _train_lines() -> str:
    from fgrpo.core.recipe import TrainConfig

    keep = ("iterations", "group_size", "prompts_per_iteration", "lr", "checkpoint_every", "mixed_precision")
    lines = []
    for row in key_rows(TrainConfig):
        if row["key"] in keep:
            lines.append(f"  {row['key']}: {row['default'].strip(chr(39))}  # {row['help'][:90]}")
    return "\n".join(lines)


def init_text(world: str | None, model: str | None) -> str:
    from fgrpo.core import registry
    from fgrpo.core.shipped import recipes_folder

    if world is not None:
        if world not in WORLDS:
            close = difflib.get_close_matches(world, list(WORLDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError([ConfigError("--world", f"got {world!r}{hint}; allowed: {', '.join(WORLDS)}")])
        shipped = read_text_file(recipes_folder() / f"{WORLDS[world]}.yaml", limit=1 << 20, what="a recipe")
        return f"# Started from the shipped {WORLDS[world]}.yaml (fgrpo init --world {world}).\n" + shipped
    assert model is not None
    try:
        cls = registry.load("model", model)
    except registry.ComponentError as exc:
        raise RecipeError([ConfigError("--model", str(exc))]) from None
    published = list(getattr(cls, "published", {}) or {})
    path = published[0] if published else "YOUR/MODEL  # a hub id or a folder"
    return MODEL_TEMPLATE.format(model=model, path=path, train=_train_lines())


def cmd_init(args: argparse.Namespace) -> int:
    if (args.world is None) == (args.model is None):
        raise RecipeError([ConfigError("init", "give one of --world WORLD or --model NAME")])
    text = init_text(args.world, args.model)
    if args.out is None:
        out.print(text, markup=False, end="")
        return 0
    target = Path(args.out)
    if target.exists():
        raise RecipeError([ConfigError("--out", f"{target} exists; fgrpo init writes a new file only")])
    from fgrpo.core import confine

    confine.write_atomic(target, text)
    out.print(f"wrote {target}; check it with: fgrpo validate {target}", markup=False)
    return 0
