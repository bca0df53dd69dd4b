"""Reference parity as data: what a recipe's reference sets, value by value, against the recipe.

``recipes/references/parity.yaml`` (shipped with the recipes) records for each recipe that
reproduces a reference the reference (``sources``: repository and commit; per recipe the config
and script) and every hyper-parameter the reference sets: its value in fgrpo's terms, the
recipe key it maps to and where the reference sets it (``file:line``). Differences the recipe
keeps on purpose are listed under ``deviations`` with their reason and measured size; anything
else that differs is a parity error. ``fgrpo validate RECIPE --against-reference`` prints the
comparison; ``tests/test_reference_parity.py`` fails on any unlisted difference.

A value is ``{key, value, at}``: ``key`` a dotted path into the resolved recipe
(``model.lora.rank``) or one of the ``derived.*`` quantities of :data:`DERIVED` (computed with
the entry's process count), ``value`` the reference's in fgrpo's terms (null is a value too),
``at`` where the reference sets it; optional ``note``, ``unordered: true`` (lists compared as
sets, e.g. LoRA targets) and ``unused: why`` for a parameter the reference does not use in that
setting (the KL form with beta 0). A parameter the reference sets is never left out as "silent".
A key the recipe lacks is a problem unless the value is ``unused`` or listed as a deviation with
``recipe: null`` and a reason (the reference's sampler noise where fgrpo's sampler has none).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

#: what every entry must record (the issue-21 list): a name missing from an entry is an error
REQUIRED = (
    "resolution",
    "steps",
    "guidance",
    "kernel",
    "eta",
    "trained_steps",
    "beta",
    "kl",
    "clip_range",
    "adv_clip",
    "group_size",
    "prompts_per_iteration",
    "optimizer_steps_per_iteration",
    "lr",
    "ema_decay",
    "lora_rank",
    "lora_alpha",
    "lora_init",
    "lora_targets",
    "text_length",
    "dtype",
    "vae_dtype",
    "text_encoder_dtype",
    "mixed_precision",
)
STATUS_SAME, STATUS_DEVIATION, STATUS_DIFFERENT, STATUS_UNUSED = "same", "intended", "DIFFERENT", "n/a"


def table_path() -> Path:
    """The shipped table (next to the recipes: an editable install reads the repository's)."""
    from fgrpo.core.shipped import recipes_folder

    return recipes_folder() / "references" / "parity.yaml"


def load_table(path: str | Path | None = None) -> dict[str, Any]:
    path = Path(path) if path is not None else table_path()
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


# --- derived quantities ------------------------------------------------------------------------


def _per_step(data: Mapping[str, Any], processes: int) -> int:
    train = data["train"]
    samples = train["prompts_per_iteration"] * train["group_size"]
    per_process = train["minibatch_size"] or samples // processes
    return per_process * max(1, train["gradient_accumulation_steps"]) * processes


def _optimizer_steps(data: Mapping[str, Any], processes: int) -> int:
    train = data["train"]
    return (
        math.ceil(train["prompts_per_iteration"] * train["group_size"] / _per_step(data, processes))
        * train["inner_epochs"]
    )


def _trained_steps(data: Mapping[str, Any], _processes: int) -> str:
    """Which steps are stochastic and trained, as text: "0-8" (full), "window 2 at 3-4" or
    "window 2, start 0-3" (fast), "random 6 of 16" (full, random subset: drawn per sample),
    "random 14 of 0-23" (full, random subset of all steps but the last: ignore_last), "random 8 of
    0-8 per iteration" (sparse: drawn once per iteration for the whole batch)."""
    sampler = data["sampler"]
    steps = sampler["steps"]
    if sampler["name"] == "full":
        pool = steps - 1 if sampler.get("ignore_last") else steps
        n = int(pool * sampler["timestep_fraction"])
        if not sampler.get("random_subset"):
            return f"0-{n - 1}"
        return f"random {n} of 0-{pool - 1}" if sampler.get("ignore_last") else f"random {n} of {steps}"
    if sampler["name"] == "fast":
        window = sampler["window"]
        low, high = sampler.get("window_range") or (0, max(steps // 2, window))
        if high - window == low:
            return f"window {window} at {low}-{low + window - 1}"
        return f"window {window}, start {low}-{high - window}"
    if sampler["name"] == "sparse":
        low, high = sampler.get("step_range") or (0, steps)
        count = sampler.get("trained")
        if count is None or count >= high - low:
            return f"{low}-{high - 1}"
        return f"random {count} of {low}-{high - 1} per iteration"
    return f"{sampler['name']} sampler"


def _eval_guidance(data: Mapping[str, Any], _processes: int) -> Any:
    model = data["model"]
    scale = data["eval"].get("guidance_scale")
    if scale is not None:
        return scale
    return model.get("guidance_scale", model.get("true_cfg_scale"))


def _final(data: Mapping[str, Any], _processes: int) -> Any:
    from fgrpo.core import registry

    sampler = data["sampler"]
    if sampler.get("final") is not None:
        return sampler["final"]
    return getattr(registry.load("kernel", sampler["kernel"]["name"]), "reference_final", "sample")


def _rewards(data: Mapping[str, Any], _processes: int) -> list[str]:
    """The rewards by name, ``name*weight`` where the weight is not 1."""
    return [r["name"] if r["weight"] == 1 else f"{r['name']}*{r['weight']:g}" for r in data["reward"]]


#: ``derived.NAME`` keys: functions of (resolved recipe, processes)
DERIVED: dict[str, Callable[[Mapping[str, Any], int], Any]] = {
    "samples_per_optimizer_step": _per_step,
    "optimizer_steps_per_iteration": _optimizer_steps,
    "trained_steps": _trained_steps,
    "eval_guidance": _eval_guidance,
    "final": _final,
    "rewards": _rewards,
}


def resolve(data: Mapping[str, Any], key: str, processes: int) -> Any:
    """The recipe's value at ``key`` (a dotted path, or ``derived.NAME``); KeyError if absent."""
    if key.startswith("derived."):
        return DERIVED[key.split(".", 1)[1]](data, processes)
    node: Any = data
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit():
            node = node[int(part)]
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            raise KeyError(key)
    return node


def same(a: Any, b: Any) -> bool:
    """Equal as recipe values: numbers to 1e-9 relative, lists item by item, the rest with ==."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# --- the comparison ----------------------------------------------------------------------------


@attrs.frozen
class Row:
    name: str
    key: str
    reference: Any
    at: str
    recipe: Any
    status: str
    note: str = ""


def compare(name: str, data: Mapping[str, Any], table: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    """(rows, problems) for the recipe ``name`` (its table entry) with resolved data ``data``.

    A problem: a required parameter the entry does not record, a key the recipe lacks, a value
    that differs without a listed deviation, a deviation whose recipe value is not the recipe's
    (stale), a deviation of a value that no longer differs."""
    entry = table["recipes"][name]
    processes = int(entry["reference"].get("processes", 1))
    values: Mapping[str, Any] = entry["values"]
    deviations: Mapping[str, Any] = entry.get("deviations") or {}
    problems = [f"{name}: the table records no {p!r}" for p in REQUIRED if p not in values]
    problems += [f"{name}: deviation {d!r} is not a recorded value" for d in deviations if d not in values]
    rows = []
    for param, spec in values.items():
        key, expected, at, note = spec["key"], spec.get("value"), str(spec.get("at", "")), spec.get("note", "")
        deviation = deviations.get(param)
        try:
            actual = resolve(data, key, processes)
        except KeyError:
            # a parameter the recipe's components do not have (a deterministic sampler's eta, the
            # clip range of an objective without a ratio) is a row only when the table says why
            if spec.get("unused"):
                rows.append(Row(param, key, expected, at, None, STATUS_UNUSED, str(spec["unused"])))
            elif deviation is not None and deviation.get("recipe") is None and deviation.get("reason"):
                rows.append(Row(param, key, expected, at, None, STATUS_DEVIATION, deviation["reason"]))
            else:
                problems.append(f"{name}: {param}: the recipe has no {key}")
            continue
        if spec.get("unused"):
            rows.append(Row(param, key, expected, at, actual, STATUS_UNUSED, str(spec["unused"])))
            continue
        if not at:
            problems.append(f"{name}: {param}: no file:line of the reference")

        def norm(value: Any, unordered: bool = bool(spec.get("unordered"))) -> Any:
            return sorted(value, key=str) if unordered and isinstance(value, list) else value

        if same(norm(actual), norm(expected)):
            if deviation is not None:
                problems.append(
                    f"{name}: {param}: listed as a deviation but the recipe has the reference's {expected!r}"
                )
            rows.append(Row(param, key, expected, at, actual, STATUS_SAME, note))
        elif deviation is None:
            problems.append(f"{name}: {param} ({key}): the reference has {expected!r} ({at}), the recipe {actual!r}")
            rows.append(Row(param, key, expected, at, actual, STATUS_DIFFERENT, note))
        elif not same(norm(actual), norm(deviation.get("recipe"))):
            problems.append(
                f"{name}: {param} ({key}): the recipe has {actual!r}, its listed deviation {deviation.get('recipe')!r}"
            )
            rows.append(Row(param, key, expected, at, actual, STATUS_DIFFERENT, deviation.get("reason", "")))
        else:
            if not deviation.get("reason"):
                problems.append(f"{name}: {param}: a deviation needs a reason")
            why = deviation.get("reason", "") + (f" (measured: {deviation['size']})" if deviation.get("size") else "")
            rows.append(Row(param, key, expected, at, actual, STATUS_DEVIATION, why))
    return rows, problems


def header(name: str, table: Mapping[str, Any]) -> str:
    ref = table["recipes"][name]["reference"]
    source = table["sources"][ref["source"]]
    where = ", ".join(str(ref[k]) for k in ("config", "script") if ref.get(k))
    return (
        f"{name}: {ref['source']} ({source['repo']} @ {source['commit'][:12]}) {where}, "
        f"{ref.get('processes', 1)} process(es)"
    )


def render(name: str, rows: list[Row], table: Mapping[str, Any]) -> str:
    """The comparison as plain text, one parameter per line (nothing folded or cut, so it reads
    the same in a terminal, a CI log or a grep): parameter, recipe key, the reference's value,
    the recipe's, the status, then where the reference sets it and the note or reason."""
    cells = [("parameter", "recipe key", "reference", "recipe", "status", "where / why")]
    order = (STATUS_DIFFERENT, STATUS_DEVIATION, STATUS_UNUSED, STATUS_SAME)  # what needs a look first
    for row in sorted(rows, key=lambda r: order.index(r.status)):
        why = f"{row.at}{' - ' if row.at and row.note else ''}{row.note}"
        cells.append((row.name, row.key, _shown(row.reference), _shown(row.recipe), row.status, why))
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = [header(name, table)]
    lines += ["  ".join(c[i].ljust(widths[i]) for i in range(5)) + "  " + c[5] for c in cells]
    return "\n".join(line.rstrip() for line in lines)


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
