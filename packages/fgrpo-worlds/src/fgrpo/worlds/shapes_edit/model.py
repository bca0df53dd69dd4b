"""``shapes-edit-dit``: the shapes world's editing model, shipped pretrained: ``shapes-dit`` whose
transformer also sees the prompt's source image as extra tokens of the same sequence, to the
right of the state's, at the state's cells' positions plus a learned marker (FLUX Kontext's
in-sequence conditioning: the same (h, w) ids, another first coordinate), at the same timestep;
only the state's tokens are read out.

Each prompt is an instruction with one source image (a :class:`fgrpo.core.media.Prompt`; the
``shapes-edit`` prompt source renders shapes scenes). ``encode`` puts the instruction's text
embeddings and the source's pixels in [-1, 1] (``source``, (B, 3, 24, 24), batch first, shared by
both branches of classifier-free guidance) into ``cond``; everything else is ``shapes-dit``'s.
The shipped weights (``weights/shapes-edit-base.safetensors``) are made by
``fgrpo.worlds.shapes_edit.pretrain`` from imperfect edit pairs of the training instructions only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core import media
from fgrpo.worlds.shapes.model import ShapesDiT
from fgrpo.worlds.shapes.network import Architecture, edit_vocabulary

EDIT_WEIGHTS_RESOURCE = "shapes_edit/weights/shapes-edit-base.safetensors"


@attrs.define(eq=False)
class ShapesEditDiT(ShapesDiT):
    """The pretrained shapes-edit base model; satisfies :class:`fgrpo.core.protocols.Policy`.
    Keys as ``shapes-dit``'s; ``path`` null: the shipped editing base."""

    source_image_count: ClassVar[tuple[int, int]] = (1, 1)
    weights_resource: ClassVar[str] = EDIT_WEIGHTS_RESOURCE

    _sources: dict = attrs.field(init=False, factory=dict, repr=False)

    def _random_architecture(self, given: dict[str, Any]) -> Architecture:
        return Architecture(vocab=edit_vocabulary(), source_images=1, **given)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        arch = self.architecture
        if arch.source_images != 1:
            raise ValueError(
                f"model.path: {self.path!r} is a text-to-image shapes network (source_images {arch.source_images}); "
                "shapes-edit-dit needs an editing network (fgrpo.worlds.shapes_edit.pretrain writes one)"
            )

    def check_prompts(self, prompts: Sequence[str]) -> list[str]:
        """Words outside the vocabulary, too many words, or a source image that is not 24 x 24."""
        problems = super().check_prompts([media.text_of(p) for p in prompts])
        size = self.architecture.size
        for prompt in dict.fromkeys(prompts):
            for ref in media.source_images(prompt):
                image = media.load_image(ref)
                if image.size != (size, size):
                    problems.append(
                        f"{media.where(prompt)}: its source image is {image.width}x{image.height}; shapes-edit-dit "
                        f"takes {size}x{size}"
                    )
        return problems

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """``shapes-dit``'s text conditioning (per instruction) and ``source``: each prompt's source
        image as pixels in [-1, 1] (B, 3, 24, 24), cached per prompt."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        cond = super().encode([media.text_of(p) for p in prompts])
        cond["source"] = torch.stack([self._source(p) for p in prompts])
        return cond

    def _source(self, prompt: str) -> torch.Tensor:
        if prompt not in self._sources:
            refs = media.source_images(prompt)
            if len(refs) != 1:
                raise ValueError(
                    f"shapes-edit-dit: prompt {media.where(prompt)} has {len(refs)} source images; it takes exactly 1"
                )
            pixels = media.to_tensor(media.load_image(refs[0])) * 2 - 1
            if len(self._sources) >= 4096:
                self._sources.pop(next(iter(self._sources)))
            self._sources[prompt] = pixels.to(self.device)
        return self._sources[prompt]

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if "source" not in cond:
            raise ValueError("shapes-edit-dit: cond has no 'source' pixels; build it with encode()")
        return super().velocity(x, sigma, cond)


__all__ = ["EDIT_WEIGHTS_RESOURCE", "ShapesEditDiT"]
