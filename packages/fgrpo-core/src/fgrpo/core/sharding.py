"""Sharded runs: training state split over the processes, by FSDP2 or DeepSpeed ZeRO-2 (through
accelerate's FSDP and DeepSpeed plugins).

A data-parallel run keeps the whole network and optimizer on every process and averages the
gradients itself (``phases.sync_gradients``). A sharded run hands the policy's
``trainable_module`` (the transformer: the module that holds every trainable parameter and that
the policy calls for each forward) to ``accelerator.prepare`` together with the optimizer:

- FSDP2 (:func:`shard_policy`): accelerate makes every transformer block (the module's
  ``_no_split_modules``, or the classes the config names) and then the whole module an FSDP
  unit; parameters become DTensor shards, each forward all-gathers a unit's parameters and
  backward reduce-scatters its gradients, averaged over the processes.
- DeepSpeed ZeRO-2 (:func:`prepare_deepspeed`): the module stays whole on every process;
  gradients are reduced to the process that owns their partition in every backward, each process
  keeps and steps the AdamW state of its partition only (``engine.backward``/``engine.step``,
  :func:`backward`, :func:`optimizer_step`), then the updated weights are all-gathered.

What follows for the rest of fgrpo:

- every process runs the same sequence of collective passes: under FSDP every forward (rollout,
  reference, update, evaluation: evaluation runs on every process), under both every backward;
  the update pads a process that has fewer (sample, step) batches than another with
  zero-weighted passes (:func:`missing_passes`);
- whole tensors are gathered where a file is written (:func:`full`, :func:`optimizer_state`):
  every process takes part, the main process writes. A checkpoint holds whole tensors, the same
  files as a data-parallel run, so any kind of run resumes from it and ``fgrpo export`` and
  ``fgrpo sample`` read it as they read any other;
- loading keeps each process's shard of the whole tensors it reads (:func:`shard_like`,
  :func:`load_optimizer_state`).

accelerate 1.15 sets FSDP and DeepSpeed up only on accelerators; on a machine without one, an
FSDP launch is completed over gloo (:func:`enable_on_cpu`) and a DeepSpeed launch runs on
DeepSpeed's CPU accelerator over gloo (:func:`accelerator_options`), so that the code paths run
(slowly) on a laptop or in CI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from fgrpo.core.config import ConfigError, RecipeError

FSDP = "FSDP"
DEEPSPEED = "DEEPSPEED"


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support
        return None
    return DTensor


def is_sharded_tensor(t: Any) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def kind(accelerator: Any) -> str:
    """accelerate's distributed type, e.g. ``MULTI_GPU``, ``FSDP``, ``DEEPSPEED``."""
    return str(accelerator.distributed_type).split(".")[-1]


def is_sharded(accelerator: Any) -> bool:
    """Whether the run's training state is split over its processes (FSDP or DeepSpeed ZeRO-2):
    backward passes and checkpoints then involve every process."""
    return kind(accelerator) in (FSDP, DEEPSPEED)


def shards_weights(accelerator: Any) -> bool:
    """Whether the weights themselves are split (FSDP): every forward then involves every process."""
    return kind(accelerator) == FSDP


def launched_sharded(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``accelerate launch`` asked for FSDP (its config file or ``--use_fsdp``)."""
    env = os.environ if env is None else env
    return env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def launched_deepspeed(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``accelerate launch`` asked for DeepSpeed (its config file or ``--use_deepspeed``)."""
    env = os.environ if env is None else env
    return env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator_options(cpu: bool, timeout: Any = None) -> tuple[bool, list[Any]]:
    """The ``cpu`` flag and kwargs handlers for ``Accelerator``: accelerate sets DeepSpeed up only
    when not told to run on the CPU, so a DeepSpeed launch on a machine without accelerators asks
    for the gloo backend instead (DeepSpeed then picks its CPU accelerator)."""
    from accelerate.utils import InitProcessGroupKwargs

    options = {"timeout": timeout} if timeout is not None else {}
    if cpu and launched_deepspeed() and "LOCAL_RANK" in os.environ:
        return False, [InitProcessGroupKwargs(backend="gloo", **options)]
    return cpu, [InitProcessGroupKwargs(**options)] if options else []


def enable_on_cpu(accelerator: Any) -> None:
    """An FSDP launch on a machine without accelerators: accelerate 1.15 would run it as plain
    data parallel over gloo (it sets FSDP up only for accelerators); complete the set-up as
    accelerate does there: the FSDP plugin from the launcher's settings, with the run's mixed
    precision."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState does


def _refuse(key: str, message: str) -> RecipeError:
    return RecipeError([ConfigError(key, message)])


def _trainable_module(policy: Any, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    module = getattr(policy, "trainable_module", None)
    name = type(policy).__name__
    if not isinstance(module, torch.nn.Module):
        raise _refuse(
            "model",
            f"{name} cannot be sharded: it names no trainable_module (the network FSDP or DeepSpeed splits over the "
            "processes); launch it data parallel (recipes/accelerate/ddp.yaml)",
        )
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    owned = {id(p) for p in module.parameters()}
    if any(id(p) not in owned for p in trainable):
        raise _refuse("model", f"{name} trains parameters outside its trainable_module, which cannot be sharded; launch it data parallel")
    return module


def prepare(accelerator: Any, policy: Any, optimizer: torch.optim.Optimizer, train: Any) -> list[torch.nn.Parameter]:
    """Shard the policy's training state as the launch asks (FSDP2 or DeepSpeed ZeRO-2); returns the
    trainable parameters in the optimizer's order."""
    if kind(accelerator) == DEEPSPEED:
        return prepare_deepspeed(accelerator, policy, optimizer, train)
    return shard_policy(accelerator, policy, optimizer)


def shard_policy(accelerator: Any, policy: Any, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """Shard the policy's ``trainable_module`` with the optimizer through ``accelerator.prepare``
    (in place: the policy keeps calling the same module); returns the trainable parameters, now
    DTensor shards, in the optimizer's order."""
    module = _trainable_module(policy, optimizer)
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise _refuse(
            "accelerate",
            f"fsdp_version {plugin.fsdp_version} is not supported: fgrpo shards with FSDP2 (fully_shard keeps the policy's "
            "module in place); set fsdp_version: 2 (recipes/accelerate/fsdp-lora.yaml, fsdp-full.yaml)",
        )
    _as_data_parallel(plugin)
    prepared, _ = accelerator.prepare(module, optimizer)
    if prepared is not module:  # the policy would keep calling the unsharded module
        raise RuntimeError("accelerate replaced the policy's trainable_module instead of sharding it in place")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if {id(p) for p in params} != {id(p) for p in policy.trainable_parameters() if p.requires_grad}:
        raise RuntimeError("after sharding, the optimizer's parameters are not the policy's trainable parameters")
    return params


def _as_data_parallel(plugin: Any) -> None:
    """Mixed precision with the numerics of a data-parallel run: weights all-gathered in their own
    dtype (accelerate keeps trainable ones in float32) and computed under the run's autocast,
    gradients reduced in float32. accelerate's bf16 policy would gather bf16 copies of the weights
    and reduce in bf16: then a forward's rounding depends on its batch size, and the first ratio
    is 1 only when the update's forward passes hold the rollout's batches."""
    policy = plugin.mixed_precision_policy
    if policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=policy.cast_forward_inputs
    )


# --- whole tensors and shards ------------------------------------------------------------------


def full(t: Any) -> Any:
    """The whole tensor of a DTensor shard (every process must call: an all-gather); other values
    as they are."""
    return t.full_tensor() if is_sharded_tensor(t) else t


def full_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor gathered (in the mapping's order: the same on every process)."""
    return {k: full(v) for k, v in state.items()}


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) as ``like`` holds it: this process's shard when ``like`` is a
    DTensor (no communication: every process has read the whole tensor), else ``value``."""
    if not is_sharded_tensor(like):
        return value
    from torch.distributed.tensor import DTensor, distribute_tensor

    assert isinstance(like, DTensor)  # is_sharded_tensor
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def optimizer_state(accelerator: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with whole tensors, the file a data-parallel run writes (every
    process of a sharded run must call this); ``params`` are the trainable parameters in order."""
    engine = deepspeed_engine(accelerator)
    if engine is not None:
        return _deepspeed_optimizer_state(engine, optimizer, params)
    state = optimizer.state_dict()
    return {
        **state,
        "state": {i: full_state(per_param) for i, per_param in sorted(state["state"].items())},
    }


def load_optimizer_state(
    accelerator: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: Mapping[str, Any]
) -> None:
    """Load :func:`optimizer_state`'s dict (of any kind of run): a sharded run keeps its share.
    Call it after the weights are loaded (DeepSpeed copies them into its float32 partitions)."""
    engine = deepspeed_engine(accelerator)
    if engine is not None:
        _load_deepspeed_optimizer_state(engine, optimizer, params, state)
        return
    per_param = dict(state["state"])
    for i, values in per_param.items():
        param = params[int(i)] if int(i) < len(params) else None
        if param is None or not is_sharded_tensor(param):
            continue
        per_param[i] = {
            k: shard_like(v, param) if isinstance(v, torch.Tensor) and v.shape == param.shape else v
            for k, v in values.items()
        }
    optimizer.load_state_dict({**state, "state": per_param})


def missing_passes(accelerator: Any, passes: int) -> int:
    """How many zero-weighted forward/backward passes this process adds so that every process of a
    sharded run makes as many as the busiest (FSDP's collectives run in every pass)."""
    counts = accelerator.gather(torch.tensor([passes], device=accelerator.device))
    return int(counts.max()) - passes


# --- DeepSpeed ZeRO-2 ---------------------------------------------------------------------------


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
    module = _trainable_module(policy, optimizer)
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    clip = config.get("gradient_clipping", "auto")
    if clip not in ("auto", None) and float(clip) != float(train.max_grad_norm):
        raise _refuse(
            "train.max_grad_norm",
            f"got {train.max_grad_norm} but the DeepSpeed config has gradient_clipping {clip}; set one of them "
            "(leave gradient_clipping out of the accelerate config: fgrpo passes train.max_grad_norm)",
        )
    config["gradient_clipping"] = float(train.max_grad_norm)
    config["train_micro_batch_size_per_gpu"] = 1  # bookkeeping only: fgrpo forms its own batches
    config["gradient_accumulation_steps"] = accelerator.gradient_accumulation_steps
    config["managed_gradient_accumulation"] = False
    config.setdefault("steps_per_print", 2**62)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    engine, _ = accelerator.prepare(module, optimizer)
    if engine.module is not module:
        raise RuntimeError("DeepSpeed wrapped another module than the policy's trainable_module")
    return params


def deepspeed_engine(accelerator: Any) -> Any:
    """The DeepSpeed engine of a DeepSpeed run (None otherwise)."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return wrapped.engine if wrapped is not None else None


def backward(accelerator: Any, loss: torch.Tensor) -> None:
    """Backward of one pass: DeepSpeed's (which reduces the gradients to their partitions), or
    autograd's with accelerate's loss scaling (fp16)."""
    engine = deepspeed_engine(accelerator)
    if engine is not None:
        engine.backward(loss, scale_wrt_gas=False)
        return
    scaler = getattr(accelerator, "scaler", None)
    (scaler.scale(loss) if scaler is not None else loss).backward()


def deepspeed_step(engine: Any) -> torch.Tensor | None:
    """One DeepSpeed optimizer step (clipping included); the gradient norm before clipping."""
    engine.step()
    norm = engine.get_global_grad_norm()
    return None if norm is None else torch.as_tensor(float(norm))


def _group_of(zero: Any, param: torch.nn.Parameter) -> int:
    """The optimizer group of a parameter (``_hp_mapping`` is None on a process that holds none of it)."""
    return next(g for g, group in enumerate(zero.bit16_groups) if any(p is param for p in group))


def _deepspeed_optimizer_state(engine: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[str, Any]:
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


def _load_deepspeed_optimizer_state(
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


__all__ = [
    "accelerator_options",
    "backward",
    "check_deepspeed",
    "deepspeed_engine",
    "deepspeed_step",
    "enable_on_cpu",
    "full",
    "full_state",
    "is_sharded",
    "is_sharded_tensor",
    "kind",
    "launched_deepspeed",
    "launched_sharded",
    "load_optimizer_state",
    "missing_passes",
    "optimizer_state",
    "prepare",
    "prepare_deepspeed",
    "shard_like",
    "shard_policy",
    "shards_weights",
]
