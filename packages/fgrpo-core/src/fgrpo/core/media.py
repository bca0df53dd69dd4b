"""Prompts conditioned on source images (image editing, image-to-video): the :class:`Prompt` type,
image references, reading and checking image files, and what rewards receive.

A prompt stays a ``str`` everywhere (samplers, caches, rewards, logs), so text-to-image code never
changes. A prompt that starts from images is a :class:`Prompt`: its text plus ``images``, a tuple of
*image references* — an image file's absolute path, or any hashable object with a ``to_pil()``
method (the shapes-edit world's rendered scenes). Its identity is (text, images): two rows of a
dataset with the same instruction and different source images are two prompts (flow_grpo's
counting_edit has 818 rows and 318 distinct instructions), so everything keyed by prompt (the
policy's encoding cache, the prompt source's metadata, groups of the advantage) tells them apart;
a ``Prompt`` without images is equal to its text.

The policy encodes ``prompt.images`` with the text (:func:`source_images`); a policy declares how
many it takes per prompt with the class attribute ``source_image_count = (least, most)`` (absent:
``(0, 0)``, a text-to-image model), and the trainer refuses a mismatch before anything runs
(:func:`count_problems`). A reward that compares the output with its sources declares
``accepts_sources = True`` and is called with ``sources=`` (:func:`reward_sources`), see
docs/writing-a-plugin.md for why this is an argument and not metadata.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

#: 8-bit image modes a source image may have (PIL's names); what the pipelines read as RGB
ALLOWED_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA")


class Prompt(str):
    """A prompt's text with the source images it is conditioned on (``images``: image references,
    in order) and, for messages, where it was read (``origin``, e.g. ``train_metadata.jsonl:17``).

    Equal and hashed by (text, images); ``origin`` is not part of it. Pickles with its images (a
    prompt crosses processes and checkpoints like a string)."""

    images: tuple[Hashable, ...]
    origin: str | None

    def __new__(cls, text: str, images: Iterable[Hashable] = (), origin: str | None = None) -> Prompt:
        self = super().__new__(cls, text)
        self.images = tuple(images)
        self.origin = origin
        return self

    @property
    def text(self) -> str:
        """The text alone, a plain ``str`` (what a tokenizer gets)."""
        return str.__str__(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Prompt):
            return str.__eq__(self, other) and self.images == other.images
        if isinstance(other, str):
            return not self.images and str.__eq__(self, other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return str.__hash__(self) if not self.images else hash((self.text, self.images))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Prompt, (self.text, self.images, self.origin))

    def __repr__(self) -> str:
        return f"Prompt({str.__repr__(self)}, images={self.images!r})"


def source_images(prompt: str) -> tuple[Hashable, ...]:
    """The image references a prompt is conditioned on (none for a plain string)."""
    return getattr(prompt, "images", ())


def text_of(prompt: str) -> str:
    """The prompt's text as a plain ``str``."""
    return str.__str__(prompt)


def where(prompt: str) -> str:
    """``'text' (file:line)`` for messages."""
    origin = getattr(prompt, "origin", None)
    shown = repr(text_of(prompt)) if len(prompt) <= 80 else repr(text_of(prompt)[:77] + "...")
    return f"{shown} ({origin})" if origin else shown


# --- policies: how many source images a prompt may have -----------------------------------------


def image_count(policy_or_class: Any) -> tuple[int, int]:
    """(least, most) source images per prompt a policy takes (``source_image_count``; (0, 0) when
    it declares none: text-to-image)."""
    least, most = getattr(policy_or_class, "source_image_count", (0, 0))
    return int(least), int(most)


def count_problems(policy_or_class: Any, prompts: Sequence[str], name: str | None = None) -> list[str]:
    """Why each prompt has a number of source images the policy does not take (one line each)."""
    least, most = image_count(policy_or_class)
    model = name or getattr(policy_or_class, "__name__", None) or type(policy_or_class).__name__
    problems = []
    for prompt in dict.fromkeys(prompts):
        n = len(source_images(prompt))
        if least <= n <= most:
            continue
        if most == 0:
            problems.append(
                f"{where(prompt)} has {n} source image{'s' * (n != 1)}, but the model {model} generates from text "
                f"only; "
                "use an editing model (flux-kontext, qwen-image-edit) or prompts without 'image' (a folder or file "
                "source: sources: false keeps it as metadata)"
            )
        elif n == 0:
            problems.append(
                f"{where(prompt)} has no source image, but the model {model} edits images: it takes "
                f"{_count_text(least, most)} per prompt (an 'image' key in the prompt's row)"
            )
        else:
            problems.append(
                f"{where(prompt)} has {n} source images; the model {model} takes {_count_text(least, most)} per prompt"
            )
    return problems


def _count_text(least: int, most: int) -> str:
    if least == most:
        return f"exactly {least}"
    return f"{least} to {most}"


# --- image files --------------------------------------------------------------------------------


def pixel_limit() -> int:
    """The decompression-bomb limit: PIL's ``Image.MAX_IMAGE_PIXELS`` (89.5 M pixels by default)."""
    from PIL import Image

    return int(Image.MAX_IMAGE_PIXELS or 1 << 62)


def allowed_text() -> str:
    """What a source image may be, for error messages."""
    return (
        f"allowed: an 8-bit {', '.join(ALLOWED_MODES)} image (PNG, JPEG, WebP ...) of at least 1x1 and at most "
        f"{pixel_limit() / 1e6:.1f} M pixels (the decompression-bomb limit)"
    )


def _png_size(file: Path) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk (PIL refuses to identify a 0x0 PNG at all)."""
    with open(file, "rb") as f:
        head = f.read(24)
    if len(head) == 24 and head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    return None


def check_image(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the image file ``path`` as a source image, or None: missing, not an
    image PIL reads, truncated, 0x0, CMYK or more than 8 bits per channel, more pixels than the
    decompression-bomb limit. Reads the header (the pixel count is checked before anything is
    decoded), then verifies the file."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path)
    if not file.exists():
        return "does not exist"
    if not file.is_file():
        return "is not a file"
    if file.stat().st_size == 0:
        return "is an empty file (0 bytes)"
    limit = pixel_limit()
    saved = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = None  # the size is checked here, before any decoding, with our message
        with Image.open(file) as image:
            width, height = image.size
            mode = image.mode
            if width * height > limit:
                return (
                    f"is {width}x{height} ({width * height / 1e6:.1f} M pixels), more than the decompression-bomb "
                    f"limit"
                )
            if width == 0 or height == 0:
                return f"is {width}x{height}: no pixels"
            if mode not in ALLOWED_MODES:
                if mode == "CMYK":
                    return "is CMYK"
                if mode.startswith("I;16") or mode == "I":
                    return f"has 16 or more bits per channel (mode {mode})"
                if mode == "F":
                    return "has 32-bit floating-point pixels (mode F)"
                return f"has mode {mode}"
            image.verify()
    except UnidentifiedImageError:
        size = _png_size(file)
        if size is not None and 0 in size:
            return f"is {size[0]}x{size[1]}: no pixels"
        return "is not an image (PIL cannot identify it)"
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        return f"cannot be read as an image ({first})"
    finally:
        Image.MAX_IMAGE_PIXELS = saved
    return None


@functools.lru_cache(maxsize=4096)
def _load_file(path: str) -> Any:
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def load_image(reference: Hashable) -> Any:
    """The source image a reference names, as an RGB PIL image (as the diffusers pipelines read
    it: ``convert("RGB")``). Cached: treat it as read-only (resize returns a new image)."""
    to_pil = getattr(reference, "to_pil", None)
    if to_pil is not None:
        image = to_pil()
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(reference, (str, os.PathLike)):
        return _load_file(os.fspath(reference))
    raise TypeError(f"a source image is a file path or an object with to_pil(), got {type(reference).__name__}")


def to_tensor(image: Any, size: tuple[int, int] | None = None) -> torch.Tensor:
    """A PIL image as float32 (3, H, W) in [0, 1], resized to ``size`` = (height, width) with
    Lanczos (the pipelines' ``VaeImageProcessor.resize``) unless it already has that size."""
    import numpy as np
    from PIL import Image

    if size is not None and (image.height, image.width) != tuple(size):
        image = image.resize((int(size[1]), int(size[0])), Image.Resampling.LANCZOS)
    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255.0


# --- rewards ------------------------------------------------------------------------------------


def output_size(outputs: Any) -> tuple[int, int] | None:
    """(height, width) of image (B, 3, H, W) or video (B, T, 3, H, W) outputs; None otherwise."""
    if isinstance(outputs, torch.Tensor) and outputs.dim() in (4, 5) and outputs.shape[-3] == 3:
        return int(outputs.shape[-2]), int(outputs.shape[-1])
    return None


def reward_sources(prompts: Sequence[str], outputs: Any) -> list[tuple[torch.Tensor, ...]]:
    """What a reward with ``accepts_sources = True`` receives as ``sources``: per sample, its
    prompt's source images as float32 (3, H, W) tensors in [0, 1] on the outputs' device, resized
    to the outputs' height and width (as flow_grpo resizes them before the pipeline and the
    reward); an empty tuple for a prompt without sources."""
    size = output_size(outputs)
    device = outputs.device if isinstance(outputs, torch.Tensor) else torch.device("cpu")
    made: dict[str, tuple[torch.Tensor, ...]] = {}
    out = []
    for prompt in prompts:
        if prompt not in made:
            made[prompt] = tuple(to_tensor(load_image(ref), size).to(device) for ref in source_images(prompt))
        out.append(made[prompt])
    return out


def side_by_side(sources: Sequence[tuple[torch.Tensor, ...]], outputs: torch.Tensor, gap: int = 1) -> torch.Tensor:
    """Images (B, 3, H, W'): each sample's sources, then its output, left to right with a
    ``gap``-pixel white line between them (sources resized to the output's size); what sample grids
    and the report's filmstrip show for prompts with source images."""
    b, _, h, w = outputs.shape
    count = max((len(s) for s in sources), default=0)
    if count == 0:
        return outputs
    width = count * (w + gap) + w
    canvas = outputs.new_ones(b, 3, h, width)
    for i, srcs in enumerate(sources):
        for k, src in enumerate(srcs):
            if tuple(src.shape[-2:]) != (h, w):
                src = torch.nn.functional.interpolate(src[None].float(), size=(h, w), mode="bilinear", antialias=True)[
                    0
                ]
            canvas[i, :, :, k * (w + gap) : k * (w + gap) + w] = src.to(canvas)
        canvas[i, :, :, count * (w + gap) :] = outputs[i]
    return canvas


__all__ = [
    "ALLOWED_MODES",
    "Prompt",
    "allowed_text",
    "check_image",
    "count_problems",
    "image_count",
    "load_image",
    "output_size",
    "pixel_limit",
    "reward_sources",
    "side_by_side",
    "source_images",
    "text_of",
    "to_tensor",
    "where",
]
