"""recipe.yaml -> a validated, typed recipe; every problem reported at once.

A recipe names each component by its registered ``name``; the other keys of that mapping are the
component's constructor arguments, checked against its declared fields (types, bounds, choices)
without building anything. ``train``, ``eval`` and ``log`` are the trainer's own sections.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml

from fgrpo.core import media, registry, stages
from fgrpo.core.config import ConfigError, RecipeError, check_params, param, read_text_file, shown
from fgrpo.core.guard import check_guard, guard_recipe_errors
from fgrpo.core.shipped import find_recipe
from fgrpo.core.yaml_reading import apply_overrides, load_yaml

# --- the trainer's own sections ----------------------------------------------------------------


@attrs.define
class TrainConfig:
    iterations: int = param(100, ge=1, help="training iterations (rollout + update)")
    prompts_per_iteration: int = param(8, ge=1, help="prompt groups per iteration, all processes together")
    group_size: int = param(8, ge=2, help="samples per prompt (G)")
    rollout_prompts: int = param(0, ge=0, help="prompt groups per rollout call; 0 = all of this process's")
    rollout_precision: Literal["same", "bfloat16", "float16"] = param(
        "same", help="autocast the rollout to this dtype (faster, but off-policy: `fgrpo check` shows it)"
    )
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = param(
        "auto",
        help="autocast of every network forward (rollout, update, evaluation); auto: accelerate's "
        "(accelerate launch --mixed_precision / its config file), else no. Kernel arithmetic stays float32",
    )
    gradient_accumulation_steps: int = param(
        0,
        ge=0,
        help="minibatches per optimizer step; 0: accelerate's (--gradient_accumulation_steps / its config), else 1",
    )
    inner_epochs: int = param(1, ge=1, help="passes over each iteration's samples")
    minibatch_size: int = param(0, ge=0, help="samples per optimizer step; 0 = the whole batch (on-policy)")
    micro_batch_size: int = param(
        0,
        ge=0,
        help="(sample, step) pairs per forward pass (all trained steps of a sample batched; forward-process "
        "objectives: "
        "(sample, point) pairs, a DPO pair's two rows counting as two); 0 = the whole minibatch",
    )
    reference_batch_size: int = param(
        0,
        ge=0,
        help="(sample, step) pairs per forward of the passes without gradient (the KL's reference, once per "
        "iteration; forward-process objectives: the old policy's and the reference's, once per epoch); 0 = "
        "micro_batch_size",
    )
    reward_worker: bool = param(
        False,
        help="decode and score each rollout chunk (train.rollout_prompts) in a worker thread while the next chunk "
        "rolls out",
    )
    compile: bool = param(
        False,
        help="torch.compile the policy's transformer: minutes of first compilation (inductor caches it for later "
        "runs), then faster iterations; on the CPU it needs a C++ compiler",
    )
    shuffle_minibatches: bool = param(True, help="shuffle samples before splitting into minibatches")
    lr: float = param(1e-4, gt=0, le=1, help="AdamW learning rate")
    weight_decay: float = param(1e-4, ge=0, help="AdamW's decoupled weight decay (flow_grpo's adam_weight_decay)")
    adam_betas: tuple[float, float] = param((0.9, 0.999), ge=0, lt=1, help="AdamW (beta1, beta2), each in [0, 1)")
    adam_eps: float = param(1e-8, gt=0, help="AdamW epsilon, added to the denominator")
    max_grad_norm: float = param(1.0, ge=0, help="gradient-norm clip; 0 = off")
    lr_schedule: Literal["constant", "linear", "cosine"] = param(
        "constant",
        help="the learning rate over the run, after the warm-up: constant, or decaying to 0 linearly or by cosine",
    )
    warmup_iterations: int = param(0, ge=0, help="iterations of linear learning-rate warm-up from 0")
    ema_decay: float = param(0.0, ge=0, lt=1, help="EMA of the trainable weights; 0 = off")
    ema_every: int = param(1, ge=1, help="update the EMA every N optimizer steps (counted over the whole run)")
    ema_warmup: bool = param(
        True, help="flow_grpo's EMA warm-up: decay min((1 + n) / (10 + n), ema_decay) after n optimizer steps"
    )
    ema_rule: Literal["step", "flow_grpo"] = param(
        "step",
        help="step: update after optimizer step n when n % ema_every == 0; flow_grpo: as its ema.step(global_step) "
        "(train_sd3.py:959), after optimizer step n when (n + 1) % ema_every == 0",
    )
    ema_repeats: int = param(
        1,
        ge=1,
        help="updates applied at each of those steps: flow_grpo steps its EMA once per training minibatch, so "
        "its gradient_accumulation_steps times per optimizer step (minibatch_size / its train.batch_size)",
    )
    advantage: Literal["reward_sum", "advantage_sum", "reward_product", "gdpo"] = param(
        "reward_sum",
        help="reward_sum: weight rewards then normalise; advantage_sum: normalise each then weight; "
        "reward_product: normalise the product of the rewards, each raised to its weight (rewards >= 0); "
        "gdpo: advantage_sum, then renormalised over the whole batch (Pref-GRPO apply_gdpo)",
    )
    global_std: bool = param(False, help="normalise by the std of the whole batch instead of the group's")
    per_prompt: bool = param(
        True,
        help="advantages from each prompt group's mean and std (flow_grpo per_prompt_stat_tracking, "
        "MixGRPO/DanceGRPO use_group); false: the whole batch's mean and std",
    )
    advantage_std: Literal["population", "unbiased"] = param(
        "population", help="std estimator of the advantages: population (flow_grpo) or unbiased (MixGRPO, DanceGRPO)"
    )
    advantage_eps: float = param(
        1e-4, ge=0, help="A = (r - mean) / (std + eps): flow_grpo 1e-4, MixGRPO/DanceGRPO 1e-8"
    )
    drop_zero_advantage: bool = param(
        True,
        help="leave samples whose advantage is exactly 0 out of the update, so that the policy loss and the "
        "KL average over informative samples only (flow_grpo)",
    )
    checkpoint_every: int = param(0, ge=0, help="iterations between checkpoints; 0 = only at the end")
    keep_checkpoints: int = param(2, ge=1, help="iteration checkpoints kept on disk")
    process_group_timeout_s: float = param(
        1800.0,
        gt=0,
        help="with several processes: seconds one waits for the others at a collective (gather, all-reduce, "
        "barrier) before the run ends with an error; cover the main process's evaluations and checkpoints",
    )


@attrs.define
class EvalConfig:
    every: int = param(0, ge=0, help="iterations between evaluations; 0 = off")
    steps: int = param(20, ge=1, help="ODE steps at evaluation, on the sampler's schedule")
    guidance_scale: float | None = param(
        None,
        ge=1.0,
        help="the model's guidance_scale at evaluation (flow_grpo eval_guidance_scale); null = the training one",
    )
    samples_per_prompt: int = param(4, ge=1, help="samples drawn per held-out prompt at each evaluation")
    max_prompts: int = param(0, ge=0, help="test prompts used; 0 = all")
    batch_size: int = param(64, ge=1, help="samples generated at once during an evaluation")
    at_start: bool = param(True, help="evaluate the base before training")
    guard: dict | None = param(
        None,
        validator=check_guard,
        help="over-optimisation guard: {metric: gold/LABEL/METRIC (or a list; omitted: every limit the "
        "evaluators name), proxy: eval/reward_mean, patience: 2, action: warn | stop, direction: auto}; fires when "
        "the proxy rose while a watched gold metric worsened for `patience` evaluations in a row "
        "(fgrpo.core.guard); {} = on with those defaults; null = off",
    )

    @staticmethod
    def check_recipe(resolved: Mapping[str, Any]) -> list[ConfigError]:
        errors = guard_recipe_errors(resolved)
        if errors:
            return errors
        scale = resolved["eval"].get("guidance_scale")
        model = resolved.get("model")
        if scale is None or not isinstance(model, Mapping) or "guidance_scale" in model:
            return []
        return [
            ConfigError(
                "eval.guidance_scale",
                f"got {scale!r}, but the model {model.get('name')!r} has no guidance_scale key; "
                "remove eval.guidance_scale",
            )
        ]


def _trackers():  # accelerate is imported when a recipe is checked, not with this module
    from fgrpo.core import trackers

    return trackers


@attrs.define
class LogConfig:
    trackers: list[str] = param(
        factory=lambda: ["tensorboard"],
        validator=lambda _i, _a, names: _trackers().check_names(names),
        help="experiment trackers through accelerate: tensorboard, wandb, comet_ml, mlflow, aim, clearml, dvclive, "
        "swanlab, trackio",
    )
    project: str = param("fgrpo", help="the trackers' project name (wandb, comet_ml, mlflow ...)")
    init_kwargs: dict[str, dict[str, Any]] = param(
        factory=dict,
        validator=lambda _i, _a, value: _trackers().check_init_kwargs(value),
        help="per-tracker options for accelerate's init_trackers, e.g. {wandb: {entity: me, tags: [a]}}",
    )
    quiet: bool = param(
        False, help="no progress bars and no line per iteration: evaluations, warnings and the end only (as --quiet)"
    )
    timeout_s: float = param(
        30.0,
        gt=0,
        le=3600,
        help="the most a call to a tracker's server may take, retries included (mlflow's HTTP client), before the "
        "run is told it failed",
    )
    sample_grid: bool = param(True, help="write a PNG grid of evaluation samples")
    plots: bool = param(True, help="write a curve PNG (needs matplotlib)")

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], prefix: str) -> list[ConfigError]:
        # checked against each tracker's own signature here, not when compose starts it
        return _trackers().init_kwargs_errors(values["trackers"], values["init_kwargs"], prefix)


SECTIONS: dict[str, str] = {
    "seed": "integer seed of everything random",
    "model": "the policy: {name: ..., **params}",
    "sampler": "the rollout sampler with its kernel",
    "reward": "one reward or a list of rewards, each with an optional weight",
    "evaluator": "gold metrics run at evaluation (not optimised): one evaluator or a list, each {name: ..., label: "
    "..., **params}",
    "objective": "the policy-gradient objective",
    "prompts": "the prompt source",
    "train": "trainer settings",
    "eval": "evaluation settings",
    "log": "logging settings",
    "then": "later stages, each a mapping of the keys it changes from the stage before, each starting from the "
    "policy that stage ended with (fgrpo.core.stages)",
}
REQUIRED = ("model", "sampler", "reward", "objective", "prompts")
OWN_SECTIONS = {"train": TrainConfig, "eval": EvalConfig, "log": LogConfig}
EVALUATOR_EXTRA_KEYS = ("label", "every")


@attrs.frozen
class RewardSpec:
    """One reward of a recipe: its registered ``name`` and its own ``params``, and the keys of its
    entry that are the trainer's (declared here, checked as any component's keys are)."""

    name: str
    label: str | None = param(None, help="name of this reward in metrics (default: its name)")
    weight: float = param(1.0, ge=-1e6, le=1e6, help="weight of this reward in the sum")
    params: dict[str, Any] = attrs.field(factory=dict)
    frame_stride: int = param(1, ge=1, help="videos: score every k-th frame as an image (fgrpo.core.scoring.score)")
    timeout_s: float | None = param(
        None, gt=0, help="seconds a call may take before the run ends with an error; null = no limit"
    )


#: the keys of a reward entry that are the trainer's, not the reward's
REWARD_EXTRA_KEYS = tuple(f.name for f in attrs.fields(RewardSpec) if f.name not in ("name", "params"))


@attrs.frozen
class EvaluatorSpec:
    name: str
    label: str  # its metrics are logged as gold/<label>/<key>
    params: dict[str, Any]
    # None: at every evaluation; N: at the evaluations of iterations divisible by N, and the last;
    # 0: at the last only (an evaluator too slow to run as often as the others)
    every: int | None = None

    def runs_at(self, iteration: int, last: int) -> bool:
        if self.every is None or iteration == last:
            return True
        return self.every > 0 and iteration % self.every == 0


@attrs.frozen
class Recipe:
    """A validated recipe. ``data`` is the resolved mapping (defaults filled in)."""

    data: dict[str, Any]
    seed: int
    train: TrainConfig
    eval: EvalConfig
    log: LogConfig
    rewards: tuple[RewardSpec, ...]
    source: str = ""
    evaluators: tuple[EvaluatorSpec, ...] = ()
    #: the component sections as checked (coerced, defaults filled in), before ``data`` made them plain
    checked: dict[str, dict[str, Any]] = attrs.field(factory=dict, repr=False)
    #: the stages of ``then``, validated (``data`` is the first stage's, without ``then``)
    later: tuple[Recipe, ...] = ()

    def all_stages(self) -> tuple[Recipe, ...]:
        """This recipe's stages in the order they train: itself, then those of ``then``."""
        return (self, *self.later)

    def spec(self, section: str) -> dict[str, Any]:
        return copy.deepcopy(self.data[section])

    def build(self, section: str) -> Any:
        """Build the component of ``section`` (model, sampler, objective, prompts) from its keys as
        they were checked when the recipe was validated (not checked again)."""
        if section not in self.checked:
            spec = self.spec(section)
            return registry.create(section, spec.pop("name"), **spec)
        spec = copy.deepcopy(self.checked[section])
        name = spec.pop("name")
        return registry.construct(section, registry.load(section, name), spec, name)

    def build_rewards(self) -> list[tuple[RewardSpec, Any]]:
        return [(r, registry.create("reward", r.name, **copy.deepcopy(r.params))) for r in self.rewards]

    def build_evaluators(self) -> list[tuple[EvaluatorSpec, Any]]:
        return [(e, registry.create("evaluator", e.name, **copy.deepcopy(e.params))) for e in self.evaluators]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.data, sort_keys=False)


MAX_RECIPE_BYTES = 16 << 20


def load(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe file, or the shipped recipe of that name (``shapes``, as
    ``fgrpo compose shapes`` takes it); raises RecipeError with every problem."""
    path = find_recipe(str(path))
    try:
        text = read_text_file(path, limit=MAX_RECIPE_BYTES, what="a recipe")
    except OSError as exc:
        raise RecipeError([ConfigError(str(path), f"cannot read the recipe: {exc.strerror}")]) from None
    except ValueError as exc:
        raise RecipeError([ConfigError("", str(exc))]) from None
    return from_text(text, overrides, source=str(path))


def from_text(text: str, overrides: Sequence[str] = (), source: str = "recipe") -> Recipe:
    data, duplicates = load_yaml(text, source)
    if data is None:
        data = {}
    return from_dict(data, overrides, source, _errors=duplicates)


def from_dict(
    data: Mapping[str, Any],
    overrides: Sequence[str] = (),
    source: str = "python",
    *,
    _errors: Sequence[ConfigError] = (),
) -> Recipe:
    """A recipe from a Python mapping (what a recipe file holds), with ``--set``-style
    ``overrides`` (``["train.lr=3e-4"]``); raises :class:`RecipeError` with every problem. The
    mapping is not changed."""
    if not isinstance(data, Mapping):
        raise RecipeError(
            [*_errors, ConfigError(source, f"a recipe is a mapping of sections, got {type(data).__name__}")]
        )
    data, errors = apply_overrides(copy.deepcopy(dict(data)), overrides)
    recipe, more = validate(data, source)
    errors = [*_errors, *errors, *more]
    if errors:
        raise RecipeError(errors)
    assert recipe is not None
    return recipe


def validate(data: Mapping[str, Any], source: str = "recipe") -> tuple[Recipe | None, list[ConfigError]]:
    if stages.KEY in data:
        return _validate_stages(data, source)
    errors: list[ConfigError] = []
    resolved: dict[str, Any] = {}
    for key in data:
        if key not in SECTIONS:
            allowed = ", ".join(SECTIONS)
            errors.append(ConfigError(str(key), f"unknown section; allowed: {allowed}"))
    for key in REQUIRED:
        if key not in data:
            errors.append(ConfigError(key, f"missing required section ({SECTIONS[key]})"))

    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        errors.append(ConfigError("seed", f"expected a non-negative integer, got {shown(seed)}"))
    resolved["seed"] = seed

    for section in ("model", "sampler", "objective", "prompts"):
        if section in data:
            resolved[section], errs = registry.check_spec(section, data[section], section)
            errors.extend(errs)

    rewards: list[RewardSpec] = []
    if "reward" in data:
        rewards, resolved["reward"], errs = _check_rewards(data["reward"])
        errors.extend(errs)
    evaluators: list[EvaluatorSpec] = []
    if "evaluator" in data:  # absent stays absent: recipes without one resolve as before
        evaluators, resolved["evaluator"], errs = _check_evaluators(data["evaluator"])
        errors.extend(errs)

    configs = {}
    for section, cls in OWN_SECTIONS.items():
        raw = data.get(section, {})
        if not isinstance(raw, Mapping):  # `train:` or `--set train=` would silently mean "all defaults"
            errors.append(
                ConfigError(
                    section,
                    f"expected a mapping of {section} keys, got {'an empty section' if raw is None else shown(raw)}; "
                    f"leave the section out for the defaults",
                )
            )
            raw = {}
        checked, errs = check_params(cls, raw, section)
        errors.extend(errs)
        resolved[section] = checked
        if not errs:
            configs[section] = cls(**checked)
            resolved[section] = _plain(attrs.asdict(configs[section]))
    if not errors:
        errors.extend(cross_section_errors(resolved))
    if errors:
        return None, errors
    recipe = Recipe(
        data=_plain(resolved),
        seed=seed,
        train=configs["train"],
        eval=configs["eval"],
        log=configs["log"],
        rewards=tuple(rewards),
        source=source,
        evaluators=tuple(evaluators),
        checked={section: resolved[section] for section in ("model", "sampler", "objective", "prompts")},
    )
    return recipe, []


def _validate_stages(data: Mapping[str, Any], source: str) -> tuple[Recipe | None, list[ConfigError]]:
    """A recipe with ``then``: the first stage and each later one (laid over the stage before)
    validated whole; a later stage's problem is named under ``then.N`` unless a stage before has one
    at that key (the same bad value, merged into it, is reported once)."""
    first = {k: v for k, v in data.items() if k != stages.KEY}
    recipe, errors = validate(first, source)
    wrong = stages.list_error(data[stages.KEY])
    if wrong is not None:
        return None, [*errors, wrong]
    seen = {e.key for e in errors}
    later, before = [], first
    for i, stage in enumerate(data[stages.KEY]):
        wrong = stages.stage_error(i, stage)
        if wrong is not None:
            errors.append(wrong)
            continue
        before = stages.merged(before, stage)
        one, errs = validate(before, source)
        fresh = [e for e in errs if e.key not in seen]
        seen |= {e.key for e in errs}
        if one is not None:
            fresh += stages.start_errors(one.data["model"], stage)
            later.append(one)
        where = f"{stages.KEY}.{i}"
        errors += [ConfigError(f"{where}.{e.key}" if e.key else where, e.message) for e in fresh]
    if errors or recipe is None:
        return None, errors
    return attrs.evolve(recipe, later=tuple(later)), []


def cross_section_errors(resolved: Mapping[str, Any]) -> list[ConfigError]:
    """Rules that involve several sections, checked once each section is valid on its own: a
    component class (or a trainer section) may declare ``check_recipe(resolved) -> errors``."""
    classes: list[Any] = []
    for section in ("model", "sampler", "objective", "prompts"):
        spec = resolved.get(section)
        if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
            classes.append(registry.load(section, spec["name"]))
    classes.extend(OWN_SECTIONS.values())
    errors: list[ConfigError] = training_kind_errors(resolved)
    for cls in classes:
        check = getattr(cls, "check_recipe", None)
        if check is not None:
            errors.extend(check(resolved))
    return errors + source_image_errors(resolved)


def source_image_errors(resolved: Mapping[str, Any], shown_at_most: int = 5) -> list[ConfigError]:
    """A text-to-image model given prompts with source images, or an editing model given prompts
    without (the model class's ``source_image_count``), refused at validation when the prompt
    source can list its prompts without being built (``listed_prompts``: the built-in sources);
    the trainer checks any other source the same way before the first rollout."""
    model, prompts = resolved.get("model"), resolved.get("prompts")
    if not (isinstance(model, Mapping) and isinstance(prompts, Mapping)):
        return []
    model_cls, source_cls = registry.load("model", model["name"]), registry.load("prompts", prompts["name"])
    lister = getattr(source_cls, "listed_prompts", None)
    if lister is None:
        return []
    try:
        listed = lister({k: v for k, v in prompts.items() if k != "name"})
    except (OSError, ValueError):  # reported by the source's own checks, or when it is built
        return []
    problems = media.count_problems(model_cls, listed, name=model["name"])
    errors = [ConfigError("prompts", p) for p in problems[:shown_at_most]]
    if len(problems) > shown_at_most:
        errors.append(
            ConfigError("prompts", f"... and {len(problems) - shown_at_most} more prompts the model cannot take")
        )
    return errors


def training_kind_errors(resolved: Mapping[str, Any]) -> list[ConfigError]:
    """An objective trains on what the sampler's rollouts hold: stochastic transitions (grpo,
    grpo-guard: the full, fast and mixgrpo samplers) or finished samples that it re-noises itself
    (nft, awm, dpo: the deterministic ``ode`` sampler). A pair that cannot train is refused,
    naming both keys."""
    objective, sampler = resolved.get("objective"), resolved.get("sampler")
    if not (isinstance(objective, Mapping) and isinstance(sampler, Mapping)):
        return []
    kind = registry.load("objective", objective["name"]).trains_on
    records = getattr(registry.load("sampler", sampler["name"]), "transitions", True)
    kernel = sampler.get("kernel")
    kernel_name = kernel.get("name") if isinstance(kernel, Mapping) else kernel
    if kind == "forward" and records:
        return [
            ConfigError(
                "objective.name",
                f"got {objective['name']!r}, which trains on forward-process points (its rollouts' finished samples, "
                f"re-noised), with sampler.name {sampler['name']!r}, whose stochastic steps (sampler.kernel "
                f"{shown(kernel_name)}) it cannot train on; use the deterministic sampler, e.g. sampler: {{name: ode, "
                "kernel: dpmpp2m}, or an objective that trains on stochastic transitions (grpo, grpo-guard)",
            )
        ]
    if kind == "transitions" and not records:
        return [
            ConfigError(
                "sampler.name",
                f"got {sampler['name']!r}, whose rollouts record no stochastic transitions, with objective.name "
                f"{objective['name']!r}, which trains on them; use the full, fast or mixgrpo sampler with a "
                f"stochastic "
                "kernel (sde, dance, cps), or an objective that trains on the forward process (nft, awm, dpo)",
            )
        ]
    return []


def _entries(section: str, value: Any) -> tuple[list[tuple[str, Mapping[str, Any]]], list[ConfigError]]:
    """A section that holds one component (a name or a mapping) or a list of them: (key, mapping)
    for each, and an error for each item that is neither."""
    single = not isinstance(value, list)
    entries, errors = [], []
    for i, item in enumerate([value] if single else value):
        key = section if single else f"{section}.{i}"
        if isinstance(item, str):
            item = {"name": item}
        if isinstance(item, Mapping):
            entries.append((key, item))
        else:
            errors.append(
                ConfigError(
                    key,
                    f"expected {'an' if section[0] in 'aeiou' else 'a'} {section} name or mapping, got {shown(item)}",
                )
            )
    return entries, errors


def _duplicate_labels(section: str, resolved: Sequence[Mapping[str, Any]]) -> list[ConfigError]:
    labels = [r["label"] for r in resolved]
    return [
        ConfigError(section, f"two {section}s are labelled {shown(label)}; give each a distinct 'label'")
        for label in sorted({lb for lb in labels if labels.count(lb) > 1})
    ]


def _check_rewards(value: Any) -> tuple[list[RewardSpec], Any, list[ConfigError]]:
    if value == []:
        return [], value, [ConfigError("reward", "expected at least one reward")]
    specs, resolved = [], []
    entries, errors = _entries("reward", value)
    for key, item in entries:
        params = {k: v for k, v in item.items() if k not in REWARD_EXTRA_KEYS}
        spec, errs = registry.check_spec("reward", params, key)
        extra, extra_errs = _trainer_keys(item, key)
        errors += errs + extra_errs
        # (a key that failed its check is absent from ``extra``)
        weight, stride, timeout = extra.get("weight", 1.0), extra.get("frame_stride", 1), extra.get("timeout_s")
        label = extra.get("label") or str(spec.get("name", "?"))
        resolved.append(
            {**spec, "weight": float(weight), "label": label, "frame_stride": stride, "timeout_s": timeout}
        )
        if not errs and not extra_errs:
            params = {k: v for k, v in spec.items() if k != "name"}
            specs.append(
                RewardSpec(spec["name"], label, float(weight), params, frame_stride=stride, timeout_s=timeout)
            )
    return specs, resolved, errors + _duplicate_labels("reward", resolved)


def _check_evaluators(value: Any) -> tuple[list[EvaluatorSpec], list[dict[str, Any]], list[ConfigError]]:
    """The ``evaluator`` section: one evaluator (a name or a mapping) or a list of them; each
    keeps its recipe keys plus ``label`` (default its name), unique across the section."""
    if value is None:
        return (
            [],
            [],
            [
                ConfigError(
                    "evaluator",
                    "expected an evaluator name, a mapping or a list of them, got an empty section; leave it out for "
                    "none",
                )
            ],
        )
    specs, resolved = [], []
    entries, errors = _entries("evaluator", value)
    for key, item in entries:
        label = item.get("label")
        if label is not None and (not isinstance(label, str) or not label or "/" in label):
            errors.append(ConfigError(f"{key}.label", f"got {shown(label)}; allowed: a non-empty string without '/'"))
            label = None
        every = item.get("every")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            errors.append(
                ConfigError(
                    f"{key}.every",
                    f"got {shown(every)}; allowed: null (at every evaluation), 0 (at the last only) or N > 0 "
                    "(iterations divisible by N, and the last)",
                )
            )
            every = None
        params = {k: v for k, v in item.items() if k not in EVALUATOR_EXTRA_KEYS}
        spec, errs = registry.check_spec("evaluator", params, key)
        errors += errs
        label = label or str(spec.get("name", "?"))
        resolved.append({**spec, "label": label, "every": every})
        if not errs:
            specs.append(EvaluatorSpec(spec["name"], label, {k: v for k, v in spec.items() if k != "name"}, every))
    return specs, resolved, errors + _duplicate_labels("evaluator", resolved)


def _trainer_keys(item: Mapping[str, Any], key: str) -> tuple[dict[str, Any], list[ConfigError]]:
    """The trainer's keys of a reward entry (:data:`REWARD_EXTRA_KEYS`), checked against
    :class:`RewardSpec`'s declarations (a key that fails its check is left out)."""
    given = {k: item[k] for k in REWARD_EXTRA_KEYS if k in item}
    checked, errors = check_params(RewardSpec, {"name": "", "params": {}, **given}, key)
    return {k: v for k, v in checked.items() if k in REWARD_EXTRA_KEYS}, errors


def _plain(value: Any) -> Any:
    """Plain YAML-safe data (tuples as lists, built objects by their repr)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
