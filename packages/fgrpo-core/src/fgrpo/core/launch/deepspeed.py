"""DeepSpeed ZeRO-2 (accelerate's DeepSpeed plugin): the policy's ``trainable_module`` stays whole
on every process; gradients are reduced to the process that owns their partition in every
backward, each process keeps and steps the AdamW state of its partition only
(``engine.backward``/``engine.step``), then the updated weights are all-gathered.

So every backward involves every process (a process with fewer passes pads them), forwards do
not. Checkpoints hold whole tensors in ``torch.optim`` format, assembled from every process's
partition, the same files as a data-parallel run.

accelerate 1.15 sets DeepSpeed up only when not told to run on the CPU: on a machine without
accelerators a DeepSpeed launch runs on DeepSpeed's CPU accelerator over gloo
(:func:`accelerator_options`), so that the code paths run (slowly) on a laptop or in CI.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import attrs
import torch

from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.launch.common import Processes, broadcast_parameters, passes_behind, refuse, trainable_module, trainable_of

T = TypeVar("T")


@attrs.define
class DeepSpeedZeRO2(Processes):
    """Gradients and optimizer state split over the processes by DeepSpeed's engine; the weights whole."""

    sharded: ClassVar[bool] = True
    sharded_weights: ClassVar[bool] = False
    description: ClassVar[str] = "sharded (DeepSpeed ZeRO-2)"

    @staticmethod
    def check(accelerator: Any) -> None:
        check_deepspeed(accelerator)

    @property
    def engine(self) -> Any:
        return self.accelerator.deepspeed_engine_wrapped.engine

    def prepare(self, policy: Any, optimizer: torch.optim.Optimizer, train: Any) -> list[torch.nn.Parameter]:
        broadcast_parameters(self.accelerator, trainable_of(optimizer))
        return prepare_deepspeed(self.accelerator, policy, optimizer, train)

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's backward, which reduces the gradients to their partitions."""
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_grad_norm: float) -> torch.Tensor | None:
        """``engine.step()``: clipping (to ``train.max_grad_norm``, set at prepare) included."""
        engine = self.engine
        engine.step()
        norm = engine.get_global_grad_norm()
        if max_grad_norm <= 0 or norm is None:
            return None
        return torch.as_tensor(float(norm))

    def missing_forwards(self, passes: int) -> int:
        return 0  # the weights are whole on every process

    def missing_backwards(self, passes: int) -> int:
        return passes_behind(self.accelerator, passes)

    def gathered(self, collect: Callable[[], T]) -> T | None:
        value = collect()
        return value if self.is_main else None

    def optimizer_state(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[str, Any]:
        return _optimizer_state(self.engine, optimizer, params)

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: Mapping[str, Any]
    ) -> None:
        """After the weights are loaded: DeepSpeed copies them into its float32 partitions."""
        _load_optimizer_state(self.engine, optimizer, params, state)


# --- set-up -------------------------------------------------------------------------------------


def launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``accelerate launch`` asked for DeepSpeed (its config file or ``--use_deepspeed``)."""
    env = os.environ if env is None else env
    return env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator_options(cpu: bool, timeout: Any = None) -> tuple[bool, list[Any]]:
    """The ``cpu`` flag and kwargs handlers for ``Accelerator``: accelerate sets DeepSpeed up only
    when not told to run on the CPU, so a DeepSpeed launch on a machine without accelerators asks
    for the gloo backend instead (DeepSpeed then picks its CPU accelerator)."""
    from accelerate.utils import InitProcessGroupKwargs

    options = {"timeout": timeout} if timeout is not None else {}
    if cpu and launched() and "LOCAL_RANK" in os.environ:
        return False, [InitProcessGroupKwargs(backend="gloo", **options)]
    return cpu, [InitProcessGroupKwargs(**options)] if options else []


def check_deepspeed(accelerator: Any) -> None:
    """Refuse what fgrpo does not run under DeepSpeed: a ZeRO stage other than 2 (stage 3 splits the
    weights, which the policy's own forward does not gather), offloading (not tested)."""
    plugin = accelerator.state.deepspeed_plugin
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    errors = []
    if plugin.zero_stage != 2:
        errors.append(ConfigError("accelerate", f"DeepSpeed zero_stage {plugin.zero_stage} is not supported: fgrpo runs ZeRO-2 (recipes/accelerate/deepspeed-zero2.yaml); FSDP shards the weights too (fsdp-lora.yaml, fsdp-full.yaml)"))
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            errors.append(ConfigError("accelerate", f"DeepSpeed {key} to {device!r} is not supported (not tested with fgrpo); set offload_*_device: none"))
    if errors:
        raise RecipeError(errors)


def prepare_deepspeed(accelerator: Any, policy: Any, optimizer: torch.optim.Optimizer, train: Any) -> list[torch.nn.Parameter]:
    """Give the policy's ``trainable_module`` and the optimizer to DeepSpeed (ZeRO-2) through
    ``accelerator.prepare``. The policy keeps calling the module itself (ZeRO-2 leaves it whole);
    fgrpo's update owns the batching: DeepSpeed's gradient accumulation is unmanaged (every
    ``engine.step()`` is a boundary) and its clipping is ``train.max_grad_norm``."""
    module = trainable_module(policy, optimizer)
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    clip = config.get("gradient_clipping", "auto")
    if clip not in ("auto", None) and float(clip) != float(train.max_grad_norm):
        raise refuse(
            "train.max_grad_norm",
            f"got {train.max_grad_norm} but the DeepSpeed config has gradient_clipping {clip}; set one of them "
            "(leave gradient_clipping out of the accelerate config: fgrpo passes train.max_grad_norm)",
        )
    config["gradient_clipping"] = float(train.max_grad_norm)
    config["train_micro_batch_size_per_gpu"] = 1  # bookkeeping only: fgrpo forms its own batches
    config["gradient_accumulation_steps"] = accelerator.gradient_accumulation_steps
    config["managed_gradient_accumulation"] = False
    config.setdefault("steps_per_print", 2**62)
    params = trainable_of(optimizer)
    engine, _ = accelerator.prepare(module, optimizer)
    if engine.module is not module:
        raise RuntimeError("DeepSpeed wrapped another module than the policy's trainable_module")
    return params


# --- the optimizer state in torch.optim format ----------------------------------------------------


def _group_of(zero: Any, param: torch.nn.Parameter) -> int:
    """The optimizer group of a parameter (``_hp_mapping`` is None on a process that holds none of it)."""
    return next(g for g, group in enumerate(zero.bit16_groups) if any(p is param for p in group))


def _optimizer_state(engine: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """AdamW's per-parameter state assembled from every process's partition (DeepSpeed's tensor
    fragment API; collective), in ``torch.optim`` format; the float32 master weights too when
    the module computes in lower precision (bf16), so a resume is exact."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero = engine.optimizer
    index = {id(p): i for i, p in enumerate(params)}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in zero.bit16_groups[g]]}
        for g, group in enumerate(optimizer.param_groups)
    ]
    state: dict[int, dict[str, Any]] = {}
    if getattr(zero, "_hp_optimizer_states_linked", False):
        for i, p in enumerate(params):
            flat_state = optimizer.state[zero.single_partition_of_fp32_groups[_group_of(zero, p)]]
            keys = [k for k, v in flat_state.items() if torch.is_tensor(v) and v.dim() > 0]
            state[i] = {k: v.detach().clone().cpu() for k, v in flat_state.items() if k not in keys}
            for key in keys:
                state[i][key] = safe_get_full_optimizer_state(p, key).detach().cpu()
    saved: dict[str, Any] = {"state": state, "param_groups": groups}
    if any(p.dtype != torch.float32 for p in params):
        saved["fp32_weights"] = {i: safe_get_full_fp32_param(p).detach().cpu() for i, p in enumerate(params)}
    return saved


def _load_optimizer_state(
    engine: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: Mapping[str, Any]
) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero = engine.optimizer
    for group, saved_group in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    per_param = state["state"]
    masters = state.get("fp32_weights")
    for i, p in enumerate(params):  # the weights were loaded into the module: DeepSpeed's float32 copy follows
        safe_set_full_fp32_param(p, (masters[i] if masters is not None else p.detach()).to(p.device, torch.float32))
    if not per_param:
        return
    for g, flat in enumerate(zero.single_partition_of_fp32_groups):
        first = next(i for i, p in enumerate(params) if _group_of(zero, p) == g)
        optimizer.state[flat] = {
            k: (torch.zeros_like(flat) if torch.is_tensor(v) and v.dim() > 0 else (v.clone() if torch.is_tensor(v) else v))
            for k, v in per_param[first].items()
        }
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    for i, p in enumerate(params):
        for key, value in per_param[i].items():
            if torch.is_tensor(value) and value.dim() > 0:
                safe_set_full_optimizer_state(p, value.to(p.device, torch.float32), key)
