"""Setting a launch up: the Accelerator of a run (mixed precision and gradient accumulation from
the recipe or the launcher, the kinds accelerate leaves unfinished on a CPU completed, the kinds
fgrpo does not run refused) and the :class:`~fgrpo.core.launch.protocol.Launch` that serves it."""

from __future__ import annotations

import os
from typing import Any

import torch

from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.launch.deepspeed import DeepSpeedZeRO2, DeepSpeedZeRO3, accelerator_options, stage_class
from fgrpo.core.launch.deepspeed import launched as deepspeed_launched
from fgrpo.core.launch.fsdp import FSDP2, enable_on_cpu
from fgrpo.core.launch.fsdp import launched as fsdp_launched
from fgrpo.core.launch.processes import DataParallel
from fgrpo.core.launch.protocol import Launch

#: accelerate's distributed types that run data parallel (:class:`DataParallel`)
DATA_PARALLEL = (
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_XPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_MUSA",
    "MULTI_HPU",
    "MULTI_SDAA",
)
#: the other kinds, by accelerate's distributed type (DeepSpeed's by its ZeRO stage: :func:`launch_class`)
SHARDED: dict[str, type[FSDP2] | type[DeepSpeedZeRO2]] = {"FSDP": FSDP2, "DEEPSPEED": DeepSpeedZeRO2}


def kind(accelerator: Any) -> str:
    """accelerate's distributed type, e.g. ``MULTI_GPU``, ``FSDP``, ``DEEPSPEED``."""
    return str(accelerator.distributed_type).split(".")[-1]


def of(accelerator: Any) -> Launch:
    """The launch object that serves ``accelerator`` (one per run: ``run.learner.launch``)."""
    return launch_class(kind(accelerator), accelerator)(accelerator)


def launch_class(
    name: str, accelerator: Any = None
) -> type[DataParallel] | type[FSDP2] | type[DeepSpeedZeRO2] | type[DeepSpeedZeRO3]:
    """The class of accelerate's distributed type ``name`` (of ``accelerator``'s ZeRO stage for
    DeepSpeed); the types fgrpo does not run are refused."""
    if name == "DEEPSPEED" and accelerator is not None:
        return stage_class(accelerator)
    if name in SHARDED:
        return SHARDED[name]
    if name in DATA_PARALLEL:
        return DataParallel
    raise RecipeError(
        [
            ConfigError(
                "accelerate",
                f"distributed type {name} (from the accelerate config or launch flags) is not supported: fgrpo runs "
                f"data "
                "parallel (recipes/accelerate/ddp.yaml), sharded with FSDP2 (fsdp-lora.yaml, fsdp-full.yaml) or with "
                "DeepSpeed ZeRO-2 or ZeRO-3 (deepspeed-zero2.yaml, deepspeed-zero3.yaml, their -offload variants); to "
                "fit "
                "memory also use LoRA, gradient checkpointing, model.text_encoder_device: cpu and bf16 weights",
            )
        ]
    )


def loads_shards() -> bool:
    """Whether this process's launch, as accelerate set it up (a run makes its launch before its
    policy), lets the policy load the network it shards shard by shard (its class's
    ``loads_shards``: FSDP2, DeepSpeed ZeRO-3). False when no Accelerator was made (tools, tests,
    a notebook), and with accelerate's own low-memory load (``fsdp_cpu_ram_efficient_loading``:
    the main process loads whole and broadcasts what the module holds at ``prepare``)."""
    found = _loading_class()
    return bool(found is not None and found.loads_shards)


def _loading_class() -> type[FSDP2] | type[DeepSpeedZeRO2] | None:
    """The class of the launch accelerate set up in this process, when it may load shard by shard."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if getattr(state.get("fsdp_plugin"), "cpu_ram_efficient_loading", False):
        return None
    name = str(state.get("distributed_type")).split(".")[-1]
    if name == "DEEPSPEED":
        plugins = state.get("deepspeed_plugins")  # accelerate's: one plugin, or a dict with one selected
        found = plugins.values() if isinstance(plugins, dict) else [plugins] if plugins is not None else []
        stages = {getattr(p, "zero_stage", None) for p in found if getattr(p, "selected", True)}
        return DeepSpeedZeRO3 if stages == {3} else DeepSpeedZeRO2
    return SHARDED.get(name)


def start(cpu: bool | None = None, train: Any = None, **options: Any) -> Launch:
    """The launch of a run: :func:`make_accelerator`'s Accelerator and the object that serves it."""
    return of(make_accelerator(cpu, train, **options))


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
            errors.append(
                ConfigError(
                    "train.mixed_precision",
                    f"got {precision!r} but accelerate was launched with mixed precision {launched_precision!r}; "
                    "set one of them (train.mixed_precision: auto follows accelerate)",
                )
            )
    if precision not in ("no", "bf16", "fp16"):
        errors.append(
            ConfigError("train.mixed_precision", f"accelerate asks for {precision!r}; allowed: no, bf16, fp16")
        )
    try:
        steps_from_launcher = int(launched_steps) if launched_steps is not None else None
    except ValueError:
        steps_from_launcher = None
        errors.append(
            ConfigError(
                "train.gradient_accumulation_steps", f"accelerate passed {launched_steps!r}; expected an integer"
            )
        )
    if wanted_steps:
        steps = wanted_steps
        if steps_from_launcher not in (None, 1, steps):
            errors.append(
                ConfigError(
                    "train.gradient_accumulation_steps",
                    f"got {steps} but accelerate was launched with {steps_from_launcher}; set one of them (0 follows "
                    f"accelerate)",
                )
            )
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
    its constructor (``log_with``). Data-parallel, FSDP (also on the CPU) and DeepSpeed launches
    run; other kinds are refused."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if cpu is None:
        cpu = not torch.cuda.is_available()
    precision, steps = accelerate_settings(train)
    if precision == "fp16" and (cpu or not torch.cuda.is_available()):
        raise RecipeError(
            [
                ConfigError(
                    "train.mixed_precision",
                    "fp16 mixed precision needs a GPU (accelerate ignores it on the CPU); use bf16 or no",
                )
            ]
        )
    if AcceleratorState._shared_state.get("_mixed_precision") not in (None, precision):
        AcceleratorState._reset_state()  # a new run in the same process (tests, tools): its own precision
    timeout = getattr(train, "process_group_timeout_s", None)
    cpu, handlers = accelerator_options(cpu, timedelta(seconds=timeout) if timeout else None)
    acc = Accelerator(
        cpu=cpu, mixed_precision=precision, gradient_accumulation_steps=steps, kwargs_handlers=handlers, **options
    )
    if kind(acc) == "MULTI_CPU" and fsdp_launched():
        enable_on_cpu(acc)
    served = launch_class(kind(acc), acc)
    if deepspeed_launched() and not issubclass(served, DeepSpeedZeRO2):
        raise RecipeError(
            [
                ConfigError(
                    "accelerate",
                    f"the launch asks for DeepSpeed but accelerate set up {kind(acc)} (a DeepSpeed run needs "
                    f"processes started by "
                    "accelerate launch or torchrun, and the deepspeed package); fgrpo does not run it as something "
                    "else",
                )
            ]
        )
    served.check(acc)
    return acc
