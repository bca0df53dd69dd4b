"""LoRA for the backbones: the ``lora`` recipe key (one shape for every backbone: ``{rank, alpha,
target_modules, init}`` or null for full fine-tuning), peft injection, the reference-policy
context :func:`adapters_disabled` (diffusers models have no ``disable_adapter()`` context
manager), state dicts of what a policy trains (LoRA weights or every weight), adapter files, and
the export in diffusers' own LoRA format (:func:`save_diffusers_lora`).

peft and safetensors are imported inside the functions that need them, so importing this module
(and listing plugins) stays cheap.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # from its own module: mypy reads diffusers' top-level names as its dummy objects
    from diffusers.models.modeling_utils import ModelMixin

from fgrpo.core.config import param

# --- the ``lora`` recipe key --------------------------------------------------------------------

#: LoRA on both attention streams (image and text) of every joint block, named as flow_grpo names
#: them (scripts/train_sd3.py:419-428); FLUX and Qwen-Image add their feed-forward layers. peft
#: matches a target as a whole suffix of a module name at a dot, so "attn.to_q" adapts every block's
#: attn.to_q and not SD3.5's second (dual) attention attn2, which "to_q" also matches: on SD3.5-M,
#: blocks 0-12, 52 more linears and 5.1 M more LoRA parameters at r 32 (+27%).
JOINT_ATTENTION_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)

LORA_KEYS = ("rank", "alpha", "target_modules", "init")
#: ``init`` values: peft's default (A Kaiming-uniform, B zero: starts as the base model), "gaussian"
#: (A normal(0, 1/r), B zero: also starts as the base model; what every flow_grpo script uses, so the
#: diffusers backbones default to it), "random" (A and B both random, so the
#: adapter changes the outputs from the start: for tests). Methods that modify the base weights
#: (PiSSA, OLoRA) are excluded because the reference policy must stay the base model.
LORA_INITS: dict[str, Any] = {"default": True, "gaussian": "gaussian", "random": False}
LORA_HELP = (
    "{rank, alpha (null: 2 x rank), target_modules (module-name suffixes, peft's matching), "
    "init: default|gaussian|random}; null or rank 0: full fine-tuning"
)

ADAPTER_NAME = "default"


def lora_converter(
    rank: int, target_modules: Sequence[str] | None, init: str = "default"
) -> Callable[[Any], dict[str, Any] | None]:
    """A converter for a backbone's ``lora`` key with these defaults (alpha defaults to 2 x rank,
    the LoRA scale flow_grpo and DanceGRPO use for every model).

    Accepts ``None`` or a mapping with any of ``rank, alpha, target_modules, init`` and returns
    the complete mapping, or ``None`` for full fine-tuning (``null`` or rank 0). Idempotent.
    ``target_modules`` None (as a default) means "the backbone decides" (it resolves it when
    it injects the adapter). Raises ``ValueError("got ...; allowed ...")`` for bad values.
    """
    defaults = {
        "rank": rank,
        "alpha": None,
        "target_modules": None if target_modules is None else list(target_modules),
        "init": init,
    }

    def convert(value: Any) -> dict[str, Any] | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"got {value!r}; allowed: null (full fine-tuning) or a mapping with keys {', '.join(LORA_KEYS)}"
            )
        unknown = sorted(set(value) - set(LORA_KEYS))
        if unknown:
            raise ValueError(
                f"got unknown key(s) {', '.join(map(repr, unknown))}; allowed keys: {', '.join(LORA_KEYS)}"
            )
        spec = {**defaults, **dict(value)}
        r = spec["rank"]
        if r is None or (isinstance(r, (int, float)) and not isinstance(r, bool) and r == 0):
            return None
        if isinstance(r, bool) or not isinstance(r, (int, float)) or r < 0 or int(r) != r:
            raise ValueError(f"got rank {r!r}; allowed: a positive integer, or 0/null for full fine-tuning")
        spec["rank"] = int(r)
        a = spec["alpha"]
        if a is None:
            a = 2 * spec["rank"]
        if isinstance(a, bool) or not isinstance(a, (int, float)) or a <= 0:
            raise ValueError(f"got alpha {a!r}; allowed: a number > 0 (null: 2 x rank)")
        spec["alpha"] = float(a) if not float(a).is_integer() else int(a)
        targets = spec["target_modules"]
        if isinstance(targets, str):
            targets = [targets]
        if targets is not None:
            if (
                not isinstance(targets, (list, tuple))
                or not targets
                or not all(isinstance(t, str) and t for t in targets)
            ):
                raise ValueError(f"got target_modules {targets!r}; allowed: a non-empty list of module names")
            targets = list(targets)
        spec["target_modules"] = targets
        if spec["init"] not in LORA_INITS:
            raise ValueError(f"got init {spec['init']!r}; allowed: {', '.join(map(repr, LORA_INITS))}")
        return spec

    return convert


def lora_param(rank: int, target_modules: Sequence[str] | None, *, default: bool = True, init: str = "default") -> Any:
    """The ``lora`` recipe key of a backbone: its default rank (alpha 2 x rank), targets and init,
    or ``default=False`` for full fine-tuning unless the recipe asks for an adapter."""
    convert = lora_converter(rank, target_modules, init)
    return param(
        factory=(lambda: convert({})) if default else (lambda: None),
        converter=convert,
        help=LORA_HELP,
    )


def lora_config(spec: Mapping[str, Any]) -> Any:
    """The peft ``LoraConfig`` of a normalised ``lora`` spec."""
    from peft import LoraConfig

    return LoraConfig(
        r=int(spec["rank"]),
        lora_alpha=spec["alpha"],
        target_modules=list(spec["target_modules"]),
        init_lora_weights=LORA_INITS[spec["init"]],
    )


def inject_lora(
    model: ModelMixin, spec: Mapping[str, Any], *, trainable_dtype: torch.dtype | None = torch.float32
) -> None:
    """Freeze ``model`` and add a peft LoRA adapter (named ``"default"``) from a normalised spec.

    Only the adapter's weights are trainable afterwards. With ``trainable_dtype`` (float32 by
    default) the adapter weights are kept in that dtype even when the base model is bf16/fp16:
    peft casts the layer input to the adapter's dtype and the result back, so the optimiser
    state and updates are float32 (as diffusers' training scripts do with ``cast_training_params``).
    """
    model.requires_grad_(False)
    config = lora_config(spec)
    try:
        model.add_adapter(config, adapter_name=ADAPTER_NAME)
    except ValueError as exc:
        raise ValueError(f"lora.target_modules {list(spec['target_modules'])!r}: {exc}") from exc
    if trainable_dtype is not None:
        for p in model.parameters():
            if p.requires_grad and p.dtype != trainable_dtype:
                p.data = p.data.to(trainable_dtype)


def _tuner_layers(model: torch.nn.Module) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def adapters_enabled(model: torch.nn.Module) -> bool:
    layers = _tuner_layers(model)
    return bool(layers) and not any(getattr(layer, "disable_adapters", False) for layer in layers)


@contextmanager
def adapters_disabled(model: ModelMixin) -> Iterator[None]:
    """Run ``model`` as its base model: LoRA adapters off inside, back on (exactly) afterwards.

    Uses diffusers' ``disable_adapters()``/``enable_adapters()`` (peft's ``disable_adapter()``
    context exists only on a ``PeftModel``). Nesting is safe: an inner context leaves adapters
    that were already disabled alone. Re-enabling also restores ``requires_grad`` on the adapter.
    """
    if not _tuner_layers(model):
        raise RuntimeError("the model has no LoRA adapter to disable")
    if not adapters_enabled(model):
        yield
        return
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def cpu_copies(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies of whole tensors (DTensor shards of a sharded run are gathered first:
    every process must call this)."""
    from fgrpo.core.launch.shards import full

    return {k: full(v.detach()).to("cpu", copy=True) for k, v in state.items()}


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights only (peft naming without the adapter name), detached CPU copies."""
    from peft import get_peft_model_state_dict

    return cpu_copies(get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME))


def load_lora_state_dict(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load adapter weights saved by :func:`lora_state_dict`; every adapter key must be present."""
    from peft import set_peft_model_state_dict

    expected = set(lora_state_dict_keys(model))
    given = set(state)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(
            "LoRA state dict does not match the adapter: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    # load_state_dict copies into the existing parameters: their dtype and device are kept.
    result = set_peft_model_state_dict(model, dict(state), adapter_name=ADAPTER_NAME)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"LoRA state dict: unexpected keys {unexpected[:3]}")


def lora_state_dict_keys(model: torch.nn.Module) -> list[str]:
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME))


_LORA_PREFIXES = ("base_model.model.", "transformer.", "unet.", "model.")
_LORA_FILES = ("adapter_model.safetensors", "pytorch_lora_weights.safetensors", "trainable.safetensors")


def read_lora_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Adapter weights from a ``.safetensors`` file or a folder holding one.

    Understands fgrpo's own files (keys as :func:`lora_state_dict` gives them), peft's
    ``save_pretrained`` (``base_model.model.`` prefix) and diffusers' ``save_lora_weights``
    (``transformer.`` prefix); the adapter name in ``lora_A.default.weight`` is removed too.
    """
    from safetensors.torch import load_file

    path = os.fspath(path)
    if os.path.isdir(path):
        found = [os.path.join(path, f) for f in _LORA_FILES if os.path.isfile(os.path.join(path, f))]
        if not found:
            found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if len(found) != 1 and not (found and os.path.basename(found[0]) in _LORA_FILES):
            raise FileNotFoundError(
                f"lora_path {path!r}: expected one of {', '.join(_LORA_FILES)} (or a single .safetensors file)"
            )
        path = found[0]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"lora_path {path!r} does not exist")
    state = load_file(path)
    out = {}
    for key, value in state.items():
        for prefix in _LORA_PREFIXES:
            if key.startswith(prefix) and "lora_" in key[len(prefix) :]:
                key = key[len(prefix) :]
                break
        key = re.sub(rf"\.(lora_[AB])\.{ADAPTER_NAME}\.", r".\1.", key)
        out[key] = value
    return out


# --- export in diffusers' own format ----------------------------------------------------------

DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"


def lora_file_name(module: str) -> str:
    """The export's file of the adapter of the pipeline's network ``module`` (``transformer``: the
    file ``load_lora_weights(folder)`` reads; Wan 2.2's ``transformer_2``: its own file)."""
    if module == "transformer":
        return DIFFUSERS_LORA_FILE
    return DIFFUSERS_LORA_FILE.replace(".safetensors", f"_{module}.safetensors")


def save_diffusers_lora(
    pipeline_class: Any,
    model: ModelMixin,
    folder: str | os.PathLike[str],
    state: Mapping[str, torch.Tensor] | None = None,
    *,
    weight_name: str = DIFFUSERS_LORA_FILE,
) -> str:
    """Write ``model``'s adapter as ``pipeline_class.save_lora_weights`` does: keys prefixed with the
    pipeline's transformer name, the adapter's LoraConfig (rank, alpha, targets) in the
    safetensors metadata, so ``pipe.load_lora_weights(folder)`` gets the same scale. ``state``:
    adapter weights as :func:`lora_state_dict` gives them, instead of the model's. Returns the
    file written."""
    state = {k: v.contiguous() for k, v in (lora_state_dict(model) if state is None else cpu_copies(state)).items()}
    metadata = model.peft_config[ADAPTER_NAME].to_dict()
    for key, value in list(metadata.items()):
        if isinstance(value, set):  # target_modules is a set after peft normalises it
            metadata[key] = sorted(value)
    os.makedirs(folder, exist_ok=True)
    if not hasattr(pipeline_class, "save_lora_weights"):
        # a pipeline without a LoRA loader (HunyuanVideo 1.5 in diffusers 0.42): the same file a
        # one-transformer loader writes, which ``pipe.transformer.load_lora_adapter(folder,
        # weight_name=..., prefix="transformer")`` reads
        from diffusers.loaders.lora_pipeline import CogVideoXLoraLoaderMixin as pipeline_class
    pipeline_class.save_lora_weights(
        os.fspath(folder),
        transformer_lora_layers=state,
        transformer_lora_adapter_metadata=metadata,
        weight_name=weight_name,
    )
    return os.path.join(os.fspath(folder), weight_name)


PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def save_peft_adapter(
    model: ModelMixin, folder: str | os.PathLike[str], state: Mapping[str, torch.Tensor] | None = None
) -> list[str]:
    """Write ``model``'s adapter as peft's ``PeftModel.save_pretrained`` does (``adapter_config.json``
    and ``adapter_model.safetensors``, keys under ``base_model.model.``), so that
    ``PeftModel.from_pretrained(transformer, folder)`` loads it. diffusers' ``load_lora_weights``
    picks ``pytorch_lora_weights.safetensors`` by name, so both formats share one folder.
    ``state``: adapter weights as :func:`lora_state_dict` gives them. Returns the files written."""
    from safetensors.torch import save_file

    state = lora_state_dict(model) if state is None else cpu_copies(state)
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    model.peft_config[ADAPTER_NAME].save_pretrained(folder)
    weights = os.path.join(folder, PEFT_WEIGHTS_FILE)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()}, weights, metadata={"format": "pt"})
    return [os.path.join(folder, PEFT_CONFIG_FILE), weights]


# --- what a policy trains ---------------------------------------------------------------------


def trainable_state(model: torch.nn.Module, *, lora: bool) -> dict[str, torch.Tensor]:
    """What a policy trains, as detached CPU copies: its LoRA weights, or every weight."""
    if lora:
        return lora_state_dict(model)
    return cpu_copies(model.state_dict())


def load_trainable_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, lora: bool) -> None:
    if lora:
        load_lora_state_dict(model, state)
    else:
        from fgrpo.core.launch.shards import shard_like

        current = model.state_dict()  # a sharded run's module keeps DTensor shards: cut whole tensors to them
        model.load_state_dict(
            {k: shard_like(v, current[k]) if k in current else v for k, v in state.items()}, strict=True
        )
