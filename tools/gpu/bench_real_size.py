#!/usr/bin/env python
"""fgrpo at real model size: every shipped real recipe's phases timed, its allocator peak beside ``fgrpo memory``'s.

    python tools/gpu/bench_real_size.py --all                 # every real backbone / checkpoint, one recipe each
    python tools/gpu/bench_real_size.py --recipe recipes/flux2-t2i.yaml --memory   # one, fgrpo memory run here too
    python tools/gpu/bench_real_size.py --all --memory-dir mem/   # beside mem/<recipe>.json (fgrpo memory --json)
    python tools/gpu/bench_real_size.py --all --shrink         # the same code path, tiny, on a CPU (the test)
    python tools/gpu/bench_real_size.py --backbone sd3         # per-NFE costs and iterations against their floor

Recipe mode (``--all``, ``--recipe``; :mod:`fgrpo.models.real_size`): the recipe's policy around its
backbone's tiny pipeline, its trained transformer(s) (both Wan 2.2 experts) built with random
weights from the config ``fgrpo memory`` takes (:func:`fgrpo.models.fake_size.transformer_config`:
the published ``config.json``, else the diffusers defaults of the published size), the text
encoders' outputs stood in at their real shapes and their weights (and the VAE's) as flat tensors
of the published counts where the load plan puts them on the accelerator. It then runs what
``fgrpo memory`` runs on fake tensors: one process's rollout (``--gpus`` processes share the
recipe's prompts) with the recipe's sampler, one update micro-batch (forward, backward, AdamW's
step) and the checkpoint gather; per phase it prints seconds and ``torch.cuda.max_memory_allocated``
beside ``fgrpo memory --launch ddp --gpus N``'s accelerator figure (one GPU holds the whole model:
the ddp figure is the comparable one). ``--all`` takes the first shipped recipe of each
(backbone, checkpoint): SD3.5-M, FLUX.1 [dev], FLUX.1 Kontext, FLUX.2 [dev] and [klein],
Qwen-Image, Qwen-Image-Edit, Z-Image and Z-Image-Turbo, Wan 2.1 1.3B, Wan 2.2 T2V and I2V A14B (two
experts), HunyuanVideo 1.5 (whose forward fake tensors cannot pass: ``fgrpo memory`` gives its
formula). ``--shrink`` takes the tiny pipeline's sizes for every integer of the transformer config
and runs one prompt of two samples at 64 px: the default suite runs it on the CPU.

Backbone mode (``--backbone``): every backbone whose policy class declares a published transformer
config (``published`` in ``fgrpo.models.sizes``) is built from that config with random weights, in
bf16 on the GPU, inside the backbone's tiny pipeline (``fgrpo.models.testing.pipelines``), whose
text encoders and VAE stand in. The transformer takes its conditioning widths (the text
projection's input, ``joint_attention_dim``/``text_dim``, the latent channels) from the tiny one.
For each setting (CFG 4.5 and no CFG; gradient checkpointing on and off) the script measures the
cost of one NFE forward at the rollout's batch, one NFE forward at the update's batch without
gradient, one NFE forward+backward at the update's batch, then full fgrpo iterations (group
``--group``, ``--steps`` SDE steps, LoRA r32, KL 0.04) with a cheap reward on the decoded images,
and prints each iteration's time over its floor (the target is <= 1.25), its phases and
``torch.cuda.max_memory_allocated`` beside ``--expected-json``'s figure.

On the GPU machine (torch, transformers, peft, accelerate there; diffusers and fgrpo not): carry
wheels (``.whl``: diffusers and its missing requirements), install them and fgrpo's packages
without dependencies into /tmp/site, then run this script (docs/backbones.md has the commands).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1024**3


#: conditioning widths of a transformer that must match its text encoders' and VAE's outputs: a
#: real-size transformer takes them from the backbone's tiny pipeline (whose encoders stand in)
STAND_IN_KEYS = (
    "joint_attention_dim",
    "pooled_projection_dim",
    "text_dim",
    "image_dim",
    "in_channels",
    "out_channels",
)
#: the size of a transformer: ``--shrink`` takes them from the backbone's tiny pipeline
SIZE_KEYS = (
    "num_layers",
    "num_single_layers",
    "num_refiner_layers",
    "num_attention_heads",
    "attention_head_dim",
    "axes_dims_rope",
    "rope_axes_dim",
    "ffn_dim",
    "caption_projection_dim",
    "dual_attention_layers",
    "pos_embed_max_size",
    "rope_max_seq_len",
    "sample_size",
)


def published_backbones() -> dict[str, tuple[str, Any]]:
    """Every installed backbone whose policy class declares a published transformer config:
    model name -> (checkpoint, its ``Published``), the first such checkpoint of each."""
    from fgrpo.core import registry

    found = {}
    for name in registry.names("model"):
        try:
            cls = registry.load("model", name)
        except registry.ComponentError:
            continue
        for checkpoint, published in (getattr(cls, "published", None) or {}).items():
            if published.config:
                found[name] = (checkpoint, published)
                break
    return dict(sorted(found.items()))


def tiny_builder(backbone: str) -> Any:
    """The backbone's tiny pipeline builder (``fgrpo.models.testing.pipelines``), named after it."""
    from fgrpo.models.testing import pipelines

    kind, options = BUILDERS.get(backbone, (backbone.replace("-", "_"), {}))
    builders = pipelines.builders()
    if kind not in builders:
        raise SystemExit(
            f"bench_real_size: no tiny pipeline builder for {backbone!r} (builders: {', '.join(builders)})"
        )
    return lambda: builders[kind](**options)


#: backbones whose tiny builder is not named after them, or takes options: model -> (kind, options)
BUILDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sd3": ("sd3", {"sd35": True}),  # SD3.5's dual-attention blocks, as the published SD3.5-Medium config
    "wan-i2v": ("wan22_i2v", {}),
    "qwen-image-edit-plus": ("qwen_image_edit", {"plus": True}),
}


def real_config(published: Any, tiny: Any, shrink: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the transformer config to build, the keys taken from the tiny pipeline's transformer): the
    published config with the stand-in encoders' widths, and with ``shrink`` the tiny sizes."""
    import inspect

    accepted = set(inspect.signature(type(tiny).__init__).parameters) - {"self"}
    tiny_config = dict(tiny.config)
    config = {k: v for k, v in dict(published.config).items() if k in accepted}
    taken = {
        k: tiny_config[k] for k in STAND_IN_KEYS if k in config and k in tiny_config and config[k] != tiny_config[k]
    }
    if shrink:
        taken.update({k: tiny_config[k] for k in SIZE_KEYS if k in tiny_config and k in accepted})
    return {**config, **taken}, taken


def build_pipeline(backbone: str, shrink: bool, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """The backbone's tiny pipeline (its text encoders and VAE stand in) with a transformer of the
    published architecture (random weights, built on the GPU when there is one), and the config
    keys taken from the tiny one."""
    import torch

    _, published = published_backbones()[backbone]
    pipe = tiny_builder(backbone)()
    config, taken = real_config(published, pipe.transformer, shrink)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        transformer = type(pipe.transformer)(**config)
    transformer.to(dtype)
    pipe.register_modules(transformer=transformer)
    if getattr(pipe, "transformer_2", None) is not None:  # a second expert (Wan 2.2): the same architecture
        with torch.device(transformer.device):
            pipe.register_modules(transformer_2=type(transformer)(**config).to(dtype))
    return pipe, taken


def model_keys(backbone: str, dtype: Any, args: Any, guidance: float, checkpointing: bool) -> dict[str, Any]:
    """The backbone's recipe keys for one setting (the guidance key it has; frames for video)."""
    import attrs

    from fgrpo.core import registry

    fields = {f.name for f in attrs.fields(registry.load("model", backbone))}
    keys: dict[str, Any] = dict(
        dtype=str(dtype).replace("torch.", ""),
        resolution=args.resolution,
        gradient_checkpointing=checkpointing,
        lora={"rank": 32, "alpha": 64, "init": "gaussian"},
    )
    keys["true_cfg_scale" if "true_cfg_scale" in fields else "guidance_scale"] = guidance  # FLUX.1-dev: true CFG
    if args.frames is not None and "num_frames" in fields:
        keys["num_frames"] = args.frames
    if "text_encoder_out_layers" in fields:  # FLUX.2: the stand-in text encoder has 2 layers, not 30
        keys["text_encoder_out_layers"] = [1, 2, 2]
    return keys


def expected_peak(path: str | None) -> float | None:
    """The expected peak in bytes from ``--expected-json``: a number, ``{"total": bytes}``,
    ``{"total_gib": GiB}`` or ``tools/memory.py --json``'s ``{"kinds": {"ddp": {"total": ...}}}``."""
    if path is None:
        return None
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "kinds" in data:
        data = data["kinds"]["ddp"]
    if isinstance(data, dict):
        return float(data["total"]) if "total" in data else float(data["total_gib"]) * 1024**3
    return float(data)


def per_nfe_costs(policy: Any, rollout_rows: int, train_rows: int, repeats: int) -> dict[str, float]:
    """Seconds per NFE: forward at the rollout's batch, no-grad forward and forward+backward at
    the update's batch (each the median of ``repeats`` after a warm-up)."""
    import torch

    from fgrpo.core import tensors, timing

    cond1 = policy.encode(["a photo of a cat holding a sign that says fgrpo"])
    epc = policy.evaluations_per_call

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            timing.synchronize(policy.device)
            t0 = time.perf_counter()
            fn()
            timing.synchronize(policy.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def forward(rows: int, grad: bool) -> float:
        x = torch.randn(rows, *policy.latent_shape, device=policy.device)
        sigma = torch.full((rows,), 0.6, device=policy.device)
        cond = tensors.repeat_interleave(cond1, rows)

        def once():
            if grad:
                policy.velocity(x, sigma, cond).float().square().mean().backward()
            else:
                with torch.no_grad():
                    policy.velocity(x, sigma, cond)

        return timed(once) / (rows * epc)

    return {
        "rollout_fwd": forward(rollout_rows, False),
        "nograd_fwd": forward(train_rows, False),
        "fwd_bwd": forward(train_rows, True),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every shipped real recipe's backbone (one per checkpoint)")
    parser.add_argument("--recipe", action="append", default=[], help="a recipe file (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the recipes --all runs, one a line, and stop")
    parser.add_argument("--gpus", type=int, default=8, help="processes the recipe's prompts are shared by")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--memory", action="store_true", help="run fgrpo memory (fake tensors, CPU) here too")
    parser.add_argument("--memory-dir", default=None, help="a folder of fgrpo memory --json outputs, <recipe>.json")
    parser.add_argument("--backbone", default=None, help="backbone mode: a model name with a published config")
    parser.add_argument("--flux", action="store_true", help="the same as --backbone flux")
    parser.add_argument("--shrink", "--small", action="store_true", help="the tiny sizes (a CPU check of the script)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--frames", type=int, default=None, help="frames of a video backbone (null: its default)")
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=1, help="prompt groups per iteration")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=8, help="(sample, step) pairs per update forward")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per setting (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per per-NFE cost")
    parser.add_argument("--settings", default="cfg,nocfg,cfg+ckpt,nocfg+ckpt")
    parser.add_argument(
        "--expected-json",
        default=None,
        help="backbone mode: the expected peak (e.g. fgrpo memory's JSON) to print beside the measured",
    )
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(str(p.relative_to(ROOT)) for p in all_recipes()))
        return 0
    if args.all or args.recipe:
        return recipe_mode(args)
    known = published_backbones()
    backbone = "flux" if args.flux else args.backbone or "sd3"
    if backbone not in known:
        print(f"bench_real_size: --backbone: got {backbone!r}; allowed: {', '.join(known)}", file=sys.stderr)
        return 2
    bench(backbone, args)
    return 0


# --- recipe mode: a shipped recipe's phases at real size (fgrpo.models.real_size) -----------------


ROOT = Path(__file__).resolve().parents[2]


def all_recipes() -> list[Path]:
    """The first shipped recipe of each real (backbone, checkpoint)."""
    from fgrpo.models import real_size

    return real_size.one_per_checkpoint(real_size.real_recipes(ROOT / "recipes"))


def recipe_mode(args: Any) -> int:
    paths = [Path(p) for p in args.recipe] + (all_recipes() if args.all else [])
    for path in paths:
        if not path.is_file():
            print(f"bench_real_size: --recipe: got {str(path)!r}; allowed: a recipe file", file=sys.stderr)
            return 2
    for path in paths:
        code = bench_recipe(path, args)
        if code:
            return code
    return 0


def bench_recipe(path: Any, args: Any) -> int:
    """One recipe: its phases at real size (``--shrink``: tiny), each beside fgrpo memory's figure."""
    import torch

    from fgrpo.models import memory_formula, real_size

    data, problem = memory_formula.read_recipe(str(path), args.overrides)
    if not problem and args.shrink:
        data, problem = memory_formula.read_recipe(str(path), real_size.shrunk_overrides(data) + args.overrides)
    if problem:
        print(f"bench_real_size: {path}: {problem}", file=sys.stderr)
        return 2
    expected = memory_figure(path, data, args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = data["model"]
    try:
        built, phases = real_size.run(data, args.gpus, device, args.shrink)
    except torch.cuda.OutOfMemoryError as exc:  # the next recipe still runs: one GPU holds the whole model
        said = str(exc).splitlines()[0][:160]
    else:
        said = ""
    if said:
        _free()
        figures = [v[0] / GIB for v in expected.values() if isinstance(v, tuple)]
        want = f"fgrpo memory's peak {max(figures):.2f} GiB" if figures else "fgrpo memory -"
        print(f"{model['name']}: {path.name}: out of memory on one GPU ({want}): {said}")
        return 0
    print(
        f"{model['name']}: {path.name}, {model['path']}-size transformer{' (shrunk)' if args.shrink else ''} "
        f"{_count(built.parameters)} parameters ({'; '.join(built.sources.values())}), {model.get('dtype')}, "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, 1 of {args.gpus} processes"
    )
    for name in real_size.PHASES:
        print(f"  {name:>7}: {phases[name].seconds:8.2f} s; {phase_peak(phases[name].peak, expected.get(name))}")
    if "note" in expected:
        print(f"  fgrpo memory: {expected['note']}")
    del built, phases
    _free()
    return 0


def _free() -> None:
    """Let the next recipe start from an empty allocator."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def memory_figure(path: Any, data: dict[str, Any], args: Any) -> dict[str, Any]:
    """fgrpo memory's accelerator figure per phase (ddp, ``--gpus``): read from ``--memory-dir``,
    measured here with ``--memory``, or a note saying why there is none."""
    import json

    if args.memory_dir is not None:
        file = Path(args.memory_dir) / f"{path.stem}.json"
        if not file.is_file():
            return {"note": f"no {file}"}
        return memory_phases(json.loads(file.read_text()))
    if not args.memory:
        return {"note": "not run (--memory, or --memory-dir with fgrpo memory --json outputs)"}
    if args.shrink:
        return {"note": "real size only (without --shrink)"}
    from fgrpo.models import memory

    try:
        return memory_phases(json.loads(json.dumps(memory.measure(data, args.gpus, "ddp"), default=float)))
    except memory.FAKE_LIMITS:  # HunyuanVideo 1.5: the formula alone
        from fgrpo.models import memory_formula

        return memory_phases({"measured": None, "formula": memory_formula.estimate(data, args.gpus)["kinds"]["ddp"]})


def memory_phases(result: dict[str, Any]) -> dict[str, Any]:
    """{phase: (bytes, how)} from ``fgrpo memory --json``'s output (measured, or the formula alone)."""
    if result.get("measured", True) is None:
        total = float(result["formula"]["total"])
        return {phase: (total, "formula") for phase in ("load", "rollout", "update", "gather")}
    return {
        phase: (float(parts.get("accelerator", {}).get("Total", 0)), "measured")
        for phase, parts in result["phases"].items()
    }


def phase_peak(peak: int | None, expected: tuple[float, str] | None) -> str:
    """``max_memory_allocated`` over a phase beside fgrpo memory's figure for it."""
    want = f"fgrpo memory {expected[0] / GIB:.2f} GiB ({expected[1]})" if expected else "fgrpo memory -"
    if peak is None:
        return f"max_memory_allocated - (no CUDA); {want}"
    ratio = f", fgrpo memory / measured {expected[0] / peak:.2f}" if expected and peak else ""
    return f"max_memory_allocated {peak / GIB:.2f} GiB; {want}{ratio}"


def needs_images(backbone: str) -> bool:
    from fgrpo.core import registry

    return registry.load("model", backbone).source_image_count[0] > 0


def bench(backbone: str, args: Any) -> None:
    """Every setting of ``args.settings`` on one backbone: per-NFE costs, iterations, the peak."""
    import torch
    from rich.console import Console

    from fgrpo.core import recipe as recipe_mod
    from fgrpo.core.building import build_run
    from fgrpo.core.trainer import iteration

    checkpoint = published_backbones()[backbone][0]
    if needs_images(backbone):  # the bench's prompts are text: its transformer is timed as its text backbone's
        print(f"{backbone}: skipped (its prompts carry source images); its transformer is {checkpoint}'s")
        return
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    print(
        f"{backbone}: {checkpoint}-size transformer{' (shrunk)' if args.shrink else ''}, "
        f"{args.resolution} px, group {args.group} x {args.prompts} prompt(s), {args.steps} steps, LoRA r32, "
        f"{torch.cuda.get_device_name() if cuda else 'CPU'}, {str(dtype).replace('torch.', '')}"
    )
    pipe, taken = build_pipeline(backbone, args.shrink, dtype)
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"transformer: {n_params / 1e9:.2f}B parameters; from the tiny pipeline: {taken}")
    expected = expected_peak(args.expected_json)

    for setting in [s for s in args.settings.split(",") if s]:
        guidance = 1.0 if "nocfg" in setting else 4.5
        checkpointing = "ckpt" in setting
        policy = registry_policy(backbone, pipe, model_keys(backbone, dtype, args, guidance, checkpointing))
        recipe = recipe_mod.from_text(
            f"""
            seed: 0
            model: {{name: {backbone}, path: unused}}
            sampler: {{name: full, steps: {args.steps}, timestep_fraction: 0.99, kernel: {{name: sde, eta: 0.7}}}}
            reward: {{name: jpeg-compressibility}}
            objective: {{name: grpo, clip_range: 1.0e-4, kl_beta: 0.04}}
            prompts: {{name: list, train: ["a cat holding a sign", "a red bicycle", "a bowl of ramen",
                                          "a lighthouse at night"]}}
            train: {{iterations: 100, group_size: {args.group}, prompts_per_iteration: {args.prompts}, lr: 3.0e-4,
                     micro_batch_size: {args.micro_batch}, drop_zero_advantage: false}}
            log: {{quiet: true, trackers: [], sample_grid: false, plots: false}}
            """,
            source="bench_real_size",
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        run = build_run(recipe, out_dir=None, console=Console(quiet=True), quiet=True, policy=policy)
        costs = per_nfe_costs(policy, args.group * args.prompts, args.micro_batch, args.repeats)
        rows = []
        for it in range(args.iterations + 1):
            m = iteration(run, it)
            if it:
                rows.append(m)
        print(f"{setting:>11}: {report(rows, costs)}; {peak_line(cuda, expected)}")
        if checkpointing:
            policy.transformer.disable_gradient_checkpointing()
        del run, policy
        _remove_lora(pipe.transformer)
        if cuda:
            torch.cuda.empty_cache()


def registry_policy(backbone: str, pipe: Any, keys: dict[str, Any]) -> Any:
    from fgrpo.core import registry

    return registry.load("model", backbone).from_pipeline(pipe, **keys)


def report(rows: list[dict[str, Any]], costs: dict[str, float]) -> str:
    """One setting's line: per-NFE costs, NFE, the iteration against its floor, and its phases."""
    it_s = statistics.median(m["time_iteration_s"] for m in rows)
    m = rows[-1]
    ref = m.get("nfe_reference", 0)
    floor = (
        m["nfe_rollout"] * costs["rollout_fwd"] + (m["nfe_train"] - ref) * costs["fwd_bwd"] + ref * costs["nograd_fwd"]
    )
    phases = ", ".join(
        f"{name.removeprefix('time_').removesuffix('_s')} {statistics.median(r[name] for r in rows):.2f}"
        for name in (
            "time_rollout_s",
            "time_train_s",
            "time_model_s",
            "time_reward_s",
            "time_decode_s",
            "time_overhead_s",
        )
        if name in m
    )
    return (
        f"forward {costs['rollout_fwd'] * 1e3:.2f} ms/NFE (rollout batch), {costs['nograd_fwd'] * 1e3:.2f} (no grad, "
        f"update batch), forward+backward {costs['fwd_bwd'] * 1e3:.2f} ms/NFE; NFE rollout {m['nfe_rollout']}, train "
        f"{m['nfe_train'] - ref} + reference {ref}; iteration {it_s:.2f} s, floor {floor:.2f} s, ratio "
        f"{it_s / floor:.2f} (phases, s: {phases})"
    )


def peak_line(cuda: bool, expected: float | None) -> str:
    """``torch.cuda.max_memory_allocated`` since the setting began, beside the expected figure."""
    import torch

    want = f"expected {expected / GIB:.2f} GiB" if expected is not None else "no --expected-json"
    if not cuda:
        return f"peak not measured (no CUDA); {want}"
    peak = torch.cuda.max_memory_allocated()
    ratio = f", expected / measured {expected / peak:.2f}" if expected is not None else ""
    return f"max_memory_allocated {peak / GIB:.2f} GiB; {want}{ratio}"


def _remove_lora(transformer: Any) -> None:
    """Take the adapter out so the next setting starts from the bare transformer."""
    try:
        transformer.delete_adapters("default")
    except Exception:  # older diffusers/peft: unload through peft
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in transformer.modules():
            if isinstance(module, BaseTunerLayer):
                module.delete_adapter("default")


if __name__ == "__main__":
    sys.exit(main())
