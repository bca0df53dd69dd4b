"""``fgrpo memory RECIPE``: a recipe's peak memory per process at the real size, measured on fake
tensors (``FakeTensorMode``: shapes and dtypes, no storage) with torch's ``MemTracker``, beside
the formula estimate (:mod:`fgrpo.models.memory_formula`).

The recipe's own code runs: its policy (the backbone's velocity, guidance, LoRA, checkpointing;
built by the backbone's fake-size harness, ``fgrpo.models.fake_size``), its sampler's rollout of
this process's prompts, one update micro-batch through the velocity with backward and AdamW's step,
and the checkpoint gather (the trainable state dict). Fake tensors on ``cuda`` stand for the
accelerator, on ``cpu`` for the host.

Under ``--launch fsdp`` the launch's sharding runs too (:mod:`fgrpo.core.launch.fake_fsdp`): the
trained transformer loads shard by shard and is sharded by the launch's own code (FSDP2
``fully_shard``, one unit per block) on a fake process group of ``--gpus`` ranks, and torch's
``FSDPMemTracker`` measures rank 0: its padded shards of the weights, gradients and AdamW state,
and the blocks' all-gathered weights while they compute.

What cannot run on fake tensors is marked ``formula``: DeepSpeed's sharding (ZeRO-2/3: gradients,
optimizer state and, with ZeRO-3, weights divided by the processes from the measured sizes, plus
one block gathered; DeepSpeed's allocator does not run on fake tensors), VAE decoding and reward
models (not run).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fgrpo.core.launch import memory as launch_memory
from fgrpo.core.launch.memory import FORMULA_KIND, MEASURED, declared_launch, sharding_note, share

if TYPE_CHECKING:
    import torch

GIB = 1024**3
KINDS = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


class _Restart:
    """MemTracker hooks that allow a root module to be called again (the sampler's steps): its
    per-module stats restart there; the peaks this command reports are global."""

    def _again(self: Any, module: torch.nn.Module) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        again = module in self.memory_tracking and not self._mod_tracker.is_bw
        if again and set(self._mod_tracker.parents) - {name} == {"Global"}:
            self.reset_mod_stats()

    def _pre_fw_hook(self: Any, module: torch.nn.Module, inputs: Any) -> None:
        self._again(module)
        super()._pre_fw_hook(module, inputs)  # type: ignore[misc]

    def _post_fw_hook(self: Any, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if module in self.memory_tracking:  # not when a root's restart cleared it (a VAE's encoder)
            super()._post_fw_hook(module, inputs, outputs)  # type: ignore[misc]

    def _pre_bw_hook(self: Any, module: torch.nn.Module, args: Any) -> None:
        if module in self.memory_tracking:
            super()._pre_bw_hook(module, args)  # type: ignore[misc]

    def _post_bw_hook(self: Any, module: torch.nn.Module, args: Any) -> None:
        if module in self.memory_tracking:
            super()._post_bw_hook(module, args)  # type: ignore[misc]

    def _update_peak_stats(self: Any, peak_state: Any) -> None:
        # the global peak only (what this command reports): MemTracker's own also walks every
        # module's stats on every op, which at the real size costs minutes per forward
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap["Total"]:
                self._peak_mem[device] = snap["Total"]
                self._peak_mem_snap[device] = dict(snap)

    def _track(self: Any, reftype: Any, t: torch.Tensor) -> None:
        if not launch_memory.untracked(t):  # the launch's meta tensors while it shards: no memory
            super()._track(reftype, t)  # type: ignore[misc]


def _tracker(root: Any = None, optimizer: Any = None) -> Any:
    """``MemTracker`` with :class:`_Restart`'s hooks; with a sharded ``root`` module (and its
    ``optimizer``), the sharded launch's tracker (``FSDPMemTracker``)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if root is not None:
        return launch_memory.sharded_tracker(_Restart, root, optimizer)
    return type("Tracker", (_Restart, MemTracker), {})()


def _snapshot(tracker: Any, which: str = "peak") -> dict[str, dict[str, int]]:
    """{accelerator|host: {kind: bytes}} of the tracker's peak since its last reset (or now)."""
    import torch

    out: dict[str, dict[str, int]] = {}
    for device, parts in tracker.get_tracker_snapshot(which).items():
        role = "accelerator" if torch.device(device).type == "cpu" else "host"  # fgrpo.models.fake_size
        into = out.setdefault(role, {})
        for kind, value in parts.items():
            name = str(getattr(kind, "value", kind))  # MemTracker's kinds: "Parameter", "Gradient", ...
            name = launch_memory.kind_name(name)
            into[name] = into.get(name, 0) + int(value)
    return out


def _weights_at_load(parts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """At load every tensor made is a weight: MemTracker files what is made outside a module's
    forward as activations, and the flat stand-ins as other."""
    for kinds in parts.values():
        for kind in ("Activation", "Other"):
            kinds["Parameter"] = kinds.get("Parameter", 0) + kinds.pop(kind, 0)
    return parts


def _prompts(policy: Any, count: int) -> list[str]:
    """``count`` prompts, with the fewest source images the backbone takes (none for text-to-image)."""
    from fgrpo.models.fake_size import prompts

    return prompts(policy, count)


def _reset_peak(tracker: Any) -> None:
    # MemTracker keeps one peak over its whole context; each phase reports its own from here on
    tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
    tracker._peak_mem = {d: s.get("Total", 0) for d, s in tracker._peak_mem_snap.items()}


def _trajectory_bytes(traj: Any) -> int:
    import torch

    seen: dict[int, int] = {}
    for value in vars(traj).values() if hasattr(traj, "__dict__") else _attrs_values(traj):
        tensors = list(value.values()) if isinstance(value, Mapping) else [value]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _attrs_values(obj: Any) -> list[Any]:
    import attrs

    return [getattr(obj, f.name) for f in attrs.fields(type(obj))]


def measure(data: Mapping[str, Any], gpus: int, launch: str) -> dict[str, Any]:
    """Per phase (load, rollout, update, gather): {accelerator|host: {kind: peak bytes}} and the parts
    that are formula; ``data``: the recipe read by :func:`fgrpo.models.memory_formula.read_recipe`."""
    import torch

    from fgrpo.core import registry
    from fgrpo.models import fake_size  # the diffusers backbones' harness (fgrpo-models)

    model, train, sampler_spec = dict(data["model"]), dict(data["train"]), dict(data["sampler"])
    name = model.pop("name")
    policy, _ = fake_size.real_size_policy(name, model, launch)
    fake_size.record_text_shapes(policy)
    sampler = registry.create(
        "sampler", sampler_spec["name"], **{k: v for k, v in sampler_spec.items() if k != "name"}
    )
    prompts_here = max(int(train.get("prompts_per_iteration", 8)) // gpus, 1)
    chunk = int(train.get("rollout_prompts") or 0) or prompts_here
    chunks = -(-prompts_here // chunk)  # the rollout runs in chunks; their trajectories are all kept
    group = int(train.get("group_size", 8))
    micro = int(train.get("micro_batch_size") or 1)
    formula = ["VAE decode", "reward models", "text encoders (published parameter count, outputs stood in)"]
    if sharding_note(launch, gpus):
        formula.append(sharding_note(launch, gpus))
    # "auto": the launcher's, which fsdp-lora.yaml / fsdp-full.yaml set to bf16
    precision = str(train.get("mixed_precision") or "auto").replace("auto", "bf16")
    phases: dict[str, Any] = {}
    metas = fake_size.meta_transformers(policy, launch)
    sharded = launch_memory.runs_sharding(launch)  # the launch's own sharding, on a fake process group
    with launch_memory.sharded_run(launch, gpus) as mesh, fake_size.fake_runtime():
        tracker = _tracker()
        with tracker:
            built = fake_size.materialise(policy, name, launch, metas)
            trainable = [p for p in policy.trainable_parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=False)
            if sharded:
                trainable = launch_memory.shard(mesh, policy, optimizer, precision)
            modules = [m for m in (getattr(policy.pipeline, a, None) for a in ("transformer", "transformer_2")) if m]
            tracker.track_external(*modules)  # what they hold now, small tensors (real numbers) included
            tracker._update_peak_stats(None)
        phases["load"] = _weights_at_load(_snapshot(tracker))
        after_load = _weights_at_load(_snapshot(tracker, "current"))
        if sharded:
            root = policy.trainable_module
            tracker = _tracker(root, optimizer)
            inside = {id(m) for m in root.modules()}
            tracker.track_external(*(m for m in modules if id(m) not in inside), *built["flat"].values())
        else:
            tracker = _tracker()
            tracker.track_external(*modules, optimizer, *built["flat"].values())
        with tracker:
            with torch.no_grad():
                traj = sampler.rollout(policy, _prompts(policy, min(chunk, prompts_here)), group)
            phases["rollout"] = _snapshot(tracker)
            kept = _trajectory_bytes(traj)
            # one chunk ran; the others' trajectories, of the same size, are held as well
            more = (chunks - 1) * kept
            phases["rollout"]["storage"] = {"Rollout": chunks * kept}
            _reset_peak(tracker)
            if traj.latents.shape[1]:  # a step of the rollout
                x, sigma = traj.latents[:micro, 0], traj.sigmas[traj.step_index[:micro, 0]]
            else:  # forward-process objectives (NFT, AWM) train on the final samples, noised at a drawn time
                x, sigma = traj.final[:micro], traj.sigmas[len(traj.sigmas) // 2]
            cond = {k: v[:micro] for k, v in traj.cond.items() if isinstance(v, torch.Tensor)}
            loss = policy.velocity(x, sigma, cond).float().square().mean()
            loss.backward()
            optimizer.step()
            phases["update"] = _snapshot(tracker)
            after_step = _snapshot(tracker, "current")
            _reset_peak(tracker)
            policy.trainable_state_dict()
            phases["gather"] = _snapshot(tracker)
    # the EMA's float32 copy of what trains (fgrpo.core.ema), held from the start (not run here)
    ema = 4 * sum(p.numel() for p in trainable) if float(train.get("ema_decay") or 0) > 0 else 0
    ema = ema // gpus if launch != "ddp" else ema
    if ema:
        formula.append("EMA (float32 copy of what trains)")
    for phase in ("load", "rollout", "update", "gather"):
        acc = phases[phase].setdefault("accelerator", {})
        extra = {"EMA": ema, "Rollout (other chunks)": more if phase != "load" else 0}
        for kind, value in extra.items():
            if value:
                acc[kind] = value
                acc["Total"] = acc.get("Total", 0) + value
    if chunks > 1:
        formula.append(f"rollout storage of {chunks - 1} more chunk(s) (the measured chunk's size)")
    if launch in ("zero2", "zero3"):
        trained = [m for _, m in policy.trained_transformers()]
        weights = sum(p.numel() * p.element_size() for m in trained for p in m.parameters())
        block = max((_bytes(b) for m in trained for b in _blocks(m)), default=0)
        for phase in phases.values():
            share(phase.get("accelerator", {}), gpus, launch, weights, block)
    return {
        "phases": phases,
        "after_load": after_load,
        "after_step": after_step,
        "formula": formula,
        "sources": built["sources"],
        "launch": launch,
        "gpus": gpus,
    }


def _blocks(module: Any) -> list[Any]:
    names = set(getattr(module, "_no_split_modules", None) or [])
    return [m for m in module.modules() if type(m).__name__ in names]


def _bytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def total(parts: Mapping[str, Mapping[str, int]], role: str) -> int:
    return int(parts.get(role, {}).get("Total", 0))


def render(result: Mapping[str, Any], estimate: Mapping[str, Any] | None) -> list[str]:
    lines = [
        f"per process, {result['gpus']} processes, launch {result['launch']} (GiB; measured on fake tensors)",
        "| phase | accelerator | host | accelerator by kind |",
        "|---|---|---|---|",
    ]
    for phase, parts in result["phases"].items():
        acc = parts.get("accelerator", {})
        kinds = ", ".join(f"{k} {v / GIB:.2f}" for k, v in acc.items() if k != "Total" and v >= GIB // 100)
        lines.append(
            f"| {phase} | {total(parts, 'accelerator') / GIB:.2f} | {total(parts, 'host') / GIB:.2f} | {kinds} |"
        )
    storage = result["phases"].get("rollout", {}).get("storage", {}).get("Rollout", 0)
    lines.append(f"rollout storage (the trajectory, kept to the update): {storage / GIB:.2f} GiB")
    lines.append("formula (not measured): " + "; ".join(result["formula"]))
    lines.append("transformer config: " + "; ".join(f"{k}: {v}" for k, v in result["sources"].items()))
    if estimate is not None:
        lines.append(f"formula estimate, whole run: {estimate['total'] / GIB:.2f} GiB per GPU ({estimate['kind']})")
    return lines


def add_parser(sub: Any) -> None:
    p = sub.add_parser("memory", help="a recipe's peak memory per process at the real size, measured on fake tensors")
    p.add_argument("recipe", help="a recipe file")
    p.add_argument("--gpus", type=int, default=8, help="processes (GPUs) the run is launched on")
    p.add_argument(
        "--launch",
        choices=MEASURED,
        default=None,
        help="how the run is launched; default: the one the recipe's header names",
    )
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per accelerator; the check allows 95 %%")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print the measurement as JSON (bytes)")
    p.set_defaults(handler=cmd_memory)


def cmd_memory(args: argparse.Namespace) -> int:
    from fgrpo.core.consoles import err
    from fgrpo.models import memory_formula

    if args.gpus < 1:
        err.print(f"--gpus: got {args.gpus}; must be >= 1")
        return 2
    data, problem = memory_formula.read_recipe(args.recipe, args.overrides)
    if problem:
        err.print(problem)
        return 2
    from pathlib import Path

    args.launch = args.launch or declared_launch(Path(args.recipe).read_text(encoding="utf-8")) or "ddp"
    formula = memory_formula.estimate(data, args.gpus)["kinds"][FORMULA_KIND[args.launch]]
    try:
        result = measure(data, args.gpus, args.launch)
    except FAKE_LIMITS as exc:  # a data-dependent value or an op fake tensors lack: the formula alone
        return _formula_only(args, formula, exc)
    result["estimate"] = {"total": formula["total"], "kind": FORMULA_KIND[args.launch], "parts": formula}
    peak = max(total(p, "accelerator") for p in result["phases"].values())
    limit = 0.95 * args.gpu_memory * GIB
    result["fits"] = peak <= limit
    if args.json:
        print(json.dumps(result, default=float))
    else:
        print("\n".join(render(result, result["estimate"])))
        verdict = "fits" if result["fits"] else "does NOT fit"
        print(
            f"peak {peak / GIB:.2f} GiB per accelerator: {verdict} in {limit / GIB:.1f} GiB "
            f"(95 % of {args.gpu_memory})"
        )
    return 0 if result["fits"] else 1


def _fake_limits() -> tuple[type[BaseException], ...]:
    from torch._subclasses import fake_tensor

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
    return tuple(getattr(fake_tensor, n) for n in names if hasattr(fake_tensor, n))


#: what fake tensors cannot pass (a value read off the data, a shape that depends on it, an op without a fake kernel)
FAKE_LIMITS = _fake_limits()


SKIPPED = ("/torch/", "fake_size.py")  #: frames of the machinery, not of the code that read a value


def _where(exc: BaseException) -> str:
    """The last frame of the traceback outside torch: the model code that needed a real value."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not any(s in f.filename for s in SKIPPED)]
    if not frames:
        return "torch"
    last = frames[-1]
    return f"{last.filename.split('site-packages/')[-1]}:{last.lineno} ({last.name})"


def _formula_only(args: argparse.Namespace, formula: Mapping[str, Any], exc: BaseException) -> int:
    """The run cannot pass on fake tensors: say where, and judge the fit by the formula, marked as such."""
    where = f"{type(exc).__name__} at {_where(exc)}"
    peak = float(formula["total"])
    limit = 0.95 * args.gpu_memory * GIB
    fits = peak <= limit
    if args.json:
        print(
            json.dumps(
                {"measured": None, "fake_tensors_stopped": where, "formula": formula, "fits": fits}, default=float
            )
        )
    else:
        print(f"measured: nothing (fake tensors cannot pass {where}); every phase falls back to the formula")
        print(
            f"formula (not measured) {peak / GIB:.2f} GiB per accelerator ({FORMULA_KIND[args.launch]}): "
            f"{'fits' if fits else 'does NOT fit'} in {limit / GIB:.1f} GiB (95 % of {args.gpu_memory})"
        )
    return 0 if fits else 1
