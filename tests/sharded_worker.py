"""Train one recipe three ways in the same processes (under torchrun, 2 CPU processes over gloo)
and leave the run folders for the test to compare:

1. ``OUT/ddp``: data parallel, N iterations;
2. ``OUT/sharded``: the same recipe sharded by KIND (``fsdp`` or ``deepspeed``: the environment
   ``accelerate launch`` sets for recipes/accelerate/fsdp-*.yaml or deepspeed-zero2.yaml;
   ``zero3``, ``zero2-offload``, ``zero3-offload``: a DeepSpeed config file), N iterations;
3. ``OUT/resumed``: sharded, N - 1 iterations, then resumed from its checkpoint to N;
4. ``OUT/crossed``: data parallel, N - 1 iterations, then resumed sharded to N.

Process 1 trains on every other sample only (as when ``train.drop_zero_advantage`` leaves out
more of its samples than of process 0's), so with a small ``train.micro_batch_size`` it makes
fewer forward/backward passes and a sharded run must pad them.

Writes ``OUT/report-rankR.json``: what each run saw of its parameters (sharded or whole, the size
of this process's shard), how many padding passes it made, and its last row.

Usage: sharded_worker.py KIND RECIPE OUT N [KEY=VALUE ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console

from fgrpo.core import launch, update
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.opening import close_run, open_run
from fgrpo.core.points import forward, transitions
from fgrpo.core.trainer import train

LAUNCHES = {  # what `accelerate launch --config_file recipes/accelerate/<config>.yaml` sets
    "fsdp": {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "FSDP_OFFLOAD_PARAMS": "false",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
        "FSDP_ACTIVATION_CHECKPOINTING": "false",
    },
    "deepspeed": {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
    },
    # ZeRO-3 and offloading from a DeepSpeed config file (``deepspeed_config_file``): the tiny
    # network's weights are all under DeepSpeed's default persistence threshold (1e5 elements),
    # which would keep them whole; the file sets it to 0 so that every weight is partitioned
    "zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    "zero2-offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero3-offload": {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        }
    },
}


def launch_environment(kind: str, out: Path) -> dict[str, str]:
    """What ``accelerate launch`` sets for KIND: its variables, or a DeepSpeed config file."""
    settings = LAUNCHES[kind]
    if kind in ("fsdp", "deepspeed"):
        return settings
    path = out / f"deepspeed-{kind}.json"
    path.write_text(json.dumps({**settings, "gradient_accumulation_steps": 1}))
    return {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
    }


PADDING = [0]


def fewer_on_process_1(informative):
    def kept_samples(run, adv):
        kept, _ = informative(run, adv)
        if run.accelerator.process_index == 1:
            kept = kept[::2]
        return kept, int(run.accelerator.gather(torch.tensor([len(kept)])).max())

    return kept_samples


def counted(idle_passes):
    def padding(run, traj, adv, count, *level):
        PADDING[0] += count
        idle_passes(run, traj, adv, count, *level)

    return padding


def counted_points(idle):
    def padding(self, count, *level):
        PADDING[0] += count
        idle(self, count, *level)

    return padding


def run(path: str, out: Path, iterations: int, overrides: list[str], *, resume: bool = False) -> dict:
    recipe = recipe_mod.load(path, [*overrides, f"train.iterations={iterations}"])
    PADDING[0] = 0
    r = open_run(recipe, out=str(out), resume=resume, console=Console(quiet=True), quiet=True)
    try:
        stepped = [p for group in r.learner.optimizer.param_groups for p in group["params"]]
        if not stepped:  # ZeRO-3 hands its flat float32 partitions to the optimizer only while it steps
            stepped = list(r.learner.launch.engine.optimizer.fp32_partitioned_groups_flat)
        policy = r.learner.policy
        network = list(policy.trainable_module.parameters()) if hasattr(policy, "trainable_module") else []
        seen = {
            "kind": launch.kind(r.accelerator),
            "sharded": r.learner.launch.sharded,
            "dtensor": launch.is_sharded_tensor(r.learner.trainable[0]),
            # ZeRO-3: weights (trainable or frozen) whose data this process does not hold between forwards
            "partitioned_weights": sum(launch.is_partitioned(p) and p.data.numel() == 0 for p in network),
            "description": r.learner.launch.description,
            "network_weights": len(network),
            # elements whose AdamW state this process holds and steps, of all trainable elements
            "stepped_numel": sum((p.to_local() if launch.is_sharded_tensor(p) else p).numel() for p in stepped),
            "trainable_numel": sum(getattr(p, "ds_numel", p.numel()) for p in r.learner.trainable),
            "start": r.start_iteration,
        }
        seen["last_row"] = train(r)
        seen["padding_passes"] = PADDING[0]
    finally:
        close_run(r)
    return seen


def main() -> None:
    kind, path, out, n, *overrides = sys.argv[1:]
    out, n = Path(out), int(n)
    update.informative = fewer_on_process_1(update.informative)
    transitions.idle_passes = counted(transitions.idle_passes)
    forward.ForwardPoints.idle = counted_points(forward.ForwardPoints.idle)
    report = {"ddp": run(path, out / "ddp", n, overrides), "crossed_ddp": run(path, out / "crossed", n - 1, overrides)}
    os.environ.update(launch_environment(kind, out))
    if kind != "fsdp":  # a DeepSpeed launch starts fresh processes: accelerate's state starts over here
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    report["sharded"] = run(path, out / "sharded", n, overrides)
    report["partial"] = run(path, out / "resumed", n - 1, overrides)
    report["resumed"] = run(path, out / "resumed", n, overrides, resume=True)
    report["crossed"] = run(path, out / "crossed", n, overrides, resume=True)
    (out / f"report-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(report, default=float))


if __name__ == "__main__":
    main()
