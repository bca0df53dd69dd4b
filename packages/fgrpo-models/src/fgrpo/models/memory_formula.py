#!/usr/bin/env python
"""Estimated peak memory per GPU of a recipe, for each launch kind, as a table.

    python tools/memory.py recipes/wan22-t2v-pickscore.yaml --gpus 8
    python tools/memory.py recipes/flux2-t2i.yaml --gpus 8 --set train.micro_batch_size=2

What is counted (GiB per GPU): the frozen weights (transformer(s), text encoders unless
``text_encoder_device: cpu``, VAE) in the recipe's dtypes; what trains (LoRA or the whole
transformer) in float32 with its gradients and AdamW's two moments (and a float32 EMA copy
when ``train.ema_decay`` > 0); the activations one update forward/backward keeps
(``micro_batch_size`` (sample, step) pairs, both guidance branches), with and without gradient
checkpointing; the rollout storage of this process's samples (latents before and after every
trained step, means, the final latent, the prompt embeddings). The launch kinds: data parallel
(everything whole on every GPU), FSDP2 (transformer weights, gradients and AdamW state split
over the GPUs, one block gathered at a time), DeepSpeed ZeRO-2 (gradients and AdamW state split,
weights whole), ZeRO-3 (weights split too, one block gathered at a time), ZeRO-2 with the
optimizer state offloaded to the CPU, and ZeRO-3 with the optimizer state and the weight
partitions (and so the EMA, kept beside them) offloaded to the CPU.

Sizes come from the pipeline's own configs: a local folder (``model.path``) or a hub id in the
local hub cache is built on the meta device (no weights read, parameters counted exactly, LoRA
sizes from the adapted layers' shapes); a hub id that is not cached falls back to the published
sizes its backbone declares (``published`` on the policy class, :mod:`fgrpo.models.sizes`;
approximate). Activations use the usual transformer estimate
(Korthikanti et al. 2022, flash attention: 34 bytes x tokens x hidden per layer in 16-bit, 2 x
tokens x hidden per layer boundary with checkpointing). These are estimates: the GPU script
``tools/gpu/`` compares them with ``torch.cuda.max_memory_allocated`` where a GPU is available.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fgrpo.core.launch.memory import FORMULA_LAUNCHES as LAUNCHES
from fgrpo.core.launch.memory import FORMULA_NOTES as LAUNCH_NOTES
from fgrpo.core.launch.memory import SPLIT_WEIGHTS

GIB = 1024**3
BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


# --- sizes from configs -------------------------------------------------------------------------


def _folder(path: str) -> Path | None:
    """The pipeline folder: a local one, or the hub cache's snapshot of a hub id (configs only)."""
    if Path(path).is_dir():
        return Path(path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True, allow_patterns=["*.json"]))
    except Exception:  # not cached (or no hub client): the published sizes
        return None


def _meta_module(folder: Path, name: str, spec: list[str]) -> Any:
    """The pipeline component ``name`` built from its config on the meta device (no weights)."""
    import importlib

    from accelerate import init_empty_weights

    library, class_name = spec
    cls = getattr(importlib.import_module(library), class_name)
    with init_empty_weights():
        if library == "diffusers":
            return cls.from_config(cls.load_config(folder / name))
        from transformers import AutoConfig

        return cls._from_config(AutoConfig.from_pretrained(folder / name))


def param_count(module: Any) -> int:
    """Parameters of ``module`` as the loaded model has them: a weight transformers ties to another
    (``_tied_weights_keys``: an encoder's token embedding, an output head when the config ties it)
    counts once, which a module built on the meta device does not know yet."""
    params = dict(module.named_parameters())
    total = sum(p.numel() for p in params.values())
    config: Any = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for tied, target in dict(getattr(module, "_tied_weights_keys", None) or {}).items():
        head = "lm_head" in tied
        if (
            tied in params
            and target in params
            and params[tied] is not params[target]
            and (not head or getattr(text, "tie_word_embeddings", False))
        ):
            total -= params[tied].numel()
    return total


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_params(module: Any, rank: int, targets: list[str]) -> int:
    """Parameters of a rank-``rank`` LoRA on the Linear layers ``targets`` names (peft's suffix rule)."""
    import torch

    return sum(
        rank * (m.in_features + m.out_features)
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.Linear) and _matches(n, targets)
    )


def sizes(model: Mapping[str, Any]) -> dict[str, Any]:
    """{transformers: [params per network], text, vae, hidden, layers, block (largest block's params),
    lora (per trained network), exact} from the pipeline's configs, else the backbone's published sizes."""
    lora = model.get("lora")
    rank = int(lora["rank"]) if lora else 0
    targets = list((lora or {}).get("target_modules") or [])
    folder = _folder(str(model["path"]))
    if folder is not None and (folder / "model_index.json").is_file():
        index = json.loads((folder / "model_index.json").read_text())
        built = {
            n: _meta_module(folder, n, spec)
            for n, spec in index.items()
            if isinstance(spec, list)
            and len(spec) == 2
            and spec[0] in ("diffusers", "transformers")
            and (folder / n / "config.json").is_file()
        }
        experts = [built[n] for n in ("transformer", "transformer_2") if n in built]
        texts = [m for n, m in built.items() if n.startswith("text_encoder") or n == "image_encoder"]
        first = experts[0]
        blocks = [
            m for m in first.modules() if type(m).__name__ in set(getattr(first, "_no_split_modules", None) or [])
        ]
        config = first.config
        hidden = int(
            config.get("num_attention_heads", 1) * config.get("attention_head_dim", 0)
            or config.get("dim", 0)
            or config.get("inner_dim", 0)
        )
        trained = _trained_count(model, len(experts))
        return {
            "transformers": [param_count(m) for m in experts],
            "text": sum(param_count(m) for m in texts),
            "vae": param_count(built["vae"]) if "vae" in built else 0,
            "hidden": hidden,
            "layers": max(len(blocks), 1),
            "block": max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
            "lora": [lora_params(m, rank, targets) for m in experts[:trained]] if rank else [],
            "exact": True,
        }
    known = backbone(model).published.get(str(model["path"]))
    if known is None:
        raise SystemExit(
            f"model.path {model['path']!r}: no local folder or cached configs, and model {model['name']!r} "
            f"declares no published sizes for it (its policy class's `published`, fgrpo.models.sizes)"
        )
    count = known.experts
    per_block = known.transformer / known.layers
    # r x (in + out) per adapted linear: q, k, v, out of the image stream (8 r h), of the text stream
    # too when add_* are targeted, a feed-forward of width 4h when it is (10 r h)
    per_layer = (
        8
        + (8 if any("add_" in t for t in targets) else 0)
        + (10 if any(w in t for t in targets for w in ("ff", "mlp", "feed")) else 0)
    )
    lora_each = rank * known.hidden * per_layer * known.layers
    return {
        "transformers": [known.transformer] * count,
        "text": known.text,
        "vae": known.vae,
        "hidden": known.hidden,
        "layers": known.layers,
        "block": per_block,
        "lora": [lora_each] * _trained_count(model, count) if rank else [],
        "exact": False,
    }


def _trained_count(model: Mapping[str, Any], experts: int) -> int:
    chosen = model.get("train_experts")
    return len(chosen) if chosen else experts


# --- the estimate -------------------------------------------------------------------------------


def backbone(model: Mapping[str, Any]) -> Any:
    """The recipe's model class: it declares its geometry and published sizes (fgrpo.models.sizes)."""
    from fgrpo.core import registry

    return registry.load("model", model["name"])


def geometry(model: Mapping[str, Any]) -> Any:
    """The sample's token geometry: the published checkpoint's own where it has one, else the backbone's."""
    cls = backbone(model)
    known = cls.published.get(str(model.get("path", "")))
    return known.geometry if known is not None and known.geometry is not None else cls.geometry


def tokens(model: Mapping[str, Any]) -> tuple[int, int]:
    """(image/video tokens, text tokens) of one sample."""
    g = geometry(model)
    resolution = model.get("resolution") or 1024
    height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
    frames = 1 if g.temporal is None else (int(model.get("num_frames", 81)) - 1) // g.temporal + 1
    text = int(model.get("max_sequence_length") or 512) + g.extra_text_tokens
    return frames * (height // g.spatial) * (width // g.spatial), text


def estimate(data: Mapping[str, Any], gpus: int) -> dict[str, Any]:
    """Per launch kind: {part: bytes per GPU}; plus the sizes used."""
    model, train, sampler = data["model"], data["train"], data["sampler"]
    s = sizes(model)
    weight_bytes = BYTES.get(str(model.get("dtype", "float32")), 4)
    vae_bytes = BYTES.get(str(model.get("vae_dtype") or model.get("dtype", "float32")), 4)
    text_bytes = BYTES.get(str(model.get("text_encoder_dtype") or model.get("dtype", "float32")), 4)
    full = not model.get("lora")
    transformer = sum(s["transformers"]) * weight_bytes
    text = 0 if model.get("text_encoder_device") == "cpu" else s["text"] * text_bytes
    vae = s["vae"] * vae_bytes
    trained = sum(s["transformers"][: _trained_count(model, len(s["transformers"]))]) if full else sum(s["lora"])
    ema = 4 * trained if float(train.get("ema_decay") or 0) > 0 else 0
    image_tokens, text_tokens = tokens(model)
    # an editing backbone's source images are tokens of the sequence too (FLUX.1 Kontext, Qwen-Image-Edit:
    # the packing backbones; Wan's image-to-video concatenates its first frame along the channels instead)
    cls = backbone(model)
    sources = int(getattr(cls, "source_image_count", (0, 0))[1]) if getattr(cls, "packs_2x2", False) else 0
    seq = image_tokens * (1 + sources) + text_tokens
    pairs = int(train.get("micro_batch_size") or 1) * backbone(model).forwards_per_sample(model)
    act_full = 34 * seq * s["hidden"] * s["layers"] * pairs
    act_ckpt = (2 * seq * s["hidden"] * s["layers"] + 34 * seq * s["hidden"]) * pairs
    checkpointing = bool(model.get("gradient_checkpointing"))
    prompts, group = int(train.get("prompts_per_iteration", 8)), int(train.get("group_size", 8))
    samples = prompts * group // max(gpus, 1)
    trained_steps = _trained_steps(sampler)
    latent = image_tokens * geometry(model).values_per_token
    # float32 latents before and after every trained step and their means, the final latent; the
    # prompt embeddings once per prompt (the hidden size as the text width's stand-in)
    rollout = samples * latent * 4 * (3 * trained_steps + 1)
    rollout += max(prompts // max(gpus, 1), 1) * text_tokens * s["hidden"] * 4
    kinds = {}
    for kind in LAUNCHES:
        split = gpus if kind in SPLIT_WEIGHTS else 1
        state_split = gpus if kind != "ddp" else 1
        frozen = transformer / split + (s["block"] * weight_bytes if split > 1 else 0)
        if full:
            frozen = 0 if kind in SPLIT_WEIGHTS else transformer
        weights_trained = 4 * trained / split
        optimizer = (4 + 8) * trained / state_split  # float32 gradients and AdamW's two moments
        if kind.endswith("-offload"):
            optimizer = 4 * trained / state_split  # the moments (and masters) in CPU memory
        if kind == "zero3-offload":  # the weight partitions in CPU memory: on the GPU the gathered block
            frozen, weights_trained = s["block"] * weight_bytes, 0
        parts = {
            "weights": frozen + text + vae + weights_trained,
            "grads+adamw": optimizer,
            "ema": 0 if kind == "zero3-offload" else ema / split,
            "activations": act_ckpt if checkpointing else act_full,
            "rollout": rollout,
        }
        parts["total"] = sum(parts.values())
        kinds[kind] = parts
    return {
        "kinds": kinds,
        "sizes": s,
        "activations": {"checkpointing": act_ckpt, "none": act_full},
        "tokens": (image_tokens, text_tokens),
        "samples_per_gpu": samples,
        "trained_steps": trained_steps,
    }


def _trained_steps(sampler: Mapping[str, Any]) -> int:
    if sampler["name"] == "full":  # ignore_last: the fraction of all steps but the last
        pool = sampler.get("steps", 10) - (1 if sampler.get("ignore_last") else 0)
        return max(1, int(pool * sampler.get("timestep_fraction", 0.99)))
    if sampler["name"] in ("fast", "mixgrpo"):
        return int(sampler.get("window", 2))
    if sampler["name"] == "sparse":  # `trained` of step_range (null: the whole range, default [0, steps])
        low, high = sampler.get("step_range") or (0, sampler.get("steps", 10))
        return min(int(sampler.get("trained") or high - low), high - low)
    return max(1, int(sampler.get("last", sampler.get("steps", 1))))


def render(result: Mapping[str, Any], gpus: int) -> list[str]:
    columns = ["weights", "grads+adamw", "ema", "activations", "rollout", "total"]
    lines = [
        f"| launch ({gpus} GPUs) | " + " | ".join(f"{c} GiB" for c in columns) + " | config |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for kind, parts in result["kinds"].items():
        lines.append(
            f"| {kind} | " + " | ".join(f"{parts[c] / GIB:.1f}" for c in columns) + f" | {LAUNCH_NOTES[kind]} |"
        )
    s = result["sizes"]
    image, text = result["tokens"]
    lines += [
        "",
        f"sizes ({'from the configs, exact' if s['exact'] else 'published, approximate'}): transformer "
        + " + ".join(f"{p / 1e9:.2f}B" for p in s["transformers"])
        + f", text encoders {s['text'] / 1e9:.2f}B, VAE {s['vae'] / 1e9:.3f}B, trained {sum(s['lora']) / 1e6:.1f}M "
        f"LoRA" + f" ({len(s['lora'])} network(s)); {image} image + {text} text tokens per sample, "
        f"{result['samples_per_gpu']} samples" + f" x {result['trained_steps']} trained steps per GPU",
        f"activations per update pass: {result['activations']['checkpointing'] / GIB:.2f} GiB with gradient "
        f"checkpointing, "
        f"{result['activations']['none'] / GIB:.2f} GiB without",
    ]
    return lines


def read_recipe(path: str, overrides: list[str]) -> tuple[dict[str, Any], str]:
    """The recipe's sections with the model's keys resolved (defaults, LoRA targets) by the backbone's
    own validation, without building anything or reading its dataset; (data, the problems)."""
    import yaml

    from fgrpo.core import registry
    from fgrpo.core.yaml_reading import apply_overrides

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        return {}, f"{path}: {exc}"
    data, errors = apply_overrides(data, overrides)
    model, more = registry.check_spec("model", dict(data.get("model") or {}))
    errors = list(errors) + [e for e in more if not str(e).startswith("model.path")]
    if errors:
        return {}, "\n".join(str(e) for e in errors)
    data["model"] = model
    data.setdefault("train", {})
    data.setdefault("sampler", {"name": "full", "steps": 10})
    return data, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="a recipe file")
    parser.add_argument("--gpus", type=int, default=8, help="processes (GPUs) the run is launched on")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key"
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes)")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        print(f"--gpus: got {args.gpus}; must be >= 1", file=sys.stderr)
        return 2
    data, problem = read_recipe(args.recipe, args.overrides)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    result = estimate(data, args.gpus)
    if args.json:
        print(json.dumps(result, default=float))
    else:
        print("\n".join(render(result, args.gpus)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
