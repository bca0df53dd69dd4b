"""The ``fgrpo`` command: plugins, validate, compose, report, check, sample, export, push.

Bad input (a recipe error, an unknown or broken component) prints one line per problem and exits
with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shlex
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.table import Table
from rich.tree import Tree

from fgrpo.core import composing, discovery, push, registry, trained
from fgrpo.core import report as run_report
from fgrpo.core.config import ConfigError, DeprecatedKey, RecipeError, first_line, help_lines
from fgrpo.core.consoles import err, out

EXIT_USAGE = 2
#: fgrpo sample's bounds: far beyond any use, far below what would exhaust memory before a line is written
MAX_SAMPLES = 100_000
MAX_STEPS = 10_000
#: a write that failed for want of room: a full disk, a quota, a file-size limit, a read-only disk
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
#: the environment variable through which fgrpo launch tells its processes the launch options it got
#: the exit codes of a run stopped by Ctrl-C (SIGINT) or SIGTERM: 128 + the signal, as a shell reports it
STOPPED_BY_SIGNAL = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def _add_recipe_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    text = "path to recipe.yaml, or the name of a built-in recipe (shapes, vector, ...)"
    if optional:
        p.add_argument("recipe", nargs="?", default=None, help=text)
    else:
        p.add_argument("recipe", help=text)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set train.lr=1e-4 (repeatable)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported like every other bad input: one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


def integer_at_least(low: int, high: int = 2**63 - 1) -> Any:
    """An argparse type: an integer from ``low`` to ``high``, else one line naming the argument."""
    allowed = f"an integer >= {low}" if high == 2**63 - 1 else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        return value

    return parse


def finite_number(low: float, *, strict: bool = False) -> Any:
    """An argparse type: a finite number >= ``low`` (> ``low`` when ``strict``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"expected a finite number {'>' if strict else '>='} {low:g}, got {text!r}"
            )
        return value

    return parse


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
    return int(text)


def _log_level(text: str) -> str:
    from fgrpo.core import logs

    try:
        return logs.check(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: {', '.join(logs.LEVELS)}") from None


def _add_log_args(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``-v`` on the main parser and on every command (either place works)."""
    from fgrpo.core import logs

    options = (
        (
            ("--log-level",),
            dict(
                type=_log_level,
                metavar="LEVEL",
                help=(
                    f"{', '.join(logs.LEVELS)} (default: ${logs.ENV} or info); debug also shows diffusers' and "
                    f"transformers' own output"
                ),
            ),
        ),
        (("-v", "--verbose"), dict(action="store_const", const="debug", help="--log-level debug")),
    )
    for flags, kwargs in options:
        try:
            p.add_argument(*flags, dest="log_level", default=argparse.SUPPRESS, **kwargs)
        except argparse.ArgumentError:  # a plugin's command that has an option of that name keeps its own
            pass


#: the commands ``fgrpo launch`` starts under accelerate
LAUNCHED = ("compose", "check", "sample")


def build_parser() -> argparse.ArgumentParser:
    from fgrpo.core.shipped import versions_text

    parser = _Parser(
        prog="fgrpo",
        description="Online RL for flow-matching generators.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # --version prints one line per distribution
    )
    parser.add_argument(
        "--version", action="version", version=versions_text(), help="the fgrpo distributions' versions"
    )
    _add_log_args(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plugins", help="list installed components and where they come from")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--keys", action="store_true", help="also list every component's recipe keys")
    p.set_defaults(handler=cmd_plugins)

    p = sub.add_parser("recipes", help="the shipped recipes: model, objective, what each shows, what it measured")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=discovery.cmd_recipes)

    p = sub.add_parser("keys", help="every recipe key of a section or component: type, default, bounds, help")
    p.add_argument("section", nargs="?", help="train, eval, log, a kind (objective) or kind.name (model.sd3)")
    p.set_defaults(handler=discovery.cmd_keys)

    p = sub.add_parser("init", help="a starting recipe with comments, for a world or a model")
    p.add_argument("--world", help="shapes, shapes-edit, driving or vector: the shipped recipe to start from")
    p.add_argument("--model", help="a registered model (sd3, flux, wan, ...): a Flow-GRPO recipe for it")
    p.add_argument("--out", help="a new file to write (default: print it)")
    p.set_defaults(handler=discovery.cmd_init)

    p = sub.add_parser("validate", help="check a recipe and report every problem")
    _add_recipe_args(p)
    p.add_argument(
        "--against-reference",
        nargs="?",
        const="",
        default=None,
        metavar="ENTRY",
        help="also compare it, value by value, with the reference it reproduces (recipes/references/parity.yaml; "
        "ENTRY: the table's entry, default the recipe's file name); exit 1 on a difference the table does not list",
    )
    p.set_defaults(handler=cmd_validate)

    p = sub.add_parser("compose", help="build the recipe's components and train")
    _add_recipe_args(p)
    p.add_argument("--out", default=None, help="run folder (default: a new runs/<recipe name>/<date-time>)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue OUT from its newest complete checkpoint")
    again.add_argument(
        "--start-over",
        action="store_true",
        help="train OUT again from iteration 0 when it holds no complete checkpoint",
    )
    p.add_argument("--dry-run", action="store_true", help="build and show the components, do not train")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars and no line per iteration (evaluations, warnings and the end are shown)",
    )
    p.set_defaults(handler=cmd_compose)

    p = sub.add_parser("report", help="write a run's self-contained HTML report (curves, evaluations, filmstrip)")
    p.add_argument("run", help="a run folder (the --out of compose)")
    p.add_argument("--out", default=None, help="the HTML file (default: RUN/report.html)")
    p.set_defaults(handler=cmd_report)

    p = sub.add_parser("check", help="on-policy check: the first ratio must be exactly 1")
    _add_recipe_args(p)
    p.add_argument(
        "--tolerance", type=finite_number(0), default=1e-6, help="largest |ratio - 1| accepted (default 1e-6)"
    )
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser("sample", help="write images from the base model or a checkpoint")
    _add_recipe_args(p, optional=True)  # with --checkpoint, its own recipe is the default
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a checkpoint folder or a run folder (its newest complete checkpoint); sampled with the "
        "checkpoint's own recipe unless RECIPE is given (it must agree on the model)",
    )
    p.add_argument("--prompts", required=True, help="a prompt file (.txt or .jsonl)")
    p.add_argument("--n", type=integer_at_least(1, MAX_SAMPLES), default=1, help="samples per prompt")
    p.add_argument("--seed", type=integer_at_least(0), default=0)
    p.add_argument(
        "--steps", type=integer_at_least(1, MAX_STEPS), default=None, help="ODE steps (default: eval.steps)"
    )
    p.add_argument("--out", required=True, help="a new (or empty) folder for the samples and their index.jsonl")
    p.add_argument("--no-ema", action="store_true", help="the raw trained weights even when the run keeps an EMA")
    p.add_argument(
        "--no-scores",
        action="store_true",
        help="do not build the recipe's rewards: index.jsonl without each sample's scores and details",
    )
    p.set_defaults(handler=trained.cmd_sample)

    p = sub.add_parser("export", help="a checkpoint's trained weights in the backbone's own format (diffusers LoRA)")
    p.add_argument(
        "checkpoint", help="a checkpoint folder (RUN/checkpoints/iter_N) or a run folder (its newest checkpoint)"
    )
    p.add_argument("--out", required=True, help="folder to write (e.g. for pipe.load_lora_weights(OUT))")
    p.add_argument("--no-ema", action="store_true", help="the raw trained weights even when the run keeps an EMA")
    p.set_defaults(handler=trained.cmd_export)

    p = sub.add_parser(
        "push",
        help="upload a run's export (its newest checkpoint, a checkpoint or an export folder) and a model card to "
        "the Hugging Face Hub",
    )
    p.add_argument("source", help="a run folder (its newest checkpoint), a checkpoint folder, or an export folder")
    p.add_argument("repo", help="the hub model repository, OWNER/NAME (created when absent)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--dry-run", action="store_true", help="print what would be uploaded; no token, no network")
    p.add_argument("--no-ema", action="store_true", help="the raw trained weights even when the run keeps an EMA")
    p.add_argument(
        "--timeout",
        type=integer_at_least(1, 86400),
        default=600,
        help="seconds the upload may take in all (the token check and the repository's creation: 15 s each)",
    )
    p.set_defaults(handler=push.cmd_push)

    p = sub.add_parser(
        "launch",
        help="accelerate launch of a command, its recipe checked first: "
        "fgrpo launch [ACCELERATE OPTIONS] compose RECIPE ...",
        description="Check the recipe once, then start the command in every process with accelerate's launcher "
        "(e.g. fgrpo launch --config_file recipes/accelerate/ddp.yaml compose recipe.yaml). A bad recipe is one "
        "message and exit code 2, whether found before the processes start or in them.",
    )
    p.add_argument(
        "arguments",
        nargs=argparse.REMAINDER,
        help=f"accelerate launch options, then one of {', '.join(LAUNCHED)} with its arguments",
    )
    p.set_defaults(handler=cmd_launch)

    from fgrpo.core.hookspecs import register_commands

    register_commands(sub)
    for name, command in sub.choices.items():  # plugins' commands too
        if name != "launch":
            _add_log_args(command)
    return parser


# --- plugins -----------------------------------------------------------------------------------


def plugin_rows(with_keys: bool = False) -> list[dict[str, Any]]:
    rows = []
    for kind in registry.GROUPS:
        for entry in registry.entries(kind):
            state, detail = registry.status(entry)
            row: dict[str, Any] = {
                "kind": kind,
                "name": entry.name,
                "target": entry.target,
                "distribution": entry.distribution,
                "version": entry.version,
                "extras": list(entry.extras),
                "status": state,
                "error": detail or None,
            }
            if with_keys and state == "ok":
                cls = registry.load(kind, entry.name)
                row["keys"] = [{"key": k, "default": d, "help": h} for k, d, h in _keys(cls)]
            rows.append(row)
    return rows


def _keys(cls: Any) -> list[tuple[str, str, str]]:
    import attrs

    return help_lines(cls) if attrs.has(cls) else []


def cmd_plugins(args: argparse.Namespace) -> int:
    from fgrpo.core.hookspecs import failures, plugin_manager

    rows = plugin_rows(args.keys)
    hooks = [{"name": name, "status": "ok"} for name, _ in plugin_manager().list_name_plugin()] + [
        {"name": f.name, "distribution": f.distribution, "status": "import error", "error": f.error}
        for f in failures()
    ]
    if args.json:
        out.print_json(json.dumps({"components": rows, "hook_plugins": hooks}))
        return 0
    table = Table(title="fgrpo components", show_lines=False)
    for col in ("kind", "name", "target", "distribution", "status"):
        table.add_column(col)
    for row in rows:
        colour = {"ok": "green", "missing extra": "yellow"}.get(row["status"], "red")
        status = f"[{colour}]{row['status']}[/]"
        table.add_row(row["kind"], row["name"], row["target"], f"{row['distribution']} {row['version']}", status)
    out.print(table)
    for row in rows:
        if row["error"]:
            out.print(f"  {row['kind']} {row['name']}: {row['error']}", markup=False)
        for key in row.get("keys", []):
            out.print(f"  {row['kind']} {row['name']}.{key['key']} = {key['default']}  {key['help']}", markup=False)
    for hook in hooks:
        line = f"hook plugin {hook['name']}: {hook['status']}"
        out.print(line + (f" ({hook['error']})" if hook.get("error") else ""), markup=False)
    return 0


# --- recipes -----------------------------------------------------------------------------------


def _load(args: argparse.Namespace):
    from fgrpo.core import recipe as recipe_mod

    return recipe_mod.load(args.recipe, args.overrides)


def cmd_validate(args: argparse.Namespace) -> int:
    recipe = _load(args)
    iterations = " + ".join(str(stage.train.iterations) for stage in recipe.all_stages())
    stages = f" in {len(recipe.later) + 1} stages" if recipe.later else ""
    out.print(f"{args.recipe}: ok ({len(recipe.rewards)} reward(s), {iterations} iterations{stages})", markup=False)
    if args.against_reference is None:
        return 0
    from fgrpo.core import parity
    from fgrpo.core.shipped import find_recipe

    table = parity.load_table()
    name = args.against_reference or Path(find_recipe(args.recipe)).stem
    if name not in table["recipes"]:
        entries = ", ".join(sorted(table["recipes"]))
        raise RecipeError(
            [ConfigError("--against-reference", f"no entry {name!r} in {parity.table_path()}; entries: {entries}")]
        )
    rows, problems = parity.compare(name, recipe.data, table)
    out.print(parity.render(name, rows, table), markup=False, highlight=False, soft_wrap=True)
    for problem in problems:
        err.print(problem, markup=False, highlight=False)
    counts = {
        status: sum(r.status == status for r in rows) for status in (parity.STATUS_SAME, parity.STATUS_DEVIATION)
    }
    out.print(
        f"{name}: {counts[parity.STATUS_SAME]} values as the reference, {counts[parity.STATUS_DEVIATION]} intended "
        f"deviations, {len(problems)} problem(s)",
        markup=False,
    )
    return 1 if problems else 0


def composition_tree(recipe: Any, title: str) -> Tree:
    from fgrpo.core.recipe import REWARD_EXTRA_KEYS

    tree = Tree(f"[bold]{title}[/]")
    for section in ("model", "sampler", "objective", "prompts"):
        _spec_branch(tree, section, section, recipe.data[section])
    rewards = tree.add("reward")
    for spec in recipe.data["reward"]:
        params = {k: v for k, v in spec.items() if k not in REWARD_EXTRA_KEYS}
        _spec_branch(rewards, "reward", f"{spec['label']} (weight {spec['weight']})", params)
    if recipe.data.get("evaluator"):
        evaluators = tree.add("evaluator")
        for spec in recipe.data["evaluator"]:
            _spec_branch(evaluators, "evaluator", spec["label"], {k: v for k, v in spec.items() if k != "label"})
    for section in ("train", "eval", "log"):
        node = tree.add(section)
        for key, value in recipe.data[section].items():
            node.add(f"{key} = {value!r}", highlight=False)
    tree.add(f"seed = {recipe.seed}")
    return tree


def _spec_branch(parent: Tree, kind: str, label: str, spec: dict[str, Any]) -> None:
    entry = registry.entry(kind, spec["name"])
    node = parent.add(f"{label}: [bold]{spec['name']}[/] -> {entry.target} ({entry.distribution} {entry.version})")
    for key, value in spec.items():
        if key == "name":
            continue
        if isinstance(value, dict) and "name" in value and key in registry.GROUPS:
            _spec_branch(node, key, key, value)
            continue
        node.add(f"{key} = {value!r}", highlight=False)


def cmd_compose(args: argparse.Namespace) -> int:
    recipe = _load(args)
    if args.dry_run:
        components = build_components(recipe)
        out.print(composition_tree(recipe, f"composed {args.recipe} (dry run)"))
        for k, stage in enumerate(recipe.later, 2):
            title = f"then stage {k} of {len(recipe.later) + 1}, from stage {k - 1}'s policy"
            out.print(composition_tree(stage, title))
        out.print(f"built {len(components)} components; nothing trained (--dry-run)", markup=False)
        return 0
    return composing.compose(recipe, args)


def cmd_report(args: argparse.Namespace) -> int:
    path = run_report.write(Path(args.run), Path(args.out) if args.out else None)
    out.print(f"report: {path} ({path.stat().st_size / 1024:.0f} KiB)", markup=False)
    return 0


def build_components(recipe: Any) -> dict[str, Any]:
    from fgrpo.core.building import check_prompts

    built = {section: recipe.build(section) for section in ("model", "sampler", "objective", "prompts")}
    source = built["prompts"]
    check_prompts(built["model"], source.train_prompts() + source.test_prompts(), "prompts", source.metadata)
    for spec, reward in recipe.build_rewards():
        built[f"reward/{spec.label}"] = reward
    for spec, evaluator in recipe.build_evaluators():
        built[f"evaluator/{spec.label}"] = evaluator
    return built


def cmd_check(args: argparse.Namespace) -> int:
    """The first ratio of one on-policy iteration must be 1 within ``--tolerance``."""
    from fgrpo.core.onpolicy import diagnose, first_ratio_check

    deviation, run = first_ratio_check(_load(args), console=out)
    out.print(
        f"largest |ratio - 1| before the first optimizer step: {deviation:.3e} (tolerance {args.tolerance:g}; "
        f"{composing.accelerate_summary(run)})",
        markup=False,
    )
    if deviation <= args.tolerance:
        out.print("on-policy check passed", markup=False)
        return 0
    for line in diagnose(run):
        out.print(f"diagnosis: {line}", markup=False)
    out.print("on-policy check FAILED", markup=False)
    return 1


def cmd_launch(args: argparse.Namespace) -> int:
    """``fgrpo launch [ACCELERATE OPTIONS] COMMAND ...``: the command's recipe is loaded and checked
    here, once (a bad one is reported once, exit 2, before any process starts); then accelerate's
    launcher starts ``python -m fgrpo.core.cli COMMAND ...`` in every process, and the exit code
    is the first failed process's (2 for a recipe error found in the processes), without the
    launcher's traceback."""
    import logging
    import subprocess

    from fgrpo.core import logs

    rest = list(args.arguments)
    at = next((i for i, word in enumerate(rest) if word in LAUNCHED), None)
    if at is None:
        raise RecipeError(
            [
                ConfigError(
                    "launch",
                    f"got {' '.join(rest) or 'nothing'!r}; expected accelerate launch options, then "
                    f"{' or '.join(LAUNCHED)} with its arguments",
                )
            ]
        )
    from fgrpo.core.interrupts import LAUNCH_OPTIONS
    from fgrpo.core.shipped import with_shipped_configs

    command, errors = rest[at:], []
    try:
        options = with_shipped_configs(rest[:at])
    except RecipeError as exc:  # reported with the recipe's errors, all at once
        errors, options = exc.errors, []
    checked = build_parser().parse_args(command)
    if getattr(checked, "log_level", None):
        logs.configure(checked.log_level)
    if getattr(checked, "recipe", None) is not None:
        try:
            _load(checked)
        except RecipeError as exc:
            errors += exc.errors
    if errors:
        raise RecipeError(errors)
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_args = launch_command_parser().parse_args([*options, "--module", "fgrpo.core.cli", *command])
    if logs.current() != "debug":  # the processes print their own errors; the agent's summary repeats them
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # the processes inherit the environment: they name the options in the line that says how to go on
    os.environ[LAUNCH_OPTIONS] = shlex.join(rest[:at])
    try:
        launch_command(launch_args)
    except subprocess.CalledProcessError as exc:
        return exc.returncode if exc.returncode > 0 else 1
    except Exception as exc:
        failure = getattr(exc, "get_first_failure", None)
        if failure is None:
            raise
        rank, first = failure()
        code = first.exitcode if isinstance(first.exitcode, int) and first.exitcode > 0 else 1
        if code not in (EXIT_USAGE, *STOPPED_BY_SIGNAL):  # the processes said why themselves
            err.print(f"error: process {rank} of the launch failed (exit code {first.exitcode})", markup=False)
        return code
    finally:
        os.environ.pop(LAUNCH_OPTIONS, None)
    return 0


# --- entry -------------------------------------------------------------------------------------


def report_once(lines: Sequence[str]) -> None:
    """Error lines, from the main process only: every process of a launch reads the same recipe
    and finds the same errors (at --log-level debug every process prints, each line marked)."""
    from fgrpo.core import logs

    rank = composing.process_rank()
    if rank != 0 and logs.current() != "debug":
        return
    mark = f"process {rank}: " if rank != 0 else ""
    for line in lines:
        err.print(f"{mark}{line}", markup=False)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A recipe key under its old name is one line (``note: ...``), not Python's warning with its
    source line; every other warning as Python shows it."""
    if issubclass(category, DeprecatedKey):
        err.print(f"note: {message}", markup=False)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


def main(argv: Sequence[str] | None = None) -> int:
    from fgrpo.core import logs, threads

    warnings.showwarning = _show_warning
    warnings.simplefilter("always", DeprecatedKey)  # each renamed key of each recipe read, every time

    threads.configure()  # before anything imports torch: the OpenMP wait policy is read at load
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        logs.configure()  # FGRPO_LOG_LEVEL, before anything imports diffusers or transformers
    except ValueError as exc:
        err.print(f"error: {exc}", markup=False)
        return EXIT_USAGE
    parser = build_parser()
    if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):
        args = argparse.Namespace(handler=cmd_launch, arguments=argv[1:])  # accelerate's options are not ours to parse
    else:
        args = parser.parse_args(argv)
    if getattr(args, "log_level", None):
        logs.configure(args.log_level)
    try:
        return int(args.handler(args) or 0)
    except RecipeError as exc:
        report_once([f"error: {e}" for e in exc.errors] + [f"{len(exc.errors)} error(s); nothing was run."])
        return EXIT_USAGE
    except registry.ComponentError as exc:
        report_once([f"error: {exc}"])
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # a second Ctrl-C or SIGTERM while training (fgrpo.core.interrupts)
        err.print("interrupted", markup=False)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        err.print(
            f"error: cannot write {exc.filename or 'a file'}: {exc.strerror}; what was written before is kept "
            "(a run's complete checkpoints: --resume continues from the newest)",
            markup=False,
        )
        return EXIT_USAGE
    except RuntimeError as exc:
        lost = _lost_peers(exc)
        if lost is None:
            raise
        err.print(f"error: {lost}", markup=False)
        return 1


def _lost_peers(exc: RuntimeError) -> str | None:
    """The one line for a collective that failed in a multi-process run (a peer stopped, stuck or
    dead: gloo and NCCL time out after train.process_group_timeout_s); None for any other error."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    text = str(exc)
    if not (
        isinstance(exc, getattr(dist, "DistError", ()))
        or "Timed out" in text
        or "timeout" in text.lower()
        or "closed by peer" in text
    ):
        return None
    return (
        f"process {dist.get_rank()} of {dist.get_world_size()} lost the other processes in a collective "
        f"({first_line(exc)}): "
        "one of them is stopped, stuck or dead. The wait is bounded by train.process_group_timeout_s; "
        "the run's checkpoints are kept (--resume continues it)"
    )


if __name__ == "__main__":
    sys.exit(main())
