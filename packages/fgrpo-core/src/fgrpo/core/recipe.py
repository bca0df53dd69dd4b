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

from fgrpo.core import registry
from fgrpo.core.config import ConfigError, RecipeError, check_params, param

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
        0, ge=0, help="minibatches per optimizer step; 0: accelerate's (--gradient_accumulation_steps / its config), else 1"
    )
    inner_epochs: int = param(1, ge=1, help="passes over each iteration's samples")
    minibatch_size: int = param(0, ge=0, help="samples per optimizer step; 0 = the whole batch (on-policy)")
    micro_batch_size: int = param(0, ge=0, help="(sample, step) pairs per forward pass; 0 = the whole minibatch")
    shuffle_minibatches: bool = param(True, help="shuffle samples before splitting into minibatches")
    lr: float = param(1e-4, gt=0, le=1, help="AdamW learning rate")
    weight_decay: float = param(1e-4, ge=0)
    adam_betas: tuple[float, float] = param((0.9, 0.999))
    adam_eps: float = param(1e-8, gt=0)
    max_grad_norm: float = param(1.0, ge=0, help="gradient-norm clip; 0 = off")
    lr_schedule: Literal["constant", "linear", "cosine"] = param("constant")
    warmup_iterations: int = param(0, ge=0)
    ema_decay: float = param(0.0, ge=0, lt=1, help="EMA of the trainable weights; 0 = off")
    ema_every: int = param(1, ge=1, help="update the EMA every N optimizer steps (counted over the whole run)")
    ema_warmup: bool = param(
        True, help="flow_grpo's EMA warm-up: decay min((1 + n) / (10 + n), ema_decay) after n optimizer steps"
    )
    advantage: Literal["reward_sum", "advantage_sum"] = param(
        "reward_sum", help="reward_sum: weight rewards then normalise; advantage_sum: normalise each then weight"
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
    advantage_eps: float = param(1e-4, ge=0, help="A = (r - mean) / (std + eps): flow_grpo 1e-4, MixGRPO/DanceGRPO 1e-8")
    drop_zero_advantage: bool = param(
        True,
        help="leave samples whose advantage is exactly 0 out of the update, so that the policy loss and the "
        "KL average over informative samples only (flow_grpo)",
    )
    checkpoint_every: int = param(0, ge=0, help="iterations between checkpoints; 0 = only at the end")
    keep_checkpoints: int = param(2, ge=1, help="iteration checkpoints kept on disk")


@attrs.define
class EvalConfig:
    every: int = param(0, ge=0, help="iterations between evaluations; 0 = off")
    steps: int = param(20, ge=1, help="ODE steps at evaluation, on the sampler's schedule")
    guidance_scale: float | None = param(
        None, ge=1.0, help="the model's guidance_scale at evaluation (flow_grpo eval_guidance_scale); null = the training one"
    )
    samples_per_prompt: int = param(4, ge=1)
    max_prompts: int = param(0, ge=0, help="test prompts used; 0 = all")
    batch_size: int = param(64, ge=1)
    at_start: bool = param(True, help="evaluate the base before training")

    @staticmethod
    def check_recipe(resolved: Mapping[str, Any]) -> list[ConfigError]:
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
        help="experiment trackers through accelerate: tensorboard, wandb, comet_ml, mlflow, aim, clearml, dvclive, swanlab, trackio",
    )
    project: str = param("fgrpo", help="the trackers' project name (wandb, comet_ml, mlflow ...)")
    init_kwargs: dict[str, dict[str, Any]] = param(
        factory=dict,
        validator=lambda _i, _a, value: _trackers().check_init_kwargs(value),
        help="per-tracker options for accelerate's init_trackers, e.g. {wandb: {entity: me, tags: [a]}}"
    )
    quiet: bool = param(False, help="no progress bars: one line per iteration (CI logs)")
    sample_grid: bool = param(True, help="write a PNG grid of evaluation samples")
    plots: bool = param(True, help="write a curve PNG (needs matplotlib)")


SECTIONS: dict[str, str] = {
    "seed": "integer seed of everything random",
    "model": "the policy: {name: ..., **params}",
    "sampler": "the rollout sampler with its kernel",
    "reward": "one reward or a list of rewards, each with an optional weight",
    "objective": "the policy-gradient objective",
    "prompts": "the prompt source",
    "train": "trainer settings",
    "eval": "evaluation settings",
    "log": "logging settings",
}
REQUIRED = ("model", "sampler", "reward", "objective", "prompts")
OWN_SECTIONS = {"train": TrainConfig, "eval": EvalConfig, "log": LogConfig}
REWARD_EXTRA_KEYS = ("weight", "label", "frame_stride")


@attrs.frozen
class RewardSpec:
    name: str
    label: str
    weight: float
    params: dict[str, Any]
    frame_stride: int = 1  # videos: score every k-th frame as an image (fgrpo.core.phases.score)


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

    def spec(self, section: str) -> dict[str, Any]:
        return copy.deepcopy(self.data[section])

    def build(self, section: str) -> Any:
        """Build the component of ``section`` (model, sampler, objective, prompts)."""
        spec = self.spec(section)
        name = spec.pop("name")
        return registry.create(section, name, **spec)

    def build_rewards(self) -> list[tuple[RewardSpec, Any]]:
        return [(r, registry.create("reward", r.name, **copy.deepcopy(r.params))) for r in self.rewards]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.data, sort_keys=False)


# --- reading -----------------------------------------------------------------------------------


def _yaml_error(source: str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if isinstance(exc, yaml.constructor.ConstructorError) and "tag" in str(problem):
        tag = problem.split("tag", 1)[1].strip().strip("'")
        return ConfigError(
            where, f"the YAML tag {tag} is not allowed: recipes are plain data (yaml.safe_load)"
        )
    return ConfigError(where, f"malformed YAML: {problem}")


def read_yaml(text: str, source: str = "recipe") -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError([_yaml_error(source, exc)]) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML; typed later by the schema)."""
    if "=" not in item:
        raise RecipeError([ConfigError("--set", f"expected KEY=VALUE (e.g. train.lr=1e-4), got {item!r}")])
    key, raw = item.split("=", 1)
    path = [part for part in key.strip().split(".")]
    if not all(path):
        raise RecipeError([ConfigError("--set", f"bad key {key!r}: expected dotted keys like train.lr")])
    return path, read_yaml(raw, f"--set {key}") if raw.strip() else ""


def apply_overrides(data: Any, overrides: Sequence[str]) -> tuple[Any, list[ConfigError]]:
    errors: list[ConfigError] = []
    data = copy.deepcopy(data)
    for item in overrides:
        try:
            path, value = parse_override(item)
        except RecipeError as exc:
            errors.extend(exc.errors)
            continue
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = _child(node, part)
            if nxt is None:
                if isinstance(node, dict):
                    node[part] = nxt = {}
                else:
                    errors.append(ConfigError(".".join(path[: i + 1]), "cannot set a key inside a non-mapping"))
                    break
            node = nxt
        else:
            last = path[-1]
            if isinstance(node, list) and last.isdigit() and int(last) < len(node):
                node[int(last)] = value
            elif isinstance(node, dict):
                node[last] = value
            else:
                errors.append(ConfigError(".".join(path), "cannot set a key inside a non-mapping"))
    return data, errors


def _child(node: Any, part: str) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    return None


def load(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe file; raises RecipeError with every problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecipeError([ConfigError(str(path), f"cannot read the recipe: {exc.strerror}")]) from None
    return from_text(text, overrides, source=str(path))


def from_text(text: str, overrides: Sequence[str] = (), source: str = "recipe") -> Recipe:
    data = read_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError([ConfigError(source, f"a recipe is a mapping of sections, got {type(data).__name__}")])
    data, errors = apply_overrides(data, overrides)
    recipe, more = validate(data, source)
    errors.extend(more)
    if errors:
        raise RecipeError(errors)
    assert recipe is not None
    return recipe


def validate(data: Mapping[str, Any], source: str = "recipe") -> tuple[Recipe | None, list[ConfigError]]:
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
        errors.append(ConfigError("seed", f"expected a non-negative integer, got {seed!r}"))
    resolved["seed"] = seed

    for section in ("model", "sampler", "objective", "prompts"):
        if section in data:
            resolved[section], errs = registry.check_spec(section, data[section], section)
            errors.extend(errs)

    rewards: list[RewardSpec] = []
    if "reward" in data:
        rewards, resolved["reward"], errs = _check_rewards(data["reward"])
        errors.extend(errs)

    configs = {}
    for section, cls in OWN_SECTIONS.items():
        raw = data.get(section) or {}
        if not isinstance(raw, Mapping):
            errors.append(ConfigError(section, f"expected a mapping, got {raw!r}"))
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
    )
    return recipe, []


def cross_section_errors(resolved: Mapping[str, Any]) -> list[ConfigError]:
    """Rules that involve several sections, checked once each section is valid on its own: a
    component class (or a trainer section) may declare ``check_recipe(resolved) -> errors``."""
    classes: list[Any] = []
    for section in ("model", "sampler", "objective", "prompts"):
        spec = resolved.get(section)
        if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
            classes.append(registry.load(section, spec["name"]))
    classes.extend(OWN_SECTIONS.values())
    errors: list[ConfigError] = []
    for cls in classes:
        check = getattr(cls, "check_recipe", None)
        if check is not None:
            errors.extend(check(resolved))
    return errors


def _check_rewards(value: Any) -> tuple[list[RewardSpec], Any, list[ConfigError]]:
    items = value if isinstance(value, list) else [value]
    single = not isinstance(value, list)
    if not items:
        return [], value, [ConfigError("reward", "expected at least one reward")]
    specs, resolved, errors = [], [], []
    for i, item in enumerate(items):
        key = "reward" if single else f"reward.{i}"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping):
            errors.append(ConfigError(key, f"expected a reward name or mapping, got {item!r}"))
            continue
        extra = {k: item[k] for k in REWARD_EXTRA_KEYS if k in item}
        params = {k: v for k, v in item.items() if k not in REWARD_EXTRA_KEYS}
        spec, errs = registry.check_spec("reward", params, key)
        errors.extend(errs)
        weight = extra.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            errors.append(ConfigError(f"{key}.weight", f"expected a number, got {weight!r}"))
            weight = 1.0
        label = extra.get("label", spec.get("name", "?"))
        if not isinstance(label, str):
            errors.append(ConfigError(f"{key}.label", f"expected a string, got {label!r}"))
            label = str(label)
        stride = extra.get("frame_stride", 1)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            errors.append(ConfigError(f"{key}.frame_stride", f"got {stride!r}; allowed: an integer >= 1 (videos: score every k-th frame)"))
            stride = 1
        resolved.append({**spec, "weight": float(weight), "label": label, "frame_stride": stride})
        if not errs:
            params = {k: v for k, v in spec.items() if k != "name"}
            specs.append(RewardSpec(spec["name"], label, float(weight), params, frame_stride=stride))
    labels = [r["label"] for r in resolved]
    for label in sorted({lb for lb in labels if labels.count(lb) > 1}):
        errors.append(ConfigError("reward", f"two rewards are labelled {label!r}; give each a distinct 'label'"))
    return specs, resolved, errors


def _plain(value: Any) -> Any:
    """Plain YAML-safe data (tuples as lists, built objects by their repr)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
