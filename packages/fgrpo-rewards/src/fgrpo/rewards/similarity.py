"""``image-similarity``: how close an edit's output stays to its source image, as the cosine of
their image features: CLIP's projected image embedding (``backbone: clip``, flow_grpo's
``image_similarity`` on ``openai/clip-vit-large-patch14``, the reward its ``counting_edit``
configs weight against GenEval) or DINOv2's class token (``backbone: dino``), which sees layout and
appearance more than semantics, or the structural similarity of the pixels themselves
(``backbone: ssim``: Wang et al. 2004's SSIM with an 11-tap Gaussian window of sigma 1.5 over the
valid region, K1 0.01, K2 0.03, on [0, 1] images, averaged over channels and windows; the
preservation measure editing papers report beside LPIPS, no weights to load). With ``grid: G``
and ``spare: k`` SSIM is taken per patch of a G x G split and the k least similar patches are set
aside before the mean: the region an edit is asked to change costs nothing, a change anywhere else
does (an edit-locality prior; a whole-image similarity charges the asked-for change as much as
collateral damage).

The reward takes the sources (``accepts_sources``): each output is compared with its prompt's
``source``-th source image, resized to the output's size as the trainer hands it (flow_grpo
resizes its reference images to the training resolution before both its pipeline and this
reward); both are then preprocessed alike, in torch on the model's device, by the model's own
processor settings (resize, centre crop, normalise). ``resize: bilinear`` reproduces flow_grpo's
torchvision ``T.Resize`` on tensors; ``bicubic`` (default) is the processor's PIL resampling.
A prompt without a source image is an error. clip and dino need the ``[clip]`` extra
(transformers); weights through :mod:`fgrpo.core.hub` (a hub id, or a ``save_pretrained``
folder), once per process.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from fgrpo.core.config import ConfigError, dotted, param
from fgrpo.core.protocols import RewardResult
from fgrpo.rewards.clip import (
    DTYPES,
    _features,
    check_images,
    device_key,
    dtype_key,
    load_clip,
    loading_error,
    preprocess,
    require_transformers,
    resolve_device,
    shared,
)

DEFAULT_PATHS = {"clip": "openai/clip-vit-large-patch14", "dino": "facebook/dinov2-base"}
#: SSIM's constants (Wang, Bovik, Sheikh and Simoncelli 2004, section III.C): window, sigma, K1, K2
SSIM_WINDOW, SSIM_SIGMA, SSIM_K1, SSIM_K2 = 11, 1.5, 0.01, 0.03


def ssim(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B,) float64 mean SSIM of images x, y (B, C, H, W) in [0, 1]: local means, variances and
    covariance under a normalised Gaussian window (shrunk to the image's smaller side when that is
    under 11 pixels), over the windows that fit inside the image, then averaged over channels."""
    x, y = x.double(), y.double()
    size = min(SSIM_WINDOW, x.shape[-1], x.shape[-2])
    taps = torch.arange(size, dtype=torch.float64, device=x.device) - (size - 1) / 2
    g = torch.exp(-(taps**2) / (2 * SSIM_SIGMA**2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :]).expand(x.shape[1], 1, size, size)

    def local(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, kernel, groups=x.shape[1])

    mx, my = local(x), local(y)
    vx, vy, cxy = local(x * x) - mx**2, local(y * y) - my**2, local(x * y) - mx * my
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    index = (2 * mx * my + c1) * (2 * cxy + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return index.flatten(1).mean(1)


def patch_ssim(x: torch.Tensor, y: torch.Tensor, grid: int) -> torch.Tensor:
    """(B, grid * grid) float64 SSIM of each patch of a grid x grid split of images x, y (B, C, H, W)
    (patch edges at round(i * side / grid)), row by row."""
    if grid > min(x.shape[-2:]):
        raise ValueError(f"image-similarity: grid {grid} is finer than the {x.shape[-1]}x{x.shape[-2]} images")
    rows = [round(i * x.shape[-2] / grid) for i in range(grid + 1)]
    cols = [round(i * x.shape[-1] / grid) for i in range(grid + 1)]
    return torch.stack(
        [
            ssim(x[..., r0:r1, c0:c1], y[..., r0:r1, c0:c1])
            for r0, r1 in itertools.pairwise(rows)
            for c0, c1 in itertools.pairwise(cols)
        ],
        dim=1,
    )


def spared_ssim(x: torch.Tensor, y: torch.Tensor, grid: int, spare: int) -> torch.Tensor:
    """(B,) float64 mean SSIM of the grid's patches left after the ``spare`` least similar are set
    aside: an edit's own change (in the patches it touches) is not charged, a change elsewhere is."""
    patches = patch_ssim(x, y, grid)
    return patches.sort(dim=1, descending=True).values[:, : patches.shape[1] - spare].mean(1)


@attrs.frozen
class Features:
    """A loaded image-feature network: ``embed(pixels)`` -> (B, D) features, its processor's settings."""

    embed: Any
    image_config: dict
    device: torch.device
    dtype: torch.dtype


def load_features(backbone: str, path: str, processor_path: str | None, dtype: str, device: str | None) -> Features:
    """CLIP's projected image embedding or DINOv2's class token (after its layer norm), once per process."""
    if backbone == "clip":
        clip = load_clip(path, processor_path, dtype, device)
        return Features(
            lambda pixels: clip.model.get_image_features(pixel_values=pixels),
            clip.image_config,
            clip.device,
            clip.dtype,
        )
    require_transformers()
    dev = resolve_device(device)

    def build() -> Features:
        from transformers import AutoImageProcessor, AutoModel

        from fgrpo.core.hub import pretrained_source

        model_from = pretrained_source(path, key="reward.path")
        processor_from = (
            pretrained_source(processor_path, key="reward.processor_path") if processor_path else model_from
        )
        try:
            model = AutoModel.from_pretrained(model_from.location, **model_from.kwargs)
            processor = AutoImageProcessor.from_pretrained(processor_from.location, **processor_from.kwargs)
        except (OSError, ValueError) as exc:
            raise loading_error(
                "reward.path", processor_path or path, "a DINOv2 model and image processor", exc
            ) from exc
        model = model.to(device=dev, dtype=DTYPES[dtype]).eval().requires_grad_(False)
        return Features(
            lambda pixels: model(pixel_values=pixels).pooler_output, processor.to_dict(), dev, DTYPES[dtype]
        )

    return shared(("dino", path, processor_path or path, dtype, str(dev)), build)


@attrs.define
class ImageSimilarity:
    """score = cos(features(output), features(source)), or SSIM(output, source); details
    ``similarity`` (the same).

    flow_grpo's ``counting_edit``: ``{name: image-similarity, resize: bilinear, weight: 0.5}`` beside
    ``{name: geneval, weight: 0.5}`` (FLUX Kontext; Qwen-Image-Edit weights them 0.2 / 0.8)."""

    accepts_sources = True

    backbone: str = param(
        "clip",
        choices=("clip", "dino", "ssim"),
        help="clip: CLIP's image embedding (flow_grpo's); dino: DINOv2's class token; ssim: the pixels' structural "
        "similarity (no model)",
    )
    path: str | None = param(
        None,
        help="hub id or folder of the model; none = openai/clip-vit-large-patch14 (clip) or facebook/dinov2-base "
        "(dino)",
    )
    processor_path: str | None = param(None, help="hub id or folder of its image processor; none = path")
    source: int = param(
        0, ge=0, help="which source image of a prompt to compare with (Qwen-Image-Edit-Plus prompts have several)"
    )
    resize: str = param(
        "bicubic",
        choices=("bicubic", "bilinear"),
        help="resampling before the crop: the processor's bicubic, or flow_grpo's bilinear (torchvision on tensors)",
    )
    grid: int = param(
        1, ge=1, help="ssim only: split both images into grid x grid patches and score each patch's SSIM"
    )
    spare: int = param(
        0,
        ge=0,
        help="ssim only: set the spare least similar patches aside before averaging, so that an edit's own "
        "change is not charged (a localised edit scores 1, a change elsewhere is charged)",
    )
    batch_size: int = param(32, ge=1, help="images embedded per forward pass")
    dtype: str = dtype_key("the weights")
    device: str | None = device_key()
    _features: Any = attrs.field(init=False, default=None, repr=False)

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], prefix: str) -> list[ConfigError]:
        errors = []
        if values["backbone"] != "ssim":
            errors += [
                ConfigError(dotted(prefix, name), f"got {values[name]}; allowed: {default} unless backbone is ssim")
                for name, default in (("grid", 1), ("spare", 0))
                if values[name] != default
            ]
        elif values["spare"] >= values["grid"] ** 2:
            errors.append(
                ConfigError(
                    dotted(prefix, "spare"),
                    f"got {values['spare']}; allowed: fewer than the grid's {values['grid'] ** 2} patches",
                )
            )
        return errors

    def __attrs_post_init__(self) -> None:
        if self.backbone == "ssim":  # pixels, no model
            return
        self._features = load_features(
            self.backbone, self.path or DEFAULT_PATHS[self.backbone], self.processor_path, self.dtype, self.device
        )

    @torch.no_grad()
    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """(B, D) float32 unit-norm features of images (B, 3, H, W) in [0, 1]."""
        f = self._features
        parts = []
        for start in range(0, images.shape[0], self.batch_size):
            pixels = preprocess(images[start : start + self.batch_size].to(f.device), f.image_config, mode=self.resize)
            parts.append(_features(f.embed(pixels.to(f.dtype))).float())
        return F.normalize(torch.cat(parts), dim=-1)

    def __call__(
        self,
        outputs: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        *,
        sources: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> RewardResult:
        check_images(outputs, prompts, "image-similarity")
        if sources is None:  # the Reward protocol's call: scoring passes sources (accepts_sources)
            raise ValueError(
                "image-similarity compares each output with its prompt's source image: call it with sources="
            )
        missing = [i for i, s in enumerate(sources) if len(s) <= self.source]
        if missing:
            i = missing[0]
            raise ValueError(
                f"image-similarity: prompt {str(prompts[i])!r} has {len(sources[i])} source image(s); the reward "
                f"compares "
                f"with source {self.source} (an editing dataset's 'image')"
            )
        reference = torch.stack([s[self.source] for s in sources]).to(outputs.device)
        if self._features is None:
            similarity = spared_ssim(outputs.clamp(0, 1), reference, self.grid, self.spare).float().cpu()
        else:
            similarity = (self.embed(outputs) * self.embed(reference)).sum(-1).cpu()
        return RewardResult(scores=similarity, details={"similarity": similarity})


__all__ = ["ImageSimilarity", "load_features", "ssim"]
