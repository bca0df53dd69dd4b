"""DeepSpeed ZeRO-2 and ZeRO-3 (accelerate's DeepSpeed plugin), with or without offloading.

ZeRO-2 (:class:`DeepSpeedZeRO2`): the policy's ``trainable_module`` stays whole on every process;
gradients are reduced to the process that owns their partition in every backward, each process
keeps and steps the AdamW state of its partition only (``engine.backward``/``engine.step``), then
the updated weights are all-gathered. So every backward involves every process (a process with
fewer passes pads them), forwards do not.

ZeRO-3 (:class:`DeepSpeedZeRO3`): the weights are partitioned too (the frozen base weights of a
LoRA run as well). DeepSpeed's hooks on the module all-gather each submodule's weights for its
forward and free them after, so every forward involves every process (padded as under FSDP);
a policy that loads its network shard by shard (the diffusers backbones) hands DeepSpeed a module
already partitioned, each process having read only its partitions (:mod:`.zero3_load`);
consecutive rollout steps reuse gathered weights as far as DeepSpeed's
``stage3_max_live_parameters`` / ``stage3_max_reuse_distance`` allow, and weights under
``stage3_param_persistence_threshold`` stay whole. Whatever reads or writes whole weights outside a
forward (checkpoints, resume) does so inside :meth:`DeepSpeedZeRO3.whole_weights`; the EMA keeps
each process's partition (:mod:`.shards`).

Offloading (``offload_optimizer_device: cpu``, ZeRO-2 or 3; ``offload_param_device: cpu``, ZeRO-3):
the float32 master weights and AdamW state (and the ZeRO-3 partitions) live in CPU memory and the
run's own ``torch.optim.AdamW`` steps them there (``zero_force_ds_cpu_optimizer`` off, the same
update as every other kind; DeepSpeedCPUAdam would be faster but is another implementation).

Checkpoints of every stage hold whole tensors in ``torch.optim`` format, assembled from every
process's partition, the same files as a data-parallel run (any kind resumes from them).

accelerate 1.15 sets DeepSpeed up only when not told to run on the CPU: on a machine without
accelerators a DeepSpeed launch runs on DeepSpeed's CPU accelerator over gloo
(:func:`accelerator_options`), so that the code paths run (slowly) on a laptop or in CI.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

import attrs
import torch

from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.launch.common import (
    Processes,
    broadcast_parameters,
    passes_behind,
    refuse,
    trainable_module,
    trainable_of,
)
from fgrpo.core.launch.shards import full, is_partitioned, shard_like
from fgrpo.core.launch.zero3_load import Partitions

T = TypeVar("T")


@attrs.define
class DeepSpeedZeRO2(Processes):
    """Gradients and optimizer state split over the processes by DeepSpeed's engine; the weights whole."""

    sharded: ClassVar[bool] = True
    sharded_weights: ClassVar[bool] = False
    stage: ClassVar[int] = 2

    @property
    def description(self) -> str:
        return f"sharded (DeepSpeed ZeRO-{self.stage}{offloaded(self.accelerator)})"

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
        """DeepSpeed's backward, which reduces the gradients to their partitions. Then what
        ``engine.forward`` does before the next pass (the policy calls the module itself): without
        it ZeRO-3 would overwrite, not accumulate, the partitions' gradients of the step's earlier
        passes."""
        engine = self.engine
        engine.backward(loss, scale_wrt_gas=False)
        engine.optimizer.clear_backward_seen_flag()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """DeepSpeed's own: the run's AdamW holds DeepSpeed's float32 partitions, whose gradient
        buffers an offloaded optimizer allocates once (``optimizer.zero_grad`` would drop them)."""
        self.engine.optimizer.zero_grad(set_to_none=True)

    def step(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_grad_norm: float
    ) -> torch.Tensor | None:
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


@attrs.define
class DeepSpeedZeRO3(DeepSpeedZeRO2):
    """Weights, gradients and optimizer state split over the processes by DeepSpeed's engine."""

    sharded_weights: ClassVar[bool] = True
    stage: ClassVar[int] = 3
    loads_shards: ClassVar[bool] = True  # through the policy's shard_loading(place) (zero3_load)

    def prepare(self, policy: Any, optimizer: torch.optim.Optimizer, train: Any) -> list[torch.nn.Parameter]:
        """The weights the policy has not read yet (stand-ins) partitioned from their files first
        (:mod:`.zero3_load`); then, as ZeRO-2, the trainable weights every process holds whole
        made process 0's, and the module and optimizer given to DeepSpeed."""
        loading = getattr(policy, "shard_loading", None)
        if not callable(loading):
            return super().prepare(policy, optimizer, train)
        partitions = Partitions(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        with loading(partitions):
            partitions.finish(trainable_module(policy, optimizer))
            broadcast_parameters(self.accelerator, [p for p in trainable_of(optimizer) if not is_partitioned(p)])
            return prepare_deepspeed(self.accelerator, policy, optimizer, train)

    @staticmethod
    def check(accelerator: Any) -> None:
        check_deepspeed(accelerator)
        load_models_whole()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """DeepSpeed's, and the partitions' gradients zeroed: ZeRO-3 copies a gradient into its
        partition in the step's first backward and adds it in later ones, so a weight the first pass
        did not reach (the other expert of Wan 2.2) would add to the previous step's gradient."""
        super().zero_grad(optimizer)
        flat = getattr(self.engine.optimizer, "grad_partitions_flat_buffer", None)
        if flat is not None:
            flat.zero_()

    def missing_forwards(self, passes: int) -> int:
        return passes_behind(self.accelerator, passes)  # each forward all-gathers the weights

    @contextmanager
    def whole_weights(self, params: Sequence[torch.nn.Parameter], modify: bool = False) -> Iterator[None]:
        """The partitioned ``params`` gathered whole inside (collective); with ``modify``, what the
        main process wrote into them is partitioned again on leaving (every process has it)."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(list(params), modifier_rank=0 if modify else None):
            yield

    def optimizer_state(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[str, Any]:
        return _zero3_optimizer_state(self.engine.optimizer, optimizer, params)

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: Mapping[str, Any]
    ) -> None:
        _zero3_load_optimizer_state(self.engine.optimizer, optimizer, params, state)


def load_models_whole() -> None:
    """accelerate hands a stage-3 DeepSpeed config to transformers whatever ``zero3_init_flag``
    says, and transformers then builds every model it loads inside ``deepspeed.zero.Init``
    (partitioned): the frozen text encoders would be split outside any engine that gathers them
    for a forward. Only the trained network is partitioned: by :meth:`DeepSpeedZeRO3.prepare`
    from the policy's files (:mod:`.zero3_load`), or by DeepSpeed at prepare after a whole load."""
    # accelerate imports transformers' deepspeed integration when it sets that config: when the
    # module is not loaded there is nothing to unset (and fgrpo-core does not depend on transformers)
    integration = sys.modules.get("transformers.integrations.deepspeed")
    if integration is not None:
        integration.unset_hf_deepspeed_config()


def stage_class(accelerator: Any) -> type[DeepSpeedZeRO2] | type[DeepSpeedZeRO3]:
    """The class of a DeepSpeed launch's ZeRO stage (the others are refused by :func:`check_deepspeed`)."""
    return DeepSpeedZeRO3 if accelerator.state.deepspeed_plugin.zero_stage == 3 else DeepSpeedZeRO2


def offload_devices(accelerator: Any) -> dict[str, str]:
    """``offload_optimizer`` / ``offload_param`` -> device, for those the DeepSpeed config offloads."""
    zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    found = {key: (zero.get(key) or {}).get("device") or "none" for key in OFFLOADS}
    return {key: device for key, device in found.items() if device != "none"}


def offloaded(accelerator: Any) -> str:
    devices = offload_devices(accelerator)
    return "".join(f", {key.split('_')[1]} offloaded to {device}" for key, device in devices.items())


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


#: the DeepSpeed config's offloading sections
OFFLOADS = ("offload_optimizer", "offload_param")


def check_deepspeed(accelerator: Any) -> None:
    """Refuse what fgrpo does not run under DeepSpeed: ZeRO stages 0 and 1 (stage 2 splits the same
    state and more), offloading to anything but the CPU (NVMe swapping is not tested), parameter
    offloading without ZeRO-3 (DeepSpeed offloads only partitioned weights), ZeRO-3's
    ``zero3_init_flag`` set true."""
    plugin = accelerator.state.deepspeed_plugin
    errors = []
    if plugin.zero_stage not in (2, 3):
        errors.append(
            ConfigError(
                "accelerate",
                f"DeepSpeed zero_stage {plugin.zero_stage} is not supported: fgrpo runs ZeRO-2 "
                f"(recipes/accelerate/deepspeed-zero2.yaml) and ZeRO-3 (deepspeed-zero3.yaml); FSDP shards the "
                f"weights too (fsdp-lora.yaml, fsdp-full.yaml)",
            )
        )
    for key, device in offload_devices(accelerator).items():
        if device != "cpu":
            errors.append(
                ConfigError(
                    "accelerate",
                    f"DeepSpeed {key} to {device!r} is not supported (NVMe swapping is not tested with fgrpo); "
                    f"allowed: none, cpu",
                )
            )
        elif key == "offload_param" and plugin.zero_stage != 3:
            errors.append(
                ConfigError(
                    "accelerate",
                    f"DeepSpeed offload_param to 'cpu' needs zero_stage 3 (got {plugin.zero_stage}): only ZeRO-3 "
                    f"partitions the weights (recipes/accelerate/deepspeed-zero3-offload.yaml)",
                )
            )
    if plugin.zero_stage == 3 and os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "").lower() in ("true", "1"):
        errors.append(
            ConfigError(
                "accelerate",
                "DeepSpeed zero3_init_flag true is not supported: transformers would load the frozen text encoders "
                "partitioned, outside any DeepSpeed engine that gathers them; set zero3_init_flag: false (fgrpo "
                "partitions the trained network when the run is prepared)",
            )
        )
    if errors:
        raise RecipeError(errors)


def prepare_deepspeed(
    accelerator: Any, policy: Any, optimizer: torch.optim.Optimizer, train: Any
) -> list[torch.nn.Parameter]:
    """Give the policy's ``trainable_module`` and the optimizer to DeepSpeed through
    ``accelerator.prepare``. The policy keeps calling the module itself (ZeRO-2 leaves it whole,
    ZeRO-3's hooks gather its weights in place); fgrpo's update owns the batching: DeepSpeed's
    gradient accumulation is unmanaged (every ``engine.step()`` is a boundary), its clipping is
    ``train.max_grad_norm``, and an offloaded optimizer state is stepped by the run's AdamW."""
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
    if offload_devices(accelerator):
        config["zero_force_ds_cpu_optimizer"] = False  # the run's torch AdamW, as every other kind steps
    params = trainable_of(optimizer)
    engine, _ = accelerator.prepare(module, optimizer)
    if engine.module is not module:
        raise RuntimeError("DeepSpeed wrapped another module than the policy's trainable_module")
    return params


# --- the optimizer state in torch.optim format ----------------------------------------------------


def _group_of(zero: Any, param: torch.nn.Parameter) -> int:
    """The optimizer group of a parameter (``_hp_mapping`` is None on a process that holds none of it)."""
    return next(g for g, group in enumerate(zero.bit16_groups) if any(p is param for p in group))


def _optimizer_state(
    engine: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
) -> dict[str, Any]:
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
            k: (
                torch.zeros_like(flat)
                if torch.is_tensor(v) and v.dim() > 0
                else (v.clone() if torch.is_tensor(v) else v)
            )
            for k, v in per_param[first].items()
        }
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    for i, p in enumerate(params):
        for key, value in per_param[i].items():
            if torch.is_tensor(value) and value.dim() > 0:
                safe_set_full_optimizer_state(p, value.to(p.device, torch.float32), key)


# --- ZeRO-3: the same torch.optim format, from the partitions --------------------------------------


def _zero3_partition(zero: Any, param: torch.nn.Parameter, key: str | None = None) -> torch.Tensor:
    """This process's partition of ``param``'s float32 master weight (``key`` None) or of its
    optimizer state ``key``: a slice of its sub-group's flat tensor, laid out as ``ds_tensor``."""
    group, offset, numel = zero.grad_position[zero.get_param_id(param)]
    flat = zero.fp32_partitioned_groups_flat[group]
    return (flat if key is None else zero.optimizer.state[flat][key]).narrow(0, offset, numel)


def _zero3_flat(zero: Any, param: torch.nn.Parameter) -> torch.Tensor:
    return zero.fp32_partitioned_groups_flat[zero.grad_position[zero.get_param_id(param)][0]]


@torch.no_grad()
def _zero3_optimizer_state(
    zero: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
) -> dict[str, Any]:
    """AdamW's per-parameter state gathered from every process's partition (collective), in
    ``torch.optim`` format (each original group lists its parameters in the optimizer's order);
    the float32 master weights too when the module computes in lower precision (bf16)."""
    index = {id(p): i for i, p in enumerate(params)}
    members: dict[int, list[int]] = {}
    for sub, group in enumerate(zero.fp16_groups):
        members.setdefault(zero.sub_group_to_group_id[sub], []).extend(index[id(p)] for p in group)
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": sorted(members.get(g, []))}
        for g, group in enumerate(optimizer.param_groups)
    ]
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        flat_state = optimizer.state.get(_zero3_flat(zero, p), {})
        state[i] = {
            k: full(_zero3_partition(zero, p, k), like=p).detach().cpu()
            if torch.is_tensor(v) and v.dim() > 0
            else (v.detach().clone().cpu() if torch.is_tensor(v) else v)
            for k, v in flat_state.items()
        }
    state = {i: s for i, s in state.items() if s}
    saved: dict[str, Any] = {"state": state, "param_groups": groups}
    if any(p.dtype != torch.float32 for p in params):
        saved["fp32_weights"] = {
            i: full(_zero3_partition(zero, p), like=p).detach().cpu() for i, p in enumerate(params)
        }
    return saved


@torch.no_grad()
def _zero3_load_optimizer_state(
    zero: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: Mapping[str, Any]
) -> None:
    """After the weights are loaded (:meth:`DeepSpeedZeRO3.whole_weights`): the float32 masters
    from the file (bf16) or the loaded weights, the moments cut to this process's partitions."""
    for group, saved_group in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    masters = state.get("fp32_weights")
    per_param = state["state"]
    for i, p in enumerate(params):
        whole = masters[i] if masters is not None else full(p)
        _zero3_partition(zero, p).copy_(shard_like(whole.to(torch.float32), p))
    if not per_param:
        return
    for flat in zero.fp32_partitioned_groups_flat:
        first = next(i for i, p in enumerate(params) if _zero3_flat(zero, p) is flat)
        optimizer.state[flat] = {
            k: (
                torch.zeros_like(flat)
                if torch.is_tensor(v) and v.dim() > 0
                else (v.clone() if torch.is_tensor(v) else v)
            )
            for k, v in per_param[first].items()
        }
    for i, p in enumerate(params):
        for key, value in per_param[i].items():
            if torch.is_tensor(value) and value.dim() > 0:
                _zero3_partition(zero, p, key).copy_(shard_like(value.to(torch.float32), p))
