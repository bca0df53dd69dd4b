"""``aesthetic``: the LAION improved aesthetic predictor (an MLP on a CLIP ViT-L/14 image embedding).

Needs the ``[clip]`` extra. The head's weights are the published
``sac+logos+ava1-l14-linearMSE.pth`` (christophschuhmann/improved-aesthetic-predictor; flow_grpo
ships a copy in its assets): a local file or ``owner/repo:filename`` on the hub.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.rewards.clip import check_images, device_key, dtype_key, image_embeddings, load_clip, shared
from fgrpo.rewards.weights import read_state_dict


def aesthetic_head(width: int) -> nn.Sequential:
    """The predictor's MLP with the published module indices (layers.0, .2, .4, .6, .7): widths
    1024, 128, 64, 16, 1 after the input (768 for ViT-L/14), no activations between them, exactly
    as the published predictor (its dropouts are identities at inference)."""
    return nn.Sequential(
        nn.Linear(width, 1024),
        nn.Dropout(0.2),
        nn.Linear(1024, 128),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.Dropout(0.1),
        nn.Linear(64, 16),
        nn.Linear(16, 1),
    )


def load_head(spec: str, key: str = "reward.head") -> nn.Sequential:
    state = read_state_dict(spec, key)
    state = {k.removeprefix("layers."): v for k, v in state.items()}
    if "0.weight" not in state:
        raise OSError(f"{key}: {spec!r} is not an aesthetic head (no layers.0.weight; keys: {sorted(state)[:6]})")
    head = aesthetic_head(int(state["0.weight"].shape[1]))
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:
        raise OSError(f"{key}: {spec!r} does not fit the aesthetic head: {exc}") from exc
    return head.eval().requires_grad_(False)


@attrs.define
class Aesthetic:
    """score = MLP(unit-norm CLIP image embedding): the LAION aesthetic score, about 1-10 (most
    images 4-7). The prompt is not used. The CLIP is ``openai/clip-vit-large-patch14`` (the head
    was trained on its embeddings); images are preprocessed in torch on the model's device.
    Details: none.
    """

    head: str = param(help="the MLP weights: a .pth/.safetensors file or owner/repo:filename")
    path: str = param("openai/clip-vit-large-patch14", help="hub id or folder of the CLIP ViT-L/14")
    processor_path: str | None = param(None, help="hub id or folder of its CLIPProcessor; none = path")
    batch_size: int = param(32, ge=1, help="images scored per forward pass")
    dtype: str = dtype_key("the CLIP weights (the head runs in float32)")
    device: str | None = device_key()
    _clip: Any = attrs.field(init=False, default=None, repr=False)
    _head: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._clip = load_clip(self.path, self.processor_path, self.dtype, self.device)
        device = self._clip.device
        self._head = shared(("aesthetic-head", self.head, str(device)), lambda: load_head(self.head).to(device))
        projection = int(self._clip.model.config.projection_dim)
        if self._head[0].in_features != projection:
            raise ValueError(
                f"reward.head: the head reads {self._head[0].in_features}-d embeddings but the CLIP at "
                f"{self.path!r} makes {projection}-d ones"
            )

    @torch.no_grad()
    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        check_images(outputs, prompts, "aesthetic")
        embedding = image_embeddings(self._clip, outputs, self.batch_size)
        return RewardResult(scores=self._head(embedding).squeeze(-1).float().cpu())
