"""What the diffusers backbones share (every built-in one, and plugins built the same way).

- dtype and device parsing for the ``dtype``/``device`` recipe keys;
- loading a pipeline from a hub id or a local folder, failing fast when the weights are absent
  (:func:`load_pipeline`, over :func:`fgrpo.core.hub.pretrained_source`);
- the schedule: the pipeline scheduler's own sigmas with an optional fixed time shift and, for a
  truncating scheduler, its integer timesteps (:func:`scheduler_grid`, :func:`integer_timesteps`),
  and the resolution-dependent shift ``mu`` (:func:`dynamic_shift_mu`);
- guidance: :func:`guided` (classifier-free guidance), 2x2 latent packing (:func:`pack_2x2`);
- :class:`PromptCache`, a bounded per-prompt cache of frozen text-encoder outputs.

LoRA (the ``lora`` recipe key, peft injection, adapter state and files) is
:mod:`fgrpo.models.lora`. diffusers is imported inside the functions that need it, so importing
this module (and listing plugins) stays cheap.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fgrpo.core.config import first_line

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


def load_pipeline(
    pipeline_class: Any, path: str, torch_dtype: torch.dtype, *, key: str = "model.path", **components: Any
) -> Any:
    """``pipeline_class.from_pretrained(path)`` in ``torch_dtype``, from a local folder or a hub id;
    ``pipeline_class`` may be a diffusers class name (imported after the weights are found);
    ``components``: modules already built (not read from the folder).

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
        return pipeline_class.from_pretrained(
            source.location, **source.kwargs, **components, **from_pretrained_dtype_kwargs(torch_dtype)
        )
    except WeightsUnavailable:
        raise
    except (OSError, ValueError) as exc:
        raise OSError(f"{key}: cannot load a {pipeline_class.__name__} from {path!r}: {first_line(exc)}") from exc


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


#: ``sigma_grid`` values: the sigmas of a multistep flow scheduler (Wan 2.1's UniPC) as the installed
#: diffusers spaces them, or as diffusers 0.33.1 did (flow_grpo's pin): 1 - linspace(1, 1/T, N + 1)
#: reversed, against linspace(1, 1/T, N + 1) now. Euler flow schedulers space them alike in both.
SIGMA_GRIDS = ("diffusers", "diffusers-0.33")


def scheduler_grid(
    scheduler: Any,
    steps: int,
    *,
    shift: float | None,
    image_seq_len: int | None = None,
    explicit_grid: bool = False,
    sigma_grid: str = "diffusers",
    mu: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sigmas, timesteps) of ``pipe(num_inference_steps=steps)``, from a copy of the pipeline's
    scheduler: the sigmas (steps + 1 values, 1 -> 0, float32 on the CPU), and the integer
    timesteps (steps,) int64 the scheduler hands the network when it truncates them (multistep
    flow schedulers: UniPC, DPM-Solver), else None (Euler: sigma * num_train_timesteps as floats).

    - ``shift`` None keeps the scheduler's own shifting (a fixed ``shift``/``flow_shift``, or the
      dynamic one with ``mu`` from ``image_seq_len``); a number is a fixed time shift
      s*t/(1+(s-1)*t) that replaces dynamic shifting.
    - ``explicit_grid``: the pipeline passes ``sigmas=linspace(1, 1/steps, steps)`` (FLUX,
      Qwen-Image) instead of letting the scheduler space the timesteps (SD3, Wan).
    - ``sigma_grid`` (:data:`SIGMA_GRIDS`): a multistep flow scheduler's grid as the installed
      diffusers makes it or as diffusers 0.33.1 did. Kernels integrate these sigmas one step at a
      time whatever the scheduler's own (multistep) update.
    - ``mu``: the dynamic shift the pipeline computes itself (FLUX.2's depends on the number of
      steps too), instead of the scheduler config's line in ``image_seq_len``.
    """
    if steps < 1:
        raise ValueError(f"steps: got {steps}; must be >= 1")
    if sigma_grid not in SIGMA_GRIDS:
        raise ValueError(f"sigma_grid: got {sigma_grid!r}; allowed: {', '.join(map(repr, SIGMA_GRIDS))}")
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = dict(scheduler.config)
    timesteps = None
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        shift_key, grid = "shift", (np.linspace(1.0, 1 / steps, steps) if explicit_grid else None)
    elif config.get("use_flow_sigmas"):
        shift_key, grid = "flow_shift", None
    else:
        raise ValueError(
            f"{type(scheduler).__name__} is not a flow-matching scheduler (FlowMatchEulerDiscreteScheduler, or one "
            "with use_flow_sigmas): fgrpo's kernels need sigmas of a rectified flow"
        )
    overrides: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    if shift is not None and (config.get("use_dynamic_shifting") or shift != float(config.get(shift_key, 1.0))):
        overrides = {shift_key: float(shift), "use_dynamic_shifting": False}
    elif config.get("use_dynamic_shifting"):
        if mu is None:
            if image_seq_len is None:
                raise ValueError("this scheduler shifts by resolution: scheduler_grid needs image_seq_len")
            mu = dynamic_shift_mu(config, image_seq_len)
        kwargs["mu"] = float(mu)
    config.update(overrides)
    if shift_key == "flow_shift" and sigma_grid == "diffusers-0.33":
        if config.get("use_dynamic_shifting") or config.get("shift_terminal"):
            raise ValueError(
                "sigma_grid 'diffusers-0.33': that grid has no dynamic shifting or terminal stretch; set model.shift"
            )
        sigmas_np, ints = _unipc_flow_grid_0_33(config, steps)
        sigmas, timesteps = torch.from_numpy(sigmas_np), torch.from_numpy(ints)
    else:
        if grid is not None:
            kwargs["sigmas"] = grid
        copy = type(scheduler).from_config(config)
        with np.errstate(divide="ignore", invalid="ignore"):
            copy.set_timesteps(None if grid is not None else steps, device="cpu", **kwargs)
        sigmas = copy.sigmas
        if shift_key == "flow_shift":
            timesteps = copy.timesteps.to(torch.int64)
    sigmas = sigmas.to(dtype=torch.float32)
    if sigmas.shape[0] != steps + 1 or not torch.isfinite(sigmas).all():
        raise ValueError(
            f"steps: the pipeline scheduler's schedule for {steps} step(s) is not {steps + 1} finite sigmas "
            f"({sigmas.tolist()}); use more steps (a terminal-stretched schedule needs at least 2)"
        )
    return sigmas, timesteps


def _unipc_flow_grid_0_33(config: Mapping[str, Any], steps: int) -> tuple[Any, Any]:
    """UniPCMultistepScheduler.set_timesteps with use_flow_sigmas in diffusers 0.33.1 (float32
    sigmas with the final one, int64 timesteps)."""
    import numpy as np

    train = config.get("num_train_timesteps", 1000)
    shift = float(config.get("flow_shift", 1.0))
    sigmas = 1.0 - np.linspace(1, 1 / train, steps + 1)
    sigmas = np.flip(shift * sigmas / (1 + (shift - 1) * sigmas))[:-1].copy()
    timesteps = (sigmas * train).astype(np.int64)
    last = sigmas[-1] if config.get("final_sigmas_type", "zero") == "sigma_min" else 0.0
    return np.concatenate([sigmas, [last]]).astype(np.float32), timesteps


def scheduler_sigmas(
    scheduler: Any,
    steps: int,
    *,
    shift: float | None,
    device: torch.device,
    image_seq_len: int | None = None,
    explicit_grid: bool = False,
    sigma_grid: str = "diffusers",
    mu: float | None = None,
) -> torch.Tensor:
    """The sigmas of :func:`scheduler_grid`, float32 on ``device``."""
    sigmas, _ = scheduler_grid(
        scheduler,
        steps,
        shift=shift,
        image_seq_len=image_seq_len,
        explicit_grid=explicit_grid,
        sigma_grid=sigma_grid,
        mu=mu,
    )
    return sigmas.to(device)


def integer_timesteps(sigma: torch.Tensor, table_sigmas: torch.Tensor, table_timesteps: torch.Tensor) -> torch.Tensor:
    """The integer timesteps (float32, on sigma's device) a truncating scheduler gives the network at
    ``sigma``: the scheduler's own for a sigma of a grid it made (``table_*``, from
    :func:`scheduler_grid`: it truncates the float64 value, which floor(float32 * 1000) does not
    always reproduce), else int(sigma * 1000) in float32 (DanceGRPO's and MixGRPO's rule). No host
    sync."""
    fallback = torch.floor(sigma.float() * 1000.0)
    if table_sigmas.numel() == 0:
        return fallback
    hit = sigma.float()[:, None] == table_sigmas.to(sigma.device)[None, :]
    found = (hit * table_timesteps.to(sigma.device, torch.float32)[None, :]).sum(dim=1)
    return torch.where(hit.any(dim=1), found, fallback)


def video_frames(video: torch.Tensor) -> torch.Tensor:
    """A video VAE's output (B, 3, T, H, W) in [-1, 1] as fgrpo's videos (B, T, 3, H, W) float32 in
    [0, 1], as the pipelines' ``postprocess_video(output_type="pt")``."""
    return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)


def video_latent_shape(
    pipe: Any, channels: int, num_frames: int, height: int, width: int
) -> tuple[int, int, int, int]:
    """(C, (T - 1) / temporal + 1, H / spatial, W / spatial) of a video pipeline's latent."""
    spatial, temporal = int(pipe.vae_scale_factor_spatial), int(pipe.vae_scale_factor_temporal)
    return (int(channels), (num_frames - 1) // temporal + 1, height // spatial, width // spatial)


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
