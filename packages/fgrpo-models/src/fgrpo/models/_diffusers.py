"""What the diffusers backbones share (sd3, flux, qwen-image, wan and plugins built the same way).

- dtype and device parsing for the ``dtype``/``device`` recipe keys;
- loading a pipeline from a hub id or a local folder, failing fast when the weights are absent
  (:func:`load_pipeline`, over :func:`fgrpo.core.hub.pretrained_source`);
- the schedule: the pipeline scheduler's own sigmas with an optional fixed time shift
  (:func:`scheduler_sigmas`), and the resolution-dependent shift ``mu`` (:func:`dynamic_shift_mu`);
- guidance: :func:`guided` (classifier-free guidance), 2x2 latent packing (:func:`pack_2x2`);
- the ``lora`` recipe key (one shape for every backbone: ``{rank, alpha, target_modules, init}``
  or null for full fine-tuning), peft injection, state dicts, adapter files, and the export in
  diffusers' own LoRA format (:func:`save_diffusers_lora`);
- :func:`adapters_disabled`, the reference-policy context (diffusers models have no
  ``disable_adapter()`` context manager);
- :class:`PromptCache`, a bounded per-prompt cache of frozen text-encoder outputs.

diffusers, peft and safetensors are imported inside the functions that need them, so importing
this module (and listing plugins) stays cheap.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fgrpo.core.config import param

# --- import-time messages a user cannot act on --------------------------------------------------


class _TorchvisionFallbackFilter(logging.Filter):
    """transformers (>= 5) says, when diffusers' pipeline modules import the CLIP/SigLIP image
    processors, that torchvision is missing and it falls back to the PIL processors. Our
    backbones never use those processors (the pipelines' image encoders stay unloaded), so the
    message is noise on every sd3 run; this drops exactly that message from exactly that logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


def _quiet_transformers_imports() -> None:
    logger = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _TorchvisionFallbackFilter) for f in logger.filters):
        logger.addFilter(_TorchvisionFallbackFilter())


_quiet_transformers_imports()

# --- dtype and device ---------------------------------------------------------------------------

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DTYPE_CHOICES = tuple(DTYPES)


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (also float32, float16)."""
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise ValueError(f"got {value!r}; allowed: {', '.join(map(repr, DTYPE_CHOICES))}")
        return value
    try:
        return DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(f"got {value!r}; allowed: {', '.join(map(repr, DTYPE_CHOICES))}") from None


_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
DEVICE_HELP = "'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'"


def check_device(_instance: Any, _attribute: Any, value: Any) -> None:
    """attrs validator for a ``device`` key: a device string or an already resolved torch.device."""
    if isinstance(value, torch.device):
        return
    if not isinstance(value, str) or not _DEVICE_RE.match(value):
        raise ValueError(f"got {value!r}; allowed: {DEVICE_HELP}")


def resolve_device(value: str | torch.device) -> torch.device:
    if isinstance(value, torch.device):
        return value
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(value)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {value!r} was asked for but CUDA is not available; use 'cpu' or 'auto'")
    return device


def from_pretrained_dtype_kwargs(torch_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``{"dtype": ...}`` for diffusers versions that renamed ``torch_dtype``, else ``{"torch_dtype": ...}``."""
    try:
        from diffusers.utils import deprecation_utils

        renamed = hasattr(deprecation_utils, "_TORCH_DTYPE_DEPRECATION_MESSAGE")
    except ImportError:  # pragma: no cover - old diffusers
        renamed = False
    return {"dtype": torch_dtype} if renamed else {"torch_dtype": torch_dtype}


def freeze(*modules: torch.nn.Module | None) -> None:
    """No gradients and eval mode for every given module (None entries are skipped)."""
    for module in modules:
        if module is not None:
            module.requires_grad_(False)
            module.eval()


# --- loading ------------------------------------------------------------------------------------


def load_pipeline(pipeline_class: Any, path: str, torch_dtype: torch.dtype, *, key: str = "model.path") -> Any:
    """``pipeline_class.from_pretrained(path)`` in ``torch_dtype``, from a local folder or a hub id;
    ``pipeline_class`` may be a diffusers class name (imported after the weights are found).

    Absent weights fail at once with one message naming ``key``, the id and the remedies
    (:func:`fgrpo.core.hub.pretrained_source`); a folder that is not a pipeline of this class is
    reported with the class name. Raises ``OSError`` (the registry's "could not be built").
    """
    from fgrpo.core.hub import WeightsUnavailable, pretrained_source

    source = pretrained_source(path, key=key)
    if isinstance(pipeline_class, str):
        import diffusers

        pipeline_class = getattr(diffusers, pipeline_class)
    from fgrpo.core import logs

    logs.quiet_libraries()  # diffusers' "Loading pipeline components" bars follow fgrpo's log level
    try:
        return pipeline_class.from_pretrained(source.location, **source.kwargs, **from_pretrained_dtype_kwargs(torch_dtype))
    except WeightsUnavailable:
        raise
    except (OSError, ValueError, EnvironmentError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OSError(f"{key}: cannot load a {pipeline_class.__name__} from {path!r}: {first}") from exc


# --- the schedule and guidance ------------------------------------------------------------------


def dynamic_shift_mu(config: Mapping[str, Any], image_seq_len: int) -> float:
    """The resolution-dependent shift ``mu`` of FLUX/Qwen-Image/SD3.5 pipelines: linear in the
    number of image tokens between (base_image_seq_len, base_shift) and (max_image_seq_len,
    max_shift), read from the scheduler's config (defaults as diffusers' ``calculate_shift``)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + base_shift - m * base_len


def scheduler_sigmas(
    scheduler: Any, steps: int, *, shift: float | None, device: torch.device, image_seq_len: int | None = None,
    explicit_grid: bool = False,
) -> torch.Tensor:
    """The sigmas (steps + 1 values, 1 -> 0, float32 on ``device``) that ``pipe(num_inference_steps=
    steps)`` integrates over, from a copy of the pipeline's scheduler.

    - ``shift`` None keeps the scheduler's own shifting (a fixed ``shift``, or the dynamic one with
      ``mu`` from ``image_seq_len``); a number is a fixed time shift s*t/(1+(s-1)*t) that replaces
      dynamic shifting.
    - ``explicit_grid``: the pipeline passes ``sigmas=linspace(1, 1/steps, steps)`` (FLUX,
      Qwen-Image) instead of letting the scheduler space the timesteps (SD3, Wan).
    - A multistep scheduler with flow sigmas (Wan 2.1's UniPC, ``flow_shift``) becomes the Euler
      scheduler over the same shifted sigmas: kernels integrate one step at a time.
    """
    if steps < 1:
        raise ValueError(f"steps: got {steps}; must be >= 1")
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = dict(scheduler.config)
    grid = np.linspace(1.0, 1 / steps, steps) if explicit_grid else None
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        cls = type(scheduler)
    elif config.get("use_flow_sigmas"):
        # UniPC / DPM-Solver over flow sigmas (Wan 2.1): their grid, linspace(1, 1/T, steps + 1)
        # without its last point, shifted by flow_shift; stepped one Euler step at a time here
        cls = FlowMatchEulerDiscreteScheduler
        train_steps = config.get("num_train_timesteps", 1000)
        config = {"num_train_timesteps": train_steps, "shift": config.get("flow_shift", 1.0), "use_dynamic_shifting": False}
        grid = np.linspace(1.0, 1 / train_steps, steps + 1)[:-1]
    else:
        raise ValueError(
            f"{type(scheduler).__name__} is not a flow-matching scheduler (FlowMatchEulerDiscreteScheduler, or one "
            "with use_flow_sigmas): fgrpo's kernels need sigmas of a rectified flow"
        )
    overrides: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    if shift is not None and (config.get("use_dynamic_shifting") or shift != float(config.get("shift", 1.0))):
        overrides = {"shift": float(shift), "use_dynamic_shifting": False}
    elif config.get("use_dynamic_shifting"):
        if image_seq_len is None:
            raise ValueError("this scheduler shifts by resolution: scheduler_sigmas needs image_seq_len")
        kwargs["mu"] = dynamic_shift_mu(config, image_seq_len)
    if grid is not None:
        kwargs["sigmas"] = grid
    copy = cls.from_config({**config, **overrides})
    with np.errstate(divide="ignore", invalid="ignore"):
        copy.set_timesteps(None if grid is not None else steps, device="cpu", **kwargs)
    sigmas = copy.sigmas.to(dtype=torch.float32)
    if not torch.isfinite(sigmas).all():
        raise ValueError(
            f"steps: the pipeline scheduler's schedule for {steps} step(s) is not finite ({sigmas.tolist()}); "
            "use more steps (a terminal-stretched schedule needs at least 2)"
        )
    return sigmas.to(device)


def guided(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: v_u + s (v_c - v_u)."""
    return uncond + scale * (cond - uncond)


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches as tokens (FLUX, Qwen-Image), in the
    pipelines' ``_pack_latents`` order."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack_2x2` for a latent of ``height`` x ``width``."""
    b, _, d = tokens.shape
    x = tokens.reshape(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


# --- the ``lora`` recipe key --------------------------------------------------------------------

#: LoRA on both attention streams (image and text) of every joint block, as flow_grpo's SD3 adapter;
#: FLUX and Qwen-Image add their feed-forward layers.
JOINT_ATTENTION_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

LORA_KEYS = ("rank", "alpha", "target_modules", "init")
#: ``init`` values: peft's default (A Kaiming, B zero: starts as the base model), "gaussian" (A
#: normal(1/r), B zero: also starts as the base model), "random" (A and B both random, so the
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
    defaults = {"rank": rank, "alpha": None, "target_modules": None if target_modules is None else list(target_modules), "init": init}

    def convert(value: Any) -> dict[str, Any] | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"got {value!r}; allowed: null (full fine-tuning) or a mapping with keys {', '.join(LORA_KEYS)}"
            )
        unknown = sorted(set(value) - set(LORA_KEYS))
        if unknown:
            raise ValueError(f"got unknown key(s) {', '.join(map(repr, unknown))}; allowed keys: {', '.join(LORA_KEYS)}")
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
            if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"got target_modules {targets!r}; allowed: a non-empty list of module names")
            targets = list(targets)
        spec["target_modules"] = targets
        if spec["init"] not in LORA_INITS:
            raise ValueError(f"got init {spec['init']!r}; allowed: {', '.join(map(repr, LORA_INITS))}")
        return spec

    return convert


def lora_param(rank: int, target_modules: Sequence[str] | None, *, default: bool = True) -> Any:
    """The ``lora`` recipe key of a backbone: its default rank (alpha 2 x rank) and targets, or
    ``default=False`` for full fine-tuning unless the recipe asks for an adapter."""
    convert = lora_converter(rank, target_modules)
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


def inject_lora(model: torch.nn.Module, spec: Mapping[str, Any], *, trainable_dtype: torch.dtype | None = torch.float32) -> None:
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
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
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
    from fgrpo.core.sharding import full

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
            if key.startswith(prefix) and "lora_" in key[len(prefix):]:
                key = key[len(prefix):]
                break
        key = re.sub(rf"\.(lora_[AB])\.{ADAPTER_NAME}\.", r".\1.", key)
        out[key] = value
    return out


# --- export in diffusers' own format ----------------------------------------------------------

DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"


def save_diffusers_lora(
    pipeline_class: Any, model: torch.nn.Module, folder: str | os.PathLike[str], state: Mapping[str, torch.Tensor] | None = None
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
    pipeline_class.save_lora_weights(
        os.fspath(folder),
        transformer_lora_layers=state,
        transformer_lora_adapter_metadata=metadata,
        weight_name=DIFFUSERS_LORA_FILE,
    )
    return os.path.join(os.fspath(folder), DIFFUSERS_LORA_FILE)


PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def save_peft_adapter(
    model: torch.nn.Module, folder: str | os.PathLike[str], state: Mapping[str, torch.Tensor] | None = None
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


# --- prompt embeddings --------------------------------------------------------------------------


class PromptCache:
    """Per-prompt text-encoder outputs (one dict of tensors per prompt string), least recently
    used first out once ``max_size`` prompts are held; ``max_size`` 0 disables caching.

    ``get(prompts, encode)`` returns the batch-first stack for ``prompts`` and calls ``encode``
    (a function of a list of strings returning a dict of batch-first tensors) once, with only
    the distinct prompts that are not cached. The text encoders are frozen, so entries never go
    stale; tensors are computed outside inference mode so they can feed a training forward.
    """

    def __init__(self, max_size: int | None = 1024):
        self.max_size = max_size
        self._rows: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.encoded = 0  # prompts sent to the encoder so far (for tests and stats)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, prompt: str) -> bool:
        return prompt in self._rows

    def clear(self) -> None:
        self._rows.clear()

    def get(
        self, prompts: Sequence[str], encode: Callable[[list[str]], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ValueError("encode() needs at least one prompt")
        with torch.inference_mode(False), torch.no_grad():
            rows: dict[str, dict[str, torch.Tensor]] = {}
            todo = []
            for p in prompts:
                if p in self._rows:
                    self._rows.move_to_end(p)
                    rows[p] = self._rows[p]
                elif p not in rows and p not in todo:
                    todo.append(p)
            if todo:
                batch = encode(todo)
                self.encoded += len(todo)
                for i, p in enumerate(todo):
                    rows[p] = {k: v[i].clone() for k, v in batch.items()}  # not views pinning the batch
                    if self.max_size is None or self.max_size > 0:
                        self._rows[p] = rows[p]
                if self.max_size is not None:
                    while len(self._rows) > self.max_size:
                        self._rows.popitem(last=False)
            keys = rows[prompts[0]].keys()
            return {k: torch.stack([rows[p][k] for p in prompts]) for k in keys}


def trainable_state(model: torch.nn.Module, *, lora: bool) -> dict[str, torch.Tensor]:
    """What a policy trains, as detached CPU copies: its LoRA weights, or every weight."""
    if lora:
        return lora_state_dict(model)
    return cpu_copies(model.state_dict())


def load_trainable_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, lora: bool) -> None:
    if lora:
        load_lora_state_dict(model, state)
    else:
        from fgrpo.core.sharding import shard_like

        current = model.state_dict()  # a sharded run's module keeps DTensor shards: cut whole tensors to them
        model.load_state_dict({k: shard_like(v, current[k]) if k in current else v for k, v in state.items()}, strict=True)
